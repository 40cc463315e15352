"""The small runtime that generated kernels import: argument checks, the compile
cache and ``load``.

Importing this package imports only the standard library (``checks`` imports
torch when used): no lark, no jinja2, no compiler stage.
"""
from __future__ import annotations

from . import cache
from .loader import LoadError, load

__all__ = ["cache", "checks", "load", "LoadError"]


def __getattr__(name):
    # ``fp4gen.runtime.checks`` imports torch; load it on first use only
    if name == "checks":
        import importlib

        return importlib.import_module(f"{__name__}.checks")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
