"""legalize(spec) -> KernelPlan: can the target run these formats, head dim and tiles?

The first pass. It refuses what a target cannot issue (raising ``PlanError`` at the
offending spec field) and records, per matrix product, which MMA instruction kind
will run it (``KernelPlan.mma``).

sm100a (tcgen05.mma):
  nvfp4 x nvfp4            -> kind::mxf4nvf4.block_scale.block16 (E4M3 scales, 1x16)
  mxfp4 x mxfp4            -> kind::mxf4nvf4.block_scale.block32 (E8M0 scales, 1x32)
  fp8/mxfp4 mixes, MX fp8  -> kind::mxf8f6f4.block_scale (E8M0 scales, 1x32)
  fp8 x fp8, tensor scales -> kind::f8f6f4 (no block scales; fp32 scales applied in softmax)
  bf16 x bf16, fp16 x fp16 -> kind::f16
sm90a (wgmma): fp8 (e4m3/e5m2) x fp8, bf16 x bf16, fp16 x fp16; no FP4.
reference: any format combination (torch emulation).
"""
from __future__ import annotations

from typing import Optional

from ..plan import KernelPlan, MmaChoice, PlanError
from ..spec import (
    BACKWARD_OPERANDS, DIRECT_P_A_RANGE, DIRECT_P_B_RANGE, DIRECT_P_FORMATS, HEAD_DIM_RANGE, Format, GuardKind, KernelSpec, OperandFormat, PKind,
    PSource, ScaleGranularity, Target,
)

# Dense tensor-core throughput per SM per clock (FLOP = 2 per multiply-add).
# sm90: H100/H200 989 TFLOP/s BF16 dense over 132 SMs at 1.83 GHz = 4096 FLOP/clk/SM
# (1024 per tensor core, 4 tensor cores per SM); FP8 twice that.
# sm100: BF16 ~2x Hopper per SM, FP8 2x BF16, FP4 4x BF16 (the brief's "~4x").
RATES = {
    ("sm90a", "16bit"): 4096, ("sm90a", "fp8"): 8192,
    ("sm100a", "16bit"): 8192, ("sm100a", "fp8"): 16384, ("sm100a", "fp4"): 32768,
}

TARGET_FORMATS = {
    Target.SM100A: (Format.NVFP4, Format.MXFP4, Format.FP8E4M3, Format.FP8E5M2, Format.BF16, Format.FP16),
    Target.SM90A: (Format.FP8E4M3, Format.FP8E5M2, Format.BF16, Format.FP16),
}
OUTPUT_FORMATS = (Format.BF16, Format.FP16, Format.FP32)
# the sm90a forward's head dims (its key tile per head dim is the planner's, pipeline.py);
# its backward takes 64 and 128 only (ir/passes/backward.py: dK, dV live in registers)
HEAD_DIMS = {Target.SM90A: (64, 96, 128, 192, 256), Target.SM100A: (64, 128, 192, 256)}
SM90_BACKWARD_HEAD_DIMS = (64, 128)


def _loc(spec: KernelSpec, *paths: str):
    """First recorded location among ``paths`` (most specific first)."""
    for p in paths:
        loc = spec.loc(p)
        if loc is not None:
            return loc
    return None


def _is_mx(f: OperandFormat) -> bool:
    """An OCP MX block format: 1x32 blocks with E8M0 scales."""
    return f.granularity is ScaleGranularity.BLOCK and f.block == 32 and f.scale is Format.E8M0


