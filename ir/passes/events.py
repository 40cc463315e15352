"""plan_events and simulate: the KV-loop as events, barriers and TMEM accesses.

``plan_events`` writes one loop body per warp role (``KernelPlan.events``, in role
program order). ``simulate(plan, tiles)`` unrolls it for a few KV tiles, runs the
dependency graph (each role in program order, each event starting when its barriers
have arrived, its role is free and its shared unit is free) and checks:

* deadlock: some event can never start (its barrier is never signalled);
* TMEM hazards: every two accesses to overlapping columns, at least one a write,
  must happen in the order of the sequential program (tile by tile, stage by stage,
  step by step). A write that overtakes a read of older data is a write-after-read
  (e.g. QK^T of tile j+1 writing S while P of tile j still lives there and PV has not
  consumed it); a read that overtakes the write it needs is a read-after-write.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..plan import Access, BarrierRef, Event, KernelPlan, PlanError
from ..spec import Target

# Canonical step order within one (tile, stage): the sequential program the kernel must equal.
STEP_ORDER = ("LOAD_K", "LOAD_V", "CP_SF_QK", "QK", "LOAD_S", "ROWMAX", "SOFTMAX", "PUBLISH_P1", "PUBLISH_P2", "PUBLISH_P",
              "RESCALE_O", "CP_SFV", "PV_1", "PV_2", "PV", "EPILOGUE")


def _sm100_events(plan: KernelPlan) -> tuple[Event, ...]:
    spec = plan.spec
    q = spec.schedule.q_stages
    kv = plan.pipeline.kv_stages
    halves = plan.publish.mode == "halves"
    qk_sf = plan.mma_choice("QK").block_scaled
    pv_sf = plan.mma_choice("PV").block_scaled
    # p_source smem: P is an SMEM tile, not a TMEM region; its accesses are not TMEM accesses
    p_tmem = plan.mma_choice("PV").a_source == "tmem"

    def p_acc(s: int, part: int = 0) -> tuple:
        return (Access(f"P{s}", part),) if p_tmem else ()

    last = q - 1
    ev: list[Event] = [
        Event("LOAD_K", "load", None, (BarrierRef("K_empty", -kv),), ("K_full",), cost="load_k",
              what="TMA K tile (+ its scale factors) into the smem ring"),
        Event("LOAD_V", "load", None, (BarrierRef("V_empty", -kv),), ("V_full",), cost="load_v",
              what="TMA V tile (+ its scale factors) into the smem ring"),
    ]
    # MMA warp: for each stage, PV of the previous tile, then QK^T of this tile (FA4 order).
    for s in range(q):
        o = 1 - s
        if pv_sf:
            ev.append(Event("CP_SFV", "mma", s, (BarrierRef("V_full"), BarrierRef(f"S_drained[{s}]")), (),
                            writes=(Access(f"SFV{s}"),), dj=-1, cost="cp_sf",
                            what=f"tcgen05.cp V's scales into S{s}'s drained columns"))
        pv_reads = (Access(f"SFP{s}"), Access(f"SFV{s}")) if pv_sf else ()
        if halves:
            ev.append(Event("PV_1", "mma", s, (BarrierRef(f"P_half1[{s}]"), BarrierRef(f"O_rescaled[{s}]"),
                                               BarrierRef("V_full")), (),
                            reads=p_acc(s, 1) + (Access(f"O{s}"),) + pv_reads, writes=(Access(f"O{s}"),),
                            dj=-1, cost="pv_half", what="PV on the first half of the keys"))
            ev.append(Event("PV_2", "mma", s, (BarrierRef(f"P_full[{s}]"),),
                            (f"O_done[{s}]", f"S_free[{s}]") + (("V_empty",) if s == last else ()),
                            reads=p_acc(s, 2) + (Access(f"O{s}"),) + pv_reads, writes=(Access(f"O{s}"),),
                            dj=-1, cost="pv_half", what="PV on the second half; commit frees S and V"))
        else:
            ev.append(Event("PV", "mma", s, (BarrierRef(f"P_full[{s}]"), BarrierRef(f"O_rescaled[{s}]"),
                                             BarrierRef("V_full")),
                            (f"O_done[{s}]", f"S_free[{s}]") + (("V_empty",) if s == last else ()),
                            reads=p_acc(s) + (Access(f"O{s}"),) + pv_reads, writes=(Access(f"O{s}"),),
                            dj=-1, cost="pv", what="PV on the whole P; commit frees S and V"))
        if qk_sf:
            waits = [BarrierRef("K_full")]
            if q == 2:
                # stage 0's scales go into S1, which still holds tile j-1 until softmax1 drained it;
                # stage 1's go into S0, which QK_0(j) has just written.
                waits.append(BarrierRef(f"S_drained[{o}]", -1 if s == 0 else 0))
            ev.append(Event("CP_SF_QK", "mma", s, tuple(waits), (),
                            writes=(Access(f"SFQ{s}"), Access(f"SFK{s}")), cost="cp_sf",
                            what="tcgen05.cp Q's and K's scales for this QK^T" +
                                 (f" into S{o}'s drained columns" if q == 2 else "")))
        ev.append(Event("QK", "mma", s, (BarrierRef("K_full"), BarrierRef(f"S_free[{s}]", -1)),
                        (f"S_full[{s}]",) + (("K_empty",) if s == last else ()),
                        reads=((Access(f"SFQ{s}"), Access(f"SFK{s}")) if qk_sf else ()),
                        writes=(Access(f"S{s}"),), cost="qk", what=f"S{s} = Q{s} K^T"))
    for s in range(q):
        r = f"softmax{s}"
        ev.append(Event("LOAD_S", r, s, (BarrierRef(f"S_full[{s}]"),), (f"S_drained[{s}]",), reads=(Access(f"S{s}"),),
                        cost="load_s", what=f"tcgen05.ld all scores of S{s} into registers"))
        ev.append(Event("ROWMAX", r, s, (), (f"rowmax[{s}]",), cost="rowmax", resource="cuda_cores",
                        what="row max; hands the rescale factor to the correction warps"))
        ev.append(Event("SOFTMAX", r, s, (), (), cost="softmax", resource="cuda_cores",
                        what=("Direct-P codes + block exponents" if spec.p_production.kind.value == "direct_p"
                              else "exp2 + convert") + ", row sum"))
        psf = (Access(f"SFP{s}"),) if pv_sf else ()
        if halves:
            ev.append(Event("PUBLISH_P1", r, s, (), (f"P_half1[{s}]",), writes=p_acc(s, 1) + psf,
                            cost="publish_half", what="tcgen05.st P keys of the first half (+ all block scales), fence"))
            ev.append(Event("PUBLISH_P2", r, s, (), (f"P_full[{s}]",), writes=p_acc(s, 2),
                            cost="publish_half", what="tcgen05.st P keys of the second half, fence"))
        else:
            ev.append(Event("PUBLISH_P", r, s, (), (f"P_full[{s}]",), writes=p_acc(s) + psf,
                            cost="publish", what="tcgen05.st all of P (+ block scales), fence"))
    for s in range(q):
        ev.append(Event("RESCALE_O", "correction", s, (BarrierRef(f"rowmax[{s}]"), BarrierRef(f"O_done[{s}]", -1)),
                        (f"O_rescaled[{s}]",), reads=(Access(f"O{s}"),), writes=(Access(f"O{s}"),), cost="rescale",
                        what=f"O{s} *= exp2(m_old - m_new) when the row max moved"))
    for s in range(q):
        ev.append(Event("EPILOGUE", "correction", s, (BarrierRef(f"O_done[{s}]"),), (), reads=(Access(f"O{s}"),),
                        cost="epilogue", last_tile_only=True, what=f"O{s} / l -> smem -> TMA store"))
    return tuple(ev)


def _sm90_events(plan: KernelPlan) -> tuple[Event, ...]:
    wgs = plan.sm90.consumer_warpgroups
    kv = plan.pipeline.kv_stages
    last = wgs - 1
    ev: list[Event] = [
        Event("LOAD_K", "producer", None, (BarrierRef("K_empty", -kv),), ("K_full",), cost="load_k",
              what="TMA K tile into the smem ring"),
        Event("LOAD_V", "producer", None, (BarrierRef("V_empty", -kv),), ("V_full",), cost="load_v",
              what="TMA V tile into the smem ring" + (" (stored D x S)" if plan.sm90.v_transposed else "")),
    ]
    for w in range(wgs):
        # the wgmma stream of consumer w is asynchronous to its softmax: a separate role sharing the tensor core
        ev.append(Event("QK", f"wgmma{w}", w, (BarrierRef("K_full"),), (f"S_full[{w}]",) + (("K_empty",) if w == last else ()),
                        cost="qk", resource="tensor", what="wgmma S = Q K^T (registers)"))
        ev.append(Event("PV", f"wgmma{w}", w, (BarrierRef(f"P_full[{w}]"), BarrierRef(f"O_rescaled[{w}]"),
                                               BarrierRef("V_full")),
                        (f"O_done[{w}]",) + (("V_empty",) if w == last else ()), dj=-1, cost="pv", resource="tensor",
                        what="wgmma O += P V (P from registers)"))
    for w in range(wgs):
        r = f"consumer{w}"
        ev.append(Event("ROWMAX", r, w, (BarrierRef(f"S_full[{w}]"),), (), cost="rowmax", resource="cuda_cores",
                        what="wgmma.wait for S; row max"))
        ev.append(Event("SOFTMAX", r, w, (), (f"P_full[{w}]",), cost="softmax", resource="cuda_cores",
                        what=("Direct-P codes" if plan.spec.p_production.kind.value == "direct_p" else "exp2 + convert")
                        + ", row sum, P to the A-fragment layout"))
        ev.append(Event("RESCALE_O", r, w, (BarrierRef(f"O_done[{w}]", -1),), (f"O_rescaled[{w}]",), cost="rescale",
                        what="wait PV(j-1), rescale O in registers"))
        ev.append(Event("EPILOGUE", r, w, (BarrierRef(f"O_done[{w}]"),), (), cost="epilogue", last_tile_only=True,
                        what="O / l -> smem -> TMA store"))
    return tuple(ev)


def plan_events(plan: KernelPlan) -> KernelPlan:
    t = plan.spec.target
    if t is Target.SM100A:
        return replace(plan, events=_sm100_events(plan))
    if t is Target.SM90A:
        return replace(plan, events=_sm90_events(plan))
    return plan


def roles_in_order(events) -> list[str]:
    seen: list[str] = []
    for e in events:
        if e.role not in seen:
            seen.append(e.role)
    return seen


# ----------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Span:
    """One executed event instance."""

    event: Event
    tile: int
    start: float
    end: float

    @property
    def label(self) -> str:
        st = "" if self.event.stage is None else f"[{self.event.stage}]"
        return f"{self.event.name}{st}(j={self.tile})"


@dataclass(frozen=True)
class Simulation:
    spans: tuple[Span, ...]
    tiles: int
    makespan: float

    def of(self, name: str, stage: Optional[int] = None, tile: Optional[int] = None) -> list[Span]:
        return [s for s in self.spans if s.event.name == name and (stage is None or s.event.stage == stage)
                and (tile is None or s.tile == tile)]


class SimulationError(PlanError):
    """A deadlock or TMEM hazard found by ``simulate``."""


def _program(events, role: str, tiles: int) -> list[tuple[Event, int]]:
    body = [e for e in events if e.role == role]
    lag = max([-e.dj for e in body] + [0])
    out = []
    for j in range(tiles + lag):
        for e in body:
            t = j + e.dj
            if 0 <= t < tiles and (not e.last_tile_only or t == tiles - 1):
                out.append((e, t))
    return out


def _duration(plan: KernelPlan, e: Event) -> float:
    if plan.cost is not None:
        d = dict(plan.cost.event_cycles).get(e.cost)
        if d is not None:
            return max(float(d), 1.0)
    return 10.0


def _columns(plan: KernelPlan, a: Access) -> tuple[int, int]:
    r = plan.tmem.region(a.region)
    if a.part == 0:
        return r.first_col, r.last_col
    half = r.columns // 2
    return (r.first_col, r.first_col + half - 1) if a.part == 1 else (r.first_col + half, r.last_col)


def simulate(plan: KernelPlan, tiles: int = 3) -> Simulation:
    """Run the event graph for ``tiles`` KV tiles; raise ``SimulationError`` on deadlock or hazard."""
    events = plan.events
    if not events:
        return Simulation((), tiles, 0.0)
    roles = roles_in_order(events)
    progs = {r: _program(events, r, tiles) for r in roles}
    pos = {r: 0 for r in roles}
    free = {r: 0.0 for r in roles}
    unit_free: dict[str, float] = {}
    arrived: dict[tuple[str, int], float] = {}
    spans: list[Span] = []
    signalled_by: dict[tuple[str, int], str] = {}

    def ready_time(e: Event, t: int) -> Optional[float]:
        at = 0.0
        for w in e.waits:
            k = (w.barrier, t + w.dj)
            if k[1] < 0:
                continue  # barriers start in the free/empty phase
            if k not in arrived:
                return None
            at = max(at, arrived[k])
        return at

    while True:
        # start the ready event with the earliest start time (ties: role order)
        best = None
        for r in roles:
            if pos[r] >= len(progs[r]):
                continue
            e, t = progs[r][pos[r]]
            rt = ready_time(e, t)
            if rt is None:
                continue
            start = max(rt, free[r], unit_free.get(e.resource, 0.0) if e.resource else 0.0)
            if best is None or start < best[0]:
                best = (start, r, e, t)
        if best is None:
            break
        start, r, e, t = best
        end = start + _duration(plan, e)
        free[r] = end
        if e.resource:
            unit_free[e.resource] = end
        pos[r] += 1
        span = Span(e, t, start, end)
        spans.append(span)
        for b in e.signals:
            k = (b, t)
            if k in arrived:
                raise SimulationError(f"barrier {b} of tile {t} is signalled twice ({signalled_by[k]} and {span.label})")
            arrived[k] = end
            signalled_by[k] = span.label
    stuck = [(r, *progs[r][pos[r]]) for r in roles if pos[r] < len(progs[r])]
    if stuck:
        lines = []
        for r, e, t in stuck:
            missing = [f"{w.barrier}(j={t + w.dj})" for w in e.waits if t + w.dj >= 0 and (w.barrier, t + w.dj) not in arrived]
            st = "" if e.stage is None else f"[{e.stage}]"
            lines.append(f"{r}: {e.name}{st}(j={t}) waits on {', '.join(missing) or 'nothing (role blocked)'}")
        raise SimulationError("event schedule deadlocks: no role can make progress", None, lines)
    if plan.tmem is not None:
        _check_hazards(plan, spans)
    return Simulation(tuple(spans), tiles, max(s.end for s in spans))


def _order_key(s: Span) -> tuple:
    stage = -1 if s.event.stage is None else s.event.stage
    return (s.tile, stage, STEP_ORDER.index(s.event.name))


def _check_hazards(plan: KernelPlan, spans: list[Span]) -> None:
    acc = []  # (key, span, lo, hi, is_write, region)
    for s in spans:
        for a in s.event.reads:
            lo, hi = _columns(plan, a)
            acc.append((_order_key(s), s, lo, hi, False, a.region))
        for a in s.event.writes:
            lo, hi = _columns(plan, a)
            acc.append((_order_key(s), s, lo, hi, True, a.region))
    acc.sort(key=lambda x: x[0])
    found = []
    for i, (ka, sa, la, ha, wa, ra) in enumerate(acc):
        for kb, sb, lb, hb, wb, rb in acc[i + 1:]:
            if sa is sb or not (wa or wb) or ha < lb or hb < la or ka == kb:
                continue
            if sa.end > sb.start + 1e-9:
                kind = "write-after-read" if (not wa and wb) else "read-after-write" if (wa and not wb) else "write-after-write"
                found.append((sb.start, f"TMEM {kind} hazard on columns {max(la, lb)}..{min(ha, hb)}: {sb.label} "
                                        f"{'writes' if wb else 'reads'} {rb} at cycle {sb.start:.0f} while {sa.label} "
                                        f"{'writes' if wa else 'reads'} {ra} until cycle {sa.end:.0f}",
                              f"{sb.label} must wait for {sa.label} (a barrier it signals, or the in-order tensor pipe)"))
    if found:
        found.sort(key=lambda f: f[0])
        first = found[0]
        more = [f[1] for f in found[1:6]]
        extra = [f"{len(found) - 6} more" for _ in [0] if len(found) > 6]
        raise SimulationError(first[1], None, [first[2]] + more + extra)
