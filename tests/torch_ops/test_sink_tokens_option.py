"""``sink_tokens N`` as a spec option (issue 21): fp4gen.attention and a generated module's own
entry points run the attention on keys N.. and attend the first N keys exactly beside it, merged
by their log-sum-exps (numerics.outliers.SinkTokens), forward and backward, on the CPU.

- Forward: the result is outliers.apply + the reference + Post.apply by hand, bit for bit.
- Values and gradients: float64 autograd of exact attention of the original inputs, for every
  mask kind, softcap, learned sinks (and their gradient), GQA, Sq != Sk (rows that see no key
  among N..), alone and with the other transforms.
- The backward is one autograd node (torch_ops._SinkTokensAttention): the merge depends on the
  op's LSE, which carries no gradient, so the op followed by Post.apply under plain autograd
  gets dQ and dK wrong; the planted faults below (that composition, the exact keys' share
  dropped, the LSE shift's gradient dropped) fail the gradient check.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.frontend import parse_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.spec import Transforms
from fp4gen.lowering import reference as ref_lowering
from fp4gen.lowering import sm90 as sm90_lowering
from fp4gen.numerics import exact, outliers, reference
from fp4gen.runtime import transforms
from fp4gen.runtime.loader import exec_file
from fp4gen.torch_ops import AttentionInputError, attention, attention_varlen

ROOT = Path(__file__).resolve().parents[2]
FP32 = ("Q : fp32; K : fp32{smooth}; P : fp32; V : fp32{chan}; O : fp32; "
        "backward {{ dO : fp32; dS : fp32; dP : fp32; dQ : fp32; dK : fp32; dV : fp32 }}")
NVMX = "Q : nvfp4; K : nvfp4{smooth}; P : mxfp4; V : mxfp4{chan}; O : bf16"
WITH = {
    "alone": {},
    "smooth": dict(smooth=" smooth"),
    "all": dict(smooth=" smooth", chan=" channel_scale", rotate="rotate qk hadamard(seed=3)"),
    "chan_rotate": dict(chan=" channel_scale", rotate="rotate qk hadamard"),
}


def spec(n=2, with_="alone", recipe=FP32, head_dim=16, mask="none", extra=""):
    o = {"smooth": "", "chan": "", "rotate": "", **WITH[with_]}
    body = recipe.format(smooth=o["smooth"], chan=o["chan"])
    (s,) = parse_text(f"attention st {{ target reference; head_dim {head_dim}; mask {mask}; {body}; {o['rotate']}; "
                      f"sink_tokens {n}; {extra} }}")
    return s


def leaves(b=2, sq=7, sk=10, h=4, hkv=2, d=16, seed=0):
    """float64 GQA leaves; K with a common offset (smoothing's LSE shift is then large)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64) + 2.0
    v = torch.randn(b, sk, hkv, d, generator=g, dtype=torch.float64)
    v[..., :2] *= 8  # channels whose channel_scale is not 1
    return [x.requires_grad_() for x in (q, k, v)]


def grads(out, xs, seed=9):
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, xs, do)


MASKS = {"none": (-1, -1), "causal": (-1, 0), "window(3, 1)": (3, 1)}


def check_against_exact(s, xs, window, softcap=0.0, sinks=None, tol=1e-5):
    """O, LSE and the gradients (q, k, v and the learned sinks) of fp4gen.attention against
    float64 autograd of exact attention; returns the largest gradient error seen."""
    o, lse = attention(*xs[:3], spec=s, sinks=sinks, return_lse=True)
    oe, le = exact.attention(*xs[:3], scale=0.25, window=window, softcap=softcap, sinks=sinks)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(le))
    fin = torch.isfinite(le)
    assert float((o - oe).detach().abs().max()) < tol and float((lse - le).detach()[fin].abs().max()) < tol
    worst = 0.0
    for name, g, ge in zip(("dq", "dk", "dv", "dsinks"), grads(o, xs), grads(oe, xs)):
        err = float((g - ge).abs().max()) / max(1.0, float(ge.abs().max()))
        assert err < tol, f"{name} off by {err:.3g} against float64 autograd of exact attention"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("with_", list(WITH))
