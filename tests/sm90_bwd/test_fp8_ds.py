"""FP8 dS on sm90a (CPU): the planner's decision and refusals, the lowering context flag, and
the numerics oracle's recipe (``reference.fp8_ds_tile_scale``): per backward tile of 64 query
rows x 128 keys, dS8 = e4m3(dS * f) with f = s_q / c (s_q: the tile's Q block scale), used as
dS8 / f by dQ = dS K and dK = dS^T Q; c a power of two, handed from one query tile of a key
tile to the next (the walk starts at the key tile's first query tile with a visible key):
the power of two covering max|dS| s_q on the first tile and when the guess would overflow
e4m3, else the guess; a c taken from the max is handed on times 4, a guess is halved for the
next tile when the tile used less than a sixteenth of e4m3's range (docs/numerics.md, "FP8 dS
on sm90a")."""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bwd_modules as bm  # noqa: E402

from fp4gen.frontend import parse_text  # noqa: E402
from fp4gen.ir.passes import plan_kernel  # noqa: E402
from fp4gen.ir.passes.backward import BWD_TILE_M as TM, BWD_TILE_N as TN, plan_backward  # noqa: E402
from fp4gen.ir.plan import SMEM_LIMIT_BYTES, PlanError  # noqa: E402
from fp4gen.ir.spec import Format, OperandFormat, ScaleGranularity  # noqa: E402
from fp4gen.lowering.sm90_bwd import context  # noqa: E402
from fp4gen.numerics import reference as R  # noqa: E402
from fp4gen.numerics.formats import E4M3, round_to  # noqa: E402
from fp4gen.numerics.quant import quantize_fp8  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "sm90_fp8_train_d128.attn")


# ------------------------------------------------------------------ planner

@pytest.mark.parametrize("d,causal,det", [(128, True, False), (64, True, True), (128, False, False)])
def test_fp8_ds_plans(d, causal, det):
    bp = plan_backward(bm.make_plan(d, causal, det, "ds"))
    assert bp.ds_fp8 and bp.grad_format("dS") == "fp8e4m3" and bp.mma_format == "fp8e4m3"
    mm = {m.name: m for m in bp.mmas}
    assert (mm["dK"].a_source, mm["dK"].a_major, mm["dK"].b_major) == ("registers", "K", "K")
    assert (mm["dQ"].a_source, mm["dQ"].a_major, mm["dQ"].b_major) == ("smem", "K", "K")
    items = {i.name: i.bytes for i in bp.smem}
    # no bf16 Q/K tiles; K^T8 once, Q^T8 and dS (e4m3) double-buffered
    assert "Q" not in items and "K" not in items
    assert items["K^T8"] == 128 * d and items["Q^T8"] == 2 * d * 64 and items["dS"] == 2 * 64 * 128
    for name in ("V", "dO", "K8", "Q8", "dO^T", "dQ", "LSE/D", "mbarriers"):  # the rest as with bf16 dS
        assert name in items
    assert bp.smem_bytes == sum(items.values()) <= SMEM_LIMIT_BYTES
    assert any(n.startswith(f"dS scale: one e4m3 scale per {TM} x {TN} tile") for n in bp.notes)
    assert any("B = Q^T" in n and "B = K^T" in n and "stmatrix.trans" in n for n in bp.notes)
    ctx = context(bm.make_plan(d, causal, det, "ds"))
    assert ctx["ds_fp8"] is True and ctx["s_fp8"] is True and ctx["do_fp8"] is True


@pytest.mark.parametrize("fp8", [False, True, "s"])
def test_existing_specs_keep_bf16_ds(fp8):
    plan = bm.make_plan(128, True, False, fp8)
    bp = plan_backward(plan)
    assert not bp.ds_fp8 and bp.mma_format_of("dK") == bp.mma_format_of("dQ") == "bf16"
    assert {"Q", "K"} <= {i.name for i in bp.smem} and "K^T8" not in {i.name for i in bp.smem}
    assert context(plan)["ds_fp8"] is False


def test_example_has_the_ds8_kernel():
    from fp4gen.frontend import parse_file

    specs = {s.name: s for s in parse_file(EXAMPLE)}
    base, ds8 = specs["sm90_fp8_train_causal_d128"], specs["sm90_fp8_train_ds8_causal_d128"]
    # the same kernel plus `dS : fp8e4m3`
    assert dict(ds8.backward.formats) == {**dict(base.backward.formats), "dS": OperandFormat(
        Format.FP8E4M3, ds8.backward.format_of("dS").granularity, None, Format.FP32)}
    assert dataclasses.replace(ds8, name=base.name, backward=base.backward) == base
    assert plan_kernel(ds8).backward.ds_fp8 and not plan_kernel(base).backward.ds_fp8
    assert R.fp8_ds_recipe(ds8) and not R.fp8_ds_recipe(base)


