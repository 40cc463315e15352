#!/usr/bin/env python3
"""Masks beyond dense causal: varlen and sliding-window forwards beside FA4's, in one GPU run.

For each fp4gen sm90a recipe (BF16, FP8 exp, FP8 Direct-P; for each mask the example kernel
compiled for it, ``RECIPES``, called as flash_attn users call) and FA4's CuTe BF16 forward
(``flash_attn.cute.flash_attn_func`` / ``flash_attn_varlen_func``), on the same inputs:

- ``dense``: causal, B x S (S = --seqlen, B = --tokens // S);
- ``varlen``: causal, ragged sequences (seeded lengths from S/8 to S, about --tokens in all);
- ``window``: window_size (--window, 0) over the dense shape (FA4's semantics).

Useful FLOPs count only the (query, key) pairs the mask keeps: 4 D per pair per head. Each row
has ``tflops`` (useful), ``ratio_vs_fa4_bf16`` (same mask, FA4's time / ours) and
``ratio_vs_dense`` (useful throughput on this mask / the same kernel's on ``dense``: issue 19
asks >= 0.9). fp4gen times are end to end (the FP8 recipes quantize inside the call). Each
output is checked against an fp32 masked reference on the first sequence's first head
(``cosine``). Medians of ``triton.testing.do_bench``.

    python3 bench/masks.py                       # JSON in $OUT or bench/results/masks-<date>.json
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name -> mask -> the example kernel that serves it (a generated kernel is compiled for its
# spec's mask and layout: the dense causal kernel does not run varlen or a window; None: the
# recipe has no such example and its row says so)
RECIPES = {
    "fp4gen-bf16": {"dense": "examples/sm90_bf16_d128.attn::sm90_bf16_causal_d128",
                    "varlen": "examples/sm90_bf16_varlen_d128.attn::sm90_bf16_varlen_causal_d128",
                    "window": "examples/sm90_bf16_window_bwd_d128.attn::sm90_bf16_window_bwd_d128"},
    "fp4gen-fp8-exp": {"dense": "examples/sm90_fp8_exp_d128.attn::sm90_fp8_exp_causal_d128",
                       "varlen": "examples/sm90_fp8_varlen_d128.attn::sm90_fp8_exp_varlen_causal_d128",
                       "window": None},
    "fp4gen-fp8-directp": {"dense": "examples/sm90_fp8_directp_d128.attn::sm90_fp8_directp_causal_d128",
                           "varlen": "examples/sm90_fp8_varlen_d128.attn::sm90_fp8_directp_varlen_causal_d128",
                           "window": "examples/sm90_fp8_directp_window_d128.attn::sm90_fp8_directp_window_d128"},
}  # the window examples are window(255, 0): --window 255
FA4 = "fa4-cute-bf16"


def varlen_lengths(total: int, s_max: int, seed: int = 0) -> list:
    import random

    rng = random.Random(seed)
    out = []
    while sum(out) < total:
        out.append(rng.randint(max(1, s_max // 8), s_max))
    return out


def pairs(kind: str, lengths: list, window: int) -> int:
    """(query, key) pairs the mask keeps, summed over sequences (bottom-right aligned, Sq = Sk)."""
    if kind == "window":
        return sum(sum(min(r + 1, window + 1) for r in range(n)) for n in lengths)
    return sum(n * (n + 1) // 2 for n in lengths)


def reference(q, k, v, kind: str, window: int):
    """fp32 attention of one (S, D) head with the mask (causal, or causal within the window)."""
    import torch

    s = (q.float() @ k.float().T) / q.shape[-1] ** 0.5
    n = s.shape[0]
    i = torch.arange(n, device=s.device)
    keep = i[None, :] <= i[:, None]
    if kind == "window":
        keep &= i[None, :] >= i[:, None] - window
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.float()


def cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--window", type=int, default=255, help="window_size (W, 0)")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--name", default=None)
    a = p.parse_args(argv)

    sys.path.insert(0, str(HERE))
    from checkout import ensure_fp4gen_importable

    ensure_fp4gen_importable()
    import torch
    import triton.testing as tt
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    from fp4gen.torch_ops import attention, attention_varlen

    torch.manual_seed(0)
    dev, D, H, S = "cuda", 128, a.heads, a.seqlen
    B = max(1, a.tokens // S)
    lengths = varlen_lengths(a.tokens, S)
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lengths)), dtype=torch.int32, device=dev)
    total = int(cu[-1])
    qd, kd, vd = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    qv, kv, vv = (torch.randn(total, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    w = (a.window, 0)
    cases = {  # kind -> (lengths for the FLOP count, {kernel: callable}, first head's (q, k, v, out getter))
        "dense": [S] * B, "varlen": lengths, "window": [S] * B}

    def missing(kind):
        def fn():
            raise LookupError(f"no {kind} example kernel for this recipe")
        return fn

    def calls(name, specs):
        if name == FA4:
            return {"dense": lambda: flash_attn_func(qd, kd, vd, causal=True),
                    "varlen": lambda: flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                             max_seqlen_q=S, max_seqlen_k=S, causal=True),
                    "window": lambda: flash_attn_func(qd, kd, vd, causal=True, window_size=w)}
        out = {"dense": lambda: attention(qd, kd, vd, spec=specs["dense"], causal=True, backend="generated"),
               "varlen": lambda: attention_varlen(qv, kv, vv, cu, cu, S, S, spec=specs["varlen"], causal=True,
                                                  backend="generated"),
               "window": lambda: attention(qd, kd, vd, spec=specs["window"], window_size=w, backend="generated")}
        return {k: fn if specs[k] else missing(k) for k, fn in out.items()}

    kernels = {FA4: None} | {n: s for n, s in RECIPES.items() if n in a.recipes.split(",")}
    refs = {"dense": reference(qd[0, :, 0], kd[0, :, 0], vd[0, :, 0], "dense", a.window),
            "varlen": reference(qv[:lengths[0], 0], kv[:lengths[0], 0], vv[:lengths[0], 0], "dense", a.window),
            "window": reference(qd[0, :, 0], kd[0, :, 0], vd[0, :, 0], "window", a.window)}
    rows, times = [], {}
    date = _dt.date.today().isoformat()
    dev_name = torch.cuda.get_device_name()
    for name, spec in kernels.items():
        for kind, fn in calls(name, spec).items():
            row = {"kernel": name, "mask": kind, "S": S, "H": H, "D": D, "tokens": sum(cases[kind]),
                   "sequences": len(cases[kind]), "window": a.window if kind == "window" else None,
                   "device": dev_name, "date": date, "command": "python3 bench/masks.py " + shlex.join(argv or sys.argv[1:])}
            try:
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                first = out[0, :, 0] if kind != "varlen" else out[:lengths[0], 0]
                row["cosine"] = round(cosine(first, refs[kind]), 6)
                ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001 - reported in the row, the run goes on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(f"{name:20s} {kind:7s} FAILED {row['error']}", flush=True)
                continue
            flops = 4.0 * D * H * pairs(kind, cases[kind], a.window)
            row |= {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
            times[(name, kind)] = (ms, flops)
            rows.append(row)
    for row in rows:
        if "ms" not in row:
            continue
        fa4 = times.get((FA4, row["mask"]))
        dense = times.get((row["kernel"], "dense"))
        row["ratio_vs_fa4_bf16"] = round(fa4[0] / row["ms"], 3) if fa4 else None
        if dense:
            row["ratio_vs_dense"] = round((row["tflops"] * 1e9 * dense[0]) / dense[1], 3)
    print(f"{'kernel':20s} {'mask':7s} {'ms':>8s} {'TFLOP/s':>8s} {'xFA4':>6s} {'xdense':>7s} {'cosine':>8s}")
    for r in rows:
        if "ms" in r:
            print(f"{r['kernel']:20s} {r['mask']:7s} {r['ms']:8.3f} {r['tflops']:8.1f} "
                  f"{r['ratio_vs_fa4_bf16'] or 0:6.2f} {r.get('ratio_vs_dense') or 0:7.2f} {r['cosine']:8.5f}")
    out_dir = Path(os.environ.get("OUT") or HERE / "results")
    path = out_dir / f"{a.name or 'masks-' + date}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
