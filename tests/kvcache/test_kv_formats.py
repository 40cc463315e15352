"""The cache formats: what a written token becomes, against the definitions written out here
(formats.encode/decode on the formula, not the module's code path), the nibble order, appends
token by token equal to one write, and the tensor scales."""
from __future__ import annotations

import pytest
import torch

from fp4gen.ir.spec import CacheFormat, Format, ScaleGranularity
from fp4gen.numerics import kvcache as kv
from fp4gen.numerics.formats import E2M1, E4M3, decode, encode
from fp4gen.numerics.quant import quantize_fp8_tensor, quantize_nvfp4

BF16 = CacheFormat()
FP8_TOKEN = CacheFormat(Format.FP8E4M3, ScaleGranularity.TOKEN)
FP8_TENSOR = CacheFormat(Format.FP8E4M3, ScaleGranularity.TENSOR)
NVFP4 = CacheFormat(Format.NVFP4, ScaleGranularity.BLOCK)
NVFP4_2L = CacheFormat(Format.NVFP4, ScaleGranularity.BLOCK, tensor_scale=True)
ALL = (BF16, FP8_TOKEN, FP8_TENSOR, NVFP4, NVFP4_2L)


def _tokens(T=40, Hkv=2, D=64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, Hkv, D, generator=g) * scale).to(torch.bfloat16)


def _cache(fmt, x, slots=3, page=64):
    ts = kv.tensor_scales(fmt, x)
    return kv.CacheTensor.allocate(fmt, slots, page, x.shape[1], x.shape[2], tensor_scale=ts)


def test_fp8_token_is_amax_over_d_times_recip_448():
    x = _tokens()
    c = _cache(FP8_TOKEN, x)
    rows, cols = torch.zeros(40, dtype=torch.long), torch.arange(40)
    c.write(rows, cols, x)
    xf = x.float()
    s = xf.abs().amax(-1) * torch.tensor(1 / 448, dtype=torch.float32)  # fl32(1/448), as the Hopper contract
    assert torch.equal(c.scale[0, :40], s)
    assert torch.equal(c.data[0, :40], encode(xf / s[..., None], E4M3))
    assert torch.equal(c.read(rows, cols), decode(encode(xf / s[..., None], E4M3), E4M3) * s[..., None])


def test_fp8_tensor_scale_is_fixed_and_appends_saturate():
    x = _tokens()
    c = _cache(FP8_TENSOR, x)
    s = x.float().abs().amax(dim=(0, 2)) * torch.tensor(1 / 448, dtype=torch.float32)
    assert torch.equal(c.tensor_scale, s)
    # the allocation data itself: quantize_fp8_tensor over all of it, per head
    rows, cols = torch.zeros(40, dtype=torch.long), torch.arange(40)
    c.write(rows, cols, x)
    assert torch.equal(c.data[0, :40], quantize_fp8_tensor(x[None].float()).codes[0])
    # a later token 4x larger than anything at allocation saturates at +-448 * scale
    big = x[:1] * 4
    c.write(torch.tensor([1]), torch.tensor([0]), big)
    got = c.read(torch.tensor([1]), torch.tensor([0]))
    assert got.abs().amax(-1).tolist()[0] == pytest.approx((448 * s).tolist())
    assert (got.abs() <= 448 * s[None, :, None]).all()


