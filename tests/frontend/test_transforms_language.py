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


# ------------------------------------------------------------------ sink_tokens N -----

@pytest.mark.parametrize("body, want", [
    ("  sink_tokens 1", Transforms(sink_tokens=1)),
    ("  sink_tokens 4", Transforms(sink_tokens=4)),
    ("  sink_tokens 128", Transforms(sink_tokens=128)),
    ("  sink_tokens none", Transforms()),
    ("  sink_tokens 2\n  K : fp8e4m3 smooth\n  V : fp8e4m3 channel_scale\n  rotate qk hadamard(seed=1)",
     Transforms(True, True, True, 1, 2)),
    ("  sink_tokens 3\n  softcap 30\n  sinks learned\n  mask window(64, 0)", Transforms(sink_tokens=3)),
])
def test_sink_tokens_parse(body, want):
    s = one(body)
    assert s.transforms == want
    assert ("sink_tokens" in s.transforms.names) == bool(want.sink_tokens)


def test_sink_tokens_location_and_text():
    s = one("  mask causal\n  sink_tokens 4")
    assert (s.loc("sink_tokens").line, s.loc("sink_tokens").col) == (5, 15)
    assert str(s.transforms) == "sink_tokens(4)" and s.transforms.names == ("sink_tokens",)


@pytest.mark.parametrize("body, line, col, words", [
    ("  sink_tokens 0", 4, 15, ["sink_tokens 0 attends no key exactly"]),
    ("  sink_tokens -1", 4, 15, ["sink_tokens must be from 1 to 128, got -1"]),
    ("  sink_tokens 129", 4, 15, ["sink_tokens must be from 1 to 128, got 129"]),
    ("  sink_tokens 1.5", 4, 15, ["sink_tokens must be an integer, got '1.5'"]),
    ("  sink_tokens 1" + "0" * 45, 4, 15, ["at most 40 are read"]),
    ("  sink_tokens nnone", 4, 15, ["unknown sink_tokens value 'nnone'"]),
    ("  sink_tokens learned", 4, 15, ["takes a count of leading keys, not 'learned'"]),
    ("  sink_tokens 2\n  sink_tokens 3", 5, 3, ["sink_tokens is set twice"]),
    ("  V : mxfp4 sink_tokens", 4, 13, ["sink_tokens is a statement of the attention block", "not an option of V"]),
    ("  schedule {\n    sink_tokens 4\n  }", 5, 5, ["'sink_tokens' belongs directly in the attention block"]),
    ("  backward {\n    sink_tokens 4\n  }", 5, 5, ["'sink_tokens' belongs directly in the attention block"]),
    ("  sink_tokns 4", 4, 3, ["unknown statement 'sink_tokns'", ]),
])
def test_sink_tokens_errors_at_their_word(body, line, col, words):
    d = only_error(body)
    assert (d.loc.file, d.loc.line, d.loc.col) == ("t.attn", line, col), d.render()
    for w in words:
        assert w in d.message, d.render()


def test_sink_tokens_hints():
    assert "did you mean 'sink_tokens'?" in (only_error("  sink_tokns 4").hint or "")
    assert "sink_tokens none" in only_error("  sink_tokens 0").hint
    assert "'sink_tokens 4'" in only_error("  sinks 4").hint  # a count after `sinks` points here


def test_sink_tokens_with_varlen_or_a_kv_cache_is_refused():
    d = only_error("  sink_tokens 4\n  layout varlen")
    assert (d.loc.line, d.loc.col) == (4, 15) and "layout varlen is not built" in d.message
    (note,) = d.notes
    assert note.loc.line == 5 and "layout" in note.message
    ds = errors("  sink_tokens 4\n  kv_cache {\n    format bf16\n  }")
    assert any(d.loc.line == 4 and "'sink_tokens 4' with a kv_cache block" in d.message for d in ds), ds


def test_sink_tokens_with_a_backward_block_is_a_spec():
    """Every backward takes it (the op's backward on keys N.. with the merged O and LSE, the exact
    keys beside it: fp4gen.torch_ops._SinkTokensAttention): no refusal, on every target."""
    for target in ("reference", "sm90a", "sm100a"):
        s = one("  mask causal\n  sink_tokens 4\n  backward {\n    reuse lse\n  }", head_dim=128, target=target)
        assert s.transforms.sink_tokens == 4 and s.backward is not None
        plan_kernel(s)  # the planner takes it as the same spec without the line


def test_sink_tokens_round_trip_and_plan_record():
    s = one("  K : fp8e4m3 smooth\n  sink_tokens 4")
    d = spec_to_dict(s)
    assert d["transforms"] == {"smooth_k": True, "channel_scale_v": False, "hadamard": False,
                               "hadamard_seed": None, "sink_tokens": 4}
    back = spec_from_dict(json.loads(json.dumps(d)))
    assert back == s and back.transforms.sink_tokens == 4
    pd = json.loads(json.dumps(plan_to_dict(plan_kernel(s))))
    assert spec_from_plan_dict(pd).transforms == s.transforms
    t = pd["transforms"]
    assert t["transforms"] == ["smooth_k", "sink_tokens"]
    sink = [p for p in t["passes"] if p["transform"] == "sink_tokens"]
    # bf16 rows of D=64 are 128 bytes: K and V copied without their first n keys, Q read for the
    # exact scores, O and LSE read and written by the merge
    assert [(p["per"], p["bytes_read"], p["bytes_written"]) for p in sink] == [
        ("key", 256, 256), ("query", 128, 0), ("query", 132, 132)]
    b, h, n = t["example"]
    assert t["example_bytes"] == sum(p["bytes_read"] + p["bytes_written"] for p in t["passes"]) * b * h * n


def test_older_transforms_json_reads_without_sink_tokens():
    """A transforms record written before the field existed (every committed PLAN_JSON with
    transforms) reads as sink_tokens 0, and such a spec writes no sink_tokens key."""
    s = one("  K : fp8e4m3 smooth")
    d = spec_to_dict(s)
    assert "sink_tokens" not in d["transforms"]
    assert spec_from_dict(d).transforms == Transforms(smooth_k=True)
