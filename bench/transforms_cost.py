#!/usr/bin/env python3
"""What the outlier transforms (issue 21) cost a generated sm90a FP8 forward, measured.

For each module (``--modules``: generated/ names; default the FP8 exp and FP8 Direct-P sm90a
forwards at D = 128, non-causal and causal) and each option (``--options``, default all of
OPTIONS), the timed call is the whole forward a user gets: the option's torch steps
(``fp4gen.runtime.transforms.before``, what a generated module of a spec with that option runs
around its kernel), the module's kernel-only forward (``forward_untransformed``) on the
transformed inputs, and the steps that map O and LSE back. ``none`` is the kernel alone (also
with ``return_lse=True``, so every row makes the same outputs). ``sink_tokens`` (``sink_tokens 1``)
runs the kernel on keys 1.. and merges the exact first key by ``Post.apply``, as a module does.

Shapes: B = --tokens // S (32k tokens: B = 2 at S = 16k), S = --seqlen, H = --heads (16),
D = 128, bf16 q/k/v on one GPU. Timing: CUDA events around each call, --warmup calls then the
median of --iters; every option of a module is timed on the same inputs, options interleaved
round-robin so that clock drift does not favour one. ``ratio_vs_none`` = median / the module's
``none`` median; ``overhead_pct`` = (ratio - 1) * 100 (issue 21 asks <= 5 % for the chosen
options). ``cosine_vs_none`` / ``rel_l2_vs_none``: the option's O against the kernel-alone O on batch 0
(the transforms are exact in real arithmetic, so these differ only by quantization: a rel-L2
near the recipe's own error, ~0.05, means the steps ran right; a wrong step shows as ~1).

Output: JSON (command, date, device, commit, shape, rows) written atomically to --out-dir
(default $OUT on a device run, else bench/results/) as <--name>.json.

    python3 bench/transforms_cost.py                         # on an H200: transforms-cost-h200.json
    python3 bench/transforms_cost.py --cpu-smoke --out-dir /tmp/x

``--cpu-smoke``: the reference backend on the CPU in place of the kernel (the modules' own specs),
S = 64, B = 1, H = 1, one iteration, two modules (FP8 exp non-causal, FP8 Direct-P causal) unless
--modules names others; checks that the script runs end to end
(tests/bench/test_transforms_cost.py), not a measurement.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout: the repo's fp4gen and generated/
    sys.path.insert(0, str(ROOT))

MODULES = ("sm90_fp8_exp_d128_sm90a", "sm90_fp8_directp_d128_sm90a",
           "sm90_fp8_exp_causal_d128_sm90a", "sm90_fp8_directp_causal_d128_sm90a")
# option -> the spec's Transforms fields
OPTIONS = {
    "none": {},
    "smooth_k": {"smooth_k": True},
    "channel_scale_v": {"channel_scale_v": True},
    "hadamard": {"hadamard": True, "hadamard_seed": 0},
    "smooth_k+hadamard": {"smooth_k": True, "hadamard": True, "hadamard_seed": 0},
    "all_three": {"smooth_k": True, "channel_scale_v": True, "hadamard": True, "hadamard_seed": 0},
    "sink_tokens": {"sink_tokens": 1},
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench/transforms_cost.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", default=",".join(MODULES), help="comma-separated generated/ module names")
    p.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated subset of {', '.join(OPTIONS)}")
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=32768, help="B * S (B = tokens // seqlen)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--name", default=None, help="output file stem (default transforms-cost-h200, "
                                                "or transforms-cost-cpu-smoke with --cpu-smoke)")
    p.add_argument("--out-dir", default=None, help="default $OUT, else bench/results")
    p.add_argument("--cpu-smoke", action="store_true", help="the reference backend on the CPU, tiny shapes")
    a = p.parse_args(argv)
    a.argv = list(argv)
    if a.cpu_smoke:  # tiny: the reference backend is ~1000x slower than a kernel
        a.seqlen, a.tokens, a.heads, a.warmup, a.iters = 64, 64, 1, 0, 1
        if a.modules == ",".join(MODULES):  # one non-causal exp, one causal Direct-P
            a.modules = f"{MODULES[0]},{MODULES[3]}"
    a.modules = [m.strip() for m in a.modules.split(",") if m.strip()]
    a.options = [o.strip() for o in a.options.split(",") if o.strip()]
    bad = [o for o in a.options if o not in OPTIONS]
    if bad:
        p.error(f"--options: unknown {', '.join(bad)}; use {', '.join(OPTIONS)}")
    if "none" not in a.options:
        a.options.insert(0, "none")  # every ratio is against it
    if a.seqlen <= 1 or a.tokens < a.seqlen or a.iters < 1 or a.warmup < 0 or a.heads < 1:
        p.error("need --seqlen > 1, --tokens >= --seqlen, --heads >= 1, --iters >= 1, --warmup >= 0")
    a.name = a.name or ("transforms-cost-cpu-smoke" if a.cpu_smoke else "transforms-cost-h200")
    return a


def device_problem(cpu_smoke: bool):
    """Why this machine cannot run the timed benchmark (None if it can)."""
    if cpu_smoke:
        return None
    import torch

    if not torch.cuda.is_available():
        return ("no CUDA GPU here: the timed run needs a Hopper (sm90a) GPU; use --cpu-smoke for "
                "the CPU check that the script runs")
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"the sm90a modules need a Hopper GPU (compute capability 9.0); this one is {cap[0]}.{cap[1]}"
    return None


def load_module(name: str):
    """The generated module ``name`` (generated/<name>.py) and its spec."""
    from fp4gen.runtime.specjson import spec_from_plan_json

    mod = importlib.import_module(f"generated.{name}")
    spec = spec_from_plan_json(mod.PLAN_JSON)
    if spec.transforms:
        raise ValueError(f"{name}: its spec has transforms ({spec.transforms}); give a module without them "
                         "(every option here is added to the module's own spec)")
    return mod, spec


def kernel_of(mod, spec, cpu_smoke: bool):
    """f(q, k, v) -> (o, lse): the module's kernel-only forward, or on the CPU smoke the reference
    backend with the module's spec."""
    if cpu_smoke:
        from fp4gen.numerics import reference

        return lambda q, k, v: reference.forward(q, k, v, spec)
    from fp4gen.runtime import transforms

    fwd = transforms.untransformed(mod, "forward")
    return lambda q, k, v: fwd(q, k, v, return_lse=True)