def _nvfp4_definition(x: torch.Tensor, g: float):
    """Two-level NVFP4 from its definition: s_B = e4m3((amax_B / 6) / g) * g, q = e2m1(x / s_B)."""
    T, H, D = x.shape
    xb = x.float().reshape(T, H, D // 16, 16)
    amax = xb.abs().amax(-1)
    sc = encode((amax / 6.0) / g, E4M3)
    s = decode(sc, E4M3) * g
    q = torch.where(s[..., None] == 0, torch.zeros_like(xb), xb / torch.where(s == 0, torch.ones_like(s), s)[..., None])
    codes = encode(q, E2M1)
    return codes.reshape(T, H, D), sc, (decode(codes, E2M1) * s[..., None]).reshape(T, H, D)


@pytest.mark.parametrize("fmt", [NVFP4, NVFP4_2L], ids=["one_level", "two_level"])
def test_nvfp4_against_its_definition(fmt):
    x = _tokens(scale=1e-3 if fmt.tensor_scale else 1.0)  # small values: the tensor scale matters
    c = _cache(fmt, x)
    rows, cols = torch.zeros(40, dtype=torch.long), torch.arange(40)
    c.write(rows, cols, x)
    if fmt.tensor_scale:
        g = c.tensor_scale
        amax = x.float().abs().amax(dim=(0, 2))
        assert torch.all(g == torch.exp2(torch.round(torch.log2(g))))  # a power of two
        assert torch.all(g * 2688 >= amax) and torch.all(g * 1344 < amax)  # the smallest one covering amax
    for h in range(2):
        gh = float(c.tensor_scale[h]) if fmt.tensor_scale else 1.0
        codes, sc, vals = _nvfp4_definition(x[:, h:h + 1], gh)
        assert torch.equal(c.scale[0, :40, h:h + 1], sc)
        lo, hi = c.data[0, :40, h] & 0xF, c.data[0, :40, h] >> 4  # element 2i in the low nibble
        assert torch.equal(lo, codes[:, 0, 0::2]) and torch.equal(hi, codes[:, 0, 1::2])
        assert torch.equal(c.read(rows, cols)[:, h:h + 1], vals)
    if not fmt.tensor_scale:  # one-level: quantize_nvfp4 along D, the operand quantizer, bit for bit
        assert torch.equal(c.read(rows, cols), quantize_nvfp4(x.float(), dim=-1).dequantize())


@pytest.mark.parametrize("fmt", ALL, ids=str)
def test_token_by_token_appends_equal_one_write(fmt):
    """Scales are fixed when a token is written: appending one token at a time (as decode does)
    stores what one write of all of them stores."""
    x = _tokens(T=20)
    a, b = _cache(fmt, x), _cache(fmt, x)
    a.write(torch.zeros(20, dtype=torch.long), torch.arange(20), x)
    for t in range(20):
        b.write(torch.tensor([0]), torch.tensor([t]), x[t:t + 1])
    assert torch.equal(a.data, b.data)
    if a.scale is not None:
        assert torch.equal(a.scale, b.scale)


def test_bytes_per_token():
    assert BF16.bytes_per_token(128) == 256
    assert FP8_TENSOR.bytes_per_token(128) == 128 and FP8_TOKEN.bytes_per_token(128) == 132
    assert NVFP4.bytes_per_token(128) == 72  # 64 B of codes + 8 E4M3 scales: 3.56x less than bf16
    for fmt in ALL:
        c = kv.CacheTensor.allocate(fmt, 2, 16, 4, 128, tensor_scale=torch.ones(4) if fmt.has_tensor_scale else None)
        extra = 4 * 4 if fmt.has_tensor_scale else 0
        assert c.bytes() == 2 * 16 * 4 * fmt.bytes_per_token(128) + extra


def test_allocate_needs_the_tensor_scale():
    with pytest.raises(kv.KVCacheError, match="per-KV-head scale"):
        kv.CacheTensor.allocate(FP8_TENSOR, 2, 16, 4, 64)
    with pytest.raises(kv.KVCacheError, match="no tensor scale"):
        kv.CacheTensor.allocate(FP8_TOKEN, 2, 16, 4, 64, tensor_scale=torch.ones(4))
    with pytest.raises(kv.KVCacheError, match="multiple of 16"):
        kv.CacheTensor.allocate(NVFP4, 2, 16, 4, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL, ids=str)
def test_cuda_writes_the_same_bits(fmt):
    x = _tokens(T=64, Hkv=4, D=128)
    a = _cache(fmt, x)
    b = kv.CacheTensor.allocate(fmt, 3, 64, 4, 128, device="cuda",
                                tensor_scale=None if a.tensor_scale is None else a.tensor_scale.cuda())
    rows, cols = torch.arange(64) // 32, torch.arange(64) % 32
    a.write(rows, cols, x)
    b.write(rows.cuda(), cols.cuda(), x.cuda())
    assert torch.equal(a.data, b.data.cpu())
    if a.scale is not None:
        assert torch.equal(a.scale, b.scale.cpu())
    assert torch.equal(a.read(rows, cols), b.read(rows.cuda(), cols.cuda()).cpu())
