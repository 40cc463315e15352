"""Dumps: JSON schema fields, text, SVG (well-formed, labelled), HTML."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from fp4gen.ir.dump import SCHEMA_VERSION, to_html, to_json, to_svg, to_text
from fp4gen.ir.passes import plan_kernel

import specs


@pytest.fixture(scope="module")
def paper():
    return plan_kernel(specs.paper_fp4(), debug=True)


def test_json_schema(paper):
    j = to_json(paper)
    assert j["schema"] == SCHEMA_VERSION == "fp4gen.plan/1"
    assert json.loads(json.dumps(j)) == j
    t = j["tmem"]
    assert t["total_columns"] == 512 and t["alloc_columns"] == 512 and t["lanes"] == 128
    regions = {r["name"]: r for r in t["regions"]}
    assert (regions["S0"]["first_col"], regions["S0"]["last_col"]) == (0, 127)
    assert regions["S0"]["aliases"] == ["P0", "SFP0", "SFV0", "SFQ1", "SFK1"]
    assert regions["P0"]["alias_of"] == "S0" and regions["P0"]["lanes"] == [0, 127]
    assert regions["P0"]["live"] == {"opens": "PUBLISH_P1[0]", "closes": "PV_2[0]", "loop": "per_tile"}
    ev = j["events"]["by_stage"]
    assert set(ev) == {"shared", "0", "1"}
    qk0 = next(e for e in ev["0"] if e["name"] == "QK")
    assert {"barrier": "S_free[0]", "tile": "j-1"} in qk0["waits"] and "S_full[0]" in qk0["signals"]
    assert j["events"]["barriers"]["P_full[0]"]["signalled_by"] == ["PUBLISH_P2[0]"]
    assert j["pipeline"]["registers"] == {"total": 65536, "limit": 65536}
    assert j["cost"]["chosen"] == "direct_p_fast" and j["cost"]["assumptions"]
    assert j["simulation"]["tiles"] == 3 and j["sm90"] is None


def test_json_sm90_and_reference():
    j = to_json(plan_kernel(specs.sm90_fp8()))
    assert j["tmem"] is None and j["sm90"]["consumer_warpgroups"] == 2 and j["sm90"]["v_transposed"] is True
    j = to_json(plan_kernel(specs.reference()))
    assert j["tmem"] is None and j["events"] is None and j["cost"] is None and j["contracts"]
    json.dumps(j)


def test_text(paper):
    t = to_text(paper)
    assert "TMEM: 512 of 512 columns, tcgen05.alloc 512" in t
    assert "[  0, 127]  S0" in t and "[ 64,  79]  P0" in t and "[384, 511]  O1" in t
    assert "P publish: halves" in t and "Cost model" in t


def test_svg_is_wellformed_and_labelled(paper):
    svg = to_svg(paper)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    texts = " ".join(el.text or "" for el in root.iter() if el.tag.endswith("text"))
    for word in ("S0", "S1", "O0", "O1", "P0 64-79", "SFP0 80-83", "lane 127", "512", "softmax0", "mma"):
        assert word in texts, word
    assert "Event timeline" in texts


def test_svg_sm90_and_reference():
    ET.fromstring(to_svg(plan_kernel(specs.sm90_fp8())))
    ET.fromstring(to_svg(plan_kernel(specs.reference())))


def test_html(paper):
    h = to_html(paper)
    assert h.startswith("<!DOCTYPE html>") and "<svg" in h and "TMEM: 512 of 512" in h
