"""The one JSON form of IR data: ``KernelSpec`` <-> dict, ``KernelPlan`` -> ``fp4gen.plan/1``.

Everything in fp4gen that turns a spec or a plan into JSON goes through this module: the
plan dumps (``fp4gen.ir.dump.to_json``, ``fp4gen schedule --format json``, the goldens in
``tests/ir/golden/``), every generated module's ``PLAN_JSON`` (``fp4gen.lowering.plan_json``),
the reference backend's ``SPEC_JSON`` and the loader's check of it, and the spec fingerprint
of ``fp4gen.torch_ops``. It imports only the IR data classes (``fp4gen.ir.spec``,
``fp4gen.ir.plan``), so the runtime, which generated modules import, reads a spec back
without the front end or the planner.

Spec (``spec_to_dict`` / ``spec_from_dict``, schema ``SPEC_SCHEMA``): every field of a
``KernelSpec``, enums by their spelling. Lossless for what the kernel computes;
``with_source=False`` drops the provenance fields ``locs`` and ``source_lines`` (where each
field was written, the spec's text), which a spec read back then lacks (``origin()`` says
"default"). ``source_file`` is always kept. ``computed_fields`` leaves out all three.

Plan (``plan_to_dict``, schema ``PLAN_SCHEMA`` = ``"fp4gen.plan/1"``, docs/plan.md): a
readable view of every section of the plan, plus ``kernel_spec``, the spec in
``spec_to_dict(spec, with_source=False)`` form. ``spec_from_plan_dict`` reads the spec back
from it. There is no ``plan_from_dict``: the view is not lossless (cycle counts are rounded
to 0.1, derived values such as ``threads`` and ``aliases`` are written instead of what they
derive from, event waits are written as tile names, and the backward section is a plain
walk of a planner class that this layer cannot import), so the plan is recomputed from the
spec when it is needed (``fp4gen.ir.passes.plan_kernel(spec_from_plan_dict(d))``).

``json_text`` is the multi-line text generated modules embed: stable (sorted keys) and
short (a value that fits in ``width`` columns stays on one line).
"""
from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType
from typing import Any, Mapping, Optional

from .plan import KernelPlan
from .spec import (
    Backward, CacheFormat, DirectPPolicy, Format, Guard, GuardKind, KernelSpec, KvCache, KvStorage, Layout, Mask,
    OperandFormat, PKind, PProduction, PPublish, PSource, ScaleGranularity, Schedule, Sinks, SourceLoc, Target,
    TmemRegionRequest, Transforms,
)

SPEC_SCHEMA = 1
PLAN_SCHEMA = "fp4gen.plan/1"

# Where a spec was written, not what it computes: one spec text read through two
# paths gives two values here and one kernel.
SOURCE_FIELDS = ("source_file", "locs", "source_lines")


# --------------------------------------------------------------------------- spec


def _fmt_to(f: OperandFormat) -> dict:
    return {"format": f.format.value, "granularity": f.granularity.value, "block": f.block,
            "scale": f.scale.value if f.scale is not None else None}


def _fmt_from(d: dict) -> OperandFormat:
    return OperandFormat(Format(d["format"]), ScaleGranularity(d["granularity"]), d["block"],
                         Format(d["scale"]) if d["scale"] is not None else None)


def _kv_cache_to(c: KvCache) -> dict[str, Any]:
    return {"storage": c.storage.value, "page_size": c.page_size,
            "format": {"format": c.format.format.value, "granularity": c.format.granularity.value,
                       "tensor_scale": c.format.tensor_scale},
            "q_tokens": c.q_tokens, "gqa": c.gqa}


def _kv_cache_from(d: Mapping[str, Any]) -> KvCache:
    f = d["format"]
    return KvCache(storage=KvStorage(d["storage"]), page_size=d["page_size"],
                   format=CacheFormat(Format(f["format"]), ScaleGranularity(f["granularity"]), bool(f["tensor_scale"])),
                   q_tokens=int(d["q_tokens"]), gqa=int(d["gqa"]))


