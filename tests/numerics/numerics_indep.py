"""Independent, deliberately plain implementations of the number formats and the
block quantizers, for checking fp4gen.numerics. Nothing here imports fp4gen:
values come from the format definitions with Fractions, rounding is a search over
every representable value, float32 arithmetic is emulated with struct.
"""
from __future__ import annotations

import bisect
import functools
import math
import struct
from fractions import Fraction

# (ebits, mbits, bias, kind)
SPECS = {"e2m1": (2, 1, 1, "fn_nonan"), "e4m3": (4, 3, 7, "fn"), "e5m2": (5, 2, 15, "ieee")}


def f32(x: float) -> float:
    """Round a Python float (float64) to the nearest float32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def code_value(name: str, code: int):
    """Fraction value of a code, or 'nan' / 'inf' / '-inf'."""
    eb, mb, bias, kind = SPECS[name]
    sign = -1 if code >> (eb + mb) & 1 else 1
    e = (code >> mb) & ((1 << eb) - 1)
    m = code & ((1 << mb) - 1)
    if kind == "fn" and e == (1 << eb) - 1 and m == (1 << mb) - 1:
        return "nan"
    if kind == "ieee" and e == (1 << eb) - 1:
        return "nan" if m else ("inf" if sign > 0 else "-inf")
    if e == 0:
        v = Fraction(m, 1 << mb) * Fraction(2) ** (1 - bias)
    else:
        v = (1 + Fraction(m, 1 << mb)) * Fraction(2) ** (e - bias)
    return sign * v


@functools.lru_cache(maxsize=None)
def positive_finite(name: str):
    """[(code, Fraction)] for every finite non-negative code (sign bit clear)."""
    eb, mb, _, _ = SPECS[name]
    out = []
    for c in range(1 << (eb + mb)):
        v = code_value(name, c)
        if isinstance(v, Fraction):
            out.append((c, v))
    return tuple(out)


def nearest_code(x: float, name: str) -> int:
    """RNE with saturation to the largest finite value (PTX .satfinite)."""
    eb, mb, _, _ = SPECS[name]
    sign = (1 << (eb + mb)) if math.copysign(1.0, x) < 0 else 0
    a = abs(Fraction(x))
    vals = positive_finite(name)  # sorted by value (the formats are monotone in their codes)
    top_c, top_v = vals[-1]
    if a >= top_v:
        return top_c | sign
    i = bisect.bisect_right([v for _, v in vals], a)  # vals[i-1] <= a < vals[i]
    (c0, v0), (c1, v1) = vals[i - 1], vals[i]
    d0, d1 = a - v0, v1 - a
    c = c0 if d0 < d1 or (d0 == d1 and c0 % 2 == 0) else c1
    return c | sign


def e8m0_value(code: int):
    return "nan" if code == 255 else Fraction(2) ** (code - 127)


def e8m0_code(x: float, rounding: str) -> int:
    if math.isnan(x) or math.copysign(1.0, x) < 0:
        return 255
    if math.isinf(x):
        return 254
    if x == 0:
        return 0
    a = Fraction(x)
    cands = _E8M0_CANDS
    if rounding == "up":
        ok = [c for c, v in cands if v >= a]
        return ok[0] if ok else 254
    if rounding == "down":
        ok = [c for c, v in cands if v <= a]
        return ok[-1] if ok else 0
    best = None
    for c, v in cands:
        d = abs(v - a)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c)
    return best[1]


_E8M0_CANDS = [(c, Fraction(2) ** (c - 127)) for c in range(255)]


def fv(frac) -> float:
    return float(frac)


# ----------------------------------------------------------- quantizers ----

def nvfp4_block(xs: list[float]):
    """One NVFP4 block without tensor scale: (codes, scale_code, scale)."""
    amax = max(abs(x) for x in xs)
    sc = nearest_code(f32(amax / 6.0), "e4m3")  # (f64 division then f32: see module doc)
    s = fv(code_value("e4m3", sc))
    codes = [0 if s == 0 else nearest_code(f32(x / s), "e2m1") for x in xs]
    return codes, sc, s


def mxfp4_block(xs: list[float]):
    """One MXFP4 block, ceil rule: smallest power of two >= fl32(amax / 6)."""
    amax = max(abs(x) for x in xs)
    t = f32(amax / 6.0)
    sc = e8m0_code(t, "up")
    s = fv(e8m0_value(sc))
    codes = [nearest_code(f32(x / s), "e2m1") for x in xs]
    return codes, sc, s


def fp8_group(xs: list[float], name="e4m3", fmax=448.0):
    amax = max(abs(x) for x in xs)
    # the contract: amax times the fp32-rounded reciprocal of fmax (what CUDA does for
    # amax / 448.0); the f64 product of two f32 values is exact, then one f32 rounding
    s = 1.0 if amax == 0 else f32(amax * f32(1.0 / fmax))
    return [nearest_code(f32(x / s), name) for x in xs], s
