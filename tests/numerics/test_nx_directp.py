"""P production: the Hopper FP8 Direct-P codes, MXFP4 Direct-P (fast/accurate) vs a
plain per-block loop, two-level P, and the guard."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fp4gen.ir.spec import (DirectPPolicy, Format, Guard, GuardKind, KernelSpec, PKind,
                            PProduction, Target, default_operand_format)
from fp4gen.numerics import directp as dp
from fp4gen.numerics.accuracy import compare, exact_attention
from fp4gen.numerics.reference import forward
from numerics_indep import code_value, f32, nearest_code

E2M1_VALS = [float(code_value("e2m1", c)) for c in range(8)]
LOG2_6_F32 = f32(math.log2(6.0))


def rne(y: float) -> int:
    return round(y)  # Python rounds half to even


# ------------------------------------------------------------- FP8 Direct-P

def test_fp8_direct_p_exact_at_integers_and_subnormals():
    x = torch.arange(-20, 1, dtype=torch.float32)
    v = dp.p_fp8_direct(x[None], torch.zeros(1))[0][0]
    for xi, vi in zip(x.tolist(), v.tolist()):
        if xi >= -14:
            assert vi == 2.0 ** xi  # code 8x+120, exact power of two
        else:
            assert vi == 0.0  # clamped to code 0
    # between -15 and -14 the codes 0..7 are E4M3 subnormals: value code * 2**-9 / 256
    xs = -15 + torch.arange(8, dtype=torch.float32) / 8
    codes = dp.fp8_direct_p_codes(xs)
    assert codes.tolist() == list(range(8))
    assert (dp.p_fp8_direct(xs[None], torch.zeros(1))[0][0] == codes.float() * 2.0 ** -17).all()


@settings(max_examples=300, deadline=None, database=None)
@given(st.floats(min_value=-40, max_value=0, width=32))
def test_fp8_direct_p_codes_match_plain_formula(x):
    want = rne(min(max(f32(8.0 * x + 120.0), 0.0), 120.0))
    assert int(dp.fp8_direct_p_codes(torch.tensor([x]))[0]) == want


def test_fp8_direct_p_is_piecewise_linear_2x_and_l_sums_it():
    x = -torch.rand(1, 4000, generator=torch.Generator().manual_seed(0)) * 12
    pv, l = dp.p_fp8_direct(x, torch.zeros(1))
    # the chord 2**n * (1 + f) of 2**(n + f) lies up to 6.2% above the curve; rounding the
    # code to an integer moves f by at most 1/16
    p = torch.exp2(x)
    normal = x >= -14
    r = pv[normal] / p[normal]
    assert r.min() > 0.95 and r.max() < 1.11 and r.max() > 1.04
    assert ((pv - p).abs()[~normal] <= 2.0 ** -14).all()
    assert torch.allclose(l, pv.sum(-1))
    assert dp.fp8_direct_p_codes(torch.tensor([float("-inf"), float("nan")])).tolist() == [0, 0x7F]


# ----------------------------------------------------------- MXFP4 Direct-P

def plain_direct_p(t_row, m, policy, a=1.5, b=1.2, block=32):
    """Direct-P of one row, loops and float32 emulation; returns (pv list, l)."""
    pv = []
    for s in range(0, len(t_row), block):
        u = [f32(t - m) for t in t_row[s:s + block]]
        umax = max(u)
        eb = -127 if umax == -math.inf else max(-127, min(127, math.floor(umax)))
        for uj in u:
            if uj == -math.inf:
                code = 0
            else:
                x = f32(f32(uj - eb) + LOG2_6_F32)
                if policy == "fast":
                    y = f32(f32(x * f32(a)) + f32(b))
                    code = rne(min(max(y, 0.0), 7.0))
                else:
                    code = nearest_code(f32(2.0 ** x), "e2m1")
            pv.append(E2M1_VALS[code] * 2.0 ** eb)
    return pv, sum(pv)


@settings(max_examples=40, deadline=None, database=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 100), st.sampled_from(["fast", "accurate"]),
       st.sampled_from([0.5, 3.0, 20.0]), st.floats(-30, 30, width=32))
def test_mxfp4_direct_p_matches_plain_loops(seed, n, policy, spread, m):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * spread
    t[torch.rand(n, generator=g) < 0.1] = float("-inf")  # masked keys
    pv, l, codes, eb = dp.direct_p_mxfp4(t[None], torch.tensor([m]), policy)
    want, wl = plain_direct_p(t.tolist(), m, policy)
    if policy == "accurate":
        # torch.exp2 (float32) may differ from the correctly rounded 2**x by an ulp, which
        # can flip an RNE tie; allow that on at most a few elements
        diff = sum(1 for a_, b_ in zip(pv[0].tolist(), want) if a_ != b_)
        assert diff <= max(1, n // 50)
    else:
        assert pv[0].tolist() == want
        assert float(l[0]) == pytest.approx(wl, rel=1e-6)
    assert torch.equal(l, pv.sum(-1))  # l is built from exactly what PV consumes


def test_fast_classifier_shape():
    x = torch.linspace(-3, 3.6, 1000)
    c = dp.fast_codes(x)
    assert (c[1:] >= c[:-1]).all()  # monotone
    assert int(dp.fast_codes(torch.tensor([float("-inf")]))[0]) == 0
    assert int(dp.fast_codes(torch.tensor([100.0]))[0]) == 7
    # default A=1.5, B=1.2: x = log2 6 (the block max) -> code 5
    assert int(dp.fast_codes(torch.tensor([math.log2(6)]))[0]) == 5


def test_direct_p_block_max_saturates_and_masked_block():
    t = torch.tensor([[0.0, -1.0, -2.0, -3.0] * 8 + [float("-inf")] * 32])
    pv, l, codes, eb = dp.direct_p_mxfp4(t, torch.zeros(1), "accurate")
    assert eb.tolist() == [[0.0, -127.0]]
    assert codes[0, 0] == 7 and (codes[0, 32:] == 0).all()  # 6 * 2**0 is the block max value
    assert pv[0, :4].tolist() == [6.0, 3.0, 1.5, 1.0]  # 6 * 2**u to E2M1 (0.75 ties to even 1.0)


def test_two_level_uses_full_e4m3_range():
    """A key tile far below the running max (p <= 2**-12): plain NVFP4 P gets E4M3 block
    scales in the subnormal/zero range; the two-level rescale keeps its accuracy."""
    g = torch.Generator().manual_seed(4)
    t = torch.randn(3, 128, generator=g) * 2
    m = t.amax(-1) + 12.0  # the running max came from an earlier tile
    p = torch.exp2(t - m[:, None])
    pv, l = dp.p_two_level(t, m)
    assert torch.allclose(l, p.sum(-1))
    rel_two = ((pv - p).norm() / p.norm()).item()
    pv_plain, _ = dp.p_exp_fp4(t, m, "nvfp4", 16)
    rel_plain = ((pv_plain - p).norm() / p.norm()).item()
    assert rel_two < 0.15 and rel_plain > 0.3, (rel_two, rel_plain)
    # the first level puts each row's largest p at exactly 448 * 6
    r = p.amax(-1, keepdim=True) / (448.0 * 6.0)
    assert torch.allclose((p / r).amax(-1), torch.full((3,), 2688.0))


# ------------------------------------------------------------------ guard

def _spec(guard):
    mx = default_operand_format(Format.MXFP4)
    f32 = default_operand_format(Format.FP32)  # Q/K exact: the guard is about P
    return KernelSpec(name="g", target=Target.SM100A, head_dim=64, q=f32, k=f32, p=mx, v=mx,
                      o=default_operand_format(Format.FP32),
                      p_production=PProduction(PKind.DIRECT_P, DirectPPolicy.ACCURATE), guard=guard)


def test_guard_sample_positions():
    assert dp.guard_sample_positions(1000, 16).tolist()[:3] == [0, 62, 125]
    assert dp.guard_sample_positions(5, 16).tolist() == [0, 1, 2, 3, 4]
    assert dp.guard_sample_positions(0, 16).numel() == 0


@pytest.mark.parametrize("shift", [-130.0, 120.0])
def test_guard_fixes_large_logits(shift):
    """Logits far from 0 push the block exponents out of E8M0's range without the guard
    (underflow: every block flushes to zero; overflow: saturated blocks and an infinite
    accumulator); with the guard the result matches the moderate-logit accuracy."""
    g = torch.Generator().manual_seed(5)
    B, S, H, D = 1, 256, 2, 64
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, S, H, D, generator=g)
    v = torch.randn(B, S, H, D, generator=g)
    # a shared direction adds `shift` (natural units) to every logit: softmax is unchanged
    q[..., 0] = 1.0
    k[..., 0] = shift * math.sqrt(D)
    o_ref, _, _ = exact_attention(q, k, v, D ** -0.5, False)
    o_plain, _ = forward(q, k, v, _spec(Guard()))
    o_guard, _ = forward(q, k, v, _spec(Guard(GuardKind.SAMPLE, 110, 16)))
    bad = compare(torch.nan_to_num(o_plain, nan=0.0, posinf=0.0, neginf=0.0), o_ref)
    good = compare(o_guard, o_ref)
    assert good["cosine"] > 0.95, good
    assert not (bad["cosine"] > 0.5), bad  # NaN (an all-zero output) counts as failed
    # the guard leaves moderate logits alone (its reference is 0 there)
    k[..., 0] = 0.0
    o1, _ = forward(q, k, v, _spec(Guard()))
    o2, _ = forward(q, k, v, _spec(Guard(GuardKind.SAMPLE, 110, 16)))
    assert torch.equal(o1, o2)
