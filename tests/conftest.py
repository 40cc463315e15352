"""Shared pytest setup: tests marked ``@pytest.mark.gpu`` are skipped without CUDA."""
from __future__ import annotations

import pytest


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
