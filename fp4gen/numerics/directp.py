"""P production: Direct-P (MXFP4 fast / accurate, Hopper FP8), SageAttention3's
two-level P, the exp paths, and the sampling guard.

Inputs are always a tile of scores already in log2 units,
``t = s * softmax_scale * log2(e)`` (float32, masked entries = -inf), and a row
reference ``m`` (float32, one per row, log2 units). Every function returns

- ``pv``: the float32 values the PV product consumes (payload x scale, exactly
  what a tensor core would multiply, including block scales), and
- ``l_inc``: this tile's contribution to the row normaliser l (float32).

The exact definitions, with equations, are in docs/numerics.md ("P production").
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from .backward_rules import P_FP8_SCALE_LOG2
from .formats import E2M1, E4M3, decode, encode, pow2
from .quant import quantize_mxfp4, quantize_nvfp4

LOG2E = math.log2(math.e)
LOG2_6 = torch.tensor(math.log2(6.0), dtype=torch.float32).item()  # float32-rounded log2(6)
P_FP8_SCALE = 2.0 ** P_FP8_SCALE_LOG2  # Hopper contract: P_fp8 = e4m3(p * 2**8)
E8M0_EMIN, E8M0_EMAX = -127, 127
FAST_A, FAST_B = 1.50, 1.20
# MXFP4 Direct-P's P approximates GAIN * 2**(t - m). The gain is not exact (the block
# maximum saturates, the fast classifier compresses values); these are the mid-range
# values measured on N(0, sigma^2) logits, sigma in [0.5, 8] nats (accurate 4.3..5.7,
# fast 2.6..3.4): the LSE subtracts log2(GAIN), leaving at most ~0.15 nats of bias there.
DIRECT_P_GAIN = {"fast": 2.9, "accurate": 5.0}



def _neg_inf_like(x):
    return torch.full_like(x, float("-inf"))


# ------------------------------------------------------------ exp paths ----

def p_exp(t: torch.Tensor, m: torch.Tensor):
    """p = exp2(t - m) in float32 (masked -> 0). Returns (p, x) with x = t - m <= 0."""
    x = t - m[..., None]
    return torch.exp2(x), x


def p_exp_hp(t, m, dtype):
    """exp path, P in a 16/32-bit float: PV consumes p rounded to ``dtype``; l sums unrounded p."""
    p, _ = p_exp(t, m)
    return p.to(dtype).to(torch.float32), p.sum(-1)


def p_exp_fp8(t, m, fmt=E4M3):
    """Hopper contract, P via exp: P_fp8 = fp8_rne(p * 256); PV consumes decode(P_fp8) / 256;
    l sums the unrounded float32 p (as FA3 does)."""
    p, _ = p_exp(t, m)
    codes = encode(p * P_FP8_SCALE, fmt)
    return decode(codes, fmt) / P_FP8_SCALE, p.sum(-1)


def p_exp_fp4(t, m, kind: str, block: int):
    """exp path into NVFP4 / MXFP4 P (blocks along keys): PV consumes the dequantized
    block-quantized p; l sums the unrounded p."""
    p, _ = p_exp(t, m)
    if kind == "mxfp4":
        q = quantize_mxfp4(p, dim=-1, block=block)
    else:
        q = quantize_nvfp4(p, dim=-1, block=block)
    return q.dequantize(), p.sum(-1)


def p_two_level(t, m, block: int = 16):
    """SageAttention3's two-level P: per row (of this key tile) r = rowmax(p) / (448*6)
    (1 if the row is all zero), P2 = p / r in [0, 448*6], NVFP4-quantize P2 (1x``block``
    along keys, E4M3 scales = amax/6 <= 448), PV consumes deq(P2) * r; l sums unrounded p."""
    p, _ = p_exp(t, m)
    rmax = p.amax(-1, keepdim=True)
    r = torch.where(rmax > 0, rmax / (448.0 * 6.0), torch.ones_like(rmax))
    q = quantize_nvfp4(p / r, dim=-1, block=block)
    return q.dequantize() * r, p.sum(-1)


# ----------------------------------------------------- Hopper FP8 Direct-P ----

def fp8_direct_p_codes(x: torch.Tensor) -> torch.Tensor:
    """Hopper FP8 Direct-P: x = t - m (<= 0, log2 units) -> E4M3 bit patterns.

    code = rne(clamp(8*x + 120, 0, 120)); the code read as E4M3 bits is a piecewise-
    linear 2**x * 256 (exact at integer x); codes < 8 are E4M3 subnormals. NaN x -> NaN
    code 0x7F (a NaN score poisons its row through l and O)."""
    tt = torch.clamp(8.0 * x + 120.0, 0.0, 120.0)  # clamp maps -inf (masked) to 0
    code = torch.round(tt).to(torch.uint8)
    return torch.where(torch.isnan(x), torch.full_like(code, 0x7F), code)


def p_fp8_direct(t, m):
    """PV consumes decode_e4m3(code) / 256; l sums exactly those values."""
    x = t - m[..., None]
    pv = decode(fp8_direct_p_codes(x), E4M3) / P_FP8_SCALE
    return pv, pv.sum(-1)


# ---------------------------------------------------- MXFP4 Direct-P (sm100) --

def fast_codes(x: torch.Tensor, a: float = FAST_A, b: float = FAST_B) -> torch.Tensor:
    """Fast policy: E2M1 magnitude code from x with the affine classifier.

    code = min(7, rne(max(0, a*x + b))) read as an index into the E2M1 magnitude
    table (0, 0.5, 1, 1.5, 2, 3, 4, 6). -inf -> 0. Float32 arithmetic: y = fma-free
    a*x then + b (the kernel may use an FMA; the difference only matters exactly at
    rounding ties)."""
    y = torch.clamp(x * a + b, 0.0, 7.0)  # clamp maps -inf to 0
    y = torch.nan_to_num(y, nan=0.0)  # a NaN block is poisoned through its scale; keep codes defined
    return torch.round(y).to(torch.uint8)


# A what-if for issue 18's "one FFMA per score" lever, not what any kernel does: the fast
# classifier A*((t - m) - e_B + log2 6) + B regrouped as A*t + c_B with the per-(row, block)
# constant c_B = B + A*log2 6 - A*(m + e_B), so each score costs one FFMA instead of today's
# subtractions and FMA. The value is the same; the roundings are not: today x rounds after
# each add (an ulp of |u| each), the one-FFMA form rounds c_B (an ulp of A*|m + e_B|) and
# the FMA's result once. Measured in docs/numerics.md ("One FFMA per score").
CLASSIFIER_FORMS = ("sat_ffma", "two_op", "one_ffma")
_CLASSIFIER_FORM = ["sat_ffma"]  # what direct_p_mxfp4(form=None) uses; set by classifier_form


@contextlib.contextmanager
def classifier_form(form: str):
    """Within the block, ``direct_p_mxfp4`` (and so the reference forward) codes fast Direct-P
    with ``form`` (one of CLASSIFIER_FORMS): how the forms are compared end to end."""
    if form not in CLASSIFIER_FORMS:
        raise ValueError(f"unknown classifier form {form!r}: use one of {CLASSIFIER_FORMS}")
    old = _CLASSIFIER_FORM[0]
    _CLASSIFIER_FORM[0] = form
    try:
        yield
    finally:
        _CLASSIFIER_FORM[0] = old


def fma_f32(x: torch.Tensor, y, z) -> torch.Tensor:
    """fl32(x*y + z) rounded once (an FFMA), for float32 operands. The product of two floats
    is exact in float64; the float64 sum is taken to round-to-odd (TwoSum's exact error moves
    an inexact even result one ulp toward the true sum), and rounding that to float32 is then
    correct (Boldo & Melquiond 2008: odd rounding at p >= q + 2 bits, here 53 >= 26). A plain
    float64 sum would round twice and miss ties (tests/numerics/test_directp_classifier_forms.py)."""
    xd, yd, zd = (torch.as_tensor(v, dtype=torch.float32).to(torch.float64) for v in (x, y, z))
    p = xd * yd
    s = p + zd
    bb = s - p
    err = (p - (s - bb)) + (zd - bb)  # p + z == s + err exactly (Knuth's TwoSum)
    even = (s.view(torch.int64) & 1) == 0
    fix = (err != 0) & even & torch.isfinite(s) & torch.isfinite(err)
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    return torch.where(fix, torch.nextafter(s, toward), s).to(torch.float32)


def one_ffma_offset(m: torch.Tensor, eb: torch.Tensor, a: float = FAST_A, b: float = FAST_B) -> torch.Tensor:
    """c_B = fl32(fma(-A, fl32(m + e_B), K)) with K = fl32(B + A*log2 6): the classifier's add
    with the row reference, the block exponent, log2 6 and B folded in (per row and block)."""
    af = torch.tensor(a, dtype=torch.float32).item()
    k = torch.tensor(torch.tensor(b, dtype=torch.float32).double().item() + af * LOG2_6, dtype=torch.float32)
    me = (m.to(torch.float32)[..., None] + eb).to(torch.float32)
    return fma_f32(torch.full_like(me, -af), me, k)


def one_ffma_codes(tb: torch.Tensor, m: torch.Tensor, eb: torch.Tensor, a: float = FAST_A,
                   b: float = FAST_B) -> torch.Tensor:
    """Fast codes from one FFMA per score: code = rne(clamp(fl32(A*t + c_B), 0, 7)).
    tb: (..., nblocks, block) log2-unit scores (masked -inf), m: (...) row reference,
    eb: (..., nblocks) block exponents. -inf -> 0; NaN -> 0 (its block scale is NaN)."""
    c = one_ffma_offset(m, eb, a, b)
    af = torch.tensor(a, dtype=torch.float32).item()
    y = fma_f32(torch.full_like(tb, af), tb, c[..., None])
    y = torch.nan_to_num(torch.clamp(y, 0.0, 7.0), nan=0.0)
    return torch.round(y).to(torch.uint8)

# The sm100a kernels' fast classifier ("sat_ffma", the default form): the affine value divided
# by 7, so that the FFMA's .sat (clamp to [0, 1], NaN -> 0) is the clamp to codes [0, 7]:
#   y = sat(fl32(A7 * t + c_B)),  c_B = fl32(fma(-A7, fl32(m + e_B), K7)),
#   A7 = fl32(A / 7),  K7 = fl32((B + A log2 6) / 7),  code = rne(7 y) (7 y exact).
# One scalar FFMA.SAT per score and one packed FFMA per two (7 y + 1.5 * 2^23 leaves the code in
# the low bits). The kernel folds the softmax scale into the multiplier, A7s = fl32(scale * A7),
# and applies it to the raw score s: fl32(A7s * s) and fl32(A7 * fl32(scale * s)) differ by an
# ulp or two, so with scale != 1 a code can differ from this model only where 7 y lies within
# a few ulps of a .5 boundary (docs/numerics.md section 13).


def sat_constants(a: float = FAST_A, b: float = FAST_B) -> tuple:
    """(A7, K7) as float32 values (Python floats): the classifier's multiplier and offset / 7.
    The kernel takes its constants from here, so both sides use the same numbers."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
    a32, b32 = f32(a), f32(b)
    return f32(a32 / 7.0), f32((b32 + a32 * LOG2_6) / 7.0)


