"""SASS of a compiled kernel: assemble, disassemble, parse, and count instructions per loop.

The static performance model (``fp4gen/lowering/perf.py``) needs what the GPU executes, not
the PTX: ptxas removes the register-pair moves the PTX carries, unrolls, if-converts and
schedules. So the kept PTX is assembled again with the pinned ptxas
(``fp4gen.lowering.ptxas.find_ptxas``) and the cubin is disassembled with ``nvdisasm``:

* ``$FP4GEN_NVDISASM``, else the ``nvidia-cuda-nvdisasm`` wheel of this environment
  (``nvidia/cu13/bin/nvdisasm``, pinned in the test extras), else ``PATH``;
* ``parse_sass(text)`` -> ``Function`` objects: instructions (address, guard predicate,
  opcode with its modifiers, operands), basic blocks and the control-flow graph;
* ``natural_loops(fn)``: back edges (tail -> head with head dominating tail) and their bodies;
* ``roles(fn)``: warp roles. A role branch begins with ``USETMAXREG`` (PTX ``setmaxnreg``,
  PTX ISA 9.7.17.1 "setmaxnreg"): every role region is the set of blocks its USETMAXREG
  dominates; the register count it sets names it;
* ``tile_loop(fn, role)``: the role's KV-tile loop, the innermost non-trivial loop that holds
  the role's tensor-core instructions, or else its mbarrier waits;
* ``classify(opcode)``: the pipe an instruction issues to; ``count_pipes`` counts a loop body
  (one iteration, every block once) by pipe, unknown opcodes under "other" and listed.

Limits (stated, not hidden): counts are static: a branch inside the loop (a masked tile, a
conditional O rescale) contributes both sides once per iteration; the out-of-line retry loops
of mbarrier waits and ``USETMAXREG.TRY_ALLOC`` ("spin loops") are left out, because they run
only while a warp waits, and the waiting is what the model's max over roles stands for.
Calls (``CALL.REL``) are not followed: the callee is a slow path (IEEE division, ...).
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fp4gen.device import markers as _markers

from . import ptxas as _ptxas

NVDISASM_ENV = "FP4GEN_NVDISASM"


class NvdisasmUnavailable(RuntimeError):
    """No nvdisasm found (install the test extras, or set $FP4GEN_NVDISASM)."""


def find_nvdisasm() -> Path:
    """``$FP4GEN_NVDISASM``, else the ``nvidia-cuda-nvdisasm`` wheel's binary, else ``PATH``.
    nvdisasm only prints what the cubin holds, so (unlike ptxas) any recent version reads the
    same instructions; the wheel is preferred only because it knows sm_100a."""
    env = os.environ.get(NVDISASM_ENV)
    if env:
        p = Path(env)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise NvdisasmUnavailable(f"${NVDISASM_ENV}={env} is not an executable file")
        return p
    for site in map(Path, sys.path):
        wheel = site / "nvidia" / "cu13" / "bin" / "nvdisasm"
        if wheel.is_file() and os.access(wheel, os.X_OK):
            return wheel
    found = shutil.which("nvdisasm")
    if found:
        return Path(found)
    raise NvdisasmUnavailable("the SASS reader needs nvdisasm: `pip install nvidia-cuda-nvdisasm==13.5.37` "
                              f"(in fp4gen's test extras), or set ${NVDISASM_ENV}")


_TARGET = re.compile(r"^\.target (\S+)", re.M)


def assemble_cubin(ptx: str, *, ptxas: Optional[Path] = None, timeout: float = 900) -> bytes:
    """The cubin the pinned ptxas makes of ``ptx`` for its own ``.target``."""
    tool = ptxas or _ptxas.find_ptxas()
    m = _TARGET.search(ptx)
    if m is None:
        raise ValueError("the PTX has no .target line")
    with tempfile.TemporaryDirectory(prefix="fp4gen_sass_") as d:
        src, out = Path(d) / "kernel.ptx", Path(d) / "kernel.cubin"
        src.write_text(_ptxas._readable_by(ptx, tool))
        r = subprocess.run([str(tool), f"-arch={m[1]}", str(src), "-o", str(out)],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"ptxas failed (exit {r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}")
        return out.read_bytes()


def disassemble(cubin: bytes, *, nvdisasm: Optional[Path] = None, timeout: float = 600) -> str:
    """``nvdisasm -c`` of a cubin: the code sections as text."""
    tool = nvdisasm or find_nvdisasm()
    with tempfile.TemporaryDirectory(prefix="fp4gen_sass_") as d:
        p = Path(d) / "kernel.cubin"
        p.write_bytes(cubin)
        r = subprocess.run([str(tool), "-c", str(p)], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"nvdisasm failed (exit {r.returncode}):\n{(r.stderr or r.stdout)[-3000:]}")
    return r.stdout


def sass_of_ptx(ptx: str) -> str:
    return disassemble(assemble_cubin(ptx))


# ----------------------------------------------------------------------------- parse


@dataclass
class Instr:
    addr: int
    pred: str  # "" (always), "P0", "!P0", "UP1", "PT", "!PT", ...
    opcode: str  # with modifiers: "FFMA.FTZ", "HGMMA.64x128x16.F32.BF16"
    operands: str
    text: str

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def mods(self) -> tuple:
        return tuple(self.opcode.split(".")[1:])


@dataclass
class Block:
    index: int
    label: Optional[str]
    instrs: list = field(default_factory=list)
    succs: list = field(default_factory=list)
    preds: list = field(default_factory=list)


@dataclass
class Function:
    name: str
    instrs: list
    blocks: list = field(default_factory=list)

    def block_of(self, addr: int) -> Block:
        for b in self.blocks:
            if b.instrs and b.instrs[0].addr <= addr <= b.instrs[-1].addr:
                return b
        raise KeyError(addr)


_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@(!?U?P[0-9T]+)\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*(.*?)\s*;?\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+|[$\w.]+):\s*$")
_FUNC_HDR = re.compile(r"^\s*\.type\s+(\S+),@function")
_TARGET_LABEL = re.compile(r"`\((\.L_x_\d+)\)")
# an indirect branch (a switch) lists its targets in nvdisasm's annotation:
#   BRX R2 -0x7a0 (*"BRANCH_TARGETS .L_x_313,.L_x_314,.L_x_6"*)
_BRANCH_TARGETS = re.compile(r'BRANCH_TARGETS\s+([^"]+)"')


def parse_sass(text: str) -> list:
    """The functions of an ``nvdisasm -c`` listing, each with blocks and CFG edges."""
    funcs, cur, pending_label = [], None, None
    labels_at = {}
    for line in text.splitlines():
        m = _FUNC_HDR.match(line)
        if m:
            cur = Function(m[1], [])
            funcs.append(cur)
            labels_at = {}
            cur._labels = labels_at  # label -> address of the next instruction
            cur._pending = []
            continue
        if cur is None:
            continue
        m = _LABEL.match(line)
        if m and not line.startswith((" ", "\t")):
            cur._pending.append(m[1])
            continue
        m = _INSTR.match(line)
        if m:
            ins = Instr(int(m[1], 16), m[2] or "", m[3], m[4].rstrip(" ;"), line.strip())
            for lab in cur._pending:
                labels_at[lab] = ins.addr
            cur._pending = []
            cur.instrs.append(ins)
    for f in funcs:
        _build_cfg(f)
    return funcs


def parse_instr_lines(lines: list) -> Function:
    """A function from bare hand-written lines (tests): ``LABEL:`` or ``[@P] OPC operands ;``;
    addresses are assigned in steps of 16."""
    text = ["\t.type\t\tf,@function"]
    addr = 0
    for ln in lines:
        ln = ln.strip()
        if not ln:
            continue
        if ln.endswith(":"):
            text.append(ln)
        else:
            text.append(f"        /*{addr:04x}*/  {ln}")
            addr += 16
    return parse_sass("\n".join(text))[0]


_BRANCH = {"BRA", "BRX", "JMP", "JMX"}
_END = {"EXIT", "RET", "KILL"}


def _always(pred: str) -> bool:
    return pred in ("", "PT")


def _never(pred: str) -> bool:
    return pred == "!PT"


def _is_conditional_bra(ins: Instr) -> bool:
    """``@P0 BRA`` or the uniform-predicate form ``BRA.U !UP0, `(...)``."""
    if not _always(ins.pred):
        return True
    head = ins.operands.split("`", 1)[0].strip().rstrip(",").strip()
    return bool(head) and head not in ("PT",)