def _spec(reuse="q k lse", do="fp8e4m3", ds="fp8e4m3", dp=None):
    lines = [f"    reuse {reuse}", f"    dO : {do}", f"    dS : {ds}"] + ([f"    dP : {dp}"] if dp else [])
    text = bm.FP8_SPEC.format(name="x", d=128, mask="causal", do=do, ds="", det="false")
    text = text.replace(f"    reuse q k lse\n    dO : {do}\n", "\n".join(lines) + "\n")
    return parse_text(text, "x.attn")[0]


@pytest.mark.parametrize("kw,match,field", [
    (dict(do="bf16"), r"FP8 dS needs `reuse q k` with fp8e4m3\(block=128\) Q/K and dO : fp8e4m3", "backward.dS"),
    (dict(reuse="lse"), r"FP8 dS needs `reuse q k`", "backward.dS"),
    (dict(ds="fp8e4m3(scale=token)"), r"scales FP8 dS itself, one power-of-two scale per 64 x 128 tile",
     "backward.dS"),
    (dict(ds="fp8e4m3(block=128)"), r"scales FP8 dS itself, one power-of-two scale per 64 x 128 tile",
     "backward.dS"),
    (dict(ds="fp8e5m2"), r"dS : fp8e5m2\(scale=tensor\) is not supported", "backward.dS"),
    (dict(dp="fp8e4m3"), r"FP8 dP on sm90a is not implemented.*never feeds an MMA", "backward.dP"),
])
def test_fp8_ds_refusals_point_at_the_spec_line(kw, match, field):
    spec = _spec(**kw)
    with pytest.raises(PlanError, match=match) as ei:
        plan_backward(_forward_plan(spec))
    loc = ei.value.loc
    assert loc is not None and loc == spec.loc(field)
    assert spec.source_lines[loc.line - 1].strip().startswith(field.split(".")[1])


def _forward_plan(spec):
    """The forward's plan without the backward attached (plan_kernel would raise already)."""
    from fp4gen.ir.plan import KernelPlan

    return KernelPlan(spec=spec)


def test_planner_refusal_reaches_plan_kernel():
    with pytest.raises(PlanError, match="FP8 dS needs"):
        plan_kernel(_spec(do="bf16"))


# ------------------------------------------------------------------ the scale's bit formula

def _cover_ref(x: float) -> float:
    """Independent: the smallest power of two s with 448 s >= x (1 below 2^-117, NaN for inf/NaN)."""
    if math.isnan(x) or math.isinf(x):
        return float("nan")
    if x < 2.0 ** -117:
        return 1.0
    s = 2.0 ** (math.frexp(x)[1] - 12)
    while 448.0 * s < x:
        s *= 2
    return s


def _cover(xs):
    return R.fp8_ds_scale_cover(torch.tensor(xs, dtype=torch.float32)).tolist()


def test_scale_cover_edges():
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    up = lambda v: torch.nextafter(f32(v), f32(math.inf)).item()  # noqa: E731
    down = lambda v: torch.nextafter(f32(v), f32(0.0)).item()  # noqa: E731
    cases = {
        0.0: 1.0, -0.0: 1.0, 1e-45: 1.0, 2.0 ** -126: 1.0, 2.0 ** -118: 1.0, down(2.0 ** -117): 1.0,
        2.0 ** -117: 2.0 ** -125,
        1.0: 2.0 ** -8, 2.0: 2.0 ** -7, 448.0: 1.0, up(448.0): 2.0, 224.0: 0.5, 256.0: 1.0, 1024.0: 4.0,
        1.75: 2.0 ** -8, up(1.75): 2.0 ** -7, down(1.75): 2.0 ** -8,  # m = 1.75: 448 s == bound exactly
        1.75 * 2.0 ** 20: 2.0 ** 12, up(1.75 * 2.0 ** 20): 2.0 ** 13, down(2.0 ** 20): 2.0 ** 12,
        3.4028234663852886e38: 2.0 ** 120,  # float32 max: no overflow
    }
    got = _cover(list(cases))
    for (x, want), g in zip(cases.items(), got):
        assert g == want, (x, g, want)
        assert g == _cover_ref(x), x
    nan = _cover([math.inf, -math.inf, math.nan])
    assert all(math.isnan(v) for v in nan)


def test_scale_cover_random_is_the_smallest_power_of_two():
    g = torch.Generator().manual_seed(3)
    x = torch.exp2(torch.empty(20000).uniform_(-116.9, 127.9, generator=g)).to(torch.float32)
    x = x[torch.isfinite(x)]
    s = R.fp8_ds_scale_cover(x)
    m, _ = torch.frexp(s)
    assert bool((m == 0.5).all())  # powers of two
    x64, s64 = x.double(), s.double()
    assert bool((448 * s64 >= x64).all()) and bool((x64 > 224 * s64).all())
    assert s.tolist()[:500] == [_cover_ref(v) for v in x.tolist()[:500]]