def sat_offset(m: torch.Tensor, eb: torch.Tensor, a: float = FAST_A, b: float = FAST_B) -> torch.Tensor:
    """c_B = fl32(fma(-A7, fl32(m + e_B), K7)) per row and block (m: (...), eb: (..., nblocks))."""
    a7, k7 = sat_constants(a, b)
    me = (m.to(torch.float32)[..., None] + eb).to(torch.float32)
    return fma_f32(torch.full_like(me, -a7), me, torch.full_like(me, k7))


def sat_codes(tb: torch.Tensor, m: torch.Tensor, eb: torch.Tensor, a: float = FAST_A, b: float = FAST_B,
              scale: float = 1.0) -> torch.Tensor:
    """The saturating classifier's codes: rne(7 sat(fl32(A7s * s + c_B))), A7s = fl32(scale * A7).
    tb: (..., nblocks, block) scores, in log2 units when ``scale`` is 1 (the reference), raw
    QK^T with the kernel's ``scale`` (= softmax scale * log2 e, float32) otherwise; m: (...)
    row reference; eb: (..., nblocks) block exponents. -inf -> 0; NaN -> 0 (.sat)."""
    a7, _ = sat_constants(a, b)
    a7s = (torch.tensor(scale, dtype=torch.float32) * torch.tensor(a7, dtype=torch.float32)).item()
    c = sat_offset(m, eb, a, b)
    y = fma_f32(torch.full_like(tb, a7s), tb, c[..., None])
    y = torch.nan_to_num(torch.clamp(y, 0.0, 1.0), nan=0.0)
    return torch.round(y.double() * 7.0).to(torch.uint8)  # 7 y is exact in float64


