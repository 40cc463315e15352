"""``fp4gen accuracy``'s oracle knows the mask fields of issue 19: window sizes, softcap,
learned sinks and varlen (per sequence), and equals ``exact.attention``, the one definition."""
from __future__ import annotations

import pytest
import torch

from fp4gen.frontend import parse_text
from fp4gen.numerics import accuracy, exact

FP32 = ("Q : fp32; K : fp32; P : fp32; V : fp32; O : fp32; "
        "backward { dO : fp32; dS : fp32; dP : fp32; dQ : fp32; dK : fp32; dV : fp32 }")


def spec(fields: str):
    (k,) = parse_text(f"attention acc {{ target reference; head_dim 16; {FP32}; {fields} }}")
    return k


def rnd(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("window, softcap, with_sinks", [
    ((-1, -1), 0.0, False), ((-1, 0), 0.0, False), ((5, 3), 2.0, True), ((-1, 7), 0.0, True),
    ((0, 0), 1.0, False), ((2, -1), 0.0, True)])
def test_blocked_oracle_equals_exact_attention(window, softcap, with_sinks):
    """Values, LSE and autograd's gradients of ``exact.attention``, with GQA, Sq != Sk and row
    blocks that split the window's rows."""
    q, do = rnd(2, 37, 4, 16, seed=1), rnd(2, 37, 4, 16, seed=4)
    k, v = rnd(2, 45, 2, 16, seed=2), rnd(2, 45, 2, 16, seed=3)
    sinks = rnd(4, seed=5) if with_sinks else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = exact.attention(*leaves, scale=0.3, window=window, softcap=softcap, sinks=sinks)
    want_grads = torch.autograd.grad(o, leaves, do)
    got_o, got_lse, got_grads = accuracy.exact_attention(q, k, v, 0.3, do=do, window=window, softcap=softcap,
                                                         sinks=sinks, row_block=8)
    torch.testing.assert_close(got_o, o.detach(), rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(lse))
    fin = torch.isfinite(lse)
    torch.testing.assert_close(got_lse[fin], lse.detach()[fin], rtol=0, atol=1e-12)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_causal_flag_and_window_must_agree():
    q = rnd(1, 4, 1, 16, seed=0)
    with pytest.raises(ValueError, match="disagree"):
        accuracy.exact_attention(q, q, q, 0.25, True, window=(3, 0))


def _dropping_mask_fields(real):
    """A planted fault: the oracle as it was, causal or nothing, no window/softcap/sinks."""
    def oracle(q, k, v, scale, causal=False, do=None, *, window=None, softcap=0.0, sinks=None, row_block=None):
        return real(q, k, v, scale, causal or tuple(window or ()) == (-1, 0), do)
    return oracle


WSS = "mask window(8, 0); softcap 2; sinks learned"  # each field changes the output by far more than 1e-5


def test_report_of_window_softcap_sinks_spec(monkeypatch):
    """An all-fp32 spec's report vs the oracle is float32 rounding, O and gradients; with the
    fault planted (the oracle knowing causal only) the same check fails."""
    s = spec(WSS)
    rep = accuracy.report(s, seqlen=48, heads=2, batch=2, seed=3)
    assert len(rep["sink_logits"]) == 2
    for key in ("rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2"):
        assert rep[key] < 1e-5, (key, rep)
    assert rep["lse_max_abs"] < 1e-5
    monkeypatch.setattr(accuracy, "exact_attention", _dropping_mask_fields(accuracy.exact_attention))
    assert accuracy.report(s, seqlen=48, heads=2, batch=2, seed=3)["rel_l2"] > 1e-2


@pytest.mark.parametrize("fields", ["mask window(8, 0)", "mask window(-1, 4)", "softcap 0.5", "sinks learned"])
def test_each_field_is_checked(fields, monkeypatch):
    s = spec(fields)
    assert accuracy.report(s, seqlen=40, heads=2, seed=1)["rel_l2"] < 1e-5
    monkeypatch.setattr(accuracy, "exact_attention", _dropping_mask_fields(accuracy.exact_attention))
    assert accuracy.report(s, seqlen=40, heads=2, seed=1)["rel_l2"] > 1e-3


def test_varlen_report_runs_a_ragged_batch_per_sequence(monkeypatch):
    s = spec(f"layout varlen; {WSS}")
    rep = accuracy.report(s, seqlen=40, heads=2, batch=3, seed=2)
    lengths = rep["seqlens"]
    assert 0 in lengths and 1 in lengths and len(lengths) == 5 and max(lengths) <= 40
    assert rep == accuracy.report(s, seqlen=40, heads=2, batch=3, seed=2)  # seeded
    for key in ("rel_l2", "dq_rel_l2", "dk_rel_l2", "dv_rel_l2"):
        assert rep[key] < 1e-5, (key, rep)

    def one_sequence(q, k, v, cu_q, cu_k, scale, do=None, **mask):  # planted: cu_seqlens ignored
        o, lse, g = accuracy.exact_attention(q[None], k[None], v[None], scale,
                                             do=None if do is None else do[None], **mask)
        return o[0], lse[0], None if g is None else tuple(x[0] for x in g)
    monkeypatch.setattr(accuracy, "exact_attention_varlen", one_sequence)
    assert accuracy.report(s, seqlen=40, heads=2, batch=3, seed=2)["rel_l2"] > 1e-2


def test_ragged_lengths_are_seeded_and_hold_an_empty_and_a_single_token_sequence():
    draw = [accuracy.ragged_lengths(4, 9, torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert draw[0] == draw[1] != draw[2]
    for lengths in draw:
        assert sorted(lengths)[:2] == [0, 1] and len(lengths) == 6 and all(0 <= n <= 9 for n in lengths)
    assert accuracy.cu_seqlens([0, 2, 1]).tolist() == [0, 0, 2, 3]
