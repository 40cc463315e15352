"""``fp4gen verify``: every static proof fp4gen has for a compiled kernel, in one table.

Per kernel of a spec (sm100a: the forward and, when the spec has one the planner accepts, the
backward), each compiled for sm_100a on the CPU:

* ``conformance``: the compiled kernel's TMEM columns, MMA kinds, barriers and P stores are
  the plan's (``conformance.py``);
* ``descriptors``: every tcgen05.mma instruction descriptor (M, N, K, formats, majors, scale
  type, sf ids per K step), the TMEM columns its operands read per K step and its SMEM matrix
  descriptors are the plan's (``descriptors.py``, fields from the PTX ISA's tables);
* ``registers``: ptxas honours the plan's setmaxnreg budgets and spills within the plan's
  budget (``ptxas.py``);
* ``emulator``: the forward's CTA 0 executed from the compiled PTX on the CPU
  (``emulator/``: TMA, tcgen05 ld/st/cp/mma with block scales, mbarriers, every warp) over four
  KV tiles with a ragged tail, O and LSE against the reference numerics; the backward's every
  CTA of a 256 x 256 causal problem, dQ/dK/dV against the exact gradient; no warp collective
  may run with part of a warp;
* ``protocol`` (forwards): the emulated CTA's trace of barrier and async-memory events explored
  under every interleaving the ISA allows (``protocol.py``): no deadlock, no race, no barrier
  misuse, assuming in-order tensor-pipe issue (the S-column reuse FA4 also relies on; docs/sm100.md);
* ``cute-warnings``: every warning of CuTe DSL's own checker (arrive counts, TMEM loads at a
  release or dealloc) is triaged in the template beside the code it names
  (``cute_warnings.py``; one extra compile per kernel).

Only hardware can prove the rest (the block-scaled MMA with A from TMEM, P's nibble order
in TMEM, timing): docs/sm100.md lists what is proven and what is not. sm90a kernels run on
the H200 and are checked there (tests/sm90*); reference kernels have nothing to compile.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Check:
    kernel: str
    part: str  # forward | backward
    check: str  # conformance | descriptors | registers | emulator | protocol | cute-warnings | skipped
    ok: bool
    detail: str  # one line: what was found, or every mismatch
    seconds: float = 0.0


def _registers(ptx: str, roles, spill_budget: int) -> tuple[bool, str]:
    from . import ptxas

    reports = ptxas.assemble(ptx)
    bad = ptxas.check_registers(ptx, reports, budgets={r.name: r.registers for r in roles},
                                spill_budget_bytes=spill_budget)
    r, counts = reports[0], ptxas.setmaxnreg_budgets(ptx)
    found = (f"{r.registers} regs at entry, setmaxnreg {sorted(counts['inc'])} up / "
             f"{sorted(counts['dec'])} down, spills {r.spill_store_bytes} B st + "
             f"{r.spill_load_bytes} B ld (budget {spill_budget})")
    return not bad, found if not bad else "; ".join(map(str, bad))


def _descriptors(kernel: str, part: str, bad: list, ptx: str) -> Check:
    n = len(re.findall(r"^\s*tcgen05\.mma\.", ptx, re.M))  # counted, not traced again
    return Check(kernel, part, "descriptors", not bad,
                 f"{n} tcgen05.mma: descriptors, operand columns and sf ids as planned" if not bad
                 else "; ".join(map(str, bad)))


EMULATED_SHAPE = dict(seqlen_q=256, seqlen_k=448)  # one CTA (two query tiles), 3.5 KV tiles


def _emulator(kernel: str, source: str, art) -> tuple:
    """(Check, trace or None) of one emulated CTA."""
    from .emulator import run
    from .emulator.machine import EmulationError

    t = time.perf_counter()
    run.prime(source, art.ptx, art.mlir)  # the PTX verify just compiled
    try:
        res = run.emulate_forward(source, seed=0, **EMULATED_SHAPE)
    except EmulationError as e:
        return Check(kernel, "forward", "emulator", False, f"emulation stopped: {e}".splitlines()[0],
                     time.perf_counter() - t), None
    tol = run.o_tolerance(res)
    ok = res.max_abs_err <= tol and res.max_lse_err <= run.LSE_TOLERANCE
    shape = f"Sq {res.seqlen_q}, Sk {res.seqlen_k}"
    detail = (f"{shape}: O max err {res.max_abs_err:.2g} (tol {tol:.2g}), LSE {res.max_lse_err:.2g} "
              f"(tol {run.LSE_TOLERANCE:g}); {res.instructions} warp instructions")
    return Check(kernel, "forward", "emulator", ok, detail if ok else "vs reference: " + detail,
                 time.perf_counter() - t), res.trace


def _emulator_backward(kernel: str, source: str, art) -> Check:
    from .emulator import run
    from .emulator.machine import EmulationError

    t = time.perf_counter()
    run.prime(source, art.ptx, art.mlir, backward=True)
    try:
        res = run.emulate_backward(source, seqlen_q=256, seqlen_k=256, seed=0)
    except EmulationError as e:
        return Check(kernel, "backward", "emulator", False, f"emulation stopped: {e}".splitlines()[0],
                     time.perf_counter() - t)
    worst = max(res.errors.values())
    ok = worst < run.BWD_TOLERANCE and not res.notes
    errs = ", ".join(f"{k} {v:.2g}" for k, v in sorted(res.errors.items()))
    detail = (f"Sq 256, Sk 256, {res.ctas} CTAs: rel-L2 vs the exact gradient {errs} (tol "
              f"{run.BWD_TOLERANCE:g}); {res.instructions} warp instructions"
              + (f"; partial-warp collectives: {res.notes[0]}" if res.notes else ""))
    return Check(kernel, "backward", "emulator", ok, detail, time.perf_counter() - t)


def _protocol(kernel: str, trace) -> Check:
    from . import protocol

    t = time.perf_counter()
    if trace is None:
        return Check(kernel, "forward", "protocol", False, "no trace: the emulation did not finish")
    rep = protocol.check_protocol(trace, in_order_tensor_pipe=True)
    kinds = {}
    for f in rep.findings:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    head = (f"{trace.kv_tiles} KV tiles, {rep.states} states"
            f"{'' if rep.exhaustive else ' (NOT exhaustive)'}, in-order tensor pipe assumed")
    if rep.ok:
        return Check(kernel, "forward", "protocol", True, head + ": no deadlock, race or barrier misuse",
                     time.perf_counter() - t)
    first = rep.findings[0] if rep.findings else None
    found = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return Check(kernel, "forward", "protocol", False,
                 f"{head}: {found or 'search cut off'}" + (f"; first: {first.message}" if first else ""),
                 time.perf_counter() - t)


def _cute_warnings(kernel: str, part: str, source: str, backward: bool) -> Check:
    from . import cute_warnings

    t = time.perf_counter()
    found = cute_warnings.collect(source, backward=backward)
    bad = cute_warnings.untriaged(found, source)
    codes = sorted({w.code for w in found})
    detail = (f"{len(found)} warnings ({', '.join(codes) or 'none'}), each triaged beside its code" if not bad
              else "untriaged: " + "; ".join(map(str, bad)))
    return Check(kernel, part, "cute-warnings", not bad, detail, time.perf_counter() - t)


def verify_spec(spec, plan=None) -> list[Check]:
    """The checks of one kernel spec (already parsed; ``plan``, if the caller has it), in order.
    Raises PlanError for a spec the planner refuses (a user error) and RuntimeError when
    compilation itself fails."""
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.ir.plan import PlanError
    from fp4gen.ir.spec import Target

    from . import conformance as C
    from . import descriptors as D
    from . import render

    if spec.target is not Target.SM100A:
        why = ("sm90a kernels are checked by running them on the H200 (tests/sm90*)"
               if spec.target is Target.SM90A else "the reference backend compiles nothing")
        return [Check(spec.name, "forward", "skipped", True, why)]
    plan = plan if plan is not None else plan_kernel(spec)
    source = render(plan)
    out = []
    t = time.perf_counter()
    art = C.compile_artifacts(source)
    dt = time.perf_counter() - t
    bad = C.check_conformance(plan, art)
    out.append(Check(spec.name, "forward", "conformance", not bad,
                     "TMEM map, MMA kinds, barriers and P stores as planned" if not bad else C.report(bad), dt))
    out.append(_descriptors(spec.name, "forward", D.check_descriptors(plan, art.ptx), art.ptx))
    ok, detail = _registers(art.ptx, plan.pipeline.roles, plan.pipeline.spill_budget_bytes)
    out.append(Check(spec.name, "forward", "registers", ok, detail))
    emulated, trace = _emulator(spec.name, source, art)
    out.append(emulated)
    out.append(_protocol(spec.name, trace))
    out.append(_cute_warnings(spec.name, "forward", source, backward=False))
    if spec.backward is None:
        return out
    from .sm100_bwd import backward_plan

    try:
        bp = backward_plan(plan)
    except PlanError as e:
        out.append(Check(spec.name, "backward", "skipped", True, f"not generated: {e.message}"))
        return out
    t = time.perf_counter()
    art = C.compile_artifacts(source, backward=True)
    dt = time.perf_counter() - t
    bad = C.check_backward_conformance(bp, art)
    out.append(Check(spec.name, "backward", "conformance", not bad,
                     "TMEM map, MMA kinds, barriers and stores as planned" if not bad else C.report(bad), dt))
    out.append(_descriptors(spec.name, "backward", D.check_backward_descriptors(bp, art.ptx), art.ptx))
    ok, detail = _registers(art.ptx, bp.roles, bp.spill_budget_bytes)
    out.append(Check(spec.name, "backward", "registers", ok, detail))
    out.append(_emulator_backward(spec.name, source, art))
    out.append(_cute_warnings(spec.name, "backward", source, backward=True))
    return out


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]


def table(checks: list[Check]) -> str:
    rows = [("kernel", "part", "check", "result", "detail")]
    for c in checks:
        rows.append((c.kernel, c.part, c.check, "ok" if c.ok else "FAIL", c.detail.replace("\n", " | ")))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(r[i].ljust(w[i]) for i in range(4)) + "  " + r[4] for r in rows)
