#!/usr/bin/env python3
"""The static performance model (fp4gen/lowering/perf.py) against one H200 run.

Two halves, two machines:

1. On the H200 (``--measure``, the default when CUDA is present): in one process, time
   fp4gen's sm90a forwards (BF16, FP8 exp, FP8 Direct-P; causal and not; D128) and FA4's sm90
   BF16 forward at S 4k and 16k with bench/attention.py's own timing loop (imported and run,
   ``--rounds`` times), and write ``$OUT/perf-model-h200-measured.json``: rows of ``kernel``,
   ``S``, ``causal``, ``measured_ratio`` (the median over rounds of FA4's time / the kernel's,
   within each round), ``ms`` and ``round_ratios``. An FP8 module is timed twice by
   bench/attention.py: end to end and ``-kernel-only`` (its inputs quantized outside the timed
   call); the model predicts the kernel, so the join uses the kernel-only row.

2. On the CPU (``--predict MEASURED.json``): predict every kernel with perf.py (same shapes:
   B = 32768 // S, H 16, D 128), join with ``predicted_ratio``, and write
   ``bench/results/perf-model-h200.json`` (rows: ``kernel``, ``S``, ``causal``,
   ``predicted_ratio``, ``measured_ratio``, ``error`` = predicted / measured - 1, and the
   model's bottleneck) and ``bench/results/perf-model-h200.png`` (predicted vs measured).

    python3 bench/perf_model_h200.py                       # on the H200 (device tool), writes $OUT
    python3 bench/perf_model_h200.py --predict $OUT/perf-model-h200-measured.json
    python3 bench/perf_model_h200.py --predict bench/results/attention-sm90-fwd-d128-fusedquant-h200.json \
        --name perf-model-h200-vs-fusedquant-run     # against an earlier run's rows

FA4 on the CPU side: flash-attn-4 4.0.0b36 in a folder named by $FP4GEN_FA4_PATH
(fp4gen/lowering/perf.py ``fa4_ptx`` says how to install it there).

Through the device tool (docs/runtime.md; ~3-5 minutes of command time for 3 rounds):

    run(carry=[".dev"], timeout_s=600, command="source .dev/activate && export PYTHONUNBUFFERED=1 && "
        "python3 bench/perf_model_h200.py --rounds 3")
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

KERNELS = [f"generated/sm90_{p}{c}_d128_sm90a.py" for c in ("", "_causal") for p in ("bf16", "fp8_exp", "fp8_directp")]
SEQLENS = (4096, 16384)
TOKENS, HEADS, HEAD_DIM = 32768, 16, 128
FA4 = "fa4-cute-bf16"


def bench_name(module_path: str) -> str:
    """The row name bench/attention.py gives a generated module (``fp4gen_kernel_name``)."""
    sys.path.insert(0, str(HERE))
    import attention

    class _M:  # the three attributes fp4gen_kernel_name reads, from the module's text
        pass

    m = _M()
    consts = _constants(ROOT / module_path)
    m.TARGET, m.KERNEL_NAME = consts.get("TARGET", "unknown"), consts.get("KERNEL_NAME", Path(module_path).stem)
    m.__name__ = Path(module_path).stem
    return attention.fp4gen_kernel_name(m)


def _constants(path: Path) -> dict:
    import ast

    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except Exception:
                pass
    return out


# ----------------------------------------------------------------------------- H200 half


def measure(out_dir: Path, rounds: int, warmup: int, rep: int) -> Path:
    sys.path.insert(0, str(HERE))
    import attention

    per_round = []
    for r in range(rounds):
        name = f"perf-model-h200-round{r + 1}"
        rc = attention.main([*KERNELS, "--seqlens", ",".join(map(str, SEQLENS)), "--tokens", str(TOKENS),
                             "--heads", str(HEADS), "--head-dim", str(HEAD_DIM), "--anchors", "fa4",
                             "--warmup", str(warmup), "--rep", str(rep), "--name", name,
                             "--out-dir", str(out_dir), "--no-plot"])
        if rc != 0:
            raise SystemExit(f"bench/attention.py exited {rc} in round {r + 1}")
        per_round.append(json.loads((out_dir / f"{name}.json").read_text()))
    groups = {}
    for rows in per_round:
        for row in rows:
            if row.get("pass", "fwd") != "fwd" or row.get("ratio_vs_fa4_bf16") is None:
                continue
            groups.setdefault((row["kernel"], row["S"], row["causal"]), []).append(row)
    out = []
    for (kernel, s, causal), rows in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        ratios = [x["ratio_vs_fa4_bf16"] for x in rows]
        out.append({"kernel": kernel, "S": s, "causal": causal, "measured_ratio": round(statistics.median(ratios), 3),
                    "round_ratios": ratios, "ms": statistics.median(x["ms"] for x in rows),
                    "tflops": statistics.median(x["tflops"] for x in rows), "device": rows[0]["device"],
                    "date": rows[0]["date"]})
    path = out_dir / "perf-model-h200-measured.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({len(out)} rows)")
    return path


# ----------------------------------------------------------------------------- CPU half


def predictions(seqlens=SEQLENS, gpu: str = "h200") -> list:
    """One row per (kernel, S, causal): the model's TFLOP/s and its ratio to FA4's BF16 forward."""
    sys.path.insert(0, str(ROOT))
    from fp4gen.lowering import perf

    fa4 = {c: perf.fa4_artifacts("sm_90a", c) for c in (False, True)}
    rows = []
    for path in KERNELS:
        art = perf.fp4gen_artifacts(str(ROOT / path))
        for s in seqlens:
            shape = {"B": TOKENS // s, "H": HEADS, "S": s, "D": HEAD_DIM, "causal": art.info.causal}
            p = perf.with_fa4_ratio(perf.predict(art, gpu, shape), perf.predict(fa4[art.info.causal], gpu, shape))
            # the steady state (no rebase: these kernels have none) and the count of cold
            # instructions the model left out of it (perf.cold_regions)
            rows.append({"kernel": bench_name(path), "S": s, "causal": art.info.causal,
                         "predicted_ratio": p["ratio_vs_fa4_bf16"], "predicted_tflops": p["predicted_tflops"],
                         "bottleneck": p["bottleneck"], "cycles_per_tile": p["cycles_per_tile"],
                         "worst_case_ratio": p["worst_case"]["ratio_vs_fa4_bf16"],
                         "cold_instructions_per_tile": p["cold"]["instructions_per_tile"]})
    for c in (False, True):
        for s in seqlens:
            shape = {"B": TOKENS // s, "H": HEADS, "S": s, "D": HEAD_DIM, "causal": c}
            p = perf.predict(fa4[c], gpu, shape)
            rows.append({"kernel": FA4, "S": s, "causal": c, "predicted_ratio": 1.0,
                         "predicted_tflops": p["predicted_tflops"], "bottleneck": p["bottleneck"],
                         "cycles_per_tile": p["cycles_per_tile"]})
    return rows


def as_measured(rows: list) -> list:
    """Measured rows as ``measure`` writes them; rows of bench/attention.py's own JSON (an
    earlier run: ``ratio_vs_fa4_bf16``) are taken too, forward D128 at the S values here."""
    out = []
    for r in rows:
        if "measured_ratio" in r:
            out.append(r)
        elif (r.get("pass", "fwd") == "fwd" and r.get("D", HEAD_DIM) == HEAD_DIM and r.get("S") in SEQLENS
              and r.get("ratio_vs_fa4_bf16") is not None):
            out.append({"kernel": r["kernel"], "S": r["S"], "causal": r["causal"],
                        "measured_ratio": r["ratio_vs_fa4_bf16"], "ms": r.get("ms"), "tflops": r.get("tflops"),
                        "device": r.get("device"), "date": r.get("date")})
    return out


def predicted_ratio(measured: list, predicted: list) -> list:
    """Join measured rows (kernel, S, causal, measured_ratio) with predicted ones. A kernel
    measured both end to end and ``-kernel-only`` is compared on its kernel-only row (the model
    has no quantization pass); the end-to-end row is kept, marked ``compared: false``."""
    pred = {(r["kernel"], r["S"], r["causal"]): r for r in predicted}
    have_ko = {(m["kernel"][: -len("-kernel-only")], m["S"], m["causal"]) for m in measured
               if m["kernel"].endswith("-kernel-only")}
    out = []
    for m in measured:
        base = m["kernel"][: -len("-kernel-only")] if m["kernel"].endswith("-kernel-only") else m["kernel"]
        key = (base, m["S"], m["causal"])
        p = pred.get(key)
        if p is None:
            continue
        compared = m["kernel"].endswith("-kernel-only") or key not in have_ko
        row = {"kernel": m["kernel"], "S": m["S"], "causal": m["causal"], "predicted_ratio": p["predicted_ratio"],
               "measured_ratio": m["measured_ratio"],
               "error": round(p["predicted_ratio"] / m["measured_ratio"] - 1, 3) if m["measured_ratio"] else None,
               "compared": compared, "predicted_tflops": p["predicted_tflops"], "bottleneck": p["bottleneck"]}
        for k in ("worst_case_ratio", "cold_instructions_per_tile"):
            if k in p:
                row[k] = p[k]
        for k in ("tflops", "ms", "round_ratios", "device", "date"):
            if k in m:
                row["measured_" + k if k in ("tflops", "ms") else k] = m[k]
        out.append(row)
    return out


def ranks_agree(rows: list) -> dict:
    """Per (S, causal): does the predicted order of the compared kernels match the measured one?"""
    out = {}
    for key in sorted({(r["S"], r["causal"]) for r in rows}):
        rs = [r for r in rows if (r["S"], r["causal"]) == key and r["compared"]]
        by_p = [r["kernel"] for r in sorted(rs, key=lambda r: r["predicted_ratio"])]
        by_m = [r["kernel"] for r in sorted(rs, key=lambda r: r["measured_ratio"])]
        out[f"S={key[0]} causal={key[1]}"] = by_p == by_m
    return out


def plot(rows: list, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows if r["compared"]]
    fig, ax = plt.subplots(figsize=(6.5, 6))
    lo = min(min(r["measured_ratio"] for r in rs), min(r["predicted_ratio"] for r in rs)) * 0.9
    hi = max(max(r["measured_ratio"] for r in rs), max(r["predicted_ratio"] for r in rs)) * 1.1
    xs = [lo, hi]
    ax.plot(xs, xs, "k-", lw=1, label="predicted = measured")
    ax.fill_between(xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], color="0.9", label="±15%")
    markers = {(4096, False): "o", (16384, False): "s", (4096, True): "^", (16384, True): "D"}
    for r in rs:
        kind = ("fa4" if r["kernel"] == FA4 else "bf16" if "bf16" in r["kernel"]
                else "fp8-exp" if "exp" in r["kernel"] else "fp8-directp")
        color = {"fa4": "k", "bf16": "tab:blue", "fp8-exp": "tab:orange", "fp8-directp": "tab:green"}[kind]
        ax.scatter(r["measured_ratio"], r["predicted_ratio"], c=color, marker=markers.get((r["S"], r["causal"]), "x"))
    for kind, color in (("FA4 BF16", "k"), ("fp4gen BF16", "tab:blue"), ("fp4gen FP8 exp", "tab:orange"),
                        ("fp4gen FP8 Direct-P", "tab:green")):
        ax.scatter([], [], c=color, label=kind)
    for (s, c), mk in markers.items():
        ax.scatter([], [], c="0.5", marker=mk, label=f"S={s // 1024}k{' causal' if c else ''}")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured ratio to FA4 BF16 (H200)")
    ax.set_ylabel("predicted ratio to FA4 BF16 (static model)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--predict", metavar="MEASURED_JSON", help="CPU half: join these measured rows with the model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out-dir", default=None, help="default: $OUT (device), else bench/results")
    ap.add_argument("--name", default="perf-model-h200")
    a = ap.parse_args(argv)
    out_dir = Path(a.out_dir or os.environ.get("OUT") or (HERE / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not a.predict:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run this on the H200, or give --predict MEASURED.json", file=sys.stderr)
            return 2
        measure(out_dir, a.rounds, a.warmup, a.rep)
        return 0
    measured = as_measured(json.loads(Path(a.predict).read_text()))
    rows = predicted_ratio(measured, predictions())
    ok = [r for r in rows if r["compared"]]
    worst = max(ok, key=lambda r: abs(r["error"]))
    summary = {"rows": rows, "within_15pct": all(abs(r["error"]) <= 0.15 for r in ok),
               "worst": {k: worst[k] for k in ("kernel", "S", "causal", "error")}, "ranks_agree": ranks_agree(rows),
               "measured_from": str(a.predict),
               "model": "steady state: cold regions (fp4gen/lowering/perf.py cold_regions) charged 0 times "
                        "per KV tile; worst_case_ratio charges them on every tile",
               "command": "python3 bench/perf_model_h200.py --predict " + str(a.predict)}
    path = out_dir / f"{a.name}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{'kernel':48s} {'S':>6s} {'causal':6s} {'pred':>6s} {'meas':>6s} {'err':>7s}  bottleneck")
    for r in rows:
        print(f"{r['kernel']:48s} {r['S']:6d} {str(r['causal']):6s} {r['predicted_ratio']:6.3f} "
              f"{r['measured_ratio']:6.3f} {r['error']:+7.1%}{'' if r['compared'] else ' (end to end)'}  {r['bottleneck']}")
    print(f"within 15%: {summary['within_15pct']}; ranks agree: {summary['ranks_agree']}")
    try:
        png = plot(rows, path.with_suffix(".png"), f"static model vs {measured[0].get('device', 'H200')} "
                                                   f"({measured[0].get('date', '')})")
        print(f"wrote {path} and {png}")
    except ImportError as e:
        print(f"wrote {path}; no plot ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
