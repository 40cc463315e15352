"""Window masks, softcap, sinks and varlen in the float64 oracle (numerics/exact.py) and the
reference backend (numerics/reference.py), against a formula written out here entry by entry."""
from __future__ import annotations

import math

import pytest
import torch

from fp4gen.frontend import parse_text
from fp4gen.numerics import exact, masking
from fp4gen.numerics import reference as ref

FP32_GRADS = "backward { dO : fp32; dS : fp32; dP : fp32; dQ : fp32; dK : fp32; dV : fp32 }"


def spec(fields: str = "", formats: str = "Q : fp32; K : fp32; P : fp32; V : fp32; O : fp32", d: int = 16,
         tile: str = "tile 64 x 16"):
    (k,) = parse_text(f"attention a {{ target reference; head_dim {d}; {formats}; {fields}; "
                      f"schedule {{ {tile} }}; {FP32_GRADS} }}")
    return k


def formula(q, k, v, scale, window, cap, sinks):
    """float64 attention spelled out: the mask by its definition per (i, j), the sink as an extra
    column of the softmax with a zero value row. -> o (B, Sq, H, D), lse (B, H, Sq)."""
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    left, right = window
    o = torch.zeros(B, Sq, H, D, dtype=torch.float64)
    lse = torch.full((B, H, Sq), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kh = h // (H // Hkv)
            for i in range(Sq):
                keys = [j for j in range(Sk)
                        if (right < 0 or j <= i + Sk - Sq + right) and (left < 0 or j >= i + Sk - Sq - left)]
                logits = [float(q[b, i, h].double() @ k[b, j, kh].double()) * scale for j in keys]
                if cap:
                    logits = [cap * math.tanh(x / cap) for x in logits]
                rows = [v[b, j, kh].double() for j in keys]
                if sinks is not None:
                    logits.append(float(sinks[h]))
                    rows.append(torch.zeros(D, dtype=torch.float64))
                if not logits:
                    continue
                t = torch.tensor(logits, dtype=torch.float64)
                p = torch.softmax(t, 0)
                o[b, i, h] = (p[:, None] * torch.stack(rows)).sum(0)
                lse[b, h, i] = torch.logsumexp(t, 0)
    return o, lse


def qkv(b=2, sq=9, sk=13, h=4, hkv=2, d=16, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, h, d, generator=g) * scale, torch.randn(b, sk, hkv, d, generator=g) * scale,
            torch.randn(b, sk, hkv, d, generator=g))


def close_lse(a, b, tol):
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    assert (a[fin].double() - b[fin].double()).abs().max().item() < tol if fin.any() else True


CASES = [
    # (spec fields, window, softcap, sinks?, sq, sk)
    ("", (-1, -1), 0.0, False, 9, 13),
    ("mask causal", (-1, 0), 0.0, False, 9, 13),
    ("mask causal", (-1, 0), 0.0, False, 13, 9),  # Sq > Sk: the first rows see no key
    ("mask window(3, 2)", (3, 2), 0.0, False, 9, 13),
    ("mask window(0, 0)", (0, 0), 0.0, False, 13, 9),  # one key per row at most
    ("mask window(2, -1)", (2, -1), 0.0, False, 9, 13),
    ("mask window(40, 40)", (40, 40), 0.0, False, 9, 13),  # wider than the sequence: no mask
    ("softcap 2.5", (-1, -1), 2.5, False, 9, 13),
    ("sinks learned", (-1, -1), 0.0, True, 9, 13),
    ("mask window(1, 0); softcap 4; sinks learned", (1, 0), 4.0, True, 13, 9),
]


@pytest.mark.parametrize("fields, window, cap, with_sinks, sq, sk", CASES)
def test_oracle_and_reference_forward_match_the_formula(fields, window, cap, with_sinks, sq, sk):
    q, k, v = qkv(sq=sq, sk=sk, scale=1.5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1)) * 2 if with_sinks else None
    sp = spec(fields)
    want_o, want_lse = formula(q, k, v, sp.scale, window, cap, sinks)
    o, lse = exact.attention(q, k, v, scale=sp.scale, window=window, softcap=cap, sinks=sinks)
    assert (o - want_o).abs().max() < 1e-12
    close_lse(lse, want_lse, 1e-12)
    o, lse = ref.forward(q, k, v, sp, sinks=sinks)
    assert o.dtype == lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    assert (o.double() - want_o).abs().max() < 2e-5
    close_lse(lse, want_lse, 2e-5)


def _grads_of_exact(q, k, v, do, *, scale, window, cap, sinks):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    s = sinks.double().requires_grad_() if sinks is not None else None
    o, _ = exact.attention(*leaves, scale=scale, window=window, softcap=cap, sinks=s)
    o.backward(do.double())
    return [x.grad for x in leaves], (s.grad if s is not None else None)


