#!/usr/bin/env python3
"""Side-by-side loss curves from bench/train_gpt.py result files.

    python3 bench/plot_train.py train_sdpa.json train_fp4gen.json -o train_loss.png

Left: training loss (the mean over each logging window) against step, with the
held-out loss as markers. Right: the median step time of each window. Each run
is labelled with its attention (and spec, and which backend ran it). A short
text summary (final losses, median step time) is printed too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def label_of(run: dict) -> str:
    if run.get("attn") != "fp4gen":
        return f"{run.get('attn', '?')} (bf16)" if run.get("config", {}).get("amp") == "bf16" else run.get("attn", "?")
    spec = run.get("spec") or {}
    counts = run.get("dispatch_counts") or {}
    ran = "generated" if any(k.endswith("/generated") for k in counts) else "reference"
    return f"fp4gen {spec.get('kernel', '?')} [{ran}]"


def summary(run: dict) -> str:
    log = run.get("log") or []
    ms = statistics.median(r["ms_per_step"] for r in log) if log else float("nan")
    last = log[-1]["loss"] if log else float("nan")
    val = run.get("final_val_loss")
    div = run.get("diverged_at_step")
    tail = f"diverged at step {div}" if div else f"final val {val:.4f}" if val is not None else "no val"
    return f"{label_of(run):45s} steps {log[-1]['step'] if log else 0:6d}  last train {last:.4f}  {tail}  median {ms:.1f} ms/step"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="train_<attn>.json files from bench/train_gpt.py")
    ap.add_argument("-o", "--out", default="train_loss.png")
    args = ap.parse_args(argv)
    runs = []
    for p in args.results:
        try:
            runs.append(json.loads(Path(p).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"cannot read {p}: {e}")
    try:
        import matplotlib
    except ImportError:
        ap.error("matplotlib is not installed (pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(13, 4.8))
    for run in runs:
        label = label_of(run)
        log = run.get("log") or []
        line, = ax_loss.plot([r["step"] for r in log], [r["loss"] for r in log], label=f"{label} train", lw=1.2)
        ev = run.get("eval") or []
        if ev:
            ax_loss.plot([e["step"] for e in ev], [e["val_loss"] for e in ev], "o--", color=line.get_color(),
                         ms=4, lw=0.8, label=f"{label} val")
        ax_time.plot([r["step"] for r in log], [r["ms_per_step"] for r in log], color=line.get_color(), label=label)
        if run.get("diverged_at_step"):
            ax_loss.axvline(run["diverged_at_step"], color=line.get_color(), ls=":", lw=1)
    m = runs[0].get("model", {})
    ax_loss.set_title(f"byte-level GPT, {m.get('layers')}L d{m.get('d_model')} "
                      f"{m.get('heads')}x{m.get('head_dim')} seq {m.get('seq')} ({runs[0].get('device', '?')})")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats/byte)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_time.set_title("step time (median per logging window)")
    ax_time.set_xlabel("step")
    ax_time.set_ylabel("ms / step")
    ax_time.set_yscale("log")
    ax_time.grid(alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    for run in runs:
        print(summary(run))
    shas = {r.get("corpus", {}).get("sha256") for r in runs}
    if len(shas) > 1:
        print("warning: the runs used different corpora (Python versions differ): losses are not comparable")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
