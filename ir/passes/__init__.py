"""Planning passes: ``KernelSpec`` -> ``KernelPlan``.

Each pass is a plain function from one immutable value to the next::

    plan = legalize(spec)          # formats, head dim, tiles; MMA kinds
    plan = plan_decode(plan)       # a kv_cache spec: row packing, split-KV rule and combine
    plan = plan_contracts(plan)    # operand contracts (dtype, blocks, scales, who quantizes)
    plan = plan_tmem(plan)         # sm100a TMEM regions
    plan = plan_publish(plan)      # P publish timing (whole / halves)
    plan = plan_pipeline(plan)     # warp roles, registers, smem (+ Sm90Plan on sm90a)
    plan = plan_events(plan)       # per KV tile and stage: events, barriers, TMEM accesses
    plan = cost_model(plan)        # cycles per KV tile per unit, bottleneck
    plan = attach_backward(plan)   # sm90a backward plan when the spec has a backward block

``plan_kernel(spec)`` runs them in order; ``verify`` runs after every pass when
``debug=True`` or the environment variable ``FP4GEN_VERIFY=1`` is set (tests always
do), and once at the end regardless. Errors for bad specs are ``PlanError``.
"""
from __future__ import annotations

import os

from ..plan import KernelPlan, PlanError
from ..spec import KernelSpec
from .contracts import plan_contracts
from .decode import plan_decode
from .cost import cost_model
from .events import SimulationError, Simulation, plan_events, simulate
from .attach_backward import attach_backward
from .backward import plan_backward
from .legalize import legalize
from .pipeline import plan_pipeline
from .publish import plan_publish
from .tmem import plan_tmem
from .verify import verify

PASSES = (plan_decode, plan_contracts, plan_tmem, plan_publish, plan_pipeline, plan_events, cost_model, attach_backward)

__all__ = ["plan_kernel", "legalize", "plan_decode", "plan_contracts", "plan_tmem", "plan_publish", "plan_pipeline",
           "plan_events", "cost_model", "attach_backward", "plan_backward", "simulate", "verify", "PlanError", "SimulationError", "Simulation",
           "PASSES"]


def plan_kernel(spec: KernelSpec, debug: bool = False) -> KernelPlan:
    """Run every planning pass on ``spec``; raises ``PlanError`` for specs the target cannot run."""
    debug = debug or os.environ.get("FP4GEN_VERIFY", "") not in ("", "0")
    plan = legalize(spec)
    if debug:
        verify(plan)
    for p in PASSES:
        plan = p(plan)
        if debug:
            verify(plan)
    if not debug:
        verify(plan)
    return plan
