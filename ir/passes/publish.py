"""plan_publish: when the softmax warps hand P to the PV MMA, in one piece or two.

halves (the paper's choice): part 1 covers the first tile_n/2 keys. The MMA warp
starts PV on those keys (one K=64 step of the fp4 MMA per 64 keys) as soon as part 1
is written and fenced; part 2 unblocks the rest of PV. The score columns of the
stage become free for the next QK^T only after PV has consumed both halves: this
is the TMEM ownership dependency that limits overlap, not tensor-core speed.
"""
from __future__ import annotations

from dataclasses import replace

from ..plan import KernelPlan, PublishPart, PublishPlan
from ..spec import PPublish, Target


def plan_publish(plan: KernelPlan) -> KernelPlan:
    spec = plan.spec
    if spec.target is Target.REFERENCE:
        return plan
    n = spec.schedule.tile_n
    bits = spec.p.format.bits
    sm100 = spec.target is Target.SM100A
    scaled = sm100 and plan.mma_choice("PV").block_scaled
    p_cols = n * bits // 32
    notes = []
    p_tmem = sm100 and plan.mma_choice("PV").a_source == "tmem"
    if p_tmem:
        notes.append("fence the tcgen05.st of P (fence_view_async_tmem_store) before arriving on the barrier")
    elif sm100:
        # p_source smem: generic-proxy st.shared read by the async proxy (PTX ISA 9.7.13.4, fence.proxy)
        notes.append("p_source smem: P's codes go to SMEM by st.shared; fence.proxy.async.shared::cta before "
                     "arriving on the barrier, so that the MMA (async proxy) sees them")
    if spec.schedule.p_publish is PPublish.HALVES and sm100:
        h = n // 2
        parts = (
            PublishPart(1, (0, h - 1), (0, p_cols // 2 - 1) if p_tmem else None, scaled, "P_half1",
                        f"PV MMA on keys 0..{h - 1} (its first K steps)"),
            PublishPart(2, (h, n - 1), (p_cols // 2, p_cols - 1) if p_tmem else None, False, "P_full",
                        f"PV MMA on keys {h}..{n - 1}; after it the stage's S is free"),
        )
        s_free = "PV has consumed both halves of P (in-order tensor pipe after PV part 2)"
    else:
        if spec.schedule.p_publish is PPublish.HALVES and not sm100:
            notes.append("sm90a: P stays in the consumer's registers (wgmma A operand); halves do not apply, "
                         "P is handed over whole")
        parts = (PublishPart(1, (0, n - 1), (0, p_cols - 1) if p_tmem else None, scaled, "P_full",
                             "the whole PV MMA; after it the stage's S is free"),)
        s_free = ("PV has consumed P (in-order tensor pipe after PV)" if sm100
                  else "the PV wgmma has read P from the consumer's registers (wgmma.wait_group)")
    mode = "halves" if len(parts) == 2 else "whole"
    return replace(plan, publish=PublishPlan(mode, parts, s_free, tuple(notes)))
