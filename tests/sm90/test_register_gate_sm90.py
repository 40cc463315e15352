"""The register and spill gate for sm90a kernels (``fp4gen verify``, ``verify.verify_sm90``).

Fast tests: the checks on hand-written PTX headers and ptxas logs, one planted fault each (a
spill, a setmaxnreg or a C7508 in a helper kernel; a plan budget that the attention kernel does
not set), and how compiled kernels are sorted into rows. The slow one compiles the input
quantizers, and the transposing ones again without their launch bound (the 8 B spill the gate
found). ``fp4gen verify`` of the FP8 training example, every kernel its module launches, is in
tests/cli/test_cli_verify.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from fp4gen.lowering import ptxas as G
from fp4gen.lowering import verify as V

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# the sm90a forward's shape: 3 warpgroups (producer + 2 consumers), one CTA per SM
ATTENTION_PTX = """.version 9.4
.target sm_90a
.visible .entry kernel_cutlass_kernel_mSm90Fwd_0(
)
.reqntid 384, 1, 1
.minnctapersm 1
{
\tsetmaxnreg.dec.sync.aligned.u32 \t24;
\tsetmaxnreg.inc.sync.aligned.u32 \t240;
}
"""
HELPER_PTX = """.version 9.4
.target sm_90a
.visible .entry kernel_cutlass_kernel_fp4gendevicequantize_BlockQuant_0(
)
.reqntid 256, 1, 1
{
}
"""


def log(registers=168, spill_st=0, spill_ld=0, remark=""):
    return (remark + "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
            "ptxas info    : Function properties for k\n"
            f"    {spill_st} bytes stack frame, {spill_st} bytes spill stores, {spill_ld} bytes spill loads\n"
            f"ptxas info    : Used {registers} registers, used 1 barriers\n")


C7508 = ("ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine "
         "register count at entry.\n")


def helper_checks(ptx=HELPER_PTX, text=log(registers=64)):
    return {m.check for m in G.check_helper(ptx, G.parse_report(text))}


def test_a_conforming_helper_kernel_passes():
    assert helper_checks() == set()


@pytest.mark.parametrize("fault, expected", [
    (dict(text=log(registers=64, spill_st=8, spill_ld=8)), {"ptxas.spills"}),  # the quantizer's 8 + 8 B
    (dict(text=log(registers=64, spill_ld=4)), {"ptxas.spills"}),
    (dict(ptx=HELPER_PTX.replace("{\n}", "{\n\tsetmaxnreg.inc.sync.aligned.u32 \t96;\n}")), {"ptx.setmaxnreg"}),
    (dict(text=log(registers=64, remark=C7508)), {"ptxas.C7508"}),
])
def test_each_planted_fault_in_a_helper_kernel_is_caught(fault, expected):
    assert helper_checks(**fault) == expected


@pytest.fixture(scope="module")
def train_plan():
    from fp4gen.frontend import parse_file
    from fp4gen.ir.passes import plan_kernel

    (spec,) = [s for s in parse_file(EXAMPLES / "sm90_fp8_train_d128.attn") if s.name == "sm90_fp8_train_causal_d128"]
    return plan_kernel(spec)


def test_the_budgets_are_the_plans(train_plan):
    """Forward from ``plan.sm90``, backward from ``plan.backward``; both fit one CTA's 64K registers."""
    for part, p in (("forward", train_plan.sm90), ("backward", train_plan.backward)):
        budgets = V._sm90_role_budgets(train_plan, part)
        assert budgets == {"producer": p.producer_registers, "consumer": p.consumer_registers}
        assert 128 * budgets["producer"] + 256 * budgets["consumer"] <= 65536


def attention_checks(budgets, ptx=ATTENTION_PTX, text=log()):
    return {m.check for m in G.check_registers(ptx, G.parse_report(text), budgets=budgets,
                                               spill_budget_bytes=V.SM90_SPILL_BUDGET_BYTES)}


def test_the_attention_kernel_with_the_plans_budgets_passes(train_plan):
    assert attention_checks(V._sm90_role_budgets(train_plan, "forward")) == set()


