"""sm100a backend: a finished ``KernelPlan`` -> CuTe DSL Blackwell forward module.

``render(plan)`` turns plan fields into a jinja2 context for
``templates/sm100/fwd.py.j2``; it decides nothing the plan did not record:
TMEM columns come from ``plan.tmem``, the publication parts from
``plan.publish``, MMA kinds from ``plan.mma``, KV stages and warp roles from
``plan.pipeline``. Those values become the module's ``ForwardKernelConfig``
(``kernel_config``), which configures the one kernel class,
``fp4gen.device.sm100.forward.AttentionFwdSm100``. What the kernel cannot implement yet is
refused here with a ``LoweringError`` (never silently approximated) or listed in the
generated module's docstring under "Known gaps".
"""
from __future__ import annotations

import dataclasses
import math

from fp4gen.device.sm100.config import ForwardKernelConfig
from fp4gen.numerics.directp import DIRECT_P_GAIN, P_FP8_SCALE

from . import Comment, LoweringError, plan_json, template_env


# TMEM regions the template addresses, by plan name (all must be in plan.tmem)
REQUIRED_REGIONS = ("S0", "S1", "O0", "O1", "P0", "P1")
SCALED_QK_REGIONS = ("SFQ0", "SFK0", "SFQ1", "SFK1")
SCALED_PV_REGIONS = ("SFP0", "SFV0", "SFP1", "SFV1")
# warp roles in the order the template numbers warps (first warp of each role)
ROLE_ORDER = ("softmax0", "softmax1", "correction", "mma", "load", "epilogue", "spare")


def tmem_columns(plan) -> dict[str, tuple[int, int]]:
    """plan.tmem regions as {name: (first_col, last_col)}."""
    if plan.tmem is None:
        raise LoweringError("the sm100a plan has no TMEM section (plan_tmem did not run)")
    return {r.name: (r.first_col, r.last_col) for r in plan.tmem.regions}


def mma(plan, name: str):
    for m in getattr(plan, "mma", ()):
        if m.name == name:
            return m
    raise LoweringError(f"the plan has no MMA choice for {name}")


def role_warps(roles: dict) -> dict:
    """{role: its warp indices}: the plan's roles numbered in ROLE_ORDER (warps 0-3 softmax
    stage 0, 4-7 stage 1, 8-11 correction, 12 MMA, 13 load, then the idle roles)."""
    unknown = sorted(set(roles) - set(ROLE_ORDER))
    if unknown:
        raise LoweringError(f"the sm100a template has no warp role {', '.join(unknown)} (it numbers {ROLE_ORDER})")
    out, first = {}, 0
    for name in ROLE_ORDER:
        out[name] = tuple(range(first, first + roles.get(name, 0)))
        first += roles.get(name, 0)
    return out