@pytest.mark.parametrize("fields, window, cap, with_sinks, sq, sk", CASES)
def test_reference_backward_matches_autograd_of_the_oracle(fields, window, cap, with_sinks, sq, sk):
    q, k, v = qkv(sq=sq, sk=sk, scale=1.5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1)) * 2 if with_sinks else None
    sp = spec(fields)
    o, lse = ref.forward(q, k, v, sp, sinks=sinks)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    got = ref.backward(q, k, v, o, lse, do, sp, sinks=sinks)
    want, dsink = _grads_of_exact(q, k, v, do, scale=sp.scale, window=window, cap=cap, sinks=sinks)
    for g, w in zip(got, want):
        assert not torch.isnan(g).any()
        assert (g.double() - w).abs().max() < 5e-5
    if sinks is not None:
        assert (ref.sinks_grad(o, lse, do, sinks).double() - dsink).abs().max() < 5e-5


@pytest.mark.parametrize("window, cap, with_sinks", [((-1, 0), 0.0, False), ((1, 1), 3.0, True), ((0, 0), 0.0, True)])
def test_gradcheck_of_the_oracle(window, cap, with_sinks):
    """autograd of the float64 oracle is its derivative, also across fully masked rows (Sq > Sk)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 3, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.randn(2, generator=g, dtype=torch.float64, requires_grad=True) if with_sinks else None
    args = (q, k, v) + ((s,) if with_sinks else ())

    def f(*xs):
        return exact.attention(*xs[:3], scale=0.7, window=window, softcap=cap, sinks=xs[3] if with_sinks else None)[0]

    assert torch.autograd.gradcheck(f, args)


# ---- adversarial ---------------------------------------------------------------------------


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    q, k, v = qkv(sq=12, sk=5)
    sp = spec("mask window(0, 0)")  # rows 0..6 of 12 sit before the first key's diagonal
    o, lse = ref.forward(q, k, v, sp)
    assert torch.isneginf(lse[:, :, :7]).all() and torch.isfinite(lse[:, :, 7:]).all()
    assert (o[:, :7] == 0).all() and not torch.isnan(o).any()
    do = torch.randn(o.shape)
    for g in ref.backward(q, k, v, o, lse, do, sp):
        assert not torch.isnan(g).any()
    oe, le = exact.attention(q, k, v, scale=sp.scale, window=(0, 0))
    assert (oe[:, :7] == 0).all() and torch.isneginf(le[:, :, :7]).all()


def test_softcap_with_huge_logits():
    q, k, v = qkv(scale=40.0)  # scaled scores ~1e3
    sp = spec("softcap 30")
    want_o, want_lse = formula(q, k, v, sp.scale, (-1, -1), 30.0, None)
    o, lse = ref.forward(q, k, v, sp)
    assert (o.double() - want_o).abs().max() < 1e-4
    close_lse(lse, want_lse, 1e-4)
    oe, le = exact.attention(q, k, v, scale=sp.scale, softcap=30.0)
    assert (oe - want_o).abs().max() < 1e-12


@pytest.mark.parametrize("sink", [1e4, -1e4, 80.0])
def test_huge_sink_logits(sink):
    q, k, v = qkv()
    sinks = torch.full((4,), sink)
    sp = spec("sinks learned")
    want_o, want_lse = formula(q, k, v, sp.scale, (-1, -1), 0.0, sinks)
    o, lse = ref.forward(q, k, v, sp, sinks=sinks)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert (o.double() - want_o).abs().max() < 1e-5
    assert ((lse.double() - want_lse).abs() / want_lse.abs().clamp(min=1)).max() < 1e-6
    do = torch.randn(o.shape)
    assert torch.isfinite(ref.sinks_grad(o, lse, do, sinks)).all()


def test_masked_keys_do_not_reach_the_output():
    """What a window hides (also in whole skipped tiles) cannot change O, with quantized numerics."""
    q, k, v = qkv(sq=40, sk=64, d=64)
    sp = spec("mask window(8, 0)", formats="Q : bf16; K : bf16; P : bf16; V : bf16; O : bf16", d=64,
              tile="tile 64 x 16")
    o, _ = ref.forward(q, k, v, sp)
    v2 = v.clone()
    v2[:, :64 - 40 - 8 - 1] = 1e3  # keys no row of the window sees (row 0 sees keys 16..24)
    assert torch.equal(ref.forward(q, k, v2, sp)[0], o)


def test_quantized_numerics_compose_with_window_and_softcap():
    q, k, v = qkv(sq=64, sk=96, d=64)
    fields = "mask window(32, 0); softcap 5"
    sp = spec(fields, formats="Q : fp8e4m3(block=128); K : fp8e4m3(block=128); P : fp8e4m3; V : fp8e4m3; O : bf16",
              d=64, tile="tile 128 x 128")
    o, lse = ref.forward(q, k, v, sp)
    oe, le = exact.attention(q, k, v, scale=sp.scale, window=(32, 0), softcap=5.0)
    cos = torch.nn.functional.cosine_similarity(o.double().flatten(), oe.flatten(), 0)
    assert cos > 0.995
    assert (lse.double() - le).abs().max() < 0.1


# ---- varlen ----------------------------------------------------------------------------------


def _packed(lens_q, lens_k, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, generator=g)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("fields, formats", [
    ("mask causal", "Q : fp32; K : fp32; P : fp32; V : fp32; O : fp32"),
    ("mask window(2, 1); sinks learned; softcap 3", "Q : fp32; K : fp32; P : fp32; V : fp32; O : fp32"),
    ("mask causal", "Q : fp8e4m3(block=128); K : fp8e4m3(block=128); P : fp8e4m3; V : fp8e4m3; O : bf16"),
])
def test_varlen_is_the_dense_call_per_sequence(fields, formats):
    lens_q, lens_k = [5, 0, 1, 7, 3], [6, 4, 0, 7, 9]  # an empty query sequence and an empty key sequence
    q, k, v, cq, ck = _packed(lens_q, lens_k)
    sp = spec(fields + "; layout varlen", formats=formats)
    sinks = torch.randn(4) if "sinks" in fields else None
    o, lse = ref.forward_varlen(q, k, v, cq, ck, sp, sinks=sinks, max_seqlen_q=7, max_seqlen_k=9)
    assert o.shape == q.shape and lse.shape == (4, q.shape[0])
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5))
    dq, dk, dv = ref.backward_varlen(q, k, v, o, lse, do, cq, ck, sp, sinks=sinks)
    dense = spec(fields, formats=formats)
    for (q0, q1), (k0, k1) in zip(zip(cq[:-1].tolist(), cq[1:].tolist()), zip(ck[:-1].tolist(), ck[1:].tolist())):
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: O = 0, LSE = -inf (the sink with sinks)
            assert (o[q0:q1] == 0).all()
            want = sinks[:, None].expand(4, q1 - q0) if sinks is not None else torch.full((4, q1 - q0), -math.inf)
            assert torch.equal(lse[:, q0:q1], want)
            assert (dq[q0:q1] == 0).all()
            continue
        ob, lb = ref.forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dense, sinks=sinks)
        assert torch.equal(o[q0:q1], ob[0]) and torch.equal(lse[:, q0:q1], lb[0])
        g = ref.backward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], ob, lb, do[None, q0:q1], dense, sinks=sinks)
        assert torch.equal(dq[q0:q1], g[0][0]) and torch.equal(dk[k0:k1], g[1][0]) and torch.equal(dv[k0:k1], g[2][0])
    assert not torch.isnan(o).any() and not torch.isnan(dq).any()


def test_varlen_oracle_against_the_formula():
    lens_q, lens_k = [3, 0, 6], [5, 2, 0]
    q, k, v, cq, ck = _packed(lens_q, lens_k)
    o, lse = exact.attention_varlen(q, k, v, cq, ck, scale=0.3, window=(1, 0))
    for q0, q1, k0, k1 in masking.segments(cq, ck, q.shape[0], k.shape[0]):
        wo, wl = formula(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], 0.3, (1, 0), 0.0, None)
        assert (o[q0:q1] - wo[0]).abs().max() < 1e-12 if q1 > q0 else True
        if q1 > q0:
            close_lse(lse[:, q0:q1], wl[0], 1e-12)


@pytest.mark.parametrize("cq, ck, total_q, match", [
    ([0, 3, 2], [0, 3, 5], 2, "never decrease"),
    ([1, 3], [0, 3], 3, "start at 0"),
    ([0, 3], [0, 2, 5], 3, "offsets"),
    ([0, 4], [0, 5], 3, "ends at 4"),
    ([0], [0], 0, "B \\+ 1 >= 2"),
])
def test_varlen_offsets_are_checked(cq, ck, total_q, match):
    with pytest.raises(ValueError, match=match):
        masking.segments(torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32), total_q, 5)


def test_max_seqlen_is_checked():
    q, k, v, cq, ck = _packed([5, 3], [5, 3])
    with pytest.raises(ref.ReferenceError, match="max_seqlen_q=4"):
        ref.forward_varlen(q, k, v, cq, ck, spec("layout varlen"), max_seqlen_q=4)


def test_sinks_must_match_the_spec():
    q, k, v = qkv()
    with pytest.raises(ref.ReferenceError, match="pass sinks"):
        ref.forward(q, k, v, spec("sinks learned"))
    with pytest.raises(ref.ReferenceError, match="has no sinks"):
        ref.forward(q, k, v, spec(""), sinks=torch.zeros(4))
    with pytest.raises(ref.ReferenceError, match="layout varlen"):
        ref.forward(q, k, v, spec("layout varlen"))
