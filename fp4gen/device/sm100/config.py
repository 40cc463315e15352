"""The frozen configs of the sm100a kernel classes (``forward.AttentionFwdSm100``,
``backward.AttentionBwdSm100``): every value a kernel reads of its plan.

The lowering (fp4gen/lowering/sm100.py, sm100_bwd.py) builds one from the plan and the
generated module renders it as a literal (``FWD_CONFIG = ForwardKernelConfig(...)``); the kernel
class chooses its variants from it with ``cutlass.const_expr``. This module imports nothing
but the standard library, so that the lowering can build a config and a generated module can
be imported without CuTe DSL.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

P_MODES = ("directp_fp4", "exp_fp8", "two_level_fp4")


def _first_cols(regions) -> dict:
    return {name: first for name, first, _ in regions}


@dataclass(frozen=True)
class ForwardKernelConfig:
    """One sm100a forward: tile shape, formats, the P path, warp roles, TMEM map."""

    head_dim: int
    tile_m: int  # query rows per stage (TMEM lanes)
    tile_n: int  # keys per KV tile
    q_stages: int  # query tiles per CTA, one softmax warpgroup each
    kv_stages: int  # K/V SMEM ring depth
    causal: bool  # bottom-right aligned causal mask
    pv_fp8: bool  # P/V in FP8 E4M3 (PV kind::f8f6f4)
    pv_block_scaled: bool  # the PV kind carries P/V block scales
    pv_sf_vec: int  # keys per P/V block scale: 32 (MXFP4, E8M0) or 16 (NVFP4, E4M3)
    v_k_major: bool  # V stored transposed (D x keys) for a K-major PV B operand
    p_mode: str  # directp_fp4 | exp_fp8 | two_level_fp4
    p_policy: Optional[str]  # Direct-P policy: fast | accurate (None otherwise)
    p_fp8_scale: float  # exp_fp8: P is stored as e4m3(p_fp8_scale * p) (numerics.directp.P_FP8_SCALE)
    o_scale: float  # 1 / p_fp8_scale for FP8 P, else 1: O is divided by P's fixed factor
    lse_shift: float  # Direct-P: log2 G, P ~ G 2^(t - m) (numerics.directp.DIRECT_P_GAIN)
    direct_p_a: float
    direct_p_b: float
    p_parts: int  # P publications per KV tile (plan.publish parts)
    p_part_cols: int  # 32-bit words (TMEM columns) of one row of P per publish part
    p_smem: bool  # p_source smem: PV reads P from an SMEM tile, not from TMEM
    p_row_bytes: int  # bytes of one row of P's SMEM tile (K-major: tile_n codes)
    guard_m: int  # sampling guard (Algorithm 3): 0, 0 when the spec has none
    guard_l: int
    # warp roles (plan.pipeline.roles, in the order the kernel numbers warps)
    softmax_warps: tuple  # one tuple of warp indices per query stage
    correction_warps: tuple
    mma_warp: int
    load_warp: int
    idle_warps: tuple  # warps of the roles the kernel does not implement (epilogue, spare)
    n_warps: int
    regs_softmax: int  # setmaxnreg budgets per warpgroup
    regs_correction: int
    regs_other: int
    tmem_alloc_cols: int
    tmem: tuple  # (name, first column, last column) per plan.tmem region, inclusive

    def __post_init__(self):
        if self.p_mode not in P_MODES:
            raise ValueError(f"p_mode must be one of {P_MODES}, got {self.p_mode!r}")
        if self.p_mode == "exp_fp8" and not math.log2(self.p_fp8_scale).is_integer():
            # the kernel folds the factor into the exponent: exp2(x + log2 p_fp8_scale)
            raise ValueError(f"p_fp8_scale must be a power of two, got {self.p_fp8_scale}")

    @property
    def guard(self) -> bool:
        return self.guard_l > 0

    @property
    def direct_p(self) -> bool:
        return self.p_mode == "directp_fp4"

    @property
    def exp_fp8(self) -> bool:
        return self.p_mode == "exp_fp8"

    @property
    def two_level(self) -> bool:
        """O is kept in units of the tile's row factor r (docs/sm100.md)."""
        return self.p_mode == "two_level_fp4"

    @property
    def running_max(self) -> bool:
        """The exp and two-level paths keep an online row max; Direct-P has a fixed reference."""
        return self.p_mode != "directp_fp4"

    @property
    def p_swizzle(self) -> str:
        """CuTe's name of the UMMA swizzle of P's SMEM rows (p_source smem): it XORs a row's
        16-byte chunk index with bits 7.. of its byte offset (PTX ISA 5.5.7; 9.7.16.4.1)."""
        return "S<%d,4,3>" % {1: 0, 2: 1, 4: 2, 8: 3}[self.p_row_bytes // 16]

    def first_col(self, region: str) -> int:
        """First TMEM column of a plan region."""
        return _first_cols(self.tmem)[region]

    def softmax_stage_warps(self) -> tuple:
        """(first softmax warp, warps per stage): stage j's softmax warps are
        first + j * per .. first + (j + 1) * per - 1, so that a warp's stage is
        ``(warp - first) // per`` (the one softmax body finds its stage so)."""
        first, per = self.softmax_warps[0][0], len(self.softmax_warps[0])
        want = tuple(tuple(range(first + j * per, first + (j + 1) * per)) for j in range(self.q_stages))
        if tuple(map(tuple, self.softmax_warps)) != want:
            raise ValueError(f"softmax warps {self.softmax_warps}: not {self.q_stages} consecutive groups of "
                             f"{per}, one softmax body cannot tell a warp's stage")
        return first, per

    def stage_stride(self, region: str) -> int:
        """Columns from query stage j's ``region`` (S, O, P) to stage j+1's. The softmax and
        the epilogue trace one body for every stage and address stage j's region as stage 0's
        plus ``j`` strides, so the plan's regions must be evenly spaced (the D128 plan's are)."""
        firsts = [self.first_col("%s%d" % (region, j)) for j in range(self.q_stages)]
        strides = {b - a for a, b in zip(firsts, firsts[1:])} or {0}
        if len(strides) != 1:
            raise ValueError(f"TMEM regions {region}0..{region}{self.q_stages - 1} start at columns "
                             f"{firsts}: not evenly spaced, one softmax body cannot serve every stage")
        return strides.pop()

    def p_offset_in_s(self) -> int:
        """Columns from S_j's first to P_j's (TMEM P): one offset for every stage, since one
        softmax body addresses P_j from S_j."""
        if self.stage_stride("P") != self.stage_stride("S"):
            raise ValueError(f"P_j moves by {self.stage_stride('P')} columns per stage, S_j by "
                             f"{self.stage_stride('S')}: one softmax body needs P at one offset inside every S_j")
        return self.first_col("P0") - self.first_col("S0")


@dataclass(frozen=True)
class BackwardKernelConfig:
    """One sm100a backward (fp4gen.ir.passes.backward_sm100.BackwardPlanSm100)."""

    head_dim: int
    tile_m: int  # queries per step (N of S^T/dP^T, TMEM lanes of dQ)
    tile_n: int  # keys per CTA (TMEM lanes of S^T, dP^T, dV, dK)
    q_stages: int  # Q/dO ring depth (plan: SMEM budget)
    causal: bool
    deterministic: bool  # dQ: key tiles add into each query tile in ascending order
    # FP8 dO: dP^T = V dO^T and dV += P^T dO are kind::f8f6f4 (V E4M3, dO ``do_format``, P^T
    # E4M3 of 2^8 P in TMEM); their scales come in per (batch, head) and apply after the MMAs
    do_fp8: bool
    do_format: str  # "bf16", "e4m3" or "e5m2"
    p_fp8_scale_log2: int  # P^T's fixed scale with an FP8 dO: E4M3 of 2^this P
    # dQ accumulates in dP^T's columns (informational: either way the MMA warp waits for the
    # dQ warps' drain of the previous tile before it issues the next tile's first MMA)
    dq_aliases_dp: bool
    # warp roles (plan roles, in the order the kernel numbers warps)
    compute_warps: tuple
    dq_warps: tuple
    mma_warp: int
    load_warp: int
    n_warps: int
    regs_compute: int  # setmaxnreg budgets per warpgroup
    regs_dq: int
    regs_other: int
    # setmaxnreg.inc (True) for budgets above the launch share, .dec otherwise
    regs_compute_increase: bool
    regs_dq_increase: bool
    regs_other_increase: bool
    tmem_alloc_cols: int
    tmem: tuple  # (name, first column, last column) per backward TMEM region, inclusive

    def first_col(self, region: str) -> int:
        return _first_cols(self.tmem)[region]
