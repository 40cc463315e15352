"""The sm100a backward compiled for sm_100a on the CPU and checked against its plan.

No Blackwell GPU exists here: ``conformance.compile_artifacts(..., backward=True)`` compiles
the backward kernel in a subprocess with CuTe DSL keeping its IR, and
``check_backward_conformance`` reads the TMEM columns of every tcgen05.mma / tcgen05.ld /
tcgen05.st from the IR and the MMA kind, barriers, P^T store width, fences and dQ reduction
from the PTX. About 5-20 s per compile on 2 cores (marked ``slow``); five compiles in all.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from fp4gen.lowering import conformance as C
from fp4gen.lowering import sm100

import bwd100 as H


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """(plan, backward plan, artifacts) of the example's causal d128 backward."""
    plan = H.example_plan()
    art = C.compile_artifacts(sm100.render(plan), str(tmp_path_factory.mktemp("bwd_example")), backward=True)
    return plan, plan.backward, art


@pytest.mark.slow
def test_example_backward_conforms(example):
    plan, bp, art = example
    assert art.names == (plan.spec.name + ".backward",)
    assert C.check_backward_conformance(bp, art) == [], C.report(C.check_backward_conformance(bp, art))
    f = C.backward_mlir_facts(art.mlir)
    # the facts the check compared, spelled out for the d128 map
    assert f.acc == {"S": {0}, "dP": {128}, "dV": {256}, "dK": {384}, "dQ": {128}}
    assert f.dv_a == {0} and f.tmem_st == {0} and f.alloc_columns == [512]
    # 4 stores of 16 columns per tile body; two bodies (unmasked tiles, masked tiles)
    assert re.findall(r"tcgen05\.st\.sync\.aligned\.32x32b\.x(\d+)", art.ptx) == ["16"] * 8
    assert {"S": 8, "dP": 8, "dV": 8, "dK": 8, "dQ": 8} in f.loop_mma
    assert len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16", art.ptx)) == 40


@pytest.mark.slow
def test_example_backward_passes_the_register_gate(example):
    """Every role's setmaxnreg honoured (no C7508) and no spill at all (the plan allows none)."""
    from fp4gen.lowering import ptxas

    _, bp, art = example
    reports = ptxas.assemble(art.ptx)
    assert bp.spill_budget_bytes == 0
    assert ptxas.check_registers(art.ptx, reports, budgets={r.name: r.registers for r in bp.roles},
                                 spill_budget_bytes=0) == []
    assert reports[0].spills == 0


@pytest.mark.slow
def test_wrong_plans_are_caught_on_correct_artifacts(example):
    """The check is not vacuous: the same artifacts against plans that differ in one decision."""
    _, bp, art = example

    def checks(bad):
        return {m.check for m in C.check_backward_conformance(bad, art)}

    assert checks(H.with_regions(bp, dK=(256, 383), dV=(384, 511))) >= {
        "mlir.bwd.dV.accumulator", "mlir.bwd.dK.accumulator"}
    assert "mlir.bwd.dQ.accumulator" in checks(H.with_regions(bp, dQ=(384, 511)))
    assert "mlir.bwd.tmem.alloc" in checks(dataclasses.replace(bp, tmem=dataclasses.replace(bp.tmem, alloc_columns=256)))
    assert "ptx.bwd.mbarrier.count" in checks(dataclasses.replace(bp, mbarriers=bp.mbarriers - 2))
    assert "ptx.bwd.dq.order" in checks(dataclasses.replace(bp, dq_reduction="ordered_atomic_fp32"))
    m = list(bp.mmas)
    m[0] = dataclasses.replace(m[0], k=2 * m[0].k)  # S^T with twice the K slices
    assert "mlir.bwd.mma_per_query_tile" in checks(dataclasses.replace(bp, mmas=tuple(m)))
    # P^T placed elsewhere in S^T: the dV MMA's A operand and the stores are reported
    assert checks(H.with_regions(bp, P=(64, 127))) >= {"mlir.bwd.dV.A(P)", "mlir.bwd.tcgen05.st.P"}
    # one of the four P^T stores missing
    lines = art.ptx.splitlines()
    first_st = next(i for i, ln in enumerate(lines) if ln.strip().startswith("tcgen05.st."))
    one_less = dataclasses.replace(art, ptx="\n".join(lines[:first_st] + lines[first_st + 1:]))
    assert "ptx.bwd.p_store.width" in {m.check for m in C.check_backward_conformance(bp, one_less)}
    # the P^T stores lose their tcgen05.wait::st
    no_wait = dataclasses.replace(art, ptx="\n".join(ln for ln in art.ptx.splitlines() if "tcgen05.wait::st" not in ln))
    assert "ptx.bwd.fence.tmem_store" in {m.check for m in C.check_backward_conformance(bp, no_wait)}


