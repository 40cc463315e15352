#!/usr/bin/env python3
"""Plot bench/attention.py results: TFLOP/s against sequence length.

One panel per (pass, mask); one line per kernel; FA4 BF16 drawn dashed as
the baseline. Used by bench/attention.py at the end of a run when matplotlib
is importable, or afterwards on any machine:

    python bench/plot.py bench/results/attention-2026-11-29.json [-o out.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plot_rows(rows, png_path, title=""):
    """Write a PNG for ``rows`` (the JSON list bench/attention.py writes); return its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on either machine
    import matplotlib.pyplot as plt

    panels = sorted({(r["pass"], bool(r["causal"])) for r in rows}, key=lambda p: (p[0] != "fwd", p[1]))
    if not panels:
        raise ValueError("no rows to plot")
    ncols = min(len(panels), 2)
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    kernels = sorted({r["kernel"] for r in rows}, key=lambda k: (not k.startswith("fa4"), k))
    # one colour per kernel in every panel
    # (tab20 has 20 distinct colours; C0..C9 repeat once a run has more than 10 kernels)
    cmap = plt.get_cmap("tab20")
    colors = {k: cmap(i % 20) for i, k in enumerate(kernels)}
    for ax, (pas, causal) in zip(axes.flat, panels):
        for kern in kernels:
            pts = sorted((r["S"], r["tflops"]) for r in rows
                         if r["kernel"] == kern and r["pass"] == pas and bool(r["causal"]) == causal)
            if not pts:
                continue
            xs, ys = zip(*pts)
            # anchors dashed, fp4gen end-to-end dotted, fp4gen kernel-only solid
            style = "-" if kern.endswith("kernel-only") else (":" if kern.startswith("fp4gen") else "--")
            ax.plot(xs, ys, style, marker="o", label=kern, color=colors[kern])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S (B*S fixed)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{pas}, {'causal' if causal else 'no mask'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot bench/attention.py JSON results")
    p.add_argument("json", help="results file written by bench/attention.py")
    p.add_argument("-o", "--output", help="PNG path (default: next to the JSON)")
    a = p.parse_args(argv)
    src = Path(a.json)
    try:
        rows = json.loads(src.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"plot.py: cannot read {src}: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"plot.py: {src} has no rows", file=sys.stderr)
        return 1
    d = rows[0]
    title = f"{d.get('device', '')}, H={d.get('H')}, D={d.get('D')}, {d.get('date', '')[:10]}"
    try:
        out = plot_rows(rows, a.output or src.with_suffix(".png"), title=title)
    except ImportError:
        print("plot.py: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
