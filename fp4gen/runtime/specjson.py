"""``KernelSpec`` <-> plain dict / JSON, without the front end.

Generated modules embed their spec as JSON and rebuild it with
``spec_from_json`` at import time, so they need neither lark nor jinja2.
The dict is stable (keys sorted when dumped) so that regenerated files are
byte-for-byte identical.
"""
from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any, Optional

from fp4gen.ir.spec import (
    Backward, DirectPPolicy, Format, Guard, GuardKind, KernelSpec, Mask, OperandFormat, PKind,
    PProduction, PPublish, ScaleGranularity, Schedule, SourceLoc, Target, TmemRegionRequest,
)

SCHEMA = 1


def _fmt_to(f: OperandFormat) -> dict:
    return {"format": f.format.value, "granularity": f.granularity.value, "block": f.block,
            "scale": f.scale.value if f.scale is not None else None}


def _fmt_from(d: dict) -> OperandFormat:
    return OperandFormat(Format(d["format"]), ScaleGranularity(d["granularity"]), d["block"],
                         Format(d["scale"]) if d["scale"] is not None else None)


def spec_to_dict(spec: KernelSpec, *, with_source: bool = True) -> dict[str, Any]:
    """Every field of ``spec`` as JSON-compatible values (enums by their spelling)."""
    s = spec.schedule
    d: dict[str, Any] = {
        "schema": SCHEMA,
        "name": spec.name,
        "target": spec.target.value,
        "head_dim": spec.head_dim,
        "mask": spec.mask.value,
        "softmax_scale": spec.softmax_scale,
        "operands": {n: _fmt_to(spec.operand(n)) for n in ("Q", "K", "P", "V", "O")},
        "p_production": {"kind": spec.p_production.kind.value, "policy": spec.p_production.policy.value,
                         "a": spec.p_production.a, "b": spec.p_production.b},
        "guard": {"kind": spec.guard.kind.value, "m": spec.guard.m, "l": spec.guard.l},
        "schedule": {
            "tile_m": s.tile_m, "tile_n": s.tile_n, "q_stages": s.q_stages,
            "p_publish": s.p_publish.value, "kv_stages": s.kv_stages,
            "tmem_regions": None if s.tmem_regions is None else
            [[r.name, r.first_col, r.last_col] for r in s.tmem_regions],
        },
        "backward": None if spec.backward is None else {
            "reuse": sorted(spec.backward.reuse),
            "formats": {n: _fmt_to(f) for n, f in spec.backward.formats.items()},
            "deterministic": spec.backward.deterministic,
        },
        "source_file": spec.source_file,
    }
    if with_source:
        d["locs"] = {k: [v.file, v.line, v.col] for k, v in sorted(spec.locs.items())}
        d["source_lines"] = list(spec.source_lines)
    return d


def spec_from_dict(d: dict[str, Any]) -> KernelSpec:
    """The inverse of ``spec_to_dict``."""
    if d.get("schema") != SCHEMA:
        raise ValueError(f"unsupported spec schema {d.get('schema')!r} (expected {SCHEMA})")
    ops = {n.lower(): _fmt_from(f) for n, f in d["operands"].items()}
    pp = d["p_production"]
    g = d["guard"]
    s = d["schedule"]
    regions: Optional[tuple] = None
    if s["tmem_regions"] is not None:
        regions = tuple(TmemRegionRequest(n, a, b) for n, a, b in s["tmem_regions"])
    bw = None
    if d["backward"] is not None:
        b = d["backward"]
        bw = Backward(reuse=frozenset(b["reuse"]),
                      formats=MappingProxyType({n: _fmt_from(f) for n, f in b["formats"].items()}),
                      deterministic=b["deterministic"])
    return KernelSpec(
        name=d["name"], target=Target(d["target"]), head_dim=d["head_dim"], mask=Mask(d["mask"]),
        softmax_scale=d["softmax_scale"], **ops,
        p_production=PProduction(PKind(pp["kind"]), DirectPPolicy(pp["policy"]), pp["a"], pp["b"]),
        guard=Guard(GuardKind(g["kind"]), g["m"], g["l"]),
        schedule=Schedule(tile_m=s["tile_m"], tile_n=s["tile_n"], q_stages=s["q_stages"],
                          p_publish=PPublish(s["p_publish"]), tmem_regions=regions,
                          kv_stages=s["kv_stages"]),
        backward=bw,
        locs=MappingProxyType({k: SourceLoc(*v) for k, v in d.get("locs", {}).items()}),
        source_file=d["source_file"],
        source_lines=tuple(d.get("source_lines", ())),
    )


# Where a spec was written, not what it computes: one spec text read through two
# paths gives two values here and one kernel.
SOURCE_FIELDS = ("source_file", "locs", "source_lines")


def computed_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A ``spec_to_dict`` result without ``SOURCE_FIELDS``: what the kernel computes."""
    return {k: v for k, v in d.items() if k not in SOURCE_FIELDS}


def spec_to_json(spec: KernelSpec, *, with_source: bool = True, indent: Optional[int] = None) -> str:
    return json.dumps(spec_to_dict(spec, with_source=with_source), sort_keys=True, indent=indent)


def spec_from_json(text: str) -> KernelSpec:
    return spec_from_dict(json.loads(text))
