"""Direct-P on sm_100a: scores -> E2M1 codes + E8M0 block exponents, in registers.

Device helpers called from inside ``@cute.jit`` code of the generated sm100a
forward (they trace into the caller; nothing here launches anything). The fast
policy uses only FP32 FMA/max and integer IMAD/PRMT -- no MUFU ``ex2`` -- and the
conformance check counts ``ex2`` in the PTX to prove it.

They mirror ``fp4gen.numerics.directp.direct_p_mxfp4`` (docs/numerics.md) for one
query row (one softmax thread owns one row). ``t`` is a score in log2 units
(``s * softmax_scale * log2 e``), ``m`` the fixed row reference (0 without the
guard), ``u = t - m``; per block B of 32 keys:

* ``e_B = clamp(floor(max_B u), -127, 127)``, -127 for a fully masked block; the
  E8M0 byte is ``e_B + 127``;
* fast policy (the saturating classifier, ``numerics.directp.sat_codes``):
  ``y = sat(A7s * s + c_B)`` on the raw score s, the softmax scale folded into
  ``A7s = fl32(scale * A / 7)`` and the row reference, e_B, log2 6 and B into
  ``c_B = fma(-A/7, m + e_B, (B + A log2 6) / 7)``; ``.sat`` is the clamp to codes [0, 7];
  ``code = rne(7 y)`` by one FMA with 1.5*2^23, which leaves the integer in the low
  mantissa bits (FMA rate, no F2I);
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
import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.device import ptx
from fp4gen.device.ptx import _asm

LOG2_6 = math.log2(6.0)  # rounded to f32 where used, as numerics.directp.LOG2_6
MAGIC = 12582912.0  # 1.5 * 2^23
# 2 * |E2M1| of codes 0..7 as bytes of two words (PRMT table): 0,1,2,3 | 4,6,8,12
TWICE_LO = 0x03020100
TWICE_HI = 0x0C080604


@dsl_user_op
def f32_as_i32(x, *, loc=None, ip=None) -> Int32:
    """Reinterpret the bits of an f32 as i32 (no conversion instruction)."""
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def i32_as_f32(x, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


E8M0_MAGIC = MAGIC + 127.0  # e + E8M0_MAGIC holds the integer e + 127 in its low mantissa bits


@cute.jit
def block_exponent(block_max_u: Float32, bounded: cutlass.Constexpr = False):
    """(e_B, word) for a block: e_B = clamp(floor(max_B u), -127, 127) as a float (-inf, a fully
    masked block, and an all-NaN block give -127: max.f32 returns the operand that is not NaN),
    and ``word`` = bits of fl32(e_B + 1.5 * 2^23 + 127), exact, whose low byte is the E8M0
    byte e_B + 127 (a byte store keeps just that) and whose low 9 bits ``quad_pow2`` and
    ``half_pow2_e8m0`` read. A floor and two FP32 clamps: no conversion to integer.
    ``bounded``: u <= REBASE_E is known (the guard's rebase ran on this tile, and the scores are
    finite: products of NVFP4 operands), so the clamp at 127 is left out."""
    e = cute.math.floor(block_max_u, fastmath=True)
    e = cute.arch.fmax(e, Float32(-127.0))
    if cutlass.const_expr(not bounded):
        e = cute.arch.fmin(e, Float32(127.0))
    return e, f32_as_i32(e + Float32(E8M0_MAGIC))


@cute.jit
def quad_pow2(word: Int32) -> Float32:
    """2^(e_B + 1) from ``block_exponent``'s word: the exponent field (e_B + 128) << 23, one LEA.
    A normal float for e_B in [-127, 126] (so l kept as 4 l sums exact terms down to e_B = -127
    without subnormals); e_B = 127 gives inf, as the reference's l is then (6 * 2^127 > FLT_MAX).
    Only for kernels with the guard's rebase, where every e_B <= REBASE_E: 4 l has 2^61 of
    headroom there (numerics.directp.rebase); without it 4 l would overflow 2 binades early."""
    return i32_as_f32((word << Int32(23)) + Int32(1 << 23))


@cute.jit
def half_pow2_e8m0(word: Int32) -> Float32:
    """2^(e_B-1) for e_B in [-127, 127] from ``block_exponent``'s word, exact: the exponent field
    for e_B >= -125, else 2^-126 times 2^(e_B+125) (subnormal results), so that
    l += twice * 2^(e_B - 1) costs no separate halving (kernels without the rebase)."""
    e = (word & Int32(0xFF)) - Int32(127)
    v = i32_as_f32((max(e, Int32(-125)) + Int32(126)) << Int32(23))
    tiny = Float32(cutlass.select_(e == Int32(-127), Float32(0.25), Float32(0.5)))
    return Float32(cutlass.select_(e < Int32(-125), Float32(2.0 ** -126) * tiny, v))


REBASE_E = 64  # numerics.directp.REBASE_E


@cute.jit
def rebase_shift(t_max: Float32, m: Float32):
    """The guard's headroom rebase (numerics.directp.rebase) for one row and KV tile: with
    u = t_max - m the tile's maximum over the row reference, d = floor(u) where
    REBASE_E < u < inf, else 0. Returns (d, fac): the reference moves to m + d, O and l are
    scaled by fac = 2^-d, built from the exponent field (exact; 0 for d > 126). A NaN or -inf
    u (a NaN score, a fully masked tile) compares false and leaves d = 0."""
    u = t_max - m
    d = Float32(cutlass.select_(u > Float32(REBASE_E), cute.math.floor(u, fastmath=True), Float32(0.0)))
    d = Float32(cutlass.select_(u < Float32.inf, d, Float32(0.0)))
    e = Int32(min(d, Float32(126.0)))
    fac = i32_as_f32((Int32(127) - e) << Int32(23))
    return d, Float32(cutlass.select_(d > Float32(126.0), Float32(0.0), fac))


@dsl_user_op
def byte_sum(x, *, loc=None, ip=None) -> Int32:
    """The sum of the four bytes of ``x`` (unsigned): one ``dp4a.u32.u32`` against 0x01010101
    (PTX ISA: Integer Arithmetic Instructions, dp4a)."""
    return Int32(_asm(T.i32(), "dp4a.u32.u32 $0, $1, 0x01010101, 0;", "=r,r", [Int32(x)], loc=loc, ip=ip))


@dsl_user_op
def fma_sat(a, b, c, *, loc=None, ip=None) -> Float32:
    """sat(fl32(a*b + c)): ``fma.rn.sat.f32`` (PTX ISA: Floating-Point Instructions, fma; .sat
    clamps the result to [0, 1] and turns NaN into +0). No f32x2 form has .sat."""
    return Float32(_asm(T.f32(), "fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f",
                        [Float32(a), Float32(b), Float32(c)], loc=loc, ip=ip))


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """fl32(a*b + c) rounded once, whatever the compiler's contraction choices."""
    return Float32(_asm(T.f32(), "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f",
                        [Float32(a), Float32(b), Float32(c)], loc=loc, ip=ip))


