"""The reference backend: exact torch emulation of a KernelSpec's numerics.

    o, lse = forward(q, k, v, spec)
    dq, dk, dv = backward(q, k, v, o, lse, do, spec)

q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D), H % Hkv == 0 (GQA); any float dtype, any
device. o: (B, Sq, H, D) float32; lse: (B, H, Sq) float32, natural log, in the
units of s * softmax_scale (after the softcap), flash_attn's convention.

Masks, softcap and sinks follow ``masking.py`` (FlashAttention's window_size, bottom-right
aligned; ``c * tanh(s / c)`` on the scaled score; a learned sink logit per query head,
``sinks`` (H,), in the units of the scaled scores). The sink adds ``exp(sink[h])`` to each
row's softmax denominator after the last key tile (the row max taken over it too), has no
value row, and is part of the LSE, as flash_attn's learnable sink is; ``sinks_grad`` is its
gradient. A row that sees no key: o = 0 and lse = -inf (with sinks: lse = the sink), no NaN.
Varlen (``forward_varlen`` / ``backward_varlen``): the dense path per sequence of the packed
(total, H, D) tensors, so per-tensor FP8 scales and FP8 token blocks are per sequence; its
lse is (H, total_q), as flash_attn's varlen returns it.

The forward is flash-style: keys in tiles of ``spec.schedule.tile_n`` (128 by
default, the Hopper contract's tile), query rows in chunks, never an Sq x Sk
matrix. Per tile it mirrors the kernels' arithmetic order: scores in float32,
log2-unit scores ``t = dot * (scale_q * scale_k * c)`` with
``c = fp32(softmax_scale * log2(e))``, running row max and rescale by
``exp2(m_old - m_new)``, P produced by the spec's method (directp.py), and
``O += P @ V``. Definitions and the choices made: docs/numerics.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fp4gen.ir.spec import (Format, KernelSpec, Layout, OperandFormat, PKind, ScaleGranularity,
                            GuardKind, Sinks)
from . import backward_rules as _bwd_rules  # the sm90a backward's tile and FP8 dS rule

from . import directp as dp
from . import masking
from .formats import E4M3, E5M2, decode, round_to
from .quant import quantize_fp8, quantize_mxfp4, quantize_nvfp4

LN2 = math.log(2.0)
_HP_DTYPES = {Format.FP32: torch.float32, Format.BF16: torch.bfloat16, Format.FP16: torch.float16}
_FP8 = {Format.FP8E4M3: E4M3, Format.FP8E5M2: E5M2}
_GRAN = {ScaleGranularity.TENSOR: "tensor", ScaleGranularity.BLOCK: "block",
         ScaleGranularity.TOKEN: "token", ScaleGranularity.NONE: "tensor"}


class ReferenceError(ValueError):
    """A spec or input the reference backend cannot run (message says why)."""


# ------------------------------------------------------------ operands -----

@dataclass
class Operand:
    """A quantized (B, S, Hx, D) operand as the kernel sees it.

    ``vals`` are what the MMA multiplies (payload values for FP8 with fp32 scales,
    exact dequantized values for FP4 and high-precision formats); ``row_scale``
    (B, S, Hx) multiplies the dot products of FP8 Q/K (None otherwise);
    ``post_scale`` (B, Hx) multiplies O at the end for a per-tensor FP8 V.
    """

    vals: torch.Tensor
    row_scale: Optional[torch.Tensor] = None
    post_scale: Optional[torch.Tensor] = None


def _fp4_block(fmt: OperandFormat) -> int:
    if fmt.block:
        return fmt.block
    return 16 if fmt.format is Format.NVFP4 else 32


def quantize_operand(x: torch.Tensor, fmt: OperandFormat, reduce_dim: int,
                     factor_scale: bool) -> Operand:
    """Quantize one attention operand. ``reduce_dim``: the dim the consuming MMA reduces
    over (3 = D for Q/K, 1 = S for V), along which FP4 blocks run. ``factor_scale``:
    keep FP8 scales outside the payload (Q/K row scales; V per-tensor post scale)."""
    f = fmt.format
    if f in _HP_DTYPES:
        return Operand(x.to(_HP_DTYPES[f]).to(torch.float32))
    if f in _FP8:
        gran = _GRAN[fmt.granularity]
        qt = quantize_fp8(x, gran, fmt.block or 128, _FP8[f])
        if not factor_scale:
            return Operand(qt.dequantize())
        vals = decode(qt.codes, qt.fmt)
        if reduce_dim == 3:  # Q/K: per-row scale multiplies the dot product
            B, S, Hx, _ = x.shape
            return Operand(vals, row_scale=qt.expand_scale()[..., 0].expand(B, S, Hx).contiguous())
        if gran == "tensor":  # V: a per-(b, h) scale factors out of the key sum
            return Operand(vals, post_scale=qt.scale)
        return Operand(qt.dequantize())
    if f is Format.NVFP4:
        return Operand(quantize_nvfp4(x, dim=reduce_dim, block=_fp4_block(fmt)).dequantize())
    if f is Format.MXFP4:
        return Operand(quantize_mxfp4(x, dim=reduce_dim, block=_fp4_block(fmt)).dequantize())
    raise ReferenceError(f"format {f.value} cannot be an attention operand")


# -------------------------------------------------------- P production -----

def _p_method(spec: KernelSpec):
    """Pick the P production for the spec. Returns (fn(t, m) -> (pv, l_inc), running_max, lse_shift)."""
    pf, pp = spec.p.format, spec.p_production
    kind = pp.kind
    if kind is PKind.EXP:
        if pf in _HP_DTYPES:
            dt = _HP_DTYPES[pf]
            return (lambda t, m: dp.p_exp_hp(t, m, dt)), True, 0.0
        if pf in _FP8:
            fmt = _FP8[pf]
            return (lambda t, m: dp.p_exp_fp8(t, m, fmt)), True, 0.0
        if pf.is_fp4:
            kindname, blk = pf.value, _fp4_block(spec.p)
            return (lambda t, m: dp.p_exp_fp4(t, m, kindname, blk)), True, 0.0
    elif kind is PKind.DIRECT_P:
        if pf is Format.FP8E4M3:
            return dp.p_fp8_direct, True, 0.0
        if pf is Format.MXFP4:
            pol, a, b, blk = pp.policy.value, pp.a, pp.b, _fp4_block(spec.p)

            def fn(t, m):
                pv, l_inc, _, _ = dp.direct_p_mxfp4(t, m, pol, a, b, blk)
                return pv, l_inc
            # PV consumes ~GAIN * 2**(t - m): the LSE drops log2(GAIN) (see directp.DIRECT_P_GAIN)
            return fn, False, math.log2(dp.DIRECT_P_GAIN[pol])
        raise ReferenceError(f"direct_p produces P as mxfp4 (sm100a) or fp8e4m3 (sm90a), not {pf.value}")
    elif kind is PKind.TWO_LEVEL:
        if pf is Format.NVFP4:
            blk = _fp4_block(spec.p)
            return (lambda t, m: dp.p_two_level(t, m, blk)), True, 0.0
        raise ReferenceError(f"two_level P quantization needs P : nvfp4, not {pf.value}")
    raise ReferenceError(f"P production {kind.value} with P : {pf.value} is not supported")


def _round_out(o: torch.Tensor, fmt: OperandFormat) -> torch.Tensor:
    f = fmt.format
    if f in _HP_DTYPES:
        return o.to(_HP_DTYPES[f]).to(torch.float32)
    if f in _FP8:  # O in FP8: per-token scale (one per row and head)
        return quantize_fp8(o, "token", 128, _FP8[f]).dequantize()
    raise ReferenceError(f"O : {f.value} is not supported by the reference (use bf16/fp16/fp32/fp8)")


def _check_inputs(q, k, v, spec):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ReferenceError(f"{name} must be a 4-D (B, S, H, D) tensor")
        if not torch.is_floating_point(x):
            raise ReferenceError(f"{name} must be a floating-point tensor, got {x.dtype}")
    B, Sq, H, D = q.shape
    if k.shape != v.shape:
        raise ReferenceError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ReferenceError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in B or D")
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ReferenceError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if spec.head_dim != D:
        raise ReferenceError(f"spec {spec.name!r} has head_dim {spec.head_dim}, inputs have D={D}")
    if len({q.device, k.device, v.device}) != 1:
        raise ReferenceError("q, k, v must be on one device")


def _expand_heads(x: Optional[torch.Tensor], H: int, dim: int):
    if x is None:
        return None
    g = H // x.shape[dim]
    return x if g == 1 else x.repeat_interleave(g, dim=dim)


def _check_sinks(sinks, spec: KernelSpec, H: int, device) -> Optional[torch.Tensor]:
    """The (H,) float32 sink logits a ``sinks learned`` spec needs (None for other specs)."""
    if spec.sinks is Sinks.NONE:
        if sinks is not None:
            raise ReferenceError(f"spec {spec.name!r} has no sinks, but sinks were given (write 'sinks learned')")
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.shape != (H,) or not torch.is_floating_point(sinks):
        got = f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ReferenceError(f"spec {spec.name!r} has learned sinks: pass sinks, a float tensor (H,) = ({H},); "
                             f"got {got}")
    if sinks.device != device:
        raise ReferenceError(f"sinks are on {sinks.device}, q on {device}")
    return sinks.to(torch.float32)


def _row_chunk(B: int, H: int, tile_n: int, D: int) -> int:
    # keep one (B, H, rows, tile_n) float32 score tile around ~32 MiB
    budget = (32 << 20) // 4
    r = max(128, budget // max(1, B * H * max(tile_n, D)))
    return min(2048, (r // 128) * 128)


class _Prepared:
    """Forward state shared by forward() and backward(): quantized operands in (B, H, S, D)."""

    def __init__(self, q, k, v, spec: KernelSpec, reuse_qk=(True, True)):
        _check_inputs(q, k, v, spec)
        self.B, self.Sq, self.H, self.D = q.shape
        self.Sk, self.Hkv = k.shape[1], k.shape[2]
        H = self.H
        hp = OperandFormat(Format.BF16)
        Q = quantize_operand(q, spec.q if reuse_qk[0] else hp, 3, True)
        K = quantize_operand(k, spec.k if reuse_qk[1] else hp, 3, True)
        V = quantize_operand(v, spec.v, 1, True)
        self.q = Q.vals.permute(0, 2, 1, 3)  # (B, H, Sq, D)
        self.k = _expand_heads(K.vals, H, 2).permute(0, 2, 1, 3)
        self.v = _expand_heads(V.vals, H, 2).permute(0, 2, 1, 3)
        self.sq = None if Q.row_scale is None else Q.row_scale.permute(0, 2, 1)  # (B, H, Sq)
        self.sk = None if K.row_scale is None else _expand_heads(K.row_scale, H, 2).permute(0, 2, 1)
        self.vpost = None if V.post_scale is None else _expand_heads(V.post_scale, H, 1)  # (B, H)
        # c = fp32(softmax_scale * log2(e)), folded with the FP8 scales into one multiplier
        self.c = torch.tensor(spec.scale * dp.LOG2E, dtype=torch.float32).item()
        self.window = spec.window_size
        self.masked = masking.is_masked(self.window)
        # softcap in log2 units: t = s log2(e), so c tanh(s / c) log2(e) = c2 tanh(t / c2)
        self.cap2 = spec.softcap * dp.LOG2E if spec.softcap else 0.0
        self.tile_n = spec.schedule.tile_n
        self.device = q.device
        # the sampling guard comes with the headroom rebase of Direct-P's fixed reference
        # (directp.rebase); without a guard the reference stays 0, the paper's plain form
        self.rebase = spec.guard.kind is GuardKind.SAMPLE

    def deq_q(self, r0, r1) -> torch.Tensor:
        """Dequantized Q rows (payload x its FP8 row scale), for dK = dS^T Q."""
        x = self.q[:, :, r0:r1]
        return x if self.sq is None else x * self.sq[:, :, r0:r1, None]

    def deq_k(self, c0, c1) -> torch.Tensor:
        x = self.k[:, :, c0:c1]
        return x if self.sk is None else x * self.sk[:, :, c0:c1, None]

    def scores(self, r0, r1, c0, c1) -> torch.Tensor:
        """log2-unit scores t (B, H, r, c) for rows r0:r1, keys c0:c1, masked = -inf."""
        dot = self.q[:, :, r0:r1] @ self.k[:, :, c0:c1].transpose(-1, -2)
        if self.sq is not None or self.sk is not None:
            sq = self.sq[:, :, r0:r1, None] if self.sq is not None else 1.0
            sk = self.sk[:, :, None, c0:c1] if self.sk is not None else 1.0
            t = dot * ((sq * sk) * self.c)
        else:
            t = dot * self.c
        if self.cap2:
            t = self.cap2 * torch.tanh(t / self.cap2)
        if self.masked:
            rows = torch.arange(r0, r1, device=self.device)
            cols = torch.arange(c0, c1, device=self.device)
            ok = masking.allowed(rows, cols, self.Sq, self.Sk, self.window)
            t = t.masked_fill(~ok, float("-inf"))
        return t

    def key_tiles(self, r0, r1) -> range:
        """Starts of the key tiles rows r0:r1 see (tiles aligned to tile_n, as a kernel's);
        the fully masked ones are skipped."""
        first, last = masking.key_span(r0, r1, self.Sq, self.Sk, self.window)
        if first >= last:
            return range(0)
        return range(first // self.tile_n * self.tile_n, last, self.tile_n)


def _guard_refs(st: _Prepared, spec: KernelSpec) -> torch.Tensor:
    """Row references for Direct-P MXFP4: 0, or the sampling guard's (B, H, Sq)."""
    B, H, Sq = st.B, st.H, st.Sq
    if spec.guard.kind is not GuardKind.SAMPLE:
        return torch.zeros(B, H, Sq, device=st.device)
    pos = dp.guard_sample_positions(st.Sk, spec.guard.l, st.device)
    ks = st.k[:, :, pos]
    dot = st.q @ ks.transpose(-1, -2)
    if st.sq is not None or st.sk is not None:
        sq = st.sq[..., None] if st.sq is not None else 1.0
        sk = st.sk[:, :, None, pos] if st.sk is not None else 1.0
        t = dot * ((sq * sk) * st.c)
    else:
        t = dot * st.c
    if st.cap2:
        t = st.cap2 * torch.tanh(t / st.cap2)
    if st.masked:
        ok = masking.allowed(torch.arange(Sq, device=st.device), pos, Sq, st.Sk, st.window)
        t = t.masked_fill(~ok, float("-inf"))
    return dp.guard_reference(t, float(spec.guard.m), row_block=spec.schedule.tile_m)


def _dense_only(spec: KernelSpec, what: str) -> None:
    if spec.layout is not Layout.DENSE:
        raise ReferenceError(f"spec {spec.name!r} is layout varlen: call {what}_varlen with cu_seqlens")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: KernelSpec, *,
            sinks: Optional[torch.Tensor] = None):
    """Attention forward with the spec's numerics. Returns (o float32 (B,Sq,H,D), lse (B,H,Sq)).
    ``sinks`` (H,): the sink logits of a ``sinks learned`` spec."""
    _dense_only(spec, "forward")
    return _forward(q, k, v, spec, sinks)


