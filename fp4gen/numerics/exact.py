"""Exact attention in float64, with every mask rule of ``masking.py`` and sinks: the oracle
the reference backend (``reference.py``) and the kernels are measured against.

    o, lse = attention(q, k, v, scale=0.125, window=(128, 0), softcap=30.0, sinks=s)
    o, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=0.125)

Plain torch on float64 copies of the inputs, the whole score matrix at once (for tests and
small checks), differentiable by torch.autograd in q, k, v and sinks. Shapes: q (B, Sq, H, D),
k and v (B, Sk, Hkv, D) with H % Hkv == 0; o (B, Sq, H, D) float64; lse (B, H, Sq) float64,
natural log of each row's softmax denominator in the units of the scaled (and capped) scores,
the sink term included. Varlen: (total, H, D) inputs, o (total_q, H, D), lse (H, total_q).

A row that sees no key has o = 0 and lse = -inf (with sinks: lse = the sink logit, o = 0),
and no NaN, in the values or the gradients.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import masking


def attention(q, k, v, *, scale: float, window=masking.NO_WINDOW, softcap: float = 0.0,
              sinks: Optional[torch.Tensor] = None):
    """Dense float64 attention -> (o, lse); see the module docstring."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    q64, k64, v64 = (x.to(torch.float64) for x in (q, k, v))
    ke = k64.repeat_interleave(g, dim=2) if g > 1 else k64
    ve = v64.repeat_interleave(g, dim=2) if g > 1 else v64
    s = torch.einsum("bqhd,bkhd->bhqk", q64, ke) * scale
    s = masking.softcap(s, softcap)
    ok = masking.allowed(torch.arange(Sq, device=q.device), torch.arange(Sk, device=q.device), Sq, Sk, window)
    s = s.masked_fill(~ok, float("-inf"))
    m = s.amax(-1) if Sk else torch.full((B, H, Sq), float("-inf"), dtype=torch.float64, device=q.device)
    sink = None
    if sinks is not None:
        sink = sinks.to(torch.float64)[None, :, None].expand(B, H, Sq)
        m = torch.maximum(m, sink)
    # the row max only keeps exp() in range: constant for autograd (lse and o do not depend on it)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m[..., None])
    l = e.sum(-1)
    if sink is not None:
        l = l + torch.exp(sink - m)
    seen = l > 0
    l_safe = torch.where(seen, l, torch.ones_like(l))
    p = e / l_safe[..., None]
    o = torch.einsum("bhqk,bkhd->bqhd", p, ve)
    lse = torch.where(seen, m + torch.log(l_safe), torch.full_like(l, float("-inf")))
    return o, lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale: float, window=masking.NO_WINDOW,
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None):
    """Packed sequences -> (o (total_q, H, D), lse (H, total_q)): ``attention`` per sequence,
    each aligned on its own (bottom-right) diagonal."""
    H, D = q.shape[1], q.shape[2]
    outs, lses = [], []
    for q0, q1, k0, k1 in masking.segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]):
        if q1 == q0:
            continue
        o, lse = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale=scale, window=window,
                           softcap=softcap, sinks=sinks)
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:
        return q.new_zeros(0, H, D, dtype=torch.float64), q.new_zeros(H, 0, dtype=torch.float64)
    return torch.cat(outs, 0), torch.cat(lses, 1)
