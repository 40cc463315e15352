"""Element formats: every code round-trips, encoding is RNE with saturation,
and torch's own float8 / float4 dtypes agree."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from fp4gen.numerics import formats as F
from numerics_indep import (code_value, e8m0_code, e8m0_value, nearest_code, positive_finite)

FMTS = {"e2m1": F.E2M1, "e4m3": F.E4M3, "e5m2": F.E5M2}


def enc1(x: float, fmt, saturate=True) -> int:
    return int(F.encode(torch.tensor([x], dtype=torch.float32), fmt, saturate)[0])


@pytest.mark.parametrize("name", list(FMTS))
def test_decode_matches_definition_for_every_code(name):
    fmt = FMTS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    got = F.decode(codes, fmt)
    for c in range(1 << fmt.bits):
        want = code_value(name, c)
        g = float(got[c])
        if want == "nan":
            assert math.isnan(g), (name, c)
        elif want in ("inf", "-inf"):
            assert g == float(want), (name, c)
        else:
            assert g == float(want), (name, c, g, want)
            assert math.copysign(1, g) == (-1 if c >> (fmt.bits - 1) else 1)  # -0 keeps its sign


@pytest.mark.parametrize("name", list(FMTS))
def test_encode_decode_roundtrip_every_code(name):
    fmt = FMTS[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    vals = F.decode(codes, fmt)
    back = F.encode(vals, fmt, saturate=False)
    for c in range(1 << fmt.bits):
        v = float(vals[c])
        if math.isnan(v):
            assert int(back[c]) == fmt.nan_code  # NaN has one canonical code
        else:
            assert int(back[c]) == c, (name, c, v, int(back[c]))


def test_e8m0_roundtrip_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    vals = F.decode_e8m0(codes)
    for c in range(255):
        assert float(vals[c]) == float(e8m0_value(c))
    assert math.isnan(float(vals[255]))
    for mode in ("up", "down", "nearest"):
        assert torch.equal(F.encode_e8m0(vals, mode), codes)


@settings(max_examples=400, deadline=None, database=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False), st.sampled_from(list(FMTS)))
def test_encode_is_nearest_even_saturating(x, name):
    assert enc1(x, FMTS[name]) == nearest_code(x, name)


@st.composite
def ties(draw):
    """Exact midpoints between neighbouring representable values (the ties), +- sign."""
    name = draw(st.sampled_from(list(FMTS)))
    vals = positive_finite(name)
    i = draw(st.integers(0, len(vals) - 2))
    mid = float((vals[i][1] + vals[i + 1][1]) / 2)
    sign = draw(st.sampled_from([1.0, -1.0]))
    return name, sign * mid


@settings(max_examples=200, deadline=None, database=None)
@given(ties())
def test_ties_go_to_even(case):
    name, x = case
    c = enc1(x, FMTS[name])
    assert c == nearest_code(x, name)
    assert c % 2 == 0  # even mantissa


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_saturation_and_specials(name):
    fmt = FMTS[name]
    mx = fmt.max_value
    big = torch.tensor([mx * 1.2, -mx * 4, float("inf"), float("-inf"), float("nan"), -0.0])
    sat = F.decode(F.encode(big, fmt), fmt)
    assert sat[:4].tolist() == [mx, -mx, mx, -mx]
    assert math.isnan(sat[4]) and sat[5] == 0 and math.copysign(1, sat[5]) < 0
    # just above max but rounding down to it is finite in both modes
    assert F.decode(F.encode(torch.tensor([mx * 1.01]), fmt, saturate=False), fmt).item() == mx
    raw = F.decode(F.encode(big, fmt, saturate=False), fmt)
    if name == "e5m2":
        assert raw[:4].tolist() == [float("inf"), float("-inf"), float("inf"), float("-inf")]
    else:  # E4M3 has no Inf: overflow is NaN
        assert all(math.isnan(v) for v in raw[:4].tolist())


def test_e2m1_specials():
    x = torch.tensor([7.0, -100.0, float("inf"), float("nan"), -0.0, 0.25, 0.2500001])
    c = F.encode(x, F.E2M1).tolist()
    assert c == [0x7, 0xF, 0x7, 0x7, 0x8, 0x0, 0x1]


def _all_16bit_floats():
    i = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    xs = torch.cat([i.view(torch.bfloat16).float(), i.view(torch.float16).float()])
    return xs[~torch.isnan(xs)]


@pytest.mark.parametrize("name,dt", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_matches_torch_float8(name, dt):
    fmt = FMTS[name]
    codes = torch.arange(256, dtype=torch.uint8)
    a, b = F.decode(codes, fmt), codes.view(dt).float()
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])
    # every bf16 and fp16 value (clamped: torch's cast does not saturate)
    xs = _all_16bit_floats().clamp(-fmt.max_value, fmt.max_value)
    assert torch.equal(F.encode(xs, fmt), xs.to(dt).view(torch.uint8))
    g = torch.Generator().manual_seed(0)
    xs = (torch.randn(200000, generator=g) * torch.exp(4 * torch.randn(200000, generator=g)))
    xs = xs.clamp(-fmt.max_value, fmt.max_value)
    assert torch.equal(F.encode(xs, fmt), xs.to(dt).view(torch.uint8))
    assert torch.equal(F.as_torch_fp8(F.encode(xs, fmt), fmt).float(), F.round_to(xs, fmt))


def test_matches_torch_e8m0_decode_and_nearest_off_ties():
    codes = torch.arange(256, dtype=torch.uint8)
    t = codes.view(torch.float8_e8m0fnu).float()
    ours = F.decode_e8m0(codes)
    assert torch.equal(ours[:255], t[:255]) and math.isnan(ours[255]) and math.isnan(t[255])
    g = torch.Generator().manual_seed(1)
    x = torch.exp2(torch.rand(10000, generator=g) * 200 - 100)
    m, _ = torch.frexp(x)
    off_tie = m != 0.75  # torch's cast rounds exact ties (1.5 * 2**k) up; ours to the even code
    assert torch.equal(F.encode_e8m0(x, "nearest")[off_tie], x.to(torch.float8_e8m0fnu).view(torch.uint8)[off_tie])


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(min_value=0, max_value=2.0**127, width=32, allow_infinity=False), st.sampled_from(["up", "down", "nearest"]))
def test_e8m0_encode(x, mode):
    assert int(F.encode_e8m0(torch.tensor([x]), mode)[0]) == e8m0_code(x, mode)


def test_e8m0_specials():
    x = torch.tensor([float("nan"), -1.0, -0.0, float("inf"), 0.0, 1e-45])
    assert F.encode_e8m0(x).tolist() == [255, 255, 255, 254, 0, 0]


def test_pack_fp4_order_and_torch_dtype():
    codes = torch.tensor([[1, 2, 0xF, 0x7]], dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x7F]]  # element 0 in the low nibble
    assert torch.equal(F.unpack_fp4(packed), codes)
    # torch's packed FP4 dtype holds the same bytes (torch 2.13 has no float4 casts to compare values)
    t = packed.view(torch.float4_e2m1fn_x2)
    assert torch.equal(t.view(torch.uint8), packed)
    g = torch.Generator().manual_seed(2)
    c = torch.randint(0, 16, (3, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(F.unpack_fp4(F.pack_fp4(c)), c)
    with pytest.raises(ValueError):
        F.pack_fp4(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.gpu
def test_cpu_and_cuda_identical():
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(100000, generator=g) * torch.exp(4 * torch.randn(100000, generator=g))
    for fmt in FMTS.values():
        assert torch.equal(F.encode(xs, fmt), F.encode(xs.cuda(), fmt).cpu())
    assert torch.equal(F.encode_e8m0(xs.abs()), F.encode_e8m0(xs.abs().cuda()).cpu())
