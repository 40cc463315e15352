"""exp2 on the FMA pipe (fp4gen.device.sm100.exp2_fma): its arithmetic mirrored step by step in
numpy float32 with the module's own constants, on a dense grid and the edges the FP8 exp path
meets (a masked key's -inf, NaN, the largest x = log2 256). The kernel's use of it is checked
end to end by `fp4gen verify` (the emulated fa4_nvfp8 forward against the reference; a
coefficient 10 % off fails there: O max error 0.023 against a tolerance of 0.016)."""
from __future__ import annotations

import numpy as np

from fp4gen.device.sm100.exp2_fma import EXP2_POLY, EXP2_POLY_REL_ERR, ROUND_BIAS

F = np.float32


def exp2_pair_model(x, poly=EXP2_POLY):
    """The device sequence: max.NaN, two f32 adds, an FFMA, Horner, the exponent field, a mul."""
    x = np.asarray(x, dtype=F)
    with np.errstate(invalid="ignore", over="ignore"):
        xc = np.where(np.isnan(x), x, np.maximum(x, F(-127.0))).astype(F)
        r = (xc + F(ROUND_BIAS)).astype(F)
        n = (r - F(ROUND_BIAS)).astype(F)
        f = (xc - n).astype(F)
        c0, c1, c2, c3 = (F(c) for c in poly)
        p = (f * c3 + c2).astype(F)
        p = (p * f + c1).astype(F)
        p = (p * f + c0).astype(F)
        scale = (r.view(np.uint32) << np.uint32(23)).view(F)
        return (p * scale).astype(F)


def test_relative_error_within_the_stated_bound():
    x = np.linspace(-120.0, 8.0, 2_000_001, dtype=np.float64).astype(F)
    got = exp2_pair_model(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.abs(got / want - 1).max() <= EXP2_POLY_REL_ERR


def test_the_reduction_is_exact():
    """n = rne(x + 127) - 127 (the add rounds x + 127 + 1.5 * 2^23: a tie goes to an even
    n + 127), f = x - n in [-1/2, 1/2], and the low bits of r hold n + 127."""
    x = np.array([-126.4, -3.5, -2.5, -0.5, 0.0, 0.49, 7.5, 8.0], dtype=F)
    r = (x + F(ROUND_BIAS)).astype(F)
    n = (r - F(ROUND_BIAS)).astype(F)
    want = np.rint(x.astype(np.float64) + 127) - 127
    assert np.array_equal(n, want.astype(F))
    assert np.all(np.abs(x - n) <= 0.5)
    assert np.array_equal((r.view(np.uint32) & 0x1FF).astype(np.int64), want.astype(np.int64) + 127)


def test_edges():
    got = exp2_pair_model([-np.inf, -127.0, -300.0, np.nan, 8.0])
    assert got[0] == 0 and got[1] == 0 and got[2] == 0  # a masked key adds nothing to l or P
    assert np.isnan(got[3])  # a NaN score stays NaN (max.NaN; then NaN * 2^n)
    assert abs(got[4] / 256.0 - 1) <= EXP2_POLY_REL_ERR  # P's largest value, p_fp8_scale


def test_a_wrong_coefficient_breaks_the_bound():
    """The bound test can fail: c1 0.1 % off exceeds it."""
    poly = (EXP2_POLY[0], EXP2_POLY[1] * 0.999) + tuple(EXP2_POLY[2:])
    x = np.linspace(-10.0, 8.0, 100_001, dtype=np.float64).astype(F)
    got = exp2_pair_model(x, poly).astype(np.float64)
    assert np.abs(got / np.exp2(x.astype(np.float64)) - 1).max() > EXP2_POLY_REL_ERR
