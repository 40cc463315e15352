"""sm90a forward with ``mask window(l, r)`` and ``softcap c`` on a Hopper GPU, against the
reference backend (``fp4gen.numerics.reference``: the spec's own numerics, the same key tiles
in the same order).

What is checked, per recipe (BF16, FP8 exp, FP8 Direct-P) and for the two example modules
(generated/sm90_fp8_directp_window_d128_sm90a.py, generated/sm90_bf16_softcap_causal_d128_sm90a.py):
O (rel-L2) and LSE, and that rows seeing no key have O == 0 and LSE == -inf exactly, where
the reference has them (no NaN anywhere). Shapes: windows at the sequence edges, Sq != Sk
both ways (Sq > Sk leaves the first rows of a window(l, 0) with no key), ragged lengths (not a
multiple of 128), windows narrower than a tile ((0, 0), (3, 5)), one-sided windows, a window
wider than the sequence, and softcap 30 on logits of std 30 (scaled scores ~1e2, softcap
saturated).

Tolerances: test_sm90_gpu.py's per recipe (TOL, the same reasons: MMA accumulation order,
ex2.approx, FP8 wgmma's reduced-precision accumulation). A window only changes which scores
are -inf, so it adds nothing. A softcap adds the error of ``tanh.approx.f32``: relative
2^-10.987 at most (PTX ISA), so a capped score c tanh(s / c) is off by up to
c * 2^-10.987 (natural-log units), which moves each P and the LSE by up to that much
(relative / absolute): added to the O and LSE bounds as ``_softcap_slack``.

FP8 Direct-P's LSE is held to a per-row error-model bound instead of TOL's flat one
(``directp_bounds.lse_bound``: which P codes the FP8 MMA's score errors can flip, from the
reference's own codes and l; docs/numerics.md, "FP8 Direct-P: the LSE bound"), so ``_check``
takes the reference's inputs for that recipe.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import directp_bounds  # noqa: E402
from plans import VARIANTS, load_module, make_plan  # noqa: E402
from test_sm90_gpu import TOL, _inputs, _rel_l2  # noqa: E402

pytestmark = pytest.mark.gpu

TANH_APPROX_REL_ERR = 2.0 ** -10.987  # PTX ISA, tanh.approx.f32

# (B, Sq, Sk, H, Hkv, window)
WINDOW_CASES = [
    (1, 1000, 1000, 2, 2, (255, 0)),  # sliding window, sequence start and end inside it
    (2, 300, 700, 2, 1, (255, 0)),  # Sq < Sk, ragged, GQA
    (1, 700, 300, 2, 2, (255, 0)),  # Sq > Sk: the first 400 rows see no key
    (1, 513, 513, 2, 2, (0, 0)),  # the diagonal alone: narrower than a tile
    (1, 389, 611, 1, 1, (3, 5)),  # both sides, narrow, off-diagonal
    (1, 600, 600, 1, 1, (-1, 7)),  # right bound only (causal shifted by 7)
    (1, 600, 450, 1, 1, (100, -1)),  # left bound only
    (1, 77, 77, 1, 1, (1000, 1000)),  # wider than the sequence: every key
    (1, 256, 1000, 1, 1, (0, 200)),  # right of the diagonal only, rows end at the last key
]


def _softcap_slack(softcap: float) -> float:
    return softcap * TANH_APPROX_REL_ERR


def _check(o, lse, o_ref, lse_ref, variant, softcap=0.0, what="", inputs=None, l_from_mma=False):
    """O and LSE against the reference's; ``inputs`` (q, k, v, spec[, sinks]), what the
    reference was given: needed for fp8_directp, whose LSE bound is computed from them
    (``l_from_mma``: the plan's, l summed on the tensor cores)."""
    tol_o, tol_abs, tol_rel = TOL[variant]
    slack = _softcap_slack(softcap)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), what
    inf_k, inf_r = torch.isneginf(lse), torch.isneginf(lse_ref)
    assert torch.equal(inf_k, inf_r), f"{what}: rows with LSE -inf differ ({inf_k.sum()} vs {inf_r.sum()})"
    if inf_r.any():
        rows = inf_r.permute(0, 2, 1)  # (B, Sq, H)
        assert (o.float()[rows] == 0).all(), f"{what}: a row that sees no key has O != 0"
    err = _rel_l2(o.float(), o_ref.float())
    assert err < tol_o + slack, f"{what}: rel-L2 vs reference {err:.3e} (bound {tol_o + slack:.3e})"
    fin = ~inf_r
    if variant == "fp8_directp" and inputs is not None:
        directp_bounds.check_directp_lse(lse, lse_ref, inputs, slack, what, l_from_mma)
    elif fin.any():  # (fp8_directp without inputs, e.g. a varlen caller: TOL's flat bound)
        dl = (lse[fin] - lse_ref[fin]).abs()
        bound = tol_abs + slack + tol_rel * lse_ref[fin].abs()
        assert (dl <= bound).all(), f"{what}: max |dLSE| {dl.max().item():.3e}"


