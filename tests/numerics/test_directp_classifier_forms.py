"""The fast classifier's arithmetic forms (numerics.directp): "sat_ffma", the sm100a kernels'
since 2026-12-07 and the default (checked against exact rational arithmetic), "two_op" (the
kernels' before), "one_ffma" (a what-if). FMAs are emulated exactly (fma_f32); the forms'
codes differ only at rounding boundaries.

    python tests/numerics/test_directp_classifier_forms.py [--form=sat_ffma|one_ffma] [--json]
        # the tables in docs/numerics.md section 13
"""
from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4gen.numerics import directp as dp

ROOT = Path(__file__).resolve().parents[2]


def _f32_round(exact: Fraction) -> float:
    """The float32 nearest to ``exact`` (ties to even), by comparing the exact neighbours."""
    c = np.float32(float(exact))
    cands = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.int32)) & 1))
    return float(best)


def test_fma_f32_rounds_once_where_a_float64_sum_rounds_twice():
    # (1 + 2^-12)^2 + 2^-60 = 1 + 2^-11 + 2^-24 + 2^-60: just above a float32 tie, so an FMA
    # rounds up; a float64 sum drops the 2^-60 and the tie then goes to even (down)
    x = torch.tensor([1 + 2 ** -12], dtype=torch.float32)
    z = torch.tensor([2.0 ** -60, -(2.0 ** -60)], dtype=torch.float32)
    got = dp.fma_f32(x, x, z).double().tolist()
    assert got == [1 + 2 ** -11 + 2 ** -23, 1 + 2 ** -11]
    naive = (x.double() * x.double() + z.double()).float().double().tolist()
    assert naive[0] != got[0], "the planted double rounding must be caught by this case"


def test_fma_f32_matches_exact_rounding():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(400, generator=g) * 40).float()
    y = torch.full((400,), 1.5)
    z = -(x * 1.5 + torch.randn(400, generator=g) * 1e-3).float()  # cancellation, as c_B does
    got = dp.fma_f32(x, y, z).tolist()
    for xi, yi, zi, gi in zip(x.tolist(), y.tolist(), z.tolist(), got):
        assert gi == _f32_round(Fraction(xi) * Fraction(yi) + Fraction(zi)), (xi, zi)
    inf = torch.tensor([-math.inf, math.nan])
    out = dp.fma_f32(inf, torch.ones(2), torch.zeros(2))
    assert out[0] == -math.inf and math.isnan(out[1])


def _tiles(scale, seed=0, rows=64, n=256):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, n, generator=g) * (1.44 * 1.5 * scale)
    m = torch.randn(rows, generator=g) * 3 * scale  # a guard's sampled reference: not an integer
    return t, m


def test_default_form_is_the_kernels_and_the_context_restores_it():
    t, m = _tiles(16.0)
    base = dp.direct_p_mxfp4(t, m)
    assert dp._CLASSIFIER_FORM[0] == "sat_ffma"
    for a, b in zip(base, dp.direct_p_mxfp4(t, m, form="sat_ffma")):
        assert torch.equal(a, b)
    with dp.classifier_form("one_ffma"):
        inside = dp.direct_p_mxfp4(t, m)
    assert dp._CLASSIFIER_FORM[0] == "sat_ffma"
    assert torch.equal(inside[2], dp.direct_p_mxfp4(t, m, form="one_ffma")[2])
    for a, b in zip(base, dp.direct_p_mxfp4(t, m)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="classifier form"):
        dp.direct_p_mxfp4(t, m, form="fused")
    with pytest.raises(ValueError, match="classifier form"):
        with dp.classifier_form("fused"):
            pass


def _near_boundary(t, m, eb):
    """(where the two-op affine value lies within a few ulps of a .5 code boundary, that value):
    the only places two forms' codes may differ."""
    u = t - m[:, None]
    x = u.reshape(t.shape[0], -1, 32) - eb[..., None] + dp.LOG2_6
    y = (x * dp.FAST_A + dp.FAST_B).reshape(t.shape[0], -1)
    ulps = 8 * torch.finfo(torch.float32).eps * (u.abs() * dp.FAST_A + 8)
    return ((y - torch.floor(y) - 0.5).abs() <= ulps) | (y < 1e-3), y


@pytest.mark.parametrize("scale", [1.0, 8.0, 16.0])
def test_one_ffma_codes_differ_only_at_rounding_boundaries(scale):
    t, m = _tiles(scale)
    _, _, c2, eb = dp.direct_p_mxfp4(t, m, form="two_op")
    _, _, c1, eb1 = dp.direct_p_mxfp4(t, m, form="one_ffma")
    assert torch.equal(eb, eb1)  # the block exponents do not depend on the form
    d = (c1.int() - c2.int()).abs()
    assert d.max() <= 1
    near, y = _near_boundary(t, m, eb)
    flips = d.bool() & (y > -0.5) & (y < 7.5)
    assert not (flips & ~near).any()


