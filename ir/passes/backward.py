"""plan_backward: the Hopper (sm90a) causal backward's tiles, budgets and reused state.

FA2/FA3 order: one CTA owns ``tile_n`` keys of one (batch, head) and keeps dK, dV in
registers while it walks the query tiles that can see those keys (causal: from the
first query tile touching the diagonal to the end). Per query tile it recomputes the
scores from the forward's Q/K and the stored LSE, then runs five MMAs::

    S^T  = K Q^T            (keys x queries; scores as rows = keys, so P^T is
    dP^T = V dO^T            already in the register order of the next A operand)
    dV  += P^T dO            A = P^T from registers
    dK  += dS^T Q            A = dS^T from registers
    dQ   = dS K              A = dS from SMEM (dS^T written, read MN-major; FP8 dS: dS
                             written transposed, read K-major); the fp32
                             tile is staged in SMEM and a dQ warp adds it into a global
                             accumulator with bulk reduces (cp.reduce.async.bulk, whole
                             rows), while the MMA warps run dK; when the spec asks for
                             ``deterministic`` the key tiles take turns (a per-query-tile
                             counter), so every element sees its adds in ascending
                             key-tile order.

With ``dS : fp8e4m3`` (``_ds_format``) dK and dQ are FP8 wgmmas too: dS is rounded to e4m3
with one power-of-two scale per 64 x 128 tile (Q's block scale folded in), handed from one
query tile to the next and taken from the tile's max only when the guess would overflow
(numerics: ``fp8_ds_tile_scale``), and their B operands are transposed (K-major) FP8 copies
of the forward's Q and K payloads; the bf16 Q/K tiles are gone.

Preprocessing (D_i = rowsum(dO * O), LSE in log2 units, padding) and postprocessing
(dQ scale and cast, the GQA sum of dK/dV) are host-side torch ops in this first version.

``plan_backward(plan) -> BackwardPlan``: pure; refuses what the sm90 backward cannot
run with ``PlanError`` at the spec line at fault.
"""
from __future__ import annotations

from dataclasses import dataclass

from fp4gen.numerics.backward_rules import BWD_TILE_M, BWD_TILE_N  # the oracle's too (its FP8 dS tile)

from ..plan import REGISTERS_PER_SM, SMEM_LIMIT_BYTES, KernelPlan, PlanError, SmemItem
from ..spec import Format, Mask, ScaleGranularity, Target

BWD_MMA_WARPGROUPS = 2
BWD_Q_STAGES = 2  # Q/dO ring
BWD_DS_STAGES = 2  # dS in SMEM, double-buffered so one barrier per query tile suffices
# Registers: the CTA starts with what the launch gave every thread (65536 / 384 threads,
# rounded down to 8: 168) and setmaxnreg only moves them between warpgroups: an increase
# the decreases did not pay for waits forever (a hang, seen on the H200 with a 56 + 2 x 224
# split). So producer + 2 x MMA warpgroup <= 3 x 168 = 504 per thread slot: 24 + 2 x 240.
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240
MBARRIER_BYTES = 8
# what the host launches around the backward kernel (both targets; the plan's dump says it)
DKV_OUTPUT = "bf16 (dK scaled) when H == Hkv; GQA: fp32 per query head, host sums groups"
PREPROCESS = "host: D_i = rowsum(dO * O) fp32, LSE * log2(e) (-inf -> +inf), padded to tile_m"
POSTPROCESS = "host: dQ = scale * dQ_accum, cast to bf16"


@dataclass(frozen=True)
class BwdMma:
    """One backward matrix product and how the wgmma reads its operands."""

    name: str  # S, dP, dV, dK, dQ
    formula: str
    a_source: str  # smem | registers
    a_major: str  # K | MN
    b_major: str
    operand_format: str  # element format of A and B (bf16, fp8e4m3, ...)
    warpgroup_split: str  # how the two MMA warpgroups divide the product


