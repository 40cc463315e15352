"""The FP8 backward's host side and tile algorithm on the CPU, without a GPU.

The generated FP8 ``backward`` (FP8 S from the forward's Q/K, FP8 dP and dV) runs for real,
argument list included; the CUDA-only pieces it calls are replaced by their torch
equivalents (the forward module's quantizers in their oracle mode, which the fused kernels
match bit for bit on CUDA), and the kernel launch by ``emulate_fp8_kernel``: a torch transcription of
what each CTA computes from exactly the operands the host passed (payloads, scales, the
permuted dO^T). A wrong argument order, scale, layout of dO^T or formula shows up as a
mismatch with the numerics oracle; the CuTe layouts themselves are checked on the GPU
(run_on_device.py).
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_modules as bm  # noqa: E402
from fp4gen.device.bwd_prep import dot_tiles, dot_untiles  # noqa: E402
from fp4gen.device.bwd_prep import dq_rows_to_fragments  # noqa: E402

_MODS = {}
E4M3 = torch.float8_e4m3fn


def _e4m3(x):
    return x.clamp(-448.0, 448.0).to(E4M3).float()


def emulate_fp8_kernel(mod, args, softmax_scale, causal_offset, gqa):
    """What the compiled FP8 kernel computes, tile by tile, from the arguments it is given."""
    assert mod.BWD_S_FP8 and mod.BWD_DO_FP8 and not mod.BWD_DETERMINISTIC
    (q, k, v8, do8, q8, k8, scale_q, scale_k, dot8, scale_v, scale_do, lse2, dsum, dq_acc, dk_h, dv_h) = args
    bf = torch.bfloat16
    assert v8.dtype == E4M3 and do8.dtype == E4M3 and q8.dtype == E4M3 and dot8.dtype == E4M3
    BM, BN, QB = mod.BWD_TILE_M, mod.BWD_TILE_N, mod._BWD_QUANT_BLOCK
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    sqp = lse2.shape[2]
    c = torch.tensor(softmax_scale * math.log2(math.e), dtype=torch.float32)

    def heads(x, n):  # (B, S, Hx, D) -> (B, H, n, D) zero-padded, query heads expanded
        x = x.float().repeat_interleave(H // x.shape[2], dim=2).permute(0, 2, 1, 3)
        out = torch.zeros(B, H, n, D)
        out[:, :, : x.shape[2]] = x
        return out

    n_kb = -(-Sk // BN)
    Q, Qp = heads(q, sqp), heads(q8, sqp)
    Kb, Kp = heads(k, n_kb * BN), heads(k8, n_kb * BN)
    Vp, dOp = heads(v8, n_kb * BN), heads(do8, sqp)
    # dO^T as the dV MMA reads it: column 32b + p holds query 32b + FP8_P_KEY_PERM[p]
    perm = torch.tensor(mod.FP8_P_KEY_PERM)
    assert dot8.shape == (B, H, sqp // BM, D, BM)  # one contiguous D x 64 block per query tile
    dOt = dot_untiles(dot8.view(torch.uint8)).view(E4M3).float()  # (B, H, D, Sqp)
    cols = dOt.shape[3]
    src = (torch.arange(cols // 32)[:, None] * 32 + perm[None, :]).reshape(-1)
    dOt_nat = torch.zeros_like(dOt)
    dOt_nat[..., src] = dOt
    dOt_nat = dOt_nat[..., : min(cols, sqp)]
    sq = scale_q.repeat_interleave(QB, dim=2)  # (B, H, per query)
    sk = scale_k.repeat_interleave(g, dim=1).repeat_interleave(QB, dim=2)
    svdo = (scale_v.repeat_interleave(g, dim=1) * scale_do)  # (B, H)
    dq_rows = torch.zeros(dq_acc.shape)  # the kernel adds fragment-ordered tiles (bwd_prep)
    for n in range(n_kb):
        k0 = n * BN
        dK = torch.zeros(B, H, BN, D)
        dV = torch.zeros(B, H, BN, D)
        m_min = max(k0 - causal_offset, 0) // BM if mod.BWD_CAUSAL else 0
        for m in range(m_min, sqp // BM):
            q0 = m * BM
            S = Kp[:, :, k0:k0 + BN] @ Qp[:, :, q0:q0 + BM].transpose(-1, -2)  # (keys, queries)
            scale = (sq[:, :, q0][..., None, None] * sk[:, :, k0][..., None, None]) * c
            key = torch.arange(k0, k0 + BN)[:, None]
            qry = torch.arange(q0, q0 + BM)[None, :]
            bad = key >= Sk
            if mod.BWD_CAUSAL:
                bad = bad | (key > qry + causal_offset)
            S = (S * scale).masked_fill(bad, float("-inf"))
            P256 = torch.exp2(S - (lse2[:, :, None, q0:q0 + BM] - 8.0))
            dP = Vp[:, :, k0:k0 + BN] @ dOp[:, :, q0:q0 + BM].transpose(-1, -2)
            dS = P256 * (dP * (svdo[..., None, None] / 256.0) - dsum[:, :, None, q0:q0 + BM] / 256.0)
            P8, dSb = _e4m3(P256), dS.to(bf).float()
            qt = dOt_nat[..., q0:q0 + BM]  # (B, H, D, queries)
            if qt.shape[3] < BM:
                qt = torch.nn.functional.pad(qt, (0, BM - qt.shape[3]))
            dV += P8 @ qt.transpose(-1, -2)
            dK += dSb @ Q[:, :, q0:q0 + BM].to(bf).float()
            dq_rows[:, :, q0:q0 + BM] += dSb.transpose(-1, -2) @ Kb[:, :, k0:k0 + BN].to(bf).float()
        rows = slice(k0, min(k0 + BN, Sk))
        nr = rows.stop - rows.start
        dV = dV * (scale_do[..., None, None] / 256.0)
        dk_h[:, rows] = (dK[:, :, :nr] * softmax_scale).permute(0, 2, 1, 3).to(dk_h.dtype)
        dv_h[:, rows] = dV[:, :, :nr].permute(0, 2, 1, 3).to(dv_h.dtype)
    dq_acc += dq_rows_to_fragments(dq_rows)


@pytest.fixture
def cpu_fp8_backward(cpu_backward_checks):
    """Let the generated FP8 backward run on CPU tensors: torch stand-ins for the CUDA-only
    quantization and preprocessing kernels, the emulated kernel for the launch."""
    monkeypatch = cpu_backward_checks

    def patch(mod):
        # the forward module's quantizers with the numerics oracle's arithmetic (fast=False):
        # torch's own CPU float division rounds some scales one ulp away from CUDA's
        def quantize_blockwise(x):
            return mod._quantize(x, True, fast=False)

        def quantize_v_operand(x):
            payload, scale = mod._quantize(x, False, fast=False)
            return mod._v_operand(payload), scale

        def preprocess(o, do, lse, sqp, scale_do=None):
            B, Sq, H, D = do.shape
            f32 = torch.float32
            lse2 = torch.full((B, H, sqp), float("inf"))
            l2 = lse.to(f32) * math.log2(math.e)
            lse2[:, :, :Sq] = torch.where(torch.isneginf(l2), torch.full_like(l2, float("inf")), l2)
            do8 = (do.to(f32) / scale_do[:, None, :, None]).clamp(-448.0, 448.0).to(E4M3)
            dsum = torch.zeros((B, H, sqp))
            dsum[:, :, :Sq] = ((do8.float() * scale_do[:, None, :, None]) * o.to(f32)).sum(-1).permute(0, 2, 1)
            return lse2, dsum, torch.zeros((B, H, sqp, D)), do8

        def preprocess_fp8(o, do, lse, sqp):
            dot8, scale_do = quantize_v_operand(do)
            return preprocess(o, do, lse, sqp, scale_do) + (dot_tiles(dot8, sqp), scale_do)

        def scale_per_head(x):
            return mod._quantize(x, False, fast=False)[1]

        def quantize_per_head(x, scale):
            return (x.float() / scale[:, None, :, None]).clamp(-448.0, 448.0).to(E4M3)

        monkeypatch.setattr(mod._bwd_dquant, "quantize_blockwise", quantize_blockwise)
        monkeypatch.setattr(mod._bwd_dquant, "quantize_v_operand", quantize_v_operand)
        monkeypatch.setattr(mod._bwd_prep, "preprocess", preprocess)
        monkeypatch.setattr(mod._bwd_prep, "preprocess_fp8", preprocess_fp8)
        monkeypatch.setattr(mod._bwd_prep, "scale_per_head", scale_per_head)
        monkeypatch.setattr(mod._bwd_prep, "quantize_per_head", quantize_per_head)
        monkeypatch.setattr(mod, "_bwd_launch",
                            lambda args, s, off, gqa: emulate_fp8_kernel(mod, args, s, off, gqa))
        return mod
    return patch


def _module(d, causal, tmp_path_factory):
    key = (d, causal)
    if key not in _MODS:
        plan = bm.make_plan(d, causal, False, True)
        _MODS[key] = (plan.spec, bm.load_module(plan, str(tmp_path_factory.mktemp("bwdfp8"))))
    return _MODS[key]


@pytest.mark.parametrize("case", ["basic", "ragged_200", "sq300_sk100", "gqa_6_2"])
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_host_and_tile_algorithm(case, causal, cpu_fp8_backward, tmp_path_factory):
    spec, mod = _module(64, causal, tmp_path_factory)
    cpu_fp8_backward(mod)
    row = bm.check_case(mod, spec, case, device="cpu")
    assert row["pass"], row
    # on random inputs the emulation is as close to the oracle as the H200 kernel was
    if case in ("basic", "gqa_6_2"):
        assert max(row[n]["vs_oracle"] for n in ("dq", "dk", "dv")) < 5e-3, {n: row[n] for n in ("dq", "dk", "dv")}


def test_fp8_emulation_catches_a_missing_p_scale(cpu_fp8_backward, tmp_path_factory, monkeypatch):
    """Not vacuous: a host that forgot dO's scale (dV off by scale_do) fails the check."""
    spec, mod = _module(64, True, tmp_path_factory)
    cpu_fp8_backward(mod)
    real = mod._bwd_launch

    def wrong(args, s, off, gqa):
        args = list(args)
        args[10] = torch.ones_like(args[10])  # scale_do
        real(tuple(args), s, off, gqa)

    monkeypatch.setattr(mod, "_bwd_launch", wrong)
    row = bm.check_case(mod, spec, "basic", device="cpu")
    assert not row["pass"]


def test_fp8_emulation_catches_an_unpermuted_dOt(cpu_fp8_backward, tmp_path_factory, monkeypatch):
    """dO^T must carry P's FP8 register order (FP8_P_KEY_PERM per 32 queries): a plain
    transpose gives wrong dV."""
    spec, mod = _module(64, True, tmp_path_factory)
    cpu_fp8_backward(mod)
    real = mod._bwd_launch

    def wrong(args, s, off, gqa):
        args = list(args)
        do8 = args[3]  # natural-layout payload (B, Sq, H, D)
        B, Sq, H, D = do8.shape
        plain = torch.zeros(dot_untiles(args[8].view(torch.uint8)).shape, dtype=torch.uint8)
        plain[..., :Sq] = do8.view(torch.uint8).permute(0, 2, 3, 1)
        args[8] = dot_tiles(plain, plain.shape[3]).view(E4M3)
        real(tuple(args), s, off, gqa)

    monkeypatch.setattr(mod, "_bwd_launch", wrong)
    row = bm.check_case(mod, spec, "basic", device="cpu")
    assert not row["pass"] and row["dv"]["vs_oracle"] > 0.1 and row["dk"]["vs_oracle"] < 5e-3, row
