"""Golden dumps of the example specs (text + JSON). FP4GEN_UPDATE_GOLDEN=1 rewrites them.

The goldens are reviewed by eye: they are the expected plans (layouts, barriers,
budgets), not just whatever the code printed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fp4gen.ir.dump import to_json, to_text
from fp4gen.ir.passes import plan_kernel

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.attn"))
UPDATE = os.environ.get("FP4GEN_UPDATE_GOLDEN", "") not in ("", "0")

frontend = pytest.importorskip("fp4gen.frontend")


def _plans(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # relative source paths in the dumps
    return [plan_kernel(s, debug=True) for s in frontend.parse_file(f"examples/{name}")]


def _check(path: Path, text: str):
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with FP4GEN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{path.name} differs from the golden (FP4GEN_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("example", EXAMPLES)
def test_golden(example, monkeypatch):
    for plan in _plans(example, monkeypatch):
        _check(GOLDEN / f"{plan.spec.name}.txt", to_text(plan))
        _check(GOLDEN / f"{plan.spec.name}.json", json.dumps(to_json(plan), indent=1, sort_keys=True) + "\n")


def test_paper_golden_layout_by_hand():
    """The paper recipe's golden holds the layout written out here by hand."""
    j = json.loads((GOLDEN / "fa4_fp4_d128.json").read_text())
    got = {r["name"]: (r["first_col"], r["last_col"], r["alias_of"]) for r in j["tmem"]["regions"]}
    assert got == {
        "S0": (0, 127, None), "S1": (128, 255, None), "O0": (256, 383, None), "O1": (384, 511, None),
        "P0": (64, 79, "S0"), "SFP0": (80, 83, "S0"), "SFV0": (84, 87, "S0"),
        "P1": (192, 207, "S1"), "SFP1": (208, 211, "S1"), "SFV1": (212, 215, "S1"),
        "SFQ0": (128, 135, "S1"), "SFK0": (136, 143, "S1"), "SFQ1": (0, 7, "S0"), "SFK1": (8, 15, "S0"),
    }
    assert j["spec"]["mask"] == "causal" and j["mma"][0]["kind"] == "kind::mxf4nvf4.block_scale.block16"
