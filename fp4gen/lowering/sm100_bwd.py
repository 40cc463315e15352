"""sm100a backward: a finished ``KernelPlan`` -> the Python source of the backward section.

The section (``templates/sm100/bwd.py.j2``) is appended to the forward module rendered
by ``sm100.py``. It is self-contained (its own lazy CuTe DSL imports, names prefixed
``_bwd``/``BWD_``) and defines, at module level,

- ``backward(q, k, v, o, lse, do, *, softmax_scale=None) -> (dq, dk, dv)``
- ``compile_only_backward(arch="sm_100a", variants=("bf16", "gqa")) -> list[str]``

It reads ``KERNEL_NAME``, ``SOFTMAX_SCALE`` and ``_require_sm100`` from the forward part.
Every decision comes from the ``BackwardPlanSm100``
(``fp4gen.ir.passes.backward_sm100.plan_backward_sm100``); this file turns it into a
jinja2 context (its ``BackwardKernelConfig`` configures the kernel class,
``fp4gen.device.sm100.backward.AttentionBwdSm100``) and refuses plans the kernel cannot express.
"""
from __future__ import annotations

import dataclasses

from fp4gen.device.sm100.config import BackwardKernelConfig
from fp4gen.ir.passes.backward_sm100 import P_FP8_SCALE_LOG2

from . import Comment, LoweringError, template_env

TEMPLATE = "bwd.py.j2"
# TMEM regions the template addresses (all must be in the backward plan's map)
REGIONS = ("S", "P", "dP", "dV", "dK", "dQ")
# warps the template numbers, in order: compute 0-3, dQ 4-7, MMA 8, load 9, spare 10-11
ROLE_WARPS = (("compute", 4), ("dq", 4), ("mma", 1), ("load", 1), ("spare", 2))


def backward_plan(plan):
    """The plan's BackwardPlanSm100: the one the planner recorded, else planned here (raises
    PlanError with the spec line when the sm100a backward refuses the spec)."""
    from fp4gen.ir.passes.backward_sm100 import BackwardPlanSm100, plan_backward_sm100

    bp = getattr(plan, "backward", None)
    if isinstance(bp, BackwardPlanSm100):
        return bp
    return plan_backward_sm100(plan)


