"""Each sm100a module's kernel config is its plan's (issue 17: templates render what the plan
decides, the kernel library reads nothing else).

The module's ``FWD_CONFIG`` (and ``BWD_CONFIG``) must equal the config the lowering derives from
the plan re-planned from the module's own ``PLAN_JSON``, and the values the plan records in that
JSON (TMEM columns, warp roles, P publication parts) must be the ones the config carries.
Importing a module needs no CuTe DSL (the config module is plain Python).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.serialize import spec_from_plan_json
from fp4gen.lowering import sm100, sm100_bwd

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "generated").glob("*_sm100a.py"))


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"fp4gen_config_test_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_there_are_sm100a_modules():
    assert len(MODULES) >= 6, MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_rendered_config_is_the_one_derived_from_plan_json(path):
    mod = load(path)
    plan = plan_kernel(spec_from_plan_json(mod.PLAN_JSON))
    assert mod.FWD_CONFIG == sm100.kernel_config(plan)
    if hasattr(mod, "BWD_CONFIG"):
        assert mod.BWD_CONFIG == sm100_bwd.kernel_config(plan)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_config_carries_what_plan_json_records(path):
    mod = load(path)
    d = json.loads(mod.PLAN_JSON)
    cfg = mod.FWD_CONFIG
    assert cfg.tmem == tuple((r["name"], r["first_col"], r["last_col"]) for r in d["tmem"]["regions"])
    assert cfg.tmem_alloc_cols == d["tmem"]["alloc_columns"]
    roles = {r["name"]: r for r in d["pipeline"]["roles"]}
    assert cfg.n_warps == sum(r["warps"] for r in roles.values())
    assert [len(w) for w in cfg.softmax_warps] == [roles["softmax0"]["warps"], roles["softmax1"]["warps"]]
    assert len(cfg.correction_warps) == roles["correction"]["warps"]
    assert cfg.mma_warp == cfg.correction_warps[-1] + 1 and cfg.load_warp == cfg.mma_warp + 1
    assert cfg.regs_softmax == roles["softmax0"]["registers"] and cfg.regs_correction == roles["correction"]["registers"]
    parts = d["publish"]["parts"]
    assert cfg.p_parts == len(parts)
    for h, part in enumerate(parts):
        if part["p_columns"] is not None:  # P in TMEM: part h is at these columns of P's region
            assert part["p_columns"] == [h * cfg.p_part_cols, (h + 1) * cfg.p_part_cols - 1]
    if hasattr(mod, "BWD_CONFIG"):
        b, bd = mod.BWD_CONFIG, d["backward"]
        assert b.tmem == tuple((r["name"], r["first_col"], r["last_col"]) for r in bd["tmem"]["regions"])
        assert b.n_warps == sum(r["warps"] for r in bd["roles"])
        assert (b.tile_m, b.tile_n, b.q_stages, b.causal) == (bd["tile_m"], bd["tile_n"], bd["q_stages"], bd["causal"])


def test_a_plan_with_other_publish_columns_is_refused():
    """The kernel writes publish part h at columns h * n .. of P: a plan that says otherwise is
    refused, not silently compiled to the kernel's own layout."""
    import dataclasses

    from fp4gen.frontend import parse_file
    from fp4gen.lowering import LoweringError

    plan = plan_kernel(parse_file(ROOT / "examples" / "fa4_fp4_d128.attn")[0])
    p0, p1 = plan.publish.parts
    swapped = (dataclasses.replace(p0, p_columns=p1.p_columns), dataclasses.replace(p1, p_columns=p0.p_columns))
    bad = dataclasses.replace(plan, publish=dataclasses.replace(plan.publish, parts=swapped))
    with pytest.raises(LoweringError, match="P part 1"):
        sm100.kernel_config(bad)


@pytest.mark.parametrize("path", [m for m in MODULES if "_bwd_" not in m.name], ids=lambda p: p.stem)
def test_the_perf_model_reads_the_shape_from_the_rendered_config(path):
    """fp4gen perf prices a step of tile_m * q_stages rows and the module's mask: both live only
    in FWD_CONFIG since the kernel moved into fp4gen/device (read as defaults, every sm100a
    prediction was for 128 rows, not causal: half the throughput)."""
    from fp4gen.lowering import perf

    cfg = load(path).FWD_CONFIG
    info = perf.fp4gen_info(str(path))
    assert (info.tile_m, info.tile_n, info.head_dim, info.causal) == (
        cfg.tile_m * cfg.q_stages, cfg.tile_n, cfg.head_dim, cfg.causal)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_one_softmax_body_can_serve_every_stage(path):
    """The forward traces one softmax and one epilogue body for both query stages: a warp's stage
    is (warp - first) // per, stage j's S, O and P columns are stage 0's plus j strides."""
    cfg = load(path).FWD_CONFIG
    first, per = cfg.softmax_stage_warps()
    assert [(w - first) // per for g in cfg.softmax_warps for w in g] == [j for j in range(cfg.q_stages) for _ in range(per)]
    for region in ("S", "O") + (() if cfg.p_smem else ("P",)):
        cols = [cfg.first_col(f"{region}{j}") for j in range(cfg.q_stages)]
        assert cols == [cols[0] + j * cfg.stage_stride(region) for j in range(cfg.q_stages)]
    if not cfg.p_smem:
        assert cfg.stage_stride("P") == cfg.stage_stride("S")  # P_j sits at one offset inside every S_j


def test_uneven_stages_are_refused_by_name():
    import dataclasses

    cfg = load(MODULES[0]).FWD_CONFIG
    three = dataclasses.replace(cfg, q_stages=3, tmem=(("S0", 0, 63), ("S1", 64, 127), ("S2", 160, 223)))
    with pytest.raises(ValueError, match=r"S0..S2 start at columns \[0, 64, 160\]"):
        three.stage_stride("S")
    p_moves = tuple((n, f + 16 if n == "P1" else f, last) for n, f, last in cfg.tmem)
    with pytest.raises(ValueError, match="P_j moves by 144 columns per stage, S_j by 128"):
        dataclasses.replace(cfg, tmem=p_moves).p_offset_in_s()
    with pytest.raises(ValueError, match="consecutive groups"):
        dataclasses.replace(cfg, softmax_warps=((0, 1, 2, 3), (8, 9, 10, 11))).softmax_stage_warps()
