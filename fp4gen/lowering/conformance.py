"""Static conformance of a compiled sm100a kernel with the plan it was rendered from.

No Blackwell GPU is needed: the generated module is compiled for sm_100a on the CPU
(``compile_only``) with CuTe DSL keeping its artifacts, and two of them are read:

* the lowered MLIR (``CUTE_DSL_KEEP=ir``: the cute/cute_nvgpu level after
  canonicalize + CSE), parsed and walked with the MLIR Python bindings that ship
  inside nvidia-cutlass-dsl (``cutlass._mlir``). Every TMEM address in that IR is
  ``retrieve_tmem_ptr`` plus a static ``add_offset``; the walker follows each
  consumer's operands back to that offset, so it knows which columns the QK^T and
  PV MMAs accumulate into, where P is read from, where the scale factors are set
  and copied to, and where P is stored;
* the PTX: MMA kinds, ``ex2`` count, mbarrier count, the width of the P stores (with
  ``p_source smem``: P's st.shared stores per publish part, each proxy-fenced before its arrive).

``check_conformance(plan, artifacts) -> list[Mismatch]`` (empty = conforming).
``compile_artifacts(source)`` produces the artifacts from a generated module's
source text (in a subprocess, because CuTe DSL reads CUTE_DSL_* at import).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Mismatch:
    """One way the compiled kernel differs from its plan."""

    check: str  # e.g. "tmem.QK.accumulator"
    expected: object
    found: object
    source: str  # "mlir" | "ptx"
    detail: str = ""

    def __str__(self) -> str:
        s = f"[{self.source}] {self.check}: expected {self.expected}, found {self.found}"
        return s + (f" ({self.detail})" if self.detail else "")


@dataclass
class Artifacts:
    ptx: str
    mlir: str
    compile_seconds: float = 0.0
    names: tuple = ()


# ----------------------------------------------------------------------------- compile


_RUNNER = textwrap.dedent("""
    import importlib.util, json, sys, time
    from fp4gen.runtime.loader import exec_file
    m = exec_file("fp4gen_generated_under_test", sys.argv[1])
    t = time.time()
    if sys.argv[3] == "backward":  # the bf16 variant only: one kernel, one kept MLIR
        names = m.compile_only_backward("sm_100a", variants=("bf16",))
        compiled = m.LAST_COMPILED_BACKWARD
    else:
        names = m.compile_only("sm_100a")
        compiled = m.LAST_COMPILED
    dt = time.time() - t
    open(sys.argv[2], "w").write(compiled.artifacts.PTX)
    print(json.dumps({"seconds": dt, "names": names}))