# ------------------------------------------------------------------ the tile scale

def _scale(a_sq, c_guess, first):
    a = torch.tensor(a_sq, dtype=torch.float32)
    c, nxt = R.fp8_ds_tile_scale(a, torch.tensor(c_guess, dtype=torch.float32).expand_as(a), first)
    assert c.dtype == nxt.dtype == torch.float32 and c.shape == nxt.shape == a.shape
    return c, nxt


def _f32_next(v, toward):
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(toward, dtype=torch.float32)).item()


def _is_pow2(x: torch.Tensor) -> bool:
    return bool((torch.frexp(x)[0] == 0.5).all())


def test_tile_scale_first_tile_covers_its_max():
    """(a) A key tile's first query tile has no guess (whatever is passed is ignored): c is the
    power of two covering a_sq = max|dS| s_q, so the tile's folded max a_sq / c lies in
    (224, 448]; its guess for the next tile is 4 c (headroom: the next tile, the first one
    whose queries see every key of the tile, is likely larger)."""
    g = torch.Generator().manual_seed(5)
    a = torch.exp2(torch.empty(4000).uniform_(-116.9, 120, generator=g)).tolist()
    for guess in (1.0, 2.0 ** -20, 2.0 ** 30):
        c, nxt = _scale(a, guess, True)
        assert _is_pow2(c) and torch.equal(nxt, 4 * c)
        a64, c64 = torch.tensor(a, dtype=torch.float64), c.double()
        assert bool((448 * c64 >= a64).all()) and bool((a64 > 224 * c64).all())
        assert c.tolist() == [_cover_ref(x) for x in torch.tensor(a, dtype=torch.float32).tolist()]
    c, nxt = _scale([0.0, 1e-40], 0.25, True)  # an all-zero (or subnormal) tile: c = 1
    assert c.tolist() == [1.0, 1.0] and nxt.tolist() == [4.0, 4.0]


def test_tile_scale_keeps_a_guess_that_fits():
    """(b) 28 <= a_sq / c_guess <= 448: the guess is kept, and handed on unchanged."""
    guess = 2.0 ** -9
    ratios = [28.0, 28.5, 56.0, 111.9, 112.0, 200.0, 224.0, 224.5, 300.0, 447.9, 448.0]
    c, nxt = _scale([r * guess for r in ratios] + [_f32_next(28 * guess, math.inf)], guess, False)
    assert c.tolist() == nxt.tolist() == [guess] * (len(ratios) + 1)
    # per element: (B, H) guesses
    gs = torch.tensor([[2.0 ** -3, 2.0 ** 5], [1.0, 2.0 ** -40]])
    c, nxt = R.fp8_ds_tile_scale(gs * 300, gs, False)
    assert torch.equal(c, gs) and torch.equal(nxt, gs)


def test_tile_scale_overflow_takes_the_tiles_max():
    """(c) a_sq / c_guess > 448 (the guess would saturate e4m3): c = the power of two covering
    a_sq, as for a first tile, and it is handed on times 4."""
    guess = 2.0 ** -9
    a = [_f32_next(448 * guess, math.inf), 449 * guess, 896 * guess, _f32_next(896 * guess, math.inf),
         1e6 * guess, 3e30]
    c, nxt = _scale(a, guess, False)
    assert torch.equal(nxt, 4 * c) and bool((c > guess).all()) and _is_pow2(c)
    assert c.tolist() == [_cover_ref(x) for x in torch.tensor(a, dtype=torch.float32).tolist()]
    assert c.tolist()[:4] == [2 * guess, 2 * guess, 2 * guess, 4 * guess]  # 896 g is covered by 2 g exactly
    a64, c64 = torch.tensor(a, dtype=torch.float32).double(), c.double()
    assert bool((448 * c64 >= a64).all()) and bool((a64 > 224 * c64).all())


def test_tile_scale_halves_the_next_guess_below_a_sixteenth():
    """(d) a_sq / c < 28 (the tile used less than a sixteenth of e4m3's range): the tile keeps
    the guess, the next tile's guess is c / 2. One halving per tile: a run of small tiles
    walks the scale down one binade per tile."""
    guess = 2.0 ** -9
    a = [0.0, 1e-30, guess, 20 * guess, _f32_next(28 * guess, 0.0)]
    c, nxt = _scale(a, guess, False)
    assert c.tolist() == [guess] * len(a) and nxt.tolist() == [guess / 2] * len(a)
    cs, c_g = [], torch.tensor([guess])
    for _ in range(4):  # tiles at 12 x the first guess: 12 < 28 -> halve, 24 < 28 -> halve, 48 fits
        c, c_g = R.fp8_ds_tile_scale(torch.tensor([12 * guess]), c_g, False)
        cs.append(c.item())
    assert cs == [guess, guess / 2, guess / 4, guess / 4]


