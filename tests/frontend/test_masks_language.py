"""Issue 19's spec fields: mask window(left, right), softcap, sinks, layout.

The language accepts them for every target; sm90a and sm100a refuse them in the planner's first
pass (legalize) at the field's file:line:col, so `fp4gen check` and `fp4gen compile` agree; the
reference target runs them. Specs without them serialize as before (the goldens check that).
"""
from __future__ import annotations

import json

import pytest

from fp4gen.frontend import SpecError, parse_text
from fp4gen.ir.passes import PlanError, plan_kernel
from fp4gen.ir.serialize import computed_fields, spec_from_dict, spec_from_plan_dict, spec_to_dict
from fp4gen.ir.spec import Layout, Mask, Sinks, Target, mask_for_window


def one(body: str, target: str = "reference"):
    (k,) = parse_text(f"attention k {{\n  target {target}\n  head_dim 64\n{body}\n}}\n", "m.attn")
    return k


def only_error(body: str):
    with pytest.raises(SpecError) as exc:
        parse_text(f"attention k {{\n  target reference\n  head_dim 64\n{body}\n}}\n", "m.attn")
    (d,) = exc.value.diagnostics
    return d


@pytest.mark.parametrize("text, mask, window, size", [
    ("mask window(128, 0)", Mask.WINDOW, (128, 0), (128, 0)),
    ("mask window(left=0, right=-1)", Mask.WINDOW, (0, -1), (0, -1)),
    ("mask window(-1, 16)", Mask.WINDOW, (-1, 16), (-1, 16)),
    ("mask window(-1, 0)", Mask.CAUSAL, None, (-1, 0)),  # FlashAttention's causal: one spec, one kernel
    ("mask window(-1, -1)", Mask.NONE, None, (-1, -1)),
    ("mask causal", Mask.CAUSAL, None, (-1, 0)),
    ("mask none", Mask.NONE, None, (-1, -1)),
])
def test_masks(text, mask, window, size):
    k = one("  " + text)
    assert (k.mask, k.window, k.window_size) == (mask, window, size)
    assert k.loc("mask").line == 4 and k.loc("mask").col == 8
    assert mask_for_window(*size) == (mask, window)


def test_window_causal_is_the_causal_spec():
    assert computed_fields(spec_to_dict(one("  mask window(-1, 0)"))) == computed_fields(spec_to_dict(one("  mask causal")))


def test_softcap_sinks_layout():
    k = one("  softcap 30\n  sinks learned\n  layout varlen")
    assert (k.softcap, k.sinks, k.layout) == (30.0, Sinks.LEARNED, Layout.VARLEN)
    assert [(k.loc(f).line, k.loc(f).col) for f in ("softcap", "sinks", "layout")] == [(4, 11), (5, 9), (6, 10)]
    assert k.uses_extensions == ("softcap", "sinks", "layout")
    d = one("  softcap none\n  sinks none\n  layout dense")
    assert (d.softcap, d.sinks, d.layout, d.uses_extensions) == (0.0, Sinks.NONE, Layout.DENSE, ())


@pytest.mark.parametrize("body, col, message, hint", [
    ("  mask window(-2, 0)", 15, "window left must be -1 (unbounded) or a key count", None),
    ("  mask window(4, 1.5)", 18, "window right must be an integer, got '1.5'", None),
    ("  mask window(4)", 8, "window needs right", "mask window(128, 0)"),
    ("  mask window(4, 0, 1)", 21, "window takes at most 2 arguments", None),
    ("  mask window(top=4, right=0)", 15, "window has no parameter 'top'", None),
    ("  mask windw(4, 0)", 8, "unknown mask 'windw'", "did you mean 'window'?"),
    ("  mask causal(4)", 15, "mask causal takes no arguments", None),
    ("  softcap -3", 11, "softcap must be from 0.01 to 10000, got -3", None),
    ("  softcap 0", 11, "softcap 0 would divide by zero", "softcap none"),
    ("  softcap big", 11, "unknown softcap value 'big'", None),
    ("  sinks 4", 9, "sinks takes 'none' or 'learned', not a count of sink tokens", "learned per-head sink logit"),
    ("  sinks lerned", 9, "unknown sinks value 'lerned'", "did you mean 'learned'?"),
    ("  layout packed", 10, "unknown layout 'packed'; expected 'dense' or 'varlen'", None),
    ("  softcap 30\n  softcap 50", 3, "softcap is set twice", "remove one"),
])
def test_bad_values_have_locations(body, col, message, hint):
    d = only_error(body)
    line = 5 if "\n" in body else 4
    assert (d.loc.file, d.loc.line, d.loc.col) == ("m.attn", line, col), d.render()
    assert message in d.message, d.render()
    if hint:
        assert hint in (d.hint or ""), d.render()