""")


def compile_artifacts(source: str, workdir: Optional[str] = None, timeout: int = 900, *,
                      backward: bool = False) -> Artifacts:
    """Compile a generated sm100a module (its source text) for sm_100a; return PTX + MLIR.

    ``backward``: compile the module's backward kernel (``compile_only_backward``, bf16 dK/dV
    variant) instead of the forward."""
    import json

    tmp = Path(workdir or tempfile.mkdtemp(prefix="fp4gen_sm100_"))
    tmp.mkdir(parents=True, exist_ok=True)
    mod = tmp / "module.py"
    mod.write_text(source)
    dump = tmp / "dump"
    dump.mkdir(exist_ok=True)
    for old in dump.glob("*"):
        old.unlink()
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", CUTE_DSL_KEEP="ir", CUTE_DSL_DUMP_DIR=str(dump))
    ptx_path = tmp / "kernel.ptx"
    r = subprocess.run([sys.executable, "-c", _RUNNER, str(mod), str(ptx_path),
                        "backward" if backward else "forward"], env=env, cwd=str(tmp),
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"sm_100a compilation failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    # a module with a backward compiles the forward and the backward in compile_only: keep the
    # IR of the kernel asked for (their class names tell them apart)
    wanted = "AttentionBwdSm100" if backward else "AttentionFwdSm100"
    mlirs = sorted(p for p in dump.glob("*.mlir") if wanted in p.name)
    if not mlirs:
        raise RuntimeError(f"CuTe DSL kept no MLIR of {wanted} in {dump} (CUTE_DSL_KEEP=ir not honoured?)")
    return Artifacts(ptx=ptx_path.read_text(), mlir=mlirs[-1].read_text(),
                     compile_seconds=float(info["seconds"]), names=tuple(info["names"]))


# ----------------------------------------------------------------------------- MLIR walk
#
# The kept IR is walked as text. (Parsing it with cutlass._mlir works, but CuTe DSL's
# value casters wrap operands into its tracing types on access and try to build ops,
# which is unsafe outside a trace.) The printed form is regular: one op per line,
# ``%res = dialect.op(%a, %b) ... : (types) -> type``, regions delimited by braces,
# type aliases ``!name = ...`` at the top. SSA names are resolved through a scope
# stack because sibling regions reuse names.

_INT_TUPLE = re.compile(r'!cute\.int_tuple<"(-?\d+)">')
_OP = re.compile(r'^\s*(?:(%[\w#]+(?::\d+)?(?:\s*,\s*%[\w#]+)*)\s*=\s*)?"?([a-z_][\w.]*)"?(.*)$')
_NAME = re.compile(r"%[\w#]+")


@dataclass
class _Op:
    name: str
    line: str
    operands: list
    defs: list  # the op defining each operand, resolved where the op is printed (None: block argument)
    lineno: int

    def sig_types(self) -> list:
        """Operand types from the trailing ``: (t0, t1, ...)`` signature (aliases unexpanded)."""
        i = self.line.rfind(" : (")
        if i < 0:
            return []
        body, depth, cur, out = self.line[i + 4:], 0, "", []
        for ch in body:
            if ch in "<([{":
                depth += 1
            elif ch in ">)]}":
                if depth == 0:
                    out.append(cur.strip())
                    return out
                depth -= 1
            if ch == "," and depth == 0:
                out.append(cur.strip())
                cur = ""
                continue
            cur += ch
        return out


def _split_ops(text: str):
    aliases = {}
    ops = []
    scopes = [{}]
    for n, line in enumerate(text.splitlines(), 1):
        st = line.strip()
        if st.startswith("!") and " = " in st and not st.startswith("!llvm"):
            k, v = st.split(" = ", 1)
            aliases[k] = v
            continue
        closes = st.startswith("}")
        if closes:
            scopes.pop()
            if not st.endswith("{"):
                continue
            scopes.append({})
            continue
        m = _OP.match(line)
        if m and m.group(2) and not st.startswith("//") and not st.startswith("^"):
            results, name, rest = m.group(1), m.group(2), m.group(3)
            head = rest.split(" : ", 1)[0]
            names = _NAME.findall(head)
            # resolve now: SSA defs precede their uses, and sibling regions reuse names later
            defs = [next((sc[x] for sc in reversed(scopes) if x in sc), None) for x in names]
            op = _Op(name, st, names, defs, n)
            ops.append(op)
            if results:
                for r in results.split(","):
                    scopes[-1][r.strip().split(":")[0]] = op
        if st.endswith("{"):
            scopes.append({})
            # block arguments of the region (e.g. scf.for's induction variable) stay undefined
    return ops, aliases


def _def(op: _Op, i: int):
    return op.defs[i] if i < len(op.defs) else None


@dataclass
class _Facts:
    """What the walker found, as plain Python values."""

    alloc_columns: list = field(default_factory=list)
    qk_acc: set = field(default_factory=set)
    pv_acc: set = field(default_factory=set)
    pv_a: set = field(default_factory=set)
    pv_a_types: set = field(default_factory=set)  # what the PV gemms' A operands are (TMEM / SMEM desc)
    sf: dict = field(default_factory=lambda: {"qk_sf_a": set(), "qk_sf_b": set(), "pv_sf_a": set(), "pv_sf_b": set()})
    s2t_dst: set = field(default_factory=set)
    tmem_st: set = field(default_factory=set)
    tmem_ld: set = field(default_factory=set)
    loop_mma: list = field(default_factory=list)  # (qk, pv) gemm counts per scf.for that issues MMAs


def _stage_stride(op: Optional[_Op]) -> Optional[int]:
    """N when ``op`` is ``cute.make_int_tuple(%x)`` of ``%x = arith.muli %stage, %cN`` (either
    operand order): the column offset of a run-time query stage (``stage_tmem``: stage 0's
    region plus stage * N). None for any other run-time offset."""
    if op is None or op.name != "cute.make_int_tuple" or not op.defs:
        return None
    mul = op.defs[0]
    if mul is None or mul.name != "arith.muli":
        return None
    for d in mul.defs:
        m = re.search(r"arith\.constant (\d+) : i32", d.line) if d is not None else None
        if m:
            return int(m.group(1))
    return None


def _offsets(op: Optional[_Op], depth: int = 0, seen=None, stages: int = 1) -> set:
    """Static TMEM column offsets (from retrieve_tmem_ptr) that the value defined by ``op`` is built on.

    A run-time offset ``stage * N`` (one traced body for every query stage) stands for every
    stage of the plan: ``stages`` offsets, 0, N, ..., (stages - 1) N. Which stage a warp takes
    is not read from the IR; the emulator runs every stage's warps at their real addresses."""
    seen = set() if seen is None else seen
    if op is None or depth > 60 or id(op) in seen:
        return set()
    seen.add(id(op))
    if op.name == "cute_nvgpu.arch.sm100.retrieve_tmem_ptr":
        return {0}
    if ".atom.make" in op.name or op.name in ("cute.make_atom", "cute.make_tiled_copy", "cute.make_tiled_mma"):
        return set()  # a copy/MMA atom built from some tensor is not an address of the data
    if op.name == "cute.add_offset":
        inner = _offsets(_def(op, 0), depth + 1, seen, stages)
        m = _INT_TUPLE.search(op.line.split(" : ", 1)[-1])
        if m is None:
            stride = _stage_stride(_def(op, 1))
            if stride is None:
                return {("dynamic",)} if inner else set()
            return {o + k * stride for o in inner if isinstance(o, int) for k in range(stages)}
        return {o + int(m.group(1)) for o in inner if isinstance(o, int)}
    out = set()
    for d in op.defs:
        out |= _offsets(d, depth + 1, seen, stages)
    return out


def _use(op: _Op, i: int) -> set:
    return _offsets(_def(op, i))


