"""Issue 24 on an H200: a fused QKV projection's q, k, v views give the FP8 recipes' results bit for
bit as compact copies do, without copy kernels (tests/torch_ops/test_strided_qkv.py checks the host
path on the CPU). Skipped without a Hopper GPU.

    .venv/bin/python -m pytest -q -m gpu tests/torch_ops/test_strided_gpu.py
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.torch_ops import attention

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TRAIN = str(EXAMPLES / "sm90_fp8_train_d128.attn")
DS8 = TRAIN + "::sm90_fp8_train_ds8_causal_d128"
FP8 = TRAIN + "::sm90_fp8_train_causal_d128"
DIRECTP = str(EXAMPLES / "sm90_fp8_directp_d128.attn") + "::sm90_fp8_directp_causal_d128"
BF16 = str(EXAMPLES / "sm90_bf16_d128.attn") + "::sm90_bf16_causal_d128"
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")


def _generated(spec, backward=True):
    info = torch_ops.explain(spec, "cuda", causal=True)
    if not info["forward"].startswith("generated") or (backward and not info["backward"].startswith("generated")):
        pytest.skip(f"no generated sm90a kernels for {spec}: {info.get('reason')}")


def _fused(b, s, h, hkv, d=128, seed=0):
    """(x, q, k, v): q, k, v views of one projection output x (B, S, (H + 2 Hkv) D)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, s, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = x.split([h * d, hkv * d, hkv * d], -1)
    return x, q.view(b, s, h, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)


def _step(spec, q, k, v, go):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, spec=spec, causal=True, backend="generated")
    return (o,) + torch.autograd.grad(o, (q, k, v), go)


def _bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("spec", [DS8, FP8], ids=["ds8", "fp8"])
@pytest.mark.parametrize("b, s, h, hkv", [(2, 1024, 6, 6), (1, 700, 8, 2)])
def test_fused_qkv_train_step_matches_compact_inputs(spec, b, s, h, hkv):
    """O, dK, dV bit for bit; dQ (fp32 atomics across key tiles: summation order varies run to run)
    as close as two runs on compact inputs are."""
    _generated(spec)
    _, q, k, v = _fused(b, s, h, hkv)
    go = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    strided = _step(spec, q, k, v, go)
    compact = _step(spec, q.contiguous(), k.contiguous(), v.contiguous(), go)
    again = _step(spec, q.contiguous(), k.contiguous(), v.contiguous(), go)
    for name, a, c in zip(("o", "dq", "dk", "dv"), strided, compact):
        if name == "dq":
            noise = (again[1].float() - c.float()).abs().max()
            assert (a.float() - c.float()).abs().max() <= 2 * noise + 1e-3 * c.float().abs().max(), name
        else:
            assert _bits(a, c), name


def test_fused_qkv_prefill_matches_compact_inputs():
    _generated(DIRECTP, backward=False)
    _, q, k, v = _fused(4, 1024, 6, 6)
    with torch.inference_mode():
        o = attention(q, k, v, spec=DIRECTP, causal=True, backend="generated")
        oc = attention(q.contiguous(), k.contiguous(), v.contiguous(), spec=DIRECTP, causal=True,
                       backend="generated")
    assert _bits(o, oc)


def _copy_kernels(fn) -> int:
    """CUDA kernels of one ``fn()`` whose name says copy (direct_copy_kernel_cuda, ...; not cat's)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "copy" in e.key.lower() and "cat" not in e.key.lower())


def test_fused_qkv_step_launches_no_more_copies_than_compact_inputs():
    """The ds8 training step on views of a fused QKV launches no copy kernel beyond those of the step
    on compact q, k, v (issue 24: it launched three in the forward and three in the backward)."""
    _generated(DS8)
    _, q, k, v = _fused(4, 2048, 6, 6)
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    go = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    fused = _copy_kernels(lambda: _step(DS8, q, k, v, go))
    compact = _copy_kernels(lambda: _step(DS8, qc, kc, vc, go))
    assert fused <= compact, (fused, compact)


def test_bf16_forward_kernel_on_row_strided_views():
    """Whether the BF16 sm90a forward kernel reads a fused QKV's views correctly when handed them
    directly (its TMA descriptors come from the tensors' strides, and its compiled arguments accept
    token strides that are multiples of D): fp4gen.attention still copies them for the BF16 kernels
    (torch_ops._forward_operands) until this has passed on an H200."""
    _generated(BF16, backward=False)
    mod = torch_ops._plan(torch_ops._entry(torch_ops.spec_key(BF16, causal=True)), torch.device("cuda"),
                          "generated", False, False, False).mod
    _, q, k, v = _fused(2, 1000, 6, 2)
    o = mod.forward(q, k, v)
    oc = mod.forward(q.contiguous(), k.contiguous(), v.contiguous())
    assert _bits(o, oc)
