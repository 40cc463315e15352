"""Host steps every attention backward shares, whatever its target (sm100_bwd_host, sm90_bwd_host).

The torch preprocessing (the arithmetic of ``fp4gen.device.bwd_prep``'s fused kernel, which the
sm100a backward and the sm90a host tests on CPU tensors use), the per-query-head dK/dV outputs
and their GQA sums. Importing this module imports only the standard library; torch is imported
where it is used.
"""
from __future__ import annotations

import math


def preprocess_torch(o, do, lse, sqp: int):
    """LSE in log2 units (+inf where the forward saw no key, so P = 0), D_i = rowsum(dO * O) and a
    zeroed fp32 dQ accumulator, each padded to ``sqp`` query rows (whole query tiles)."""
    import torch

    B, Sq, H, D = do.shape
    f32, dev = torch.float32, do.device
    lse2 = torch.full((B, H, sqp), float("inf"), dtype=f32, device=dev)
    l2 = lse.to(f32) * math.log2(math.e)
    lse2[:, :, :Sq] = torch.where(torch.isneginf(l2), torch.full_like(l2, float("inf")), l2)
    dsum = torch.zeros((B, H, sqp), dtype=f32, device=dev)
    dsum[:, :, :Sq] = (do.to(f32) * o.to(f32)).sum(-1).permute(0, 2, 1)
    dq_acc = torch.zeros((B, H, sqp, D), dtype=f32, device=dev)
    return lse2, dsum, dq_acc


def dkv_per_query_head(k, heads: int):
    """The kernel's dK and dV outputs, (B, Sk, heads, D): fp32 under GQA (summed over each
    group by ``gqa_sum``), else in K's dtype, written directly."""
    import torch

    B, Sk, Hkv, D = k.shape
    dtype = torch.float32 if heads > Hkv else k.dtype
    return (torch.empty((B, Sk, heads, D), dtype=dtype, device=k.device),
            torch.empty((B, Sk, heads, D), dtype=dtype, device=k.device))


def gqa_sum(dk_h, dv_h, k, v):
    """dK, dV per key/value head: the query heads of a group share one (a no-op without GQA)."""
    B, Sk, H, D = dk_h.shape
    Hkv = k.shape[2]
    if H == Hkv:
        return dk_h, dv_h
    g = H // Hkv
    return (dk_h.view(B, Sk, Hkv, g, D).sum(3).to(k.dtype),
            dv_h.view(B, Sk, Hkv, g, D).sum(3).to(v.dtype))
