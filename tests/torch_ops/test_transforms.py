"""The spec's outlier transforms (``K : ... smooth``, ``V : ... channel_scale``, ``rotate qk
hadamard``) in fp4gen.attention / attention_varlen, on the reference backend on the CPU: the same
result as numerics.outliers.apply by hand around the reference, exact attention (float64 oracle)
in values and gradients, refusals at call time, and planted faults that these checks catch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.frontend import parse_text
from fp4gen.ir.spec import Transforms
from fp4gen.numerics import exact, outliers, reference
from fp4gen.torch_ops import AttentionInputError, attention, attention_varlen

FP32 = ("Q : fp32; K : fp32{smooth}; P : fp32; V : fp32{chan}; O : fp32; "
        "backward {{ dO : fp32; dS : fp32; dP : fp32; dQ : fp32; dK : fp32; dV : fp32 }}")
FP8 = "Q : fp8e4m3(block=128); K : fp8e4m3(block=128){smooth}; P : fp8e4m3 via exp; V : fp8e4m3{chan}; O : bf16"

OPTIONS = {
    "smooth_k": dict(smooth=" smooth"),
    "channel_scale_v": dict(chan=" channel_scale"),
    "hadamard": dict(rotate="rotate qk hadamard(seed=5)"),
    "all": dict(smooth=" smooth", chan=" channel_scale", rotate="rotate qk hadamard"),
}


def spec(option: str, recipe: str = FP8, head_dim: int = 64, extra: str = ""):
    o = {"smooth": "", "chan": "", "rotate": "", **OPTIONS.get(option, {})}
    body = recipe.format(smooth=o["smooth"], chan=o["chan"])
    (k,) = parse_text(f"attention tr {{ target reference; head_dim {head_dim}; {body}; {o['rotate']}; {extra} }}")
    return k


def inputs(b=1, sq=96, sk=128, h=4, hkv=2, d=64, seed=0, dtype=torch.float32, k_offset=3.0):
    """GQA inputs; K gets a common offset (as LLM keys have) so that the LSE shift of smoothing is
    large enough to see, V a few large channels."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, generator=g, dtype=dtype) + k_offset
    v = torch.randn(b, sk, hkv, d, generator=g, dtype=dtype)
    v[..., :3] *= 20
    return q, k, v


@pytest.mark.parametrize("option", list(OPTIONS))
def test_spec_option_is_outliers_apply_by_hand(option):
    s = spec(option)
    assert s.transforms, "the option must reach the spec"
    q, k, v = inputs()
    o, lse = attention(q, k, v, spec=s, causal=True, return_lse=True)
    plain = dataclasses.replace(torch_ops.effective_spec(s, causal=True), transforms=Transforms())
    t = s.transforms
    tq, tk, tv, post = outliers.apply(q, k, v, t.names, s.scale, hadamard_seed=t.hadamard_seed)
    oh, lh = reference.forward(tq, tk, tv, plain)
    assert torch.equal(o, post.o(oh).to(o.dtype))
    assert torch.equal(lse, post.lse(lh))


def _close_to_exact(o, lse, q, k, v, scale, window=(-1, -1), o_tol=0.15, lse_tol=0.4):
    oe, le = exact.attention(q.double(), k.double(), v.double(), scale=scale, window=window)
    rel = float((o.double() - oe).norm() / oe.norm())
    dl = float((lse.double() - le).abs().max())
    assert rel < o_tol, f"O rel-L2 {rel:.3g} against exact attention"
    assert dl < lse_tol, f"LSE off by {dl:.3g} against exact attention"
    return rel, dl


@pytest.mark.parametrize("option", list(OPTIONS))
def test_fp8_recipe_with_option_is_still_attention(option):
    """The transforms change what is quantized, not what is computed: the FP8 recipe's O and LSE
    stay at FP8 accuracy of exact attention of the original inputs. Bounds: measured on these
    inputs (2026-12-02), O rel-L2 0.096 and LSE 0.24 without a transform, at most 0.099 and 0.28
    with one; a missing Post (below) is off by far more (O's columns by up to 2**5, the LSE by
    scale * q . mean ~ 3)."""
    s = spec(option)
    q, k, v = inputs()
    o, lse = attention(q, k, v, spec=s, return_lse=True)
    _close_to_exact(o, lse, q, k, v, s.scale)


@pytest.mark.parametrize("fault, option", [("o", "channel_scale_v"), ("lse", "smooth_k")])
def test_planted_fault_post_not_applied_fails(monkeypatch, fault, option):
    """Without Post (O's columns not scaled back, the LSE not shifted back) the check above fails."""
    monkeypatch.setattr(outliers.Post, fault, lambda self, x: x)
    s = spec(option)
    q, k, v = inputs()
    o, lse = attention(q, k, v, spec=s, return_lse=True)
    with pytest.raises(AssertionError):
        _close_to_exact(o, lse, q, k, v, s.scale)


def leaves(*shapes, seed=0, offset=(0.0, 2.0, 0.0)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(sh, generator=g, dtype=torch.float64) + off).requires_grad_()
            for sh, off in zip(shapes, offset)]


