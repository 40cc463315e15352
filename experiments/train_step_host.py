#!/usr/bin/env python3
"""Where a training step's time goes at bench/train_gpt.py's size: host or GPU? (needs an sm_90 GPU)

Two measurements, on the H200 (docs/training.md, "Host-bound steps, and CUDA graphs"):

- ``calls``: the host time of one call of each piece of an fp4gen attention forward and
  backward (``fp8-ds8`` recipe, B 16, S 1024, H 6, D 128), synchronized before each call and
  timed until the call returns, so it is the time to enqueue its work (the GPU queue is empty
  and never fills); torch's own launch and allocation costs beside them for scale.
- ``step``: whole training steps of train_gpt's model (eager), their wall time, the host time
  to enqueue one step, and the GPU's busy time per step from torch.profiler (the union of its
  kernels' intervals), for each recipe given.

    source .dev/activate && python3 experiments/train_step_host.py calls
    source .dev/activate && python3 experiments/train_step_host.py step sdpa fp8-ds8
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from checkout import ensure_fp4gen_importable  # noqa: E402

ensure_fp4gen_importable()

from fp4gen import torch_ops  # noqa: E402

SPEC = "examples/sm90_fp8_train_d128.attn::sm90_fp8_train_ds8_causal_d128"
MODULE = "fp4gen.generated.sm90_fp8_train_ds8_causal_d128_sm90a"
B, S, H, D = 16, 1024, 6, 128


def host_us(fn, n: int = 50) -> float:
    """Median host time of fn() in microseconds, the GPU idle before each call."""
    fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def calls() -> None:
    import importlib

    from fp4gen.device import bwd_prep
    from fp4gen.device import quantize as fused

    spec = str(ROOT / SPEC)
    gen = importlib.import_module(MODULE)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def op_forward():
        return torch_ops.attention(*leaves, spec=spec, causal=True)

    def op_forward_backward():
        torch.autograd.grad(op_forward(), leaves, do)

    opts = torch_ops.forward_state_options(gen)
    o, lse = gen.forward(q, k, v, return_lse=True)
    prepared = gen.quantize_inputs(q, k, v, **opts)
    amax = torch.empty((B, H, S // 128), dtype=torch.int32, device="cuda")

    def device_context():
        with torch.cuda.device(q.device):
            pass

    rows = [("fp4gen.attention forward (autograd op)", op_forward),
            ("fp4gen.attention forward + autograd.grad", op_forward_backward),
            ("module.quantize_inputs (the forward's state)", lambda: gen.quantize_inputs(q, k, v, **opts)),
            ("module.forward", lambda: gen.forward(q, k, v, return_lse=True)),
            ("module.backward(prepared=)", lambda: gen.backward(q, k, v, o, lse, do, prepared=prepared)),
            ("bwd_prep.preprocess_fp8", lambda: bwd_prep.preprocess_fp8(o, do, lse, S)),
            ("one quantizer launch (dO's block amax)", lambda: fused._launch("amax", D, do, do, amax)),
            ("torch: with torch.cuda.device(...)", device_context),
            ("torch: torch.empty (1 MiB)", lambda: torch.empty(1 << 20, dtype=torch.uint8, device="cuda")),
            ("torch: one elementwise launch (x.add_(0))", lambda: q.add_(0)),
            ("torch_ops.spec_key(spec)", lambda: torch_ops.spec_key(spec, causal=True))]
    print(f"B={B} S={S} H={H} D={D}; host time per call, median of 50, GPU idle before each")
    for name, fn in rows:
        print(f"{name:48s} {host_us(fn):9.1f} us", flush=True)


def step(recipes) -> None:
    import train_gpt
    from torch.profiler import ProfilerActivity, profile

    x = torch.randint(0, 256, (16, 1024), device="cuda")
    y = torch.randint(0, 256, (16, 1024), device="cuda")
    for recipe in recipes:
        attn, spec, backend = train_gpt.RECIPES[recipe]
        core = train_gpt.sdpa_core if attn == "sdpa" else train_gpt.fp4gen_core(str(ROOT / spec), backend)
        torch.manual_seed(0)
        model = train_gpt.GPT(6, 768, 6, 128, 1024, core).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def one_step(model=model, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(15):
            one_step()
        wall = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            one_step()
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
        enqueue = host_us(one_step, n=5) / 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                one_step()
            torch.cuda.synchronize()
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, cur = 0.0, None
        for a, b in spans:  # the union of the kernels' intervals
            if cur is None or a > cur[1]:
                busy += 0.0 if cur is None else cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        busy += 0.0 if cur is None else cur[1] - cur[0]
        print(f"{recipe:10s} step {statistics.median(wall):6.2f} ms (median of 20), host enqueue "
              f"{enqueue:6.2f} ms, GPU busy {busy / 3 / 1e3:6.2f} ms/step", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("calls", "step"):
        sys.exit("usage: train_step_host.py calls | step RECIPE [RECIPE ...]")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("train_step_host.py needs an sm_90 GPU (the generated sm90a kernels run there)")
    calls() if sys.argv[1] == "calls" else step(sys.argv[2:] or ["sdpa", "fp8-ds8"])
