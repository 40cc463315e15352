"""Masking of one score tile: keys past the sequence end, causal, and a sliding window.

Causal here means key j is visible to query i iff j <= i + causal_offset
(offset 0: top-left aligned, as torch's ``is_causal``; Sk - Sq: bottom-right).
A window (left, right) (fp4gen.numerics.masking, FlashAttention's ``window_size``; -1 =
unbounded side) means i + offset - left <= j <= i + offset + right, with the same offset.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .layout import acc_mn


@cute.jit
def apply(
    acc_s: cute.Tensor,
    coords: cute.Tensor,
    row0: Int32,
    col0: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    causal_offset: Int32,
    window: cutlass.Constexpr = None,
):
    """Set masked scores to -inf. ``coords``: (row, col) in the tile of each element.
    ``window``: (left, right) or None (then ``causal`` alone decides)."""
    s_mn = acc_mn(acc_s)
    c_mn = acc_mn(coords)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        limit = seqlen_k - col0
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, row0 + c_mn[r, 0][0] + 1 + causal_offset - col0)
        if cutlass.const_expr(window is None):
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if c_mn[0, j][1] >= limit:
                    s_mn[r, j] = -Float32.inf
        else:
            # columns (tile-relative) [lo, limit) are visible to this row
            diag = row0 + c_mn[r, 0][0] + causal_offset - col0
            lo = Int32(0)
            if cutlass.const_expr(window[1] >= 0):
                limit = cutlass.min(limit, diag + (window[1] + 1))
            if cutlass.const_expr(window[0] >= 0):
                lo = diag - window[0]
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if c_mn[0, j][1] >= limit:
                    s_mn[r, j] = -Float32.inf
                if c_mn[0, j][1] < lo:
                    s_mn[r, j] = -Float32.inf


@cute.jit
def apply_keys_by_queries(
    s_mn: cute.Tensor,
    c_mn: cute.Tensor,
    key0: Int32,
    q0: Int32,
    tile_keys: cutlass.Constexpr[int],
    tile_queries: cutlass.Constexpr[int],
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    causal_offset: Int32,
    window: cutlass.Constexpr = None,
    fill: cutlass.Constexpr = None,
):
    """The backward's transposed score tile S^T (rows keys, columns queries: ``s_mn`` and its
    (key, query) coordinates ``c_mn`` in (M, N) view, the tile at keys ``key0``, queries
    ``q0``): masked entries set to ``fill`` (None: -inf), with the rules above (keys past ``seqlen_k``,
    causal, or ``window`` (left, right)). Only a tile that crosses a bound is walked."""
    limit_row = seqlen_k - key0
    need_mask = key0 + tile_keys > seqlen_k
    if cutlass.const_expr(causal):
        need_mask = need_mask | (key0 + tile_keys - 1 > q0 + causal_offset)
    if cutlass.const_expr(window is not None and window[1] >= 0):
        need_mask = need_mask | (key0 + tile_keys - 1 > q0 + causal_offset + window[1])
    if cutlass.const_expr(window is not None and window[0] >= 0):
        need_mask = need_mask | (key0 < q0 + (tile_queries - 1) + causal_offset - window[0])
    if need_mask:
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            kr = c_mn[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                bad = kr >= limit_row
                if cutlass.const_expr(causal):
                    bad = bad | (key0 + kr > q0 + c_mn[0, j][1] + causal_offset)
                if cutlass.const_expr(window is not None and window[1] >= 0):
                    bad = bad | (key0 + kr > q0 + c_mn[0, j][1] + causal_offset + window[1])
                if cutlass.const_expr(window is not None and window[0] >= 0):
                    bad = bad | (key0 + kr < q0 + c_mn[0, j][1] + causal_offset - window[0])
                if bad:
                    if cutlass.const_expr(fill is None):
                        s_mn[r, j] = -Float32.inf
                    else:
                        s_mn[r, j] = Float32(fill)
