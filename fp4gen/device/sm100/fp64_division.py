"""fl32(x / y) without ptxas's division subroutine: the PTX text (no CuTe import here, so that
a GPU test can run the very same text through CuPy; ``two_level`` wraps it for CuTe DSL).

Why: an fp32 ``x / y`` (div.rn.f32) is an inline fast path plus a CALL to a slow-path
subroutine, and ptxas stores that call's return address to the stack at every call site in a
192-register softmax warp (the two-level kernel's last 88 B of "spill stores"). These compute
the same correctly rounded quotient in fp64, with no call:

* x / y is never an fp32 rounding midpoint and, for normal x, y and quotient, lies more than
  2^-49 (relative) from every midpoint: with x = Mx 2^a, y = My 2^b (24-bit Mx, My), a midpoint
  (2K+1) 2^(f-1) of the quotient's binade has a 25-bit odd part, which Mx = My (2K+1) 2^k cannot
  have, and x - y (2K+1) 2^(f-1) is a nonzero multiple of 2^min(a, b+f-1) >= 2^(a-25);
* so any value within a relative 2^-49 of x / y rounds (cvt.rn.f32.f64) to fl32(x / y). fp64
  gets within 2^-52: ``x * fl64(1/c)`` for a constant c (two fp64 roundings); for a variable y,
  the reciprocal of ``rcp.approx.ftz.f64`` (PTX ISA 9.7.3.14: 20 mantissa bits, relative error
  below 2^-19) after two Newton steps (2^-38, then the fp64 rounding), the product corrected
  once by its exact fp64 remainder (fma).

Domain: positive normal x, y with a normal fp32 quotient (each caller states why its are).
tests/sm100/test_two_level_division.py checks the claims: exhaustively for the constants the
kernel uses, at the lemma's tight cases for the variable form, and the PTX on a Hopper GPU.
"""
from __future__ import annotations

import struct


def f64_literal(v: float) -> str:
    """PTX's exact hexadecimal form of an fp64 immediate."""
    return "0d%016X" % struct.unpack("<Q", struct.pack("<d", float(v)))[0]


def const_ptx(c: float) -> str:
    """$0 = fl32($1 / c) for a constant c: cvt to fp64, one multiply by fl64(1/c), RN to fp32."""
    return ("{\n.reg .f64 d;\n"
            "cvt.f64.f32 d, $1;\n"
            f"mul.rn.f64 d, d, {f64_literal(1.0 / float(c))};\n"
            "cvt.rn.f32.f64 $0, d;\n}")


# $0 = fl32($1 / $2)
DIV_PTX = ("{\n.reg .f64 xd, yd, r, e, q;\n"
           "cvt.f64.f32 xd, $1;\ncvt.f64.f32 yd, $2;\n"
           "rcp.approx.ftz.f64 r, yd;\n"
           "neg.f64 yd, yd;\n"
           "fma.rn.f64 e, yd, r, 0d3FF0000000000000;\nfma.rn.f64 r, r, e, r;\n"  # e = 1 - y r
           "fma.rn.f64 e, yd, r, 0d3FF0000000000000;\nfma.rn.f64 r, r, e, r;\n"
           "mul.rn.f64 q, xd, r;\n"
           "fma.rn.f64 e, yd, q, xd;\nfma.rn.f64 q, e, r, q;\n"  # q += (x - y q) r
           "cvt.rn.f32.f64 $0, q;\n}")


def cuda_asm(ptx: str) -> str:
    """The same text as a CUDA C++ inline-asm string (operands %0, %1, ...)."""
    import re

    return re.sub(r"\$(\d)", r"%\1", ptx).replace("\n", "\\n")