def context(plan, bp=None) -> dict:
    spec = plan.spec
    if spec.target.value != "sm100a":
        raise LoweringError(f"the sm100a backward got a plan for {spec.target.value}")
    if spec.backward is None:
        raise LoweringError(f"kernel {spec.name!r} has no backward block")
    bp = bp if bp is not None else backward_plan(plan)
    fmts = {m.name: m.operand_format for m in bp.mmas}
    do_fp8 = fmts["dP"] == "fp8"
    want = {"S": "bf16", "dK": "bf16", "dQ": "bf16", "dP": fmts["dP"], "dV": fmts["dP"]}
    if fmts != want or fmts["dP"] not in ("bf16", "fp8"):
        raise LoweringError(f"the sm100a backward template runs S^T, dK and dQ in bf16 and dP^T, dV in bf16 or "
                            f"(with an FP8 dO) FP8; the plan asks {fmts}")
    do_fmt = bp.grad_format("dO")
    if do_fp8 != do_fmt.startswith("fp8"):
        raise LoweringError(f"dP^T / dV MMAs in {fmts['dP']} but dO : {do_fmt}")
    if do_fp8:  # the kernel's FP8 operand types: V and P^T E4M3, dO its own
        for name in ("dP", "dV"):
            got = next(m for m in bp.mmas if m.name == name).formats()
            if got != ("fp8e4m3", do_fmt):
                raise LoweringError(f"the sm100a backward's {name} MMA reads E4M3 x {do_fmt}; the plan has {got}")
    if bp.tile_m != 128 or bp.tile_n != 128 or bp.head_dim not in (64, 128):
        raise LoweringError(f"the sm100a backward template is written for 128 x 128 tiles and head_dim 64/128; "
                            f"plan has {bp.tile_m} x {bp.tile_n}, head_dim {bp.head_dim}")
    roles = tuple((r.name, r.warps) for r in bp.roles)
    if roles != ROLE_WARPS:
        raise LoweringError(f"the sm100a backward template numbers its warps {ROLE_WARPS}; the plan has {roles}")
    regs = {r.name: r.registers for r in bp.roles}
    if len({regs["mma"], regs["load"], regs["spare"]}) != 1:
        raise LoweringError(f"setmaxnreg works per warpgroup: mma, load and spare warps share one budget ({regs})")
    cols = {r.name: (r.first_col, r.last_col) for r in bp.tmem.regions}
    missing = [n for n in REGIONS if n not in cols]
    if missing:
        raise LoweringError(f"the backward TMEM map lacks {', '.join(missing)}")
    if cols["P"][0] != cols["S"][0]:
        # the compute thread stores P^T chunk c (16 columns) over S^T chunk c // 2, which it has
        # already loaded; any other offset would overwrite scores it still has to read
        raise LoweringError(f"the template writes P^T over the first columns of S^T (P at {cols['P'][0]}, "
                            f"S at {cols['S'][0]})")
    per = 4 if do_fp8 else 2  # queries per 32-bit TMEM column: E4M3 or bf16 P^T
    if cols["P"][1] - cols["P"][0] + 1 != bp.tile_m // per:
        raise LoweringError(f"P^T is {bp.tile_m} {'E4M3' if do_fp8 else 'bf16'} queries = {bp.tile_m // per} "
                            f"columns; plan has {cols['P']}")

    summary = [
        f"tiles: {bp.tile_m} queries x {bp.tile_n} keys; warps: "
        + ", ".join(f"{r.name} {r.warps} ({r.registers} regs)" for r in bp.roles),
        "MMAs: " + "; ".join(f"{m.formula} (A {m.a_source} {m.a_major}-major, B {m.b_major}-major, acc TMEM {m.accumulator})"
                             for m in bp.mmas),
        "TMEM (alloc " + str(bp.tmem.alloc_columns) + "): " + ", ".join(
            f"{r.name} {r.first_col}-{r.last_col}" + (f" (over {r.alias_of})" if r.alias_of else "")
            for r in bp.tmem.regions),
        f"SMEM {bp.smem_bytes} of {bp.smem_limit} B (Q/dO stages {bp.q_stages}); {bp.mbarriers} mbarriers",
        f"dQ: {bp.dq_reduction}; dK/dV: {bp.dkv_output}",
        f"pre: {bp.preprocess}",
        f"post: {bp.postprocess}",
        "reuse: " + " ".join(bp.reuse) + "; gradients: " + ", ".join(f"{n} {f}" for n, f in bp.grad_formats),
    ]
    gaps = [
        "never run: the kernel compiles for sm_100a and conforms statically (TMEM columns, MMA kinds and "
        "counts, barriers), but no Blackwell GPU has executed it",
        "P^T reaches TMEM through the dV MMA's own A-operand fragment (tcgen05.make_tmem_copy of it, as "
        "CUTLASS's Blackwell fmha backward does); how the hardware reads that layout is unverified",
        "LSE2 and D are read from global memory (16-byte loads, the same addresses in every compute thread), "
        "not staged in SMEM by the load warp",
        "dK/dV rows are written with scalar global stores by the compute threads (no SMEM + TMA store)",
        "dQ is reduced with red.global.add.v4.f32 from registers, not SMEM + TMA reduce-add",
        "one CTA per key tile (no persistent scheduler, no 2-CTA MMA); serial per query tile (no overlap of "
        "the next tile's S^T with this tile's dS^T)",
    ]
    warps, first = {}, 0
    for name, n in roles:
        warps[name] = tuple(range(first, first + n))
        first += n
    config = BackwardKernelConfig(
        head_dim=bp.head_dim,
        tile_m=bp.tile_m,
        tile_n=bp.tile_n,
        q_stages=bp.q_stages,
        causal=bp.causal,
        deterministic=bp.deterministic,
        do_fp8=do_fp8,
        do_format=do_fmt[len("fp8"):] if do_fp8 else "bf16",
        p_fp8_scale_log2=P_FP8_SCALE_LOG2,
        dq_aliases_dp=bp.dq_aliases_dp,
        compute_warps=warps["compute"],
        dq_warps=warps["dq"],
        mma_warp=warps["mma"][0],
        load_warp=warps["load"][0],
        n_warps=sum(w for _, w in roles),
        regs_compute=regs["compute"],
        regs_dq=regs["dq"],
        regs_other=regs["mma"],
        # setmaxnreg.inc for budgets above the launch share, .dec otherwise (per warpgroup)
        regs_compute_increase=regs["compute"] > bp.registers_at_launch,
        regs_dq_increase=regs["dq"] > bp.registers_at_launch,
        regs_other_increase=regs["mma"] > bp.registers_at_launch,
        tmem_alloc_cols=bp.tmem.alloc_columns,
        tmem=tuple((r.name, r.first_col, r.last_col) for r in bp.tmem.regions),
    )
    return dict(
        kernel_name=Comment(spec.name),
        origins={k: Comment(spec.origin(path)) for k, path in (
            ("backward", "backward"), ("reuse", "backward.reuse"), ("mask", "mask"),
            ("deterministic", "backward.deterministic"))},
        # the section's header comment: the plan in words, then the status and its known gaps
        header=[Comment("  " + line) for line in summary] + [
            Comment("STATUS: compiled for sm_100a and checked statically (fp4gen.lowering.conformance."),
            Comment("check_backward_conformance); never run on Blackwell hardware. Known gaps:")] + [
            Comment("  - " + gap) for gap in gaps],
        config=config,
        # the config literal's keywords: the template renders each value through | pyrepr
        config_fields=[(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)],
    )


def kernel_config(plan, bp=None) -> BackwardKernelConfig:
    """The ``BackwardKernelConfig`` the generated module renders (``context(plan)["config"]``)."""
    return context(plan, bp)["config"]


def render_backward(plan, bp=None) -> str:
    """Source text of the backward section for ``plan`` (append to the sm100a forward module);
    ``bp`` overrides the plan's backward plan (tests render deliberately wrong plans)."""
    return template_env("sm100").get_template(TEMPLATE).render(**context(plan, bp))
