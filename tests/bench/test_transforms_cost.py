"""bench/transforms_cost.py on the CPU: the --cpu-smoke run (reference backend in place of the
kernel) writes a complete JSON with its command, the ratios follow their definition, every
option's output agrees with the plain forward's; no CUDA and bad options are refused clearly;
a planted wrong step (O's channel scales not put back) shows in the agreement column."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("transforms_cost", ROOT / "bench" / "transforms_cost.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


SMOKE_MODULES = ("sm90_fp8_exp_d128_sm90a", "sm90_fp8_directp_causal_d128_sm90a")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    m = load()
    out = tmp_path_factory.mktemp("tc")
    argv = ["--cpu-smoke", "--out-dir", str(out), "--name", "smoke"]
    assert m.main(argv) == 0
    assert not list(out.glob("*.tmp"))  # written atomically
    return m, json.loads((out / "smoke.json").read_text()), out


def test_cpu_smoke_writes_every_row(smoke):
    m, doc, out = smoke
    assert doc["command"] == f"python3 bench/transforms_cost.py --cpu-smoke --out-dir {out} --name smoke"
    assert doc["cpu_smoke"] is True and doc["commit"]
    rows = {(r["module"], r["option"]): r for r in doc["rows"]}
    assert set(rows) == {(mod, o) for mod in SMOKE_MODULES for o in m.OPTIONS}
    for mod in SMOKE_MODULES:
        none = rows[(mod, "none")]["median_ms"]
        for o in m.OPTIONS:
            r = rows[(mod, o)]
            assert "error" not in r
            assert r["shape"] == {"B": 1, "S": 64, "H": 1, "D": 128}
            assert r["ratio_vs_none"] == pytest.approx(r["median_ms"] / none, rel=1e-3)
            assert r["overhead_pct"] == pytest.approx((r["ratio_vs_none"] - 1) * 100, abs=0.02)
            # exact transforms: only the FP8 quantization differs (the recipe's error is ~0.05)
            assert r["rel_l2_vs_none"] < 0.1 and r["cosine_vs_none"] > 0.99, (mod, o, r)


def test_planted_wrong_step_shows(tmp_path, monkeypatch):
    """O's channel scales not put back: the channel_scale_v row's rel-L2 against none is ~1."""
    from fp4gen.numerics import outliers

    m = load()
    monkeypatch.setattr(outliers.Post, "_o", lambda self, o: o)
    assert m.main(["--cpu-smoke", "--modules", SMOKE_MODULES[0], "--options", "channel_scale_v",
                   "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "transforms-cost-cpu-smoke.json").read_text())
    (row,) = [r for r in doc["rows"] if r["option"] == "channel_scale_v"]
    assert row["rel_l2_vs_none"] > 0.5


def test_no_cuda_is_a_clear_refusal(monkeypatch, capsys, tmp_path):
    import torch

    m = load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert m.main(["--out-dir", str(tmp_path)]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_bad_option_is_refused(capsys):
    m = load()
    with pytest.raises(SystemExit) as e:
        m.main(["--cpu-smoke", "--options", "smooth"])
    assert e.value.code == 2 and "unknown smooth" in capsys.readouterr().err


def test_a_module_with_transforms_is_refused_in_its_row(tmp_path):
    m = load()
    assert m.main(["--cpu-smoke", "--modules", "sm90_fp8_outlier_robust_d128_sm90a", "--out-dir", str(tmp_path)]) == 1
    (row,) = json.loads((tmp_path / "transforms-cost-cpu-smoke.json").read_text())["rows"]
    assert "its spec has transforms" in row["error"]
