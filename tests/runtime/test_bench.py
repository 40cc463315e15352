"""bench/attention.py and bench/plot.py: the parts that run without a GPU."""
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import attention  # noqa: E402
import plot  # noqa: E402


def test_flops_formula():
    # 4*B*H*S*S*D forward, half when causal, 2.5x for backward
    assert attention.attn_flops(2, 16384, 16, 128, False) == 4 * 2 * 16 * 16384 ** 2 * 128
    assert attention.attn_flops(2, 16384, 16, 128, True) == 2 * 2 * 16 * 16384 ** 2 * 128
    assert attention.attn_flops(1, 1024, 1, 64, False, bwd=True) == 2.5 * 4 * 1024 ** 2 * 64


def test_parse_args_defaults_and_choices():
    a = attention.parse_args([])
    assert a.seqlens == [1024, 4096, 8192, 16384] and a.tokens == 32768
    assert a.causals == (False, True) and a.anchor_set == {"fa4", "sdpa", "cudnn8", "sage"} and a.head_dim == 128
    a = attention.parse_args(["m1", "x.attn:k", "--head-dim", "64", "--causal", "true", "--anchors", "fa4"])
    assert a.kernels == ["m1", "x.attn:k"] and a.head_dim == 64 and a.causals == (True,) and a.anchor_set == {"fa4"}
    with pytest.raises(SystemExit):
        attention.parse_args(["--anchors", "fa3"])
    with pytest.raises(SystemExit):
        attention.parse_args(["--seqlens", "65536"])  # B would be 0


def test_kernel_names_and_masks():
    m = ModuleType("x")
    m.KERNEL_NAME, m.TARGET = "fp8_directp_d128", "sm90a"
    assert attention.fp4gen_kernel_name(m) == "fp4gen-sm90a-fp8-directp-d128"
    m.BENCH_NAME = "custom"
    assert attention.fp4gen_kernel_name(m) == "custom"
    assert attention.mask_of(m) == (False, True)
    m.PLAN_JSON = json.dumps({"spec": {"mask": "causal"}})
    assert attention.mask_of(m) == (True,)
    m.PLAN_JSON = json.dumps({"spec": {"mask": "none"}})
    assert attention.mask_of(m) == (False,)
    m.CAUSAL = True  # an explicit module constant wins over the plan
    assert attention.mask_of(m) == (True,)


def test_cosine():
    torch = pytest.importorskip("torch")
    a = torch.tensor([1.0, 2.0, 3.0])
    assert attention.cosine(a, a) == pytest.approx(1.0)
    assert attention.cosine(a, -a) == pytest.approx(-1.0)
    assert attention.cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == pytest.approx(0.0)
    assert attention.cosine(torch.zeros(3), a) != attention.cosine(torch.zeros(3), a)  # nan


def test_unloadable_kernels_are_skipped_with_reason(capsys):
    msgs = []
    out = attention.make_fp4gen(["no_such_module_xyz", "/nonexistent/k.attn"], None, msgs.append)
    assert out == []
    assert msgs[0].startswith("skip no_such_module_xyz: failed to load (LoadError: ")
    assert "does not exist" in msgs[1]


def test_main_without_gpu_exits_cleanly(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert attention.main(["--out-dir", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().out


def _rows():
    rows = []
    for k, base in (("fa4-cute-bf16", 600.0), ("fp4gen-sm90a-x", 900.0)):
        for causal in (False, True):
            for S in (1024, 4096):
                rows.append({"kernel": k, "pass": "fwd", "B": 32768 // S, "S": S, "H": 16, "D": 128,
                             "causal": causal, "ms": 1.0, "tflops": base + S / 100, "ratio_vs_fa4_bf16": None,
                             "cosine": 0.99, "device": "NVIDIA H200", "date": "2026-11-29T00:00:00Z",
                             "command": "python3 bench/attention.py"})
    return rows


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = plot.plot_rows(_rows(), tmp_path / "r.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_cli(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "r.json"
    src.write_text(json.dumps(_rows()))
    assert plot.main([str(src)]) == 0
    assert (tmp_path / "r.png").is_file()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert plot.main([str(bad)]) == 2


def test_saved_anchor_results_have_the_row_schema():
    files = sorted((BENCH / "results").glob("*anchors-only*.json"))
    if not files:
        pytest.skip("no anchors-only results saved")
    for f in files:
        rows = json.loads(f.read_text())
        assert rows
        for r in rows:
            # rows keep ROW_KEYS' order; files from before the cuDNN FP8 anchor lack its ratio
            assert tuple(r) in (attention.ROW_KEYS,
                                tuple(k for k in attention.ROW_KEYS if k != "ratio_vs_cudnn_fp8"))
            assert r["pass"] in ("fwd", "bwd") and r["tflops"] > 0 and r["B"] * r["S"] == 32768
            fl = attention.attn_flops(r["B"], r["S"], r["H"], r["D"], r["causal"], r["pass"] == "bwd")
            assert fl / (r["ms"] * 1e-3) / 1e12 == pytest.approx(r["tflops"], rel=2e-3)