def accurate_codes(x: torch.Tensor) -> torch.Tensor:
    """Accurate policy: code = e2m1_rne(exp2(x)) saturating at 6 (the hardware EX2 on the value path)."""
    return encode(torch.exp2(x), E2M1)


def direct_p_mxfp4(t: torch.Tensor, m: torch.Tensor, policy: str = "fast",
                   a: float = FAST_A, b: float = FAST_B, block: int = 32, form: Optional[str] = None):
    """Direct-P into MXFP4 P. t: (..., N) log2-unit scores, m: (...) row reference.

    Per block B of ``block`` keys: u = t - m; e_B = clamp(floor(max_B u), -127, 127)
    (an E8M0 exponent; a fully masked block gets -127); x = u - e_B + log2(6) < log2(12);
    code = classifier(x); PV consumes E2M1(code) * 2**e_B (which approximates 6 * 2**u,
    the block maximum saturating to 6 * 2**e_B), and l sums exactly those values.
    ``form`` (fast policy only): the classifier's arithmetic: "sat_ffma" (the default and the
    sm100a kernels': ``sat_codes``), "two_op" (``fast_codes`` of x above: the kernels before
    2026-12-07) or "one_ffma" (``one_ffma_codes``, a what-if no kernel implements); None
    takes the form set by ``classifier_form``.
    Returns (pv, l_inc, codes, e_B).
    """
    u = t - m[..., None]
    n = u.shape[-1]
    pad = (-n) % block
    if pad:
        u = torch.nn.functional.pad(u, (0, pad), value=float("-inf"))
    ub = u.reshape(*u.shape[:-1], -1, block)
    umax = ub.amax(-1)  # NaN propagates
    nan_blk = torch.isnan(umax)
    umax = torch.where(torch.isneginf(umax) | nan_blk, torch.full_like(umax, E8M0_EMIN), umax)
    # e_B = floor(max_B u): the exponent field of the block's largest 2**u, so the block
    # maximum lands at x in [log2 6, log2 12) and saturates to code 7 (see docs/numerics.md)
    eb = torch.clamp(torch.floor(torch.clamp(umax, -1e4, 1e4)), E8M0_EMIN, E8M0_EMAX)
    form = _CLASSIFIER_FORM[0] if form is None else form
    if form not in CLASSIFIER_FORMS:
        raise ValueError(f"unknown classifier form {form!r}: use one of {CLASSIFIER_FORMS}")
    x = ub - eb[..., None] + LOG2_6
    if policy == "fast" and form in ("one_ffma", "sat_ffma"):
        tb = t if not pad else torch.nn.functional.pad(t, (0, pad), value=float("-inf"))
        codes = (one_ffma_codes if form == "one_ffma" else sat_codes)(tb.reshape(ub.shape), m, eb, a, b)
    elif policy == "fast":
        codes = fast_codes(x, a, b)
    elif policy == "accurate":
        codes = accurate_codes(x)
    else:
        raise ValueError(f"unknown Direct-P policy {policy!r}: use 'fast' or 'accurate'")
    vals = decode(codes, E2M1)
    # E8M0 NaN scale for a block with a NaN score: the whole block (and its row) turns NaN
    scale = torch.where(nan_blk, torch.full_like(eb, float("nan")), _pow2_e8m0(eb))
    pvb = vals * scale[..., None]
    pv = pvb.reshape(*u.shape[:-1], -1)[..., :n]
    return pv, pv.sum(-1), codes.reshape(*u.shape[:-1], -1)[..., :n], eb