def _extensions_to(spec: KernelSpec) -> dict[str, Any]:
    """The fields beyond dense none/causal attention (window, softcap, sinks, layout, kv_cache,
    transforms), each written only when it is not the default: a spec that does not use them
    serializes byte for byte as before they existed (the goldens, every committed PLAN_JSON, the
    torch_ops keys)."""
    d: dict[str, Any] = {}
    if spec.window is not None:
        d["window"] = list(spec.window)
    if spec.softcap:
        d["softcap"] = spec.softcap
    if spec.sinks is not Sinks.NONE:
        d["sinks"] = spec.sinks.value
    if spec.layout is not Layout.DENSE:
        d["layout"] = spec.layout.value
    if spec.kv_cache is not None:
        d["kv_cache"] = _kv_cache_to(spec.kv_cache)
    if spec.transforms:
        t = spec.transforms
        d["transforms"] = {"smooth_k": t.smooth_k, "channel_scale_v": t.channel_scale_v, "hadamard": t.hadamard,
                           "hadamard_seed": t.hadamard_seed}
        if t.sink_tokens:  # written only when set: the transforms of older specs keep their bytes
            d["transforms"]["sink_tokens"] = t.sink_tokens
    return d


def _extensions_from(d: Mapping[str, Any]) -> dict[str, Any]:
    """``_extensions_to``'s inverse: KernelSpec keyword arguments (the defaults for absent keys)."""
    w = d.get("window")
    if (d["mask"] == Mask.WINDOW.value) != (w is not None):
        raise ValueError(f"mask {d['mask']!r} with window {w!r}: a window mask and its sizes come together")
    return {"window": None if w is None else (int(w[0]), int(w[1])), "softcap": float(d.get("softcap", 0.0)),
            "sinks": Sinks(d.get("sinks", "none")), "layout": Layout(d.get("layout", "dense")),
            "kv_cache": None if d.get("kv_cache") is None else _kv_cache_from(d["kv_cache"]),
            "transforms": _transforms_from(d.get("transforms"))}


def _transforms_from(t: Optional[Mapping[str, Any]]) -> Transforms:
    if t is None:
        return Transforms()
    seed = t.get("hadamard_seed")
    return Transforms(smooth_k=bool(t["smooth_k"]), channel_scale_v=bool(t["channel_scale_v"]),
                      hadamard=bool(t["hadamard"]), hadamard_seed=None if seed is None else int(seed),
                      sink_tokens=int(t.get("sink_tokens", 0)))


