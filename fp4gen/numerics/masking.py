"""Which keys each query row sees, softcap, and varlen segments: the one home of these rules
for the reference backend (``reference.py``) and the float64 oracle (``exact.py``).

The conventions are FlashAttention's (``flash_attn_func(..., causal, window_size, softcap)``):

- ``window = (left, right)``, -1 = unbounded: query i of Sq sees key j of Sk iff
  ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (aligned bottom-right, so that the last
  query sees the last key; causal is (-1, 0)). With varlen the alignment is per sequence.
- ``softcap c > 0``: a scaled score s becomes ``c * tanh(s / c)`` before the softmax.
- varlen: sequence b holds query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key rows
  ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of the packed (total_tokens, H, D) tensors.
"""
from __future__ import annotations

from typing import Optional

import torch

Window = tuple[int, int]
NO_WINDOW: Window = (-1, -1)


def allowed(rows: torch.Tensor, cols: torch.Tensor, sq: int, sk: int, window: Window) -> torch.Tensor:
    """(len(rows), len(cols)) bool: which keys ``cols`` each query row of ``rows`` sees."""
    left, right = window
    diag = rows[:, None] + (sk - sq)  # the key on each row's diagonal
    ok = torch.ones(rows.numel(), cols.numel(), dtype=torch.bool, device=rows.device)
    if right >= 0:
        ok &= cols[None, :] <= diag + right
    if left >= 0:
        ok &= cols[None, :] >= diag - left
    return ok


def key_span(r0: int, r1: int, sq: int, sk: int, window: Window) -> tuple[int, int]:
    """[first, last) keys that some row of r0:r1 sees (empty when first >= last): the key
    tiles outside it are skipped, as a kernel skips fully masked tiles."""
    left, right = window
    first = 0 if left < 0 else max(0, r0 + sk - sq - left)
    last = sk if right < 0 else min(sk, r1 - 1 + sk - sq + right + 1)
    return first, max(first, last)


def is_masked(window: Window) -> bool:
    return tuple(window) != NO_WINDOW


def check_window(who: str, window) -> Window:
    """``window`` as two ints, each -1 or >= 0; ValueError naming ``who`` otherwise."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"{who}: window_size must be a pair (left, right), got {window!r}") from None
    for name, x in (("left", left), ("right", right)):
        if isinstance(x, bool) or not isinstance(x, int) or x < -1:
            raise ValueError(f"{who}: window_size {name} must be -1 (unbounded) or an int >= 0, got {x!r}")
    return int(left), int(right)


def softcap(s: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(s / cap)`` (``s`` unchanged for cap 0); -inf stays -inf."""
    return s if not cap else cap * torch.tanh(s / cap)


def softcap_grad(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """d(capped)/d(s) from the capped score: ``1 - tanh^2 = 1 - (capped / cap)^2``; 0 where the
    score was masked (-inf), so that a masked entry's zero dS stays zero (not NaN)."""
    g = 1.0 - (capped / cap) ** 2
    return torch.where(torch.isfinite(capped), g, torch.zeros_like(g))


def check_offset_tensors(cu_seqlens_q, cu_seqlens_k, who: str = "varlen attention") -> None:
    """What ``segments`` checks of the offsets without reading them: 1-D int32/int64 tensors of
    one length B + 1 >= 2 (ValueError naming ``who`` otherwise). Shapes only: no host sync."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{who}: {name} must be a 1-D int32 tensor of B + 1 offsets, got {got}")
        if cu.numel() < 2:
            raise ValueError(f"{who}: {name} holds {cu.numel()} offset(s); B sequences need B + 1 >= 2")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{who}: cu_seqlens_q has {cu_seqlens_q.numel()} offsets and cu_seqlens_k "
                         f"{cu_seqlens_k.numel()}: one per sequence boundary in both")


def offsets_valid(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int, *,
                  max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None) -> torch.Tensor:
    """A 0-d bool tensor on the offsets' device: True iff ``segments`` would accept these offsets
    (given ``check_offset_tensors`` passed). Computed by torch ops on the device, never read to
    the host, so a GPU caller can act on it without a sync (``torch.where``)."""
    c = torch.stack((cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)))  # (2, B + 1)
    lens = c[:, 1:] - c[:, :-1]
    ok = (c[:, 0] == 0).all() & (c[0, -1] == total_q) & (c[1, -1] == total_k) & (lens.amin() >= 0)
    if max_seqlen_q is not None:
        ok = ok & (lens[0].amax() <= max_seqlen_q)
    if max_seqlen_k is not None:
        ok = ok & (lens[1].amax() <= max_seqlen_k)
    return ok


def segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int, *,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
             who: str = "varlen attention") -> list[tuple[int, int, int, int]]:
    """[(q0, q1, k0, k1)] per sequence from the cumulative lengths, checked: 1-D integer
    tensors of one length B + 1 >= 2 (``check_offset_tensors``), starting at 0, non-decreasing,
    ending at the packed tensors' token counts, and no sequence longer than ``max_seqlen_*``
    (when given). Reads the offsets to the host (``.tolist()``: a sync for GPU tensors; a
    launcher that must not sync checks with ``offsets_valid`` instead)."""
    check_offset_tensors(cu_seqlens_q, cu_seqlens_k, who)
    bounds = []
    for name, cu, total, mx in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        c = [int(x) for x in cu.tolist()]
        if c[0] != 0 or any(b < a for a, b in zip(c, c[1:])):
            raise ValueError(f"{who}: {name} must start at 0 and never decrease, got {c[:8]}{'...' * (len(c) > 8)}")
        if c[-1] != total:
            raise ValueError(f"{who}: {name} ends at {c[-1]}, but the packed tensor has {total} tokens")
        longest = max(b - a for a, b in zip(c, c[1:]))
        if mx is not None and longest > mx:
            raise ValueError(f"{who}: a sequence has {longest} tokens, more than max_seqlen_{name[-1]}={mx}")
        bounds.append(c)
    cq, ck = bounds
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]
