"""Masking of one score tile: keys past the sequence end, and causal.

Causal here means key j is visible to query i iff j <= i + causal_offset
(offset 0: top-left aligned, as torch's ``is_causal``; Sk - Sq: bottom-right).
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
):
    """Set masked scores to -inf. ``coords``: (row, col) in the tile of each element."""
    s_mn = acc_mn(acc_s)
    c_mn = acc_mn(coords)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        limit = seqlen_k - col0
        if cutlass.const_expr(causal):
            limit = cutlass.min(limit, row0 + c_mn[r, 0][0] + 1 + causal_offset - col0)
        for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            if c_mn[0, j][1] >= limit:
                s_mn[r, j] = -Float32.inf
