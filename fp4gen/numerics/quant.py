"""Block quantizers: NVFP4, MXFP4, FP8 (per-tensor / per-block / per-token), and
the scale-factor layouts the kernels consume.

All functions are vectorized torch code (no Python loops over elements) and
give identical bits on CPU and CUDA; the FP8 ones are the quantizers the sm90
kernels call before launch (the "Hopper FP8 contract", docs/numerics.md).

Conventions:

- Attention tensors are ``(B, S, H, D)``. FP4 blocks run along the dimension
  the consuming MMA reduces over (``dim``): D for Q and K, the key/sequence
  dimension for P and V. FP8 "block" scales cover ``block`` consecutive
  tokens x the whole head dim, per (batch, head).
- Every quantizer returns payload codes (uint8, same shape as the input, one
  code per byte, unpacked) plus the exact float32 scale that dequantizes them,
  and the scale's own codes where the scale has a small format (E4M3, E8M0).
- Dequantized value = decode(payload) * scale, evaluated in float32 (exact:
  the product of an FP4/FP8 value and a scale is representable unless it
  under/overflows float32).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .formats import (E2M1, E2M1_VALUES, E4M3, E5M2, MiniFloat, decode, decode_e8m0, encode,
                      encode_e8m0)

FP4_MAX = 6.0


def _to_blocks(x: torch.Tensor, dim: int, block: int):
    """Move ``dim`` last, zero-pad it to a multiple of ``block``, split into blocks.

    Returns (blocks (..., nb, block), n) with n the unpadded length.
    """
    x = x.to(torch.float32).movedim(dim, -1)
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block), n


def _from_blocks(xb: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    x = xb.reshape(*xb.shape[:-2], -1)[..., :n]
    return x.movedim(-1, dim)


def _clamp_e2m1_finite(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q clamped to +-(the largest E2M1 value v with fl32(v * scale) finite); ``scale``
    broadcasts against q.

    Only scales near float32's top reach it: an MXFP4 block (ceil rule) with amax above
    3.5 * 2**126 gets scale 2**126, and its 3.99 would round to the E2M1 value 4, which
    dequantizes to 2**128 = Inf from finite input. Everywhere else the bound is 6, where
    ``encode`` saturates anyway, so the codes do not change. NaN stays NaN."""
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=q.device)
    ok = torch.isfinite(scale.unsqueeze(-1) * vals)
    cap = torch.where(ok, vals, torch.zeros_like(vals)).amax(-1)
    return torch.where(torch.isnan(q), q, torch.maximum(torch.minimum(q, cap), -cap))


def _amax(xb: torch.Tensor, dims) -> torch.Tensor:
    # abs().amax propagates NaN (torch.amax returns NaN if any element is NaN)
    return xb.abs().amax(dim=dims)


@dataclass
class FP4Tensor:
    """A block-scaled FP4 tensor (NVFP4 or MXFP4), payload unpacked."""

    codes: torch.Tensor  # uint8 E2M1 codes, shape of the original tensor
    scale: torch.Tensor  # float32 effective per-block scale, shape (..., nb) with dim moved last
    scale_codes: torch.Tensor  # uint8 E4M3 (nvfp4) or E8M0 (mxfp4) codes, same shape as scale
    tensor_scale: Optional[torch.Tensor]  # nvfp4 per-tensor fp32 scale (folded into `scale`)
    dim: int
    block: int
    kind: str  # "nvfp4" | "mxfp4"

    def dequantize(self) -> torch.Tensor:
        vals = decode(self.codes, E2M1)
        vb, n = _to_blocks(vals, self.dim, self.block)
        return _from_blocks(vb * self.scale.unsqueeze(-1), self.dim, n)