def _sm100_kind(name: str, a_name: str, a: OperandFormat, b_name: str, b: OperandFormat,
                spec: KernelSpec) -> tuple[str, bool, Optional[int], Optional[str], int]:
    """(kind, block_scaled, sf_block, sf_dtype, rate) for one tcgen05 product, or PlanError."""
    fa, fb = a.format, b.format
    where = _loc(spec, b_name, a_name)
    pair = f"{a_name} {a} x {b_name} {b}"
    if fa is Format.NVFP4 and fb is Format.NVFP4:
        return "kind::mxf4nvf4.block_scale.block16", True, 16, "e4m3", RATES["sm100a", "fp4"]
    if fa is Format.MXFP4 and fb is Format.MXFP4:
        return "kind::mxf4nvf4.block_scale.block32", True, 32, "e8m0", RATES["sm100a", "fp4"]
    if fa.is_fp4 and fb.is_fp4:
        raise PlanError(f"{name} mixes nvfp4 and mxfp4 ({pair}): one tcgen05.mma uses one block size",
                        where, ["use nvfp4 for both (block16) or mxfp4 for both (block32)"])
    low_a, low_b = fa.is_fp4 or fa.is_fp8, fb.is_fp4 or fb.is_fp8
    if low_a and low_b:
        if fa.is_fp4 or fb.is_fp4 or _is_mx(a) or _is_mx(b):
            # kind::mxf8f6f4 mixes fp8/fp6/fp4 payloads but needs MX (1x32, E8M0) scales on both.
            bad = [(n, f) for n, f in ((a_name, a), (b_name, b)) if not _is_mx(f)]
            if bad:
                n, f = bad[0]
                raise PlanError(
                    f"{name} ({pair}) runs as kind::mxf8f6f4.block_scale, which needs 1x32 blocks "
                    f"with e8m0 scales on both operands; {n} is {f}",
                    _loc(spec, f"{n}.block", f"{n}.scale", n),
                    [f"write {n} : {f.format.value}(block=32, scale=e8m0)" if f.format.is_fp8
                     else f"write {n} : mxfp4"])
            return "kind::mxf8f6f4.block_scale", True, 32, "e8m0", RATES["sm100a", "fp8"]
        # both fp8 with tensor/token/no scales: the unscaled kind; scales applied to S / O in registers
        return "kind::f8f6f4", False, None, None, RATES["sm100a", "fp8"]
    if fa is fb and fa in (Format.BF16, Format.FP16):
        return "kind::f16", False, None, None, RATES["sm100a", "16bit"]
    raise PlanError(f"{name} cannot mix {pair} in one tcgen05.mma", where,
                    ["both operands of a product must be low precision (fp4/fp8) or the same 16-bit type"])


def _sm90_kind(name: str, a_name: str, a: OperandFormat, b_name: str, b: OperandFormat,
               spec: KernelSpec) -> tuple[str, int]:
    fa, fb = a.format, b.format
    if fa.is_fp8 and fb.is_fp8:
        return "wgmma.f8 (e4m3/e5m2 -> f32)", RATES["sm90a", "fp8"]
    if fa is fb and fa in (Format.BF16, Format.FP16):
        return f"wgmma.{fa.value} (-> f32)", RATES["sm90a", "16bit"]
    raise PlanError(f"{name} cannot mix {a_name} {a} x {b_name} {b} in one wgmma",
                    _loc(spec, b_name, a_name),
                    ["wgmma takes fp8 x fp8 (e4m3/e5m2 in any mix) or the same 16-bit type on both sides"])


def _check_formats(spec: KernelSpec) -> None:
    t = spec.target
    allowed = TARGET_FORMATS[t]
    for name in ("Q", "K", "P", "V"):
        f = spec.operand(name)
        if f.format not in allowed:
            notes = [f"{t.value} consumes {', '.join(x.value for x in allowed)}"]
            if t is Target.SM90A and f.format.is_fp4:
                notes.insert(0, "Hopper has no FP4 tensor cores; use fp8e4m3 (or target sm100a)")
            raise PlanError(f"{t.value} cannot consume {name} : {f.format.value}", spec.loc(name), notes)
    if spec.o.format not in OUTPUT_FORMATS:
        raise PlanError(f"O : {spec.o.format.value} is not an output format",
                        spec.loc("O"), ["O is written by the epilogue as bf16, fp16 or fp32"])


def _check_backward_formats(spec: KernelSpec) -> None:
    """Every target, the reference too: no backend rounds a gradient to FP4."""
    if spec.backward is not None:
        for g in BACKWARD_OPERANDS:
            f = spec.backward.format_of(g)
            if f.format.is_fp4:
                raise PlanError(f"backward operand {g} : {f.format.value} is not supported",
                                _loc(spec, f"backward.{g}", "backward"),
                                ["the paper's training path keeps gradients in fp8 (e4m3/e5m2) or bf16"])


