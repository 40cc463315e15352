"""cost_model: predicted cycles per KV tile per SM, per unit, for the exp path and Direct-P.

A KV tile here is one tile_n-key step of the whole CTA: all query stages (sm100a) or
all consumer warpgroups (sm90a), i.e. ``rows = q_stages * tile_m`` (sm100a) or
``tile_m`` (sm90a) query rows times ``tile_n`` keys. Units are assumed to overlap
perfectly (``cycles_per_tile`` = the slowest unit, the bottleneck) or not at all
(``serial_cycles``). Every rate is listed in ``ASSUMPTIONS`` and in docs/plan.md.
"""
from __future__ import annotations

from dataclasses import replace

from ..plan import CostModel, KernelPlan, PathCost, UnitCost
from ..spec import Format, PKind, Target

MUFU_PER_CLK = 16  # MUFU.EX2 results per clock per SM (4 per sub-partition)
FMA_PER_CLK = 128  # fp32 FFMA/FADD/FMNMX per clock per SM (FFMA2 on sm100 could double it; not counted)
ALU_PER_CLK = 64  # integer/logic (PRMT, shifts) per clock per SM
CVT_PER_CLK = 16  # F2F/F2I/I2F and packed cvt (e.g. cvt.rn.satfinite.e4m3x2.f32) instructions per clock per SM
SMEM_BYTES_PER_CLK = 128  # shared-memory bandwidth per SM
TMEM_BYTES_PER_CLK = 512  # tcgen05.ld/st per SM (assumed: 4 sub-partitions x 32 lanes x 4 B)
L2_BYTES_PER_CLK = 64  # TMA fill rate per SM from L2 (K/V tiles are shared by many CTAs)
CP_SF_CYCLES = 32  # one tcgen05.cp of a few scale-factor atoms

ASSUMPTIONS = (
    "tensor-core dense rates per SM per clock (2 FLOP per MAC): sm90a bf16/fp16 4096, fp8 8192 "
    "(989 TFLOP/s BF16 / 132 SMs / 1.83 GHz; i.e. 1024 per tensor core, 4 per SM); "
    "sm100a bf16 8192, fp8 and mixed mxf8f6f4 16384, fp4 (mxf4nvf4) 32768 (4x bf16)",
    f"MUFU.EX2 {MUFU_PER_CLK}/clk/SM; FP32 FMA/FADD/FMNMX {FMA_PER_CLK}/clk/SM (FFMA2 not counted); "
    f"integer/PRMT {ALU_PER_CLK}/clk/SM",
    f"conversions (F2I/I2F, cvt fp32->e4m3x2 / e2m1x2 / bf16x2, 2 values each) {CVT_PER_CLK} instr/clk/SM "
    "(a lead from the brief, to be checked in SASS)",
    f"shared memory {SMEM_BYTES_PER_CLK} B/clk/SM read by the MMAs (operands re-read per stage/warpgroup)",
    f"TMEM ld/st {TMEM_BYTES_PER_CLK} B/clk/SM (assumed); S loaded once, P stored once, O loaded+stored "
    "once per tile by the correction warps (worst case: the row max moved in every tile)",
    f"TMA fill {L2_BYTES_PER_CLK} B/clk/SM from L2 (K/V reused across CTAs); HBM not modelled",
    "exp path per score: 1 EX2, 3 FP32 ops (scale-subtract FFMA, row-sum FADD, max FMNMX), 1/2 cvt; "
    "block-scaled fp4 P adds 2 FP32 ops (block max, scale multiply); two-level adds 3",
    "Direct-P fast per score: 6 FP32 ops (affine x, classifier FFMA, 2 clamps, magic-number round, "
    "normaliser from the code), +1 block max for MX P; 1/4 PRMT to pack; no EX2, no cvt",
    "Direct-P accurate: fast path + 1 EX2 per 2 scores (the part computed with hardware EX2; a guess)",
)


def _bits(f: Format) -> int:
    return f.bits


def _path(name: str, units: list[UnitCost]) -> PathCost:
    top = max(u.cycles for u in units)
    # units within 2% of the slowest share the bottleneck ("mma+mufu")
    names = "+".join(u.unit for u in units if u.cycles >= 0.98 * top)
    return PathCost(name, tuple(units), names, top, sum(u.cycles for u in units))