def test_kernel_takes_the_oracles_rule():
    """The all-FP8 backward kernel halves, hands on and floors its dS scale with the oracle's
    constants (one definition in fp4gen.numerics.backward_rules, imported by the kernel
    library), and the generated module asks for that kernel variant."""
    import importlib

    from fp4gen.device.sm90 import backward as K

    assert K.DS_SMALL == R.FP8_DS_SMALL == 448 / 16
    assert K.DS_HEADROOM == R.FP8_DS_HEADROOM == 4.0
    assert K.DS_C_HALVE_MIN == R.FP8_DS_HALVE_MIN == 2.0 ** -59
    mod = importlib.import_module("fp4gen.generated.sm90_fp8_train_ds8_causal_d128_sm90a")
    assert mod.BWD_CONFIG.ds_fp8 and mod.BWD_CONFIG.s_fp8 and mod.BWD_CONFIG.do_fp8
    assert mod.BWD_CONFIG.mma_majors == (("K", "K"),) * 5  # every FP8 wgmma operand K-major


def test_tile_scale_guess_never_halves_below_the_floor():
    """A run of all-zero tiles (e.g. dO rows masked out of the loss: dS = 0) halves the guess
    once per tile, but not below 2^-60: without the floor, ~140 such tiles take it to 0, where
    the kernel's 1 / c and dK rescale break (NaN). A guess already below the floor (a head of
    tiny gradients, fitted on overflow) is kept, not raised."""
    c_g = torch.tensor([2.0 ** -8])
    for _ in range(200):
        c, c_g = R.fp8_ds_tile_scale(torch.tensor([0.0]), c_g, False)
    assert c_g.item() == 2.0 ** -60 and c.item() == 2.0 ** -60
    c, nxt = R.fp8_ds_tile_scale(torch.tensor([0.0]), torch.tensor([2.0 ** -80]), False)
    assert c.item() == nxt.item() == 2.0 ** -80


def test_oracle_fp8_ds_masked_do_rows_stay_finite():
    """Causal, dO zero past the first 128 rows (so dS = 0 on most tiles): the FP8-dS oracle is
    finite and as close to the bf16-dS one as on ordinary inputs."""
    (s8, sd, _), (q, k, v, o, lse, do) = _state("long_1000", 64)
    do = do.clone()
    do[:, 128:] = 0
    a = R.backward(q, k, v, o, lse, do, s8)
    b = R.backward(q, k, v, o, lse, do, sd)
    assert bm.all_finite(*b)
    for x, y in zip(a[:2], b[:2]):
        assert bm.rel_l2(y, x) < 6e-2


def test_tile_scale_nan():
    """(e) inf/NaN: a first tile's c is NaN (the cover of inf/NaN), and so is every later c of
    the walk (NaN / NaN > 448 is false: the NaN guess is kept); a later tile overflowing to inf
    gets c = NaN. A NaN max in a later tile keeps a finite guess (NaN compares false: neither
    an overflow nor small), but that tile's e4m3(f dS) is NaN anyway."""
    c, nxt = _scale([math.nan, math.inf], 1.0, True)
    assert bool(c.isnan().all()) and bool(nxt.isnan().all())
    c, nxt = R.fp8_ds_tile_scale(torch.tensor([100.0, 1e-3]), torch.tensor([math.nan, math.nan]), False)
    assert bool(c.isnan().all()) and bool(nxt.isnan().all())
    c, nxt = _scale([math.inf], 0.5, False)
    assert bool(c.isnan().all()) and bool(nxt.isnan().all())
    c, nxt = _scale([math.nan], 0.5, False)
    assert c.tolist() == nxt.tolist() == [0.5]
    assert bool(round_to(torch.tensor([math.nan]) * 0.5, E4M3).isnan().all())


# ------------------------------------------------------------------ the oracle

def _specs(d, causal=True):
    """(bf16-dS recipe, FP8-dS recipe, FP8-dS recipe with fp32 dP (the kernel keeps dP in fp32
    registers, as test_bwd_gpu's oracle) and fp32 dQ/dK/dV outputs)."""
    s8, sd = bm.make_spec(d, causal, False, True), bm.make_spec(d, causal, False, "ds")
    f32 = OperandFormat(Format.FP32)
    fmts = {**dict(sd.backward.formats), "dP": f32, "dQ": f32, "dK": f32, "dV": f32}
    return s8, sd, dataclasses.replace(sd, backward=dataclasses.replace(sd.backward, formats=fmts))


