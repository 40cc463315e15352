"""Copy partitions shared by the sm100a forward (``forward.py``) and its unit kernels
(``selftest_kernels.py``), which must issue the forward's very copies.

- ``tma_part(atom, s, g, is_sf)``: the SMEM and global sides of a TMA load of one CTA (no
  multicast), modes 0-2 grouped; ``is_sf``: a scale-factor tile, whose broadcast (stride-0)
  modes are dropped.
- ``s2t_part(atom, s_sf, t_sf)`` / ``s2t(cp, stage)``: scale factors from SMEM to TMEM by
  ``tcgen05.cp``; the partition once, then one copy per SMEM stage.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05


@cute.jit
def tma_part(atom, s, g, is_sf: cutlass.Constexpr):
    ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                   cute.group_modes(s, 0, 3), cute.group_modes(g, 0, 3))
    if const_expr(is_sf):
        ts = cute.filter_zeros(ts)
        tg = cute.filter_zeros(tg)
    return ts, tg


def s2t_part(atom, s_sf, t_sf):
    """(tiled copy, SMEM descriptor source over the stages, TMEM destination)."""
    s_c = cute.filter_zeros(s_sf)
    t_c = cute.filter_zeros(t_sf)
    tiled = tcgen05.make_s2t_copy(atom, t_c)
    thr = tiled.get_slice(0)
    src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(s_c))
    return (tiled, src, thr.partition_D(t_c))


def s2t(cp, stage):
    tiled, src, dst = cp
    cute.copy(tiled, src[None, None, None, None, stage], dst)
