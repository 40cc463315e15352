#!/usr/bin/env python3
"""Where a backward call's time goes: GPU time per kernel (torch.profiler) of one call of
FA4's BF16 backward and of each fp4gen module given, plus the CPU time to enqueue a call and
the call's time with the CPU overhead hidden. FP8 modules whose backward takes the forward's
quantized state are also profiled with ``prepared=quantize_inputs(q, k, v, for_backward=True)``
(the state ``fp4gen.attention`` hands over), and their forward quantizer with and without
``for_backward`` (the extra V payload it writes).

    source .dev/activate && S=4096 python3 bench/attention_bwd_profile.py \\
        generated/sm90_fp8_train_causal_d128_sm90a.py generated/sm90_bf16_causal_d128_sm90a.py

Causal, H=16, D=128, B = 32768 // S (env S, default 4096). Prints a table per contender; the
numbers behind the host-pass table of docs/backward.md. Needs a Hopper GPU and flash-attn-4.
"""
import importlib.util
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_bwd import ensure_fp4gen_importable  # noqa: E402


def load(path, i):
    spec = importlib.util.spec_from_file_location(f"profiled_module_{i}", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def main():
    ensure_fp4gen_importable()
    from flash_attn.cute import flash_attn_func

    S = int(os.environ.get("S", "4096"))
    B, H, D = 32768 // S, 16, 128
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qf, kf, vf = (x.detach().requires_grad_(True) for x in (q, k, v))
    o_, lse = flash_attn_func(qf, kf, vf, causal=True, return_lse=True)[:2]
    o, lse = o_.detach(), lse.float().contiguous()
    fns = {"fa4": lambda: torch.autograd.grad(o_, (qf, kf, vf), do, retain_graph=True)}
    for i, path in enumerate(sys.argv[1:]):
        m = load(path, i)
        name = os.path.basename(path)[:-3]
        fns[name] = lambda m=m: m.backward(q, k, v, o, lse, do)
        if getattr(m, "BWD_S_FP8", False):
            # the state fp4gen.attention hands over: with FP8 dP, V's natural payload too; with
            # FP8 dS, Q's and K's transposed payloads
            from fp4gen.torch_ops import forward_state_options

            opts = forward_state_options(m)
            prep = m.quantize_inputs(q, k, v, **opts)
            fns[name + " +forward state"] = lambda m=m, prep=prep: m.backward(q, k, v, o, lse, do, prepared=prep)
            # what that costs the forward: its quantizer with and without the extra payloads
            fns[name + " forward quantize_inputs"] = lambda m=m: m.quantize_inputs(q, k, v)
            if opts:
                fns[name + f" forward quantize_inputs({', '.join(opts)})"] = \
                    lambda m=m, opts=opts: m.quantize_inputs(q, k, v, **opts)
    for name, f in fns.items():
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))  # keep the GPU busy: the CPU side alone is timed
        t = time.perf_counter()
        f()
        cpu_ms = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e9))  # calls queued behind a sleep: their CPU overhead is hidden
        start.record()
        for _ in range(10):
            f()
        end.record()
        torch.cuda.synchronize()
        gpu_ms = start.elapsed_time(end) / 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            f()
            torch.cuda.synchronize()
        print(f"=== {name} (S={S}, B={B}): CPU enqueue {cpu_ms:.3f} ms | GPU per call {gpu_ms:.3f} ms", flush=True)
        total = 0.0
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.device_time if hasattr(e, "device_time") else e.cuda_time
            total += us
            print(f"   {us:9.1f} us  {e.name[:100]}")
        print(f"   {total:9.1f} us  all kernels", flush=True)


if __name__ == "__main__":
    main()
