"""Register views of Hopper wgmma fragments.

A wgmma accumulator of an m64nN tile is held per thread as ``((2, 2, N/8), M, N)``:
(column pair, row half (+8), 8-column chunk). Thread ``t`` of a warp owns rows
``t/4`` and ``t/4 + 8`` of its warp's 16 rows, columns ``8j + 2(t%4) + {0,1}``.
``acc_mn`` re-indexes that as (rows, cols) for row-wise softmax.

The PV product reads P as the A operand from registers:

- BF16 (k16 atoms): the A register order equals the accumulator order, so P is
  written through an accumulator-shaped view of the A fragment.
- FP8 (k32 atoms): each A register holds 4 consecutive k of one row, which a
  thread does not own in the accumulator. Instead of shuffling between threads,
  we pick, for each A byte slot, a score the thread *does* own in the same row,
  and permute V's keys to match (``FP8_P_KEY_PERM``): free in registers, one
  gather on V when it is quantized.
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Uint32

from . import ptx


def _mn_layout(layout):
    shp, st = layout.shape, layout.stride
    if len(shp[0]) == 2:  # an n8 accumulator has no chunk mode: ((2, 2), M, N)
        shp = ((shp[0][0], shp[0][1], 1),) + tuple(shp[1:])
        st = ((st[0][0], st[0][1], 0),) + tuple(st[1:])
    # ((2, 2, V), M, N) -> ((row half, M), (col pair, V, N))
    return cute.make_layout(
        ((shp[0][1], shp[1]), (shp[0][0], shp[0][2], shp[2])),
        stride=((st[0][1], st[1]), (st[0][0], st[0][2], st[2])),
    )


def acc_mn(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of a wgmma accumulator (same registers)."""
    return cute.make_tensor(acc.iterator, _mn_layout(acc.layout))


# FP8 PV: A-operand slot p (0..31 within each 32-key block) holds the score of key
# FP8_P_KEY_PERM[p] of that block. V^T (D, S) must be stored with column 32b + p
# holding key 32b + FP8_P_KEY_PERM[p].
def _fp8_perm():
    perm = []
    for p in range(32):
        kh, q, i = p // 16, (p % 16) // 4, p % 4
        perm.append(16 * kh + 8 * (i >> 1) + 2 * q + (i & 1))
    return tuple(perm)


FP8_P_KEY_PERM = _fp8_perm()


# FP8 dQ = dS K (backward): position p (0..31 within each 32-key group) of K^T holds key
# FP8_DS_KEY_PERM[p] of that group. The backward stores FP8 dS from the wgmma accumulator
# with ``stmatrix ... .trans.b16``, whose 16-bit units must come from one thread; a thread
# holds accumulator rows (keys) r and r + 8, so its packed pair puts key r + 8 right after
# key r within every 16 keys (0, 8, 1, 9, ..., 7, 15), and K^T, the B operand of dQ = dS K,
# must have its keys in that order.
FP8_DS_KEY_PERM = tuple(16 * (p // 16) + (p % 16) // 2 + 8 * (p % 2) for p in range(32))


def store_p_bf16(acc_s: cute.Tensor, frg_p: cute.Tensor):
    """P (fp32 in the accumulator) -> BF16 A fragment; register orders coincide."""
    as_acc = cute.make_tensor(frg_p.iterator, acc_s.layout)
    as_acc.store(acc_s.load().to(frg_p.element_type))


def pack_p_fp8(acc_s: cute.Tensor, frg_p: cute.Tensor, codes_in_low_byte: bool):
    """Fill the FP8 A fragment of PV from one thread's scores (permuted keys).

    ``codes_in_low_byte``: the accumulator already holds E4M3 codes in the low
    byte of each word (Direct-P); otherwise it holds fp32 values that are
    converted with round-to-nearest-even, saturating (cvt ...e4m3x2).
    A word w = rh + 2*kh + 4*kb takes, for byte i, the accumulator element
    (col pair i&1, row half rh, chunk 4kb + 2kh + (i>>1)).
    """
    words = cute.recast_tensor(frg_p, Uint32)
    n_kb = cute.size(acc_s) // 16
    for kb in range(n_kb):
        for kh in range(2):
            for rh in range(2):
                src = [
                    (i & 1) + 2 * rh + 4 * (4 * kb + 2 * kh + (i >> 1)) for i in range(4)
                ]
                if codes_in_low_byte:
                    words[rh + 2 * kh + 4 * kb] = ptx.pack_low_bytes4(
                        ptx.f32_as_u32(acc_s[src[0]]),
                        ptx.f32_as_u32(acc_s[src[1]]),
                        ptx.f32_as_u32(acc_s[src[2]]),
                        ptx.f32_as_u32(acc_s[src[3]]),
                    )
                else:
                    words[rh + 2 * kh + 4 * kb] = ptx.cvt_e4m3x4(
                        acc_s[src[0]], acc_s[src[1]], acc_s[src[2]], acc_s[src[3]]
                    )
