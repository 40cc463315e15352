"""Operator accuracy of a spec's numerics against float64 attention.

    from fp4gen.numerics.accuracy import report
    report(spec, seqlen=1024, heads=4, batch=1, seed=0, head_dim=None, device="cpu")

Inputs: q, k, v i.i.d. standard normal (float32, torch.Generator seeded with
``seed``), shape (batch, seqlen, heads, head_dim); for a backward spec dO is
standard normal too. The exact reference is float64 softmax attention of the
*unquantized* inputs (and its analytic gradients), so the numbers include
every quantization the spec asks for.

    python -m fp4gen.numerics.accuracy --table [--seqlen 1024 --heads 4 --seed 0]

prints the recipe table of docs/numerics.md.
"""
from __future__ import annotations

import argparse
import sys

import torch

from fp4gen.ir.spec import (DirectPPolicy, Format, Guard, KernelSpec, Mask,
                            OperandFormat, PKind, PProduction, ScaleGranularity, Target,
                            default_operand_format)

from . import reference


# The float64 oracle takes the query rows a block at a time so that its score matrix
# (and the few temporaries of the same shape the softmax and the gradients make) stays
# near this size whatever S is: a whole S = 8192 score matrix alone is 512 MiB.
ORACLE_BLOCK_BYTES = 16 << 20


def exact_attention(q, k, v, scale: float, causal: bool, do=None, *, row_block=None):
    """float64 attention (and gradients when ``do`` is given), one (b, h) and one block of
    ``row_block`` query rows at a time (default: ``ORACLE_BLOCK_BYTES`` of scores)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    rb = row_block or max(1, ORACLE_BLOCK_BYTES // (8 * max(1, Sk)))
    q, k, v = (x.to(torch.float64) for x in (q, k, v))
    o = torch.zeros(B, Sq, H, D, dtype=torch.float64)
    lse = torch.zeros(B, H, Sq, dtype=torch.float64)
    grads = None
    if do is not None:
        do = do.to(torch.float64)
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    cols = torch.arange(Sk)[None, :]
    for b in range(B):
        for h in range(H):
            kh = h // g
            kb, vb = k[b, :, kh], v[b, :, kh]
            for r0 in range(0, Sq, rb):
                r = slice(r0, min(Sq, r0 + rb))
                s = (q[b, r, h] @ kb.T) * scale
                if causal:
                    rows = torch.arange(r.start, r.stop)[:, None]
                    s = s.masked_fill(cols > rows + Sk - Sq, float("-inf"))
                mx = s.amax(-1, keepdim=True)
                mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)
                e = torch.exp(s - mx)
                l = e.sum(-1, keepdim=True)
                p = torch.where(l > 0, e / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(e))
                o[b, r, h] = p @ vb
                lse[b, h, r] = torch.where(l[:, 0] > 0, (mx + torch.log(l))[:, 0],
                                           torch.full_like(l[:, 0], float("-inf")))
                if do is not None:
                    dob = do[b, r, h]
                    dsum = (dob * o[b, r, h]).sum(-1, keepdim=True)
                    ds = p * (dob @ vb.T - dsum)
                    grads[0][b, r, h] = ds @ kb * scale
                    grads[1][b, :, kh] += ds.T @ q[b, r, h] * scale
                    grads[2][b, :, kh] += p.T @ dob
    return o, lse, grads


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    x = x.to(torch.float64).flatten()
    r = ref.to(torch.float64).flatten()
    cos = float((x @ r) / (x.norm() * r.norm()))
    rel = float((x - r).norm() / r.norm())
    return {"cosine": cos, "rel_l2": rel, "max_abs": float((x - r).abs().max())}


def row_cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over (b, s, h) rows of the cosine between output vectors."""
    x = x.to(torch.float64)
    r = ref.to(torch.float64)
    c = (x * r).sum(-1) / (x.norm(dim=-1) * r.norm(dim=-1)).clamp_min(1e-300)
    return float(c.mean())


