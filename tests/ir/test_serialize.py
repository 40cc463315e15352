"""fp4gen.ir.serialize: the one JSON form of specs and plans."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4gen.ir import serialize
from fp4gen.ir.dump import to_json
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.serialize import (
    PlanJsonError, computed_fields, json_text, plan_to_dict, spec_from_dict, spec_from_plan_dict,
    spec_from_plan_json, spec_to_dict,
)
from fp4gen.ir.spec import (Backward, Guard, KernelSpec, KvCache, Layout, Mask, OperandFormat, PProduction, PSource,
                            Schedule, Sinks, Transforms)

ROOT = Path(__file__).resolve().parents[2]
frontend = pytest.importorskip("fp4gen.frontend")
EXAMPLES = [s for p in sorted((ROOT / "examples").glob("*.attn")) for s in frontend.parse_file(p)]


def field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_spec_dict_names_every_field():
    """A field added to KernelSpec (or a part of it) must be added to spec_to_dict too."""
    spec = next(s for s in EXAMPLES if s.backward is not None)
    # schedule.p_source is written only when it is not the default (tmem), so that the embedded
    # dicts of the tmem kernels keep their bytes: set it
    spec = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, p_source=PSource.SMEM))
    # so are the window, softcap, sinks and layout (issue 19): set them too
    spec = dataclasses.replace(spec, mask=Mask.WINDOW, window=(64, 0), softcap=30.0, sinks=Sinks.LEARNED,
                               layout=Layout.VARLEN)
    # and the kv_cache block (issue 22)
    spec = dataclasses.replace(spec, kv_cache=KvCache())
    # and the outlier transforms (issue 21)
    spec = dataclasses.replace(spec, transforms=Transforms(smooth_k=True, hadamard=True, hadamard_seed=1))
    d = spec_to_dict(spec)
    ops = {"q", "k", "p", "v", "o"}
    assert set(d) - {"schema", "operands"} == field_names(KernelSpec) - ops
    assert set(d["operands"]) == {n.upper() for n in ops}
    assert set(d["operands"]["Q"]) == field_names(OperandFormat)
    assert set(d["p_production"]) == field_names(PProduction)
    assert set(d["guard"]) == field_names(Guard)
    assert set(d["schedule"]) == field_names(Schedule)
    assert set(d["backward"]) == field_names(Backward)


@pytest.mark.parametrize("spec", EXAMPLES, ids=lambda s: s.name)
def test_plan_dict_gives_back_the_spec(spec):
    d = json.loads(json.dumps(to_json(plan_kernel(spec))))
    got = spec_from_plan_dict(d)
    assert got == spec and computed_fields(spec_to_dict(got)) == computed_fields(spec_to_dict(spec))
    assert got.locs == {} and got.source_lines == ()  # provenance is not in the plan
    full = spec_from_dict(spec_to_dict(spec))  # with_source=True keeps it
    assert (full.locs, full.source_lines) == (spec.locs, spec.source_lines)


def test_plan_to_dict_is_to_json_without_the_simulation():
    plan = plan_kernel(EXAMPLES[0])
    j = to_json(plan)
    assert j["simulation"] is not None
    assert plan_to_dict(plan) == dict(j, simulation=None)


@pytest.mark.parametrize("bad, why", [
    ([], "a plan is a JSON object"),
    ({"schema": "fp4gen.plan/0"}, "plan schema 'fp4gen.plan/0'"),
    ({"schema": serialize.PLAN_SCHEMA, "spec": {"mask": "none"}}, "no kernel_spec"),
    ({"schema": serialize.PLAN_SCHEMA, "kernel_spec": {"schema": 1}}, "kernel_spec is malformed"),
])
def test_spec_from_plan_dict_says_why(bad, why):
    with pytest.raises(PlanJsonError, match=why):
        spec_from_plan_dict(bad)
    with pytest.raises(PlanJsonError, match="not JSON"):
        spec_from_plan_json("{")


def test_json_text_of_a_plan():
    d = to_json(plan_kernel(EXAMPLES[0]))
    text = json_text(d)
    assert json.loads(text) == json.loads(json.dumps(d))
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) > 50
    # long lines are single strings that cannot be broken
    assert all(len(ln) <= 100 or ln.strip().count('"') <= 4 for ln in lines)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(_json, st.integers(min_value=1, max_value=120))
def test_json_text_reads_back(value, width):
    assert json.loads(json_text(value, width)) == value
