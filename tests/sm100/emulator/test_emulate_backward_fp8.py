"""End to end: the generated sm100a backward with an FP8 dO (generated/
sm100_bwd_fp8do_causal_d128_sm100a.py: dP^T = V dO^T and dV += P^T dO as kind::f8f6f4, V E4M3,
dO E5M2, P^T E4M3 of 2^8 P in TMEM) executed from its compiled PTX on every CTA of its grid,
through the module's own host code (its quantization of V and dO and their scales), against
fp4gen's reference backward of the module's spec (the same FP8 numerics); and planted faults
that must each make the gradients they touch disagree.

Marked slow: each emulation is a few seconds per CTA, the backward compiles once (~10 s, cached).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
KERNEL = "sm100_bwd_fp8do_causal_d128"
_RESULTS = {}


def _emulate(sq, sk, mutation=None, **kw):
    from fp4gen.lowering.emulator.run import emulate_backward

    key = (sq, sk, mutation, tuple(sorted(kw.items())))
    if key not in _RESULTS:
        src = (ROOT / "generated" / f"{KERNEL}_sm100a.py").read_text()
        _RESULTS[key] = emulate_backward(src, seqlen_q=sq, seqlen_k=sk, seed=0, ptx_mutation=mutation, **kw)
    return _RESULTS[key]


def _tol():
    from fp4gen.lowering.emulator.run import BWD_REFERENCE_TOLERANCE

    return BWD_REFERENCE_TOLERANCE


# square causal (2 key tiles), ragged 200 (TMA zero-fills keys past Sk), Sq > Sk (the first
# queries see no key), two heads x two batches (each (batch, head) has its own dO scale)
@pytest.mark.parametrize("sq,sk,heads,batch", [(256, 256, 1, 1), (200, 200, 1, 1), (256, 128, 1, 1),
                                               (128, 256, 2, 2)])
def test_gradients_match_the_reference_backend(sq, sk, heads, batch):
    kw = dict(heads=heads, batch=batch) if heads * batch > 1 else {}
    res = _emulate(sq, sk, **kw)
    assert res.oracle == "reference"
    assert max(res.errors.values()) < _tol(), res.errors
    # the FP8 roundings themselves (E5M2 dO, E4M3 V and P^T) against the exact gradient
    assert 0.01 < max(res.exact_errors.values()) < 0.15, res.exact_errors
    assert not res.notes


def _scale_loads(ptx: str) -> dict:
    """The two ld.global.b32 of the (batch, head) scales: offset "" (dP^T's) and "+4" (dV's) ->
    (destination register, base register)."""
    hits = re.findall(r"ld\.global\.b32 \t(%r\d+), \[(%rd\d+)(\+4)?\];", ptx)
    by = {off: (reg, base) for reg, base, off in hits}
    assert len(hits) == 2 and set(by) == {"", "+4"} and by[""][1] == by["+4"][1], hits
    return by


def _dv_reads_the_dp_scale(ptx: str) -> str:
    reg, base = _scale_loads(ptx)["+4"]
    return ptx.replace(f"ld.global.b32 \t{reg}, [{base}+4];", f"ld.global.b32 \t{reg}, [{base}];")


def _dp_reads_the_dv_scale(ptx: str) -> str:
    reg, base = _scale_loads(ptx)[""]
    return ptx.replace(f"ld.global.b32 \t{reg}, [{base}];", f"ld.global.b32 \t{reg}, [{base}+4];")


def _p_as_e5m2(ptx: str) -> str:
    """P^T rounded to E5M2 instead of E4M3 (the dV MMA still reads E4M3 codes)."""
    return ptx.replace("cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.satfinite.e5m2x2.f32")


def test_a_wrong_dv_scale_is_caught():
    res = _emulate(256, 256, _dv_reads_the_dp_scale)
    assert res.errors["dv"] > 100 * _tol() and res.errors["dk"] < _tol() and res.errors["dq"] < _tol(), res.errors


def test_a_wrong_dp_scale_is_caught():
    res = _emulate(256, 256, _dp_reads_the_dv_scale)
    # dS^T = P^T (dP^T - D) feeds dK and dQ; dV does not read dP^T
    assert res.errors["dk"] > 100 * _tol() and res.errors["dq"] > 100 * _tol(), res.errors
    assert res.errors["dv"] < _tol(), res.errors


def test_p_in_the_wrong_fp8_format_is_caught():
    res = _emulate(256, 256, _p_as_e5m2)
    assert res.errors["dv"] > 100 * _tol() and res.errors["dk"] < _tol(), res.errors
