"""sm90a backend: a finished ``KernelPlan`` -> CuTe DSL Hopper forward module source.

The kernel is one library class (``fp4gen.device.sm90.forward``); this file derives its
``ForwardConfig`` from the plan (``config``), refuses plans the kernel cannot run (those
should have been refused by the planner), and renders ``templates/sm90/fwd.py.j2``: the
module's docstring, ``PLAN_JSON``, the config literal with the spec line behind each value,
the roles the plan lays out, and the binding to the runtime (``fp4gen.runtime.sm90_host``).
"""
from __future__ import annotations

import dataclasses

from . import Code, Comment, LoweringError, plan_json, pyrepr, template_env

TEMPLATE = "fwd.py.j2"


def context(plan) -> dict:
    from fp4gen.ir.spec import Format, PKind, ScaleGranularity, Target

    spec = plan.spec
    sm = plan.sm90
    if spec.target is not Target.SM90A:
        raise LoweringError(f"sm90 backend got a plan for target {spec.target.value}")
    if sm is None:
        raise LoweringError("plan has no sm90 section (run the planner for target sm90a)")
    from fp4gen.ir.passes.legalize import HEAD_DIMS

    if spec.head_dim not in HEAD_DIMS[Target.SM90A]:
        raise LoweringError(f"sm90 forward supports head_dim {', '.join(map(str, HEAD_DIMS[Target.SM90A]))}, "
                            f"not {spec.head_dim}", "head_dim")
    fq, fk, fv, fp = spec.q.format, spec.k.format, spec.v.format, spec.p.format
    if {fq, fk, fv} == {Format.BF16}:
        in_fp8 = False
        if fp is not Format.BF16 or spec.p_production.kind is not PKind.EXP:
            raise LoweringError("BF16 Q/K/V on sm90 take P as bf16 via exp", "P")
        p_mode = "bf16"
    elif {fq, fk, fv} == {Format.FP8E4M3}:
        in_fp8 = True
        if fp is not Format.FP8E4M3:
            raise LoweringError(f"FP8 Q/K/V on sm90 need P as fp8e4m3, got {fp.value}", "P")
        if not sm.v_transposed:
            raise LoweringError("FP8 PV needs V transposed (K-major) on sm90")
        # the kernel's scale contract (numerics: Hopper FP8): Q, K one fp32 scale per
        # 128-token block (= one key/query tile), V one fp32 scale per (batch, head)
        for name, f in (("Q", spec.q), ("K", spec.k)):
            if f.granularity is not ScaleGranularity.BLOCK or f.block != 128:
                raise LoweringError(
                    f"sm90 FP8 takes {name} with one fp32 scale per 128-token block "
                    f"({name} : fp8e4m3(block=128)), got {f}", name)
        if spec.v.granularity is not ScaleGranularity.TENSOR:
            raise LoweringError(f"sm90 FP8 takes V with one scale per tensor (V : fp8e4m3(scale=tensor)), got {spec.v}", "V")
        kind = spec.p_production.kind
        if kind is PKind.EXP:
            p_mode = "fp8_exp"
        elif kind is PKind.DIRECT_P:
            p_mode = "fp8_directp"
        else:
            raise LoweringError(f"P via {kind.value} is not available on sm90", "P.via")
    else:
        raise LoweringError(
            f"sm90 takes Q/K/V all bf16 or all fp8e4m3, got {fq.value}/{fk.value}/{fv.value}",
            next(n for n, f in (("Q", fq), ("K", fk), ("V", fv)) if f is not fq) if len({fq, fk, fv}) > 1 else "Q")
    if spec.o.format is not Format.BF16:
        raise LoweringError(f"sm90 writes O as bf16, not {spec.o.format.value}", "O")
    if sm.tile_m != 64 * sm.consumer_warpgroups:
        raise LoweringError(f"tile_m {sm.tile_m} must be 64 x consumer_warpgroups ({sm.consumer_warpgroups})")
    if sm.tile_m != 128:
        raise LoweringError(f"the sm90 forward runs 128-row query tiles (2 consumer warpgroups), got {sm.tile_m} x {sm.tile_n}",
                            "schedule.tile")
    if sm.tile_n % 16 or not 64 <= sm.tile_n <= 128:
        # the bf16 PV MMA steps 16 keys; more than 128 keys of S do not fit beside O in registers
        raise LoweringError(f"the sm90 forward runs 64..128 keys per tile in steps of 16, got {sm.tile_m} x {sm.tile_n}",
                            "schedule.tile")
    if in_fp8 and sm.tile_n != 128:
        # one K scale per 128-token block is one scale per key tile (ForwardKernel.tile_mult)
        raise LoweringError(f"sm90 FP8 runs 128-key tiles (one K scale block each), got {sm.tile_m} x {sm.tile_n}",
                            "schedule.tile")
    if sm.kv_stages < 2:
        raise LoweringError("sm90 needs at least 2 K/V stages", "schedule.kv_stages")
    if sm.pingpong and not sm.intra_warpgroup_overlap:
        raise LoweringError("sm90 ping-pong is implemented together with intra-warpgroup overlap")

    origins = {k: Comment(spec.origin(k)) for k in ("Q", "K", "P", "V", "O", "mask", "head_dim")}
    for k in ("softcap", "sinks", "layout"):
        origins[k] = Comment(spec.origin(k))
    origins["schedule"] = Comment(spec.origin("schedule.tile"))
    cfg = _config(plan, in_fp8, p_mode)
    return dict(
        kernel_name=Comment(spec.name),
        spec_file=Comment(spec.source_file),
        plan_json=plan_json(plan),
        has_transforms=bool(spec.transforms),  # the module applies the spec's outlier transforms
        origins=origins,
        config=cfg,
        config_fields=_config_fields(cfg, origins),
        structure=_structure(plan),
        summary=_summary(cfg),
        origin_lines=_origin_lines(cfg, origins),
        forward_note=_forward_doc(cfg)[0],
        forward_doc=_forward_doc(cfg)[1],
    )


