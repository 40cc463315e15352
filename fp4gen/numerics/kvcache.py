"""KV caches in low precision, and decode attention against them (issue 22): the numerics.

    kc = CacheTensor.allocate(fmt, slots, page, Hkv, D)          # zeros, in the cache's format
    kc.write(rows, cols, x)                                       # quantize tokens into slots
    x = kc.read(rows, cols)                                       # float32, exactly what is stored
    o, lse = decode(q, k_cache, v_cache, cache_seqlens, spec, page_table=..., k_new=..., v_new=...)

A cache tensor has flash_attn's shape, ``(slots, page, Hkv, D)``: contiguous, ``slots`` is the
batch of the cache and ``page`` its ``seqlen_cache``; paged, ``slots`` is the number of pages
and ``page`` the page size, and token t of sequence b is slot ``page_table[b, t // page]``,
row ``t % page``. What it stores per format (``CacheFormat``, ``fp4gen.ir.spec``):

- ``bf16``: ``data`` bf16 ``(slots, page, Hkv, D)``.
- ``fp8e4m3(scale=token)``: ``data`` uint8 E4M3 codes ``(slots, page, Hkv, D)``, ``scale``
  float32 ``(slots, page, Hkv)``: ``quantize_fp8_token`` of each written token (amax over D
  times fp32(1/448); 1 for a zero token). Value = decode(code) * scale.
- ``fp8e4m3(scale=tensor)``: the codes, and ``scale`` float32 ``(Hkv,)`` fixed when the cache is
  allocated (``tensor_scales``: ``quantize_fp8_tensor``'s rule over all the allocation data of
  each KV head); a token is ``e4m3(x / scale)``, saturating at +-448, as
  ``quantize_fp8_tensor`` rounds.
- ``nvfp4``: ``data`` uint8 ``(slots, page, Hkv, D // 2)``, two E2M1 codes a byte (element 2i
  in the low nibble, ``formats.pack_fp4``), ``scale`` uint8 E4M3 codes ``(slots, page, Hkv,
  D // 16)`` (``quantize_nvfp4`` along D); with ``tensor_scale``, ``tensor_scale`` float32
  ``(Hkv,)``, a power of two g = 2^ceil(log2(amax / (448 * 6))) fixed at allocation, and the
  token is ``quantize_nvfp4(x / g)`` (x / g and the products are exact for a power of two, so
  this is the two-level rule with g, from the one quantizer). Value = e2m1 * e4m3 * g.

``decode`` is the reference backend of ``fp4gen.attention_with_kvcache``: it appends the new
tokens (quantized as above), gathers each sequence's cache dequantized in float32, and runs
the reference's tile arithmetic (``reference._Prepared``, the spec's Q, P and O numerics; K
and V enter exactly as stored) split along the keys as a flash-decoding kernel runs it:
``num_splits`` contiguous runs of key tiles per sequence, each a partial (o_s, lse_s), then
``combine``. One split is ``reference.forward`` bit for bit (tests/kvcache). ``split_count``
is the split rule the planner records (``ir/passes/decode.py``) and a kernel host would use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from fp4gen.ir.spec import CacheFormat, Format, KernelSpec, KvStorage, OperandFormat, ScaleGranularity

from . import directp as dp
from . import reference as ref
from .formats import E2M1, E4M3, decode as decode_codes, encode, pack_fp4, unpack_fp4
from .quant import FP4_MAX, quantize_fp8_tensor, quantize_fp8_token, quantize_nvfp4

NVFP4_BLOCK = 16
LN2 = math.log(2.0)


class KVCacheError(ValueError):
    """A cache, page table, length or new token tensor that does not fit (the message says which)."""


# --------------------------------------------------------------------- formats -----

def _check_tokens(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not torch.is_floating_point(x):
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise KVCacheError(f"{what}: tokens must be a float (T, Hkv, D) tensor, got {got}")


def tensor_scales(fmt: CacheFormat, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The per-KV-head fp32 scale a ``scale=tensor`` fp8 or a two-level nvfp4 cache fixes at
    allocation, from ``x`` (..., Hkv, D), the data it is allocated from (None for the formats
    without one). fp8: ``quantize_fp8_tensor``'s amax * fp32(1/448) over all of ``x`` per head
    (1 when it is all zero). nvfp4: the power of two g >= amax / (448 * 6) (1 when zero)."""
    if fmt.has_tensor_scale and x.numel() == 0:
        return torch.ones(x.shape[-2], dtype=torch.float32, device=x.device)
    if fmt.format is Format.FP8E4M3 and fmt.granularity is ScaleGranularity.TENSOR:
        Hkv, D = x.shape[-2], x.shape[-1]
        return quantize_fp8_tensor(x.reshape(1, -1, Hkv, D)).scale[0]
    if fmt.format is Format.NVFP4 and fmt.tensor_scale:
        amax = x.to(torch.float32).abs().reshape(-1, x.shape[-2], x.shape[-1]).amax(dim=(0, 2))
        t = amax / torch.tensor(448.0 * FP4_MAX, dtype=torch.float32, device=x.device)
        mant, ex = torch.frexp(t)  # t = mant 2^ex, mant in [0.5, 1): 2^ceil(log2 t) = 2^ex unless mant == 0.5
        e = torch.where(mant == 0.5, ex - 1, ex)
        g = torch.ldexp(torch.ones_like(t), e)
        return torch.where(amax == 0, torch.ones_like(t), g)
    return None


