"""Helpers of the sm100a backward tests: spec texts, plans, module loading."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

from fp4gen.frontend import parse_file, parse_text
from fp4gen.ir.passes import plan_kernel

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sm100_bwd_d128.attn"

# the example's forward (NVFP4 Q/K, FP8 P/V) with a configurable backward block
SPEC = """
attention {name} {{
  target   sm100a
  head_dim {d}
  mask     {mask}
  Q : nvfp4
  K : nvfp4
  P : fp8e4m3 via exp
  V : fp8e4m3(scale=tensor)
  O : bf16
  guard none
  schedule {{
    tile      128 x 128
    q_stages  2
    p_publish halves
    tmem      auto
  }}
  backward {{
    reuse {reuse}
{extra}    deterministic {det}
  }}
}}
"""


def spec_text(name="bwd_test", d=128, causal=True, det=False, reuse="lse", extra=""):
    return SPEC.format(name=name, d=d, mask="causal" if causal else "none", det=str(det).lower(),
                       reuse=reuse, extra=extra)


def plan_text(text, filename="bwd_test.attn"):
    return plan_kernel(parse_text(text, filename)[0])


def example_plan():
    return plan_kernel(parse_file(EXAMPLE)[0])


def with_regions(bp, **cols):
    """``bp`` with TMEM regions moved: name=(first, last)."""
    regs = tuple(dataclasses.replace(r, first_col=cols[r.name][0], last_col=cols[r.name][1])
                 if r.name in cols else r for r in bp.tmem.regions)
    return dataclasses.replace(bp, tmem=dataclasses.replace(bp.tmem, regions=regs))


# the forward part a backward section reads (KERNEL_NAME, SOFTMAX_SCALE, _require_sm100,
# compile_only, which the section extends with the backward variants): lets
# the backward be rendered and compiled alone, e.g. for head_dim 64, which the sm100a forward
# template does not render yet
BACKWARD_ONLY_PRELUDE = '''KERNEL_NAME = "{name}"
SOFTMAX_SCALE = {scale!r}


def _require_sm100():
    from fp4gen.runtime.checks import UnsupportedDeviceError

    raise UnsupportedDeviceError("sm_100 only")


def compile_only(arch="sm_100a"):
    return []  # no forward here


'''


def backward_only_source(plan, bp=None):
    from fp4gen.lowering.sm100_bwd import render_backward

    return BACKWARD_ONLY_PRELUDE.format(name=plan.spec.name, scale=plan.spec.scale) + render_backward(plan, bp)


def load_source(source: str, path: Path):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"bwd100_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
