"""to_json(plan) -> dict: the plan in the ``fp4gen.plan/1`` schema (docs/plan.md).

The JSON form itself is ``fp4gen.ir.serialize.plan_to_dict`` (the one serializer of spec and
plan JSON); this adds the ``simulation`` section, which needs the planner's event simulator.
"""
from __future__ import annotations

from typing import Any

from ..plan import KernelPlan
from ..serialize import PLAN_SCHEMA as SCHEMA_VERSION, event_id, plan_to_dict

__all__ = ["SCHEMA_VERSION", "SIM_TILES", "event_id", "to_json"]

SIM_TILES = 3


def to_json(plan: KernelPlan) -> dict[str, Any]:
    """The whole plan as plain JSON types; ``json.dumps(to_json(plan))`` always works."""
    sim = None
    if plan.events:
        from ..passes.events import simulate

        sim = {"tiles": SIM_TILES, "makespan_cycles": round(float(simulate(plan, SIM_TILES).makespan), 1)}
    return plan_to_dict(plan, simulation=sim)
