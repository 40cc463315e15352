#!/usr/bin/env python3
"""Decode speed of the sm90a split-KV kernel (issue 22): time per call and the cache bandwidth.

For each (format, batch, cache length) the kernel runs through its generated module's ``decode``
(the launch plus the torch combine of the splits; appends are not timed) on a cache of random
tokens in that format, paged (64 tokens a page, pages shuffled), gqa 8, 8 KV heads, D 128, one
query token, the planner's split count. Reported: CUDA-event median over ``--iters`` calls after
``--warmup``, and the cache bytes read (K + V data and scales of the valid tokens) per second.
Nothing here is a claim: it is the measurement to make on the H200 (``docs/decode.md``).

``--anchors`` adds, in the same process and on the same shapes: the card's copy bandwidth
(``dst.copy_(src)`` of a 4 GiB buffer, bytes read + written per second: the ceiling a decode
kernel that only reads its cache is compared with), FA4's BF16 decode (flash_attn.cute's
``flash_attn_func`` on a contiguous cache, causal, its own split heuristic; and paged through
``flash_attn_varlen_func`` with a page table when that FA4 build accepts one) and SDPA's.
Each fp4gen row then carries ``x_fa4_bf16`` (FA4 time / fp4gen time) and ``of_copy_bw``.

    python3 bench/decode_sm90.py                                   # every format, batch 1/8/64, 4k/32k
    python3 bench/decode_sm90.py --formats bf16 --batches 64 --lengths 32768 --stages 2 --tile-n 64

``--stages`` and ``--tile-n`` take several values: every (format, stages, tile) the kernel can hold
in SMEM runs (the others are listed as skipped, with the reason).
    python3 bench/decode_sm90.py --anchors --batches 64 --lengths 32768 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import ensure_fp4gen_importable  # noqa: E402  (bench/checkout.py, beside this file)


def spec_for(fmt: str, stages: int, tile_n: int = 128):
    from fp4gen.frontend import parse_text

    name = "".join(ch if ch.isalnum() else "_" for ch in f"bench_{fmt}_{stages}_{tile_n}")
    return parse_text(f"""attention {name} {{
  target sm90a
  head_dim 128
  mask causal
  schedule {{
    tile 128 x {tile_n}
    kv_stages {stages}
  }}
  kv_cache {{
    storage paged(page_size=64)
    format {fmt}
    q_tokens 1
    gqa 8
  }}
}}""", filename="bench/decode_sm90.py")[0]


def median_us(call, iters, warmup):
    import torch

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(iters, warmup, gib=4):
    """Bytes read + written per second by a device-to-device copy: the card's practical ceiling."""
    import torch

    n = gib << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), iters, warmup)
    del src, dst
    return {"anchor": "copy", "bytes": 2 * n, "us": round(us, 1), "GB_per_s": round(2 * n / us / 1e3, 1)}


