"""sm90a backward: a finished ``KernelPlan`` -> the Python source of the backward section.

The section (functions, a kernel class, host code) is appended to the forward module
rendered by ``sm90.py``; it is self-contained (its own imports, names prefixed
``_bwd``/``BWD_``) and defines, at module level,

- ``backward(q, k, v, o, lse, do, *, softmax_scale=None) -> (dq, dk, dv)``
- ``compile_only_backward(arch) -> list[str]``

and reads ``KERNEL_NAME`` from the forward part. All decisions come from the
``BackwardPlan`` (``fp4gen.ir.passes.backward.plan_backward``); this file only turns
it into a jinja2 context.
"""
from __future__ import annotations


from . import Comment, LoweringError, identifier, template_env

TEMPLATE = "bwd.py.j2"


def backward_plan(plan):
    """The plan's BackwardPlan: the one the planner recorded, else planned here."""
    bp = getattr(plan, "backward", None)
    if bp is not None:
        return bp
    from fp4gen.ir.passes.backward import plan_backward

    return plan_backward(plan)


def context(plan) -> dict:
    from fp4gen.numerics import backward_rules as rules  # FP8 dS's scale rule, the oracle's too
    from fp4gen.ir.spec import Target

    spec = plan.spec
    if spec.target is not Target.SM90A:
        raise LoweringError(f"sm90 backward got a plan for target {spec.target.value}")
    if spec.backward is None:
        raise LoweringError(f"kernel {spec.name!r} has no backward block")
    bp = backward_plan(plan)
    fmts = {m.name: m.operand_format for m in bp.mmas}
    # FP8 dS (dK and dQ in FP8) exists only on top of FP8 S and FP8 dP/dV: it reads the forward's
    # FP8 Q/K payloads (transposed copies) and bounds its scale with dO's and V's
    ds_ok = fmts["dK"] == fmts["dQ"] == "bf16" or \
        fmts["dK"] == fmts["dQ"] == fmts["S"] == fmts["dP"] == "fp8e4m3"
    if not ds_ok or fmts["dV"] != fmts["dP"] or not {fmts["S"], fmts["dP"]} <= {"bf16", "fp8e4m3"}:
        raise LoweringError(f"the sm90 backward template has no variant for MMA formats {fmts}")
    if bp.tile_n != 64 * bp.mma_warpgroups or bp.tile_m != 64:
        raise LoweringError(f"sm90 backward tiles must be 64 x (64 x warpgroups), got {bp.tile_m} x {bp.tile_n}")
    if bp.mma_warpgroups != 2:
        # the dQ accumulator's fragment order (fp4gen.device.bwd_prep.dq_fragment_index, which the
        # post-processing kernel undoes) is that of two warpgroups splitting the head dim
        raise LoweringError(f"the sm90 backward's dQ layout needs 2 MMA warpgroups, the plan has {bp.mma_warpgroups}")
    name = spec.name
    summary = [
        f"tiles: {bp.tile_m} queries x {bp.tile_n} keys, {bp.mma_warpgroups} MMA warpgroups + a TMA warp "
        "and a dQ warp, "
        f"Q/dO stages {bp.q_stages}, dS stages {bp.ds_stages}, SMEM {bp.smem_bytes} B",
        "MMAs: " + "; ".join(f"{m.formula} (A {m.a_source})" for m in bp.mmas),
        f"dQ: {bp.dq_reduction}; dK/dV: {bp.dkv_output}",
        f"pre: {bp.preprocess}",
        f"post: {bp.postprocess}",
        "reuse: " + " ".join(bp.reuse) + "; gradients: " + ", ".join(f"{n} {f}" for n, f in bp.grad_formats),
    ]
    return dict(
        kernel_name=Comment(name),
        class_name=identifier("".join(p.capitalize() for p in name.replace("-", "_").split("_")) + "Sm90Bwd"),
        s_fp8=fmts["S"] == "fp8e4m3",
        do_fp8=fmts["dP"] == "fp8e4m3",
        ds_fp8=bp.ds_fp8,  # dK += dS^T Q and dQ = dS K in FP8 (dS : fp8e4m3)
        # FP8 dS's scale rule, as the numerics oracle has it (reference.fp8_ds_tile_scale)
        ds_small=rules.FP8_DS_SMALL, ds_headroom=rules.FP8_DS_HEADROOM,
        ds_halve_min_log2=rules.FP8_DS_HALVE_MIN_LOG2,
        origins={k: Comment(spec.origin(path)) for k, path in (
            ("backward", "backward"), ("mask", "mask"), ("reuse", "backward.reuse"),
            ("deterministic", "backward.deterministic"), ("ds", "backward.dS"))},
        head_dim=bp.head_dim,
        causal=bp.causal,
        tile_m=bp.tile_m,
        tile_n=bp.tile_n,
        mma_wgs=bp.mma_warpgroups,
        q_stages=bp.q_stages,
        ds_stages=bp.ds_stages,
        deterministic=bp.deterministic,
        producer_regs=bp.producer_registers,
        consumer_regs=bp.consumer_registers,
        plan_summary=[Comment(line) for line in summary],
    )


def render_backward(plan) -> str:
    """Source text of the backward section for ``plan`` (append to the forward module)."""
    return template_env("sm90").get_template(TEMPLATE).render(**context(plan))
