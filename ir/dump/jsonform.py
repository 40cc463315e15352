"""to_json(plan) -> dict: the plan in a stable, versioned JSON form (see docs/plan.md)."""
from __future__ import annotations

import dataclasses

from typing import Any, Optional

from ..plan import KernelPlan

SCHEMA_VERSION = "fp4gen.plan/1"
SIM_TILES = 3


def _r(x: float) -> float:
    return round(float(x), 1)


def _tile(dj: int) -> str:
    return "j" if dj == 0 else f"j{dj:+d}"


def event_id(e) -> str:
    return e.name if e.stage is None else f"{e.name}[{e.stage}]"


def _spec(plan: KernelPlan) -> dict:
    s = plan.spec
    sch = s.schedule
    out = {
        "head_dim": s.head_dim, "mask": s.mask.value, "softmax_scale": s.scale,
        "formats": {k: str(s.operand(k)) for k in ("Q", "K", "P", "V", "O")},
        "p_production": {"kind": s.p_production.kind.value, "policy": s.p_production.policy.value,
                         "a": s.p_production.a, "b": s.p_production.b},
        "guard": {"kind": s.guard.kind.value, "m": s.guard.m, "l": s.guard.l},
        "schedule": {"tile_m": sch.tile_m, "tile_n": sch.tile_n, "q_stages": sch.q_stages,
                     "kv_stages": sch.kv_stages, "p_publish": sch.p_publish.value,
                     "tmem": "auto" if sch.tmem_regions is None else
                     [{"name": r.name, "first_col": r.first_col, "last_col": r.last_col} for r in sch.tmem_regions]},
        "backward": None if s.backward is None else {
            "reuse": sorted(s.backward.reuse),
            "formats": {g: str(s.backward.format_of(g)) for g in ("dO", "dS", "dP", "dQ", "dK", "dV")},
            "deterministic": s.backward.deterministic},
    }
    return out


def _tmem(plan: KernelPlan) -> Optional[dict]:
    tm = plan.tmem
    if tm is None:
        return None
    inside = {r.name: [x.name for x in tm.regions if x.alias_of == r.name] for r in tm.regions}
    return {
        "total_columns": tm.total_columns, "alloc_columns": tm.alloc_columns,
        "limit_columns": tm.limit_columns, "lanes": 128,
        "regions": [{
            "name": r.name, "first_col": r.first_col, "last_col": r.last_col, "columns": r.columns,
            "lanes": [r.first_lane, r.last_lane], "dtype": r.dtype, "purpose": r.purpose, "stage": r.stage,
            "alias_of": r.alias_of, "aliases": inside[r.name],
            "live": {"opens": r.live.opens, "closes": r.live.closes, "loop": r.live.loop},
            "explicit": r.explicit,
        } for r in tm.regions],
        "notes": list(tm.notes),
    }


def _events(plan: KernelPlan) -> Optional[dict]:
    if not plan.events:
        return None

    def one(e) -> dict:
        return {"id": event_id(e), "name": e.name, "role": e.role, "stage": e.stage, "tile": _tile(e.dj),
                "waits": [{"barrier": w.barrier, "tile": _tile(e.dj + w.dj)} for w in e.waits],
                "signals": list(e.signals),
                "reads": [{"region": a.region, "part": a.part} for a in e.reads],
                "writes": [{"region": a.region, "part": a.part} for a in e.writes],
                "unit": e.resource, "last_tile_only": e.last_tile_only, "what": e.what}

    stages: dict[str, list] = {}
    for e in plan.events:
        key = "shared" if e.stage is None else str(e.stage)
        stages.setdefault(key, []).append(one(e))
    barriers: dict[str, dict] = {}
    for e in plan.events:
        for b in e.signals:
            barriers.setdefault(b, {"signalled_by": [], "waited_by": []})["signalled_by"].append(event_id(e))
        for w in e.waits:
            barriers.setdefault(w.barrier, {"signalled_by": [], "waited_by": []})["waited_by"].append(event_id(e))
    return {"tile_note": "tile j is the KV tile of the loop iteration; j-1 the previous one",
            "by_stage": stages, "barriers": dict(sorted(barriers.items()))}


