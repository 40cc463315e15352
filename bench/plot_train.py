#!/usr/bin/env python3
"""Side-by-side loss curves from bench/train_gpt.py result files.

    python3 bench/plot_train.py train_sdpa.json train_bf16.json train_fp8.json -o train_loss.png \
        [--summary train_summary.json]

Left: training loss (the mean over each logging window) against step, with the
held-out loss as markers. Middle: each run's training loss minus the first
run's (the baseline, e.g. SDPA BF16), smoothed over a few logging windows.
Right: the median step time of each window. Each run's legend entry carries its
median step time (after the warm-up steps) and its final held-out loss. A short
text summary is printed, and ``--summary`` writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def ran_on(run: dict) -> str:
    """'fwd+bwd generated', 'fwd generated, bwd reference', ... from the op's dispatch counts."""
    counts = run.get("dispatch_counts") or {}
    parts = {}
    for p in ("fwd", "bwd"):
        kinds = sorted(k.split("/", 1)[1] for k, n in counts.items() if k.startswith(p + "/") and n)
        parts[p] = "+".join(kinds) or "?"
    if parts["fwd"] == parts["bwd"]:
        return f"fwd+bwd {parts['fwd']}"
    return f"fwd {parts['fwd']}, bwd {parts['bwd']}"


def label_of(run: dict) -> str:
    if run.get("attn") != "fp4gen":
        amp = run.get("config", {}).get("amp")
        name = "SDPA" if run.get("attn") == "sdpa" else str(run.get("attn", "?"))
        return f"{name} BF16" if amp == "bf16" else f"{name} fp32"
    spec = run.get("spec") or {}
    where = ran_on(run)
    tag = "" if where == "fwd+bwd generated" else f" [{where}]"  # the usual case goes unsaid
    return f"{spec.get('kernel', '?')}{tag}"


def step_ms(run: dict) -> float:
    """Median step time: the run's own summary (after warm-up), else the median of its windows."""
    ms = run.get("ms_per_step")
    if ms is not None:
        return float(ms)
    log = run.get("log") or []
    return statistics.median(r["ms_per_step"] for r in log) if log else float("nan")


def summary_row(run: dict) -> dict:
    log = run.get("log") or []
    return {"label": label_of(run), "file": run.get("_file"), "steps": log[-1]["step"] if log else 0,
            "last_train_loss": log[-1]["loss"] if log else None,
            "final_val_loss": run.get("final_val_loss"), "ms_per_step": step_ms(run),
            "diverged_at_step": run.get("diverged_at_step"),
            "stopped_early_at_step": run.get("stopped_early_at_step"),
            "dispatch_counts": run.get("dispatch_counts"), "device": run.get("device")}


def summary(run: dict) -> str:
    r = summary_row(run)
    div, stop, val = r["diverged_at_step"], r["stopped_early_at_step"], r["final_val_loss"]
    tail = (f"diverged at step {div}" if div else f"final val {val:.4f}" if val is not None else "no val")
    if stop:
        tail += f" (stopped early at step {stop})"
    last = r["last_train_loss"] if r["last_train_loss"] is not None else float("nan")
    return (f"{r['label']:60s} steps {r['steps']:6d}  last train {last:.4f}  {tail}  "
            f"median {r['ms_per_step']:.2f} ms/step")