def _pow2_e8m0(e: torch.Tensor) -> torch.Tensor:
    """2**e for integer-valued float e in [-127, 127] (2**-127 is an fp32 subnormal)."""
    ei = e.to(torch.int32)
    v = pow2(torch.clamp(ei, min=-126))
    return torch.where(ei == -127, v * 0.5, v)


# ------------------------------------------------------- headroom rebase ----

# A fixed row reference m (0, or the guard's sampled maximum) is only safe while every
# score stays within ~126 binades above it: beyond, e_B clamps at 127, the block maximum
# decodes to 6 * 2**127 > FLT_MAX, l and the PV accumulator overflow to inf, and O = inf/inf
# or inf - inf = NaN. The guard's L samples do not bound the keys they miss: with q, k 8x
# (scores of std ~140 log2 units) the sampled maximum is up to ~460 binades below the row
# maximum (found 2026-12-02, issue 16). So the guard (reference._Prepared.rebase) comes with
# a rebase: before a tile is coded, a row whose tile maximum exceeds m by more than REBASE_E
# moves its reference up by the integer d = floor(max u) and scales what it has accumulated
# (O, l) by the exact power of two 2**-d (0 when d >= 127: those contributions are below
# 2**-126 of the new maximum's). After it every value is at most 6 * 2**REBASE_E, so l and O
# keep 2**61 of headroom for the sum over keys and |V|. REBASE_E is far above moderate
# logits (where the guard alone suffices), so there nothing changes, bit for bit.
REBASE_E = 64


