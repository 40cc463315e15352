"""The sm90a backward with ``mask window(l, r)`` and ``softcap c`` on a Hopper GPU: dq, dk, dv of
every recipe (BF16; FP8 S, dP, dV; all-FP8 with dS : fp8e4m3) against the numerics oracle
(reference.backward with dP in fp32, from the reference forward's O and LSE) and float64
autograd (``bwd_modules.check_masked``).

Shapes: ragged S, Sq != Sk both ways (Sq > Sk leaves rows of a window(l, 0) with no key: their
dq must be exactly 0, and keys no query sees get exactly zero dk, dv), windows at the sequence
edges (left 0, right 0, one-sided), narrower than a tile, wider than the sequence, and softcap
30 with q, k times 8 (scaled scores of std ~64: the cap saturated). Tolerances: the existing
backward's (TOL_ORACLE, TOL_ORACLE_FP8, F64_FACTOR / F64_SLACK) plus, with a softcap, the error
model of tanh.approx (``bwd_modules.softcap_slacks``); for the FP8 recipes, gradients whose
exact value cancels to ~0 (window(0, 0): dq = dk = 0) are held to the FP8 MMAs' error model
instead (``bwd_modules.fp8_cancellation_bounds``; test_fp8_window_cancellation.py shows why on
the CPU). A failure prints each gradient's measured error and its bound (``bwd_modules.describe``).
Skipped without CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_modules as bm  # noqa: E402

pytestmark = pytest.mark.gpu

_MODS = {}


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _module(tmp_path_factory, recipe, d=128, window=None, softcap=0.0, causal=False, det=False):
    key = (recipe, d, window, softcap, causal, det)
    if key not in _MODS:
        from fp4gen.ir.passes import plan_kernel

        spec = bm.make_masked_spec(recipe, d, window=window, softcap=softcap, causal=causal, deterministic=det)
        _MODS[key] = (spec, bm.load_module(plan_kernel(spec), str(tmp_path_factory.mktemp("sm90bwdw"))))
    return _MODS[key]


# (B, Sq, Sk, H, Hkv)
SHAPES = [
    (2, 256, 256, 4, 4),
    (1, 200, 200, 2, 2),  # ragged
    (1, 300, 100, 2, 2),  # Sq > Sk
    (1, 100, 300, 2, 2),  # Sq < Sk
    (1, 1000, 1000, 6, 2),  # long, GQA
]
WINDOWS = [
    (255, 0),  # sliding window (Mistral-style)
    (0, 0),  # the diagonal only, narrower than a tile
    (100, 37),  # both sides, off the tile grid
    (0, 200),  # left 0: from the diagonal to the right
    (-1, 64),  # right bound only (causal shifted by 64)
    (64, -1),  # left bound only
    (5000, 5000),  # wider than the sequence: every key
]


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_bf16_window(window, shape, tmp_path_factory):
    spec, mod = _module(tmp_path_factory, "bf16", window=window)
    row = bm.check_masked(mod, spec, shape)
    assert row["pass"], bm.describe(row)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("recipe", ["fp8", "ds8"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [(255, 0), (0, 0), (100, 37), (64, -1)])
def test_fp8_recipes_window(recipe, window, shape, tmp_path_factory):
    spec, mod = _module(tmp_path_factory, recipe, window=window)
    row = bm.check_masked(mod, spec, shape)
    assert row["pass"], bm.describe(row)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "ds8"])
@pytest.mark.parametrize("mult", [1.0, 8.0])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(255, 0)), dict(window=(100, 37))])
@pytest.mark.parametrize("shape", [(2, 256, 256, 4, 4), (1, 300, 100, 2, 2), (1, 1000, 1000, 6, 2)])
def test_softcap(recipe, mult, mask, shape, tmp_path_factory):
    """softcap 30; q, k x 8 saturates it (dS through 1 - tanh^2 near 0)."""
    spec, mod = _module(tmp_path_factory, recipe, softcap=30.0, **mask)
    row = bm.check_masked(mod, spec, shape, mult=mult)
    assert row["pass"], bm.describe(row)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("recipe", ["bf16", "fp8", "ds8"])
@pytest.mark.parametrize("window", [(0, 0), (-1, 64), (64, -1)])
@pytest.mark.parametrize("shape", [(1, 300, 100, 2, 2), (1, 100, 300, 2, 1)])
def test_softcap_window_edges(recipe, window, shape, tmp_path_factory):
    """softcap 30 with windows at the edges (the diagonal only, one side unbounded) and
    Sq != Sk both ways, q, k x 8: the softcap path masks windows with its own per-row bounds
    (``Backward.softcap_window_mask``), so each side of the rule is checked here."""
    spec, mod = _module(tmp_path_factory, recipe, window=window, softcap=30.0)
    row = bm.check_masked(mod, spec, shape, mult=8.0)
    assert row["pass"], bm.describe(row)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("shape", [(1, 200, 200, 2, 2), (1, 64, 700, 2, 2)])
def test_d64_window_softcap(shape, tmp_path_factory):
    spec, mod = _module(tmp_path_factory, "bf16", d=64, window=(100, 37), softcap=30.0)
    row = bm.check_masked(mod, spec, shape, mult=8.0)
    assert row["pass"], bm.describe(row)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("window", [(100, 37), (0, 0), (255, 0)])
def test_deterministic_window(window, tmp_path_factory):
    """Deterministic dQ under a left bound: a query tile's key tiles take turns from the first
    that visits it (a wrong first tile hangs or double-adds); two runs bit-identical."""
    spec, mod = _module(tmp_path_factory, "bf16", window=window, det=True)
    shape = (1, 1000, 1000, 2, 2)
    row = bm.check_masked(mod, spec, shape)
    assert row["pass"], bm.describe(row)
    gen = torch.Generator(device="cpu").manual_seed(5)
    q, k, v, do = (torch.randn(1, 1000, 2, 128, generator=gen).to(torch.bfloat16).cuda() for _ in range(4))
    from fp4gen.numerics import reference

    o, lse = reference.forward(q, k, v, spec)
    o, lse = o.to(torch.bfloat16), lse.float()
    a = mod.backward(q, k, v, o, lse, do)
    b = mod.backward(q, k, v, o, lse, do)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("name", ["sm90_bf16_window_bwd_d128", "sm90_bf16_softcap_bwd_causal_d128",
                                  "sm90_fp8_train_window_softcap_d128", "sm90_fp8_train_ds8_window_softcap_d128"])
@pytest.mark.parametrize("shape, mult", [((2, 1000, 1000, 4, 4), 1.0), ((1, 300, 700, 2, 1), 8.0)])
def test_generated_examples(name, shape, mult):
    """The committed example modules (generated/) on the same checks."""
    import importlib

    mod = importlib.import_module(f"fp4gen.generated.{name}_sm90a")
    from fp4gen.frontend import parse_file

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    specs = {s.name: s for f in ("sm90_bf16_window_bwd_d128.attn", "sm90_fp8_train_window_softcap_bwd_d128.attn")
             for s in parse_file(os.path.join(root, "examples", f))}
    row = bm.check_masked(mod, specs[name], shape, mult=mult)
    assert row["pass"], bm.describe(row)
