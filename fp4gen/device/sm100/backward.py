"""The sm100a (Blackwell) attention backward kernel: ``AttentionBwdSm100``, one class for every
generated sm100a backward (docs/sm100.md, "The backward"; docs/design/kernel-library.md).

A generated module renders its backward plan's values as a ``BackwardKernelConfig``
(fp4gen/device/sm100/config.py) and builds this class with it; the causal mask and the
deterministic dQ order are chosen with ``cutlass.const_expr``. The global-memory reductions it
calls are fp4gen/device/ptx.py, its tcgen05 fences fp4gen/device/sm100/bwd.py.

Comments that say "Triaged" answer a CuTe DSL checker warning at the line below them
(fp4gen/lowering/cute_warnings.py reads them here).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from fp4gen.device import ptx
from fp4gen.device.pipelines import coop, participants
from fp4gen.device.sm100 import bwd as bdev
from fp4gen.device.sm100.config import BackwardKernelConfig
from fp4gen.device.sm100.copies import tma_part

BF16 = cutlass.BFloat16
E4M3 = cutlass.Float8E4M3FN
# element type of dO (and of V and P^T with it) by BackwardKernelConfig.do_format
DO_DTYPE = {"bf16": BF16, "e4m3": E4M3, "e5m2": cutlass.Float8E5M2}
CHUNK = 32  # TMEM columns per tcgen05.ld.32x32b.x32 (one register per column)


def slice0(layout):
    return cute.slice_(layout, (None, None, None, 0))


def view(src, layout, dtype=BF16):
    """The same SMEM bytes through another MMA's (transposed) operand layout."""
    return cute.make_tensor(cute.recast_ptr(src.iterator, layout.inner, dtype=dtype), layout.outer)


def gemm(mma, acc, tA, tB, accumulate_first):
    """One product over all K slices (one tcgen05.mma each); ``accumulate_first`` is False
    (zero-initialise) or a run-time flag. Returns the atom so that loops rebind it."""
    for kb in range(cute.size(tA, mode=[2])):  # a plain Python helper: unrolled at trace time
        mma.set(tcgen05.Field.ACCUMULATE, accumulate_first if kb == 0 else True)
        cute.gemm(mma, acc, tA[None, None, kb], tB[None, None, kb], acc)
    return mma