def rebase(t: torch.Tensor, m: torch.Tensor, e_hi: int = REBASE_E):
    """Headroom rebase before a key tile (see above). t: (..., N) log2-unit scores of the tile,
    m: (...) the current row reference. Returns (m_new, fac): the reference to code the tile
    with and the factor (an exact power of two, 1 where nothing moved) for O and l. The tile
    maximum is max(t) - m (fl32 subtraction is monotone, so it equals max(t - m)); a NaN or
    fully masked row does not move."""
    umax = t.amax(-1) - m
    need = (umax > e_hi) & torch.isfinite(umax)
    d = torch.where(need, torch.floor(umax), torch.zeros_like(umax))
    fac = torch.where(d > 126, torch.zeros_like(d), _pow2_e8m0(-torch.clamp(d, max=126)))
    return m + d, fac


# --------------------------------------------------------------- guard ----

def guard_sample_positions(sk: int, L: int, device=None) -> torch.Tensor:
    """The L sampled key positions: floor((j * sk) / L) for j = 0..L-1 (deduplicated;
    always includes key 0, where attention sinks live)."""
    if sk == 0 or L <= 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    pos = (torch.arange(L, device=device, dtype=torch.long) * sk) // L
    return torch.unique(pos)


def guard_reference(t_sample: torch.Tensor, M: float, row_block: int = 128) -> torch.Tensor:
    """Row references from sampled scores (log2 units), the guard's decision.

    t_sample: (..., R, L) scores of each row against the sampled keys (masked = -inf).
    m_hat_i = max over samples (0 if none visible). A row block of ``row_block`` rows
    is *guarded* when any |m_hat_i| > M; guarded rows use m_i = m_hat_i, the others
    m_i = 0 (the unguarded Direct-P reference). Returns m (..., R) float32.
    """
    mh = t_sample.amax(-1) if t_sample.shape[-1] else torch.full(t_sample.shape[:-1], float("-inf"),
                                                                  device=t_sample.device)
    mh = torch.where(torch.isneginf(mh), torch.zeros_like(mh), mh)
    R = mh.shape[-1]
    pad = (-R) % row_block
    big = (mh.abs() > M) | torch.isnan(mh)
    bigp = torch.nn.functional.pad(big, (0, pad)) if pad else big
    blk = bigp.reshape(*bigp.shape[:-1], -1, row_block).any(-1, keepdim=True)
    guarded = blk.expand(*blk.shape[:-1], row_block).reshape(*bigp.shape)[..., :R]
    return torch.where(guarded, mh, torch.zeros_like(mh))
