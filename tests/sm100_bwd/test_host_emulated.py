"""The generated sm100a ``backward`` host code and the kernel's tile algorithm, on the CPU.

The generated ``backward`` (argument checks, LSE2/D preprocessing and padding, dQ scaling,
GQA sums, dtypes) runs for real on CPU tensors; only ``_bwd_launch`` is replaced by
``emulate_kernel``, a torch transcription of one CTA per key tile of the template (query tiles
of 128 from the causal start tile, masks, P^T = exp2(S^T c - LSE2), bf16 P^T/dS^T, dK scaled in
the epilogue, zero dK/dV for key tiles no query sees). Results are compared with the exact
float64 gradient. This checks the host side and the tile algorithm, not the CuTe layouts or
the compiled kernel (never run: there is no Blackwell GPU).
"""
from __future__ import annotations

import math

import pytest
import torch

from fp4gen.lowering import sm100
from fp4gen.numerics import reference as refnum
from fp4gen.numerics.formats import E4M3, E5M2, decode, round_to

import bwd100 as H

CASES = {  # name: (B, Sq, Sk, H, Hkv)
    "basic": (1, 256, 256, 2, 2),
    "ragged_200": (1, 200, 200, 2, 2),
    "s1": (1, 1, 1, 1, 1),
    "sq100_sk300": (1, 100, 300, 2, 2),
    "sq300_sk100": (1, 300, 100, 2, 2),  # causal: the first 200 queries see no key
    "gqa_6_2": (2, 130, 190, 6, 2),
}