def _state(case, d, seed=0, causal=True):
    s8, sd, sd32 = _specs(d, causal)
    q, k, v, do = bm.make_inputs(case, d, seed, "cpu")
    o, lse = R.forward(q, k, v, s8)  # the FP8 forward's own O and LSE (what training hands over)
    return (s8, sd, sd32), (q, k, v, o.to(torch.bfloat16), lse, do)


# (case, d): small random causal inputs (S = 256 and 1000, D 64/128), GQA, large logits
ORACLE_CASES = [("basic", 64), ("basic", 128), ("gqa_6_2", 64), ("large_logits", 128), ("long_1000", 64)]
# FP8 dS against the bf16-dS recipe, both vs float64 autograd (rel-L2). Measured (this test's
# inputs, and ragged / non-square causal ones): 1.22-1.30x (e.g. basic d128: 0.050 -> 0.062;
# long_1000 d64: 0.052 -> 0.066); large_logits (near one-hot rows, where the FP8 forward itself
# is off by ~0.58): 1.01x. FP8 dS (with the FP8 Q/K payloads it multiplies) is 0.037-0.039 off
# the bf16-dS recipe, i.e. adds ~0.038 in quadrature.
RATIO_MAX = 1.5


@pytest.mark.parametrize("case,d", ORACLE_CASES)
def test_oracle_fp8_ds_accuracy(case, d):
    (s8, sd, _), (q, k, v, o, lse, do) = _state(case, d)
    a = R.backward(q, k, v, o, lse, do, s8)
    b = R.backward(q, k, v, o, lse, do, sd)
    f = bm.autograd_f64(q, k, v, do, True, s8.scale)
    assert bm.all_finite(*b)
    for x, y, ref in zip(a[:2], b[:2], f[:2]):
        e_bf16, e_fp8 = bm.rel_l2(x, ref), bm.rel_l2(y, ref)
        assert e_fp8 <= RATIO_MAX * e_bf16, (case, d, e_fp8, e_bf16)
        assert bm.rel_l2(y, x) > 1e-3  # dS really is rounded differently
    assert torch.equal(a[2], b[2])  # dV does not depend on dS


# The error must not grow with S. Measured (B = 1, H = 1, D = 128, causal, seed 0; rel-L2 vs
# float64 autograd, dq / dk): S = 1024: bf16 dS 0.048 / 0.047, FP8 dS per tile 0.062 / 0.061
# (1.30x, +0.014); S = 4096: 0.052 / 0.052 -> 0.064 / 0.064 (1.24x, +0.012). The FP8-dS oracle
# is 0.037-0.038 off the bf16-dS one at both lengths. (Every tile's c from its own max gives
# the same to 3 digits: 1e-4 apart.) The per-(batch, head) bound recipe that this replaced
# gave 0.065 / 0.063 (1.35x, +0.017) at 1024 but 0.100 / 0.099 (1.93x, +0.048; 0.085 off the
# bf16-dS oracle) at 4096, failing every bound below at S = 4096.
LONG_RATIO_MAX, LONG_EXCESS_MAX, LONG_GROWTH_MAX = 1.5, 2e-2, 1.2


def test_fp8_ds_error_does_not_grow_with_s():
    _, sd, _ = _specs(128)
    s8 = bm.make_spec(128, True, False, True)
    to_bf16 = {}
    for S in (1024, 4096):
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(1, S, 1, 128, generator=g).to(torch.bfloat16) for _ in range(4))
        o, lse = R.forward(q, k, v, s8)
        o = o.to(torch.bfloat16)
        a = R.backward(q, k, v, o, lse, do, s8)
        b = R.backward(q, k, v, o, lse, do, sd)
        f = bm.autograd_f64(q, k, v, do, True, s8.scale)
        for name, x, y, ref in zip(("dq", "dk"), a[:2], b[:2], f[:2]):
            e_bf16, e_fp8 = bm.rel_l2(x, ref), bm.rel_l2(y, ref)
            assert e_fp8 <= LONG_RATIO_MAX * e_bf16, (S, name, e_fp8, e_bf16)
            assert e_fp8 <= e_bf16 + LONG_EXCESS_MAX, (S, name, e_fp8, e_bf16)
            to_bf16[S, name] = bm.rel_l2(y, x)
    for name in ("dq", "dk"):
        assert to_bf16[4096, name] <= LONG_GROWTH_MAX * to_bf16[1024, name], to_bf16


