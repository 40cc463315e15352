"""Every generated module's PLAN_JSON holds the spec it was generated from (issue 17, item 5).

The modules are read, not imported (no CuTe DSL needed): PLAN_JSON is the module-level string
constant the loader's contract check reads too. The spec it holds must equal the one the
front end parses from the module's SPEC_FILE, in everything the kernel computes.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from fp4gen.ir.serialize import PLAN_SCHEMA, computed_fields, spec_from_plan_json, spec_to_dict

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p for p in (ROOT / "generated").glob("*.py") if p.name != "__init__.py")

frontend = pytest.importorskip("fp4gen.frontend")


def module_constants(path: Path) -> dict:
    """Module-level ``NAME = <str literal>`` assignments, with the source lines each spans."""
    out = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = (node.value.value, node.end_lineno - node.lineno + 1)
    return out


def parsed_spec(spec_file: str, kernel: str):
    """The spec as ``fp4gen regenerate`` parses it (the repository-relative file name)."""
    text = (ROOT / spec_file).read_text(encoding="utf-8")
    (spec,) = [s for s in frontend.parse_text(text, filename=spec_file) if s.name == kernel]
    return spec


def test_there_are_modules_to_check():
    assert len(MODULES) >= 17, [p.name for p in MODULES]
    assert {p.stem.rsplit("_", 1)[1] for p in MODULES} >= {"sm90a", "sm100a"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_plan_json_round_trips_the_spec(path):
    c = module_constants(path)
    plan_json, lines = c["PLAN_JSON"]
    d = json.loads(plan_json)
    assert d["schema"] == PLAN_SCHEMA
    assert lines > 10, f"PLAN_JSON of {path.name} is on {lines} line(s); it is rendered one line per JSON line"
    got = spec_from_plan_json(plan_json)
    want = parsed_spec(c["SPEC_FILE"][0], c["KERNEL_NAME"][0])
    assert got.target.value == c["TARGET"][0] == d["target"]
    assert computed_fields(spec_to_dict(got)) == computed_fields(spec_to_dict(want))
    assert got == want  # dataclass equality: the computed fields and source_file
    assert spec_to_dict(got, with_source=False) == d["kernel_spec"]  # and back to the same dict
