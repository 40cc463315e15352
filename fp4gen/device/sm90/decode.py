"""The Hopper (sm_90a) split-KV decode kernel (issue 22): one CuTe DSL class for every sm90a
``kv_cache`` spec, parameterised by a frozen ``DecodeConfig`` (``decode_config.py``).

One CTA per (split, KV head, sequence). Its 64 rows are the ``gqa`` query heads of that KV head
times the sequence's query tokens (row r: token r // gqa, head hk * gqa + r % gqa; rows past
Sq * gqa are padding and are not stored), so one read of each K/V tile serves every query head
of the group. The CTA walks the key tiles of its split (``numerics.kvcache.split_tiles``: runs
of ceil(tiles / splits) tiles of the sequence's own tile count) and writes the normalized
partial o_s (fp32) and its LSE in log2 units; the host combines the splits with
``numerics.kvcache.combine`` (docs/decode.md).

Per key tile (4 warps, 128 threads):

1. K and V rows into SMEM, 8 elements per copy: contiguous, token j of sequence b is cache
   row (b, j); paged, (page_table[b, j // page], j % page). Rows past the sequence are zeros.
2. S = Q K^T on the tensor cores, warp-level ``mma.sync`` m16n8k16 (BF16 in, FP32 out), each
   warp 16 of the 64 rows; S goes to SMEM.
3. The online softmax as the reference's tile loop (``numerics.reference._tile_loop``): two
   threads per row, x = s * softmax_scale * log2 e, masked keys -inf (past the sequence;
   causal bottom-right), m_new = max(m, max x), p = 2^(x - m_new) rounded to bf16 into SMEM
   for PV, l = l * 2^(m - m_new) + sum of the unrounded p, the row's rescale into SMEM.
4. O = O * rescale + P V with the same MMA (P and V read back from SMEM).

FP8 caches (``fp8e4m3(scale=token|tensor)``): the E4M3 rows are copied into an SMEM staging
tile and widened to BF16 there (exact: every E4M3 value is a BF16 value), so the same BF16 MMAs
run on them. The scales stay out of the MMAs, which keeps the reference's arithmetic
(``numerics.kvcache``: value = e4m3 x scale in fp32): K's scale multiplies S's column (token)
or the softmax scale (tensor); V's tensor scale multiplies O at the end, and V's per-token scale
joins P: P' = bf16(p) x s_v(j) in fp32, fed to PV as two BF16 MMAs, hi = bf16(P') and lo =
bf16(P' - hi), so the product keeps ~16 bits of P' where one bf16 would round it to 8 (the
reference multiplies bf16(p) by the fp32 dequantized V). Why not FP8 wgmma with Q in E4M3: it
would round Q to E4M3, which the reference (Q : bf16) does not.

NVFP4 caches (``nvfp4``, ``nvfp4(tensor_scale=fp32)``): the packed E2M1 rows (element 2i in
byte i's low nibble) and their E4M3 block scales (one per 16 elements along D) are staged the
same way and widened to BF16 as e2m1 x e4m3 (x the per-KV-head power of two g): at most 4
significant bits, so exact in BF16, and the very values ``numerics.kvcache.dequantize_rows``
computes; the BF16 MMAs then run as for a BF16 cache.

Why mma.sync and not wgmma: decode is bound by the HBM read of the cache, not by the tensor
cores (64 rows x one K/V read), and the warp MMA needs neither SMEM matrix descriptors nor
swizzled layouts nor the asynchronous-proxy fences wgmma does, so every operand here is a
plain row-major SMEM tile and the kernel could be made right without a GPU to try it on. The
price is issue rate and synchronous loads (no TMA, no multi-stage ring yet): this is the
correctness-first kernel of issue 22's scope, not its speed.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from .. import ptx
from .decode_config import PAD, ROW_TILE, WARPS, DecodeConfig

VEC = 8  # bf16 elements per load/store (16 bytes)
VEC8 = 16  # e4m3 elements (or packed e2m1 bytes) per copy (16 bytes)
NVFP4_BLOCK = 16  # elements per E4M3 block scale along D
# the value of each E2M1 code 0..15 (numerics.formats.E2M1; tests compare)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# PAD (decode_config): bf16 elements of padding after each row of Q, K, V and P in SMEM: row
# pitches of 4 words mod 32 banks, so the 8 rows x 4 words a warp's mma.sync fragment load (or P
# store) touches are 32 different banks (unpadded, pitches of 64 or 32 words put all 8 rows in
# one bank: 8-way conflicts)


def row_slot(i: int) -> int:
    """Which of a thread's two rows value i of an m16n8 C fragment ((2 columns, 2 row halves),
    M blocks, N blocks) belongs to: 0 row g, 1 row g + 8."""
    return (i // 2) % 2


class DecodeKernel:
    """The split-KV decode of a BF16, FP8 or NVFP4 cache (contiguous or paged)."""

    def __init__(self, config: DecodeConfig):
        self.config = config
        self.tile_n, self.hdim = config.tile_n, config.head_dim
        self.threads = config.num_threads
        self.fp8 = config.fp8
        self.token_scale = config.token_scale
        self.nvfp4 = config.nvfp4
        # load stages: the copy targets (a bf16 cache's operand tiles, else the staging tiles and
        # scales) come in kv_stages copies; a widened operand tile is rewritten every tile
        self.stages = config.kv_stages
        self.k_stages = 1 if self.fp8 or self.nvfp4 else self.stages
        m, n, d = ROW_TILE, self.tile_n, self.hdim
        # every copy and widening loop splits its work evenly over the CTA's threads
        for work in (m * d // VEC, n * d // VEC, n * d // VEC8, n * d // 2 // VEC8, n * d // NVFP4_BLOCK,
                     n * d // 4, n * d // 8):
            assert work % self.threads == 0, (config, work)

    def shared_storage(self):
        """Q, K, V and P (bf16, rows padded by PAD), the staging tiles and scales of a narrow cache."""
        m, n, d = ROW_TILE, self.tile_n, self.hdim
        st, kst = self.stages, self.k_stages
        dp, np_ = d + PAD, n + PAD
        fields = {
            "sQ": cute.struct.Align[cute.struct.MemRange[BFloat16, m * dp], 128],
            "sK": cute.struct.Align[cute.struct.MemRange[BFloat16, n * dp * kst], 128],
            "sV": cute.struct.Align[cute.struct.MemRange[BFloat16, n * dp * kst], 128],
            "sP": cute.struct.Align[cute.struct.MemRange[BFloat16, m * np_], 128],
        }
        if self.fp8:  # the E4M3 staging tiles (widened into sK, sV)
            fields["sK8"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, n * d * st], 128]
            fields["sV8"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, n * d * st], 128]
        if self.nvfp4:  # packed E2M1 staging, the decoded block scales, the code -> value table
            fields["sK4"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, n * d // 2 * st], 128]
            fields["sV4"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, n * d // 2 * st], 128]
            fields["sKsc"] = cute.struct.Align[cute.struct.MemRange[Float32, n * d // NVFP4_BLOCK * st], 16]
            fields["sVsc"] = cute.struct.Align[cute.struct.MemRange[Float32, n * d // NVFP4_BLOCK * st], 16]
            fields["sLut"] = cute.struct.Align[cute.struct.MemRange[Float32, 16], 16]
        if self.token_scale:  # each key's K and V scale, and P's low half
            fields["sSK"] = cute.struct.Align[cute.struct.MemRange[Float32, n * st], 16]
            fields["sSV"] = cute.struct.Align[cute.struct.MemRange[Float32, n * st], 16]
            fields["sPlo"] = cute.struct.Align[cute.struct.MemRange[BFloat16, m * np_], 128]
        return cute.struct(type("DecodeStorage", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, H, D) bf16
        mK: cute.Tensor,  # (slots, page, Hkv, D) bf16, or uint8 E4M3 codes
        mV: cute.Tensor,  # (slots, page, Hkv, D) bf16, or uint8 E4M3 codes
        mSK,  # fp8: K's fp32 scales, (slots, page, Hkv) per token or (Hkv,) per tensor; else None
        mSV,  # fp8: V's, the same shape; nvfp4: K's / V's E4M3 block scale codes (slots, page, Hkv, D / 16)
        mGK,  # nvfp4(tensor_scale=fp32): K's per-KV-head power of two (Hkv,) fp32, else None
        mGV,
        mPageTable,  # paged: (B, pages per sequence) int32, else None
        mSeqlens: cute.Tensor,  # (B,) int32: keys of each sequence (cached + appended)
        mO: cute.Tensor,  # (splits, B, H, Sq, D) fp32: normalized partial outputs
        mLSE: cute.Tensor,  # (splits, B, H, Sq) fp32: log2-unit partial LSEs
        num_splits: Int32,
        softmax_scale_log2: Float32,  # softmax_scale * log2(e)
        stream,
    ):
        mma_op = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(mma_op, (WARPS, 1, 1))
        self.storage_t = self.shared_storage()
        grid = (num_splits, cute.size(mK.shape[2]), cute.size(mQ.shape[0]))
        self.kernel(mQ, mK, mV, mSK, mSV, mGK, mGV, mPageTable, mSeqlens, mO, mLSE, tiled_mma, num_splits,
                    softmax_scale_log2).launch(grid=grid, block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mSK, mSV, mGK, mGV, mPageTable,
               mSeqlens: cute.Tensor,
               mO: cute.Tensor, mLSE: cute.Tensor, tiled_mma: cute.TiledMma, num_splits: Int32,
               softmax_scale_log2: Float32):
        cfg = self.config
        m, n, d = ROW_TILE, self.tile_n, self.hdim
        gqa = cfg.gqa
        tidx, _, _ = cute.arch.thread_idx()
        split, hk, b = cute.arch.block_idx()
        storage = cutlass.utils.SmemAllocator().allocate(self.storage_t)
        dp, np_ = d + PAD, n + PAD  # row pitches of the bf16 tiles (bank-conflict-free fragment loads)
        sQ = storage.sQ.get_tensor(cute.make_layout((m, d), stride=(dp, 1)))
        st, kst = self.stages, self.k_stages

        def staged(rng, rows, cols, count, dtype=None, pitch=None):  # (rows, cols, stage), row-major per stage
            pitch = cols if pitch is None else pitch
            return rng.get_tensor(cute.make_layout((rows, cols, count), stride=(pitch, 1, rows * pitch)), dtype=dtype)

        sK_all = staged(storage.sK, n, d, kst, pitch=dp)
        sV_all = staged(storage.sV, n, d, kst, pitch=dp)
        # V as PV's (N = D, K = keys) operand: the same SMEM, transposed
        sVt_all = storage.sV.get_tensor(cute.make_layout((d, n, kst), stride=(1, dp, n * dp)))
        sP = storage.sP.get_tensor(cute.make_layout((m, n), stride=(np_, 1)))
        sK8 = sV8 = sK8w = sV8w = sKw = sVw = None
        if const_expr(self.fp8 or self.nvfp4):
            # the widened operand tiles as words of two bf16 (padded rows: row r starts at word r * dp / 2)
            sKw = storage.sK.get_tensor(cute.make_layout(n * dp // 2), dtype=cutlass.Uint32)
            sVw = storage.sV.get_tensor(cute.make_layout(n * dp // 2), dtype=cutlass.Uint32)
        if const_expr(self.fp8):
            sK8 = staged(storage.sK8, n, d, st)
            sV8 = staged(storage.sV8, n, d, st)
            # the same tiles as words: 4 E4M3 codes in, 2 bf16 pairs out
            sK8w = staged(storage.sK8, 1, n * d // 4, st, cutlass.Uint32)
            sV8w = staged(storage.sV8, 1, n * d // 4, st, cutlass.Uint32)
        sK4w = sV4w = sKsc = sVsc = sLut = sK4 = sV4 = None
        if const_expr(self.nvfp4):
            sK4 = staged(storage.sK4, n, d // 2, st)
            sV4 = staged(storage.sV4, n, d // 2, st)
            sK4w = staged(storage.sK4, 1, n * d // 8, st, cutlass.Uint32)  # 8 codes a word
            sV4w = staged(storage.sV4, 1, n * d // 8, st, cutlass.Uint32)
            sKsc = staged(storage.sKsc, 1, n * d // NVFP4_BLOCK, st)
            sVsc = staged(storage.sVsc, 1, n * d // NVFP4_BLOCK, st)
            sLut = storage.sLut.get_tensor(cute.make_layout(16))
            if tidx == 0:  # published by the first tile's barriers
                for i in cutlass.range_constexpr(16):
                    sLut[i] = Float32(E2M1_VALUES[i])
        sSK = sSV = sPlo = None
        if const_expr(self.token_scale):
            sSK = staged(storage.sSK, 1, n, st)
            sSV = staged(storage.sSV, 1, n, st)
            sPlo = storage.sPlo.get_tensor(cute.make_layout((m, n), stride=(np_, 1)))
        k_mult = softmax_scale_log2  # what S is multiplied by (a tensor K scale joins it)
        v_mult = Float32(1.0)  # what O is multiplied by at the end (a tensor V scale)
        if const_expr(self.fp8 and not self.token_scale):
            k_mult = softmax_scale_log2 * mSK[hk]
            v_mult = mSV[hk]

        seqlen_q = mQ.shape[1]
        seqlen_k = mSeqlens[b]
        n_tiles = cute.ceil_div(seqlen_k, n)
        per = cutlass.max(cute.ceil_div(n_tiles, num_splits), 1)
        t_begin = cutlass.min(n_tiles, split * per)
        t_end = cutlass.min(n_tiles, t_begin + per)

        # 16-byte cp.async copies: global -> SMEM without registers in between
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=16 * 8)
        g2s8 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Uint8,
                                   num_bits_per_copy=16 * 8)

        # ---- Q rows into SMEM (padding rows zero)
        cpr = d // VEC  # copies per row
        for i in cutlass.range_constexpr(m * cpr // self.threads):
            idx = tidx + i * self.threads
            r = idx // cpr
            c = idx % cpr
            dst = cute.local_tile(sQ[r, None], (VEC,), (c,))
            if r < seqlen_q * gqa:
                cute.copy(g2s, cute.local_tile(mQ[b, r // gqa, hk * gqa + r % gqa, None], (VEC,), (c,)), dst)
            else:
                dst.fill(0.0)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)  # the first tile's barrier publishes Q to every thread

        thr_mma = tiled_mma.get_slice(tidx)
        tSsQ = thr_mma.partition_A(sQ)
        tSsK = thr_mma.partition_B(sK_all[None, None, 0])
        tOsP = thr_mma.partition_A(sP)
        tPsP = thr_mma.partition_C(sP)  # where this thread's S elements sit, as P
        tOsPlo = thr_mma.partition_A(sPlo) if const_expr(self.token_scale) else None
        tPsPlo = thr_mma.partition_C(sPlo) if const_expr(self.token_scale) else None
        tOsV = thr_mma.partition_B(sVt_all[None, None, 0])
        tSrQ = thr_mma.make_fragment_A(tSsQ[None, None, 0])
        tSrK = thr_mma.make_fragment_B(tSsK[None, None, 0])
        tOrP = thr_mma.make_fragment_A(tOsP[None, None, 0])
        tOrV = thr_mma.make_fragment_B(tOsV[None, None, 0])
        acc_O = thr_mma.make_fragment_C(thr_mma.partition_shape_C((m, d)))
        acc_O.fill(0.0)
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((m, d)))
        tScS = thr_mma.partition_C(cute.make_identity_tensor((m, n)))

        # softmax in registers, on the S accumulator itself: the m16n8 C fragment gives this thread
        # two rows, ra (values 0, 1 of each 4) and ra + 8 (values 2, 3; row_slot), 2 columns per
        # 8-column block; the 4 threads of a quad (lane % 4) share the rows, so a row's max and sum
        # are a register reduction and two shuffles. acc_O has the same rows (same MMA, same M).
        ra = tScS[0][0]
        rb = tScS[2][0]
        warp_live = (tidx // 32) * 16 < seqlen_q * gqa  # the warp's rows: 16 w .. 16 w + 15
        row_max0 = Float32(-Float32.inf)
        row_max1 = Float32(-Float32.inf)
        row_sum0 = Float32(0.0)
        row_sum1 = Float32(0.0)
        # keys j < limit are visible to a row: the sequence, and causal j <= j_last - Sq + 1 + token
        limit0 = seqlen_k
        limit1 = seqlen_k
        if const_expr(cfg.causal):
            limit0 = cutlass.min(seqlen_k, seqlen_k - seqlen_q + ra // gqa + 1)
            limit1 = cutlass.min(seqlen_k, seqlen_k - seqlen_q + rb // gqa + 1)

        ops = (mK, mV, mSK, mSV, mGK, mGV, mPageTable, sK_all, sV_all, sK8, sV8, sK4, sV4, sKsc, sVsc, sSK, sSV,
               g2s, g2s8, b, hk, seqlen_k, tidx)
        # the ring's prologue: tiles t_begin .. t_begin + st - 2 into stages 0 .. st - 2, one
        # commit group each (empty past the split: every thread commits the same count)
        for s in cutlass.range_constexpr(st - 1):
            if t_begin + s < t_end:
                self.issue(ops, (t_begin + s) * n, s)
            cute.arch.cp_async_commit_group()
        for t in cutlass.range(t_begin, t_end, unroll=1):
            key0 = t * n
            stage = 0
            if const_expr(st == 1):
                cute.arch.sync_threads()  # the previous tile's readers of the stage refilled now are done
                self.issue(ops, key0, 0)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)  # this thread's copies landed
                cute.arch.sync_threads()  # and every other thread's
            else:
                stage = (t - t_begin) % st
                # group i is tile t_begin + i: with the prologue's st - 1 and one per earlier tile,
                # at most st - 2 younger groups may still fly once tile t has landed
                cute.arch.cp_async_wait_group(st - 2)
                # every thread's copies of tile t landed, and every reader of tile t - 1 is done:
                # its stage is the one refilled next
                cute.arch.sync_threads()
                nxt = t + st - 1
                if nxt < t_end:
                    self.issue(ops, nxt * n, (nxt - t_begin) % st)
                cute.arch.cp_async_commit_group()  # (empty near the end: the count stays uniform)
            kstage = stage if const_expr(kst == st) else 0
            tSsK_t = thr_mma.partition_B(sK_all[None, None, kstage])  # this tile's stage
            tOsV_t = thr_mma.partition_B(sVt_all[None, None, kstage])
            if const_expr(self.fp8):
                # widen the E4M3 tiles to BF16 (exact), one word of 4 codes at a time; word w is
                # row w // (d / 4) of the dense staging tile, which starts PAD / 2 words later per
                # row in the padded operand tile
                for i in cutlass.range(n * d // 4 // self.threads, unroll=4):
                    w = tidx + i * self.threads
                    o = 2 * w + (w // (d // 4)) * (PAD // 2)
                    fk = ptx.e4m3x4_to_f32(sK8w[0, w, stage])
                    sKw[o] = ptx.f32x2_to_bf16x2(fk[0], fk[1])
                    sKw[o + 1] = ptx.f32x2_to_bf16x2(fk[2], fk[3])
                    fv = ptx.e4m3x4_to_f32(sV8w[0, w, stage])
                    sVw[o] = ptx.f32x2_to_bf16x2(fv[0], fv[1])
                    sVw[o + 1] = ptx.f32x2_to_bf16x2(fv[2], fv[3])
                cute.arch.sync_threads()
            if const_expr(self.nvfp4):
                # widen E2M1 x E4M3 (x g) to BF16 (exact), one word of 8 codes at a time
                for i in cutlass.range(n * d // 8 // self.threads, unroll=2):
                    w = tidx + i * self.threads
                    blk = (w * 8) // NVFP4_BLOCK  # row-major (n, d) tile: 16 elements per block
                    o = 4 * w + (w // (d // 8)) * (PAD // 2)
                    self.widen_e2m1(sK4w[0, w, stage], sKsc[0, blk, stage], sLut, sKw, o)
                    self.widen_e2m1(sV4w[0, w, stage], sVsc[0, blk, stage], sLut, sVw, o)
                cute.arch.sync_threads()

            # a warp whose 16 rows are all padding (gqa x Sq < 64: decode with one token has 8 rows,
            # one live warp) skips the math: it only copies, widens and meets the barriers
            if warp_live:
                # S = Q K^T
                acc_S = thr_mma.make_fragment_C(thr_mma.partition_shape_C((m, n)))
                acc_S.fill(0.0)
                # dynamic k-block loops: unrolled, the compiler hoists every block's operand loads
                # at once (a K tile's fragments alone are 256 registers)
                for kb in cutlass.range(cute.size(tSsQ, mode=[2]), unroll=1):
                    cute.autovec_copy(tSsQ[None, None, kb], tSrQ)
                    cute.autovec_copy(tSsK_t[None, None, kb], tSrK)
                    cute.gemm(tiled_mma, acc_S, tSrQ, tSrK, acc_S)

                # online softmax (the reference's tile loop, numerics.reference._tile_loop):
                # x = s * softmax_scale * log2 e, masked keys -inf, m_new = max(m, max x),
                # p = 2^(x - m_new) rounded to bf16 for PV, l = l * 2^(m - m_new) + sum of unrounded p
                tmax0 = Float32(-Float32.inf)
                tmax1 = Float32(-Float32.inf)
                for i in cutlass.range_constexpr(cute.size(acc_S)):
                    c = tScS[i][1]
                    if const_expr(self.token_scale):
                        x = acc_S[i] * sSK[0, c, stage] * softmax_scale_log2  # (q . k8) s_k c, as dot * c
                    else:
                        x = acc_S[i] * k_mult
                    if const_expr(row_slot(i) == 0):
                        if key0 + c >= limit0:
                            x = Float32(-Float32.inf)
                        tmax0 = cute.arch.fmax(tmax0, x)
                    else:
                        if key0 + c >= limit1:
                            x = Float32(-Float32.inf)
                        tmax1 = cute.arch.fmax(tmax1, x)
                    acc_S[i] = x
                for off in cutlass.range_constexpr(1, 3):  # the quad's 4 threads: lanes xor 1, xor 2
                    tmax0 = cute.arch.fmax(tmax0, cute.arch.shuffle_sync_bfly(tmax0, offset=off))
                    tmax1 = cute.arch.fmax(tmax1, cute.arch.shuffle_sync_bfly(tmax1, offset=off))
                m_new0 = cute.arch.fmax(row_max0, tmax0)
                m_new1 = cute.arch.fmax(row_max1, tmax1)
                m_use0 = m_new0
                m_use1 = m_new1
                if m_new0 == -Float32.inf:
                    m_use0 = Float32(0.0)  # nothing visible yet: p = 2^-inf = 0, not NaN
                if m_new1 == -Float32.inf:
                    m_use1 = Float32(0.0)
                alpha0 = cute.math.exp2(row_max0 - m_use0, fastmath=True)
                alpha1 = cute.math.exp2(row_max1 - m_use1, fastmath=True)
                rP = cute.make_fragment_like(acc_S, BFloat16)
                rPlo = cute.make_fragment_like(acc_S, BFloat16) if const_expr(self.token_scale) else None
                tot0 = Float32(0.0)
                tot1 = Float32(0.0)
                for i in cutlass.range_constexpr(cute.size(acc_S)):
                    if const_expr(row_slot(i) == 0):
                        p = cute.math.exp2(acc_S[i] - m_use0, fastmath=True)
                        tot0 = tot0 + p
                    else:
                        p = cute.math.exp2(acc_S[i] - m_use1, fastmath=True)
                        tot1 = tot1 + p
                    pb = p.to(BFloat16)
                    if const_expr(self.token_scale):
                        # P' = bf16(p) s_v(j), as two bf16 halves for PV
                        pw = pb.to(Float32) * sSV[0, tScS[i][1], stage]
                        hi = pw.to(BFloat16)
                        rP[i] = hi
                        rPlo[i] = (pw - hi.to(Float32)).to(BFloat16)
                    else:
                        rP[i] = pb
                for off in cutlass.range_constexpr(1, 3):
                    tot0 = tot0 + cute.arch.shuffle_sync_bfly(tot0, offset=off)
                    tot1 = tot1 + cute.arch.shuffle_sync_bfly(tot1, offset=off)
                row_sum0 = row_sum0 * alpha0 + tot0
                row_sum1 = row_sum1 * alpha1 + tot1
                row_max0 = m_new0
                row_max1 = m_new1
                # P through SMEM into PV's A layout: a warp writes and reads only its own 16 rows
                cute.autovec_copy(rP, tPsP)
                if const_expr(self.token_scale):
                    cute.autovec_copy(rPlo, tPsPlo)
                cute.arch.sync_warp()

                # O = O * alpha + P V
                for i in cutlass.range_constexpr(cute.size(acc_O)):
                    if const_expr(row_slot(i) == 0):
                        acc_O[i] = acc_O[i] * alpha0
                    else:
                        acc_O[i] = acc_O[i] * alpha1
                for kb in cutlass.range(cute.size(tOsP, mode=[2]), unroll=1):
                    cute.autovec_copy(tOsP[None, None, kb], tOrP)
                    cute.autovec_copy(tOsV_t[None, None, kb], tOrV)
                    cute.gemm(tiled_mma, acc_O, tOrP, tOrV, acc_O)
                    if const_expr(self.token_scale):
                        cute.autovec_copy(tOsPlo[None, None, kb], tOrP)
                        cute.gemm(tiled_mma, acc_O, tOrP, tOrV, acc_O)

        # ---- epilogue: o_s = acc / l (0 where nothing was visible), lse_s = m + log2 l (-inf);
        # lane t = 0 of each quad writes its two rows' LSE
        if tidx % 4 == 0:
            if ra < seqlen_q * gqa:
                lse = Float32(-Float32.inf)
                if row_sum0 > 0.0:
                    lse = row_max0 + cute.math.log2(row_sum0, fastmath=False)
                mLSE[split, b, hk * gqa + ra % gqa, ra // gqa] = lse
            if rb < seqlen_q * gqa:
                lse = Float32(-Float32.inf)
                if row_sum1 > 0.0:
                    lse = row_max1 + cute.math.log2(row_sum1, fastmath=False)
                mLSE[split, b, hk * gqa + rb % gqa, rb // gqa] = lse
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            r = tOcO[i][0]
            if r < seqlen_q * gqa:
                l = row_sum0 if const_expr(row_slot(i) == 0) else row_sum1
                o = Float32(0.0)
                if l > 0.0:
                    o = acc_O[i] / l
                    if const_expr(self.fp8 and not self.token_scale):
                        o = o * v_mult
                mO[split, b, hk * gqa + r % gqa, r // gqa, tOcO[i][1]] = o

    @cute.jit
    def issue(self, ops, key0, st):
        """Start the copies of the key tile at ``key0`` into load stage ``st``: cp.async for the
        rows (zeros past the sequence), plain loads for per-token / per-block scales."""
        (mK, mV, mSK, mSV, mGK, mGV, mPageTable, sK_all, sV_all, sK8, sV8, sK4, sV4, sKsc, sVsc, sSK, sSV,
         g2s, g2s8, b, hk, seqlen_k, tidx) = ops
        n, d = self.tile_n, self.hdim
        if const_expr(self.nvfp4):
            self.load_nvfp4(mK, mV, mSK, mSV, mGK, mGV, mPageTable, sK4, sV4, sKsc, sVsc, g2s8, b, hk, key0,
                            seqlen_k, tidx, st)
        elif const_expr(self.fp8):
            # E4M3 code 0 is 0.0: rows past the sequence read as zeros
            self.copy_rows(mK, mV, sK8, sV8, g2s8, VEC8, d // VEC8, 4, mPageTable, b, hk, key0, seqlen_k, tidx, st)
            if const_expr(self.token_scale):
                for i in cutlass.range_constexpr(-(-n // self.threads)):
                    r = tidx + i * self.threads
                    if r < n:
                        j = key0 + r
                        sk = Float32(0.0)  # a key past the sequence: masked, and its V weighs 0
                        sv = Float32(0.0)
                        if j < seqlen_k:
                            slot, prow = self.cache_row(mPageTable, b, j)
                            sk = mSK[slot, prow, hk]
                            sv = mSV[slot, prow, hk]
                        sSK[0, r, st] = sk
                        sSV[0, r, st] = sv
        else:
            self.copy_rows(mK, mV, sK_all, sV_all, g2s, VEC, d // VEC, 4, mPageTable, b, hk, key0, seqlen_k, tidx, st)

    @cute.jit
    def copy_rows(self, mK, mV, sK, sV, atom, vec: cutlass.Constexpr, per_row: cutlass.Constexpr,
                  unroll: cutlass.Constexpr, mPageTable, b, hk, key0, seqlen_k, tidx, st):
        """K and V rows key0.. of one tile from the cache into SMEM stage ``st``, ``vec``
        elements per cp.async (``per_row`` copies a row), through the page table when paged;
        rows past the sequence are zero-filled (zero bits are 0.0 in every cache format)."""
        for i in cutlass.range(self.tile_n * per_row // self.threads, unroll=unroll):
            idx = tidx + i * self.threads
            r = idx // per_row
            c = idx % per_row
            dk = cute.local_tile(sK[r, None, st], (vec,), (c,))
            dv = cute.local_tile(sV[r, None, st], (vec,), (c,))
            j = key0 + r
            if j < seqlen_k:
                slot, prow = self.cache_row(mPageTable, b, j)
                cute.copy(atom, cute.local_tile(mK[slot, prow, hk, None], (vec,), (c,)), dk)
                cute.copy(atom, cute.local_tile(mV[slot, prow, hk, None], (vec,), (c,)), dv)
            else:
                dk.fill(0)
                dv.fill(0)

    @cute.jit
    def load_nvfp4(self, mK, mV, mSK, mSV, mGK, mGV, mPageTable, sK4, sV4, sKsc, sVsc, g2s8, b, hk, key0, seqlen_k,
                   tidx, st):
        """One key tile of an NVFP4 cache into SMEM: the packed rows by cp.async (zeros past the
        sequence), the block scales decoded to fp32 (times g with a tensor scale; 0 past it)."""
        n, d = self.tile_n, self.hdim
        # packed E2M1, two codes a byte; code 0 is 0.0
        self.copy_rows(mK, mV, sK4, sV4, g2s8, VEC8, d // 2 // VEC8, 2, mPageTable, b, hk, key0, seqlen_k, tidx, st)
        nb = d // NVFP4_BLOCK
        for i in cutlass.range_constexpr(n * nb // self.threads):
            e = tidx + i * self.threads
            r = e // nb
            blk = e % nb
            j = key0 + r
            sk = Float32(0.0)
            sv = Float32(0.0)
            if j < seqlen_k:
                slot, prow = self.cache_row(mPageTable, b, j)
                sk = ptx.e4m3x4_to_f32(cutlass.Uint32(mSK[slot, prow, hk, blk]))[0]
                sv = ptx.e4m3x4_to_f32(cutlass.Uint32(mSV[slot, prow, hk, blk]))[0]
                if const_expr(self.config.tensor_scale):
                    sk = sk * mGK[hk]
                    sv = sv * mGV[hk]
            sKsc[0, e, st] = sk
            sVsc[0, e, st] = sv

    @cute.jit
    def widen_e2m1(self, word, scale, sLut, dst, o):
        """8 E2M1 codes (element k in bits 4k..4k+3) times ``scale`` -> 4 words of bf16 pairs at
        dst[o ..]: exact (at most 4 significant bits)."""
        for k in cutlass.range_constexpr(4):
            lo = sLut[(word >> (8 * k)) & 0xF] * scale
            hi = sLut[(word >> (8 * k + 4)) & 0xF] * scale
            dst[o + k] = ptx.f32x2_to_bf16x2(lo, hi)

    @cute.jit
    def cache_row(self, mPageTable, b, j):
        """(slot, row) of token j of sequence b: contiguous (b, j); paged through the page table."""
        slot = b
        prow = j
        if const_expr(self.config.paged):
            slot = mPageTable[b, j // self.config.page_size]
            prow = j % self.config.page_size
        return slot, prow


def kernel_class(config: DecodeConfig) -> type:
    """The kernel class for ``config`` (one for every cache format)."""
    return DecodeKernel