def test_round_trip_spec_and_plan():
    k = one("  mask window(32, 8)\n  softcap 20.5\n  sinks learned\n  layout varlen")
    d = spec_to_dict(k)
    assert (d["window"], d["softcap"], d["sinks"], d["layout"]) == ([32, 8], 20.5, "learned", "varlen")
    assert spec_from_dict(json.loads(json.dumps(d))) == k
    plan_dict = json.loads(json.dumps(__import__("fp4gen.ir.dump", fromlist=["to_json"]).to_json(plan_kernel(k))))
    assert spec_from_plan_dict(plan_dict) == k
    assert plan_dict["spec"]["window"] == [32, 8]


def test_spec_without_the_fields_has_no_new_keys():
    d = spec_to_dict(one("  mask causal"))
    assert not {"window", "softcap", "sinks", "layout"} & set(d)


def test_a_window_mask_needs_its_sizes():
    d = spec_to_dict(one("  mask window(8, 0)"))
    del d["window"]
    with pytest.raises(ValueError, match="window"):
        spec_from_dict(d)


GPU_REFUSALS = [
    ("  mask window(256, 0)", "mask", "implements mask none and causal"),
    ("  softcap 30", "softcap", "without a softcap"),
    ("  sinks learned", "sinks", "without sinks"),
    ("  layout varlen", "layout", "dense (B, S, H, D) layout only"),
]
# the sm90a forward implements window and softcap (c593e12), sinks and varlen (BF16); its backward none
SM90_FORWARD_TAKES = {"mask", "softcap", "sinks", "layout"}


@pytest.mark.parametrize("target, body, field, words",
                         [("sm100a",) + r for r in GPU_REFUSALS] +
                         [("sm90a",) + r for r in GPU_REFUSALS if r[1] not in SM90_FORWARD_TAKES])
def test_gpu_targets_refuse_at_the_field(target, body, field, words):
    k = one(body, target)
    with pytest.raises(PlanError) as exc:
        plan_kernel(k)
    assert exc.value.loc == k.loc(field) and exc.value.loc.line == 4
    assert words in exc.value.message and target in exc.value.message
    assert any("target reference" in n for n in exc.value.notes)
    plan_kernel(k.with_target(Target.REFERENCE))  # the reference plans it


@pytest.mark.parametrize("body", ["  mask window(256, 0)", "  softcap 30", "  sinks learned", "  layout varlen"])
def test_the_sm90a_forward_plans_window_and_softcap(body):
    plan_kernel(one(body, "sm90a"))


def test_check_and_compile_refuse_alike(tmp_path):
    from fp4gen.cli.main import main

    spec = tmp_path / "w.attn"
    spec.write_text((__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "sm90_bf16_d128.attn")
                    .read_text().replace("mask     causal", "mask     causal\n  sinks learned"))
    assert main(["check", str(spec)]) == 1
    assert main(["compile", str(spec), "-o", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert main(["check", "--target", "reference", str(spec)]) == 0


@pytest.mark.parametrize("example, head_dim, refused", [
    ("sm90_bf16_d128.attn", 96, True), ("sm90_bf16_d128.attn", 256, True), ("sm90_bf16_d128.attn", 64, False),
    ("fa4_fp4_d128.attn", 64, True), ("fa4_fp4_d128.attn", 192, True),
])
def test_head_dims_check_refuses_what_compile_refuses(tmp_path, example, head_dim, refused):
    """The language takes 64, 96, 128, 192, 256 (and any multiple of 16 to 256); sm90a builds 64
    and 128, sm100a 128: check refuses the rest at the head_dim line, as compile does."""
    from fp4gen.cli.main import main

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    spec = tmp_path / "d.attn"
    spec.write_text((root / "examples" / example).read_text().replace("head_dim 128", f"head_dim {head_dim}"))
    assert main(["check", str(spec)]) == (1 if refused else 0)
    assert main(["compile", str(spec), "-o", str(tmp_path / "out")]) == (1 if refused else 0)
    assert main(["check", "--target", "reference", str(spec)]) == 0