@pytest.mark.parametrize("mask", list(MASKS))
def test_values_and_gradients_are_exact_attention(with_, mask):
    """fp32 recipe: float32 transforms and reference against float64, agreement to float32's
    rounding (measured 2026-12-07: at most 3e-6 over these cases)."""
    check_against_exact(spec(2, with_, mask=mask), leaves(), MASKS[mask])


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("sq, sk", [(12, 6), (5, 9)])
def test_softcap_learned_sinks_and_ragged_shapes(mask, sq, sk):
    """softcap (the exact keys take its derivative), learned sinks (their gradient from the merged
    O and LSE), Sq > Sk (causal rows that see only the exact keys, or none at all)."""
    s = spec(3, "chan_rotate", mask=mask, extra="softcap 5; sinks learned")
    sinks = torch.tensor([1.0, -0.5, 0.3, 2.0], dtype=torch.float64, requires_grad=True)
    check_against_exact(s, leaves(sq=sq, sk=sk, seed=sq) + [sinks], MASKS[mask], softcap=5.0, sinks=sinks)


def test_forward_is_outliers_apply_by_hand():
    """The spec option is numerics.outliers.apply around the reference and Post.apply, bit for
    bit (NV/MX recipe with smoothing and channel scales, causal, GQA, bf16 inputs)."""
    s = spec(4, "all", recipe=NVMX, head_dim=64, mask="causal")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, sq, h, 64, generator=g).to(torch.bfloat16) for sq, h in ((96, 4), (128, 2), (128, 2)))
    o, lse = attention(q, k, v, spec=s, return_lse=True)
    t = s.transforms
    tq, tk, tv, post = outliers.apply(q, k, v, t.names, s.scale, hadamard_seed=t.hadamard_seed, sink_tokens=4,
                                      window=s.window_size)
    assert tk.shape[1] == 124
    plain = dataclasses.replace(s, transforms=Transforms())
    oh, lh = reference.forward(tq.to(q.dtype), tk.to(q.dtype), tv.to(q.dtype), plain)
    oh, lh = post.apply(oh.to(q.dtype), lh)
    assert torch.equal(o, oh.to(o.dtype)) and torch.equal(lse, lh)


# ------------------------------------------------------------------- planted faults -----

def _naive(q2, k2, v2, post, key, softmax_scale, backend, sinks):
    """What plain autograd would do: the op (its LSE carries no gradient), then the merge."""
    o2, lse2 = torch_ops._attention_op(q2, k2, v2, key, softmax_scale, backend, sinks)
    return post.apply(o2, lse2)


@pytest.mark.parametrize("fault", ["op_then_merge", "no_exact_share", "no_lse_shift_grad"])
def test_planted_faults_fail_the_gradient_check(monkeypatch, fault):
    s = spec(2, "smooth")
    xs = leaves()
    check_against_exact(s, xs, (-1, -1))  # passes as built
    if fault == "op_then_merge":
        monkeypatch.setattr(torch_ops, "_sink_tokens_attention", _naive)
    else:
        real = outliers.SinkTokens.grads

        def wrong(self, o, lse, do):
            dq, dk, dv, dlse = real(self, o, lse, do)
            if fault == "no_exact_share":
                return torch.zeros_like(dq), torch.zeros_like(dk), torch.zeros_like(dv), dlse
            return dq, dk, dv, torch.zeros_like(dlse)
        monkeypatch.setattr(outliers.SinkTokens, "grads", wrong)
    with pytest.raises(AssertionError, match="off by"):
        check_against_exact(s, xs, (-1, -1))


def test_planted_fault_option_ignored_changes_the_forward(monkeypatch):
    """If the spec's sink_tokens did not reach the transforms (the count dropped on the way), the
    FP4 result would be the plain recipe's: not the by-hand result above."""
    s = spec(1, recipe=NVMX, head_dim=64)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=g) for _ in range(3))
    o = attention(q, k, v, spec=s)
    real = transforms.before
    monkeypatch.setattr(transforms, "before", lambda spec, *a, **kw: real(
        dataclasses.replace(spec, transforms=Transforms()), *a, **kw))
    assert not torch.equal(o, attention(q, k, v, spec=s))


# --------------------------------------------------------------------------- refusals -----

def test_refusals_at_call_time():
    s = spec(4)
    x = torch.randn(1, 4, 2, 16)
    with pytest.raises(AttentionInputError, match=r"sink_tokens: n must be an int in 1..3"):
        attention(x, x, x, spec=s)  # no key left for the quantized attention
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="varlen\\) sequences is not built"):
        attention_varlen(x[0], x[0], x[0], cu, cu, 4, 4, spec=s)