def _build_cfg(f: Function) -> None:
    labels = f._labels
    by_addr = {ins.addr: i for i, ins in enumerate(f.instrs)}
    leaders = {0} if f.instrs else set()
    for addr in labels.values():
        leaders.add(by_addr[addr])
    for i, ins in enumerate(f.instrs):
        if ins.base in _BRANCH or ins.base in _END:
            if i + 1 < len(f.instrs):
                leaders.add(i + 1)
    order = sorted(leaders)
    label_of = {}
    for lab, addr in labels.items():
        label_of.setdefault(by_addr[addr], lab)
    blocks, start_of = [], {}
    for k, s in enumerate(order):
        e = order[k + 1] if k + 1 < len(order) else len(f.instrs)
        b = Block(k, label_of.get(s), f.instrs[s:e])
        blocks.append(b)
        start_of[s] = k
    block_at_label = {lab: start_of[by_addr[addr]] for lab, addr in labels.items()}
    for k, b in enumerate(blocks):
        last = b.instrs[-1]
        fall = k + 1 if k + 1 < len(blocks) else None
        succ = []
        if last.base in _BRANCH and not _never(last.pred):
            labels_named = _TARGET_LABEL.findall(last.operands)
            m = _BRANCH_TARGETS.search(last.operands)
            if m:
                labels_named += [t.strip() for t in m[1].split(",")]
            targets = [block_at_label[t] for t in labels_named if t in block_at_label]
            succ += targets
            if (last.base == "BRA" and _is_conditional_bra(last)) and fall is not None:
                succ.append(fall)
        elif last.base in _END and not _never(last.pred):
            if not _always(last.pred) and fall is not None:
                succ.append(fall)
        elif fall is not None:
            succ.append(fall)
        b.succs = sorted(set(succ))
    for b in blocks:
        for s in b.succs:
            blocks[s].preds.append(b.index)
    f.blocks = blocks