def _cover64(x: torch.Tensor) -> torch.Tensor:
    """Independent of the bit formula: the smallest power of two c with 448 c >= x (float64),
    1 below 2^-117."""
    m, e = torch.frexp(x / 448)  # x / 448 = m 2^e, m in [0.5, 1)
    c = torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))
    return torch.where(x < 2.0 ** -117, torch.ones_like(x), c)


def _transcription(case, d, variant="kernel", causal=True):
    """The recipe written out independently in float64, computing dK and dQ as the kernel does
    (from FP8 payloads; block scales applied after the MMA). Per key tile n of 128 keys, its
    CTA walks the query tiles t of 64 rows in ascending order from m_min (causal: the first
    tile with a visible key, max(0, n0 - (Sk - Sq)) // 64; else 0), carrying a guess g:
    a = max|dS_t| s_q; c = the power of two covering a on the first tile or when a / g > 448,
    else g; the next g = 4 c if c came from a, else c / 2 if a / c < 28 (and c >= 2^-59),
    else c; dS8 = e4m3(dS s_q / c),
    dK_n = sum_t c dS8^T Q8_t, dQ_t += (c s_k / s_q) dS8 K8_n.

    ``variant``: "kernel"; "no_sq": the wrong f = 1 / c' with c' walked on max|dS| alone (no Q
    scale), dequantized correctly; "m_min0": every walk starts at query tile 0 (the fully
    masked tiles of a bottom-right causal mask included); "amax": every tile's c from its own
    max (no guess handed on). Returns (dq, dk) (B, S, H*, D) float64 and, per visited tile in
    walk order (key tile outer), (c, max |dS f|, whether c came from the max), (B, H) each, and
    the tile's first key and query."""
    (_, sd, _), (q, k, v, o, lse, do) = _state(case, d, causal=causal)
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    qq, kq = quantize_fp8(q, "block", 128), quantize_fp8(k, "block", 128)
    vq, doq = quantize_fp8(v, "tensor"), quantize_fp8(do, "tensor")
    bhsd = lambda x: x.double().permute(0, 2, 1, 3)  # noqa: E731
    q8, k8 = bhsd(qq.dequantize() / qq.expand_scale()), bhsd(kq.dequantize() / kq.expand_scale())
    k8 = k8.repeat_interleave(g, 1)
    sq = qq.expand_scale()[..., 0].double().permute(0, 2, 1)  # (B, H, Sq)
    sk = kq.expand_scale()[..., 0].double().permute(0, 2, 1).repeat_interleave(g, 1)
    vdeq = bhsd(vq.dequantize()).repeat_interleave(g, 1)
    dodeq, O = bhsd(doq.dequantize()), bhsd(o)
    s = (q8 * sq[..., None]) @ (k8 * sk[..., None]).transpose(-1, -2) * sd.scale
    if causal:
        i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
        s = s.masked_fill(j > i + (Sk - Sq), -math.inf)
    lse = lse.double()
    lse = torch.where(torch.isneginf(lse), math.inf, lse)  # a query that sees no key: P = 0
    p = torch.exp(s - lse[..., None])
    drow = (dodeq * O).sum(-1)
    ds = p * (dodeq @ vdeq.transpose(-1, -2) - drow[..., None])
    dq = torch.zeros(B, H, Sq, D, dtype=torch.float64)
    dk = torch.zeros(B, H, Sk, D, dtype=torch.float64)
    walk = []
    for n0 in range(0, Sk, TN):
        n1 = min(Sk, n0 + TN)
        m_min = max(0, n0 - (Sk - Sq)) // TM if causal and variant != "m_min0" else 0
        guess = None
        for t0 in range(m_min * TM, Sq, TM):
            t1 = min(Sq, t0 + TM)
            s_q = sq[:, :, t0]  # (B, H): one Q block per 64-row tile
            assert torch.equal(sq[:, :, t0:t1], s_q[..., None].expand(-1, -1, t1 - t0))
            tile = ds[:, :, t0:t1, n0:n1]
            a = tile.abs().amax((-2, -1)) * (1.0 if variant == "no_sq" else s_q)
            if guess is None or variant == "amax":  # the first tile (or no guess at all)
                redo = torch.ones_like(a, dtype=torch.bool)
                c = _cover64(a)
            else:
                redo = a / guess > 448
                c = torch.where(redo, _cover64(a), guess)
            guess = torch.where(redo, 4 * c, torch.where((a / c < 28) & (c >= 2.0 ** -59), c / 2, c))
            f = 1 / c if variant == "no_sq" else s_q / c
            ds8 = round_to(tile * f[..., None, None], E4M3).double()
            walk.append((c, (tile * f[..., None, None]).abs().amax((-2, -1)), redo, n0, t0))
            if variant != "no_sq":  # the kernel's arithmetic: payloads, scales after the MMA
                dk[:, :, n0:n1] += c[..., None, None] * (ds8.transpose(-1, -2) @ q8[:, :, t0:t1])
                dq[:, :, t0:t1] += ((c / s_q)[..., None, None] * sk[:, :, n0:n0 + 1, None]
                                    * (ds8 @ k8[:, :, n0:n1]))
            else:
                used = ds8 / f[..., None, None]
                dk[:, :, n0:n1] += used.transpose(-1, -2) @ (q8[:, :, t0:t1] * sq[:, :, t0:t1, None])
                dq[:, :, t0:t1] += used @ (k8[:, :, n0:n1] * sk[:, :, n0:n1, None])
    dq, dk = dq * sd.scale, (dk * sd.scale).reshape(B, Hkv, g, Sk, D).sum(2)
    return dq.permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3), walk


