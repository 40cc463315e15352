"""Smoke test of bench/train_gpt.py and bench/plot_train.py on the CPU (a few steps)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "fa4_nvfp8_d128.attn"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_gpt_tiny_runs_both_attentions(tmp_path):
    if not SPEC.is_file():
        pytest.skip(f"{SPEC} is missing")
    train_gpt = _load("train_gpt")
    common = ["--tiny", "--steps", "3", "--seed", "7"]
    sdpa = train_gpt.main(["--attn", "sdpa", "--out", str(tmp_path / "sdpa.json"), *common])
    fp4 = train_gpt.main(["--attn", "fp4gen", "--spec", str(SPEC), "--out", str(tmp_path / "fp4gen.json"), *common])

    for run in (sdpa, fp4):
        on_disk = json.loads((tmp_path / f"{run['attn']}.json").read_text())
        assert on_disk["log"] == run["log"]
        assert [r["step"] for r in run["log"]] == [1, 2, 3]
        assert all(math.isfinite(r["loss"]) and r["ms_per_step"] > 0 for r in run["log"])
        assert run["diverged_at_step"] is None and math.isfinite(run["final_val_loss"])
    # same seed, same data, same initial weights: the first losses differ only by the
    # attention numerics (FP8 P/V vs fp32), and a byte model starts near ln(256)
    first_sdpa, first_fp4 = sdpa["log"][0]["loss"], fp4["log"][0]["loss"]
    assert abs(first_sdpa - first_fp4) < 0.02
    assert abs(first_sdpa - math.log(256)) < 0.5
    assert sdpa["corpus"]["sha256"] == fp4["corpus"]["sha256"]
    # the fp4gen run says what ran: 2 layers x 3 steps forward and backward,
    # plus the final evaluation's forwards (1 batch x 2 layers); on the CPU the reference
    counts = fp4["dispatch_counts"]
    assert counts == {"bwd/reference": 6, "fwd/reference": 8}
    assert fp4["backend"]["forward"] == "reference"
    assert fp4["spec"]["kernel"] == "fa4_nvfp8_d128"

    pytest.importorskip("matplotlib")
    plot = _load("plot_train")
    png = tmp_path / "loss.png"
    assert plot.main([str(tmp_path / "sdpa.json"), str(tmp_path / "fp4gen.json"), "-o", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_train_gpt_rejects_bad_spec(tmp_path, capsys):
    train_gpt = _load("train_gpt")
    bad = tmp_path / "bad.attn"
    bad.write_text("attention x { target reference; head_dim 64; Q : fp5 }\n")
    with pytest.raises(SystemExit) as e:
        train_gpt.main(["--attn", "fp4gen", "--spec", str(bad), "--tiny", "--steps", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "bad.attn:1:" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        train_gpt.main(["--attn", "fp4gen", "--spec", str(tmp_path / "none.attn"), "--tiny", "--steps", "1"])
    assert "cannot read spec file" in capsys.readouterr().err
