"""The register and spill gate (fp4gen/lowering/ptxas.py): ptxas -v's report read back, and
checked against the plan's setmaxnreg budgets and spill allowance.

The fast tests feed the checker hand-written PTX headers and ptxas logs, one planted fault
each, and check that the forward plans allow no spills. The slow ones assemble the paper's kernel as compiled for sm_100a, once as generated
and once with its launch bound removed (the defect the gate was written for: ptxas then
ignores every setmaxnreg, C7508, and spills kilobytes).
"""
from __future__ import annotations

import re

import pytest

from fp4gen.lowering import ptxas as G

BUDGETS = {"softmax0": 192, "softmax1": 192, "correction": 80, "mma": 48, "load": 48}
PTX = """.version 9.4
.target sm_100a
.visible .entry k(
)
.reqntid 512, 1, 1
.minnctapersm 1
{
\tsetmaxnreg.inc.sync.aligned.u32 \t192;
\tsetmaxnreg.dec.sync.aligned.u32 \t80;
\tsetmaxnreg.dec.sync.aligned.u32 \t48;
}
"""
LOG_OK = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_100a'
ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 5 barriers
"""
LOG_C7508 = """ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine register count at entry.
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_100a'
ptxas info    : Function properties for k
    184 bytes stack frame, 408 bytes spill stores, 752 bytes spill loads
ptxas info    : Used 128 registers, used 5 barriers, 184 bytes cumulative stack size
"""


def checks(ptx=PTX, log=LOG_OK, budgets=BUDGETS, spill=0):
    return {m.check for m in G.check_registers(ptx, G.parse_report(log), budgets=budgets, spill_budget_bytes=spill)}


def test_report_is_parsed():
    (r,) = G.parse_report(LOG_C7508)
    assert (r.function, r.registers, r.spill_store_bytes, r.spill_load_bytes, r.stack_frame_bytes) == \
        ("k", 128, 408, 752, 184)
    assert r.codes() == {"C7508"} and r.spills == 1160
    (r,) = G.parse_report(LOG_OK)
    assert r.remarks == () and r.spills == 0


def test_a_conforming_kernel_passes():
    assert checks() == set()


@pytest.mark.parametrize("fault, expected", [
    (dict(ptx=PTX.replace(".minnctapersm 1\n", "")), {"ptx.minnctapersm"}),
    (dict(log=LOG_C7508), {"ptxas.C7508", "ptxas.spills"}),
    (dict(ptx=PTX.replace("u32 \t80;", "u32 \t72;")), {"ptx.setmaxnreg"}),  # a budget the plan lacks
    (dict(ptx=PTX.replace("\tsetmaxnreg.dec.sync.aligned.u32 \t80;\n", "")), {"ptx.setmaxnreg"}),  # never set
    (dict(ptx=PTX.replace("setmaxnreg.dec.sync.aligned.u32 \t80", "setmaxnreg.inc.sync.aligned.u32 \t80")),
     {"ptx.setmaxnreg.direction"}),
    (dict(log=LOG_OK.replace("0 bytes spill stores", "16 bytes spill stores")), {"ptxas.spills"}),
    (dict(log=LOG_OK.replace("Used 128", "Used 96")), {"ptxas.entry_registers"}),
])
def test_each_planted_fault_is_caught(fault, expected):
    assert checks(**fault) == expected


def test_spills_within_the_plans_budget_pass():
    log = LOG_OK.replace("0 bytes spill stores, 0 bytes spill loads", "20 bytes spill stores, 268 bytes spill loads")
    assert checks(log=log, spill=288) == set()
    assert checks(log=log, spill=287) == {"ptxas.spills"}


def test_old_ptxas_gets_the_version_lowered(tmp_path):
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    fake.chmod(0o755)
    assert G._readable_by(PTX, fake).startswith(".version 9.0\n")
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.5, V13.5.37'\n")
    assert G._readable_by(PTX, fake) == PTX


@pytest.mark.parametrize("name", ["fa4_fp4_d128", "fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128"])
def test_forward_plans_allow_no_spills_and_fit_the_register_file(name):
    """Issue 16: every sm100a forward spills nothing, so its plan allows nothing (no per-P-path
    allowance), and its setmaxnreg budgets are legal (PTX ISA 9.7.19.5: multiples of 8 in
    24..256, one per warpgroup) and fit the SM's 64K registers."""
    from fp4gen.frontend import parse_file
    from fp4gen.ir.passes import plan_kernel

    from test_sm100_lowering import EXAMPLES

    pp = plan_kernel(parse_file(EXAMPLES / f"{name}.attn")[0]).pipeline
    assert pp.spill_budget_bytes == 0 and pp.spill_reason == ""
    assert all(r.registers % 8 == 0 and 24 <= r.registers <= 256 for r in pp.roles)
    assert sum(r.threads * r.registers for r in pp.roles) <= 65536
    # the budgets come with their reasons in the plan
    assert any(n.startswith("register budgets per thread") for n in pp.notes)