def test_one_ffma_is_not_a_no_op_at_rounding_boundaries():
    """The what-if must be measurable: scores placed within ~1e-5 of the code 3 / 4 boundary
    (A*x + B = 3.5) under non-integer references move in some rows (if this fails, the
    one-FFMA path silently computes today's form). On random scores such flips are rare:
    see measure()."""
    g = torch.Generator().manual_seed(0)
    rows = 4096
    m = torch.randn(rows, generator=g) * 40
    e = torch.randint(-20, 60, (rows,), generator=g).float()
    u = torch.empty(rows, 32)
    u[:, 0] = e + 0.5  # the block maximum: e_B = e
    u[:, 1:] = (e[:, None] - dp.LOG2_6 + (3.5 - dp.FAST_B) / dp.FAST_A) + torch.randn(rows, 31, generator=g) * 1e-5
    t = (u + m[:, None]).float()
    c2 = dp.direct_p_mxfp4(t, m, form="two_op")[2]
    c1 = dp.direct_p_mxfp4(t, m, form="one_ffma")[2]
    assert (c1 != c2).sum() > 100
    assert (c1.int() - c2.int()).abs().max() == 1


# ------------------------------------------------------------- the saturating classifier


def _sat_code_exact(t: float, m: float, e: int, scale: float = 1.0) -> int:
    """The saturating classifier for one score in exact rational arithmetic: every float32
    rounding taken from the exact value (``_f32_round``), independent of ``fma_f32``."""
    a7, k7 = dp.sat_constants()
    a7s = _f32_round(Fraction(np.float32(scale).item()) * Fraction(a7))
    me = _f32_round(Fraction(np.float32(m).item()) + e)
    c = _f32_round(-Fraction(a7) * Fraction(me) + Fraction(k7))
    if math.isinf(t):
        return 0
    y = _f32_round(Fraction(a7s) * Fraction(t) + Fraction(c))
    y = min(max(y, 0.0), 1.0)
    q = Fraction(y) * 7
    k = math.floor(q)
    assert q - k != Fraction(1, 2)  # 7 y is never a tie: y would be (2k+1)/14
    return k + (1 if q - k > Fraction(1, 2) else 0)


