"""verify(plan): the invariants every (partial) plan must satisfy. Raises PlanError.

* TMEM (sm100a): every region inside 0..511 and inside the allocation; the allocation
  a power of two >= 32; regions that share columns must be declared aliases (one
  inside the other, ``alias_of``), never siblings; whether aliases are live at
  different times is proven by the event simulation (TMEM hazards).
* SMEM and registers within the per-SM limits.
* Events (when planned): simulate a few KV tiles without deadlock or TMEM hazard.

Sections not yet planned are skipped, so tests can call verify after every pass.
"""
from __future__ import annotations

from ..plan import TMEM_COLUMNS, KernelPlan, PlanError
from ..spec import Target


def _loc(plan: KernelPlan, region):
    if region is not None and region.explicit:
        return plan.spec.loc(f"schedule.tmem.{region.name}") or plan.spec.loc("schedule.tmem")
    return None


def check_tmem(plan: KernelPlan) -> None:
    tm = plan.tmem
    if tm is None:
        return
    a = tm.alloc_columns
    if a < 32 or a & (a - 1) or a > TMEM_COLUMNS:
        raise PlanError(f"TMEM allocation of {a} columns is not a power of two in 32..{TMEM_COLUMNS}")
    byname = {r.name: r for r in tm.regions}
    if len(byname) != len(tm.regions):
        raise PlanError("TMEM plan names a region twice")
    for r in tm.regions:
        if r.first_col < 0 or r.last_col >= min(a, TMEM_COLUMNS) or r.first_col > r.last_col:
            raise PlanError(f"TMEM region {r.name} cols {r.first_col}..{r.last_col} is outside the "
                            f"{a}-column allocation", _loc(plan, r))
        if not (0 <= r.first_lane <= r.last_lane < 128):
            raise PlanError(f"TMEM region {r.name} lanes {r.first_lane}..{r.last_lane} outside 0..127", _loc(plan, r))
        if r.alias_of is not None:
            p = byname.get(r.alias_of)
            if p is None or not (p.first_col <= r.first_col and r.last_col <= p.last_col):
                raise PlanError(f"TMEM region {r.name} is declared inside {r.alias_of} but is not", _loc(plan, r))
    regs = list(tm.regions)
    for i, x in enumerate(regs):
        for y in regs[i + 1:]:
            if not x.overlaps(y):
                continue
            if x.alias_of == y.name or y.alias_of == x.name:
                continue  # declared reuse of the parent's columns; lifetimes checked by simulate()
            culprit = y if y.explicit else x
            raise PlanError(
                f"TMEM regions {x.name} (cols {x.first_col}..{x.last_col}) and {y.name} "
                f"(cols {y.first_col}..{y.last_col}) overlap and are both live",
                _loc(plan, culprit),
                [f"{x.name}: {x.purpose}, live {x.live.opens} .. {x.live.closes}",
                 f"{y.name}: {y.purpose}, live {y.live.opens} .. {y.live.closes}",
                 "only a region placed inside its own stage's S may reuse columns"])


def check_budgets(plan: KernelPlan) -> None:
    pp = plan.pipeline
    if pp is None:
        return
    if pp.smem_bytes != sum(i.bytes for i in pp.smem):
        raise PlanError("shared memory total does not match its items")
    if pp.smem_bytes > pp.smem_limit:
        raise PlanError(f"shared memory plan needs {pp.smem_bytes} bytes but a CTA may use {pp.smem_limit}")
    regs = sum(r.threads * r.registers for r in pp.roles)
    if regs != pp.registers_total or regs > pp.registers_limit:
        raise PlanError(f"register plan needs {regs} registers; limit {pp.registers_limit}")
    for r in pp.roles:
        if r.registers % 8 or not (24 <= r.registers <= 256):
            raise PlanError(f"role {r.name}: setmaxnreg takes a multiple of 8 in 24..256, not {r.registers}")
    if plan.sm90 is not None:
        s9 = plan.sm90
        if s9.tile_m != s9.consumer_warpgroups * 64 or s9.smem_bytes != pp.smem_bytes:
            raise PlanError("Sm90Plan disagrees with the pipeline plan")
        if plan.spec.target is not Target.SM90A:
            raise PlanError("an Sm90Plan on a non-sm90a target")
    if plan.spec.target is Target.SM100A and plan.tmem is None:
        raise PlanError("an sm100a pipeline without a TMEM plan")


def verify(plan: KernelPlan, tiles: int = 3) -> KernelPlan:
    """Check every planned section; returns the plan unchanged so passes can be chained."""
    if plan.spec.target is not Target.SM100A and plan.tmem is not None:
        raise PlanError(f"{plan.spec.target.value} has no tensor memory, but the plan has a TMEM section")
    check_tmem(plan)
    check_budgets(plan)
    if plan.events:
        from .events import simulate
        simulate(plan, tiles)
    return plan
