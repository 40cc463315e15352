#!/usr/bin/env python3
"""Attention benchmark: fp4gen kernels beside the anchors, in one GPU run.

Anchors: flash-attn-4's CuTe BF16 kernels (``flash_attn.cute.flash_attn_func``,
``ratio_vs_fa4_bf16``), cuDNN's FP8 attention through cudnn-frontend (``bench/cudnn_fp8.py``:
E4M3 in, quantized outside the timed call; ``ratio_vs_cudnn_fp8``), torch SDPA with the cuDNN
back end (BF16) and SageAttention 1.0.6 (``sageattention.sageattn``). fp4gen kernels are
given on the command line as generated module names, ``.py`` files or
``.attn`` specs (loaded with ``fp4gen.load``); one that fails to load
is skipped with the reason printed.

Shapes: S in --seqlens with B = --tokens // S (32k tokens by default), H=16,
D=128 (--head-dim 64 for D64), causal and not. Times are medians of
``triton.testing.do_bench(..., return_mode="median")`` after warm-up; FLOPs
are 4*B*H*S*S*D for the forward (half when causal) and 2.5x that for the
backward. Each kernel's output is checked against SDPA in fp32 on a slice
(batch 0, the first --check-heads heads) and the cosine is printed and stored.

Output: a JSON list of rows (see ``ROW_KEYS``) in $OUT/<name>.json when $OUT
is set (device runs), else bench/results/<name>.json, plus a PNG plot when
matplotlib is importable (otherwise run bench/plot.py on the JSON later).

    python3 bench/attention.py                               # anchors only
    python3 bench/attention.py fa4_fp8_sm90a examples/x.attn --backward
    python3 bench/attention.py --seqlens 4096 --causal false --head-dim 64

See docs/runtime.md for running it through the device tool.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ROW_KEYS = ("kernel", "pass", "B", "S", "H", "D", "causal", "ms", "tflops", "ratio_vs_fa4_bf16",
            "ratio_vs_cudnn_fp8", "cosine", "device", "date", "command")
FA4 = "fa4-cute-bf16"
CUDNN_FP8 = "cudnn-fp8"
ANCHORS = ("fa4", "sdpa", "cudnn8", "sage")


def attn_flops(B, S, H, D, causal, bwd=False):
    f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * 2.5 if bwd else f


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernels", nargs="*", help="fp4gen kernels: generated module names, .py files or .attn specs "
                   "(a spec may name one kernel as path.attn:KERNEL)")
    p.add_argument("--seqlens", default="1024,4096,8192,16384", help="comma-separated S values")
    p.add_argument("--tokens", type=int, default=32768, help="B*S per shape (B = tokens // S)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--causal", default="both", choices=("both", "true", "false"))
    p.add_argument("--backward", action="store_true", help="also time backward passes (FA4 BF16, SDPA "
                   "cuDNN and fp4gen modules that have backward)")
    p.add_argument("--no-forward", action="store_true", help="with --backward: skip the forward rows")
    p.add_argument("--anchors", default=",".join(ANCHORS), help="comma-separated subset of "
                   f"{','.join(ANCHORS)} ('' for none; ratios need fa4 and cudnn8)")
    p.add_argument("--target", default=None, help="target passed to fp4gen.load for .attn specs")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time, ms")
    p.add_argument("--check-heads", type=int, default=2, help="heads of batch 0 checked against fp32 SDPA "
                   "(0 disables the check)")
    p.add_argument("--name", default=None, help="output file stem (default attention-<date>)")
    p.add_argument("--out-dir", default=None, help="where JSON/PNG go (default $OUT, else bench/results)")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    a.seqlens = [int(x) for x in a.seqlens.split(",") if x]
    a.causals = {"both": (False, True), "true": (True,), "false": (False,)}[a.causal]
    a.anchor_set = {x.strip() for x in a.anchors.split(",") if x.strip()}
    unknown = a.anchor_set - set(ANCHORS)
    if unknown:
        p.error(f"unknown anchors: {', '.join(sorted(unknown))}")
    for s in a.seqlens:
        if s <= 0 or a.tokens // s < 1:
            p.error(f"seqlen {s} does not fit --tokens {a.tokens}")
    return a


# ---------------------------------------------------------------------------
# kernels under test: each is (name, fwd(q,k,v,causal) -> o, bwd-maker or None)


class Kernel:
    """One contender.

    ``fwd_setup(q, k, v, causal)`` gets (B, S, H, D) bf16 tensors, does any
    untimed preparation (layout copies) and returns ``(fn, to_bshd)``: ``fn()``
    runs one forward (the timed call), ``to_bshd(out)`` turns its result into
    o (B, S, H, D) for the correctness check. ``bwd_setup(q, k, v, do, causal)``
    likewise returns ``(fn, to_bshd)`` where ``fn()`` runs one backward and
    ``to_bshd`` maps its result to (dq, dk, dv) in (B, S, H, D); None when the
    kernel has no backward.
    """

    def __init__(self, name, fwd_setup, bwd_setup=None, causal_ok=(False, True)):
        self.name, self.fwd_setup, self.bwd_setup, self.causal_ok = name, fwd_setup, bwd_setup, causal_ok


def _first(o):
    return o[0] if isinstance(o, tuple) else o


def make_anchors(anchor_set, log):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = []
    if "fa4" in anchor_set:
        try:
            from flash_attn.cute import flash_attn_func as fa4

            def fa4_fwd(q, k, v, causal):
                return (lambda: fa4(q, k, v, causal=causal)), _first

            def fa4_bwd(q, k, v, do, causal):
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                o = _first(fa4(qg, kg, vg, causal=causal))
                return (lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)), tuple

            out.append(Kernel(FA4, fa4_fwd, fa4_bwd))
        except Exception as e:
            log(f"skip {FA4}: cannot import flash_attn.cute ({type(e).__name__}: {e})")

    # SDPA and SageAttention are called the way their users call them: on
    # contiguous (B, H, S, D) tensors, made once outside the timed call.
    def bhsd(*ts):
        return tuple(t.transpose(1, 2).contiguous() for t in ts)

    def from_bhsd(o):
        return o.transpose(1, 2)

    if "sdpa" in anchor_set:
        def sdpa_fwd(q, k, v, causal):
            qt, kt, vt = bhsd(q, k, v)

            def fn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return fn, from_bhsd

        def sdpa_bwd(q, k, v, do, causal):
            qt, kt, vt = (t.requires_grad_() for t in bhsd(q, k, v))
            (dot,) = bhsd(do)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return ((lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)),
                    lambda gs: tuple(from_bhsd(g) for g in gs))

        out.append(Kernel("sdpa-cudnn-bf16", sdpa_fwd, sdpa_bwd))
    if "cudnn8" in anchor_set:
        sys.path.insert(0, str(HERE))
        import cudnn_fp8

        why = cudnn_fp8.available()
        if why:
            log(f"skip {CUDNN_FP8}: {why}")
        else:
            def cudnn8_fwd(q, k, v, causal):
                a = cudnn_fp8.CudnnFp8Attention(q, k, v, causal)
                return a.forward, a.o_dequantized

            def cudnn8_bwd(q, k, v, do, causal):
                a = cudnn_fp8.CudnnFp8Attention(q, k, v, causal, do=do)
                return a.backward, a.grads_dequantized

            out.append(Kernel(CUDNN_FP8, cudnn8_fwd, cudnn8_bwd))
    if "sage" in anchor_set:
        try:
            from sageattention import sageattn

            def sage_fwd(q, k, v, causal):
                qt, kt, vt = bhsd(q, k, v)
                return (lambda: sageattn(qt, kt, vt, is_causal=causal)), from_bhsd

            out.append(Kernel("sageattn-1.0.6", sage_fwd))
        except Exception as e:
            log(f"skip sageattn: cannot import sageattention ({type(e).__name__}: {e})")
    return out


def fp4gen_kernel_name(mod):
    name = getattr(mod, "BENCH_NAME", None)
    if name:
        return name
    target = getattr(mod, "TARGET", "unknown")
    kname = getattr(mod, "KERNEL_NAME", mod.__name__.rsplit(".", 1)[-1])
    return f"fp4gen-{target}-{kname}".replace("_", "-")


def mask_of(mod):
    """Causal settings a module serves: a generated module implements its spec's mask only."""
    m = getattr(mod, "MASK", None)
    if m in ("causal", "none"):
        return (m == "causal",)
    c = getattr(mod, "CAUSAL", None)
    if isinstance(c, bool):
        return (c,)
    plan = getattr(mod, "PLAN_JSON", None)
    if plan:
        try:
            text = json.dumps(json.loads(plan))
        except Exception:
            text = str(plan)
        if '"mask": "causal"' in text:
            return (True,)
        if '"mask": "none"' in text:
            return (False,)
    return (False, True)