def _same_scales(oracle, walk) -> bool:
    return len(oracle) == len(walk) and all(torch.equal(a.double(), w[0]) for a, w in zip(oracle, walk))


@pytest.mark.parametrize("case,d,causal", [("basic", 64, True), ("gqa_6_2", 128, True), ("ragged_200", 128, True),
                                           ("sq100_sk300", 64, True), ("basic", 128, False)])
def test_oracle_is_the_recipe(case, d, causal, monkeypatch):
    """The oracle (fp32, tiled) equals the float64 transcription of the kernel's arithmetic up to
    fp32 rounding, and picks the same c for every tile in the same walk order; the same
    transcription with f missing s_q is far off, so this test sees a wrong f. The result alone
    hardly tells the scale rules apart (e4m3 is a float format: a power-of-two scale only moves
    which tiny values fall into its subnormals; every tile from its own max is ~5e-6 off), so
    the scales are compared exactly. Ragged and non-square cases cover partial row / key tiles
    and the bottom-right causal offset; the last one has no mask.

    Measured: oracle vs transcription 5e-8 to 1.3e-6 causal, 6.6e-5 unmasked (dS = P (dP - D)
    cancels, so fp32 vs float64 can flip an e4m3 rounding decision); the scales equal on every
    tile; every tile from its own max differs on 3/12 to 22/36 tiles; with the wrong f 3.1e-2 to
    3.8e-2 (another rounding of every dS value)."""
    (_, _, sd32), (q, k, v, o, lse, do) = _state(case, d, causal=causal)
    (dq, dk, _), scales = bm.oracle_tile_scales(monkeypatch, (q, k, v, o, lse, do, sd32))
    tq, tk, walk = _transcription(case, d, causal=causal)
    e_q, e_k = bm.rel_l2(dq, tq), bm.rel_l2(dk, tk)
    assert e_q < 1e-3 and e_k < 1e-3, (e_q, e_k)
    assert _same_scales(scales, walk)
    assert not _same_scales(scales, _transcription(case, d, "amax", causal)[2])  # the comparison sees the rule
    wq, wk, _ = _transcription(case, d, "no_sq", causal)
    assert bm.rel_l2(dq, wq) > 1e-2 and bm.rel_l2(dk, wk) > 1e-2, (bm.rel_l2(dq, wq), bm.rel_l2(dk, wk))
    # no tile saturates e4m3; a tile whose c comes from its max uses e4m3's top binade
    folded, redo = torch.stack([w[1] for w in walk]), torch.stack([w[2] for w in walk])
    assert bool((folded <= 448).all()) and bool(((folded > 224) | (folded == 0))[redo].all())
    assert bool(redo.any()) and not bool(redo.all())  # some tiles keep the guess


@pytest.mark.parametrize("case,d", [("sq300_sk100", 64), ("sq300_sk100", 128), ("basic", 64)])
def test_oracle_walks_from_the_first_visible_query_tile(case, d, monkeypatch):
    """Each key tile's walk starts at its first query tile with a visible key, m_min: with a
    bottom-right causal mask and Sq > Sk (sq300_sk100: queries 0..199 see no key, so the one
    key tile starts at query tile 3) and in the square causal case (key tile n starts at query
    tile 2n). The oracle matches the transcription that starts there, scale for scale; starting
    at query tile 0 instead (an m_min mistake: the masked tiles' max 0 gives c = 1, then one
    halving per tile, and the first real tile gets a guess far too large) is far off.

    Measured: 1e-7 vs the transcription; starting at 0: 4.2e-2 / 2.7e-2 (sq300_sk100 D 64 /
    128), 6.9e-2 (basic)."""
    (_, _, sd32), (q, k, v, o, lse, do) = _state(case, d)
    (dq, dk, _), scales = bm.oracle_tile_scales(monkeypatch, (q, k, v, o, lse, do, sd32))
    tq, tk, walk = _transcription(case, d)
    assert bm.rel_l2(dq, tq) < 1e-3 and bm.rel_l2(dk, tk) < 1e-3
    assert _same_scales(scales, walk)
    if case == "sq300_sk100":
        assert len(walk) == 2  # query tiles 3 and 4 of the one key tile
    wq, wk, wrong = _transcription(case, d, "m_min0")
    assert len(wrong) > len(walk)
    assert bm.rel_l2(dq, wq) > 1e-2 and bm.rel_l2(dk, wk) > 1e-2, (bm.rel_l2(dq, wq), bm.rel_l2(dk, wk))


