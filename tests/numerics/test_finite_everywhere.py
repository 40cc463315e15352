"""No NaN or Inf from finite input, for every quantizer of numerics/quant.py and the outlier
transforms of numerics/outliers.py (issue 21's property test).

tests/numerics/test_quant_finite.py holds the property for the dense quantizers on per-row
magnitude regimes. This file adds what it leaves out: every public ``quantize_*`` of quant.py is
covered (a new one fails ``test_every_quantizer_is_covered`` until it is listed here), the
bfloat16 extremes (+-max bf16, the smallest bf16 subnormal), whole scale groups that are
all-equal or all-zero, the varlen FP8 quantizer, and the transforms (smooth_k, channel_scale_v,
hadamard, and the Post that maps O and LSE back) over the range where their exact result is a
float32 (smooth_k: max |k| <= F32_MAX / 2; hadamard: max |x| <= F32_MAX / sqrt(D); channel
scaling: everywhere). The planted fault (smooth_k's mean summed in float32, as before this
file) shows the transform check fails.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fp4gen.numerics import outliers
from fp4gen.numerics import quant as Q
from test_quant_finite import QUANTIZERS, violations  # the dense quantizers and their check

F32_MAX = torch.finfo(torch.float32).max
BF16_MAX = float(torch.finfo(torch.bfloat16).max)  # 3.3895e38
BF16_TINY = 2.0 ** -133  # the smallest bf16 subnormal
S, H, D = 32, 2, 32
# per-group magnitudes: bf16's extremes, fp32 subnormals, the FP8 scale underflow region, ordinary
MAGS = [0.0, BF16_TINY, 1.4e-45, 3e-43, 1e-38, 1e-3, 1.0, 448.0, 1e30, BF16_MAX, F32_MAX]


@st.composite
def grouped(draw, group: int = 8):
    """(1, S, H, D) float32: token blocks of ``group`` rows, each all-zero, all-equal (one value,
    +- sign per element or not) or seeded noise, at a magnitude hypothesis picks per block."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    blocks = []
    for _ in range(S // group):
        mag = draw(st.sampled_from(MAGS))
        kind = draw(st.sampled_from(["zero", "equal", "equal_signs", "noise"]))
        shape = (1, group, H, D)
        if kind == "zero":
            b = torch.zeros(shape)
        elif kind == "equal":
            b = torch.full(shape, mag * draw(st.sampled_from([1.0, -1.0])))
        elif kind == "equal_signs":
            b = torch.where(torch.rand(shape, generator=g) < 0.5, -mag, mag).to(torch.float32)
        else:
            b = (torch.rand(shape, generator=g) * 2 - 1) * mag
        blocks.append(b)
    return torch.cat(blocks, 1)


SETTINGS = settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name,quantize,groups", QUANTIZERS, ids=[q[0] for q in QUANTIZERS])
@SETTINGS
@given(x=grouped())
def test_quantizers_on_bf16_extremes_and_flat_groups(name, quantize, groups, x):
    assert torch.isfinite(x).all()
    assert violations(quantize, groups, x) == []


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("gran", ["block", "tensor"])
@SETTINGS
@given(x=grouped(), cut=st.lists(st.integers(0, S), min_size=1, max_size=4))
def test_varlen_fp8_quantizer(fmt, gran, x, cut):
    """Packed sequences (with empty ones), per-sequence groups: finite, within the group's amax."""
    if not hasattr(Q, "quantize_fp8_varlen"):
        pytest.skip("no varlen FP8 quantizer in this tree")
    packed = x[0]  # (total, H, D)
    cu = torch.tensor([0] + sorted(cut) + [S], dtype=torch.int32)
    t = Q.quantize_fp8_varlen(packed, cu, gran, block=8, fmt=fmt)
    d = t.dequantize(cu)
    assert torch.isfinite(d).all()
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # the error bound, per sequence and head
        if b > a:
            amax = packed[a:b].double().abs().amax(dim=(0, 2))
            assert ((d[a:b].double() - packed[a:b].double()).abs().amax(dim=(0, 2)) <= amax * (1 + 1e-6)).all()


# every public quantizer, and where it is checked (a new one must be added to a property test)
COVERED = {"quantize_nvfp4", "quantize_mxfp4", "quantize_fp8", "quantize_fp8_tensor", "quantize_fp8_token",
           "quantize_fp8_blockwise", "quantize_fp8_varlen"}


def test_every_quantizer_is_covered():
    names = {n for n, f in inspect.getmembers(Q, inspect.isfunction)
             if n.startswith("quantize") and f.__module__ == Q.__name__}
    assert names - COVERED == set(), "quantizers without a finite-output property test"
    dense = {"quantize_nvfp4", "quantize_mxfp4", "quantize_fp8"}  # the last dispatches to the three FP8 ones
    assert dense <= {n for n in names}  # the dense ones the imported QUANTIZERS exercise exist


# ------------------------------------------------------------ the transforms -----

def _scaled(x: torch.Tensor, bound: float) -> torch.Tensor:
    """x with its magnitudes capped at ``bound`` (the transform's exact-result domain), keeping
    zeros, subnormals and all-equal groups as drawn."""
    return torch.where(x.abs() > bound, torch.sign(x) * bound, x)


def transform_violations(q, k, v) -> list[str]:
    """What is non-finite in smooth_k / hadamard / channel_scale_v of finite (q, k, v) inside
    their domains, and in the Post of channel scaling on an O that is a convex combination."""
    out = []
    ks, m = outliers.smooth_k(_scaled(k, F32_MAX / 2))
    if not (torch.isfinite(ks).all() and torch.isfinite(m).all()):
        out.append("smooth_k: non-finite")
    qh, kh = outliers.hadamard(_scaled(q, F32_MAX / math.sqrt(D)), _scaled(k, F32_MAX / math.sqrt(D)), seed=3)
    if not (torch.isfinite(qh).all() and torch.isfinite(kh).all()):
        out.append("hadamard: non-finite")
    vs, c = outliers.channel_scale_v(v)
    if not (torch.isfinite(vs).all() and torch.isfinite(c).all()):
        out.append("channel_scale_v: non-finite")
    elif (vs.abs() > 2).any():  # amax / c is in [1/2, 1], up to 2 above 2**127 (c stops at 2**127)
        out.append("channel_scale_v: a scaled value above 2")
    else:  # O' = the mean over tokens of V' (a convex combination), mapped back by O' c
        o = outliers.Post(v_scale=c).o(vs.mean(1, keepdim=True).expand(-1, 4, -1, -1))
        if not torch.isfinite(o).all():
            out.append("Post.o: non-finite")
    return out


@SETTINGS
@given(q=grouped(), k=grouped(), v=grouped())
def test_transforms_finite_in_their_domain(q, k, v):
    assert transform_violations(q, k, v) == []


@pytest.mark.parametrize("mag", [BF16_MAX, F32_MAX / 2, 1e37, 1e30, 1.0, BF16_TINY, 1.4e-45])
def test_smoothing_an_all_equal_k_gives_zero(mag):
    """All-equal keys smooth to exactly 0 (their mean is the value itself), at any magnitude."""
    k = torch.full((1, 64, 2, 8), mag)
    ks, m = outliers.smooth_k(k)
    assert torch.equal(ks, torch.zeros_like(ks)) and torch.equal(m, torch.full_like(m, mag))


def test_planted_fault_float32_mean_is_caught(monkeypatch):
    """smooth_k with the float32 mean it had before: S keys of 1e38 sum past F32_MAX, and the
    check reports it."""
    def float32_mean(k):
        k = k.to(torch.float32)
        m = k.mean(dim=1, keepdim=True)
        return k - m, m

    monkeypatch.setattr(outliers, "smooth_k", float32_mean)
    k = torch.full((1, S, H, D), 1e38)
    z = torch.zeros(1, S, H, D)
    assert transform_violations(z, k, z) == ["smooth_k: non-finite"]