def test_explain_lists_it():
    assert torch_ops.explain(spec(2, "smooth"), "cpu")["transforms"] == ["smooth_k", "sink_tokens"]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    """The node traces: the op inside it is the custom op when compiling, and the exact keys'
    backward is closed-form torch (no torch.autograd.grad, which Dynamo does not trace)."""
    torch._dynamo.reset()
    s = spec(2, "all")
    xs = leaves(b=1, sq=6, sk=8)

    def f(q, k, v):
        return attention(q, k, v, spec=s, causal=True)

    got = torch.compile(f, backend=backend, fullgraph=True)(*xs)
    want = f(*xs)
    assert torch.equal(got, want)
    for g, ge in zip(grads(got, xs), grads(want, xs)):
        torch.testing.assert_close(g, ge, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ generated modules' entry points -----

_LOADED = []


@pytest.fixture(autouse=True)
def _unload():
    yield
    while _LOADED:
        sys.modules.pop(_LOADED.pop(), None)


def load(source: str, tmp_path: Path, stem: str):
    """Import rendered module text as a module (runtime.loader.exec_file: registered in sys.modules)."""
    path = tmp_path / f"{stem}.py"
    path.write_text(source)
    name = f"st_module_{stem}_{len(_LOADED)}"
    mod = exec_file(name, path)
    _LOADED.append(name)
    return mod


def test_reference_module_forward_and_backward(tmp_path):
    """A reference module of a sink_tokens spec: its forward is fp4gen.attention's bit for bit, its
    backward (runtime/transforms.py: the module's backward on keys N.. with the merged O and LSE,
    the exact keys beside it) autograd's through fp4gen.attention and exact attention's."""
    s = spec(3, "all", head_dim=16, mask="causal")
    mod = load(ref_lowering.render(plan_kernel(s)), tmp_path, "ref")
    assert type(mod).__name__ == "TransformedModule"
    q, k, v = (x.detach().float() for x in leaves(b=1, sq=9, sk=12, seed=3))
    o, lse = mod.forward(q, k, v, return_lse=True)
    oa, la = attention(q, k, v, spec=mod, return_lse=True)
    assert torch.equal(o, oa) and torch.equal(lse, la)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    got = mod.backward(q, k, v, o, lse, do)
    xs = [x.clone().double().requires_grad_() for x in (q, k, v)]
    oe, _ = exact.attention(*xs, scale=0.25, window=(-1, 0))
    want = torch.autograd.grad(oe, xs, do.double())
    for name, g, ge in zip("qkv", got, want):
        err = float((g.double() - ge).abs().max()) / max(1.0, float(ge.abs().max()))
        assert err < 1e-5, f"d{name} off by {err:.3g}"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_sm90_module_runs_it_around_its_kernel(tmp_path, dtype, tol):
    """The sm90a FP8 train module of a spec with `sink_tokens 4` and smoothing, its CUDA kernels
    replaced by the reference of the spec without transforms: forward equals fp4gen.attention's
    reference result bit for bit, backward its gradients, both through the module's own entry
    points (runtime/transforms.py). Measured 2026-12-07: float32 inputs dQ 2.8e-8, dK and dV 0;
    bf16 dQ 2.0e-3 (one rounding: the module sums dQ's parts (the kernel's, the exact keys', the
    LSE shift's) in float32 and rounds once, autograd accumulates them in q's dtype), dK, dV 0."""
    text = (ROOT / "examples/sm90_fp8_train_d128.attn").read_text()
    text = text.replace("K : fp8e4m3(block=128)", "K : fp8e4m3(block=128) smooth")
    text = text.replace("  head_dim 128\n", "  head_dim 128\n  sink_tokens 4\n")
    s = parse_text(text)[0]
    assert s.transforms == Transforms(smooth_k=True, sink_tokens=4)
    mod = load(sm90_lowering.render(plan_kernel(s)), tmp_path, "sm90")
    plain = dataclasses.replace(s, transforms=Transforms())
    seen = []

    def fake_forward(q, k, v, *, softmax_scale=None, return_lse=False, prepared=None):
        seen.append(k.shape[1])
        o, lse = reference.forward(q, k, v, plain)
        return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)

    def fake_backward(q, k, v, o, lse, do, *, softmax_scale=None, prepared=None):
        return reference.backward(q, k, v, o, lse, do, plain)

    mod.forward, mod.backward = fake_forward, fake_backward
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 256, h, 128, generator=g).to(dtype) for h in (4, 2, 2))
    o, lse = mod.forward(q, k, v, return_lse=True)
    assert seen == [252]  # the kernel saw keys 4..
    oa, la = attention(q, k, v, spec=s, backend="reference", return_lse=True)
    assert torch.equal(o, oa) and torch.equal(lse, la)
    do = torch.randn(q.shape, generator=g).to(q.dtype)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
    attention(*xs, spec=s, backend="reference").backward(do)
    for name, g_, ga in zip("qkv", (dq, dk, dv), (x.grad for x in xs)):
        rel = float((g_.float() - ga.float()).norm() / ga.float().norm())
        assert rel < tol, f"d{name} rel-L2 {rel:.3g} against autograd through fp4gen.attention"
