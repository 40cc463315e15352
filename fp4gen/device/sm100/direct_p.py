"""Direct-P on sm_100a: scores -> E2M1 codes + E8M0 block exponents, in registers.

Device helpers called from inside ``@cute.jit`` code of the generated sm100a
forward (they trace into the caller; nothing here launches anything). The fast
policy uses only FP32 add/FMA/min/max and integer PRMT/BFI -- no MUFU ``ex2`` --
and the conformance check counts ``ex2`` in the PTX to prove it.

They mirror ``fp4gen.numerics.directp.direct_p_mxfp4`` (docs/numerics.md) for one
query row (one softmax thread owns one row). ``t`` is a score in log2 units
(``s * softmax_scale * log2 e``), ``m`` the fixed row reference (0 without the
guard), ``u = t - m``; per block B of 32 keys:

* ``e_B = clamp(floor(max_B u), -127, 127)``, -127 for a fully masked block; the
  E8M0 byte is ``e_B + 127``;
* ``x = (u - e_B) + log2(6)`` (two FP32 roundings, as the reference);
* fast policy: ``code = rne(clamp(A*x + B, 0, 7))`` -- rne by adding 1.5*2^23,
  which leaves the integer in the low mantissa bits (FADD rate, no F2I). The
  compiler may contract ``A*x + B`` into one FMA (the reference rounds twice;
  they differ only exactly at rounding ties);
* accurate policy: ``code = e2m1_rne(ex2(x))``: EX2 on the MUFU, the rounding by
  the hardware ``cvt.rn.satfinite.e2m1x2.f32`` (two codes per instruction);
* PV consumes ``E2M1(code) * 2^e_B`` and ``l`` sums exactly those values: twice
  each magnitude (an integer 0..12) comes from a PRMT table lookup, the block sum is
  exact in integers, then ``l += sum / 2 * 2^e_B``.

FP8 P on sm_100a (training recipe) uses the exp path in the template; the shared,
target-neutral FP8 Direct-P helpers live in ``fp4gen.device.directp``.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.device.ptx import _asm

LOG2_6 = math.log2(6.0)  # rounded to f32 where used, as numerics.directp.LOG2_6
MAGIC = 12582912.0  # 1.5 * 2^23
# 2 * |E2M1| of codes 0..7 as bytes of two words (PRMT table): 0,1,2,3 | 4,6,8,12
_TWICE_E2M1_LO = 0x03020100
_TWICE_E2M1_HI = 0x0C080604


@dsl_user_op
def f32_as_i32(x, *, loc=None, ip=None) -> Int32:
    """Reinterpret the bits of an f32 as i32 (no conversion instruction)."""
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def i32_as_f32(x, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def block_exponent(block_max_u: Float32) -> Int32:
    """e_B = clamp(floor(max_B u), -127, 127); -inf (fully masked block) -> -127."""
    d = min(cute.arch.fmax(block_max_u, Float32(-1.0e4)), Float32(1.0e4))
    e = Int32(cute.math.floor(d, fastmath=True))
    return max(min(e, Int32(127)), Int32(-127))


@cute.jit
def pow2_e8m0(e: Int32) -> Float32:
    """2^e for e in [-127, 127] from the exponent field (2^-127 is subnormal: halve 2^-126)."""
    v = i32_as_f32((max(e, Int32(-126)) + Int32(127)) << Int32(23))
    return Float32(cutlass.select_(e == Int32(-127), v * Float32(0.5), v))


@cute.jit
def fast_code(t: Float32, m: Float32, e_b: Float32, a: cutlass.Constexpr, b: cutlass.Constexpr) -> Float32:
    """Fast policy: rne(clamp(a*x + b, 0, 7)) + 1.5*2^23 (the code is in the low bits)."""
    x = ((t - m) - e_b) + Float32(LOG2_6)
    y = min(cute.arch.fmax(x * Float32(a) + Float32(b), Float32(0.0)), Float32(7.0))
    return y + Float32(MAGIC)


@dsl_user_op
def twice_value(r, *, loc=None, ip=None) -> Int32:
    """2 * E2M1 magnitude of the code held in ``r`` (= code + 1.5*2^23; its low 16 bits
    are the code, so it is a valid PRMT selector as is). One PRMT, exact."""
    return Int32(_asm(T.i32(), "{\n.reg .b32 lo, hi;\n"
                      f"mov.b32 lo, {_TWICE_E2M1_LO:#x};\nmov.b32 hi, {_TWICE_E2M1_HI:#x};\n"
                      "prmt.b32 $0, lo, hi, $1;\n}", "=r,r", [f32_as_i32(r, loc=loc, ip=ip)], loc=loc, ip=ip))


@dsl_user_op
def insert_code(word, r, slot: int, *, loc=None, ip=None) -> Int32:
    """``word`` with nibble ``slot`` set to the code held in ``r`` (one BFI; key ``slot`` of 8
    in the low nibble first)."""
    return Int32(_asm(T.i32(), f"bfi.b32 $0, $1, $2, {4 * slot}, 4;", "=r,r,r",
                      [f32_as_i32(r, loc=loc, ip=ip), Int32(word)], loc=loc, ip=ip))


@dsl_user_op
def accurate_pair(t0, t1, m, e_b, *, loc=None, ip=None) -> Int32:
    """Accurate policy for two scores: the byte ``code(t1) << 4 | code(t0)`` with
    code = e2m1_rne(ex2(x)), x = ((t - m) - e_B) + log2 6. EX2 on the MUFU; the
    rounding by ``cvt.rn.satfinite.e2m1x2.f32`` (RNE, ties to even; x <= log2 6, so
    only EX2's approximation error can reach the saturation at 6)."""
    c = Float32(LOG2_6)
    x0 = ((Float32(t0) - Float32(m)) - Float32(e_b)) + c
    x1 = ((Float32(t1) - Float32(m)) - Float32(e_b)) + c
    return Int32(_asm(T.i32(), "{\n.reg .f32 p0, p1;\n.reg .b8 q;\n"
                      "ex2.approx.ftz.f32 p0, $1;\nex2.approx.ftz.f32 p1, $2;\n"
                      "cvt.rn.satfinite.e2m1x2.f32 q, p1, p0;\n"  # first source -> upper nibble
                      "cvt.u32.u8 $0, q;\n}", "=r,f,f", [x0, x1], loc=loc, ip=ip))


@dsl_user_op
def twice_values_pair(byte, *, loc=None, ip=None) -> Int32:
    """Bytes {2*|E2M1(high nibble)|, 2*|E2M1(low nibble)|} of a code byte (one PRMT)."""
    return Int32(_asm(T.i32(), "{\n.reg .b32 lo, hi;\n"
                      f"mov.b32 lo, {_TWICE_E2M1_LO:#x};\nmov.b32 hi, {_TWICE_E2M1_HI:#x};\n"
                      "prmt.b32 $0, lo, hi, $1;\n}", "=r,r", [Int32(byte)], loc=loc, ip=ip))


@cute.jit
def e2m1_nibble(b: Int32, shift: cutlass.Constexpr) -> Float32:
    """Signed E2M1 value of the nibble of ``b`` at bit ``shift`` (sign bit 3, magnitude
    code bits 0-2), through the same PRMT table (the guard's software dot products)."""
    nib = (b >> Int32(shift)) & Int32(0xF)
    v = Float32(twice_values_pair(nib & Int32(7)) & Int32(0xFF)) * Float32(0.5)
    return Float32(cutlass.select_(nib >= Int32(8), -v, v))
