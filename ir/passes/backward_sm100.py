"""plan_backward_sm100: the Blackwell (sm100a) attention backward's tiles, warp roles,
TMEM map, SMEM budget and MMAs.

FA2/FA3/FA4 order, as on sm90a (``backward.py``): one CTA owns ``tile_n`` keys of one
(batch, head) and walks the query tiles that can see them. What changes on Blackwell
is where the accumulators live: every product is a ``tcgen05.mma`` issued by one
thread of one MMA warp and accumulates in tensor memory (TMEM, 128 lanes x 512
columns of 32 bits), not in registers. Per query tile of ``tile_m`` queries::

    S^T  = K Q^T     A = K (SMEM, K-major)       B = Q (SMEM, K-major)       acc S   (keys x queries)
    dP^T = V dO^T    A = V (SMEM, K-major)       B = dO (SMEM, K-major)      acc dP  (keys x queries)
    -- compute warps: P^T = exp2(S^T c - LSE2), dS^T = P^T (dP^T - D); P^T (bf16) -> TMEM
       over S^T's first columns, dS^T (bf16) -> SMEM
    dV  += P^T dO    A = P^T (TMEM)              B = dO (SMEM, MN-major)     acc dV  (keys x d)
    dK  += dS^T Q    A = dS^T (SMEM, K-major)    B = Q (SMEM, MN-major)      acc dK  (keys x d)
    dQ   = dS K      A = dS (SMEM, MN-major)     B = K (SMEM, MN-major)      acc dQ  (queries x d)
    -- dQ warps: dQ (TMEM) -> fp32 atomics into a global accumulator

The transposed operands (dO, Q, K, dS read MN-major) are the same SMEM bytes viewed
through the other MMA's layout: unlike Hopper's 16-bit wgmma-from-registers path,
tcgen05 reads 16-bit operands MN-major from SMEM, so no transposed copies are made.

TMEM ownership (lanes = the accumulator's M: keys for S/dP/dV/dK, queries for dQ)::

    S^T  [0, tile_m)                 fp32   (P^T, bf16 pairs, overwrites its first tile_m/2 columns)
    dP^T [tile_m, 2 tile_m)          fp32
    dV   next d columns              fp32   (lives across the whole query loop)
    dK   next d columns              fp32   (lives across the whole query loop)
    dQ   next d columns when they fit in 512, else over dP^T (dP^T is drained before dQ is written)

``plan_backward_sm100(plan) -> BackwardPlanSm100`` is pure; it refuses what the sm100a
backward template cannot run with ``PlanError`` at the spec line at fault, and the TMEM
budget with the columns of every accumulator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fp4gen.numerics.backward_rules import P_FP8_SCALE_LOG2

from ..plan import (REGISTERS_PER_SM, SMEM_LIMIT_BYTES, TMEM_COLUMNS, TMEM_LANES, KernelPlan, LiveInterval, PlanError, SmemItem,
                    TmemPlan, TmemRegion, WarpRole)
from ..spec import Format, Mask, ScaleGranularity, Target
from .backward import DKV_OUTPUT, POSTPROCESS, PREPROCESS, backward_block

BWD_TILE_M = 128  # queries per step: the N of S^T/dP^T and the M (TMEM lanes) of dQ
BWD_TILE_N = 128  # keys per CTA: the M (TMEM lanes) of S^T, dP^T, dV, dK
BWD_HEAD_DIMS = (64, 128)  # what the template is written and compiled for
# bytes of SMEM the allocator may lose aligning each operand buffer to 1024 B
# (swizzled tcgen05 operands) plus the mbarriers and the TMEM address slot
SMEM_ALIGN_SLACK = 1024
MBARRIER_BYTES = 8
# one kind per element format (PTX: tcgen05.mma.cta_group::1.kind::f16 covers bf16 and fp16)
MMA_KIND = {"bf16": "kind::f16", "fp8": "kind::f8f6f4"}
K_PER_INSTRUCTION = {"kind::f16": 16, "kind::f8f6f4": 32}
# FP8 dO: P^T in TMEM is E4M3 of 2^P_FP8_SCALE_LOG2 P, as in the reference

# warp roles in warp order; setmaxnreg works per warpgroup, so warps 8-11 share one budget.
# Budgets from ptxas -v on the compiled d128 kernel: the MMA warp keeps the shared-memory
# descriptors of 40 MMAs live (48 registers spilled), the compute warps 64 scores + 64 LSE/D
# values of a 32-query chunk; 216/168/112 left the fewest spills (68 bytes) of those tried.
ROLES = (
    WarpRole("compute", 4, 216, "tcgen05.ld S^T/dP^T; P^T = exp2(S^T c - LSE2) -> TMEM (bf16), "
                                 "dS^T = P^T (dP^T - D) -> SMEM (bf16); epilogue: dK (scaled), dV -> global"),
    WarpRole("dq", 4, 168, "tcgen05.ld dQ; red.global.add.v4.f32 into the fp32 dQ accumulator"),
    WarpRole("mma", 1, 112, "issues the five tcgen05.mma per query tile and their commits"),
    WarpRole("load", 1, 112, "TMA: K, V once per CTA; Q, dO per query tile"),
    WarpRole("spare", 2, 112, "idle (completes the fourth warpgroup for setmaxnreg)"),
)


@dataclass(frozen=True)
class BwdMmaSm100:
    """One backward product as a tcgen05.mma: shape, operand sources and majors, accumulator."""

    name: str  # S, dP, dV, dK, dQ
    formula: str
    kind: str  # tcgen05 kind (kind::f16 for bf16 operands)
    m: int  # accumulator lanes
    n: int  # accumulator columns
    k: int  # reduction length per query tile
    a_source: str  # smem | tmem
    a_major: str  # K | MN
    b_major: str
    operand_format: str  # bf16 | fp8 (kind::f8f6f4 takes E4M3 and E5M2 in either operand)
    accumulator: str  # TMEM region name
    accumulate: str  # zero_init (per query tile) | across_tiles
    a_format: str = ""  # element formats of A and B (bf16, fp8e4m3, fp8e5m2); "" = operand_format
    b_format: str = ""

    def formats(self) -> tuple[str, str]:
        return (self.a_format or self.operand_format, self.b_format or self.operand_format)

    @property
    def instructions(self) -> int:
        """tcgen05.mma instructions per query tile (one per K_PER_INSTRUCTION slice of k)."""
        return self.k // K_PER_INSTRUCTION[self.kind]

    @property
    def warpgroup_split(self) -> str:  # the line the shared plan dump prints for every MMA
        return f"{self.m} x {self.n} x {self.k}, {self.kind}, accumulates in TMEM {self.accumulator}"


@dataclass(frozen=True)
class BackwardPlanSm100:
    """Every decision of the sm100a backward, for the lowering, the conformance check and the dumps."""

    head_dim: int
    causal: bool
    tile_m: int  # queries per step
    tile_n: int  # keys per CTA
    q_stages: int  # Q/dO ring depth
    roles: tuple[WarpRole, ...]
    threads: int
    registers_total: int
    registers_at_launch: int  # per thread before setmaxnreg: roles above it increase, below decrease
    tmem: TmemPlan
    dq_aliases_dp: bool  # dQ's columns are dP^T's (d128): the MMA warp waits for the dQ warps' drain
    reuse: tuple[str, ...]
    grad_formats: tuple[tuple[str, str], ...]  # (operand, format) for dO dP dS dQ dK dV
    mma_format: str  # operand formats of the five MMAs, '+'-joined (bf16, bf16+fp8)
    mma_kind: str  # their tcgen05 kinds, '+'-joined (kind::f16, kind::f16+kind::f8f6f4)
    mmas: tuple[BwdMmaSm100, ...]
    deterministic: bool
    dq_reduction: str  # atomic_fp32 | ordered_atomic_fp32
    dkv_output: str
    preprocess: str
    postprocess: str
    smem: tuple[SmemItem, ...]
    smem_bytes: int
    smem_limit: int
    mbarriers: int  # mbarrier.init count of the kernel (conformance)
    origins: tuple[tuple[str, str], ...] = ()  # decision -> spec path it came from
    notes: tuple[str, ...] = ()
    spill_budget_bytes: int = 0  # the register gate's allowance (fp4gen/lowering/ptxas.py); none spill

    # the shared plan dump (ir/dump/text.py) prints these for every backward plan
    @property
    def mma_warpgroups(self) -> int:
        """sm100a issues every MMA from a single thread of one warp (no MMA warpgroups)."""
        return 0

    def grad_format(self, name: str) -> str:
        return dict(self.grad_formats)[name]

    def mma(self, name: str) -> BwdMmaSm100:
        for m in self.mmas:
            if m.name == name:
                return m
        raise KeyError(name)

    def role(self, name: str) -> WarpRole:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(name)

    def mma_instructions_per_tile(self) -> int:
        return sum(m.instructions for m in self.mmas)


def _pow2_alloc(cols: int) -> int:
    n = 32
    while n < cols:
        n *= 2
    return n


def tmem_map(d: int, tile_m: int = BWD_TILE_M, tile_n: int = BWD_TILE_N, limit: int = TMEM_COLUMNS,
             loc=None, p_bits: int = 16) -> tuple[TmemPlan, bool]:
    """The backward's TMEM regions for head_dim ``d``; (plan, dQ aliases dP^T). ``p_bits``: P^T's
    element width (16 bf16, 8 E4M3 with an FP8 dO), 32 // p_bits queries per column.

    Raises PlanError naming every accumulator's columns when they cannot fit in ``limit``."""
    if tile_n != TMEM_LANES:
        raise PlanError(f"the sm100a backward puts one key per TMEM lane: tile_n must be {TMEM_LANES}, not {tile_n}",
                        loc)
    s0, dp0, dv0 = 0, tile_m, 2 * tile_m
    dk0 = dv0 + d
    dq0 = dk0 + d
    # S^T, dP^T, dV and dK are all live at once (dV, dK across the whole loop)
    need = dq0
    if need > limit:
        raise PlanError(
            f"sm100a backward TMEM: S^T {tile_m} + dP^T {tile_m} + dV {d} + dK {d} = {need} columns "
            f"exceed the {limit} TMEM columns (head_dim {d})", loc,
            notes=("dV and dK accumulate across the whole query loop and S^T/dP^T are both live while "
                   "dS^T is formed; head_dim <= 128 fits",))
    dq_alias = dq0 + d > limit
    if dq_alias:
        if d > tile_m:
            raise PlanError(f"sm100a backward TMEM: dQ ({d} columns) fits neither after dK (ends at "
                            f"{dq0 + d} > {limit}) nor over dP^T ({tile_m} columns)", loc)
        dq0 = dp0
    tile = LiveInterval("S_DP_MMA", "DV_DK_DQ_MMA", "per_tile")
    regions = [
        TmemRegion("S", s0, s0 + tile_m - 1, 0, tile_n - 1, "fp32",
                   "S^T = K Q^T (keys x queries), read by the compute warps", None, tile),
        TmemRegion("P", s0, s0 + tile_m * p_bits // 32 - 1, 0, tile_n - 1, "bf16x2" if p_bits == 16 else "e4m3x4",
                   ("P^T in bf16 (two queries per column)" if p_bits == 16 else
                    "P^T as E4M3 of 2^8 P (four queries per column)")
                   + ", A operand of dV += P^T dO; written over S^T chunk by chunk after that chunk was loaded",
                   None,
                   LiveInterval("PUBLISH_P", "DV_MMA", "per_tile"), alias_of="S"),
        TmemRegion("dP", dp0, dp0 + tile_m - 1, 0, tile_n - 1, "fp32",
                   "dP^T = V dO^T (keys x queries), read by the compute warps", None, tile),
        TmemRegion("dV", dv0, dv0 + d - 1, 0, tile_n - 1, "fp32", "dV += P^T dO (keys x d)", None,
                   LiveInterval("first DV_MMA", "EPILOGUE", "whole_loop")),
        TmemRegion("dK", dk0, dk0 + d - 1, 0, tile_n - 1, "fp32", "dK += dS^T Q (keys x d), unscaled", None,
                   LiveInterval("first DK_MMA", "EPILOGUE", "whole_loop")),
        TmemRegion("dQ", dq0, dq0 + d - 1, 0, tile_m - 1, "fp32",
                   "dQ = dS K (queries x d), drained by the dQ warps" + (" (over dP^T)" if dq_alias else ""),
                   None, LiveInterval("DQ_MMA", "DQ_DRAINED", "per_tile"), alias_of="dP" if dq_alias else None),
    ]
    total = max(r.last_col for r in regions) + 1
    per = 32 // p_bits
    notes = [f"P^T starts at S^T's first column: P chunk c ({32 // per} columns) overwrites S^T chunk c // {per} (32 "
             "columns), which the compute thread has already loaded",
             "dQ over dP^T: the compute warps have read dP^T before they publish dS^T, and the MMA warp "
             "waits for the dQ warps' drain of the previous tile before the next dP^T" if dq_alias else
             "dQ has its own columns"]
    return TmemPlan(tuple(regions), total, _pow2_alloc(total), limit, tuple(notes)), dq_alias


