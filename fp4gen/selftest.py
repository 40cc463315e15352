"""``fp4gen selftest``: the Blackwell smoke kit (docs/selftest.md).

On an sm_100 GPU it runs, in order, the four unit kernels of
``fp4gen.device.sm100.selftest_kernels`` (one risky tcgen05 form each: block-scaled MXFP4 P.V
with A from TMEM, the E2M1 nibble order in TMEM, block32 sf_id 2, accumulator column reuse)
and then the forward of every sm100a example in ``examples/*.attn`` on a small problem,
compared with the same spec's reference backend (``fp4gen.load(spec, target="reference")``:
the same quantisation and P rules in torch). It prints one table (or JSON).

A unit check that fails or errors is run again right away in its variant with the PTX ISA's
tcgen05 fences (row ``NAME+fences``): a pass there points at the forward's missing fences,
not at the MMA form.

Anywhere else it prints what it would run and returns rows with status ``not run``; the command
then exits 0.

Each check runs in its own subprocess (``python -m fp4gen.selftest --one NAME``) with a time
limit: a kernel that traps poisons the CUDA context and one that deadlocks never returns, and
either must not take the later checks with it.
"""
from __future__ import annotations

import json as _json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = ROOT / "examples"

# the example problem: two query tiles per CTA, three KV tiles, ragged ends (masking on the
# last tile), grouped-query heads; small enough for a few seconds of reference on the CPU
EXAMPLE_SHAPE = {"batch": 1, "seqlen_q": 300, "seqlen_k": 333, "heads": 2, "heads_kv": 1}
# kernel vs reference backend (same numerics; they differ by ex2.approx, fp32 summation order,
# FMA contraction and the codes those flip at rounding ties): a smoke threshold, not a bound
EXAMPLE_REL_L2 = 2e-2
EXAMPLE_LSE_ABS = 2e-2
CHECK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Planned:
    name: str  # unit kernel name, or the example's kernel name
    kind: str  # "unit" | "example"
    what: str
    spec: Optional[str] = None  # examples: the .attn path
    fenced: bool = False  # unit: the variant with the ISA's tcgen05 fences (a follow-up)


@dataclass
class Row:
    name: str
    kind: str
    what: str
    status: str  # pass | fail | error | not run
    max_error: Optional[float]  # unit: relative max error; example: O's rel-L2 vs the reference
    seconds: float
    detail: str = ""


def sm100_examples(examples_dir: Optional[Path] = None) -> list:
    """(path, spec) of every kernel targeting sm100a in ``examples_dir``/*.attn, in file order."""
    import fp4gen
    from fp4gen.ir.spec import Target
    from fp4gen.runtime.fileio import read_text_file

    out = []
    for path in sorted(Path(examples_dir or EXAMPLES_DIR).glob("*.attn")):
        parsed = fp4gen.parse_text(read_text_file(path), filename=str(path))
        for spec in parsed if isinstance(parsed, (list, tuple)) else [parsed]:
            if spec.target is Target.SM100A:
                out.append((path, spec))
    return out


def plan(examples_dir: Optional[Path] = None) -> list:
    """The checks ``run`` performs, in order: the unit kernels, then each sm100a example."""
    from fp4gen.device.sm100 import selftest_kernels as sk

    items = [Planned(n, "unit", sk.WHAT[n]) for n in sk.CHECKS]
    s = EXAMPLE_SHAPE
    for path, spec in sm100_examples(examples_dir):
        what = (f"forward B={s['batch']} Sq={s['seqlen_q']} Sk={s['seqlen_k']} H={s['heads']} "
                f"Hkv={s['heads_kv']} vs {path.name} on the reference backend")
        items.append(Planned(spec.name, "example", what, str(path)))
    return items


