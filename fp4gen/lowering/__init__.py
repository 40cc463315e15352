"""Lowering: a finished ``KernelPlan`` -> the source text of one Python module.

One module per (kernel, target). The backends live beside this file:

- ``reference.py``: a module that runs the spec through ``fp4gen.numerics.reference``.
- ``sm90.py``: a CuTe DSL Hopper kernel rendered from ``templates/sm90/``.
- ``sm100.py``: a CuTe DSL Blackwell kernel rendered from ``templates/sm100/``.

Each backend exposes ``render(plan) -> str``. The renderer makes no decision the
plan did not record; it only turns plan fields into a jinja2 context.

The contract every generated module keeps (tests and ``fp4gen.load`` rely on it):

- ``KERNEL_NAME: str``, ``TARGET: str`` (``"sm90a"``, ``"sm100a"``, ``"reference"``),
  ``SPEC_FILE: str``, ``PLAN_JSON: str`` (the plan it was rendered from).
- ``forward(q, k, v, *, softmax_scale=None, return_lse=False)`` with torch tensors
  ``q: (B, Sq, H, D)``, ``k, v: (B, Sk, Hkv, D)`` (``H % Hkv == 0``); returns ``o``
  ``(B, Sq, H, D)`` or ``(o, lse)`` with ``lse: (B, H, Sq)`` float32 (natural log).
- ``backward(q, k, v, o, lse, do, *, softmax_scale=None)`` -> ``(dq, dk, dv)``, only when
  the spec has a backward block (otherwise the name is absent).
- ``compile_only(arch: str) -> list[str]`` (CuTe DSL targets only): compiles every
  kernel variant for ``arch`` (``"sm_90a"``/``"sm_100a"``) without a GPU and returns
  the names compiled. CI calls it for every generated module.
- Generated modules import torch, CuTe DSL and ``fp4gen.runtime`` / ``fp4gen.numerics``
  / ``fp4gen.device`` only: never the front end, the IR passes, lark or jinja2.
"""
from __future__ import annotations

import importlib

BACKENDS = {"reference": "reference", "sm90a": "sm90", "sm100a": "sm100"}


class LoweringError(Exception):
    """A plan that this backend cannot render (should have been refused by the planner)."""


def template_env(subdir: str):
    """The jinja2 environment every backend renders with: templates/<subdir>/, strict
    undefined names (a context key the template needs but the plan lacks is an error,
    never an empty string), block tags that leave no blank lines behind."""
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("fp4gen.templates", subdir),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def module_name(kernel_name: str, target: str) -> str:
    """File stem of the generated module for one kernel and target."""
    return f"{kernel_name}_{target}"


def render(plan) -> str:
    """Render the plan's generated module source for ``plan.spec.target``."""
    target = plan.spec.target.value
    backend = BACKENDS.get(target)
    if backend is None:
        raise LoweringError(f"no backend for target {target!r}; known: {', '.join(BACKENDS)}")
    try:
        mod = importlib.import_module(f"{__name__}.{backend}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{backend}":
            raise LoweringError(f"the {target} backend is not implemented yet") from None
        raise
    return mod.render(plan)