def _softmax_units(kind: str, elems: int, p: Format, block_scaled_p: bool) -> dict[str, tuple[float, str]]:
    """cycles of mufu/fma/alu/cvt for producing P from ``elems`` scores."""
    if kind == "exp" or kind == "two_level":
        fma = 3 + (2 if (p.is_fp4 and block_scaled_p) else 0) + (3 if kind == "two_level" else 0)
        cvt = 0.0 if p is Format.FP32 else 0.5
        return {"mufu": (elems / MUFU_PER_CLK, f"{elems} EX2"),
                "fma": (elems * fma / FMA_PER_CLK, f"{fma} ops x {elems} scores"),
                "cvt": (elems * cvt / CVT_PER_CLK, f"{cvt} cvt x {elems} scores"),
                "alu": (0.0, "-")}
    fma = 6 + (1 if p.is_fp4 else 0)
    mufu = 0.5 if kind == "direct_p_accurate" else 0.0
    return {"mufu": (elems * mufu / MUFU_PER_CLK, f"{mufu} EX2 x {elems} scores"),
            "fma": (elems * fma / FMA_PER_CLK, f"{fma} ops x {elems} scores"),
            "cvt": (0.0, "codes from float arithmetic, no cvt"),
            "alu": (elems * 0.25 / ALU_PER_CLK, f"1/4 PRMT x {elems} scores")}


def cost_model(plan: KernelPlan) -> KernelPlan:
    spec = plan.spec
    t = spec.target
    if t is Target.REFERENCE:
        return plan
    s, d = spec.schedule, spec.head_dim
    n = s.tile_n
    stages = s.q_stages if t is Target.SM100A else plan.sm90.consumer_warpgroups
    rows = stages * s.tile_m if t is Target.SM100A else s.tile_m
    elems = rows * n
    qk, pv = plan.mma_choice("QK"), plan.mma_choice("PV")
    qk_cyc = 2 * rows * n * d / qk.flops_per_clk_sm
    pv_cyc = 2 * rows * n * d / pv.flops_per_clk_sm
    mma = UnitCost("mma", qk_cyc + pv_cyc, f"QK {qk.kind} {qk_cyc:.0f} + PV {pv.kind} {pv_cyc:.0f}")
    qb, kb, vb, pb = (spec.q.format.bits, spec.k.format.bits, spec.v.format.bits, spec.p.format.bits)
    if t is Target.SM100A:
        smem_bytes = stages * (s.tile_m * d * qb + n * d * kb + n * d * vb) // 8
        tmem_bytes = elems * 4 + elems * pb // 8 + rows * d * 4 * 2
        tmem = UnitCost("tmem", tmem_bytes / TMEM_BYTES_PER_CLK,
                        f"{tmem_bytes} B (S ld {elems * 4}, P st {elems * pb // 8}, O ld+st {rows * d * 8})")
    else:
        wg_rows = 64
        smem_bytes = stages * (wg_rows * d * qb + n * d * kb + n * d * vb) // 8
        tmem = None
    smem = UnitCost("smem", smem_bytes / SMEM_BYTES_PER_CLK, f"{smem_bytes} B of MMA operands")

    chosen = {PKind.EXP: "exp", PKind.TWO_LEVEL: "two_level",
              PKind.DIRECT_P: "direct_p_" + spec.p_production.policy.value}[spec.p_production.kind]
    names = ["exp"]
    if (t is Target.SM100A and spec.p.format is Format.MXFP4) or (t is Target.SM90A and spec.p.format.is_fp8):
        names += ["direct_p_fast", "direct_p_accurate"]
    if chosen not in names:
        names.append(chosen)
    paths = []
    per_path_sm = {}
    for name in names:
        sm = _softmax_units(name, elems, spec.p.format, pv.block_scaled)
        per_path_sm[name] = sm
        units = [mma] + [UnitCost(u, c, det) for u, (c, det) in sm.items()] + [smem] + ([tmem] if tmem else [])
        paths.append(_path(name, units))

    sm = per_path_sm[chosen]
    softmax_stage = max(c for c, _ in sm.values()) / stages
    ev = {
        "qk": qk_cyc / stages, "pv": pv_cyc / stages, "pv_half": pv_cyc / stages / 2,
        "rowmax": elems / stages / FMA_PER_CLK,
        "softmax": softmax_stage,
        "load_k": n * d * kb / 8 / L2_BYTES_PER_CLK, "load_v": n * d * vb / 8 / L2_BYTES_PER_CLK,
        "cp_sf": CP_SF_CYCLES,
        "epilogue": s.tile_m * d * spec.o.format.bits / 8 / L2_BYTES_PER_CLK,
    }
    if t is Target.SM100A:
        ev.update({
            "load_s": s.tile_m * n * 4 / TMEM_BYTES_PER_CLK,
            "publish": s.tile_m * n * pb / 8 / TMEM_BYTES_PER_CLK + 16,
            "publish_half": s.tile_m * n * pb / 16 / TMEM_BYTES_PER_CLK + 16,
            "rescale": s.tile_m * d * 8 / TMEM_BYTES_PER_CLK,
        })
    else:
        ev["rescale"] = 64 * d / FMA_PER_CLK
    cm = CostModel(t.value, chosen, tuple(paths), tuple(sorted((k, round(v, 1)) for k, v in ev.items())), ASSUMPTIONS)
    return replace(plan, cost=cm)