def emulate_kernel(mod, args, softmax_scale, causal_offset, gqa):
    """What the compiled kernel computes, CTA by CTA, in float32 torch."""
    bf = torch.bfloat16
    q, k, v, do, lse2, dsum, dq_acc, dq_turn, dk_h, dv_h, scales = args
    assert dk_h.dtype == (torch.float32 if gqa else bf)
    cfg = mod.BWD_CONFIG
    if cfg.do_fp8:  # V and dO come as FP8 codes; their scales apply after dP^T's and dV's MMAs
        assert v.dtype == do.dtype == torch.uint8
        v = decode(v, E4M3)
        do = decode(do, {"e4m3": E4M3, "e5m2": E5M2}[cfg.do_format])
    else:
        assert torch.equal(scales, torch.ones_like(scales))
    BM, BN = mod.BWD_CONFIG.tile_m, mod.BWD_CONFIG.tile_n
    B, Sq, Hh, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hh // Hkv
    c = torch.tensor(softmax_scale * math.log2(math.e), dtype=torch.float32)
    sqp = lse2.shape[2]
    assert sqp % BM == 0 and dq_acc.shape == (B, Hh, sqp, D) and dq_turn.shape == (B, Hh, sqp // BM)

    def pad_rows(x, n):  # TMA: rows past the end read as zeros
        out = torch.zeros(x.shape[0], x.shape[1], n, x.shape[3])
        out[:, :, : x.shape[2]] = x.float()
        return out

    Q = pad_rows(q.permute(0, 2, 1, 3), sqp)
    dO = pad_rows(do.permute(0, 2, 1, 3), sqp)
    n_kb = -(-Sk // BN)
    K = pad_rows(k.repeat_interleave(g, dim=2).permute(0, 2, 1, 3), n_kb * BN)
    V = pad_rows(v.repeat_interleave(g, dim=2).permute(0, 2, 1, 3), n_kb * BN)
    m_max = -(-Sq // BM)
    for n in range(n_kb):
        k0 = n * BN
        Kt, Vt = K[:, :, k0:k0 + BN], V[:, :, k0:k0 + BN]
        dK = torch.zeros(B, Hh, BN, D)
        dV = torch.zeros(B, Hh, BN, D)
        m_min = max(k0 - causal_offset, 0) // BM if mod.BWD_CONFIG.causal else 0
        for m in range(m_min, m_max):
            q0 = m * BM
            Qt, dOt = Q[:, :, q0:q0 + BM], dO[:, :, q0:q0 + BM]
            S = Kt @ Qt.transpose(-1, -2)  # S^T: (keys, queries)
            key = torch.arange(k0, k0 + BN)[:, None]
            qry = torch.arange(q0, q0 + BM)[None, :]
            bad = key >= Sk
            if mod.BWD_CONFIG.causal:
                bad = bad | (key > qry + causal_offset)
            P = torch.exp2((S * c - lse2[:, :, None, q0:q0 + BM]).masked_fill(bad, float("-inf")))
            dP = Vt @ dOt.transpose(-1, -2) * scales[:, :, 0, None, None]
            dS = P * (dP - dsum[:, :, None, q0:q0 + BM])
            Pb = round_to(P * 2.0 ** cfg.p_fp8_scale_log2, E4M3) if cfg.do_fp8 else P.to(bf).float()
            dSb = dS.to(bf).float()
            dV += Pb @ dOt
            dK += dSb @ Qt
            dq_acc[:, :, q0:q0 + BM] += dSb.transpose(-1, -2) @ Kt
        rows = slice(k0, min(k0 + BN, Sk))
        nr = rows.stop - rows.start
        dk_h[:, rows] = (dK[:, :, :nr] * softmax_scale).permute(0, 2, 1, 3).to(dk_h.dtype)
        dV = dV * scales[:, :, 1, None, None]  # FP8 dO: s_do / 2^8 (bf16: 1)
        dv_h[:, rows] = dV[:, :, :nr].permute(0, 2, 1, 3).to(dv_h.dtype)


def exact_grads(q, k, v, do, causal, scale):
    """float64 forward (o, lse) and the analytic gradients; rows that see no key have P = 0."""
    f = torch.float64
    B, Sq, Hh, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = Hh // Hkv
    Q, dO = q.to(f).transpose(1, 2), do.to(f).transpose(1, 2)
    K = k.to(f).repeat_interleave(g, dim=2).transpose(1, 2)
    V = v.to(f).repeat_interleave(g, dim=2).transpose(1, 2)
    s = Q @ K.transpose(-1, -2) * scale
    if causal:
        bad = torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + (Sk - Sq)
        s = s.masked_fill(bad, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
    o = p @ V
    dV = p.transpose(-1, -2) @ dO
    dS = p * (dO @ V.transpose(-1, -2) - (dO * o).sum(-1, keepdim=True))
    dQ = dS @ K * scale
    dK = dS.transpose(-1, -2) @ Q * scale

    def kv(x):  # per query head -> per kv head (GQA sum)
        return x.view(B, Hkv, g, Sk, D).sum(2).transpose(1, 2)

    return (o.transpose(1, 2).to(torch.bfloat16), lse.float(),
            (dQ.transpose(1, 2), kv(dK), kv(dV)))


def rel_l2(x, ref):
    x, ref = x.double(), ref.double()
    floor = 1e-4 * math.sqrt(ref.numel())  # gradients that are zero up to rounding: absolute
    return ((x - ref).norm() / max(ref.norm().item(), floor)).item()


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bwd_host")
    causal = H.load_source(sm100.render(H.example_plan()), tmp / "causal.py")
    plan_nc = H.plan_text(H.spec_text(name="bwd_host_nc", causal=False, det=True))
    noncausal = H.load_source(sm100.render(plan_nc), tmp / "noncausal.py")
    plan_fp8 = H.plan_text(H.spec_text(name="bwd_host_fp8", extra="    dO : fp8e4m3\n    dP : fp32\n"))
    fp8 = H.load_source(sm100.render(plan_fp8), tmp / "fp8.py")
    return {True: causal, False: noncausal, "fp8": fp8, "fp8_spec": plan_fp8.spec}


@pytest.fixture
def on_cpu(cpu_backward_checks):
    """Let a generated backward run on CPU tensors with the emulated kernel."""
    monkeypatch = cpu_backward_checks

    def patch(mod, offset_error=0):
        monkeypatch.setattr(mod, "_require_sm100", lambda: None)
        monkeypatch.setattr(mod, "_bwd_launch", lambda args, s, off, gqa:
                            emulate_kernel(mod, args, s, off + offset_error, gqa))
        return mod
    return patch


def run_case(mod, name, causal, seed=0):
    B, Sq, Sk, Hh, Hkv = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    D = mod.BWD_CONFIG.head_dim
    q = torch.randn(B, Sq, Hh, D, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(B, Sk, Hkv, D, generator=gen).to(torch.bfloat16)
    do = torch.randn(B, Sq, Hh, D, generator=gen).to(torch.bfloat16)
    o, lse, ref = exact_grads(q, k, v, do, causal, mod.SOFTMAX_SCALE)
    got = mod.backward(q, k, v, o, lse, do)
    for x, like in zip(got, (q, k, v)):
        assert x.dtype == torch.bfloat16 and x.shape == like.shape
    return [rel_l2(x, r) for x, r in zip(got, ref)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal", [True, False])
def test_host_and_tile_algorithm_match_the_exact_gradient(case, causal, modules, on_cpu):
    mod = on_cpu(modules[causal])
    errs = run_case(mod, case, causal)
    # bf16 P^T / dS^T / outputs give about 2.5e-3 on these cases (a wrong diagonal gives > 0.5)
    assert max(errs) < 1e-2, dict(zip(("dq", "dk", "dv"), errs))


@pytest.mark.parametrize("case", ["basic", "ragged_200", "sq100_sk300", "gqa_6_2"])
def test_fp8_do_host_and_tile_algorithm_match_the_reference_backend(case, modules, on_cpu):
    """FP8 dO (E4M3 here): the module's quantization of V and dO, its scales and D, and the tile
    algorithm, against fp4gen's reference backward of the same spec (its own FP8 numerics)."""
    mod = on_cpu(modules["fp8"])
    B, Sq, Sk, Hh, Hkv = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q, do = (torch.randn(B, Sq, Hh, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, Sk, Hkv, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
    o, lse, exact = exact_grads(q, k, v, do, True, mod.SOFTMAX_SCALE)
    got = mod.backward(q, k, v, o, lse, do)
    ref = refnum.backward(q, k, v, o, lse, do, modules["fp8_spec"])
    errs = {n: rel_l2(x, r) for n, x, r in zip(("dq", "dk", "dv"), got, ref)}
    far = {n: rel_l2(x, r) for n, x, r in zip(("dq", "dk", "dv"), got, exact)}
    # the same numerics up to fp32 summation order and bf16 outputs; the exact gradient is
    # 1-4 % away (E4M3 dO and V, E4M3 P^T)
    assert max(errs.values()) < 1e-3, errs
    assert 2e-3 < max(far.values()) < 0.1, far


def test_a_wrong_causal_start_is_caught(modules, on_cpu):
    """Not vacuous: the emulated kernel with its diagonal one key tile off fails the comparison."""
    mod = on_cpu(modules[True], offset_error=128)
    assert max(run_case(mod, "basic", True)) > 0.1


def test_backward_refuses_without_an_sm100_gpu(modules):
    """Without monkeypatching: the module's own refusal, before any argument is looked at."""
    from fp4gen.runtime.checks import UnsupportedDeviceError

    with pytest.raises(UnsupportedDeviceError, match="sm_100a"):
        modules[True].backward(None, None, None, None, None, None)
