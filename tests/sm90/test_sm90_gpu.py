"""sm90a kernels on a Hopper GPU against the numerics oracle (``fp4gen.numerics.reference``).

Tolerances, and why they are not zero:

- BF16: the kernel and the oracle do the same online softmax over the same 128-key tiles in
  the same (ascending) order; they differ in the order of fp32 additions inside the MMAs,
  ex2.approx vs torch.exp2 (~2 ulp), and the rounding of P to bf16 at slightly different
  values. Measured on the H200: rel-L2 ~1.5e-4, |dLSE| <= 2e-5. Bound: rel-L2 1e-3.
- FP8 (both P modes): Hopper's FP8 wgmma accumulates with reduced precision (DeepSeek-V3
  reports ~14 retained mantissa bits), so S and O differ from the fp32 oracle by ~1e-4
  relative; a shifted score moves an E4M3 code of P by one step (1/16 relative) at a
  rounding boundary. Measured: rel-L2 3e-3..5.5e-3, cosine >= 0.99998. Bound: rel-L2 1.5e-2,
  and the kernel may not be less accurate than the oracle against exact float64 attention
  by more than that margin.
- LSE: |dLSE| <= tol_abs + tol_rel |LSE|. BF16 tol_rel 1e-5. FP8 exp tol_rel 1e-3: the LSE
  is dominated by the row max, a product of the FP8 QK^T MMA whose reduced-precision
  accumulation gives a relative error of ~2^-11 (measured: |dLSE| up to 3.8e-2 on rows
  whose logits are ~12x the usual, i.e. LSE of several tens). FP8 Direct-P: a per-row
  error-model bound (``directp_bounds.lse_bound``): a score error flips a P code by one step
  (1/15..1/8 of that term), which moves l by up to ~4 % where l is held by a few terms (few
  keys, large logits) and by little in long rows; the flat bound was too tight for the
  former (session 5: 4.6e-2) and too loose for the latter. TOL's fp8_directp LSE entries
  are unused.
- Fully masked rows (causal, Sq > Sk): O == 0 and LSE == -inf exactly, in both.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import directp_bounds  # noqa: E402
from plans import VARIANTS, load_module, make_plan  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [
    # (B, Sq, Sk, H, Hkv, logit multiplier)
    (1, 1024, 1024, 4, 4, 1.0),  # tile-aligned
    (2, 300, 700, 4, 2, 1.0),  # ragged tails, GQA 2:1
    (1, 700, 300, 4, 1, 1.0),  # Sq > Sk: fully masked rows when causal; GQA 4:1
    (1, 513, 513, 2, 2, 12.0),  # large logits
    (1, 77, 77, 1, 1, 1.0),  # shorter than one tile
]
# (rel-L2 of O, |dLSE| absolute part, |dLSE| part relative to |LSE|)
TOL = {"bf16": (1e-3, 1e-4, 1e-5), "fp8_exp": (1.5e-2, 5e-3, 1e-3), "fp8_directp": (1.5e-2, 1.5e-2, 1e-3)}


def _check_lse(lse, lse_ref, variant, inputs=None, l_from_mma=False):
    """``inputs`` (q, k, v, spec[, sinks]), what the reference was given: fp8_directp's bound
    is computed from them (``l_from_mma``: the plan's)."""
    if variant == "fp8_directp":
        directp_bounds.check_directp_lse(lse, lse_ref, inputs, l_from_mma=l_from_mma)
        return
    _, tol_abs, tol_rel = TOL[variant]
    fin = ~torch.isneginf(lse_ref)
    dl = (lse[fin] - lse_ref[fin]).abs()
    ok = dl <= tol_abs + tol_rel * lse_ref[fin].abs()
    rel = (dl / lse_ref[fin].abs().clamp_min(1.0)).max().item()
    assert ok.all(), f"max |dLSE| {dl.max().item():.3e}, max |dLSE|/max(1,|LSE|) {rel:.3e}"

_MODS = {}


def _module(variant, d, causal, tmp_path_factory):
    key = (variant, d, causal)
    if key not in _MODS:
        _MODS[key] = load_module(make_plan(variant, d, causal), str(tmp_path_factory.mktemp("sm90gen")))
    return _MODS[key]


def _inputs(B, Sq, Sk, H, Hkv, d, mult, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(B, Sq, H, d, device="cuda", generator=g) * mult).bfloat16()
    k = torch.randn(B, Sk, Hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, Sk, Hkv, d, device="cuda", generator=g).bfloat16()
    return q, k, v


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_matches_oracle(variant, d, causal, case, tmp_path_factory):
    from fp4gen.numerics import reference
    from fp4gen.numerics.accuracy import exact_attention

    mod = _module(variant, d, causal, tmp_path_factory)
    B, Sq, Sk, H, Hkv, mult = case
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, d, mult, seed=Sq * 7 + Sk + d)
    plan = make_plan(variant, d, causal)
    o, lse = mod.forward(q, k, v, return_lse=True)
    o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
    assert o.shape == q.shape and o.dtype == torch.bfloat16
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    assert not torch.isnan(o).any()

    tol_o = TOL[variant][0]
    err = _rel_l2(o.float(), o_ref.float())
    assert err < tol_o, f"rel-L2 vs oracle {err:.3e}"

    # masked rows: exactly -inf / 0 where the oracle has them
    inf_k, inf_r = torch.isneginf(lse), torch.isneginf(lse_ref)
    assert torch.equal(inf_k, inf_r)
    if inf_r.any():
        rows = inf_r.permute(0, 2, 1)  # (B, Sq, H)
        assert (o.float()[rows] == 0).all()
    _check_lse(lse, lse_ref, variant, inputs=(q, k, v, plan.spec))

    # no less accurate than the spec's own numerics against exact attention
    if not causal or Sq <= Sk:
        o_ex = exact_attention(q.cpu(), k.cpu(), v.cpu(), plan.spec.scale, causal)[0]
        o_ex = o_ex.to(o.device)
        e_kernel, e_oracle = _rel_l2(o.float(), o_ex), _rel_l2(o_ref.float(), o_ex)
        assert e_kernel <= e_oracle + tol_o, f"kernel {e_kernel:.3e} vs oracle {e_oracle:.3e} (exact)"


