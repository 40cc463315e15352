"""Register and spill gates: what ptxas does with a generated kernel's register plan.

CuTe DSL assembles its PTX with an embedded ptxas and does not show the report, so the
gate assembles the kept PTX again with a standalone ptxas 13.0 (``-v``) and reads:

* the entry register count (``Used N registers``): with ``.reqntid T`` and
  ``.minnctapersm 1`` it is ``REGISTERS_PER_SM // T`` rounded down to 8, the share
  every warp starts with before its role's ``setmaxnreg``;
* spill stores and loads, and the stack frame;
* every remark with a code, above all ``C7508 'setmaxnreg' ignored``: ptxas then
  gives every warp the entry count and the plan's budgets mean nothing.

``check_registers`` compares that with the plan: the ``setmaxnreg`` immediates in the
PTX are the plan's role budgets, nothing is ignored, spills are within the plan's
budget (``PipelinePlan.spill_budget_bytes``; zero unless the plan says why).

Where ptxas comes from: ``$FP4GEN_PTXAS``, else the ``nvidia-cuda-nvcc`` 13.5 wheel in this
Python environment (the test extras pin it). It reads the ``.version 9.4`` CuTe DSL 4.8.1
writes, and its report matched the embedded ptxas's (``cute.compile(..., options=
"remarks{ptx}")``) on the paper's kernel. An older ptxas given through ``$FP4GEN_PTXAS``
gets the version line lowered to what it reads (the only rewrite made; ptxas refuses any
instruction the lower version lacks).

Where the PTX comes from: the sm100a gates read what ``conformance.compile_artifacts`` keeps;
``compile_kept`` compiles every kernel a generated module's ``compile_only`` builds (sm90a: the
attention kernels and the quantizer / backward pre- and post-processing kernels they launch)
and returns each one's PTX under the name ``compile_only`` gives it. ``check_helper`` gates a
kernel that has no warp roles (the helpers: no ``setmaxnreg``, no spills, no C7508).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .conformance import Mismatch

PTXAS_ENV = "FP4GEN_PTXAS"
# PTX ISA versions ptxas releases read (an older ptxas through $FP4GEN_PTXAS).
PTX_VERSION_OF_RELEASE = {(13, 0): (9, 0), (13, 1): (9, 1), (13, 2): (9, 2), (13, 3): (9, 3)}


class PtxasUnavailable(RuntimeError):
    """No ptxas found (install the test extras, or set $FP4GEN_PTXAS)."""


@dataclass(frozen=True)
class PtxasReport:
    """ptxas -v's account of one entry function."""

    function: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    remarks: tuple  # "C7508 'setmaxnreg' ignored; ..." (code first), for this function or the file

    @property
    def spills(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    def codes(self) -> set:
        return {r.split(" ", 1)[0] for r in self.remarks}


def find_ptxas() -> Path:
    """``$FP4GEN_PTXAS``, else the ptxas of the ``nvidia-cuda-nvcc`` wheel in this environment.
    Not ``PATH``: ptxas versions allocate registers differently (13.0 spills 64 B where 13.5 and
    CuTe DSL's embedded ptxas spill 20 B), so the budgets hold for the pinned one only."""
    env = os.environ.get(PTXAS_ENV)
    if env:
        p = Path(env)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise PtxasUnavailable(f"${PTXAS_ENV}={env} is not an executable file")
        return p
    for site in map(Path, sys.path):
        wheel = site / "nvidia" / "cu13" / "bin" / "ptxas"
        if wheel.is_file() and os.access(wheel, os.X_OK):
            return wheel
    raise PtxasUnavailable("the register gate needs the ptxas of the nvidia-cuda-nvcc wheel: "
                           "`pip install nvidia-cuda-nvcc==13.5.37` (in fp4gen's test extras), "
                           f"or set ${PTXAS_ENV}")


_VERSION = re.compile(r"^\.version (\d+)\.(\d+)\s*$", re.M)
_TARGET = re.compile(r"^\.target (\S+)", re.M)


def _readable_by(ptx: str, tool: Path) -> str:
    """``ptx`` with its ``.version`` lowered to what ``tool`` reads, if that is older."""
    m = _VERSION.search(ptx)
    if m is None:
        raise ValueError("the PTX has no .version line")
    r = subprocess.run([str(tool), "--version"], capture_output=True, text=True)
    rel = re.search(r"release (\d+)\.(\d+)", r.stdout)
    top = PTX_VERSION_OF_RELEASE.get((int(rel[1]), int(rel[2]))) if rel else None
    if top is None or (int(m[1]), int(m[2])) <= top:
        return ptx
    return ptx[:m.start()] + ".version %d.%d" % top + ptx[m.end():]


_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_REMARK = re.compile(r"\((C\d{4})\) (.*)$")


def parse_report(log: str) -> list:
    """The per-function reports in a ``ptxas -v`` log. Remarks printed before a function's
    'Compiling entry function' line (ptxas prints C7508 there) belong to the next function."""
    out, pending, cur = [], [], None
    for line in log.splitlines():
        m = _REMARK.search(line)
        if m:
            pending.append(f"{m[1]} {m[2].strip()}")
            continue
        m = _FUNC.search(line)
        if m:
            cur = {"function": m[1], "remarks": pending}
            pending = []
            continue
        if cur is None:
            continue
        m = _PROPS.search(line)
        if m:
            cur.update(stack=int(m[1]), st=int(m[2]), ld=int(m[3]))
            continue
        m = _USED.search(line)
        if m:
            out.append(PtxasReport(cur["function"], int(m[1]), cur.get("st", 0), cur.get("ld", 0),
                                   cur.get("stack", 0), tuple(cur["remarks"])))
            cur = None
    if pending and out:  # remarks after the last function are the file's
        last = out[-1]
        out[-1] = PtxasReport(last.function, last.registers, last.spill_store_bytes, last.spill_load_bytes,
                              last.stack_frame_bytes, last.remarks + tuple(pending))
    return out


def assemble(ptx: str, *, ptxas: Optional[Path] = None, timeout: float = 600) -> list:
    """Assemble ``ptx`` for its own ``.target`` with ``ptxas -v``; the per-entry reports."""
    tool = ptxas or find_ptxas()
    m = _TARGET.search(ptx)
    if m is None:
        raise ValueError("the PTX has no .target line")
    with tempfile.TemporaryDirectory(prefix="fp4gen_ptxas_") as d:
        src = Path(d) / "kernel.ptx"
        src.write_text(_readable_by(ptx, tool))
        r = subprocess.run([str(tool), f"-arch={m[1]}", "-v", str(src), "-o", str(Path(d) / "kernel.cubin")],
                           capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed (exit {r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}")
    reports = parse_report(r.stderr + r.stdout)
    if not reports:
        raise RuntimeError(f"no entry function in the ptxas report:\n{(r.stderr + r.stdout)[-2000:]}")
    return reports


_REQNTID = re.compile(r"\.reqntid (\d+)")
_MINCTA = re.compile(r"\.minnctapersm (\d+)")
_SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);")


def setmaxnreg_budgets(ptx: str) -> dict:
    """{"inc": {counts}, "dec": {counts}} of every setmaxnreg in the PTX."""
    out = {"inc": set(), "dec": set()}
    for kind, n in _SETMAXNREG.findall(ptx):
        out[kind].add(int(n))
    return out


def entry_registers(threads: int, registers_per_sm: int = 65536) -> int:
    """What each thread of a one-CTA-per-SM launch of ``threads`` starts with."""
    return min(255, registers_per_sm // threads) // 8 * 8


def check_registers(ptx: str, reports: list, *, budgets: dict, spill_budget_bytes: int = 0) -> list:
    """Mismatches between ptxas's treatment of ``ptx`` and the plan.

    ``budgets``: role -> registers (the plan's ``WarpRole.registers``). The PTX must carry
    ``.minnctapersm 1`` (else C7508), every setmaxnreg must name a plan budget and every plan
    budget other than the entry count must appear, ptxas must honour them (no C7508), and the
    spills of the whole kernel must stay within ``spill_budget_bytes``.
    """
    out = []
    m = _REQNTID.search(ptx)
    threads = int(m[1]) if m else None
    if _MINCTA.search(ptx) is None:
        out.append(Mismatch("ptx.minnctapersm", 1, None, "ptx",
                            "without it ptxas cannot know the entry register count and ignores setmaxnreg"))
    found = setmaxnreg_budgets(ptx)
    entry = entry_registers(threads) if threads else None
    plan_counts = set(budgets.values())
    named = found["inc"] | found["dec"]
    if named - plan_counts:
        out.append(Mismatch("ptx.setmaxnreg", sorted(plan_counts), sorted(named), "ptx",
                            "a setmaxnreg count that no role of the plan has"))
    missing = {c for c in plan_counts if c != entry} - named
    if missing:
        out.append(Mismatch("ptx.setmaxnreg", sorted(plan_counts), sorted(named), "ptx",
                            f"plan budgets {sorted(missing)} are never set"))
    if entry is not None:
        wrong = {c for c in found["inc"] if c <= entry} | {c for c in found["dec"] if c > entry}
        if wrong:
            out.append(Mismatch("ptx.setmaxnreg.direction", f"inc above / dec to at most {entry}", sorted(wrong), "ptx"))
    for r in reports:
        if "C7508" in r.codes():
            out.append(Mismatch("ptxas.C7508", "setmaxnreg honoured", "ignored", "ptxas",
                                next(x for x in r.remarks if x.startswith("C7508"))))
        if entry is not None and r.registers != entry:
            out.append(Mismatch("ptxas.entry_registers", entry, r.registers, "ptxas",
                                f".reqntid {threads} with one CTA per SM"))
        if r.spills > spill_budget_bytes:
            out.append(Mismatch("ptxas.spills", f"<= {spill_budget_bytes} bytes",
                                f"{r.spill_store_bytes} B stores + {r.spill_load_bytes} B loads", "ptxas",
                                f"stack frame {r.stack_frame_bytes} B"))
    return out


def check_helper(ptx: str, reports: list, *, spill_budget_bytes: int = 0) -> list:
    """Mismatches for a kernel without warp roles (a quantizer, the backward's pre/post
    processing): it has no plan budget to set, so any ``setmaxnreg`` is one the plan lacks;
    ptxas must not ignore one (C7508) and the spills stay within ``spill_budget_bytes``."""
    out = []
    named = sorted(setmaxnreg_budgets(ptx)["inc"] | setmaxnreg_budgets(ptx)["dec"])
    if named:
        out.append(Mismatch("ptx.setmaxnreg", "none (no warp roles)", named, "ptx",
                            "a helper kernel has no register budget in the plan"))
    for r in reports:
        if "C7508" in r.codes():
            out.append(Mismatch("ptxas.C7508", "no setmaxnreg ignored", "ignored", "ptxas",
                                next(x for x in r.remarks if x.startswith("C7508"))))
        if r.spills > spill_budget_bytes:
            out.append(Mismatch("ptxas.spills", f"<= {spill_budget_bytes} bytes",
                                f"{r.spill_store_bytes} B stores + {r.spill_load_bytes} B loads", "ptxas",
                                f"stack frame {r.stack_frame_bytes} B"))
    return out


# ----------------------------------------------------------------------------- every kernel's PTX


@dataclass(frozen=True)
class KeptKernel:
    """One kernel ``compile_only`` built: the name it returned for it, the PTX entry function
    (its mangled name says which class compiled it) and the PTX."""

    name: str
    entry: str
    ptx: str


# CuTe DSL names a kept PTX file after the function compiled, cut short, so that variants of one
# kernel (the quantizer's) overwrite each other: the child numbers the files in compile order
# instead (as scripts/ptx_fingerprint.py does).
_KEEP_RUNNER = textwrap.dedent("""
    import importlib.util, itertools, json, sys
    from cutlass.base_dsl import compiler as C
    _n = itertools.count()
    _orig = C.CompileOptions._set_artifact_dump_paths
    def _numbered(opt, dump_dir, function_name, arch, ext, attr):  # a staticmethod in CuTe DSL 4.8
        return _orig(opt, dump_dir, f"k{next(_n):03d}", arch, ext, attr)
    C.CompileOptions._set_artifact_dump_paths = staticmethod(_numbered)
    from fp4gen.runtime.loader import exec_file
    m = exec_file("fp4gen_generated_under_test", sys.argv[1])
    print(json.dumps(m.compile_only(sys.argv[2])))
""")
_ENTRY = re.compile(r"^\.visible \.entry (\S+?)\(", re.M)


def compile_kept(source: str, arch: str, timeout: int = 1800) -> list:
    """Every kernel a generated module's ``compile_only(arch)`` compiles, in compile order, as
    ``KeptKernel``s. ``compile_only`` returns one name per compile, in that order; a count that
    differs (a compile skipped or split) is an error, not a guess."""
    with tempfile.TemporaryDirectory(prefix="fp4gen_kept_") as d:
        mod, dump = Path(d) / "module.py", Path(d) / "dump"
        mod.write_text(source)
        dump.mkdir()
        env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(dump),
                   FP4GEN_CACHE_DIR=str(Path(d) / "cache"))
        r = subprocess.run([sys.executable, "-c", _KEEP_RUNNER, str(mod), arch], env=env, cwd=d,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{arch} compilation failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
        names = json.loads(r.stdout.strip().splitlines()[-1])
        ptxs = [p.read_text() for p in sorted(dump.glob(f"k*.{arch}.ptx"))]
    if len(ptxs) != len(names):
        raise RuntimeError(f"compile_only named {len(names)} kernels ({', '.join(names)}) but CuTe DSL kept "
                           f"{len(ptxs)} PTX files")
    out = []
    for name, ptx in zip(names, ptxs):
        m = _ENTRY.search(ptx)
        if m is None:
            raise RuntimeError(f"the kept PTX of {name} has no entry function")
        out.append(KeptKernel(name, m[1], ptx))
    return out
