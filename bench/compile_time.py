#!/usr/bin/env python3
"""CPU compile time of every sm100a kernel, at an old commit against this checkout (issue 16:
"compile time per kernel must not grow by more than 20%").

    git worktree add /tmp/old16 3dfd8ce
    python bench/compile_time.py --old /tmp/old16 --runs 3 \\
        --json bench/results/compile-time-sm100-cpu.json

A kernel is one call of a generated sm100a module: ``compile_only("sm_100a")``'s forward
(``_bwd_forward_compile_only`` where the module also has a backward, so that the forward is
timed alone) and ``compile_only_backward("sm_100a")`` (its bf16 and GQA variants). Each
measurement is one fresh process running that tree's own generated module with that tree's
own fp4gen sources (``PYTHONPATH`` = the tree; the child reports which fp4gen it imported and
the run fails if it is not the tree's), with empty fp4gen and CuTe DSL caches, so nothing is
loaded that an earlier run compiled. The call is timed alone (not the imports): wall clock and
the process's CPU time (every thread, plus child processes). Runs are interleaved (old, new,
then new, old on the next round) so that drift in the machine's load hits both sides alike;
the medians are compared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROWTH_LIMIT = 0.20  # issue 16's allowance

_CHILD = r"""
import importlib.util, json, os, resource, sys, time
tree, module, part = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("fp4gen_compile_timed", module)
m = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = m  # registered, as an import does (a module with outlier transforms needs it)
spec.loader.exec_module(m)
call = m.compile_only_backward if part == "backward" else getattr(m, "_bwd_forward_compile_only", m.compile_only)
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
w0, c0 = time.perf_counter(), cpu()
names = call("sm_100a")
wall, cpu_s = time.perf_counter() - w0, cpu() - c0
import fp4gen.device, fp4gen.runtime
files = [sys.modules[n].__file__ for n in ("fp4gen", "fp4gen.device", "fp4gen.runtime")]
print(json.dumps({"wall_s": wall, "cpu_s": cpu_s, "names": names, "fp4gen_files": files}))
"""


def kernels(new: Path, old: Path) -> list:
    """(module file name, part) of every sm100a kernel of ``new``'s generated/; whether ``old`` has it."""
    out = []
    for mod in sorted((new / "generated").glob("*_sm100a.py")):
        parts = ["forward"] + (["backward"] if "def compile_only_backward" in mod.read_text() else [])
        for part in parts:
            out.append((mod.name, part, (old / "generated" / mod.name).is_file()))
    return out


def measure(tree: Path, module: str, part: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="fp4gen_ctime_") as d:
        env = dict(os.environ, PYTHONPATH=str(tree), CUTE_DSL_ARCH="sm_100a",
                   FP4GEN_CACHE_DIR=str(Path(d) / "fp4gen"), CUTE_DSL_CACHE_DIR=str(Path(d) / "cute"))
        env.pop("CUTE_DSL_KEEP", None)
        r = subprocess.run([sys.executable, "-c", _CHILD, str(tree), str(tree / "generated" / module), part],
                           env=env, cwd=str(tree), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{tree}/{module} {part}: compile failed\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    stray = [f for f in res.pop("fp4gen_files") if not Path(f).resolve().is_relative_to(tree.resolve())]
    if stray:
        raise SystemExit(f"{tree}/{module}: imported fp4gen from outside the tree: {stray}")
    return res


def git_head(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="a checkout (worktree) of the old commit")
    ap.add_argument("--new", type=Path, default=ROOT, help="the checkout to compare (default: this one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated module-name substrings to keep")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    todo = [k for k in kernels(args.new, args.old) if not args.only or any(s in k[0] for s in args.only.split(","))]
    samples = {(m, p, side): [] for m, p, has_old in todo for side in ("old", "new") if side == "new" or has_old}
    t0 = time.time()
    for run in range(args.runs):
        for module, part, has_old in todo:
            sides = ("old", "new") if run % 2 == 0 else ("new", "old")
            for side in sides:
                if side == "old" and not has_old:
                    continue
                res = measure(args.old if side == "old" else args.new, module, part)
                samples[(module, part, side)].append(res)
                print(f"run {run + 1} {side:3s} {module} {part}: {res['cpu_s']:.1f} s CPU, "
                      f"{res['wall_s']:.1f} s wall", file=sys.stderr, flush=True)
    rows = []
    for module, part, has_old in todo:
        row = {"module": module, "part": part}
        for side in ("old", "new"):
            got = samples.get((module, part, side))
            if got:
                row[side] = {"cpu_s": [round(x["cpu_s"], 2) for x in got], "wall_s": [round(x["wall_s"], 2) for x in got],
                             "median_cpu_s": round(statistics.median(x["cpu_s"] for x in got), 2),
                             "median_wall_s": round(statistics.median(x["wall_s"] for x in got), 2),
                             "names": got[0]["names"]}
        if has_old:
            row["growth_cpu"] = round(row["new"]["median_cpu_s"] / row["old"]["median_cpu_s"] - 1, 3)
            row["growth_wall"] = round(row["new"]["median_wall_s"] / row["old"]["median_wall_s"] - 1, 3)
            row["within_limit"] = row["growth_cpu"] <= GROWTH_LIMIT
        rows.append(row)
        print(f"{module:40s} {part:8s} " + (f"old {row['old']['median_cpu_s']:6.1f} s  " if has_old else " " * 15)
              + f"new {row['new']['median_cpu_s']:6.1f} s CPU" + (f"  {row['growth_cpu']:+.1%}" if has_old else
                                                                    "  (new kernel)"))
    out = {"what": "CPU compile time per sm100a kernel (compile_only / compile_only_backward for sm_100a), "
                   "one process per compile, empty caches, medians of interleaved runs",
           "command": "python bench/compile_time.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "old": {"tree": str(args.old), "commit": git_head(args.old)},
           "new": {"tree": str(args.new), "commit": git_head(args.new)},
           "runs": args.runs, "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
           "seconds_total": round(time.time() - t0), "growth_limit": GROWTH_LIMIT, "kernels": rows,
           "all_within_limit": all(r.get("within_limit", True) for r in rows)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["all_within_limit"] else 1


if __name__ == "__main__":
    sys.exit(main())
