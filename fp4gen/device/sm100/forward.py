"""The sm100a (Blackwell) attention forward kernel: ``AttentionFwdSm100``, one class for every
generated sm100a forward (docs/sm100.md; docs/design/kernel-library.md).

A generated module renders its plan's values as a ``ForwardKernelConfig``
(fp4gen/device/sm100/config.py) and builds this class with it; each variant (P path, P in
TMEM or SMEM, causal, block-scaled PV, the sampling guard) is chosen with
``cutlass.const_expr(cfg.x)``, which CuTe DSL resolves while tracing, so a module compiles to
the instructions of its variant only. The TMEM columns, warp roles, register budgets and P
publication parts are the plan's (through the config); nothing here chooses them.

Comments that say "Triaged" answer a CuTe DSL checker warning at the line below them
(fp4gen/lowering/cute_warnings.py reads them here).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as bsl
from cutlass.tensor_utils import LayoutEnum
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

from fp4gen.device import markers
from fp4gen.device import directp as dpf  # E4M3 decode, shared with sm90a
from fp4gen.device.pipelines import coop, stage_pipelines, stage_view
from fp4gen.device import ptx
from fp4gen.device.sm100 import copies
from fp4gen.device.sm100 import direct_p as dp
from fp4gen.device.sm100 import exp2_fma as e2f
from fp4gen.device.sm100 import opaque as opq
from fp4gen.device.sm100 import two_level as tl
from fp4gen.device.sm100.config import ForwardKernelConfig
from fp4gen.numerics import directp as dpn

F4 = cutlass.Float4E2M1FN
E4M3 = cutlass.Float8E4M3FN
E8M0 = cutlass.Float8E8M0FNU
# FP8 exp path: pairs of scores in each eight whose exp2 runs on the FMA pipe (exp2_fma) instead
# of the MUFU. 2 of 8 (model, B200: issue 782 against MUFU 776 cycles per warp and tile, from
# 1,032 MUFU-bound with none); 3 of 8 spilled 24 B
EXP2_FMA_PAIRS_IN_8 = 2


class AttentionFwdSm100:
    """Warp-specialized two-stage block-scaled attention forward (docs/sm100.md).

    ``config``: the plan's values (a ``ForwardKernelConfig``, rendered in the generated
    module); ``gmem_layouts``: the host's description of the global tensors
    (``fp4gen.runtime.sm100_host.ForwardHost.gmem_layouts``), from which ``__call__`` builds
    its tensors, so that host and kernel read one table."""

    def __init__(self, config: ForwardKernelConfig, gmem_layouts):
        cfg = self.config = config
        self.gmem_layouts = gmem_layouts
        self.softmax_warps = cfg.softmax_warps
        self.correction_warps = cfg.correction_warps
        self.mma_warp = cfg.mma_warp
        self.load_warp = cfg.load_warp
        self.threads = 32 * cfg.n_warps  # the plan's roles; warps past the load warp idle
        self.qk_tiler = (cfg.tile_m, cfg.tile_n, cfg.head_dim)
        self.pv_tiler = (cfg.tile_m, cfg.head_dim, cfg.tile_n)
        # P publications per KV tile (plan.publish: whole, or halves: keys [0, N/2) then [N/2, N))
        self.p_parts = cfg.p_parts
        self.pv_sf = E4M3 if cfg.pv_sf_vec == 16 else E8M0  # P/V block-scale type of a block-scaled PV
        self.pv_dtype = E4M3 if cfg.pv_fp8 else F4
        self.p_source = tcgen05.OperandSource.SMEM if cfg.p_smem else tcgen05.OperandSource.TMEM
        # the softmax's copies of its tile loop, masked or not, in the order they run (softmax():
        # the unmasked tiles first on Direct-P). No extra copies for an unguarded stage's m = 0
        # (ea85f78 had them: 64 fewer FADD2 per tile, twice the code, +85 % compile time)
        # The exp and two-level paths keep one loop: split, each spilled (two-level 4 bytes; the FP8
        # exp path 8 to 32 bytes in its masked copy once the other copy had FMA-pipe exp2s)
        self.tile_loops = (False, True) if cfg.direct_p else (True,)

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer, sfq_ptr: cute.Pointer,
        k_ptr: cute.Pointer, sfk_ptr: cute.Pointer,
        v_ptr: cute.Pointer, sfv_ptr: cute.Pointer,
        o_ptr: cute.Pointer, lse_ptr: cute.Pointer, vs_ptr: cute.Pointer,
        seqlen_q: Int32, seqlen_k: Int32, num_bh: Int32, kv_group: Int32,
        scale_log2: Float32,
        stream,
    ):
        cfg = self.config
        D = cfg.head_dim
        num_bh_kv = num_bh // kv_group
        # Global layouts shared with the host (gmem_layouts; prepare_operands builds
        # tensors that match them, tests/sm100/test_sm100_host.py checks both agree).
        gl = self.gmem_layouts(cute, bsl, seqlen_q, seqlen_k, num_bh, num_bh_kv)
        mQ = cute.make_tensor(q_ptr, gl["q"])
        mK = cute.make_tensor(k_ptr, gl["k"])
        mV = cute.make_tensor(v_ptr, gl["v"])
        mO = cute.make_tensor(o_ptr, gl["o"])
        mLSE = cute.make_tensor(lse_ptr, gl["lse"])
        # V's per-(batch, kv head) fp32 tensor scale (1.0 when V has block scales only)
        mVS = cute.make_tensor(vs_ptr, gl["vs"])
        # Scale factors in the tcgen05 scale-factor atom layout (32x4x4 bytes per atom).
        mSFQ = cute.make_tensor(sfq_ptr, gl["sfq"])
        mSFK = cute.make_tensor(sfk_ptr, gl["sfk"])
        mSFV = cute.make_tensor(sfv_ptr, gl["sfv"]) if const_expr(cfg.pv_block_scaled) else None

        # byte views of Q, K and their scales for the guard's software dot products
        mQb = cute.make_tensor(cute.recast_ptr(q_ptr, dtype=cutlass.Uint8), cute.make_layout(
            (seqlen_q, D // 2, num_bh), stride=(D // 2, 1, cute.assume(seqlen_q * (D // 2), 64))))
        mKb = cute.make_tensor(cute.recast_ptr(k_ptr, dtype=cutlass.Uint8), cute.make_layout(
            (seqlen_k, D // 2, num_bh_kv), stride=(D // 2, 1, cute.assume(seqlen_k * (D // 2), 64))))
        mSFQb = cute.make_tensor(cute.recast_ptr(sfq_ptr, dtype=cutlass.Uint8), mSFQ.layout)
        mSFKb = cute.make_tensor(cute.recast_ptr(sfk_ptr, dtype=cutlass.Uint8), mSFK.layout)

        qk_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            F4, F4, OperandMajorMode.K, OperandMajorMode.K, E4M3, 16,
            tcgen05.CtaGroup.ONE, self.qk_tiler[:2])
        v_major = OperandMajorMode.K if const_expr(cfg.v_k_major) else OperandMajorMode.MN
        if const_expr(cfg.pv_block_scaled):
            pv_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
                self.pv_dtype, self.pv_dtype, OperandMajorMode.K, v_major, self.pv_sf, cfg.pv_sf_vec,
                tcgen05.CtaGroup.ONE, self.pv_tiler[:2], self.p_source)
        else:
            pv_mma = sm100_utils.make_trivial_tiled_mma(
                self.pv_dtype, self.pv_dtype, OperandMajorMode.K, v_major, Float32,
                tcgen05.CtaGroup.ONE, self.pv_tiler[:2], self.p_source)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk_mma.thr_id.shape,))

        sQ_l = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, F4, cfg.q_stages)
        sK_l = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, F4, cfg.kv_stages)
        sV_l = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, self.pv_dtype, cfg.kv_stages)
        sSFQ_l = bsl.make_smem_layout_sfa(qk_mma, self.qk_tiler, 16, cfg.q_stages)
        sSFK_l = bsl.make_smem_layout_sfb(qk_mma, self.qk_tiler, 16, cfg.kv_stages)
        sSFV_l = None
        sSFP_l = None
        if const_expr(cfg.pv_block_scaled):
            sSFV_l = bsl.make_smem_layout_sfb(pv_mma, self.pv_tiler, cfg.pv_sf_vec, cfg.kv_stages)
            # P's block scales take the same path as the loaded scales (SMEM -> tcgen05.cp
            # -> TMEM): one buffer per query stage.
            sSFP_l = bsl.make_smem_layout_sfa(pv_mma, self.pv_tiler, cfg.pv_sf_vec, cfg.q_stages)
        if const_expr(cfg.p_smem):
            # Layout of P as the A operand in SMEM (p_source smem): one tile per query stage. The
            # softmax warps' stores compute the same swizzle by hand; this says they agree.
            tP_l = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, self.pv_dtype, cfg.q_stages)
            assert str(tP_l.inner) == cfg.p_swizzle, f"P's SMEM swizzle is {tP_l.inner}, the stores assume {cfg.p_swizzle}"
        else:
            # Layout of P as the A operand read from TMEM.
            tP_l = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, self.pv_dtype, 1)

        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)

        def slice0(l):
            return cute.slice_(l, (None, None, None, 0))

        tma_q, gQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, mQ, slice0(sQ_l), self.qk_tiler, qk_mma, cluster_vmnk.shape)
        tma_k, gK = cute.nvgpu.make_tiled_tma_atom_B(g2s, mK, slice0(sK_l), self.qk_tiler, qk_mma, cluster_vmnk.shape)
        tma_v, gV = cute.nvgpu.make_tiled_tma_atom_B(g2s, mV, slice0(sV_l), self.pv_tiler, pv_mma, cluster_vmnk.shape)
        tma_sfq, gSFQ = cute.nvgpu.make_tiled_tma_atom_A(g2s, mSFQ, slice0(sSFQ_l), self.qk_tiler, qk_mma, cluster_vmnk.shape, internal_type=cutlass.Int16)
        tma_sfk, gSFK = cute.nvgpu.make_tiled_tma_atom_B(g2s, mSFK, slice0(sSFK_l), self.qk_tiler, qk_mma, cluster_vmnk.shape, internal_type=cutlass.Int16)
        tma_sfv, gSFV = None, None
        if const_expr(cfg.pv_block_scaled):
            tma_sfv, gSFV = cute.nvgpu.make_tiled_tma_atom_B(g2s, mSFV, slice0(sSFV_l), self.pv_tiler, pv_mma, cluster_vmnk.shape, internal_type=cutlass.Int16)

        # O leaves through SMEM by a TMA store (one (tile_m, D) tile per query stage, one buffer
        # the stages take in turn): rows past the sequence end are clipped by the tensor map
        self.o_dtype = mO.element_type
        sO_l = sm100_utils.make_smem_layout_epi(self.o_dtype, LayoutEnum.ROW_MAJOR, (cfg.tile_m, D), 1)
        assert str(sO_l.inner) == "S<3,4,3>", f"O's SMEM swizzle is {sO_l.inner}, the epilogue's stores assume S<3,4,3>"
        tma_o, gO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                cute.slice_(sO_l, (None, None, 0)), (cfg.tile_m, D))

        self.q_bytes = cute.size_in_bytes(F4, slice0(sQ_l)) + cute.size_in_bytes(E4M3, slice0(sSFQ_l))
        self.k_bytes = cute.size_in_bytes(F4, slice0(sK_l)) + cute.size_in_bytes(E4M3, slice0(sSFK_l))
        self.v_bytes = cute.size_in_bytes(self.pv_dtype, slice0(sV_l))
        if const_expr(cfg.pv_block_scaled):
            self.v_bytes += cute.size_in_bytes(self.pv_sf, slice0(sSFV_l))

        grid = (cute.ceil_div(seqlen_q, cfg.tile_m * cfg.q_stages), num_bh, 1)
        self.kernel(
            qk_mma, pv_mma,
            tma_q, gQ, tma_k, gK, tma_v, gV, tma_sfq, gSFQ, tma_sfk, gSFK, tma_sfv, gSFV, tma_o, gO,
            mLSE, mVS, mQb, mKb, mSFQb, mSFKb, sQ_l, sK_l, sV_l, sSFQ_l, sSFK_l, sSFV_l, sSFP_l, tP_l, sO_l,
            seqlen_q, seqlen_k, kv_group, scale_log2,
        ).launch(grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream,
                 # .minnctapersm 1: without it ptxas cannot know the entry register count and
                 # ignores every setmaxnreg (C7508); all warps then get 128 and spill
                 min_blocks_per_mp=1, hint_smem_base_uniform=False)

    @cute.kernel
    def kernel(
        self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom, gQ_mkl: cute.Tensor, tma_k: cute.CopyAtom, gK_nkl: cute.Tensor,
        tma_v: cute.CopyAtom, gV_nkl: cute.Tensor, tma_sfq: cute.CopyAtom, gSFQ_mkl: cute.Tensor,
        tma_sfk: cute.CopyAtom, gSFK_nkl: cute.Tensor, tma_sfv: cute.CopyAtom, gSFV_nkl: cute.Tensor,
        tma_o: cute.CopyAtom, gO_mkl: cute.Tensor, mLSE: cute.Tensor, mVS: cute.Tensor,
        mQb: cute.Tensor, mKb: cute.Tensor, mSFQb: cute.Tensor, mSFKb: cute.Tensor,
        sQ_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
        sSFQ_l: cute.Layout, sSFK_l: cute.Layout, sSFV_l: cute.Layout, sSFP_l: cute.Layout,
        tP_l: cute.ComposedLayout, sO_l: cute.ComposedLayout,
        seqlen_q: Int32, seqlen_k: Int32, kv_group: Int32, scale_log2: Float32,
    ):
        cfg = self.config
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()

        if warp == self.load_warp:
            for atom in (tma_q, tma_k, tma_v, tma_sfq, tma_sfk, tma_o):
                cpasync.prefetch_descriptor(atom)
            if const_expr(cfg.pv_block_scaled):
                cpasync.prefetch_descriptor(tma_sfv)

        @cute.struct
        class Storage:
            q_bar: cute.struct.MemRange[cutlass.Int64, cfg.q_stages * 2]
            k_bar: cute.struct.MemRange[cutlass.Int64, cfg.kv_stages * 2]
            v_bar: cute.struct.MemRange[cutlass.Int64, cfg.kv_stages * 2]
            s_bar: cute.struct.MemRange[cutlass.Int64, cfg.q_stages * 2]
            p_bar: cute.struct.MemRange[cutlass.Int64, cfg.q_stages * 2 * self.p_parts]
            o_bar: cute.struct.MemRange[cutlass.Int64, cfg.q_stages * 2]
            stats_bar: cute.struct.MemRange[cutlass.Int64, cfg.q_stages * 2]
            # two-level P: row_sum also holds the last tile's row factor r (after the sums)
            row_sum: cute.struct.MemRange[Float32, cfg.q_stages * cfg.tile_m * (2 if cfg.two_level else 1)]
            row_max: cute.struct.MemRange[Float32, cfg.q_stages * cfg.tile_m]
            guard_flag: cute.struct.MemRange[Int32, cfg.q_stages]
            tmem_holding_buf: Int32

        smem = utils.SmemAllocator()
        st = smem.allocate(Storage)
        # swizzled MMA operands start on a 1024-byte boundary (a whole 128B-swizzle pattern):
        # the SMEM descriptors carry base offset 0, which is right only there (PTX ISA
        # 9.7.16.4.1, matrix descriptor "base offset"). Found by the emulator's TMA model.
        sQ = smem.allocate_tensor(F4, sQ_l.outer, 1024, sQ_l.inner)
        sK = smem.allocate_tensor(F4, sK_l.outer, 1024, sK_l.inner)
        sV = smem.allocate_tensor(self.pv_dtype, sV_l.outer, 1024, sV_l.inner)
        sP = None
        if const_expr(cfg.p_smem):
            sP = smem.allocate_tensor(self.pv_dtype, tP_l.outer, 1024, tP_l.inner)  # p_source smem
        sO = smem.allocate_tensor(self.o_dtype, sO_l.outer, 1024, sO_l.inner)
        sSFQ = smem.allocate_tensor(E4M3, sSFQ_l, 128)
        sSFK = smem.allocate_tensor(E4M3, sSFK_l, 128)
        sSFV = None
        sSFP = None
        if const_expr(cfg.pv_block_scaled):
            sSFV = smem.allocate_tensor(self.pv_sf, sSFV_l, 128)
            sSFP = smem.allocate_tensor(self.pv_sf, sSFP_l, 128)

        one = coop(1)
        # The `wg` side of a stage's barriers is 128 threads: that stage's four softmax warps
        # (stage_view sends each warp to its own stage's barriers) or the four correction warps.
        # CuTe's checker reported C3 (arrive count vs init count) on them while each stage had
        # its own code; with run-time stage addresses it pairs no arrive with an init and is
        # silent (2026-12-07): the emulator's protocol check counts the arrivals instead.
        wg = coop(32 * 4)
        # load -> MMA
        q_prod, q_cons = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.q_bar.data_ptr(), num_stages=cfg.q_stages,
            producer_group=one, consumer_group=one, tx_count=self.q_bytes).make_participants()
        k_prod, k_cons = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.k_bar.data_ptr(), num_stages=cfg.kv_stages,
            producer_group=one, consumer_group=one, tx_count=self.k_bytes).make_participants()
        v_prod, v_cons = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.v_bar.data_ptr(), num_stages=cfg.kv_stages,
            producer_group=one, consumer_group=one, tx_count=self.v_bytes).make_participants()
        # Per query stage j (pipelines.stage_pipelines: stage j's mbarriers follow stage j-1's):
        # MMA -> softmax_j: "S_j full"; softmax_j -> MMA (release): "S_j drained" (scores in
        # registers; the lower columns of S_j may now take the other stage's QK^T scales)
        s_pipes = stage_pipelines(pipeline.PipelineUmmaAsync, st.s_bar, cfg.q_stages, one, wg)
        # softmax_j -> MMA: P_j part h written (tcgen05.st + fence) and, with part 1, its scales
        p_pipes = stage_pipelines(pipeline.PipelineAsyncUmma, st.p_bar, cfg.q_stages, wg, one, stages=self.p_parts)
        # MMA -> correction: O_j final
        o_pipes = stage_pipelines(pipeline.PipelineUmmaAsync, st.o_bar, cfg.q_stages, one, wg)
        # softmax_j -> correction: final row statistics of stage j
        t_pipes = stage_pipelines(pipeline.PipelineAsync, st.stats_bar, cfg.q_stages, wg, wg)

        # the word tcgen05.alloc writes the TMEM base to, at a register address (opaque_i32 says
        # why: without the uniform-base hint LLVM folds SMEM addresses into symbol + offset)
        tmem_word = cute.make_ptr(Int32, opq.opaque_i32(st.tmem_holding_buf.ptr.toint()),
                                  cute.AddressSpace.smem, assumed_align=4)
        tmem = utils.TmemAllocator(
            tmem_word,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=self.threads),  # every warp retrieves the base
            allocator_warp_id=self.correction_warps[0])
        tmem.allocate(cfg.tmem_alloc_cols)

        # ---- TMEM views: every column offset is the plan's (cfg.tmem) -----------------
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_mma.make_fragment_A(sQ)
        tSrK = qk_mma.make_fragment_B(sK)
        tOrV = pv_mma.make_fragment_B(sV)
        s_fake = qk_mma.make_fragment_C(qk_mma.partition_shape_C(self.qk_tiler[:2]))
        o_fake = pv_mma.make_fragment_C(pv_mma.partition_shape_C(self.pv_tiler[:2]))

        tmem.wait_for_alloc()

        # Register budgets from plan.pipeline.roles: each role sets its own (setmaxnreg) as the
        # first statement of its branch. Set in separate branches before the roles, ptxas cannot
        # tell which budget reaches which role, gives every role the smallest and spills.
        if warp >= cfg.idle_warps[0]:  # the idle warps of the last warpgroup
            cute.arch.setmaxregister_decrease(cfg.regs_other)

        # ============================ load warp ============================
        if warp == self.load_warp:
            cute.arch.setmaxregister_decrease(cfg.regs_other)
            m_block, bh, bh_kv, n_kv = self.tile_coords(seqlen_q, seqlen_k, kv_group)
            gQ = cute.local_tile(gQ_mkl, cute.slice_(self.qk_tiler, (None, 0, None)), (None, None, None))
            gK = cute.local_tile(gK_nkl, cute.slice_(self.qk_tiler, (0, None, None)), (None, None, None))
            gV = cute.local_tile(gV_nkl, cute.slice_(self.pv_tiler, (0, None, None)), (None, None, None))
            gSFQ = cute.local_tile(gSFQ_mkl, cute.slice_(self.qk_tiler, (None, 0, None)), (None, None, None))
            gSFK = cute.local_tile(gSFK_nkl, cute.slice_(self.qk_tiler, (0, None, None)), (None, None, None))
            tQs, tQg = copies.tma_part(tma_q, sQ, qk_thr.partition_A(gQ), False)
            tKs, tKg = copies.tma_part(tma_k, sK, qk_thr.partition_B(gK), False)
            tVs, tVg = copies.tma_part(tma_v, sV, pv_thr.partition_B(gV), False)
            tSFQs, tSFQg = copies.tma_part(tma_sfq, sSFQ, qk_thr.partition_A(gSFQ), True)
            tSFKs, tSFKg = copies.tma_part(tma_sfk, sSFK, qk_thr.partition_B(gSFK), True)
            # (CuTe's checker reported W0014, a tcgen05.ld outstanding at a release, at this
            # acquire until 2026-12-07; the load warp issues no tcgen05.ld.)
            for j in cutlass.range_constexpr(cfg.q_stages):
                h = q_prod.acquire_and_advance()
                mt = m_block * cfg.q_stages + j
                cute.copy(tma_q, tQg[None, mt, 0, bh], tQs[None, h.index], tma_bar_ptr=h.barrier)
                cute.copy(tma_sfq, tSFQg[None, mt, 0, bh], tSFQs[None, h.index], tma_bar_ptr=h.barrier)
            for i in cutlass.range(n_kv, unroll=1):
                hk = k_prod.acquire_and_advance()
                cute.copy(tma_k, tKg[None, i, 0, bh_kv], tKs[None, hk.index], tma_bar_ptr=hk.barrier)
                cute.copy(tma_sfk, tSFKg[None, i, 0, bh_kv], tSFKs[None, hk.index], tma_bar_ptr=hk.barrier)
                hv = v_prod.acquire_and_advance()
                cute.copy(tma_v, tVg[None, 0, i, bh_kv], tVs[None, hv.index], tma_bar_ptr=hv.barrier)
                if const_expr(cfg.pv_block_scaled):
                    gSFV = cute.local_tile(gSFV_nkl, cute.slice_(self.pv_tiler, (0, None, None)), (None, None, None))
                    tSFVs, tSFVg = copies.tma_part(tma_sfv, sSFV, pv_thr.partition_B(gSFV), True)
                    cute.copy(tma_sfv, tSFVg[None, 0, i, bh_kv], tSFVs[None, hv.index], tma_bar_ptr=hv.barrier)

        # ============================ MMA warp =============================
        # Issue order (plan.pipeline.mma_order): QK_0(0), QK_1(0); then per KV tile i >= 1
        # and stage j: PV_j(i-1), QK_j(i); finally PV_0(n-1), PV_1(n-1). The tensor pipe runs
        # tcgen05 ops in issue order, so PV_j(i-1) has read P_j before QK_j(i) rewrites S_j.
        if warp == self.mma_warp:
            cute.arch.setmaxregister_decrease(cfg.regs_other)
            m_block, bh, bh_kv, n_kv = self.tile_coords(seqlen_q, seqlen_k, kv_group)
            tmem_base = tmem.retrieve_ptr(Float32)
            tStS, tOtO, tOrP, tSFQ, tSFK, tSFV, tSFP = self.tmem_views(tmem_base, qk_mma, pv_mma, s_fake, o_fake, tP_l, sSFQ_l, sSFK_l, sSFV_l, sSFP_l)
            if const_expr(cfg.p_smem):
                tOrP_all = pv_mma.make_fragment_A(sP)  # SMEM descriptors of P (p_source smem)
                tOrP = [tOrP_all[None, None, None, j] for j in range(cfg.q_stages)]
            s2t = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), E4M3)
            cpQ = [copies.s2t_part(s2t, sSFQ, tSFQ[j]) for j in range(cfg.q_stages)]
            cpK = [copies.s2t_part(s2t, sSFK, tSFK[j]) for j in range(cfg.q_stages)]
            cpV, cpP = None, None
            if const_expr(cfg.pv_block_scaled):
                s2t8 = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.pv_sf)
                cpV = [copies.s2t_part(s2t8, sSFV, tSFV[j]) for j in range(cfg.q_stages)]
                cpP = [copies.s2t_part(s2t8, sSFP, tSFP[j]) for j in range(cfg.q_stages)]
            s_prod0, _ = s_pipes[0].make_participants()
            s_prod1, _ = s_pipes[1].make_participants()
            _, p_cons0 = p_pipes[0].make_participants()
            _, p_cons1 = p_pipes[1].make_participants()
            o_prod0, _ = o_pipes[0].make_participants()
            o_prod1, _ = o_pipes[1].make_participants()
            hq0 = q_cons.wait_and_advance()
            hq1 = q_cons.wait_and_advance()
            hk = k_cons.wait_and_advance()
            qk_mma, s_prod0, s_prod1 = self.issue_qk(0, qk_mma, tStS, tSFQ, tSFK, cpQ, cpK, tSrQ, tSrK, hq0.index, hk.index, s_prod0, s_prod1)
            qk_mma, s_prod1, s_prod0 = self.issue_qk(1, qk_mma, tStS, tSFQ, tSFK, cpQ, cpK, tSrQ, tSrK, hq1.index, hk.index, s_prod1, s_prod0)
            hk.release()
            for i in cutlass.range(1, n_kv, unroll=1):
                hv = v_cons.wait_and_advance()
                hk = k_cons.wait_and_advance()
                pv_mma, p_cons0 = self.issue_pv(0, pv_mma, tOtO, tOrP, tOrV, tSFP, tSFV, cpP, cpV, hv.index, i - 1, p_cons0)
                qk_mma, s_prod0, s_prod1 = self.issue_qk(0, qk_mma, tStS, tSFQ, tSFK, cpQ, cpK, tSrQ, tSrK, hq0.index, hk.index, s_prod0, s_prod1)
                pv_mma, p_cons1 = self.issue_pv(1, pv_mma, tOtO, tOrP, tOrV, tSFP, tSFV, cpP, cpV, hv.index, i - 1, p_cons1)
                qk_mma, s_prod1, s_prod0 = self.issue_qk(1, qk_mma, tStS, tSFQ, tSFK, cpQ, cpK, tSrQ, tSrK, hq1.index, hk.index, s_prod1, s_prod0)
                hk.release()
                hv.release()
            hv = v_cons.wait_and_advance()
            pv_mma, p_cons0 = self.issue_pv(0, pv_mma, tOtO, tOrP, tOrV, tSFP, tSFV, cpP, cpV, hv.index, n_kv - 1, p_cons0)
            ho = o_prod0.acquire_and_advance()
            ho.commit()  # O_0 final once every tcgen05 op issued so far has completed
            pv_mma, p_cons1 = self.issue_pv(1, pv_mma, tOtO, tOrP, tOrV, tSFP, tSFV, cpP, cpV, hv.index, n_kv - 1, p_cons1)
            ho = o_prod1.acquire_and_advance()
            ho.commit()
            hv.release()
            hq0.release()
            hq1.release()

        # ========================== softmax warps ==========================
        # One traced body serves every query stage: stage j is its warps' (the plan's groups of
        # softmax warps, in order), and its TMEM columns, mbarriers and SMEM rows are stage 0's
        # plus j strides. Traced once per stage, the softmax made up most of the kernel twice
        # over (compile time, issue 16).
        if warp < self.softmax_warps[-1][-1] + 1:
            cute.arch.setmaxregister_increase(cfg.regs_softmax)
            first, per = cfg.softmax_stage_warps()
            j = (warp - first) // per
            m_block, bh, bh_kv, n_kv = self.tile_coords(seqlen_q, seqlen_k, kv_group)
            tmem_base = tmem.retrieve_ptr(Float32)
            tStS, tOtO, _, _, _, _, _ = self.tmem_views(tmem_base, qk_mma, pv_mma, s_fake, o_fake, tP_l, sSFQ_l, sSFK_l, sSFV_l, sSFP_l)
            self.softmax(j, tidx % 128, m_block, n_kv, seqlen_q, seqlen_k, scale_log2,
                         stage_tmem(tStS[0], j, cfg.stage_stride("S")), stage_tmem(tOtO[0], j, cfg.stage_stride("O")),
                         sSFP, sP, stage_view(s_pipes, j).make_consumer(), stage_view(p_pipes, j).make_producer(),
                         stage_view(t_pipes, j).make_producer(),
                         st.row_sum.data_ptr(), st.row_max.data_ptr(),
                         mQb, mKb, mSFQb, mSFKb, bh, bh_kv, st.guard_flag.data_ptr())

        # ======================= correction / epilogue =====================
        if warp >= self.correction_warps[0] and warp <= self.correction_warps[-1]:
            cute.arch.setmaxregister_decrease(cfg.regs_correction)
            m_block, bh, bh_kv, n_kv = self.tile_coords(seqlen_q, seqlen_k, kv_group)
            tmem_base = tmem.retrieve_ptr(Float32)
            _, tOtO, _, _, _, _, _ = self.tmem_views(tmem_base, qk_mma, pv_mma, s_fake, o_fake, tP_l, sSFQ_l, sSFK_l, sSFV_l, sSFP_l)
            tmem.relinquish_alloc_permit()
            v_scale = mVS[bh_kv]
            gO = cute.local_tile(gO_mkl, (cfg.tile_m, cfg.head_dim), (None, None, None))
            tOs, tOg = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                             cute.group_modes(gO, 0, 2))
            # the stages one after the other, one traced body (as the softmax's)
            for j in cutlass.range(cfg.q_stages, unroll=1):
                ptx.perf_marker(markers.PER_CTA_LOOP)  # for the perf model: not a KV-tile loop
                self.epilogue(j, tidx % 128, m_block, bh, seqlen_q, stage_tmem(tOtO[0], j, cfg.stage_stride("O")),
                              sO, sO_l, tma_o, tOs, tOg, mLSE, v_scale, stage_view(o_pipes, j).make_consumer(),
                              stage_view(t_pipes, j).make_consumer(), st.row_sum.data_ptr(), st.row_max.data_ptr())
            cute.arch.barrier(barrier_id=2, number_of_threads=128)
            tmem.free(tmem_base)

    # ---------------------------------------------------------------- helpers
    @cute.jit
    def tile_coords(self, seqlen_q: Int32, seqlen_k: Int32, kv_group: Int32):
        """(query block, batch x head, its KV head, KV tiles to visit) of this CTA, read by each
        role after its setmaxnreg: kept live from the prologue, ptxas spills them."""
        cfg = self.config
        m_block, bh, _ = cute.arch.block_idx()
        n_kv = cute.ceil_div(seqlen_k, cfg.tile_n)
        if const_expr(cfg.causal):
            # keys past the CTA's last row's diagonal (bottom-right aligned) are never needed
            last = (m_block + 1) * cfg.tile_m * cfg.q_stages + seqlen_k - seqlen_q
            n_kv = cutlass.min(n_kv, cute.ceil_div(cutlass.max(last, 1), cfg.tile_n))
        return m_block, bh, bh // kv_group, n_kv

    @cute.jit
    def tmem_views(self, tmem_base, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, s_fake: cute.Tensor,
                   o_fake: cute.Tensor, tP_l: cute.ComposedLayout, sSFQ_l: cute.Layout, sSFK_l: cute.Layout,
                   sSFV_l: cute.Layout, sSFP_l: cute.Layout):
        """The plan's TMEM regions (every column offset is the plan's, cfg.tmem) as tensors.
        Each role builds them after its setmaxnreg from a freshly read base: kept live from
        the prologue, the base is one more value ptxas carries through every role's budget,
        and it spills it."""
        cfg = self.config

        def region(name, layout):
            return cute.make_tensor(tmem_base + cfg.first_col(name), layout)

        def region_as(name, dtype, layout):
            return cute.make_tensor(cute.recast_ptr(tmem_base + cfg.first_col(name), dtype=dtype), layout)

        tStS = [region("S%d" % j, s_fake.layout) for j in range(cfg.q_stages)]
        tOtO = [region("O%d" % j, o_fake.layout) for j in range(cfg.q_stages)]
        if const_expr(cfg.p_smem):
            tOrP = None  # p_source smem: P is an SMEM tile (the MMA warp's fragment of sP)
        else:
            tOrP_fake = pv_mma.make_fragment_A(cute.make_tensor(tmem_base, tP_l.outer))[None, None, None, 0]
            tOrP = [region_as("P%d" % j, self.pv_dtype, tOrP_fake.layout) for j in range(cfg.q_stages)]
        tSFQ_l = bsl.make_tmem_layout_sfa(qk_mma, self.qk_tiler, 16, slice0l(sSFQ_l))
        tSFK_l = bsl.make_tmem_layout_sfb(qk_mma, self.qk_tiler, 16, slice0l(sSFK_l))
        tSFQ = [region_as("SFQ%d" % j, E4M3, tSFQ_l) for j in range(cfg.q_stages)]
        tSFK = [region_as("SFK%d" % j, E4M3, tSFK_l) for j in range(cfg.q_stages)]
        tSFV, tSFP = None, None
        if const_expr(cfg.pv_block_scaled):
            tSFV_l = bsl.make_tmem_layout_sfb(pv_mma, self.pv_tiler, cfg.pv_sf_vec, slice0l(sSFV_l))
            tSFP_l = bsl.make_tmem_layout_sfa(pv_mma, self.pv_tiler, cfg.pv_sf_vec, slice0l(sSFP_l))
            tSFV = [region_as("SFV%d" % j, self.pv_sf, tSFV_l) for j in range(cfg.q_stages)]
            tSFP = [region_as("SFP%d" % j, self.pv_sf, tSFP_l) for j in range(cfg.q_stages)]
        return tStS, tOtO, tOrP, tSFQ, tSFK, tSFV, tSFP

    @cute.jit
    def issue_qk(self, j: cutlass.Constexpr, qk_mma, tStS, tSFQ, tSFK, cpQ, cpK, tSrQ, tSrK,
                 q_idx, k_idx, s_prod_j, s_prod_other):
        """S_j <- Q_j K^T (block16 NVFP4). Its scales go to the other stage's drained S columns."""
        s_prod_other.acquire()  # the other stage's S is drained (no advance: its own QK re-waits)
        hs = s_prod_j.acquire_and_advance()
        copies.s2t(cpQ[j], q_idx)
        copies.s2t(cpK[j], k_idx)
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
            qk_mma.set(tcgen05.Field.SFA, tSFQ[j][None, None, kb].iterator)
            qk_mma.set(tcgen05.Field.SFB, tSFK[j][None, None, kb].iterator)
            cute.gemm(qk_mma, tStS[j], tSrQ[None, None, kb, q_idx], tSrK[None, None, kb, k_idx], tStS[j])
        hs.commit()
        # returned so that the caller rebinds them: the tracer threads pipeline state through
        # staged loops only as plain local variables
        return qk_mma, s_prod_j, s_prod_other

    @cute.jit
    def issue_pv(self, j: cutlass.Constexpr, pv_mma, tOtO, tOrP, tOrV, tSFP, tSFV, cpP, cpV,
                 v_idx, i, p_cons_j):
        """O_j += P_j V (P_j from TMEM), one K=64/32 step group per published part of P."""
        cfg = self.config
        n_k = cute.size(tOrP[j], mode=[2])
        per_part = n_k // self.p_parts
        for part in cutlass.range_constexpr(self.p_parts):
            hp = p_cons_j.wait_and_advance()
            if const_expr(cfg.pv_block_scaled and part == 0):
                # part 1 carries the block scales of the whole tile (plan.publish)
                copies.s2t(cpV[j], v_idx)
                copies.s2t(cpP[j], j)
            for kk in cutlass.range_constexpr(per_part):
                kb = part * per_part + kk
                pv_mma.set(tcgen05.Field.ACCUMULATE, (i != 0) or (kb != 0))
                if const_expr(cfg.pv_block_scaled):
                    pv_mma.set(tcgen05.Field.SFA, tSFP[j][None, None, kb].iterator)
                    pv_mma.set(tcgen05.Field.SFB, tSFV[j][None, None, kb].iterator)
                cute.gemm(pv_mma, tOtO[j], tOrP[j][None, None, kb], tOrV[None, None, kb, v_idx], tOtO[j])
            hp.release()
        return pv_mma, p_cons_j

    def o_chunks(self, tOtO, t: Int32, cols: int):
        """O_j (tile_m x head_dim fp32 in TMEM) in chunks of ``cols`` columns, with the
        tcgen05.ld/st copies of one chunk for row ``t``: what ``scale_o`` reads and writes."""
        cfg = self.config
        chunks = cute.make_tensor(tOtO.iterator, cute.logical_divide(
            cute.composition(tOtO.layout, cute.make_layout((cfg.tile_m, cfg.head_dim))), (None, cols)))
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(cols)), Float32),
                                    chunks[None, (None, 0)]).get_slice(t)
        st = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(cols)), Float32),
                                    chunks[None, (None, 0)]).get_slice(t)
        return chunks, ld, st, cols

    @cute.jit
    def scale_o(self, o_view, fac: Float32, wait_each: cutlass.Constexpr):
        """O_j *= fac, one row per thread, chunk by chunk (``o_chunks``); the caller makes the
        whole warp take it or not (tcgen05.ld/st are .sync.aligned, PTX ISA 9.7.16.8.3/4).
        ``wait_each``: each chunk's store is waited for before the next chunk's load, so one
        chunk at a time is in registers (the rebase's rescale: without it, spills). A rolled
        loop over the chunks (less code for a branch that almost never runs) spilled 80 B in
        the masked tile loop, so the chunks are unrolled."""
        chunks, ld, st, cols = o_view
        for c in cutlass.range_constexpr(self.config.head_dim // cols):
            src = ld.partition_S(chunks[None, (None, c)])
            reg = cute.make_rmem_tensor(ld.partition_D(chunks[None, (None, c)]).shape, Float32)
            cute.copy(ld, src, reg)
            cute.arch.fence_view_async_tmem_load()  # reg is defined only after wait::ld
            for e in cutlass.range_constexpr(cols):
                reg[e] = reg[e] * fac
            cute.copy(st, reg, st.partition_D(chunks[None, (None, c)]))
            if const_expr(wait_each):
                cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def softmax(self, j: Int32, t: Int32, m_block: Int32, n_kv: Int32,
                seqlen_q: Int32, seqlen_k: Int32, scale_log2: Float32, tStS, tOtO, sSFP, sP,
                s_cons, p_prod, st_prod, row_sum_ptr, row_max_ptr,
                mQb, mKb, mSFQb, mSFKb, bh: Int32, bh_kv: Int32, guard_flag_ptr):
        """Softmax warpgroup of query stage j (known at run time only): one thread per query row
        (TMEM lane). ``tStS``, ``tOtO`` and the pipelines are stage j's."""
        cfg = self.config
        # S_j tile (128 lanes x tile_n fp32 columns) -> registers, one row per thread
        # loaded in 32-column chunks (one tcgen05.ld.32x32b.x32 each): a single x128 load
        # would need 128 destination registers in one instruction
        chunk_l = cute.composition(tStS.layout, cute.make_layout((cfg.tile_m, 32)))
        tS_chunks = [cute.make_tensor(tStS.iterator + 32 * c, chunk_l) for c in range(cfg.tile_n // 32)]
        ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32)
        # a warp's tcgen05.ld/st address depends only on its warp (the 32 lanes it serves):
        # slicing by the warp's first thread, marked uniform, lets ptxas keep the address in a
        # uniform register instead of an R2UR before each of the tile's loads and stores
        # (Direct-P only: the FP8 exp path then spilled 16 bytes)
        t_warp = t
        if const_expr(cfg.direct_p):
            t_warp = cute.arch.make_warp_uniform(t // 32) * 32
        thr_ld = tcgen05.make_tmem_copy(ld, tS_chunks[0]).get_slice(t_warp)
        tS_t = [thr_ld.partition_S(x) for x in tS_chunks]
        tS_rc = [cute.make_rmem_tensor(thr_ld.partition_D(x).shape, Float32) for x in tS_chunks]
        # P_j and the O rescale use fp32-typed views of their plan columns; one row of P is
        # p_cols 32-bit words, part_cols of them per publish part (plan.publish)
        part_cols = cfg.p_part_cols
        p_cols = part_cols * self.p_parts
        if const_expr(cfg.p_smem):
            # p_source smem: row t of stage j's P tile as 32-bit words, and the swizzle of its
            # 16-byte chunks (bits 7.. of the row's byte offset; the tile starts 1024-aligned)
            p_row = cute.make_ptr(Int32, sP.iterator.toint() + j * (cfg.tile_m * cfg.p_row_bytes) + t * cfg.p_row_bytes,
                                  cute.AddressSpace.smem, assumed_align=16)
            p_sw = ((t * cfg.p_row_bytes) >> Int32(7)) & Int32(cfg.p_row_bytes // 16 - 1)
        else:
            part_l = cute.composition(tStS.layout, cute.make_layout((cfg.tile_m, part_cols)))
            p_off = cfg.p_offset_in_s()  # P_j's plan columns relative to S_j, one for every stage
            tStP_parts = [cute.make_tensor(tStS.iterator + p_off + h * part_cols, part_l)
                          for h in range(self.p_parts)]
            st_atom = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(part_cols)), Float32)
            thr_st = tcgen05.make_tmem_copy(st_atom, tStP_parts[0]).get_slice(t_warp)
        # O_j's rescale: 32-column chunks on the exp and two-level paths; 16 for the rebase's
        # (its 32-column chunks spilled 176 B; see scale_o)
        o_view = self.o_chunks(tOtO, t, 16 if cfg.direct_p else 32)

        row = (m_block * cfg.q_stages + j) * cfg.tile_m + t
        # causal masking is bottom-right aligned: row r sees key c iff c <= r + seqlen_k - seqlen_q
        diag = row + seqlen_k - seqlen_q
        if const_expr(cfg.running_max):
            m_run = -Float32.inf
        else:
            m_run = Float32(0.0)  # Direct-P's fixed row reference (no guard: 0)
            if const_expr(cfg.guard):
                # Extreme-logit guard (Algorithm 3; numerics.directp.guard_reference), once per CTA:
                # scores of this row against guard_l sampled keys floor(s * Sk / L), from software
                # dot products of the dequantized NVFP4 payloads; the 128-row block (= this stage's
                # tile) is guarded when any |max| > guard_m, and then each row uses its own max.
                m_hat = -Float32.inf
                if row < seqlen_q:
                    for smp in cutlass.range(cfg.guard_l, unroll=1):  # rolled: runs once per CTA
                        pos = (smp * seqlen_k) // cfg.guard_l
                        dot = Float32(0.0)
                        for kb in cutlass.range(cfg.head_dim // 16, unroll=1):
                            part = Float32(0.0)
                            for e2 in cutlass.range_constexpr(8):
                                qb = Int32(mQb[row, kb * 8 + e2, bh])
                                kbyte = Int32(mKb[pos, kb * 8 + e2, bh_kv])
                                part = part + dp.e2m1_nibble(qb, 0) * dp.e2m1_nibble(kbyte, 0)
                                part = part + dp.e2m1_nibble(qb, 4) * dp.e2m1_nibble(kbyte, 4)
                            sq = dpf.decode(dp.i32_as_f32(Int32(mSFQb[row, kb * 16, bh])))
                            sk = dpf.decode(dp.i32_as_f32(Int32(mSFKb[pos, kb * 16, bh_kv])))
                            dot = dot + part * (sq * sk)
                        ts = dot * scale_log2
                        if const_expr(cfg.causal):
                            ts = Float32(cutlass.select_(pos > diag, -Float32.inf, ts))
                        m_hat = cute.arch.fmax(m_hat, ts)
                m_hat = Float32(cutlass.select_(m_hat == -Float32.inf, Float32(0.0), m_hat))
                flag = cute.make_tensor(guard_flag_ptr + j, cute.make_layout(1))
                if t == 0:
                    flag[0] = Int32(0)
                cute.arch.barrier(barrier_id=3 + j, number_of_threads=128)
                if cute.math.abs(m_hat) > Float32(cfg.guard_m):
                    flag[0] = Int32(1)
                cute.arch.barrier(barrier_id=3 + j, number_of_threads=128)
                guard_on = flag[0]
                m_run = Float32(cutlass.select_(guard_on != Int32(0), m_hat, Float32(0.0)))
        l_run = Float32(0.0)
        if const_expr(cfg.direct_p):
            # the l lookup table's first word in a register of its own (ptxas would rebuild a
            # constant before each PRMT: one MOV per four keys)
            twice_lo = dp.thread_register(dp.TWICE_LO)
        # fast Direct-P: the saturating classifier (numerics.directp.sat_codes) on raw scores,
        # the softmax scale folded into its multiplier A7s = fl32(scale * A7)
        fold_scale = cfg.direct_p and cfg.p_policy == "fast"
        if const_expr(fold_scale):
            sat_a7, sat_k7 = dpn.sat_constants(cfg.direct_p_a, cfg.direct_p_b)
            a7_s = scale_log2 * Float32(sat_a7)
            # constants of the tile loop in registers of their own (ptxas rebuilt them every tile);
            # not with P through SMEM, whose row address takes the register (8 B spilled)
            sat_a7_r, sat_112_r = sat_a7, None
            if const_expr(not cfg.p_smem):
                sat_a7_r = dp.thread_f32(sat_a7)
                sat_112_r = dp.thread_f32(112.0)
        if const_expr(cfg.two_level):
            r_prev = Float32(1.0)  # row factor of the previous KV tile (O_j is in its units)
        words_per_part = part_cols
        n_blocks = cfg.tile_n // 32
        # Two copies of the tile loop, as FA4's: first the tiles that every row of this stage
        # sees whole (no key past the sequence end or, causal, past the stage's first row's
        # diagonal), without the masking code; then the rest, with it. In one loop ptxas
        # if-converts the masking (a compare, a select and a move per key) and every tile
        # issues it. The exp and two-level paths keep one loop (self.tile_loops).
        row0 = (m_block * cfg.q_stages + j) * cfg.tile_m
        n_whole = seqlen_k // cfg.tile_n
        if const_expr(cfg.causal):
            n_whole = cutlass.min(n_whole, cutlass.max(row0 + seqlen_k - seqlen_q + 1, 0) // cfg.tile_n)
        n_whole = cutlass.min(n_whole, n_kv)
        # (plain int arithmetic: the DSL's preprocessor rewrites `x if c else y` and `or`)
        for copy in cutlass.range_constexpr(len(self.tile_loops)):
            masked = self.tile_loops[copy]  # a Python bool: each copy traces its own variant
            lo = Int32(0)
            hi = n_whole
            if const_expr(masked):
                lo = n_whole
                hi = n_kv
                if const_expr(cfg.running_max):  # exp / two-level: the one loop takes every tile
                    lo = Int32(0)
            for i in cutlass.range(lo, hi):
                hs = s_cons.wait_and_advance()
                for c in cutlass.range_constexpr(cfg.tile_n // 32):
                    cute.copy(thr_ld, tS_t[c], tS_rc[c])
                cute.arch.fence_view_async_tmem_load()
                hs.release()  # "S_j drained": the MMA warp may put the other stage's QK scales here
                # scores -> log2 units t = s * scale * log2(e); masked keys -> -inf, only on the
                # tiles that cross the sequence end or (causal) this row's diagonal
                s_max = -Float32.inf
                # (fast Direct-P keeps the raw scores: its classifier's multiplier holds the scale)
                if const_expr(cfg.direct_p and not fold_scale):
                    # two scores per mul.rn.f32x2 (PTX ISA: Floating-Point Instructions, mul; each
                    # lane rounds as the scalar FMUL does, no flush to zero)
                    for c in cutlass.range_constexpr(0, cfg.tile_n, 2):
                        tS_rc[c // 32][c % 32], tS_rc[c // 32][c % 32 + 1] = cute.arch.mul_packed_f32x2(
                            (tS_rc[c // 32][c % 32], tS_rc[c // 32][c % 32 + 1]), (scale_log2, scale_log2))
                elif const_expr(cfg.two_level):
                    for c in cutlass.range_constexpr(cfg.tile_n):
                        tS_rc[c // 32][c % 32] = tS_rc[c // 32][c % 32] * scale_log2
                # (the FP8 exp path keeps raw scores too: its exponent is one FFMA, below)
                if const_expr(masked):
                    # this row sees keys [0, n_valid) of the tile (bottom-right causal: key <= diag).
                    # Per 32 keys one bit mask of the kept ones, then per key a bit test and an
                    # FSEL (FMA pipe), written in place and unconditionally: behind a run-time
                    # `if n_valid < tile_n` (the rows diverge on it anyway) ptxas merged the two
                    # paths with a register move per key (172 IMAD.MOV a tile).
                    n_valid = seqlen_k - i * cfg.tile_n
                    if const_expr(cfg.causal):
                        n_valid = cutlass.min(n_valid, diag + 1 - i * cfg.tile_n)
                    for b in cutlass.range_constexpr(cfg.tile_n // 32):
                        keep = ptx.keep_below(n_valid - 32 * b)
                        for c in cutlass.range_constexpr(32):
                            tS_rc[b][c] = ptx.keep_or_neg_inf(tS_rc[b][c], keep, c)
                if const_expr(cfg.running_max):
                    for c in cutlass.range_constexpr(cfg.tile_n):
                        s_max = cute.arch.fmax(s_max, tS_rc[c // 32][c % 32])
                if const_expr(cfg.running_max):
                    # online max (exp / FP8 paths): O_j and l are rescaled by 2^(m_old - m_new).
                    # PV_j of the previous tile has completed (its commit precedes this S_j) and
                    # PV_j of this tile waits for P below, so O_j is ours to rescale until P_j is
                    # published (the exp path does it there, the two-level path after packing P).
                    if const_expr(cfg.exp_fp8):
                        s_max = s_max * scale_log2  # the max of raw s, in log2 units (scale > 0)
                    m_new = cute.arch.fmax(m_run, s_max)
                    m_new_s = Float32(cutlass.select_(m_new == -Float32.inf, Float32(0.0), m_new))
                    m_old_s = Float32(cutlass.select_(m_run == -Float32.inf, m_new_s, m_run))
                    alpha = cute.math.exp2(m_old_s - m_new_s, fastmath=True)
                    l_run = l_run * alpha
                    o_alpha = alpha  # O_j *= alpha where P_j is published (below)
                    m_run = m_new
                    m_ref = m_new_s
                else:
                    m_ref = m_run
                bmaxes = []
                if const_expr(cfg.direct_p):
                    # the blocks' maxima, for e_B below and the guard's rebase
                    for b in cutlass.range_constexpr(n_blocks):
                        bmax = -Float32.inf
                        for c in cutlass.range_constexpr(32):
                            bmax = cute.arch.fmax(bmax, tS_rc[b][c])
                        if const_expr(fold_scale):
                            bmax = bmax * scale_log2  # fl32(max s * scale) = max fl32(s * scale): scale > 0
                        bmaxes.append(bmax)
                    if const_expr(cfg.guard):
                        # headroom rebase (numerics.directp.rebase): a tile more than REBASE_E
                        # binades above the row reference moves it up by an integer d, and O, l
                        # by the exact 2^-d (O where P is published, below); else d = 0, fac = 1
                        t_max = bmaxes[0]
                        for b in cutlass.range_constexpr(1, n_blocks):
                            t_max = cute.arch.fmax(t_max, bmaxes[b])
                        # (a cold branch, taken by the whole warp when any row needs it: the hot
                        # path is a subtract, a compare and a vote)
                        if cute.arch.vote_any_sync(t_max - m_run > Float32(dp.REBASE_E)):
                            ptx.perf_marker(markers.REBASE)  # a cold region for the perf model
                            d_shift, fac = dp.rebase_shift(t_max, m_run)
                            m_run = m_run + d_shift
                            l_run = l_run * fac
                            # O_j *= 2^-d here: PV_j of the previous tile has completed (its commit
                            # precedes this S_j). Tile 0's PV overwrites O_j (ACCUMULATE off).
                            # 16-column chunks, each store waited for before the next load (32-column
                            # chunks spilled 176 B)
                            if i > 0:
                                self.scale_o(o_view, fac, True)
                        m_ref = m_run
                # ---- P codes and block exponents (scale bytes go to SMEM for tcgen05.cp) ----
                t_sf = t
                if const_expr(cfg.p_smem):
                    # P's SMEM row address is live too: carried through both tile loops, the
                    # scale bytes' row spilled (8 B) there; read again here (3 instructions)
                    t_sf = row_in_warpgroup()
                p_words = cute.make_rmem_tensor((p_cols,), cutlass.Int32)
                sfp_bytes = None
                if const_expr(cfg.pv_block_scaled):
                    sfp_bytes = cute.make_tensor(cute.recast_ptr(sSFP.iterator, dtype=cutlass.Uint8), sSFP.layout)
                e_fs, e_words = [], []  # Direct-P: each block's e_B (float) and block_exponent word
                if const_expr(cfg.exp_fp8):
                    exp_off = Float32(math.log2(cfg.p_fp8_scale)) - m_ref
                    lsum2 = (Float32(0.0), Float32(0.0))
                blocks_per_part = n_blocks // self.p_parts
                if const_expr(cfg.two_level):
                    # ---- two-level P (numerics.directp.p_two_level) ----
                    # level 1: p = exp2(t - m) in place of the scores; l sums the unrounded p;
                    # the tile's row factor r = rowmax(p) / 2688 maps the row onto [0, 448*6]
                    lsum = Float32(0.0)
                    pmax = Float32(0.0)
                    for c in cutlass.range_constexpr(cfg.tile_n):
                        pc = cute.math.exp2(tS_rc[c // 32][c % 32] - m_ref, fastmath=True)
                        tS_rc[c // 32][c % 32] = pc
                        lsum = lsum + pc
                        pmax = cute.arch.fmax(pmax, pc)
                    l_run = l_run + lsum
                    r = tl.row_factor(pmax)
                    inv_r = Float32(1.0) / r
                    # level 2: NVFP4 of P2 = p / r, 16 keys per E4M3 scale s = e4m3(amax / 6)
                    for b in cutlass.range_constexpr(cfg.tile_n // cfg.pv_sf_vec):
                        amax = Float32(0.0)
                        for c in cutlass.range_constexpr(cfg.pv_sf_vec):
                            k = b * cfg.pv_sf_vec + c
                            p2 = tS_rc[k // 32][k % 32] * inv_r
                            tS_rc[k // 32][k % 32] = p2
                            amax = cute.arch.fmax(amax, p2)
                        # fl32(amax / 6) without a division subroutine call (two_level.div_rn_const);
                        # a quotient below 2^-126 has E4M3 code 0 however it is rounded
                        sc = tl.e4m3_code(tl.div_rn_const(amax, 6.0))
                        s_b = dpf.decode(dp.i32_as_f32(sc))
                        inv_s = Float32(cutlass.select_(s_b > Float32(0.0), Float32(1.0) / s_b, Float32(0.0)))
                        for w in cutlass.range_constexpr(cfg.pv_sf_vec // 8):
                            word = Int32(0)
                            for h in cutlass.range_constexpr(4):
                                k = b * cfg.pv_sf_vec + w * 8 + 2 * h
                                qb = tl.e2m1_pair(tS_rc[k // 32][k % 32] * inv_s, tS_rc[(k + 1) // 32][(k + 1) % 32] * inv_s)
                                word = word | (qb << Int32(8 * h))
                            p_words[b * (cfg.pv_sf_vec // 8) + w] = word
                        # scale-factor atom coordinate of (row t, 16-key block b) in stage j's buffer:
                        # (((row % 32, row // 32), 0), (vec, b % 4)), MMA_M 0, K64 step b // 4, stage j
                        sfp_bytes[(((t % 32, t // 32), 0), (0, b % 4)), 0, b // 4, j] = cutlass.Uint8(sc)
                    # O_j holds O / r_prev (the previous tile's units); PV adds deq(P2) V, so bring O_j
                    # to this tile's units: O_j *= alpha * r_prev / r (O_true = O_j * r, exactly as
                    # the reference's deq(P2) * r). The last r is applied in the epilogue.
                    # fl32(r_prev / r) by two_level.div_rn: both in [2^-64, 1], the quotient normal
                    o_fac = Float32(cutlass.select_(i == 0, Float32(1.0), o_alpha * tl.div_rn(r_prev, r)))
                    # tcgen05.ld/st are .sync.aligned: the whole warp takes the branch when any of
                    # its rows needs it (o_fac = 1 leaves a row exact), never part of it (PTX ISA
                    # 9.7.16.8.3/4). Found by the emulator (strict_aligned).
                    if cute.arch.vote_any_sync(o_fac != Float32(1.0)):
                        self.scale_o(o_view, o_fac, False)
                    r_prev = r
                elif const_expr(cfg.direct_p):
                    # every block's exponent and E8M0 byte first: publish part 1 carries the block
                    # scales of the whole tile (plan.publish)
                    for b in cutlass.range_constexpr(n_blocks):
                        e_bf, e_word = dp.block_exponent(bmaxes[b] - m_ref, bounded=cfg.guard)
                        e_fs.append(e_bf)
                        e_words.append(e_word)
                        # scale-factor atom coordinate of (row t, 32-key block b) in stage j's buffer:
                        # (((row % 32, row // 32), 0), (vec, b % 2)), MMA_M 0, K64 step b // 2, stage j
                        sfp_bytes[(((t_sf % 32, t_sf // 32), 0), (0, b % 2)), 0, b // 2, j] = cutlass.Uint8(e_word)
                # ---- P codes of each publish part's blocks, then that part published: with halves
                # the PV MMA starts on keys [0, N/2) while the codes of [N/2, N) are made ----
                for part in cutlass.range_constexpr(self.p_parts):
                    # this part's blocks; none for two-level P, made above for the whole tile
                    b_end = part * blocks_per_part if cfg.two_level else (part + 1) * blocks_per_part
                    for b in cutlass.range_constexpr(part * blocks_per_part, b_end):
                        if const_expr(cfg.direct_p):
                            e_bf, e_word = e_fs[b], e_words[b]
                            twice = Int32(0)  # 2 * sum of the block's E2M1 magnitudes, exact in integers
                            if const_expr(cfg.p_policy == "fast"):
                                c_b = dp.sat_offset(m_ref, e_bf, sat_a7_r, sat_k7)
                                twice = dp.sat_block(tS_rc[b], a7_s, c_b, p_words, b * 4, lo_t=twice_lo, hi_mul=sat_112_r)
                            else:
                                # two codes per hardware conversion; the PRMT lookup yields both magnitudes
                                # as bytes, summed bytewise (<= 16 * 12 per byte) and folded per block
                                twice2 = Int32(0)
                                for w in cutlass.range_constexpr(4):
                                    word = Int32(0)
                                    for h in cutlass.range_constexpr(4):
                                        q = dp.accurate_pair(tS_rc[b][w * 8 + 2 * h], tS_rc[b][w * 8 + 2 * h + 1], m_ref, e_bf)
                                        twice2 = twice2 + dp.twice_values_pair(q, twice_lo, dp.TWICE_HI)
                                        word = word | (q << Int32(8 * h))
                                    p_words[b * 4 + w] = word
                                twice = dp.byte_sum(twice2)
                            if const_expr(cfg.guard):
                                l_run = l_run + Float32(twice) * dp.quad_pow2(e_word)  # l_run is 4 l here
                            else:
                                l_run = l_run + Float32(twice) * dp.half_pow2_e8m0(e_word)
                        else:
                            # p' = p_fp8_scale * exp2(t - m) = exp2(s * scale - (m - log2 p_fp8_scale)):
                            # one FFMA per score (two per f32x2), the stored factor in the exponent;
                            # l sums the unrounded p' (as the reference sums p) in two lanes
                            # 2 pairs in 8 take exp2 on the FMA pipe (exp2_fma): the tile is MUFU-bound
                            # otherwise (MUFU 16 lanes/clk/SM on B200); a masked key's x = -inf gives 0
                            pf = cute.make_rmem_tensor((32,), Float32)
                            for c in cutlass.range_constexpr(0, 32, 2):
                                x = cute.arch.fma_packed_f32x2((tS_rc[b][c], tS_rc[b][c + 1]),
                                                               (scale_log2, scale_log2), (exp_off, exp_off))
                                if const_expr((c // 2) % 8 < EXP2_FMA_PAIRS_IN_8):
                                    pf[c], pf[c + 1] = e2f.exp2_pair(x[0], x[1])
                                else:
                                    pf[c] = cute.math.exp2(x[0], fastmath=True)
                                    pf[c + 1] = cute.math.exp2(x[1], fastmath=True)
                                lsum2 = cute.arch.add_packed_f32x2(lsum2, (pf[c], pf[c + 1]))
                            p8 = cute.recast_tensor(cute.make_tensor(p_words.iterator + b * 8, cute.make_layout(8)), E4M3)
                            p8.store(pf.load().to(E4M3))
                    hp = p_prod.acquire_and_advance()
                    if const_expr(cfg.p_smem):
                        # p_source smem: this part's 16-byte chunks of row t at their swizzled places
                        # (st.shared; fence.proxy.async below hands them to the MMA's async proxy)
                        for cc in cutlass.range_constexpr(words_per_part // 4):
                            c = part * (words_per_part // 4) + cc
                            dst = cute.make_tensor(p_row + ((Int32(c) ^ p_sw) * Int32(4)), cute.make_layout(4))
                            for e in cutlass.range_constexpr(4):
                                dst[e] = p_words[c * 4 + e]
                    else:
                        dst = thr_st.partition_D(tStP_parts[part])
                        # register side shaped by partition_S of the tile (not by dst, which spans lanes)
                        src = cute.make_rmem_tensor(
                            thr_st.partition_S(cute.make_identity_tensor((cfg.tile_m, part_cols))).shape, Float32)
                        src_i = cute.recast_tensor(src, cutlass.Int32)
                        for w in cutlass.range_constexpr(words_per_part):
                            src_i[w] = p_words[part * words_per_part + w]
                        cute.copy(thr_st, src, dst)
                    if const_expr(cfg.exp_fp8):
                        if const_expr(part == 0):
                            # O_j *= alpha between P's first store and its first arrive (PV_j of this
                            # tile waits for that arrive). Done before P, O's 32-column chunk sat
                            # beside the 128 values of p (ptxas hoists P's ex2 above the branch) and
                            # spilled; here the scores are dead and at most half of P is in registers.
                            # the whole warp or none of it: tcgen05.ld/st are .sync.aligned (PTX ISA
                            # 9.7.16.8.3/4); alpha = 1 leaves a row exact. Found by the emulator.
                            if cute.arch.vote_any_sync(o_alpha < Float32(1.0)):
                                self.scale_o(o_view, o_alpha, False)
                    cute.arch.fence_view_async_tmem_store()  # P's (and O's) tcgen05.st complete
                    if const_expr(part == 0 or cfg.p_smem):
                        # generic-proxy SMEM writes (the block scales, before part 0; P itself with
                        # p_source smem) made visible to the MMA's async proxy (tcgen05.cp, the MMA)
                        cute.arch.fence_proxy("async.shared", space="cta")
                    hp.commit()
                if const_expr(cfg.exp_fp8):
                    l_run = l_run + (lsum2[0] + lsum2[1])  # in units of p_fp8_scale (below)
        # final statistics for the epilogue
        hst = st_prod.acquire_and_advance()
        rs = cute.make_tensor(row_sum_ptr + j * cfg.tile_m, cute.make_layout(cfg.tile_m))
        rm = cute.make_tensor(row_max_ptr + j * cfg.tile_m, cute.make_layout(cfg.tile_m))
        if const_expr(cfg.direct_p and cfg.guard):
            l_run = l_run * Float32(0.25)  # it summed 4 l (dp.quad_pow2); exact
        if const_expr(cfg.exp_fp8):
            l_run = l_run * Float32(1.0 / cfg.p_fp8_scale)  # it summed p' = p_fp8_scale p; exact
        rs[t] = l_run
        rm[t] = m_run
        if const_expr(cfg.two_level):
            # O_j is in units of the last tile's r; stored after the row sums of both stages
            rf = cute.make_tensor(row_sum_ptr + (cfg.q_stages + j) * cfg.tile_m, cute.make_layout(cfg.tile_m))
            rf[t] = r_prev
        hst.commit()

    @cute.jit
    def epilogue(self, j: Int32, t: Int32, m_block: Int32, bh: Int32, seqlen_q: Int32,
                 tOtO, sO, sO_l, tma_o, tOs, tOg, mLSE, v_scale: Float32, o_cons, st_cons, row_sum_ptr, row_max_ptr):
        """O_j / l -> bf16 rows: TMEM -> registers -> SMEM (O's swizzled tile) -> one TMA store
        (rows past the sequence end clipped by the tensor map); LSE in natural log by STG."""
        cfg = self.config
        hst = st_cons.wait_and_advance()
        rs = cute.make_tensor(row_sum_ptr + j * cfg.tile_m, cute.make_layout(cfg.tile_m))
        rm = cute.make_tensor(row_max_ptr + j * cfg.tile_m, cute.make_layout(cfg.tile_m))
        l = rs[t]
        m = rm[t]
        o_fac = Float32(cfg.o_scale) * v_scale
        if const_expr(cfg.two_level):
            rf = cute.make_tensor(row_sum_ptr + (cfg.q_stages + j) * cfg.tile_m, cute.make_layout(cfg.tile_m))
            o_fac = o_fac * rf[t]  # the last KV tile's row factor r
        hst.release()
        ho = o_cons.wait_and_advance()
        # P's fixed factor (FP8: PV consumed 256 p; two-level: r) and V's tensor scale fold into 1/l
        inv = Float32(cutlass.select_(l > Float32(0.0), o_fac / l, Float32(0.0)))
        cols = 16  # per tcgen05.ld: with 32, the 80-register correction warps spilled 8 bytes
        o_ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(cols)), Float32)
        tOtO_c = cute.make_tensor(tOtO.iterator, cute.logical_divide(
            cute.composition(tOtO.layout, cute.make_layout((cfg.tile_m, cfg.head_dim))), (None, cols)))
        thr_old = tcgen05.make_tmem_copy(o_ld, tOtO_c[None, (None, 0)]).get_slice(t)
        row = (m_block * cfg.q_stages + j) * cfg.tile_m + t
        o_base = sO.iterator.toint()  # 1024-aligned: the layout's swizzle is by absolute address bits
        # every lane loads (tcgen05.ld is .sync.aligned: a ragged last tile must not split the
        # warp); row t's values of a chunk go to SMEM as 16-byte pieces (8 bf16, contiguous
        # under the swizzle)
        for cchunk in cutlass.range_constexpr(cfg.head_dim // cols):
            src = thr_old.partition_S(tOtO_c[None, (None, cchunk)])
            reg = cute.make_rmem_tensor(thr_old.partition_D(tOtO_c[None, (None, cchunk)]).shape, Float32)
            cute.copy(thr_old, src, reg)
            cute.arch.fence_view_async_tmem_load()
            for g in cutlass.range_constexpr(cols // 8):
                ob = cute.make_rmem_tensor((8,), sO.element_type)
                for e in cutlass.range_constexpr(8):
                    ob[e] = (reg[g * 8 + e] * inv).to(sO.element_type)
                ow = cute.recast_tensor(ob, Int32)
                # the byte offset in the tile, then its 128-byte swizzle (S<3,4,3> over bytes: the
                # 16-byte chunk index XOR the 128-byte row index mod 8, checked in __call__)
                off = sO_l.outer((t, cchunk * cols + g * 8, 0)) * (sO.element_type.width // 8)
                off = off ^ ((off >> Int32(3)) & Int32(0x70))
                dst = cute.make_tensor(cute.make_ptr(Int32, o_base + off, cute.AddressSpace.smem, assumed_align=16),
                                       cute.make_layout(4))
                for w in cutlass.range_constexpr(4):
                    dst[w] = ow[w]
        if row < seqlen_q:
            lse2 = m + cute.math.log2(l, fastmath=True) - Float32(cfg.lse_shift)
            mLSE[row, bh] = Float32(cutlass.select_(l > Float32(0.0), lse2 * Float32(math.log(2.0)), -Float32.inf))
        # the tile to the TMA store's async proxy, then one thread issues the store and waits
        # until it has read SMEM, which the next stage overwrites. O_j's TMEM columns are
        # released after the fence (conformance's p_smem check reads a window of SMEM stores
        # closed by an mbarrier operation as P's publication, which must be proxy-fenced).
        cute.arch.fence_proxy("async.shared", space="cta")
        ho.release()
        cute.arch.barrier(barrier_id=2, number_of_threads=128)
        if t == 0:
            cute.copy(tma_o, tOs[None, 0], tOg[None, m_block * cfg.q_stages + j, 0, bh])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=2, number_of_threads=128)


@dsl_user_op
def row_in_warpgroup(*, loc=None, ip=None) -> Int32:
    """%tid.x mod 128 read where it is used (a side-effecting read is not hoisted; PTX ISA:
    Special Registers, %tid)."""
    tid = Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True,
                                is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
    return tid & Int32(127)


def stage_tmem(stage0, j, stride: int):
    """Query stage ``j``'s copy of the TMEM region ``stage0`` (stage 0's), ``stride`` columns per
    stage (``ForwardKernelConfig.stage_stride``)."""
    return cute.make_tensor(stage0.iterator + j * stride, stage0.layout)


def slice0l(layout):
    return cute.slice_(layout, (None, None, None, 0))
