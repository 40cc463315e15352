"""plan_decode(plan): the decode plan of a ``kv_cache`` spec (issue 22).

Decode reads a long cache for a few query rows, so it is bound by HBM, not by the tensor
cores. What the plan decides:

- **row packing**: the ``gqa`` query heads that share a KV head, times ``q_tokens``, are the
  rows of one tile, so one read of a K/V tile serves all of them (and a wgmma M of 64 is
  filled by gqa 8 x q_tokens 8, or padded for fewer).
- **split-KV** (flash-decoding): with batch x KV heads CTAs too few to fill the SMs, each
  sequence's key tiles are cut into ``splits`` contiguous runs, each CTA writes a partial
  (o, lse) and a combine merges them (``numerics.kvcache.split_count`` / ``combine``, the one
  home of the rule and the arithmetic; the plan records the constants and the choice for
  representative shapes, since batch and length are known only at run time).

The reference target and sm90a run a kv_cache spec (sm90a: the split-KV decode kernel,
``fp4gen.device.sm90.decode``, rendered by ``fp4gen.lowering.sm90_decode``, which refuses at
their spec lines what the kernel does not read yet); sm100a is refused at the ``kv_cache`` line.
"""
from __future__ import annotations

from dataclasses import replace

from fp4gen.numerics import kvcache as kv

from ..plan import DecodePlan, KernelPlan, PlanError, SplitChoice
from ..spec import KvStorage, Target

# The sm90a decode kernel's machine (the reference backend splits as it would, so that its
# results do not depend on where it runs).
SM_COUNT = 132
DEVICE = "H200 (132 SMs)"
# the copy bandwidth issue 22 quotes for the H200 (HBM3e peak is 4.8 TB/s)
HBM_BYTES_PER_S = 4.3e12
ROW_TILE = 64  # a wgmma M-mode
# representative shapes for the dump: (batch, kv_heads, cache length)
EXAMPLE_SHAPES = ((1, 8, 32768), (8, 8, 8192), (64, 8, 32768), (128, 8, 1024), (1, 8, 131072))


def split_choice(dp: DecodePlan, batch: int, kv_heads: int, cache_len: int) -> SplitChoice:
    """The split the rule picks for one shape, and the HBM-bound time of one cache read."""
    ctas = batch * kv_heads * dp.row_tiles
    tiles = -(-cache_len // dp.tile_n)
    splits = kv.split_count(ctas, tiles, dp.sm_count)
    nbytes = int(batch * kv_heads * cache_len * dp.cache_bytes_per_token)
    return SplitChoice(batch, kv_heads, cache_len, ctas, tiles, splits, nbytes,
                       round(nbytes / dp.hbm_bytes_per_s * 1e6, 1))


def plan_decode(plan: KernelPlan) -> KernelPlan:
    spec = plan.spec
    c = spec.kv_cache
    if c is None:
        return plan
    if spec.target not in (Target.REFERENCE, Target.SM90A):
        raise PlanError(f"kv_cache: {spec.target.value} has no decode kernel yet", spec.loc("kv_cache"),
                        ["target reference runs it (fp4gen.attention_with_kvcache), and target sm90a a bf16 "
                         "cache (docs/decode.md, issue 22)"])
    rows = c.q_tokens * c.gqa
    fmt = c.format
    per_token = 2 * fmt.bytes_per_token(spec.head_dim)  # K and V
    dp = DecodePlan(
        storage=c.storage.value, page_size=c.page_size if c.storage is KvStorage.PAGED else None,
        cache_format=str(fmt), q_tokens=c.q_tokens, gqa=c.gqa,
        rows_per_cta=rows, row_tile=ROW_TILE, row_tiles=-(-rows // ROW_TILE), tile_n=spec.schedule.tile_n,
        sm_count=SM_COUNT, device=DEVICE,
        split_rule=(f"splits = the fewest s <= min(max_splits, key_tiles // min_tiles_per_split) whose wave "
                    f"efficiency ctas*s / (slots*ceil(ctas*s / slots)), slots = {kv.CTAS_PER_SM} x sm_count "
                    "(two CTAs an SM hide each other's load latency), is within split_efficiency of the "
                    "best; 1 when ctas >= slots (numerics.kvcache.split_count)"),
        min_tiles_per_split=kv.MIN_TILES_PER_SPLIT, max_splits=kv.MAX_SPLITS, split_efficiency=kv.SPLIT_EFFICIENCY,
        combine=("each split s writes o_s = acc_s / l_s (fp32) and lse_s = m_s + log2 l_s; the combine takes "
                 "M = max_s lse_s, w_s = 2^(lse_s - M), o = sum w_s o_s / sum w_s, lse = M + log2 sum w_s "
                 "(a sink is one more term without a value row); numerics.kvcache.combine"),
        cache_bytes_per_token=per_token, hbm_bytes_per_s=HBM_BYTES_PER_S,
        notes=(f"rows: gqa {c.gqa} x q_tokens {c.q_tokens} = {rows} query rows per KV head, "
               f"{-(-rows // ROW_TILE)} tile(s) of {ROW_TILE}: one K/V read serves them all",
               "split partials: o (splits, batch, H, Sq, D) and lse (splits, batch, H, Sq) fp32"),
    )
    dp = replace(dp, examples=tuple(split_choice(dp, *s) for s in EXAMPLE_SHAPES))
    return replace(plan, decode=dp)