def grads(out, xs, seed=9):
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, xs, do)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_float64_autograd_of_exact_attention(option, causal):
    s = spec(option, recipe=FP32, head_dim=16)
    q, k, v = leaves((2, 7, 4, 16), (2, 10, 2, 16), (2, 10, 2, 16))
    o, lse = attention(q, k, v, spec=s, causal=causal, return_lse=True)
    window = (-1, 0) if causal else (-1, -1)
    oe, le = exact.attention(q, k, v, scale=0.25, window=window)
    # fp32 transforms and reference against float64: agreement to float32's rounding
    assert (o - oe).abs().max() < 1e-5 and (lse.double() - le).abs().max() < 1e-5
    for g, ge in zip(grads(o, [q, k, v]), grads(oe, [q, k, v])):
        assert (g - ge).abs().max() < 1e-5 * max(1.0, float(ge.abs().max()))


def test_gradient_check_catches_a_wrong_backward(monkeypatch):
    """Planted fault: V's scales taken with their (zero almost everywhere) derivative dropped the
    wrong way, i.e. Post.o multiplying by c detached while v / c is not divided: dv is off."""
    real = outliers.channel_scale_v

    def wrong(v):
        vs, c = real(v)
        return vs.detach() + (v - v.detach()), c  # forward right, dv not divided by c
    monkeypatch.setattr(outliers, "channel_scale_v", wrong)
    s = spec("channel_scale_v", recipe=FP32, head_dim=16)
    q, k, v = leaves((1, 6, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16), offset=(0.0, 0.0, 0.0))
    with torch.no_grad():
        v[..., 0] *= 10  # a channel whose scale is not 1
    o = attention(q, k, v, spec=s)
    oe, _ = exact.attention(q, k, v, scale=0.25)
    assert (o - oe).abs().max() < 1e-5  # the forward is right
    dv, dve = grads(o, [v])[0], grads(oe, [v])[0]
    assert (dv - dve).abs().max() > 1e-2


@pytest.mark.parametrize("option", list(OPTIONS))
def test_varlen_matches_exact_per_sequence(option):
    """attention_varlen takes the packed tokens as one sequence for the mean and the V scales (exact:
    every row's keys are shifted alike); each sequence is exact attention of its own tokens."""
    s = spec(option, recipe=FP32, head_dim=16)
    lens = [5, 0, 9, 1]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    q, k, v = leaves((sum(lens), 4, 16), (sum(lens), 2, 16), (sum(lens), 2, 16))
    o, lse = attention_varlen(q, k, v, cu, cu, max(lens), max(lens), spec=s, causal=True, return_lse=True)
    assert o.shape == q.shape and lse.shape == (4, sum(lens))
    parts = []
    for b, n in enumerate(lens):
        if n == 0:
            continue
        sl = slice(int(cu[b]), int(cu[b]) + n)
        oe, le = exact.attention(q[None, sl], k[None, sl], v[None, sl], scale=0.25, window=(-1, 0))
        assert (lse[:, sl].double() - le[0]).abs().max() < 1e-5
        parts.append(oe[0])
    oe = torch.cat(parts)
    assert (o - oe).abs().max() < 1e-5
    for g, ge in zip(grads(o, [q, k, v]), grads(oe, [q, k, v])):
        assert (g - ge).abs().max() < 1e-5 * max(1.0, float(ge.abs().max()))


def test_call_softcap_or_sinks_with_smoothing_is_refused():
    s = spec("smooth_k")
    q, k, v = inputs()
    with pytest.raises(AttentionInputError, match="softcap"):
        attention(q, k, v, spec=s, softcap=30.0)
    with pytest.raises(AttentionInputError, match="sink"):
        attention(q, k, v, spec=s, sinks=torch.zeros(4))


def test_a_spec_without_options_runs_as_before():
    """No transform step for a spec without options: the op sees the caller's tensors."""
    s = spec("none")
    assert not s.transforms
    q, k, v = inputs()
    o, lse = attention(q, k, v, spec=s, return_lse=True)
    oh, lh = reference.forward(q, k, v, s)
    assert torch.equal(o, oh.to(o.dtype)) and torch.equal(lse, lh)


def test_explain_lists_the_transforms():
    r = torch_ops.explain(spec("all"), "cpu")
    assert r["transforms"] == ["smooth_k", "channel_scale_v", "hadamard"] and r["forward"] == "reference"
    assert "transforms" not in torch_ops.explain(spec("none"), "cpu")


@pytest.mark.parametrize("option", ["hadamard", "all"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(option, backend):
    """The transform steps trace (the seeded Hadamard matrix is a constant of the graph), forward
    and backward."""
    torch._dynamo.reset()
    s = spec(option, recipe=FP32, head_dim=16)
    q, k, v = leaves((1, 6, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16))

    def f(q, k, v):
        return attention(q, k, v, spec=s, causal=True)

    got = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    want = f(q, k, v)
    assert torch.equal(got, want)
    for g, ge in zip(grads(got, [q, k, v]), grads(want, [q, k, v])):
        torch.testing.assert_close(g, ge, rtol=1e-12, atol=1e-12)