@pytest.mark.parametrize("scale", [1.0, 0.12752])
def test_sat_codes_match_exact_arithmetic(scale):
    g = torch.Generator().manual_seed(7)
    rows = 6
    t = (torch.randn(rows, 64, generator=g) * 6).float()
    t[0, :5] = float("-inf")
    m = (torch.randn(rows, generator=g) * 3).float()
    eb = torch.randint(-4, 6, (rows, 2), generator=g).float()
    got = dp.sat_codes(t.reshape(rows, 2, 32), m, eb, scale=scale).reshape(rows, -1)
    for r in range(rows):
        for c in range(64):
            want = _sat_code_exact(float(t[r, c]), float(m[r]), int(eb[r, c // 32]), scale)
            assert int(got[r, c]) == want, (r, c, float(t[r, c]))


def test_sat_codes_clamp_and_nan():
    t = torch.tensor([[[-math.inf, math.nan, 1e30, -1e30] + [0.0] * 28]])
    got = dp.sat_codes(t, torch.zeros(1), torch.zeros(1, 1))
    assert got[0, 0, :4].tolist() == [0, 0, 7, 0]


@pytest.mark.parametrize("scale", [1.0, 8.0, 16.0])
def test_sat_ffma_codes_differ_from_two_op_only_at_rounding_boundaries(scale):
    t, m = _tiles(scale)
    _, _, c2, eb = dp.direct_p_mxfp4(t, m, form="two_op")
    _, _, cs, ebs = dp.direct_p_mxfp4(t, m, form="sat_ffma")
    assert torch.equal(eb, ebs)
    d = (cs.int() - c2.int()).abs()
    assert d.max() <= 1
    near, _ = _near_boundary(t, m, eb)
    assert not (d.bool() & ~near).any()


def test_planted_fault_a_wrong_sat_offset_is_caught():
    """The exact-arithmetic check above must fail for a classifier whose c_B is off by an ulp."""
    orig = dp.sat_offset
    try:
        dp.sat_offset = lambda m, eb, a=dp.FAST_A, b=dp.FAST_B: torch.nextafter(orig(m, eb, a, b), torch.tensor(9.0))
        with pytest.raises(AssertionError):
            test_sat_codes_match_exact_arithmetic(1.0)
            # an ulp of c_B moves no code on 384 random scores: then plant a boundary input
            a7, k7 = dp.sat_constants()
            c = orig(torch.zeros(1), torch.zeros(1, 1))[0, 0].item()
            t0 = torch.tensor((3.5 / 7 - c) / a7, dtype=torch.float32)
            ts = t0.view(torch.int32) + torch.arange(-64, 64, dtype=torch.int32)
            tb = ts.view(torch.float32).reshape(1, 4, 32)
            got = dp.sat_codes(tb, torch.zeros(1), torch.zeros(1, 4)).reshape(-1)
            for i, tv in enumerate(tb.reshape(-1).tolist()):
                assert int(got[i]) == _sat_code_exact(tv, 0.0, 0)
    finally:
        dp.sat_offset = orig


# ----------------------------------------------------------------------------- measurement

def _cases():
    sys.path.insert(0, str(ROOT / "tests" / "sm100"))
    import test_direct_p_extreme_logits as X

    def big(scale):
        return lambda: X._inputs(sq=1024, sk=1024, seed=1, scale=scale)

    return X, {"randn": big(1.0), "x8": big(8.0), "x16": big(16.0),
               "outlier_channels": X._outlier_channels, "one_huge_logit": X._one_huge_logit}


def measure(new: str = "sat_ffma") -> list:
    """Per input: P codes (form ``new`` vs the two-op form of the kernels before 2026-12-07, from
    the (t, m) the reference codes), and O / LSE of the reference forward in both forms against
    exact attention (fa4_fp4_d128 spec)."""
    from fp4gen.numerics import reference as R
    from fp4gen.numerics.accuracy import compare, exact_attention

    X, cases = _cases()
    spec = X.SPEC
    rows = []
    for name, make in cases.items():
        q, k, v = make()
        seen = []
        orig = dp.direct_p_mxfp4

        def spy(t, m, *a, **kw):
            seen.append((t.clone(), m.clone()))
            return orig(t, m, *a, **kw)

        dp.direct_p_mxfp4 = spy
        try:
            with dp.classifier_form("two_op"):
                o2, l2 = R.forward(q, k, v, spec)
        finally:
            dp.direct_p_mxfp4 = orig
        with dp.classifier_form(new):
            o1, l1 = R.forward(q, k, v, spec)
        n = diff = in_range = 0
        dy = 0.0
        for t, m in seen:
            _, _, c2, eb = dp.direct_p_mxfp4(t, m, "fast", form="two_op")
            c1 = dp.direct_p_mxfp4(t, m, "fast", form=new)[2]
            live = torch.isfinite(t)
            n += int(live.sum())
            diff += int(((c1 != c2) & live).sum())
            if t.shape[-1] % 32 == 0:  # the affine values themselves (before the rounding to a code)
                tb = t.reshape(*t.shape[:-1], -1, 32)
                y2 = ((tb - m[..., None, None]) - eb[..., None] + dp.LOG2_6) * dp.FAST_A + dp.FAST_B
                if new == "one_ffma":
                    y1 = dp.fma_f32(torch.full_like(tb, dp.FAST_A), tb, dp.one_ffma_offset(m, eb)[..., None])
                else:  # sat_ffma: 7 y before the clamp, on the two-op scale
                    a7, _ = dp.sat_constants()
                    y1 = dp.fma_f32(torch.full_like(tb, a7), tb, dp.sat_offset(m, eb)[..., None]).double() * 7
                sel = torch.isfinite(tb) & (y2 > -0.5) & (y2 < 7.5)  # where the code is not clamped
                in_range += int(sel.sum())
                if sel.any():
                    dy = max(dy, float((y1 - y2)[sel].abs().max()))
        deq = [R.quantize_operand(x, f, 3, True).vals for x, f in ((q, spec.q), (k, spec.k))]
        oe, le, _ = exact_attention(deq[0], deq[1], v.float(), spec.scale, True)
        row = {"input": name, "scores": n, "codes_changed": diff, "codes_changed_frac": diff / max(n, 1),
               "scores_unclamped": in_range, "max_abs_affine_diff": dy,
               "o_rel_l2_between_forms": compare(o1.float(), o2.float())["rel_l2"]}
        row["form"] = new
        for form, o, lse in (("two_op", o2, l2), ("new", o1, l1)):
            c = compare(o.float(), oe)
            row[form] = {"o_rel_l2": c["rel_l2"], "o_cosine": c["cosine"],
                         "lse_max_abs_err": (lse.double() - le).abs().max().item(),
                         "lse_mean_abs_err": (lse.double() - le).abs().mean().item(),
                         "finite": bool(torch.isfinite(o).all() and torch.isfinite(lse).all())}
        rows.append(row)
    return rows


if __name__ == "__main__":
    import json

    new = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--form=")), "sat_ffma")
    res = measure(new)
    print(f"{'input':18s} {'scores':>9s} {'unclamped':>9s} {'max|dy|':>8s} {'codes chg':>9s} {'O form-diff':>11s} "
          f"{'O rel-L2 two-op / ' + new:>28s} {'LSE max err two-op / ' + new:>30s}")
    for r in res:
        a, b = r["two_op"], r["new"]
        print(f"{r['input']:18s} {r['scores']:9d} {r['scores_unclamped']:9d} {r['max_abs_affine_diff']:8.1e} "
              f"{r['codes_changed']:9d} {r['o_rel_l2_between_forms']:11.2e} "
              f"{a['o_rel_l2']:13.5f} / {b['o_rel_l2']:.5f} {a['lse_max_abs_err']:15.5f} / {b['lse_max_abs_err']:.5f}")
    if "--json" in sys.argv:
        print(json.dumps(res, indent=1))