def sm100_device() -> tuple:
    """(available, why): whether this machine has an sm_100 GPU, and what it has otherwise."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False, "torch is not importable"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible"
    for i in range(torch.cuda.device_count()):
        if torch.cuda.get_device_capability(i) == (10, 0):
            return True, f"cuda:{i} {torch.cuda.get_device_name(i)}"
    names = ", ".join(f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                      for i in range(torch.cuda.device_count()))
    return False, f"no sm_100 GPU ({names})"


# ------------------------------------------------------------------ one check


def fenced_follow_up(item: Planned) -> Planned:
    """The check to run after unit check ``item`` failed: the same kernel with the ISA's tcgen05
    fences (selftest_kernels.KernelConfig.fenced). Passing there and failing without them points
    at the forward's missing fences, not at the form (docs/selftest.md)."""
    return Planned(item.name, "unit", item.what + " [with tcgen05 fences and, for reuse, a commit+wait]",
                   fenced=True)


def row_name(item: Planned) -> str:
    return item.name + ("+fences" if item.fenced else "")


def run_unit(name: str, device=None, fenced: bool = False) -> Row:
    from fp4gen.device.sm100 import selftest_kernels as sk

    t = time.perf_counter()
    got, _ = sk.run(name, device, fenced=fenced)
    ok, err, words = sk.judge(name, got)
    return Row(name + ("+fences" if fenced else ""), "unit", sk.WHAT[name], "pass" if ok else "fail", err,
               time.perf_counter() - t, words)


