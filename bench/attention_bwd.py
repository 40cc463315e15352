#!/usr/bin/env python3
"""Causal attention backward: fp4gen's generated sm90a backward beside FA4 and SDPA, one GPU run.

Contenders, all in one process on the same inputs:

- ``fa4-cute-bf16``: flash-attn-4's CuTe BF16 backward (``flash_attn.cute.flash_attn_func``
  forward once, then ``torch.autograd.grad`` of its output: FA4's own pre/post-processing
  kernels included), the baseline of every ratio;
- ``sdpa-cudnn-bf16``: ``torch.nn.functional.scaled_dot_product_attention`` (cuDNN back end)
  backward, likewise through autograd;
- ``cudnn-fp8``: cuDNN's FP8 backward graph (``bench/cudnn_fp8.py``; E4M3 q, k, v, dO made
  once outside the timed call, its own FP8 forward's o and stats), ``ratio_vs_cudnn_fp8`` of
  every row; its rel-L2 is reported but not gated (FP8 gradients);
- fp4gen generated modules given on the command line (``generated/...py`` files, module
  names under ``fp4gen.generated``, or ``FILE.attn::KERNEL``), each timed twice where it can be:
  ``<name>``: the module's full ``backward(q, k, v, o, lse, do)`` call (host preprocessing
  D = rowsum(dO*O), LSE padding, the dQ accumulator's zeroing, the launch, dQ scaling and
  casts: the same work FA4's autograd call does), and ``<name>-kernel-only``: the backward
  kernel launch alone, on arguments captured from one full call (only when the module has
  the ``_bwd_launch`` hook the sm90a template generates). A backward that recomputes S from
  the forward's FP8 Q/K (``BWD_S_FP8``) also gets ``<name>-fwd-state``: the full call handed
  the forward's ``quantize_inputs(q, k, v, **forward_state_options(mod))`` (``prepared=``), as
  ``fp4gen.attention`` does in a training step, so Q, K (and, with FP8 dP, V) are not
  quantized again. The JSON's ``timed`` says which.

fp4gen's backward runs on FA4's forward state (its o and LSE), so all contenders compute
the same gradients: the correctness gate, before timing, is rel-L2(dq, dk, dv) vs FA4's
gradients < ``--gate`` (2e-2). A module's gradients from its *own* forward (for the FP8
P/V recipe: the FP8 forward's o and LSE) are reported beside it, not gated.

Shapes: causal, S in --seqlens (4096, 8192, 16384), B = --tokens // S (32k tokens), H=16,
D=128. TFLOP/s use the standard causal backward count: 2.5 x the forward's
4*B*H*S*S*D/2. Times are medians of ``triton.testing.do_bench(..., return_mode="median")``
(CUDA events when triton is missing), taken in ``--rounds`` interleaved rounds per shape (every
contender once per round, FA4 first); a row reports the median over rounds of its time and of
its per-round ratio to FA4 (``ms_rounds`` keeps each round's time).

    python3 bench/attention_bwd.py generated/sm90_bf16_causal_d128_sm90a.py \\
        generated/sm90_fp8_train_causal_d128_sm90a.py --name attention-bwd-h200

Output: ``<out>/<name>.json`` (``--out``, else $OUT, else bench/results) written after every
row, and ``<name>.png`` (TFLOP/s per S and kernel; matplotlib). A contender that fails
records its error and the run goes on. Imports nothing GPU-specific until it runs, so
``--help`` and the unit tests (tests/bench/) work on a CPU machine.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import time
import traceback
from statistics import median
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cudnn_fp8  # noqa: E402  (bench/cudnn_fp8.py: the cuDNN FP8 anchor, shared with attention.py)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SCHEMA = "fp4gen-attention-bwd/2"
FA4 = "fa4-cute-bf16"
CUDNN_FP8 = "cudnn-fp8"
SDPA = "sdpa-cudnn-bf16"
ROW_KEYS = ("kernel", "kind", "timed", "B", "S", "H", "D", "causal", "ms", "tflops", "ratio_vs_fa4",
            "ratio_vs_cudnn_fp8", "ms_rounds", "rel_l2_vs_fa4", "gate_pass", "rel_l2_own_forward_vs_fa4", "error")
TIMED_FULL = "full backward(q, k, v, o, lse, do) call: host pre/post-processing + kernel launch"
TIMED_KERNEL = "backward kernel launch only (arguments prepared by one full call, untimed)"
TIMED_FULL_STATE = ("full backward(..., prepared=quantize_inputs(q, k, v, **forward_state_options(mod))) call: "
                    "the forward's quantized Q/K payloads and scales, V's scale, (FP8 dP) V's natural payload and "
                    "(FP8 dS) Q's and K's transposed payloads handed over as fp4gen.attention does (made once, "
                    "untimed: the FP8 forward's quantizer writes them; bench/attention_bwd_profile.py times what "
                    "the extra payloads add to it), "
                    "host pre/post-processing + kernel launch")
TIMED_CUDNN_FP8 = ("cuDNN FP8 backward graph execute (E4M3 q, k, v, o, dO prepared outside; gradients E4M3 on "
                   "Hopper, BF16 on Blackwell)")
TIMED_AUTOGRAD = "torch.autograd.grad of the forward output (the library's pre/post-processing included)"


def bwd_flops(B: int, S: int, H: int, D: int, causal: bool = True) -> float:
    """Standard attention backward FLOPs: 2.5 x the forward's 4*B*H*S*S*D (halved when causal)."""
    fwd = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return 2.5 * fwd


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def rel_l2(x, ref) -> float:
    x, ref = x.double(), ref.double()
    den = ref.norm()
    if not bool(den > 0):
        return float((x - ref).norm())
    return float((x - ref).norm() / den)


