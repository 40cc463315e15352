"""No host sync on fp4gen.attention's forward + backward on an H200 (skipped without Hopper): after a
warm-up call (the first compiles and may read the device), an identical training call runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing CUDA call (an
.item(), a .cpu(), a bool() of a GPU tensor, a blocking copy; torch's own synchronizing calls:
a raw cudaStreamSynchronize inside a launcher would not show). Cases: the FP8 ds8 training recipe
(dense and GQA), the BF16 varlen forward, the outlier transforms; invalid varlen offsets on the GPU
(NaN out, memory safe, the clear error with FP4GEN_CHECK_OFFSETS=1).

    .venv/bin/python -m pytest -q -m gpu tests/torch_ops/test_host_path_gpu.py
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.torch_ops import attention, attention_varlen

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DS8 = f"{EXAMPLES / 'sm90_fp8_train_d128.attn'}::sm90_fp8_train_ds8_causal_d128"
VARLEN = f"{EXAMPLES / 'sm90_bf16_varlen_d128.attn'}::sm90_bf16_varlen_d128"
ROBUST = str(EXAMPLES / "sm90_fp8_outlier_robust_d128.attn")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    yield
    torch.cuda.set_sync_debug_mode(0)


def _generated(spec):
    info = torch_ops.explain(spec, "cuda")
    if not info["forward"].startswith("generated"):
        pytest.skip(f"no generated sm90a forward for {spec}: {info.get('reason')}")


def _no_sync(step):
    step()  # warm: compile, first lookups
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _qkv(b=2, s=1024, h=4, hkv=4, d=128, grad=True):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(grad)
            for n in (h, hkv, hkv)]


@pytest.mark.parametrize("hkv", [4, 1])
def test_training_step_has_no_host_sync(hkv):
    _generated(DS8)
    q, k, v = _qkv(hkv=hkv)
    go = torch.randn_like(q)

    def step():
        o = attention(q, k, v, spec=DS8)
        torch.autograd.grad(o, (q, k, v), go)
    _no_sync(step)


# sm90_host.check_varlen checks GPU offsets on the device (numerics.masking.offsets_valid), the grid
# from max_seqlen_q: no read to the host (FP4GEN_CHECK_OFFSETS=1 turns the read back on).
def test_varlen_forward_has_no_host_sync():
    _generated(VARLEN)
    t = [torch.randn(2048, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    cu = torch.tensor([0, 768, 2048], dtype=torch.int32, device="cuda")
    _no_sync(lambda: attention_varlen(*t, cu, cu, 1280, 1280, spec=VARLEN))


@pytest.mark.parametrize("bad, max_q", [([0, 768, 4096], 1280), ([0, 1500, 768], 1280), ([1, 768, 2048], 1280),
                                        ([0, 1 << 30, 2048], 1280), ([0, 768, 2048], 1000)])
def test_varlen_invalid_gpu_offsets_come_back_nan(bad, max_q, monkeypatch):
    """Invalid offsets on the GPU are not read (no error without the debug mode): the kernel never
    sees them (memory safe: a valid call afterwards matches the reference) and o, lse are NaN;
    with FP4GEN_CHECK_OFFSETS=1 the clear error instead."""
    _generated(VARLEN)
    g = torch.Generator(device="cuda").manual_seed(1)
    t = [torch.randn(2048, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    good = torch.tensor([0, 768, 2048], dtype=torch.int32, device="cuda")
    cu = torch.tensor(bad, dtype=torch.int32, device="cuda")
    o, lse = attention_varlen(*t, cu, good, max_q, 1280, spec=VARLEN, return_lse=True)
    torch.cuda.synchronize()
    assert torch.isnan(o).all() and torch.isnan(lse).all()
    o = attention_varlen(*t, good, good, 1280, 1280, spec=VARLEN)
    want = attention_varlen(*t, good, good, 1280, 1280, spec=VARLEN, backend="reference")
    assert (o.float() - want.float()).abs().max().item() < 2e-2
    monkeypatch.setenv("FP4GEN_CHECK_OFFSETS", "1")
    with pytest.raises(torch_ops.AttentionInputError, match="cu_seqlens_q|max_seqlen_q"):
        attention_varlen(*t, cu, good, max_q, 1280, spec=VARLEN)


def test_transforms_forward_has_no_host_sync():
    _generated(ROBUST)
    q, k, v = _qkv(grad=False)
    _no_sync(lambda: attention(q, k, v, spec=ROBUST))


def test_the_sync_check_can_fail():
    """Planted: a .item() in the step must raise under the same mode (else the tests above prove nothing)."""
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):
        _no_sync(lambda: x.sum().item())
