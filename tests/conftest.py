"""Shared pytest setup: tests marked ``@pytest.mark.gpu`` are skipped without CUDA.

On a checkout that is not pip-installed (the GPU machine), pyproject's package
mapping (ir/ -> fp4gen.ir, ...) is registered by hand before any test imports it.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
if importlib.util.find_spec("fp4gen") is None or importlib.util.find_spec("fp4gen.ir") is None:
    from fp4gen.runtime.srctree import use_source_tree

    use_source_tree(_ROOT)


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture
def cpu_backward_checks(monkeypatch):
    """Let a generated ``backward`` run its host code on CPU tensors: the runtime checks skip
    the device and TMA-alignment requirements and ``require_arch`` passes (the tests that use
    this replace the kernel launch with an emulation). Returns ``monkeypatch``."""
    from fp4gen.runtime import checks

    orig = checks.check_backward

    def check_backward_cpu(*a, **kw):
        kw.update(device_type=None, tma=False)
        return orig(*a, **kw)

    monkeypatch.setattr(checks, "check_backward", check_backward_cpu)
    monkeypatch.setattr(checks, "require_arch", lambda *a, **kw: None)
    return monkeypatch
