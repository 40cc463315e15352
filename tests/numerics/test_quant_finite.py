"""No quantizer in numerics/quant.py turns finite input into NaN or Inf (issue 21).

Property, for every quantizer and every scale group: the dequantized values are finite and
within the group's amax of the input (|deq - x| <= amax_group), and a group whose scale
underflows quantizes to zero. Inputs mix zeros, fp32 subnormals, tiny normals and values near
the float32 maximum, a magnitude regime drawn per token row so that one tensor holds groups of
very different sizes. The planted faults put back the two bugs this test found (an FP8 scale
that underflows to 0, MXFP4's top binade without a payload bound) and show the check fails.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fp4gen.numerics import quant as Q

F32_MAX = torch.finfo(torch.float32).max
# per-row magnitude regimes: zero, fp32 subnormals, tiny normals (FP8 scales underflow below
# ~6e-43), ordinary, huge, the float32 maximum
REGIMES = [0.0, 1.4e-45, 1e-44, 3e-43, 7e-43, 1e-40, 1.2e-38, 1e-20, 1.0, 448.0, 1e30, 2.6e38, F32_MAX]
S, H, D = 32, 2, 32

# (name, quantize(x) -> object with .dequantize(), groups(t) -> t reshaped so that the last dim is one group)
def _fp4_groups(dim, block):
    def g(t):
        t = t.movedim(dim, -1)
        return t.reshape(*t.shape[:-1], -1, block)
    return g


def _fp8_groups(kind, block=None):
    def g(t):  # t (B, S, H, D)
        if kind == "tensor":
            return t.permute(0, 2, 1, 3).reshape(t.shape[0], t.shape[2], -1)
        if kind == "token":
            return t
        B, S_, H_, D_ = t.shape
        return t.reshape(B, S_ // block, block, H_, D_).permute(0, 1, 3, 2, 4).reshape(B, S_ // block, H_, -1)
    return g


QUANTIZERS = [
    ("nvfp4 D", lambda x: Q.quantize_nvfp4(x, dim=-1), _fp4_groups(-1, 16)),
    ("nvfp4 S", lambda x: Q.quantize_nvfp4(x, dim=1), _fp4_groups(1, 16)),
    ("nvfp4 tensor scale", lambda x: Q.quantize_nvfp4(x, dim=-1, tensor_scale=True), _fp4_groups(-1, 16)),
    ("mxfp4 ceil D", lambda x: Q.quantize_mxfp4(x, dim=-1), _fp4_groups(-1, 32)),
    ("mxfp4 ceil S", lambda x: Q.quantize_mxfp4(x, dim=1), _fp4_groups(1, 32)),
    ("mxfp4 ocp D", lambda x: Q.quantize_mxfp4(x, dim=-1, rule="ocp"), _fp4_groups(-1, 32)),
    ("fp8 e4m3 tensor", lambda x: Q.quantize_fp8(x, "tensor"), _fp8_groups("tensor")),
    ("fp8 e4m3 block 8", lambda x: Q.quantize_fp8(x, "block", 8), _fp8_groups("block", 8)),
    ("fp8 e4m3 token", lambda x: Q.quantize_fp8(x, "token"), _fp8_groups("token")),
    ("fp8 e5m2 tensor", lambda x: Q.quantize_fp8(x, "tensor", fmt="e5m2"), _fp8_groups("tensor")),
    ("fp8 e5m2 token", lambda x: Q.quantize_fp8(x, "token", fmt="e5m2"), _fp8_groups("token")),
]


def violations(quantize, groups, x: torch.Tensor) -> list[str]:
    """What is wrong with quantize(x) (finite x): non-finite output, an error above the
    group's amax, or a non-zero output in a group whose amax is below 1e-43."""
    d = quantize(x).dequantize()
    out = []
    if not torch.isfinite(d).all():
        out.append(f"{int(torch.isnan(d).sum())} NaN and {int(torch.isinf(d).sum())} Inf from finite input")
        return out
    xg, dg = groups(x.double()), groups(d.double())
    amax = xg.abs().amax(-1, keepdim=True)
    err = (dg - xg).abs()
    if (err > amax * (1 + 1e-6)).any():
        out.append(f"error above the group amax (worst {float((err - amax).max()):.3g})")
    tiny = (amax < 1e-43).expand_as(dg)
    if (dg[tiny] != 0).any():
        out.append("a group with amax < 1e-43 does not quantize to zero")
    return out


