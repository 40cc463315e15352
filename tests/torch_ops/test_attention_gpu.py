"""fp4gen.torch_ops on a CUDA GPU (skipped without one)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.torch_ops import attention

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.gpu


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), 0).item()


def _qkv(d=128, s=256, h=4, hkv=2):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(2, s, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for n in (h, hkv, hkv)]


def test_reference_backend_on_gpu_matches_cpu():
    spec = f"{EXAMPLES / 'fa4_nvfp8_d128.attn'}"
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    o = attention(q, k, v, spec=spec, backend="reference")
    o.float().square().sum().backward()
    qc, kc, vc = (t.detach().cpu().requires_grad_(True) for t in (q, k, v))
    oc = attention(qc, kc, vc, spec=spec)
    oc.float().square().sum().backward()
    assert _cos(o.cpu(), oc) > 0.999
    for a, b in ((q, qc), (k, kc), (v, vc)):
        assert _cos(a.grad.cpu(), b.grad) > 0.99


def test_generated_sm90_forward_agrees_with_reference():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    spec = f"{EXAMPLES / 'sm90_fp8_exp_d128.attn'}::sm90_fp8_exp_causal_d128"
    info = torch_ops.explain(spec, "cuda")
    if not info["forward"].startswith("generated"):
        pytest.skip(f"no generated sm90a forward: {info.get('reason')}")
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    torch_ops.reset_dispatch_counts()
    o = attention(q, k, v, spec=spec)
    assert torch_ops.dispatch_counts()["fwd/generated"] == 1
    ref = attention(q.detach(), k.detach(), v.detach(), spec=spec, backend="reference")
    assert _cos(o, ref) > 0.995
    # the spec has no backward block: no silent reference backward on the GPU (issue 19)
    with pytest.raises(torch_ops.NoKernelError, match="add a `backward"):
        o.float().square().sum().backward()