def _refuse_formats(spec) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    bw = spec.backward
    reuse = tuple(sorted(bw.reuse))
    quantized = [n for n, f in (("q", spec.q.format), ("k", spec.k.format))
                 if n in bw.reuse and f is not Format.BF16]
    if quantized:
        fmts = "/".join(sorted({(spec.q if n == "q" else spec.k).format.value for n in quantized}))
        raise PlanError(
            f"the sm100a backward recomputes S^T with bf16 MMAs; reusing the forward's {fmts} "
            f"{' and '.join(x.upper() for x in quantized)} payloads (block-scaled QK^T in the backward, "
            "dequantized Q/K for dK/dQ) is not implemented",
            spec.loc("backward.reuse") or spec.loc("backward"),
            notes=("write `reuse lse` to recompute S^T from the caller's bf16 Q and K (the reference "
                   "backward then uses bf16 Q/K as well)",))
    if "lse" not in bw.reuse:
        raise PlanError("the sm100a backward recomputes P from the forward's LSE; `reuse` must name lse",
                        spec.loc("backward.reuse") or spec.loc("backward"))
    grads = tuple((n, bw.format_of(n).format.value) for n in ("dO", "dP", "dS", "dQ", "dK", "dV"))
    for n, f in grads:
        if n == "dO" and f.startswith("fp8"):
            _check_fp8_do(spec, bw)
            continue
        if f.startswith("fp8"):
            raise PlanError(
                f"FP8 {n} on sm100a is not implemented yet ({n} : {f})",
                spec.loc(f"backward.{n}") or spec.loc("backward"),
                notes=("FP8 dO is (dP^T = V dO^T and dV += P^T dO run as kind::f8f6f4); an FP8 dS needs FP8 "
                       "Q and K for dK and dQ, which NVFP4 Q/K cannot give exactly (E2M1 x E4M3 has 5 "
                       "significant bits); use bf16 dS",) if n == "dS" else ())
        ok = ("bf16", "fp32") if n == "dP" else ("bf16",)  # dP never feeds an MMA: fp32 in registers
        if f not in ok:
            raise PlanError(f"gradient {n} : {f} is not supported by the sm100a backward ({' or '.join(ok)})",
                            spec.loc(f"backward.{n}") or spec.loc("backward"))
    return reuse, grads


