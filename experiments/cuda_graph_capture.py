#!/usr/bin/env python3
"""Which parts of an fp4gen attention step capture into a CUDA graph with ``torch.cuda.graph``?
(needs an sm_90 GPU)

Each case warms up on a side stream, captures one call, replays it and compares with an eager
call; each runs in its own process, because a failed capture can leave the CUDA context
unusable. Cases (``fp8-ds8`` recipe, B 16, S 1024, H 6, D 128):

- ``forward``: ``fp4gen.attention`` under no_grad;
- ``autograd``: ``fp4gen.attention`` and ``torch.autograd.grad`` (an eager training step's
  attention);
- ``ops``: the forward op, then the backward op called directly (no autograd engine);
- ``module``: the forward op, then the generated module's ``backward(prepared=)``;
- ``prep``: the forward op, then the FP8 backward's preprocessing alone;
- ``autograd_ffi_stream``: as ``autograd``, with the generated module's backward run inside
  ``tvm_ffi.use_torch_stream()`` (TVM-FFI's stream set from torch's current stream on the
  calling thread, the autograd engine's).

    source .dev/activate && python3 experiments/cuda_graph_capture.py

On the H200 (2026-11-30) ``forward``, ``ops``, ``module`` and ``prep`` captured and replayed
bit-exact; ``autograd`` and ``autograd_ffi_stream`` failed (docs/training.md). ``torch.compile(mode="reduce-overhead")`` captures the whole step.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("forward", "autograd", "ops", "module", "prep", "autograd_ffi_stream")


def run_case(case: str) -> None:
    import importlib

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from checkout import ensure_fp4gen_importable

    ensure_fp4gen_importable()
    from fp4gen import torch_ops
    from fp4gen.device import bwd_prep

    spec = str(ROOT / "examples/sm90_fp8_train_d128.attn::sm90_fp8_train_ds8_causal_d128")
    key = torch_ops.spec_key(spec, causal=True)
    gen = importlib.import_module("fp4gen.generated.sm90_fp8_train_ds8_causal_d128_sm90a")
    B, S, H, D = 16, 1024, 6, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    if case == "autograd_ffi_stream":
        import tvm_ffi

        plain_backward = gen.backward

        def backward_on_torch_stream(*args, **kwargs):
            with tvm_ffi.use_torch_stream():
                return plain_backward(*args, **kwargs)

        gen.backward = backward_on_torch_stream

    def call():
        if case == "forward":
            with torch.no_grad():
                return (torch_ops.attention(q, k, v, spec=spec, causal=True),)
        if case.startswith("autograd"):
            o = torch_ops.attention(*leaves, spec=spec, causal=True)
            return (o,) + torch.autograd.grad(o, leaves, do)
        o, lse, state = torch.ops.fp4gen.attention_fwd(q, k, v, key, None, "generated")
        if case == "ops":
            return (o,) + tuple(torch.ops.fp4gen.attention_bwd(q, k, v, o, lse, do, state, key, None, "generated"))
        if case == "module":
            return (o,) + tuple(gen.backward(q, k, v, o, lse, do, prepared=torch_ops._prepared_from_state(state)))
        return (o,) + tuple(t for t in bwd_prep.preprocess_fp8(o, do, lse, S) if isinstance(t, torch.Tensor))

    eager = [t.clone() for t in call()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static = call()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (the point is to report it)
        print(f"{case:9s} capture FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        return
    rel = [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
           for a, b in zip(static, eager)]
    print(f"{case:9s} captured and replayed; rel-L2 vs eager per output: " + " ".join(f"{r:.1e}" for r in rel))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
    else:
        for c in CASES:
            out = subprocess.run([sys.executable, __file__, c], capture_output=True, text=True, timeout=300)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith(c)]
            print(lines[-1] if lines else f"{c:9s} no result (exit {out.returncode}): {out.stderr.strip()[-200:]}")