def _check_scales(spec: KernelSpec) -> None:
    t = spec.target
    if t is Target.SM90A:
        for name in ("Q", "K"):
            f = spec.operand(name)
            if f.format.is_fp8 and f.granularity is ScaleGranularity.BLOCK and f.scale not in (None, Format.FP32):
                raise PlanError(f"{name} : {f} on sm90a: Hopper fp8 scales are fp32",
                                _loc(spec, f"{name}.scale", name), [f"write {name} : {f.format.value}(block=128)"])
        v = spec.v
        if v.format.is_fp8 and v.granularity not in (ScaleGranularity.TENSOR, ScaleGranularity.NONE):
            raise PlanError(f"V : {v} on sm90a: V takes one fp32 scale per tensor",
                            _loc(spec, "V.block", "V.scale", "V"),
                            ["a scale per key of V would have to be applied inside the PV reduction; "
                             f"write V : {v.format.value}(scale=tensor)"])
    if t is Target.SM100A:
        for name in ("Q", "K", "P", "V"):
            f = spec.operand(name)
            token_block = name in ("Q", "K") and f.scale in (None, Format.FP32)  # fp32 per run of tokens, as on sm90a
            if f.format.is_fp8 and f.granularity is ScaleGranularity.BLOCK and not _is_mx(f) and not token_block:
                raise PlanError(f"{name} : {f} on sm100a: block-scaled fp8 must be MX (block=32, scale=e8m0)",
                                _loc(spec, f"{name}.block", f"{name}.scale", name),
                                [f"write {name} : {f.format.value}(block=32, scale=e8m0) or scale=tensor"])
            if name in ("P", "V") and f.format.is_fp8 and f.granularity is ScaleGranularity.TOKEN:
                raise PlanError(f"{name} : {f}: a per-token scale of {name} cannot be applied after PV",
                                _loc(spec, f"{name}.scale", name), ["use scale=tensor or MX blocks"])


def _check_p_production(spec: KernelSpec) -> None:
    pp, p, t = spec.p_production, spec.p, spec.target
    loc = _loc(spec, "P.via", "P")
    if pp.kind is PKind.DIRECT_P:
        if t is Target.SM100A and p.format is not Format.MXFP4:
            raise PlanError(f"direct_p on sm100a produces mxfp4 codes, but P is {p}", loc,
                            ["Direct-P writes E2M1 codes with one E8M0 exponent per 32 keys: write P : mxfp4 via direct_p"])
        if t is Target.SM90A and p.format is not Format.FP8E4M3:
            raise PlanError(f"direct_p on sm90a produces fp8e4m3 codes, but P is {p}", loc,
                            ["write P : fp8e4m3 via direct_p"])
        if t is Target.REFERENCE and p.format not in DIRECT_P_FORMATS:
            raise PlanError(f"direct_p produces mxfp4 or fp8e4m3 codes, but P is {p}", loc)
        given = [k for k in ("P.via.a", "P.via.b", "P.via.policy") if spec.loc(k) is not None]
        if p.format.is_fp8 and given:
            raise PlanError(f"direct_p into {p.format.value} takes no classifier parameters "
                            f"({', '.join(g.rsplit('.', 1)[1] for g in given)} given)", spec.loc(given[0]),
                            ["FP8 Direct-P is the exact piecewise-linear 2^x of docs/numerics.md; policy, a and b "
                             "tune the FP4 (E2M1) classifier only: write P : fp8e4m3 via direct_p"])
        (alo, ahi), (blo, bhi) = DIRECT_P_A_RANGE, DIRECT_P_B_RANGE  # the front end's bounds, for specs built in Python
        if not (alo <= pp.a <= ahi) or not (blo <= pp.b <= bhi):
            raise PlanError(f"direct_p classifier a={pp.a}, b={pp.b} is outside the usable range",
                            _loc(spec, "P.via.a", "P.via"), ["the paper uses a in [1.5, 1.6], b in [0.95, 1.2]"])
    if pp.kind is PKind.TWO_LEVEL and p.format is not Format.NVFP4:
        raise PlanError(f"two_level quantizes P to nvfp4 (e4m3 block scales), but P is {p}", loc,
                        ["write P : nvfp4 via two_level"])
    if spec.guard.kind is GuardKind.SAMPLE:
        if p.format.is_high_precision:
            raise PlanError("the extreme-logit guard protects low-precision P blocks; P is " + str(p),
                            spec.loc("guard"), ["remove the guard, or make P fp4/fp8"])
        if spec.guard.m <= 0 or spec.guard.l <= 0:
            raise PlanError(f"guard sample(m={spec.guard.m}, l={spec.guard.l}) needs positive constants",
                            _loc(spec, "guard.m", "guard"))


