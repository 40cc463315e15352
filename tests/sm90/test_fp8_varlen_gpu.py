"""sm90a FP8 forward with ``layout varlen`` (both FP8 recipes: P via exp and via Direct-P) on a
Hopper GPU, against the reference backend (``reference.forward_varlen``: the dense path per
sequence, so per-sequence scales), through the example modules
(examples/sm90_fp8_varlen_d128.attn, generated/sm90_fp8_*_varlen_*_sm90a.py).

Ragged batches around the 128-token scale block and key tile (1, 100, 128, 129, 1000 tokens and
an empty sequence), non-causal and causal, logits of std 1 and 8, Sq != Sk per sequence both
ways (causal rows that see no key: O == 0 and LSE == -inf exactly, where the reference has
them), GQA 2:1. Tolerances: test_window_softcap_gpu.py's ``_check`` with test_sm90_gpu.py's
per-recipe TOL: varlen only changes which rows, keys and scales a CTA reads, not the arithmetic.

``test_packed_equals_dense_kernel_per_sequence`` runs each sequence alone through the dense FP8
module of the same recipe and mask: same scales (blocks restart per sequence), same operand
bytes, same tiles and order, masked keys contributing exact zeros in both, so the results are
expected to be bit-equal; a difference is a varlen indexing bug (a scale, V^T column or row).
Each case is well under 5 s on an H200 once its module is compiled (one compile per module).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import _shim_plain_checkout  # noqa: E402,F401  (the package mapping on a plain checkout)
from test_window_softcap_gpu import _check  # noqa: E402

pytestmark = pytest.mark.gpu


ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sm90_fp8_varlen_d128.attn"
DENSE = {"fp8_exp": ROOT / "examples" / "sm90_fp8_exp_d128.attn",
         "fp8_directp": ROOT / "examples" / "sm90_fp8_directp_d128.attn"}

# per-sequence (Sq, Sk)
BATCHES = {
    "ragged": [(n, n) for n in (1, 100, 128, 129, 1000, 0)],
    # Sq > Sk (causal: the first Sq - Sk rows see no key), Sq < Sk, no keys at all, one query
    "uneven": [(5, 0), (300, 44), (1, 900), (129, 257), (513, 64), (128, 128)],
}


def _kernel(variant, causal):
    return f"sm90_{variant}_varlen{'_causal' if causal else ''}_d128"


_MODS = {}


def _mod(path, name):
    import fp4gen

    if name not in _MODS:
        _MODS[name] = fp4gen.load(str(path), kernel=name)
    return _MODS[name]


def _packed(lengths, H, Hkv, mult, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(a for a, _ in lengths), sum(b for _, b in lengths)
    q = (torch.randn(tq, H, 128, device="cuda", generator=g) * mult).bfloat16()
    k = (torch.randn(tk, Hkv, 128, device="cuda", generator=g) * mult).bfloat16()
    v = torch.randn(tk, Hkv, 128, device="cuda", generator=g).bfloat16()
    cu_q = torch.tensor([0] + [a for a, _ in lengths], device="cuda").cumsum(0).int()
    cu_k = torch.tensor([0] + [b for _, b in lengths], device="cuda").cumsum(0).int()
    return q, k, v, cu_q, cu_k, max(a for a, _ in lengths), max(b for _, b in lengths)


@pytest.mark.parametrize("variant", ["fp8_exp", "fp8_directp"])
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
@pytest.mark.parametrize("mult", [1.0, 8.0], ids=["std1", "std8"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_fp8_varlen_matches_reference(variant, causal, mult, batch):
    from fp4gen.numerics import reference

    mod = _mod(EXAMPLE, _kernel(variant, causal))
    lengths = BATCHES[batch]
    q, k, v, cu_q, cu_k, mq, mk = _packed(lengths, 4, 2, mult, seed=len(batch) + int(mult) + 2 * causal)
    o, lse = mod.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True)
    import fp4gen

    (spec,) = [s for s in fp4gen.parse_file(EXAMPLE) if s.name == _kernel(variant, causal)]
    o_ref, lse_ref = reference.forward_varlen(q, k, v, cu_q, cu_k, spec)
    what = f"{variant} varlen causal={causal} x{mult} {batch}"
    if causal and batch == "uneven":
        assert torch.isneginf(lse_ref).any(), f"{what}: the batch must have rows that see no key"
    # _check takes dense (B, S, H, D) / (B, H, S): one batch of all packed rows
    _check(o[None], lse[None], o_ref[None], lse_ref[None], variant, what=what)


@pytest.mark.parametrize("variant", ["fp8_exp", "fp8_directp"])
@pytest.mark.parametrize("causal", [False, True], ids=["nomask", "causal"])
def test_packed_equals_dense_kernel_per_sequence(variant, causal):
    mod = _mod(EXAMPLE, _kernel(variant, causal))
    dense = _mod(DENSE[variant], f"sm90_{variant}{'_causal' if causal else ''}_d128")
    lengths = BATCHES["uneven"]
    q, k, v, cu_q, cu_k, mq, mk = _packed(lengths, 4, 2, 8.0, seed=99)
    o, lse = mod.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True)
    c_q, c_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lengths)):
        qa, qe, ka, ke = c_q[b], c_q[b + 1], c_k[b], c_k[b + 1]
        if qa == qe or ka == ke:
            continue  # the dense module takes no empty side
        ob, lb = dense.forward(q[None, qa:qe], k[None, ka:ke], v[None, ka:ke], return_lse=True)
        assert torch.equal(o[qa:qe], ob[0]), f"{variant} causal={causal} sequence {b}: O differs from the dense kernel"
        assert torch.equal(lse[:, qa:qe], lb[0]), f"{variant} causal={causal} sequence {b}: LSE differs"


def test_fp8_varlen_no_keys_anywhere_gives_empty_rows():
    """Every sequence without keys: no launch, O = 0, LSE = -inf."""
    mod = _mod(EXAMPLE, _kernel("fp8_directp", True))
    q, k, v, cu_q, cu_k, mq, mk = _packed([(3, 0), (0, 0), (7, 0)], 2, 1, 1.0, seed=5)
    o, lse = mod.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_fp8_varlen_window_softcap_sinks_match_reference(tmp_path):
    """The extensions the varlen kernel shares with the dense one, together, on FP8 Direct-P:
    window(127, 0) at the sequence edges, softcap 30 on logits of std 8, learned sinks. Its
    module is rendered here (no example), so the first call compiles it (~30-40 s)."""
    from fp4gen.numerics import reference

    from plans import load_module, make_plan

    plan = make_plan("fp8_directp", 128, window=(127, 0), softcap=30.0, sinks=True, varlen=True)
    mod = load_module(plan, str(tmp_path))
    q, k, v, cu_q, cu_k, mq, mk = _packed(BATCHES["uneven"], 4, 2, 8.0, seed=7)
    sinks = torch.linspace(-4.0, 12.0, 4, device="cuda")
    o, lse = mod.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, return_lse=True, sinks=sinks)
    o_ref, lse_ref = reference.forward_varlen(q, k, v, cu_q, cu_k, plan.spec, sinks=sinks)
    _check(o[None], lse[None], o_ref[None], lse_ref[None], "fp8_directp", softcap=30.0,
           what="fp8_directp varlen window(127, 0) softcap 30 sinks")