def _tile_loop(st, r0: int, r1: int, tiles, p_fn, running_max: bool, fixed_m):
    """The online-softmax loop of query rows [r0, r1) over the key tiles ``tiles`` (their first
    keys), in the kernels' order -> (acc (B, H, rows, D), l (B, H, rows), m (B, H, rows)): the
    unnormalised output, the row sum in 2**lse_shift units and the row reference (log2 units;
    -inf where no tile raised it). One home for the forward and the split-KV decode."""
    B, H, D, Sk, dev = st.B, st.H, st.D, st.Sk, st.device
    acc = torch.zeros(B, H, r1 - r0, D, device=dev)
    l = torch.zeros(B, H, r1 - r0, device=dev)
    if running_max:
        m = torch.full((B, H, r1 - r0), float("-inf"), device=dev)
    else:
        m = fixed_m[:, :, r0:r1]
    for c0 in tiles:
        c1 = min(Sk, c0 + st.tile_n)
        t = st.scores(r0, r1, c0, c1)
        if running_max:
            m_new = torch.maximum(m, t.amax(-1))  # NaN propagates
            m_new_s = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
            m_old_s = torch.where(torch.isneginf(m), m_new_s, m)
            alpha = torch.exp2(m_old_s - m_new_s)
            pv, l_inc = p_fn(t, m_new_s)
            l = l * alpha + l_inc
            acc = acc * alpha[..., None] + pv @ st.v[:, :, c0:c1]
            m = m_new
        else:  # Direct-P MXFP4: the fixed reference; guarded, moved up where a tile would overflow
            if st.rebase:
                m, fac = dp.rebase(t, m)
                l = l * fac
                acc = acc * fac[..., None]
            pv, l_inc = p_fn(t, m)
            l = l + l_inc
            acc = acc + pv @ st.v[:, :, c0:c1]
    return acc, l, m