def publish_part_cols(plan, p_bits: int) -> int:
    """32-bit words of one row of P per publication part (plan.publish): the kernel writes
    part h at words [h * n, (h + 1) * n) of P's columns, so the parts must be that."""
    parts = plan.publish.parts
    widths = {(p.keys[1] - p.keys[0] + 1) * p_bits // 32 for p in parts}
    if len(widths) != 1:
        raise LoweringError(f"the sm100a template publishes P in parts of equal width; plan.publish has {parts}")
    n = widths.pop()
    for h, p in enumerate(parts):
        if p.keys[0] * p_bits // 32 != h * n or (p.p_columns is not None and tuple(p.p_columns) != (h * n, h * n + n - 1)):
            raise LoweringError(f"P part {p.index} covers keys {p.keys} / columns {p.p_columns}; the sm100a "
                                f"template writes part {h} at columns {h * n}..{h * n + n - 1} of P")
    return n


def kernel_config(plan) -> ForwardKernelConfig:
    """The ``ForwardKernelConfig`` the generated module renders for ``plan``
    (``context(plan)["config"]``)."""
    return context(plan)["config"]


def context(plan) -> dict:
    """The template context for one plan (exposed for tests and the conformance check)."""
    spec = plan.spec
    if spec.target.value != "sm100a":
        raise LoweringError(f"the sm100a backend got a plan for {spec.target.value}")
    if spec.head_dim != 128:
        # D64 fits the TMEM plan but has not been compiled and checked yet (docs/sm100.md)
        raise LoweringError(f"sm100a lowering implements head_dim 128 only (not yet {spec.head_dim})", "head_dim")
    sch = spec.schedule
    if sch.q_stages != 2 or sch.tile_m != 128 or sch.tile_n != 128:
        raise LoweringError("sm100a lowering implements q_stages 2 with a 128 x 128 tile only "
                            f"(plan: q_stages {sch.q_stages}, tile {sch.tile_m} x {sch.tile_n})", "schedule.tile")
    qk, pv = mma(plan, "QK"), mma(plan, "PV")
    if qk.kind != "kind::mxf4nvf4.block_scale.block16":
        raise LoweringError(f"sm100a lowering needs NVFP4 Q/K (kind::mxf4nvf4.block_scale.block16), plan has {qk.kind}", "Q")
    pk = spec.p_production.kind.value
    pf = spec.p.format.value
    if pv.kind == "kind::mxf4nvf4.block_scale.block32" and pk == "direct_p" and pf == "mxfp4":
        p_mode, pv_fp8 = "directp_fp4", False
    elif pv.kind == "kind::f8f6f4" and pf == "fp8e4m3" and pk == "exp":
        p_mode, pv_fp8 = "exp_fp8", True
    elif pv.kind == "kind::mxf4nvf4.block_scale.block16" and pk == "two_level" and pf == "nvfp4":
        p_mode, pv_fp8 = "two_level_fp4", False
    else:
        raise LoweringError(
            f"sm100a lowering implements P : mxfp4 via direct_p (PV kind::mxf4nvf4.block_scale.block32), "
            f"P : nvfp4 via two_level (PV kind::mxf4nvf4.block_scale.block16) and "
            f"P : fp8e4m3 via exp (PV kind::f8f6f4); this plan has P : {pf} via {pk}, PV {pv.kind}", "P")
    p_smem = pv.a_source == "smem"
    if pv.a_source not in ("tmem", "smem"):
        raise LoweringError(f"PV's A operand (P) comes from TMEM or SMEM, plan says {pv.a_source}")
    if p_smem and p_mode != "directp_fp4":
        # implemented and checked (conformance, descriptors, emulator) for Direct-P MXFP4 P only:
        # with two-level NVFP4 P the two products share one MMA type, and conformance tells PV
        # from QK^T by that type when both read A from SMEM
        raise LoweringError(f"sm100a lowering implements p_source smem for P : mxfp4 via direct_p only "
                            f"(this plan: P : {pf} via {pk})", "schedule.p_source")

    # the operand formats the kernel and its host side (prepare_operands) implement
    if spec.q.block not in (None, 16) or spec.k.block not in (None, 16):
        raise LoweringError(f"sm100a lowering implements NVFP4 Q/K with blocks of 16 (plan: {spec.q}, {spec.k})", "Q")
    vf = spec.v.format.value
    if pv_fp8:
        if vf != "fp8e4m3" or spec.v.granularity.value not in ("tensor", "none"):
            raise LoweringError("sm100a lowering implements FP8 V as fp8e4m3 with one scale per (batch, head) "
                                f"(scale=tensor); plan has V : {spec.v}", "V")
    elif p_mode == "two_level_fp4":
        # block16 PV: P and V share the kind, so V is NVFP4 (E4M3 scales per 16 keys, no tensor scale)
        if vf != "nvfp4" or spec.v.block not in (None, 16) or spec.v.granularity.value not in ("block", "none"):
            raise LoweringError("sm100a lowering implements NVFP4 V with blocks of 16 keys (E4M3 block scales, "
                                f"no tensor scale) for two-level P; plan has V : {spec.v}", "V")
    elif vf != "mxfp4" or spec.v.block not in (None, 32):
        raise LoweringError(f"sm100a lowering implements MXFP4 V with blocks of 32 keys; plan has V : {spec.v}", "V")

    cols = tmem_columns(plan)
    need = [n for n in REQUIRED_REGIONS if not (p_smem and n.startswith("P"))] + list(SCALED_QK_REGIONS) + (list(SCALED_PV_REGIONS) if pv.block_scaled else [])
    missing = [n for n in need if n not in cols]
    if missing:
        raise LoweringError(f"plan.tmem lacks region(s) {', '.join(missing)} that the sm100a template addresses")

    pub = plan.publish
    if pub is None or pub.mode not in ("whole", "halves"):
        raise LoweringError("the sm100a plan has no P publication plan (plan_publish did not run)")
    halves = pub.mode == "halves"

    pipe = plan.pipeline
    kv_stages = getattr(pipe, "kv_stages", None) or sch.kv_stages
    if not kv_stages:
        raise LoweringError("the plan does not fix the number of KV stages")
    roles = {r.name: r.warps for r in getattr(pipe, "roles", ())}
    for name, want in (("softmax0", 4), ("softmax1", 4), ("correction", 4), ("mma", 1), ("load", 1)):
        if roles.get(name, want) != want:
            raise LoweringError(f"sm100a template has {want} warp(s) for role {name}, the plan asks {roles[name]}")
    n_warps = sum(roles.values()) if roles else 14
    if n_warps != 16:
        raise LoweringError(f"the sm100a template runs 4 warpgroups (16 warps); the plan has {n_warps} warps")
    warps = role_warps(roles)
    regs = {r.name: r.registers for r in pipe.roles}
    other = {regs.get(n) for n in ("mma", "load", "epilogue", "spare") if n in regs}
    if regs.get("softmax0") != regs.get("softmax1") or len(other) != 1:
        raise LoweringError("setmaxnreg works per warpgroup: softmax0/softmax1 and the mma/load/epilogue/spare "
                            f"warps must share a register budget, plan has {regs}")

    gaps = []
    guard = None
    if spec.guard.kind.value == "sample":
        if p_mode != "directp_fp4":
            raise LoweringError("the sampling guard applies to Direct-P into MXFP4 only", "guard")
        guard = (spec.guard.m, spec.guard.l)
        gaps.append(f"the guard sample(m={spec.guard.m}, l={spec.guard.l}) uses software dot products against the "
                    "sampled keys read from global memory (scalar byte loads, once per CTA): correct by "
                    "construction only, never run")
    if p_mode in ("exp_fp8", "two_level_fp4"):
        gaps.append("O rescaling (online max) is done by the softmax warps, not by the correction warpgroup")
    if p_mode == "two_level_fp4":
        gaps.append("two-level P keeps O in TMEM in units of the current tile's row factor r and rescales it "
                    "by alpha * r_prev / r on every KV tile (a TMEM round trip of O per tile, even when the "
                    "max does not move)")
        gaps.append("two-level P rounding differs from fp4gen.numerics.directp.p_two_level by at most an ulp "
                    "before each quantization: P2 = p * (1/r) and q = P2 * (1/s) use one reciprocal per row / "
                    "block instead of a division per element, and r is clamped below at 2^-64 (tiles whose "
                    "whole row is < 2^-52 of the row max); docs/sm100.md")
    gaps.append("the correction warpgroup writes O with plain global stores (no TMA store); the epilogue/spare "
                "warps of the plan idle")
    gaps.append("P's block scales reach TMEM through SMEM + tcgen05.cp (not tcgen05.st)")
    gaps.append("forward() quantizes and packs the operands (prepare_operands; checked on the CPU against "
                "fp4gen.numerics and the kernel's own global layouts), compiles and launches: the launch, "
                "the FP4 nibble order as the hardware reads it and the tcgen05 scale-factor layout on the "
                "device are unverified")
    gaps.append("never run on hardware: numerics are checked only by reading the code against docs/numerics.md")

    policy = spec.p_production.policy.value if p_mode == "directp_fp4" else None
    if p_smem:
        gaps.append("p_source smem: P's E2M1 codes go to a 64-byte-swizzled K-major SMEM tile by plain "
                    "st.shared (four 32-bit stores per 16-byte chunk, not vectorized)")
    summary = (f"Plan: QK {qk.kind}; PV {pv.kind} (P from {'SMEM' if p_smem else 'TMEM'}); P publish {pub.mode}; "
               f"{kv_stages} KV stages; TMEM {plan.tmem.alloc_columns} columns.")
    config = ForwardKernelConfig(
        head_dim=spec.head_dim,
        tile_m=sch.tile_m,
        tile_n=sch.tile_n,
        q_stages=sch.q_stages,
        kv_stages=int(kv_stages),
        causal=spec.mask.value == "causal",
        pv_fp8=pv_fp8,
        pv_block_scaled=bool(pv.block_scaled),
        # keys per P/V block scale of the block-scaled PV (16: E4M3 scales, 32: E8M0)
        pv_sf_vec=16 if p_mode == "two_level_fp4" else 32,
        v_k_major=pv.b_major == "K-major",
        p_mode=p_mode,
        p_policy=policy,
        p_fp8_scale=P_FP8_SCALE,
        o_scale=1.0 / P_FP8_SCALE if pv_fp8 else 1.0,
        # P approximates G 2^u: the LSE drops log2 G, the calibrated gain of the reference
        # numerics (docs/numerics.md, Direct-P; one definition, fp4gen.numerics.directp)
        lse_shift=math.log2(DIRECT_P_GAIN[policy]) if p_mode == "directp_fp4" else 0.0,
        direct_p_a=float(spec.p_production.a),
        direct_p_b=float(spec.p_production.b),
        p_parts=len(pub.parts),
        p_part_cols=publish_part_cols(plan, spec.p.format.bits),
        p_smem=p_smem,
        # bytes of one row of P's SMEM tile (K-major: one query row's tile_n codes)
        p_row_bytes=sch.tile_n * spec.p.format.bits // 8,
        guard_m=guard[0] if guard else 0,
        guard_l=guard[1] if guard else 0,
        softmax_warps=(warps["softmax0"], warps["softmax1"]),
        correction_warps=warps["correction"],
        mma_warp=warps["mma"][0],
        load_warp=warps["load"][0],
        idle_warps=warps["epilogue"] + warps["spare"],
        n_warps=n_warps,
        regs_softmax=regs["softmax0"],
        regs_correction=regs.get("correction", regs["softmax0"]),
        regs_other=other.pop(),
        tmem_alloc_cols=int(plan.tmem.alloc_columns),
        tmem=tuple((r.name, r.first_col, r.last_col) for r in plan.tmem.regions),
    )
    p_text = {"directp_fp4": f"Direct-P ({policy} policy, A={spec.p_production.a}, B={spec.p_production.b}): "
                             "E2M1 codes + E8M0 block exponents straight from the scores",
              "exp_fp8": "exp2 on the MUFU, then E4M3 (256 p), online max",
              "two_level_fp4": "exp2 on the MUFU (online max), then two-level NVFP4 (per-row factor "
                               "r = rowmax(p)/2688, E2M1 codes of p/r, E4M3 scales per 16 keys)"}[p_mode]
    return dict(
        kernel_name=Comment(spec.name),
        spec_file=Comment(spec.source_file),
        summary=summary,
        plan_json=plan_json(plan),
        has_transforms=bool(spec.transforms),  # the module applies the spec's outlier transforms
        softmax_scale=float(spec.scale),
        config=config,
        # the config literal's keywords: the template renders each value through | pyrepr
        config_fields=[(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)],
        pv_format_text=("FP8 E4M3" if pv_fp8 else "NVFP4 (E2M1, 1x16 blocks, E4M3 scales)"
                        if p_mode == "two_level_fp4" else "MXFP4 (E2M1, 1x32 blocks, E8M0 scales)"),
        pv_kind_text=pv.kind,
        p_text=p_text,
        gaps=[Comment(gap) for gap in gaps],
    )


def render(plan) -> str:
    """Source text of the generated sm100a module for ``plan``: the forward, plus the backward
    section (``sm100_bwd.render_backward``) when the spec has a backward block that the sm100a
    backward planner accepts. A refused backward block is listed among the module's known gaps
    with the planner's message (the forward stays usable)."""
    ctx = context(plan)
    bwd = None
    if plan.spec.backward is not None:
        from fp4gen.ir.plan import PlanError

        from .sm100_bwd import backward_plan, render_backward

        try:
            bp = backward_plan(plan)
        except PlanError as e:
            where = f" ({e.loc})" if e.loc else ""
            ctx["gaps"] = [Comment(f"backward not generated: the sm100a backward planner refuses this spec's "
                                   f"backward block{where}: {e.message}")] + ctx["gaps"]
        else:
            bwd = render_backward(plan, bp)
    src = template_env("sm100").get_template("fwd.py.j2").render(**ctx)
    return src + ("\n\n" + bwd if bwd else "")