def spec_to_dict(spec: KernelSpec, *, with_source: bool = True) -> dict[str, Any]:
    """Every field of ``spec`` as JSON-compatible values (enums by their spelling);
    ``with_source=False`` leaves out ``locs`` and ``source_lines``."""
    s = spec.schedule
    d: dict[str, Any] = {
        "schema": SPEC_SCHEMA,
        "name": spec.name,
        "target": spec.target.value,
        "head_dim": spec.head_dim,
        "mask": spec.mask.value,
        "softmax_scale": spec.softmax_scale,
        **_extensions_to(spec),
        "operands": {n: _fmt_to(spec.operand(n)) for n in ("Q", "K", "P", "V", "O")},
        "p_production": {"kind": spec.p_production.kind.value, "policy": spec.p_production.policy.value,
                         "a": spec.p_production.a, "b": spec.p_production.b},
        "guard": {"kind": spec.guard.kind.value, "m": spec.guard.m, "l": spec.guard.l},
        "schedule": {
            "tile_m": s.tile_m, "tile_n": s.tile_n, "q_stages": s.q_stages,
            "p_publish": s.p_publish.value, "kv_stages": s.kv_stages,
            "tmem_regions": None if s.tmem_regions is None else
            [[r.name, r.first_col, r.last_col] for r in s.tmem_regions],
            # written only when not the default, so that the dumps of every tmem spec keep their bytes
            **({"p_source": s.p_source.value} if s.p_source is not PSource.TMEM else {}),
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


def spec_from_dict(d: Mapping[str, Any]) -> KernelSpec:
    """The inverse of ``spec_to_dict`` (a dict without ``locs``/``source_lines`` gives a spec
    without them). ValueError for another schema; KeyError/ValueError for a malformed dict."""
    if d.get("schema") != SPEC_SCHEMA:
        raise ValueError(f"unsupported spec schema {d.get('schema')!r} (expected {SPEC_SCHEMA})")
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
        softmax_scale=d["softmax_scale"], **_extensions_from(d), **ops,
        p_production=PProduction(PKind(pp["kind"]), DirectPPolicy(pp["policy"]), pp["a"], pp["b"]),
        guard=Guard(GuardKind(g["kind"]), g["m"], g["l"]),
        schedule=Schedule(tile_m=s["tile_m"], tile_n=s["tile_n"], q_stages=s["q_stages"],
                          p_publish=PPublish(s["p_publish"]), tmem_regions=regions,
                          kv_stages=s["kv_stages"], p_source=PSource(s.get("p_source", "tmem"))),
        backward=bw,
        locs=MappingProxyType({k: SourceLoc(*v) for k, v in d.get("locs", {}).items()}),
        source_file=d["source_file"],
        source_lines=tuple(d.get("source_lines", ())),
    )


def computed_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """A ``spec_to_dict`` result without ``SOURCE_FIELDS``: what the kernel computes."""
    return {k: v for k, v in d.items() if k not in SOURCE_FIELDS}


def spec_to_json(spec: KernelSpec, *, with_source: bool = True, indent: Optional[int] = None) -> str:
    return json.dumps(spec_to_dict(spec, with_source=with_source), sort_keys=True, indent=indent)


def spec_from_json(text: str) -> KernelSpec:
    return spec_from_dict(json.loads(text))


# --------------------------------------------------------------------------- plan


def _r(x: float) -> float:
    return round(float(x), 1)


def _tile(dj: int) -> str:
    return "j" if dj == 0 else f"j{dj:+d}"


def event_id(e) -> str:
    return e.name if e.stage is None else f"{e.name}[{e.stage}]"


def _plain(x):
    """Dataclasses -> dicts of their fields, tuples -> lists, recursively (the sections whose
    JSON is their fields as they are: ``sm90`` and ``backward``)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _spec_view(s: KernelSpec) -> dict:
    """The spec as a reader wants it: the scale resolved, formats spelled as in a spec."""
    sch = s.schedule
    return {
        "head_dim": s.head_dim, "mask": s.mask.value, "softmax_scale": s.scale, **_extensions_to(s),
        "formats": {k: str(s.operand(k)) for k in ("Q", "K", "P", "V", "O")},
        "p_production": {"kind": s.p_production.kind.value, "policy": s.p_production.policy.value,
                         "a": s.p_production.a, "b": s.p_production.b},
        "guard": {"kind": s.guard.kind.value, "m": s.guard.m, "l": s.guard.l},
        "schedule": {"tile_m": sch.tile_m, "tile_n": sch.tile_n, "q_stages": sch.q_stages,
                     "kv_stages": sch.kv_stages, "p_publish": sch.p_publish.value,
                     "tmem": "auto" if sch.tmem_regions is None else
                     [{"name": r.name, "first_col": r.first_col, "last_col": r.last_col} for r in sch.tmem_regions],
                     **({"p_source": sch.p_source.value} if sch.p_source is not PSource.TMEM else {})},
        "backward": None if s.backward is None else {
            "reuse": sorted(s.backward.reuse),
            "formats": {g: str(s.backward.format_of(g)) for g in ("dO", "dS", "dP", "dQ", "dK", "dV")},
            "deterministic": s.backward.deterministic},
    }


def _tmem(plan: KernelPlan) -> Optional[dict]:
    tm = plan.tmem
    if tm is None:
        return None
    inside = {r.name: [x.name for x in tm.regions if x.alias_of == r.name] for r in tm.regions}
    return {
        "total_columns": tm.total_columns, "alloc_columns": tm.alloc_columns,
        "limit_columns": tm.limit_columns, "lanes": 128,
        "regions": [{
            "name": r.name, "first_col": r.first_col, "last_col": r.last_col, "columns": r.columns,
            "lanes": [r.first_lane, r.last_lane], "dtype": r.dtype, "purpose": r.purpose, "stage": r.stage,
            "alias_of": r.alias_of, "aliases": inside[r.name],
            "live": {"opens": r.live.opens, "closes": r.live.closes, "loop": r.live.loop},
            "explicit": r.explicit,
        } for r in tm.regions],
        "notes": list(tm.notes),
    }


def _events(plan: KernelPlan) -> Optional[dict]:
    if not plan.events:
        return None

    def one(e) -> dict:
        return {"id": event_id(e), "name": e.name, "role": e.role, "stage": e.stage, "tile": _tile(e.dj),
                "waits": [{"barrier": w.barrier, "tile": _tile(e.dj + w.dj)} for w in e.waits],
                "signals": list(e.signals),
                "reads": [{"region": a.region, "part": a.part} for a in e.reads],
                "writes": [{"region": a.region, "part": a.part} for a in e.writes],
                "unit": e.resource, "last_tile_only": e.last_tile_only, "what": e.what}

    stages: dict[str, list] = {}
    for e in plan.events:
        key = "shared" if e.stage is None else str(e.stage)
        stages.setdefault(key, []).append(one(e))
    barriers: dict[str, dict] = {}
    for e in plan.events:
        for b in e.signals:
            barriers.setdefault(b, {"signalled_by": [], "waited_by": []})["signalled_by"].append(event_id(e))
        for w in e.waits:
            barriers.setdefault(w.barrier, {"signalled_by": [], "waited_by": []})["waited_by"].append(event_id(e))
    return {"tile_note": "tile j is the KV tile of the loop iteration; j-1 the previous one",
            "by_stage": stages, "barriers": dict(sorted(barriers.items()))}


def plan_to_dict(plan: KernelPlan, *, simulation: Optional[dict] = None) -> dict[str, Any]:
    """The whole plan in the ``fp4gen.plan/1`` schema, plain JSON types (docs/plan.md).

    ``simulation`` is the ``simulation`` section (``{"tiles", "makespan_cycles"}``) or None:
    it comes from the planner's event simulator, which this layer cannot import;
    ``fp4gen.ir.dump.to_json`` fills it."""
    s = plan.spec
    pp = plan.pipeline
    return {
        "schema": PLAN_SCHEMA,
        "kernel": s.name, "target": s.target.value, "source_file": s.source_file,
        "spec": _spec_view(s),
        "kernel_spec": spec_to_dict(s, with_source=False),
        "mma": [{"name": m.name, "a": m.a, "b": m.b, "kind": m.kind, "block_scaled": m.block_scaled,
                 "sf_block": m.sf_block, "sf_dtype": m.sf_dtype, "a_source": m.a_source, "b_source": m.b_source,
                 "a_major": m.a_major, "b_major": m.b_major, "flops_per_clk_sm": m.flops_per_clk_sm}
                for m in plan.mma],
        "contracts": [{"operand": c.operand, "payload": c.payload, "bits": c.bits, "block": c.block,
                       "scale_dtype": c.scale_dtype, "granularity": c.granularity, "scale_layout": c.scale_layout,
                       "major": c.major, "storage": c.storage, "quantized_by": c.quantized_by,
                       "notes": list(c.notes)} for c in plan.contracts],
        "tmem": _tmem(plan),
        "publish": None if plan.publish is None else {
            "mode": plan.publish.mode, "s_free_after": plan.publish.s_free_after, "notes": list(plan.publish.notes),
            "parts": [{"index": p.index, "keys": list(p.keys),
                       "p_columns": list(p.p_columns) if p.p_columns else None, "with_scales": p.with_scales,
                       "barrier": p.barrier, "unblocks": p.unblocks} for p in plan.publish.parts]},
        "pipeline": None if pp is None else {
            "tile_m": pp.tile_m, "tile_n": pp.tile_n, "q_stages": pp.q_stages, "kv_stages": pp.kv_stages,
            "roles": [{"name": r.name, "warps": r.warps, "threads": r.threads, "registers": r.registers,
                       "does": r.does} for r in pp.roles],
            "smem": {"items": [{"name": i.name, "bytes": i.bytes, "detail": i.detail} for i in pp.smem],
                     "total_bytes": pp.smem_bytes, "limit_bytes": pp.smem_limit},
            "registers": {"total": pp.registers_total, "limit": pp.registers_limit},
            "spills": {"budget_bytes": pp.spill_budget_bytes, "reason": pp.spill_reason},
            "mma_order": pp.mma_order, "notes": list(pp.notes)},
        "sm90": None if plan.sm90 is None else _plain(plan.sm90),
        "events": _events(plan),
        "cost": None if plan.cost is None else {
            "unit": "cycles per KV tile per SM",
            "chosen": plan.cost.chosen,
            "paths": [{"path": p.path, "bottleneck": p.bottleneck, "cycles_per_tile": _r(p.cycles_per_tile),
                       "serial_cycles": _r(p.serial_cycles),
                       "units": [{"unit": u.unit, "cycles": _r(u.cycles), "detail": u.detail} for u in p.units]}
                      for p in plan.cost.paths],
            "event_cycles": {k: _r(v) for k, v in plan.cost.event_cycles},
            "assumptions": list(plan.cost.assumptions)},
        "simulation": simulation,
        "notes": list(plan.notes),
        "backward": None if plan.backward is None else _plain(plan.backward),
        # only for a kv_cache spec, so that every other plan keeps its bytes
        **({"decode": _plain(plan.decode)} if plan.decode is not None else {}),
        # only for a spec with outlier transforms, likewise
        **({"transforms": _plain(plan.transforms)} if plan.transforms is not None else {}),
    }


class PlanJsonError(ValueError):
    """A PLAN_JSON (or plan dict) that does not hold a spec this version can read."""


def spec_from_plan_dict(d: Any) -> KernelSpec:
    """The ``KernelSpec`` a ``fp4gen.plan/1`` dict was planned from (its ``kernel_spec``),
    without ``locs``/``source_lines``; ``PlanJsonError`` saying why when ``d`` holds none."""
    if not isinstance(d, Mapping):
        raise PlanJsonError(f"a plan is a JSON object, not {type(d).__name__}")
    if d.get("schema") != PLAN_SCHEMA:
        raise PlanJsonError(f"plan schema {d.get('schema')!r}, expected {PLAN_SCHEMA!r}")
    ks = d.get("kernel_spec")
    if not isinstance(ks, Mapping):
        raise PlanJsonError("the plan has no kernel_spec (written before fp4gen recorded it)")
    try:
        return spec_from_dict(ks)
    except (KeyError, TypeError, ValueError) as e:
        raise PlanJsonError(f"the plan's kernel_spec is malformed ({type(e).__name__}: {e})") from None


def spec_from_plan_json(text: str) -> KernelSpec:
    """``spec_from_plan_dict`` of a ``PLAN_JSON`` string (``PlanJsonError`` if it is not JSON)."""
    try:
        d = json.loads(text)
    except (TypeError, ValueError) as e:
        raise PlanJsonError(f"not JSON ({e})") from None
    return spec_from_plan_dict(d)


# --------------------------------------------------------------------------- text


def json_text(value: Any, width: int = 100) -> str:
    """``value`` as JSON on several lines, keys sorted, ending in a newline: a list or object
    whose one-line form fits in ``width`` columns (indent included) stays on one line; a longer
    one opens a line of its own, its items follow one level (one space) deeper, as many short
    items to a line as fit, and a long item is broken the same way. Deterministic;
    ``json.loads`` reads back ``value``."""
    lines: list[str] = []

    def emit(v, depth: int, prefix: str, suffix: str) -> None:
        pad = " " * depth
        flat = prefix + json.dumps(v, sort_keys=True) + suffix
        if not isinstance(v, (dict, list)) or not v or len(pad) + len(flat) <= width:
            lines.append(pad + flat)
            return
        if isinstance(v, dict):
            items = [(json.dumps(k) + ": ", v[k]) for k in sorted(v)]
            opener, closer = "{", "}"
        else:
            items = [("", x) for x in v]
            opener, closer = "[", "]"
        lines.append(pad + prefix + opener)
        inner = pad + " "
        line = ""  # short items gathered for the current line
        for i, (p, x) in enumerate(items):
            sep = "," if i + 1 < len(items) else ""
            piece = p + json.dumps(x, sort_keys=True) + sep
            if len(inner) + len(piece) <= width or not isinstance(x, (dict, list)) or not x:
                if line and len(line) + 1 + len(piece) <= width:
                    line += " " + piece
                else:
                    if line:
                        lines.append(line)
                    line = inner + piece
                continue
            if line:
                lines.append(line)
                line = ""
            emit(x, depth + 1, p, sep)
        if line:
            lines.append(line)
        lines.append(pad + closer + suffix)

    emit(value, 0, "", "")
    return "\n".join(lines) + "\n"
