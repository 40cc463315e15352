"""bench/attention_bwd.py on the CPU: FLOP count, arguments, and the whole pipeline (JSON
schema, correctness gate, error rows, kernel-only capture, plot) on stand-in contenders:
a torch "FA4" in sys.modules and small generated-module look-alikes written to tmp."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ab():
    return _load("attention_bwd")


# ---------------------------------------------------------------------------
# FLOPs


def test_flop_count_counts_the_causal_matmuls(ab):
    """Forward: QK^T and PV, 2*D FLOPs per (query, key) pair each, over the S*S/2 pairs of the
    causal triangle (the usual convention; the exact S(S+1)/2 differs by 1/S); backward 2.5x."""
    for B, S, H, D in ((1, 64, 1, 64), (3, 256, 2, 128)):
        pairs = sum(i + 1 for i in range(S))  # visible (query, key) pairs, counted
        fwd_exact = B * H * pairs * 2 * (2 * D)
        assert ab.bwd_flops(B, S, H, D) == pytest.approx(2.5 * fwd_exact, rel=1.5 / S)
    assert ab.bwd_flops(1, 128, 1, 64, causal=False) == 2 * ab.bwd_flops(1, 128, 1, 64)


def test_flop_count_agrees_with_the_other_benchmarks(ab):
    attention = _load("attention")
    for B, S in ((8, 4096), (4, 8192), (2, 16384)):
        assert ab.bwd_flops(B, S, 16, 128) == attention.attn_flops(B, S, 16, 128, True, bwd=True)
    # bench/results/sm90-bwd-h200.json (tests/sm90_bwd/run_on_device.py's own formula):
    # FA4's backward at B2 S16384 H16 D128 took 9.2024 ms = 597.40 TFLOP/s
    assert ab.tflops(ab.bwd_flops(2, 16384, 16, 128), 9.202431678771973) == pytest.approx(597.40, abs=0.01)


# ---------------------------------------------------------------------------
# command line


def test_help_and_bad_arguments(ab, capsys):
    with pytest.raises(SystemExit) as e:
        ab.parse_args(["--help"])
    assert e.value.code == 0 and "FA4" in capsys.readouterr().out
    a = ab.parse_args([])
    assert a.seqlens == [4096, 8192, 16384] and a.tokens == 32768 and a.heads == 16 and a.head_dim == 128
    assert a.anchor_set == {"fa4", "sdpa", "cudnn8"} and a.gate == 2e-2
    for bad, msg in ((["--seqlens", "4k"], "integers"), (["--seqlens", "65536"], "does not fit"),
                     (["--anchors", "fa4,sage"], "unknown anchors"), (["--gate", "0"], "positive")):
        with pytest.raises(SystemExit) as e:
            ab.parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_cuda_it_says_so(ab, tmp_path, capsys):
    assert ab.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------
# the pipeline on stand-ins


def _attention(q, k, v, scale):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def _fake_fa4(q, k, v, causal=True, return_lse=False):
    """flash_attn.cute.flash_attn_func look-alike: autograd-able fp32 math, bf16 out."""
    assert causal
    o, lse = _attention(q.float(), k.float(), v.float(), q.shape[-1] ** -0.5)
    return o.to(q.dtype), lse.float()


MODULE = '''
import torch
KERNEL_NAME = "{name}"
TARGET = "sm90a"
HEAD_DIM = {d}
BWD_CAUSAL = True
LAUNCHES = []


def _attn(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM ** -0.5
    n = s.shape[-1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


def forward(q, k, v, *, softmax_scale=None, return_lse=False):
    o, lse = _attn(q.float(), k.float(), v.float())
    return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)


def _bwd_launch(args, scale, offset, gqa):
    q, k, v, do, turn, out = args
    # like the deterministic kernel's turn counters: a launch needs them at zero
    assert int(turn.sum()) == 0, "turn counters not reset"
    turn += 1
    LAUNCHES.append(1)
    {body}


def backward(q, k, v, o, lse, do, *, softmax_scale=None):
    out = []
    _bwd_launch((q, k, v, do, torch.zeros(4, dtype=torch.int32), out), HEAD_DIM ** -0.5, 0, False)
    return tuple(x.to(torch.bfloat16) for x in out[0])
'''

EXACT = '''leaves = [x.float().requires_grad_(True) for x in (q, k, v)]
    o, _ = _attn(*leaves)
    g = torch.autograd.grad(o, leaves, do.float())
    out.append({result})'''


def _write_module(tmp_path, name, result="g", broken=False):
    body = "raise RuntimeError('kernel exploded')" if broken else EXACT.format(result=result)
    path = tmp_path / f"{name}_sm90a.py"
    path.write_text(MODULE.format(name=name, d=64, body=body))
    return path


def test_pipeline_json_gate_errors_and_plot(ab, tmp_path, monkeypatch, capsys):
    fa = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = _fake_fa4
    fa.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    good = _write_module(tmp_path, "good_bwd")
    wrong = _write_module(tmp_path, "wrong_bwd", result="(g[0] * 1.5,) + g[1:]")  # dq off by 50%
    broken = _write_module(tmp_path, "broken_bwd", broken=True)
    missing = tmp_path / "nope_sm90a.py"
    out = tmp_path / "out"
    torch.manual_seed(0)
    rc = ab.main([str(good), str(wrong), str(broken), str(missing), "--device", "cpu", "--seqlens", "32,64",
                  "--tokens", "128", "--heads", "2", "--head-dim", "64", "--name", "t", "--out", str(out),
                  "--rounds", "3"])
    text = capsys.readouterr().out
    assert rc == 1  # a gate failure and errors: non-zero, but every row is written
    doc = json.loads((out / "t.json").read_text())
    assert doc["schema"] == ab.SCHEMA
    assert {"device", "date", "command", "flops", "timing", "gate", "timed"} <= set(doc["meta"])
    assert [m["loaded"] for m in doc["modules"]] == [True, True, True, False]
    assert "does not exist" in doc["modules"][3]["error"]
    rows = doc["rows"]
    assert all(tuple(r) == ab.ROW_KEYS for r in rows)
    by = {(r["kernel"], r["S"]): r for r in rows}
    for S, B in ((32, 4), (64, 2)):
        fa4 = by[(ab.FA4, S)]
        assert fa4["B"] == B and fa4["ratio_vs_fa4"] == 1.0 and fa4["error"] is None
        assert fa4["tflops"] == round(ab.tflops(ab.bwd_flops(B, S, 2, 64), fa4["ms"]), 1) or fa4["ms"] == 0
        # SDPA's cuDNN back end does not run on the CPU: an error row, and the run goes on
        sd = by[(ab.SDPA, S)]
        assert sd["error"] or sd["gate_pass"]
        g = by[("fp4gen-good-bwd", S)]
        assert g["gate_pass"] is True and max(g["rel_l2_vs_fa4"]) < 1e-2 and g["timed"] == ab.TIMED_FULL
        assert g["rel_l2_own_forward_vs_fa4"] is not None and g["ratio_vs_fa4"] > 0
        # three interleaved timing rounds: the row's time is their median
        assert len(fa4["ms_rounds"]) == 3 and fa4["ms"] == round(sorted(fa4["ms_rounds"])[1], 4)
        assert len(g["ms_rounds"]) == 3 and g["ms"] == round(sorted(g["ms_rounds"])[1], 4)
        ko = by[("fp4gen-good-bwd-kernel-only", S)]
        assert ko["timed"] == ab.TIMED_KERNEL and ko["ms"] > 0 and ko["error"] is None
        w = by[("fp4gen-wrong-bwd", S)]
        assert w["gate_pass"] is False and w["rel_l2_vs_fa4"][0] > 0.4 and w["rel_l2_vs_fa4"][1] < 1e-2
        b = by[("fp4gen-broken-bwd", S)]
        assert "kernel exploded" in b["error"] and b["ms"] is None and b["tflops"] is None
    assert "FAIL" in text and "pass" in text
    if importlib.util.find_spec("matplotlib"):
        assert (out / "t.png").stat().st_size > 5_000


def test_plot_without_timed_rows_is_an_error_not_a_crash(ab, tmp_path):
    pytest.importorskip("matplotlib")
    rows = [ab.make_row("x", "fp4gen", ab.TIMED_FULL, 2, 4096, 16, 128, error="boom")]
    with pytest.raises(ValueError, match="no timed rows"):
        ab.plot(rows, tmp_path / "x.png")
    rows.append(ab.make_row(ab.FA4, "anchor", ab.TIMED_AUTOGRAD, 2, 4096, 16, 128, ms=1.0, ratio=1.0))
    assert math.isclose(rows[-1]["tflops"], round(ab.bwd_flops(2, 4096, 16, 128) / 1e9, 1))
    assert ab.plot(rows, tmp_path / "x.png").stat().st_size > 5_000


def test_ratio_is_the_median_of_per_round_ratios(ab):
    # FA4 1, 2, 4 ms in three rounds; the contender 2, 2, 2 ms: per-round ratios 0.5, 1, 2 -> 1,
    # where the ratio of the medians would also be 1 but a ratio of means would not
    fa4 = [1.0, 2.0, 4.0]
    mine = [2.0, 2.0, 2.0]
    ratio = ab.median([f / t for f, t in zip(fa4, mine)])
    row = ab.make_row("x", "fp4gen", ab.TIMED_FULL, 2, 4096, 16, 128, ms=ab.median(mine), ms_rounds=mine,
                      ratio=ratio)
    assert row["ratio_vs_fa4"] == 1.0 and row["ms"] == 2.0 and row["ms_rounds"] == mine
    assert ab.median([3.0, 1.0]) == 2.0 and ab.median([5.0]) == 5.0


def test_rounds_must_be_positive(ab, capsys):
    with pytest.raises(SystemExit):
        ab.parse_args(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err