def anchor_rows(batch, length, iters, warmup, hkv=8, gqa=8, d=128):
    """FA4 BF16 and SDPA decode on the shapes fp4gen's rows use (one query token, causal)."""
    import torch

    rows = []
    q = torch.randn(batch, 1, hkv * gqa, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, length, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * 2
    base = {"batch": batch, "cache_len": length, "cache_bytes": nbytes}

    def row(name, call):
        try:
            call()
            us = median_us(call, iters, warmup)
            rows.append({"anchor": name, **base, "us": round(us, 1), "GB_per_s": round(nbytes / us / 1e3, 1)})
        except Exception as e:  # an anchor this build lacks is reported, not fatal
            rows.append({"anchor": name, **base, "error": f"{type(e).__name__}: {str(e)[:300]}"})

    try:
        from flash_attn.cute import interface as fa4
    except Exception as e:
        rows.append({"anchor": "fa4_bf16", **base, "error": f"flash_attn.cute not importable: {e}"})
        fa4 = None
    if fa4 is not None:
        row("fa4_bf16", lambda: fa4.flash_attn_func(q, k, v, causal=True, num_splits=0, pack_gqa=True))
        row("fa4_bf16_splits1", lambda: fa4.flash_attn_func(q, k, v, causal=True, num_splits=1, pack_gqa=True))
        page = 128
        pps = -(-length // page)
        perm = torch.randperm(batch * pps, device="cuda")
        kp = torch.empty(batch * pps, page, hkv, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.empty_like(kp)
        kp[perm] = k.reshape(batch * pps, page, hkv, d)
        vp[perm] = v.reshape(batch * pps, page, hkv, d)
        pt = perm.to(torch.int32).reshape(batch, pps)
        cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        used = torch.full((batch,), length, device="cuda", dtype=torch.int32)
        row("fa4_bf16_paged128", lambda: fa4.flash_attn_varlen_func(
            q.reshape(batch, hkv * gqa, d), kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=used,
            page_table=pt, causal=True, num_splits=0, pack_gqa=True))
        del kp, vp
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    row("sdpa_bf16", lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
    return rows


def refusal_of(fmt, stages, tile_n):
    """Why the sm90a decode kernel cannot run (fmt, stages, tile_n) (a ring too deep for SMEM),
    or None."""
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.ir.plan import PlanError
    from fp4gen.lowering import LoweringError
    from fp4gen.lowering.sm90_decode import config

    try:
        config(plan_kernel(spec_for(fmt, stages, tile_n)))
    except (LoweringError, PlanError) as e:
        return str(e)
    return None


def run_one(fmt, batch, length, stages, iters, warmup, hkv=8, tile_n=128):
    import torch

    import fp4gen
    from fp4gen.api import _kv_module, _kv_plan
    from fp4gen.numerics import kvcache as kv

    spec = spec_for(fmt, stages, tile_n)
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

    us = median_us(call, iters, warmup)
    nbytes = int(2 * batch * hkv * length * spec.kv_cache.format.bytes_per_token(128))
    return {"format": fmt, "batch": batch, "cache_len": length, "kv_stages": stages, "tile_n": tile_n,
            "splits": splits,
            "us": round(us, 1), "cache_bytes": nbytes, "GB_per_s": round(nbytes / us / 1e3, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8e4m3(scale=token)", "nvfp4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3], choices=(1, 2, 3, 4),
                    help="load-ring depths to run (each that fits SMEM)")
    ap.add_argument("--tile-n", nargs="+", type=int, default=[128], choices=(64, 128), help="keys per tile")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--anchors", action="store_true", help="copy bandwidth, FA4 BF16 and SDPA decode beside")
    ap.add_argument("--json", default=None, help="also write every row (and the command) to this file")
    args = ap.parse_args(argv)
    ensure_fp4gen_importable()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_sm90.py: needs a CUDA GPU (sm90a); none is visible")
    rows = []

    def emit(r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    copy = copy_bandwidth(args.iters, args.warmup) if args.anchors else None
    if copy:
        emit(copy)
    for batch in args.batches:
        for length in args.lengths:
            anchors = anchor_rows(batch, length, args.iters, args.warmup) if args.anchors else []
            for r in anchors:
                emit(r)
            fa4 = next((r["us"] for r in anchors if r["anchor"] == "fa4_bf16" and "us" in r), None)
            for fmt in args.formats:
                for tile_n in args.tile_n:
                    for stages in args.stages:
                        why = refusal_of(fmt, stages, tile_n)
                        if why:
                            emit({"format": fmt, "batch": batch, "cache_len": length, "kv_stages": stages,
                                  "tile_n": tile_n, "skipped": why})
                            continue
                        r = run_one(fmt, batch, length, stages, args.iters, args.warmup, tile_n=tile_n)
                        if fa4:
                            r["x_fa4_bf16"] = round(fa4 / r["us"], 3)
                        if copy:
                            r["of_copy_bw"] = round(r["GB_per_s"] / copy["GB_per_s"], 3)
                        emit(r)
                        torch.cuda.empty_cache()
    if args.json:
        from fp4gen.runtime.fileio import atomic_write

        doc = {"command": "python3 bench/decode_sm90.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "device": torch.cuda.get_device_name(), "rows": rows}
        atomic_write(args.json, json.dumps(doc, indent=1) + "\n", parents=True)


if __name__ == "__main__":
    main()
