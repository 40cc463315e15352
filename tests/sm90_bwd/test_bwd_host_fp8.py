"""The FP8 backward's host side and tile algorithm on the CPU, without a GPU.

The generated FP8 ``backward`` (FP8 S from the forward's Q/K, FP8 dP and dV) runs for real,
argument list included; the CUDA-only pieces it calls are replaced by their torch
equivalents (the forward module's quantizers in their oracle mode, which the fused kernels
match bit for bit on CUDA), and the kernel launch by ``emulate_fp8_kernel``: a torch transcription of
what each CTA computes from exactly the operands the host passed (payloads, scales, the
permuted dO^T). A wrong argument order, scale, layout of dO^T or formula shows up as a
mismatch with the numerics oracle; the CuTe layouts themselves are checked on the GPU
(run_on_device.py).

The FP8-dS variant (``dS : fp8e4m3``, ``BWD_DS_FP8``) is run the same way: its stand-in for
the fused ``quantize_blockwise(x, transposed=...)`` also writes the transposed payload copy
(``transposed_operand``), and ``emulate_fp8_ds_kernel`` reads dK's and dQ's B operands back
out of those copies (Q^T, K^T tiles in their per-32 token orders) and rounds dS per 64 x 128
tile with the kernel's power-of-two scale walk.
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
from fp4gen.device.layout import FP8_DS_KEY_PERM, FP8_P_KEY_PERM  # noqa: E402
from fp4gen.device.quantize import TRANSPOSED_TILES, transposed_operand, transposed_tiles  # noqa: E402

_MODS = {}
E4M3 = torch.float8_e4m3fn


def _e4m3(x):
    return x.clamp(-448.0, 448.0).to(E4M3).float()


def _per_query_head(x, H: int, n: int):
    """(B, S, Hx, D) -> (B, H, n, D) float32, zero-padded to n tokens, key/value heads repeated
    for the query heads of their group (the kernel's view of one operand per query head)."""
    B, _, _, D = x.shape
    x = x.float().repeat_interleave(H // x.shape[2], dim=2).permute(0, 2, 1, 3)
    out = torch.zeros(B, H, n, D)
    out[:, :, : x.shape[2]] = x
    return out


def matmul(a, b):
    """The emulators' MMA: an exact-enough fp32 product (``mma_e8m13`` models Hopper's FP8 one)."""
    return a @ b


# Hopper's FP8 wgmma (QGMMA) does not accumulate in full fp32: the products of one k-step
# (32 for 8-bit operands) and the accumulator are aligned to the largest exponent among them
# and kept to 13 fraction bits (an e8m13 accumulator), truncated toward zero: public analyses
# of H100's FP8 GEMMs (DeepSeek-V3's report: "around 14 bits"; software emulations that match
# the hardware drop 10 of fp32's 23 fraction bits). A model, not a bit-exact transcription.
FP8_MMA_K = 32
FP8_ACC_FRAC_BITS = 13


def mma_e8m13(a, b, k_step: int = FP8_MMA_K, frac_bits: int = FP8_ACC_FRAC_BITS):
    """a (..., M, K) @ b (..., K, N) with the FP8 wgmma's accumulation modelled: per k-step the
    accumulator and the step's products, aligned to the largest exponent, each truncated to
    ``frac_bits`` fraction bits below it, then summed (float64, returned as float32)."""
    a, b = a.double(), b.double()
    acc = torch.zeros(a.shape[:-1] + (b.shape[-1],), dtype=torch.float64)
    for k0 in range(0, a.shape[-1], k_step):
        terms = a[..., :, None, k0:k0 + k_step] * b[..., k0:k0 + k_step, :].transpose(-1, -2)[..., None, :, :]
        terms = torch.cat([acc[..., None], terms], dim=-1)
        big = terms.abs().amax(-1, keepdim=True)
        _, e = torch.frexp(big)  # big = m 2^e, m in [0.5, 1): its leading bit is 2^(e - 1)
        quantum = torch.ldexp(torch.ones_like(big), e - 1 - frac_bits)
        acc = (torch.trunc(terms / quantum) * quantum).sum(-1)
    return acc.float()


def _visible(mod, key, qry, Sq, Sk, causal_offset, window=None):
    """(keys, queries) bool: the kernel's mask (keys past Sk, causal, or the config's window;
    ``window`` overrides it: a planted fault)."""
    from fp4gen.numerics import masking

    win = window if window is not None else mod.BWD_CONFIG.window
    ok = key < Sk
    if win is not None:
        ok = ok & masking.allowed(qry[0], key[:, 0], Sq, Sk, tuple(win)).T
    elif mod.BWD_CAUSAL:
        ok = ok & (key <= qry + causal_offset)
    return ok


def _query_tiles(mod, n, causal_offset, n_tiles, window=None):
    """[first, end) query tiles key tile ``n``'s CTA walks (the kernel's own trace-time rule)."""
    win = window if window is not None else mod.BWD_CONFIG.window
    if win is not None:
        import dataclasses

        from fp4gen.device.sm90.backward import Backward

        cfg = dataclasses.replace(mod.BWD_CONFIG, window=tuple(win))
        lo, hi = Backward(cfg).window_query_tiles(n, causal_offset, n_tiles)
        return range(int(lo), int(hi))
    m_min = max(n * mod.BWD_TILE_N - causal_offset, 0) // mod.BWD_TILE_M if mod.BWD_CAUSAL else 0
    return range(m_min, n_tiles)


def emulate_fp8_kernel(mod, args, softmax_scale, causal_offset, gqa, mma=matmul, window=None):
    """What the compiled FP8 kernel computes, tile by tile, from the arguments it is given.
    ``mma``: the product of its FP8 MMAs (S^T, dP^T, dV; ``mma_e8m13`` for the hardware's
    accumulation); ``window``: a (left, right) that replaces the config's (a planted fault)."""
    assert mod.BWD_S_FP8 and mod.BWD_DO_FP8 and not mod.BWD_DETERMINISTIC
    (q, k, v8, do8, q8, k8, scale_q, scale_k, dot8, scale_v, scale_do, lse2, dsum, dq_acc, dk_h, dv_h) = args
    bf = torch.bfloat16
    assert v8.dtype == E4M3 and do8.dtype == E4M3 and q8.dtype == E4M3 and dot8.dtype == E4M3
    BM, BN, QB = mod.BWD_TILE_M, mod.BWD_TILE_N, mod._bwd_dquant.BLOCK
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    sqp = lse2.shape[2]
    c = torch.tensor(softmax_scale * math.log2(math.e), dtype=torch.float32)

    def heads(x, n):
        return _per_query_head(x, H, n)

    n_kb = -(-Sk // BN)
    Q, Qp = heads(q, sqp), heads(q8, sqp)
    Kb, Kp = heads(k, n_kb * BN), heads(k8, n_kb * BN)
    Vp, dOp = heads(v8, n_kb * BN), heads(do8, sqp)
    # dO^T as the dV MMA reads it: column 32b + p holds query 32b + FP8_P_KEY_PERM[p]
    perm = torch.tensor(FP8_P_KEY_PERM)
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
        tiles = _query_tiles(mod, n, causal_offset, sqp // BM, window)
        m_min = tiles.start
        for m in tiles:
            q0 = m * BM
            S = mma(Kp[:, :, k0:k0 + BN], Qp[:, :, q0:q0 + BM].transpose(-1, -2))  # (keys, queries)
            scale = (sq[:, :, q0][..., None, None] * sk[:, :, k0][..., None, None]) * c
            key = torch.arange(k0, k0 + BN)[:, None]
            qry = torch.arange(q0, q0 + BM)[None, :]
            bad = ~_visible(mod, key, qry, Sq, Sk, causal_offset, window)
            S = (S * scale).masked_fill(bad, float("-inf"))
            P256 = torch.exp2(S - (lse2[:, :, None, q0:q0 + BM] - 8.0))
            dP = mma(Vp[:, :, k0:k0 + BN], dOp[:, :, q0:q0 + BM].transpose(-1, -2))
            dS = P256 * (dP * (svdo[..., None, None] / 256.0) - dsum[:, :, None, q0:q0 + BM] / 256.0)
            P8, dSb = _e4m3(P256), dS.to(bf).float()
            qt = dOt_nat[..., q0:q0 + BM]  # (B, H, D, queries)
            if qt.shape[3] < BM:
                qt = torch.nn.functional.pad(qt, (0, BM - qt.shape[3]))
            dV += mma(P8, qt.transpose(-1, -2))
            dK += dSb @ Q[:, :, q0:q0 + BM].to(bf).float()
            dq_rows[:, :, q0:q0 + BM] += dSb.transpose(-1, -2) @ Kb[:, :, k0:k0 + BN].to(bf).float()
        rows = slice(k0, min(k0 + BN, Sk))
        nr = rows.stop - rows.start
        dV = dV * (scale_do[..., None, None] / 256.0)
        dk_h[:, rows] = (dK[:, :, :nr] * softmax_scale).permute(0, 2, 1, 3).to(dk_h.dtype)
        dv_h[:, rows] = dV[:, :, :nr].permute(0, 2, 1, 3).to(dv_h.dtype)
    dq_acc += dq_rows_to_fragments(dq_rows)


def _cover(x):
    """The smallest power of two c with 448 c >= x (float32 x >= 0); 1 below 2^-117 (0
    included), NaN for inf / NaN: the kernel's ``ptx.fp8_scale_cover``, written with frexp
    instead of its exponent bits."""
    x64 = x.double()
    m, e = torch.frexp(x64 / 448.0)  # x / 448 = m 2^e, m in [0.5, 1)
    c = torch.ldexp(torch.ones_like(x64), torch.where(m == 0.5, e - 1, e))
    c = torch.where(x64 < 2.0 ** -117, torch.ones_like(c), c)
    return torch.where(x64.isfinite(), c, torch.full_like(c, float("nan"))).float()


def _from_tiles(xt8, perm):
    """A transposed FP8 copy as the kernel's TMA reads it, (B, Hx, tiles, D, T): tile t is one
    D x T block of tokens t T ..., position 32 g + p holding token 32 g + perm[p] -> the payload
    values in natural token order, (B, Hx, tiles T, D) float."""
    B, Hx, T, D, M = xt8.shape
    flat = xt8.float().permute(0, 1, 3, 2, 4).reshape(B, Hx, D, T * M)
    idx = (torch.arange(T * M // 32)[:, None] * 32 + torch.tensor(perm)[None, :]).reshape(-1)
    nat = torch.zeros_like(flat)
    nat[..., idx] = flat
    return nat.transpose(-1, -2)


def emulate_fp8_ds_kernel(mod, args, softmax_scale, causal_offset, gqa, record=None, mma=matmul, window=None):
    """What the compiled FP8-dS kernel (``BWD_DS_FP8``) computes, tile by tile, from the
    arguments it is given. As ``emulate_fp8_kernel`` for S, P, dP and dV; dS in e4m3 with one
    power-of-two scale c per 64 x 128 tile, Q's block scale folded in (f = s_q / c): each CTA
    (128 keys of one query head) walks its query tiles from m_min up, c guessed from the
    previous tile (1 before the first), taken from the tile's own max (``_cover``) on the first
    tile and when f |dS| would pass 448 (and then handed on times 4), halved for the next tile
    when it stayed below 28 (448 / 16).
    dQ = (c s_k / s_q) dS8 K8 with K8 read from the K^T copy (kt8), dK = sum c dS8^T Q8 with Q8
    read from the Q^T copy (qt8), kept in units of the current c as the kernel keeps its
    accumulator. ``record``: a list that gets (c, whether c came from the tile's max, key tile,
    query tile) per visited tile, (B, H) tensors for the first two. ``mma``, ``window``: as
    ``emulate_fp8_kernel`` (here every MMA is FP8)."""
    assert mod.BWD_S_FP8 and mod.BWD_DO_FP8 and mod.BWD_DS_FP8 and not mod.BWD_DETERMINISTIC
    (q, k, v8, do8, q8, k8, scale_q, scale_k, dot8, scale_v, scale_do, qt8, kt8,
     lse2, dsum, dq_acc, dk_h, dv_h) = args
    for t in (v8, do8, q8, k8, dot8, qt8, kt8):
        assert t.dtype == E4M3, t.dtype
    BM, BN, QB = mod.BWD_TILE_M, mod.BWD_TILE_N, mod._bwd_dquant.BLOCK
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    assert gqa == (g > 1)
    sqp = lse2.shape[2]
    n_kb, n_qb = -(-Sk // BN), -(-Sq // QB)
    # the transposed copies: Q^T in 64-query tiles, K^T in 128-key tiles (TRANSPOSED_TILES)
    assert qt8.shape == (B, H, n_qb * QB // BM, D, BM) and qt8.shape[2] * BM >= sqp, qt8.shape
    assert kt8.shape == (B, Hkv, n_kb, D, BN), kt8.shape
    c_log2 = torch.tensor(softmax_scale * math.log2(math.e), dtype=torch.float32)

    def heads(x, n):
        return _per_query_head(x, H, n)

    Qp, Kp = heads(q8, sqp), heads(k8, n_kb * BN)  # S^T = K Q^T: the natural payloads
    Vp, dOp = heads(v8, n_kb * BN), heads(do8, sqp)
    Qt = _from_tiles(qt8, FP8_P_KEY_PERM)  # (B, H, tiles * 64, D): dK's B operand
    Kt = _from_tiles(kt8, FP8_DS_KEY_PERM).repeat_interleave(g, dim=1)  # (B, H, n_kb * 128, D): dQ's
    dOt = _from_tiles(dot8, FP8_P_KEY_PERM)  # dO^T as dV's B operand (natural query order)
    sq = scale_q.float()  # (B, H, n_qb)
    sk = scale_k.float().repeat_interleave(g, dim=1)  # (B, H, n_kb)
    svdo = scale_v.float().repeat_interleave(g, dim=1) * scale_do.float() * (1.0 / 256.0)
    dq_rows = torch.zeros(dq_acc.shape)
    for n in range(n_kb):
        k0 = n * BN
        dV = torch.zeros(B, H, BN, D)
        acc_dK = torch.zeros(B, H, BN, D)  # dK / dk_c
        dk_c = torch.ones(B, H)
        c_next = torch.ones(B, H)
        tiles = _query_tiles(mod, n, causal_offset, sqp // BM, window)
        m_min = tiles.start
        for m in tiles:
            q0 = m * BM
            s_q = sq[:, :, q0 // QB]  # (B, H): a 64-row tile lies in one 128-token Q block
            S = mma(Kp[:, :, k0:k0 + BN], Qp[:, :, q0:q0 + BM].transpose(-1, -2))  # (keys, queries)
            key = torch.arange(k0, k0 + BN)[:, None]
            qry = torch.arange(q0, q0 + BM)[None, :]
            bad = ~_visible(mod, key, qry, Sq, Sk, causal_offset, window)
            S = (S * ((s_q * sk[:, :, n]) * c_log2)[..., None, None]).masked_fill(bad, float("-inf"))
            P256 = torch.exp2(S - (lse2[:, :, None, q0:q0 + BM] - 8.0))
            dP = mma(Vp[:, :, k0:k0 + BN], dOp[:, :, q0:q0 + BM].transpose(-1, -2))
            # f dS^T = (2^8 P^T) (f dP^T / 2^8 - f D / 2^8), f = s_q / c with c this tile's guess
            c = c_next
            f = s_q * (1.0 / c)
            dSf = P256 * (dP * (svdo * f)[..., None, None]
                          - dsum[:, :, None, q0:q0 + BM] * (f / 256.0)[..., None, None])
            amax = dSf.abs().amax(dim=(-2, -1))
            redo = (amax > 448.0) | (m == m_min)
            small = (amax < 28.0) & ~redo
            c_new = torch.where(redo, _cover(amax * c), c)
            dSf = dSf * (c / c_new)[..., None, None]
            c = c_new
            c_next = torch.where(redo, c * 4.0, torch.where(small & (c >= 2.0 ** -59), c * 0.5, c))  # the kernel's floor
            if record is not None:
                record.append((c.clone(), redo.clone(), n, m))
            dS8 = _e4m3(dSf)  # (keys, queries)
            dV += mma(_e4m3(P256), dOt[:, :, q0:q0 + BM])
            dq_rows[:, :, q0:q0 + BM] += ((c * sk[:, :, n] / s_q)[..., None, None]
                                          * mma(dS8.transpose(-1, -2), Kt[:, :, k0:k0 + BN]))
            change = c != dk_c
            acc_dK = torch.where(change[..., None, None], acc_dK * (dk_c / c)[..., None, None], acc_dK)
            dk_c = torch.where(change, c, dk_c)
            acc_dK += mma(dS8, Qt[:, :, q0:q0 + BM])
        rows = slice(k0, min(k0 + BN, Sk))
        nr = rows.stop - rows.start
        dK = acc_dK * dk_c[..., None, None]
        dV = dV * (scale_do.float()[..., None, None] / 256.0)
        dk_h[:, rows] = (dK[:, :, :nr] * softmax_scale).permute(0, 2, 1, 3).to(dk_h.dtype)
        dv_h[:, rows] = dV[:, :, :nr].permute(0, 2, 1, 3).to(dv_h.dtype)
    dq_acc += dq_rows_to_fragments(dq_rows)


@pytest.fixture
def cpu_fp8_backward(cpu_backward_checks):
    """Let the generated FP8 backward run on CPU tensors: torch stand-ins for the CUDA-only
    quantization and preprocessing kernels, the emulated kernel for the launch."""
    monkeypatch = cpu_backward_checks

    def patch(mod, transposed_perms=None, mma=matmul, window=None):
        """``transposed_perms``: {"q" or "k": a token order per 32} overriding
        ``TRANSPOSED_TILES``' for that copy (a deliberately wrong layout); ``mma``, ``window``:
        passed to the emulated kernel."""
        # the forward module's quantizers with the numerics oracle's arithmetic (fast=False):
        # torch's own CPU float division rounds some scales one ulp away from CUDA's
        def quantize_blockwise(x, transposed=None):
            payload, scale = mod._quantize(x, True, fast=False)
            if transposed is None:
                return payload, scale
            # the fused kernel's third tensor: the same codes transposed (its torch reference)
            if transposed_perms and transposed in transposed_perms:
                tokens = TRANSPOSED_TILES[transposed][0]
                tiles = -(-x.shape[1] // mod.QUANT_BLOCK) * mod.QUANT_BLOCK // tokens
                return payload, scale, transposed_tiles(payload, tiles, tokens, transposed_perms[transposed])
            return payload, scale, transposed_operand(payload, transposed)

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
        emulate = emulate_fp8_ds_kernel if getattr(mod, "BWD_DS_FP8", False) else emulate_fp8_kernel
        monkeypatch.setattr(mod, "_bwd_launch",
                            lambda args, s, off, gqa: emulate(mod, args, s, off, gqa, mma=mma, window=window))
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


# ------------------------------------------------------------------ FP8 dS (dS : fp8e4m3)

_DS_MODS = {}


def _ds_module(d, causal, tmp_path_factory):
    """The FP8-dS backward (``bm.make_spec(d, causal, False, fp8="ds")``, the template behind
    generated/sm90_fp8_train_ds8_causal_d128_sm90a.py), rendered and imported once per (d, causal)."""
    key = (d, causal)
    if key not in _DS_MODS:
        plan = bm.make_plan(d, causal, False, "ds")
        mod = bm.load_module(plan, str(tmp_path_factory.mktemp("bwdfp8ds")))
        assert mod.BWD_S_FP8 and mod.BWD_DO_FP8 and mod.BWD_DS_FP8
        _DS_MODS[key] = (plan.spec, mod)
    return _DS_MODS[key]


def _capture_launch(mod, monkeypatch):
    """Record the arguments of every kernel launch (then run the emulation as before)."""
    seen, real = [], mod._bwd_launch

    def launch(args, s, off, gqa):
        seen.append((args, s, off, gqa))
        real(args, s, off, gqa)

    monkeypatch.setattr(mod, "_bwd_launch", launch)
    return seen


def _ds_inputs(mod, spec, case, seed=0):
    """q, k, v, do of ``case`` on the CPU and the FP8 forward's own o and lse (the oracle's)."""
    from fp4gen.numerics import reference

    q, k, v, do = bm.make_inputs(case, spec.head_dim, seed, "cpu")
    o, lse = reference.forward(q, k, v, spec)
    return q, k, v, o.to(torch.bfloat16), lse.float(), do


# causal: square, ragged (partial query and key tiles), Sq > Sk (queries that see no key; one
# key tile walking from query tile 3), Sq < Sk (key tiles that start at query tile 0), GQA;
# unmasked once (every walk from query tile 0) at D = 64
DS_CASES = [("basic", 128, True), ("ragged_200", 128, True), ("sq300_sk100", 128, True),
            ("sq100_sk300", 128, True), ("gqa_6_2", 128, True), ("basic", 64, False)]
# the emulation vs the numerics oracle (dP fp32): both round dS per tile with the same scales
# (test_fp8_ds_emulation_picks_the_oracles_tile_scales), from fp32 values that differ in the
# last bits (summation order), so an e4m3 rounding of P or dS can land one step apart.
# Measured on DS_CASES: <= 9e-5, and 2e-4 on dv of sq100_sk300 (the H200 kernel was ~3e-3 off
# a float64 emulation of itself: ex2.approx, FMA contraction)
TOL_DS_ORACLE = 5e-3


@pytest.mark.parametrize("case,d,causal", DS_CASES)
def test_fp8_ds_host_and_tile_algorithm(case, d, causal, cpu_fp8_backward, tmp_path_factory, monkeypatch):
    spec, mod = _ds_module(d, causal, tmp_path_factory)
    cpu_fp8_backward(mod)
    seen = _capture_launch(mod, monkeypatch)
    row = bm.check_case(mod, spec, case, device="cpu")
    assert row["pass"], row
    errs = {n: row[n]["vs_oracle"] for n in ("dq", "dk", "dv")}
    assert max(errs.values()) < TOL_DS_ORACLE, errs
    # the launch got the fused quantizer's transposed copies of the very payloads S reads
    (args, _, off, gqa), = seen
    q, k = args[0], args[1]
    q8, k8, qt8, kt8 = args[4], args[5], args[11], args[12]
    assert off == k.shape[1] - q.shape[1] and gqa == (q.shape[2] != k.shape[2])
    for x8, xt8, op in ((q8, qt8, "q"), (k8, kt8, "k")):
        assert xt8.dtype == E4M3 and torch.equal(xt8.view(torch.uint8), transposed_operand(x8, op).view(torch.uint8))


def test_fp8_ds_emulation_picks_the_oracles_tile_scales(cpu_fp8_backward, tmp_path_factory, monkeypatch):
    """The emulation walks the tiles as the oracle's recipe does (``fp8_ds_tile_scale``): the
    same c for every visited tile in the same order (key tile outer, query tiles ascending from
    m_min), GQA and Sq != Sk included. The gradients alone hardly tell scale rules apart (a
    power-of-two scale only moves which tiny values fall into e4m3's subnormals), so the scales
    are compared exactly."""
    for case in ("gqa_6_2", "sq300_sk100"):
        spec, mod = _ds_module(128, True, tmp_path_factory)
        cpu_fp8_backward(mod)
        mine = []
        monkeypatch.setattr(mod, "_bwd_launch",
                            lambda args, s, off, gqa: emulate_fp8_ds_kernel(mod, args, s, off, gqa, record=mine))
        q, k, v, o, lse, do = _ds_inputs(mod, spec, case)
        mod.backward(q, k, v, o, lse, do)
        _, oracle = bm.oracle_tile_scales(monkeypatch, (q, k, v, o, lse, do, spec))  # one row chunk
        assert len(mine) == len(oracle) > 0, (case, len(mine), len(oracle))
        assert all(torch.equal(c, r) for (c, _, _, _), r in zip(mine, oracle)), case
        if case == "sq300_sk100":  # the one key tile starts at query tile 3 (queries 192...)
            assert [(n, m) for _, _, n, m in mine] == [(0, 3), (0, 4)]
        else:  # not vacuous: some tiles kept the guess handed on, some took their own max
            redo = torch.stack([r for _, r, _, _ in mine])
            assert bool(redo.any()) and not bool(redo.all())


def _as_bytes(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


# launch argument index -> prepared index: q8, k8, scale_q, scale_k, scale_v, v8, qt8, kt8
_PREPARED_ARGS = ((4, 0), (5, 1), (6, 3), (7, 4), (9, 5), (2, 6), (11, 7), (12, 8))


@pytest.mark.parametrize("cuda_scales", [True, False])
def test_fp8_ds_prepared_matches_quantizing_anew(cuda_scales, cpu_fp8_backward, tmp_path_factory, monkeypatch):
    """``prepared`` from the module's own quantize_inputs(..., fast=False, for_backward=True,
    transposed_qk=True) (9 tensors, its torch path on the CPU) reaches the kernel as is (the
    launch gets prepared's Q/K payloads, scales, V payload and transposed copies: nothing is
    quantized twice) and gives the gradients of the backward quantizing q, k, v itself.

    ``cuda_scales``: the torch path's scales with CUDA's arithmetic (amax times fl32(1/448), as
    torch on CUDA and the fused quantizer compute amax / 448.0; the oracle quantizer's, which
    the stand-ins use): bit-identical gradients. Otherwise torch's CPU division, which puts some
    scales one ulp off: the same payload codes but a few, and gradients within the
    emulation-vs-oracle tolerance (measured 4.7e-3 on dq)."""
    spec, mod = _ds_module(128, True, tmp_path_factory)
    cpu_fp8_backward(mod)
    if cuda_scales:
        # the forward's quantize_inputs calls its runtime host's quantize (runtime/sm90_host.py)
        quantize = mod._HOST.quantize
        monkeypatch.setattr(mod._HOST, "quantize", lambda x, per_block, fast=True: quantize(x, per_block, fast=False))
    seen = _capture_launch(mod, monkeypatch)
    q, k, v, o, lse, do = _ds_inputs(mod, spec, "gqa_6_2")
    prepared = mod.quantize_inputs(q, k, v, fast=False, for_backward=True, transposed_qk=True)
    assert len(prepared) == 9
    assert [tuple(t.shape) for t in prepared[7:]] == [(1, 6, 4, 128, 64), (1, 2, 2, 128, 128)]
    with_state = mod.backward(q, k, v, o, lse, do, prepared=prepared)
    anew = mod.backward(q, k, v, o, lse, do)
    (args, *_), (args_anew, *_) = seen
    for a, p in _PREPARED_ARGS:
        assert args[a].dtype == prepared[p].dtype and torch.equal(_as_bytes(args[a]), _as_bytes(prepared[p])), (a, p)
    for a, _ in _PREPARED_ARGS:
        if cuda_scales:
            assert torch.equal(_as_bytes(args[a]), _as_bytes(args_anew[a])), a
        elif args[a].dtype == E4M3:
            same = (_as_bytes(args[a]) == _as_bytes(args_anew[a])).float().mean().item()
            assert same > 0.999, (a, same)
        else:
            torch.testing.assert_close(args[a], args_anew[a], rtol=2 ** -23, atol=0)
    for name, x, y in zip(("dq", "dk", "dv"), with_state, anew):
        assert x.dtype == y.dtype == torch.bfloat16 and x.shape == y.shape
        if cuda_scales:
            assert torch.equal(x, y), name
        else:
            assert bm.rel_l2(x, y) < TOL_DS_ORACLE, (name, bm.rel_l2(x, y))


def test_fp8_ds_prepared_needs_the_transposed_copies(cpu_fp8_backward, tmp_path_factory):
    """A ``prepared`` without Q^T / K^T (quantize_inputs without transposed_qk: 7 tensors, or
    the forward's 6), or with copies of the wrong shape, is refused before anything runs; so
    is transposed_qk without for_backward."""
    spec, mod = _ds_module(128, True, tmp_path_factory)
    cpu_fp8_backward(mod)
    q, k, v, o, lse, do = _ds_inputs(mod, spec, "ragged_200")
    for kw in ({"for_backward": True}, {}):
        prepared = mod.quantize_inputs(q, k, v, fast=False, **kw)
        assert len(prepared) == (7 if kw else 6)
        with pytest.raises(ValueError, match="transposed"):
            mod.backward(q, k, v, o, lse, do, prepared=prepared)
    with pytest.raises(ValueError, match="transposed_qk"):
        mod.quantize_inputs(q, k, v, fast=False, transposed_qk=True)
    # nine tensors, but Q^T and K^T swapped (or made for other q, k): refused by shape
    good = mod.quantize_inputs(q, k, v, fast=False, for_backward=True, transposed_qk=True)
    swapped = good[:7] + (good[8], good[7])
    with pytest.raises(ValueError, match="prepared's qt8 must be float8_e4m3fn of shape"):
        mod.backward(q, k, v, o, lse, do, prepared=swapped)


@pytest.mark.parametrize("op,wrong", [("k", FP8_P_KEY_PERM), ("q", FP8_DS_KEY_PERM)])
def test_fp8_ds_emulation_catches_a_wrong_transposed_layout(op, wrong, cpu_fp8_backward, tmp_path_factory):
    """Not vacuous: K^T built in P's token order instead of dS's (FP8_P_KEY_PERM for
    FP8_DS_KEY_PERM) gives a wrong dQ, Q^T in dS's order a wrong dK; the other gradients stay
    right (S reads the natural payloads). Measured: 1.02 (dQ) / 1.02 (dK) off the oracle, the
    others < 1e-4."""
    spec, mod = _ds_module(128, True, tmp_path_factory)
    cpu_fp8_backward(mod, transposed_perms={op: wrong})
    row = bm.check_case(mod, spec, "ragged_200", device="cpu")
    bad, good = ("dq", "dk") if op == "k" else ("dk", "dq")
    assert not row["pass"], row
    assert row[bad]["vs_oracle"] > 0.1 and row[good]["vs_oracle"] < TOL_DS_ORACLE, row
    assert row["dv"]["vs_oracle"] < TOL_DS_ORACLE, row
