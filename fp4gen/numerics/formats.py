"""Bit-exact element formats: E2M1 (FP4), E4M3 (FP8 "fn"), E5M2 (FP8), E8M0 (scale).

Everything here is pure torch, vectorized, and gives identical bits on CPU and
CUDA (no transcendental functions: exponents come from ``torch.frexp`` and
powers of two are built from their IEEE bit patterns).

Codes are returned as ``torch.uint8`` tensors (one code per byte; FP4 codes
use the low nibble). ``decode`` maps codes back to exact float32 values.

Rules (see docs/numerics.md, "Element formats"):

- Rounding: round-to-nearest, ties to even (RNE) on the format's grid,
  subnormals included.
- Saturation (default, ``saturate=True``, the PTX ``.satfinite`` behaviour):
  finite values beyond the largest finite value, and +-Inf, become +-max.
  With ``saturate=False``: E5M2 overflows to +-Inf, E4M3 to NaN (it has no
  Inf); E2M1 always saturates (it has neither).
- NaN: E4M3 -> 0x7F, E5M2 -> 0x7F (sign bit cleared); E2M1 has no NaN, a NaN
  input encodes to 0x7 (+6); the block quantizers make the whole block NaN
  through its scale instead (see quant.py).
- Signed zero: -0.0 encodes to the sign bit alone (0x80 / 0x8) and decodes
  back to -0.0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MiniFloat:
    name: str
    ebits: int
    mbits: int
    bias: int
    max_code: int  # largest finite magnitude code (sign bit clear)
    inf_code: int | None  # magnitude code of Inf, if the format has Inf
    nan_code: int | None  # canonical NaN code, if the format has NaN

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (also the subnormal binade's scale)."""
        return 1 - self.bias

    @property
    def max_value(self) -> float:
        return _decode_mag_py(self, self.max_code)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    def is_nan_code(self, mag: int) -> bool:
        if self is E4M3:
            return mag == 0x7F
        if self is E5M2:
            return mag > 0x7C
        return False


E2M1 = MiniFloat("e2m1", 2, 1, 1, max_code=0x7, inf_code=None, nan_code=None)
E4M3 = MiniFloat("e4m3", 4, 3, 7, max_code=0x7E, inf_code=None, nan_code=0x7F)
E5M2 = MiniFloat("e5m2", 5, 2, 15, max_code=0x7B, inf_code=0x7C, nan_code=0x7F)

FORMATS = {"e2m1": E2M1, "e4m3": E4M3, "e5m2": E5M2}

# E2M1 magnitudes by code (index = 3-bit magnitude code)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _decode_mag_py(fmt: MiniFloat, mag: int) -> float:
    """Plain-Python decode of a magnitude code (the definition; used to build tables)."""
    e = mag >> fmt.mbits
    m = mag & ((1 << fmt.mbits) - 1)
    if fmt.inf_code is not None and mag == fmt.inf_code:
        return float("inf")
    if fmt.is_nan_code(mag):
        return float("nan")
    if e == 0:
        return m * 2.0 ** (fmt.emin - fmt.mbits)
    return (1.0 + m / (1 << fmt.mbits)) * 2.0 ** (e - fmt.bias)


def code_table(fmt: MiniFloat) -> list[float]:
    """Value of every code 0 .. 2**bits - 1 (sign bit included)."""
    out = []
    for c in range(1 << fmt.bits):
        v = _decode_mag_py(fmt, c & (fmt.sign_bit - 1))
        out.append(-v if c & fmt.sign_bit else v)
    return out


_TABLE_CACHE: dict = {}


def _table(fmt: MiniFloat, device) -> torch.Tensor:
    key = (fmt.name, str(device))
    t = _TABLE_CACHE.get(key)
    if t is None:
        t = torch.tensor(code_table(fmt), dtype=torch.float32, device=device)
        _TABLE_CACHE[key] = t
    return t


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact 2**k as float32 for integer tensors k in [-126, 127] (built from the bits)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    if not torch.is_floating_point(x):
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    return x.to(torch.float32)


