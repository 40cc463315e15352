"""Device check of the fused FP8 input quantizer (fp4gen.device.quantize), standalone.

Run on the H200 (see /work/shared/device/README.md):

    source .dev/activate && python3 tests/sm90/quant_device_check.py [--json $OUT/quant.json]

Prints a PASS/FAIL table (bit-exact payload bytes and scales: fused vs the generated
module's torch path vs the fp4gen.numerics oracle) and the time of the fused quantizer vs
the torch path at B=2, S=16384, H=16, D=128, plus forward() end to end. Exit status 1 if any
case fails. No pytest needed. Timing is printed, never asserted.

``--device cpu --no-timing`` only exercises this script's plumbing (both "fused" and torch
path are then the torch path); there the adversarial cases report q8/k8 0xFF vs 0x7F
against the oracle: x86 makes Inf/Inf a negative NaN, which torch's float8 cast keeps
(0xFF), while the oracle (and the GPU, whose NaNs are positive) give 0x7F.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import load_module, make_plan  # noqa: E402


DEV = "cuda"  # --device cpu: a plumbing check of this script (both paths are then the torch path)


def _rand(shape, g, scale=3.0):
    return (torch.randn(*shape, device=DEV, generator=g) * scale).bfloat16()


def _oracle(mod, q, k, v):
    from fp4gen.numerics.quant import quantize_fp8_blockwise, quantize_fp8_tensor

    tq, tk, tv = quantize_fp8_blockwise(q, 128, 1), quantize_fp8_blockwise(k, 128, 1), quantize_fp8_tensor(v)
    return (tq.payload, tk.payload, mod._v_operand(tv.payload),
            tq.scale.permute(0, 2, 1).contiguous(), tk.scale.permute(0, 2, 1).contiguous(), tv.scale)


def _diff(name, a, b):
    """'' if equal (bit-exact; NaN scales only need to be NaN in both), else a short reason."""
    if tuple(a.shape) != tuple(b.shape):
        return f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if name.startswith("scale"):
        na, nb = torch.isnan(a), torch.isnan(b)
        bad = (na != nb) | (~na & ~nb & (a.view(torch.int32) != b.view(torch.int32)))
    else:
        bad = a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)
    n = int(bad.sum())
    if n == 0:
        return ""
    idx = tuple(int(i) for i in bad.nonzero()[0])
    av = a[idx].float().item() if name.startswith("scale") else int(a.contiguous().view(torch.uint8)[idx])
    bv = b[idx].float().item() if name.startswith("scale") else int(b.contiguous().view(torch.uint8)[idx])
    return f"{name}: {n} differ, first at {idx}: {av} vs {bv}"


def compare(mod, q, k, v):
    fused = mod.quantize_inputs(q, k, v)
    torch_path = mod.quantize_inputs(q, k, v, fast=False)
    oracle = _oracle(mod, q, k, v)
    names = ("q8", "k8", "vt8", "scale_q", "scale_k", "scale_v")
    out = []
    for ref_name, ref in (("torch", torch_path), ("oracle", oracle)):
        for n, a, b in zip(names, fused, ref):
            d = _diff(n, a, b)
            if d:
                out.append(f"[vs {ref_name}] {d}")
    return out


def adversarial(D):
    g = torch.Generator(device=DEV).manual_seed(1)
    B, S, H = 2, 128 * 7 + 45, 3
    base = _rand((B, S, H, D), g)
    q, k, v = base.clone(), base.clone() * 0.25, base.clone() * 8
    for t in (q, k):
        t[0, 0:128, 0] = 0.0
        t[0, 128:256, 1] = -0.0
        t[1, 0:128, 0] = _rand((128, D), g) * 1e37
        t[1, 128:256, 0] = _rand((128, D), g) * 1e-39
        t[1, 256:384, 0] = _rand((128, D), g) * 1e-3
        t[1, 256, 0, 0] = 3.0e38
        t[0, 300, 2, 5] = float("nan")
        t[1, 400, 2, 7] = float("inf")
        t[1, 401, 2, 9] = float("-inf")
        t[0, S - 1, 1, 0] = 448.0 * 3
    ties = torch.tensor([448.0, 1.0625, 3.25, -0.0029296875, 0.013671875, 240.0, 232.0], device=DEV)
    q[0, 512:519, 2, :] = ties[:, None].bfloat16()
    v_nan, v_inf, v_zero = v.clone(), v.clone(), v.clone()
    v_nan[1, 3, 1, 4] = float("nan")
    v_inf[0, 5, 2, 0] = float("-inf")
    v_zero[:, :, 0] = 0.0
    v_sub = v * 1e-40
    return [(f"adversarial v#{i}", q, k, vv) for i, vv in enumerate((v, v_nan, v_inf, v_zero, v_sub))]


def cases(D):
    g = torch.Generator(device=DEV).manual_seed(D)
    out = []
    for B, Sq, Sk, H, Hkv in ((2, 256, 256, 4, 4), (2, 300, 700, 4, 2), (1, 77, 45, 4, 1),
                              (3, 129, 161, 6, 3), (1, 4096, 4096, 8, 8)):
        out.append((f"rand B{B} Sq{Sq} Sk{Sk} H{H}/{Hkv}", _rand((B, Sq, H, D), g),
                    _rand((B, Sk, Hkv, D), g, 0.5), _rand((B, Sk, Hkv, D), g, 20.0)))
    for scale in (1e-30, 1e30):
        out.append((f"rand scale {scale:g}", _rand((1, 333, 2, D), g, scale), _rand((1, 333, 2, D), g, scale),
                    _rand((1, 333, 2, D), g, scale)))
    qkv = _rand((2, 200, 3, 4, D), g)
    out.append(("strided views", *qkv.unbind(2)))
    flat = _rand((1 + 2 * 200 * 4 * D,), g)[1:].view(2, 200, 4, D)
    out.append(("misaligned base", flat, flat, flat))
    return out + adversarial(D)


def torch_cuda_scale_rule():
    """How torch on this GPU evaluates ``amax / 448.0`` (what the torch path and the oracle
    compute on CUDA) over every positive finite bf16 amax: 'reciprocal' (amax * fl32(1/448),
    what the fused kernel copies: fp4gen.device.quantize.SCALE_BY_RECIPROCAL), 'division', or
    'neither'."""
    a = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().to(DEV)
    got = a / 448.0
    recip = a * torch.full_like(a, 1.0 / 448.0)
    quot = a / torch.full_like(a, 448.0)
    if torch.equal(got, recip):
        return "reciprocal"
    return "division" if torch.equal(got, quot) else "neither"


def time_ms(fn, iters=50, warmup=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    tmp = tempfile.mkdtemp(prefix="fp4gen_qcheck_")
    from fp4gen.device import quantize as dq

    rule = torch_cuda_scale_rule()
    print(f"torch {torch.__version__}: amax / 448.0 on CUDA is a {rule}; the fused kernel uses "
          f"{'reciprocal' if dq.SCALE_BY_RECIPROCAL else 'division'}\n")
    rows, failed = [], 0
    print(f"{'case':42s} {'D':>4s}  result")
    for D in (128, 64):
        mod = load_module(make_plan("fp8_exp", D, False), tmp)
        for name, q, k, v in cases(D):
            try:
                bad = compare(mod, q, k, v)
            except Exception as e:  # report, keep going
                bad = [f"error: {type(e).__name__}: {str(e)[:300]}"]
            failed += bool(bad)
            rows.append(dict(case=name, D=D, ok=not bad, details=bad[:6]))
            print(f"{name:42s} {D:4d}  {'PASS' if not bad else 'FAIL'}")
            for line in bad[:6]:
                print(f"      {line}")

    timing = {}
    if not args.no_timing:
        B, S, H, D = 2, 16384, 16, 128
        mod = load_module(make_plan("fp8_exp", D, False), tmp)
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v = _rand((B, S, H, D), g), _rand((B, S, H, D), g), _rand((B, S, H, D), g)
        ins = mod.quantize_inputs(q, k, v)
        o = torch.empty_like(q)
        lse = torch.empty(B, H, S, device=DEV, dtype=torch.float32)
        timing = dict(
            fused_quantize_inputs=time_ms(lambda: mod.quantize_inputs(q, k, v)),
            torch_quantize_inputs=time_ms(lambda: mod.quantize_inputs(q, k, v, fast=False), iters=10, warmup=2),
            fused_q_only=time_ms(lambda: dq.quantize_blockwise(q)),
            fused_v_only=time_ms(lambda: dq.quantize_v_operand(v)),
            kernel_only=time_ms(lambda: mod.run_prepared(ins, o, lse, S, D ** -0.5, 0)),
            forward_fused=time_ms(lambda: mod.forward(q, k, v), iters=20),
        )
        # bytes: Q, K read bf16 + write e4m3; V read twice (amax pass, write pass) + write e4m3
        n = B * S * H * D
        gbytes = (2 * (2 * n + n) + (2 * n + 2 * n + n)) / 1e9
        timing["fused_effective_TBps"] = gbytes / timing["fused_quantize_inputs"]
        print(f"\nB={B} S={S} H={H} D={D} (ms, median)")
        for key, val in timing.items():
            print(f"  {key:28s} {val:9.4f}")
        print(f"  speedup fused vs torch path  {timing['torch_quantize_inputs'] / timing['fused_quantize_inputs']:.1f}x")
    print(f"\n{len(rows) - failed}/{len(rows)} cases bit-exact" + ("" if not failed else f", {failed} FAILED"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(scale_rule=rule, rows=rows, timing=timing), f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