def run_example(item: Planned, device=None) -> Row:
    import torch

    from fp4gen.api import load
    from fp4gen.numerics.accuracy import compare

    t = time.perf_counter()
    s = EXAMPLE_SHAPE
    dev = torch.device(device or "cuda")
    mod = load(item.spec, kernel=item.name)
    ref = load(item.spec, kernel=item.name, target="reference")
    gen = torch.Generator().manual_seed(0)
    d = mod.HEAD_DIM

    def draw(seq, heads):
        return torch.randn((s["batch"], seq, heads, d), generator=gen).to(torch.bfloat16)

    q, k, v = draw(s["seqlen_q"], s["heads"]), draw(s["seqlen_k"], s["heads_kv"]), draw(s["seqlen_k"], s["heads_kv"])
    o, lse = mod.forward(q.to(dev), k.to(dev), v.to(dev), return_lse=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ro, rlse = ref.forward(q, k, v, return_lse=True)
    c = compare(o.cpu().float(), ro.float())
    lse, rlse = lse.cpu().double(), rlse.double()
    both = torch.isfinite(lse) & torch.isfinite(rlse)
    same_inf = bool(torch.equal(torch.isfinite(lse), torch.isfinite(rlse)))
    lse_err = float((lse[both] - rlse[both]).abs().max()) if bool(both.any()) else 0.0
    nan = bool(torch.isnan(o).any())
    ok = (not nan) and c["rel_l2"] <= EXAMPLE_REL_L2 and lse_err <= EXAMPLE_LSE_ABS and same_inf
    detail = (f"O rel_l2 {c['rel_l2']:.3g} (limit {EXAMPLE_REL_L2}), cosine {c['cosine']:.6f}, "
              f"max_abs {c['max_abs']:.3g}; LSE max_abs {lse_err:.3g} (limit {EXAMPLE_LSE_ABS})"
              + ("" if same_inf else "; -inf rows differ") + ("; NaN in O" if nan else ""))
    return Row(item.name, "example", item.what, "pass" if ok else "fail", c["rel_l2"],
               time.perf_counter() - t, detail)


def run_one(item: Planned, device=None) -> Row:
    """One check in this process; an exception becomes status ``error``."""
    t = time.perf_counter()
    try:
        return run_unit(item.name, device, item.fenced) if item.kind == "unit" else run_example(item, device)
    except Exception as e:  # the check's own failure (compile, launch, trap): reported, not raised
        msg = f"{type(e).__name__}: {e}".strip().splitlines()
        return Row(row_name(item), item.kind, item.what, "error", None, time.perf_counter() - t,
                   " | ".join(msg[:3] + (msg[-1:] if len(msg) > 3 else [])))


def run_isolated(item: Planned, timeout: float = CHECK_TIMEOUT_S) -> Row:
    """One check in a subprocess (a trap or a hang stays there)."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "fp4gen.selftest", "--one", item.name, "--kind", item.kind]
    if item.spec:
        cmd += ["--spec", item.spec]
    if item.fenced:
        cmd += ["--fenced"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return Row(row_name(item), item.kind, item.what, "error", None, time.perf_counter() - t,
                   f"no result within {timeout:.0f} s (a deadlock: a barrier or MMA that never completes?)")
    lines = r.stdout.strip().splitlines()
    try:
        return Row(**_json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError):
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return Row(row_name(item), item.kind, item.what, "error", None, time.perf_counter() - t,
                   f"check process exited {r.returncode} without a result: " + " | ".join(tail))


# ------------------------------------------------------------------ the command


def table(rows: list) -> str:
    head = ("check", "kind", "status", "max error", "seconds", "what / result")
    body = [(r.name, r.kind, r.status, "-" if r.max_error is None else f"{r.max_error:.3g}",
             f"{r.seconds:.1f}", r.what + (f" -- {r.detail}" if r.detail else "")) for r in rows]
    w = [max(len(x[i]) for x in [head] + body) for i in range(5)]
    return "\n".join("  ".join(x[i].ljust(w[i]) for i in range(5)) + "  " + x[5] for x in [head] + body)


def run(json: bool = False, *, out=None, examples_dir: Optional[Path] = None, isolate: bool = True,
        runner: Optional[Callable] = None) -> list:
    """Run every check on this machine's sm_100 GPU and print one table (``json``: a JSON
    object). Without an sm_100 GPU: print the plan, every row ``not run``. Returns the rows."""
    out = out or sys.stdout
    items = plan(examples_dir)
    have, why = sm100_device()
    if not have:
        rows = [Row(i.name, i.kind, i.what, "not run", None, 0.0) for i in items]
        if json:
            print(_json.dumps({"device": None, "ran": False, "why": why,
                               "checks": [asdict(r) for r in rows]}, indent=2), file=out)
        else:
            print(f"fp4gen selftest: {why}; nothing run. On an sm_100 GPU it would run "
                  f"{len(items)} checks:", file=out)
            for n, i in enumerate(items, 1):
                print(f"  {n:2d}. [{i.kind}] {i.name}: {i.what}", file=out)
            print("  A unit check that fails is run again with the ISA's tcgen05 fences (NAME+fences).", file=out)
        return rows
    runner = runner or (run_isolated if isolate else run_one)
    rows = []
    for i in items:
        if not json:
            print(f"selftest: {i.name} ...", file=sys.stderr, flush=True)
        rows.append(runner(i))
        if i.kind == "unit" and rows[-1].status != "pass":
            rows.append(runner(fenced_follow_up(i)))
    if json:
        print(_json.dumps({"device": why, "ran": True, "checks": [asdict(r) for r in rows]}, indent=2), file=out)
    else:
        print(f"fp4gen selftest on {why}", file=out)
        print(table(rows), file=out)
    return rows


def _main(argv=None) -> int:
    """``python -m fp4gen.selftest --one NAME --kind unit|example [--spec PATH]``: one check in
    this process, its row as one JSON line (what ``run_isolated`` reads)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fp4gen.selftest")
    p.add_argument("--one", required=True)
    p.add_argument("--kind", choices=("unit", "example"), required=True)
    p.add_argument("--spec")
    p.add_argument("--fenced", action="store_true", help="unit: the variant with the ISA's tcgen05 fences")
    a = p.parse_args(argv)
    if a.kind == "unit":
        from fp4gen.device.sm100 import selftest_kernels as sk

        item = Planned(a.one, "unit", sk.WHAT.get(a.one, a.one), fenced=a.fenced)
    else:
        item = next((i for i in plan() if i.name == a.one and i.kind == "example"),
                    Planned(a.one, "example", "", a.spec))
    row = run_one(item)
    print(_json.dumps(asdict(row)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