def _check_fp8_do(spec, bw) -> None:
    """FP8 dO (E4M3 or E5M2, one scale per (batch, head)): dP^T = V dO^T and dV += P^T dO become
    kind::f8f6f4 MMAs, which take V as the forward quantized it (E4M3, one scale per (batch,
    kv head)) and P^T as E4M3 of 2^8 P (the reference's rule: ``fp4gen.numerics.reference``)."""
    fdo = bw.format_of("dO")
    where = spec.loc("backward.dO") or spec.loc("backward")
    if fdo.granularity not in (ScaleGranularity.TENSOR, ScaleGranularity.NONE):
        raise PlanError(f"dO : {fdo}: the sm100a backward scales FP8 dO per (batch, head) (the scale folds into "
                        f"dP^T and dV after their MMAs); write `dO : {fdo.format.value}`", where)
    if spec.v.format is not Format.FP8E4M3 or spec.v.granularity not in (ScaleGranularity.TENSOR,
                                                                          ScaleGranularity.NONE):
        raise PlanError(f"FP8 dO needs the forward's V as fp8e4m3(scale=tensor) (dP^T = V dO^T is one kind::f8f6f4 "
                        f"MMA: it cannot mix FP8 with bf16 or take V's block scales), got V : {spec.v}", where)
    if spec.p.format is not Format.FP8E4M3:
        raise PlanError(f"FP8 dO needs P : fp8e4m3 in the forward (dV += P^T dO reads P^T as E4M3), "
                        f"got P : {spec.p.format.value}", where)


