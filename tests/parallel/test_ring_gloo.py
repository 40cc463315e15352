"""Context-parallel attention on the CPU: 1, 2 and 4 gloo processes on the reference backend,
against the single-process ``fp4gen.attention`` on the whole sequence and the float64 oracle.

What is exact and what is not, and why:
- a2a (Ulysses) runs the very single-process computation per head: bit-for-bit equal.
- a ring of one rank computes one block and merges it into nothing (weight e^0 = 1): bit-for-bit.
- a ring of W > 1 merges normalised per-block O by the LSE rule and sums dQ/dK/dV per block, where
  one process accumulates tile by tile with a running max: the same fp32 terms in another order.
  With every operand and gradient in fp32 the difference is rounding: max |cp - ref| <= 2e-6
  max |ref| (seen: <= 8e-7), and the error against the float64 oracle stays that of one process.
- with the FP8 recipe, P is rounded to FP8 relative to each block's own running max (one process:
  the running max over all keys so far), so single entries move by FP8 steps; the check is then
  that the CP error against the oracle is no worse than 1.1x the single process's.
"""
from __future__ import annotations

import pytest
import torch

from . import harness
from .harness import OUTPUTS, rel_l2, rel_max

FP32_TOL = 2e-6


def _assert_equal(res):
    for n in OUTPUTS:
        assert torch.equal(res["cp"][n], res["ref"][n].to(res["cp"][n].dtype)), (res["case"]["name"], n)


def _assert_fp32_close(res):
    for n in OUTPUTS:
        err = rel_max(res["cp"][n], res["ref"][n])
        assert err <= FP32_TOL, f"{res['case']['name']} {n}: max|cp - ref| / max|ref| = {err:.3g} > {FP32_TOL}"
        cp_err, ref_err = rel_l2(res["cp"][n], res["oracle"][n]), rel_l2(res["ref"][n], res["oracle"][n])
        assert cp_err <= 1.5 * ref_err + 1e-7, (res["case"]["name"], n, cp_err, ref_err)


def test_one_rank_ring_is_bit_exact(tmp_path):
    cases = [dict(name="fp32", spec="fp32", S=384, H=2, causal=True, mode="ring"),
             dict(name="bf16", spec="bf16", S=384, H=2, causal=True, mode="ring", dtype="bfloat16")]
    for res in harness.run(1, cases, tmp_path).values():
        _assert_equal(res)


def test_two_rank_ring_fp32(tmp_path):
    cases = [dict(name="causal_balanced", spec="fp32", S=512, H=2, causal=True, mode="ring"),
             dict(name="causal_contiguous", spec="fp32", S=512, H=2, causal=True, mode="ring", balanced=False),
             dict(name="full_gqa_b2", spec="fp32", B=2, S=256, H=4, Hkv=2, causal=False, mode="ring")]
    for res in harness.run(2, cases, tmp_path).values():
        _assert_fp32_close(res)
        st = res["stats"]
        B, Sl, Hkv = res["case"].get("B", 1), res["case"]["S"] // 2, res["case"].get("Hkv", res["case"]["H"])
        kv_bytes = 2 * B * Sl * Hkv * 32 * 4  # K and V, fp32
        assert st["fwd_bytes_per_step"] == kv_bytes and st["bwd_bytes_per_step"] == 2 * kv_bytes


def test_two_rank_a2a_is_bit_exact(tmp_path):
    cases = [dict(name="a2a_causal_gqa", spec="fp32", S=256, H=4, Hkv=2, causal=True, mode="a2a"),
             dict(name="a2a_full_bf16", spec="bf16", S=256, H=2, causal=False, mode="a2a", dtype="bfloat16",
                  balanced=False)]
    for res in harness.run(2, cases, tmp_path).values():
        _assert_equal(res)


def test_two_rank_ring_fp8_exchange(tmp_path):
    """The FP8 recipe: K and V travel as E4M3 payload + one fp32 amax per 128-token block and head
    (its backward reads the FP8 payloads too: dO and dS are FP8), half of BF16's bytes."""
    cases = [dict(name="fp8", spec="fp8", S=512, H=2, causal=True, mode="ring"),
             dict(name="fp8_input", spec="fp8", S=512, H=2, causal=True, mode="ring", exchange="input")]
    res = harness.run(2, cases, tmp_path)
    fp8, raw = res["fp8"], res["fp8_input"]
    for n in OUTPUTS:
        cp_err, ref_err = rel_l2(fp8["cp"][n], fp8["oracle"][n]), rel_l2(fp8["ref"][n], fp8["oracle"][n])
        assert cp_err <= 1.1 * ref_err, (n, cp_err, ref_err)
        # the receiver's reference quantizes what it decoded back to the sender's codes and
        # scales: FP8 on the wire computes what K/V at full precision compute, bit for bit
        assert torch.equal(fp8["cp"][n], raw["cp"][n]), n
    st = fp8["stats"]
    assert st["exchange_fwd"] == {"k": "fp8e4m3(block=128)", "v": "fp8e4m3(block=128)"}
    n_el = 256 * 2 * 32  # one rank's K (or V): S / W tokens x Hkv x D
    scales = 4 * (256 // 128) * 2  # fp32, per 128-token block and head
    assert st["fwd_bytes_per_step"] == 2 * (n_el + scales)  # bf16 K and V: 2 * 2 * n_el
    assert st["bwd_bytes_per_step"] == 2 * (n_el + scales) + 2 * 4 * n_el  # + the fp32 dK, dV
    assert raw["stats"]["fwd_bytes_per_step"] == 2 * 4 * n_el


def test_four_rank_ring_causal_balanced(tmp_path):
    cases = [dict(name="w4_ring", spec="fp32", S=256, H=2, causal=True, mode="ring")]
    _assert_fp32_close(harness.run(4, cases, tmp_path)["w4_ring"])


def test_four_rank_a2a_is_bit_exact(tmp_path):
    cases = [dict(name="w4_a2a", spec="fp32", S=128, H=4, causal=True, mode="a2a")]
    _assert_equal(harness.run(4, cases, tmp_path)["w4_a2a"])


@pytest.mark.parametrize("fault", ["merge", "skip"])
def test_planted_fault_is_caught(tmp_path, fault):
    """A merge that drops the running part's weight, or a ring that skips one step's block: the
    fp32 comparison above must fail."""
    cases = [dict(name="f", spec="fp32", S=512, H=2, causal=True, mode="ring")]
    res = harness.run(2, cases, tmp_path, fault=fault)["f"]
    with pytest.raises(AssertionError):
        _assert_fp32_close(res)