def quantize_tokens(fmt: CacheFormat, x: torch.Tensor, tscale: Optional[torch.Tensor] = None):
    """Tokens (T, Hkv, D) -> (data, scale) rows as the cache stores them (module docstring);
    ``tscale``: the cache's per-head tensor scale for the formats that have one."""
    _check_tokens(x, "quantize_tokens")
    T, Hkv, D = x.shape
    if fmt.format is Format.BF16:
        return x.to(torch.bfloat16), None
    if fmt.format is Format.FP8E4M3:
        if fmt.granularity is ScaleGranularity.TOKEN:
            qt = quantize_fp8_token(x[None])
            return qt.codes[0], qt.scale[0]
        if tscale is None:
            raise KVCacheError("an fp8e4m3(scale=tensor) cache needs its per-KV-head scale")
        return encode(x.to(torch.float32) / tscale[None, :, None], E4M3), None
    if fmt.format is Format.NVFP4:
        if D % NVFP4_BLOCK:
            raise KVCacheError(f"an nvfp4 cache needs a head dim that is a multiple of 16, got {D}")
        xs = x.to(torch.float32)
        if fmt.tensor_scale:
            if tscale is None:
                raise KVCacheError("a two-level nvfp4 cache needs its per-KV-head tensor scale")
            xs = xs / tscale[None, :, None]
        qt = quantize_nvfp4(xs, dim=-1, block=NVFP4_BLOCK)
        return pack_fp4(qt.codes), qt.scale_codes
    raise KVCacheError(f"a KV cache holds bf16, fp8e4m3 or nvfp4, not {fmt.format.value}")


