"""sm100a lowering: rendering from the plan, the host refusal, and static conformance.

No Blackwell GPU here: the compile tests build the kernels for sm_100a on the CPU and
check the kept MLIR/PTX against the plan (fp4gen.lowering.conformance). They take
10-30 s per kernel variant on 2 CPU cores and are marked ``slow``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from fp4gen.frontend import parse_file
from fp4gen.ir.passes import plan_kernel
from fp4gen.lowering import LoweringError, sm100
from fp4gen.lowering import conformance as C

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# the guard's block vote: bar.sync on named barrier 3 + stage (a register: one softmax body
# serves both query stages), 128 threads; the correction warps' barrier 2 is an immediate
GUARD_VOTE = r"bar\.sync\s+(3|%r\d+), 128"
SUPPORTED = ("fa4_fp4_d128", "fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128")


def plan_of(name: str):
    return plan_kernel(parse_file(EXAMPLES / f"{name}.attn")[0])


def moved(plan, name: str, first: int):
    """The plan with region ``name`` moved to start at column ``first`` (same width)."""
    regs = []
    for r in plan.tmem.regions:
        if r.name == name:
            r = dataclasses.replace(r, first_col=first, last_col=first + (r.last_col - r.first_col))
        regs.append(r)
    return dataclasses.replace(plan, tmem=dataclasses.replace(plan.tmem, regions=tuple(regs)))


def load_module(source: str, tmp_path: Path, stem: str):
    path = tmp_path / f"{stem}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"fp4gen_test_{stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ rendering (fast)


@pytest.mark.parametrize("name", SUPPORTED)
def test_module_contract_and_tmem_from_plan(name, tmp_path):
    plan = plan_of(name)
    mod = load_module(sm100.render(plan), tmp_path, name)
    assert mod.KERNEL_NAME == plan.spec.name and mod.TARGET == "sm100a"
    assert json.loads(mod.PLAN_JSON)["tmem"]["alloc_columns"] == plan.tmem.alloc_columns
    cfg = mod.FWD_CONFIG
    assert cfg.tmem == tuple((r.name, r.first_col, r.last_col) for r in plan.tmem.regions)
    assert cfg.tmem_alloc_cols == plan.tmem.alloc_columns
    assert cfg.kv_stages == plan.pipeline.kv_stages
    assert cfg.p_parts == len(plan.publish.parts) == (2 if plan.publish.mode == "halves" else 1)
    assert callable(mod.forward) and callable(mod.compile_only)
    assert not hasattr(mod, "backward")  # the sm100a backward is not generated (documented gap)
    # a partial kernel must say so in its docstring
    assert "Known gaps" in mod.__doc__ and "never run on Blackwell hardware" in mod.__doc__


def test_offsets_follow_the_plan_not_the_template(tmp_path):
    plan = moved(plan_of("fa4_fp4_d128"), "P0", 96)
    mod = load_module(sm100.render(plan), tmp_path, "moved")
    assert ("P0", 96, 111) in mod.FWD_CONFIG.tmem and mod.FWD_CONFIG.first_col("P0") == 96


def with_spec(plan, **changes):
    return dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, **changes))


def test_unsupported_p_production_is_refused_with_reason():
    """two_level into MXFP4 P (a block32 PV) is not a variant the template implements."""
    plan = plan_of("fa4_fp4_d128")
    pp = dataclasses.replace(plan.spec.p_production, kind=type(plan.spec.p_production.kind)("two_level"))
    with pytest.raises(LoweringError, match="P : mxfp4 via two_level"):
        sm100.render(with_spec(plan, p_production=pp))


def test_two_level_needs_nvfp4_v():
    plan = plan_of("sage3_fp4_d128")
    with pytest.raises(LoweringError, match="NVFP4 V with blocks of 16"):
        sm100.render(with_spec(plan, v=plan_of("fa4_fp4_d128").spec.v))


def test_two_level_renders_block16_pv(tmp_path):
    mod = load_module(sm100.render(plan_of("sage3_fp4_d128")), tmp_path, "sage3")
    cfg = mod.FWD_CONFIG
    assert cfg.p_mode == "two_level_fp4" and cfg.two_level and cfg.pv_sf_vec == 16
    assert cfg.pv_block_scaled and not cfg.pv_fp8 and cfg.lse_shift == 0.0
    assert "two-level P" in mod.__doc__  # its numerics deviations are listed as known gaps
    # V's block scales are E4M3 per 16 keys in the tcgen05 atom layout
    lay = mod.operand_layouts(1, 256, 256, 2, 2)
    assert lay["sfv"].cute_dtype == "Float8E4M3FN"
    assert lay["sfv"].shape == (2, (128 // 128) * (256 // 16 // 4) * 512)


def test_two_level_o_folding_matches_the_reference():
    """The kernel's algebra, emulated on the CPU in float32: O kept in units of the tile's
    row factor r (rescaled by alpha * r_prev / r before each PV, times the last r in the
    epilogue), P2 = p * (1/r), codes of P2 * (1/s) -- against numerics' p_two_level with the
    running max. Checks the derivation in docs/sm100.md, not the compiled kernel."""
    import torch

    from fp4gen.numerics import directp as dp
    from fp4gen.numerics.formats import E2M1, E4M3, decode, encode

    def kernel_tile(t, m):
        p = torch.exp2(t - m[:, None])
        pmax = p.amax(-1)
        r = torch.where(pmax > 0, torch.clamp(pmax / 2688.0, min=2.0 ** -64), torch.ones_like(pmax))
        b = (p * (1.0 / r)[:, None]).view(p.shape[0], -1, 16)
        s = decode(encode(b.amax(-1) / 6.0, E4M3), E4M3)
        inv_s = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        deq = decode(encode(b * inv_s[..., None], E2M1), E2M1) * s[..., None]
        return deq.view_as(p), r, p.sum(-1)

    g = torch.Generator().manual_seed(0)
    rows, n_tiles, D = 128, 4, 64
    t = torch.randn(rows, 128 * n_tiles, generator=g) * 4.0
    t[:8, 128:] = -float("inf")  # rows whose later tiles are fully masked (r = 1 there)
    t[8:16, :128] -= 60.0  # a first tile far below the later max (alpha << 1)
    v = torch.randn(128 * n_tiles, D, generator=g)
    m = torch.full((rows,), -float("inf"))
    o_ref, l_ref = torch.zeros(rows, D), torch.zeros(rows)
    o_k, l_k, r_prev = torch.zeros(rows, D), torch.zeros(rows), torch.ones(rows)
    for j in range(n_tiles):
        tj, vj = t[:, 128 * j:128 * (j + 1)], v[128 * j:128 * (j + 1)]
        m_new = torch.maximum(m, tj.amax(-1))
        alpha = torch.where(torch.isinf(m), torch.ones_like(m), torch.exp2(m - m_new))
        pv, l_inc = dp.p_two_level(tj, m_new)
        o_ref, l_ref = o_ref * alpha[:, None] + pv @ vj, l_ref * alpha + l_inc
        deq, r, lk_inc = kernel_tile(tj, m_new)
        fac = torch.ones_like(r) if j == 0 else alpha * (r_prev / r)
        o_k, l_k, r_prev = o_k * fac[:, None] + deq @ vj, l_k * alpha + lk_inc, r
        # the quantized P the MMA consumes, times r, is the reference's P
        assert torch.equal(deq * r[:, None], pv)
        m = m_new
    assert torch.equal(l_k, l_ref)
    got, want = o_k * r_prev[:, None] / l_k[:, None], o_ref / l_ref[:, None]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_plan_without_a_required_region_is_refused():
    plan = plan_of("fa4_fp4_d128")
    regs = tuple(r for r in plan.tmem.regions if r.name != "SFV1")
    bad = dataclasses.replace(plan, tmem=dataclasses.replace(plan.tmem, regions=regs))
    with pytest.raises(LoweringError, match="SFV1"):
        sm100.render(bad)


def test_forward_refuses_without_gpu(tmp_path, monkeypatch):
    import torch

    mod = load_module(sm100.render(plan_of("fa4_fp4_d128")), tmp_path, "nogpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    x = torch.zeros(1, 128, 1, 128)
    with pytest.raises(RuntimeError, match="sm_100a.*no CUDA GPU"):
        mod.forward(x, x, x)


def test_forward_refuses_on_hopper(tmp_path, monkeypatch):
    import torch

    mod = load_module(sm100.render(plan_of("fa4_fp4_d128")), tmp_path, "hopper")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    x = torch.zeros(1, 128, 1, 128)
    with pytest.raises(RuntimeError, match="H200 \\(sm_90\\)"):
        mod.forward(x, x, x)


def test_compile_only_rejects_other_arch(tmp_path):
    mod = load_module(sm100.render(plan_of("fa4_fp4_d128")), tmp_path, "arch")
    with pytest.raises(ValueError, match="sm_100a only"):
        mod.compile_only("sm_90a")


# ------------------------------------------------------------------ compiled (slow)


@pytest.fixture(scope="module")
def fast_artifacts(tmp_path_factory):
    plan = plan_of("fa4_fp4_d128")
    art = C.compile_artifacts(sm100.render(plan), str(tmp_path_factory.mktemp("fa4_fp4")))
    print(f"fa4_fp4_d128 compiled for sm_100a in {art.compile_seconds:.1f} s")
    return plan, art


@pytest.mark.slow
def test_fast_direct_p_kernel_conforms(fast_artifacts):
    plan, art = fast_artifacts
    assert art.names == ("fa4_fp4_d128.forward",)
    assert C.check_conformance(plan, art) == []
    # spot checks that do not go through the checker
    assert "kind::mxf4nvf4.block_scale.block16" in art.ptx
    assert "kind::mxf4nvf4.block_scale.block32" in art.ptx
    assert "ex2." not in art.ptx
    assert "tcgen05.cp.cta_group::1" in art.ptx
    # the spec asks for the guard: its block vote (named barrier 3 + stage of the softmax
    # warpgroups, a register: one body serves both) and the byte loads of the sampled keys
    assert re.search(GUARD_VOTE, art.ptx) and re.search(r"ld\.global\.[su]8", art.ptx)


@pytest.mark.slow
def test_checker_reports_a_plan_the_kernel_does_not_implement(fast_artifacts):
    plan, art = fast_artifacts
    other = moved(plan, "S1", 160)  # the kernel accumulates S1 at column 128
    got = C.check_conformance(other, art)
    assert any(m.check == "mlir.QK.accumulator" for m in got), C.report(got)
    fewer = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, kv_stages=2))
    assert any(m.check == "ptx.mbarrier.count" for m in C.check_conformance(fewer, art))
    # a P store no longer waited on before its barrier arrive
    unfenced = dataclasses.replace(art, ptx="\n".join(
        ln for ln in art.ptx.splitlines() if "tcgen05.wait::st" not in ln))
    assert any(m.check == "ptx.fence.tmem_store" for m in C.check_conformance(plan, unfenced))
    # a run-time stage stride other than the plan's (one softmax body for both stages: stage j
    # reads S at S0 + j * 128): made 96, stage 1 would store P1 at 160 and rescale O1 at 352
    assert re.search(r"arith\.muli %\w+, %c128_i32", art.mlir)
    stride96 = dataclasses.replace(art, mlir=re.sub(
        r"^(\s*)(%\w+) = arith\.muli (%\w+), %c128_i32",
        r"\1%c96_planted = arith.constant 96 : i32\n\1\2 = arith.muli \3, %c96_planted", art.mlir, flags=re.M))
    got = C.check_conformance(plan, stride96)
    checks = {m.check for m in got}
    assert {"mlir.tcgen05.st.P", "mlir.tcgen05.st.dst"} <= checks, C.report(got)


@pytest.mark.slow
def test_wrong_offset_is_caught(tmp_path):
    """Render with P moved (a template/plan disagreement), check against the original plan.
    P0 and P1 move together: one softmax body serves both stages, so P_j must sit at one
    offset inside every S_j (the kernel refuses a plan where it does not, at compile time)."""
    plan = plan_of("fa4_fp4_d128")
    shifted = moved(moved(plan, "P0", 96), "P1", 224)
    art = C.compile_artifacts(sm100.render(shifted), str(tmp_path))
    got = C.check_conformance(plan, art)
    checks = {m.check for m in got}
    assert "mlir.PV.A(P)" in checks and "mlir.tcgen05.st.P" in checks, C.report(got)
    # ... and the same artifacts conform to the plan they were rendered from
    assert C.check_conformance(shifted, art) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128"])
def test_other_variants_conform(name, tmp_path):
    plan = plan_of(name)
    art = C.compile_artifacts(sm100.render(plan), str(tmp_path))
    print(f"{name} compiled for sm_100a in {art.compile_seconds:.1f} s")
    assert C.check_conformance(plan, art) == []
    # the register gate on the same PTX: setmaxnreg honoured, spills within the plan's budget
    from fp4gen.lowering import ptxas

    assert ptxas.check_registers(art.ptx, ptxas.assemble(art.ptx),
                                 budgets={r.name: r.registers for r in plan.pipeline.roles},
                                 spill_budget_bytes=plan.pipeline.spill_budget_bytes) == []
    if name == "fa4_nvfp8_d128":
        assert "kind::f8f6f4" in art.ptx and "block_scale.block32" not in art.ptx
        assert not re.search(GUARD_VOTE, art.ptx)  # no guard in this spec
    elif name == "sage3_fp4_d128":
        # two-level P: exp2 on the MUFU, hardware E2M1 / E4M3 conversions, one block16 kind
        assert "kind::mxf4nvf4.block_scale.block16" in art.ptx and "block_scale.block32" not in art.ptx
        assert "ex2." in art.ptx
        assert "cvt.rn.satfinite.e2m1x2.f32" in art.ptx and "cvt.rn.satfinite.e4m3x2.f32" in art.ptx
        assert not re.search(GUARD_VOTE, art.ptx)  # no guard in this spec
    else:
        assert "ex2." in art.ptx  # the accurate policy puts EX2 on the value path


def test_prmt_table_matches_e2m1_magnitudes():
    """The PRMT lookup that builds the normaliser holds 2 * |E2M1(code)| for codes 0..7."""
    import torch

    from fp4gen.device.sm100 import direct_p as dp
    from fp4gen.numerics.formats import E2M1, decode

    table = [(dp.TWICE_LO >> (8 * i)) & 0xFF for i in range(4)]
    table += [(dp.TWICE_HI >> (8 * i)) & 0xFF for i in range(4)]
    want = (2 * decode(torch.arange(8, dtype=torch.uint8), E2M1)).tolist()
    assert table == want
