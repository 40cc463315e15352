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
* ``protocol``: each emulated CTA's trace of barrier and async-memory events (the forward's
  one CTA, every CTA of the backward's problem) explored under every interleaving the ISA
  allows (``protocol.py``): no deadlock, no race, no barrier misuse, assuming in-order
  tensor-pipe issue (the S-column reuse FA4 also relies on; docs/sm100.md). Global memory (the
  backward's dQ atomics and turn counter) is outside the model;
* ``cute-warnings``: every warning of CuTe DSL's own checker (arrive counts, TMEM loads at a
  release or dealloc) is triaged beside the code it names, in the kernel library's files
  (``cute_warnings.py``; one extra compile per kernel).

Only hardware can prove the rest (the block-scaled MMA with A from TMEM, P's nibble order
in TMEM, timing): docs/sm100.md lists what is proven and what is not.

sm90a specs get, for every kernel their module launches (compiled for sm_90a on the CPU), the
``registers`` gate (``verify_sm90``: the forward and the backward against the plan's producer /
consumer setmaxnreg budgets, the helper kernels of ``fp4gen/device`` (input quantizers, the
backward's pre/post-processing) for no setmaxnreg, no spill, no C7508) and ``cute-warnings``
(one more compile of the whole module with CuTe's checker on). The other checks read tcgen05
code and are sm100a-only (one ``skipped`` row says so); sm90a kernels run on the H200 and are
checked there (tests/sm90*). Reference kernels have nothing to compile.
"""
from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Check:
    kernel: str
    part: str  # forward | backward (sm90a also: quantizers | bwd-prep; all: a skipped row)
    check: str  # conformance | descriptors | registers | emulator | protocol | cute-warnings | skipped
    ok: bool
    detail: str  # one line: what was found, or every mismatch
    seconds: float = 0.0


def _registers(ptx: str, budgets: dict, spill_budget: int) -> tuple[bool, str]:
    """ptxas -v of one kernel with warp roles against the plan's role -> registers budgets."""
    from . import ptxas

    reports = ptxas.assemble(ptx)
    bad = ptxas.check_registers(ptx, reports, budgets=budgets, spill_budget_bytes=spill_budget)
    r, counts = reports[0], ptxas.setmaxnreg_budgets(ptx)
    found = (f"{r.registers} regs at entry, setmaxnreg {sorted(counts['inc'])} up / "
             f"{sorted(counts['dec'])} down, spills {r.spill_store_bytes} B st + "
             f"{r.spill_load_bytes} B ld (budget {spill_budget})")
    return not bad, found if not bad else "; ".join(map(str, bad))


def _roles(roles) -> dict:
    return {r.name: r.registers for r in roles}


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


def _emulator_backward(kernel: str, source: str, art) -> tuple:
    """(Check, one trace per CTA, or None) of the emulated backward."""
    from .emulator import run
    from .emulator.machine import EmulationError

    t = time.perf_counter()
    run.prime(source, art.ptx, art.mlir, backward=True)
    try:
        res = run.emulate_backward(source, seqlen_q=256, seqlen_k=256, seed=0)
    except EmulationError as e:
        return Check(kernel, "backward", "emulator", False, f"emulation stopped: {e}".splitlines()[0],
                     time.perf_counter() - t), None
    worst = max(res.errors.values())
    tol = run.backward_tolerance(res)
    ok = worst < tol and not res.notes
    errs = ", ".join(f"{k} {v:.2g}" for k, v in sorted(res.errors.items()))
    # FP8 operands: gated against the spec's own numerics, the exact gradient's distance beside
    against = "the exact gradient" if res.oracle == "exact" else "the reference backend"
    exact = ("" if res.oracle == "exact" else
             "; vs the exact gradient " + ", ".join(f"{k} {v:.2g}" for k, v in sorted(res.exact_errors.items())))
    detail = (f"Sq 256, Sk 256, {res.ctas} CTAs: rel-L2 vs {against} {errs} (tol "
              f"{tol:g}){exact}; {res.instructions} warp instructions"
              + (f"; partial-warp collectives: {res.notes[0]}" if res.notes else ""))
    return Check(kernel, "backward", "emulator", ok, detail, time.perf_counter() - t), res.traces


def _protocol(kernel: str, part: str, traces) -> Check:
    """Every emulated CTA's trace (``traces``; None: the emulation did not finish) explored by
    the protocol model check; the forward emulates one CTA, the backward every CTA of its grid
    (each CTA's own barriers: the CTAs share only global memory, which the model leaves out)."""
    from . import protocol

    t = time.perf_counter()
    if traces is None:
        return Check(kernel, part, "protocol", False, "no trace: the emulation did not finish")
    reps = [protocol.check_protocol(tr, in_order_tensor_pipe=True) for tr in traces]
    kinds = {}
    for rep in reps:
        for f in rep.findings:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
    exhaustive = all(rep.exhaustive for rep in reps)
    what = f"{traces[0].kv_tiles} KV tiles" if part == "forward" else f"{len(traces)} CTAs"
    head = (f"{what}, {sum(rep.states for rep in reps)} states"
            f"{'' if exhaustive else ' (NOT exhaustive)'}, in-order tensor pipe assumed")
    if all(rep.ok for rep in reps):
        return Check(kernel, part, "protocol", True, head + ": no deadlock, race or barrier misuse",
                     time.perf_counter() - t)
    first = next((rep.findings[0] for rep in reps if rep.findings), None)
    found = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return Check(kernel, part, "protocol", False,
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
    from . import ptxas, render

    if spec.target not in (Target.SM90A, Target.SM100A):
        return [Check(spec.name, "forward", "skipped", True, "the reference backend compiles nothing")]
    ptxas.find_ptxas()  # PtxasUnavailable before minutes of compiling, not after
    if spec.target is Target.SM90A:
        return verify_sm90(plan if plan is not None else plan_kernel(spec))
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
    ok, detail = _registers(art.ptx, _roles(plan.pipeline.roles), plan.pipeline.spill_budget_bytes)
    out.append(Check(spec.name, "forward", "registers", ok, detail))
    emulated, trace = _emulator(spec.name, source, art)
    out.append(emulated)
    out.append(_protocol(spec.name, "forward", None if trace is None else [trace]))
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
    ok, detail = _registers(art.ptx, _roles(bp.roles), bp.spill_budget_bytes)
    out.append(Check(spec.name, "backward", "registers", ok, detail))
    emulated, traces = _emulator_backward(spec.name, source, art)
    out.append(emulated)
    out.append(_protocol(spec.name, "backward", traces))
    out.append(_cute_warnings(spec.name, "backward", source, backward=True))
    return out


# ----------------------------------------------------------------------------- sm90a

# The sm90a plans state no spill allowance (neither Sm90Plan nor the backward's BackwardPlan has
# one): every kernel of an sm90a module, attention or helper, must spill nothing.
SM90_SPILL_BUDGET_BYTES = 0
# compile_only's names of the helper kernels, by the device module that defines them
SM90_HELPER_PARTS = (("fp8_quantize_", "quantizers", "quantize"), ("bwd_", "bwd-prep", "bwd_prep"))


def _sm90_part_of_name(kernel: str, name: str) -> tuple:
    """(row, helper family or None) of the kernel ``compile_only`` named ``name``."""
    if name == kernel or name.startswith(kernel + ".backward"):
        return ("forward" if name == kernel else "backward"), None
    found = [(part, fam) for prefix, part, fam in SM90_HELPER_PARTS if name.startswith(prefix)]
    if not found:
        raise RuntimeError(f"{kernel}: compile_only compiled {name!r}, a kernel verify does not know")
    return found[0]


def sm90_part(kernel: str, name: str, entry: str) -> str:
    """Which row a kernel of ``kernel``'s module belongs to: forward, backward, or the helper
    family (quantizers, bwd-prep) of ``fp4gen/device``. The name (``compile_only``'s) and the
    entry (the class that compiled it) must agree, else the kept PTX is not the kernel named."""
    part, family = _sm90_part_of_name(kernel, name)
    helper_entry = [fam for _, _, fam in SM90_HELPER_PARTS if f"device{fam}_" in entry]
    if helper_entry != ([family] if family else []):
        raise RuntimeError(f"{kernel}: the PTX kept for {name} is {entry[:80]}..., another kernel")
    return part


def _sm90_role_budgets(plan, part: str) -> dict:
    """The setmaxnreg budgets the plan gives the forward's (``plan.sm90``) or the backward's
    (``plan.backward``) producer and consumer warpgroups."""
    p = plan.sm90 if part == "forward" else plan.backward
    return {"producer": p.producer_registers, "consumer": p.consumer_registers}


def _sm90_attention(kernel: str, part: str, kept: list, budgets: dict) -> Check:
    t = time.perf_counter()
    found = [(k.name.removeprefix(kernel + "."), *_registers(k.ptx, budgets, SM90_SPILL_BUDGET_BYTES))
             for k in kept]
    ok = all(good for _, good, _ in found)
    details = {d for _, _, d in found}
    if ok and len(details) == 1:  # one kernel, or variants (the backward's GQA one) that agree
        detail = details.pop() if len(found) == 1 else f"{', '.join(n for n, _, _ in found)}: {details.pop()}"
    else:  # each kernel's report, or only the failing ones' mismatches
        detail = "; ".join(f"{n}: {d}" for n, good, d in found if ok or not good)
    return Check(kernel, part, "registers", ok, detail, time.perf_counter() - t)


def _sm90_helpers(kernel: str, part: str, kept: list) -> Check:
    from . import ptxas

    t = time.perf_counter()
    regs, spilled, bad = [], 0, []
    for k in kept:
        reports = ptxas.assemble(k.ptx)
        regs += [r.registers for r in reports]
        spilled += sum(r.spills for r in reports)
        bad += [f"{k.name}: {m}" for m in ptxas.check_helper(k.ptx, reports,
                                                              spill_budget_bytes=SM90_SPILL_BUDGET_BYTES)]
    detail = (f"{len(kept)} kernels, {min(regs)}-{max(regs)} regs, no setmaxnreg, no C7508, spills {spilled} B "
              f"(budget {SM90_SPILL_BUDGET_BYTES} per kernel)" if not bad else "; ".join(bad))
    return Check(kernel, part, "registers", not bad, detail, time.perf_counter() - t)


def _sm90_cute_warnings(kernel: str, source: str) -> list[Check]:
    """One ``cute-warnings`` row per part: every warning CuTe's checker raises on the part's
    kernels is triaged beside the code it names (one compile of every kernel of the module)."""
    from . import cute_warnings

    t = time.perf_counter()
    compiled = cute_warnings.collect_module(source, "sm_90a")
    seconds = time.perf_counter() - t
    parts: dict = {}
    for name, found in compiled:
        parts.setdefault(_sm90_part_of_name(kernel, name)[0], []).append(found)
    out = []
    for part, per_kernel in parts.items():
        found = [w for ws in per_kernel for w in ws]
        bad = cute_warnings.untriaged(found, source)
        codes = sorted({w.code for w in found})
        if bad:
            detail = "untriaged: " + "; ".join(map(str, bad))
        else:
            detail = (f"{len(per_kernel)} kernels, {len(found)} warnings ({', '.join(codes) or 'none'})"
                      + (", each triaged beside its code" if found else ""))
        out.append(Check(kernel, part, "cute-warnings", not bad, detail, seconds if not out else 0.0))
    return out


def verify_sm90(plan) -> list[Check]:
    """For every kernel an sm90a module launches, compiled for sm_90a on the CPU: the register
    and spill gate (the forward and backward against the plan's producer / consumer setmaxnreg
    budgets, the helper kernels (input quantizers, backward pre/post-processing) for no
    setmaxnreg, no spill and no C7508) and CuTe's checker warnings; per part its ``registers``
    row, then its ``cute-warnings`` row."""
    from . import ptxas, render

    name = plan.spec.name
    source = render(plan)
    t = time.perf_counter()
    kept = ptxas.compile_kept(source, "sm_90a")
    compile_s = time.perf_counter() - t
    parts: dict = {}
    for k in kept:
        parts.setdefault(sm90_part(name, k.name, k.entry), []).append(k)
    if "forward" not in parts or (plan.backward is not None) != ("backward" in parts):
        raise RuntimeError(f"{name}: compile_only compiled {', '.join(k.name for k in kept)}; expected the forward"
                           + (" and the backward" if plan.backward is not None else ""))
    out = []
    for part in ("forward", "backward", "quantizers", "bwd-prep"):
        if part not in parts:
            continue
        if part == "forward" and getattr(plan, "decode", None) is not None:
            # the split-KV decode kernel has no warp specialisation and no setmaxnreg: the
            # helper kernels' gate (no setmaxnreg, no C7508, spills within budget) is its gate
            out.append(_sm90_helpers(name, part, parts[part]))
        elif part in ("forward", "backward"):
            out.append(_sm90_attention(name, part, parts[part], _sm90_role_budgets(plan, part)))
        else:
            out.append(_sm90_helpers(name, part, parts[part]))
    out[0] = replace(out[0], seconds=out[0].seconds + compile_s)  # the one compile of every kernel
    warned = {c.part: c for c in _sm90_cute_warnings(name, source)}
    if set(warned) != {c.part for c in out}:
        raise RuntimeError(f"{name}: the checker's compile covered parts {sorted(warned)}, the register gate's "
                           f"{sorted(c.part for c in out)}")
    out = [row for c in out for row in (c, warned[c.part])]
    out.append(Check(name, "all", "skipped", True,
                     "conformance, descriptors, emulator and protocol are sm100a-only; "
                     "sm90a kernels run on the H200 (tests/sm90*)"))
    return out


def as_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]


def table(checks: list[Check]) -> str:
    rows = [("kernel", "part", "check", "result", "detail")]
    for c in checks:
        rows.append((c.kernel, c.part, c.check, "ok" if c.ok else "FAIL", c.detail.replace("\n", " | ")))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(r[i].ljust(w[i]) for i in range(4)) + "  " + r[4] for r in rows)