def dequantize_rows(fmt: CacheFormat, data: torch.Tensor, scale: Optional[torch.Tensor],
                    tscale: Optional[torch.Tensor]) -> torch.Tensor:
    """(data, scale) rows (T, Hkv, ...) -> float32 (T, Hkv, D), exact."""
    if fmt.format is Format.BF16:
        return data.to(torch.float32)
    if fmt.format is Format.FP8E4M3:
        vals = decode_codes(data, E4M3)
        if fmt.granularity is ScaleGranularity.TOKEN:
            return vals * scale[..., None]
        return vals * tscale[None, :, None]
    vals = decode_codes(unpack_fp4(data), E2M1)
    T, Hkv, D = vals.shape
    s = decode_codes(scale, E4M3)
    if fmt.tensor_scale:
        s = s * tscale[None, :, None]
    return (vals.reshape(T, Hkv, D // NVFP4_BLOCK, NVFP4_BLOCK) * s[..., None]).reshape(T, Hkv, D)


@dataclass
class CacheTensor:
    """K or V of a KV cache in its format: ``data``, ``scale``, ``tensor_scale`` as the module
    docstring lays them out; ``(slots, page, Hkv, D)`` addressing."""

    fmt: CacheFormat
    data: torch.Tensor
    scale: Optional[torch.Tensor] = None
    tensor_scale: Optional[torch.Tensor] = None
    head_dim: int = 0

    @classmethod
    def allocate(cls, fmt: CacheFormat, slots: int, page: int, kv_heads: int, head_dim: int, *,
                 device=None, tensor_scale: Optional[torch.Tensor] = None) -> "CacheTensor":
        """An all-zero cache. ``tensor_scale`` (Hkv,) is required by the formats that fix one."""
        shape = (slots, page, kv_heads)
        if fmt.has_tensor_scale:
            if tensor_scale is None or tuple(tensor_scale.shape) != (kv_heads,):
                raise KVCacheError(f"a {fmt} cache needs its per-KV-head scale, a float32 tensor ({kv_heads},)")
            tensor_scale = tensor_scale.to(device=device, dtype=torch.float32)
        elif tensor_scale is not None:
            raise KVCacheError(f"a {fmt} cache has no tensor scale")
        if fmt.format is Format.BF16:
            return cls(fmt, torch.zeros(*shape, head_dim, dtype=torch.bfloat16, device=device), head_dim=head_dim)
        if fmt.format is Format.FP8E4M3:
            scale = (torch.ones(*shape, dtype=torch.float32, device=device)
                     if fmt.granularity is ScaleGranularity.TOKEN else None)
            return cls(fmt, torch.zeros(*shape, head_dim, dtype=torch.uint8, device=device), scale,
                       tensor_scale, head_dim)
        if head_dim % NVFP4_BLOCK:
            raise KVCacheError(f"an nvfp4 cache needs a head dim that is a multiple of 16, got {head_dim}")
        return cls(fmt, torch.zeros(*shape, head_dim // 2, dtype=torch.uint8, device=device),
                   torch.zeros(*shape, head_dim // NVFP4_BLOCK, dtype=torch.uint8, device=device),
                   tensor_scale, head_dim)

    @property
    def slots(self) -> int:
        return self.data.shape[0]

    @property
    def page(self) -> int:
        return self.data.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.data.shape[2]

    @property
    def device(self):
        return self.data.device

    def write(self, rows: torch.Tensor, cols: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize tokens x (T, Hkv, D) into slots (rows[t], cols[t]), in place."""
        if x.shape[0] == 0:
            return
        data, scale = quantize_tokens(self.fmt, x.to(self.device), self.tensor_scale)
        self.data[rows, cols] = data
        if scale is not None:
            self.scale[rows, cols] = scale

    def read(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The tokens in slots (rows[t], cols[t]), float32 (T, Hkv, D), exactly as stored."""
        sc = None if self.scale is None else self.scale[rows, cols]
        return dequantize_rows(self.fmt, self.data[rows, cols], sc, self.tensor_scale)

    def bytes(self) -> int:
        """What the cache occupies (data and scales)."""
        n = self.data.numel() * self.data.element_size()
        for t in (self.scale, self.tensor_scale):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


def as_cache(x, what: str) -> CacheTensor:
    """A ``CacheTensor``, or a plain bf16 (slots, page, Hkv, D) tensor (flash_attn's bf16 cache,
    wrapped without a copy: writes go into it)."""
    if isinstance(x, CacheTensor):
        return x
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype == torch.bfloat16:
        return CacheTensor(CacheFormat(), x, head_dim=x.shape[-1])
    got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
    raise KVCacheError(f"{what} must be a CacheTensor (fp4gen.allocate_kv_cache) or a bf16 (slots, page, Hkv, D) "
                       f"tensor, got {got}")


# ------------------------------------------------------------------- addressing -----

def token_slots(lengths: list[int], page: int, page_table: Optional[torch.Tensor], slots: int, device):
    """Per sequence b, the (rows, cols) of its tokens 0 .. lengths[b] - 1: contiguous, row b and
    cols 0..L-1; paged, row ``page_table[b, t // page]`` and col ``t % page``."""
    out = []
    for b, L in enumerate(lengths):
        t = torch.arange(L, device=device)
        if page_table is None:
            out.append((torch.full_like(t, b), t))
        else:
            out.append((page_table[b, t // page].to(torch.long), t % page))
    return out


def check_layout(k_cache: CacheTensor, v_cache: CacheTensor, cache_seqlens, page_table, batch: int,
                 new_tokens: int, spec: Optional[KernelSpec] = None) -> list[int]:
    """The cache lengths as ints, after checking that the caches, the page table and the
    lengths (plus ``new_tokens`` to append) fit together; KVCacheError saying what does not."""
    for nm, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.data.shape[:3] != k_cache.data.shape[:3] or c.head_dim != k_cache.head_dim:
            raise KVCacheError(f"{nm} is (slots, page, Hkv, D) = {tuple(c.data.shape[:3]) + (c.head_dim,)}; "
                               f"k_cache {tuple(k_cache.data.shape[:3]) + (k_cache.head_dim,)}: they must match")
    if spec is not None and spec.kv_cache is not None:
        want = spec.kv_cache.format
        for nm, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.fmt != want:
                raise KVCacheError(f"{nm} is {c.fmt}, the spec's cache is {want}")
        paged = spec.kv_cache.storage is KvStorage.PAGED
        if paged and page_table is None:
            raise KVCacheError(f"spec {spec.name!r} has a paged cache: pass page_table (batch, pages per sequence)")
        if not paged and page_table is not None:
            raise KVCacheError(f"spec {spec.name!r} has a contiguous cache: it takes no page_table "
                               "(write 'storage paged(page_size=N)' in its kv_cache block)")
        if paged and k_cache.page != spec.kv_cache.page_size:
            raise KVCacheError(f"the cache's pages hold {k_cache.page} tokens, the spec's page_size is "
                               f"{spec.kv_cache.page_size}")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = [cache_seqlens] * batch
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 1 and \
            cache_seqlens.dtype in (torch.int32, torch.int64) and cache_seqlens.numel() == batch:
        lengths = [int(x) for x in cache_seqlens.tolist()]
    else:
        got = (f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}" if isinstance(cache_seqlens, torch.Tensor)
               else type(cache_seqlens).__name__)
        raise KVCacheError(f"cache_seqlens must be an int or an int32 tensor ({batch},), got {got}")
    if any(L < 0 for L in lengths):
        raise KVCacheError(f"cache_seqlens must be >= 0, got {lengths[:8]}")
    page = k_cache.page
    if page_table is None:
        if k_cache.slots < batch:
            raise KVCacheError(f"a contiguous cache of {k_cache.slots} sequences cannot hold a batch of {batch}")
        room = page
    else:
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != batch or \
                page_table.dtype not in (torch.int32, torch.int64):
            got = (f"{page_table.dtype} {tuple(page_table.shape)}" if isinstance(page_table, torch.Tensor)
                   else type(page_table).__name__)
            raise KVCacheError(f"page_table must be an int32 tensor (batch={batch}, pages per sequence), got {got}")
        room = page_table.shape[1] * page
    for b, L in enumerate(lengths):
        if L + new_tokens > room:
            raise KVCacheError(f"sequence {b}: {L} cached + {new_tokens} new tokens do not fit in {room} slots"
                               + (" (page_table's pages x page_size)" if page_table is not None else ""))
        if page_table is not None and L + new_tokens:
            used = page_table[b, : -(-(L + new_tokens) // page)]
            if bool(((used < 0) | (used >= k_cache.slots)).any()):
                raise KVCacheError(f"sequence {b}: page_table holds a page index outside 0..{k_cache.slots - 1}: "
                                   f"{used.tolist()[:8]}")
    return lengths


# ------------------------------------------------------------------ split-KV -----

# The split rule's constants (the planner records them with the choice for common shapes).
MIN_TILES_PER_SPLIT = 2  # each split reads at least 2 key tiles: its partial costs one (rows x D) fp32 write
MAX_SPLITS = 64
SPLIT_EFFICIENCY = 0.9  # the fewest splits whose wave efficiency is within 90 % of the best
CTAS_PER_SM = 2  # the decode CTAs an SM is given at once: each hides the other's load latency


def split_count(ctas: int, key_tiles: int, sm_count: int) -> int:
    """Flash-decoding's split of the keys: ``ctas`` (batch x KV heads x row tiles) each read
    ``key_tiles`` tiles; with s splits there are ctas * s CTAs over sm_count x CTAS_PER_SM
    slots, filled in waves. The wave efficiency of s is ctas s / (slots ceil(ctas s / slots));
    the rule takes the fewest splits (at most MAX_SPLITS, each with at least MIN_TILES_PER_SPLIT
    tiles) whose efficiency is within SPLIT_EFFICIENCY of the best one, and 1 when the CTAs
    alone fill every slot.

    Why two slots per SM: a decode CTA walks its tiles one after another, so while it waits on
    a tile's loads (or computes) its SM idles unless a second CTA is there; every sm90a
    decode variant's 128 threads fit twice in the register file (255 registers at most), and
    a CTA too big for two in SMEM only runs the extra wave after the first. Why the fewest:
    each split adds a (rows x D) fp32 partial write and read to the combine, and splits
    beyond the slots only cut the key runs shorter."""
    if ctas <= 0 or key_tiles <= 0:
        return 1
    most = max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT))
    slots = sm_count * CTAS_PER_SM
    if ctas >= slots or most == 1:
        return 1

    def eff(s):
        n = ctas * s
        return n / (slots * -(-n // slots))

    best = max(eff(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if eff(s) >= SPLIT_EFFICIENCY * best)


def split_tiles(key_tiles: int, num_splits: int) -> list[range]:
    """The key tiles of each split: contiguous runs of ceil(tiles / splits) (the last ones may
    be short or empty)."""
    per = max(1, -(-key_tiles // num_splits))
    return [range(min(key_tiles, s * per), min(key_tiles, (s + 1) * per)) for s in range(num_splits)]


def combine(o_parts: torch.Tensor, lse_parts: torch.Tensor, sink: Optional[torch.Tensor] = None):
    """The combine of split-KV partials: ``o_parts`` (S, ..., D) normalized partial outputs,
    ``lse_parts`` (S, ...) their log2-unit LSEs (-inf for a split that saw no key); ``sink``
    (...) a log2-unit sink logit (a term without a value row). With M = max lse_s and
    w_s = 2^(lse_s - M): o = sum_s w_s o_s / sum_s w_s, lse = M + log2(sum_s w_s); no key and
    no sink: o = 0, lse = -inf. Returns (o (..., D), lse2 (...))."""
    lse_all = lse_parts if sink is None else torch.cat([lse_parts, sink[None]], 0)
    m = lse_all.amax(0)
    m_s = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp2(lse_parts - m_s)
    l = w.sum(0)
    if sink is not None:
        l = l + torch.exp2(sink - m_s)
    empty = l == 0
    o = (w[..., None] * o_parts).sum(0) / torch.where(empty, torch.ones_like(l), l)[..., None]
    o = torch.where(empty[..., None], torch.zeros_like(o), o)
    lse = torch.where(empty, torch.full_like(l, float("-inf")), m_s + torch.log2(torch.where(empty, torch.ones_like(l), l)))
    return o, lse


def _partial(st, p_fn, running_max: bool, fixed_m, lse_shift: float, tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """One split: ref._tile_loop over the key tiles ``tiles`` (starts), all query
    rows -> (o (B, H, Sq, D) = acc / l, lse2 (B, H, Sq) = m + log2 l - shift; -inf when l = 0)."""
    acc, l, m = ref._tile_loop(st, 0, st.Sq, tiles, p_fn, running_max, fixed_m)
    m_s = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    empty = l == 0
    l1 = torch.where(empty, torch.ones_like(l), l)
    o = torch.where(empty[..., None], torch.zeros_like(acc), acc / l1[..., None])
    lse2 = torch.where(empty, torch.full_like(l, float("-inf")), m_s + torch.log2(l1) - lse_shift)
    return o, lse2


def _inner_spec(spec: KernelSpec) -> KernelSpec:
    """The spec the reference's tile loop runs on gathered cache rows: K and V in fp32 (they
    enter exactly as the cache stores them), no kv_cache block."""
    fp32 = OperandFormat(Format.FP32)
    return replace(spec, k=fp32, v=fp32, kv_cache=None)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: KernelSpec, *, num_splits: int = 1,
           sinks: Optional[torch.Tensor] = None):
    """One sequence's decode: q (1, Sq, H, D), k and v (1, L, Hkv, D) float32 as the cache holds
    them -> (o (1, Sq, H, D) float32 rounded to O's format, lse (1, H, Sq) natural log), by
    ``num_splits`` splits of the key tiles and ``combine`` (the sink joins the combine)."""
    inner = _inner_spec(spec)
    st = ref._Prepared(q, k, v, inner)
    sink = ref._check_sinks(sinks, inner, st.H, st.device)
    p_fn, running_max, lse_shift = ref._p_method(inner)
    fixed_m = None if running_max else ref._guard_refs(st, inner)
    visible = list(st.key_tiles(0, st.Sq))  # tiles some row sees (the mask's span)
    n_tiles = -(-st.Sk // st.tile_n)
    parts = []
    for run in split_tiles(n_tiles, max(1, num_splits)):
        tiles = [c0 for c0 in visible if c0 // st.tile_n in run]
        parts.append(_partial(st, p_fn, running_max, fixed_m, lse_shift, tiles))
    o_parts = torch.stack([p[0] for p in parts])
    lse_parts = torch.stack([p[1] for p in parts])
    sink2 = None if sink is None else (sink * dp.LOG2E)[None, :, None].expand_as(lse_parts[0])
    o, lse2 = combine(o_parts, lse_parts, sink2)
    o = ref._round_out(o.permute(0, 2, 1, 3), inner.o).contiguous()
    return o, lse2 * LN2


def append(k_cache: CacheTensor, v_cache: CacheTensor, lengths: list[int], page_table, k_new, v_new) -> None:
    """Write k_new, v_new (B, Sn, Hkv, D) at positions lengths[b] .. lengths[b] + Sn - 1 of each
    sequence, quantized into the caches' formats (in place)."""
    B, Sn = k_new.shape[0], k_new.shape[1]
    ends = [L + Sn for L in lengths]
    for b, (rows, cols) in enumerate(token_slots(ends, k_cache.page, page_table, k_cache.slots, k_cache.device)):
        rows, cols = rows[lengths[b]:], cols[lengths[b]:]
        k_cache.write(rows, cols, k_new[b])
        v_cache.write(rows, cols, v_new[b])


def gather(cache: CacheTensor, lengths: list[int], page_table) -> list[torch.Tensor]:
    """Each sequence's tokens, float32 (1, L, Hkv, D), exactly as stored."""
    return [cache.read(rows, cols)[None]
            for rows, cols in token_slots(lengths, cache.page, page_table, cache.slots, cache.device)]


def decode(q: torch.Tensor, k_cache: CacheTensor, v_cache: CacheTensor, lengths: list[int], spec: KernelSpec, *,
           page_table: Optional[torch.Tensor] = None, k_new: Optional[torch.Tensor] = None,
           v_new: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
           num_splits=1):
    """Decode on the reference backend: append k_new/v_new (B, Sn, Hkv, D) after ``lengths``
    (checked by ``check_layout``), then attend q (B, Sq, H, D) to each sequence's
    lengths[b] + Sn keys (masks bottom-right aligned: the last query sees the last key).
    ``num_splits``: an int, or a callable (key tiles of the sequence) -> int. Returns
    (o (B, Sq, H, D) float32, lse (B, H, Sq) float32)."""
    B, Sq, H, D = q.shape
    Sn = 0
    if k_new is not None:
        append(k_cache, v_cache, lengths, page_table, k_new, v_new)
        Sn = k_new.shape[1]
    ends = [L + Sn for L in lengths]
    ks, vs = gather(k_cache, ends, page_table), gather(v_cache, ends, page_table)
    o = torch.zeros(B, Sq, H, D, device=q.device)
    lse = torch.full((B, H, Sq), float("-inf"), device=q.device)
    tile_n = spec.schedule.tile_n
    for b in range(B):
        n = num_splits(-(-ends[b] // tile_n)) if callable(num_splits) else num_splits
        ob, lb = attend(q[b:b + 1], ks[b], vs[b], spec, num_splits=n, sinks=sinks)
        o[b], lse[b] = ob[0], lb[0]
    return o, lse