def step_of(option: str, spec, kernel):
    """f(q, k, v) -> o: the option's steps around ``kernel``, as a user's forward runs them."""
    from fp4gen.ir.spec import Transforms
    from fp4gen.runtime import transforms

    fields = OPTIONS[option]
    if option == "none":
        return lambda q, k, v: kernel(q, k, v)[0]
    tspec = replace(spec, transforms=Transforms(**fields))

    def run(q, k, v):  # runtime.transforms.TransformedModule.forward's steps
        q2, k2, v2, post = transforms.before(tspec, q, k, v, spec.scale)
        o, lse = kernel(q2, k2, v2)
        if post.sinks is not None:  # sink_tokens: O and LSE merged with the exact keys'
            return post.apply(o, lse)[0].to(q.dtype)
        o, _ = post.o(o).to(q.dtype), post.lse(lse)
        return o
    return run


def time_steps(steps: dict, inputs, warmup: int, iters: int, cuda: bool) -> dict:
    """Median seconds per call of each step, interleaved round-robin."""
    import torch

    times = {n: [] for n in steps}
    with torch.no_grad():
        for _ in range(warmup):
            for f in steps.values():
                f(*inputs)
        if cuda:
            torch.cuda.synchronize()
        for _ in range(iters):
            for n, f in steps.items():
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    f(*inputs)
                    b.record()
                    b.synchronize()
                    times[n].append(a.elapsed_time(b) / 1e3)
                else:
                    t0 = time.perf_counter()
                    f(*inputs)
                    times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def agreement(a, b) -> tuple[float, float]:
    """(cosine, rel-L2) of O ``a`` against ``b`` on batch 0."""
    import torch

    a, b = a[0].double().flatten(), b[0].double().flatten()
    den = (a.norm() * b.norm()).clamp_min(1e-300)
    return float(torch.dot(a, b) / den), float((a - b).norm() / b.norm().clamp_min(1e-300))


def run_module(name: str, args, cuda: bool) -> list[dict]:
    import torch

    mod, spec = load_module(name)
    if spec.head_dim != 128 and not args.cpu_smoke:
        print(f"note: {name} has head dim {spec.head_dim}", file=sys.stderr)
    kernel = kernel_of(mod, spec, args.cpu_smoke)
    B, S, H, D = args.tokens // args.seqlen, args.seqlen, args.heads, spec.head_dim
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g, device=dev, dtype=dtype) for _ in range(3))
    rows, steps = [], {}
    for opt in args.options:
        try:
            steps[opt] = step_of(opt, spec, kernel)
        except Exception as e:  # an option the spec refuses: say so in its row
            rows.append({"module": name, "option": opt, "error": f"{type(e).__name__}: {e}"})
    with torch.no_grad():  # every step once, for its output (and to refuse what fails)
        outs = {}
        for opt in list(steps):
            try:
                outs[opt] = steps[opt](q, k, v)
            except Exception as e:
                rows.append({"module": name, "option": opt, "error": f"{type(e).__name__}: {e}"})
                traceback.print_exc()
                del steps[opt]
    if "none" not in steps:
        return rows
    med = time_steps(steps, (q, k, v), args.warmup, args.iters, cuda)
    for opt, t in med.items():
        ratio = t / med["none"]
        cos, rel = agreement(outs[opt], outs["none"])
        rows.append({"module": name, "option": opt, "median_ms": round(t * 1e3, 4),
                     "ratio_vs_none": round(ratio, 4), "overhead_pct": round((ratio - 1) * 100, 2),
                     "cosine_vs_none": round(cos, 6), "rel_l2_vs_none": round(rel, 6),
                     "shape": {"B": B, "S": S, "H": H, "D": D}, "iters": args.iters})
    order = {o: i for i, o in enumerate(args.options)}
    return sorted(rows, key=lambda r: order.get(r["option"], len(order)))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checkout import ensure_fp4gen_importable  # the GPU machine's tree is not pip-installed

    ensure_fp4gen_importable()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    problem = device_problem(args.cpu_smoke)
    if problem:
        print(f"transforms_cost: {problem}", file=sys.stderr)
        return 2
    import torch

    cuda = not args.cpu_smoke
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny tensors: threads only contend with whatever else runs
    rows = []
    for name in args.modules:
        try:
            rows += run_module(name, args, cuda)
        except Exception as e:  # a module that does not load or run: a row that says why
            traceback.print_exc()
            rows.append({"module": name, "error": f"{type(e).__name__}: {e}"})
        for r in rows:
            if r["module"] == name:
                print(json.dumps(r), flush=True)
    doc = {"command": "python3 bench/transforms_cost.py " + shlex.join(args.argv),
           "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": git_commit(),
           "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
           "torch": torch.__version__, "cpu_smoke": args.cpu_smoke,
           "timing": "CUDA events, median" if cuda else "perf_counter, median (not a measurement)",
           "rows": rows}
    out_dir = Path(args.out_dir or os.environ.get("OUT") or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{args.name}.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)  # atomic: a reader never sees half a file
    print(f"wrote {out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