def encode(x: torch.Tensor, fmt: MiniFloat, saturate: bool = True) -> torch.Tensor:
    """float tensor -> uint8 codes of ``fmt`` (RNE; see the module docstring for specials)."""
    x = _as_f32(x)
    sign = torch.signbit(x)
    a = x.abs()
    nan = torch.isnan(x)
    a = torch.where(nan, torch.zeros_like(a), a)
    big = torch.isinf(a) | (a > 2.0 ** 120)  # beyond every format here; keep frexp/pow2 in range
    a_fin = torch.where(big, torch.zeros_like(a), a)
    _, ex = torch.frexp(a_fin)  # a = mant * 2**ex, mant in [0.5, 1); ex = 0 for a = 0
    e = torch.clamp(ex.to(torch.int32) - 1, min=fmt.emin)  # binade exponent, subnormals share emin
    e = torch.where(a_fin == 0, torch.full_like(e, fmt.emin), e)  # frexp(0) has exponent 0
    q = e - fmt.mbits  # exponent of one unit in the last place
    # a * 2**-q is exact (power-of-two scaling); torch.round is ties-to-even
    m_int = torch.round(a_fin * pow2(-q)).to(torch.int32)
    mag = (e - fmt.emin) * (1 << fmt.mbits) + m_int
    over = big | (mag > fmt.max_code)
    if saturate or fmt.inf_code is None and fmt.nan_code is None:
        mag = torch.where(over, torch.full_like(mag, fmt.max_code), mag)
    else:
        ovf = fmt.inf_code if fmt.inf_code is not None else fmt.nan_code
        mag = torch.where(over, torch.full_like(mag, ovf), mag)
    code = mag | torch.where(sign, fmt.sign_bit, 0).to(torch.int32)
    if fmt.nan_code is not None:
        code = torch.where(nan, torch.full_like(code, fmt.nan_code), code)
    else:  # E2M1: no NaN; documented choice: +max
        code = torch.where(nan, torch.full_like(code, fmt.max_code), code)
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """uint8 codes -> exact float32 values (table lookup; -0, NaN, Inf preserved)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    mask = (1 << fmt.bits) - 1
    return _table(fmt, codes.device)[(codes & mask).long()]


def round_to(x: torch.Tensor, fmt: MiniFloat, saturate: bool = True) -> torch.Tensor:
    """Nearest representable float32 value (fake quantization)."""
    return decode(encode(x, fmt, saturate), fmt)


# ---------------------------------------------------------------- E8M0 -----

E8M0_NAN = 0xFF
E8M0_BIAS = 127


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 code c -> 2**(c - 127) as float32; 0xFF -> NaN; code 0 -> 2**-127 (fp32 subnormal)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    c = codes.to(torch.int32)
    # code 0 is 2**-127, an fp32 subnormal outside pow2's range: build it as 2**-126 / 2
    v = pow2(torch.clamp(c - 127, min=-126))
    v = torch.where(c == 0, v * 0.5, v)
    return torch.where(c == E8M0_NAN, torch.full_like(v, float("nan")), v)


def encode_e8m0(x: torch.Tensor, rounding: str = "up") -> torch.Tensor:
    """Positive float -> E8M0 code.

    ``rounding``: ``"up"`` (smallest power of two >= x; what the quantizers use so a
    block never saturates), ``"down"`` (largest power of two <= x, the OCP MX
    spec's floor rule), ``"nearest"`` (nearest power of two in value; a tie,
    x = 1.5 * 2**k, goes to the even code).
    Clamps to [2**-127, 2**127]; 0 -> code 0; NaN, negative, -0 -> 0xFF; +Inf -> 254.
    """
    x = _as_f32(x)
    bad = torch.isnan(x) | torch.signbit(x)  # negative numbers (and -0) have no E8M0 code
    a = torch.where(bad | torch.isinf(x), torch.ones_like(x), x)
    zero = a == 0
    a = torch.where(zero, torch.ones_like(a), a)
    mant, ex = torch.frexp(a)  # a = mant * 2**ex, mant in [0.5, 1)
    k = ex.to(torch.int32) - 1  # floor(log2 a)
    exact = mant == 0.5
    if rounding == "down":
        e = k
    elif rounding == "up":
        e = torch.where(exact, k, k + 1)
    elif rounding == "nearest":
        up = (mant > 0.75) | ((mant == 0.75) & (((k + 127) & 1) == 1))
        e = torch.where(up, k + 1, k)
    else:
        raise ValueError(f"unknown E8M0 rounding {rounding!r}: use 'up', 'down' or 'nearest'")
    c = torch.clamp(e + 127, 0, 254)
    c = torch.where(zero, torch.zeros_like(c), c)
    c = torch.where(torch.isinf(x) & ~bad, torch.full_like(c, 254), c)
    c = torch.where(bad, torch.full_like(c, E8M0_NAN), c)
    return c.to(torch.uint8)


# ------------------------------------------------------------- packing -----

def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte along the last dim: element 2i in the low
    nibble, 2i+1 in the high nibble (torch.float4_e2m1fn_x2 / CUTLASS order)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"last dimension must be even to pack FP4 pairs, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: uint8 (..., n) -> codes (..., 2n)."""
    if packed.dtype != torch.uint8:
        packed = packed.view(torch.uint8)
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def as_torch_fp8(codes: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    """Reinterpret uint8 codes as torch's float8 dtype (no copy)."""
    dt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt.name]
    return codes.view(dt)
