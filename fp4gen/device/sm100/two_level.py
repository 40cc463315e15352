"""Two-level P on sm_100a (SageAttention3): p -> NVFP4 codes + E4M3 block scales, in registers.

Device helpers called from inside ``@cute.jit`` code of the generated sm100a forward
(they trace into the caller). They implement ``fp4gen.numerics.directp.p_two_level``
(docs/numerics.md section 8) for one query row (one softmax thread owns one row):

* the template computes p = exp2(t - m) on the MUFU (online max m) and the tile's row
  factor r = fl32(rowmax(p) / 2688) (1 for an all-zero row), then P2 = p * fl32(1/r);
* per 16 keys: the E4M3 scale code ``e4m3_code(amax(P2) / 6)`` (RNE, saturating at 448,
  by the hardware ``cvt.rn.satfinite.e4m3x2.f32``), its value s, and E2M1 codes of
  P2 * fl32(1/s) (0 where s == 0) by ``cvt.rn.satfinite.e2m1x2.f32`` (RNE, saturating
  at 6: the same rounding as numerics.formats.encode);
* the PV MMA (kind::mxf4nvf4.block_scale.block16) consumes E2M1 * s = deq(P2); the
  factor r is applied to O by the template (docs/sm100.md, "Two-level P").
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.device.ptx import _asm
from fp4gen.device.sm100 import fp64_division

P2_RANGE = 448.0 * 6.0  # P2 = p / r spans [0, 2688]: E4M3 scales amax/6 reach 448
# smallest row factor the kernel uses: O lives in TMEM in units of r (O / r must stay finite)
R_MIN = 2.0 ** -64


@dsl_user_op
def e4m3_code(x, *, loc=None, ip=None) -> Int32:
    """E4M3 code (RNE, satfinite: > 448 -> 0x7E) of a non-negative f32, in the low byte."""
    return Int32(_asm(T.i32(), "{\n.reg .b16 h;\n"
                      "cvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, $1;\n"  # second source -> low byte
                      "cvt.u32.u16 $0, h;\n}", "=r,f", [Float32(x)], loc=loc, ip=ip))


@dsl_user_op
def e2m1_pair(x0, x1, *, loc=None, ip=None) -> Int32:
    """The byte ``code(x1) << 4 | code(x0)``: E2M1 RNE codes (saturating at 6) of two f32."""
    return Int32(_asm(T.i32(), "{\n.reg .b8 q;\n"
                      "cvt.rn.satfinite.e2m1x2.f32 q, $2, $1;\n"  # first source -> upper nibble
                      "cvt.u32.u8 $0, q;\n}", "=r,f,f", [Float32(x0), Float32(x1)], loc=loc, ip=ip))


# ---- fl32(x / y) with no division subroutine call (fp64_division says why and how) ----------


@dsl_user_op
def div_rn_const(x, c: float, *, loc=None, ip=None) -> Float32:
    """fl32(x / c) for a constant c, for positive normal x with a normal quotient."""
    return Float32(_asm(T.f32(), fp64_division.const_ptx(c), "=f,f", [Float32(x)], loc=loc, ip=ip))


@dsl_user_op
def div_rn(x, y, *, loc=None, ip=None) -> Float32:
    """fl32(x / y) for positive normal x, y with a normal quotient."""
    return Float32(_asm(T.f32(), fp64_division.DIV_PTX, "=f,f,f", [Float32(x), Float32(y)], loc=loc, ip=ip))


@cute.jit
def row_factor(pmax: Float32) -> Float32:
    """r = fl32(pmax / 2688), clamped below at R_MIN; 1 for an all-zero (masked) row.
    pmax <= 1 (p = ex2 of a non-positive number); a quotient below 2^-126 (outside
    div_rn_const's domain) is below R_MIN, which the clamp returns either way."""
    r = cute.arch.fmax(div_rn_const(pmax, P2_RANGE), Float32(R_MIN))
    return Float32(cutlass.select_(pmax > Float32(0.0), r, Float32(1.0)))
