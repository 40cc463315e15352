"""Context-parallel attention on two GPUs over NCCL (needs 2 CUDA devices; the lead runs it on
nvidia-h200-x2):

    .venv/bin/python -m pytest -q tests/parallel/test_nccl_gpu.py

- the reference backend on CUDA (the NCCL ring and all-to-all plumbing, side-stream transfers):
  the fp32 bound of the gloo tests;
- the generated sm90a kernels (BF16, and the FP8 training recipe with K/V in FP8 on the wire):
  CP's error against the float64 oracle within 1.5x (BF16) / 1.25x (FP8) of single-GPU fp4gen's on
  the same spec, and every block ran a generated kernel. The off-diagonal blocks of a causal ring
  need a ``mask none`` kernel with a backward: the spec file below holds both masks.
"""
from __future__ import annotations

import pytest
import torch

from . import harness
from .harness import OUTPUTS, rel_l2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs (NCCL)")]

_BLOCK = """
attention cp_{name}_{mask}_d128 {{
  target   sm90a
  head_dim 128
  mask     {mask}
  Q : {qk}
  K : {qk}
  P : {p}
  V : {v}
  O : bf16
  schedule {{
    tile 128 x 128
  }}
  backward {{
    reuse q k lse
{dO}    deterministic false
  }}
}}
"""
RECIPES = {"bf16": dict(qk="bf16", p="bf16", v="bf16", dO=""),
           "fp8": dict(qk="fp8e4m3(block=128)", p="fp8e4m3 via exp", v="fp8e4m3(scale=tensor)", dO="    dO : fp8e4m3\n")}


def spec_file(tmp_path):
    path = tmp_path / "cp_sm90.attn"
    path.write_text("".join(_BLOCK.format(name=n, mask=m, **r) for n, r in RECIPES.items() for m in ("causal", "none")))
    return path


def test_nccl_ring_and_a2a_reference_backend(tmp_path):
    from .test_ring_gloo import _assert_equal, _assert_fp32_close

    cases = [dict(name="ring", spec="fp32", S=1024, H=2, causal=True, mode="ring", device="cuda", backend="reference"),
             dict(name="a2a", spec="fp32", S=512, H=4, causal=True, mode="a2a", device="cuda", backend="reference")]
    res = harness.run(2, cases, tmp_path, pg_backend="nccl")
    _assert_fp32_close(res["ring"])
    _assert_equal(res["a2a"])


@pytest.mark.parametrize("recipe,factor", [("bf16", 1.5), ("fp8", 1.25)])
def test_nccl_ring_generated_kernels(tmp_path, recipe, factor):
    path = spec_file(tmp_path)
    case = dict(name=recipe, spec=f"{path}::cp_{recipe}_causal_d128", full_spec=f"{path}::cp_{recipe}_none_d128",
                S=4096, H=4, causal=True, mode="ring", device="cuda", dtype="bfloat16")
    res = harness.run(2, [case], tmp_path / "run", pg_backend="nccl")[recipe]
    assert "fwd/reference" not in res["stats"]["dispatch"] and "bwd/reference" not in res["stats"]["dispatch"], \
        res["stats"]["dispatch"]
    for n in OUTPUTS:
        cp_err, ref_err = rel_l2(res["cp"][n], res["oracle"][n]), rel_l2(res["ref"][n], res["oracle"][n])
        assert cp_err <= factor * ref_err + 1e-4, (n, cp_err, ref_err)
    if recipe == "fp8":
        assert res["stats"]["exchange_fwd"] == {"k": "fp8e4m3(block=128)", "v": "fp8e4m3(tensor)"}


def test_nccl_overlap_schedule_and_late_delivery(tmp_path):
    """Debug mode on CUDA: the schedule check of the gloo tests, and received buffers that hold
    NaN until their wait (written on the current stream, copied after the side stream and the
    NCCL work were waited): a right result means no kernel read a buffer before its wait."""
    from .test_overlap_gloo import schedule_errors
    from .test_ring_gloo import _assert_fp32_close

    cases = [dict(name="dbg", spec="fp32", S=1024, H=2, causal=True, mode="ring", device="cuda", backend="reference",
                  debug=True)]
    res = harness.run(2, cases, tmp_path, pg_backend="nccl")["dbg"]
    for trace in res["stats"]["traces"]:
        assert schedule_errors(trace, 2) == [], trace
    _assert_fp32_close(res)


def _overlapped(kernels) -> int:
    """How many NCCL kernels run, at some point, while a non-NCCL kernel runs (same rank)."""
    nccl = [(s, e) for n, s, e in kernels if "nccl" in n.lower()]
    work = [(s, e) for n, s, e in kernels if "nccl" not in n.lower()]
    return sum(any(s < b and a < e for s, e in work) for a, b in nccl)


def test_nccl_transfer_overlaps_the_block_kernels(tmp_path):
    """The profiler's kernel timeline of one ring forward on rank 0: the NCCL send/recv of the
    next K/V block runs during the current block's kernels (rank 1 posts its side 50 ms late,
    harness._profile_forward, so the transfer cannot end before rank 0's kernels start). The
    planted fault, a blocking ring (each transfer waited before the block's kernels), must show
    no overlap."""
    case = dict(name="p", spec="fp32", S=16384, H=4, causal=False, mode="ring", device="cuda", backend="reference",
                profile=True, compare=False)
    kernels = harness.run(2, [case], tmp_path / "ok", pg_backend="nccl")["p"]["stats"]["kernels"]
    assert any("nccl" in n.lower() for n, _, _ in kernels), sorted({n for n, _, _ in kernels})[:20]
    assert _overlapped(kernels) >= 1, kernels
    blocking = harness.run(2, [case], tmp_path / "sync", pg_backend="nccl", fault="sync_ring")["p"]["stats"]["kernels"]
    assert any("nccl" in n.lower() for n, _, _ in blocking)
    assert _overlapped(blocking) == 0, blocking
