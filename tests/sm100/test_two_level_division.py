"""The two-level softmax's call-free fl32(x / y) (``fp4gen.device.sm100.two_level.div_rn*``).

The helpers replace fp32 ``x / y`` (whose slow-path subroutine call made ptxas store a return
address at every call site of the 192-register softmax: the two-level kernel's last spill bytes)
by fp64 arithmetic rounded once to fp32. The numerics must not change, so the claim is that the
result equals IEEE fp32 division on the helpers' domain (positive normal operands, normal
quotient). Checked here on the CPU:

- ``div_rn_const`` is one fp64 multiply by fl64(1/c) then RN to fp32: numpy does exactly that,
  so every fp32 mantissa (2^23 of them) at the exponents the kernel uses is compared with
  numpy's fp32 division, for c = 6 and 2688 (the kernel's constants);
- ``div_rn``'s fp64 reciprocal comes from ``rcp.approx.ftz.f64`` (hardware), so its exact bits
  cannot be emulated; the proof's lemma is checked instead: on the hardest inputs (x chosen so
  that x / y is as close as fp32 allows to a rounding midpoint) x / y stays more than 2^-49
  (relative) from the midpoint, exactly in rational arithmetic, so any fp64 result within
  2^-51 of x / y rounds to fl32(x / y);
- the CuTe DSL helpers compile (``division_probe``, sm_90a) into that PTX and no fp32 division.

With a CUDA GPU (the PTX needs no sm_100 instruction: Hopper runs it), the PTX text itself runs
through CuPy against numpy's fp32 division on random and near-midpoint inputs
(``test_helpers_on_the_gpu``).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from fractions import Fraction

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _p in (_HERE, _ROOT):  # plain checkout on the device machine: nothing pip-installed
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _all_mantissas(exponent: int) -> np.ndarray:
    """Every fp32 in [2^exponent, 2^(exponent+1))."""
    m = np.arange(1 << 23, dtype=np.uint32)
    return ((np.uint32(exponent + 127) << np.uint32(23)) | m).view(np.float32)


def _const_model(x: np.ndarray, c: float, recip=None) -> np.ndarray:
    """div_rn_const's arithmetic: fp64(x) * fl64(1/c), rounded to fp32 (numpy: RN both)."""
    r = np.float64(1.0 / c) if recip is None else np.float64(recip)
    return (x.astype(np.float64) * r).astype(np.float32)


# exponents of x the kernel divides: amax in (2^-126 * 2688, 2688] for 6; pmax in [2^-64 * 2688, 1]
# for 2688 (smaller quotients are clamped to 2^-64); the ends and a few in between
EXPONENTS = {6.0: (-115, -80, -30, -1, 0, 5, 10, 11), 2688.0: (-53, -40, -20, -5, -1, 0)}


@pytest.mark.parametrize("c", sorted(EXPONENTS))
def test_const_division_equals_fp32_division_for_every_mantissa(c):
    for e in EXPONENTS[c]:
        x = _all_mantissas(e)
        want = x / np.float32(c)  # IEEE fp32 division (numpy rounds the fp32 quotient once)
        got = _const_model(x, c)
        bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert bad.size == 0, f"c={c}, 2^{e}: {bad.size} mantissas differ, first x={x[bad[0]]!r}"


def test_a_worse_reciprocal_is_caught():
    """Planted fault: fl32(1/6) in place of fl64(1/6) (2^-25 off) changes some quotients."""
    x = _all_mantissas(0)
    got = _const_model(x, 6.0, recip=float(np.float32(1.0 / 6.0)))
    assert np.count_nonzero(got.view(np.uint32) != (x / np.float32(6.0)).view(np.uint32)) > 0