def _check_shape(spec: KernelSpec) -> None:
    t, s = spec.target, spec.schedule
    if spec.head_dim not in HEAD_DIM_RANGE:
        r = HEAD_DIM_RANGE
        raise PlanError(f"head_dim {spec.head_dim} must be a multiple of {r.step} from {r.start} to {r[-1]}",
                        spec.loc("head_dim"))
    if t is Target.REFERENCE:
        return
    if spec.head_dim not in HEAD_DIMS[t]:
        raise PlanError(f"{t.value} supports head_dim {', '.join(map(str, HEAD_DIMS[t]))}, not {spec.head_dim}",
                        spec.loc("head_dim"))
    if t is Target.SM90A and spec.backward is not None and spec.head_dim not in SM90_BACKWARD_HEAD_DIMS:
        # here, before the forward is planned, so that check and compile refuse it alike
        raise PlanError(f"head_dim {spec.head_dim}: the sm90a forward takes it, its backward takes head_dim "
                        f"{' and '.join(map(str, SM90_BACKWARD_HEAD_DIMS))} only (dK and dV stay in registers: "
                        f"2 x head_dim/2 fp32 per thread)", spec.loc("head_dim"),
                        ["drop the backward block (a forward-only kernel), or use head_dim 64 or 128"])
    tile = _loc(spec, "schedule.tile", "schedule")
    if s.kv_stages is not None and not (1 <= s.kv_stages <= 8):
        raise PlanError(f"kv_stages {s.kv_stages} must be between 1 and 8", _loc(spec, "schedule.kv_stages", "schedule"))
    if t is Target.SM100A:
        if s.tile_m != 128:
            raise PlanError(f"tile {s.tile_m} x {s.tile_n}: a cta_group::1 tcgen05.mma tile has 128 query rows",
                            tile, ["one query stage is 128 rows, one row per TMEM lane; write tile 128 x N"])
        if s.tile_n % 64 or not (64 <= s.tile_n <= 256):
            raise PlanError(f"tile {s.tile_m} x {s.tile_n}: tile_n must be 64, 128, 192 or 256 on sm100a", tile,
                            ["P is published in halves of 32-key blocks and the fp4 MMA consumes K in steps of 64"])
        if s.q_stages not in (1, 2):
            raise PlanError(f"q_stages {s.q_stages}: sm100a plans 1 or 2 query stages (one softmax warpgroup each)",
                            _loc(spec, "schedule.q_stages", "schedule"))
    if t is Target.SM90A:
        if s.tile_m % 64 or not (64 <= s.tile_m <= 192):
            raise PlanError(f"tile {s.tile_m} x {s.tile_n}: tile_m must be 64, 128 or 192 on sm90a", tile,
                            ["a wgmma M-mode is 64 rows per consumer warpgroup (at most 3 consumers)"])
        if s.tile_n % 16 or not (64 <= s.tile_n <= 256):
            raise PlanError(f"tile {s.tile_m} x {s.tile_n}: tile_n must be a multiple of 16 in 64..256", tile,
                            ["wgmma N is at most 256"])
        wgs = s.tile_m // 64
        if spec.loc("schedule.q_stages") is not None and s.q_stages != wgs:
            raise PlanError(f"q_stages {s.q_stages} with tile_m {s.tile_m}: on sm90a the query stages are the "
                            f"{wgs} consumer warpgroup(s) of 64 rows", spec.loc("schedule.q_stages"),
                            [f"write q_stages {wgs} or drop it"])
    if s.p_source is PSource.SMEM and t is Target.SM90A:
        raise PlanError("p_source smem: sm90a keeps P in the consumer's registers (the wgmma A operand)",
                        _loc(spec, "schedule.p_source", "schedule"), ["drop p_source (it chooses the sm100a PV form)"])
    if s.tmem_regions is not None and t is not Target.SM100A:
        raise PlanError(f"{t.value} has no tensor memory; drop the tmem block", _loc(spec, "schedule.tmem", "schedule"))


# the extensions each target's forward implements (the reference implements all of them).
# sm90a varlen: BF16 and the FP8 recipes, forward only (per-sequence FP8 scales: docs/runtime.md)
FORWARD_EXTENSIONS = {Target.SM90A: ("mask", "softcap", "sinks", "layout"), Target.SM100A: ()}
# the extensions each target's backward implements: sm90a window(l, r) and softcap (dS through
# 1 - tanh^2), every backward recipe (device/sm90/backward.py)
BACKWARD_EXTENSIONS = {Target.SM90A: ("mask", "softcap"), Target.SM100A: ()}