def test_oracle_row_chunks_are_whole_tiles(monkeypatch):
    """Row chunks not a multiple of 64 are rounded down to whole dS tiles (here 100 -> 64) and
    each key tile's guess is carried from one chunk to the next: the same scales as the default
    chunking (one chunk), and the same result up to fp32 summation order. (Splitting a tile
    between chunks would give it two scales: ~1e-2 off.)"""
    (_, _, sd32), (q, k, v, o, lse, do) = _state("ragged_200", 64)
    args = (q, k, v, o, lse, do, sd32)
    ref, ref_scales = bm.oracle_tile_scales(monkeypatch, args)
    monkeypatch.setattr(R, "_row_chunk", lambda *a: 100)
    got, scales = bm.oracle_tile_scales(monkeypatch, args)
    for x, y in zip(got, ref):
        assert bm.rel_l2(x, y) < 1e-5
    walk = _transcription("ragged_200", 64)[2]
    assert _same_scales(ref_scales, walk)
    # with 64-row chunks the oracle picks the scales query tile by query tile
    assert _same_scales(scales, sorted(walk, key=lambda w: (w[4], w[3])))


def test_recipe_needs_the_backward_key_tile():
    (_, sd, _), (q, k, v, o, lse, do) = _state("basic", 64)
    s64 = dataclasses.replace(sd, schedule=dataclasses.replace(sd.schedule, tile_n=64))
    with pytest.raises(R.ReferenceError, match=r"per 64 x 128 tile"):
        R.backward(q, k, v, o, lse, do, s64)


def test_other_fp8_ds_granularities_keep_per_row_scales():
    """dS : fp8e4m3(scale=token) is not the sm90a recipe: the oracle keeps one scale per row of
    each key tile (its old behaviour); and the recipe needs FP8 dO and reused FP8 Q/K."""
    _, sd, _ = _specs(64)
    tok = OperandFormat(Format.FP8E4M3, ScaleGranularity.TOKEN, None, Format.FP32)
    st = dataclasses.replace(sd, backward=dataclasses.replace(
        sd.backward, formats={**dict(sd.backward.formats), "dS": tok}))
    assert not R.fp8_ds_recipe(st)
    bf16_do = dataclasses.replace(sd, backward=dataclasses.replace(
        sd.backward, formats={"dS": sd.backward.format_of("dS")}))
    assert not R.fp8_ds_recipe(bf16_do)
    no_reuse = dataclasses.replace(sd, backward=dataclasses.replace(sd.backward, reuse=frozenset({"lse"})))
    assert not R.fp8_ds_recipe(no_reuse)
    q, k, v, do = bm.make_inputs("basic", 64, 0, "cpu")
    o, lse = R.forward(q, k, v, sd)
    a = R.backward(q, k, v, o, lse, do, st)
    b = R.backward(q, k, v, o, lse, do, sd)
    assert bm.rel_l2(a[0], b[0]) > 1e-3


def test_oracle_fp8_ds_nan_propagates():
    """A NaN in row 5 of O makes D_5 NaN, hence dS row 5 (masked entries too: 0 * NaN). Row 5 is
    in query tile 0, which only key tile 0 visits (causal, S = 256: key tile 1 starts at query
    tile 2); there it is the first tile, so its c is NaN (torch's amax propagates NaN, the
    cover of NaN is NaN) and so is every c that key tile's walk hands on (fp8_ds_tile_scale
    keeps a NaN guess): in the oracle the head's dQ of every row and dK of keys 0..127 are NaN;
    dK of keys 128..255, the other heads and dV stay finite. (Whether the kernel's max keeps a
    NaN depends on its max instruction and it skips fully masked tiles, so on the GPU only row
    5's dQ and the dK of the keys it sees are sure to be NaN.)"""
    (_, sd, _), (q, k, v, o, lse, do) = _state("basic", 64)
    o = o.clone()
    o[0, 5, 1, 3] = float("nan")
    dq, dk, dv = R.backward(q, k, v, o, lse, do, sd)
    assert bool(dq[0, :, 1].isnan().all()) and bool(dk[0, :TN, 1].isnan().all())
    assert bm.all_finite(dk[0, TN:, 1], dq[1], dk[1], dq[0, :, 0], dk[0, :, 0], dv)