def quantize_nvfp4(x: torch.Tensor, dim: int = -1, block: int = 16,
                   tensor_scale: bool = False) -> FP4Tensor:
    """NVFP4: E2M1 payload, ``block`` (16) elements along ``dim`` share one E4M3 scale.

    Without a tensor scale: s_B = e4m3(amax_B / 6). With one (``tensor_scale=True``,
    over the whole tensor): g = amax / (448*6) (1 if amax == 0),
    s_B = e4m3((amax_B / 6) / g) * g. Payload q = e2m1(x / s_B) (saturating at 6),
    0 where s_B == 0. A NaN in a block makes its scale NaN (E4M3 0x7F).
    """
    xb, _ = _to_blocks(x, dim, block)
    amax = _amax(xb, -1)
    g = None
    if tensor_scale:
        t = _amax(xb, tuple(range(xb.dim())))
        g = _div_exact(t, 448.0 * FP4_MAX)
        g = torch.where(g == 0, torch.ones_like(g), g)  # amax 0, or so small that t / 2688 underflows
        sc = encode(_div_exact(amax, FP4_MAX) / g, E4M3)
        s = decode(sc, E4M3) * g
    else:
        sc = encode(_div_exact(amax, FP4_MAX), E4M3)
        s = decode(sc, E4M3)
    sb = s.unsqueeze(-1)
    q = torch.where(sb == 0, torch.zeros_like(xb), xb / torch.where(sb == 0, torch.ones_like(sb), sb))
    q = _clamp_e2m1_finite(q, sb)
    codes = _from_blocks(encode(q, E2M1).to(torch.float32), dim, x.shape[dim]).to(torch.uint8)
    return FP4Tensor(codes, s, sc, g, dim, block, "nvfp4")


def quantize_mxfp4(x: torch.Tensor, dim: int = -1, block: int = 32, rule: str = "ceil") -> FP4Tensor:
    """MXFP4: E2M1 payload, ``block`` (32) elements along ``dim`` share one E8M0 scale.

    ``rule="ceil"`` (default): s_B = 2**ceil(log2(fl(amax_B / 6))) so no element
    saturates; ``rule="ocp"``: the OCP MX v1.0 rule s_B = 2**(floor(log2 amax_B) - 2),
    which may saturate elements to +-6. q = e2m1(x / s_B) (exact division by a power of two).
    amax_B == 0 -> scale code 0 (2**-127), payload 0.
    """
    xb, _ = _to_blocks(x, dim, block)
    amax = _amax(xb, -1)
    if rule == "ceil":
        sc = encode_e8m0(_div_exact(amax, FP4_MAX), "up")
    elif rule == "ocp":
        c = encode_e8m0(amax, "down").to(torch.int32)
        c = torch.where((c > 0) & (c < 255), torch.clamp(c - 2, min=0), c)
        sc = c.to(torch.uint8)
    else:
        raise ValueError(f"unknown MXFP4 scale rule {rule!r}: use 'ceil' or 'ocp'")
    s = decode_e8m0(sc)
    q = _clamp_e2m1_finite(xb / s.unsqueeze(-1), s.unsqueeze(-1))
    codes = _from_blocks(encode(q, E2M1).to(torch.float32), dim, x.shape[dim]).to(torch.uint8)
    return FP4Tensor(codes, s, sc, None, dim, block, "mxfp4")


# ----------------------------------------------------------------- FP8 -----

@dataclass
class FP8Tensor:
    """FP8 payload with fp32 scales.

    ``scale`` broadcasts against the (B, S, H, D) payload after ``expand_scale``:
    granularity "tensor": (B, H); "block": (B, ceil(S/block), H); "token": (B, S, H).
    """

    codes: torch.Tensor  # uint8, shape of the input
    scale: torch.Tensor  # float32
    fmt: MiniFloat
    granularity: str
    block: int
    seq_dim: int = 1

    @property
    def payload(self) -> torch.Tensor:
        """The payload as torch's float8 dtype (a view, for wgmma / torch._scaled_mm)."""
        dt = torch.float8_e4m3fn if self.fmt is E4M3 else torch.float8_e5m2
        return self.codes.view(dt)

    def expand_scale(self) -> torch.Tensor:
        """Per-element scale, broadcastable to the payload's (B, S, H, D)."""
        S = self.codes.shape[1]
        if self.granularity == "tensor":
            return self.scale[:, None, :, None]
        if self.granularity == "token":
            return self.scale[..., None]
        return self.scale.repeat_interleave(self.block, dim=1)[:, :S, :, None]

    def dequantize(self) -> torch.Tensor:
        return decode(self.codes, self.fmt) * self.expand_scale()


