"""plan_pipeline (roles, registers, SMEM, Sm90Plan) and cost_model, against hand-computed numbers."""
from __future__ import annotations

import pytest

from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.plan import PlanError, Sm90Plan

import specs
from specs import line_of


def test_sm90_fp8_d128_plan():
    p = plan_kernel(specs.sm90_fp8(), debug=True)
    # Q 128x128 fp8 + 2 x (K + V) 128x128 fp8 + O 128x128 bf16 + 10 mbarriers
    smem = 16384 + 2 * (16384 + 16384) + 32768 + 10 * 8
    assert p.sm90 == Sm90Plan(tile_m=128, tile_n=128, consumer_warpgroups=2, kv_stages=2, v_transposed=True,
                              intra_warpgroup_overlap=True, pingpong=True, smem_bytes=smem,
                              producer_registers=24, consumer_registers=240, l_from_mma=True)
    # only Direct-P sums its codes on the tensor cores; the exp path sums fp32 p
    assert plan_kernel(specs.sm90_fp8(directp=False)).sm90.l_from_mma is False
    assert p.pipeline.registers_total == 128 * 24 + 2 * 128 * 240
    assert p.contract("V").storage.endswith("transposed D x S")


def test_sm90_bf16_and_d64():
    p = plan_kernel(specs.sm90_bf16(), debug=True)
    assert p.sm90.v_transposed is False
    assert p.sm90.smem_bytes == 32768 + 2 * (32768 + 32768) + 32768 + 80
    assert plan_kernel(specs.sm90_bf16(64), debug=True).sm90.pingpong is False


def test_sm90_kv_stages_from_spec():
    p = plan_kernel(specs.with_schedule(specs.sm90_fp8(), kv_stages=3), debug=True)
    assert p.sm90.kv_stages == 3


def test_sm100_roles_fill_the_register_file():
    p = plan_kernel(specs.paper_fp4(), debug=True)
    names = [r.name for r in p.pipeline.roles]
    assert names[:3] == ["softmax0", "softmax1", "correction"] and "mma" in names and "load" in names
    assert p.pipeline.registers_total == 65536
    assert p.pipeline.smem_bytes <= 227 * 1024


def test_smem_overflow_refused():
    s = specs.with_schedule(specs.sm100_bf16(), kv_stages=8)
    with pytest.raises(PlanError, match="shared memory plan needs") as ei:
        plan_kernel(s)
    assert ei.value.loc.line == line_of("schedule.kv_stages")


def test_cost_sm90_fp8():
    p = plan_kernel(specs.sm90_fp8(), debug=True)
    exp, dp = p.cost.path("exp"), p.cost.path("direct_p_fast")
    assert exp.unit("mma").cycles == 2 * (2 * 128 * 128 * 128) / 8192 == 1024
    assert exp.unit("mufu").cycles == 128 * 128 / 16 == 1024
    assert exp.bottleneck == "mma+mufu"  # EX2 as fast as the FP8 tensor cores at D128
    assert dp.unit("mufu").cycles == 0 and dp.bottleneck == "mma"
    assert p.cost.chosen == "direct_p_fast"


def test_cost_sm100_paper():
    p = plan_kernel(specs.paper_fp4(), debug=True)
    exp, dp = p.cost.path("exp"), p.cost.path("direct_p_fast")
    assert exp.unit("mma").cycles == 2 * (2 * 256 * 128 * 128) / 32768 == 512
    assert exp.bottleneck == "mufu" and exp.cycles_per_tile == 256 * 128 / 16
    assert dp.bottleneck == "fma" and dp.cycles_per_tile == 7 * 256 * 128 / 128
    assert dp.cycles_per_tile < exp.cycles_per_tile


def test_cost_sm90_bf16_is_mma_bound():
    p = plan_kernel(specs.sm90_bf16(), debug=True)
    assert p.cost.path("exp").unit("mma").cycles == 2 * 2 * 128 ** 3 / 4096
    assert p.cost.path("exp").bottleneck == "mma"
    assert [x.path for x in p.cost.paths] == ["exp"]  # bf16 P: no Direct-P