@pytest.mark.parametrize("variant", VARIANTS)
def test_softmax_scale_and_noncontiguous_heads(variant, tmp_path_factory):
    """An explicit softmax_scale and q/k/v sliced out of a packed qkv tensor (strided heads)."""
    from fp4gen.numerics import reference

    d = 128
    mod = _module(variant, d, False, tmp_path_factory)
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = torch.randn(2, 384, 3, 4, d, device="cuda", generator=g).bfloat16()
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    o = mod.forward(q, k, v, softmax_scale=0.05)
    import dataclasses

    spec = dataclasses.replace(make_plan(variant, d, False).spec, softmax_scale=0.05)
    o_ref, _ = reference.forward(q.contiguous(), k.contiguous(), v.contiguous(), spec)
    assert _rel_l2(o.float(), o_ref.float()) < TOL[variant][0]


def test_bad_arguments_are_refused_clearly(tmp_path_factory):
    mod = _module("bf16", 64, False, tmp_path_factory)
    q = torch.randn(1, 128, 2, 64, device="cuda").bfloat16()
    with pytest.raises(TypeError, match="bfloat16"):
        mod.forward(q.float(), q, q)
    with pytest.raises(ValueError, match="64"):
        mod.forward(q[..., :32], q[..., :32], q[..., :32])
    with pytest.raises(ValueError, match="multiple"):
        mod.forward(torch.randn(1, 128, 3, 64, device="cuda").bfloat16(), q, q)


@pytest.mark.parametrize("causal", [False, True])
def test_direct_p_l_from_mma(causal, tmp_path_factory):
    """Optional plan field l_from_mma: l = P @ ones on the tensor cores, same tolerance."""
    from fp4gen.numerics import reference

    plan = make_plan("fp8_directp", 128, causal, l_from_mma=True)
    mod = load_module(plan, str(tmp_path_factory.mktemp("sm90lmma")))
    for case in CASES[:4]:
        B, Sq, Sk, H, Hkv, mult = case
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, 128, mult, seed=Sq + Sk)
        o, lse = mod.forward(q, k, v, return_lse=True)
        o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
        assert _rel_l2(o.float(), o_ref.float()) < TOL["fp8_directp"][0]
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
        _check_lse(lse, lse_ref, "fp8_directp", inputs=(q, k, v, plan.spec), l_from_mma=True)


@pytest.mark.parametrize("shape", [(2, 300, 4, 128), (1, 1024, 2, 64)])
def test_fast_quantizer_bit_equal_to_oracle(shape, tmp_path_factory):
    mod = _module("fp8_exp", shape[-1], False, tmp_path_factory)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(*shape, device="cuda", generator=g) * 3).bfloat16()
    x[0, :5] = 0  # an all-zero block row
    for per_block in (True, False):
        p_fast, s_fast = mod._quantize(x, per_block, fast=True)
        p_ref, s_ref = mod._quantize(x, per_block, fast=False)
        assert torch.equal(s_fast, s_ref)
        assert torch.equal(p_fast.view(torch.uint8), p_ref.view(torch.uint8))