def _forward(q, k, v, spec: KernelSpec, sinks):
    st = _Prepared(q, k, v, spec)
    sink = _check_sinks(sinks, spec, st.H, st.device)
    p_fn, running_max, lse_shift = _p_method(spec)
    B, H, Sq, Sk, D = st.B, st.H, st.Sq, st.Sk, st.D
    dev = st.device
    o = torch.empty(B, H, Sq, D, device=dev)
    lse = torch.empty(B, H, Sq, device=dev)
    fixed_m = None if running_max else _guard_refs(st, spec)
    rc = _row_chunk(B, H, st.tile_n, D)
    for r0 in range(0, Sq, rc):
        r1 = min(Sq, r0 + rc)
        acc, l, m = _tile_loop(st, r0, r1, st.key_tiles(r0, r1), p_fn, running_max, fixed_m)
        m_s = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        if sink is not None:  # exp(sink) joins the denominator; the max is taken over it too
            sink_t = (sink * dp.LOG2E)[None, :, None].expand_as(m_s)
            m_fin = torch.maximum(m_s, sink_t)
            alpha = torch.exp2(m_s - m_fin)
            # in the units of l: 2**lse_shift (Direct-P's gain) per unit of probability
            l = l * alpha + torch.exp2(sink_t - m_fin + lse_shift)
            acc = acc * alpha[..., None]
            m_s = m_fin
        empty = l == 0  # fully masked row (or every P rounded to zero): O = 0, LSE = -inf
        o[:, :, r0:r1] = torch.where(empty[..., None], torch.zeros_like(acc),
                                     acc / torch.where(empty, torch.ones_like(l), l)[..., None])
        lse2 = m_s + torch.log2(torch.where(empty, torch.ones_like(l), l)) - lse_shift
        lse[:, :, r0:r1] = torch.where(empty, torch.full_like(lse2, float("-inf")), lse2 * LN2)
    if st.vpost is not None:
        o = o * st.vpost[:, :, None, None]
    o = o.permute(0, 2, 1, 3)
    return _round_out(o, spec.o).contiguous(), lse


