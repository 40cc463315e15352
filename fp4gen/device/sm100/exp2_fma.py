"""exp2 of two floats on the FMA pipe (CuTe DSL device helper, sm_100a: f32x2 arithmetic).

The FP8 exp path issues one MUFU ``ex2`` per score, and MUFU runs at 16 lanes per clock per SM
on B200: a 128 x 128 tile per softmax warp costs 128 x 8 = 1,024 MUFU cycles, more than the
warp issues otherwise (~460 instructions), so the tile is MUFU-bound (FA4 moves part of its
exponentials to the FMA pipe for the same reason). ``exp2_pair`` computes 2^x for a pair of
scores with f32x2 arithmetic, 11 instructions for two:

* x clamped below at -127 by ``max.NaN.f32`` (a NaN stays NaN; 2^-127 flushes to 0 below);
* r = x + (1.5 * 2^23 + 127) rounds to the integer n = rne(x) and holds n + 127 in its low
  mantissa bits; n = r - (1.5 * 2^23 + 127) and f = x - n in [-1/2, 1/2] are exact;
* 2^f by a degree-3 polynomial (``EXP2_POLY``, Horner in three FFMA2): relative error at most
  7.6e-5 in fp32 (MUFU's ``ex2.approx`` has ~2^-22; P is then rounded to E4M3, whose half ulp
  is 2^-4, and l sums the unrounded values: see EXP2_POLY for what that moves);
* times 2^n, built as the float bits (n + 127) << 23 from r (0 for n = -127).

Valid for x <= 127 (the exp path's x is at most log2 of P's stored factor, 8).
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.device.ptx import _asm
from fp4gen.device.sm100.direct_p import E8M0_MAGIC, f32_as_i32, i32_as_f32

# 2^f ~ c0 + f (c1 + f (c2 + f c3)) on [-1/2, 1/2], minimax in relative error (reweighted least
# squares on 200,001 points, coefficients rounded to fp32): max |p / 2^f - 1| = 7.52e-5. Where
# that moves an E4M3 rounding of P, the kernel's O leaves the reference's (which takes the exact
# exp2) by one P ulp: the emulated fa4_nvfp8 O max error went from 0.00049 to 0.0049 (tolerance
# 0.016). Degree 4 (2.7e-6: 0.00098) spilled 8 B; the MUFU's ex2.approx has ~2^-22.
EXP2_POLY = (0.9999282956123352, 0.6932609677314758, 0.24260851740837097, 0.05517060309648514)
EXP2_POLY_REL_ERR = 7.6e-5
ROUND_BIAS = E8M0_MAGIC  # 1.5 * 2^23 + 127, the trick of direct_p.block_exponent


@dsl_user_op
def max_nan(a, b, *, loc=None, ip=None) -> Float32:
    """max(a, b), NaN if either is (``max.NaN.f32``, PTX ISA: Floating-Point Instructions, max)."""
    return Float32(_asm(T.f32(), "max.NaN.f32 $0, $1, $2;", "=f,f,f", [Float32(a), Float32(b)], loc=loc, ip=ip))


@cute.jit
def exp2_pair(x0: Float32, x1: Float32):
    """(2^x0, 2^x1) on the FMA pipe: see the module docstring."""
    xc = (max_nan(x0, Float32(-127.0)), max_nan(x1, Float32(-127.0)))
    r = cute.arch.add_packed_f32x2(xc, (Float32(ROUND_BIAS), Float32(ROUND_BIAS)))
    n = cute.arch.add_packed_f32x2(r, (Float32(-ROUND_BIAS), Float32(-ROUND_BIAS)))
    f = cute.arch.fma_packed_f32x2(n, (Float32(-1.0), Float32(-1.0)), xc)
    c0, c1, c2, c3 = (Float32(c) for c in EXP2_POLY)
    p = cute.arch.fma_packed_f32x2(f, (c3, c3), (c2, c2))
    p = cute.arch.fma_packed_f32x2(p, f, (c1, c1))
    p = cute.arch.fma_packed_f32x2(p, f, (c0, c0))
    scale = (i32_as_f32(f32_as_i32(r[0]) << Int32(23)), i32_as_f32(f32_as_i32(r[1]) << Int32(23)))
    return cute.arch.mul_packed_f32x2(p, scale)
