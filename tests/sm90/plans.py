"""KernelPlans for the sm90 tests and benchmarks, built directly in Python.

Until ``fp4gen.ir.passes.plan_kernel`` exists these are the plans the renderer
is exercised with; each mirrors a spec the planner should produce.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _shim_plain_checkout():
    """On a plain checkout (the device machine: nothing pip-installed) register pyproject's
    package mapping (ir/ -> fp4gen.ir, ...) by hand."""
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    from fp4gen.runtime.srctree import use_source_tree

    use_source_tree(_ROOT)


_shim_plain_checkout()

from fp4gen.ir.plan import KernelPlan, Sm90Plan  # noqa: E402
from fp4gen.ir.spec import (  # noqa: E402
    Format, KernelSpec, Layout, Mask, OperandFormat, PKind, PProduction, ScaleGranularity, Sinks, Target,
)

VARIANTS = ("bf16", "fp8_exp", "fp8_directp")


@dataclasses.dataclass(frozen=True)
class Sm90PlanX(Sm90Plan):
    """Sm90Plan plus fields the renderer reads optionally (requested for ir/plan.py)."""

    # FP8 Direct-P: the normaliser l as P @ ones on the tensor cores instead of decoding
    # every code on the ALUs
    l_from_mma: bool = False


def _fp8(block):
    if block:
        return OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 128, Format.FP32)
    return OperandFormat(Format.FP8E4M3, ScaleGranularity.TENSOR, None, Format.FP32)


def make_plan(variant: str, head_dim: int = 128, causal: bool = False, *,
              overlap: bool = True, pingpong: bool = True, kv_stages: int = 2,
              l_from_mma: bool = False, window=None, softcap: float = 0.0, sinks: bool = False,
              varlen: bool = False) -> KernelPlan:
    """``window``: (left, right) for ``mask window(left, right)`` (not with ``causal``);
    ``softcap``: the spec's softcap (0: none); ``sinks``: ``sinks learned``; ``varlen``:
    ``layout varlen``."""
    name = f"sm90_{variant}_d{head_dim}{'_causal' if causal else ''}"
    mask = Mask.CAUSAL if causal else Mask.NONE
    if window is not None:
        assert not causal, "a window spec has mask window, not causal"
        name += f"_w{window[0]}_{window[1]}".replace("-", "m")
        mask = Mask.WINDOW
    if softcap:
        name += f"_cap{softcap:g}".replace(".", "p")
    name += "_sinks" * sinks + "_varlen" * varlen
    if variant == "bf16":
        spec = KernelSpec(name=name, target=Target.SM90A, head_dim=head_dim, mask=mask)
        fp8 = False
    else:
        kind = PKind.EXP if variant == "fp8_exp" else PKind.DIRECT_P
        spec = KernelSpec(
            name=name, target=Target.SM90A, head_dim=head_dim, mask=mask,
            q=_fp8(True), k=_fp8(True), v=_fp8(False),
            p=OperandFormat(Format.FP8E4M3), p_production=PProduction(kind=kind),
        )
        fp8 = True
    if window is not None or softcap:
        spec = dataclasses.replace(spec, window=tuple(window) if window is not None else None, softcap=float(softcap))
    if sinks or varlen:
        spec = dataclasses.replace(spec, sinks=Sinks.LEARNED if sinks else Sinks.NONE,
                                   layout=Layout.VARLEN if varlen else Layout.DENSE)
    elt = 1 if fp8 else 2
    smem = elt * head_dim * (128 + 2 * kv_stages * 128)
    sm = (Sm90PlanX if l_from_mma else Sm90Plan)(
        tile_m=128, tile_n=128, consumer_warpgroups=2, kv_stages=kv_stages,
        v_transposed=fp8, intra_warpgroup_overlap=overlap, pingpong=pingpong and overlap,
        smem_bytes=smem, producer_registers=24, consumer_registers=240,
        **({"l_from_mma": True} if l_from_mma else {}),
    )
    return KernelPlan(spec=spec, sm90=sm)


def load_module(plan: KernelPlan, directory: str):
    """Render ``plan`` into ``directory`` and import the generated module."""
    from fp4gen.lowering.sm90 import render

    path = os.path.join(directory, f"{plan.spec.name}.py")
    with open(path, "w") as f:
        f.write(render(plan))
    spec = importlib.util.spec_from_file_location(f"_sm90gen_{plan.spec.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
