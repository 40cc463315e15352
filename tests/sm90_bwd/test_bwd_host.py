"""The backward's host side and tile algorithm on the CPU, without a GPU.

The generated ``backward`` (argument checks, LSE/D preprocessing, padding, dQ scaling, GQA
sums, dtypes) runs for real; only the kernel launch is replaced by ``emulate_kernel``, a
torch transcription of what each CTA does (key tile of 128, query tiles of 64 from the
causal start tile, masking, P = exp2(S c - LSE2), bf16 A operands, dQ accumulation, dK
scaled in the epilogue). So a wrong tile range, mask, padding value or host formula shows
up here; the CuTe layouts themselves are only checked on the GPU (test_bwd_gpu.py).
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_modules as bm  # noqa: E402
from fp4gen.device.bwd_prep import dq_rows_to_fragments  # noqa: E402

_MODS = {}


def emulate_kernel(mod, args, softmax_scale, causal_offset, gqa):
    """What the compiled kernel computes, tile by tile, in float32 torch."""
    bf = torch.bfloat16
    det = mod.BWD_DETERMINISTIC
    if det:
        q, k, v, do, lse2, dsum, dq_acc, dq_turn, dk_h, dv_h = args
    else:
        q, k, v, do, lse2, dsum, dq_acc, dk_h, dv_h = args
    assert dk_h.dtype == (torch.float32 if gqa else bf)
    BM, BN = mod.BWD_TILE_M, mod.BWD_TILE_N
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    c = torch.tensor(softmax_scale * math.log2(math.e), dtype=torch.float32)
    sqp = lse2.shape[2]
    assert sqp % BM == 0 and dq_acc.shape == (B, H, sqp, D)

    def pad_rows(x, n):  # TMA: rows past the end read as zeros
        out = torch.zeros(x.shape[0], x.shape[1], n, x.shape[3])
        out[:, :, : x.shape[2]] = x.float()
        return out

    Q = pad_rows(q.permute(0, 2, 1, 3), sqp)
    dO = pad_rows(do.permute(0, 2, 1, 3), sqp)
    n_kb = -(-Sk // BN)
    K = pad_rows(k.repeat_interleave(g, dim=2).permute(0, 2, 1, 3), n_kb * BN)
    V = pad_rows(v.repeat_interleave(g, dim=2).permute(0, 2, 1, 3), n_kb * BN)
    dq_rows = torch.zeros(dq_acc.shape)  # the kernel adds fragment-ordered tiles (bwd_prep)
    causal = mod.BWD_CAUSAL
    for n in range(n_kb):
        k0 = n * BN
        Kt, Vt = K[:, :, k0:k0 + BN], V[:, :, k0:k0 + BN]
        dK = torch.zeros(B, H, BN, D)
        dV = torch.zeros(B, H, BN, D)
        m_min = max(k0 - causal_offset, 0) // BM if causal else 0
        for m in range(m_min, sqp // BM):
            q0 = m * BM
            Qt, dOt = Q[:, :, q0:q0 + BM], dO[:, :, q0:q0 + BM]
            S = Kt @ Qt.transpose(-1, -2)  # (keys, queries)
            key = torch.arange(k0, k0 + BN)[:, None]
            qry = torch.arange(q0, q0 + BM)[None, :]
            bad = key >= Sk
            if causal:
                bad = bad | (key > qry + causal_offset)
            S = S.masked_fill(bad, float("-inf"))
            P = torch.exp2(S * c - lse2[:, :, None, q0:q0 + BM])
            dP = Vt @ dOt.transpose(-1, -2)
            dS = P * (dP - dsum[:, :, None, q0:q0 + BM])
            Pb, dSb = P.to(bf).float(), dS.to(bf).float()
            dV += Pb @ dOt
            dK += dSb @ Qt
            dq_rows[:, :, q0:q0 + BM] += dSb.transpose(-1, -2) @ Kt
        rows = slice(k0, min(k0 + BN, Sk))
        nr = rows.stop - rows.start
        dk_h[:, rows] = (dK[:, :, :nr] * softmax_scale).permute(0, 2, 1, 3).to(dk_h.dtype)
        dv_h[:, rows] = dV[:, :, :nr].permute(0, 2, 1, 3).to(dv_h.dtype)
    dq_acc += dq_rows_to_fragments(dq_rows)


def _module(d, causal, det, tmp_path_factory):
    key = (d, causal, det)
    if key not in _MODS:
        plan = bm.make_plan(d, causal, det)
        _MODS[key] = (plan.spec, bm.load_module(plan, str(tmp_path_factory.mktemp("bwdhost"))))
    return _MODS[key]


@pytest.fixture
def cpu_backward(cpu_backward_checks):
    """Let the generated backward run on CPU tensors with the emulated kernel."""
    monkeypatch = cpu_backward_checks

    def patch(mod):
        monkeypatch.setattr(mod, "_bwd_launch", lambda args, s, off, gqa: emulate_kernel(mod, args, s, off, gqa))
        return mod
    return patch


CPU_CASES = ["basic", "ragged_200", "s1", "sq100_sk300", "sq300_sk100", "gqa_6_2", "large_logits"]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_host_and_tile_algorithm(case, causal, cpu_backward, tmp_path_factory):
    spec, mod = _module(64, causal, False, tmp_path_factory)
    cpu_backward(mod)
    row = bm.check_case(mod, spec, case, device="cpu")
    assert row["pass"], row
    # the bf16 outputs the contract promises
    q, k, v, do = bm.make_inputs(case, 64, device="cpu")
    o, lse = bm.torch_forward(q, k, v, causal, spec.scale)
    for x, ref in zip(mod.backward(q, k, v, o, lse, do), (q, k, v)):
        assert x.dtype == torch.bfloat16 and x.shape == ref.shape


def test_deterministic_variant_host(cpu_backward, tmp_path_factory):
    spec, mod = _module(64, True, True, tmp_path_factory)
    cpu_backward(mod)
    row = bm.check_case(mod, spec, "gqa_6_2", device="cpu")
    assert row["pass"], row


def test_emulator_catches_a_wrong_causal_start(cpu_backward, tmp_path_factory, monkeypatch):
    """The check is not vacuous: shifting the causal offset by one tile breaks it."""
    spec, mod = _module(64, True, False, tmp_path_factory)
    monkeypatch.setattr(mod, "_bwd_launch",
                        lambda args, s, off, gqa: emulate_kernel(mod, args, s, off + 64, gqa))
    row = bm.check_case(mod, spec, "basic", device="cpu")
    assert not row["pass"]