def ensure_fp4gen_importable():
    sys.path.insert(0, str(HERE))
    from checkout import ensure_fp4gen_importable as ensure

    ensure()


def make_fp4gen(items, target, log):
    if not items:
        return []
    ensure_fp4gen_importable()
    from fp4gen.api import load  # .attn specs too (fp4gen.runtime.load takes generated modules only)

    out = []
    for item in items:
        path, kernel = item, None
        if ".attn:" in item:
            path, kernel = item.rsplit(":", 1)
        try:
            t0 = time.time()
            mod = load(path, kernel=kernel, target=target if path.endswith(".attn") else None)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            log(f"skip {item}: failed to load ({type(e).__name__}: {first})")
            continue
        name = fp4gen_kernel_name(mod)
        # Optional hook: a module whose forward can take pre-quantized inputs says
        # how to make them from bf16 q, k, v. Such a module is timed twice: end to
        # end (bf16 in, quantization included, row NAME) and kernel only (the
        # preparation untimed, row NAME-kernel-only).
        prep = getattr(mod, "bench_inputs", None)
        if prep is not None:
            def fwd_setup_prepared(q, k, v, causal, _mod=mod, _prep=prep):
                a, kw = _prep(q, k, v)
                return (lambda: _mod.forward(*a, **kw)), _first

            out.append(Kernel(name + "-kernel-only", fwd_setup_prepared, None, mask_of(mod)))

        def fwd_setup(q, k, v, causal, _mod=mod):
            return (lambda: _mod.forward(q, k, v)), _first

        bwd_setup = None
        if callable(getattr(mod, "backward", None)):
            def bwd_setup(q, k, v, do, causal, _mod=mod):
                o, lse = _mod.forward(q, k, v, return_lse=True)
                return (lambda: _mod.backward(q, k, v, o, lse, do)), tuple

        log(f"loaded {item} as {name} in {time.time() - t0:.1f}s (causal: {mask_of(mod)})")
        out.append(Kernel(name, fwd_setup, bwd_setup, mask_of(mod)))
    return out