def report(spec: KernelSpec, seqlen: int = 1024, heads: int = 4, batch: int = 1, seed: int = 0,
           head_dim=None, device="cpu") -> dict:
    D = head_dim or spec.head_dim
    if head_dim is not None and head_dim != spec.head_dim:
        from dataclasses import replace
        spec = replace(spec, head_dim=head_dim)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seqlen, heads, D)
    q, k, v, do = (torch.randn(shape, generator=gen) for _ in range(4))
    causal = spec.mask is Mask.CAUSAL
    o, lse = reference.forward(q.to(device), k.to(device), v.to(device), spec)
    o_ref, lse_ref, grads = exact_attention(q, k, v, spec.scale, causal,
                                            do if spec.backward is not None else None)
    out = {"kernel": spec.name, "target": spec.target.value}
    out.update(compare(o.cpu(), o_ref))
    out["mean_row_cosine"] = row_cosine(o.cpu(), o_ref)
    fin = torch.isfinite(lse_ref)
    out["lse_max_abs"] = float((lse.cpu().double()[fin] - lse_ref[fin]).abs().max()) if fin.any() else 0.0
    if spec.backward is not None:
        dq, dk, dv = reference.backward(q.to(device), k.to(device), v.to(device), o, lse,
                                        do.to(device), spec)
        for name, x, r in (("dq", dq, grads[0]), ("dk", dk, grads[1]), ("dv", dv, grads[2])):
            c = compare(x.cpu(), r)
            out[f"{name}_cosine"] = c["cosine"]
            out[f"{name}_rel_l2"] = c["rel_l2"]
    return out


# ------------------------------------------------------------- recipes -----

def _fmt(name: str) -> OperandFormat:
    return default_operand_format(Format(name))


FP8_BLOCK = OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 128, Format.FP32)
FP8_TENSOR = OperandFormat(Format.FP8E4M3, ScaleGranularity.TENSOR, None, Format.FP32)


def recipes(head_dim: int = 128, causal: bool = False) -> list[KernelSpec]:
    """The table's recipes, built in code (the spec parser is not needed)."""
    mask = Mask.CAUSAL if causal else Mask.NONE
    nv, mx, bf = _fmt("nvfp4"), _fmt("mxfp4"), _fmt("bf16")

    def mk(name, target, q, k, p, v, pp=PProduction(), guard=Guard()):
        return KernelSpec(name=name, target=target, head_dim=head_dim, mask=mask, q=q, k=k, p=p,
                          v=v, o=bf, p_production=pp, guard=guard)

    fast = PProduction(PKind.DIRECT_P, DirectPPolicy.FAST, 1.50, 1.20)
    acc = PProduction(PKind.DIRECT_P, DirectPPolicy.ACCURATE)
    return [
        mk("NV/MX fast (Direct-P)", Target.SM100A, nv, nv, mx, mx, fast),
        mk("NV/MX accurate (Direct-P)", Target.SM100A, nv, nv, mx, mx, acc),
        mk("NV/MX exp", Target.SM100A, nv, nv, mx, mx),
        mk("NV/FP8 (FP8 P/V, exp)", Target.SM100A, nv, nv, FP8_TENSOR, FP8_TENSOR),
        mk("NV/NV (exp)", Target.SM100A, nv, nv, nv, nv),
        mk("SageAttention3-like (two-level P)", Target.SM100A, nv, nv, nv, nv,
           PProduction(PKind.TWO_LEVEL)),
        mk("FP8 Direct-P sm90", Target.SM90A, FP8_BLOCK, FP8_BLOCK, FP8_TENSOR, FP8_TENSOR,
           PProduction(PKind.DIRECT_P)),
        mk("FP8 exp sm90", Target.SM90A, FP8_BLOCK, FP8_BLOCK, FP8_TENSOR, FP8_TENSOR),
        mk("BF16", Target.REFERENCE, bf, bf, bf, bf),
    ]


def table(seqlen=1024, heads=4, batch=1, seed=0, head_dim=128, causal=False) -> list[dict]:
    return [report(s, seqlen, heads, batch, seed) for s in recipes(head_dim, causal)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4gen.numerics.accuracy",
                                 description="operator accuracy of the recipe table vs float64")
    ap.add_argument("--table", action="store_true", help="print the recipe table (markdown)")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args(argv)
    if not a.table:
        ap.print_help()
        return 2
    rows = table(a.seqlen, a.heads, a.batch, a.seed, a.head_dim, a.causal)
    print(f"inputs: q,k,v ~ N(0,1) float32, B={a.batch} S={a.seqlen} H={a.heads} D={a.head_dim} "
          f"seed={a.seed} {'causal' if a.causal else 'non-causal'}, softmax_scale=1/sqrt(D); "
          "reference: float64 attention of the unquantized inputs")
    print("| recipe | target | cosine | mean row cosine | rel-L2 | max abs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['target']} | {r['cosine']:.4f} | {r['mean_row_cosine']:.4f} "
              f"| {r['rel_l2']:.4f} | {r['max_abs']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
