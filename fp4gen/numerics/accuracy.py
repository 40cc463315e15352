"""Operator accuracy of a spec's numerics against float64 attention.

    from fp4gen.numerics.accuracy import report
    report(spec, seqlen=1024, heads=4, batch=1, seed=0, head_dim=None, device="cpu")

Inputs: q, k, v i.i.d. standard normal (float32, torch.Generator seeded with
``seed``), shape (batch, seqlen, heads, head_dim); for a backward spec dO is
standard normal too. The exact reference is float64 softmax attention of the
*unquantized* inputs (and its analytic gradients), so the numbers include
every quantization the spec asks for. The oracle applies the spec's mask (window sizes
included), softcap and sinks (``exact_attention``: ``exact.attention`` in bounded memory);
a ``sinks learned`` spec gets seeded per-head sink logits (``draw_sinks``), and a
``layout varlen`` spec runs on a seeded ragged batch (``ragged_lengths``, with an empty
sequence and one of length 1) against the oracle per sequence; the report lists both.

    python -m fp4gen.numerics.accuracy --table [--seqlen 1024 --heads 4 --seed 0]

prints the recipe table of docs/numerics.md;

    python -m fp4gen.numerics.accuracy --outliers [--seqlen 1024 --heads 2 --recipe NAME]

its outlier-case table (section 14); ``--isolate CASE`` the one-operand-at-a-time table there.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import replace

import torch

from fp4gen.ir.spec import (Backward, DirectPPolicy, Format, Guard, KernelSpec, Layout, Mask,
                            OperandFormat, PKind, PProduction, ScaleGranularity, Sinks, Target,
                            default_operand_format)

from . import masking, reference


# The float64 oracle takes the query rows a block at a time so that its score matrix
# (and the few temporaries of the same shape the softmax and the gradients make) stays
# near this size whatever S is: a whole S = 8192 score matrix alone is 512 MiB.
ORACLE_BLOCK_BYTES = 16 << 20


def exact_attention(q, k, v, scale: float, causal: bool = False, do=None, *, window=None,
                    softcap: float = 0.0, sinks=None, row_block=None):
    """float64 attention (and gradients when ``do`` is given), one (b, h) and one block of
    ``row_block`` query rows at a time (default: ``ORACLE_BLOCK_BYTES`` of scores).

    ``exact.attention`` computed in bounded memory: the same definition (the mask rules,
    softcap and sinks of ``masking.py``; ``window`` is FlashAttention's window_size, or
    ``causal`` for (-1, 0)), with analytic gradients instead of autograd's whole score
    matrix. ``sinks`` (H,) are the learned sink logits. Returns (o, lse, (dq, dk, dv) or None)."""
    if window is None:
        window = (-1, 0) if causal else masking.NO_WINDOW
    elif causal and tuple(window) != (-1, 0):
        raise ValueError(f"exact_attention: causal=True and window={window!r} disagree")
    window = masking.check_window("exact_attention", window)
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    rb = row_block or max(1, ORACLE_BLOCK_BYTES // (8 * max(1, Sk)))
    q, k, v = (x.to(torch.float64) for x in (q, k, v))
    sink64 = None if sinks is None else sinks.detach().to(torch.float64).cpu()
    o = torch.zeros(B, Sq, H, D, dtype=torch.float64)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float64)
    if sink64 is not None:
        lse[:] = sink64[None, :, None]
    grads = None
    if do is not None:
        do = do.to(torch.float64)
        grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    if Sk == 0:  # no key: o = 0, lse = -inf (the sink with sinks), gradients 0
        return o, lse, grads
    cols = torch.arange(Sk)
    for b in range(B):
        for h in range(H):
            kh = h // g
            kb, vb = k[b, :, kh], v[b, :, kh]
            for r0 in range(0, Sq, rb):
                r = slice(r0, min(Sq, r0 + rb))
                s = masking.softcap((q[b, r, h] @ kb.T) * scale, softcap)
                if masking.is_masked(window):
                    ok = masking.allowed(torch.arange(r.start, r.stop), cols, Sq, Sk, window)
                    s = s.masked_fill(~ok, float("-inf"))
                mx = s.amax(-1, keepdim=True)
                if sink64 is not None:
                    mx = torch.maximum(mx, sink64[h].expand_as(mx))
                mx = torch.where(torch.isneginf(mx), torch.zeros_like(mx), mx)
                e = torch.exp(s - mx)
                l = e.sum(-1, keepdim=True)
                if sink64 is not None:  # the sink's term in the denominator; it has no value row
                    l = l + torch.exp(sink64[h] - mx)
                p = torch.where(l > 0, e / torch.where(l > 0, l, torch.ones_like(l)), torch.zeros_like(e))
                o[b, r, h] = p @ vb
                lse[b, h, r] = torch.where(l[:, 0] > 0, (mx + torch.log(l))[:, 0],
                                           torch.full_like(l[:, 0], float("-inf")))
                if do is not None:
                    dob = do[b, r, h]
                    dsum = (dob * o[b, r, h]).sum(-1, keepdim=True)
                    ds = p * (dob @ vb.T - dsum)
                    if softcap:  # through c * tanh(s / c)
                        ds = ds * masking.softcap_grad(s, softcap)
                    grads[0][b, r, h] = ds @ kb * scale
                    grads[1][b, :, kh] += ds.T @ q[b, r, h] * scale
                    grads[2][b, :, kh] += p.T @ dob
    return o, lse, grads


def exact_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, do=None, *,
                           window=masking.NO_WINDOW, softcap: float = 0.0, sinks=None):
    """``exact_attention`` per packed sequence (each on its own bottom-right diagonal):
    q (total_q, H, D), k/v (total_k, Hkv, D) -> (o (total_q, H, D), lse (H, total_q),
    (dq, dk, dv) or None), float64, as ``reference.forward_varlen`` lays them out."""
    H, D = q.shape[1], q.shape[2]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=torch.float64)
    grads = None if do is None else tuple(torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
    for q0, q1, k0, k1 in masking.segments(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]):
        ob, lb, gb = exact_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale,
                                     do=None if do is None else do[None, q0:q1], window=window,
                                     softcap=softcap, sinks=sinks)
        o[q0:q1], lse[:, q0:q1] = ob[0], lb[0]
        if gb is not None:
            grads[0][q0:q1], grads[1][k0:k1], grads[2][k0:k1] = gb[0][0], gb[1][0], gb[2][0]
    return o, lse, grads


def spec_oracle(spec: KernelSpec, q, k, v, do=None, *, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """float64 attention with ``spec``'s scale, mask (window sizes included), softcap and
    sinks: ``exact_attention`` for a dense spec, ``exact_attention_varlen`` on packed inputs
    with their ``cu_seqlens_*`` for a ``layout varlen`` one. -> (o, lse, grads or None)."""
    mask = dict(window=spec.window_size, softcap=spec.softcap, sinks=sinks)
    if spec.layout is Layout.VARLEN:
        return exact_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, spec.scale, do, **mask)
    return exact_attention(q, k, v, spec.scale, do=do, **mask)


# ------------------------------------------------- the inputs of a report -----
# Drawn from the report's seeded generator after q, k, v (and dO), so that a dense spec without
# sinks sees the very inputs it always did.

def draw_sinks(heads: int, seqlen: int, gen: torch.Generator) -> torch.Tensor:
    """Per-head sink logits (H,) float32: ``log(seqlen) + N(0, 1)``, so that the sink holds a
    share of each row's softmax mass comparable to the keys' (an N(0, 1) sink next to ~seqlen
    keys of N(0, 1) scores would weigh ~1/seqlen, too little for a wrong sink to show)."""
    return math.log(max(2, seqlen)) + torch.randn(heads, generator=gen)


def ragged_lengths(batch: int, seqlen: int, gen: torch.Generator) -> list[int]:
    """The sequence lengths of a varlen report: ``batch`` lengths drawn uniformly from
    1..seqlen, plus one empty sequence and one of length 1, in a seeded random order."""
    drawn = torch.randint(1, seqlen + 1, (batch,), generator=gen).tolist()
    lengths = [0, 1] + drawn
    return [lengths[i] for i in torch.randperm(len(lengths), generator=gen).tolist()]


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """int32 cumulative offsets (B + 1,) of sequences of these lengths."""
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


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
    """The spec's numerics (the reference backend) against float64 attention of the same
    unquantized inputs, with the spec's mask, softcap and sinks (``draw_sinks``); a varlen
    spec runs on a ragged batch (``ragged_lengths``: ``batch`` sequences of up to ``seqlen``
    tokens plus an empty one and one of length 1) against the per-sequence oracle."""
    D = head_dim or spec.head_dim
    if head_dim is not None and head_dim != spec.head_dim:
        from dataclasses import replace
        spec = replace(spec, head_dim=head_dim)
    gen = torch.Generator().manual_seed(seed)
    varlen = spec.layout is Layout.VARLEN
    lengths = ragged_lengths(batch, seqlen, gen) if varlen else None
    shape = (sum(lengths), heads, D) if varlen else (batch, seqlen, heads, D)
    q, k, v, do = (torch.randn(shape, generator=gen) for _ in range(4))
    sinks = draw_sinks(heads, seqlen, gen) if spec.sinks is not Sinks.NONE else None
    dev = [x.to(device) for x in (q, k, v, do)]
    dev_sinks = None if sinks is None else sinks.to(device)
    do_ref = do if spec.backward is not None else None
    cu = cu_seqlens(lengths) if varlen else None
    if varlen:
        seq = dict(max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        o, lse = reference.forward_varlen(*dev[:3], cu.to(device), cu.to(device), spec, sinks=dev_sinks, **seq)
    else:
        o, lse = reference.forward(*dev[:3], spec, sinks=dev_sinks)
    o_ref, lse_ref, grads = spec_oracle(spec, q, k, v, do_ref, sinks=sinks, cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = {"kernel": spec.name, "target": spec.target.value}
    if varlen:
        out["seqlens"] = lengths
    if sinks is not None:
        out["sink_logits"] = [round(float(x), 4) for x in sinks]
    out.update(compare(o.cpu(), o_ref))
    out["mean_row_cosine"] = row_cosine(o.cpu(), o_ref)
    fin = torch.isfinite(lse_ref)
    out["lse_max_abs"] = float((lse.cpu().double()[fin] - lse_ref[fin]).abs().max()) if fin.any() else 0.0
    if spec.backward is not None:
        if varlen:
            dq, dk, dv = reference.backward_varlen(*dev[:3], o, lse, dev[3], cu.to(device), cu.to(device), spec,
                                                   sinks=dev_sinks, **seq)
        else:
            dq, dk, dv = reference.backward(*dev[:3], o, lse, dev[3], spec, sinks=dev_sinks)
        for name, x, r in (("dq", dq, grads[0]), ("dk", dk, grads[1]), ("dv", dv, grads[2])):
            c = compare(x.cpu(), r)
            out[f"{name}_cosine"] = c["cosine"]
            out[f"{name}_rel_l2"] = c["rel_l2"]
    return out


# ------------------------------------------------ reports on given inputs -----

def per_head(x: torch.Tensor, ref: torch.Tensor) -> list[dict]:
    """``compare`` and ``row_cosine`` of each head h of (B, S, H, D) tensors."""
    out = []
    for h in range(ref.shape[2]):
        c = compare(x[:, :, h], ref[:, :, h])
        c["mean_row_cosine"] = row_cosine(x[:, :, h], ref[:, :, h])
        out.append({"head": h, **c})
    return out


def for_head_dim(spec: KernelSpec, head_dim: int) -> KernelSpec:
    """``spec`` with ``head_dim`` (the default softmax_scale follows it, 1/sqrt(D))."""
    if head_dim == spec.head_dim:
        return spec
    from dataclasses import replace
    return replace(spec, head_dim=head_dim)


def report_case(spec: KernelSpec, case, transforms=(), device="cpu", hadamard_seed=None,
                sink_tokens: int = 1) -> dict:
    """The spec's numerics (reference backend) on ``case`` (an ``activations.Case``) against
    float64 attention of the case's unquantized inputs: O (and LSE) overall and per head, and
    the gradients' when the spec has a backward and the case a dO. ``transforms`` (names of
    ``outliers.ALL_TRANSFORMS``) are applied before the reference and undone after it; the oracle
    always sees the original inputs. The spec's head dim becomes the case's."""
    from . import outliers

    if spec.layout is Layout.VARLEN:
        raise ValueError(f"{spec.name} has layout varlen; --inputs takes dense (B, S, H, D) tensors: "
                         "use a dense spec")
    spec = for_head_dim(spec, case.head_dim)
    q, k, v = case.q, case.k, case.v
    sinks = None
    if spec.sinks is not Sinks.NONE:
        sinks = draw_sinks(q.shape[2], k.shape[1], torch.Generator().manual_seed(0))
    tq, tk, tv, post = outliers.apply(q, k, v, transforms, spec.scale, softcap=spec.softcap, sinks=sinks,
                                      hadamard_seed=hadamard_seed, sink_tokens=sink_tokens,
                                      window=spec.window_size)
    dev_sinks = None if sinks is None else sinks.to(device)
    o, lse = reference.forward(tq.to(device), tk.to(device), tv.to(device), spec, sinks=dev_sinks)
    o, lse = post.apply(o, lse)
    o, lse = o.cpu(), lse.cpu()
    want_bwd = spec.backward is not None and case.do is not None
    if want_bwd and transforms:
        raise ValueError("the outlier transforms are forward-only here: drop them for a backward report")
    o_ref, lse_ref, grads = spec_oracle(spec, q, k, v, case.do if want_bwd else None, sinks=sinks)
    out = {"kernel": spec.name, "target": spec.target.value, "inputs": case.name,
           "shape": {"q": list(q.shape), "k": list(k.shape)}, "softmax_scale": spec.scale}
    if transforms:
        out["transforms"] = list(transforms)
    if case.meta:
        out["meta"] = case.meta
    notes = []
    causal = case.meta.get("causal") if case.meta else None
    if causal is not None and bool(causal) != (spec.window_size == (-1, 0)):
        notes.append(f"the inputs were captured with causal={bool(causal)}; the spec's mask is "
                     f"{spec.mask.value}")
    mscale = case.meta.get("scale") if case.meta else None
    if isinstance(mscale, (int, float)) and abs(mscale - spec.scale) > 1e-6 * spec.scale:
        notes.append(f"the inputs were captured with softmax scale {mscale:.6g}; the spec uses {spec.scale:.6g}")
    if spec.backward is not None and case.do is None:
        notes.append("no dO in the inputs: forward only")
    if notes:
        out["notes"] = notes
    out.update(compare(o, o_ref))
    out["mean_row_cosine"] = row_cosine(o, o_ref)
    fin = torch.isfinite(lse_ref)
    out["lse_max_abs"] = float((lse.double()[fin] - lse_ref[fin]).abs().max()) if fin.any() else 0.0
    out["nonfinite_o"] = int((~torch.isfinite(o)).sum())
    out["per_head"] = per_head(o, o_ref)
    if want_bwd:
        dev = [x.to(device) for x in (q, k, v, case.do)]
        dq, dk, dv = reference.backward(*dev[:3], o.to(device), lse.to(device), dev[3], spec, sinks=dev_sinks)
        for name, x, r in (("dq", dq, grads[0]), ("dk", dk, grads[1]), ("dv", dv, grads[2])):
            c = compare(x.cpu(), r)
            out[f"{name}_cosine"], out[f"{name}_rel_l2"] = c["cosine"], c["rel_l2"]
    out["_o"], out["_o_ref"] = o, o_ref  # for report_inputs' overall numbers; dropped there
    return out


def report_inputs(spec: KernelSpec, cases, transforms=(), device="cpu") -> dict:
    """``report_case`` for every case, and the metrics over all of them together (O of every
    case flattened into one vector)."""
    reps = [report_case(spec, c, transforms, device) for c in cases]
    o = torch.cat([r.pop("_o").flatten() for r in reps])
    ref = torch.cat([r.pop("_o_ref").flatten() for r in reps])
    out = {"kernel": spec.name, "target": spec.target.value, "cases": reps}
    out.update({f"overall_{k}": v for k, v in compare(o, ref).items()})
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


# the backward table's gradient formats: dO fp8e5m2 one scale per token, dP and dS fp8e4m3 one
# scale per row (of each key tile), dQ/dK/dV bf16 (docs/numerics.md, "Backward accuracy")
FP8_GRADS = {"dO": OperandFormat(Format.FP8E5M2, ScaleGranularity.TOKEN, None, Format.FP32),
             "dP": OperandFormat(Format.FP8E4M3, ScaleGranularity.TOKEN, None, Format.FP32),
             "dS": OperandFormat(Format.FP8E4M3, ScaleGranularity.TOKEN, None, Format.FP32)}
BACKWARD_RECIPES = (("NV/MX fast (Direct-P)", FP8_GRADS), ("NV/FP8 (FP8 P/V, exp)", FP8_GRADS),
                    ("FP8 exp sm90", FP8_GRADS), ("BF16", FP8_GRADS), ("BF16", {}))


def backward_table(seqlen=1024, heads=2, batch=1, seed=0, head_dim=128) -> list[dict]:
    """Causal gradients of the forward recipes in BACKWARD_RECIPES with FP8 (or bf16) gradient
    operands against float64 analytic gradients of the unquantized inputs (``report``)."""
    by_name = {s.name: s for s in recipes(head_dim, causal=True)}
    rows = []
    for name, formats in BACKWARD_RECIPES:
        spec = replace(by_name[name], backward=Backward(formats=formats))
        r = report(spec, seqlen, heads, batch, seed)
        r["gradients"] = "fp8 (dO e5m2, dP/dS e4m3)" if formats else "bf16"
        rows.append(r)
    return rows


# ------------------------------------------- the outlier-case table (issue 21) -----

OUTLIER_CASES = ("randn", "outlier_v_rows", "massive_k", "sink", "outlier_v_channels", "llm_mix")
OUTLIER_OPTIONS = ((), ("smooth_k",), ("smooth_k", "sink_tokens"))


def outlier_table(seqlen: int = 1024, heads: int = 2, seed: int = 0, head_dim: int = 128,
                  names=None, cases=OUTLIER_CASES, options=OUTLIER_OPTIONS) -> list[dict]:
    """rel-L2 of O of every recipe (``recipes``; ``names`` picks some) on every synthetic case
    (``activations.synthetic``, non-causal) with each tuple of transforms in ``options``, and its
    ratio to the same recipe's randn error with the same transforms (issue 21's criterion: within
    2x). One row per (recipe, case): {"recipe", "case", "rel_l2": {opt: x}, "ratio": {opt: x}}, opt
    the transforms joined by "+" ("none" for none)."""
    from . import activations

    if "randn" not in cases:
        raise ValueError("the outlier table needs the randn case: every ratio is against it")
    specs = [s for s in recipes(head_dim) if names is None or s.name in names]
    if names is not None and len(specs) != len(set(names)):
        known = ", ".join(s.name for s in recipes(head_dim))
        raise ValueError(f"unknown recipe(s) among {sorted(names)}: use {known}")
    inputs = {c: activations.synthetic(c, seqlen=seqlen, heads=heads, head_dim=head_dim, seed=seed)
              for c in cases}
    rows = []
    for spec in specs:
        errs = {c: {"+".join(o) or "none": report_case(spec, inputs[c], o)["rel_l2"] for o in options}
                for c in cases}
        for c in cases:
            rows.append({"recipe": spec.name, "case": c, "rel_l2": errs[c],
                         "ratio": {o: x / errs["randn"][o] for o, x in errs[c].items()}})
    return rows


def operand_isolation(case: str, seqlen: int = 1024, heads: int = 2, seed: int = 0, head_dim: int = 128,
                      names=None, transforms=()) -> list[dict]:
    """Which operand's quantization dominates a recipe's error on synthetic ``case``: rel-L2 of O
    with every operand quantized ("all"), then with one of Q, K, P, V quantized and the others
    bf16 ("q", "k", "p", "v"). A Direct-P recipe keeps its P format throughout (P is made in it),
    so its "q"/"k"/"v" columns include P's error."""
    from . import activations

    c = activations.synthetic(case, seqlen=seqlen, heads=heads, head_dim=head_dim, seed=seed)
    bf = _fmt("bf16")
    rows = []
    for spec in recipes(head_dim):
        if names is not None and spec.name not in names:
            continue
        row = {"recipe": spec.name, "case": case, "all": report_case(spec, c, transforms)["rel_l2"]}
        for op in ("q", "k", "p", "v"):
            ops = {o: getattr(spec, o) if o == op else bf for o in ("q", "k", "p", "v")}
            if spec.p_production.kind is not PKind.EXP:
                ops["p"] = spec.p
            row[op] = report_case(replace(spec, **ops), c, transforms)["rel_l2"]
        rows.append(row)
    return rows


