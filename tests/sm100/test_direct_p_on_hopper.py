"""The sm100a Direct-P device helpers, run on Hopper, against ``fp4gen.numerics.directp``.

``tests/sm100/directp_probe.py`` wraps ``fp4gen.device.sm100.direct_p``'s fast-policy
helpers in a one-thread-per-row kernel that repeats the sm100 template's per-block loop,
compiled for sm_90a (the accurate policy's ``cvt.rn.satfinite.e2m1x2.f32`` is sm_100-only
and is not covered here).

What is compared, and how exactly:

- E8M0 bytes e_B + 127: bit-exact, every block (masked blocks: 0, i.e. e_B = -127).
- Codes: bit-exact, every key, against the saturating classifier
  (``numerics.directp.sat_codes``: y = sat(fl32(A7 t + c_B)), code = rne(7 y)). The kernel
  rounds where the model does: both FMAs are explicit ``fma.rn`` (no contraction choice
  left to the compiler), and 7 y is exact in the second FMA. rne(7 y) has no ties (y would
  have to be (2k+1)/14, not a binary fraction), so the "boundary" inputs place y within a few
  ulps either side of each (k + 1/2)/7.
- The packed nibble words equal the codes packed key 8w+c -> nibble c of word w, and the
  per-block integer ``twice`` equals 2 * sum of the E2M1 magnitudes of the kernel's codes.
- l: every block term twice/2 * 2^e_B is exact in fp32 (twice <= 384, a 9-bit integer;
  at e_B = -127 the terms are multiples of 2^-128, representable as subnormals), so the
  kernel's l differs from the exact sum S of its own P values only by its 3 fp32 additions
  (4 blocks, ascending, all terms >= 0): |l - S| <= gamma_3 S, gamma_n = nu / (1 - nu),
  u = 2^-24, plus 3 * 2^-150 for subnormal partial sums. S is ``math.fsum`` in float64
  (correctly rounded: relative error <= 2^-53, negligible here). Against the oracle's own
  l (a torch fp32 sum of the 128 P values, in whatever order torch uses) on rows where the
  codes agree: |l - l_oracle| <= (gamma_3 + gamma_127) S + 4 * 2^-150 (any summation tree
  of 128 nonnegative terms is within gamma_127 S). Rows whose S exceeds the fp32 range
  (only with e_B clamped at 127, i.e. u >= 128, outside the documented range) must be +inf.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _p in (_HERE, _ROOT):  # plain checkout on the device machine: nothing pip-installed
    if _p not in sys.path:
        sys.path.insert(0, _p)

from fp4gen.numerics.directp import direct_p_mxfp4, sat_constants, sat_offset  # noqa: E402
from fp4gen.numerics.directp import fma_f32  # noqa: E402
from fp4gen.numerics.formats import E2M1, decode  # noqa: E402

N_KEYS = 128  # == directp_probe.N_KEYS (not imported here: that import needs cutlass)
U = 2.0 ** -24
FLT_MAX = torch.finfo(torch.float32).max


def _gamma(n):
    """Higham's gamma_n: any order of n fp32 additions of nonnegative terms is within gamma_n S."""
    return n * U / (1 - n * U)
A7, K7 = sat_constants()  # the kernel's f32 constants