def mlir_facts(mlir_text: str, pv_atom: Optional[str] = None, stages: int = 1) -> _Facts:
    """``pv_atom``: with P in SMEM (p_source smem) both products read A from SMEM, so the PV
    gemm is the one whose tiled-MMA type contains this text; None: the gemm with A in TMEM.
    ``stages``: the plan's query stages, over which a run-time stage offset ranges (``_offsets``)."""
    ops, aliases = _split_ops(mlir_text)

    def _use(op: _Op, i: int) -> set:
        return _offsets(_def(op, i), stages=stages)

    def expand(t: str) -> str:
        return aliases.get(t, t)

    def is_pv(types: list) -> bool:
        if pv_atom is not None:
            return bool(types) and pv_atom in expand(types[0])
        return len(types) >= 3 and "tmem" in expand(types[2])  # P from TMEM: the PV product

    facts = _Facts()
    qk_atoms, pv_atoms = set(), set()
    for op in ops:
        if op.name == "cute_nvgpu.arch.sm100.alloc_tmem":
            c = _def(op, 0)
            m = re.search(r"arith\.constant (\d+)", c.line) if c else None
            facts.alloc_columns.append(int(m.group(1)) if m else "dynamic")
        elif op.name == "cute.gemm":
            types = op.sig_types()
            if is_pv(types):
                pv_atoms.add(types[0])
                facts.pv_a_types.add(expand(types[2]).split("<", 1)[0] if len(types) >= 3 else "")
                facts.pv_acc |= _use(op, 1)
                facts.pv_a |= _use(op, 2)
            else:
                qk_atoms.add(types[0] if types else "")
                facts.qk_acc |= _use(op, 1)
    for op in ops:
        if op.name.startswith("cute_nvgpu.atom.set_value"):
            m = re.search(r"set_value<(\w+)>", op.line)
            which = m.group(1) if m else ""
            types = op.sig_types()
            if which in ("sf_a", "sf_b") and types:
                prod = "qk" if types[0] in qk_atoms else "pv" if types[0] in pv_atoms else None
                if prod:
                    facts.sf[f"{prod}_{which}"] |= _use(op, 1)
        elif op.name == "cute.copy":
            types = op.sig_types()
            atom = expand(types[0]) if types else ""
            if "s2t_copy" in atom:
                facts.s2t_dst |= _use(op, 2)
            elif "tmem_store" in atom:
                facts.tmem_st |= _use(op, 2)
            elif "tmem_load" in atom:
                facts.tmem_ld |= _use(op, 1)
    # MMAs per iteration of every scf.for that issues them (lexical nesting by braces)
    lines = mlir_text.splitlines()
    for op in ops:
        if op.name != "scf.for":
            continue
        depth, qk, pv = 0, 0, 0
        for line in lines[op.lineno - 1:]:
            st = line.strip()
            if st.startswith("cute.gemm("):
                t = _Op("cute.gemm", st, [], [], 0).sig_types()
                if is_pv(t):
                    pv += 1
                else:
                    qk += 1
            depth += st.count("{") - st.count("}")
            if depth <= 0 and st.endswith("}"):
                break
        if qk or pv:
            facts.loop_mma.append((qk, pv))
    return facts


# ----------------------------------------------------------------------------- the check


# the MLIR spelling of a plan's scale-factor dtype (MmaChoice.sf_dtype)
_SF_MLIR = {"e8m0": "f8E8M0FNU", "e4m3": "f8E4M3FN"}


def _regions(plan) -> dict:
    return {r.name: (r.first_col, r.last_col) for r in plan.tmem.regions}


def _in(off, reg) -> bool:
    return isinstance(off, int) and reg[0] <= off <= reg[1]


def _k_inst(kind: str) -> int:
    """K elements per tcgen05.mma instruction of a kind (fp4 64, fp8/f8f6f4 32, f16 16)."""
    if "mxf4" in kind:
        return 64
    if "f8f6f4" in kind:
        return 32
    return 16


def expected_barriers(plan) -> int:
    """mbarriers the sm100a template allocates for this plan (each pipeline: full + empty)."""
    sch = plan.spec.schedule
    q = sch.q_stages
    kv = plan.pipeline.kv_stages
    parts = len(plan.publish.parts)
    # Q ring + K ring + V ring + per stage (S full/drained, P parts, O done, row statistics)
    return 2 * q + 2 * kv + 2 * kv + q * (2 + 2 * parts + 2 + 2)


def scale_fence_mismatches(lines: list) -> list:
    """P's block scales are stores to SMEM (st.shared: bytes, or the four of a row packed into one
    word) that tcgen05.cp reads through the async proxy once the MMA warp has seen a publish
    arrive. So in every publish window (the code from one mbarrier arrive to the next that holds
    a tcgen05.st, i.e. a part of P) with an st.shared in it, a fence.proxy.async must follow the
    window's last st.shared before the arrive (PTX ISA 9.7.13.4; missing, the copy may read
    stale bytes: NaNs, not errors). A window that stores nothing to SMEM (the second half of P)
    needs none. ``lines``: stripped PTX lines in text order."""
    last_store, fenced, publish = None, False, False
    for i, ln in enumerate(lines):
        if ln.startswith("st.shared"):
            last_store, fenced = i, False
        elif ln.startswith("fence.proxy.async"):
            fenced = True
        elif ln.startswith("tcgen05.st."):
            publish = True
        elif ln.startswith("mbarrier.arrive"):
            if publish and last_store is not None and not fenced:
                return [Mismatch("ptx.fence.scales", "fence.proxy.async between P's scale stores and the arrive",
                                 "missing", "ptx", f"PTX line {last_store + 1} (store) .. {i + 1} (arrive): "
                                 "P's scale bytes in SMEM feed tcgen05.cp")]
            last_store, fenced, publish = None, False, False
    return []