_MODS = {}


def _module(plan, tmp_path_factory):
    if plan.spec.name not in _MODS:
        _MODS[plan.spec.name] = load_module(plan, str(tmp_path_factory.mktemp("sm90ws")))
    return _MODS[plan.spec.name]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "x".join(map(str, c)).replace(" ", ""))
def test_window_matches_reference(variant, case, tmp_path_factory):
    from fp4gen.numerics import reference

    B, Sq, Sk, H, Hkv, window = case
    plan = make_plan(variant, 128, window=window)
    mod = _module(plan, tmp_path_factory)
    q, k, v = _inputs(B, Sq, Sk, H, Hkv, 128, 1.0, seed=Sq * 3 + Sk)
    o, lse = mod.forward(q, k, v, return_lse=True)
    o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
    _check(o, lse, o_ref, lse_ref, variant, what=f"{variant} window{window} {Sq}x{Sk}", inputs=(q, k, v, plan.spec))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mult", [1.0, 30.0], ids=["std1", "std30"])
def test_softcap_matches_reference(variant, causal, mult, tmp_path_factory):
    """Softcap 30 with ordinary logits and with logits of std 30 (the cap saturated)."""
    from fp4gen.numerics import reference

    plan = make_plan(variant, 128, causal, softcap=30.0)
    mod = _module(plan, tmp_path_factory)
    for B, Sq, Sk, H, Hkv in [(1, 513, 513, 2, 2), (1, 300, 700, 2, 1), (1, 700, 300, 1, 1)]:
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, 128, mult, seed=Sq + Sk)
        o, lse = mod.forward(q, k, v, return_lse=True)
        o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
        _check(o, lse, o_ref, lse_ref, variant, 30.0, f"{variant} softcap causal={causal} x{mult} {Sq}x{Sk}",
               inputs=(q, k, v, plan.spec))


def test_window_with_softcap(tmp_path_factory):
    """Both at once (Direct-P: the codes come from the capped scores)."""
    from fp4gen.numerics import reference

    plan = make_plan("fp8_directp", 128, window=(200, 0), softcap=30.0)
    mod = _module(plan, tmp_path_factory)
    q, k, v = _inputs(1, 700, 900, 2, 2, 128, 30.0, seed=11)
    o, lse = mod.forward(q, k, v, return_lse=True)
    o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
    _check(o, lse, o_ref, lse_ref, "fp8_directp", 30.0, "directp window+softcap", inputs=(q, k, v, plan.spec))


@pytest.mark.parametrize("name,variant", [
    ("sm90_fp8_directp_window_d128_sm90a", "fp8_directp"),
    ("sm90_bf16_softcap_causal_d128_sm90a", "bf16"),
])
def test_example_modules(name, variant):
    """The generated example modules: the spec in their PLAN_JSON against the reference."""
    from fp4gen.numerics import reference
    from fp4gen.runtime.specjson import spec_from_plan_json

    mod = importlib.import_module(f"fp4gen.generated.{name}")
    spec = spec_from_plan_json(mod.PLAN_JSON)
    for i, (B, Sq, Sk, H, Hkv, mult) in enumerate([(1, 1000, 1000, 2, 2, 1.0), (2, 300, 700, 2, 1, 1.0),
                                                   (1, 700, 300, 2, 2, 1.0), (1, 513, 513, 2, 2, 30.0)]):
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, 128, mult, seed=100 + i)
        o, lse = mod.forward(q, k, v, return_lse=True)
        o_ref, lse_ref = reference.forward(q, k, v, spec)
        _check(o, lse, o_ref, lse_ref, variant, spec.softcap, f"{name} {Sq}x{Sk} x{mult}", inputs=(q, k, v, spec))


@pytest.mark.parametrize("kw", [dict(overlap=False), dict(l_from_mma=True)], ids=["plain_steps", "l_from_mma"])
def test_window_other_schedules(kw, tmp_path_factory):
    """The window's three tile runs through step_plain (no intra-warpgroup overlap), and
    Direct-P with l from the tensor cores."""
    from fp4gen.numerics import reference

    variant = "fp8_directp" if kw.get("l_from_mma") else "bf16"
    plan = make_plan(variant, 128, window=(255, 0), softcap=30.0 if kw.get("overlap") is False else 0.0, **kw)
    mod = load_module(plan, str(tmp_path_factory.mktemp("sm90ws_sched")))
    for B, Sq, Sk, H, Hkv, window in WINDOW_CASES[:3]:
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, 128, 1.0, seed=Sq + 2 * Sk)
        o, lse = mod.forward(q, k, v, return_lse=True)
        o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
        _check(o, lse, o_ref, lse_ref, variant, plan.spec.softcap, f"{kw} {Sq}x{Sk}", inputs=(q, k, v, plan.spec),
               l_from_mma=bool(kw.get("l_from_mma")))
