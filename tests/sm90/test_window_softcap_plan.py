"""The sm90a forward's window and softcap, no GPU: what the planner accepts and refuses, the
config the lowering derives, and that specs without them render as before.

The kernels themselves: test_window_softcap_gpu.py (H200)."""
from __future__ import annotations

import os
import sys

import pytest

from fp4gen.frontend import parse_text
from fp4gen.ir.passes import PlanError, plan_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import make_plan  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BODY = """  Q : bf16
  K : bf16
  P : bf16
  V : bf16
  O : bf16
  schedule {
    tile 128 x 128
  }"""


def one(lines: str, target: str = "sm90a", backward: bool = False):
    bwd = "\n  backward {\n    reuse q k lse\n  }" if backward else ""
    (k,) = parse_text(f"attention k {{\n  target {target}\n  head_dim 128\n{lines}\n{BODY}{bwd}\n}}\n", "m.attn")
    return k


@pytest.mark.parametrize("lines, window, softcap", [
    ("  mask window(255, 0)", (255, 0), 0.0),
    ("  mask window(-1, 7)", (-1, 7), 0.0),
    ("  mask causal\n  softcap 30", None, 30.0),
    ("  mask window(3, 5)\n  softcap 50", (3, 5), 50.0),
])
def test_sm90a_forward_plans_and_lowers_window_and_softcap(lines, window, softcap):
    from fp4gen.lowering.sm90 import config

    cfg = config(plan_kernel(one(lines)))
    assert cfg.window == window and cfg.softcap == softcap
    assert cfg.causal == ("causal" in lines)


@pytest.mark.parametrize("lines, field", [
    ("  sinks learned", "sinks"),
    ("  mask window(255, 0)\n  layout varlen", "layout"),
])
def test_sm90a_backward_still_refuses_at_the_field(lines, field):
    k = one(lines, backward=True)
    with pytest.raises(PlanError) as exc:
        plan_kernel(k)
    assert exc.value.loc == k.loc(field)
    assert "backward does not" in exc.value.message and "sm90a" in exc.value.message
    assert any("drop the backward block" in n for n in exc.value.notes)


@pytest.mark.parametrize("lines, field, target", [
    ("  mask window(255, 0)", "mask", "sm100a"),
    ("  softcap 30", "softcap", "sm100a"),
    ("  sinks learned", "sinks", "sm100a"),
    ("  mask window(255, 0)\n  layout varlen", "mask", "sm100a"),  # the first field it lacks is named
])
def test_what_a_target_lacks_is_refused_at_its_line(lines, field, target):
    k = one(lines, target)
    with pytest.raises(PlanError) as exc:
        plan_kernel(k)
    assert exc.value.loc == k.loc(field)


def test_config_refuses_a_window_that_is_causal_or_unbounded():
    from fp4gen.device.sm90.config import ForwardConfig
    from fp4gen.lowering.sm90 import config

    base = config(make_plan("bf16"))
    import dataclasses

    for bad in [dict(window=(-1, 0)), dict(window=(-1, -1)), dict(window=(5, 0), causal=True),
                dict(window=(-2, 3)), dict(softcap=-1.0)]:
        with pytest.raises(ValueError):
            dataclasses.replace(base, **bad)
    assert isinstance(dataclasses.replace(base, window=(0, 0)), ForwardConfig)


def test_softcap_in_log2_units_as_the_reference():
    """The kernel caps x = s * scale * log2 e at c2 = c log2 e, the reference's ``cap2``."""
    import math

    from fp4gen.lowering.sm90 import config

    cfg = config(make_plan("fp8_directp", softcap=30.0))
    assert cfg.softcap_log2 == pytest.approx(30.0 / math.log(2.0), rel=1e-15)


def test_plain_specs_render_no_window_or_softcap_field():
    """Fields at their default are left out of the config literal: the modules of specs
    without a window or softcap render (and compile) as before."""
    from fp4gen.lowering.sm90 import render

    src = render(make_plan("fp8_exp", 128, True))
    assert "    window=" not in src and "    softcap=" not in src
    src = render(make_plan("fp8_exp", 128, window=(255, 0), softcap=30.0))
    assert "    window=(255, 0)," in src and "    softcap=30.0," in src


@pytest.mark.parametrize("module, window, softcap", [
    ("sm90_fp8_directp_window_d128_sm90a", (255, 0), 0.0),
    ("sm90_bf16_softcap_causal_d128_sm90a", None, 30.0),
])
def test_example_modules_carry_the_spec(module, window, softcap):
    import importlib

    mod = importlib.import_module(f"fp4gen.generated.{module}")
    assert mod.CONFIG.window == window and mod.CONFIG.softcap == softcap
