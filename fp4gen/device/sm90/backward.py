"""The Hopper (sm_90a) attention backward: one CuTe DSL kernel class, parameterised by the plan.

FA2/FA3 order (``ir/passes/backward.py`` plans it): a CTA owns ``tile_n`` keys of one
(batch, head) and keeps dK, dV in registers while it walks the query tiles that see those
keys. Warp roles: two MMA warpgroups (S^T = K Q^T, dP^T = V dO^T, dV += P^T dO,
dK += dS^T Q, dQ = dS K) and a producer warpgroup whose warp 0 issues the TMA loads and
warp 1 adds each query tile's dQ into the global fp32 accumulator with bulk reduces.

``BackwardConfig`` holds the plan's decisions as plain values (the generated module renders
it); the variants (FP8 S / dP and dV / dS, causal, deterministic dQ) are chosen with
``cutlass.const_expr`` while tracing, so each spec compiles to the instructions its
template-rendered kernel did. Tensors a variant does not read are passed as ``None``
(constant at compile time: no kernel parameter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from fp4gen.numerics import backward_rules as rules
from fp4gen.numerics.directp import P_FP8_SCALE
from fp4gen.numerics.formats import E4M3

from .. import layout as dlayout
from .. import mask as dmask
from .. import ptx
from .. import softmax as dsoftmax
from ..pipelines import tma_pipelines
from ..quantize import BLOCK as QUANT_BLOCK  # tokens per FP8 Q/K scale (the forward's quantizer)
from .config import check_window_softcap

BF16 = cutlass.BFloat16
FP8 = cutlass.Float8E4M3FN
P_LOG2_SCALE = math.log2(P_FP8_SCALE)  # FP8 P is produced as 2^8 P (as the FP8 forward's)
# FP8 dS's scale rule, as the numerics oracle has it (reference.fp8_ds_tile_scale)
DS_C_HALVE_MIN = 2.0 ** rules.FP8_DS_HALVE_MIN_LOG2  # a tile's scale is halved for the next only from here up
DS_SMALL = rules.FP8_DS_SMALL  # a tile whose f |dS| all stay below 448 / 16 halves the next tile's c
DS_HEADROOM = rules.FP8_DS_HEADROOM  # a c taken from a tile's exact max is handed on times this
E4M3_MAX = E4M3.max_value  # 448: dS overflows e4m3 past it
BAR_DS = 1  # named barrier: every MMA warp has written its dS^T into SMEM
BAR_DQ_FULL = 2  # named barrier: the MMA warps have written this query tile's dQ into SMEM
BAR_DQ_EMPTY = 3  # named barrier: the dQ warp has read the SMEM tile out (it may be rewritten)
DQ_REDUCE_LANES = 8  # the dQ warp splits a tile's bulk reduce over this many lanes
MMA_NAMES = ("S", "dP", "dV", "dK", "dQ")
# softcap: what a masked entry of the tanh tile holds. Not -inf: P = exp2(c2 tanh - LSE2) must be 0
# and 1 - tanh^2 finite (0 * inf is NaN): -2^32 gives exp2(-2^32 c2) = 0 and 1 - 2^64
SOFTCAP_FILL = -(2.0 ** 32)


@dataclass(frozen=True)
class BackwardConfig:
    """The plan's decisions that the kernel reads (``BackwardPlan`` fields, rendered by the
    generated module)."""

    head_dim: int
    causal: bool
    tile_m: int  # query rows per inner step
    tile_n: int  # keys per CTA (mma_warpgroups x 64)
    mma_warpgroups: int
    q_stages: int  # Q/dO ring depth
    ds_stages: int  # dS tiles in SMEM
    deterministic: bool  # key tiles add into each dQ tile in ascending order (a turn counter)
    s_fp8: bool  # S^T = K Q^T from the forward's FP8 Q/K payloads (reuse q k)
    do_fp8: bool  # dP^T = V dO^T and dV += P^T dO with FP8 dO, V, P (dO : fp8e4m3)
    ds_fp8: bool  # dQ = dS K and dK += dS^T Q with FP8 dS and the forward's Q/K copies (dS : fp8e4m3)
    producer_registers: int  # setmaxnreg of the producer warpgroup
    consumer_registers: int  # setmaxnreg of each MMA warpgroup
    # (A major, B major) of each MMA in MMA_NAMES order: "K" or "MN" (the plan's BwdMma records)
    mma_majors: tuple
    # Fields with a default: a module renders them only when its spec sets them, so the modules
    # of specs without them (and their PTX) stay as they were.
    # mask window(left, right), -1 = unbounded side, bottom-right aligned (fp4gen.numerics.masking);
    # None: no window (``causal`` is its own field)
    window: Optional[tuple] = None
    softcap: float = 0.0  # c > 0: scaled scores are c tanh(s / c), dS takes 1 - tanh^2; 0: none

    def __post_init__(self):
        check_window_softcap("backward", self.causal, self.window, self.softcap, side_limit=2 ** 30)

    @property
    def softcap_log2(self) -> float:
        """The softcap in log2 units (the kernel's scores are x = s * softmax_scale * log2 e):
        c tanh(s / c) log2 e = c2 tanh(x / c2), c2 = c log2 e (the reference's ``cap2``)."""
        return self.softcap * math.log2(math.e)

    def major(self, mma: str):
        """(A, B) ``warpgroup.OperandMajorMode`` of one MMA (S, dP, dV, dK, dQ)."""
        a, b = self.mma_majors[MMA_NAMES.index(mma)]
        return getattr(warpgroup.OperandMajorMode, a), getattr(warpgroup.OperandMajorMode, b)

    def mn_major(self, mma: str, operand: int) -> bool:
        """Whether operand 0 (A) or 1 (B) of ``mma`` is read MN-major: from a transposed view
        of its SMEM tile (a K-major operand is read as stored)."""
        return self.mma_majors[MMA_NAMES.index(mma)][operand] == "MN"


def smem_layout(dtype, rows, cols, major_cols, stages=None):
    """Row-major (cols contiguous) swizzled SMEM tile whose swizzle atom is at most
    ``major_cols`` wide, so that a transposed (MN-major) view split across warpgroups
    along ``cols`` is still a legal wgmma operand."""
    kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, major_cols)
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def transposed(x):
    """Transposed view of an SMEM tile (first two modes swapped, same bytes)."""
    shape = (x.shape[1], x.shape[0], *x.shape[2:])
    order = (1, 0, *range(2, cute.rank(x)))
    return cute.composition(x, cute.make_ordered_layout(shape, order=order))


def tiles_view(t):
    """A transposed FP8 payload stored as one contiguous D x T block per tile of T tokens,
    (B, H, tiles, D, T) -> the kernel's view (d, (token in tile, tile), head, batch)."""
    return cute.make_tensor(t.iterator, cute.make_layout(
        (t.shape[3], (t.shape[4], t.shape[2]), t.shape[1], t.shape[0]),
        stride=(t.stride[3], (t.stride[4], t.stride[2]), t.stride[1], t.stride[0])))


def tree_max(vals):
    """Max of a list (a power-of-two length) as a balanced tree (a trace-time helper)."""
    while len(vals) > 1:
        vals = [cute.arch.fmax(vals[2 * i], vals[2 * i + 1]) for i in range(len(vals) // 2)]
    return vals[0]


class Backward:
    """dK, dV (and the dQ contribution) of ``tile_n`` keys of one (batch, head) per CTA.

    Inputs (torch layouts): q, do (B, Sq, H, D) and k, v (B, Sk, Hkv, D) bf16 (FP8 dO / V
    payloads with ``do_fp8``); with ``s_fp8`` the forward's FP8 Q/K payloads and their
    128-token block scales; with ``do_fp8`` dO^T (B, H, Sqp / tile_m, D, tile_m) and the
    per-(batch, head) scales of V and dO; with ``ds_fp8`` qt8 (B, H, tiles, D, tile_m) and
    kt8 (B, Hkv, tiles, D, tile_n), the forward quantizer's transposed copies of the Q/K
    payloads (fp4gen.device.quantize.TRANSPOSED_TILES), dK's and dQ's K-major B operands (q
    and k bf16 only give the shapes); lse2, dsum (B, H, Sqp) fp32 with Sqp = Sq rounded up
    to tile_m (LSE in log2 units, +inf past Sq or for empty rows, so P = 0 there;
    dsum = rowsum(dO * O), 0 past Sq).
    Outputs: dq_acc fp32 (B, H, Sqp, D), each tile_m-row tile in fragment order
    (fp4gen.device.bwd_prep.dq_fragment_index), accumulated with bulk reduces (with
    ``deterministic`` in key-tile order: dq_turn int32 (B, H, Sqp / tile_m) zeros; key tile
    n adds its dQ tile for query tile m once dq_turn[b, h, m] == n, then increments it);
    dk, dv (B, Sk, H, D) per query head, dk scaled by softmax_scale: bf16 when H == Hkv,
    fp32 for GQA (the host sums each group).

    dQ staging tile in SMEM and the dQ accumulator in global memory hold each query tile in
    the MMA warps' register order ("fragment order"): warpgroup w's thread t stores its
    accumulator registers 4i..4i+3 at float w * tile_m * D / 2 + 512 i + 4 t, so every store
    is a conflict-free 16-byte STS and the dQ warp moves the whole tile with a few bulk
    reduces; the post-processing kernel puts the rows back in order.
    """

    def __init__(self, config: BackwardConfig):
        c = config
        self.config = c
        self.s_dtype = FP8 if c.s_fp8 else BF16
        self.do_dtype = FP8 if c.do_fp8 else BF16
        self.ds_dtype = FP8 if c.ds_fp8 else BF16  # the dS tile and its B operands (K, Q or their ^T copies)
        self.mma_threads = 128 * c.mma_warpgroups
        self.threads = self.mma_threads + 128  # + one producer warpgroup (warp 0: TMA loads, warp 1: dQ adds)
        self.dq_sync_threads = self.mma_threads + 32  # both dQ barriers: the MMA warps and the dQ warp
        self.dq_tile_floats = c.tile_m * c.head_dim

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mQ8: Optional[cute.Tensor],
        mK8: Optional[cute.Tensor],
        mScaleQ: Optional[cute.Tensor],
        mScaleK: Optional[cute.Tensor],
        mdOt: Optional[cute.Tensor],
        mScaleV: Optional[cute.Tensor],
        mScaledO: Optional[cute.Tensor],
        mQt: Optional[cute.Tensor],
        mKt: Optional[cute.Tensor],
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQacc: cute.Tensor,
        mdQturn: Optional[cute.Tensor],
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        softmax_scale_log2: Float32,
        softmax_scale: Float32,
        causal_offset: Int32,
        stream,
    ):
        cfg = self.config
        d, bm, bn = cfg.head_dim, cfg.tile_m, cfg.tile_n
        wgs = cfg.mma_warpgroups
        # kernel views (seq, d, head, batch), d contiguous
        mQ, mK, mV, mdO, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mdO, mdK, mdV)
        ]
        if cutlass.const_expr(cfg.s_fp8):
            mQ8, mK8 = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ8, mK8)]
        if cutlass.const_expr(cfg.do_fp8):
            # dO^T (B, H, Sqp / tile_m, D, tile_m): one contiguous D x tile_m block per query tile
            # -> (d, (query in tile, tile), head, batch), queries contiguous within a tile
            mdOt = tiles_view(mdOt)
        if cutlass.const_expr(cfg.ds_fp8):
            # the forward quantizer's transposed copies: Q^T in tile_m-query tiles (queries permuted
            # per 32 like dO^T), K^T in tile_n-key tiles (keys interleaved per 16 like the dS tile dQ reads)
            mQt, mKt = tiles_view(mQt), tiles_view(mKt)
        s_a, s_b = cfg.major("S")
        dp_a, dp_b = cfg.major("dP")
        dv_a, dv_b = cfg.major("dV")
        dk_a, dk_b = cfg.major("dK")
        dq_a, dq_b = cfg.major("dQ")
        # S^T = K Q^T and dP^T = V dO^T: keys are M (64 per warpgroup), queries N
        mma_s = [
            sm90_utils.make_trivial_tiled_mma(
                self.s_dtype, self.s_dtype, s_a, s_b, Float32, (wgs, 1, 1), (64, bm))
            for _ in range(2)
        ]
        mma_dp = [
            sm90_utils.make_trivial_tiled_mma(
                self.do_dtype, self.do_dtype, dp_a, dp_b, Float32, (wgs, 1, 1), (64, bm))
            for _ in range(2)
        ]
        # dV += P^T dO, dK += dS^T Q: A from registers (the S^T / dP^T accumulators); FP8 dV
        # reads B = dO^T from its own K-major (queries contiguous) copy
        mma_dv = sm90_utils.make_trivial_tiled_mma(
            self.do_dtype, self.do_dtype, dv_a, dv_b, Float32, (wgs, 1, 1), (64, d), warpgroup.OperandSource.RMEM)
        # FP8 dK: A = e4m3 dS^T from registers, B = the Q^T copy (queries contiguous)
        mma_dk = sm90_utils.make_trivial_tiled_mma(
            self.ds_dtype, self.ds_dtype, dk_a, dk_b, Float32, (wgs, 1, 1), (64, d), warpgroup.OperandSource.RMEM)
        # dQ = dS K: 64 queries, the head dim split between the warpgroups; bf16 dS is stored as
        # dS^T (keys x queries, queries contiguous), an MN-major A operand; FP8 dS as dS (queries
        # x keys, keys contiguous: K-major, written transposed from the dS^T registers), B = the K^T copy
        mma_dq = [
            sm90_utils.make_trivial_tiled_mma(
                self.ds_dtype, self.ds_dtype, dq_a, dq_b, Float32, (1, wgs, 1), (64, d // wgs))
            for _ in range(2)
        ]
        if cutlass.const_expr(cfg.ds_fp8):
            # sQ / sK hold dK's and dQ's B operands: the Q^T (d x queries) and K^T (d x keys) copies,
            # K-major; sdS holds dS (queries x keys, keys contiguous), dQ's K-major A operand
            sQ_layout = smem_layout(FP8, d, bm, bm, cfg.q_stages)
            sK_layout = smem_layout(FP8, d, bn, bn)
            sdS_layout = smem_layout(FP8, bm, bn, bn, cfg.ds_stages)
        else:
            sQ_layout = smem_layout(BF16, bm, d, d, cfg.q_stages)
            sK_layout = smem_layout(BF16, bn, d, d // wgs)
            sdS_layout = smem_layout(BF16, bn, bm, bm, cfg.ds_stages)
        sdO_layout = smem_layout(self.do_dtype, bm, d, d, cfg.q_stages)
        sV_layout = smem_layout(self.do_dtype, bn, d, d)
        sQ8_layout = sK8_layout = sdOt_layout = None
        if cutlass.const_expr(cfg.s_fp8):
            sQ8_layout = smem_layout(FP8, bm, d, d, cfg.q_stages)
            sK8_layout = smem_layout(FP8, bn, d, d)
        if cutlass.const_expr(cfg.do_fp8):
            sdOt_layout = smem_layout(FP8, d, bm, bm, cfg.q_stages)

        g2s = cpasync.CopyBulkTensorTileG2SOp()

        def tma(src, layout, tile, staged):
            return cpasync.make_tiled_tma_atom(g2s, src, cute.select(layout, mode=[0, 1]) if staged else layout, tile)

        if cutlass.const_expr(cfg.ds_fp8):
            tma_atom_Q, tma_Q = tma(mQt, sQ_layout, (d, bm), True)
            tma_atom_K, tma_K = tma(mKt, sK_layout, (d, bn), False)
        else:
            tma_atom_Q, tma_Q = tma(mQ, sQ_layout, (bm, d), True)
            tma_atom_K, tma_K = tma(mK, sK_layout, (bn, d), False)
        tma_atom_dO, tma_dO = tma(mdO, sdO_layout, (bm, d), True)
        tma_atom_V, tma_V = tma(mV, sV_layout, (bn, d), False)
        self.qdo_bytes = (cute.size_in_bytes(self.ds_dtype, cute.select(sQ_layout, mode=[0, 1]))
                          + cute.size_in_bytes(self.do_dtype, cute.select(sdO_layout, mode=[0, 1])))
        self.kv_bytes = cute.size_in_bytes(self.ds_dtype, sK_layout) + cute.size_in_bytes(self.do_dtype, sV_layout)
        self.qdo_bytes += 2 * bm * 4  # the stage's LSE2 and D rows (fp32)
        tma_atom_Q8 = tma_Q8 = tma_atom_K8 = tma_K8 = tma_atom_dOt = tma_dOt = None
        if cutlass.const_expr(cfg.s_fp8):
            tma_atom_Q8, tma_Q8 = tma(mQ8, sQ8_layout, (bm, d), True)
            tma_atom_K8, tma_K8 = tma(mK8, sK8_layout, (bn, d), False)
            self.qdo_bytes += cute.size_in_bytes(FP8, cute.select(sQ8_layout, mode=[0, 1]))
            self.kv_bytes += cute.size_in_bytes(FP8, sK8_layout)
        if cutlass.const_expr(cfg.do_fp8):
            tma_atom_dOt, tma_dOt = tma(mdOt, sdOt_layout, (d, bm), True)
            self.qdo_bytes += cute.size_in_bytes(FP8, cute.select(sdOt_layout, mode=[0, 1]))

        self.shared_storage = self.shared_storage_type(sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
                                                       sQ8_layout, sK8_layout, sdOt_layout)
        grid = (cute.ceil_div(cute.size(mK.shape[0]), bn), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        # the kernel's arguments in groups (flattened in this order into its parameters)
        self.kernel(
            (tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V),
            (tma_atom_Q8, tma_Q8, tma_atom_K8, tma_K8, mScaleQ, mScaleK),
            (tma_atom_dOt, tma_dOt, mScaleV, mScaledO),
            (mLSE2, mDsum, mdQacc, mdQturn, mdK, mdV),
            (mma_s[0], mma_s[1], mma_dp[0], mma_dp[1], mma_dv, mma_dk, mma_dq[0], mma_dq[1]),
            (sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sQ8_layout, sK8_layout, sdOt_layout),
            softmax_scale_log2, softmax_scale, causal_offset,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def shared_storage_type(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sQ8_layout, sK8_layout,
                            sdOt_layout):
        """The CTA's SMEM: barriers, the key-side and query-side tiles, dS, the dQ staging tile
        and each stage's LSE2 / D rows (plus the variant's FP8 tiles)."""
        cfg = self.config
        bm = cfg.tile_m
        ds_dtype, do_dtype = self.ds_dtype, self.do_dtype
        fields = dict(
            mbar_kv=cute.struct.MemRange[cutlass.Int64, 2],
            mbar_qdo=cute.struct.MemRange[cutlass.Int64, 2 * cfg.q_stages],
            sK=cute.struct.Align[cute.struct.MemRange[ds_dtype, cute.cosize(sK_layout)], 1024],
            sV=cute.struct.Align[cute.struct.MemRange[do_dtype, cute.cosize(sV_layout)], 1024],
            sQ=cute.struct.Align[cute.struct.MemRange[ds_dtype, cute.cosize(sQ_layout)], 1024],
            sdO=cute.struct.Align[cute.struct.MemRange[do_dtype, cute.cosize(sdO_layout)], 1024],
            sdS=cute.struct.Align[cute.struct.MemRange[ds_dtype, cute.cosize(sdS_layout)], 1024],
            sdQ=cute.struct.Align[cute.struct.MemRange[Float32, self.dq_tile_floats], 128],
            # LSE2 and D of each Q/dO stage's queries, loaded with the stage (no global loads in the loop)
            sLSE=cute.struct.Align[cute.struct.MemRange[Float32, bm * cfg.q_stages], 128],
            sDsum=cute.struct.Align[cute.struct.MemRange[Float32, bm * cfg.q_stages], 128],
        )
        if cfg.ds_fp8:
            # each MMA warp's max f |dS| of a tile whose dS scale is recomputed
            fields["sDsMax"] = cute.struct.Align[cute.struct.MemRange[Float32, self.mma_threads // 32], 16]
        if cfg.s_fp8:
            fields["sQ8"] = cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sQ8_layout)], 1024]
            fields["sK8"] = cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sK8_layout)], 1024]
        if cfg.do_fp8:
            fields["sdOt"] = cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sdOt_layout)], 1024]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(
        self,
        loads: tuple,  # (TMA atom, tensor) of Q, dO, K, V (Q^T / K^T copies with ds_fp8)
        fp8_s: tuple,  # s_fp8: (atom, tensor) of Q8, K8, then the Q and K block scales; else Nones
        fp8_do: tuple,  # do_fp8: (atom, tensor) of dO^T, then the V and dO scales; else Nones
        gmem: tuple,  # LSE2, D, the dQ accumulator, its turn counters (deterministic), dK, dV
        mmas: tuple,  # S (first, rest), dP (first, rest), dV, dK, dQ (first, rest)
        layouts: tuple,  # SMEM layouts of Q, dO, K, V, dS, Q8, K8, dO^T
        softmax_scale_log2: Float32,
        softmax_scale: Float32,
        causal_offset: Int32,
    ):
        tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV = loads
        tma_atom_Q8, mQ8, tma_atom_K8, mK8, mScaleQ, mScaleK = fp8_s
        tma_atom_dOt, mdOt, mScaleV, mScaledO = fp8_do
        mLSE2, mDsum, mdQacc, mdQturn, mdK, mdV = gmem
        mma_s0, mma_s1, mma_dp0, mma_dp1, mma_dv, mma_dk, mma_q0, mma_q1 = mmas
        sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sQ8_layout, sK8_layout, sdOt_layout = layouts
        cfg = self.config
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        atoms = [a for a in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_Q8, tma_atom_K8, tma_atom_dOt)
                 if a is not None]
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        pipe_kv, pipe_qdo = tma_pipelines(
            self.mma_threads, (storage.mbar_kv, 1, self.kv_bytes), (storage.mbar_qdo, cfg.q_stages, self.qdo_bytes))

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self.dq_tile_floats))
        sLSE = storage.sLSE.get_tensor(cute.make_layout((cfg.tile_m, cfg.q_stages)))
        sDsum = storage.sDsum.get_tensor(cute.make_layout((cfg.tile_m, cfg.q_stages)))
        sDsMax = None
        if cutlass.const_expr(cfg.ds_fp8):
            sDsMax = storage.sDsMax.get_tensor(cute.make_layout(self.mma_threads // 32))
        if cutlass.const_expr(cfg.s_fp8):
            sQ8 = storage.sQ8.get_tensor(sQ8_layout.outer, swizzle=sQ8_layout.inner)
            sK8 = storage.sK8.get_tensor(sK8_layout.outer, swizzle=sK8_layout.inner)
        else:
            sQ8, sK8 = sQ, sK  # S^T reads the bf16 tiles
        sdOt = sdO  # dV's B: dO itself (bf16, read transposed) or its own FP8 dO^T copy
        if cutlass.const_expr(cfg.do_fp8):
            sdOt = storage.sdOt.get_tensor(sdOt_layout.outer, swizzle=sdOt_layout.inner)

        n_block, head, batch = cute.arch.block_idx()
        # shapes from dO and V, whose tiles are never the transposed copies: (seq, d, head, batch)
        head_kv = head // (mdO.shape[2] // mV.shape[2])  # GQA: H % Hkv == 0
        seqlen_q = mdO.shape[0]
        seqlen_k = mV.shape[0]
        m_block_max = cute.ceil_div(seqlen_q, cfg.tile_m)
        if cutlass.const_expr(cfg.causal):
            # key j is seen by queries i >= j - causal_offset: skip the query tiles above the diagonal
            m_block_min = cutlass.max(n_block * cfg.tile_n - causal_offset, 0) // cfg.tile_m
        else:
            m_block_min = Int32(0)
        if cutlass.const_expr(cfg.window is not None):
            m_block_min, m_block_max = self.window_query_tiles(n_block, causal_offset, m_block_max)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.producer_registers)
            if warp_idx == 0:
                # (atom, gmem, smem, head, transposed: the tile is d x tokens)
                loads_kv = [(tma_atom_K, mK, sK, head_kv, cfg.ds_fp8), (tma_atom_V, mV, sV, head_kv, False)]
                loads_q = [(tma_atom_Q, mQ, sQ, head, cfg.ds_fp8), (tma_atom_dO, mdO, sdO, head, False)]
                if cutlass.const_expr(cfg.s_fp8):
                    loads_kv.append((tma_atom_K8, mK8, sK8, head_kv, False))
                    loads_q.append((tma_atom_Q8, mQ8, sQ8, head, False))
                if cutlass.const_expr(cfg.do_fp8):
                    loads_q.append((tma_atom_dOt, mdOt, sdOt, head, True))
                self.producer(loads_kv, loads_q, (mLSE2, mDsum), (sLSE, sDsum), pipe_kv, pipe_qdo, n_block, head,
                              batch, m_block_min, m_block_max)
            if warp_idx == 1:
                self.dq_writer(sdQ, mdQacc, mdQturn, batch, head, n_block, m_block_min, m_block_max, causal_offset)
        else:
            cute.arch.setmaxregister_increase(cfg.consumer_registers)
            mma_s0.set(warpgroup.Field.ACCUMULATE, False)
            mma_s1.set(warpgroup.Field.ACCUMULATE, True)
            mma_dp0.set(warpgroup.Field.ACCUMULATE, False)
            mma_dp1.set(warpgroup.Field.ACCUMULATE, True)
            mma_dv.set(warpgroup.Field.ACCUMULATE, True)  # dK, dV start at 0
            mma_dk.set(warpgroup.Field.ACCUMULATE, True)
            mma_q0.set(warpgroup.Field.ACCUMULATE, False)
            mma_q1.set(warpgroup.Field.ACCUMULATE, True)
            # per-tensor and per-block scales of the FP8 operands (1 when an MMA is bf16)
            if cutlass.const_expr(cfg.s_fp8):
                # Q/K scales: one per 128-token block; this CTA's 128 keys are one K block
                scale_k = mScaleK[batch, head_kv, n_block * cfg.tile_n // QUANT_BLOCK]
            else:
                scale_k = Float32(1.0)
            if cutlass.const_expr(cfg.do_fp8):
                # dP^T = scale_v * scale_do * (V8 dO8^T); the /2^8 undoes P's scale in dS (below)
                scale_vdo = (mScaleV[batch, head_kv] * mScaledO[batch, head]) * (1.0 / P_FP8_SCALE)
                scale_dv = mScaledO[batch, head] * (1.0 / P_FP8_SCALE)
            else:
                scale_vdo = Float32(1.0)
                scale_dv = Float32(1.0)
            self.consumer(
                (mma_s0, mma_s1), (mma_dp0, mma_dp1), mma_dv, mma_dk, (mma_q0, mma_q1),
                sQ, sdO, sK, sV, sdS, sdQ, sQ8, sK8, sdOt, pipe_kv, pipe_qdo,
                sLSE, sDsum, sDsMax, mScaleQ, scale_k, scale_vdo, scale_dv, mdK, mdV, n_block, head, batch,
                m_block_min, m_block_max, seqlen_k, softmax_scale_log2, softmax_scale, causal_offset, tidx - 128)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def producer(self, loads_kv, loads_q, rows_g, rows_s, pipe_kv, pipe_qdo, n_block, head, batch,
                 m_block_min, m_block_max):
        """One warp: this CTA's key-side tiles once, then the query-side tiles and rows (LSE2, D)
        of each query tile into the ring, one barrier per stage."""
        cfg = self.config
        d, bm, bn = cfg.head_dim, cfg.tile_m, cfg.tile_n
        one = cute.make_layout(1)

        def partition(load, tokens, index):
            atom, g, s, h, transposed = load
            tile, coord = ((d, tokens), (0, index)) if transposed else ((tokens, d), (index, 0))
            gt = cute.local_tile(g[None, None, h, batch], tile, coord)
            ts, tg = cpasync.tma_partition(atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(gt, 0, 2))
            return atom, ts, tg

        kv = [partition(x, bn, n_block) for x in loads_kv]
        qs = [partition(x, bm, None) for x in loads_q]  # indexed by the query tile below
        if m_block_min < m_block_max:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            for i in cutlass.range_constexpr(len(kv)):  # (atom, smem, gmem) of each key-side tile
                cute.copy(kv[i][0], kv[i][2], kv[i][1], tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.q_stages)
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                pipe_qdo.producer_acquire(state)
                bar = pipe_qdo.producer_get_barrier(state)
                for i in cutlass.range_constexpr(len(qs)):  # (atom, smem, gmem) of each query-side tile
                    cute.copy(qs[i][0], qs[i][2][None, m_block], qs[i][1][None, state.index], tma_bar_ptr=bar)
                # LSE2 and D: tile_m fp32 each (rows padded to the tile); one lane issues them (the
                # tile copies above elect one themselves): every issue adds its bytes to the barrier
                if cute.arch.lane_idx() == 0:
                    for i in cutlass.range_constexpr(2):
                        g = rows_g[i]
                        src = g.iterator + cute.crd2idx((batch, head, m_block * bm), g.layout)
                        ptx.bulk_load(src, rows_s[i][None, state.index].iterator, bar, bm * 4)
                state.advance()

    # ------------------------------------------------------------------ MMA warpgroups
    @cute.jit
    def consumer(self, mma_s, mma_dp, mma_dv, mma_dk, mma_q, sQ, sdO, sK, sV, sdS, sdQ, sQ8, sK8, sdOt,
                 pipe_kv, pipe_qdo, sLSE, sDsum, sDsMax, mScaleQ, scale_k, scale_vdo, scale_dv, mdK, mdV,
                 n_block, head, batch, m_block_min, m_block_max,
                 seqlen_k, softmax_scale_log2, softmax_scale, causal_offset, tidx):
        cfg = self.config
        d, bm, bn = cfg.head_dim, cfg.tile_m, cfg.tile_n
        wg = cute.arch.make_warp_uniform(tidx // 128)
        # wgmma descriptors are per warpgroup (slice at its first thread); C per thread
        wg_s = mma_s[0].get_slice(wg * 128)
        wg_dp = mma_dp[0].get_slice(wg * 128)
        wg_dv = mma_dv.get_slice(wg * 128)
        wg_dk = mma_dk.get_slice(wg * 128)
        wg_q = mma_q[0].get_slice(wg * 128)
        thr_s = mma_s[0].get_slice(tidx)
        thr_dv = mma_dv.get_slice(tidx)
        thr_dk = mma_dk.get_slice(tidx)
        thr_q = mma_q[0].get_slice(tidx)

        tSrK = wg_s.make_fragment_A(wg_s.partition_A(self.operand(sK8, "S", 0)))
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(self.operand(sQ8, "S", 1)))
        tPrV = wg_dp.make_fragment_A(wg_dp.partition_A(self.operand(sV, "dP", 0)))
        tPrdO = wg_dp.make_fragment_B(wg_dp.partition_B(self.operand(sdO, "dP", 1)))
        tVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(self.operand(sdOt, "dV", 1)))  # dO^T: (D, queries)
        # B of dK: Q^T (D, queries); A of dQ: dS (queries, keys); B of dQ: K^T (D, keys)
        tKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(self.operand(sQ, "dK", 1)))
        tQrdS = wg_q.make_fragment_A(wg_q.partition_A(self.operand(sdS, "dQ", 0)))
        tQrKt = wg_q.make_fragment_B(wg_q.partition_B(self.operand(sK, "dQ", 1)))

        s_shape = thr_s.partition_shape_C((bn, bm))
        tScS = thr_s.partition_C(cute.make_identity_tensor((bn, bm)))  # (key, query) in the tile
        # dS^T -> SMEM with stmatrix: an accumulator row (a key) holds query pairs, i.e. 8x8 blocks of
        # the row-major (keys x queries) tile, four blocks per instruction
        if cutlass.const_expr(cfg.ds_fp8):
            # FP8 dS -> SMEM as dQ's K-major A (queries x keys, 128 bytes per query row, 128-byte
            # swizzle): this warp's 16 keys are one 16-byte chunk of every row; lane l addresses
            # query row l (first stmatrix) and 32 + l (second)
            ds_chunk = wg * 4 + (tidx % 128) // 32
            ds_lane = tidx % 32
            ds_row_off = ds_lane * bn + ((ds_chunk ^ (ds_lane % 8)) * 16)
            ds_base = sdS.iterator.toint() + ds_row_off
            ds_stage_bytes = bm * bn
        else:
            st_dS = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BF16), mma_s[0])
            thr_st_dS = st_dS.get_slice(tidx)
            tSsdS = thr_st_dS.partition_D(sdS)
        # LSE2 / D of the thread's queries: the stage's rows broadcast over the keys, same partition
        # as the scores (each thread reads its query columns, in pairs)
        row_layout = cute.make_layout((bn, bm, cfg.q_stages), stride=(0, 1, bm))
        tSsLSE = thr_s.partition_C(cute.make_tensor(sLSE.iterator, row_layout))
        tSsDsum = thr_s.partition_C(cute.make_tensor(sDsum.iterator, row_layout))
        acc_dV = thr_dv.make_fragment_C(thr_dv.partition_shape_C((bn, d)))
        acc_dK = thr_dk.make_fragment_C(thr_dk.partition_shape_C((bn, d)))
        tdVrP = thr_dv.make_fragment_A(thr_dv.partition_shape_A((bn, bm)))
        tdKrdS = thr_dk.make_fragment_A(thr_dk.partition_shape_A((bn, bm)))
        dq_shape = thr_q.partition_shape_C((bm, d))
        # this thread's dQ registers in fragment order: 4 floats per 16-byte store, 512 floats apart
        dq_regs = cute.size(dq_shape)
        tdQsdQ = cute.make_tensor(sdQ.iterator + wg * (self.dq_tile_floats // cfg.mma_warpgroups) + (tidx % 128) * 4,
                                  cute.make_layout((4, dq_regs // 4), stride=(1, 512)))
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        if cutlass.const_expr(cfg.ds_fp8):
            dk_c = Float32(1.0)  # acc_dK * dk_c is dK (see the FP8 dS scale in the loop)
            ds_c_next = Float32(1.0)  # the next tile's dS scale (the first tile takes its own max's)

        s_mn = dlayout.acc_mn(cute.make_rmem_tensor(s_shape, Float32))
        c_mn = dlayout.acc_mn(tScS)
        n_rows = cute.size(s_mn, mode=[0])  # keys this thread holds
        n_cols = cute.size(s_mn, mode=[1])  # queries this thread holds
        key0 = n_block * bn

        if m_block_min < m_block_max:
            pipe_kv.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.q_stages)
            ds_stage = Int32(0)
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                q0 = m_block * bm
                acc_S = cute.make_rmem_tensor(s_shape, Float32)
                acc_dP = cute.make_rmem_tensor(s_shape, Float32)
                if cutlass.const_expr(cfg.s_fp8):
                    # reuse q k: S^T from the forward's FP8 payloads, their scales folded into c
                    scale_q = mScaleQ[batch, head, q0 // QUANT_BLOCK]
                    score_scale = (scale_q * scale_k) * softmax_scale_log2
                    if cutlass.const_expr(cfg.ds_fp8):
                        inv_scale_q = 1.0 / scale_q  # for dQ's scale, far from where it is needed
                else:
                    score_scale = softmax_scale_log2
                pipe_qdo.consumer_wait(state)
                self.gemm(mma_s, acc_S, tSrK, tSrQ[None, None, None, state.index])
                self.gemm(mma_dp, acc_dP, tPrV, tPrdO[None, None, None, state.index])
                warpgroup.wait_group(1)  # S^T is ready (dP^T still running)
                S = dlayout.acc_mn(acc_S)
                if cutlass.const_expr(cfg.softcap > 0):
                    # softcap: the log2-unit score x = S^T c becomes c2 tanh(x / c2); S^T keeps
                    # tanh(x / c2) until dP^T is ready (P and dS's 1 - tanh^2 are taken from it
                    # there, so no second tile of registers), masked entries at SOFTCAP_FILL
                    tanh_scale = score_scale * (1.0 / cfg.softcap_log2)
                    for i in cutlass.range_constexpr(cute.size(acc_S)):
                        acc_S[i] = dsoftmax.tanh_approx(acc_S[i] * tanh_scale)
                # mask keys past the end (causal: and keys after the query's diagonal; window: and
                # keys outside it)
                if cutlass.const_expr(self.window_by_rows):
                    self.window_mask_rows(S, c_mn, key0, q0, seqlen_k, causal_offset,
                                          SOFTCAP_FILL if cfg.softcap > 0 else None)
                else:
                    dmask.apply_keys_by_queries(S, c_mn, key0, q0, bn, bm, seqlen_k, cfg.causal, causal_offset,
                                                cfg.window, SOFTCAP_FILL if cfg.softcap > 0 else None)
                # P^T = exp2(S^T * c - LSE2): rows of the forward's softmax, recomputed. Column
                # by column, so each query's LSE2 / D (L1-resident) is live for two values only.
                # FP8 dV: P is produced scaled by 2^8 (the FP8 operand of dV, as in the FP8 forward)
                lse_row = cute.make_rmem_tensor(n_cols, Float32)
                cute.autovec_copy(dlayout.acc_mn(tSsLSE[None, None, None, state.index])[0, None], lse_row)
                if cutlass.const_expr(cfg.softcap == 0):  # (with a softcap: in the dS loop below)
                    for j in cutlass.range_constexpr(n_cols):
                        lse2 = self.lse2_of(lse_row, j)
                        for r in cutlass.range_constexpr(n_rows):
                            S[r, j] = ptx.ex2(S[r, j] * score_scale - lse2)
                warpgroup.wait_group(0)  # dP^T is ready
                dP = dlayout.acc_mn(acc_dP)
                dsum_row = cute.make_rmem_tensor(n_cols, Float32)
                cute.autovec_copy(dlayout.acc_mn(tSsDsum[None, None, None, state.index])[0, None], dsum_row)
                if cutlass.const_expr(cfg.ds_fp8):
                    # dS : fp8e4m3: one e4m3 scale per tile (64 queries x 128 keys), a power of two
                    # c with Q's block scale folded in: dS is rounded as e4m3(f dS), f = s_q / c, so that
                    # dK = sum over tiles of c dS8^T Q8 and dQ = c s_k / s_q dS8 K8. c is guessed from the
                    # previous tile's max |dS| (no extra barrier); a tile whose f |dS| would pass 448 (any
                    # thread, reduced at the dS barrier) is rounded again with the c its max needs.
                    ds_c = ds_c_next
                    ds_inv_c = ptx.pow2_reciprocal(ds_c)
                    ds_f = scale_q * ds_inv_c  # = s_q / c exactly
                    scale_vdo_f = scale_vdo * ds_f
                    dsum_f = ds_f * (1.0 / P_FP8_SCALE)
                # dS^T's per-query terms: D in dP^T's units and dP^T's scale (None: as the MMA gave it)
                dsum_scale, dp_scale = None, None
                if cutlass.const_expr(cfg.ds_fp8):
                    # f dS^T = (2^8 P^T) * (f dP^T / 2^8 - f D / 2^8)
                    dsum_scale, dp_scale = dsum_f, scale_vdo_f
                elif cutlass.const_expr(cfg.do_fp8):
                    # dS^T = (2^8 P^T) * (dP^T / 2^8 - D / 2^8), dP^T = scale_v * scale_do * (V8 dO8^T)
                    dsum_scale, dp_scale = 1.0 / P_FP8_SCALE, scale_vdo
                if cutlass.const_expr(cfg.softcap > 0):
                    self.softcap_ds(acc_S, acc_dP, lse_row, dsum_row, dsum_scale, dp_scale, tdVrP)
                else:
                    for j in cutlass.range_constexpr(n_cols):
                        dsum = dsum_row[j] if dsum_scale is None else dsum_row[j] * dsum_scale
                        for r in cutlass.range_constexpr(n_rows):
                            dp = dP[r, j]
                            if cutlass.const_expr(dp_scale is not None):
                                dp = dp * dp_scale
                            dP[r, j] = S[r, j] * (dp - dsum)  # dS^T
                if cutlass.const_expr(cfg.ds_fp8):
                    # both A operands converted before any MMA reads them (S^T and dP^T die here)
                    if cutlass.const_expr(cfg.softcap == 0):  # (with a softcap: softcap_ds did)
                        dlayout.pack_p_fp8(acc_S, tdVrP, False)  # e4m3 (RNE, saturating), queries permuted as dO^T
                    # this thread's max f |dS| (a tree: short dependency chains): does it overflow e4m3
                    # with this tile's c, does it use less than a sixteenth of its range
                    ds_loc = tree_max([ptx.absmax2(acc_dP[2 * i], acc_dP[2 * i + 1])
                                       for i in range(cute.size(acc_dP) // 2)])
                    ds_redo = (ds_loc > E4M3_MAX) | (m_block == m_block_min)  # the first tile: c from its max
                    ds_small = ds_loc < DS_SMALL
                    self.store_ds_fp8(acc_dP, tdKrdS, ds_base + ds_stage * ds_stage_bytes)
                    self.gemm((mma_dv, mma_dv), acc_dV, tdVrP, tVrdOt[None, None, None, state.index])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    # the dS barrier also ORs the overflows over the MMA threads (and a second one ANDs
                    # the small ones)
                    ds_redo = ptx.barrier_red(BAR_DS, self.mma_threads, ds_redo, "or")
                    ds_small = ptx.barrier_red(BAR_DS, self.mma_threads, ds_small, "and")
                    ds_c_next = ds_c
                    if ds_redo:
                        # c from the tile's max (over the warp: one redux; over the warps: SMEM and a
                        # barrier): the power of two covering max|dS| s_q = max(f |dS|) c; dS is
                        # rescaled by a power of two, rounded and stored again
                        ds_warp_max = ptx.warp_max_nonneg(ds_loc)
                        if ds_lane == 0:
                            sDsMax[tidx // 32] = ds_warp_max
                        cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=self.mma_threads)
                        ds_c_new = ptx.fp8_scale_cover(
                            tree_max([sDsMax[w] for w in range(self.mma_threads // 32)]) * ds_c)
                        ds_rescale = ds_c * ptx.pow2_reciprocal(ds_c_new)
                        for i in cutlass.range_constexpr(cute.size(acc_dP)):
                            acc_dP[i] = acc_dP[i] * ds_rescale
                        ds_c = ds_c_new
                        ds_inv_c = ptx.pow2_reciprocal(ds_c)
                        self.store_ds_fp8(acc_dP, tdKrdS, ds_base + ds_stage * ds_stage_bytes)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=self.mma_threads)
                        # handed on with headroom: the tile after a key tile's first (diagonal, half
                        # masked) one, or after an overflow, is likely larger, and its redo is dear
                        ds_c_next = ds_c * DS_HEADROOM
                        ds_small = False
                    # else the next tile's c is this one's, halved when every f |dS| was below 448 / 16,
                    # but not below 2^-60 (runs of all-zero tiles, e.g. masked dO rows, would take it to 0)
                    if ds_small & (ds_c >= DS_C_HALVE_MIN):
                        ds_c_next = ds_c * 0.5
                else:
                    # both A operands converted before any MMA reads them: S^T and dP^T die here,
                    # which keeps the live registers of the MMA warpgroups under 240
                    if cutlass.const_expr(cfg.softcap > 0):
                        pass  # P^T is in dV's A fragment already (softcap_ds)
                    elif cutlass.const_expr(cfg.do_fp8):
                        dlayout.pack_p_fp8(acc_S, tdVrP, False)  # e4m3 (RNE, saturating), queries permuted as dO^T
                    else:
                        dlayout.store_p_bf16(acc_S, tdVrP)
                    dlayout.store_p_bf16(acc_dP, tdKrdS)
                    self.gemm((mma_dv, mma_dv), acc_dV, tdVrP, tVrdOt[None, None, None, state.index])
                    # dS^T -> SMEM (dQ's A operand, MN-major), visible to the async proxy; the bf16
                    # A fragment holds the values in accumulator order
                    cute.copy(st_dS, thr_st_dS.retile(cute.make_tensor(tdKrdS.iterator, acc_dP.layout)),
                              tSsdS[None, None, None, ds_stage])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=BAR_DS, number_of_threads=self.mma_threads)
                # dQ before dK: its result is wanted first (it leaves through SMEM while dK runs)
                acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
                self.gemm(mma_q, acc_dQ, tQrdS[None, None, None, ds_stage], tQrKt)
                if cutlass.const_expr(cfg.ds_fp8):
                    # dK is kept in units of the current tile's c: rescaled (exactly: powers of two)
                    # when c changes; the previous tile's dK MMA has completed
                    if ds_c != dk_c:
                        dk_rescale = dk_c * ds_inv_c
                        for i in cutlass.range_constexpr(cute.size(acc_dK)):
                            acc_dK[i] = acc_dK[i] * dk_rescale
                        dk_c = ds_c
                self.gemm((mma_dk, mma_dk), acc_dK, tdKrdS, tKrQt[None, None, None, state.index])
                warpgroup.wait_group(1)  # dV and dQ are done, dK still running
                # hand dQ to the dQ warp: wait until it has read the previous tile out of SMEM
                if cutlass.const_expr(cfg.ds_fp8):
                    dq_scale = (scale_k * ds_c) * inv_scale_q  # dQ = c s_k / s_q dS8 K8 (softmax scale: post)
                    for i in cutlass.range_constexpr(dq_regs):
                        acc_dQ[i] = acc_dQ[i] * dq_scale
                cute.arch.barrier(barrier_id=BAR_DQ_EMPTY, number_of_threads=self.dq_sync_threads)
                cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout((4, dq_regs // 4))), tdQsdQ)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL, number_of_threads=self.dq_sync_threads)
                warpgroup.wait_group(0)
                pipe_qdo.consumer_release(state)
                state.advance()
                ds_stage = ds_stage ^ 1

        if cutlass.const_expr(cfg.do_fp8):
            for i in cutlass.range_constexpr(cute.size(acc_dV)):
                acc_dV[i] = acc_dV[i] * scale_dv  # FP8 dV: undo dO's scale and P's 2^8
        if cutlass.const_expr(cfg.ds_fp8):
            for i in cutlass.range_constexpr(cute.size(acc_dK)):
                acc_dK[i] = acc_dK[i] * dk_c  # FP8 dK: in units of the last tile's dS scale
        self.epilogue(acc_dK, acc_dV, thr_dk, mdK, mdV, head, batch, n_block, seqlen_k, softmax_scale)

    def window_query_tiles(self, n_block, causal_offset, m_block_max):
        """[first, end) query tiles that see some key of key tile ``n_block`` under the window
        (left, right): key j is seen by the queries i with j - offset - right <= i <= j - offset
        + left; the tiles outside are skipped (a CTA whose range is empty writes zero dK, dV).
        A trace-time helper."""
        cfg = self.config
        bm, bn = cfg.tile_m, cfg.tile_n
        left, right = cfg.window
        m_min = Int32(0)
        if right >= 0:
            m_min = cutlass.max(n_block * bn - causal_offset - right, 0) // bm
        if left >= 0:
            # the last query that sees the tile's last key (its nominal one: past Sk that is past
            # Sq, cut by m_block_max); below 0: none (max first: // of a negative number is not
            # a floor here)
            last_q = n_block * bn + (bn - 1 + left) - causal_offset
            m_block_max = cutlass.min(m_block_max, (cutlass.max(last_q, -1) + bm) // bm)
        return m_min, m_block_max

    def first_key_tile(self, m_block, causal_offset):
        """The first key tile that visits query tile ``m_block`` under a window's left bound
        (deterministic dQ counts its turns from there): the tile holding the first key the
        tile's first query sees (``window_query_tiles``' inverse; without a left bound it is 0)."""
        cfg = self.config
        return cutlass.max(m_block * cfg.tile_m + causal_offset - cfg.window[0], 0) // cfg.tile_n

    def softcap_ds(self, acc_s, acc_dp, lse_row, dsum_row, dsum_scale, dp_scale, frg_p):
        """dS^T with a softcap, once dP^T is there (S^T holding tanh(x / c2), masked entries at
        SOFTCAP_FILL): P^T = exp2(c2 tanh - LSE2) and dS^T = P^T (dP^T - D) (1 - tanh^2), the
        derivative of c2 tanh(x / c2) (a masked entry: P = 0 times a finite factor). P^T goes
        straight into dV's A fragment (bf16, or e4m3 as ``layout.pack_p_fp8`` packs it: RNE,
        saturating, queries permuted as dO^T) a register word at a time, so the tanh tile's
        registers die as the loop goes instead of holding a full P^T tile beside the LSE2 and D
        rows to its end (which spilled 4 B in BF16 and FP8 causal; docs/backward.md has what
        is left). Same arithmetic, same order, as the loop without a softcap. A trace-time
        helper."""
        cfg = self.config
        S, dP = dlayout.acc_mn(acc_s), dlayout.acc_mn(acc_dp)
        n_rows, n_cols = cute.size(S, mode=[0]), cute.size(S, mode=[1])
        words = cute.recast_tensor(frg_p, cutlass.Uint32)
        if cutlass.const_expr(cfg.do_fp8):
            # pack_p_fp8's words: word rh + 2 kh + 4 kb, byte b from accumulator element
            # (b & 1) + 2 rh + 4 (4 kb + 2 kh + (b >> 1))
            word_of = {}
            for kb in range(cute.size(acc_s) // 16):
                for kh in range(2):
                    for rh in range(2):
                        src = tuple((b & 1) + 2 * rh + 4 * (4 * kb + 2 * kh + (b >> 1)) for b in range(4))
                        word_of[src] = rh + 2 * kh + 4 * kb
            group = 4
        else:
            assert cute.size(frg_p) == cute.size(acc_s)  # store_p_bf16: bf16 element i is element i
            group = 2
        for j0 in range(0, n_cols, group):
            for r in range(n_rows):
                ps, idx = [], []
                for j in range(j0, j0 + group):
                    dsum = dsum_row[j] if dsum_scale is None else dsum_row[j] * dsum_scale
                    dp = dP[r, j]
                    if cutlass.const_expr(dp_scale is not None):
                        dp = dp * dp_scale
                    th = S[r, j]
                    p = ptx.ex2(th * cfg.softcap_log2 - self.lse2_of(lse_row, j))
                    dP[r, j] = (p * (dp - dsum)) * (1.0 - th * th)
                    ps.append(p)
                    idx.append(cute.crd2idx((r, j), S.layout))
                if cutlass.const_expr(cfg.do_fp8):
                    if tuple(idx) not in word_of:
                        raise AssertionError(f"softcap_ds: elements {idx} are not one word of pack_p_fp8")
                    words[word_of[tuple(idx)]] = ptx.cvt_e4m3x4(ps[0], ps[1], ps[2], ps[3])
                else:
                    if idx[1] != idx[0] + 1 or idx[0] % 2:
                        raise AssertionError(f"softcap_ds: elements {idx} are not one bf16x2 word")
                    words[idx[0] // 2] = ptx.f32x2_to_bf16x2(ps[0], ps[1])

    def lse2_of(self, lse_row, j: int):
        """Query ``j``'s LSE2 as P's exponent subtracts it: FP8 P is produced as 2^8 P (a
        trace-time helper)."""
        if self.config.do_fp8:
            return lse_row[j] - P_LOG2_SCALE
        return lse_row[j]

    @property
    def window_by_rows(self) -> bool:
        """Whether the window is masked by ``window_mask_rows``: with a softcap, and in the FP8
        recipes (FP8 dO: FP8 and all-FP8), where ``mask.apply_keys_by_queries``' per-element
        form spilled (4-12 B, ptxas 13.5). The BF16 window backward without a softcap keeps
        the per-element form: it does not spill there, and its PTX stays the one measured."""
        cfg = self.config
        return cfg.window is not None and (cfg.softcap > 0 or cfg.do_fp8)

    @cute.jit
    def window_mask_rows(self, s_mn: cute.Tensor, c_mn: cute.Tensor, key0: Int32, q0: Int32, seqlen_k: Int32,
                         causal_offset: Int32, fill: cutlass.Constexpr):
        """``mask.apply_keys_by_queries``' rule for a window (keys past ``seqlen_k``, and key j
        seen by the queries i with j - offset - right <= i <= j - offset + left), entries set to
        ``fill`` (None: -inf; SOFTCAP_FILL on the tanh tile), with per-row bounds: each of the
        thread's key rows gets its first and last visible query relative to the thread's first
        query column, and the columns, which lie at constant distances from that one, compare
        against them as immediates. The per-element form keeps a sum per query column live
        next to the in-flight dP^T, which made the FP8 window backwards spill. Only a tile that
        crosses a bound is walked."""
        cfg = self.config
        bm, bn = cfg.tile_m, cfg.tile_n
        left, right = cfg.window
        need_mask = key0 + bn > seqlen_k
        if cutlass.const_expr(right >= 0):
            need_mask = need_mask | (key0 + bn - 1 > q0 + causal_offset + right)
        if cutlass.const_expr(left >= 0):
            need_mask = need_mask | (key0 < q0 + (bm - 1) + causal_offset - left)
        if need_mask:
            col0 = c_mn[0, 0][1]
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                kr = c_mn[r, 0][0]
                row_out = kr >= seqlen_k - key0
                # this row's key, relative to the thread's first query: queries (relative) from
                # key - offset - right to key - offset + left see it
                rel = key0 + kr - causal_offset - q0 - col0
                for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    dj = c_mn[0, j][1] - col0  # a constant
                    bad = row_out
                    if cutlass.const_expr(right >= 0):
                        bad = bad | (dj < rel - right)
                    if cutlass.const_expr(left >= 0):
                        bad = bad | (dj > rel + left)
                    if bad:
                        if cutlass.const_expr(fill is None):
                            s_mn[r, j] = -Float32.inf
                        else:
                            s_mn[r, j] = Float32(fill)

    @cute.jit
    def store_ds_fp8(self, acc_ds, frg_dk, smem_addr):
        """f dS^T (fp32, in the S^T accumulator's layout) as e4m3 twice: dK's A fragment (queries
        permuted as the Q^T copy) and dQ's A tile in SMEM (queries x keys, K-major): there each
        16-bit unit is a query's (key r, key r + 8) pair, so an 8-column chunk of the accumulator
        is an 8 x 8 matrix of units that stmatrix.trans writes query-major, keys interleaved per
        16 as in the K^T copy (``smem_addr``: this lane's row of the first 32 queries)."""
        cfg = self.config
        dlayout.pack_p_fp8(acc_ds, frg_dk, False)
        units = [ptx.cvt_e4m3x4(acc_ds[4 * i], acc_ds[4 * i + 2], acc_ds[4 * i + 1], acc_ds[4 * i + 3])
                 for i in range(cfg.tile_m // 8)]
        for x4 in cutlass.range_constexpr(cfg.tile_m // 32):
            ptx.stmatrix_x4_trans(smem_addr + x4 * 32 * cfg.tile_n, *units[4 * x4:4 * x4 + 4])

    def operand(self, tile, mma: str, index: int):
        """An SMEM tile as ``mma``'s operand ``index`` (0: A, 1: B): a transposed view where the
        plan reads it MN-major (a trace-time choice)."""
        return transposed(tile) if self.config.mn_major(mma, index) else tile

    @cute.jit
    def gemm(self, mmas, acc, tA, tB):
        """One asynchronous warpgroup MMA over all k-blocks (``mmas``: first, rest)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            mma = mmas[0] if k == 0 else mmas[1]
            cute.gemm(mma, acc, tA[None, None, k], tB[None, None, k], acc)
        warpgroup.commit_group()

    @cute.jit
    def dq_writer(self, sdQ, mdQacc, mdQturn, batch, head, n_block, m_block_min, m_block_max, causal_offset):
        """One warp: adds each query tile's dQ contribution from SMEM into the fp32 global
        accumulator (both in fragment order, so the tile is one contiguous run: a bulk reduce
        per lane over 8 lanes), then frees the SMEM tile for the MMA warps' next one."""
        cfg = self.config
        lane = cute.arch.lane_idx()
        chunk = self.dq_tile_floats // DQ_REDUCE_LANES  # floats per lane's reduce
        if m_block_min < m_block_max:
            # the staging tile starts out free
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY, number_of_threads=self.dq_sync_threads)
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                tile = mdQacc.iterator + cute.crd2idx((batch, head, m_block * cfg.tile_m, 0), mdQacc.layout)
                cute.arch.barrier(barrier_id=BAR_DQ_FULL, number_of_threads=self.dq_sync_threads)
                if cutlass.const_expr(cfg.deterministic):
                    # deterministic: key tiles add into each query tile in ascending order. Key
                    # tile n waits for the n tiles before it (all of them visit this query tile: the
                    # causal start tile grows with n; under a window's left bound, for the tiles from
                    # the first that visits it); CTAs launch in key-tile order, so the wait ends.
                    turn = mdQturn.iterator + cute.crd2idx((batch, head, m_block), mdQturn.layout)
                    if lane == 0:
                        my_turn = n_block
                        if cutlass.const_expr(cfg.window is not None and cfg.window[0] >= 0):
                            my_turn = n_block - self.first_key_tile(m_block, causal_offset)
                        seen = ptx.ld_acquire_s32(turn)
                        while seen != my_turn:
                            seen = ptx.ld_acquire_s32(turn)
                    cute.arch.sync_warp()
                if lane < DQ_REDUCE_LANES:
                    ptx.bulk_add_f32(tile + lane * chunk, sdQ.iterator + lane * chunk, chunk * 4)
                cute.arch.cp_async_bulk_commit_group()
                if cutlass.const_expr(cfg.deterministic):
                    # the adds must have landed in global memory before the turn passes on
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.sync_warp()
                    if lane == 0:
                        ptx.red_release_add_s32(turn, 1)
                else:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # SMEM read out; the adds may still be in flight
                if m_block + 1 < m_block_max:  # the MMA warps wait for no tile after the last
                    cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY, number_of_threads=self.dq_sync_threads)

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, thr_kv, mdK, mdV, head, batch, n_block, seqlen_k, softmax_scale):
        """dK (scaled) and dV rows of keys < seqlen_k -> global, in the output's dtype
        (bf16 when every query head has its own key head, fp32 partials for GQA)."""
        cfg = self.config
        d, bn = cfg.head_dim, cfg.tile_n
        key0 = n_block * bn
        # partitions made here, after the loop, so their addresses are not live across it
        tKVcKV = thr_kv.partition_C(cute.make_identity_tensor((bn, d)))
        tdKgdK = thr_kv.partition_C(cute.local_tile(mdK[None, None, head, batch], (bn, d), (n_block, 0)))
        tdVgdV = thr_kv.partition_C(cute.local_tile(mdV[None, None, head, batch], (bn, d), (n_block, 0)))
        for i in cutlass.range_constexpr(cute.size(acc_dK)):
            acc_dK[i] = acc_dK[i] * softmax_scale
        rK = cute.make_rmem_tensor_like(acc_dK, mdK.element_type)
        rV = cute.make_rmem_tensor_like(acc_dV, mdV.element_type)
        rK.store(acc_dK.load().to(mdK.element_type))
        rV.store(acc_dV.load().to(mdV.element_type))
        k_mn = dlayout.acc_mn(rK)
        v_mn = dlayout.acc_mn(rV)
        c_mn = dlayout.acc_mn(tKVcKV)
        gk = dlayout.acc_mn(tdKgdK)
        gv = dlayout.acc_mn(tdVgdV)
        for r in cutlass.range_constexpr(cute.size(k_mn, mode=[0])):
            if key0 + c_mn[r, 0][0] < seqlen_k:
                # a row's column pairs are adjacent in memory: one 4-byte (bf16) or 8-byte (fp32) store each
                cute.autovec_copy(k_mn[r, None], gk[r, None])
                cute.autovec_copy(v_mn[r, None], gv[r, None])
