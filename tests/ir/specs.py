"""KernelSpec values for the planner tests, built directly (no parser).

Every spec gets a fake source location per field (line = a fixed number per field
path) so tests can check that a PlanError points at the right field.
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

from fp4gen.ir.spec import (
    DirectPPolicy, Format, Guard, GuardKind, KernelSpec, Mask, OperandFormat, PKind, PProduction, PPublish,
    Schedule, ScaleGranularity, SourceLoc, Target, TmemRegionRequest, default_operand_format,
)

FIELDS = ("name", "target", "head_dim", "mask", "Q", "K", "P", "P.via", "P.via.a", "V", "O", "guard",
          "schedule", "schedule.tile", "schedule.q_stages", "schedule.kv_stages", "schedule.p_publish",
          "schedule.tmem", "Q.block", "Q.scale", "K.block", "K.scale", "V.block", "V.scale")
LINE = {f: i + 1 for i, f in enumerate(FIELDS)}


def locs(extra: tuple[str, ...] = (), without: tuple[str, ...] = ()) -> MappingProxyType:
    return MappingProxyType({f: SourceLoc("test.attn", LINE.get(f, 100 + i), 3)
                             for i, f in enumerate(FIELDS + tuple(extra)) if f not in without})


def line_of(field: str) -> int:
    return LINE[field]


NVFP4 = default_operand_format(Format.NVFP4)
MXFP4 = default_operand_format(Format.MXFP4)
E4M3_TENSOR = default_operand_format(Format.FP8E4M3)
E4M3_BLOCK128 = OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 128, Format.FP32)
E4M3_MX = OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 32, Format.E8M0)
BF16 = OperandFormat(Format.BF16)


def paper_fp4(**kw) -> KernelSpec:
    """The paper's recipe: NVFP4 Q/K, MXFP4 P/V via Direct-P fast, D128, 2 stages, halves."""
    base = dict(name="fa4_fp4_d128", target=Target.SM100A, head_dim=128, mask=Mask.NONE,
                q=NVFP4, k=NVFP4, p=MXFP4, v=MXFP4, o=BF16,
                p_production=PProduction(PKind.DIRECT_P, DirectPPolicy.FAST, 1.5, 1.2),
                guard=Guard(GuardKind.SAMPLE, 110, 16),
                schedule=Schedule(128, 128, 2, PPublish.HALVES, None, None),
                locs=locs(), source_file="test.attn")
    base.update(kw)
    return KernelSpec(**base)


def with_schedule(spec: KernelSpec, **kw) -> KernelSpec:
    return replace(spec, schedule=replace(spec.schedule, **kw))


def paper_d256() -> KernelSpec:
    """Head dim 256 with two stages: 768 TMEM columns, must be refused."""
    return paper_fp4(name="fa4_fp4_d256", head_dim=256)


def nvfp8(**kw) -> KernelSpec:
    """NVFP4 Q/K with FP8 P/V (the paper's training-friendly path), exp."""
    return paper_fp4(**{**dict(name="fa4_nvfp8_d128", p=E4M3_TENSOR, v=E4M3_TENSOR,
                                p_production=PProduction(PKind.EXP), guard=Guard()), **kw})


def sage3(**kw) -> KernelSpec:
    return paper_fp4(**{**dict(name="sage3_fp4_d128", p=NVFP4, v=NVFP4, p_production=PProduction(PKind.TWO_LEVEL),
                                guard=Guard(), schedule=Schedule(128, 128, 2, PPublish.WHOLE)), **kw})


def sm100_bf16(**kw) -> KernelSpec:
    return paper_fp4(**{**dict(name="sm100_bf16_d128", q=BF16, k=BF16, p=BF16, v=BF16,
                                p_production=PProduction(PKind.EXP), guard=Guard()), **kw})


def sm90_fp8(directp: bool = True, head_dim: int = 128, **kw) -> KernelSpec:
    base = dict(name=f"sm90_fp8_{'directp' if directp else 'exp'}_d{head_dim}", target=Target.SM90A,
                head_dim=head_dim, q=E4M3_BLOCK128, k=E4M3_BLOCK128, p=E4M3_TENSOR, v=E4M3_TENSOR, o=BF16,
                p_production=PProduction(PKind.DIRECT_P if directp else PKind.EXP),
                # FP8 Direct-P takes no classifier parameters: the spec does not write `a`
                schedule=Schedule(128, 128, 2, PPublish.HALVES), locs=locs(without=("P.via.a",)),
                source_file="test.attn")
    base.update(kw)
    return KernelSpec(**base)


def sm90_bf16(head_dim: int = 128, **kw) -> KernelSpec:
    base = dict(name=f"sm90_bf16_d{head_dim}", target=Target.SM90A, head_dim=head_dim,
                schedule=Schedule(128, 128, 2, PPublish.HALVES), locs=locs(), source_file="test.attn")
    base.update(kw)
    return KernelSpec(**base)


def reference(**kw) -> KernelSpec:
    return paper_fp4(**{**dict(name="ref", target=Target.REFERENCE), **kw})


def explicit_tmem(*regions: tuple[str, int, int]) -> KernelSpec:
    reqs = tuple(TmemRegionRequest(n, a, b) for n, a, b in regions)
    s = paper_fp4(name="fa4_explicit", locs=locs(tuple(f"schedule.tmem.{n}" for n, _, _ in regions)))
    return with_schedule(s, tmem_regions=reqs)


ACCEPTED = {
    "paper_fp4": paper_fp4, "nvfp8": nvfp8, "sage3": sage3, "sm100_bf16": sm100_bf16,
    "sm90_fp8_directp": lambda: sm90_fp8(True), "sm90_fp8_exp": lambda: sm90_fp8(False),
    "sm90_fp8_d64": lambda: sm90_fp8(True, 64), "sm90_bf16": sm90_bf16, "sm90_bf16_d64": lambda: sm90_bf16(64),
    "reference": reference,
}
