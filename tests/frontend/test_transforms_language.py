"""Issue 21's outlier transforms in the language: ``K : ... smooth``, ``V : ... channel_scale``,
``rotate qk hadamard(seed=N)``. What they parse to, the errors at file:line:col (what
numerics.outliers.apply would refuse, refused in the front end), and that a spec without them
serializes without the field (so every existing PLAN_JSON and golden keeps its bytes)."""
from __future__ import annotations

import json

import pytest

from fp4gen.frontend import SpecError, parse_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.serialize import plan_to_dict, spec_from_dict, spec_from_plan_dict, spec_to_dict
from fp4gen.ir.spec import Transforms


def one(body: str, head_dim: int = 64, target: str = "reference"):
    (k,) = parse_text(f"attention k {{\n  target {target}\n  head_dim {head_dim}\n{body}\n}}\n", "t.attn")
    return k


def errors(body: str, head_dim: int = 64):
    with pytest.raises(SpecError) as exc:
        parse_text(f"attention k {{\n  target reference\n  head_dim {head_dim}\n{body}\n}}\n", "t.attn")
    return exc.value.diagnostics


def only_error(body: str, head_dim: int = 64):
    (d,) = errors(body, head_dim)
    return d


@pytest.mark.parametrize("body, want", [
    ("  K : fp8e4m3(block=128) smooth", Transforms(smooth_k=True)),
    ("  V : fp8e4m3(scale=tensor) channel_scale", Transforms(channel_scale_v=True)),
    ("  rotate qk hadamard", Transforms(hadamard=True)),
    ("  rotate qk hadamard(seed=7)", Transforms(hadamard=True, hadamard_seed=7)),
    ("  rotate qk hadamard(7)", Transforms(hadamard=True, hadamard_seed=7)),
    ("  K : bf16 smooth\n  V : bf16 channel_scale\n  rotate qk hadamard(seed=0)",
     Transforms(True, True, True, 0)),
    ("  P : fp8e4m3 via exp\n  K : nvfp4 smooth", Transforms(smooth_k=True)),
    ("  K : fp8e4m3", Transforms()),
])
def test_options_parse(body, want):
    s = one(body)
    assert s.transforms == want
    assert bool(s.transforms) == bool(want.names)


def test_locations_of_the_options():
    s = one("  K : fp8e4m3(block=128) smooth\n  V : fp8e4m3 channel_scale\n  rotate qk hadamard(seed=3)")
    assert (s.loc("K.smooth").line, s.loc("K.smooth").col) == (4, 26)
    assert (s.loc("V.channel_scale").line, s.loc("V.channel_scale").col) == (5, 15)
    assert (s.loc("rotate").line, s.loc("rotate").col) == (6, 13)
    assert s.loc("rotate.seed").line == 6
    assert s.loc("K").col == 7  # the format's location is where it was


@pytest.mark.parametrize("body, line, col, words", [
    ("  Q : fp8e4m3 smooth", 4, 15, ["option of K, not Q"]),
    ("  V : fp8e4m3 smooth", 4, 15, ["option of K, not V"]),
    ("  K : fp8e4m3 channel_scale", 4, 15, ["option of V, not K"]),
    ("  K : fp8e4m3 smoth", 4, 15, ["unknown option 'smoth' of K"]),
    ("  O : bf16 smooth", 4, 12, ["option of K, not O"]),
    ("  P : fp8e4m3 via exp chanel", 4, 23, ["P takes no options"]),
    ("  K : fp8e4m3 smooth smooth", 4, 22, ["written twice"]),
    ("  rotate kv hadamard", 4, 10, ["applies to 'qk'"]),
    ("  rotate qk walsh", 4, 13, ["unknown rotation 'walsh'"]),
    ("  rotate qk hadamard(seed=-1)", 4, 27, ["seed must be from 0"]),
    ("  rotate qk hadamard(seed=1.5)", 4, 27, ["seed must be an integer"]),
    ("  rotate qk hadamard(sead=1)", 4, 22, ["no parameter 'sead'"]),
    ("  rotate qk hadamard\n  rotate qk hadamard(seed=1)", 5, 3, ["the rotation is set twice"]),
    ("  backward {\n    dK : bf16 smooth\n  }", 5, 15, ["options of the forward operands"]),
])
def test_errors_at_their_word(body, line, col, words):
    d = only_error(body)
    assert (d.loc.file, d.loc.line, d.loc.col) == ("t.attn", line, col), str(d.message)
    for w in words:
        assert w in d.message


