"""The sm90a split-KV decode kernel's configuration: plain values, no CuTe DSL import, so that
the lowering can build one and tests can read one without a GPU toolchain
(``fp4gen.device.sm90.decode`` is the kernel that runs with it, docs/decode.md the design)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# what the kernel reads; the spelling of str(CacheFormat)
CACHE_FORMATS = ("bf16", "fp8e4m3(scale=token)", "fp8e4m3(scale=tensor)", "nvfp4(block=16, scale=e4m3)",
                 "nvfp4(block=16, scale=e4m3, tensor_scale=fp32)")
ROW_TILE = 64  # query rows per CTA: gqa x q_tokens, padded
WARPS = 4  # one m16n8k16 MMA row block of 16 rows per warp
HEAD_DIMS = (64, 128)
TILE_NS = (64, 128)
MAX_KV_STAGES = 4  # the load ring's depth, at most (SMEM decides what fits: smem_bytes)
SMEM_LIMIT = 227 * 1024  # what Hopper gives one CTA
PAD = 8  # bf16 elements after each SMEM row of Q, K, V, P (device/sm90/decode.py: bank conflicts)


@dataclass(frozen=True)
class DecodeConfig:
    """Everything the sm90a decode kernel takes from its plan (fp4gen/lowering/sm90_decode.py:
    ``config``). The generated module renders one literal of this class; the kernel class and
    the host (fp4gen/runtime/sm90_decode_host.py) read only these values."""

    kernel_name: str  # the spec's kernel name: the prefix of every message
    head_dim: int  # 64 or 128
    causal: bool  # mask causal, bottom-right aligned (else no mask)
    cache_format: str  # one of CACHE_FORMATS
    paged: bool  # storage paged(page_size): K/V rows gathered through the page table
    page_size: Optional[int]  # tokens per page (paged), None for a contiguous cache
    q_tokens: int  # query tokens per sequence, at most (the spec's kv_cache q_tokens)
    gqa: int  # query heads per KV head
    tile_n: int  # keys per tile (the spec's schedule tile_n: the reference's split unit)
    # Fields with a default: a module renders them only when it sets them.
    kv_stages: int = 1  # K/V load stages: s keeps tiles t + 1 .. t + s - 1 in flight while t computes

    def __post_init__(self):
        name = self.kernel_name
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"{name}: the sm90a decode kernel takes head_dim {HEAD_DIMS}, not {self.head_dim}")
        if self.cache_format not in CACHE_FORMATS:
            raise ValueError(f"{name}: cache format {self.cache_format!r} is not one of {CACHE_FORMATS}")
        if self.tile_n not in TILE_NS:
            raise ValueError(f"{name}: tile_n must be one of {TILE_NS}, got {self.tile_n}")
        if not 1 <= self.q_tokens * self.gqa <= ROW_TILE:
            raise ValueError(f"{name}: q_tokens x gqa = {self.q_tokens * self.gqa} rows must fit one "
                             f"{ROW_TILE}-row tile")
        if not 1 <= self.kv_stages <= MAX_KV_STAGES:
            raise ValueError(f"{name}: kv_stages must be 1 to {MAX_KV_STAGES}, got {self.kv_stages}")
        if self.smem_bytes > SMEM_LIMIT:
            raise ValueError(f"{name}: kv_stages {self.kv_stages} needs {self.smem_bytes} bytes of SMEM with tile_n "
                             f"{self.tile_n}, D {self.head_dim} and a {self.cache_format} cache; a CTA has "
                             f"{SMEM_LIMIT} (fewer stages, or tile_n 64)")
        if self.paged != (self.page_size is not None):
            raise ValueError(f"{name}: page_size is set exactly when the cache is paged")
        if self.paged and (self.page_size < 1 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"{name}: page_size must be a power of two, got {self.page_size}")

    @property
    def rows(self) -> int:
        """The query rows a CTA holds (gqa x q_tokens; the rest of the 64-row tile is padding)."""
        return self.q_tokens * self.gqa

    @property
    def fp8(self) -> bool:
        """An E4M3 cache with fp32 scales."""
        return self.cache_format.startswith("fp8e4m3")

    @property
    def token_scale(self) -> bool:
        """An fp8 cache with one scale per token (else one per KV head)."""
        return self.cache_format == "fp8e4m3(scale=token)"

    @property
    def nvfp4(self) -> bool:
        """Packed E2M1 with E4M3 block scales (16 along D)."""
        return self.cache_format.startswith("nvfp4")

    @property
    def tensor_scale(self) -> bool:
        """An nvfp4 cache with the per-KV-head power of two g (two-level)."""
        return self.cache_format.endswith("tensor_scale=fp32)")

    @property
    def smem_bytes(self) -> int:
        """The kernel's SMEM (``DecodeKernel.shared_storage``, every field 128-byte aligned: an
        upper bound; tests compare): Q, K, V, P bf16 with padded rows, the ring's staging
        tiles and scales (a bf16 cache's K/V tiles are the ring itself)."""
        m, n, d, st = ROW_TILE, self.tile_n, self.head_dim, self.kv_stages
        up = lambda x: -(-x // 128) * 128  # noqa: E731
        kst = 1 if self.fp8 or self.nvfp4 else st
        parts = [m * (d + PAD) * 2, 2 * n * (d + PAD) * 2 * kst, m * (n + PAD) * 2]
        if self.fp8:
            parts += [n * d * st] * 2
        if self.nvfp4:
            parts += [n * d // 2 * st] * 2 + [n * d // 16 * 4 * st] * 2 + [64]
        if self.token_scale:
            parts += [n * 4 * st] * 2 + [m * (n + PAD) * 2]
        return sum(up(x) for x in parts)

    @property
    def num_threads(self) -> int:
        return 32 * WARPS
