"""The outlier transforms leave exact attention unchanged, and the synthetic cases have the
structure they claim (numerics/outliers.py, numerics/activations.py; issue 21)."""
import itertools

import pytest
import torch

from fp4gen.numerics import activations, outliers


def _attn(q, k, v, scale, causal=False):
    """float64 softmax attention written out here: (o (B,S,H,D), lse (B,H,S))."""
    H, hk = q.shape[2], k.shape[2]
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(H // hk, dim=1) for x in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2), torch.logsumexp(s, -1)


SUBSETS = [c for r in range(1, 4) for c in itertools.combinations(outliers.TRANSFORMS, r)]


@pytest.mark.parametrize("transforms", SUBSETS, ids=["+".join(t) for t in SUBSETS])
@pytest.mark.parametrize("causal", [False, True])
def test_transforms_leave_attention_unchanged(transforms, causal):
    c = activations.synthetic("llm_mix", seqlen=96, heads=4, head_dim=32, kv_heads=2, seed=3)
    q, k, v = (x.double() for x in (c.q, c.k, c.v))
    scale = 32 ** -0.5
    o0, l0 = _attn(q, k, v, scale, causal)
    tq, tk, tv, post = outliers.apply(c.q, c.k, c.v, transforms, scale, hadamard_seed=7)
    o1, l1 = _attn(tq, tk, tv, scale, causal)
    o1, l1 = post.o(o1), post.lse(l1)
    # float32 transforms of values up to ~50: agreement to float32 rounding of the inputs
    assert float((o1 - o0).abs().max()) < 2e-4 * float(o0.abs().max())
    assert float((l1 - l0).abs().max()) < 1e-4 * float(l0.abs().max())


def test_a_wrong_lse_shift_is_caught():
    """Planted: smoothing without its LSE correction moves the LSE (the check above can fail)."""
    c = activations.synthetic("massive_k", seqlen=64, heads=2, head_dim=32)
    tq, tk, tv, post = outliers.apply(c.q, c.k, c.v, ["smooth_k"], 32 ** -0.5)
    l0 = _attn(c.q, c.k, c.v, 32 ** -0.5)[1]
    l1 = _attn(tq, tk, tv, 32 ** -0.5)[1]
    assert float((l1 - l0).abs().max()) > 1.0
    assert float((post.lse(l1) - l0).abs().max()) < 1e-3


def test_what_each_transform_does_to_the_operands():
    c = activations.synthetic("llm_mix", seqlen=128, heads=2, head_dim=64)
    ks, m = outliers.smooth_k(c.k)
    assert float(ks.mean(1).abs().max()) < 1e-4 and float(m.abs().max()) > 20  # the +-30 channels
    vs, cs = outliers.channel_scale_v(c.v)
    e = torch.frexp(cs)[0]
    assert bool((e == 0.5).all())  # powers of two
    amax = vs.abs().amax(1)
    assert float(amax.min()) >= 0.5 and float(amax.max()) <= 1.0
    assert torch.equal(vs * cs, c.v)  # exact
    r = outliers.hadamard_matrix(64, seed=1)
    assert torch.allclose(r @ r.T, torch.eye(64), atol=1e-6)
    # a channel outlier of K is spread over all channels by the rotation
    _, kr = outliers.hadamard(c.q, c.k)
    def imbalance(x):  # largest channel's mean |k| over the median channel's
        m = x.abs().mean(1)
        return float((m.amax(-1) / m.median(-1).values).max())
    assert imbalance(c.k) > 10 and imbalance(kr) < 3  # 25 -> 2.1 here
    with pytest.raises(ValueError, match="power-of-two head dim"):
        outliers.hadamard_matrix(96)


def test_apply_refuses_what_would_change_the_attention():
    c = activations.synthetic("randn", seqlen=16, heads=1, head_dim=16)
    with pytest.raises(ValueError, match="softcap"):
        outliers.apply(c.q, c.k, c.v, ["smooth_k"], 0.25, softcap=30.0)
    with pytest.raises(ValueError, match="sink"):
        outliers.apply(c.q, c.k, c.v, ["smooth_k"], 0.25, sinks=torch.zeros(1))
    with pytest.raises(ValueError, match="unknown transform"):
        outliers.apply(c.q, c.k, c.v, ["smooth_v"], 0.25)
    outliers.apply(c.q, c.k, c.v, ["hadamard", "channel_scale_v"], 0.25, softcap=30.0)  # these are fine


def test_zero_channel_gets_scale_one():
    v = torch.randn(1, 8, 1, 4)
    v[..., 2] = 0
    vs, c = outliers.channel_scale_v(v)
    assert float(c[0, 0, 0, 2]) == 1.0 and torch.equal(vs[..., 2], v[..., 2])


# ------------------------------------------------------------ synthetic cases -----

def test_synthetic_is_seeded_and_shaped():
    for kind in activations.SYNTHETIC:
        a = activations.synthetic(kind, seqlen=64, heads=4, head_dim=32, kv_heads=2, seed=5)
        b = activations.synthetic(kind, seqlen=64, heads=4, head_dim=32, kv_heads=2, seed=5)
        assert torch.equal(a.q, b.q) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert a.q.shape == (1, 64, 4, 32) and a.k.shape == a.v.shape == (1, 64, 2, 32)
        assert a.meta["synthetic"] == kind
    with pytest.raises(ValueError, match="unknown synthetic case"):
        activations.synthetic("massive_q")


def test_synthetic_structures():
    S, D = 512, 64
    mk = activations.synthetic("massive_k", seqlen=S, heads=2, head_dim=D)
    chan = mk.k.abs().mean(1)  # (B, H, D): 4 channels near 30, the rest near 0.8
    assert int((chan > 20).sum(-1).min()) == 4
    sink = activations.synthetic("sink", seqlen=S, heads=2, head_dim=D)
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", sink.q, sink.k) * D ** -0.5, -1)
    share = float(p[..., 0].mean())
    assert 0.2 < share < 0.8, share  # the sink holds a large share of every row's mass
    rows = activations.synthetic("outlier_v_rows", seqlen=S, heads=2, head_dim=D)
    assert int((rows.v.abs().amax(-1) > 40).sum()) >= 8 * 2 * 0.9
    pk = activations.synthetic("peaked", seqlen=S, heads=2, head_dim=D)
    std = float((torch.einsum("bqhd,bkhd->bhqk", pk.q, pk.k) * D ** -0.5).std())
    assert 7 < std < 11, std
