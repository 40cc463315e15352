"""sm90a backward: a finished ``KernelPlan`` -> the Python source of the backward section.

The section is appended to the forward module rendered by ``sm90.py`` and reads
``KERNEL_NAME`` from it. It renders the plan's decisions as the kernel library's config
(``fp4gen.device.sm90.backward.BackwardConfig``: the kernel class lives there) and binds
the host side (``fp4gen.runtime.sm90_bwd_host.BackwardHost``); at module level it defines

- ``backward(q, k, v, o, lse, do, *, softmax_scale=None, prepared=None) -> (dq, dk, dv)``
- ``compile_only_backward(arch) -> list[str]``

All decisions come from the ``BackwardPlan`` (``fp4gen.ir.passes.backward.plan_backward``);
this file only turns it into a jinja2 context.
"""
from __future__ import annotations

from . import Comment, LoweringError, template_env

TEMPLATE = "bwd.py.j2"


def backward_plan(plan):
    """The plan's BackwardPlan: the one the planner recorded, else planned here."""
    bp = getattr(plan, "backward", None)
    if bp is not None:
        return bp
    from fp4gen.ir.passes.backward import plan_backward

    return plan_backward(plan)


# BackwardConfig's fields that are BackwardPlan fields of the same name (besides: the three FP8
# choices, read off the MMA formats, and the MMA majors)
CONFIG_FIELDS = ("head_dim", "causal", "tile_m", "tile_n", "mma_warpgroups", "q_stages", "ds_stages",
                 "deterministic", "producer_registers", "consumer_registers")
MMA_ORDER = ("S", "dP", "dV", "dK", "dQ")  # = fp4gen.device.sm90.backward.MMA_NAMES (test_render_contract)


def context(plan) -> dict:
    from fp4gen.ir.spec import Mask, Target

    spec = plan.spec
    if spec.target is not Target.SM90A:
        raise LoweringError(f"sm90 backward got a plan for target {spec.target.value}")
    if spec.backward is None:
        raise LoweringError(f"kernel {spec.name!r} has no backward block")
    lacking = [f for f in spec.uses_extensions if f not in ("mask", "softcap")]
    if lacking:  # legalize refuses them at their spec lines first
        raise LoweringError(f"the sm90a backward kernel does not implement {', '.join(lacking)}", lacking[0])
    bp = backward_plan(plan)
    fmts = {m.name: m.operand_format for m in bp.mmas}
    # FP8 dS (dK and dQ in FP8) exists only on top of FP8 S and FP8 dP/dV: it reads the forward's
    # FP8 Q/K payloads (transposed copies) and bounds its scale with dO's and V's
    ds_ok = fmts["dK"] == fmts["dQ"] == "bf16" or \
        fmts["dK"] == fmts["dQ"] == fmts["S"] == fmts["dP"] == "fp8e4m3"
    if not ds_ok or fmts["dV"] != fmts["dP"] or not {fmts["S"], fmts["dP"]} <= {"bf16", "fp8e4m3"}:
        raise LoweringError(f"the sm90 backward kernel has no variant for MMA formats {fmts}")
    if bp.tile_n != 64 * bp.mma_warpgroups or bp.tile_m != 64:
        raise LoweringError(f"sm90 backward tiles must be 64 x (64 x warpgroups), got {bp.tile_m} x {bp.tile_n}")
    if bp.mma_warpgroups != 2:
        # the dQ accumulator's fragment order (fp4gen.device.bwd_prep.dq_fragment_index, which the
        # post-processing kernel undoes) is that of two warpgroups splitting the head dim
        raise LoweringError(f"the sm90 backward's dQ layout needs 2 MMA warpgroups, the plan has {bp.mma_warpgroups}")
    mmas = {m.name: m for m in bp.mmas}
    if tuple(sorted(mmas)) != tuple(sorted(MMA_ORDER)):
        raise LoweringError(f"the sm90 backward kernel runs the MMAs {MMA_ORDER}, the plan has {tuple(mmas)}")
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
    flags = dict(
        s_fp8=fmts["S"] == "fp8e4m3",  # S^T = K Q^T from the forward's FP8 Q/K payloads (reuse q k)
        do_fp8=fmts["dP"] == "fp8e4m3",  # dP^T = V dO^T and dV += P^T dO with FP8 dO, V, P
        ds_fp8=bp.ds_fp8,  # dK += dS^T Q and dQ = dS K in FP8 (dS : fp8e4m3)
    )
    config = {field: getattr(bp, field) for field in CONFIG_FIELDS}
    config.update(flags)
    # the fields with a default, rendered only when the spec sets them (the modules of specs
    # without them stay as they were)
    if spec.mask is Mask.WINDOW:
        config["window"] = tuple(spec.window_size)
    if spec.softcap:
        config["softcap"] = float(spec.softcap)
    return dict(
        kernel_name=Comment(name),
        origins={k: Comment(spec.origin(path)) for k, path in (
            ("backward", "backward"), ("mask", "mask"), ("reuse", "backward.reuse"),
            ("deterministic", "backward.deterministic"), ("ds", "backward.dS"), ("softcap", "softcap"))},
        config=config,
        mmas=[dict(formula=Comment(mmas[n].formula), a_source=Comment(mmas[n].a_source),
                   a_major=mmas[n].a_major, b_major=mmas[n].b_major,
                   operand_format=Comment(mmas[n].operand_format)) for n in MMA_ORDER],
        causal=bp.causal,
        tile_m=bp.tile_m,
        tile_n=bp.tile_n,
        plan_summary=[Comment(line) for line in summary],
        **flags,
    )


def render_backward(plan) -> str:
    """Source text of the backward section for ``plan`` (append to the forward module)."""
    return template_env("sm90").get_template(TEMPLATE).render(**context(plan))
