"""legalize: what each target can consume, and where a refusal points."""
from __future__ import annotations

import pytest

from fp4gen.ir.passes import legalize, plan_kernel
from fp4gen.ir.plan import PlanError
from fp4gen.ir.spec import Format, OperandFormat, PKind, PProduction, ScaleGranularity, Target

import specs
from specs import line_of


def kinds(spec):
    p = legalize(spec)
    return p.mma_choice("QK").kind, p.mma_choice("PV").kind


def test_paper_recipe_kinds():
    assert kinds(specs.paper_fp4()) == ("kind::mxf4nvf4.block_scale.block16", "kind::mxf4nvf4.block_scale.block32")


def test_fp8_pv_kinds():
    # tensor-scaled fp8 P/V need no block scales: the unscaled f8f6f4 kind
    assert kinds(specs.nvfp8())[1] == "kind::f8f6f4"
    # MX fp8 V with mxfp4 P: the mixed, block-scaled kind
    mixed = specs.paper_fp4(v=specs.E4M3_MX, p_production=PProduction(PKind.EXP))
    assert kinds(mixed)[1] == "kind::mxf8f6f4.block_scale"


def test_sm90_kinds_and_majors():
    p = legalize(specs.sm90_fp8())
    pv = p.mma_choice("PV")
    assert pv.kind.startswith("wgmma.f8") and pv.b_major == "K-major" and pv.a_source == "registers"
    assert legalize(specs.sm90_bf16()).mma_choice("PV").b_major == "MN-major"


def test_reference_takes_anything():
    s = specs.reference(q=specs.BF16, k=specs.E4M3_TENSOR)
    assert kinds(s) == ("torch", "torch")


def refuse(spec, field, *words):
    with pytest.raises(PlanError) as ei:
        plan_kernel(spec, debug=True)
    e = ei.value
    fields = (field,) if isinstance(field, str) else field
    assert e.loc is not None and e.loc.line in [line_of(f) for f in fields], (e.loc, field, str(e))
    for w in words:
        assert w in e.message, (w, e.message)
    return e


def test_no_fp4_on_hopper():
    e = refuse(specs.sm90_fp8(q=specs.NVFP4), "Q", "sm90a", "nvfp4")
    assert any("FP4" in n for n in e.notes)


def test_nvfp4_with_mxfp4_refused():
    refuse(specs.paper_fp4(k=specs.MXFP4), "K", "mixes nvfp4 and mxfp4")


def test_mixed_kind_needs_mx_scales():
    s = specs.paper_fp4(v=specs.E4M3_TENSOR, p_production=PProduction(PKind.EXP))
    refuse(s, ("V", "V.block", "V.scale"), "mxf8f6f4", "1x32")


def test_direct_p_needs_mxfp4_on_sm100_and_fp8_on_sm90():
    refuse(specs.paper_fp4(p=specs.E4M3_TENSOR), "P.via", "direct_p", "mxfp4")
    refuse(specs.sm90_fp8(p=specs.BF16, v=specs.BF16), "P.via", "direct_p", "fp8")


def test_two_level_needs_nvfp4():
    refuse(specs.paper_fp4(p_production=PProduction(PKind.TWO_LEVEL)), "P.via", "two_level")


def test_tile_checks():
    refuse(specs.with_schedule(specs.paper_fp4(), tile_m=64), "schedule.tile", "128 query rows")
    refuse(specs.with_schedule(specs.sm90_fp8(), tile_m=96), "schedule.tile", "tile_m")
    refuse(specs.with_schedule(specs.paper_fp4(), tile_n=96), "schedule.tile", "tile_n")


def test_head_dims():
    refuse(specs.sm90_fp8(head_dim=80), "head_dim", "64, 96, 128, 192, 256")  # a multiple of 16, not built
    refuse(specs.paper_fp4(head_dim=100), "head_dim", "multiple of 16")


def test_sm90_q_stages_must_match_warpgroups():
    refuse(specs.with_schedule(specs.sm90_fp8(), q_stages=3), "schedule.q_stages", "consumer warpgroup")


def test_sm90_v_scale_per_tensor():
    v = OperandFormat(Format.FP8E4M3, ScaleGranularity.TOKEN, None, Format.FP32)
    refuse(specs.sm90_fp8(v=v), ("V", "V.block", "V.scale"), "per tensor")


def test_output_format():
    refuse(specs.paper_fp4(o=specs.E4M3_TENSOR), "O", "output format")


def test_guard_needs_low_precision_p():
    from fp4gen.ir.spec import Guard, GuardKind
    refuse(specs.sm100_bf16(guard=Guard(GuardKind.SAMPLE, 110, 16)), "guard", "guard")


def test_tmem_block_on_hopper():
    from fp4gen.ir.spec import TmemRegionRequest
    s = specs.with_schedule(specs.sm90_bf16(), tmem_regions=(TmemRegionRequest("S0", 0, 127),))
    refuse(s, "schedule.tmem", "no tensor memory")


def test_render_has_location_and_caret():
    try:
        plan_kernel(specs.sm90_fp8(q=specs.NVFP4))
    except PlanError as e:
        lines = [""] * 10
        lines[line_of("Q") - 1] = "  Q : nvfp4"
        text = e.render(lines)
        assert text.splitlines()[0].startswith(f"test.attn:{line_of('Q')}:3: error:")
        assert "    ^" in text
    else:
        pytest.fail("accepted fp4 on sm90a")


def test_fp8_direct_p_refuses_classifier_parameters():
    # `P : fp8e4m3 via direct_p(a=...)`: a/b/policy tune the FP4 classifier only
    spec = specs.sm90_fp8(locs=specs.locs())  # locs() records P.via.a as written by the user
    with pytest.raises(PlanError) as e:
        plan_kernel(spec)
    assert "takes no classifier parameters" in e.value.message
    assert e.value.loc.line == line_of("P.via.a")