# ------------------------------------------------------------------ inputs


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def case_random():
    g = _gen(1)
    rows = 384
    sigma = torch.tensor([0.5, 2.0, 8.0, 24.0]).repeat_interleave(rows // 4)[:, None]
    t = torch.randn(rows, N_KEYS, generator=g) * sigma
    m = torch.zeros(rows)
    m[1::3] = t[1::3].amax(-1)  # guarded rows: m = the row's (sampled) max
    m[2::3] = torch.randn(rows, generator=g)[2::3] * 5.0
    return t, m


def case_large_small():
    """|t| up to ~100 log2 units, wide and narrow spreads, m = 0 or a large reference."""
    g = _gen(2)
    rows = 384
    off = (torch.rand(rows, 1, generator=g) * 2 - 1) * 95.0
    spread = torch.tensor([0.05, 1.0, 10.0, 40.0]).repeat(rows // 4)[:, None]
    t = (off + spread * torch.randn(rows, N_KEYS, generator=g)).clamp(-110.0, 110.0)
    m = torch.zeros(rows)
    m[1::2] = ((torch.rand(rows, generator=g) * 2 - 1) * 40.0)[1::2]
    return t, m


def case_e8m0_edges():
    """e_B at and beyond both ends of E8M0: 2^-127 (a subnormal fp32 scale) with nonzero
    codes, clamped -127 (all codes 0 below), exact 127 and clamped 127 (codes saturate)."""
    g = _gen(3)
    rows = []
    for umax, m in [(-126.5, 26.5), (-126.01, 30.0), (-126.99, 0.0), (-127.0, 0.0),
                    (-127.3, 27.0), (-140.0, 40.0), (-200.0, 100.0), (127.2, 0.0),
                    (127.99, 27.0), (128.0, 28.0), (131.0, 31.0), (300.0, 200.0)]:
        for spread in (0.5, 3.0):
            u = umax - spread * torch.rand(N_KEYS, generator=g)
            u[::32] = umax  # every block reaches umax
            rows.append((u + m, m))
    t = torch.stack([r[0] for r in rows]).float()
    m = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    return t, m


def case_masked():
    """-inf keys: whole blocks, whole rows, causal-like prefixes, one visible key per block."""
    g = _gen(4)
    rows = 256
    t = torch.randn(rows, N_KEYS, generator=g) * 6.0
    m = torch.zeros(rows)
    ninf = float("-inf")
    blk_mask = torch.rand(rows, N_KEYS // 32, generator=g) < 0.4
    t[blk_mask.repeat_interleave(32, dim=1)] = ninf
    t[0:8] = ninf  # fully masked rows: l = 0, all bytes 0
    for r in range(8, 72):  # causal-like: keys past a per-row diagonal masked
        t[r, (r - 8) * 2 + 1:] = ninf
    keep = torch.zeros(N_KEYS, dtype=torch.bool)
    keep[5::32] = True
    t[72:96, ~keep] = ninf  # one visible key per block
    m[100:] = torch.randn(rows - 100, generator=g)[:] * 3.0
    return t, m


def _f32_from_bits(bits):
    return bits.to(torch.int32).view(torch.float32)


def _tie_configs():
    # (m, e_B): references and block exponents that give c_B different roundings
    return [(0.0, 0), (0.0, -3), (0.75, 5), (-20.3, 40), (3.1, -60), (0.0, 2), (-1.5, -1),
            (0.0, 1), (0.0, -1), (0.0, 7), (0.0, -10), (0.0, 20), (0.1, 0), (-0.5, -2)]


def _y(t, m, e):
    """The classifier's y = sat(fl32(A7 t + c_B)) for scores t of one (m, e_B)."""
    c = sat_offset(torch.tensor([m], dtype=torch.float32), torch.tensor([[float(e)]]))[0, 0]
    return fma_f32(torch.full_like(t, A7), t, torch.full_like(t, c.item())).clamp(0.0, 1.0)


def case_ties(window=64):
    """Scores whose y = sat(A7 t + c_B) lies within ``window`` ulps of t either side of a code
    boundary (k + 1/2)/7, k = 0..6. Each block starts with an anchor key at u = e_B + 0.5 that
    pins e_B; the rest of the block are the boundary candidates."""
    rows_t, rows_m = [], []
    for m, e in _tie_configs():
        cands = []
        c = sat_offset(torch.tensor([m], dtype=torch.float32), torch.tensor([[float(e)]]))[0, 0].item()
        for k in range(7):
            tc = torch.tensor(((k + 0.5) / 7 - c) / A7, dtype=torch.float32)
            bits = torch.arange(-window, window, dtype=torch.int64) + int(tc.view(torch.int32).item())
            cands.append(_f32_from_bits(bits))
        cands = torch.cat(cands)
        anchor = torch.tensor(e + 0.5 + m, dtype=torch.float32)
        blocks = []
        for i in range(0, len(cands), 31):
            blk = torch.full((32,), float("-inf"))
            blk[0] = anchor
            chunk = cands[i:i + 31]
            blk[1:1 + len(chunk)] = chunk
            blocks.append(blk)
        while len(blocks) % (N_KEYS // 32):
            blocks.append(torch.full((32,), float("-inf")))
        t_rows = torch.stack(blocks).reshape(-1, N_KEYS)
        rows_t.append(t_rows)
        rows_m.append(torch.full((t_rows.shape[0],), m, dtype=torch.float32))
    return torch.cat(rows_t), torch.cat(rows_m)


CASES = {"random": case_random, "large_small": case_large_small, "e8m0_edges": case_e8m0_edges,
         "masked": case_masked, "ties": case_ties}


# ------------------------------------------------------------------ models


def models(t, m):
    """The oracle (numerics.directp, the saturating classifier). Returns dict: codes_ref (rows, N)
    uint8, eb (rows, nb) int, y (the classifier's y, for explanations), l_ref (the oracle's l)."""
    _, l_ref, codes_ref, eb = direct_p_mxfp4(t, m, policy="fast", form="sat_ffma")
    rows = t.shape[0]
    c = sat_offset(m, eb)
    tb = t.reshape(rows, -1, 32)
    y = fma_f32(torch.full_like(tb, A7), tb, c[..., None]).clamp(0.0, 1.0).reshape(rows, -1)
    return {"codes_ref": codes_ref, "eb": eb.to(torch.int64), "y": y, "l_ref": l_ref}


def exact_l(codes, eb):
    """fsum over the row of E2M1(code) * 2^e_B in float64 (exact for these terms)."""
    vals = decode(codes, E2M1).double().reshape(codes.shape[0], -1, 32)
    terms = vals * torch.pow(2.0, eb.double())[..., None]
    return torch.tensor([math.fsum(r) for r in terms.reshape(codes.shape[0], -1).tolist()],
                        dtype=torch.float64)


def _h(v):
    v = float(v)
    return f"{v!r} ({v.hex()})" if math.isfinite(v) else repr(v)


def _explain_key(name, r, c, t, m, mod, out, what):
    b = c // 32
    lines = [
        f"[{name}] {what}: first at row {r}, key {c} (block {b})",
        f"  t = {_h(t[r, c])}, m = {_h(m[r])}, u = t - m = {_h((t[r, c] - m[r]).item())}",
        f"  oracle e_B = {int(mod['eb'][r, b])}, kernel E8M0 byte = {int(out['e8m0'][r, b])} "
        f"(oracle byte {int(mod['eb'][r, b]) + 127})",
        f"  y = sat(A7 t + c_B) = {_h(mod['y'][r, c])}, 7 y = {_h(mod['y'][r, c].double() * 7)}",
        f"  code: oracle {int(mod['codes_ref'][r, c])}, "
        f"kernel raw {int(out['raw'][r, c])}, kernel packed {int(out['codes'][r, c])}",
        f"  kernel word {b * 4 + (c % 32) // 8} = {int(out['words'][r, b * 4 + (c % 32) // 8]) & 0xFFFFFFFF:#010x}",
        f"  block t values: {[float(v) for v in t[r, b * 32:(b + 1) * 32]]}",
    ]
    return "\n".join(lines)


def _explain_block(name, r, b, t, m, mod, out, what):
    return "\n".join([
        f"[{name}] {what}: first at row {r}, block {b}",
        f"  m = {_h(m[r])}, block max t = {_h(t[r, b * 32:(b + 1) * 32].max())}",
        f"  oracle e_B = {int(mod['eb'][r, b])}, kernel E8M0 byte = {int(out['e8m0'][r, b])}, "
        f"kernel twice = {int(out['twice'][r, b])}",
        f"  kernel raw codes = {out['raw'][r, b * 32:(b + 1) * 32].tolist()}",
        f"  oracle codes     = {mod['codes_ref'][r, b * 32:(b + 1) * 32].tolist()}",
        f"  block t values: {[float(v) for v in t[r, b * 32:(b + 1) * 32]]}",
    ])


def _first(mask):
    idx = mask.nonzero()
    return tuple(int(i) for i in idx[0]), int(idx.shape[0])


# ------------------------------------------------------------------ CPU tests


def test_probe_compiles_for_sm90a_without_gpu(tmp_path):
    """Compile in a fresh process (the DSL reads CUTE_DSL_* at import) and check the PTX:
    sm_90a, sat_block's PRMTs (three per word, one lookup per four keys) and no BFI, no MUFU ex2, no sm_100
    conversion, and the classifier as the explicit saturating FMA."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {_HERE!r})
        import directp_probe
        directp_probe.compile_probe()
        print("compiled")
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
    ptx = [f for f in os.listdir(tmp_path) if f.endswith(".ptx")]
    assert len(ptx) == 1, os.listdir(tmp_path)
    text = (tmp_path / ptx[0]).read_text()
    assert ".target sm_90a" in text
    # per block: four words of three byte-gathering PRMTs each, and eight table lookups
    assert text.count("prmt.b32") == (N_KEYS // 32) * (4 * 3 + 8) and text.count("bfi.b32") == 0
    assert "ex2" not in text and "e2m1x2" not in text
    # the per-key chain and sat_block may share their (pure) FMAs: at least one per key
    sat = text.count("fma.rn.sat.f32")
    assert sat >= N_KEYS, sat


def test_fallback_probe_compiles_for_sm90a():
    """run_probe falls back to DLPack tensor arguments if pointer arguments are refused."""
    import directp_probe

    directp_probe.compile_probe_tensors()


def test_boundary_inputs_straddle_every_code_boundary():
    """The boundary inputs put y on both sides of each (k + 1/2)/7 for every (m, e_B), pin the
    intended e_B, and so produce both neighbouring codes around each boundary."""
    t, m = case_ties()
    mod = models(t, m)
    live = torch.isfinite(t)
    live[:, ::32] = False  # the anchors
    y7 = mod["y"].double() * 7
    for k in range(7):
        near = live & ((y7 - (k + 0.5)).abs() < 1e-3)
        below = near & (mod["codes_ref"] == k)
        above = near & (mod["codes_ref"] == k + 1)
        assert below.sum() >= 14 and above.sum() >= 14, (k, int(below.sum()), int(above.sum()))
    want = torch.cat([torch.full((1,), e) for _, e in _tie_configs()])
    blocks_e = mod["eb"][torch.isfinite(t.reshape(t.shape[0], -1, 32)).any(-1)]
    assert set(blocks_e.tolist()) == set(want.tolist())


def test_cases_well_formed():
    for name, fn in CASES.items():
        t, m = fn()
        assert t.dtype == torch.float32 and t.shape[1] == N_KEYS and m.shape == (t.shape[0],), name
        assert not torch.isnan(t).any() and torch.isfinite(m).all(), name
    t, m = case_e8m0_edges()
    eb = models(t, m)["eb"]
    assert (eb == -127).any() and (eb == 127).any()


# ------------------------------------------------------------------ GPU tests


def _sm90_gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs an sm_90 (Hopper) GPU: the probe is compiled for sm_90a")
@pytest.mark.parametrize("name", list(CASES))
def test_direct_p_helpers_match_oracle(name):
    import directp_probe

    t, m = CASES[name]()
    mod = models(t, m)
    out = directp_probe.run_probe(t.cuda(), m.cuda())
    rows, nb = t.shape[0], N_KEYS // 32

    # 1. E8M0 bytes, bit-exact
    bad = out["e8m0"].to(torch.int64) != mod["eb"] + 127
    if bad.any():
        (r, b), n = _first(bad)
        pytest.fail(f"{n} E8M0 bytes differ\n" + _explain_block(name, r, b, t, m, mod, out, "e_B + 127"))

    # 2. the raw per-key results hold a code 0..7, and the packing is the kernel's
    raw = out["raw"]
    bad = (raw < 0) | (raw > 7)
    if bad.any():
        (r, c), n = _first(bad)
        pytest.fail(f"{n} per-key results are not 1.5*2^23 + code\n"
                    + _explain_key(name, r, c, t, m, mod, out, "raw code out of range"))
    bad = out["codes"].to(torch.int32) != raw
    if bad.any():
        (r, c), n = _first(bad)
        pytest.fail(f"{n} packed nibbles differ from the per-key codes\n"
                    + _explain_key(name, r, c, t, m, mod, out, "sat_block packing"))
    codes = raw.to(torch.uint8)
    assert torch.equal(out["words"], directp_probe.pack_words(codes))  # implied by the above

    # 3. twice (PRMT table) == 2 * block sum of E2M1 magnitudes of the kernel's codes
    twice_ref = (decode(codes, E2M1) * 2).reshape(rows, nb, 32).sum(-1).to(torch.int32)
    bad = out["twice"] != twice_ref
    if bad.any():
        (r, b), n = _first(bad)
        pytest.fail(f"{n} block sums differ (expected {int(twice_ref[r, b])})\n"
                    + _explain_block(name, r, b, t, m, mod, out, "sat_block sum"))

    # 4. codes: bit-exact against the oracle, everywhere
    diff_ref = codes != mod["codes_ref"]
    if diff_ref.any():
        (r, c), n = _first(diff_ref)
        pytest.fail(f"{n} codes differ from the oracle\n" + _explain_key(name, r, c, t, m, mod, out, "code vs oracle"))

    # 5. l against the exact sum of the kernel's own P values, and against the oracle's l
    l = out["l"].double()
    S = exact_l(codes, mod["eb"])
    tol = _gamma(3) * S + 3 * 2.0 ** -150
    # u >= 128 (e_B clamped at 127, outside the documented range) can overflow fp32: then l = inf
    may_overflow = S + tol > FLT_MAX
    must_overflow = S - tol > FLT_MAX
    bad = torch.where(may_overflow, ~torch.isposinf(l) & ((l - S).abs() > tol), (l - S).abs() > tol)
    bad |= must_overflow & ~torch.isposinf(l)
    if bad.any():
        (r,), n = _first(bad)
        pytest.fail(f"[{name}] {n} rows: l differs from the exact sum of the kernel's P values: row {r}, "
                    f"kernel l {_h(l[r])}, exact {_h(S[r])}, bound {tol[r].item():.3e}; "
                    f"blocks e_B {mod['eb'][r].tolist()}, twice {out['twice'][r].tolist()}")
    same = ~diff_ref.any(-1)
    tol_o = (_gamma(3) + _gamma(127)) * S + 4 * 2.0 ** -150
    bad = same & ~may_overflow & ((l - mod["l_ref"].double()).abs() > tol_o)
    if bad.any():
        (r,), n = _first(bad)
        pytest.fail(f"[{name}] {n} rows: l differs from the oracle's l beyond fp32 summation order: row {r}, "
                    f"kernel {_h(l[r])}, oracle {_h(mod['l_ref'][r])}, exact {_h(S[r])}, bound {tol_o[r].item():.3e}")
    # 6. 4 l as the kernels with the guard keep it (quad_pow2): the same bound as l, except that
    # 4 l overflows fp32 two binades before l does: where 4 (S + tol) passes FLT_MAX the kernel
    # may give +inf (the second H100 run met it at e_B 122 in large_small), where 4 (S - tol)
    # does it must. The guard kernels never get there: the rebase keeps e_B <= 64.
    l4 = out["l4"].double() / 4
    tol4 = _gamma(3) * S + 4 * 2.0 ** -150  # the final / 4 rounds once below 2^-124
    far = (l4 - S).abs() > tol4
    may_overflow4 = 4 * (S + tol4) > FLT_MAX
    must_overflow4 = 4 * (S - tol4) > FLT_MAX
    bad = torch.where(may_overflow4, far & ~torch.isposinf(l4), far) | (must_overflow4 & ~torch.isposinf(l4))
    if bad.any():
        (r,), n = _first(bad)
        pytest.fail(f"[{name}] {n} rows: 4 l / 4 differs from the exact sum of the kernel's P values: row {r}, "
                    f"kernel {_h(l4[r])}, exact {_h(S[r])}, bound {tol4[r].item():.3e}; e_B {mod['eb'][r].tolist()}")
    full_masked = torch.isneginf(t).all(-1)
    assert (out["l"][full_masked] == 0).all() and (out["l4"][full_masked] == 0).all()
    assert (out["e8m0"][full_masked] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_gpu(), reason="needs an sm_90 (Hopper) GPU: the probe is compiled for sm_90a")
@pytest.mark.xfail(strict=False, reason=(
    "known deviation, reported: docs/numerics.md section 6 item 6 gives a block with a NaN score "
    "a NaN scale (E8M0 0xFF); the helpers take the block max with fmax, which drops NaN, and "
    "clamp with fma.sat, which maps NaN to code 0, so a NaN score is silently zeroed"))
def test_nan_score_poisons_its_block():
    import directp_probe

    t = torch.randn(4, N_KEYS, generator=_gen(5))
    t[1, 40] = float("nan")
    m = torch.zeros(4)
    out = directp_probe.run_probe(t.cuda(), m.cuda())
    _, l_ref, _, _ = direct_p_mxfp4(t, m, policy="fast")
    assert torch.isnan(l_ref[1])  # the oracle: NaN scale for the block, so a NaN row
    assert int(out["e8m0"][1, 1]) == 0xFF and torch.isnan(out["l"][1]), (
        f"NaN score at row 1 key 40: kernel E8M0 byte {int(out['e8m0'][1, 1])} (oracle: 0xFF), code "
        f"{int(out['raw'][1, 40])}, l {float(out['l'][1])} (oracle: nan)")