@dataclass(frozen=True)
class BackwardPlan:
    """Every decision of the sm90a backward, for the lowering and the dumps."""

    head_dim: int
    causal: bool
    tile_m: int  # query rows per inner step
    tile_n: int  # keys per CTA
    mma_warpgroups: int
    producer_warps: int  # active warps of the producer warpgroup (TMA loads, dQ bulk adds)
    threads: int
    q_stages: int  # Q/dO ring depth
    ds_stages: int
    reuse: tuple[str, ...]  # forward state the backward reads (q k lse scales)
    grad_formats: tuple[tuple[str, str], ...]  # (operand, format) for dO dP dS dQ dK dV
    mma_format: str  # operand formats of the five MMAs, '+'-joined (bf16, bf16+fp8e4m3)
    mmas: tuple[BwdMma, ...]
    deterministic: bool
    dq_reduction: str  # bulk_reduce_fp32 | ordered_bulk_reduce_fp32
    dkv_output: str  # what the kernel writes for dK/dV
    preprocess: str
    postprocess: str
    smem: tuple[SmemItem, ...]
    smem_bytes: int
    smem_limit: int
    producer_registers: int
    consumer_registers: int
    registers_total: int
    notes: tuple[str, ...] = ()

    def grad_format(self, name: str) -> str:
        return dict(self.grad_formats)[name]

    def mma_format_of(self, name: str) -> str:
        """Operand format of one of the five MMAs (S, dP, dV, dK, dQ)."""
        return {m.name: m.operand_format for m in self.mmas}[name]

    @property
    def ds_fp8(self) -> bool:
        """dK += dS^T Q and dQ = dS K in FP8 (``dS : fp8e4m3``): dS rounded to e4m3 with one
        scale per tile, B = the forward's transposed FP8 Q/K copies. Read off the MMA
        table (not a field of its own, so the dumps of the other plans keep their keys)."""
        return self.mma_format_of("dQ") != "bf16"


def _elt_bytes(fmt: str) -> int:
    return 1 if fmt.startswith("fp8") else 2


def _score_format(spec, bw) -> str:
    """Operand format of S^T = K Q^T: the forward's Q/K when the spec reuses them, else bf16."""
    reused = [x for x in ("q", "k") if x in bw.reuse]
    fmts = {spec.q.format if "q" in reused else Format.BF16, spec.k.format if "k" in reused else Format.BF16}
    if fmts == {Format.BF16}:
        return "bf16"
    where = spec.loc("backward.reuse") or spec.loc("Q")
    if len(reused) != 2:
        raise PlanError(f"reuse both q and k or neither: S = Q K^T cannot mix a reused {'/'.join(sorted(fmts))} "
                        "operand with a bf16 one in one wgmma", where)
    for name, op in (("Q", spec.q), ("K", spec.k)):
        if op.format is not Format.FP8E4M3:
            raise PlanError(f"the sm90a backward can reuse fp8e4m3 or bf16 Q/K, not {name} : {op}", where,
                            notes=("drop q k from `reuse` to recompute S from bf16 Q/K",))
        if op.granularity is not ScaleGranularity.BLOCK or op.block != BWD_TILE_N:
            raise PlanError(f"reused {name} must be fp8e4m3(block={BWD_TILE_N}) (one scale per {BWD_TILE_N}-token "
                            f"block, a whole key tile of the backward), got {name} : {op}", where)
    return "fp8e4m3"


def _do_format(spec, bw) -> str:
    """Operand format of dP = dO V^T and dV = P^T dO: bf16, or FP8 dO with the forward's FP8 P and V."""
    fdo = bw.format_of("dO")
    if fdo.format is Format.BF16:
        return "bf16"
    where = spec.loc("backward.dO")
    if fdo.format is Format.FP8E5M2:
        raise PlanError("dO : fp8e5m2 is not implemented on sm90a; use fp8e4m3 (dO is scaled per (batch, head), "
                        "so E4M3's range suffices and its extra mantissa bit halves the rounding error)", where)
    if fdo.format is not Format.FP8E4M3:
        raise PlanError(f"dO must be bf16 or fp8e4m3 on sm90a, got dO : {fdo}", where)
    if fdo.granularity not in (ScaleGranularity.TENSOR, ScaleGranularity.NONE):
        raise PlanError(f"dO : {fdo}: the sm90a backward scales FP8 dO per (batch, head); write `dO : fp8e4m3`", where)
    for name, op in (("V", spec.v), ("P", spec.p)):
        if op.format is not Format.FP8E4M3:
            raise PlanError(f"dO : fp8e4m3 needs the forward's {name} in fp8e4m3 (a wgmma cannot mix FP8 and bf16: "
                            f"dP = dO V^T, dV = P^T dO), got {name} : {op.format.value}", where)
    if spec.v.granularity not in (ScaleGranularity.TENSOR, ScaleGranularity.NONE):
        raise PlanError(f"dO : fp8e4m3 needs V scaled per (batch, head) (V : fp8e4m3(scale=tensor)), got V : {spec.v}",
                        where)
    return "fp8e4m3"