# ----------------------------------------------------------------------------- dominators, loops


def reachable(f: Function, start: int = 0) -> set:
    seen, stack = set(), [start]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(f.blocks[n].succs)
    return seen


def dominators(f: Function, entry: int = 0) -> dict:
    """block -> set of blocks dominating it (iterative data-flow over the reachable blocks)."""
    nodes = reachable(f, entry)
    dom = {n: set(nodes) for n in nodes}
    dom[entry] = {entry}
    changed = True
    while changed:
        changed = False
        for n in sorted(nodes):
            if n == entry:
                continue
            ps = [p for p in f.blocks[n].preds if p in nodes]
            new = set.intersection(*(dom[p] for p in ps)) if ps else set()
            new = new | {n}
            if new != dom[n]:
                dom[n], changed = new, True
    return dom


@dataclass
class Loop:
    header: int
    blocks: frozenset
    tails: tuple

    def instrs(self, f: Function, exclude: frozenset = frozenset()) -> list:
        return [i for b in sorted(self.blocks - exclude) for i in f.blocks[b].instrs]


def natural_loops(f: Function, dom: Optional[dict] = None) -> list:
    """Natural loops (one per header, back edges merged), innermost first (smallest body)."""
    dom = dom or dominators(f)
    by_header = {}
    for n in dom:
        for s in f.blocks[n].succs:
            if s in dom and s in dom[n]:  # back edge n -> s
                body, stack = {s, n}, [n]
                while stack:
                    x = stack.pop()
                    if x == s:  # the header bounds the body
                        continue
                    for p in f.blocks[x].preds:
                        if p in dom and p not in body:
                            body.add(p)
                            stack.append(p)
                h = by_header.setdefault(s, [set(), []])
                h[0] |= body
                h[1].append(n)
    loops = [Loop(h, frozenset(b), tuple(sorted(t))) for h, (b, t) in by_header.items()]
    return sorted(loops, key=lambda lp: (len(lp.blocks), lp.header))


