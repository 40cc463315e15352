"""sm90a backend for ``kv_cache`` specs: a finished decode ``KernelPlan`` -> the CuTe DSL module
of the split-KV decode kernel (issue 22, docs/decode.md).

The kernel is one library class (``fp4gen.device.sm90.decode``); this file derives its
``DecodeConfig`` from the plan (``config``), refuses what the kernel does not run yet (at the
spec line behind it), and renders ``templates/sm90/decode.py.j2``: the docstring, ``PLAN_JSON``,
the config literal with the spec line behind each value, and the binding to the runtime
(``fp4gen.runtime.sm90_decode_host``). ``fp4gen.lowering.render`` picks this backend for an
sm90a plan with a decode section.
"""
from __future__ import annotations

import dataclasses

from . import Code, Comment, LoweringError, plan_json, pyrepr, template_env

TEMPLATE = "decode.py.j2"


def context(plan) -> dict:
    from fp4gen.device.sm90 import decode_config as dc
    from fp4gen.ir.spec import Format, KvStorage, Mask, PKind, Sinks, Target

    spec = plan.spec
    d = plan.decode
    if spec.target is not Target.SM90A:
        raise LoweringError(f"sm90 decode backend got a plan for target {spec.target.value}")
    if d is None or spec.kv_cache is None:
        raise LoweringError("plan has no decode section (a kv_cache spec planned by plan_decode)")
    c = spec.kv_cache
    if spec.head_dim not in dc.HEAD_DIMS:
        raise LoweringError(f"the sm90a decode kernel takes head_dim {' or '.join(map(str, dc.HEAD_DIMS))}, "
                            f"not {spec.head_dim}", "head_dim")
    if str(c.format) not in dc.CACHE_FORMATS:
        raise LoweringError(f"the sm90a decode kernel reads the caches {', '.join(dc.CACHE_FORMATS)}, not {c.format} "
                            "(target reference runs it)", "kv_cache.format")
    for name, f in (("Q", spec.q), ("P", spec.p), ("O", spec.o)):
        if f.format is not Format.BF16:
            raise LoweringError(f"the sm90a decode kernel takes {name} as bf16, not {f.format.value}", name)
    if spec.p_production.kind is not PKind.EXP:
        raise LoweringError(f"the sm90a decode kernel makes P by exp, not {spec.p_production.kind.value}", "P.via")
    if spec.mask not in (Mask.NONE, Mask.CAUSAL):
        raise LoweringError(f"the sm90a decode kernel masks causal or nothing, not {spec.mask.value}", "mask")
    if spec.softcap:
        raise LoweringError("the sm90a decode kernel has no softcap yet (target reference runs it)", "softcap")
    if spec.sinks is not Sinks.NONE:
        raise LoweringError("the sm90a decode kernel has no sinks yet (target reference runs them)", "sinks")
    if d.rows_per_cta > dc.ROW_TILE:
        raise LoweringError(f"gqa {c.gqa} x q_tokens {c.q_tokens} = {d.rows_per_cta} query rows: the sm90a decode "
                            f"kernel packs at most {dc.ROW_TILE} in its one row tile", "kv_cache.gqa")
    if d.tile_n not in dc.TILE_NS:
        raise LoweringError(f"the sm90a decode kernel reads key tiles of {' or '.join(map(str, dc.TILE_NS))}, "
                            f"not {d.tile_n}", "schedule.tile")
    stages = spec.schedule.kv_stages or 1  # unset: one stage (deeper rings are opt-in until timed on a GPU)
    if not 1 <= stages <= dc.MAX_KV_STAGES:
        raise LoweringError(f"the sm90a decode kernel loads K/V in 1 to {dc.MAX_KV_STAGES} stages, not {stages}",
                            "schedule.kv_stages")
    try:
        cfg = _decode_config(spec, c, d, stages)
    except ValueError as e:  # the one refusal beyond the checks above: a ring too deep for SMEM
        if "of SMEM" not in str(e):
            raise
        raise LoweringError(str(e).split(": ", 1)[1], "schedule.kv_stages") from None
    origins = {k: Comment(spec.origin(k)) for k in ("head_dim", "mask", "kv_cache.format", "kv_cache.storage",
                                                   "kv_cache.q_tokens", "kv_cache.gqa", "schedule.tile",
                                                   "schedule.kv_stages")}
    return dict(
        kernel_name=Comment(spec.name),
        spec_file=Comment(spec.source_file),
        plan_json=plan_json(plan),
        origins=origins,
        config=cfg,
        config_fields=_config_fields(cfg, origins),
        notes=[Comment(n) for n in d.notes],
        combine=Comment(d.combine),
    )


def _decode_config(spec, c, d, stages):
    from fp4gen.device.sm90 import decode_config as dc
    from fp4gen.ir.spec import KvStorage, Mask

    return dc.DecodeConfig(
        kernel_name=spec.name,
        head_dim=spec.head_dim,
        causal=spec.mask is Mask.CAUSAL,
        cache_format=str(c.format),
        paged=c.storage is KvStorage.PAGED,
        page_size=c.page_size if c.storage is KvStorage.PAGED else None,
        q_tokens=c.q_tokens,
        gqa=c.gqa,
        tile_n=d.tile_n,
        kv_stages=stages,
    )


def config(plan):
    """The ``DecodeConfig`` of ``plan`` (a LoweringError for a plan the kernel cannot run)."""
    return context(plan)["config"]


# the spec line (origins key) behind each DecodeConfig value, for its comment
_FIELD_SOURCE = {"head_dim": "head_dim", "causal": "mask", "cache_format": "kv_cache.format",
                 "paged": "kv_cache.storage", "page_size": "kv_cache.storage", "q_tokens": "kv_cache.q_tokens",
                 "gqa": "kv_cache.gqa", "tile_n": "schedule.tile", "kv_stages": "schedule.kv_stages"}


def _config_fields(cfg, origins) -> list:
    rows = []
    for f in dataclasses.fields(cfg):
        if f.default is not dataclasses.MISSING and getattr(cfg, f.name) == f.default:
            continue  # a default is not rendered: the modules of specs without it stay as they were
        if f.name == "kernel_name":
            rows.append((Code(f.name), Code("KERNEL_NAME"), Comment("the spec's kernel name")))
        else:
            rows.append((Code(f.name), pyrepr(getattr(cfg, f.name)), origins[_FIELD_SOURCE[f.name]]))
    return rows


def render(plan) -> str:
    """Source text of the generated sm90a decode module for ``plan``."""
    return template_env("sm90").get_template(TEMPLATE).render(**context(plan))
