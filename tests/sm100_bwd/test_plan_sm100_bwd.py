"""plan_backward_sm100: TMEM map, budgets, MMAs, refusals (fast, no compilation)."""
from __future__ import annotations

import pytest

from fp4gen.ir.dump import to_json, to_text
from fp4gen.ir.passes import PlanError, plan_kernel
from fp4gen.ir.passes.backward_sm100 import BackwardPlanSm100, plan_backward_sm100, tmem_map
from fp4gen.ir.plan import REGISTERS_PER_SM, SMEM_LIMIT_BYTES, TMEM_COLUMNS
from fp4gen.ir.spec import Format, OperandFormat
from fp4gen.lowering import LoweringError, sm100
from fp4gen.lowering.sm100_bwd import context, render_backward

import bwd100 as H


def regions(bp):
    return {r.name: (r.first_col, r.last_col, r.alias_of) for r in bp.tmem.regions}


def test_example_plan_tmem_map_d128():
    """The d128 map written out by hand: S^T, dP^T, dV, dK take all 512 columns; P^T is the
    first half of S^T, dQ reuses dP^T."""
    bp = H.example_plan().backward
    assert isinstance(bp, BackwardPlanSm100)
    assert regions(bp) == {
        "S": (0, 127, None), "P": (0, 63, "S"), "dP": (128, 255, None),
        "dV": (256, 383, None), "dK": (384, 511, None), "dQ": (128, 255, "dP"),
    }
    assert bp.tmem.alloc_columns == 512 and bp.tmem.total_columns == 512
    assert bp.dq_aliases_dp and bp.causal and not bp.deterministic
    assert bp.reuse == ("lse",) and bp.dq_reduction == "atomic_fp32"


def test_tmem_map_d64_gives_dq_its_own_columns():
    tm, alias = tmem_map(64)
    got = {r.name: (r.first_col, r.last_col) for r in tm.regions}
    assert got == {"S": (0, 127), "P": (0, 63), "dP": (128, 255), "dV": (256, 319), "dK": (320, 383),
                   "dQ": (384, 447)}
    assert not alias and tm.total_columns == 448 and tm.alloc_columns == 512


def test_no_two_live_regions_share_columns():
    """Only declared aliases overlap (P over S, dQ over dP)."""
    for d in (64, 128):
        tm, _ = tmem_map(d)
        rs = tm.regions
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                if a.overlaps(b):
                    assert b.alias_of == a.name or a.alias_of == b.name, (a.name, b.name)
        assert max(r.last_col for r in rs) < TMEM_COLUMNS


def test_tmem_budget_refusal_names_the_numbers():
    with pytest.raises(PlanError) as e:
        tmem_map(256)
    msg = e.value.message
    assert "S^T 128 + dP^T 128 + dV 256 + dK 256 = 768 columns" in msg and "512" in msg


def test_mmas_and_instruction_counts():
    for d in (64, 128):
        bp = plan_backward_sm100(H.plan_text(H.spec_text(d=d)))
        m = {x.name: x for x in bp.mmas}
        assert [x.name for x in bp.mmas] == ["S", "dP", "dV", "dK", "dQ"]
        assert {x.kind for x in bp.mmas} == {"kind::f16"}
        assert (m["dV"].a_source, m["dV"].a_major, m["dV"].b_major) == ("tmem", "K", "MN")
        assert (m["dQ"].a_major, m["dQ"].b_major) == ("MN", "MN")
        assert (m["dK"].a_source, m["dK"].b_major) == ("smem", "MN")
        # K = d for S^T/dP^T, 128 queries for dV/dK, 128 keys for dQ; 16 per kind::f16 instruction
        assert bp.mma_instructions_per_tile() == 2 * d // 16 + 3 * 128 // 16
        assert {x.accumulator for x in bp.mmas} == {"S", "dP", "dV", "dK", "dQ"}


def test_smem_registers_barriers_budget():
    for d in (64, 128):
        bp = plan_backward_sm100(H.plan_text(H.spec_text(d=d)))
        assert bp.smem_bytes == sum(i.bytes for i in bp.smem) <= SMEM_LIMIT_BYTES
        assert bp.q_stages == 2  # 224 KiB of operands at d128 still fit with two Q/dO stages
        assert bp.registers_total <= bp.registers_at_launch * bp.threads <= REGISTERS_PER_SM
        assert bp.threads == 384 and bp.registers_at_launch == 168
        assert bp.mbarriers == 2 + 2 * bp.q_stages + 8


def test_deterministic_and_noncausal_flags():
    bp = plan_backward_sm100(H.plan_text(H.spec_text(causal=False, det=True)))
    assert not bp.causal and bp.deterministic and bp.dq_reduction == "ordered_atomic_fp32"


def _refusal(text):
    with pytest.raises(PlanError) as e:
        plan_backward_sm100(H.plan_text(text))
    return e.value


def test_refuses_reusing_nvfp4_qk_at_the_reuse_line():
    text = H.spec_text(reuse="q k lse")
    e = _refusal(text)
    assert "reusing the forward's nvfp4 Q and K payloads" in e.message
    assert text.splitlines()[e.loc.line - 1].strip() == "reuse q k lse"
    assert any("reuse lse" in n for n in e.notes)