# ------------------------------------------------------------ backward -----

def _fake_quant_rows(x: torch.Tensor, fmt: OperandFormat) -> torch.Tensor:
    """Round a (B, H, r, c) gradient tile to ``fmt``: FP8 with one fp32 scale per row of
    the tile (amax/fmax, 1 for an all-zero row); 16/32-bit floats by a plain cast."""
    f = fmt.format
    if f in _HP_DTYPES:
        return x.to(_HP_DTYPES[f]).to(torch.float32)
    if f in _FP8:
        fm = _FP8[f]
        amax = x.abs().amax(-1, keepdim=True)
        s = torch.where(amax == 0, torch.ones_like(amax), amax / fm.max_value)
        return round_to(x / s, fm) * s
    raise ReferenceError(f"gradient format {f.value} is not supported (use fp8e4m3/fp8e5m2/bf16/fp16/fp32)")


# ------------------------------------------------ FP8 dS, the sm90a recipe -----

def _bwd_tile():
    """(tile_m, tile_n) of the sm90a backward (64 query rows x 128 keys): the FP8 dS recipe's
    scale granularity."""
    return _bwd_rules.BWD_TILE_M, _bwd_rules.BWD_TILE_N


def _is_fp8_block128(op: OperandFormat) -> bool:
    return op.format is Format.FP8E4M3 and op.granularity is ScaleGranularity.BLOCK and op.block == 128


