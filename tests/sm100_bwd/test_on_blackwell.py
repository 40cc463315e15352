"""The sm100a backward on a Blackwell GPU (sm_100): skipped everywhere else, i.e. in this project
so far (no such GPU here). Ready for the first machine that has one:

    /work/venv/bin/python -m pytest -q -m gpu tests/sm100_bwd/test_on_blackwell.py

Same shapes and tolerance as the CPU emulation (test_host_emulated.py), against the exact
float64 gradient (the FP8-dO variant against the reference backend of its spec), plus bitwise
repeatability of the deterministic variant.
"""
from __future__ import annotations

import pytest
import torch

from fp4gen.lowering import sm100

import bwd100 as H
from test_host_emulated import CASES, exact_grads, rel_l2

ON_SM100 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_SM100, reason="needs an sm_100 (Blackwell) GPU")]


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bwd_gpu")
    out = {}
    for causal, det in ((True, False), (False, True)):
        plan = H.plan_text(H.spec_text(name=f"bwd_gpu_{int(causal)}{int(det)}", causal=causal, det=det))
        out[(causal, det)] = H.load_source(sm100.render(plan), tmp / f"m{int(causal)}{int(det)}.py")
    plan = H.plan_text(H.spec_text(name="bwd_gpu_fp8", extra="    dO : fp8e5m2\n    dP : fp32\n"))
    out["fp8"] = (H.load_source(sm100.render(plan), tmp / "mfp8.py"), plan.spec)
    return out


def _inputs(case, seed=0):
    B, Sq, Sk, Hh, Hkv = CASES[case]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(torch.bfloat16)
            for s in ((B, Sq, Hh, 128), (B, Sk, Hkv, 128), (B, Sk, Hkv, 128), (B, Sq, Hh, 128))]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", [(True, False), (False, True)])
def test_matches_the_exact_gradient(case, variant, modules):
    mod = modules[variant]
    q, k, v, do = _inputs(case)
    o, lse, ref = exact_grads(q, k, v, do, variant[0], mod.SOFTMAX_SCALE)
    got = mod.backward(*(x.cuda() for x in (q, k, v, o, lse, do)))
    errs = [rel_l2(x.cpu(), r) for x, r in zip(got, ref)]
    assert max(errs) < 1e-2, dict(zip(("dq", "dk", "dv"), errs))


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_do_matches_the_reference_backend(case, modules):
    """FP8 dO (kind::f8f6f4 dP^T and dV): against fp4gen's reference backward of its spec, as
    in the CPU emulation (tests/sm100/emulator/test_emulate_backward_fp8.py)."""
    from fp4gen.numerics import reference

    mod, spec = modules["fp8"]
    q, k, v, do = _inputs(case)
    o, lse, _ = exact_grads(q, k, v, do, True, mod.SOFTMAX_SCALE)
    got = mod.backward(*(x.cuda() for x in (q, k, v, o, lse, do)))
    ref = reference.backward(q, k, v, o, lse, do, spec)
    errs = [rel_l2(x.cpu(), r) for x, r in zip(got, ref)]
    assert max(errs) < 1e-3, dict(zip(("dq", "dk", "dv"), errs))


def test_deterministic_variant_is_bitwise_repeatable(modules):
    mod = modules[(False, True)]
    q, k, v, do = _inputs("gqa_6_2")
    o, lse, _ = exact_grads(q, k, v, do, False, mod.SOFTMAX_SCALE)
    args = [x.cuda() for x in (q, k, v, o, lse, do)]
    first = mod.backward(*args)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, mod.backward(*args)))
