"""Smoke test of bench/train_gpt.py and bench/plot_train.py on the CPU (a few steps)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "fa4_nvfp8_d128.attn"
RECIPE_SPEC = ROOT / "examples" / "sm90_fp8_train_d128.attn"


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

    for run in (sdpa, fp4):
        t = run["step_time"]
        assert t["steps_counted"] + t["steps_skipped"] == len(run["step_ms"]) == run["steps_run"] == 3
        assert run["ms_per_step"] == t["median_ms"] > 0
        assert run["stopped_early_at_step"] is None

    pytest.importorskip("matplotlib")
    plot = _load("plot_train")
    png = tmp_path / "loss.png"
    assert plot.main([str(tmp_path / "sdpa.json"), str(tmp_path / "fp4gen.json"), "-o", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_train_gpt_fp8_recipe_tiny(tmp_path, monkeypatch, capsys):
    """--recipe fp8 on the CPU (reference backend): the spec, the default output name, the
    summary the plot writes, and --recipe fp8 refusing to run without a generated kernel."""
    if not RECIPE_SPEC.is_file():
        pytest.skip(f"{RECIPE_SPEC} is missing")
    train_gpt = _load("train_gpt")
    monkeypatch.setenv("OUT", str(tmp_path))
    common = ["--tiny", "--steps", "4", "--seed", "7", "--timing-warmup", "1"]
    fp8 = train_gpt.main(["--recipe", "fp8", "--backend", "reference", *common])
    sdpa = train_gpt.main(["--recipe", "sdpa", *common])
    assert (tmp_path / "train_fp8.json").is_file() and (tmp_path / "train_sdpa.json").is_file()
    assert fp8["label"] == "fp8" and fp8["attn"] == "fp4gen" and sdpa["attn"] == "sdpa"
    assert fp8["spec"]["kernel"] == "sm90_fp8_train_causal_d128" and fp8["spec"]["backward_block"]
    assert fp8["spec"]["formats"]["P"].startswith("fp8e4m3") and fp8["spec"]["formats"]["V"].startswith("fp8e4m3")
    assert fp8["dispatch_counts"] == {"bwd/reference": 8, "fwd/reference": 10}
    # the timing summary: the first step left out, the median of the other three
    t = fp8["step_time"]
    assert (t["steps_skipped"], t["steps_counted"]) == (1, 3)
    assert t["median_ms"] == pytest.approx(sorted(fp8["step_ms"][1:])[1], abs=1e-3)  # step_ms: 3 decimals
    # same weights and data: the first loss differs only by the attention numerics
    assert abs(fp8["log"][0]["loss"] - sdpa["log"][0]["loss"]) < 0.02
    assert math.isfinite(fp8["final_val_loss"])

    # --recipe fp8 means the generated kernels: on the CPU there are none, a one-line error
    with pytest.raises(SystemExit) as e:
        train_gpt.main(["--recipe", "fp8", *common])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no generated kernel applies" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        train_gpt.main(["--recipe", "sdpa", "--attn", "fp4gen", *common])
    assert "--recipe sdpa is --attn sdpa" in capsys.readouterr().err

    pytest.importorskip("matplotlib")
    plot = _load("plot_train")
    png, summ = tmp_path / "loss.png", tmp_path / "summary.json"
    assert plot.main([str(tmp_path / "train_sdpa.json"), str(tmp_path / "train_fp8.json"),
                      "-o", str(png), "--summary", str(summ)]) == 0
    assert png.stat().st_size > 10_000
    s = json.loads(summ.read_text())
    assert [r["file"] for r in s["runs"]] == ["train_sdpa.json", "train_fp8.json"]
    assert s["runs"][1]["ms_per_step"] == fp8["ms_per_step"]
    assert s["runs"][1]["final_val_loss"] == fp8["final_val_loss"]
    assert s["runs"][1]["label"].startswith("sm90_fp8_train_causal_d128") and "reference" in s["runs"][1]["label"]
    # a run that left no file (failed, timed out) is skipped with a warning, the rest is plotted
    assert plot.main([str(tmp_path / "train_sdpa.json"), str(tmp_path / "train_bf16.json"),
                      "-o", str(png), "--summary", str(summ)]) == 0
    s = json.loads(summ.read_text())
    assert len(s["runs"]) == 1 and "train_bf16.json" in s["skipped"][0]
    assert "skipped" in capsys.readouterr().err


def test_step_time_summary():
    train_gpt = _load("train_gpt")
    s = train_gpt.step_time_summary([100.0, 50.0, 10.0, 12.0, 11.0, 13.0, 30.0], warmup=2)
    assert (s["steps_skipped"], s["steps_counted"]) == (2, 5)
    assert s["median_ms"] == 12.0 and s["p10_ms"] == 10.0 and s["p90_ms"] == 30.0
    assert train_gpt.step_time_summary([5.0, 7.0], warmup=20)["median_ms"] == 7.0  # at most half skipped
    assert train_gpt.step_time_summary([], warmup=3)["median_ms"] is None


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


def test_train_gpt_compile_mode(capsys):
    """--compile-mode picks torch.compile's mode (reduce-overhead: CUDA graphs), recorded in the
    run's config; a mode it does not offer is refused by argparse, naming the choices."""
    train_gpt = _load("train_gpt")
    _, args = train_gpt.parse_args(["--attn", "sdpa", "--tiny", "--compile", "--compile-mode", "reduce-overhead"])
    assert args.compile and args.compile_mode == "reduce-overhead"
    _, args = train_gpt.parse_args(["--attn", "sdpa", "--tiny"])
    assert args.compile_mode == "default"
    with pytest.raises(SystemExit) as e:
        train_gpt.parse_args(["--attn", "sdpa", "--tiny", "--compile-mode", "max-autotune"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--compile-mode" in err and "reduce-overhead" in err
