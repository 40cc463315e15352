"""sm90a forward at head dims 96, 192 and 256 on a Hopper GPU, against the reference backend
(``fp4gen.numerics.reference``: the spec's own numerics, key tiles of the plan's tile_n in the
same order).

Plans come from the planner (``plan_kernel`` of a spec with no tile line), so these run the
key tile it picks per head dim (BF16: 128 at 96, 112 at 192, 80 at 256; FP8: 128), not a
hand-built one; then the example modules (generated/) themselves. Per recipe (BF16, FP8 exp,
FP8 Direct-P), causal and not, ragged shapes: lengths not a multiple of the tile (112 and 80
included), Sq != Sk both ways (Sq > Sk leaves the first causal rows with no key: O = 0,
LSE = -inf exactly where the reference has them), GQA, one key, shorter than one tile,
large logits. BF16 also in the varlen layout at 192 and 256 (causal; ragged, empty
sequences).

Tolerances: test_sm90_gpu.py's per recipe (TOL: MMA accumulation order, ex2.approx, FP8
wgmma's reduced-precision accumulation). A wider head sums more products per score, but the
softmax scale D^-1/2 keeps the scaled logits (and their rounding and quantization errors,
sums of D products of unit-variance inputs, ~sqrt(D) each) at the same size at every D; the
multiplier sets their spread (std ~ mult), and the bounds are relative (rel-L2 of O, |dLSE|
relative to |LSE|). FP8 Direct-P's LSE: the per-row error-model bound of ``_check``
(directp_bounds.py), not TOL's flat one.

Run: ``pytest -q -m gpu tests/sm90/test_head_dims_gpu.py``
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import VARIANTS, load_module  # noqa: E402
from test_head_dims_plan import plan_of  # noqa: E402
from test_window_softcap_gpu import _check  # noqa: E402

pytestmark = pytest.mark.gpu

HEAD_DIMS = (96, 192, 256)
CASES = [
    # (B, Sq, Sk, H, Hkv, logit multiplier)
    (1, 1000, 1000, 2, 2, 1.0),  # ragged against 128, 112 and 80 key tiles
    (2, 300, 700, 4, 2, 1.0),  # Sq < Sk, GQA 2:1
    (1, 700, 300, 4, 1, 1.0),  # Sq > Sk: causal rows with no key; GQA 4:1
    (1, 513, 513, 2, 2, 8.0),  # large logits
    (1, 77, 77, 1, 1, 1.0),  # shorter than one tile
    (1, 129, 1, 1, 1, 1.0),  # one key
    (1, 1024, 1024, 2, 2, 1.0),  # tile-aligned for 128, not for 112 or 80
]
VARLEN_BATCHES = [
    [(1000, 1000), (17, 17), (0, 5), (300, 700), (700, 300), (1, 1), (161, 161)],
    [(5, 0), (256, 256), (1, 900), (513, 64)],
]

_MODS = {}


def _module(d, variant, causal, tmp_path_factory, varlen=False):
    key = (d, variant, causal, varlen)
    if key not in _MODS:
        import dataclasses

        plan = plan_of(d, variant, "causal" if causal else "none", "  layout varlen\n" if varlen else "")
        name = f"hd_{variant}_d{d}{'_causal' if causal else ''}{'_varlen' if varlen else ''}"
        plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, name=name))
        _MODS[key] = (plan, load_module(plan, str(tmp_path_factory.mktemp("sm90hd"))))
    return _MODS[key]


def _inputs(B, Sq, Sk, H, Hkv, d, mult, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(B, Sq, H, d, device="cuda", generator=g) * mult).bfloat16()
    k = torch.randn(B, Sk, Hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, Sk, Hkv, d, device="cuda", generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(variant, d, causal, tmp_path_factory):
    from fp4gen.numerics import reference

    plan, mod = _module(d, variant, causal, tmp_path_factory)
    assert mod.TILE_N == plan.sm90.tile_n == {("bf16", 96): 128, ("bf16", 192): 112,
                                              ("bf16", 256): 80}.get((variant, d), 128)
    for B, Sq, Sk, H, Hkv, mult in CASES:
        what = f"{variant} d{d} causal={causal} {B}x{Sq}x{Sk} H{H}/{Hkv} x{mult}"
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, d, mult, seed=Sq * 7 + Sk + d)
        o, lse = mod.forward(q, k, v, return_lse=True)
        assert o.shape == q.shape and o.dtype == torch.bfloat16, what
        assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32, what
        o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
        _check(o, lse, o_ref, lse_ref, variant, what=what, inputs=(q, k, v, plan.spec))


@pytest.mark.parametrize("d", [192, 256])  # the 112- and 80-key tiles (96 runs d128's 128)
@pytest.mark.parametrize("batch", range(len(VARLEN_BATCHES)))
def test_bf16_varlen_matches_reference(d, batch, tmp_path_factory):
    """Causal (per-sequence bottom-right alignment): the harder of the two masks."""
    from fp4gen.numerics import reference

    causal = True
    plan, mod = _module(d, "bf16", causal, tmp_path_factory, varlen=True)
    lengths = VARLEN_BATCHES[batch]
    g = torch.Generator(device="cuda").manual_seed(batch + d)
    tq, tk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q = torch.randn(tq, 4, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(tk, 2, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(tk, 2, d, device="cuda", generator=g).bfloat16()
    cu_q = torch.tensor([0] + [a for a, _ in lengths], device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + [b for _, b in lengths], device="cuda").cumsum(0).int()
    mq, mk = max(a for a, _ in lengths), max(b for _, b in lengths)
    o, lse = mod.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True)
    o_ref, lse_ref = reference.forward_varlen(q, k, v, cu_q, cu_k, plan.spec)
    _check(o[None], lse[None], o_ref[None], lse_ref[None], "bf16", what=f"varlen d{d} causal={causal} #{batch}")


# one example module per new head dim (the others share these configs but for the mask, which
# test_matches_reference covers at every dim; each module is one more compile)
EXAMPLE_MODULES = [
    ("sm90_bf16_causal_d256_sm90a", "bf16"), ("sm90_fp8_directp_d96_sm90a", "fp8_directp"),
    ("sm90_fp8_exp_causal_d192_sm90a", "fp8_exp"),
]


@pytest.mark.parametrize("name,variant", EXAMPLE_MODULES)
def test_example_modules_match_reference(name, variant):
    from fp4gen.ir.serialize import spec_from_plan_json
    from fp4gen.numerics import reference

    mod = importlib.import_module(f"fp4gen.generated.{name}")
    spec = spec_from_plan_json(mod.PLAN_JSON)
    d = mod.HEAD_DIM
    for B, Sq, Sk, H, Hkv, mult in [(2, 300, 700, 4, 2, 1.0), (1, 700, 300, 2, 2, 1.0), (1, 1000, 1000, 2, 1, 4.0)]:
        what = f"{name} {B}x{Sq}x{Sk} x{mult}"
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, d, mult, seed=Sq + Sk + d)
        o, lse = mod.forward(q, k, v, return_lse=True)
        o_ref, lse_ref = reference.forward(q, k, v, spec)
        _check(o, lse, o_ref, lse_ref, variant, what=what, inputs=(q, k, v, spec))


# the other extensions at the new widths (each compiles spill-free: fp4gen verify,
# 2026-12-02): a sliding window with Gemma's softcap at the 80-key tile, learned sinks with
# FP8 Direct-P at 192, a softcap on FP8 Direct-P at 256 (the largest register set), a two-sided
# window with FP8 exp at 96
EXTENDED = [
    (256, "bf16", "window(255, 0)", "  softcap 30\n", 30.0, False),
    (192, "fp8_directp", "causal", "  sinks learned\n", 0.0, True),
    (256, "fp8_directp", "none", "  softcap 30\n", 30.0, False),
    (96, "fp8_exp", "window(100, 7)", "", 0.0, False),
]


@pytest.mark.parametrize("d,variant,mask,extra,softcap,sinks", EXTENDED)
def test_window_softcap_sinks_at_new_head_dims(d, variant, mask, extra, softcap, sinks, tmp_path_factory):
    import dataclasses

    from fp4gen.numerics import reference

    plan = plan_of(d, variant, mask, extra)
    name = f"hdx{EXTENDED.index((d, variant, mask, extra, softcap, sinks))}_{variant}_d{d}"
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, name=name))
    mod = load_module(plan, str(tmp_path_factory.mktemp("sm90hdx")))
    for B, Sq, Sk, H, Hkv, mult in [(1, 1000, 1000, 2, 2, 1.0), (2, 300, 700, 2, 1, 1.0),
                                    (1, 700, 300, 2, 2, 1.0), (1, 513, 513, 2, 2, 30.0 if softcap else 8.0)]:
        what = f"{variant} d{d} {mask}{' softcap' if softcap else ''}{' sinks' if sinks else ''} {Sq}x{Sk} x{mult}"
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, d, mult, seed=Sq + 3 * Sk + d)
        kw = {"sinks": torch.linspace(-4.0, 12.0, H, device="cuda")} if sinks else {}
        o, lse = mod.forward(q, k, v, return_lse=True, **kw)
        o_ref, lse_ref = reference.forward(q, k, v, plan.spec, **kw)
        _check(o, lse, o_ref, lse_ref, variant, softcap=softcap, what=what,
               inputs=(q, k, v, plan.spec, kw.get("sinks")))