# ---------------------------------------------------------------------------
# correctness: SDPA in fp32 on a slice (batch 0, first heads)


def reference_slice(q, k, v, causal, heads, do=None):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qs, ks, vs = (t[:1, :, :heads].float().transpose(1, 2).contiguous() for t in (q, k, v))
    # memory-efficient attention runs fp32 without materialising S x S
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        if do is None:
            with torch.no_grad():
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(1, 2)
        for t in (qs, ks, vs):
            t.requires_grad_()
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        dos = do[:1, :, :heads].float().transpose(1, 2)
        return tuple(g.transpose(1, 2) for g in torch.autograd.grad(o, (qs, ks, vs), dos))


def cosine(a, b):
    a = a.double().flatten()
    b = b.double().flatten()
    den = a.norm() * b.norm()
    if not bool(den > 0):
        return float("nan")
    return float((a @ b) / den)


# ---------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    import torch

    command = "python3 " + " ".join(shlex.quote(x) for x in ([os.path.relpath(__file__, os.getcwd())]
                                                             + (sys.argv[1:] if argv is None else list(argv))))
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    name = args.name or f"attention-{date[:10]}"
    out_dir = Path(args.out_dir or os.environ.get("OUT") or (HERE / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"

    def log(msg):
        print(msg, flush=True)

    if not torch.cuda.is_available():
        log("bench/attention.py: no CUDA device; this benchmark runs on the GPU machine (see docs/runtime.md)")
        return 2
    import triton.testing as tt
    import warnings

    # flash-attn-4 4.0.0b36 warns on every compile that its aux_data argument
    # is not a JIT argument; harmless, and it buries the table
    warnings.filterwarnings("ignore", message=r"Argument aux_data")
    device = torch.cuda.get_device_name()
    log(f"# {device}, torch {torch.__version__}, {date}")
    log(f"# {command}")

    kernels = make_anchors(args.anchor_set, log) + make_fp4gen(args.kernels, args.target, log)
    if not kernels:
        log("nothing to benchmark")
        return 1

    rows = []

    def save():
        json_path.write_text(json.dumps(rows, indent=1) + "\n")

    H, D = args.heads, args.head_dim
    passes = ([] if args.no_forward and args.backward else ["fwd"]) + (["bwd"] if args.backward else [])
    log(f"{'kernel':30s} {'pass':4s} {'B':>3s} {'S':>6s} {'causal':6s} {'ms':>9s} {'TFLOP/s':>8s} "
        f"{'xFA4':>6s} {'xcuDNN8':>7s} {'cosine':>8s}")
    torch.manual_seed(0)
    for causal in args.causals:
        for S in args.seqlens:
            B = args.tokens // S
            q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            do = torch.randn_like(q) if "bwd" in passes else None
            ref_o = reference_slice(q, k, v, causal, args.check_heads) if args.check_heads else None
            ref_g = (reference_slice(q, k, v, causal, args.check_heads, do)
                     if args.check_heads and "bwd" in passes else None)
            for pas in passes:
                fa4_ms = cudnn8_ms = None
                for kern in kernels:
                    if causal not in kern.causal_ok:
                        continue
                    if pas == "bwd" and kern.bwd_setup is None:
                        continue
                    try:
                        setup = kern.fwd_setup if pas == "fwd" else kern.bwd_setup
                        fn, to_bshd = (setup(q, k, v, causal) if pas == "fwd" else setup(q, k, v, do, causal))
                        res = to_bshd(fn())  # first call compiles
                        h = args.check_heads
                        if pas == "fwd":
                            cos = cosine(res[:1, :, :h], ref_o) if ref_o is not None else None
                        else:  # the worst of dq, dk, dv
                            cos = (min(cosine(g[:1, :, :h], r) for g, r in zip(res, ref_g))
                                   if ref_g is not None else None)
                        del res
                        torch.cuda.synchronize()
                        ms = tt.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
                        del fn
                    except Exception as e:
                        log(f"{kern.name:30s} {pas:4s} {B:3d} {S:6d} {str(causal):6s} failed: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                        torch.cuda.synchronize()
                        continue
                    tflops = attn_flops(B, S, H, D, causal, bwd=(pas == "bwd")) / (ms * 1e-3) / 1e12
                    if kern.name == FA4:
                        fa4_ms = ms
                    if kern.name == CUDNN_FP8:
                        cudnn8_ms = ms
                    ratio = (fa4_ms / ms) if fa4_ms else None
                    ratio8 = (cudnn8_ms / ms) if cudnn8_ms else None
                    row = {"kernel": kern.name, "pass": pas, "B": B, "S": S, "H": H, "D": D, "causal": causal,
                           "ms": round(ms, 4), "tflops": round(tflops, 1),
                           "ratio_vs_fa4_bf16": round(ratio, 3) if ratio else None,
                           "ratio_vs_cudnn_fp8": round(ratio8, 3) if ratio8 else None,
                           "cosine": round(cos, 6) if cos is not None and math.isfinite(cos) else cos,
                           "device": device, "date": date, "command": command}
                    rows.append(row)
                    save()  # after every row: a run cut short still leaves its results
                    cos_s = f"{cos:8.5f}" if cos is not None else "       -"
                    rat_s = f"{ratio:6.2f}" if ratio else "     -"
                    rat8_s = f"{ratio8:7.2f}" if ratio8 else "      -"
                    log(f"{kern.name:30s} {pas:4s} {B:3d} {S:6d} {str(causal):6s} {ms:9.4f} {tflops:8.1f} "
                        f"{rat_s} {rat8_s} {cos_s}")
            del q, k, v, do, ref_o, ref_g
            torch.cuda.empty_cache()
    save()
    log(f"wrote {json_path} ({len(rows)} rows)")
    if not args.no_plot:
        try:
            sys.path.insert(0, str(HERE))
            from plot import plot_rows

            png = plot_rows(rows, json_path.with_suffix(".png"), title=f"{device}, H={H}, D={D}")
            log(f"wrote {png}")
        except ImportError as e:
            log(f"no plot ({e}); run `python bench/plot.py {json_path.name}` where matplotlib is installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