def _plain(x):
    """Tuples -> lists, recursively, so the backward section is plain JSON."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def to_json(plan: KernelPlan) -> dict[str, Any]:
    """The whole plan as plain JSON types; ``json.dumps(to_json(plan))`` always works."""
    s = plan.spec
    pp = plan.pipeline
    out: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "kernel": s.name, "target": s.target.value, "source_file": s.source_file,
        "spec": _spec(plan),
        "mma": [{"name": m.name, "a": m.a, "b": m.b, "kind": m.kind, "block_scaled": m.block_scaled,
                 "sf_block": m.sf_block, "sf_dtype": m.sf_dtype, "a_source": m.a_source, "b_source": m.b_source,
                 "a_major": m.a_major, "b_major": m.b_major, "flops_per_clk_sm": m.flops_per_clk_sm}
                for m in plan.mma],
        "contracts": [{"operand": c.operand, "payload": c.payload, "bits": c.bits, "block": c.block,
                       "scale_dtype": c.scale_dtype, "granularity": c.granularity, "scale_layout": c.scale_layout,
                       "major": c.major, "storage": c.storage, "quantized_by": c.quantized_by,
                       "notes": list(c.notes)} for c in plan.contracts],
        "tmem": _tmem(plan),
        "publish": None if plan.publish is None else {
            "mode": plan.publish.mode, "s_free_after": plan.publish.s_free_after, "notes": list(plan.publish.notes),
            "parts": [{"index": p.index, "keys": list(p.keys),
                       "p_columns": list(p.p_columns) if p.p_columns else None, "with_scales": p.with_scales,
                       "barrier": p.barrier, "unblocks": p.unblocks} for p in plan.publish.parts]},
        "pipeline": None if pp is None else {
            "tile_m": pp.tile_m, "tile_n": pp.tile_n, "q_stages": pp.q_stages, "kv_stages": pp.kv_stages,
            "roles": [{"name": r.name, "warps": r.warps, "threads": r.threads, "registers": r.registers,
                       "does": r.does} for r in pp.roles],
            "smem": {"items": [{"name": i.name, "bytes": i.bytes, "detail": i.detail} for i in pp.smem],
                     "total_bytes": pp.smem_bytes, "limit_bytes": pp.smem_limit},
            "registers": {"total": pp.registers_total, "limit": pp.registers_limit},
            "spills": {"budget_bytes": pp.spill_budget_bytes, "reason": pp.spill_reason},
            "mma_order": pp.mma_order, "notes": list(pp.notes)},
        "sm90": None if plan.sm90 is None else {k: getattr(plan.sm90, k) for k in plan.sm90.__dataclass_fields__},
        "events": _events(plan),
        "cost": None if plan.cost is None else {
            "unit": "cycles per KV tile per SM",
            "chosen": plan.cost.chosen,
            "paths": [{"path": p.path, "bottleneck": p.bottleneck, "cycles_per_tile": _r(p.cycles_per_tile),
                       "serial_cycles": _r(p.serial_cycles),
                       "units": [{"unit": u.unit, "cycles": _r(u.cycles), "detail": u.detail} for u in p.units]}
                      for p in plan.cost.paths],
            "event_cycles": {k: _r(v) for k, v in plan.cost.event_cycles},
            "assumptions": list(plan.cost.assumptions)},
        "simulation": None,
        "notes": list(plan.notes),
        "backward": None if plan.backward is None else _plain(dataclasses.asdict(plan.backward)),
    }
    if plan.events:
        from ..passes.events import simulate
        sim = simulate(plan, SIM_TILES)
        out["simulation"] = {"tiles": SIM_TILES, "makespan_cycles": _r(sim.makespan)}
    return out