def _ds_format(spec, bw, s_fmt: str, do_fmt: str) -> str:
    """Operand format of dK = dS^T Q and dQ = dS K: bf16, or FP8 dS with the forward's FP8 Q/K
    (their transposed copies) when S already reads them (``reuse q k``, fp8e4m3(block=128))
    and dO is FP8 (the FP8 dS kernel extends the FP8 dP/dV one)."""
    fds = bw.format_of("dS")
    if fds.format is Format.BF16:
        return "bf16"
    where = spec.loc("backward.dS")
    if fds.format is not Format.FP8E4M3:
        raise PlanError(f"dS : {fds} is not supported by the sm90a backward; use bf16 or fp8e4m3", where)
    if fds.granularity not in (ScaleGranularity.TENSOR, ScaleGranularity.NONE):
        raise PlanError(f"dS : {fds}: the sm90a backward scales FP8 dS itself, one power-of-two scale per "
                        f"{BWD_TILE_M} x {BWD_TILE_N} tile, picked as dS is computed (the FP8 wgmma has no "
                        "block scales); write `dS : fp8e4m3`", where)
    if s_fmt != "fp8e4m3" or do_fmt != "fp8e4m3":
        raise PlanError(f"FP8 dS needs `reuse q k` with fp8e4m3(block={BWD_TILE_N}) Q/K and dO : fp8e4m3 "
                        f"(got {'S from bf16 Q/K' if s_fmt == 'bf16' else 'FP8 S'}, dO : {do_fmt})", where,
                        notes=("dQ = dS K and dK = dS^T Q read the forward's FP8 Q/K payloads (a wgmma "
                               "cannot mix FP8 and bf16), and the FP8 dS kernel extends the FP8 dP/dV one "
                               "(dO : fp8e4m3)",))
    return "fp8e4m3"


def backward_block(plan: KernelPlan, target: Target, planner: str):
    """(spec, backward block) of ``plan``, refused with the reason when the spec has no backward
    block or targets another architecture than ``planner`` plans for."""
    spec = plan.spec
    if spec.backward is None:
        raise PlanError(f"kernel {spec.name!r} has no backward block", spec.loc("backward"))
    if spec.target is not target:
        raise PlanError(f"{planner} plans the {target.value} backward; kernel {spec.name!r} targets "
                        f"{spec.target.value}", spec.loc("target"))
    return spec, spec.backward


