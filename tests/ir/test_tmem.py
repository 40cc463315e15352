"""plan_tmem: the paper's D128 layout, P and scales inside S, the 512-column limit."""
from __future__ import annotations

import pytest

from fp4gen.ir.passes import plan_kernel, verify
from fp4gen.ir.plan import PlanError

import specs
from specs import line_of


def cols(plan):
    return {r.name: (r.first_col, r.last_col, r.alias_of) for r in plan.tmem.regions}


def test_paper_layout():
    p = plan_kernel(specs.paper_fp4(), debug=True)
    c = cols(p)
    # FA4's D128 layout: all 512 columns
    assert c["S0"] == (0, 127, None) and c["S1"] == (128, 255, None)
    assert c["O0"] == (256, 383, None) and c["O1"] == (384, 511, None)
    assert p.tmem.total_columns == 512 and p.tmem.alloc_columns == 512
    # P: 128 keys x 4 bits = 16 columns, in the upper half of its own S (FA4 puts P at S + tile_n/2)
    assert c["P0"] == (64, 79, "S0") and c["P1"] == (192, 207, "S1")
    # P's E8M0 scales: one 32x4x4 atom (4 blocks of 32 keys) = 4 columns, right after P
    assert c["SFP0"] == (80, 83, "S0") and c["SFP1"] == (208, 211, "S1")
    # V's scales for PV (head_dim 128 rows of N, K = 128 keys): one atom
    assert c["SFV0"] == (84, 87, "S0")
    # Q's/K's E4M3 scales: K = 128 = two K64 atoms = 8 columns each, in the *other* stage's S
    assert c["SFQ0"] == (128, 135, "S1") and c["SFK0"] == (136, 143, "S1")
    assert c["SFQ1"] == (0, 7, "S0") and c["SFK1"] == (8, 15, "S0")
    assert all(r.first_lane == 0 and r.last_lane == 127 for r in p.tmem.regions)


def test_fp8_and_bf16_p_widths():
    c = cols(plan_kernel(specs.nvfp8(), debug=True))
    assert c["P0"] == (64, 95, "S0")  # 128 x 8 bit / 32
    assert "SFP0" not in c  # tensor-scaled fp8: no block scales
    c = cols(plan_kernel(specs.sm100_bf16(), debug=True))
    assert c["P0"] == (64, 127, "S0")  # FA4's bf16 P: the upper half of S
    assert "SFQ0" not in c


def test_nvfp4_p_two_atoms():
    c = cols(plan_kernel(specs.sage3(), debug=True))
    assert c["SFP0"] == (80, 87, "S0")  # 128 keys / (4 x 16) = 2 atoms = 8 columns


def test_d256_two_stages_refused_with_numbers():
    with pytest.raises(PlanError) as ei:
        plan_kernel(specs.paper_d256(), debug=True)
    e = ei.value
    assert e.message == ("TMEM plan needs 768 columns (S0 128 + S1 128 + O0 256 + O1 256) "
                         "but sm100a has 512 per SM")
    assert e.loc.line == line_of("head_dim")
    assert any("q_stages 1 needs 384" in n for n in e.notes)


def test_single_stage_d256_fits():
    s = specs.with_schedule(specs.paper_d256(), q_stages=1)
    p = plan_kernel(s, debug=True)
    c = cols(p)
    assert c["S0"] == (0, 127, None) and c["O0"] == (128, 383, None)
    # no other stage to borrow from: the QK^T scales get their own columns
    assert c["SFQ0"][2] is None and c["SFQ0"][0] >= 384
    assert p.tmem.alloc_columns == 512


def test_allocation_power_of_two():
    s = specs.with_schedule(specs.sm100_bf16(head_dim=64), q_stages=1, tile_n=64)
    p = plan_kernel(s, debug=True)
    assert p.tmem.total_columns == 128 and p.tmem.alloc_columns == 128


def test_explicit_regions_checked_not_trusted():
    ok = specs.explicit_tmem(("S0", 0, 127), ("S1", 128, 255), ("O0", 256, 383), ("O1", 384, 511))
    assert cols(plan_kernel(ok, debug=True))["O1"] == (384, 511, None)
    with pytest.raises(PlanError) as ei:
        plan_kernel(specs.explicit_tmem(("O0", 0, 127)), debug=True)
    assert "overlap" in ei.value.message and "S0" in ei.value.message and "O0" in ei.value.message
    assert ei.value.loc.file == "test.attn" and ei.value.loc.line >= 100  # the O0 line of the tmem block
    with pytest.raises(PlanError, match="has 64 columns but needs 128"):
        plan_kernel(specs.explicit_tmem(("O1", 448, 511)), debug=True)
    with pytest.raises(PlanError, match="past column 511"):
        plan_kernel(specs.explicit_tmem(("O1", 500, 627)), debug=True)
    with pytest.raises(PlanError, match="unknown TMEM region 'X'"):
        plan_kernel(specs.explicit_tmem(("X", 0, 3)), debug=True)
    # P0 moved onto SFP0's columns: two siblings inside S0, both live at once
    with pytest.raises(PlanError, match="P0 .*SFP0|SFP0 .*P0"):
        plan_kernel(specs.explicit_tmem(("P0", 72, 87)), debug=True)


def test_explicit_p_elsewhere_in_s_is_fine():
    p = plan_kernel(specs.explicit_tmem(("P0", 96, 111)), debug=True)
    assert cols(p)["P0"] == (96, 111, "S0")


def test_verify_rejects_broken_plan():
    from dataclasses import replace
    p = plan_kernel(specs.paper_fp4())
    regs = tuple(replace(r, first_col=300, last_col=315) if r.name == "P0" else r for r in p.tmem.regions)
    bad = replace(p, tmem=replace(p.tmem, regions=regs))
    with pytest.raises(PlanError):
        verify(bad)
