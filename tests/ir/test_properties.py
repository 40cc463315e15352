"""Property tests over generated KernelSpecs: the planner accepts (and then every invariant
holds) or refuses with a PlanError carrying a message; nothing else escapes."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4gen.ir.dump import to_json, to_svg, to_text
from fp4gen.ir.passes import PASSES, legalize, plan_kernel, verify
from fp4gen.ir.plan import TMEM_COLUMNS, PlanError
from fp4gen.ir.spec import (
    DirectPPolicy, Format, Guard, GuardKind, KernelSpec, Mask, OperandFormat, PKind, PProduction, PPublish,
    ScaleGranularity, Schedule, Target, TmemRegionRequest, default_operand_format,
)

import specs

ELEMENT = [f for f in Format if f not in (Format.E8M0, Format.E4M3)]


@st.composite
def operand(draw):
    f = draw(st.sampled_from(ELEMENT))
    kind = draw(st.integers(0, 3))
    if kind == 0 or f.is_high_precision:
        return default_operand_format(f)
    if f.is_fp4:
        return default_operand_format(f)
    g = draw(st.sampled_from([ScaleGranularity.TENSOR, ScaleGranularity.TOKEN, ScaleGranularity.BLOCK,
                              ScaleGranularity.NONE]))
    if g is ScaleGranularity.BLOCK:
        return OperandFormat(f, g, draw(st.sampled_from([16, 32, 64, 128])), draw(st.sampled_from([Format.FP32, Format.E8M0])))
    return OperandFormat(f, g, None, Format.FP32 if g is not ScaleGranularity.NONE else None)


REGION_NAMES = ["S0", "S1", "O0", "O1", "P0", "P1", "SFP0", "SFV1", "SFQ0", "SFK1", "X"]


@st.composite
def kernel_spec(draw):
    tmem = None
    if draw(st.integers(0, 4)) == 0:
        regs = {}
        for _ in range(draw(st.integers(1, 4))):
            name = draw(st.sampled_from(REGION_NAMES))
            a = draw(st.integers(0, 520))
            regs[name] = TmemRegionRequest(name, a, a + draw(st.integers(0, 300)))
        tmem = tuple(regs.values())
    sched = Schedule(
        tile_m=draw(st.sampled_from([32, 64, 96, 128, 192, 256])),
        tile_n=draw(st.sampled_from([32, 64, 96, 128, 160, 192, 256])),
        q_stages=draw(st.sampled_from([1, 2, 3])),
        p_publish=draw(st.sampled_from(list(PPublish))),
        tmem_regions=tmem,
        kv_stages=draw(st.sampled_from([None, None, 1, 2, 3, 4, 8, 9])))
    pp = PProduction(draw(st.sampled_from(list(PKind))), draw(st.sampled_from(list(DirectPPolicy))),
                     draw(st.sampled_from([1.5, 1.6, 0.0, 9.0])), draw(st.sampled_from([1.2, 0.95, -9.5])))
    guard = draw(st.sampled_from([Guard(), Guard(GuardKind.SAMPLE, 110, 16), Guard(GuardKind.SAMPLE, 0, 0)]))
    extra = tuple(f"schedule.tmem.{r.name}" for r in (tmem or ()))
    return KernelSpec(
        name="prop", target=draw(st.sampled_from(list(Target))),
        head_dim=draw(st.sampled_from([0, 16, 32, 64, 100, 128, 192, 256, 512])),
        mask=draw(st.sampled_from(list(Mask))),
        q=draw(operand()), k=draw(operand()), p=draw(operand()), v=draw(operand()),
        o=draw(st.sampled_from([specs.BF16, OperandFormat(Format.FP16), OperandFormat(Format.FP32),
                                specs.E4M3_TENSOR])),
        p_production=pp, guard=guard, schedule=sched, locs=specs.locs(extra), source_file="test.attn")


# the paper-like corner of the space, so that many generated specs are accepted
@st.composite
def near_paper(draw):
    from dataclasses import replace
    base = draw(st.sampled_from([specs.paper_fp4(), specs.nvfp8(), specs.sage3(), specs.sm100_bf16(),
                                 specs.sm90_fp8(), specs.sm90_fp8(False), specs.sm90_bf16(), specs.reference()]))
    sm90 = base.target is Target.SM90A
    tm = draw(st.sampled_from([64, 128, 192])) if sm90 else 128
    sched = replace(base.schedule, tile_m=tm, tile_n=draw(st.sampled_from([64, 128, 192, 256])),
                    q_stages=tm // 64 if sm90 else draw(st.sampled_from([1, 2])),
                    kv_stages=draw(st.sampled_from([None, 2, 3])), p_publish=draw(st.sampled_from(list(PPublish))))
    return replace(base, schedule=sched, head_dim=draw(st.sampled_from([64, 128, 192, 256])))


def check(spec):
    try:
        plan = plan_kernel(spec, debug=True)
    except PlanError as e:
        assert e.message and isinstance(e.message, str)
        return None
    # accepted: every invariant holds, the dumps work
    verify(plan)
    if plan.tmem is not None:
        assert plan.tmem.alloc_columns <= TMEM_COLUMNS
        for r in plan.tmem.regions:
            assert 0 <= r.first_col <= r.last_col < plan.tmem.alloc_columns
    if plan.pipeline is not None:
        assert plan.pipeline.smem_bytes <= plan.pipeline.smem_limit
        assert plan.pipeline.registers_total <= plan.pipeline.registers_limit
    json.dumps(to_json(plan))
    to_text(plan)
    return plan


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kernel_spec())
def test_any_spec_plans_or_refuses(spec):
    check(spec)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_paper())
def test_near_paper_specs(spec):
    plan = check(spec)
    if plan is not None and plan.spec.target is Target.SM100A:
        s = plan.spec.schedule
        # the plan's top-level regions are exactly the stages' S and O
        top = [r for r in plan.tmem.regions if r.alias_of is None and r.name[0] in "SO" and not r.name.startswith("SF")]
        assert sum(r.columns for r in top) == s.q_stages * (s.tile_n + plan.spec.head_dim)


def test_verify_after_every_pass():
    for make in specs.ACCEPTED.values():
        plan = verify(legalize(make()))
        for p in PASSES:
            plan = verify(p(plan))


def test_svg_for_accepted_examples():
    for make in specs.ACCEPTED.values():
        assert to_svg(plan_kernel(make())).startswith("<svg")