_SPIN_OPS = {"SYNCS", "NANOSLEEP", "USETMAXREG", "YIELD"}
_POLL_OPS = _SPIN_OPS | {"BRA", "PLOP3", "NOP", "MOV", "IMAD", "UMOV"}  # address copies, the retry branch


def is_spin_loop(f: Function, loop: Loop) -> bool:
    """An mbarrier try-wait retry or a setmaxnreg TRY_ALLOC retry: a few instructions that poll
    and do nothing else."""
    ins = loop.instrs(f)
    return (len(ins) <= 8 and any(i.base in _SPIN_OPS for i in ins)
            and all(i.base in _POLL_OPS for i in ins))


# ----------------------------------------------------------------------------- pipes

# The pipe each opcode issues to. Names follow the CUDA C Programming Guide's arithmetic
# instruction throughput table (section "Arithmetic Instructions"): FP32 add/mul/fma, the
# special function unit (MUFU), 32-bit integer, conversions; plus memory and the tensor core.
PIPES = ("tensor", "mufu", "fma", "alu", "conv", "lds_sts", "ldg_stg", "tmem", "sync", "uniform", "control",
         "other")

_TENSOR = {"HGMMA", "QGMMA", "IGMMA", "BGMMA", "HMMA", "IMMA", "QMMA", "OMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCIMMA", "UTCMMA",
           "UTCBAR", "UTCCP", "UTCSHIFT"}