# ------------------------------------------------------------------ the compiled kernel (slow)


@pytest.fixture(scope="module")
def paper_kernel(tmp_path_factory):
    from fp4gen.frontend import parse_file
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.lowering import conformance as C
    from fp4gen.lowering import sm100

    from test_sm100_lowering import EXAMPLES

    plan = plan_kernel(parse_file(EXAMPLES / "fa4_fp4_d128.attn")[0])
    return plan, C.compile_artifacts(sm100.render(plan), str(tmp_path_factory.mktemp("gate")))


def plan_budgets(plan):
    return {r.name: r.registers for r in plan.pipeline.roles}


@pytest.mark.slow
def test_the_paper_kernel_passes_the_gate(paper_kernel):
    plan, art = paper_kernel
    reports = G.assemble(art.ptx)
    assert len(reports) == 1 and "C7508" not in reports[0].codes()
    assert G.check_registers(art.ptx, reports, budgets=plan_budgets(plan),
                             spill_budget_bytes=plan.pipeline.spill_budget_bytes) == []
    assert reports[0].spills == 0 and plan.pipeline.spill_budget_bytes == 0


@pytest.mark.slow
def test_without_its_launch_bound_the_kernel_fails_the_gate(paper_kernel):
    """The defect as it was: no .minnctapersm, so ptxas ignores setmaxnreg and spills KBs."""
    plan, art = paper_kernel
    ptx = re.sub(r"\.minnctapersm 1\n", "", art.ptx)
    assert ptx != art.ptx
    reports = G.assemble(ptx)
    found = {m.check for m in G.check_registers(ptx, reports, budgets=plan_budgets(plan),
                                                spill_budget_bytes=plan.pipeline.spill_budget_bytes)}
    assert {"ptx.minnctapersm", "ptxas.C7508"} <= found


@pytest.mark.slow
def test_a_softmax_budget_too_small_spills_and_fails_the_gate(paper_kernel):
    """A planted spill, end to end: the softmax warps' setmaxnreg lowered from the plan's 192 to
    136 (and the plan told so, so that only the spills differ) cannot hold a row's 128 scores."""
    plan, art = paper_kernel
    budgets = plan_budgets(plan)
    soft = budgets["softmax0"]
    ptx, n = re.subn(rf"(setmaxnreg\.inc\.sync\.aligned\.u32\s+){soft};", r"\g<1>136;", art.ptx)
    assert n >= 1
    budgets = {k: (136 if v == soft else v) for k, v in budgets.items()}
    reports = G.assemble(ptx)
    assert reports[0].spills > 0
    found = {m.check for m in G.check_registers(ptx, reports, budgets=budgets,
                                                spill_budget_bytes=plan.pipeline.spill_budget_bytes)}
    assert found == {"ptxas.spills"}
