"""Shared fixtures for the torch integration tests.

The real reference backend (``fp4gen.numerics.reference``) is used when it
exists. Until then (it is written in parallel) the ops are exercised against a
float64 stand-in defined here, which computes plain softmax attention and its
analytic gradients: the tests then check the op plumbing (registration,
autograd, compile, dispatch), not the numerics.
"""
from __future__ import annotations

import importlib
import types

import pytest
import torch

from fp4gen import torch_ops
from types import MappingProxyType

from fp4gen.ir.spec import BACKWARD_OPERANDS, Backward, Format, KernelSpec, Mask, OperandFormat, Target


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def _probs(q, k, spec):
    """float64 P (B, H, Sq, Sk) and lse (B, H, Sq)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), _expand_kv(k, q.shape[2]).double()) * spec.scale
    if spec.mask is Mask.CAUSAL:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]), lse


def _standin_forward(q, k, v, spec):
    p, lse = _probs(q, k, spec)
    o = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2]).double())
    return o.to(q.dtype), lse.float()


def _standin_backward(q, k, v, o, lse, do, spec):
    h, hkv = q.shape[2], k.shape[2]
    p, _ = _probs(q, k, spec)
    do64, o64 = do.double(), o.double()
    ke, ve = _expand_kv(k, h).double(), _expand_kv(v, h).double()
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do64)
    dp = torch.einsum("bqhd,bkhd->bhqk", do64, ve)
    delta = (do64 * o64).sum(-1).transpose(1, 2)  # (B, H, Sq)
    ds = p * (dp - delta[..., None]) * spec.scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.double())
    # GQA: the heads sharing one k/v head add their gradients
    b, sk, _, d = dk.shape
    dk = dk.reshape(b, sk, hkv, h // hkv, d).sum(3)
    dv = dv.reshape(b, sk, hkv, h // hkv, d).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


STANDIN = types.SimpleNamespace(forward=_standin_forward, backward=_standin_backward,
                                __name__="float64-standin")


def _real_reference():
    try:
        mod = importlib.import_module("fp4gen.numerics.reference")
    except ImportError:
        return None
    if callable(getattr(mod, "forward", None)) and callable(getattr(mod, "backward", None)):
        return mod
    return None


@pytest.fixture
def reference_backend(monkeypatch):
    """The backend the ops use: the real reference if present, else the stand-in."""
    real = _real_reference()
    if real is None:
        monkeypatch.setattr(torch_ops, "_reference", lambda: STANDIN)
        return STANDIN
    return real


@pytest.fixture
def standin_backend(monkeypatch):
    """Force the float64 stand-in (for tests of dispatch, not numerics)."""
    monkeypatch.setattr(torch_ops, "_reference", lambda: STANDIN)
    return STANDIN


def fp32_spec(head_dim: int = 16, causal: bool = False, name: str = "fp32_test", **kw) -> KernelSpec:
    """Every operand and gradient fp32: the reference should then be plain softmax
    attention (a spec without a backward block gets bf16 gradients)."""
    f = OperandFormat(Format.FP32)
    bw = Backward(formats=MappingProxyType({n: f for n in BACKWARD_OPERANDS}))
    kw.setdefault("backward", bw)
    return KernelSpec(name=name, target=Target.REFERENCE, head_dim=head_dim,
                      mask=Mask.CAUSAL if causal else Mask.NONE, q=f, k=f, p=f, v=f, o=f, **kw)


def plain_attention64(q, k, v, scale, causal):
    """float64 softmax attention with autograd (the oracle)."""
    h = q.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, _expand_kv(k, h)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), _expand_kv(v, h))


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """These tensors are tiny: one intra-op thread is faster, and much faster on a busy
    2-core CI machine, than torch's default thread pool (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
