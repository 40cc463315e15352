"""The Hopper (sm_90a) attention forward: one CuTe DSL kernel class for every sm90a spec.

A generated sm90a module renders a ``ForwardConfig`` literal (``config.py``, no CuTe DSL) from
its plan (the lowering, fp4gen/lowering/sm90.py, derives every field) and compiles
``kernel_class(config)(config)``.
Variants are values of the config, chosen while tracing with ``const_expr`` (or plain Python
outside ``@cute.jit`` code), so each config traces to the code its own rendered kernel had:

- ``in_fp8``: Q, K, V in FP8 E4M3 with fp32 scales (Q, K one per ``quant_block`` tokens,
  V one per (batch, kv head)), V^T as the K-major PV operand; else BF16.
- ``varlen``: packed sequences, one CTA per (query tile, head, sequence) reading the
  sequence's bounds from cu_seqlens_q/k. With FP8 the scales are per sequence
  (docs/runtime.md, "FP8 varlen"): Q/K blocks restart at each sequence start and each token
  carries its block's scale ((total, H), read at a tile's first token), V one per (sequence,
  kv head), and sequence b's V^T columns start at ``config.varlen_v_start(cu_seqlens_k[b], b)``.
- ``p_mode``: P as bf16 (``"bf16"``), e4m3(2^8 exp2(x - m)) (``"fp8_exp"``) or by FP8
  Direct-P codes (``"fp8_directp"``, fp4gen.device.directp).
- ``l_from_mma``: Direct-P's normaliser l = sum of decoded P codes as P @ ones on the
  tensor cores, from the very registers PV reads.
- ``causal``: bottom-right aligned causal mask, longest query tiles scheduled first.
- ``window`` (left, right): a sliding window (fp4gen.numerics.masking); a CTA visits only
  the key tiles [n_block_min, n_block_max) its rows see (``window_tiles``) and masks the
  left-edge tiles and those from the right edge (diagonal) on.
- ``softcap``: scores become c2 tanh(x / c2) (log2 units, softmax.softcap) before the mask.
- ``intra_wg_overlap``: a warpgroup's QK^T of tile n+1 runs under the softmax of tile n
  (``step_overlap``); else one tile after the other (``step_plain``).
- ``pingpong``: the consumer warpgroups take turns issuing MMAs (named barriers 1 + wg).
- ``head_dim``, ``tile_n``: plain sizes of the MMAs, SMEM layouts and TMA boxes (head dims 64,
  96, 128, 192, 256; 64..128 keys per tile in steps of 16, FP8 128), no code per head dim;
  the planner picks the tile per head dim (BF16 d192: 112 keys, d256: 80).

Roles: warpgroup 0 is the producer (warp 0 issues the TMA loads of Q, K, V; its registers
are cut to ``producer_regs``), warpgroups 1.. are the consumers (64 query rows each,
``consumer_regs`` registers): QK^T, online softmax, PV in registers, epilogue.

The FP8 entry point takes the three scale tensors after V (``Fp8ForwardKernel.__call__``);
``kernel_class`` picks the class for a config.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from fp4gen.numerics.directp import LOG2E

from .. import layout as dlayout
from .. import mask as dmask
from .. import ptx
from .. import softmax as dsoftmax
from ..pipelines import tma_pipelines
from .config import ForwardConfig

BAR_SCHED = 1  # named barriers: 0 is __syncthreads; BAR_SCHED + i gates consumer warpgroup i's MMA issue


class TileLoop(NamedTuple):
    """What each key tile of a consumer warpgroup's loop reads (``ForwardKernel.step``): fixed
    for the whole loop, so one value instead of the same 23 arguments at every call."""

    mma_qk: tuple  # (overwrite, accumulate) QK^T MMAs
    tiled_mma_pv: object
    tSrQ: object
    tSrK: object
    tOrV: object
    tOrP: object  # P registers, the PV A operand
    acc_O: object
    pv_l: object  # l_from_mma: (MMA, acc_L, ones operand), else None
    s_shape: object
    tScS: object  # score coordinates (the mask's)
    pipe_k: object
    pipe_v: object
    row_max: object
    row_sum: object
    row_scale: object
    q_mult: object  # the softmax multiplier before the K scale
    mSK: object  # FP8 K scales, else None
    batch: object
    head_kv: object
    row0: object  # the tile's first query row
    seqlen_k: object
    causal_offset: object
    wg: object  # the consumer warpgroup
    k0: object = None  # varlen: the sequence's first key token (FP8: indexes the K scales)


class ForwardKernel:
    """One CTA = ``tile_m`` query rows of one (batch, head); loops over key tiles.
    Entry point of BF16 inputs (FP8: ``Fp8ForwardKernel``)."""

    def __init__(self, config: ForwardConfig):
        self.config = config
        self.tile_m, self.tile_n, self.hdim = config.tile_m, config.tile_n, config.head_dim
        self.kv_stages = config.kv_stages

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, H, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D)
        mV: cute.Tensor,  # (B, Sk, Hkv, D)
        mO: cute.Tensor,  # (B, Sq, H, D) bf16
        mLSE: cute.Tensor,  # (B, H, Sq) fp32
        seqlen_k: Int32,  # keys (mV may be padded beyond it)
        softmax_scale_log2: Float32,  # softmax_scale * log2(e)
        causal_offset: Int32,
        stream,
    ):
        self.launch(mQ, mK, mV, None, None, None, mO, mLSE, seqlen_k, softmax_scale_log2, causal_offset, stream)

    def shared_storage(self, sQ_layout, sK_layout, sV_layout, sOnes_layout):
        """The CTA's SMEM struct: mbarriers, then Q, the K and V rings (and the ones operand)."""
        cfg = self.config
        dtype = cfg.in_dtype
        fields = {
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_k": cute.struct.MemRange[cutlass.Int64, 2 * cfg.kv_stages],
            "mbar_v": cute.struct.MemRange[cutlass.Int64, 2 * cfg.kv_stages],
            "sQ": cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sQ_layout)], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sK_layout)], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(sV_layout)], 1024],
        }
        if cfg.l_from_mma:
            fields["sOnes"] = cute.struct.Align[cute.struct.MemRange[cutlass.Uint32, cute.cosize(sOnes_layout) // 4], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.jit
    def launch(self, mQ, mK, mV, mSQ, mSK, mSV, mO, mLSE, seqlen_k, softmax_scale_log2, causal_offset, stream,
               mSinks=None, mCuSeqlensQ=None, mCuSeqlensK=None, max_seqlen_q=None):
        """Kernel views, MMAs, SMEM layouts and TMA atoms; then the grid. ``mSQ``, ``mSK``,
        ``mSV``: FP8 scales (B, H, ceil(Sq/blk)), (B, Hkv, ceil(Sk/blk)), (B, Hkv), or None;
        FP8 varlen (total_q, H), (total_k, Hkv), (B, Hkv) (``ForwardHost.quantize_inputs_varlen``).
        ``mSinks`` (H,) fp32 with ``config.sinks``; varlen: the packed operands, the
        ``cu_seqlens`` and ``max_seqlen_q`` (``ExtForwardKernel``), else None."""
        cfg = self.config
        in_dtype = cfg.in_dtype
        if const_expr(cfg.varlen):
            # packed views: (token, d, head) with d contiguous; V as (d, key, head); LSE (token, head)
            mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
            mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[0, 2, 1]))
            if const_expr(cfg.in_fp8):
                # packed V^T (Hkv, D, Tkp) as (d, key, head), keys contiguous (K-major); sequence
                # b from column cfg.varlen_v_start(cu_seqlens_k[b], b) (ForwardHost.v_operand_varlen)
                mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[1, 2, 0]))
            else:
                mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 0, 1]))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[1, 0]))
        else:
            # kernel views: (seq, d, head, batch) with d contiguous
            mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
            mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
            if const_expr(cfg.in_fp8):
                # V^T (B, Hkv, D, Skp), keys permuted per 32 (layout.FP8_P_KEY_PERM), as the
                # (N=D, K=keys) B operand, keys contiguous (K-major, as FP8 wgmma needs)
                mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 3, 1, 0]))
            else:
                # V as the (N=D, K=keys) B operand, D contiguous (MN-major)
                mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))

        # QK^T twice: one copy overwrites (first k-block), one accumulates; each keeps its
        # runtime ACCUMULATE flag fixed for the whole kernel (no per-iteration MMA state)
        tiled_mma_qk, tiled_mma_qk_acc = [
            sm90_utils.make_trivial_tiled_mma(
                in_dtype, in_dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
                Float32, (cfg.consumer_wgs, 1, 1), (64, self.tile_n),
            )
            for _ in range(2)
        ]
        v_major = LayoutEnum.from_tensor(mV).sm90_mma_major_mode()
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            in_dtype, in_dtype, warpgroup.OperandMajorMode.K, v_major,
            Float32, (cfg.consumer_wgs, 1, 1), (64, self.hdim),
            warpgroup.OperandSource.RMEM,  # P stays in registers
        )
        tiled_mma_l = None
        sOnes_layout = None
        if const_expr(cfg.l_from_mma):
            tiled_mma_l = sm90_utils.make_trivial_tiled_mma(
                in_dtype, in_dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
                Float32, (cfg.consumer_wgs, 1, 1), (64, 8), warpgroup.OperandSource.RMEM)
            sOnes_layout = sm90_utils.make_smem_layout_b(
                LayoutEnum.ROW_MAJOR, (self.tile_m, 8, self.tile_n), in_dtype, 1)
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.hdim), in_dtype, 1)
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.hdim), in_dtype, self.kv_stages)
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.from_tensor(mV), (self.tile_m, self.hdim, self.tile_n), in_dtype, self.kv_stages)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            g2s, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, self.hdim))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.hdim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s, mV, cute.select(sV_layout, mode=[0, 1]), (self.hdim, self.tile_n))
        self.q_bytes = cute.size_in_bytes(in_dtype, cute.select(sQ_layout, mode=[0, 1]))
        self.k_bytes = cute.size_in_bytes(in_dtype, cute.select(sK_layout, mode=[0, 1]))
        self.v_bytes = cute.size_in_bytes(in_dtype, cute.select(sV_layout, mode=[0, 1]))
        self.shared_storage_t = self.shared_storage(sQ_layout, sK_layout, sV_layout, sOnes_layout)

        if const_expr(cfg.varlen):
            # one CTA per (query tile of the longest sequence, head, sequence); shorter ones exit
            grid = (cute.ceil_div(max_seqlen_q, self.tile_m), cute.size(mQ.shape[2]), mCuSeqlensQ.shape[0] - 1)
        else:
            grid = (cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mSQ, mSK, mSV,
            mO, mLSE, tiled_mma_qk, tiled_mma_qk_acc, tiled_mma_pv, sQ_layout, sK_layout, sV_layout,
            tiled_mma_l, sOnes_layout,
            seqlen_k, softmax_scale_log2, causal_offset, mSinks, mCuSeqlensQ, mCuSeqlensK,
        ).launch(grid=grid, block=[cfg.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        mSQ,  # FP8: cute.Tensor, else None (no kernel parameter)
        mSK,
        mSV,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_qk_acc: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_mma_l,  # l_from_mma: cute.TiledMma, else None
        sOnes_layout,  # l_from_mma: cute.ComposedLayout, else None
        seqlen_k: Int32,
        softmax_scale_log2: Float32,
        causal_offset: Int32,
        mSinks,  # sinks: cute.Tensor (H,) fp32, else None
        mCuSeqlensQ,  # varlen: cute.Tensor (B + 1,) int32, else None
        mCuSeqlensK,
    ):
        cfg = self.config
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage_t)
        pipe_q, pipe_k, pipe_v = tma_pipelines(
            cfg.num_mma_threads, (storage.mbar_q, 1, self.q_bytes), (storage.mbar_k, self.kv_stages, self.k_bytes),
            (storage.mbar_v, self.kv_stages, self.v_bytes))

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        bidx, head, batch = cute.arch.block_idx()
        q0 = None  # varlen: the sequence's first query and key token in the packed tensors
        k0 = None
        v0 = None  # FP8 varlen: the sequence's first column of V^T (BF16: k0)
        if const_expr(cfg.varlen):
            # batch is the sequence; its bounds replace the shapes and the scalars
            q0 = mCuSeqlensQ[batch]
            k0 = mCuSeqlensK[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - q0
            seqlen_k = mCuSeqlensK[batch + 1] - k0
            if const_expr(cfg.in_fp8):
                v0 = cfg.varlen_v_start(k0, batch)
            causal_offset = seqlen_k - seqlen_q  # bottom-right alignment per sequence
            n_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
            m_block = bidx
            if const_expr(cfg.causal):
                m_block = n_m_blocks - 1 - bidx
                if m_block < 0:
                    m_block = bidx  # past the sequence: no row of it is stored
        else:
            n_m_blocks = cute.ceil_div(mQ.shape[0], self.tile_m)
            if const_expr(cfg.causal):
                # longest rows first: the last query tiles see the most keys
                m_block = n_m_blocks - 1 - bidx
            else:
                m_block = bidx
            seqlen_q = mQ.shape[0]
        head_kv = head // (mQ.shape[2] // mK.shape[2])  # GQA: H % Hkv == 0
        n_block_max = cute.ceil_div(seqlen_k, self.tile_n)
        if const_expr(cfg.causal):
            n_block_max = cutlass.min(
                n_block_max, cute.ceil_div((m_block + 1) * self.tile_m + causal_offset, self.tile_n))
            n_block_max = cutlass.max(n_block_max, 0)
        n_block_min = None  # None: from key tile 0 (no window); else an Int32
        n_tiles = n_block_max
        if const_expr(cfg.window is not None):
            n_block_min, n_block_max = self.window_tiles(m_block, seqlen_q, seqlen_k, causal_offset)
            n_tiles = cutlass.max(n_block_max - n_block_min, 0)
        if const_expr(cfg.varlen):
            if bidx >= n_m_blocks:
                n_tiles = Int32(0)  # a tile past the sequence's end loads and computes nothing

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_regs)
            if warp_idx == 0:
                self.producer(tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                              pipe_q, pipe_k, pipe_v, m_block, head, head_kv, batch, n_tiles, n_block_min, q0, k0,
                              v0)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
            tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, False)
            tiled_mma_qk_acc.set(warpgroup.Field.ACCUMULATE, True)
            tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)  # O starts at 0
            l_parts = None
            if const_expr(cfg.l_from_mma):
                tiled_mma_l.set(warpgroup.Field.ACCUMULATE, True)
                # the ones operand: every byte E4M3 1.0 (0x38), so its swizzle does not matter
                ones_words = storage.sOnes.get_tensor(cute.make_layout(cute.cosize(sOnes_layout) // 4))
                for i in cutlass.range_constexpr(cute.cosize(sOnes_layout) // 4 // cfg.num_mma_threads):
                    ones_words[(tidx - 128) + i * cfg.num_mma_threads] = cutlass.Uint32(0x38383838)
                cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> wgmma reads
                cute.arch.barrier(barrier_id=BAR_SCHED + 2, number_of_threads=cfg.num_mma_threads)
                sOnes = cute.make_tensor(
                    cute.recast_ptr(storage.sOnes.data_ptr(), sOnes_layout.inner, dtype=cfg.in_dtype),
                    sOnes_layout.outer)
                l_parts = (tiled_mma_l, sOnes)
            self.consumer(
                (tiled_mma_qk, tiled_mma_qk_acc), tiled_mma_pv, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                mSQ, mSK, mSV,
                mO, mLSE, m_block, head, head_kv, batch, n_tiles, n_block_min, seqlen_q, seqlen_k,
                softmax_scale_log2, causal_offset, tidx - 128, l_parts, mSinks, q0, k0)

    @cute.jit
    def window_tiles(self, m_block, seqlen_q, seqlen_k, causal_offset):
        """[n_block_min, n_block_max): the key tiles some row of query tile ``m_block`` sees
        through the window (keys i + offset - left .. i + offset + right of row i); empty
        when n_block_min >= n_block_max (its rows get O = 0, LSE = -inf)."""
        left, right = self.config.window
        n_block_max = cute.ceil_div(seqlen_k, self.tile_n)
        if const_expr(right >= 0):
            row_last = cutlass.min((m_block + 1) * self.tile_m, seqlen_q) - 1
            key_end = cutlass.max(row_last + causal_offset + (right + 1), 0)  # one past its last key
            n_block_max = cutlass.min(n_block_max, (key_end + (self.tile_n - 1)) // self.tile_n)
        n_block_min = Int32(0)
        if const_expr(left >= 0):
            key_first = cutlass.max(m_block * self.tile_m + causal_offset - left, 0)
            n_block_min = key_first // self.tile_n
        return n_block_min, n_block_max

    @staticmethod
    def kv_tile(n_block_min, i):
        """Key tile index of the i-th tile visited: i itself without a window."""
        return i if n_block_min is None else n_block_min + i

    def seq_view(self, m, head, batch, start, seq_mode: int = 0):
        """One head of one sequence of a kernel view (token mode ``seq_mode``): dense
        ``m[:, :, head, batch]``; varlen the packed tensor's head with its origin moved to the
        sequence's first token ``start`` (tiles past the sequence's end read the next one's
        tokens, or TMA's zeros past the tensor: the mask drops those keys, the epilogue those rows)."""
        if const_expr(self.config.varlen):
            return cute.domain_offset((start, 0) if seq_mode == 0 else (0, start), m[None, None, head])
        return m[None, None, head, batch]

    # ------------------------------------------------------------------ producer
    @cute.jit
    def producer(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                 pipe_q, pipe_k, pipe_v, m_block, head, head_kv, batch, n_tiles, n_block_min, q0=None, k0=None,
                 v0=None):
        """One warp: Q once, then ``n_tiles`` K/V tiles in ascending key order from
        ``n_block_min`` (None: from 0). ``q0``, ``k0``: varlen's sequence start, else None;
        ``v0``: FP8 varlen's first V^T column of the sequence (None: ``k0``)."""
        gQ = cute.local_tile(self.seq_view(mQ, head, batch, q0), (self.tile_m, self.hdim), (m_block, 0))
        gK = cute.local_tile(self.seq_view(mK, head_kv, batch, k0), (self.tile_n, self.hdim), (None, 0))
        gV = cute.local_tile(self.seq_view(mV, head_kv, batch, k0 if v0 is None else v0, 1),
                             (self.hdim, self.tile_n), (0, None))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        if n_tiles > 0:
            pipe_k.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK[None, self.kv_tile(n_block_min, 0)], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_atom_Q, tQgQ, tQsQ[None, 0],
                      tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            if const_expr(self.config.intra_wg_overlap):
                # consumer order: K(0), K(1) before V(0), K(2) before V(1), ...
                for i in cutlass.range(n_tiles - 1, unroll=1):
                    prev_state = kv_state.clone()
                    kv_state.advance()
                    pipe_k.producer_acquire(kv_state)
                    cute.copy(tma_atom_K, tKgK[None, self.kv_tile(n_block_min, i + 1)], tKsK[None, kv_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                    pipe_v.producer_acquire(prev_state)
                    cute.copy(tma_atom_V, tVgV[None, self.kv_tile(n_block_min, i)], tVsV[None, prev_state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(prev_state))
                pipe_v.producer_acquire(kv_state)
                cute.copy(tma_atom_V, tVgV[None, self.kv_tile(n_block_min, n_tiles - 1)], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                kv_state.advance()
            else:
                pipe_v.producer_acquire(kv_state)
                cute.copy(tma_atom_V, tVgV[None, self.kv_tile(n_block_min, 0)], tVsV[None, kv_state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                kv_state.advance()
                for i in cutlass.range(n_tiles - 1, unroll=1):
                    pipe_k.producer_acquire(kv_state)
                    cute.copy(tma_atom_K, tKgK[None, self.kv_tile(n_block_min, i + 1)], tKsK[None, kv_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                    pipe_v.producer_acquire(kv_state)
                    cute.copy(tma_atom_V, tVgV[None, self.kv_tile(n_block_min, i + 1)], tVsV[None, kv_state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                    kv_state.advance()

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consumer(self, mma_qk, tiled_mma_pv, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                 mSQ, mSK, mSV,
                 mO, mLSE, m_block, head, head_kv, batch, n_tiles, n_block_min, seqlen_q, seqlen_k,
                 softmax_scale_log2, causal_offset, tidx, l_parts, mSinks=None, q0=None, k0=None):
        """``n_tiles`` key tiles from ``n_block_min`` (None: from 0, no window). ``mSinks``:
        the sink logits (sinks), ``q0``, ``k0``: varlen's first query and key token, else None."""
        cfg = self.config
        tiled_mma_qk = mma_qk[0]
        wg = cute.arch.make_warp_uniform(tidx // 128)
        # descriptors are per warpgroup: slice with the warpgroup's first thread
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sV))
        acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.tile_m, self.hdim)))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((self.tile_m, self.tile_n)))
        s_shape = thr_qk.partition_shape_C((self.tile_m, self.tile_n))
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        # epilogue partitions, made before any MMA runtime state changes
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim)))
        tOgO = thr_pv.partition_C(
            cute.local_tile(self.seq_view(mO, head, batch, q0), (self.tile_m, self.hdim), (m_block, 0)))

        n_rows = cute.size(dlayout.acc_mn(acc_O), mode=[0])
        row_max = cute.make_rmem_tensor(n_rows, Float32)
        row_sum = cute.make_rmem_tensor(n_rows, Float32)
        row_scale = cute.make_rmem_tensor(n_rows, Float32)
        row_lse = cute.make_rmem_tensor(n_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        acc_O.fill(0.0)
        pv_l = None
        if const_expr(cfg.l_from_mma):
            tiled_mma_l, sOnes = l_parts
            wg_l = tiled_mma_l.get_slice(wg * 128)
            thr_l = tiled_mma_l.get_slice(tidx)
            tLrOnes = wg_l.make_fragment_B(wg_l.partition_B(sOnes))
            acc_L = thr_l.make_fragment_C(thr_l.partition_shape_C((self.tile_m, 8)))
            acc_L.fill(0.0)
            pv_l = (tiled_mma_l, acc_L, tLrOnes)

        if const_expr(cfg.in_fp8 and cfg.varlen):
            # per-token scales (total_q, H), blocks restarting at each sequence start: query tile
            # m_block is the sequence's block m_block, whose scale its first token holds. A tile
            # past the sequence's end (it stores nothing) reads a token in range instead.
            tok = cutlass.min(q0 + m_block * self.tile_m, mSQ.shape[0] - 1)
            q_mult = mSQ[tok, head] * softmax_scale_log2
            out_mult = mSV[batch, head_kv]  # one V scale per (sequence, kv head)
        elif const_expr(cfg.in_fp8):
            # x = s * (scale_q * scale_k * softmax_scale * log2 e)
            q_mult = mSQ[batch, head, m_block] * softmax_scale_log2
            out_mult = mSV[batch, head_kv]  # O = O_acc * scale_v / l (l at P's 2^8 scale)
        else:
            q_mult = softmax_scale_log2
            out_mult = Float32(1.0)
        row0 = m_block * self.tile_m
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        t = TileLoop(mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_O, pv_l, s_shape, tScS, pipe_k, pipe_v,
                     row_max, row_sum, row_scale, q_mult, mSK, batch, head_kv, row0, seqlen_k, causal_offset, wg,
                     k0)

        if const_expr(cfg.pingpong):
            # warpgroup 0 goes first
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=BAR_SCHED, number_of_threads=cfg.num_mma_threads)
        if n_tiles > 0:
            pipe_q.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            # Key tiles run in ascending order, as the numerics oracle does: Direct-P's codes
            # depend on the running max at the time a tile is turned into P.
            n_block = self.kv_tile(n_block_min, 0)
            # ---- first key tile: masked (it may be the last, or cross the causal diagonal)
            acc_S = thr_qk.make_fragment_C(s_shape)
            pipe_k.consumer_wait(kv_state)
            self.gemm(mma_qk, acc_S, tSrQ, tSrK, kv_state.index)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(kv_state)
            if const_expr(cfg.softcap > 0):
                c = self.scores(acc_S, tScS, row0, n_block, seqlen_k, causal_offset,
                                self.tile_mult(q_mult, mSK, batch, head_kv, n_block, k0), True)
            else:  # the mask before the scale load, as this tile always had it
                self.scores(acc_S, tScS, row0, n_block, seqlen_k, causal_offset, None, True)
                c = self.tile_mult(q_mult, mSK, batch, head_kv, n_block, k0)
            dsoftmax.tile(acc_S, row_max, row_sum, row_scale, c, True, cfg.softmax_mode)
            self.store_p(acc_S, tOrP)
            if const_expr(not cfg.intra_wg_overlap):
                pipe_v.consumer_wait(kv_state)
                self.pv(tiled_mma_pv, acc_O, tOrP, tOrV, kv_state.index, pv_l)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(kv_state)
                kv_state.advance()
            # tiles from n_mask_start on need masking: the last one (sequence end), and
            # with a causal mask those crossing the diagonal

            if const_expr(cfg.window is None):
                n_mask_start = n_tiles - 1
                if const_expr(cfg.causal):
                    n_mask_start = cutlass.min(n_mask_start, (row0 + causal_offset) // self.tile_n)
                n_mask_start = cutlass.max(n_mask_start, 1)
                for i in cutlass.range(n_mask_start - 1, unroll=1):
                    kv_state = self.step(t, kv_state, 1 + i, False)
                for i in cutlass.range(n_tiles - n_mask_start, unroll=1):
                    kv_state = self.step(t, kv_state, n_mask_start + i, True)
            else:
                # window: [first, n_left_end) masked (left edge), [n_left_end, n_mask_start)
                # unmasked, [n_mask_start, n_end) masked (right edge / diagonal, sequence end)
                left, right = cfg.window
                first = n_block_min + 1
                n_end = n_block_min + n_tiles
                n_left_end = first
                if const_expr(left >= 0):
                    # tile n misses keys of some row iff n * tile_n < (the tile's last row) + offset - left
                    key_lo = cutlass.max(row0 + (self.tile_m - 1) + causal_offset - left, 0)
                    n_left_end = cutlass.max(first, cutlass.min(n_end, (key_lo + (self.tile_n - 1)) // self.tile_n))
                n_mask_start = n_end - 1
                if const_expr(right >= 0):
                    # tiles wholly at or left of the first row's last key need no right mask
                    key_hi = cutlass.max(row0 + causal_offset + (right + 1), 0)
                    n_mask_start = cutlass.min(n_mask_start, key_hi // self.tile_n)
                n_mask_start = cutlass.max(n_mask_start, n_left_end)
                for i in cutlass.range(n_left_end - first, unroll=1):
                    kv_state = self.step(t, kv_state, first + i, True)
                for i in cutlass.range(n_mask_start - n_left_end, unroll=1):
                    kv_state = self.step(t, kv_state, n_left_end + i, False)
                for i in cutlass.range(n_end - n_mask_start, unroll=1):
                    kv_state = self.step(t, kv_state, n_mask_start + i, True)
            if const_expr(cfg.intra_wg_overlap):
                # ---- last PV
                pipe_v.consumer_wait(kv_state)
                self.pv(tiled_mma_pv, acc_O, tOrP, tOrV, kv_state.index, pv_l)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(kv_state)
                kv_state.advance()

        if const_expr(cfg.l_from_mma):
            # each of the 8 columns of P @ ones holds a row's full l: no quad reduction
            l_mn = dlayout.acc_mn(pv_l[1])
            for r in cutlass.range_constexpr(n_rows):
                row_sum[r] = l_mn[r, 0]
        if const_expr(cfg.sinks):
            self.fold_sink(acc_O, row_max, row_sum, row_scale, mSinks[head])
        dsoftmax.finalize(acc_O, row_max, row_sum, row_lse, out_mult, cfg.l_scale_log2,
                          not (cfg.l_from_mma or cfg.sinks))
        self.epilogue(acc_O, row_lse, tOcO, tOgO, mLSE, m_block, head, batch, seqlen_q, q0)

    @cute.jit
    def fold_sink(self, acc_O, row_max, row_sum, row_scale, sink: Float32):
        """The sink logit joins each row's softmax as fp4gen.numerics.reference defines it: a
        term exp(sink) in the denominator with no value row, the max taken over it too. In log2
        units s2 = sink log2 e: m' = max(m, s2) (m = 0 for a row that saw no key), O and l scale
        by 2^(m - m'), l gains 2^(s2 - m') at l's scale (2^8 for FP8 P); a row that saw no key
        ends with O = 0 and LSE = the sink. Sums l over the quad first (``finalize`` must not)."""
        cfg = self.config
        s2 = sink * LOG2E
        for r in cutlass.range_constexpr(cute.size(row_max, mode=[0])):
            l = row_sum[r]
            if const_expr(not cfg.l_from_mma):
                l = dsoftmax._quad_sum(l)
            m = row_max[r]
            if m == -Float32.inf:
                m = Float32(0.0)
            m_fin = cute.arch.fmax(m, s2)
            alpha = ptx.ex2(m - m_fin)
            row_sum[r] = l * alpha + ptx.ex2(s2 - m_fin + float(cfg.l_scale_log2))
            row_max[r] = m_fin
            row_scale[r] = alpha
        dsoftmax.rescale_o(acc_O, row_scale)

    @cute.jit
    def tile_mult(self, q_mult, mSK, batch, head_kv, n_block, k0=None):
        """The softmax multiplier c of key tile ``n_block`` (``k0``: varlen's first key token)."""
        if const_expr(self.config.in_fp8 and self.config.varlen):
            # per-token K scales (total_k, Hkv), blocks restarting at the sequence start: key
            # tile n_block is block n_block, read at its first token (inside the sequence)
            return q_mult * mSK[k0 + n_block * self.tile_n, head_kv]
        elif const_expr(self.config.in_fp8):
            # quant_block-token K scale blocks coincide with key tiles (ForwardConfig checks)
            return q_mult * mSK[batch, head_kv, n_block]
        else:
            return q_mult

    @cute.jit
    def scores(self, acc_S, tScS, row0, n_block, seqlen_k, causal_offset, c, masked: cutlass.Constexpr[bool]):
        """Softcap (when the config has one), then the mask (when ``masked``), on the raw
        scores of key tile ``n_block``; returns the multiplier ``dsoftmax.tile`` takes: ``c``,
        or 1 once the softcap has turned the scores into log2 units."""
        cfg = self.config
        if const_expr(cfg.softcap > 0):
            dsoftmax.softcap(acc_S, c, cfg.softcap_log2)
            c = Float32(1.0)
        if const_expr(masked):
            dmask.apply(acc_S, tScS, row0, n_block * self.tile_n, seqlen_k, cfg.causal, causal_offset, cfg.window)
        return c

    @cute.jit
    def store_p(self, acc_S, tOrP):
        """Softmax output -> the PV A fragment: bf16, e4m3 (RNE), or Direct-P codes (4 per register)."""
        if const_expr(self.config.p_mode == "bf16"):
            dlayout.store_p_bf16(acc_S, tOrP)
        else:
            dlayout.pack_p_fp8(acc_S, tOrP, self.config.p_mode == "fp8_directp")

    @cute.jit
    def gemm(self, mmas, acc, tA, tB, stage):
        """Issue one warpgroup MMA over all k-blocks (asynchronous; caller waits).

        ``mmas[0]`` runs the first k-block, ``mmas[1]`` the rest (overwrite / accumulate).
        """
        warpgroup.fence()
        n_k = cute.size(tA, mode=[2])
        for k in cutlass.range_constexpr(n_k):
            mma = mmas[0] if k == 0 else mmas[1]
            if const_expr(cute.rank(tA) == 4):
                cute.gemm(mma, acc, tA[None, None, k, 0], tB[None, None, k, stage], acc)
            else:
                cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k, stage], acc)
        warpgroup.commit_group()

    @cute.jit
    def pv(self, tiled_mma_pv, acc_O, tOrP, tOrV, stage, pv_l):
        """O += P V, and with l_from_mma l += P 1 on the tensor cores (same P registers)."""
        if const_expr(self.config.l_from_mma):
            tiled_mma_l, acc_L, tLrOnes = pv_l
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(tiled_mma_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
                cute.gemm(tiled_mma_l, acc_L, tOrP[None, None, k], tLrOnes[None, None, k, 0], acc_L)
            warpgroup.commit_group()
        else:
            self.gemm((tiled_mma_pv, tiled_mma_pv), acc_O, tOrP, tOrV, stage)

    @cute.jit
    def rescale(self, acc_O, row_scale, pv_l):
        dsoftmax.rescale_o(acc_O, row_scale)
        if const_expr(self.config.l_from_mma):
            dsoftmax.rescale_o(pv_l[1], row_scale)

    @cute.jit
    def step(self, t, kv_state, n_block, masked: cutlass.Constexpr[bool]):
        """One key tile after the first (``t``: the warpgroup's ``TileLoop``): ``step_overlap``
        or ``step_plain`` (intra_wg_overlap)."""
        if const_expr(self.config.intra_wg_overlap):
            return self.step_overlap(t, kv_state, n_block, masked)
        else:
            return self.step_plain(t, kv_state, n_block, masked)

    @cute.jit
    def step_overlap(self, t, kv_state, n_block, masked: cutlass.Constexpr[bool]):
        """QK^T of tile n_block and PV of the previous tile in flight, then softmax(n_block)."""
        cfg = self.config
        v_state = kv_state.clone()
        kv_state.advance()
        c = self.tile_mult(t.q_mult, t.mSK, t.batch, t.head_kv, n_block, t.k0)
        acc_S = cute.make_rmem_tensor(t.s_shape, Float32)
        t.pipe_k.consumer_wait(kv_state)
        if const_expr(cfg.pingpong):
            cute.arch.barrier(barrier_id=BAR_SCHED + t.wg, number_of_threads=cfg.num_mma_threads)
        self.gemm(t.mma_qk, acc_S, t.tSrQ, t.tSrK, kv_state.index)
        t.pipe_v.consumer_wait(v_state)
        self.pv(t.tiled_mma_pv, t.acc_O, t.tOrP, t.tOrV, v_state.index, t.pv_l)
        if const_expr(cfg.pingpong):
            cute.arch.barrier_arrive(barrier_id=BAR_SCHED + 1 - t.wg, number_of_threads=cfg.num_mma_threads)
        warpgroup.wait_group(1)
        t.pipe_k.consumer_release(kv_state)
        c = self.scores(acc_S, t.tScS, t.row0, n_block, t.seqlen_k, t.causal_offset, c, masked)
        dsoftmax.tile(acc_S, t.row_max, t.row_sum, t.row_scale, c, False, cfg.softmax_mode)
        warpgroup.wait_group(0)
        t.pipe_v.consumer_release(v_state)
        self.store_p(acc_S, t.tOrP)
        self.rescale(t.acc_O, t.row_scale, t.pv_l)
        return kv_state

    @cute.jit
    def step_plain(self, t, kv_state, n_block, masked: cutlass.Constexpr[bool]):
        """QK^T, softmax, then PV of the same tile."""
        cfg = self.config
        c = self.tile_mult(t.q_mult, t.mSK, t.batch, t.head_kv, n_block, t.k0)
        acc_S = cute.make_rmem_tensor(t.s_shape, Float32)
        t.pipe_k.consumer_wait(kv_state)
        self.gemm(t.mma_qk, acc_S, t.tSrQ, t.tSrK, kv_state.index)
        warpgroup.wait_group(0)
        t.pipe_k.consumer_release(kv_state)
        c = self.scores(acc_S, t.tScS, t.row0, n_block, t.seqlen_k, t.causal_offset, c, masked)
        dsoftmax.tile(acc_S, t.row_max, t.row_sum, t.row_scale, c, False, cfg.softmax_mode)
        self.store_p(acc_S, t.tOrP)
        self.rescale(t.acc_O, t.row_scale, t.pv_l)
        t.pipe_v.consumer_wait(kv_state)
        self.pv(t.tiled_mma_pv, t.acc_O, t.tOrP, t.tOrV, kv_state.index, t.pv_l)
        warpgroup.wait_group(0)
        t.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def epilogue(self, acc_O, row_lse, cO, tOgO, mLSE, m_block, head, batch, seqlen_q, q0=None):
        """Registers -> global: bf16 pairs per thread, rows past seqlen_q skipped (varlen: of
        the sequence from token ``q0``; LSE (token, head))."""
        rO = cute.make_rmem_tensor_like(acc_O, tOgO.element_type)
        rO.store(acc_O.load().to(tOgO.element_type))
        o_mn = dlayout.acc_mn(rO)
        c_mn = dlayout.acc_mn(cO)
        g_mn = dlayout.acc_mn(tOgO)
        row0 = m_block * self.tile_m
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            if row0 + c_mn[r, 0][0] < seqlen_q:
                for j in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    g_mn[r, j] = o_mn[r, j]
                if c_mn[r, 0][1] == 0:
                    if const_expr(self.config.varlen):
                        mLSE[q0 + row0 + c_mn[r, 0][0], head] = row_lse[r]
                    else:
                        mLSE[row0 + c_mn[r, 0][0], head, batch] = row_lse[r]


class Fp8ForwardKernel(ForwardKernel):
    """Entry point of FP8 inputs: the fp32 scales follow V (the same kernel otherwise)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, H, D) e4m3
        mK: cute.Tensor,  # (B, Sk, Hkv, D) e4m3
        mV: cute.Tensor,  # (B, Hkv, D, Skp) e4m3: transposed, keys permuted per 32 (layout.FP8_P_KEY_PERM)
        mSQ: cute.Tensor,  # (B, H, ceil(Sq/quant_block)) fp32
        mSK: cute.Tensor,  # (B, Hkv, ceil(Sk/quant_block)) fp32
        mSV: cute.Tensor,  # (B, Hkv) fp32
        mO: cute.Tensor,  # (B, Sq, H, D) bf16
        mLSE: cute.Tensor,  # (B, H, Sq) fp32
        seqlen_k: Int32,
        softmax_scale_log2: Float32,
        causal_offset: Int32,
        stream,
    ):
        self.launch(mQ, mK, mV, mSQ, mSK, mSV, mO, mLSE, seqlen_k, softmax_scale_log2, causal_offset, stream)


class ExtForwardKernel(ForwardKernel):
    """Entry point of the configs with sinks or the varlen layout (``config.extended``): every
    operand in one signature, those the config does not read passed as None (no kernel
    parameter). Varlen: the packed operands, whose sequences ``cu_seqlens_q/k`` delimit; the
    kernel reads each sequence's lengths (``seqlen_k`` and ``causal_offset`` are then unused)."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (B, Sq, H, D); varlen (total_q, H, D)
        mK: cute.Tensor,  # (B, Sk, Hkv, D); varlen (total_k, Hkv, D)
        mV: cute.Tensor,  # as K (BF16), or FP8 V^T as Fp8ForwardKernel's; FP8 varlen (Hkv, D, Tkp)
        mSQ: Optional[cute.Tensor],  # FP8 scales as Fp8ForwardKernel's (varlen: launch's), else None
        mSK: Optional[cute.Tensor],
        mSV: Optional[cute.Tensor],
        mO: cute.Tensor,  # like q, bf16
        mLSE: cute.Tensor,  # (B, H, Sq); varlen (H, total_q) fp32
        mSinks: Optional[cute.Tensor],  # sinks: (H,) fp32 sink logits
        mCuSeqlensQ: Optional[cute.Tensor],  # varlen: (B + 1,) int32
        mCuSeqlensK: Optional[cute.Tensor],
        seqlen_k: Int32,
        max_seqlen_q: Int32,  # varlen: the longest sequence's queries (the grid)
        softmax_scale_log2: Float32,
        causal_offset: Int32,
        stream,
    ):
        self.launch(mQ, mK, mV, mSQ, mSK, mSV, mO, mLSE, seqlen_k, softmax_scale_log2, causal_offset, stream,
                    mSinks, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q)


def kernel_class(config: ForwardConfig) -> type:
    """The kernel class whose ``__call__`` takes ``config``'s operands."""
    if config.extended:
        return ExtForwardKernel
    return Fp8ForwardKernel if config.in_fp8 else ForwardKernel