class AttentionBwdSm100:
    """dK, dV (and the dQ contribution) of tile_n keys of one (batch, head) per CTA.

    ``config``: the backward plan's values (a ``BackwardKernelConfig``, rendered in the
    generated module)."""

    def __init__(self, config: BackwardKernelConfig):
        cfg = self.config = config
        D, BM, BN = cfg.head_dim, cfg.tile_m, cfg.tile_n
        self.compute_warps = cfg.compute_warps
        self.dq_warps = cfg.dq_warps
        self.mma_warp = cfg.mma_warp
        self.load_warp = cfg.load_warp
        self.threads = 32 * cfg.n_warps
        self.s_tiler = (BN, BM, D)  # S^T = K Q^T, dP^T = V dO^T: M keys, N queries, K head dim
        self.kv_tiler = (BN, D, BM)  # dV += P^T dO, dK += dS^T Q: M keys, N head dim, K queries
        self.q_tiler = (BM, D, BN)  # dQ = dS K: M queries, N head dim, K keys
        # operand types of dP^T = V dO^T and dV += P^T dO: bf16, or with an FP8 dO the forward's
        # E4M3 V, dO's FP8 type and P^T as E4M3 of 2^8 P
        self.do_dtype = DO_DTYPE[cfg.do_format]
        self.v_dtype = E4M3 if cfg.do_fp8 else BF16
        self.p_dtype = E4M3 if cfg.do_fp8 else BF16

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,  # (B, S, H, D): bf16; V, dO FP8 with do_fp8
        mLSE2: cute.Tensor, mDsum: cute.Tensor,  # fp32 (B, H, Sqp): the forward's LSE2, rowsum(dO O)
        mdQacc: cute.Tensor, mdQturn: cute.Tensor,  # fp32 (B, H, Sqp, D), int32 (B, H, Sqp / tile_m)
        mdK: cute.Tensor, mdV: cute.Tensor,  # (B, Sk, H, D), per query head (fp32 for GQA)
        mScale: cute.Tensor,  # fp32 (B, H, 2): FP8 dO's dP^T and dV factors (read only with do_fp8)
        scale_log2: Float32, softmax_scale: Float32, causal_offset: Int32, stream,
    ):
        cfg = self.config
        D, BM, BN = cfg.head_dim, cfg.tile_m, cfg.tile_n
        # kernel views (seq, d, head, batch), d contiguous
        seqlen_q, seqlen_k = mQ.shape[1], mK.shape[1]
        kv_group = mQ.shape[2] // mK.shape[2]
        mQ, mK, mV, mdO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                           for t in (mQ, mK, mV, mdO)]
        one = tcgen05.CtaGroup.ONE
        K_, MN_ = OperandMajorMode.K, OperandMajorMode.MN
        # the five products (plan.mmas): fp32 accumulators in TMEM; bf16 operands (kind::f16) but
        # for dP^T and dV with an FP8 dO (kind::f8f6f4, which reads 8-bit operands MN-major too)
        VT, DOT, PT = self.v_dtype, self.do_dtype, self.p_dtype
        mma_s = sm100_utils.make_trivial_tiled_mma(BF16, BF16, K_, K_, Float32, one, self.s_tiler[:2])
        mma_dp = sm100_utils.make_trivial_tiled_mma(VT, DOT, K_, K_, Float32, one, self.s_tiler[:2])
        mma_dv = sm100_utils.make_trivial_tiled_mma(PT, DOT, K_, MN_, Float32, one, self.kv_tiler[:2],
                                                    tcgen05.OperandSource.TMEM)  # A = P^T from TMEM
        mma_dk = sm100_utils.make_trivial_tiled_mma(BF16, BF16, K_, MN_, Float32, one, self.kv_tiler[:2])
        mma_dq = sm100_utils.make_trivial_tiled_mma(BF16, BF16, MN_, MN_, Float32, one, self.q_tiler[:2])
        # SMEM: each buffer is loaded/written through one layout and read transposed by another
        # MMA through the same bytes (K-major (rows, 64-element swizzle atoms) == the MN-major
        # view of the transposed operand)
        sK_l = sm100_utils.make_smem_layout_a(mma_s, self.s_tiler, BF16, 1)
        sV_l = sm100_utils.make_smem_layout_a(mma_dp, self.s_tiler, VT, 1)
        sQ_l = sm100_utils.make_smem_layout_b(mma_s, self.s_tiler, BF16, cfg.q_stages)
        sdO_l = sm100_utils.make_smem_layout_b(mma_dp, self.s_tiler, DOT, cfg.q_stages)
        sdSt_l = sm100_utils.make_smem_layout_a(mma_dk, self.kv_tiler, BF16, 1)
        sQt_l = sm100_utils.make_smem_layout_b(mma_dk, self.kv_tiler, BF16, cfg.q_stages)
        sdOt_l = sm100_utils.make_smem_layout_b(mma_dv, self.kv_tiler, DOT, cfg.q_stages)
        sdS_l = sm100_utils.make_smem_layout_a(mma_dq, self.q_tiler, BF16, 1)
        sKt_l = sm100_utils.make_smem_layout_b(mma_dq, self.q_tiler, BF16, 1)
        tP_l = sm100_utils.make_smem_layout_a(mma_dv, self.kv_tiler, PT, 1)  # P^T as a TMEM A operand

        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma_s.thr_id.shape,))
        g2s = cpasync.CopyBulkTensorTileG2SOp(one)
        tma_k, gK = cute.nvgpu.make_tiled_tma_atom_A(g2s, mK, slice0(sK_l), self.s_tiler, mma_s, cluster_vmnk.shape)
        tma_v, gV = cute.nvgpu.make_tiled_tma_atom_A(g2s, mV, slice0(sV_l), self.s_tiler, mma_dp, cluster_vmnk.shape)
        tma_q, gQ = cute.nvgpu.make_tiled_tma_atom_B(g2s, mQ, slice0(sQ_l), self.s_tiler, mma_s, cluster_vmnk.shape)
        tma_do, gdO = cute.nvgpu.make_tiled_tma_atom_B(g2s, mdO, slice0(sdO_l), self.s_tiler, mma_dp, cluster_vmnk.shape)
        self.kv_bytes = cute.size_in_bytes(BF16, slice0(sK_l)) + cute.size_in_bytes(VT, slice0(sV_l))
        self.qdo_bytes = cute.size_in_bytes(BF16, slice0(sQ_l)) + cute.size_in_bytes(DOT, slice0(sdO_l))

        grid = (cute.ceil_div(seqlen_k, BN), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(
            mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
            tma_k, gK, tma_v, gV, tma_q, gQ, tma_do, gdO,
            mLSE2, mDsum, mdQacc, mdQturn, mdK, mdV, mScale,
            sK_l, sV_l, sQ_l, sdO_l, sdSt_l, sQt_l, sdOt_l, sdS_l, sKt_l, tP_l,
            seqlen_q, seqlen_k, kv_group, scale_log2, softmax_scale, causal_offset,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream,
                 min_blocks_per_mp=1)  # .minnctapersm 1: else ptxas ignores setmaxnreg (C7508)

    @cute.kernel
    def kernel(
        self,
        mma_s: cute.TiledMma, mma_dp: cute.TiledMma, mma_dv: cute.TiledMma, mma_dk: cute.TiledMma,
        mma_dq: cute.TiledMma,
        tma_k: cute.CopyAtom, gK_all: cute.Tensor, tma_v: cute.CopyAtom, gV_all: cute.Tensor,
        tma_q: cute.CopyAtom, gQ_all: cute.Tensor, tma_do: cute.CopyAtom, gdO_all: cute.Tensor,
        mLSE2: cute.Tensor, mDsum: cute.Tensor, mdQacc: cute.Tensor, mdQturn: cute.Tensor,
        mdK: cute.Tensor, mdV: cute.Tensor, mScale: cute.Tensor,
        sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout, sQ_l: cute.ComposedLayout,
        sdO_l: cute.ComposedLayout, sdSt_l: cute.ComposedLayout, sQt_l: cute.ComposedLayout,
        sdOt_l: cute.ComposedLayout, sdS_l: cute.ComposedLayout, sKt_l: cute.ComposedLayout,
        tP_l: cute.ComposedLayout,
        seqlen_q: Int32, seqlen_k: Int32, kv_group: Int32,
        scale_log2: Float32, softmax_scale: Float32, causal_offset: Int32,
    ):
        cfg = self.config
        D, BM, BN = cfg.head_dim, cfg.tile_m, cfg.tile_n
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()
        head_kv = head // kv_group  # GQA: H % Hkv == 0

        if warp == self.load_warp:
            for atom in (tma_k, tma_v, tma_q, tma_do):
                cpasync.prefetch_descriptor(atom)

        @cute.struct
        class Storage:
            kv_bar: cute.struct.MemRange[cutlass.Int64, 2]
            qdo_bar: cute.struct.MemRange[cutlass.Int64, 2 * cfg.q_stages]
            s_bar: cute.struct.MemRange[cutlass.Int64, 2]
            p_bar: cute.struct.MemRange[cutlass.Int64, 2]
            dq_bar: cute.struct.MemRange[cutlass.Int64, 2]
            dkv_bar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_holding_buf: Int32

        smem = utils.SmemAllocator()
        st = smem.allocate(Storage)
        sK = smem.allocate_tensor(BF16, sK_l.outer, 1024, sK_l.inner)
        sV = smem.allocate_tensor(self.v_dtype, sV_l.outer, 1024, sV_l.inner)
        sQ = smem.allocate_tensor(BF16, sQ_l.outer, 1024, sQ_l.inner)
        sdO = smem.allocate_tensor(self.do_dtype, sdO_l.outer, 1024, sdO_l.inner)
        sdSt = smem.allocate_tensor(BF16, sdSt_l.outer, 1024, sdSt_l.inner)
        sQt, sKt, sdS = view(sQ, sQt_l), view(sK, sKt_l), view(sdSt, sdS_l)
        sdOt = view(sdO, sdOt_l, self.do_dtype)

        # CuTe's checker (compile option "warnings") reports C3 "arrive count may not match
        # the mbarrier.init count (effective count: 32)" for the four barriers with a `wg`
        # side (s, p, dq, dkv): it assumes a warp-ID guard selects one warp, but `warp < 4`
        # and `4 <= warp < 8` each select four, 128 threads = this init count. Triaged
        # 2026-12-01: not a defect.
        one, wg = coop(1), coop(128)
        # load -> MMA: K/V once, Q/dO per query tile (TMA transaction bytes)
        kv_prod, kv_cons = participants(pipeline.PipelineTmaUmma, st.kv_bar, one, one, tx_count=self.kv_bytes)
        qdo_prod, qdo_cons = participants(pipeline.PipelineTmaUmma, st.qdo_bar, one, one, stages=cfg.q_stages,
                                          tx_count=self.qdo_bytes)
        # MMA -> compute: S^T and dP^T complete; compute -> MMA (release): both drained
        s_prod, s_cons = participants(pipeline.PipelineUmmaAsync, st.s_bar, one, wg)
        # compute -> MMA: P^T in TMEM and dS^T in SMEM (fenced); MMA -> compute (release):
        # dV, dK and dQ of that tile have read them
        p_prod, p_cons = participants(pipeline.PipelineAsyncUmma, st.p_bar, wg, one)
        # MMA -> dQ warps: dQ complete; dQ warps -> MMA (release): dQ's columns drained
        dq_prod, dq_cons = participants(pipeline.PipelineUmmaAsync, st.dq_bar, one, wg)
        # MMA -> compute: dK, dV final
        dkv_prod, dkv_cons = participants(pipeline.PipelineUmmaAsync, st.dkv_bar, one, wg)

        tmem = utils.TmemAllocator(
            st.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=self.threads),
            allocator_warp_id=self.compute_warps[0])
        tmem.allocate(cfg.tmem_alloc_cols)
        tmem.wait_for_alloc()
        tmem_base = tmem.retrieve_ptr(Float32)

        # ---- TMEM views: every column offset is the plan's (cfg.tmem) -----------------
        def acc(name, mma, tiler):
            frag = mma.make_fragment_C(mma.partition_shape_C(tiler[:2]))
            return cute.make_tensor(tmem_base + cfg.first_col(name), frag.layout)

        tStS = acc("S", mma_s, self.s_tiler)
        tdPt = acc("dP", mma_dp, self.s_tiler)
        tdVt = acc("dV", mma_dv, self.kv_tiler)
        tdKt = acc("dK", mma_dk, self.kv_tiler)
        tdQt = acc("dQ", mma_dq, self.q_tiler)
        tdVrP = mma_dv.make_fragment_A(
            cute.make_tensor(cute.recast_ptr(tmem_base + cfg.first_col("P"), dtype=self.p_dtype), slice0(tP_l).outer))

        # query tiles that see this CTA's keys
        m_max = cute.ceil_div(seqlen_q, BM)
        m_min = Int32(0)
        if const_expr(cfg.causal):
            # key j is seen by queries i >= j - (Sk - Sq): skip the tiles above the diagonal
            m_min = cutlass.max(n_block * BN - causal_offset, 0) // BM
        n_tiles = cutlass.max(m_max - m_min, 0)

        # Register budgets (plan roles): each role sets its own (setmaxnreg) as the first
        # statement of its branch, so that ptxas knows which budget each role's code has.
        if warp > self.load_warp:  # the idle warps of the last warpgroup
            self.set_registers(cfg.regs_other, cfg.regs_other_increase)

        # ============================ load warp ============================
        if warp == self.load_warp:
            self.set_registers(cfg.regs_other, cfg.regs_other_increase)
            thr_s, thr_dp = mma_s.get_slice(0), mma_dp.get_slice(0)
            gK = cute.local_tile(gK_all[None, None, head_kv, batch], (BN, D), (None, None))
            gV = cute.local_tile(gV_all[None, None, head_kv, batch], (BN, D), (None, None))
            gQ = cute.local_tile(gQ_all[None, None, head, batch], (BM, D), (None, None))
            gdO = cute.local_tile(gdO_all[None, None, head, batch], (BM, D), (None, None))
            tKs, tKg = tma_part(tma_k, sK, thr_s.partition_A(gK), False)
            tVs, tVg = tma_part(tma_v, sV, thr_dp.partition_A(gV), False)
            tQs, tQg = tma_part(tma_q, sQ, thr_s.partition_B(gQ), False)
            tdOs, tdOg = tma_part(tma_do, sdO, thr_dp.partition_B(gdO), False)
            hkv = kv_prod.acquire_and_advance()
            cute.copy(tma_k, tKg[None, n_block, 0], tKs[None, 0], tma_bar_ptr=hkv.barrier)
            cute.copy(tma_v, tVg[None, n_block, 0], tVs[None, 0], tma_bar_ptr=hkv.barrier)
            for it in cutlass.range(n_tiles, unroll=1):
                hq = qdo_prod.acquire_and_advance()
                cute.copy(tma_q, tQg[None, m_min + it, 0], tQs[None, hq.index], tma_bar_ptr=hq.barrier)
                cute.copy(tma_do, tdOg[None, m_min + it, 0], tdOs[None, hq.index], tma_bar_ptr=hq.barrier)

        # ============================ MMA warp =============================
        # Per query tile: S^T, dP^T -> commit "S" -> wait "P" -> dV, dK, dQ -> commit "dQ",
        # release "P" and the Q/dO slot (both complete when these MMAs have). The tensor pipe
        # executes tcgen05 ops in issue order, so the next S^T (over P^T's columns) and the
        # next dP^T (over dQ's columns when they alias) start after this tile's dV / dQ.
        if warp == self.mma_warp:
            self.set_registers(cfg.regs_other, cfg.regs_other_increase)
            tSrK = mma_s.make_fragment_A(sK)
            tSrQ = mma_s.make_fragment_B(sQ)
            tPrV = mma_dp.make_fragment_A(sV)
            tPrdO = mma_dp.make_fragment_B(sdO)
            tVrdOt = mma_dv.make_fragment_B(sdOt)
            tKrdSt = mma_dk.make_fragment_A(sdSt)
            tKrQt = mma_dk.make_fragment_B(sQt)
            tQrdS = mma_dq.make_fragment_A(sdS)
            tQrKt = mma_dq.make_fragment_B(sKt)
            hkv = kv_cons.wait_and_advance()
            for it in cutlass.range(n_tiles, unroll=1):
                hq = qdo_cons.wait_and_advance()
                hdq = dq_prod.acquire_and_advance()  # the dQ warps drained the previous dQ
                hs = s_prod.acquire_and_advance()  # the compute warps drained S^T / dP^T
                mma_s = gemm(mma_s, tStS, tSrK[None, None, None, 0], tSrQ[None, None, None, hq.index], False)
                mma_dp = gemm(mma_dp, tdPt, tPrV[None, None, None, 0], tPrdO[None, None, None, hq.index], False)
                hs.commit()
                hp = p_cons.wait_and_advance()
                # dV, dK accumulate across query tiles: zero-initialised by the first tile only
                mma_dv = gemm(mma_dv, tdVt, tdVrP, tVrdOt[None, None, None, hq.index], it != 0)
                mma_dk = gemm(mma_dk, tdKt, tKrdSt[None, None, None, 0], tKrQt[None, None, None, hq.index], it != 0)
                mma_dq = gemm(mma_dq, tdQt, tQrdS[None, None, None, 0], tQrKt[None, None, None, 0], False)
                hdq.commit()
                hp.release()
                hq.release()
            hd = dkv_prod.acquire_and_advance()
            hd.commit()  # dK, dV final once every tcgen05.mma issued so far has completed
            hkv.release()

        # ========================== compute warps ==========================
        if warp < 4:
            self.set_registers(cfg.regs_compute, cfg.regs_compute_increase)
            tmem.relinquish_alloc_permit()
            self.compute(tidx % 128, mma_dv, tdVrP, tStS, tdPt, tdVt, tdKt, sdSt, s_cons, p_prod, dkv_cons,
                         mLSE2, mDsum, mdK, mdV, mScale, n_block, head, batch, m_min, n_tiles, seqlen_k,
                         scale_log2, softmax_scale, causal_offset)
        # ============================ dQ warps =============================
        if warp >= 4 and warp < 8:
            self.set_registers(cfg.regs_dq, cfg.regs_dq_increase)
            self.dq_reduce(tidx % 128, tdQt, dq_cons, mdQacc, mdQturn, n_block, head, batch, m_min, n_tiles)
        if warp < 8:
            # the compute and dQ warps have completed every TMEM load (tcgen05.wait::ld) and the
            # MMAs are done (the compute warps waited for "dK/dV final"): TMEM may be freed.
            # The fences order those loads across the barrier (PTX ISA 9.7.16.6). CuTe's
            # checker still reports W0015 ("dealloc not ordered after prior TMEM loads")
            # at tmem.free: it does not count this named barrier over 256 threads as
            # synchronisation. Every TMEM reader is in it. Triaged 2026-12-01.
            bdev.tcgen05_fence_before_thread_sync()
            cute.arch.barrier(barrier_id=3, number_of_threads=256)
        if warp < 4:
            bdev.tcgen05_fence_after_thread_sync()
            tmem.free(tmem_base)

    # ---------------------------------------------------------------- helpers
    def set_registers(self, count, increase):
        """setmaxnreg for this warpgroup's plan budget: .inc above the launch share, else .dec
        (a Python helper: resolved while tracing)."""
        if increase:
            cute.arch.setmaxregister_increase(count)
        else:
            cute.arch.setmaxregister_decrease(count)

    @cute.jit
    def compute(self, t: Int32, mma_dv, tdVrP, tStS, tdPt, tdVt, tdKt, sdSt, s_cons, p_prod, dkv_cons,
                mLSE2, mDsum, mdK, mdV, mScale, n_block: Int32, head: Int32, batch: Int32, m_min: Int32,
                n_tiles: Int32, seqlen_k: Int32, scale_log2: Float32, softmax_scale: Float32,
                causal_offset: Int32):
        """One thread per key (TMEM lane t): P^T and dS^T of its row, then its dK/dV rows."""
        cfg = self.config
        D, BM, BN = cfg.head_dim, cfg.tile_m, cfg.tile_n
        ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(CHUNK)), Float32)
        chunk_l = cute.composition(tStS.layout, cute.make_layout((BN, CHUNK)))
        s_chunks = [cute.make_tensor(tStS.iterator + CHUNK * c, chunk_l) for c in range(BM // CHUNK)]
        dp_chunks = [cute.make_tensor(tdPt.iterator + CHUNK * c, chunk_l) for c in range(BM // CHUNK)]
        # a warp's tcgen05.ld/st address depends only on its warp: sliced by the warp's first
        # thread, marked uniform, the address stays in a uniform register (no R2UR per load)
        t_warp = cute.arch.make_warp_uniform(t // 32) * 32
        thr_ld = tcgen05.make_tmem_copy(ld, s_chunks[0]).get_slice(t_warp)
        tS_src = [thr_ld.partition_S(x) for x in s_chunks]
        tdP_src = [thr_ld.partition_S(x) for x in dp_chunks]
        reg_shape = thr_ld.partition_D(s_chunks[0]).shape
        # P^T goes to TMEM through the dV MMA's own A-operand fragment (tdVrP at the plan's P
        # columns): the tcgen05.st partition of that fragment decides which column holds which
        # query, as in CUTLASS's Blackwell fmha backward. Its source side is
        # (((16, 2), 1), 1, 1, BM / 32) for bf16: one 16-column store per chunk of 32 queries
        # (8 columns for E4M3), registers in query order (the order tcgen05.ld.32x32b gave the
        # scores). Chunk c lands in P + 16c (8c), inside S^T chunk c // 2 (c // 4) (P starts at
        # S, the lowering checks it), already loaded.
        PT = self.p_dtype
        st = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(CHUNK * PT.width // 32)), PT)
        thr_r2t = tcgen05.make_tmem_copy(st, tdVrP).get_slice(t_warp)
        tRT_tP = thr_r2t.partition_D(tdVrP)
        p_shape = thr_r2t.partition_S(mma_dv.get_slice(0).partition_A(cute.make_identity_tensor((BN, BM)))).shape
        assert cute.rank(p_shape) == 4 and cute.size(p_shape, mode=[3]) == BM // CHUNK, p_shape

        key = n_block * BN + t
        key_out = key >= seqlen_k  # TMA filled this key's K/V rows with zeros: P must be 0
        # Per element, two at a time (f32x2): x = S^T c + nl, P = exp2(x), t = dP^T f + nD,
        # dS^T = P t. bf16: nl = -LSE2, f = 1, nD = -D. FP8 dO: P^T goes out as E4M3 of 2^8 P,
        # so the 2^8 is folded into the exponent (nl = 8 - LSE2: exp2 gives 2^8 P) and its
        # inverse into dS^T's factor (f = s_do s_v / 2^8, nD = -D / 2^8): exact powers of two.
        # The FP8 scales: dP^T = s_do s_v (dO8 V8^T), dV = (s_do / 2^8) (P8^T dO8).
        p_log2 = 0.0
        dp_scale, dv_scale = Float32(1.0), Float32(1.0)
        if const_expr(cfg.do_fp8):
            p_log2 = float(cfg.p_fp8_scale_log2)
            dp_scale = mScale[batch, head, 0] * Float32(2.0 ** -cfg.p_fp8_scale_log2)
            dv_scale = mScale[batch, head, 1]
        d_mul = Float32(-(2.0 ** -p_log2))
        # a tile needs the per-element mask only if one of its (key, query) pairs is hidden:
        # keys past Sk (the last key tile) or, causal, above the diagonal (warp-uniform)
        last_key = n_block * BN + BN - 1
        keys_in = last_key < seqlen_k
        ctx = (t, key, key_out, batch, head, mLSE2, mDsum, scale_log2, causal_offset, p_log2, d_mul, dp_scale,
               thr_ld, tS_src, tdP_src, reg_shape, thr_r2t, tRT_tP, sdSt)

        for it in cutlass.range(n_tiles, unroll=1):
            q0 = (m_min + it) * BM
            hs = s_cons.wait_and_advance()
            hp = p_prod.acquire_and_advance()  # the previous tile's dV/dK/dQ read P^T and dS^T
            rP = cute.make_rmem_tensor(p_shape, PT)
            unmasked = keys_in
            if const_expr(cfg.causal):
                unmasked = unmasked & (last_key <= q0 + causal_offset)
            if unmasked:
                for c in cutlass.range_constexpr(BM // CHUNK):
                    self.chunk(c, q0, rP, False, ctx)
            else:
                for c in cutlass.range_constexpr(BM // CHUNK):
                    self.chunk(c, q0, rP, True, ctx)
            # P^T stores complete (tcgen05.wait::st) and dS^T visible to the tensor pipe
            cute.arch.fence_view_async_tmem_store()
            cute.arch.fence_proxy("async.shared", space="cta")
            hp.commit()
            hs.release()

        # ---- epilogue: dV and dK (scaled) rows of this thread's key -> global ----
        hd = dkv_cons.wait_and_advance()
        visited = n_tiles > 0  # a key tile no query sees has zero gradients (TMEM never written)
        # dV carries FP8 dO's factor (bf16: none), dK the softmax scale
        for acc_t, out, factor, scaled in ((tdVt, mdV, dv_scale, cfg.do_fp8), (tdKt, mdK, softmax_scale, True)):
            cl = cute.composition(acc_t.layout, cute.make_layout((BN, CHUNK)))
            for c in cutlass.range_constexpr(D // CHUNK):
                src_t = cute.make_tensor(acc_t.iterator + CHUNK * c, cl)
                thr = tcgen05.make_tmem_copy(ld, src_t).get_slice(t)
                r = cute.make_rmem_tensor(thr.partition_D(src_t).shape, Float32)
                cute.copy(thr, thr.partition_S(src_t), r)
                cute.arch.fence_view_async_tmem_load()
                if key < seqlen_k:
                    for e in cutlass.range_constexpr(CHUNK):
                        v = r[e]
                        if const_expr(scaled):
                            v = v * factor
                        v = Float32(cutlass.select_(visited, v, Float32(0.0)))
                        out[batch, key, head, c * CHUNK + e] = v.to(out.element_type)
        hd.release()

    def chunk(self, c, q0, rP, masked: bool, ctx):
        """Scores of 32 queries (chunk c) of query tile q0 -> P^T (TMEM) and dS^T (SMEM) of this
        thread's key. A plain Python helper (CuTe DSL stages no closures), unrolled where it is
        traced (its loops and branches are Python's); ``ctx`` holds the compute loop's values."""
        cfg = self.config
        PT = self.p_dtype
        (t, key, key_out, batch, head, mLSE2, mDsum, scale_log2, causal_offset, p_log2, d_mul, dp_scale,
         thr_ld, tS_src, tdP_src, reg_shape, thr_r2t, tRT_tP, sdSt) = ctx
        rS = cute.make_rmem_tensor(reg_shape, Float32)
        rdP = cute.make_rmem_tensor(reg_shape, Float32)
        cute.copy(thr_ld, tS_src[c], rS)
        cute.copy(thr_ld, tdP_src[c], rdP)
        cute.arch.fence_view_async_tmem_load()
        # P^T and dS^T replace S^T and dP^T in place (registers are the limit here)
        p32 = cute.make_tensor(rS.iterator, cute.make_layout(CHUNK))
        ds32 = cute.make_tensor(rdP.iterator, cute.make_layout(CHUNK))
        # LSE2 and D of these 32 queries as 16-byte loads: the offset divides by 32 because
        # the host pads each (batch, head) row to whole query tiles (sqp = 128 k)
        row0 = cute.assume(cute.crd2idx((batch, head, q0 + c * CHUNK), mLSE2.layout), 32)
        lse_c = cute.make_rmem_tensor((CHUNK,), Float32)
        dsum_c = cute.make_rmem_tensor((CHUNK,), Float32)
        cute.autovec_copy(cute.make_tensor(mLSE2.iterator + row0, cute.make_layout(CHUNK)), lse_c)
        cute.autovec_copy(cute.make_tensor(mDsum.iterator + row0, cute.make_layout(CHUNK)), dsum_c)
        for e in range(0, CHUNK, 2):
            # LSE2 is +inf past Sq and for rows that saw no key: x = -inf, P = 0 there
            nl = cute.arch.fma_packed_f32x2((lse_c[e], lse_c[e + 1]), (Float32(-1.0), Float32(-1.0)),
                                            (Float32(p_log2), Float32(p_log2)))
            x = cute.arch.fma_packed_f32x2((p32[e], p32[e + 1]), (scale_log2, scale_log2), nl)
            xs = [x[0], x[1]]
            if masked:
                for i in range(2):
                    bad = key_out
                    if cfg.causal:  # bottom-right aligned diagonal
                        bad = bad | (key > q0 + c * CHUNK + e + i + causal_offset)
                    xs[i] = Float32(cutlass.select_(bad, -Float32.inf, xs[i]))
            p = [cute.math.exp2(xs[i], fastmath=True) for i in range(2)]
            nd = cute.arch.mul_packed_f32x2((dsum_c[e], dsum_c[e + 1]), (d_mul, d_mul))
            if cfg.do_fp8:
                tt = cute.arch.fma_packed_f32x2((ds32[e], ds32[e + 1]), (dp_scale, dp_scale), nd)
            else:
                tt = cute.arch.add_packed_f32x2((ds32[e], ds32[e + 1]), nd)
            ds32[e], ds32[e + 1] = cute.arch.mul_packed_f32x2((p[0], p[1]), tt)  # dS^T = P^T (dP^T - D)
            p32[e], p32[e + 1] = p[0], p[1]
        rPc = rP[None, None, None, c]
        cute.make_tensor(rPc.iterator, cute.make_layout(CHUNK)).store(p32.load().to(PT))
        cute.copy(thr_r2t, rPc, tRT_tP[None, None, None, c])
        dsb = cute.make_rmem_tensor((CHUNK,), BF16)
        dsb.store(ds32.load().to(BF16))
        # dS^T row -> SMEM in the dK MMA's A layout ((key, query % 16), 0, query // 16):
        # 16 queries are contiguous there (the 128-byte swizzle moves 16-byte units),
        # so each half-chunk is two 16-byte stores
        for kb in range(CHUNK // 16):
            dst = sdSt[((t, None), 0, c * (CHUNK // 16) + kb, 0)]
            cute.autovec_copy(cute.make_tensor(dsb.iterator + 16 * kb, cute.make_layout(16)), dst)

    @cute.jit
    def dq_reduce(self, t: Int32, tdQt, dq_cons, mdQacc, mdQturn, n_block: Int32, head: Int32,
                  batch: Int32, m_min: Int32, n_tiles: Int32):
        """One thread per query (TMEM lane t): its dQ row -> fp32 atomics into dq_acc."""
        cfg = self.config
        D, BM, BN = cfg.head_dim, cfg.tile_m, cfg.tile_n
        ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(CHUNK)), Float32)
        chunk_l = cute.composition(tdQt.layout, cute.make_layout((BM, CHUNK)))
        chunks = [cute.make_tensor(tdQt.iterator + CHUNK * c, chunk_l) for c in range(D // CHUNK)]
        # sliced by the warp's first thread, marked uniform (see ``compute``)
        thr_ld = tcgen05.make_tmem_copy(ld, chunks[0]).get_slice(cute.arch.make_warp_uniform(t // 32) * 32)
        src = [thr_ld.partition_S(x) for x in chunks]
        reg_shape = thr_ld.partition_D(chunks[0]).shape
        for it in cutlass.range(n_tiles, unroll=1):
            m = m_min + it
            hq = dq_cons.wait_and_advance()
            # rows past Sq land in dq_acc's padding (the host allocates whole query tiles)
            row = cute.make_tensor(mdQacc.iterator + cute.crd2idx((batch, head, m * BM + t, 0), mdQacc.layout),
                                   cute.make_layout(D))
            if const_expr(cfg.deterministic):
                # deterministic: key tiles add into each query tile in ascending order.
                # Every key tile before this one visits query tile m (the causal start tile grows
                # with the key tile) and CTAs launch in key-tile order, so the wait ends.
                turn = mdQturn.iterator + cute.crd2idx((batch, head, m), mdQturn.layout)
                if t == 0:
                    seen = ptx.ld_acquire_s32(turn)
                    while seen != n_block:
                        seen = ptx.ld_acquire_s32(turn)
                cute.arch.barrier(barrier_id=2, number_of_threads=128)
            # 32 columns at a time (registers): load, wait, then fire-and-forget adds
            for c in cutlass.range_constexpr(D // CHUNK):
                r = cute.make_rmem_tensor(reg_shape, Float32)
                cute.copy(thr_ld, src[c], r)
                cute.arch.fence_view_async_tmem_load()
                for v in cutlass.range_constexpr(CHUNK // 4):
                    ptx.red_add_f32x4(row.iterator + c * CHUNK + 4 * v,
                                       r[4 * v], r[4 * v + 1], r[4 * v + 2], r[4 * v + 3])
            hq.release()  # dQ's columns are free for the next tile's MMAs
            if const_expr(cfg.deterministic):
                cute.arch.fence_acq_rel_gpu()  # this thread's adds are performed before the turn passes
                cute.arch.barrier(barrier_id=2, number_of_threads=128)
                if t == 0:
                    ptx.red_release_add_s32(turn, 1)