_FMA = {"FFMA", "FFMA2", "FMUL", "FMUL2", "FADD", "FADD2", "FMNMX", "FMNMX3", "FSEL", "FSET", "FSETP", "FSWZADD",
        "FCHK", "HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "DFMA", "DADD", "DMUL"}
_ALU = {"IADD3", "IADD", "IADD32I", "VIADD", "VIADDMNMX", "LOP3", "LOP", "SHF", "SHL", "SHR", "IMAD", "IMUL", "IMNMX",
        "VIMNMX", "VIMNMX3", "PRMT", "BFI", "BFE", "BMSK", "SEL", "ISETP", "ICMP", "LEA", "LEA.HI", "IABS", "POPC",
        "FLO", "BREV", "PLOP3", "PSETP", "P2R", "R2P", "MOV", "MOV32I", "CS2R", "S2R", "IDP", "IDP4A", "I2IP",
        "SGXT", "IMNMX3", "VOTE", "SHFL", "MATCH", "REDUX", "CCTL", "LDC", "NOP", "SETLMEMBASE"}
_CONV = {"F2F", "F2FP", "I2F", "I2FP", "F2I", "I2I", "FRND", "F2IP"}
_MUFU = {"MUFU"}
_LDS = {"LDS", "STS", "STAS", "LDSM", "STSM", "ATOMS", "LDGSTS"}
_LDG = {"LDG", "STG", "LD", "ST", "LDL", "STL", "ATOMG", "ATOM", "RED", "UTMALDG", "UTMASTG", "UTMAPF",
        "UTMACCTL", "UTMAREDG", "UBLKCP", "UBLKRED", "UBLKPF"}
_TMEM = {"LDTM", "STTM"}
_SYNC = {"SYNCS", "BAR", "BSSY", "BSYNC", "WARPSYNC", "WARPGROUP", "DEPBAR", "MEMBAR", "FENCE", "ERRBAR", "ELECT",
         "ARRIVES", "NANOSLEEP", "USETMAXREG", "ACQBULK", "ACQSHMINIT", "CGAERRBAR", "CCTLT", "UCGABAR_ARV",
         "UCGABAR_WAIT", "UTCATOMSWS"}
_CONTROL = {"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "RPCMOV", "BREAK", "BMOV", "YIELD", "KILL", "BPT", "WARPSYNC"}


def classify(opcode: str) -> str:
    """The pipe of one SASS opcode (with or without modifiers); unknown ones are "other".

    Uniform-datapath instructions (``U*``: UIADD3, ULOP3, UMOV, ...) execute once per warp on
    the uniform datapath, not on the per-thread pipes: they still take an issue slot, and are
    counted as "uniform". ``S2UR``/``R2UR`` move into uniform registers and count there too."""
    base = opcode.split(".", 1)[0]
    if base in _TENSOR or base.startswith("UTC") and "MMA" in base:
        return "tensor"
    if base in _MUFU:
        return "mufu"
    if base in _FMA:
        return "fma"
    if base in _CONV:
        return "conv"
    if base in _LDS:
        return "lds_sts"
    if base in _LDG:
        return "ldg_stg"
    if base in _TMEM:
        return "tmem"
    if base in _CONTROL:
        return "control"
    if base in _SYNC:
        return "sync"
    if base in _ALU:
        return "alu"
    if base.startswith("U") or base in ("S2UR", "R2UR", "VOTEU", "LDCU"):
        return "uniform"
    return "other"


def count_pipes(instrs: list) -> dict:
    """{"pipes": {pipe: n}, "opcodes": {base: n}, "unknown": sorted opcodes under "other",
    "mufu_ex2": n, "ffma2": packed f32x2 FMA/FMUL/FADD, "instructions": n}. Predicated-off
    (``@!PT``) instructions are dropped; every other one counts as issued."""
    pipes, ops = Counter(), Counter()
    unknown = set()
    ex2 = packed = 0
    for i in instrs:
        if _never(i.pred):
            continue
        p = classify(i.opcode)
        pipes[p] += 1
        ops[i.base] += 1
        if p == "other":
            unknown.add(i.base)
        if i.base == "MUFU" and "EX2" in i.mods:
            ex2 += 1
        if i.base in ("FFMA2", "FMUL2", "FADD2"):
            packed += 1
    return {"pipes": {p: pipes.get(p, 0) for p in PIPES}, "opcodes": dict(ops.most_common()),
            "unknown": sorted(unknown), "mufu_ex2": ex2, "ffma2": packed,
            "instructions": sum(pipes.values())}


# ----------------------------------------------------------------------------- roles and loops


@dataclass
class Role:
    registers: Optional[int]  # the count USETMAXREG sets (None: the entry region before any)
    kind: str  # "alloc" | "dealloc" | "entry"
    start: int  # block index of the USETMAXREG
    blocks: frozenset  # blocks it dominates

    @property
    def name(self) -> str:
        return f"{self.kind}{self.registers}" if self.registers is not None else "entry"


_SETMAXREG_IMM = re.compile(r"(0x[0-9a-f]+|\d+)\s*$")


def roles(f: Function, dom: Optional[dict] = None) -> list:
    """One role per USETMAXREG (PTX ``setmaxnreg``, PTX ISA 9.7.17.1: a warpgroup-wide
    register budget change; each role branch sets its own): its register count and the
    blocks it dominates. Nested USETMAXREG regions are cut out of the enclosing one."""
    dom = dom or dominators(f)
    found = []
    for b in f.blocks:
        if b.index not in dom:
            continue
        for ins in b.instrs:
            if ins.base == "USETMAXREG":
                m = _SETMAXREG_IMM.search(ins.operands)
                regs = int(m[1], 0) if m else None
                kind = "dealloc" if "DEALLOC" in ins.mods else "alloc"
                region = frozenset(n for n in dom if b.index in dom[n])
                found.append(Role(regs, kind, b.index, region))
                break
    out = []
    for r in found:
        inner = set().union(*[o.blocks for o in found if o is not r and o.start in r.blocks and o.start != r.start]) \
            if len(found) > 1 else set()
        out.append(Role(r.registers, r.kind, r.start, frozenset(r.blocks - inner)))
    return out


def spin_blocks(f: Function, loops: list) -> frozenset:
    """The blocks of spin loops, and the one-branch blocks that only lead out of them (the
    jump back to the code after the wait)."""
    out = set()
    for lp in loops:
        if is_spin_loop(f, lp):
            out |= lp.blocks
    changed = True
    while changed:
        changed = False
        for b in f.blocks:
            if b.index in out or not b.preds or len(b.instrs) != 1 or b.instrs[0].base != "BRA":
                continue
            if all(p in out for p in b.preds):
                out.add(b.index)
                changed = True
    return frozenset(out)


def _key_count(instrs: list) -> tuple:
    """(tensor-core MMAs, waits): mbarrier try-waits and named-barrier syncs."""
    tensor = sum(1 for i in instrs if classify(i.opcode) == "tensor" and "MMA" in i.base)
    waits = sum(1 for i in instrs if (i.base == "SYNCS" and "PHASECHK" in i.mods)
                or (i.base == "BAR" and "SYNC" in i.mods))
    return tensor, waits


def tile_loops(f: Function, role: Role, loops: Optional[list] = None) -> list:
    """The role's KV-tile loops: the innermost non-spin loops whose header the role dominates
    and that hold a tensor-core MMA (roles that issue MMAs), else a wait. Several when the kernel
    has sibling loops (a masked and an unmasked copy); a loop around them (a persistent
    work-tile loop) is not one, nor a loop the kernel marks as running a fixed number of times
    per CTA (``pmevent markers.PER_CTA_LOOP``: the epilogue over query stages)."""
    loops = loops if loops is not None else natural_loops(f)
    spin = spin_blocks(f, loops)
    cands = []
    for lp in loops:
        if lp.header not in role.blocks or is_spin_loop(f, lp):
            continue
        body = lp.instrs(f, spin)
        if any(i.base == "PMTRIG" and _markers.PER_CTA_LOOP in _markers.pmtrig_events(i.operands) for i in body):
            continue
        t, w = _key_count(body)
        if t or w:
            cands.append((lp, t, w))
    if any(t for _, t, _ in cands):
        cands = [c for c in cands if c[1]]
    inner = [lp for lp, _, _ in cands if not any(o is not lp and o.blocks < lp.blocks for o, _, _ in cands)]
    return sorted(inner, key=lambda lp: lp.header)


def path_instrs(f: Function, loop: Loop, spin: frozenset = frozenset(), longest: bool = False) -> list:
    """The instructions of one iteration along the cheapest (or costliest) path from the header
    to a back edge, in instructions: a branch inside the loop (masking, a conditional O
    rescale) is counted on one side only. Nested non-spin loops on the path count once."""
    body = loop.blocks - spin
    # DAG of the body without back edges into the header (nested loops collapsed by skipping
    # their back edges too: an edge to a block that dominates its source)
    dom = dominators(f)
    best = {}

    def cost(n):
        return len(f.blocks[n].instrs)

    order = []
    seen = set()

    def visit(n):  # post-order over forward edges
        if n in seen:
            return
        seen.add(n)
        for s in f.blocks[n].succs:
            if s in body and s not in dom.get(n, ()):  # not a back edge
                visit(s)
        order.append(n)

    visit(loop.header)
    pick = max if longest else min
    for n in order:  # successors first
        nxt = [s for s in f.blocks[n].succs if s in body and s not in dom.get(n, ()) and s in best]
        back = any(s == loop.header for s in f.blocks[n].succs) or n in loop.tails
        opts = [best[s] for s in nxt]
        if back:
            opts.append((0, ()))
        if not opts:
            best[n] = (math.inf if not longest else -math.inf, ())
            continue
        c, path = pick(opts, key=lambda o: o[0])
        best[n] = (c + cost(n), (n,) + path)
    c, path = best.get(loop.header, (0, ()))
    if not path or not math.isfinite(c):
        return loop.instrs(f, spin)
    return [i for b in path for i in f.blocks[b].instrs]


def tile_loop(f: Function, role: Role, loops: Optional[list] = None) -> Optional[Loop]:
    """The role's main KV-tile loop: of its tile loops, the one with the fewest instructions on
    its cheapest path (the steady-state, unmasked tile). None if the role has none."""
    loops = loops if loops is not None else natural_loops(f)
    cands = tile_loops(f, role, loops)
    if not cands:
        return None
    spin = spin_blocks(f, loops)
    return min(cands, key=lambda lp: (len(path_instrs(f, lp, spin)), lp.header))


def loop_counts(f: Function, loop: Loop, loops: Optional[list] = None, path: str = "all") -> dict:
    """``count_pipes`` of one iteration of ``loop`` (spin loops excluded), plus the nested
    non-spin loops it contains (their bodies are counted once; "nested_loops" lists them).
    ``path``: "all" (every block once), "short" / "long" (``path_instrs``)."""
    loops = loops if loops is not None else natural_loops(f)
    spin = spin_blocks(f, loops)
    if path == "all":
        ins = loop.instrs(f, spin)
    else:
        ins = path_instrs(f, loop, spin, longest=(path == "long"))
    out = count_pipes(ins)
    out["hgmma_flops"] = hgmma_flops(ins)
    out["nested_loops"] = [{"header": o.header, "instructions": len(o.instrs(f, spin))}
                           for o in loops if o is not loop and o.blocks < loop.blocks and not is_spin_loop(f, o)]
    out["blocks"] = len(loop.blocks - spin)
    return out


_MMA_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)$")


_GMMA = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")  # wgmma: f16/bf16, fp8, int8, binary


def hgmma_flops(instrs: list) -> int:
    """FLOPs of the wgmma instructions (HGMMA for f16/bf16, QGMMA for FP8; the shape is in the
    opcode: QGMMA.64x128x32.F32.E4M3.E4M3): 2*M*N*K each,
    per warpgroup (PTX ISA 9.7.15 "wgmma.mma_async": one warpgroup computes the M x N x K)."""
    total = 0
    for i in instrs:
        if i.base not in _GMMA or _never(i.pred):
            continue
        for mod in i.mods:
            m = _MMA_SHAPE.match(mod)
            if m:
                total += 2 * int(m[1]) * int(m[2]) * int(m[3])
                break
    return total


@dataclass
class KernelSass:
    """A disassembled kernel, its entry function and its analyses."""

    text: str
    function: Function
    dom: dict
    loops: list
    roles: list

    @classmethod
    def from_text(cls, text: str, name_contains: str = "kernel") -> "KernelSass":
        funcs = parse_sass(text)
        entries = [f for f in funcs if not f.name.startswith("$")] or funcs
        f = next((x for x in entries if name_contains in x.name), entries[0])
        dom = dominators(f)
        loops = natural_loops(f, dom)
        return cls(text, f, dom, loops, roles(f, dom))

    def role_loops(self) -> list:
        """[(role, tile loop or None, counts or None)] for every role."""
        out = []
        for r in self.roles:
            lp = tile_loop(self.function, r, self.loops)
            out.append((r, lp, loop_counts(self.function, lp, self.loops) if lp else None))
        return out