def _fp8_fmt(fmt) -> MiniFloat:
    if isinstance(fmt, MiniFloat):
        return fmt
    return {"e4m3": E4M3, "fp8e4m3": E4M3, "e5m2": E5M2, "fp8e5m2": E5M2}[str(fmt)]


def _div_exact(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c with IEEE division on every device. (torch turns `x / python_float` into a
    multiply by the reciprocal on CUDA but divides on the CPU; a tensor divisor divides
    on both.)"""
    return x / torch.tensor(c, dtype=x.dtype, device=x.device)


def _fp8_scale(amax: torch.Tensor, fmt: MiniFloat) -> torch.Tensor:
    # scale = amax * fl32(1/fmax): a multiply by the fp32-rounded reciprocal, which is what
    # torch's CUDA kernels do for `amax / 448.0` and what the fused GPU quantizer
    # (fp4gen.device.quantize) does; written out so the CPU gives the same bits.
    # An all-zero group gets scale 1 (its payload is 0 anyway), and so does a group whose
    # scale underflows to 0 (fp32 amax below ~fmax * 2**-150, 6e-43 for E4M3): x / 0 would
    # give NaN for its zeros; with scale 1 its payload rounds to 0 (|x| is far below the
    # format's smallest subnormal). bf16 inputs never reach it (amax >= 2**-133).
    recip = torch.tensor(1.0 / fmt.max_value, dtype=torch.float32, device=amax.device)
    s = amax * recip
    return torch.where(s == 0, torch.ones_like(s), s)


def _check_bshd(x: torch.Tensor, what: str):
    if x.dim() != 4:
        raise ValueError(f"{what} expects a (B, S, H, D) tensor, got shape {tuple(x.shape)}")


def quantize_fp8_tensor(x: torch.Tensor, fmt=E4M3) -> FP8Tensor:
    """One fp32 scale per (batch, head): scale = amax/fmax (amax == 0 -> 1), q = fp8_rne(x/scale)."""
    _check_bshd(x, "quantize_fp8_tensor")
    fmt = _fp8_fmt(fmt)
    x = x.to(torch.float32)
    s = _fp8_scale(_amax(x, (1, 3)), fmt)  # (B, H)
    codes = encode(x / s[:, None, :, None], fmt)
    return FP8Tensor(codes, s, fmt, "tensor", 0)


def quantize_fp8_token(x: torch.Tensor, fmt=E4M3) -> FP8Tensor:
    """One fp32 scale per (batch, token, head), over the head dim."""
    _check_bshd(x, "quantize_fp8_token")
    fmt = _fp8_fmt(fmt)
    x = x.to(torch.float32)
    s = _fp8_scale(_amax(x, 3), fmt)  # (B, S, H)
    codes = encode(x / s[..., None], fmt)
    return FP8Tensor(codes, s, fmt, "token", 1)


def quantize_fp8_blockwise(x: torch.Tensor, block: int = 128, dim: int = 1, fmt=E4M3) -> FP8Tensor:
    """One fp32 scale per (batch, ``block`` consecutive tokens, head), over block x D.

    The Hopper FP8 contract's Q/K quantizer: scale = amax/448 (amax == 0 -> 1),
    payload = e4m3_rne(x / scale) saturating at +-448. The last block may be short
    (its amax covers only the real tokens). Only ``dim=1`` (the S of (B, S, H, D)) is supported.
    """
    _check_bshd(x, "quantize_fp8_blockwise")
    if dim not in (1, -3):
        raise ValueError("quantize_fp8_blockwise blocks along the sequence dim (dim=1) of (B, S, H, D)")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    fmt = _fp8_fmt(fmt)
    x = x.to(torch.float32)
    B, S, H, D = x.shape
    pad = (-S) % block
    xp = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
    nb = xp.shape[1] // block
    s = _fp8_scale(_amax(xp.reshape(B, nb, block, H, D), (2, 4)), fmt)  # (B, nb, H)
    sfull = s.repeat_interleave(block, dim=1)[:, :S, :, None]
    codes = encode(x / sfull, fmt)
    return FP8Tensor(codes, s, fmt, "block", block)


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor", block: int = 128, fmt=E4M3) -> FP8Tensor:
    if granularity == "tensor":
        return quantize_fp8_tensor(x, fmt)
    if granularity == "token":
        return quantize_fp8_token(x, fmt)
    if granularity == "block":
        return quantize_fp8_blockwise(x, block, 1, fmt)
    raise ValueError(f"unknown FP8 scale granularity {granularity!r}: use tensor, block or token")


# -------------------------------------------------------- SF layouts -------

def tcgen05_sf_offset(m: torch.Tensor, kb: torch.Tensor, k_blocks: int) -> torch.Tensor:
    """Byte offset of the scale of row ``m``, scale-column ``kb`` in the tcgen05
    block-scale layout (K-major, CUTLASS ``BlockScaledBasicChunk``):

    one 512-byte atom holds 128 rows x 4 scale columns with
    offset_in_atom = (m % 32) * 16 + ((m // 32) % 4) * 4 + (kb % 4);
    atoms are ordered K-fastest: atom = (m // 128) * ceil(k_blocks / 4) + kb // 4.
    """
    k_atoms = -(-k_blocks // 4)
    atom = (m // 128) * k_atoms + kb // 4
    return atom * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + (kb % 4)


def to_tcgen05_sf_layout(scale_codes: torch.Tensor) -> torch.Tensor:
    """(..., M, Kb) uint8 scale codes -> (..., ceil(M/128) * ceil(Kb/4) * 512) bytes in the
    tcgen05 SF atom layout (padding bytes are 0). Leading dims are independent batches."""
    *lead, M, Kb = scale_codes.shape
    Mp, Kp = -(-M // 128) * 128, -(-Kb // 4) * 4
    dev = scale_codes.device
    m = torch.arange(M, device=dev)[:, None]
    kb = torch.arange(Kb, device=dev)[None, :]
    off = tcgen05_sf_offset(m, kb, Kb).reshape(-1)
    flat = scale_codes.reshape(-1, M * Kb)
    out = torch.zeros(flat.shape[0], Mp * Kp, dtype=torch.uint8, device=dev)
    out[:, off] = flat
    return out.reshape(*lead, Mp * Kp)


def from_tcgen05_sf_layout(buf: torch.Tensor, M: int, Kb: int) -> torch.Tensor:
    """Inverse of to_tcgen05_sf_layout."""
    dev = buf.device
    m = torch.arange(M, device=dev)[:, None]
    kb = torch.arange(Kb, device=dev)[None, :]
    off = tcgen05_sf_offset(m, kb, Kb).reshape(-1)
    lead = buf.shape[:-1]
    return buf.reshape(-1, buf.shape[-1])[:, off].reshape(*lead, M, Kb)


# ------------------------------------------------------ FP8 varlen ---------
# Packed sequences (q (total, H, D), flash_attn's varlen layout): scale groups never straddle two
# sequences, so each sequence quantizes exactly as it would alone (``quantize_fp8_blockwise`` /
# ``quantize_fp8_tensor`` on its (1, S, H, D) slice), which is what the reference's
# ``forward_varlen`` does (the dense path per sequence). Blocks restart at each sequence's first
# token. Everything runs on the offsets' device with no host read of them (no sync on a GPU).

@dataclass
class FP8VarlenTensor:
    """FP8 payload of a packed (total, H, D) tensor with per-sequence fp32 scales.

    ``scale``: granularity "block": (total, H), each token carrying the scale of its block
    (``block`` tokens counted from its sequence's start); "tensor": (B, H), one per
    (sequence, head) (an empty sequence gets 1)."""

    codes: torch.Tensor  # uint8 (total, H, D)
    scale: torch.Tensor  # float32
    fmt: MiniFloat
    granularity: str
    block: int

    @property
    def payload(self) -> torch.Tensor:
        dt = torch.float8_e4m3fn if self.fmt is E4M3 else torch.float8_e5m2
        return self.codes.view(dt)

    def token_scale(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """(total, H): the scale that multiplies each token's payload."""
        if self.granularity == "block":
            return self.scale
        seq, _ = varlen_token_positions(cu_seqlens, self.codes.shape[0])
        return self.scale[seq]

    def dequantize(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return decode(self.codes, self.fmt) * self.token_scale(cu_seqlens)[..., None]


def varlen_token_positions(cu_seqlens: torch.Tensor, total: int):
    """(seq, pos) int64 (total,): each packed token's sequence and its position in it.
    Offsets that do not describe ``total`` tokens give clamped, in-range indices (no device
    assert): the caller's offset check decides what such a result is worth."""
    cu = cu_seqlens.to(torch.int64)
    nseq = cu.numel() - 1
    tok = torch.arange(total, device=cu.device)
    # token t is in sequence b iff cu[b] <= t < cu[b + 1]; empty sequences are skipped over
    seq = torch.searchsorted(cu[1:].contiguous(), tok, right=True).clamp_(max=max(nseq - 1, 0))
    return seq, tok - cu[seq]


def varlen_block_ids(cu_seqlens: torch.Tensor, total: int, block: int):
    """(ids (total,), n): each token's scale block, numbered over all sequences, blocks
    restarting at every sequence start; ``n`` bounds the ids (sum ceil(len / block) <=
    total // block + B, known without reading the offsets)."""
    cu = cu_seqlens.to(torch.int64)
    nseq = cu.numel() - 1
    seq, pos = varlen_token_positions(cu, total)
    per_seq = (cu[1:] - cu[:-1] + (block - 1)).clamp_(min=0) // block
    first = torch.cumsum(per_seq, 0) - per_seq  # each sequence's first block id
    n = total // block + max(nseq, 1)
    return (first[seq] + pos // block).clamp_(0, n - 1), n


def group_amax(x: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """amax over D and the tokens of each group: x (total, H, D), ids (total,) -> (n, H);
    a group holding a NaN gets NaN (as ``_amax``), an empty group 0."""
    tok = x.abs().amax(dim=2)  # (total, H), NaN where a token has one
    nan = torch.isnan(tok)
    idx = ids[:, None].expand_as(tok)
    amax = torch.zeros(n, tok.shape[1], dtype=torch.float32, device=x.device).scatter_reduce_(
        0, idx, torch.where(nan, torch.zeros_like(tok), tok), "amax")
    has_nan = torch.zeros_like(amax).scatter_add_(0, idx, nan.to(torch.float32))
    return torch.where(has_nan > 0, torch.full_like(amax, float("nan")), amax)


def quantize_fp8_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, granularity: str = "block",
                        block: int = 128, fmt=E4M3) -> FP8VarlenTensor:
    """FP8 quantization of a packed (total, H, D) tensor whose sequences ``cu_seqlens``
    (B + 1,) delimit: per (sequence, ``block`` tokens, head) ("block", the Hopper contract's
    Q/K) or per (sequence, head) ("tensor", its V). Bit-equal to the dense quantizer of the
    same granularity run on each sequence alone (tests/varlen/test_fp8_varlen.py)."""
    if x.dim() != 3:
        raise ValueError(f"quantize_fp8_varlen expects a packed (total, H, D) tensor, got shape {tuple(x.shape)}")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    fmt = _fp8_fmt(fmt)
    x = x.to(torch.float32)
    total = x.shape[0]
    if granularity == "block":
        ids, n = varlen_block_ids(cu_seqlens, total, block)
        s = _fp8_scale(group_amax(x, ids, n), fmt)[ids]  # (total, H)
        return FP8VarlenTensor(encode(x / s[..., None], fmt), s, fmt, "block", block)
    if granularity == "tensor":
        seq, _ = varlen_token_positions(cu_seqlens, total)
        s = _fp8_scale(group_amax(x, seq, max(cu_seqlens.numel() - 1, 1)), fmt)  # (B, H)
        return FP8VarlenTensor(encode(x / s[seq][..., None], fmt), s, fmt, "tensor", 0)
    raise ValueError(f"quantize_fp8_varlen: granularity must be 'block' or 'tensor', got {granularity!r}")