def _near_midpoint_pairs(n: int, seed: int = 16):
    """(x, y) fp32 pairs, both in [2^-64, 1), whose quotient is as close to an fp32 rounding
    midpoint as fp32 allows: with 24-bit odd My and a 25-bit odd c = (+-1 / My) mod 2^25,
    Mx = (c My -+ 1) / 2^25 is an integer, and x / y = (c -+ 1/My) 2^(a-b-25) sits a relative
    1 / (c My) > 2^-49 from the midpoint c 2^(a-b-25) (the lemma's bound is tight)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        my = int(rng.integers(1 << 22, 1 << 23)) * 2 + 1
        sign = int(rng.choice((-1, 1)))
        c = (sign * pow(my, -1, 1 << 25)) % (1 << 25)
        if c < (1 << 24):
            continue
        mx, rem = divmod(c * my - sign, 1 << 25)
        if rem or not (1 << 23) <= mx < (1 << 24):
            continue
        a, b = (int(v) for v in rng.integers(-64, 0, 2))
        out.append((math.ldexp(mx, a - 24), math.ldexp(my, b - 24)))
    return out


def test_quotients_keep_away_from_fp32_midpoints():
    """The lemma behind div_rn: |x/y - mid| > 2^-49 (x/y) for every fp32 midpoint mid."""
    pairs = _near_midpoint_pairs(4000)
    closest, coarse_wrong = 1.0, 0
    for x, y in pairs:
        q = Fraction(x) / Fraction(y)
        fq = float(q)  # fp64 nearest: locates the fp32 binade
        e = math.frexp(fq)[1] - 1  # q in [2^e, 2^(e+1))
        ulp = Fraction(2) ** (e - 23)
        k = math.floor(q / ulp)
        mids = [(Fraction(2 * j + 1, 2)) * ulp for j in (k - 1, k, k + 1)]
        d = min(abs(q - m) for m in mids) / q
        closest = min(closest, float(d))
        assert d > Fraction(1, 2 ** 49), (x, y, float(d))
        # so any fp64 value within 2^-51 of q rounds like IEEE fp32 division
        want = np.float32(x) / np.float32(y)
        for s in (-1, 1):
            approx = float(q * (1 + Fraction(s, 2 ** 51)))
            assert np.float32(approx) == want, (x, y, s)
            # planted fault: an approximation 16x coarser than fp64's does round wrongly here
            coarse_wrong += np.float32(float(q * (1 + Fraction(s, 2 ** 47)))) != want
    # the construction reaches the bound (else the test proves little)
    assert closest < 2.0 ** -48 and coarse_wrong > 0


# ------------------------------------------------------------------ the PTX on a Hopper GPU


def _gpu() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return cupy.cuda.is_available()


_GPU_SRC = r"""
extern "C" __global__ void div_probe(const float* x, const float* y, float* q, float* q6,
                                     float* q2688, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = x[i], b = y[i], r;
    asm("DIV" : "=f"(r) : "f"(a), "f"(b));
    q[i] = r;
    asm("C6" : "=f"(r) : "f"(a));
    q6[i] = r;
    asm("C2688" : "=f"(r) : "f"(a));
    q2688[i] = r;
}
"""


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU with CuPy (the helpers' PTX is sm_20+ fp64 code)")
def test_helpers_on_the_gpu():
    """The helpers' PTX text, run through CuPy (NVRTC inline asm), against IEEE fp32 division
    (numpy's, on the host) on 4M random pairs in the kernel's domain plus the lemma's tight cases."""
    import cupy as cp

    from fp4gen.device.sm100 import fp64_division as F

    def probe(div_ptx):
        src = (_GPU_SRC.replace("DIV", F.cuda_asm(div_ptx)).replace("C6", F.cuda_asm(F.const_ptx(6.0)))
               .replace("C2688", F.cuda_asm(F.const_ptx(2688.0))))
        return cp.RawKernel(src, "div_probe")

    # planted fault: one Newton step and no remainder correction leave 2^-38, not 2^-52
    step = "fma.rn.f64 e, yd, r, 0d3FF0000000000000;\nfma.rn.f64 r, r, e, r;\n"
    fix = "fma.rn.f64 e, yd, q, xd;\nfma.rn.f64 q, e, r, q;\n"
    assert F.DIV_PTX.count(step) == 2 and F.DIV_PTX.count(fix) == 1
    coarse = F.DIV_PTX.replace(step, "", 1).replace(fix, "")
    rng = np.random.default_rng(17)
    n = 1 << 22
    # r_prev / r: both in [2^-64, 1); amax / 6 and pmax / 2688 take the same x
    xs = np.float32(rng.uniform(1.0, 2.0, n) * 2.0 ** rng.integers(-64, 0, n))
    ys = np.float32(rng.uniform(1.0, 2.0, n) * 2.0 ** rng.integers(-64, 0, n))
    pairs = _near_midpoint_pairs(200000)
    xs[:len(pairs)] = [p[0] for p in pairs]
    ys[:len(pairs)] = [p[1] for p in pairs]
    x, y = cp.asarray(xs), cp.asarray(ys)

    def run(kernel):
        outs = [cp.full(n, cp.nan, dtype=cp.float32) for _ in range(3)]
        kernel(((n + 255) // 256,), (256,), (x, y, *outs, cp.int32(n)))
        cp.cuda.Device().synchronize()
        return outs

    q, q6, q2688 = run(probe(F.DIV_PTX))
    q_coarse = cp.asnumpy(run(probe(coarse))[0])
    assert np.count_nonzero(q_coarse.view(np.int32) != (xs / ys).view(np.int32)) > 0
    for name, got, want in (("div_rn", q, xs / ys), ("div_rn_const 6", q6, xs / np.float32(6.0)),
                            ("div_rn_const 2688", q2688, xs / np.float32(2688.0))):
        got = cp.asnumpy(got)
        ok = np.abs(want) >= np.float32(2.0 ** -126)  # the domain: normal quotients
        bad = (got.view(np.int32) != want.view(np.int32)) & ok
        assert int(bad.sum()) == 0, f"{name}: {int(bad.sum())} of {int(ok.sum())} differ"
        assert int(ok.sum()) > n // 2