@cute.jit
def sat_offset(m: Float32, e_b: Float32, a7, k7: cutlass.Constexpr) -> Float32:
    """c_B = fl32(fma(-A7, fl32(m + e_B), K7)) (numerics.directp.sat_offset). ``a7``: the constant or
    a register holding it (thread_f32)."""
    return fma_rn(m + e_b, Float32(-a7), Float32(k7))


# Two codes into one byte by FP32 arithmetic: the odd key's code rounded at granularity 16
# (7 y * 16 + 1.5 * 2^27: 16 rne(7 y) in an ulp-16 binade), moved exactly to the ulp-1 binade
# (+ 1.5 * 2^23 - 1.5 * 2^27), then the even key's 7 y added and rounded there: the low byte of
# the result's bits is code_odd << 4 | code_even (1.5 * 2^23 has a zero low byte).
MAGIC16 = 1.5 * 2.0 ** 27
MAGIC_SHIFT = MAGIC - MAGIC16  # exact in FP32


@cute.jit
def sat_block(s: cute.Tensor, a_s: Float32, c_b: Float32, words: cute.Tensor, w0: cutlass.Constexpr,
              packed: cutlass.Constexpr = True, lo_t=None, hi_mul=None) -> Int32:
    """The saturating classifier (numerics.directp.sat_codes) for one 32-key block of raw scores
    ``s``: the codes as four nibble words ``words[w0 .. w0+4)`` (key 8w + c in nibble c of word
    w); returns twice the block's sum of E2M1 magnitudes. Per key one ``fma.rn.sat.f32``
    (y = sat(A7s * s + c_B): the clamp to codes [0, 7] and NaN -> 0 come with it); per four keys
    three f32x2 instructions that leave two code bytes (``MAGIC16``: rne(7 y) has no ties, so
    each rounding is the code's); per word three PRMTs gathering its four bytes; per four keys
    one PRMT for the magnitudes (``twice_values_pair``), folded once per block (``byte_sum``).
    ``packed=False``: the same roundings by scalar FMAs and adds (the
    sm_90a probe: f32x2 is sm_100a only)."""
    seven = (Float32(7.0), Float32(7.0))
    if cutlass.const_expr(hi_mul is None):
        hi_mul = Float32(112.0)
    hi_mul = (hi_mul, hi_mul)
    magic16 = (Float32(MAGIC16), Float32(MAGIC16))
    shift = (Float32(MAGIC_SHIFT), Float32(MAGIC_SHIFT))
    hi_t = Int32(TWICE_HI)
    if cutlass.const_expr(lo_t is None):
        lo_t = Int32(TWICE_LO)
    twice_bytes = Int32(0)
    for w in cutlass.range_constexpr(4):
        pairs = []
        for q in cutlass.range_constexpr(2):
            k = w * 8 + 4 * q
            y = [fma_sat(s[k + i], a_s, c_b) for i in range(4)]
            if cutlass.const_expr(packed):
                hi = cute.arch.fma_packed_f32x2((y[1], y[3]), hi_mul, magic16)
                hi = cute.arch.add_packed_f32x2(hi, shift)
                r = cute.arch.fma_packed_f32x2((y[0], y[2]), seven, hi)
            else:
                h0 = fma_rn(y[1], hi_mul[0], magic16[0]) + shift[0]
                h1 = fma_rn(y[3], hi_mul[1], magic16[1]) + shift[1]
                r = (fma_rn(y[0], seven[0], h0), fma_rn(y[2], seven[1], h1))
            pairs += [f32_as_i32(r[0]), f32_as_i32(r[1])]  # keys (k, k+1), (k+2, k+3)
        # keys 8w..8w+3 and 8w+4..8w+7 as the low halves of two words: the word's two halves,
        # and each one PRMT lookup's four selectors as they are (no shift for the high half)
        lo4 = Int32(ptx.prmt(pairs[0], pairs[1], 0x40))
        hi4 = Int32(ptx.prmt(pairs[2], pairs[3], 0x40))
        words[w0 + w] = Int32(ptx.prmt(lo4, hi4, 0x5410))
        twice_bytes = twice_bytes + twice_values_pair(lo4, lo_t, hi_t) + twice_values_pair(hi4, lo_t, hi_t)
    return byte_sum(twice_bytes)


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
def thread_register(value: int, *, loc=None, ip=None) -> Int32:
    """``value`` in a per-thread register: %tid.x >> 31 (always 0) added, which ptxas cannot fold."""
    return Int32(llvm.inline_asm(T.i32(), [], "{\n.reg .u32 t;\nmov.u32 t, %tid.x;\nshr.u32 t, t, 31;\n"
                                 f"add.u32 $0, t, {value:#x};\n}}", "=r", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def thread_f32(value: float, *, loc=None, ip=None) -> Float32:
    """The fp32 ``value`` in a per-thread register (``thread_register`` of its bits): a constant
    the tile loop uses that ptxas would otherwise rebuild on every tile."""
    bits = int.from_bytes(struct.pack("<f", value), "little")
    return i32_as_f32(thread_register(bits, loc=loc, ip=ip))


@dsl_user_op
def twice_values_pair(byte, lo, hi, *, loc=None, ip=None) -> Int32:
    """Byte i = 2*|E2M1(nibble i)| for the codes (0..7) in the low nibbles of ``byte`` (one
    PRMT: its selector is the low 16 bits, four codes; a code byte gives two). ``lo``, ``hi``:
    the table's two words (``TWICE_LO``, ``TWICE_HI``); ptxas makes ``hi`` the PRMT's immediate
    and moves ``lo`` into a register before each lookup."""
    return Int32(_asm(T.i32(), "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [Int32(lo), Int32(hi), Int32(byte)],
                      loc=loc, ip=ip))


@cute.jit
def e2m1_nibble(b: Int32, shift: cutlass.Constexpr) -> Float32:
    """Signed E2M1 value of the nibble of ``b`` at bit ``shift`` (sign bit 3, magnitude
    code bits 0-2), through the same PRMT table (the guard's software dot products)."""
    nib = (b >> Int32(shift)) & Int32(0xF)
    v = Float32(twice_values_pair(nib & Int32(7), TWICE_LO, TWICE_HI) & Int32(0xFF)) * Float32(0.5)
    return Float32(cutlass.select_(nib >= Int32(8), -v, v))
