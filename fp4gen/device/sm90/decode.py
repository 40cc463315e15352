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
from .decode_config import ROW_TILE, WARPS, DecodeConfig

VEC = 8  # bf16 elements per load/store (16 bytes)
VEC8 = 16  # e4m3 elements (or packed e2m1 bytes) per copy (16 bytes)
NVFP4_BLOCK = 16  # elements per E4M3 block scale along D
# the value of each E2M1 code 0..15 (numerics.formats.E2M1; tests compare)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


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
        """Q, K, V, S (fp32), P (bf16), and per-row rescale / sum / max."""
        m, n, d = ROW_TILE, self.tile_n, self.hdim
        st, kst = self.stages, self.k_stages
        fields = {
            "sQ": cute.struct.Align[cute.struct.MemRange[BFloat16, m * d], 128],
            "sK": cute.struct.Align[cute.struct.MemRange[BFloat16, n * d * kst], 128],
            "sV": cute.struct.Align[cute.struct.MemRange[BFloat16, n * d * kst], 128],
            "sS": cute.struct.Align[cute.struct.MemRange[Float32, m * n], 128],
            "sP": cute.struct.Align[cute.struct.MemRange[BFloat16, m * n], 128],
            "sAlpha": cute.struct.Align[cute.struct.MemRange[Float32, m], 16],
            "sL": cute.struct.Align[cute.struct.MemRange[Float32, m], 16],
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
            fields["sPlo"] = cute.struct.Align[cute.struct.MemRange[BFloat16, m * n], 128]
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
        row_major = lambda rows, cols: cute.make_layout((rows, cols), stride=(cols, 1))  # noqa: E731
        sQ = storage.sQ.get_tensor(row_major(m, d))
        st, kst = self.stages, self.k_stages

        def staged(rng, rows, cols, count, dtype=None):  # (rows, cols, stage), row-major per stage
            return rng.get_tensor(cute.make_layout((rows, cols, count), stride=(cols, 1, rows * cols)), dtype=dtype)

        sK_all = staged(storage.sK, n, d, kst)
        sV_all = staged(storage.sV, n, d, kst)
        # V as PV's (N = D, K = keys) operand: the same SMEM, transposed
        sVt_all = storage.sV.get_tensor(cute.make_layout((d, n, kst), stride=(1, d, n * d)))
        sS = storage.sS.get_tensor(row_major(m, n))
        sP = storage.sP.get_tensor(row_major(m, n))
        sAlpha = storage.sAlpha.get_tensor(cute.make_layout(m))
        sL = storage.sL.get_tensor(cute.make_layout(m))
        sK8 = sV8 = sK8w = sV8w = sKw = sVw = None
        if const_expr(self.fp8 or self.nvfp4):
            # the widened operand tiles as words of two bf16
            sKw = storage.sK.get_tensor(cute.make_layout(n * d // 2), dtype=cutlass.Uint32)
            sVw = storage.sV.get_tensor(cute.make_layout(n * d // 2), dtype=cutlass.Uint32)
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
            sPlo = storage.sPlo.get_tensor(row_major(m, n))
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
        tSsS = thr_mma.partition_C(sS)
        tOsP = thr_mma.partition_A(sP)
        tOsPlo = thr_mma.partition_A(sPlo) if const_expr(self.token_scale) else None
        tOsV = thr_mma.partition_B(sVt_all[None, None, 0])
        tSrQ = thr_mma.make_fragment_A(tSsQ[None, None, 0])
        tSrK = thr_mma.make_fragment_B(tSsK[None, None, 0])
        tOrP = thr_mma.make_fragment_A(tOsP[None, None, 0])
        tOrV = thr_mma.make_fragment_B(tOsV[None, None, 0])
        acc_O = thr_mma.make_fragment_C(thr_mma.partition_shape_C((m, d)))
        acc_O.fill(0.0)
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((m, d)))

        # softmax ownership: thread t holds row t // 2, columns (t % 2) * n / 2 ..
        srow = tidx // 2
        half = n // 2
        c_lo = (tidx % 2) * half
        row_max = Float32(-Float32.inf)
        row_sum = Float32(0.0)
        # keys j < limit are visible to this row: the sequence, and causal j <= j_last - Sq + 1 + token
        limit = seqlen_k
        if const_expr(cfg.causal):
            limit = cutlass.min(seqlen_k, seqlen_k - seqlen_q + srow // gqa + 1)

        ops = (mK, mV, mSK, mSV, mGK, mGV, mPageTable, sK_all, sV_all, sK8, sV8, sK4, sV4, sKsc, sVsc, sSK, sSV,
               g2s, g2s8, b, hk, seqlen_k, tidx)
        if const_expr(st == 2):  # the ring's first tile
            if t_begin < t_end:
                self.issue(ops, t_begin * n, 0)
            cute.arch.cp_async_commit_group()
        for t in cutlass.range(t_begin, t_end, unroll=1):
            key0 = t * n
            stage = 0
            if const_expr(st == 2):
                stage = (t - t_begin) % 2
            cute.arch.sync_threads()  # the previous tile's readers of the stage refilled now are done
            if const_expr(st == 1):
                self.issue(ops, key0, 0)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)  # this thread's copies landed
            else:
                if t + 1 < t_end:
                    self.issue(ops, key0 + n, 1 - stage)  # the next tile, under this one's math
                cute.arch.cp_async_commit_group()  # (empty on the last tile: the count stays uniform)
                cute.arch.cp_async_wait_group(1)  # this tile's copies landed; the next may be in flight
            cute.arch.sync_threads()  # and every other thread's
            kstage = stage if const_expr(kst == 2) else 0
            tSsK_t = thr_mma.partition_B(sK_all[None, None, kstage])  # this tile's stage
            tOsV_t = thr_mma.partition_B(sVt_all[None, None, kstage])
            if const_expr(self.fp8):
                # widen the E4M3 tiles to BF16 (exact), one word of 4 codes at a time
                for i in cutlass.range(n * d // 4 // self.threads, unroll=4):
                    w = tidx + i * self.threads
                    fk = ptx.e4m3x4_to_f32(sK8w[0, w, stage])
                    sKw[2 * w] = ptx.f32x2_to_bf16x2(fk[0], fk[1])
                    sKw[2 * w + 1] = ptx.f32x2_to_bf16x2(fk[2], fk[3])
                    fv = ptx.e4m3x4_to_f32(sV8w[0, w, stage])
                    sVw[2 * w] = ptx.f32x2_to_bf16x2(fv[0], fv[1])
                    sVw[2 * w + 1] = ptx.f32x2_to_bf16x2(fv[2], fv[3])
                cute.arch.sync_threads()
            if const_expr(self.nvfp4):
                # widen E2M1 x E4M3 (x g) to BF16 (exact), one word of 8 codes at a time
                for i in cutlass.range(n * d // 8 // self.threads, unroll=2):
                    w = tidx + i * self.threads
                    blk = (w * 8) // NVFP4_BLOCK  # row-major (n, d) tile: 16 elements per block
                    self.widen_e2m1(sK4w[0, w, stage], sKsc[0, blk, stage], sLut, sKw, w)
                    self.widen_e2m1(sV4w[0, w, stage], sVsc[0, blk, stage], sLut, sVw, w)
                cute.arch.sync_threads()

            # S = Q K^T
            acc_S = thr_mma.make_fragment_C(thr_mma.partition_shape_C((m, n)))
            acc_S.fill(0.0)
            # dynamic k-block loops: unrolled, the compiler hoists every block's operand loads
            # at once (a K tile's fragments alone are 256 registers)
            for kb in cutlass.range(cute.size(tSsQ, mode=[2]), unroll=1):
                cute.autovec_copy(tSsQ[None, None, kb], tSrQ)
                cute.autovec_copy(tSsK_t[None, None, kb], tSrK)
                cute.gemm(tiled_mma, acc_S, tSrQ, tSrK, acc_S)
            cute.autovec_copy(acc_S, tSsS)
            cute.arch.sync_threads()

            # online softmax of row srow, columns c_lo .. c_lo + half (two threads per row)
            tile_max = Float32(-Float32.inf)
            for c in cutlass.range_constexpr(half):
                if const_expr(self.token_scale):
                    x = sS[srow, c_lo + c] * sSK[0, c_lo + c, stage] * softmax_scale_log2  # (q . k8) s_k c, as dot * c
                else:
                    x = sS[srow, c_lo + c] * k_mult
                if key0 + c_lo + c >= limit:
                    x = Float32(-Float32.inf)
                sS[srow, c_lo + c] = x
                tile_max = cute.arch.fmax(tile_max, x)
            tile_max = cute.arch.fmax(tile_max, cute.arch.shuffle_sync_bfly(tile_max, offset=1))
            m_new = cute.arch.fmax(row_max, tile_max)
            m_use = m_new
            if m_new == -Float32.inf:
                m_use = Float32(0.0)  # nothing visible yet: p = 2^-inf = 0, not NaN
            alpha = cute.math.exp2(row_max - m_use, fastmath=True)
            tot = Float32(0.0)
            for c in cutlass.range_constexpr(half):
                p = cute.math.exp2(sS[srow, c_lo + c] - m_use, fastmath=True)
                pb = p.to(BFloat16)
                if const_expr(self.token_scale):
                    # P' = bf16(p) s_v(j), as two bf16 halves for PV
                    pw = pb.to(Float32) * sSV[0, c_lo + c, stage]
                    hi = pw.to(BFloat16)
                    sP[srow, c_lo + c] = hi
                    sPlo[srow, c_lo + c] = (pw - hi.to(Float32)).to(BFloat16)
                else:
                    sP[srow, c_lo + c] = pb
                tot = tot + p
            tot = tot + cute.arch.shuffle_sync_bfly(tot, offset=1)
            row_sum = row_sum * alpha + tot
            row_max = m_new
            if tidx % 2 == 0:
                sAlpha[srow] = alpha
            cute.arch.sync_threads()

            # O = O * alpha + P V
            for i in cutlass.range_constexpr(cute.size(acc_O)):
                acc_O[i] = acc_O[i] * sAlpha[tOcO[i][0]]
            for kb in cutlass.range(cute.size(tOsP, mode=[2]), unroll=1):
                cute.autovec_copy(tOsP[None, None, kb], tOrP)
                cute.autovec_copy(tOsV_t[None, None, kb], tOrV)
                cute.gemm(tiled_mma, acc_O, tOrP, tOrV, acc_O)
                if const_expr(self.token_scale):
                    cute.autovec_copy(tOsPlo[None, None, kb], tOrP)
                    cute.gemm(tiled_mma, acc_O, tOrP, tOrV, acc_O)

        # ---- epilogue: o_s = acc / l (0 where nothing was visible), lse_s = m + log2 l (-inf)
        if tidx % 2 == 0:
            sL[srow] = row_sum
            if srow < seqlen_q * gqa:
                lse = Float32(-Float32.inf)
                if row_sum > 0.0:
                    lse = row_max + cute.math.log2(row_sum, fastmath=False)
                mLSE[split, b, hk * gqa + srow % gqa, srow // gqa] = lse
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            r = tOcO[i][0]
            if r < seqlen_q * gqa:
                l = sL[r]
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
    def widen_e2m1(self, word, scale, sLut, dst, w):
        """8 E2M1 codes (element k in bits 4k..4k+3) times ``scale`` -> 4 words of bf16 pairs at
        dst[4w ..]: exact (at most 4 significant bits)."""
        for k in cutlass.range_constexpr(4):
            lo = sLut[(word >> (8 * k)) & 0xF] * scale
            hi = sLut[(word >> (8 * k + 4)) & 0xF] * scale
            dst[4 * w + k] = ptx.f32x2_to_bf16x2(lo, hi)

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