def make_row(kernel, kind, timed, B, S, H, D, causal=True, ms=None, ms_rounds=None, ratio=None, ratio8=None, rel=None,
             gate=None, rel_own=None, error=None) -> dict:
    """One result row (every key of ROW_KEYS, in that order). ``ms``: the median over the timing
    rounds (``ms_rounds``); ``ratio``: the median over rounds of FA4's time / this time."""
    t = tflops(bwd_flops(B, S, H, D, causal), ms) if ms else None
    row = {"kernel": kernel, "kind": kind, "timed": timed, "B": B, "S": S, "H": H, "D": D, "causal": causal,
           "ms": round(ms, 4) if ms else None, "tflops": round(t, 1) if t else None,
           "ratio_vs_fa4": round(ratio, 3) if ratio else None,
           "ratio_vs_cudnn_fp8": round(ratio8, 3) if ratio8 else None,
           "ms_rounds": [round(x, 4) for x in ms_rounds] if ms_rounds else None,
           "rel_l2_vs_fa4": rel, "gate_pass": gate, "rel_l2_own_forward_vs_fa4": rel_own, "error": error}
    assert tuple(row) == ROW_KEYS
    return row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("modules", nargs="*", help="fp4gen generated modules with a backward: .py files, module "
                   "names under fp4gen.generated, or FILE.attn::KERNEL")
    p.add_argument("--seqlens", default="4096,8192,16384", help="comma-separated S values")
    p.add_argument("--tokens", type=int, default=32768, help="B*S per shape (B = tokens // S)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--anchors", default="fa4,sdpa,cudnn8", help="comma-separated subset of fa4,sdpa,cudnn8 "
                   "('' for none)")
    p.add_argument("--gate", type=float, default=2e-2, help="max rel-L2 of dq, dk, dv vs FA4 (default 2e-2)")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time, ms")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds per shape, contenders interleaved (medians over rounds are reported)")
    p.add_argument("--no-kernel-only", action="store_true", help="time fp4gen's full backward call only")
    p.add_argument("--name", default=None, help="output file stem (default attention-bwd-<date>)")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--watchdog", type=int, default=570,
                   help="seconds before a hung run dumps its stacks and exits (results so far are kept)")
    # the CPU tests run the whole pipeline on stand-in contenders
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    try:
        a.seqlens = [int(x) for x in a.seqlens.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seqlens must be comma-separated integers, got {a.seqlens!r}")
    if not a.seqlens:
        p.error("--seqlens is empty")
    for s in a.seqlens:
        if s <= 0 or a.tokens // s < 1:
            p.error(f"seqlen {s} does not fit --tokens {a.tokens}")
    a.anchor_set = {x.strip() for x in a.anchors.split(",") if x.strip()}
    unknown = a.anchor_set - {"fa4", "sdpa", "cudnn8"}
    if unknown:
        p.error(f"unknown anchors: {', '.join(sorted(unknown))} (known: fa4, sdpa, cudnn8)")
    if a.gate <= 0:
        p.error("--gate must be positive")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    return a


# ---------------------------------------------------------------------------
# fp4gen modules


def ensure_fp4gen_importable():
    sys.path.insert(0, str(HERE))
    from checkout import ensure_fp4gen_importable as ensure

    ensure()


def load_module(item: str):
    ensure_fp4gen_importable()
    from fp4gen.api import load  # .attn specs too (fp4gen.runtime.load takes generated modules only)

    path, kernel = item, None
    if "::" in item:
        path, kernel = item.rsplit("::", 1)
    return load(path, kernel=kernel)


def module_name(mod) -> str:
    return "fp4gen-" + str(getattr(mod, "KERNEL_NAME", mod.__name__.rsplit(".", 1)[-1])).replace("_", "-")


def kernel_only_call(mod, q, k, v, o, lse, do):
    """(fn, why): ``fn()`` re-launches the module's backward kernel on the arguments one full
    ``backward`` call prepared (captured through the template's ``_bwd_launch`` hook), or
    (None, reason). int32 buffers (the deterministic variant's turn counters) are zeroed
    before every launch, as the host code does; the fp32 dQ accumulator just keeps adding."""
    launch = getattr(mod, "_bwd_launch", None)
    if not callable(launch):
        return None, "the module has no _bwd_launch hook"
    import torch

    captured = []

    def spy(*a, **kw):
        captured.append((a, kw))
        return launch(*a, **kw)

    mod._bwd_launch = spy
    try:
        mod.backward(q, k, v, o, lse, do)
    finally:
        mod._bwd_launch = launch
    if len(captured) != 1:
        return None, f"one backward call launched {len(captured)} times through _bwd_launch"
    a, kw = captured[0]
    flat = [t for x in a for t in (x if isinstance(x, (tuple, list)) else (x,))]
    counters = [t for t in flat if isinstance(t, torch.Tensor) and t.dtype == torch.int32]

    def fn():
        for t in counters:
            t.zero_()
        launch(*a, **kw)

    return fn, None


# ---------------------------------------------------------------------------
# timing


def make_timer(warmup_ms, rep_ms, log, device="cuda"):
    import torch

    if device != "cuda":  # the CPU tests: wall clock, median of 3
        def cpu_timer(fn):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[1]

        return cpu_timer, "time.perf_counter on the CPU, median of 3 (test run)"
    try:
        import triton.testing as tt

        def timer(fn):
            return float(tt.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

        return timer, "triton.testing.do_bench(return_mode='median')"
    except Exception as e:  # noqa: BLE001
        log(f"# triton unavailable ({type(e).__name__}); timing with CUDA events")

    def timer(fn, reps=20, warm=3):
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    return timer, "CUDA events, median of 20"


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


# ---------------------------------------------------------------------------
# plot


def plot(rows, png_path, title=""):
    """Grouped bars: TFLOP/s per S, one bar per kernel, its ratio to FA4 written above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("ms")]
    if not ok:
        raise ValueError("no timed rows to plot")
    seqs = sorted({r["S"] for r in ok})
    kernels = []
    for r in ok:  # first-seen order: anchors first, then the modules in command-line order
        if r["kernel"] not in kernels:
            kernels.append(r["kernel"])
    width = 0.8 / len(kernels)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(seqs) * max(1, len(kernels)) / 2), 4.8))
    cmap = plt.get_cmap("tab10")
    bases = []  # a kernel-only row shares its full call's colour, hatched
    for kern in kernels:
        base = kern[: -len("-kernel-only")] if kern.endswith("-kernel-only") else kern
        if base not in bases:
            bases.append(base)
    for i, kern in enumerate(kernels):
        xs, ys, ratios = [], [], []
        for j, s in enumerate(seqs):
            r = next((r for r in ok if r["kernel"] == kern and r["S"] == s), None)
            if r is None:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            ys.append(r["tflops"])
            ratios.append(r.get("ratio_vs_fa4"))
        hatch = "//" if kern.endswith("kernel-only") else None
        base = kern[: -len("-kernel-only")] if hatch else kern
        bars = ax.bar(xs, ys, width * 0.95, label=kern, color=cmap(bases.index(base) % 10), hatch=hatch,
                      edgecolor="white" if hatch else None, alpha=0.75 if hatch else 1.0)
        for b, rt in zip(bars, ratios):
            if rt is not None:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{rt:.2f}x", ha="center", va="bottom",
                        fontsize=7)
    ax.set_xticks(range(len(seqs)))
    ax.set_xticklabels([f"S={s}\nB={next(r['B'] for r in ok if r['S'] == s)}" for s in seqs])
    ax.set_ylabel("TFLOP/s (2.5 x causal forward FLOPs)")
    ax.set_title(title or "causal attention backward", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(0, 1.3 * max(r["tflops"] or 0 for r in ok) + 1e-9)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = "python3 bench/attention_bwd.py " + " ".join(shlex.quote(x) for x in argv_list)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    name = args.name or f"attention-bwd-{date[:10]}"
    out_dir = Path(args.out or os.environ.get("OUT") or (HERE / "results"))

    def log(msg):
        print(msg, flush=True)

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        log("bench/attention_bwd.py: no CUDA device; this benchmark runs on the GPU machine (see docs/runtime.md)")
        return 2

    def sync():
        """After a failure: let the GPU finish before the next contender. A sticky CUDA error
        (illegal address, ...) raises here again; swallow it, so that the remaining rows are
        recorded as errors instead of the script dying."""
        if dev == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                log(f"# CUDA error after a failure: {_first_line(e)}")

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    import faulthandler

    if dev == "cuda" and args.watchdog > 0:
        # a hung kernel must not eat the device call (results so far are on disk)
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    try:
        return _run(args, dev, sync, log, json_path, command, date)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run(args, dev, sync, log, json_path, command, date) -> int:
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=r"Argument aux_data")  # flash-attn-4 compile noise
    timer, timing_method = make_timer(args.warmup, args.rep, log, dev)
    H, D = args.heads, args.head_dim
    doc = {"schema": SCHEMA,
           "meta": {"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                    "torch": torch.__version__, "date": date,
                    "command": command, "causal": True, "H": H, "D": D, "tokens": args.tokens,
                    "flops": "2.5 * 4*B*H*S*S*D / 2 (causal backward)",
                    "timing": f"{timing_method}; {args.rounds} interleaved rounds per shape, medians over rounds",
                    "gate": f"rel-L2 of dq, dk, dv vs {FA4} < {args.gate}",
                    "fp4gen_inputs": "FA4's forward o and LSE (own-forward rel-L2 reported, not gated)",
                    "timed": {"anchor": TIMED_AUTOGRAD, "fp4gen": TIMED_FULL, "fp4gen-fwd-state": TIMED_FULL_STATE,
                              "fp4gen-kernel-only": TIMED_KERNEL}},
           "modules": [], "rows": []}

    def save():
        json_path.write_text(json.dumps(doc, indent=1) + "\n")

    log(f"# {doc['meta']['device']}, torch {torch.__version__}, {date}")
    log(f"# {command}")

    mods = []
    for item in args.modules:
        t0 = time.time()
        try:
            mod = load_module(item)
            if not callable(getattr(mod, "backward", None)):
                raise RuntimeError("the module has no backward (its spec has no backward block)")
            if getattr(mod, "TARGET", None) != "sm90a" and dev == "cuda":
                raise RuntimeError(f"the module targets {getattr(mod, 'TARGET', '?')}, this benchmark runs sm90a")
            if getattr(mod, "BWD_CAUSAL", getattr(mod, "CAUSAL", True)) is not True:
                raise RuntimeError("the module's backward is not causal")
            if getattr(mod, "HEAD_DIM", D) != D:
                raise RuntimeError(f"the module is for head_dim {mod.HEAD_DIM}, not {D}")
            mods.append((module_name(mod), mod))
            doc["modules"].append({"item": item, "name": module_name(mod), "loaded": True,
                                   "seconds": round(time.time() - t0, 1)})
            log(f"loaded {item} as {module_name(mod)} ({time.time() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001
            doc["modules"].append({"item": item, "loaded": False, "error": _first_line(e)})
            log(f"skip {item}: {_first_line(e)}")
    save()

    fa4_func = None
    if "fa4" in args.anchor_set:
        try:
            from flash_attn.cute import flash_attn_func as fa4_func
        except Exception as e:  # noqa: BLE001
            doc["meta"]["fa4_error"] = _first_line(e)
            log(f"skip {FA4}: cannot import flash_attn.cute ({_first_line(e)}); no ratios, no gate")

    log(f"{'kernel':42s} {'B':>3s} {'S':>6s} {'ms':>9s} {'TFLOP/s':>8s} {'xFA4':>6s}  "
        f"rel-L2 vs FA4 (dq dk dv)   gate")

    def emit(row):
        doc["rows"].append(row)
        save()  # after every row: a run cut short still leaves its results
        if row["error"]:
            log(f"{row['kernel']:42s} {row['B']:3d} {row['S']:6d}  failed: {row['error']}")
            return
        rel = row["rel_l2_vs_fa4"]
        rel_s = " ".join(f"{x:.1e}" for x in rel) if rel else "-"
        own = row["rel_l2_own_forward_vs_fa4"]
        gate_s = {True: "pass", False: "FAIL", None: "-"}[row["gate_pass"]]
        if own:
            gate_s += "  (own forward: " + " ".join(f"{x:.1e}" for x in own) + ")"
        log(f"{row['kernel']:42s} {row['B']:3d} {row['S']:6d} {row['ms']:9.3f} {row['tflops']:8.1f} "
            f"{(row['ratio_vs_fa4'] or float('nan')):6.2f}  {rel_s:26s} {gate_s}")

    torch.manual_seed(0)
    for S in args.seqlens:
        B = args.tokens // S
        q, k, v, do = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        # Every contender is set up and gated first; then all are timed in interleaved rounds
        # (FA4, SDPA, fp4gen..., FA4, SDPA, ...), so that a drift of the GPU's clocks during the
        # shape hits them alike. Each row reports the median over rounds of its time and of its
        # per-round ratio to FA4's time in the same round.
        timed = []  # (make_row keyword arguments, the function timed)
        ref_grads, fa4_state = None, None
        # --- FA4: the reference gradients and forward state
        if fa4_func is not None:
            try:
                qf, kf, vf = (x.detach().requires_grad_(True) for x in (q, k, v))
                try:
                    res = fa4_func(qf, kf, vf, causal=True, return_lse=True)
                    out, lse = res[0], res[1]
                except TypeError:  # an FA4 without return_lse
                    res = fa4_func(qf, kf, vf, causal=True)
                    out, lse = (res[0] if isinstance(res, tuple) else res), None

                def fa4_bwd(out=out, leaves=(qf, kf, vf)):
                    return torch.autograd.grad(out, leaves, do, retain_graph=True)

                ref_grads = fa4_bwd()
                fa4_state = (out.detach(), lse.detach().float().contiguous() if lse is not None else None)
                timed.append((dict(kernel=FA4, kind="anchor", timed=TIMED_AUTOGRAD), fa4_bwd))
            except Exception as e:  # noqa: BLE001
                emit(make_row(FA4, "anchor", TIMED_AUTOGRAD, B, S, H, D, error=_first_line(e)))
                sync()

        def gate_of(grads):
            if ref_grads is None:
                return None, None
            rel = [rel_l2(g, r) for g, r in zip(grads, ref_grads)]
            return [float(f"{x:.3e}") for x in rel], all(x < args.gate for x in rel)

        # --- SDPA (cuDNN), called as its users do: contiguous (B, H, S, D)
        if "sdpa" in args.anchor_set:
            try:
                import torch.nn.functional as F
                from torch.nn.attention import SDPBackend, sdpa_kernel

                qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v))
                dot = do.transpose(1, 2).contiguous()
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o_s = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

                def sdpa_bwd(o_s=o_s, leaves=(qt, kt, vt), dot=dot):
                    return torch.autograd.grad(o_s, leaves, dot, retain_graph=True)

                rel, ok = gate_of([g.transpose(1, 2) for g in sdpa_bwd()])
                timed.append((dict(kernel=SDPA, kind="anchor", timed=TIMED_AUTOGRAD, rel=rel, gate=ok), sdpa_bwd))
            except Exception as e:  # noqa: BLE001
                emit(make_row(SDPA, "anchor", TIMED_AUTOGRAD, B, S, H, D, error=_first_line(e)))
                sync()

        # --- cuDNN FP8 (E4M3 q, k, v, o-free dO; quantized once, outside the timed call). Its
        # rel-L2 is reported, not gated: FP8 gradients are not held to the BF16 gate.
        if "cudnn8" in args.anchor_set:
            why = cudnn_fp8.available() if dev == "cuda" else "no CUDA device"
            if why:
                log(f"skip {CUDNN_FP8}: {why}")
            else:
                try:
                    c8 = cudnn_fp8.CudnnFp8Attention(q, k, v, True, do=do)
                    rel, _ok = gate_of(c8.grads_dequantized(c8.backward()))
                    timed.append((dict(kernel=CUDNN_FP8, kind="anchor", timed=TIMED_CUDNN_FP8, rel=rel), c8.backward))
                except Exception as e:  # noqa: BLE001
                    emit(make_row(CUDNN_FP8, "anchor", TIMED_CUDNN_FP8, B, S, H, D, error=_first_line(e)))
                    sync()

        # --- fp4gen modules
        for mname, mod in mods:
            try:
                own_o, own_lse = mod.forward(q, k, v, return_lse=True)
                o, lse = fa4_state if (fa4_state is not None and fa4_state[1] is not None) else (own_o, own_lse)
                rel, ok = gate_of(mod.backward(q, k, v, o, lse, do))  # the first call also compiles
                rel_own = None
                if o is not own_o and ref_grads is not None:
                    rel_own = [float(f"{rel_l2(g, r):.3e}") for g, r in
                               zip(mod.backward(q, k, v, own_o, own_lse, do), ref_grads)]
                del own_o, own_lse

                def full(mod=mod, o=o, lse=lse):
                    return mod.backward(q, k, v, o, lse, do)

                timed.append((dict(kernel=mname, kind="fp4gen", timed=TIMED_FULL, rel=rel, gate=ok,
                                   rel_own=rel_own), full))
                if getattr(mod, "BWD_S_FP8", False) and callable(getattr(mod, "quantize_inputs", None)):
                    # the training path: the backward reuses what the FP8 forward quantized
                    from fp4gen.torch_ops import forward_state_options

                    prepared = mod.quantize_inputs(q, k, v, **forward_state_options(mod))
                    rel_s, ok_s = gate_of(mod.backward(q, k, v, o, lse, do, prepared=prepared))

                    def with_state(mod=mod, o=o, lse=lse, prepared=prepared):
                        return mod.backward(q, k, v, o, lse, do, prepared=prepared)

                    timed.append((dict(kernel=mname + "-fwd-state", kind="fp4gen", timed=TIMED_FULL_STATE,
                                       rel=rel_s, gate=ok_s), with_state))
            except Exception as e:  # noqa: BLE001
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc()
                emit(make_row(mname, "fp4gen", TIMED_FULL, B, S, H, D, error=_first_line(e)))
                sync()
                continue
            if args.no_kernel_only:
                continue
            try:
                fn, why = kernel_only_call(mod, q, k, v, o, lse, do)
                if fn is None:
                    log(f"{mname + '-kernel-only':42s} {B:3d} {S:6d}  not timed: {why}")
                    continue
                timed.append((dict(kernel=mname + "-kernel-only", kind="fp4gen", timed=TIMED_KERNEL, rel=rel,
                                   gate=ok), fn))
            except Exception as e:  # noqa: BLE001
                emit(make_row(mname + "-kernel-only", "fp4gen", TIMED_KERNEL, B, S, H, D, error=_first_line(e)))
                sync()

        # --- timing: interleaved rounds
        times = [[] for _ in timed]
        errors = [None] * len(timed)
        for _ in range(args.rounds):
            for i, (_kw, fn) in enumerate(timed):
                if errors[i] is None:
                    try:
                        times[i].append(timer(fn))
                    except Exception as e:  # noqa: BLE001
                        errors[i] = _first_line(e)
                        sync()
        fa4_times = times[0] if (timed and timed[0][0]["kernel"] == FA4 and errors[0] is None) else None
        c8_times = next((ts for (kw, _f), ts, err in zip(timed, times, errors)
                         if kw["kernel"] == CUDNN_FP8 and err is None), None)
        for (kw, _fn), ts, err in zip(timed, times, errors):
            kw = dict(kw)
            kernel, kind, how = kw.pop("kernel"), kw.pop("kind"), kw.pop("timed")
            if err is not None:
                emit(make_row(kernel, kind, how, B, S, H, D, error=err, **kw))
                continue
            ratios = [f / t for f, t in zip(fa4_times, ts)] if fa4_times else None
            ratios8 = [c / t for c, t in zip(c8_times, ts)] if c8_times else None
            emit(make_row(kernel, kind, how, B, S, H, D, ms=median(ts), ms_rounds=ts,
                          ratio=median(ratios) if ratios else None,
                          ratio8=median(ratios8) if ratios8 else None, **kw))
        del timed, times

        del q, k, v, do, ref_grads, fa4_state
        if dev == "cuda":
            torch.cuda.empty_cache()

    save()
    n_fail = sum(1 for r in doc["rows"] if r["gate_pass"] is False)
    n_err = sum(1 for r in doc["rows"] if r["error"])
    log(f"wrote {json_path} ({len(doc['rows'])} rows, {n_err} errors, {n_fail} gate failures)")
    if not args.no_plot:
        try:
            png = plot(doc["rows"], json_path.with_suffix(".png"),
                       title=f"causal backward, {doc['meta']['device']}, H={H}, D={D}, B*S={args.tokens}")
            log(f"wrote {png}")
        except Exception as e:  # noqa: BLE001  (no matplotlib, nothing timed): the JSON stands
            log(f"no plot ({_first_line(e)})")
    return 1 if (n_fail or n_err) else 0


if __name__ == "__main__":
    sys.exit(main())