# ------------------------------------------------------------------ the module's prose
# Written here from the config's values rather than as jinja branches: the template keeps
# the module's structure, these functions what it says about the variant.


def _summary(cfg) -> list:
    """The module docstring's description of the variant, one Comment per line."""
    if cfg.in_fp8:
        p = ("by FP8 Direct-P (E4M3 codes from float arithmetic, no exp)" if cfg.p_mode == "fp8_directp"
             else "= e4m3(2^8 exp2(x - m))")
        lines = [f"Q, K, V in FP8 E4M3 with fp32 scales (Q, K per {cfg.quant_block}-token block, V per head);",
                 f"P {p}, O in bf16."]
    else:
        lines = ["Q, K, V, P in BF16, fp32 accumulation, O in bf16."]
    mask = f"window{pyrepr(cfg.window)}" if cfg.window else "causal" if cfg.causal else "no mask"
    extras = "".join([f", softcap {pyrepr(cfg.softcap)} (MUFU tanh)" if cfg.softcap else "",
                      ", a learned sink logit per head" if cfg.sinks else "",
                      ", packed variable-length sequences (varlen)" if cfg.varlen else ""])
    overlap = "".join([", softmax of tile n overlapped with QK^T of tile n+1" if cfg.intra_wg_overlap else "",
                       ", warpgroups take turns on the tensor cores" if cfg.pingpong else ""])
    lines += [f"head_dim {cfg.head_dim}, {mask}{extras}; tile {cfg.tile_m} x {cfg.tile_n},",
              f"{cfg.consumer_wgs} consumer warpgroups (64 query rows each) + 1 producer warp (TMA),",
              f"{cfg.kv_stages} K/V stages{overlap}."]
    return [Comment(x) for x in lines]


def _origin_lines(cfg, origins) -> list:
    """(name, spec line) of each choice the module docstring cites."""
    keys = ["Q", "K", "P", "V", "O", "mask"] + (["sinks"] if cfg.sinks else []) + \
        (["layout"] if cfg.varlen else []) + ["head_dim", "schedule"]
    return [(k, origins[k]) for k in keys]


def _forward_doc(cfg) -> tuple:
    """``forward``'s docstring lines about the variant: (the note after its first line, the
    paragraphs after its Returns line), one Comment per line."""
    note = ["This is a varlen kernel: this dense entry refuses every call; use ``forward_varlen``."] if cfg.varlen else []
    if cfg.in_fp8:
        doc = ["``prepared``: the operands ``quantize_inputs(q, k, v)`` made earlier for these",
               "same q, k, v (with or without ``for_backward``); the quantization is then skipped."]
    else:
        doc = ["``prepared``: unused (BF16 takes q, k, v as they are); accepted for a uniform API."]
    if cfg.causal:
        doc += ["Causal, bottom-right aligned: key j is visible to query i iff j <= i + Sk - Sq."]
    if cfg.window:
        doc += [f"Window (left, right) = {pyrepr(cfg.window)} (-1: unbounded), bottom-right aligned: key j",
                "is visible to query i iff i + Sk - Sq - left <= j <= i + Sk - Sq + right; a row that sees",
                "no key gets o = 0 and lse = -inf."]
    if cfg.softcap:
        doc += [f"Softcap c = {pyrepr(cfg.softcap)}: each scaled score s becomes c * tanh(s / c)."]
    if cfg.sinks:
        doc += ["``sinks`` (H,) float: the sink logit of each query head (required), in the units of the",
                "scaled scores: exp(sinks[h]) joins every row's softmax denominator (and the LSE), with no",
                "value row; a row that sees no key gets o = 0 and lse = its sink."]
    return [Comment(x) for x in note], [Comment(x) for x in doc]