def test_fp8_do_plans_dp_and_dv_as_f8f6f4():
    """FP8 dO: dP^T and dV become kind::f8f6f4 (E4M3 V / P^T x dO's type, 32 K per instruction),
    P^T takes a quarter of S^T's columns, V and dO half the SMEM; S^T, dK, dQ stay bf16."""
    bf = plan_backward_sm100(H.plan_text(H.spec_text()))
    bp = plan_backward_sm100(H.plan_text(H.spec_text(extra="    dO : fp8e5m2\n")))
    got = {m.name: (m.kind, m.formats(), m.instructions) for m in bp.mmas}
    assert got == {"S": ("kind::f16", ("bf16", "bf16"), 8),
                   "dP": ("kind::f8f6f4", ("fp8e4m3", "fp8e5m2"), 4),
                   "dV": ("kind::f8f6f4", ("fp8e4m3", "fp8e5m2"), 4),
                   "dK": ("kind::f16", ("bf16", "bf16"), 8), "dQ": ("kind::f16", ("bf16", "bf16"), 8)}
    assert bp.mma_kind == "kind::f16+kind::f8f6f4" and bp.mma_format == "bf16+fp8"
    p = next(r for r in bp.tmem.regions if r.name == "P")
    assert (p.first_col, p.last_col, p.alias_of) == (0, 31, "S")
    smem = {i.name: i.bytes for i in bp.smem}
    smem_bf = {i.name: i.bytes for i in bf.smem}
    assert smem["V"] * 2 == smem_bf["V"] and smem["dO"] * 2 == smem_bf["dO"] and smem["K"] == smem_bf["K"]


@pytest.mark.parametrize("extra, words", [
    ("    dS : fp8e4m3\n", ["FP8 dS on sm100a is not implemented", "dS : fp8e4m3"]),
    ("    dO : fp8e4m3(scale=token)\n", ["scales FP8 dO per (batch, head)", "dO : fp8e4m3(scale=token)"]),
    ("    dK : fp8e4m3\n", ["FP8 dK on sm100a", "dK : fp8e4m3"]),
])
def test_refuses_other_fp8_gradients_at_their_line(extra, words):
    text = H.spec_text(extra=extra)
    e = _refusal(text)
    assert words[0] in e.message, e.message
    assert text.splitlines()[e.loc.line - 1].strip() == words[1]


@pytest.mark.parametrize("field, fmt, words", [
    ("v", OperandFormat(Format.BF16), "fp8e4m3(scale=tensor)"),
    ("p", OperandFormat(Format.MXFP4), "P : fp8e4m3"),
])
def test_fp8_do_needs_the_forwards_fp8_v_and_p(field, fmt, words):
    """(The sm100a forward planner refuses such forwards first; the backward's own check is
    called directly so that it cannot rot behind it.)"""
    import dataclasses

    from fp4gen.ir.passes.backward_sm100 import _check_fp8_do

    text = H.spec_text(extra="    dO : fp8e4m3\n")
    spec = dataclasses.replace(H.plan_text(text).spec, **{field: fmt})
    with pytest.raises(PlanError) as e:
        _check_fp8_do(spec, spec.backward)
    assert words in e.value.message and text.splitlines()[e.value.loc.line - 1].strip() == "dO : fp8e4m3"


def test_refuses_a_backward_without_lse():
    e = _refusal(H.spec_text(reuse="scales"))
    assert "lse" in e.message


def test_the_paper_recipe_backward_is_refused_but_the_forward_still_renders():
    """fa4_nvfp8_d128 asks for NVFP4 Q/K reuse and FP8 gradients: no backward plan, no backward
    section, and the module says why among its known gaps."""
    from fp4gen.frontend import parse_file

    plan = plan_kernel(parse_file(H.ROOT / "examples" / "fa4_nvfp8_d128.attn")[0])
    assert plan.backward is None
    src = sm100.render(plan)
    assert "def backward(" not in src and "compile_only_backward" not in src
    assert "backward not generated: the sm100a backward planner refuses" in src
    with pytest.raises(PlanError):
        plan_backward_sm100(plan)


def test_example_module_has_the_backward_contract():
    plan = H.example_plan()
    src = sm100.render(plan)
    for name in ("def backward(q, k, v, o, lse, do, *, softmax_scale=None)", "def compile_only_backward(",
                 "def compile_only(", "def forward("):
        assert name in src
    # the plan's TMEM map is the only source of column numbers
    assert "('dV', 256, 383)" in src and "('dQ', 128, 255)" in src  # BWD_CONFIG.tmem
    assert "reuse lse" in src  # the spec line the backward's reuse decision came from
    compile(src, "module.py", "exec")


def test_plan_dumps_show_the_backward():
    plan = plan_kernel(H.plan_text(H.spec_text()).spec, debug=True)
    txt = to_text(plan)
    assert "dV += P^T dO" in txt and "kind::f16" in txt
    j = to_json(plan)
    assert {r["name"] for r in j["backward"]["tmem"]["regions"]} == {"S", "P", "dP", "dV", "dK", "dQ"}


def test_lowering_refuses_p_away_from_the_start_of_s():
    """The compute thread overwrites S^T chunk by chunk with P^T; P elsewhere would clobber scores
    it has not read yet, so the lowering refuses it."""
    plan = H.example_plan()
    bad = H.with_regions(plan.backward, P=(64, 127))
    with pytest.raises(LoweringError, match="P\\^T over the first columns of S\\^T"):
        render_backward(plan, bad)
    cfg = context(plan)["config"]
    assert (cfg.regs_compute_increase, cfg.regs_dq_increase, cfg.regs_other_increase) == (True, False, False)