def print_outlier_table(rows: list[dict]) -> None:
    """Markdown: one line per (recipe, case), rel-L2 and (x randn) per option; cells above 2x bold."""
    opts = list(rows[0]["rel_l2"])
    print("| recipe | case | " + " | ".join(opts) + " |")
    print("|---|---|" + "---|" * len(opts))
    for r in rows:
        cells = []
        for o in opts:
            cell = f"{r['rel_l2'][o]:.4f} ({r['ratio'][o]:.2f}x)"
            cells.append(f"**{cell}**" if r["ratio"][o] > 2.0 else cell)
        print(f"| {r['recipe']} | {r['case']} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4gen.numerics.accuracy",
                                 description="operator accuracy of the recipe table vs float64")
    ap.add_argument("--table", action="store_true", help="print the recipe table (markdown)")
    ap.add_argument("--backward-table", action="store_true",
                    help="print the causal backward table (markdown; default --heads for it: 2)")
    ap.add_argument("--outliers", action="store_true",
                    help="print the outlier-case table (synthetic cases x recipes, without transforms, "
                         "with K smoothing, and with smoothing and the first key exact; docs/numerics.md "
                         "section 14)")
    ap.add_argument("--isolate", metavar="CASE",
                    help="print rel-L2 on synthetic CASE with one operand quantized at a time")
    ap.add_argument("--recipe", action="append", metavar="NAME",
                    help="with --outliers / --isolate: only this recipe (repeatable; the --table rows' names)")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=None, help="default 4 (2 with --backward-table)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args(argv)
    backward_heads = 2 if a.heads is None else a.heads
    a.heads = 4 if a.heads is None else a.heads
    if a.isolate:
        from .activations import SYNTHETIC

        if a.isolate not in SYNTHETIC:
            ap.error(f"--isolate: unknown case {a.isolate!r}; use one of {', '.join(SYNTHETIC)}")
        rows = operand_isolation(a.isolate, a.seqlen, a.heads, a.seed, a.head_dim, names=a.recipe)
        print(f"inputs: numerics.activations.synthetic({a.isolate!r}, seqlen={a.seqlen}, heads={a.heads}, "
              f"head_dim={a.head_dim}, seed={a.seed}); rel-L2 of O, one operand quantized (the others bf16)")
        print("| recipe | case | all | Q only | K only | P only | V only |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['recipe']} | {r['case']} | " + " | ".join(f"{r[c]:.4f}" for c in ("all", "q", "k", "p", "v"))
                  + " |")
        return 0
    if a.outliers:
        try:
            rows = outlier_table(a.seqlen, a.heads, a.seed, a.head_dim, names=a.recipe)
        except ValueError as e:
            ap.error(str(e))
        print(f"inputs: numerics.activations.synthetic(case, seqlen={a.seqlen}, heads={a.heads}, "
              f"head_dim={a.head_dim}, seed={a.seed}), non-causal; rel-L2 of O against float64 attention "
              "of the untransformed inputs; (x randn): against the recipe's randn rel-L2 with the same "
              "transforms")
        print_outlier_table(rows)
        return 0
    if a.backward_table:
        heads = backward_heads
        rows = backward_table(a.seqlen, heads, a.batch, a.seed, a.head_dim)
        print(f"inputs: q,k,v,dO ~ N(0,1) float32, B={a.batch} S={a.seqlen} H={heads} D={a.head_dim} "
              f"seed={a.seed} causal; reference: float64 analytic gradients of the unquantized inputs")
        print("| forward recipe | gradients | dQ cos / rel-L2 | dK cos / rel-L2 | dV cos / rel-L2 |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kernel']} | {r['gradients']} | " + " | ".join(
                f"{r[g + '_cosine']:.3f} / {r[g + '_rel_l2']:.3f}" for g in ("dq", "dk", "dv")) + " |")
        return 0
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
