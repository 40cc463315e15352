"""``rotate qk hadamard`` builds its D x D matrix once per (d, seed, device, dtype), not on the
CPU with a blocking copy to the GPU on every call (issue 24): repeated ``outliers.hadamard``
calls reuse one tensor, other keys get their own, the cache is bounded, and the cached matrix is
exactly ``hadamard_matrix``'s. Planted: with the cache emptied the builder runs again (the
counting is able to see a rebuild). The GPU test runs the rotation after a warm-up with the
builder made to fail, so the GPU path copies nothing per call.

    .venv/bin/python -m pytest -q -m gpu tests/numerics/test_hadamard_cache.py
"""
from __future__ import annotations

import pytest
import torch

from fp4gen.numerics import outliers


@pytest.fixture
def builds(monkeypatch):
    """The number of hadamard_matrix builds, from an empty cache."""
    n = {"builds": 0}
    real = outliers.hadamard_matrix

    def counted(d, seed=None):
        n["builds"] += 1
        return real(d, seed)
    monkeypatch.setattr(outliers, "hadamard_matrix", counted)
    outliers._hadamard_cached.cache_clear()
    yield n
    outliers._hadamard_cached.cache_clear()


def _qk(d=64, device="cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(1, 5, 2, d, generator=g, device=device), torch.randn(1, 7, 2, d, generator=g, device=device))


def test_one_build_per_key(builds):
    q, k = _qk()
    first = outliers.hadamard(q, k, seed=3)
    for _ in range(5):
        again = outliers.hadamard(q, k, seed=3)
    assert builds["builds"] == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    outliers.hadamard(q, k, seed=4)
    outliers.hadamard(q, k)
    outliers.hadamard(*_qk(32), seed=3)
    assert builds["builds"] == 4  # seed, no seed and head dim are part of the key
    outliers.hadamard(q, k, seed=3)
    assert builds["builds"] == 4


def test_planted_cache_loss_is_counted(builds):
    q, k = _qk()
    outliers.hadamard(q, k, seed=3)
    outliers._hadamard_cached.cache_clear()
    outliers.hadamard(q, k, seed=3)
    assert builds["builds"] == 2


def test_cached_matrix_is_the_matrix(builds):
    for d, seed in ((16, None), (64, 7), (128, 0)):
        r = outliers.hadamard_on(d, seed, torch.device("cpu"))
        want = outliers.hadamard_matrix(d, seed)
        assert r.dtype == torch.float32 and torch.equal(r, want)
        assert torch.equal(outliers.hadamard_on(d, seed, "cpu", torch.float64), want.double())
    q, k = _qk()
    qr, kr = outliers.hadamard(q, k, seed=7)
    r = outliers.hadamard_matrix(64, 7)
    assert torch.equal(qr, q @ r) and torch.equal(kr, k @ r)


def test_cache_is_bounded(builds):
    size = outliers._hadamard_cached.cache_info().maxsize
    assert size is not None and 0 < size <= 64
    for seed in range(size + 5):
        outliers.hadamard_on(16, seed, "cpu")
    assert outliers._hadamard_cached.cache_info().currsize == size


@pytest.mark.gpu
def test_gpu_rotation_copies_nothing_per_call(builds, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k = _qk(128, "cuda")
    want = outliers.hadamard(q, k, seed=5)  # warm: one build, one copy
    r = outliers.hadamard_on(128, 5, q.device)
    assert r.device == q.device and builds["builds"] == 1

    def no_build(*a, **kw):
        raise AssertionError("hadamard_matrix rebuilt after the warm-up")
    monkeypatch.setattr(outliers, "hadamard_matrix", no_build)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = outliers.hadamard(q, k, seed=5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
