"""attach_backward: the last pass, which records the backward plan of the spec's target.

It sits in its own module because it picks between the two backward planners (sm90a in
``backward.py``, sm100a in ``backward_sm100.py``), and ``backward_sm100`` imports the block
parsing of ``backward``: defined in either of them it would make the two import each other.
"""
from __future__ import annotations

from dataclasses import replace

from ..plan import KernelPlan
from ..spec import Target
from .backward import plan_backward
from .backward_sm100 import backward_plan_sm100_or_none


def attach_backward(plan: KernelPlan) -> KernelPlan:
    """Record the backward plan on plans whose spec has a backward block.

    sm90a: ``plan_backward`` (refusals raise). sm100a: ``backward_sm100.plan_backward_sm100``
    when it accepts the block; a block it refuses (e.g. FP8 gradients, NVFP4 Q/K reuse) leaves
    ``backward=None`` so the forward still plans, and ``lowering.sm100`` lists the refusal among
    the generated module's known gaps.
    """
    if plan.spec.backward is None:
        return plan
    if plan.spec.target is Target.SM100A:
        bp = backward_plan_sm100_or_none(plan)
        return plan if bp is None else replace(plan, backward=bp)
    if plan.spec.target is not Target.SM90A:
        return plan
    return replace(plan, backward=plan_backward(plan))