def fp8_ds_recipe(spec: KernelSpec) -> bool:
    """Whether ``backward`` rounds dS by the sm90a FP8 dS recipe (``fp8_ds_tile_scale``): a
    ``dS : fp8e4m3`` with the default per-tensor scale (or ``scale=none``, read as per tensor
    like dO), an FP8 dO, Q and K reused (``reuse q k``) as fp8e4m3(block=128), and V FP8 with
    one scale per (batch, head). Other FP8 dS keep one scale per row of each key tile
    (``_fake_quant_rows``)."""
    bw = spec.backward
    if bw is None:
        return False
    fds, fdo = bw.format_of("dS"), bw.format_of("dO")
    return (fds.format is Format.FP8E4M3 and fds.granularity in (ScaleGranularity.TENSOR, ScaleGranularity.NONE)
            and fdo.format in _FP8 and {"q", "k"} <= set(bw.reuse)
            and _is_fp8_block128(spec.q) and _is_fp8_block128(spec.k)
            and spec.v.format in _FP8 and spec.v.granularity in (ScaleGranularity.TENSOR, ScaleGranularity.NONE))


def fp8_ds_scale_cover(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with 448 s >= x (float32 x >= 0), from x's bits, without a
    division: x = m 2^e with m in [1, 2) gives 2^(e-8) if m <= 1.75 else 2^(e-7)
    (448 = 1.75 2^8; m <= 1.75 iff the mantissa field is <= 0x600000). The sign bit is ignored.

    - x < 2^-117 (exponent field < 10: 0, subnormals and the tiny normals) -> 1. A tile with
      such an x = amax |dS| * s_q has f = s_q (see ``fp8_ds_tile_scale``), so its
      |dS f| < 2^-117 rounds to zero in e4m3, i.e. its dQ/dK contributions are flushed. (An
      exact scale there would be near fp32's subnormals, and 1 / c could overflow.) The
      kernel's ``fp4gen.device.ptx.fp8_scale_cover`` uses the same threshold.
    - inf / NaN -> NaN.
    """
    b = x.to(torch.float32).contiguous().view(torch.int32)
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    r = e - 8 + (m > 0x600000).to(torch.int32)
    s = (torch.clamp(r, min=1) << 23).view(torch.float32)
    s = torch.where(e < 10, torch.ones_like(s), s)
    return torch.where(e == 255, torch.full_like(s, float("nan")), s)


# the rule's constants (the planner takes the same and the kernel is rendered with them)
FP8_DS_SMALL = _bwd_rules.FP8_DS_SMALL  # 448 / 16
FP8_DS_HEADROOM = _bwd_rules.FP8_DS_HEADROOM
FP8_DS_HALVE_MIN = 2.0 ** _bwd_rules.FP8_DS_HALVE_MIN_LOG2  # 2^-59: the guess never goes below 2^-60


def fp8_ds_tile_scale(a_sq: torch.Tensor, c_guess: torch.Tensor, first: bool):
    """FP8 dS on sm90a: the power-of-two scale c of one backward tile (64 query rows x 128 keys,
    ``BWD_TILE_M`` x ``BWD_TILE_N``) and the next tile's guess, as the kernel picks them.

    ``a_sq`` (...) float32: the tile's max |dS| times the scale s_q of the 128-token Q block
    holding its rows; ``c_guess`` (...): the scale the previous query tile of the same key tile
    handed on (``first``: this is the key tile's first query tile, which has none). Returns
    (c, c_next)::

        c      = c_guess                 if not first and a_sq / c_guess <= 448
               = fp8_ds_scale_cover(a_sq) otherwise (the kernel rounds such a tile again)
        c_next = 4 c   if c was taken from a_sq (the tile's max sits 2-3 binades below 448 then)
               = c / 2 if a_sq / c < 28 and c >= 2^-59
               = c     otherwise

    (The floor keeps runs of all-zero tiles, e.g. from masked dO rows, from halving the guess
    down to 0, where 1 / c and the dK rescale would break.) Why the headroom and the low
    halving threshold: an exact max costs the tile a second pass (below), and with the guess
    handed on as it was and halved below 448 / 4, 6-13 % of the tiles overflowed it on random
    causal inputs at S = 4k (mostly the tile after a key tile's first, diagonal one, whose
    masked half keeps its max low); handing on 4 c and halving only below 448 / 16 brings that
    to 0.2-1 %, and the rel-L2 of dS, dQ and dK as rounded is unchanged to four digits (the
    binades given up hold dS too small to move either norm).

    The tile's dS is used as dS8 / f with f = s_q / c and dS8 = e4m3(f dS) (RNE, saturating),
    by dQ = dS K and dK = dS^T Q (K, Q the reused FP8 payloads, dequantized); |f dS| <= 448.

    Why: on Hopper the FP8 wgmma has no block scales, so a scale can only be applied per MMA
    tile. dQ of a tile gets c s_k / s_q after its MMA; dK = dS^T Q accumulates over the query
    tiles of a key tile in registers, so Q's block scale is folded into f ((dS8 / f)^T s_q Q8 =
    c dS8^T Q8) and the kernel keeps dK in units of the current c (rescaling the accumulator by
    a power of two when c changes). Agreeing on the tile's exact max would take the CTA's MMA
    warps one more barrier per tile (about 5 % of the kernel, measured); instead each thread
    checks the guess against its own values and the dS barrier ORs the overflows (and ANDs the
    "below a sixteenth"), so only a tile that overflows pays for the exact max. A per-(batch,
    head) scale from a bound of |dS| was too coarse: with P ~ 1/S most dS sit many binades
    below any head-wide bound and underflow in e4m3 (docs/numerics.md, "FP8 dS on sm90a").
    """
    a_sq = a_sq.to(torch.float32)
    over = (a_sq / c_guess > 448.0) | first
    c = torch.where(over, fp8_ds_scale_cover(a_sq), c_guess)
    small = (a_sq / c < FP8_DS_SMALL) & ~over & (c >= FP8_DS_HALVE_MIN)
    return c, torch.where(over, c * FP8_DS_HEADROOM, torch.where(small, c * 0.5, c))


def _fp8_ds_round_tiles(ds, sq_rows, tile_m: int, t0: int, m_min: int, c_guess):
    """dS of one key tile (B, H, r, c), rows from query tile ``t0`` (a multiple of ``tile_m``
    rows), as dQ and dK read it under the sm90a recipe: e4m3(f dS) / f with one f = s_q / c per
    ``tile_m`` rows, c from ``fp8_ds_tile_scale`` walked in query-tile order from the key tile's
    first visited tile ``m_min`` (tiles before it are masked entirely: dS = 0, no scale);
    ``sq_rows`` (B, H, r): each row's Q block scale. Returns (dS as read, the next c_guess)."""
    B, H, r, c = ds.shape
    out = torch.zeros_like(ds)
    for i in range(0, r, tile_m):
        t = t0 + i // tile_m
        if t < m_min:
            continue
        blk = ds[:, :, i:i + tile_m]
        s_q = sq_rows[:, :, i].to(torch.float32)
        a = blk.abs().amax(dim=(-2, -1)).to(torch.float32)  # NaN propagates
        cs, c_guess = fp8_ds_tile_scale(a * s_q, c_guess, t == m_min)
        f = (s_q / cs)[..., None, None]
        out[:, :, i:i + tile_m] = round_to(blk * f, E4M3) / f
    return out, c_guess


def _hp(x: torch.Tensor, fmt: OperandFormat) -> torch.Tensor:
    """An input in the forward's format when that is a float dtype, else rounded to bf16
    (what a backward MMA reads when it does not take the forward's low-precision payload)."""
    return x.to(_HP_DTYPES.get(fmt.format, torch.bfloat16)).to(torch.float32)


def backward(q, k, v, o, lse, do, spec: KernelSpec, *, sinks: Optional[torch.Tensor] = None):
    """Attention backward with the spec's gradient formats. Returns (dq, dk, dv) float32
    shaped like q, k, v (dk, dv summed over each GQA group).

    Recomputes P = exp2(t - lse2) from the forward's quantized Q/K (``reuse q k``;
    otherwise bf16 Q/K) and the given LSE (for an MXFP4 Direct-P forward: the forward's
    own Direct-P values divided by the l that the LSE encodes); dO, dP, dS are rounded to
    ``spec.backward.format_of(...)`` (FP8 gradient operands: dO with its OperandFormat
    granularity (tensor/block/token, as Q), dP and dS with one scale per row of each
    key tile; except the sm90a FP8 dS recipe, ``fp8_ds_recipe`` / ``fp8_ds_tile_scale``: one
    power-of-two scale per backward tile of 64 query rows x 128 keys, from the tile's amax or
    handed on by the previous tile, Q's block scale folded in). The operands of each product follow the format of its gradient
    operand, since one MMA cannot mix FP8 with bf16:

    - dP = dO V^T and dV = P^T dO: with an FP8 dO, V as the forward quantized it and P as
      FP8 E4M3 with the fixed 2**8 scale (when the forward's P is FP8/FP4); with a bf16 dO,
      the bf16 V and P rounded to bf16 (or P's own float dtype).
    - dQ = dS K and dK = dS^T Q: with an FP8 dS, the reused (quantized) Q/K; else bf16 Q/K.

    dQ/dK/dV are rounded to their formats at the end. With a softcap, dS is taken through
    ``c tanh(s / c)`` (times 1 - tanh^2) before it is rounded. ``sinks``: as given to
    ``forward`` (the LSE holds them; their own gradient is ``sinks_grad``).
    """
    _dense_only(spec, "backward")
    return _backward(q, k, v, o, lse, do, spec, sinks)


def _backward(q, k, v, o, lse, do, spec: KernelSpec, sinks):
    bw = spec.backward
    if bw is None:
        from fp4gen.ir.spec import Backward
        bw = Backward()
    reuse = bw.reuse
    st = _Prepared(q, k, v, spec, reuse_qk=("q" in reuse, "k" in reuse))
    B, H, Sq, Sk, D, Hkv = st.B, st.H, st.Sq, st.Sk, st.D, st.Hkv
    _check_sinks(sinks, spec, H, st.device)  # P = exp2(t - lse2) needs no sink: the LSE holds it
    dev = st.device
    if do.shape != q.shape or o.shape != q.shape:
        raise ReferenceError(f"o and do must have q's shape {tuple(q.shape)}")
    if lse.shape != (B, H, Sq):
        raise ReferenceError(f"lse must have shape {(B, H, Sq)}, got {tuple(lse.shape)}")
    fdo = bw.format_of("dO")
    if fdo.format in _FP8:
        dO = quantize_operand(do, fdo, 1, False).vals
    else:
        dO = quantize_operand(do, fdo, 3, False).vals
    dO = dO.permute(0, 2, 1, 3)  # (B, H, Sq, D)
    do_lp = fdo.format in _FP8  # dP and dV take the forward's low-precision V and P
    if do_lp:
        vpost = st.vpost
        vv = st.v if vpost is None else st.v * vpost[:, :, None, None]  # dequantized V for dP = dO V^T
    else:
        vv = _expand_heads(_hp(v, spec.v), H, 2).permute(0, 2, 1, 3)
    O = o.to(torch.float32).permute(0, 2, 1, 3)
    Drow = (dO * O).sum(-1)  # D_i = rowsum(dO * O)
    # sm90a FP8 dS: one dS scale per backward tile (64 query rows x 128 keys), Q's block scale folded in
    ds_tile_m = None
    if fp8_ds_recipe(spec):
        ds_tile_m, ds_tile_n = _bwd_tile()
        if st.tile_n != ds_tile_n:
            raise ReferenceError(f"the sm90a FP8 dS recipe scales dS per {ds_tile_m} x {ds_tile_n} tile: "
                                 f"it needs key tiles of {ds_tile_n} (schedule tile_n {st.tile_n})")
    lse2 = lse.to(torch.float32) / LN2
    lse2_s = torch.where(torch.isneginf(lse2), torch.full_like(lse2, float("inf")), lse2)  # -> p = 0
    p_fn, running_max, lse_shift = _p_method(spec)
    # MXFP4 Direct-P forward: recompute its own P (same codes, same reference) and divide by
    # the l the LSE encodes, so the backward uses exactly the forward's normalised P
    m_ref = None if running_max else _guard_refs(st, spec)
    fdp, fds = bw.format_of("dP"), bw.format_of("dS")
    pf = spec.p.format
    p_fmt = None if (pf in _HP_DTYPES or not do_lp) else E4M3
    p_dt = _HP_DTYPES.get(pf, torch.bfloat16)
    if fds.format in _FP8:  # dQ, dK read the reused (quantized) Q/K
        k_for_dq, q_for_dk = st.deq_k, st.deq_q
    else:  # bf16 Q/K
        qh = _hp(q, spec.q).permute(0, 2, 1, 3)
        kh = _expand_heads(_hp(k, spec.k), H, 2).permute(0, 2, 1, 3)

        def k_for_dq(c0, c1):
            return kh[:, :, c0:c1]

        def q_for_dk(r0, r1):
            return qh[:, :, r0:r1]
    dq = torch.zeros(B, H, Sq, D, device=dev)
    dk = torch.zeros(B, H, Sk, D, device=dev)
    dv = torch.zeros(B, H, Sk, D, device=dev)
    rc = _row_chunk(B, H, st.tile_n, D)
    if ds_tile_m is not None:  # row chunks of whole dS tiles; the scale guess of every key tile
        rc = max(ds_tile_m, rc // ds_tile_m * ds_tile_m)
        ds_guess = {}
    for r0 in range(0, Sq, rc):
        r1 = min(Sq, r0 + rc)
        mr = None if m_ref is None else m_ref[:, :, r0:r1]
        for c0 in st.key_tiles(r0, r1):
            c1 = min(Sk, c0 + st.tile_n)
            t = st.scores(r0, r1, c0, c1)
            if m_ref is None:
                p = torch.exp2(t - lse2_s[:, :, r0:r1, None])
            else:  # the forward's reference for this tile: the same rebases, in the same order
                if st.rebase:
                    mr, _ = dp.rebase(t, mr)
                pv, _ = p_fn(t, mr)
                p = pv * torch.exp2(mr - lse_shift - lse2_s[:, :, r0:r1])[..., None]  # pv / l
            if p_fmt is not None:
                pq = round_to(p * dp.P_FP8_SCALE, p_fmt) / dp.P_FP8_SCALE
            else:
                pq = p.to(p_dt).to(torch.float32)
            dv[:, :, c0:c1] += pq.transpose(-1, -2) @ dO[:, :, r0:r1]
            dpm = _fake_quant_rows(dO[:, :, r0:r1] @ vv[:, :, c0:c1].transpose(-1, -2), fdp)
            ds = p * (dpm - Drow[:, :, r0:r1, None])
            if st.cap2:  # through c tanh(s / c): t / c2 = tanh(s / c)
                ds = ds * masking.softcap_grad(t, st.cap2)
            if ds_tile_m is not None:
                # the kernel's CTA for this key tile starts at its first query tile with a visible key
                right = st.window[1]
                m_min = max(0, c0 - (Sk - Sq) - right) // ds_tile_m if right >= 0 else 0
                ds, ds_guess[c0] = _fp8_ds_round_tiles(ds, st.sq[:, :, r0:r1], ds_tile_m, r0 // ds_tile_m, m_min,
                                                       ds_guess.get(c0, torch.ones(B, H, device=dev)))
            else:
                ds = _fake_quant_rows(ds, fds)
            dq[:, :, r0:r1] += ds @ k_for_dq(c0, c1)
            dk[:, :, c0:c1] += ds.transpose(-1, -2) @ q_for_dk(r0, r1)
    scale = spec.scale
    dq = dq * scale
    dk = dk * scale
    # GQA: sum the gradients of every query head sharing one key/value head
    g = H // Hkv
    dk = dk.reshape(B, Hkv, g, Sk, D).sum(2)
    dv = dv.reshape(B, Hkv, g, Sk, D).sum(2)
    outs = []
    for name, x in (("dQ", dq), ("dK", dk), ("dV", dv)):
        x = x.permute(0, 2, 1, 3)
        f = bw.format_of(name)
        outs.append(x.to(_HP_DTYPES[f.format]).to(torch.float32) if f.format in _HP_DTYPES
                    else quantize_fp8(x, "token", 128, _FP8[f.format]).dequantize()
                    if f.format in _FP8 else x)
    return tuple(o_.contiguous() for o_ in outs)



def sinks_grad(o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """dL/dsinks (H,) float32 for the learned sinks: o_i = sum_j p_ij v_j with the sink in every
    row's denominator, so d o_i / d sink_h = -p_sink,i o_i and
    ``dsinks[h] = -sum_{b,i} exp(sink[h] - lse[b,h,i]) (dO_i . O_i)``. Dense: o, do (B, Sq, H, D),
    lse (B, H, Sq); varlen: o, do (total_q, H, D), lse (H, total_q)."""
    D = (do.to(torch.float32) * o.to(torch.float32)).sum(-1)  # (B, Sq, H) or (total, H)
    if lse.dim() == 3:
        p_sink = torch.exp(sinks.to(torch.float32)[None, :, None] - lse.to(torch.float32))  # (B, H, Sq)
        return -(p_sink * D.transpose(1, 2)).sum((0, 2))
    p_sink = torch.exp(sinks.to(torch.float32)[:, None] - lse.to(torch.float32))  # (H, total)
    return -(p_sink * D.transpose(0, 1)).sum(1)


# ------------------------------------------------------------- varlen -----

def _dense_spec(spec: KernelSpec) -> KernelSpec:
    from dataclasses import replace

    return replace(spec, layout=Layout.DENSE) if spec.layout is not Layout.DENSE else spec


def _check_packed(q, k, v, spec: KernelSpec):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ReferenceError(f"varlen {name} must be a 3-D (total_tokens, H, D) tensor")
    if k.shape != v.shape:
        raise ReferenceError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, spec: KernelSpec, *, sinks=None,
                   max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None):
    """Packed sequences (q (total_q, H, D), k/v (total_k, Hkv, D)) -> (o (total_q, H, D) float32,
    lse (H, total_q) float32): ``forward`` on each sequence. A sequence without keys gets
    o = 0 and lse = -inf (the sink with sinks)."""
    _check_packed(q, k, v, spec)
    dense = _dense_spec(spec)
    H, D = q.shape[1], q.shape[2]
    sink = _check_sinks(sinks, spec, H, q.device)
    segs = _segments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o = torch.zeros(q.shape[0], H, D, device=q.device)
    empty_lse = float("-inf")
    lse = torch.full((H, q.shape[0]), empty_lse, device=q.device)
    if sink is not None:
        lse[:] = sink[:, None]
    for q0, q1, k0, k1 in segs:
        if q1 == q0 or k1 == k0:
            continue
        ob, lb = _forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dense, sinks)
        o[q0:q1] = ob[0]
        lse[:, q0:q1] = lb[0]
    return o, lse


def backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, spec: KernelSpec, *, sinks=None,
                    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None):
    """``backward`` per packed sequence -> (dq, dk, dv) float32 shaped like q, k, v; lse is
    ``forward_varlen``'s (H, total_q)."""
    _check_packed(q, k, v, spec)
    dense = _dense_spec(spec)
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ReferenceError(f"varlen lse must have shape {(q.shape[1], q.shape[0])}, got {tuple(lse.shape)}")
    segs = _segments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq = torch.zeros(q.shape, device=q.device)
    dk = torch.zeros(k.shape, device=q.device)
    dv = torch.zeros(v.shape, device=q.device)
    for q0, q1, k0, k1 in segs:
        if q1 == q0 or k1 == k0:
            continue
        g = _backward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], o[None, q0:q1],
                      lse[None, :, q0:q1], do[None, q0:q1], dense, sinks)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _segments(q, k, cu_q, cu_k, max_q, max_k):
    try:
        return masking.segments(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q=max_q, max_seqlen_k=max_k,
                                who="fp4gen reference varlen")
    except ValueError as e:
        raise ReferenceError(str(e)) from None
