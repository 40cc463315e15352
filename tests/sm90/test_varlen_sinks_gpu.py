"""sm90a forward with ``layout varlen`` (BF16) and ``sinks learned`` (all recipes) on a Hopper
GPU, against the reference backend (``reference.forward_varlen`` / ``reference.forward``).

Tolerances are test_window_softcap_gpu.py's ``_check`` (per recipe, test_sm90_gpu.py's TOL): a
sink only adds one term to each row's denominator, and varlen only changes which rows and keys a
CTA reads, so neither adds error of its own (FP8 Direct-P's LSE bound, computed per row from the
reference's codes, counts the sink's share of l: a sink-dominated row cannot move). Rows that see
no key: O == 0 and LSE == -inf (the sink's logit with sinks), exactly where the reference has them.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import VARIANTS, load_module, make_plan  # noqa: E402
from test_window_softcap_gpu import _check  # noqa: E402

pytestmark = pytest.mark.gpu

# per-sequence (Sq, Sk): ragged, empty, Sq != Sk both ways, one token, longer than a tile
VARLEN_BATCHES = [
    [(1000, 1000), (17, 17), (0, 5), (300, 700), (700, 300), (1, 1), (129, 129)],
    [(5, 0), (256, 256), (1, 900), (513, 64)],
]


def _packed(lengths, H, Hkv, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q = torch.randn(tq, H, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(tk, Hkv, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(tk, Hkv, 128, device="cuda", generator=g).bfloat16()
    cu_q = torch.tensor([0] + [a for a, _ in lengths], device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + [b for _, b in lengths], device="cuda").cumsum(0).int()
    return q, k, v, cu_q, cu_k, max(a for a, _ in lengths), max(b for _, b in lengths)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch", range(len(VARLEN_BATCHES)))
def test_varlen_matches_reference(causal, batch, tmp_path):
    from fp4gen.numerics import reference

    plan = make_plan("bf16", 128, causal, varlen=True)
    mod = load_module(plan, str(tmp_path))
    q, k, v, cu_q, cu_k, mq, mk = _packed(VARLEN_BATCHES[batch], 4, 2, seed=batch)
    o, lse = mod.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True)
    o_ref, lse_ref = reference.forward_varlen(q, k, v, cu_q, cu_k, plan.spec)
    # _check takes dense (B, S, H, D) / (B, H, S): one batch of all packed rows
    _check(o[None], lse[None], o_ref[None], lse_ref[None], "bf16", what=f"varlen causal={causal} #{batch}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mult", [1.0, 8.0], ids=["std1", "std8"])
def test_sinks_match_reference(variant, mult, tmp_path):
    from fp4gen.numerics import reference

    from test_sm90_gpu import _inputs

    plan = make_plan(variant, 128, True, sinks=True)
    mod = load_module(plan, str(tmp_path))
    for B, Sq, Sk, H, Hkv in [(1, 513, 513, 4, 2), (2, 300, 700, 2, 1), (1, 700, 300, 2, 2)]:
        q, k, v = _inputs(B, Sq, Sk, H, Hkv, 128, mult, seed=Sq + Sk)
        sinks = torch.linspace(-4.0, 12.0, H, device="cuda") * mult
        o, lse = mod.forward(q, k, v, sinks=sinks, return_lse=True)
        o_ref, lse_ref = reference.forward(q, k, v, plan.spec, sinks=sinks)
        _check(o, lse, o_ref, lse_ref, variant, what=f"{variant} sinks x{mult} {Sq}x{Sk}",
               inputs=(q, k, v, plan.spec, sinks))
