"""FP8 Direct-P: E4M3 codes of P from plain float arithmetic (no MUFU.EX2).

With x = s * softmax_scale * log2(e) and m the running row max (both in log2
units), the code of one probability is

    t    = clamp(8 * (x - m) + 120, 0, 120)
    code = round_half_even(t)            # used as the E4M3 *bit pattern*

Code 120 = 0x78 is E4M3 256.0 (p = 1 at the fixed 2^8 scale); each step of 8
codes halves the value, and the 3 mantissa bits interpolate linearly between
powers of two -- E4M3's bit pattern *is* a piecewise-linear log2.

Cheap construction, two FMA-pipe instructions per score, no clamp instructions:
  FFMA.SAT  u = sat(s * (c/16) + (120 - 8 m)/128)     u = t/128 exactly (power-of-2
            scaling commutes with rounding); .sat is the clamp to [0, 128]
  FFMA      y = u * 128 + 1.5 * 2^23                   RNE to an integer in y's low
            mantissa bits: the low byte of y's bits is the code
  PRMT packs 4 codes per register for the MMA operand.
The upper clamp at 120 is made unnecessary, exactly, by directed rounding of the
row constants: m is rounded up (``row_ref``: m >= max_j s_j c) and 120 - 8m down
(``offset``), so t <= 120 before rounding and rn(t) <= 120 (120 is representable).
m is then at most 1 ulp above rn(max s * c); that ulp is far below the tolerance of
P. A NaN score gives code 0 here (the oracle's NaN code is 0x7F).

The normaliser sums exactly what PV consumes: decode(code) with E4M3's rules
(subnormals for codes < 8 included). For a 7-bit magnitude code,
bits(code << 20) is an fp32 whose exponent field is code >> 3 and whose top
mantissa bits are code & 7; multiplying by 2^120 (not flushing denormals) gives
the E4M3 value exactly, normals and subnormals alike.

This math is target-neutral; ``pack``-ing the codes into an MMA operand is the
target's business (``layout.pack_p_fp8`` on Hopper).
"""
from __future__ import annotations

import math

from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from fp4gen.numerics.directp import P_FP8_SCALE

from .ptx import _asm

CODE_ONE = 120  # E4M3 0x78 = 256.0 = 2^8 * p(1)
P_SCALE_LOG2 = int(math.log2(P_FP8_SCALE))  # P is stored at the fixed scale P_FP8_SCALE = 2^8
MAGIC_RNE = 12582912.0  # 1.5 * 2^23


@dsl_user_op
def row_ref(smax, c, *, loc=None, ip=None) -> Float32:
    """Row reference m = smax * c rounded up (so no score's t exceeds 120)."""
    return Float32(_asm(T.f32(), "mul.rp.f32 $0, $1, $2;", "=f,f,f", [Float32(smax), Float32(c)],
                        loc=loc, ip=ip))


@dsl_user_op
def offset(m, *, loc=None, ip=None) -> Float32:
    """(120 - 8 m) / 128 rounded down: the FFMA addend of ``code``."""
    return Float32(_asm(T.f32(), "fma.rm.f32 $0, $1, 0fBD800000, 0f3F700000;", "=f,f", [Float32(m)],
                        loc=loc, ip=ip))  # m * (-1/16) + 0.9375


@dsl_user_op
def code(s, c16, b128, *, loc=None, ip=None) -> Float32:
    """fp32 whose low byte is the Direct-P code of score ``s``.

    ``c16 = c / 16`` and ``b128 = offset(m)`` are per (row, tile) constants.
    """
    return Float32(
        _asm(
            T.f32(),
            "{\n.reg .f32 u;\n"
            "fma.rn.sat.f32 u, $1, $2, $3;\n"
            "fma.rn.f32 $0, u, 0f43000000, 0f4B400000;\n}",  # u * 128 + 1.5 * 2^23
            "=f,f,f,f",
            [Float32(s), Float32(c16), Float32(b128)],
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def decode(y, *, loc=None, ip=None) -> Float32:
    """E4M3 value (unscaled: code 120 -> 256.0) of the code in ``y``'s low byte.

    bits(y) = 0x4B400000 + code, so bits(y) << 20 == code << 20 (mod 2^32).
    """
    return Float32(
        _asm(
            T.f32(),
            "{\n.reg .b32 u;\n"
            "shl.b32 u, $1, 20;\n"
            "mul.rn.f32 $0, u, 0f7B800000;\n}",  # * 2^120, denormal-exact (no .ftz)
            "=f,f",
            [Float32(y)],
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def decode_acc(y, acc, *, loc=None, ip=None) -> Float32:
    """acc + decode(y) in one FFMA (same value as ``decode``, fused add)."""
    return Float32(
        _asm(
            T.f32(),
            "{\n.reg .b32 u;\n"
            "shl.b32 u, $1, 20;\n"
            "fma.rn.f32 $0, u, 0f7B800000, $2;\n}",
            "=f,f,f",
            [Float32(y), Float32(acc)],
            loc=loc,
            ip=ip,
        )
    )