def check_conformance(plan, artifacts: Artifacts) -> list:
    """Compare a compiled sm100a kernel with ``plan``; return the mismatches (empty: conforming)."""
    out: list[Mismatch] = []
    spec = plan.spec
    regs = _regions(plan)
    mma = {m.name: m for m in plan.mma}
    ptx = artifacts.ptx

    # --- PTX: MMA kinds
    kinds = set(re.findall(r"tcgen05\.mma\.cta_group::\d\.(kind::[\w:]+(?:\.block_scale(?:\.block\d+)?)?)", ptx))
    want = {mma["QK"].kind, mma["PV"].kind}
    for w in sorted(want):
        if w not in kinds:
            out.append(Mismatch("ptx.mma.kind", w, sorted(kinds), "ptx", "the plan's MMA kind is never issued"))
    for k in sorted(kinds - want):
        out.append(Mismatch("ptx.mma.kind", sorted(want), k, "ptx", "an MMA kind the plan did not choose"))

    # --- PTX: exp on the P path
    n_ex2 = len(re.findall(r"^\s*ex2\.", ptx, re.M))
    pp = spec.p_production
    if pp.kind.value == "direct_p" and pp.policy.value == "fast" and spec.p.format.value == "mxfp4":
        if n_ex2 != 0:
            out.append(Mismatch("ptx.ex2", 0, n_ex2, "ptx", "fast Direct-P must not use MUFU.EX2"))
    elif pp.kind.value in ("exp", "two_level") or pp.policy.value == "accurate":
        if n_ex2 == 0:
            out.append(Mismatch("ptx.ex2", ">0", 0, "ptx", "this P production uses the hardware EX2"))

    # --- PTX: barriers and TMEM allocation instruction
    n_bar = len(re.findall(r"^\s*mbarrier\.init", ptx, re.M))
    if n_bar != expected_barriers(plan):
        out.append(Mismatch("ptx.mbarrier.count", expected_barriers(plan), n_bar, "ptx"))
    if not re.search(r"tcgen05\.alloc\.cta_group::1", ptx):
        out.append(Mismatch("ptx.tcgen05.alloc", "present", "absent", "ptx"))

    # --- PTX: P publish width (columns per tcgen05.st of P)
    part_cols = {p.p_columns[1] - p.p_columns[0] + 1 for p in plan.publish.parts if p.p_columns}
    st_widths = {int(x) for x in re.findall(r"tcgen05\.st\.sync\.aligned\.32x32b\.x(\d+)", ptx)}
    for w in part_cols:
        if w not in st_widths:
            out.append(Mismatch("ptx.publish.width", f"tcgen05.st .x{w} (plan: {plan.publish.mode})",
                                sorted(st_widths), "ptx"))

    # --- PTX: every P store is waited on (tcgen05.wait::st) and, when P's scales go through
    # SMEM, proxy-fenced before the next mbarrier arrive (a missing fence gives NaNs, not errors)
    lines = [ln.strip() for ln in ptx.splitlines()]
    for i, ln in enumerate(lines):
        if not ln.startswith("tcgen05.st."):
            continue
        between = []
        for nxt in lines[i + 1:]:
            if nxt.startswith("mbarrier.arrive"):
                break  # (a later tcgen05.st before the arrive is covered by the same wait)
            between.append(nxt)
        if not any(x.startswith("tcgen05.wait::st") for x in between):
            out.append(Mismatch("ptx.fence.tmem_store", "tcgen05.wait::st before the arrive", "missing", "ptx",
                                f"PTX line {i + 1}: {ln[:60]}"))
            break
    if mma["PV"].block_scaled:
        out += scale_fence_mismatches(lines)

    # --- PTX, p_source smem: P's codes are 32-bit st.shared stores (scalar or v4) that the MMA
    # reads through the async proxy, so each publish part must be proxy-fenced after its last
    # store and before its mbarrier arrive (PTX ISA 9.7.13.4, fence.proxy.async: without it the
    # MMA may read stale SMEM, a race, not an error). A publish window is the code between two
    # mbarrier operations whose register stores of 32-bit words reach one part of P per thread
    # (tile_n * bits / 8 / parts bytes); the other 32-bit stores (row statistics, 8 bytes per
    # window) stay below that.
    p_smem = mma["PV"].a_source == "smem"
    if p_smem:
        part_bytes = spec.schedule.tile_n * spec.p.format.bits // 8 // len(plan.publish.parts)
        windows, cur = [], []
        for i, ln in enumerate(lines):
            if ln.startswith("mbarrier."):
                windows.append((i, cur))
                cur = []
            else:
                cur.append(ln)
        n_pub = 0
        for i, body in windows:
            nbytes, last = 0, -1
            for k, ln in enumerate(body):
                m = re.match(r"st\.shared\.(?:v([24])\.)?[bu]32\s+\[[^\]]+\],\s*[{%]", ln)
                if m:
                    nbytes += 4 * int(m.group(1) or 1)
                    last = k
            if nbytes < part_bytes:
                continue
            n_pub += 1
            if not any(x.startswith("fence.proxy.async") for x in body[last + 1:]):
                out.append(Mismatch("ptx.fence.p_smem", "fence.proxy.async between P's stores and the arrive",
                                    "missing", "ptx", f"PTX line {i + 1}: P's codes in SMEM feed the PV MMA"))
                break
        want_pub = spec.schedule.q_stages * len(plan.publish.parts)
        if n_pub < want_pub:
            out.append(Mismatch("ptx.p_smem.stores", f"{want_pub} publish windows storing {part_bytes} B of P",
                                n_pub, "ptx", "p_source smem: P's codes are not stored to SMEM part by part"))

    # --- MLIR: TMEM allocation and every region a consumer touches
    pv = mma["PV"]
    # p_source smem: the PV gemm is told from QK^T by its tiled-MMA type (scale type, A/B from
    # SMEM, block size), which differs from QK^T's when the two kinds differ
    pv_atom = None
    if p_smem:
        pv_atom = f"sf_type = {_SF_MLIR.get(pv.sf_dtype, pv.sf_dtype)}, frag_kind = ss, vec_size = {pv.sf_block}"
        qk = mma["QK"]
        if (qk.sf_dtype, qk.sf_block) == (pv.sf_dtype, pv.sf_block):
            out.append(Mismatch("mlir.PV.atom", "a PV tiled MMA type unlike QK^T's", pv_atom, "mlir",
                                "with P in SMEM the check tells PV from QK^T by the MMA type only"))
    f = mlir_facts(artifacts.mlir, pv_atom, spec.schedule.q_stages)
    if f.alloc_columns != [plan.tmem.alloc_columns]:
        out.append(Mismatch("mlir.tmem.alloc", plan.tmem.alloc_columns, f.alloc_columns, "mlir"))
    q = spec.schedule.q_stages

    def exact(check, found, names):
        want = {regs[n][0] for n in names}
        if found != want:
            out.append(Mismatch(check, sorted(want), sorted(found, key=str), "mlir",
                                f"first columns of {', '.join(names)}"))

    def within(check, found, names, need_first=True):
        rs = [regs[n] for n in names if n in regs]
        stray = sorted((o for o in found if not any(_in(o, r) for r in rs)), key=str)
        if stray:
            out.append(Mismatch(check, f"columns inside {', '.join(names)} {rs}", stray, "mlir",
                                "TMEM accesses outside the planned regions"))
        if need_first:
            missing = [n for n in names if n in regs and regs[n][0] not in found]
            if missing:
                out.append(Mismatch(check, {n: regs[n][0] for n in missing}, sorted(found, key=str), "mlir",
                                    f"never addressed at the planned first column of {', '.join(missing)}"))

    exact("mlir.QK.accumulator", f.qk_acc, [f"S{j}" for j in range(q)])
    exact("mlir.PV.accumulator", f.pv_acc, [f"O{j}" for j in range(q)])
    if p_smem:
        # no P region: PV's A is an SMEM descriptor view, never a TMEM address
        if f.pv_a_types != {"!cute_nvgpu.smem_desc_view"}:
            out.append(Mismatch("mlir.PV.A(P)", ["!cute_nvgpu.smem_desc_view"], sorted(f.pv_a_types), "mlir",
                                "p_source smem: the PV MMA must read P through an SMEM descriptor"))
    else:
        within("mlir.PV.A(P)", f.pv_a, [f"P{j}" for j in range(q)])
    within("mlir.QK.scale_A", f.sf["qk_sf_a"], [f"SFQ{j}" for j in range(q)])
    within("mlir.QK.scale_B", f.sf["qk_sf_b"], [f"SFK{j}" for j in range(q)])
    sf_names = [f"SFQ{j}" for j in range(q)] + [f"SFK{j}" for j in range(q)]
    if mma["PV"].block_scaled:
        within("mlir.PV.scale_A(P)", f.sf["pv_sf_a"], [f"SFP{j}" for j in range(q)])
        within("mlir.PV.scale_B(V)", f.sf["pv_sf_b"], [f"SFV{j}" for j in range(q)])
        sf_names += [f"SFP{j}" for j in range(q)] + [f"SFV{j}" for j in range(q)]
    within("mlir.tcgen05.cp.dst", f.s2t_dst, sf_names)
    running_max = pp.kind.value == "exp" or spec.p.format.value != "mxfp4"
    # O is stored to by the online max's rescale, and by the guard's headroom rebase of
    # Direct-P (numerics.directp.rebase)
    o_rescaled = running_max or spec.guard.kind.value == "sample"
    st_names = ([] if p_smem else [f"P{j}" for j in range(q)]) + ([f"O{j}" for j in range(q)] if o_rescaled else [])
    within("mlir.tcgen05.st.dst", f.tmem_st, st_names, need_first=False)
    # every publish part of every stage is stored at its planned column (P first + part offset)
    want_p = {f"P{j} part {p.index}": regs[f"P{j}"][0] + p.p_columns[0]
              for j in range(q) for p in plan.publish.parts if p.p_columns}
    missing_p = {k: v for k, v in want_p.items() if v not in f.tmem_st}
    if missing_p:
        out.append(Mismatch("mlir.tcgen05.st.P", missing_p, sorted(f.tmem_st, key=str),
                            "mlir", "P (or one publish part of it) is not stored at its planned column"))
    within("mlir.tcgen05.ld.src", f.tmem_ld, [f"S{j}" for j in range(q)] + [f"O{j}" for j in range(q)],
           need_first=True)

    # --- MLIR: MMAs per KV tile (the MMA warp's steady-state loop)
    want_qk = q * -(-spec.head_dim // _k_inst(mma["QK"].kind))
    want_pv = q * -(-spec.schedule.tile_n // _k_inst(mma["PV"].kind))
    if (want_qk, want_pv) not in f.loop_mma:
        out.append(Mismatch("mlir.mma_per_kv_tile", {"QK": want_qk, "PV": want_pv},
                            [{"QK": a, "PV": b} for a, b in f.loop_mma], "mlir",
                            "tcgen05.mma issued per iteration of the KV loop"))
    return out


# ----------------------------------------------------------------------------- the backward
#
# The sm100a backward (fp4gen/device/sm100/backward.py) issues five tcgen05.mma products per query
# tile. In the kept IR each ``cute.gemm`` names its tiled-MMA type, whose printed form carries
# the operand majors and where A comes from: ``ab_major = (k, k)`` S^T and dP^T (the first and
# second half of those in the loop, in issue order), ``frag_kind = ts`` (A from TMEM) dV,
# ``ab_major = (k, mn)`` with SMEM A dK, ``ab_major = (mn, mn)`` dQ.

_BWD_MMAS = ("S", "dP", "dV", "dK", "dQ")


def _bwd_mma_class(atom_type: str) -> str:
    m = re.search(r"ab_major = \((\w+), (\w+)\)", atom_type)
    fk = re.search(r"frag_kind = (\w+)", atom_type)
    majors = (m.group(1), m.group(2)) if m else ("?", "?")
    if fk and fk.group(1) == "ts":
        return "dV"
    if majors == ("k", "k"):
        return "SdP"
    if majors == ("k", "mn"):
        return "dK"
    if majors == ("mn", "mn"):
        return "dQ"
    return "?"


@dataclass
class _BwdFacts:
    alloc_columns: list = field(default_factory=list)
    acc: dict = field(default_factory=lambda: {n: set() for n in _BWD_MMAS})
    dv_a: set = field(default_factory=set)  # dV's A operand (P^T) in TMEM
    tmem_st: set = field(default_factory=set)
    tmem_ld: set = field(default_factory=set)
    loop_mma: list = field(default_factory=list)  # {S, dP, dV, dK, dQ: count} per MMA-issuing scf.for
    unclassified: list = field(default_factory=list)


def backward_mlir_facts(mlir_text: str) -> _BwdFacts:
    """TMEM columns of every backward product, the P^T stores and the TMEM loads, from the kept IR."""
    ops, aliases = _split_ops(mlir_text)

    def expand(t: str) -> str:
        return aliases.get(t, t)

    facts = _BwdFacts()
    lines = mlir_text.splitlines()
    for op in ops:
        if op.name == "cute_nvgpu.arch.sm100.alloc_tmem":
            c = _def(op, 0)
            m = re.search(r"arith\.constant (\d+)", c.line) if c else None
            facts.alloc_columns.append(int(m.group(1)) if m else "dynamic")
        elif op.name == "cute.copy":
            types = op.sig_types()
            atom = expand(types[0]) if types else ""
            if "tmem_store" in atom:
                facts.tmem_st |= _use(op, 2)
            elif "tmem_load" in atom:
                facts.tmem_ld |= _use(op, 1)
    # the MMA-issuing loops: classify each gemm, S^T / dP^T by issue order within the loop
    for op in ops:
        if op.name != "scf.for":
            continue
        depth, gemms = 0, []
        for ln, line in enumerate(lines[op.lineno - 1:], op.lineno):
            st = line.strip()
            if "cute.gemm(" in st:
                gemms.append(ln)
            depth += st.count("{") - st.count("}")
            if depth <= 0 and st.endswith("}"):
                break
        if not gemms:
            continue
        by_line = {o.lineno: o for o in ops if o.name == "cute.gemm"}
        classes = []
        for ln in gemms:
            g = by_line.get(ln)
            if g is None:
                continue
            t = g.sig_types()
            atom = expand(t[0]) if t else ""
            classes.append((_bwd_mma_class(atom), g, atom))
        # S^T and dP^T are both K-major x K-major: with an FP8 dO their atoms differ (bf16 S^T
        # first); with one atom type the first half of the run is S^T
        sdp = [(g, atom) for c, g, atom in classes if c == "SdP"]
        types = list(dict.fromkeys(atom for _, atom in sdp))
        if len(types) == 2:
            named = {id(g): ("S" if atom == types[0] else "dP") for g, atom in sdp}
        else:
            half = len(sdp) // 2
            named = {id(g): ("S" if i < half else "dP") for i, (g, _) in enumerate(sdp)}
        counts = {n: 0 for n in _BWD_MMAS}
        for c, g, _ in classes:
            name = named.get(id(g), c)
            if name not in counts:
                facts.unclassified.append(g.line[:120])
                continue
            counts[name] += 1
            facts.acc[name] |= _use(g, 1)
            if name == "dV":
                facts.dv_a |= _use(g, 2)
        facts.loop_mma.append(counts)
    return facts


# The transposed operands are views of the same SMEM bytes through another MMA's layout
# (fp4gen/device/sm100/backward.py: ``view``). The kernel's signature prints every SMEM layout as
# ``!cute.composed_layout<"S<b,m,s> o 0 o SHAPE:STRIDE">`` in argument order; for each pair the
# element (row, col) of one must sit at the same offset, under the same swizzle, as element
# (col, row) of the other. Layouts are in the tcgen05 operand form ((MN, K), MMA_MN, MMA_K, stage).
_BWD_SMEM_ARGS = ("sK", "sV", "sQ", "sdO", "sdSt", "sQt", "sdOt", "sdS", "sKt", "tP")
_BWD_SMEM_VIEWS = (("sQ", "sQt"), ("sdO", "sdOt"), ("sK", "sKt"), ("sdSt", "sdS"))
_COMPOSED = re.compile(r'!cute\.composed_layout<"(S<\d+,\d+,\d+>) o 0 o ([^":]+):([^"]+)">')


def _leaves(shape, stride):
    if isinstance(shape, tuple):
        out = []
        for a, b in zip(shape, stride):
            out += _leaves(a, b)
        return out
    return [(shape, stride)]


class _OperandLayout:
    """offset(mn, k, stage) of a tcgen05 SMEM operand layout printed by CuTe DSL (colex order)."""

    def __init__(self, swizzle: str, shape: str, stride: str):
        import ast

        sh, st = ast.literal_eval(shape), ast.literal_eval(stride)
        self.swizzle = swizzle
        self.mn = _leaves(sh[0][0], st[0][0]) + _leaves(sh[1], st[1])
        self.k = _leaves(sh[0][1], st[0][1]) + _leaves(sh[2], st[2])
        self.stage = _leaves(sh[3], st[3]) if len(sh) > 3 else [(1, 0)]

    @staticmethod
    def _at(leaves, i):
        off = 0
        for n, d in leaves:
            off += (i % n) * d
            i //= n
        return off

    def extent(self, leaves):
        e = 1
        for n, _ in leaves:
            e *= n
        return e

    def offset(self, mn, k, stage=0):
        return self._at(self.mn, mn) + self._at(self.k, k) + self._at(self.stage, stage)


def backward_smem_layouts(mlir_text: str) -> dict:
    """name -> _OperandLayout of the backward kernel's SMEM operand layouts (its signature)."""
    head = next((ln for ln in mlir_text.splitlines() if "cuda.kernel @" in ln and "AttentionBwdSm100" in ln), "")
    found = _COMPOSED.findall(head)
    if len(found) != len(_BWD_SMEM_ARGS):
        return {}
    return {n: _OperandLayout(*f) for n, f in zip(_BWD_SMEM_ARGS, found)}


def smem_view_mismatches(mlir_text: str) -> list:
    """Pairs of SMEM layouts that are not each other's transposed view of the same bytes."""
    lays = backward_smem_layouts(mlir_text)
    if not lays:
        return [Mismatch("mlir.bwd.smem.layouts", f"{len(_BWD_SMEM_ARGS)} composed layouts in the kernel signature",
                         "not found", "mlir")]
    out = []
    for a, b in _BWD_SMEM_VIEWS:
        la, lb = lays[a], lays[b]
        dims = (la.extent(la.mn), la.extent(la.k), la.extent(la.stage))
        if la.swizzle != lb.swizzle or dims != (lb.extent(lb.k), lb.extent(lb.mn), lb.extent(lb.stage)):
            out.append(Mismatch("mlir.bwd.smem.transposed_view", f"{a} and {b}: same swizzle, transposed extents",
                                f"{la.swizzle} {dims} vs {lb.swizzle}", "mlir"))
            continue
        bad = next(((i, j, s) for s in range(dims[2]) for i in range(dims[0]) for j in range(dims[1])
                    if la.offset(i, j, s) != lb.offset(j, i, s)), None)
        if bad is not None:
            i, j, s_ = bad
            out.append(Mismatch("mlir.bwd.smem.transposed_view", f"{b}({j}, {i}) at the offset of {a}({i}, {j})",
                                f"{lb.offset(j, i, s_)} != {la.offset(i, j, s_)} (stage {s_})", "mlir",
                                "a transposed operand view reads other bytes than the buffer holds"))
    return out


def expected_backward_counts(bp) -> dict:
    """tcgen05.mma instructions per query tile of each product (K / 16 for kind::f16)."""
    return {m.name: m.instructions for m in bp.mmas}


def check_backward_conformance(bp, artifacts: Artifacts) -> list:
    """Compare a compiled sm100a backward with its ``BackwardPlanSm100``; return the mismatches."""
    out: list[Mismatch] = []
    regs = {r.name: (r.first_col, r.last_col) for r in bp.tmem.regions}
    ptx = artifacts.ptx

    # --- PTX: the MMA kind, barriers, allocation, exp, the dQ reduction
    kinds = set(re.findall(r"tcgen05\.mma\.cta_group::\d\.(kind::[\w]+)", ptx))
    if kinds != set(bp.mma_kind.split("+")):
        out.append(Mismatch("ptx.bwd.mma.kind", sorted(bp.mma_kind.split("+")), sorted(kinds), "ptx"))
    n_bar = len(re.findall(r"^\s*mbarrier\.init", ptx, re.M))
    if n_bar != bp.mbarriers:
        out.append(Mismatch("ptx.bwd.mbarrier.count", bp.mbarriers, n_bar, "ptx"))
    if not re.search(r"tcgen05\.alloc\.cta_group::1", ptx):
        out.append(Mismatch("ptx.bwd.tcgen05.alloc", "present", "absent", "ptx"))
    if not re.search(r"^\s*ex2\.", ptx, re.M):
        out.append(Mismatch("ptx.bwd.ex2", ">0", 0, "ptx", "P^T = exp2(S^T c - LSE2) is recomputed"))
    n_red = len(re.findall(r"^\s*red\.global\.add\.v4\.f32", ptx, re.M))
    if n_red != bp.head_dim // 4:
        out.append(Mismatch("ptx.bwd.dq.red", bp.head_dim // 4, n_red, "ptx",
                            "red.global.add.v4.f32 per dQ row (one thread per query)"))
    ordered = bool(re.search(r"ld\.acquire\.gpu", ptx)) and bool(re.search(r"red\.release\.gpu", ptx))
    if ordered != (bp.dq_reduction == "ordered_atomic_fp32"):
        out.append(Mismatch("ptx.bwd.dq.order", bp.dq_reduction, "turns (acquire/release)" if ordered else "none",
                            "ptx", "deterministic dQ takes turns per query tile"))
    # P^T stores: one per 32 queries (16 columns of bf16 pairs, 8 of E4M3 quads), together
    # covering P's columns, in each copy of the tile body (the masked and unmasked ones)
    p_cols = regs["P"][1] - regs["P"][0] + 1
    want_w = p_cols // (bp.tile_m // 32)
    widths = [int(x) for x in re.findall(r"tcgen05\.st\.sync\.aligned\.32x32b\.x(\d+)", ptx)]
    if set(widths) != {want_w} or sum(widths) % p_cols or not widths:
        out.append(Mismatch("ptx.bwd.p_store.width", f"{bp.tile_m // 32} x tcgen05.st .x{want_w} ({p_cols} columns)",
                            widths, "ptx"))
    # every P^T store is waited on and dS^T (generic-proxy SMEM stores) fenced before the arrive
    lines = [ln.strip() for ln in ptx.splitlines()]
    for i, ln in enumerate(lines):
        if not ln.startswith("tcgen05.st."):
            continue
        between = []
        for nxt in lines[i + 1:]:
            if nxt.startswith("mbarrier.arrive"):
                break
            between.append(nxt)
        if not any(x.startswith("tcgen05.wait::st") for x in between):
            out.append(Mismatch("ptx.bwd.fence.tmem_store", "tcgen05.wait::st before the arrive", "missing", "ptx",
                                f"PTX line {i + 1}: {ln[:60]}"))
            break
        if not any(x.startswith("fence.proxy.async") for x in between):
            out.append(Mismatch("ptx.bwd.fence.ds_smem", "fence.proxy.async before the arrive", "missing", "ptx",
                                "dS^T is written to SMEM by the compute threads and read by tcgen05.mma"))
            break

    # --- MLIR: allocation, accumulators, P^T, loads, MMAs per query tile
    f = backward_mlir_facts(artifacts.mlir)
    if f.alloc_columns != [bp.tmem.alloc_columns]:
        out.append(Mismatch("mlir.bwd.tmem.alloc", bp.tmem.alloc_columns, f.alloc_columns, "mlir"))
    for m in bp.mmas:
        want = {regs[m.accumulator][0]}
        if f.acc[m.name] != want:
            out.append(Mismatch(f"mlir.bwd.{m.name}.accumulator", sorted(want), sorted(f.acc[m.name], key=str), "mlir",
                                f"first column of {m.accumulator} ({m.formula})"))
    if f.dv_a != {regs["P"][0]}:
        out.append(Mismatch("mlir.bwd.dV.A(P)", [regs["P"][0]], sorted(f.dv_a, key=str), "mlir",
                            "dV += P^T dO reads P^T from TMEM at P's first column"))
    # the stores go through the dV MMA's A fragment (the chunk offsets are its layout's, not
    # pointer arithmetic): every store is based inside P, at P's first column
    if not f.tmem_st or any(not _in(o, regs["P"]) for o in f.tmem_st) or regs["P"][0] not in f.tmem_st:
        out.append(Mismatch("mlir.bwd.tcgen05.st.P", f"P's first column {regs['P'][0]} (inside {regs['P']})",
                            sorted(f.tmem_st, key=str), "mlir", "P^T stores"))
    ld_regions = ["S", "dP", "dV", "dK", "dQ"]
    stray = sorted((o for o in f.tmem_ld if not any(_in(o, regs[n]) for n in ld_regions)), key=str)
    if stray:
        out.append(Mismatch("mlir.bwd.tcgen05.ld.src", f"columns inside {ld_regions}", stray, "mlir"))
    missing = [n for n in ld_regions if regs[n][0] not in f.tmem_ld]
    if missing:
        out.append(Mismatch("mlir.bwd.tcgen05.ld.src", {n: regs[n][0] for n in missing}, sorted(f.tmem_ld, key=str),
                            "mlir", "never loaded at the planned first column"))
    want_counts = expected_backward_counts(bp)
    if want_counts not in f.loop_mma:
        out.append(Mismatch("mlir.bwd.mma_per_query_tile", want_counts, f.loop_mma, "mlir",
                            "tcgen05.mma issued per iteration of the MMA warp's query loop"))
    if f.unclassified:
        out.append(Mismatch("mlir.bwd.mma.unknown", [], f.unclassified, "mlir", "an MMA the plan does not have"))
    out += smem_view_mismatches(artifacts.mlir)
    return out


def report(mismatches) -> str:
    if not mismatches:
        return "conforms to the plan"
    return "\n".join(str(m) for m in mismatches)


# ----------------------------------------------------------------------------- PTX statistics

_CLASSES = (
    ("MUFU ex2", re.compile(r"^ex2\.")),
    ("MUFU other (lg2/rcp/rsqrt)", re.compile(r"^(lg2|rcp|rsqrt|sqrt|sin|cos|tanh)\.")),
    ("cvt", re.compile(r"^cvt\.")),
    ("tcgen05.ld", re.compile(r"^tcgen05\.ld\.")),
    ("tcgen05.st", re.compile(r"^tcgen05\.st\.")),
    ("f32 fma/mul/add", re.compile(r"^(fma|mul|add|sub)\.(rn\.|rz\.|rm\.|rp\.)?(ftz\.)?(sat\.)?f32(x2)?\b")),
    ("f32 min/max", re.compile(r"^(min|max)\.(ftz\.)?(NaN\.)?f32")),
    ("integer/logic/select", re.compile(r"^(and|or|xor|shl|shr|selp|prmt|lop3|bfi|bfe|add\.s32|add\.u32|mul\.lo|mad)")),
)


def softmax_loop_stats(ptx: str) -> list:
    """Instruction counts per iteration of each PTX loop that both loads from and stores to
    TMEM (the softmax warps' KV loop: tcgen05.ld of S, tcgen05.st of P). One dict per loop."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    labels = {}
    for i, ln in enumerate(lines):
        m = re.match(r"^(\$L__\w+):", ln)
        if m:
            labels[m.group(1)] = i
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    out = []
    for a, b in loops:
        body = [ln for ln in lines[a:b + 1] if ln and not ln.startswith(("$", "//", "{", "}", "."))]
        body = [re.sub(r"^@!?%p\d+\s+", "", ln) for ln in body]
        if not any(x.startswith("tcgen05.ld.") for x in body) or not any(x.startswith("tcgen05.st.") for x in body):
            continue
        # innermost such loop only: skip loops that contain another qualifying loop
        if any(a < a2 and b2 < b for a2, b2 in loops if (a2, b2) != (a, b)
               and any(lines[k].startswith("tcgen05.st.") for k in range(a2, b2 + 1))):
            continue
        stats = {"instructions": len(body)}
        for name, rx in _CLASSES:
            stats[name] = sum(1 for x in body if rx.match(x))
        out.append(stats)
    return out