@pytest.mark.parametrize("wrong", [dict(producer=32), dict(consumer=232)])
def test_a_budget_the_kernel_does_not_set_is_caught(train_plan, wrong):
    """The plan says one count, the PTX sets another: both 'never set' and 'not the plan's'."""
    budgets = {**V._sm90_role_budgets(train_plan, "forward"), **wrong}
    assert attention_checks(budgets) == {"ptx.setmaxnreg"}


def test_spills_and_ignored_budgets_in_an_attention_kernel_are_caught(train_plan):
    budgets = V._sm90_role_budgets(train_plan, "forward")
    assert attention_checks(budgets, text=log(spill_st=16, spill_ld=16)) == {"ptxas.spills"}
    assert attention_checks(budgets, ptx=ATTENTION_PTX.replace(".minnctapersm 1\n", ""),
                            text=log(registers=168, remark=C7508)) == {"ptx.minnctapersm", "ptxas.C7508"}


@pytest.mark.parametrize("name, entry, part", [
    ("k", "kernel_cutlass_kernel_mKSm90Fwd_object_at_", "forward"),
    ("k.backward_gqa", "kernel_cutlass_kernel_mKSm90Bwd_object_at_", "backward"),
    ("fp8_quantize_block_qt_d128", "kernel_cutlass_kernel_fp4gendevicequantize_BlockQuant_object_at_", "quantizers"),
    ("bwd_post_d128", "kernel_cutlass_kernel_fp4gendevicebwd_prep_Post_object_at_", "bwd-prep"),
])
def test_kernels_are_sorted_into_rows(name, entry, part):
    assert V.sm90_part("k", name, entry) == part


@pytest.mark.parametrize("name, entry", [
    ("fp8_quantize_block_d128", "kernel_cutlass_kernel_fp4gendevicebwd_prep_Pre_object_at_"),  # out of order
    ("k", "kernel_cutlass_kernel_fp4gendevicequantize_VTranspose_object_at_"),
    ("something_new", "kernel_cutlass_kernel_fp4gendevicequantize_VTranspose_object_at_"),  # unknown name
])
def test_a_kernel_whose_ptx_is_not_the_one_named_is_an_error(name, entry):
    with pytest.raises(RuntimeError):
        V.sm90_part("k", name, entry)


# ------------------------------------------------------------------ compiled (slow)

# The six quantizers as the module compiles them, then the two transposing ones launched the way
# they were before the gate (no launch bound): a planted fault that is the old kernel itself.
QUANTIZERS = """
import cutlass.cute as cute
from fp4gen.device import quantize as Q


class Unbounded(Q._BlockQuant):
    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mS: cute.Tensor, stream):
        self.kernel(mX, mY, mS, None).launch(grid=self._grid(mX, mS), block=[Q.THREADS, 1, 1], stream=stream)


def compile_only(arch):
    names = Q.compile_only(arch, 128)
    Q.compile_once({}, "unbounded", lambda: Unbounded(128, False), lambda: Q._fake_args("block", 128),
                   tvm_ffi=False)
    names.append("unbounded_block")
    return names
"""


@pytest.mark.slow
def test_the_quantizers_spill_nothing_and_without_the_launch_bound_they_spill():
    """The gate found 8 + 8 B of spills in the transposing quantizers and, after the strided
    loads (a9e412e), 12 B in the plain payload kernel (ptxas 13.5 aimed them at 64 registers);
    with .minnctapersm 1 they spill nothing, and the plain kernel's unbounded launch still does
    (the transposing ones no longer spill unbounded: that fault is gone from the real code)."""
    kept = G.compile_kept(QUANTIZERS, "sm_90a")
    assert [k.name for k in kept] == [f"fp8_quantize_{kind}_d128" for kind in
                                      ("block", "amax", "vt", "vt_nat", "block_qt", "block_kt")] + \
        ["unbounded_block"]
    for k in kept[:6]:
        assert G.check_helper(k.ptx, G.assemble(k.ptx)) == [], k.name
    for k in kept[6:]:
        assert ".minnctapersm" not in k.ptx
        assert {m.check for m in G.check_helper(k.ptx, G.assemble(k.ptx))} == {"ptxas.spills"}, k.name