@pytest.mark.parametrize("extra, field, line", [
    ("  softcap 30", "softcap", 5),
    ("  sinks learned", "sinks", 5),
])
def test_smoothing_refuses_softcap_and_sinks(extra, field, line):
    d = only_error(f"  K : fp8e4m3 smooth\n{extra}")
    assert (d.loc.line, d.loc.col) == (4, 15)  # at the word 'smooth'
    assert f"K smoothing with {field}" in d.message
    (note,) = d.notes
    assert note.loc.line == line and field in note.message


def test_other_transforms_take_softcap_and_sinks():
    s = one("  softcap 30\n  sinks learned\n  V : fp8e4m3 channel_scale\n  rotate qk hadamard")
    assert s.transforms == Transforms(channel_scale_v=True, hadamard=True)


@pytest.mark.parametrize("head_dim, ok", [(16, True), (32, True), (64, True), (128, True), (256, True),
                                          (48, False), (96, False), (192, False)])
def test_hadamard_needs_a_power_of_two_head_dim(head_dim, ok):
    if ok:
        assert one("  rotate qk hadamard", head_dim=head_dim).transforms.hadamard
        return
    d = only_error("  rotate qk hadamard", head_dim=head_dim)
    assert (d.loc.line, d.loc.col) == (4, 13) and f"got {head_dim}" in d.message
    assert d.notes[0].loc.line == 3  # the head_dim line


def test_transforms_with_a_kv_cache_are_refused():
    ds = errors("  K : fp8e4m3 smooth\n  kv_cache {\n    format bf16\n  }")
    assert any(d.loc.line == 4 and "kv_cache" in d.message and "smooth" in d.message for d in ds)
    (d,) = errors("  rotate qk hadamard\n  kv_cache {\n    format bf16\n  }")
    assert d.loc.line == 4 and "kv_cache" in d.message


def test_rotate_outside_the_attention_block():
    with pytest.raises(SpecError) as exc:
        parse_text("attention k {\n  target reference\n  head_dim 64\n  schedule {\n    rotate qk hadamard\n  }\n}\n",
                   "t.attn")
    assert any(d.loc.line == 5 for d in exc.value.diagnostics)


def test_round_trip_and_plan_record():
    s = one("  K : fp8e4m3(block=128) smooth\n  V : fp8e4m3 channel_scale\n  rotate qk hadamard(seed=3)")
    d = spec_to_dict(s)
    assert d["transforms"] == {"smooth_k": True, "channel_scale_v": True, "hadamard": True, "hadamard_seed": 3}
    assert spec_from_dict(json.loads(json.dumps(d))) == s
    pd = json.loads(json.dumps(plan_to_dict(plan_kernel(s))))
    assert spec_from_plan_dict(pd).transforms == s.transforms
    t = pd["transforms"]
    assert t["transforms"] == ["smooth_k", "channel_scale_v", "hadamard"] and t["fused"] is False
    steps = {(p["transform"], p["step"]) for p in t["passes"]}
    assert {x for x, _ in steps} == {"smooth_k", "channel_scale_v", "hadamard"}
    # bytes: a bf16 row of D=64 is 128 bytes; K - mean reads and writes one
    kmean = next(p for p in t["passes"] if p["step"] == "K - mean")
    assert (kmean["bytes_read"], kmean["bytes_written"], kmean["per"]) == (128, 128, "key")
    b, h, n = t["example"]
    per_row = sum(p["bytes_read"] + p["bytes_written"] for p in t["passes"])
    assert t["example_bytes"] == per_row * b * h * n
    assert t["example_us"] == pytest.approx(t["example_bytes"] / t["hbm_bytes_per_s"] * 1e6, abs=0.05)


def test_no_options_no_field():
    s = one("  K : fp8e4m3(block=128)")
    assert "transforms" not in spec_to_dict(s)
    pd = plan_to_dict(plan_kernel(s))
    assert "transforms" not in pd and "transforms" not in pd["spec"]