def _check_extensions(spec: KernelSpec) -> None:
    """sm100a implements dense attention with mask none or causal; the sm90a forward adds
    window(l, r), softcap, sinks and varlen, its backward window and softcap. A window,
    softcap, sinks or the varlen layout a kernel lacks is refused at its spec line (only the reference target runs them
    all), here in the first planning pass, so that ``fp4gen check`` and ``fp4gen compile``
    refuse it alike."""
    t = spec.target
    if t is Target.REFERENCE:
        return
    used = spec.uses_extensions
    if not used:
        return
    forward_ok = FORWARD_EXTENSIONS.get(t, ())
    missing = [f for f in used if f not in forward_ok]
    bwd_missing = [f for f in used if f not in BACKWARD_EXTENSIONS.get(t, ())]
    if not missing and spec.backward is not None and bwd_missing:
        field = bwd_missing[0]
        raise PlanError(f"{_extension_text(spec, field)}: the {t.value} forward implements it, its backward "
                        "does not", spec.loc(field),
                        ["drop the backward block (a forward-only kernel), or target reference, which "
                         "implements the backward too (backward kernels for these are issue 19)"])
    if not missing:
        return
    field = missing[0]
    what = f"{_extension_text(spec, field)}: " + {
        "mask": f"{t.value} implements mask none and causal (window(-1, 0))",
        "softcap": f"{t.value} implements attention without a softcap",
        "sinks": f"{t.value} implements attention without sinks",
        "layout": f"{t.value} implements the dense (B, S, H, D) layout only",
    }[field]
    fix = {"mask": "write mask none or mask causal", "softcap": "drop the softcap line (or write softcap none)",
           "sinks": "drop the sinks line (or write sinks none)", "layout": "drop the layout line (or write layout dense)"}
    raise PlanError(what, spec.loc(field),
                    [f"{fix[field]}, or target reference, which implements window, softcap, sinks and varlen "
                     "(kernels for them are issue 19)"])


def _extension_text(spec: KernelSpec, field: str) -> str:
    """The spec line of extension ``field`` as written ("mask window(255, 0)")."""
    return {
        "mask": f"mask window({spec.window_size[0]}, {spec.window_size[1]})",
        "softcap": f"softcap {spec.softcap:g}",
        "sinks": f"sinks {spec.sinks.value}",
        "layout": f"layout {spec.layout.value}",
    }[field]


def _sources(spec: KernelSpec, name: str, a: OperandFormat, b: OperandFormat) -> tuple[str, str, str, str]:
    """(a_source, b_source, a_major, b_major)."""
    t = spec.target
    if t is Target.REFERENCE:
        return "global", "global", "any", "any"
    if name == "QK":
        return "smem", "smem", "K-major", "K-major"
    if t is Target.SM90A:
        # wgmma fp8 reads both operands K-major: V (keys x D) must be stored D x keys.
        return "registers", "smem", "K-major", "K-major" if b.format.is_fp8 else "MN-major"
    # sm100a: P from TMEM (the TS form) or, with `p_source smem`, from an SMEM tile through a
    # matrix descriptor (the SS form); packed fp4 V is K-major only (assumption recorded in docs/plan.md)
    return spec.schedule.p_source.value, "smem", "K-major", "K-major" if b.format.is_fp4 else "MN-major"


def legalize(spec: KernelSpec) -> KernelPlan:
    """Check the spec against its target and choose the MMA kind of QK^T and PV."""
    _check_extensions(spec)  # first: no setting of the other fields makes them run
    if spec.target is not Target.REFERENCE:
        _check_formats(spec)
        _check_scales(spec)
    else:
        if spec.o.format not in OUTPUT_FORMATS:
            raise PlanError(f"O : {spec.o.format.value} is not an output format", spec.loc("O"))
    _check_backward_formats(spec)
    _check_p_production(spec)
    _check_shape(spec)
    if spec.target is Target.SM90A:
        # the forward's key tile per head dim, from the SMEM and register budgets, before
        # any pass reads it (a tile the spec writes is kept, or refused with the numbers)
        from .pipeline import sm90_forward_tile

        spec, _ = sm90_forward_tile(spec)
    choices = []
    for name, an, bn in (("QK", "Q", "K"), ("PV", "P", "V")):
        a, b = spec.operand(an), spec.operand(bn)
        a_src, b_src, a_major, b_major = _sources(spec, name, a, b)
        if spec.target is Target.SM100A:
            kind, scaled, blk, sfd, rate = _sm100_kind(name, an, a, bn, b, spec)
        elif spec.target is Target.SM90A:
            kind, rate = _sm90_kind(name, an, a, bn, b, spec)
            scaled, blk, sfd = False, None, None
        else:
            kind, scaled, blk, sfd, rate = "torch", False, None, None, 0
        choices.append(MmaChoice(name, str(a), str(b), kind, scaled, blk, sfd, a_src, b_src, a_major, b_major, rate))
    return KernelPlan(spec=spec, mma=tuple(choices))