@st.composite
def wild(draw):
    """Per-row magnitude regimes drawn by hypothesis; the elements from a seeded generator
    (hypothesis draws the seed, the share of zeros and of exact +-1), to keep examples small."""
    rows = draw(st.lists(st.sampled_from(REGIMES), min_size=S, max_size=S))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    x = torch.rand(1, S, H, D, generator=g) * 2 - 1
    u = torch.rand(x.shape, generator=g)
    x = torch.where(u < draw(st.sampled_from([0.0, 0.3, 0.9])), torch.zeros_like(x), x)
    x = torch.where(u > 1 - draw(st.sampled_from([0.0, 0.05])), x.sign(), x)
    return x * torch.tensor(rows, dtype=torch.float32)[None, :, None, None]


@pytest.mark.parametrize("name,quantize,groups", QUANTIZERS, ids=[q[0] for q in QUANTIZERS])
@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=wild())
def test_finite_in_finite_out(name, quantize, groups, x):
    assert torch.isfinite(x).all()
    assert violations(quantize, groups, x) == []


@pytest.mark.parametrize("name,quantize,groups", QUANTIZERS, ids=[q[0] for q in QUANTIZERS])
def test_edge_cases(name, quantize, groups):
    """The cases the property is about, each on its own (a seeded sweep beside hypothesis)."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(1, S, H, D, generator=g)
    half = torch.cat([torch.zeros(1, S // 2, H, D), torch.full((1, S // 2, H, D), 3e-43)], 1)
    for x in (torch.zeros(1, S, H, D), r * 1e-44, r * 1.2e-38, half, half.transpose(1, 3).reshape(1, S, H, D),
              torch.full((1, S, H, D), F32_MAX), r.sign() * F32_MAX, r * 1e38, r * 448):
        x = torch.nan_to_num(x)  # r * F32_MAX style products stay finite; be sure
        assert violations(quantize, groups, x) == [], x.abs().max()


def test_tiny_amax_groups_are_zero_and_keep_the_rest():
    """A tensor with one tiny token row: FP8 per-token quantizes that row to 0, its scale 1,
    and the other rows exactly as without it."""
    x = torch.randn(1, 8, 1, 16, generator=torch.Generator().manual_seed(1))
    x[0, 3] = 0.0
    x[0, 3, 0, :4] = 2e-43
    q = Q.quantize_fp8_token(x)
    assert float(q.scale[0, 3, 0]) == 1.0 and int(q.codes[0, 3].sum()) == 0
    ref = Q.quantize_fp8_token(torch.cat([x[:, :3], x[:, 4:]], 1))
    assert torch.equal(torch.cat([q.codes[:, :3], q.codes[:, 4:]], 1), ref.codes)


def test_inf_input_is_documented_nan():
    """Inf is not finite input: an FP8 group with an Inf gets scale Inf and dequantizes to NaN
    (payload 0 times Inf), the other groups are untouched; the FP4 scales saturate
    (docs/numerics.md, "Specials in blocks")."""
    x = torch.ones(1, 4, 1, 32)
    x[0, 1, 0, 5] = float("inf")
    q = Q.quantize_fp8_token(x)
    d = q.dequantize()
    assert torch.isinf(q.scale[0, 1, 0]) and int(q.codes[0, 1, 0, 0]) == 0
    assert torch.isnan(d[0, 1]).all() and (d[0, [0, 2, 3]] == 1).all()
    d4 = Q.quantize_nvfp4(x, dim=-1).dequantize()
    assert float(d4[0, 1, 0, 5]) == 6 * 448 and torch.isfinite(d4).all()


# ------------------------------------------------------------ planted faults -----

def test_planted_underflowing_fp8_scale_is_caught(monkeypatch):
    """The FP8 scale rule before the fix (1 only for amax == 0): the check reports NaN."""
    def old_scale(amax, fmt):
        recip = torch.tensor(1.0 / fmt.max_value, dtype=torch.float32, device=amax.device)
        return torch.where(amax == 0, torch.ones_like(amax), amax * recip)

    monkeypatch.setattr(Q, "_fp8_scale", old_scale)
    x = torch.zeros(1, S, H, D)
    x[0, :, :, :3] = 3e-43
    name, quantize, groups = QUANTIZERS[8]  # fp8 per token
    assert any("NaN" in v for v in violations(quantize, groups, x))


def test_planted_unbounded_mxfp4_top_binade_is_caught(monkeypatch):
    """MXFP4 without the payload bound at scale 2**126: the check reports Inf."""
    monkeypatch.setattr(Q, "_clamp_e2m1_finite", lambda q, scale: q)
    x = torch.full((1, S, H, D), F32_MAX)
    name, quantize, groups = QUANTIZERS[3]
    assert any("Inf" in v for v in violations(quantize, groups, x))