def _smooth(ys, n):
    out = []
    for i in range(len(ys)):
        w = ys[max(0, i - n + 1): i + 1]
        out.append(sum(w) / len(w))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="train_<name>.json files from bench/train_gpt.py "
                    "(the first is the baseline of the difference panel)")
    ap.add_argument("-o", "--out", default="train_loss.png")
    ap.add_argument("--summary", help="also write the summary (final losses, step times) as JSON here")
    ap.add_argument("--smooth", type=int, default=10, help="logging windows averaged in the difference panel")
    args = ap.parse_args(argv)
    runs, skipped = [], []
    for p in args.results:
        # a run that failed or was cut off leaves no file: plot the others and say so
        try:
            run = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            skipped.append(f"{p}: cannot read ({e})")
            continue
        if not isinstance(run, dict) or "log" not in run:
            skipped.append(f"{p}: not a bench/train_gpt.py result (no 'log')")
            continue
        run["_file"] = Path(p).name
        runs.append(run)
    for msg in skipped:
        print(f"warning: skipped {msg}", file=sys.stderr)
    if not runs:
        ap.error("no readable result files")
    try:
        import matplotlib
    except ImportError:
        ap.error("matplotlib is not installed (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff, ax_time) = plt.subplots(1, 3, figsize=(21, 6.5))
    base = runs[0]
    base_loss = {r["step"]: r["loss"] for r in base.get("log") or []}
    for i, run in enumerate(runs):
        label = label_of(run)
        ms = step_ms(run)
        val = run.get("final_val_loss")
        legend = f"{label}, {ms:.1f} ms/step" + (f", val {val:.3f}" if val is not None else "")
        if run.get("diverged_at_step"):
            legend += f", diverged at {run['diverged_at_step']}"
        log = run.get("log") or []
        steps = [r["step"] for r in log]
        line, = ax_loss.plot(steps, [r["loss"] for r in log], label=legend, lw=1.1)
        color = line.get_color()
        ev = run.get("eval") or []
        if ev:
            ax_loss.plot([e["step"] for e in ev], [e["val_loss"] for e in ev], "o--", color=color, ms=4, lw=0.8)
        shared = [r for r in log if r["step"] in base_loss and math.isfinite(r["loss"])]
        if i > 0 and shared:
            diff = _smooth([r["loss"] - base_loss[r["step"]] for r in shared], args.smooth)
            ax_diff.plot([r["step"] for r in shared], diff, color=color, lw=1.1, label=f"{label} - baseline")
        ax_time.plot(steps, [r["ms_per_step"] for r in log], color=color, lw=1.0, label=f"{label}: {ms:.2f} ms")
        for ax in (ax_loss, ax_diff):
            if run.get("diverged_at_step"):
                ax.axvline(run["diverged_at_step"], color=color, ls=":", lw=1)
    m = base.get("model", {})
    ax_loss.set_title(f"byte-level GPT {m.get('params', 0) / 1e6:.1f}M, {m.get('layers')}L d{m.get('d_model')} "
                      f"{m.get('heads')}x{m.get('head_dim')} seq {m.get('seq')} ({base.get('device', '?')})",
                      fontsize=10)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats/byte); markers: held-out")
    # the first 10% of the windows (loss from ~5.5 down) would flatten the rest of the curves
    finals = [r["loss"] for run in runs for r in (run.get("log") or [])[len(run.get("log") or []) // 10:]
              if math.isfinite(r["loss"])]
    if finals:
        lo, hi = min(finals), max(finals)
        ax_loss.set_ylim(lo - 0.05 * (hi - lo + 1e-3), hi + 0.05 * (hi - lo + 1e-3))
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=7, loc="upper right")
    ax_diff.axhline(0.0, color="black", lw=0.8)
    ax_diff.set_title(f"training loss minus {label_of(base)} (mean of {args.smooth} windows)", fontsize=10)
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("loss difference (nats/byte)")
    ax_diff.grid(alpha=0.3)
    if len(runs) > 1:
        ax_diff.legend(fontsize=8)
    ax_time.set_title("step time (median per logging window); legend: median after warm-up", fontsize=10)
    ax_time.set_xlabel("step")
    ax_time.set_ylabel("ms / step")
    ax_time.set_ylim(bottom=0)  # step times of the runs side by side, from zero
    ax_time.grid(alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    for run in runs:
        print(summary(run))
    shas = {r.get("corpus", {}).get("sha256") for r in runs}
    warn = None
    if len(shas) > 1:
        warn = "the runs used different corpora (Python versions differ): losses are not comparable"
        print("warning: " + warn)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(
            {"png": Path(args.out).name, "baseline": label_of(base), "warning": warn, "skipped": skipped,
             "runs": [summary_row(r) for r in runs]}, indent=1) + "\n")
        print(f"wrote {args.summary}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