def plan_backward_sm100(plan: KernelPlan) -> BackwardPlanSm100:
    """The sm100a backward plan of a finished forward ``plan`` whose spec has a backward block."""
    spec, bw = backward_block(plan, Target.SM100A, "plan_backward_sm100")
    d = spec.head_dim
    m, n = BWD_TILE_M, BWD_TILE_N
    # the TMEM budget first: it is the hard limit (and names the numbers for any head_dim)
    tmem, dq_alias = tmem_map(d, m, n, loc=spec.loc("head_dim"))
    if d not in BWD_HEAD_DIMS:
        raise PlanError(f"the sm100a backward template is written for head_dim 64 and 128, not {d}",
                        spec.loc("head_dim"))
    reuse, grads = _refuse_formats(spec)
    do_fp8 = dict(grads)["dO"].startswith("fp8")
    # dP^T = V dO^T and dV += P^T dO take dO's format; S^T, dK and dQ stay bf16
    dfmt = "fp8" if do_fp8 else "bf16"
    if do_fp8:  # P^T is E4M3 in TMEM: half the columns of bf16 P^T
        tmem, dq_alias = tmem_map(d, m, n, loc=spec.loc("head_dim"), p_bits=8)
    kind, dkind = MMA_KIND["bf16"], MMA_KIND[dfmt]
    # with an FP8 dO: V (the forward's payload) and P^T are E4M3, dO the spec's FP8 type
    v_f, p_f, do_f = ("fp8e4m3", "fp8e4m3", dict(grads)["dO"]) if do_fp8 else ("bf16",) * 3
    mmas = (
        BwdMmaSm100("S", "S^T = K Q^T", kind, n, m, d, "smem", "K", "K", "bf16", "S", "zero_init"),
        BwdMmaSm100("dP", "dP^T = V dO^T", dkind, n, m, d, "smem", "K", "K", dfmt, "dP", "zero_init", v_f, do_f),
        BwdMmaSm100("dV", "dV += P^T dO", dkind, n, d, m, "tmem", "K", "MN", dfmt, "dV", "across_tiles", p_f, do_f),
        BwdMmaSm100("dK", "dK += dS^T Q", kind, n, d, m, "smem", "K", "MN", "bf16", "dK", "across_tiles"),
        BwdMmaSm100("dQ", "dQ = dS K", kind, m, d, n, "smem", "MN", "MN", "bf16", "dQ", "zero_init"),
    )
    mfmt = "bf16+fp8" if do_fp8 else "bf16"

    eb = 2  # bf16
    vb = 1 if do_fp8 else 2  # V and dO: E4M3/E5M2 payloads with an FP8 dO
    fixed = [
        SmemItem("K", n * d * eb, f"{n} keys x {d}; A of S^T (K-major) and, viewed MN-major, B of dQ"),
        SmemItem("V", n * d * vb, f"{n} keys x {d}; A of dP^T"),
        SmemItem("dS", n * m * eb, f"dS^T {n} keys x {m} queries bf16; A of dK (K-major) and of dQ (MN-major)"),
    ]

    def ring(stages):
        return [SmemItem("Q", stages * m * d * eb, f"{stages} x {m} x {d}; B of S^T (K-major) and of dK (MN-major)"),
                SmemItem("dO", stages * m * d * vb, f"{stages} x {m} x {d}; B of dP^T (K-major) and of dV (MN-major)")]

    def barriers(stages):
        # K/V once, the Q/dO ring, S+dP ready, P+dS published, dQ ready, dK/dV final: full + empty each
        return 2 + 2 * stages + 2 + 2 + 2 + 2

    def misc(stages):
        return SmemItem("barriers+align", barriers(stages) * MBARRIER_BYTES + 8 + SMEM_ALIGN_SLACK,
                        f"{barriers(stages)} mbarriers, the TMEM address slot, 1024-byte operand alignment")

    q_stages = 2
    smem = tuple(fixed + ring(2) + [misc(2)])
    if sum(i.bytes for i in smem) > SMEM_LIMIT_BYTES:
        q_stages = 1  # a single Q/dO buffer: the load of tile i+1 waits for tile i's last MMA
        smem = tuple(fixed + ring(1) + [misc(1)])
    total = sum(i.bytes for i in smem)
    if total > SMEM_LIMIT_BYTES:
        raise PlanError(f"sm100a backward SMEM {total} B exceeds {SMEM_LIMIT_BYTES} B even with one Q/dO stage: "
                        + ", ".join(f"{i.name} {i.bytes}" for i in smem), spec.loc("head_dim"))

    threads = 32 * sum(r.warps for r in ROLES)
    regs = sum(r.warps * 32 * r.registers for r in ROLES)
    # every warp starts with the launch's even share; setmaxnreg.inc can only take what the
    # decreasing warpgroups gave back
    launch = (REGISTERS_PER_SM // threads) // 8 * 8
    if regs > launch * threads:
        raise PlanError(f"sm100a backward registers: {regs} > {launch * threads} ({threads} threads x {launch} at "
                        "launch, the pool setmaxnreg redistributes) (" + ", ".join(
            f"{r.name} {r.warps} warps x {r.registers}" for r in ROLES) + ")", spec.loc("backward"))
    deterministic = bool(bw.deterministic)
    origins = (("causal", "mask"), ("reuse", "backward.reuse"), ("deterministic", "backward.deterministic"),
               ("grad formats", "backward"), ("head_dim", "head_dim"))
    notes = [
        "causal: bottom-right aligned (key j visible to query i iff j <= i + Sk - Sq); a CTA skips the query "
        "tiles entirely above its keys and masks per element" if spec.mask is Mask.CAUSAL else
        "no mask: every query tile; keys past Sk masked",
        "S^T is recomputed from the caller's bf16 Q and K" + (
            "; V is quantized as the forward does (E4M3, one scale per (batch, kv head)) and dO to "
            f"{dict(grads)['dO']} with one scale per (batch, head): dP^T and dV are kind::f8f6f4 MMAs, their "
            "scales applied to dP^T in registers and to dV in the epilogue" if do_fp8 else
            " (V is never reused: dP^T = V dO^T needs bf16 V)"),
        ("P^T is E4M3 of 2^8 P for dV" if do_fp8 else "P^T is rounded to bf16 for dV")
        + "; dS^T to bf16 for dK and dQ; dP^T stays fp32 (TMEM, then registers)",
        "LSE2 and D are read from global memory by the compute threads (32 queries per 16-byte-load batch)",
        f"Q/dO ring of {q_stages} stage(s): {total} of {SMEM_LIMIT_BYTES} bytes of SMEM",
    ]
    return BackwardPlanSm100(
        head_dim=d,
        causal=spec.mask is Mask.CAUSAL,
        tile_m=m,
        tile_n=n,
        q_stages=q_stages,
        roles=ROLES,
        threads=threads,
        registers_total=regs,
        registers_at_launch=launch,
        tmem=tmem,
        dq_aliases_dp=dq_alias,
        reuse=reuse,
        grad_formats=grads,
        mma_format=mfmt,
        mma_kind="+".join(sorted({m.kind for m in mmas})),
        mmas=mmas,
        deterministic=deterministic,
        dq_reduction="ordered_atomic_fp32" if deterministic else "atomic_fp32",
        dkv_output=DKV_OUTPUT,
        preprocess=PREPROCESS,
        postprocess=POSTPROCESS,
        smem=smem,
        smem_bytes=total,
        smem_limit=SMEM_LIMIT_BYTES,
        mbarriers=barriers(q_stages),
        origins=origins,
        notes=tuple(notes),
    )


def backward_plan_sm100_or_none(plan: KernelPlan) -> Optional[BackwardPlanSm100]:
    """``plan_backward_sm100`` for sm100a plans with a backward block the template implements; None
    otherwise (the refusal is then reported by the lowering, see ``fp4gen.lowering.sm100``)."""
    if plan.spec.backward is None or plan.spec.target is not Target.SM100A:
        return None
    try:
        return plan_backward_sm100(plan)
    except PlanError:
        return None
