"""Block quantizers vs the plain loop implementations in numerics_indep.py."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fp4gen.numerics import quant as Q
from fp4gen.numerics.formats import E2M1, E4M3, decode
from numerics_indep import fp8_group, mxfp4_block, nvfp4_block

finite = st.floats(min_value=-3000, max_value=3000, width=32, allow_nan=False, allow_infinity=False,
                   allow_subnormal=False)
mags = st.sampled_from([1e-6, 1e-3, 0.1, 1.0, 30.0, 2000.0])


@st.composite
def rows(draw, n_blocks_max, block):
    n = draw(st.integers(1, n_blocks_max * block))
    scale = draw(mags)
    xs = draw(st.lists(finite, min_size=n, max_size=n))
    return [float(torch.tensor(x * scale, dtype=torch.float32)) for x in xs]


@settings(max_examples=60, deadline=None, database=None)
@given(rows(3, 16))
def test_nvfp4_matches_loops(xs):
    t = torch.tensor(xs, dtype=torch.float32)[None]
    q = Q.quantize_nvfp4(t, dim=-1, block=16)
    for b in range(0, len(xs), 16):
        blk = xs[b:b + 16]
        codes, sc, s = nvfp4_block(blk)
        assert q.codes[0, b:b + 16].tolist() == codes
        assert int(q.scale_codes[0, b // 16]) == sc and float(q.scale[0, b // 16]) == s
    deq = q.dequantize()[0].tolist()
    want = [decode(torch.tensor([c], dtype=torch.uint8), E2M1).item() * float(q.scale[0, i // 16])
            for i, c in enumerate(q.codes[0].tolist())]
    assert deq == want


@settings(max_examples=60, deadline=None, database=None)
@given(rows(3, 32))
def test_mxfp4_matches_loops(xs):
    t = torch.tensor(xs, dtype=torch.float32)[None]
    q = Q.quantize_mxfp4(t, dim=-1, block=32)
    for b in range(0, len(xs), 32):
        codes, sc, s = mxfp4_block(xs[b:b + 32])
        assert q.codes[0, b:b + 32].tolist() == codes
        assert int(q.scale_codes[0, b // 32]) == sc and float(q.scale[0, b // 32]) == s


def test_fp4_blocks_along_other_dims_and_nan():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 3, 8, generator=g)
    q = Q.quantize_mxfp4(x, dim=1, block=32)
    # blocking along dim 1 equals blocking the moved-last tensor
    q2 = Q.quantize_mxfp4(x.movedim(1, -1), dim=-1, block=32)
    assert torch.equal(q.codes, q2.codes.movedim(-1, 1))
    assert torch.equal(q.dequantize(), q2.dequantize().movedim(-1, 1))
    x[0, 3, 0, 0] = float("nan")
    for fn in (Q.quantize_nvfp4, Q.quantize_mxfp4):
        d = fn(x, dim=1).dequantize()
        blk = 16 if fn is Q.quantize_nvfp4 else 32
        assert torch.isnan(d[0, :blk, 0, 0]).all()  # the NaN's block is NaN (through its scale)
        assert not torch.isnan(d[0, blk:, 0, 0]).any() and not torch.isnan(d[1]).any()


def test_nvfp4_tensor_scale_and_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=g) * 1e4  # amax/6 > 448: needs the tensor scale
    q = Q.quantize_nvfp4(x, tensor_scale=True)
    g_ = float(q.tensor_scale)
    assert g_ == pytest.approx(float(x.abs().max()) / (448 * 6), rel=1e-6)
    rel = ((q.dequantize() - x).norm() / x.norm()).item()
    assert rel < 0.15  # typical NVFP4 error ~0.1; saturation without tensor scale is far worse
    rel_nosc = ((Q.quantize_nvfp4(x).dequantize() - x).norm() / x.norm()).item()
    assert rel_nosc > 0.5


@settings(max_examples=25, deadline=None, database=None)
@given(st.integers(1, 3), st.integers(1, 300), st.integers(1, 3), st.integers(1, 3), mags,
       st.integers(0, 2**31 - 1), st.sampled_from([64, 128]))
def test_fp8_blockwise_matches_loops(B, S, H, D, mag, seed, block):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, D, generator=g) * mag
    if seed % 3 == 0:
        x[:, : min(S, block)] = 0  # an all-zero block gets scale 1
    q = Q.quantize_fp8_blockwise(x, block=block)
    assert q.scale.shape == (B, -(-S // block), H)
    for b in range(B):
        for i in range(0, S, block):
            for h in range(H):
                xs = x[b, i:i + block, h].flatten().tolist()
                codes, s = fp8_group(xs)
                assert float(q.scale[b, i // block, h]) == s
                assert q.codes[b, i:i + block, h].flatten().tolist() == codes


def test_fp8_tensor_and_token_scales():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 50, 3, 16, generator=g)
    qt = Q.quantize_fp8_tensor(x)
    qk = Q.quantize_fp8_token(x)
    for b in range(2):
        for h in range(3):
            codes, s = fp8_group(x[b, :, h].flatten().tolist())
            assert float(qt.scale[b, h]) == s and qt.codes[b, :, h].flatten().tolist() == codes
            for t in (0, 17, 49):
                codes, s = fp8_group(x[b, t, h].tolist())
                assert float(qk.scale[b, t, h]) == s and qk.codes[b, t, h].tolist() == codes
    for qq in (qt, qk, Q.quantize_fp8_blockwise(x)):
        assert torch.equal(qq.dequantize(), decode(qq.codes, E4M3) * qq.expand_scale())
        assert torch.equal(qq.payload.float(), decode(qq.codes, E4M3))
        assert ((qq.dequantize() - x).abs() <= x.abs().amax() / 16).all()


def test_fp8_e5m2_and_bad_input():
    x = torch.randn(1, 10, 1, 8)
    q = Q.quantize_fp8(x, "token", fmt="fp8e5m2")
    assert float(q.scale.max()) == pytest.approx(float(x.abs().amax(-1).max()) / 57344)
    with pytest.raises(ValueError, match=r"\(B, S, H, D\)"):
        Q.quantize_fp8_blockwise(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="granularity"):
        Q.quantize_fp8(x, "row")


def test_tcgen05_sf_layout():
    # hand-evaluated from the CUTLASS atom ((32,4),(sf,4)):((16,4),(0,1)), K-rest fastest
    assert int(Q.tcgen05_sf_offset(torch.tensor(0), torch.tensor(0), 8)) == 0
    assert int(Q.tcgen05_sf_offset(torch.tensor(1), torch.tensor(0), 8)) == 16
    assert int(Q.tcgen05_sf_offset(torch.tensor(32), torch.tensor(0), 8)) == 4
    assert int(Q.tcgen05_sf_offset(torch.tensor(33), torch.tensor(5), 8)) == 512 + 16 + 4 + 1
    assert int(Q.tcgen05_sf_offset(torch.tensor(128), torch.tensor(0), 8)) == 1024
    g = torch.Generator().manual_seed(3)
    sc = torch.randint(1, 255, (2, 200, 6), generator=g, dtype=torch.uint8)
    buf = Q.to_tcgen05_sf_layout(sc)
    assert buf.shape == (2, 256 * 8)
    assert torch.equal(Q.from_tcgen05_sf_layout(buf, 200, 6), sc)
    assert int((buf != 0).sum()) == 2 * 200 * 6  # every scale lands on its own byte


@pytest.mark.gpu
def test_quantizers_identical_on_cpu_and_cuda():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 300, 3, 64, generator=g) * 3
    for fn in (Q.quantize_fp8_blockwise, Q.quantize_fp8_tensor, Q.quantize_fp8_token):
        a, b = fn(x), fn(x.cuda())
        assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scale, b.scale.cpu())
    for fn in (Q.quantize_nvfp4, Q.quantize_mxfp4):
        a, b = fn(x, dim=3), fn(x.cuda(), dim=3)
        assert torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.scale_codes, b.scale_codes.cpu())
