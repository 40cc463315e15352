"""The sm90a forward kernel's configuration: plain values, no CuTe DSL import, so that the
lowering can build one and tests can read one without a GPU toolchain
(``fp4gen.device.sm90.forward`` is the kernel that runs with it)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

P_MODES = ("bf16", "fp8_exp", "fp8_directp")
WARPGROUP_THREADS = 128
# FP8 varlen: sequence b's keys start at column ForwardConfig.varlen_v_start(cu_seqlens_k[b], b)
# of the packed V^T (ForwardHost.v_operand_varlen): on a 16-byte boundary (a TMA box of the
# byte-wide V^T that starts elsewhere is an illegal instruction: measured on an H100,
# 2026-12-07, every sequence start that is not a multiple of 16 keys faulted) and VARLEN_V_GAP
# columns per sequence further on, room for the last partial 32-key permutation block after
# the rounding: start[b+1] - start[b] >= len_b - 15 + 48 >= len_b + 31 (a 32-block rounded up).
VARLEN_V_ALIGN = 16
VARLEN_V_GAP = 48


def check_window_softcap(who: str, causal: bool, window, softcap: float, side_limit: int | None = None):
    """The forward's and the backward's rule for their mask options: a window bounds a side, is
    neither causal (-1, 0) nor combined with causal, each side >= -1 (and < ``side_limit`` where
    the kernel's index arithmetic needs one); a softcap is > 0, or 0 for none."""
    if window is not None:
        left, right = window
        if (causal or (left, right) in ((-1, -1), (-1, 0)) or min(left, right) < -1
                or (side_limit is not None and max(left, right) >= side_limit)):
            sides = "each side >= -1" if side_limit is None else f"each side in [-1, {side_limit})"
            raise ValueError(f"{who}: window {window} must bound a side, be neither causal (-1, 0) nor "
                             f"combined with causal, and {sides}")
    if softcap < 0:
        raise ValueError(f"{who}: softcap must be > 0 (or 0: none), got {softcap}")


@dataclass(frozen=True)
class ForwardConfig:
    """Everything the sm90a forward takes from its plan (fp4gen/lowering/sm90.py: ``config``).

    The generated module renders one literal of this class; the kernel class and the host
    (fp4gen/runtime/sm90_host.py) read only these values."""

    kernel_name: str  # the spec's kernel name: the prefix of every message
    head_dim: int  # 64, 96, 128, 192 or 256 (the planner picks tile_n per head dim: ir/passes/pipeline.py)
    causal: bool  # mask causal (bottom-right aligned)
    in_fp8: bool  # Q, K, V in FP8 E4M3 with fp32 scales
    p_mode: str  # one of P_MODES
    l_from_mma: bool  # Direct-P's l as P @ ones on the tensor cores
    tile_m: int  # query rows per CTA (64 per consumer warpgroup)
    tile_n: int  # keys per tile
    consumer_wgs: int  # consumer warpgroups
    kv_stages: int  # K/V SMEM ring depth
    intra_wg_overlap: bool  # QK^T of tile n+1 under the softmax of tile n
    pingpong: bool  # consumer warpgroups take turns on the tensor cores
    producer_regs: int  # setmaxnreg of the producer warpgroup
    consumer_regs: int  # setmaxnreg of the consumer warpgroups
    quant_block: Optional[int]  # FP8: tokens per Q/K scale (the spec's block); None for BF16
    # Fields with a default: a module renders them only when it sets them, so the modules
    # of specs without them (and their PTX) stay as they were.
    # mask window(left, right), -1 = unbounded side (bottom-right aligned, as
    # fp4gen.numerics.masking); None: no window (``causal`` is its own field)
    window: Optional[tuple] = None
    softcap: float = 0.0  # c > 0: scaled scores become c * tanh(s / c); 0: none
    # sinks learned: a per-head sink logit (H,) fp32 joins each row's denominator and the LSE
    sinks: bool = False
    # layout varlen: packed (total, H, D) Q/K/V/O with cu_seqlens_q/k (B + 1,) int32, LSE (H, total_q);
    # FP8: per-sequence scales, per-token (total, Hx) Q/K, (B, Hkv) V, V^T from varlen_v_start
    varlen: bool = False

    @staticmethod
    def varlen_v_start(k0, b):
        """First V^T column of sequence ``b`` whose keys start at token ``k0`` (FP8 varlen):
        k0 rounded up to VARLEN_V_ALIGN, plus VARLEN_V_GAP * b. Plain integer arithmetic, so
        that the kernel (Int32), the host (torch int64 tensors) and tests (ints) share it; the
        host reads it here because the runtime layer does not import the kernel library."""
        return (k0 + (VARLEN_V_ALIGN - 1)) // VARLEN_V_ALIGN * VARLEN_V_ALIGN + VARLEN_V_GAP * b

    def __post_init__(self):
        if self.p_mode not in P_MODES:
            raise ValueError(f"{self.kernel_name}: p_mode must be one of {P_MODES}, got {self.p_mode!r}")
        if self.in_fp8 != (self.p_mode != "bf16"):
            raise ValueError(f"{self.kernel_name}: p_mode {self.p_mode!r} with in_fp8={self.in_fp8}")
        if self.l_from_mma and self.p_mode != "fp8_directp":
            raise ValueError(f"{self.kernel_name}: l_from_mma needs p_mode 'fp8_directp'")
        if self.in_fp8 and self.quant_block != self.tile_n:
            # the kernel reads one K scale per key tile (ForwardKernel.tile_mult)
            raise ValueError(f"{self.kernel_name}: FP8 scale blocks ({self.quant_block}) must be key tiles "
                             f"({self.tile_n})")
        check_window_softcap(self.kernel_name, self.causal, self.window, self.softcap)

    @property
    def extended(self) -> bool:
        """Whether the kernel takes the extended operands (sinks, cu_seqlens): ``ExtForwardKernel``."""
        return self.sinks or self.varlen

    @property
    def softcap_log2(self) -> float:
        """The softcap in the kernel's log2 units (x = s * softmax_scale * log2 e):
        c tanh(s / c) log2 e = c2 tanh(x / c2) with c2 = c log2 e, as the reference's ``cap2``."""
        from fp4gen.numerics.directp import LOG2E

        return self.softcap * LOG2E

    @property
    def softmax_mode(self) -> str:
        """The mode of fp4gen.device.softmax.tile."""
        return "fp8_directp_l_mma" if self.l_from_mma else self.p_mode

    @property
    def in_dtype(self):
        """The CuTe DSL element type of Q, K, V."""
        import cutlass

        return cutlass.Float8E4M3FN if self.in_fp8 else cutlass.BFloat16

    @property
    def num_mma_threads(self) -> int:
        return WARPGROUP_THREADS * self.consumer_wgs

    @property
    def num_threads(self) -> int:
        return WARPGROUP_THREADS * (self.consumer_wgs + 1)

    @property
    def l_scale_log2(self) -> int:
        """log2 of the fixed scale l is kept at: FP8 P is stored as P_FP8_SCALE * P (2^8)."""
        if not self.in_fp8:
            return 0
        from fp4gen.numerics.directp import P_FP8_SCALE

        return int(math.log2(P_FP8_SCALE))