def plan_backward(plan: KernelPlan) -> BackwardPlan:
    """The backward plan of a finished forward ``plan`` whose spec has a ``backward`` block."""
    spec, bw = backward_block(plan, Target.SM90A, "plan_backward")
    d = spec.head_dim
    if d not in (64, 128):
        raise PlanError(f"the sm90a backward supports head_dim 64 and 128, not {d}", spec.loc("head_dim"),
                        notes=("dK and dV stay in registers: 2 x head_dim/2 fp32 per thread",))
    reuse = tuple(sorted(bw.reuse))
    s_fmt = _score_format(spec, bw)
    grads = tuple((n, bw.format_of(n).format.value) for n in ("dO", "dP", "dS", "dQ", "dK", "dV"))
    do_fmt = _do_format(spec, bw)
    ds_fmt = _ds_format(spec, bw, s_fmt, do_fmt)
    if bw.format_of("dP").format.is_fp8:
        raise PlanError(f"FP8 dP on sm90a is not implemented (dP : {bw.format_of('dP')}): dP never feeds an MMA "
                        "(it stays fp32 in registers), so rounding it to FP8 would only lose accuracy; "
                        "leave dP out (bf16)", spec.loc("backward.dP"))
    for n in ("dQ", "dK", "dV", "dP"):
        f = bw.format_of(n).format
        if f is not Format.BF16:
            raise PlanError(f"gradient {n} : {f.value} is not supported by the sm90a backward (bf16)",
                            spec.loc(f"backward.{n}"))
    ds8 = ds_fmt != "bf16"
    m, n_ = BWD_TILE_M, BWD_TILE_N
    # FP8 wgmma operands are K-major: dS written transposed, and the Q^T / K^T FP8 copies;
    # bf16 reads dS^T, Q and K as they are (MN-major)
    ds_major = "K" if ds8 else "MN"
    mmas = (
        BwdMma("S", "S^T = K Q^T", "smem", "K", "K", s_fmt, "keys: 64 per warpgroup"),
        BwdMma("dP", "dP^T = V dO^T", "smem", "K", "K", do_fmt, "keys: 64 per warpgroup"),
        BwdMma("dV", "dV += P^T dO", "registers", "K", "K" if do_fmt != "bf16" else "MN", do_fmt,
               "keys: 64 per warpgroup"),
        BwdMma("dK", "dK += dS^T Q", "registers", "K", ds_major, ds_fmt, "keys: 64 per warpgroup"),
        BwdMma("dQ", "dQ = dS K", "smem", ds_major, ds_major, ds_fmt, f"head dim: {d // 2} columns per warpgroup"),
    )
    eb = _elt_bytes(ds_fmt)
    ob = _elt_bytes(do_fmt)
    qs = BWD_Q_STAGES
    smem = []
    if not ds8:  # bf16 Q/K for dQ and dK (FP8 dS reads the transposed FP8 copies instead)
        smem.append(SmemItem("K", n_ * d * eb, f"{n_} keys x {d} bf16, loaded once per CTA; read MN-major by dQ"
                             + ("" if s_fmt != "bf16" else " and K-major by S")))
    smem.append(SmemItem("V", n_ * d * ob, f"{n_} keys x {d} {do_fmt}, loaded once per CTA (dP)"))
    if not ds8:
        smem.append(SmemItem("Q", qs * m * d * eb, f"{qs} stages x {m} x {d} bf16; MN-major (dK)"
                             + ("" if s_fmt != "bf16" else ", K-major (S)")))
    smem.append(SmemItem("dO", qs * m * d * ob, f"{qs} stages x {m} x {d} {do_fmt}; K-major (dP)"
                         + (", MN-major (dV)" if do_fmt == "bf16" else "")))
    if s_fmt != "bf16":
        smem += [SmemItem("K8", n_ * d, f"{n_} keys x {d} {s_fmt}: the forward's payload, K-major (S)"),
                 SmemItem("Q8", qs * m * d, f"{qs} stages x {m} x {d} {s_fmt}: the forward's payload, K-major (S)")]
    if do_fmt != "bf16":
        smem += [SmemItem("dO^T", qs * d * m, f"{qs} stages x {d} x {m} {do_fmt}, queries contiguous (dV, K-major)")]
    if ds8:
        smem += [SmemItem("K^T8", d * n_, f"{d} x {n_} {ds_fmt} (K^T, keys contiguous, interleaved per 16: key r+8 "
                          "after key r): the forward quantizer's transposed copy, loaded once per CTA (dQ, K-major)"),
                 SmemItem("Q^T8", qs * d * m, f"{qs} stages x {d} x {m} {ds_fmt} (Q^T, queries contiguous, "
                          "permuted per 32 like dO^T): the forward quantizer's transposed copy (dK, K-major)")]
        ds_item = SmemItem("dS", BWD_DS_STAGES * m * n_ * eb,
                           f"{BWD_DS_STAGES} x {m} queries x {n_} keys {ds_fmt} (dS, stored transposed by "
                           "stmatrix.trans, keys interleaved per 16 like K^T8), K-major A operand of dQ")
    else:
        ds_item = SmemItem("dS", BWD_DS_STAGES * m * n_ * eb,
                           f"{BWD_DS_STAGES} x {n_} keys x {m} queries (dS^T), MN-major A operand of dQ")
    smem = tuple(smem) + (
        ds_item,
        SmemItem("dQ", m * d * 4,
                 f"{m} x {d} fp32 staging tile in fragment order (16-byte stores, one contiguous bulk reduce)"),
        SmemItem("LSE/D", 2 * qs * m * 4, f"{qs} stages x {m} fp32 LSE2 and D rows, bulk-copied with Q/dO"),
        SmemItem("mbarriers", (2 + 2 * BWD_Q_STAGES) * MBARRIER_BYTES, "K/V full+empty, Q/dO ring"),
    )
    total = sum(i.bytes for i in smem)
    if total > SMEM_LIMIT_BYTES:  # cannot happen for d <= 128; kept as the invariant
        raise PlanError(f"backward SMEM {total} B exceeds {SMEM_LIMIT_BYTES} B", spec.loc("head_dim"))
    threads = 128 * (BWD_MMA_WARPGROUPS + 1)
    regs = 128 * PRODUCER_REGISTERS + 128 * BWD_MMA_WARPGROUPS * CONSUMER_REGISTERS
    launch_regs = REGISTERS_PER_SM // threads // 8 * 8  # what each thread starts with
    assert regs <= threads * launch_regs, (regs, threads, launch_regs)  # else setmaxnreg.inc hangs
    deterministic = bool(bw.deterministic)
    if spec.mask is Mask.WINDOW:
        left, right = spec.window_size
        mask_note = (f"window({left}, {right}): bottom-right aligned (key j visible to query i iff "
                     f"{'' if left < 0 else f'i + Sk - Sq - {left} <= '}j{'' if right < 0 else f' <= i + Sk - Sq + {right}'}); "
                     "a CTA walks only the query tiles that see one of its keys (none: it writes zero dK, dV) "
                     "and masks only tiles crossing a window edge or the sequence end")
    elif spec.mask is Mask.CAUSAL:
        mask_note = ("causal: bottom-right aligned (key j visible to query i iff j <= i + Sk - Sq); a CTA skips the "
                     "query tiles entirely above its keys, masks only tiles crossing the diagonal or the sequence end")
    else:
        mask_note = "no mask: every query tile, the key tail masked"
    notes = [
        mask_note,
        "P and dS are rounded to bf16 for the MMAs; dP stays fp32 in registers"
        if do_fmt == "bf16" else
        "dV = P^T dO in FP8: P as e4m3(2^8 P) from registers (queries permuted per 32, dO^T to match), "
        "dO and V with one fp32 scale per (batch, head); "
        + ("dS in FP8 (below)" if ds8 else "dS rounded to bf16") + "; dP stays fp32 in registers",
    ]
    if spec.softcap:
        notes.append(f"softcap {spec.softcap:g}: S^T recomputed as c tanh(s / c) (tanh.approx, as the forward), "
                     "masked after the cap; dS^T = P^T (dP^T - D) (1 - tanh^2), P^T and the factor taken from the "
                     "tanh tile once dP^T is ready")
    if s_fmt != "bf16":
        notes.append("S^T recomputed from the forward's FP8 Q/K payloads and 128-token block scales "
                     "(bit-identical to the forward's P); "
                     + ("dQ/dK read the transposed FP8 copies of the same payloads" if ds8 else
                        "dQ/dK read the bf16 Q/K"))
    if ds8:
        notes += [
            "dK += dS^T Q in FP8: A = dS^T from registers (e4m3, queries permuted per 32), B = Q^T, the forward "
            "quantizer's transposed FP8 copy (K-major, queries permuted per 32 like dO^T); dQ = dS K in FP8: "
            "A = dS in SMEM (K-major, keys interleaved per 16: key r+8 after key r, written with "
            "stmatrix.trans), B = K^T, the forward quantizer's transposed FP8 copy (K-major, keys in the "
            "same order)",
            f"dS scale: one e4m3 scale per {m} x {n_} tile, a power of two c with Q's 128-token block scale "
            "folded in (dS8 = e4m3(dS s_q / c)), handed from one query tile of a key tile to the next, "
            "recomputed from the tile's max (the smallest c with 448 c >= max|dS| s_q) on the key tile's "
            "first query tile and when the guess would overflow (and then handed on times 4), and halved for "
            "the next tile when the tile uses less than a sixteenth of e4m3's range; dQ = (c s_k / s_q) dS8 K8 "
            "after its MMA, dK is kept in "
            "units of the current tile's c (dK = sum_t c_t dS8_t^T Q8_t; numerics: fp8_ds_tile_scale)",
        ]
    return BackwardPlan(
        head_dim=d,
        causal=spec.mask is Mask.CAUSAL,
        tile_m=m,
        tile_n=n_,
        mma_warpgroups=BWD_MMA_WARPGROUPS,
        producer_warps=2,
        threads=threads,
        q_stages=BWD_Q_STAGES,
        ds_stages=BWD_DS_STAGES,
        reuse=reuse,
        grad_formats=grads,
        mma_format="+".join(sorted({m_.operand_format for m_ in mmas})),
        mmas=mmas,
        deterministic=deterministic,
        dq_reduction="ordered_bulk_reduce_fp32" if deterministic else "bulk_reduce_fp32",
        dkv_output=DKV_OUTPUT,
        preprocess=PREPROCESS,
        postprocess=POSTPROCESS,
        smem=smem,
        smem_bytes=total,
        smem_limit=SMEM_LIMIT_BYTES,
        producer_registers=PRODUCER_REGISTERS,
        consumer_registers=CONSUMER_REGISTERS,
        registers_total=regs,
        notes=tuple(notes),
    )