def _structure(plan) -> list:
    """Comment lines on the warp roles and the per-tile MMA order the plan lays out
    (``plan.pipeline``; none for a plan without one, as tests build them)."""
    pipe = plan.pipeline
    if pipe is None:
        return []
    return [Comment(f"role {r.name} ({r.warps} warps, {r.registers} registers): {r.does}") for r in pipe.roles] + \
        [Comment(f"one key tile: {pipe.mma_order}")]


def config(plan):
    """The ``ForwardConfig`` of ``plan`` (a LoweringError for a plan the kernel cannot run):
    the literal the generated module renders, and what tests compare it with."""
    return context(plan)["config"]


def _config(plan, in_fp8: bool, p_mode: str):
    from fp4gen.device.sm90.config import ForwardConfig
    from fp4gen.ir.spec import Layout, Mask, Sinks

    spec, sm = plan.spec, plan.sm90
    return ForwardConfig(
        kernel_name=spec.name,
        head_dim=spec.head_dim,
        causal=spec.mask is Mask.CAUSAL,
        in_fp8=in_fp8,
        p_mode=p_mode,
        # optional plan field (Sm90Plan.l_from_mma): Direct-P's l as P @ ones on the MMA
        l_from_mma=bool(getattr(sm, "l_from_mma", False)) and p_mode == "fp8_directp",
        tile_m=sm.tile_m,
        tile_n=sm.tile_n,
        consumer_wgs=sm.consumer_warpgroups,
        kv_stages=sm.kv_stages,
        intra_wg_overlap=sm.intra_warpgroup_overlap,
        pingpong=sm.pingpong,
        producer_regs=sm.producer_registers,
        consumer_regs=sm.consumer_registers,
        quant_block=spec.q.block if in_fp8 else None,  # the spec's Q/K scale block (checked 128 above)
        window=tuple(spec.window_size) if spec.mask is Mask.WINDOW else None,
        softcap=float(spec.softcap or 0.0),
        sinks=spec.sinks is Sinks.LEARNED,
        varlen=spec.layout is Layout.VARLEN,
    )


# the spec line (origins key) or plan field behind each ForwardConfig value, for its comment
_FIELD_SOURCE = {
    "head_dim": "head_dim", "causal": "mask", "in_fp8": "Q", "p_mode": "P", "quant_block": "Q",
    "tile_m": "schedule", "tile_n": "schedule", "window": "mask", "softcap": "softcap",
    "sinks": "sinks", "varlen": "layout",
}


def _config_fields(cfg, origins) -> list:
    """(name, literal, comment) per ForwardConfig field, in declaration order; a field with a
    default (window, softcap, sinks, varlen) only when the spec sets it, so that the modules of specs
    without one render as before."""
    rows = []
    for f in dataclasses.fields(cfg):
        if f.default is not dataclasses.MISSING and getattr(cfg, f.name) == f.default:
            continue
        value = Code("KERNEL_NAME") if f.name == "kernel_name" else pyrepr(getattr(cfg, f.name))
        src = _FIELD_SOURCE.get(f.name)
        if f.name == "kernel_name":
            note = Comment("the spec's kernel name")
        else:
            note = origins[src] if src else Comment(f"plan: sm90.{_PLAN_FIELD.get(f.name, f.name)}")
        rows.append((Code(f.name), value, note))
    return rows


_PLAN_FIELD = {"consumer_wgs": "consumer_warpgroups", "intra_wg_overlap": "intra_warpgroup_overlap",
               "producer_regs": "producer_registers", "consumer_regs": "consumer_registers"}


def render(plan) -> str:
    """Source text of the generated Hopper module for ``plan``: the forward, plus the
    backward section (``sm90_bwd.render_backward``) when the spec has a backward block."""
    src = template_env("sm90").get_template(TEMPLATE).render(**context(plan))
    if plan.spec.backward is not None:
        from .sm90_bwd import render_backward

        src += "\n\n" + render_backward(plan)
    return src
