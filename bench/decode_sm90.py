#!/usr/bin/env python3
"""Decode speed of the sm90a split-KV kernel (issue 22): time per call and the cache bandwidth.

For each (format, batch, cache length) the kernel runs through its generated module's ``decode``
(the launch plus the torch combine of the splits; appends are not timed) on a cache of random
tokens in that format, paged (64 tokens a page, pages shuffled), gqa 8, 8 KV heads, D 128, one
query token, the planner's split count. Reported: CUDA-event median over ``--iters`` calls after
``--warmup``, and the cache bytes read (K + V data and scales of the valid tokens) per second.
Nothing here is a claim: it is the measurement to make on the H200 (``docs/decode.md``).

    python3 bench/decode_sm90.py                                   # every format, batch 1/8/64, 4k/32k
    python3 bench/decode_sm90.py --formats bf16 --batches 64 --lengths 32768 --stages 2
"""
from __future__ import annotations

import argparse
import json


def spec_for(fmt: str, stages: int):
    from fp4gen.frontend import parse_text

    name = "".join(ch if ch.isalnum() else "_" for ch in f"bench_{fmt}_{stages}")
    return parse_text(f"""attention {name} {{
  target sm90a
  head_dim 128
  mask causal
  schedule {{
    kv_stages {stages}
  }}
  kv_cache {{
    storage paged(page_size=64)
    format {fmt}
    q_tokens 1
    gqa 8
  }}
}}""", filename="bench/decode_sm90.py")[0]


def run_one(fmt, batch, length, stages, iters, warmup, hkv=8):
    import torch

    import fp4gen
    from fp4gen.api import _kv_module, _kv_plan
    from fp4gen.numerics import kvcache as kv

    spec = spec_for(fmt, stages)
    mod = _kv_module(spec)
    pps = -(-length // 64)
    pt = torch.randperm(batch * pps, device="cuda").to(torch.int32).reshape(batch, pps)
    # the cache is written one sequence at a time (kv_cache_from would hold all of K/V in bf16)
    kc, vc = fp4gen.allocate_kv_cache(spec, kv_heads=hkv, slots=batch * pps, device="cuda",
                                      **({"k_scale": torch.full((hkv,), 0.01), "v_scale": torch.full((hkv,), 0.01)}
                                         if spec.kv_cache.format.has_tensor_scale else {}))
    for b in range(batch):
        x = torch.randn(2, length, hkv, 128, device="cuda", dtype=torch.bfloat16)
        rows, cols = kv.token_slots([length], 64, pt[b:b + 1], kc.slots, "cuda")[0]
        kc.write(rows, cols, x[0])
        vc.write(rows, cols, x[1])
    q = torch.randn(batch, 1, hkv * 8, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    dp = _kv_plan(spec).decode
    splits = kv.split_count(batch * hkv, -(-length // dp.tile_n), dp.sm_count)
    ks, vs = (kc.scale, vc.scale) if kc.scale is not None else (kc.tensor_scale, vc.tensor_scale)
    nv = spec.kv_cache.format.format.value == "nvfp4"
    gk, gv = (kc.tensor_scale, vc.tensor_scale) if nv else (None, None)

    def call():
        mod.decode(q, kc.data, vc.data, lens, k_scale=ks, v_scale=vs, k_tensor_scale=gk, v_tensor_scale=gv,
                   page_table=pt, num_splits=splits)

    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    us = sorted(times)[len(times) // 2]
    nbytes = int(2 * batch * hkv * length * spec.kv_cache.format.bytes_per_token(128))
    return {"format": fmt, "batch": batch, "cache_len": length, "kv_stages": stages, "splits": splits,
            "us": round(us, 1), "cache_bytes": nbytes, "GB_per_s": round(nbytes / us / 1e3, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8e4m3(scale=token)", "nvfp4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--stages", type=int, default=1, choices=(1, 2))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    for fmt in args.formats:
        for batch in args.batches:
            for length in args.lengths:
                print(json.dumps(run_one(fmt, batch, length, args.stages, args.iters, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