@pytest.mark.slow
def test_transposed_smem_views_are_the_same_bytes(example):
    """Q, dO, K, dS^T are each read by two MMAs through two layouts; the check evaluates both
    layouts from the kernel signature on every element (and catches a wrong view)."""
    _, _, art = example
    lays = C.backward_smem_layouts(art.mlir)
    assert set(lays) == set(C._BWD_SMEM_ARGS)
    assert C.smem_view_mismatches(art.mlir) == []
    assert lays["sQ"].offset(5, 70) == lays["sQt"].offset(70, 5)  # query 5, dim 70
    lines = art.mlir.splitlines()
    i = next(i for i, ln in enumerate(lines) if "cuda.kernel @" in ln and "AttentionBwdSm100" in ln)
    lines[i] = lines[i].replace("(((64,2),16),1,8,2):(((1,8192),64),0,1024,16384)",
                                "(((64,2),16),1,8,2):(((1,8192),128),0,2048,16384)", 1)
    found = C.smem_view_mismatches("\n".join(lines))
    assert [m.check for m in found] == ["mlir.bwd.smem.transposed_view"] and "sQt" in str(found[0])


@pytest.mark.slow
def test_a_kernel_rendered_from_a_different_map_is_caught(example, tmp_path):
    """Render + compile with dV and dK swapped: the compiled kernel conforms to the swapped plan
    and is reported against the original one (the kernel really follows the plan's columns)."""
    plan, bp, _ = example
    swapped = H.with_regions(bp, dK=(256, 383), dV=(384, 511))
    src = sm100.render(dataclasses.replace(plan, backward=swapped))
    assert "('dV', 384, 511)" in src and "('dK', 256, 383)" in src  # BWD_CONFIG.tmem
    art = C.compile_artifacts(src, str(tmp_path), backward=True)
    assert C.check_backward_conformance(swapped, art) == []
    found = {m.check: m for m in C.check_backward_conformance(bp, art)}
    assert set(found) == {"mlir.bwd.dV.accumulator", "mlir.bwd.dK.accumulator"}
    assert found["mlir.bwd.dV.accumulator"].found == [384]


@pytest.mark.slow
def test_d64_noncausal_deterministic_backward_conforms(tmp_path):
    """head_dim 64 (dQ in its own columns 384-447) with ordered dQ adds; rendered without the
    forward, which the sm100a forward template does not render for d64 yet."""
    plan = H.plan_text(H.spec_text(name="bwd_d64_det", d=64, causal=False, det=True))
    bp = plan.backward
    art = C.compile_artifacts(H.backward_only_source(plan), str(tmp_path), backward=True)
    assert C.check_backward_conformance(bp, art) == [], C.report(C.check_backward_conformance(bp, art))
    f = C.backward_mlir_facts(art.mlir)
    assert f.acc["dQ"] == {384} and f.acc["dK"] == {320}
    assert "ld.acquire.gpu" in art.ptx and "red.release.gpu" in art.ptx
    assert len(re.findall(r"^\s*red\.global\.add\.v4\.f32", art.ptx, re.M)) == 16


@pytest.mark.slow
def test_compile_only_builds_forward_and_both_backward_variants(tmp_path):
    """The module contract: compile_only() builds every kernel without a GPU, here the forward and
    the bf16 and GQA (fp32 dK/dV) backward (in a subprocess: CuTe DSL reads CUTE_DSL_ARCH at import)."""
    import os
    import subprocess
    import sys

    mod = tmp_path / "module.py"
    mod.write_text(sm100.render(H.example_plan()))
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('m', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); print(m.compile_only('sm_100a'))")
    r = subprocess.run([sys.executable, "-c", code, str(mod)], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, CUTE_DSL_ARCH="sm_100a"), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    name = H.example_plan().spec.name
    assert r.stdout.strip().splitlines()[-1] == repr([name + ".forward", name + ".backward", name + ".backward_gqa"])
