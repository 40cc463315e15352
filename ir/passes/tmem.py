"""plan_tmem (sm100a): which TMEM columns hold what, and when.

Layout for q_stages query stages, tile_n keys, head_dim d (FA4's D128 layout when
q_stages=2, tile_n=d=128):

    S0 | S1 | O0 | O1        S_s: fp32 scores, tile_n columns; O_s: fp32 accumulator, d columns

Inside each S_s, after the softmax warps have drained the scores into registers:

    [0, ..)         SFQ/SFK of the *other* stage's next QK^T (block-scaled QK only)
    [n/2, ..)       P_s: E2M1 codes (n*4/32 columns), fp8 (n*8/32) or bf16 (n*16/32);
                    absent with `p_source smem` (P is then an SMEM tile, pipeline.py)
    after P_s       SFP_s: P's block scales (block-scaled PV only)
    after SFP_s     SFV_s: V's block scales for this stage's PV (block-scaled PV only)

Why the QK^T scale factors live in the other stage's S: a block-scaled tcgen05.mma
reads its A/B scale factors from TMEM while it writes the accumulator. QK^T of stage
s overwrites all of S_s, the O regions hold live accumulators, and S0..O1 already
take all 512 columns at D128. The only columns free while QK^T(s) runs are the
drained score columns of the other stage; the plan copies (tcgen05.cp) Q's and K's
scales there after that stage's softmax has loaded its scores ("S drained"), and
the in-order tensor pipe consumes them before that stage's own next QK^T.
With one query stage there is no other S, so the QK^T scales get their own columns.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..plan import TMEM_COLUMNS, TMEM_LANES, KernelPlan, LiveInterval, PlanError, TmemPlan, TmemRegion
from ..spec import Target
from .contracts import SF_ATOM_COLS, sf_atoms


def _pow2_alloc(cols: int) -> int:
    n = 32
    while n < cols:
        n *= 2
    return n


def ev(name: str, stage: Optional[int]) -> str:
    """Event id as used in live intervals and the events section: ``QK[0]``."""
    return f"{name}[{stage}]" if stage is not None else name


def plan_tmem(plan: KernelPlan) -> KernelPlan:
    spec = plan.spec
    if spec.target is not Target.SM100A:
        return plan
    sch = spec.schedule
    q, n, d = sch.q_stages, sch.tile_n, spec.head_dim
    qk, pv = plan.mma_choice("QK"), plan.mma_choice("PV")
    halves = sch.p_publish.value == "halves"
    last_pv = "PV_2" if halves else "PV"
    first_pub = "PUBLISH_P1" if halves else "PUBLISH_P"

    # --- the top-level regions and the 512-column limit
    need = q * (n + d)
    if need > TMEM_COLUMNS:
        parts = " + ".join([f"S{s} {n}" for s in range(q)] + [f"O{s} {d}" for s in range(q)])
        notes = [f"each query stage needs {n} score columns (tile_n) and {d} accumulator columns (head_dim)"]
        if q == 2 and n + d <= TMEM_COLUMNS:
            notes.append(f"q_stages 1 needs {n + d} columns")
        if n > 64:
            smaller = q * (64 + d)
            if smaller <= TMEM_COLUMNS:
                notes.append(f"tile {sch.tile_m} x 64 needs {smaller} columns")
        loc = spec.loc("head_dim") if d > 128 else (spec.loc("schedule.tile") or spec.loc("schedule"))
        raise PlanError(f"TMEM plan needs {need} columns ({parts}) but sm100a has {TMEM_COLUMNS} per SM", loc, notes)

    s_base = {s: s * n for s in range(q)}
    o_base = {s: q * n + s * d for s in range(q)}
    explicit = {r.name: r for r in (sch.tmem_regions or ())}
    known: list[str] = []

    def place(name: str, default_first: int, width: int) -> tuple[int, int, bool]:
        known.append(name)
        r = explicit.get(name)
        if r is None:
            return default_first, default_first + width - 1, False
        loc = spec.loc(f"schedule.tmem.{name}") or spec.loc("schedule.tmem")
        if r.last_col >= TMEM_COLUMNS:
            raise PlanError(f"TMEM region {name} cols {r.first_col}..{r.last_col} is past column {TMEM_COLUMNS - 1}",
                            loc, [f"sm100a TMEM has {TMEM_COLUMNS} columns of 32 bits per lane"])
        got = r.last_col - r.first_col + 1
        if got < width:
            raise PlanError(f"TMEM region {name} cols {r.first_col}..{r.last_col} has {got} columns but needs {width}",
                            loc, [f"{name} needs {width} columns for this spec"])
        return r.first_col, r.last_col, True

    regions: list[TmemRegion] = []
    lanes = (0, TMEM_LANES - 1)
    for s in range(q):
        a, b, x = place(f"S{s}", s_base[s], n)
        s_base[s] = a
        regions.append(TmemRegion(f"S{s}", a, b, *lanes, "fp32", f"scores of query stage {s} (QK^T accumulator)", s,
                                  LiveInterval(ev("QK", s), ev("LOAD_S", s)), None, x))
    for s in range(q):
        a, b, x = place(f"O{s}", o_base[s], d)
        regions.append(TmemRegion(f"O{s}", a, b, *lanes, "fp32", f"output accumulator of query stage {s}", s,
                                  LiveInterval(ev("PV_1" if halves else "PV", s) + " of the first tile",
                                               ev("EPILOGUE", s), "whole_loop"), None, x))
    top_end = max(r.last_col for r in regions) + 1

    # --- P and the scale factors inside the score columns
    pbits = spec.p.format.bits
    p_cols = n * pbits // 32
    p_dtype = {4: "e2m1 (8 codes per column)", 8: f"{spec.p.format.value} (4 per column)",
               16: f"{spec.p.format.value} (2 per column)"}[pbits]
    sfp_cols = sf_atoms(sch.tile_m, n, pv.sf_block) * SF_ATOM_COLS if pv.block_scaled else 0
    sfv_cols = sf_atoms(d, n, pv.sf_block) * SF_ATOM_COLS if pv.block_scaled else 0
    sfq_cols = sf_atoms(sch.tile_m, d, qk.sf_block) * SF_ATOM_COLS if qk.block_scaled else 0
    sfk_cols = sf_atoms(n, d, qk.sf_block) * SF_ATOM_COLS if qk.block_scaled else 0
    p_in_tmem = pv.a_source == "tmem"  # p_source smem: P lives in SMEM, only its scales come here
    upper = (p_cols if p_in_tmem else 0) + sfp_cols + sfv_cols
    if upper > n // 2:
        raise PlanError(f"P ({p_cols} columns) and its scales ({sfp_cols + sfv_cols}) do not fit in the upper half "
                        f"of a {n}-column S region", spec.loc("P"), ["use a larger tile_n or a narrower P"])
    free_cols = top_end
    notes = []
    for s in range(q):
        base = s_base[s]
        col = base + n // 2
        if p_in_tmem:
            a, b, x = place(f"P{s}", col, p_cols)
            regions.append(TmemRegion(f"P{s}", a, b, *lanes, p_dtype, f"P of stage {s}, the PV MMA's A operand", s,
                                      LiveInterval(ev(first_pub, s), ev(last_pv, s)), f"S{s}", x))
            col += p_cols
        if pv.block_scaled:
            a, b, x = place(f"SFP{s}", col, sfp_cols)
            regions.append(TmemRegion(f"SFP{s}", a, b, *lanes, f"{pv.sf_dtype} x4 per column (32x4x4 atom)",
                                      f"P's block scales for PV of stage {s}", s,
                                      LiveInterval(ev(first_pub, s), ev(last_pv, s)), f"S{s}", x))
            col += sfp_cols
            a, b, x = place(f"SFV{s}", col, sfv_cols)
            regions.append(TmemRegion(f"SFV{s}", a, b, *lanes, f"{pv.sf_dtype} x4 per column (32x4x4 atom)",
                                      f"V's block scales for PV of stage {s} (tcgen05.cp from smem)", s,
                                      LiveInterval(ev("CP_SFV", s), ev(last_pv, s)), f"S{s}", x))
    if not p_in_tmem:
        notes.append("p_source smem: P's codes are the PV MMA's A operand in SMEM (no P region); "
                     "its scales still come to TMEM")
    if qk.block_scaled:
        for s in range(q):
            if q == 2:
                host = 1 - s
                base, alias = s_base[host], f"S{host}"
            else:
                base, alias = free_cols, None
                free_cols += sfq_cols + sfk_cols
                notes.append("one query stage: the QK^T scale factors get their own columns after O0")
            a, b, x = place(f"SFQ{s}", base, sfq_cols)
            regions.append(TmemRegion(f"SFQ{s}", a, b, *lanes, f"{qk.sf_dtype} x4 per column (32x4x4 atom)",
                                      f"Q's block scales for QK^T of stage {s} (tcgen05.cp from smem)", s,
                                      LiveInterval(ev("CP_SF_QK", s), ev("QK", s)), alias, x))
            a, b, x = place(f"SFK{s}", base + sfq_cols, sfk_cols)
            regions.append(TmemRegion(f"SFK{s}", a, b, *lanes, f"{qk.sf_dtype} x4 per column (32x4x4 atom)",
                                      f"K's block scales for QK^T of stage {s} (tcgen05.cp from smem)", s,
                                      LiveInterval(ev("CP_SF_QK", s), ev("QK", s)), alias, x))
        if q == 2:
            notes.append("QK^T scale factors of stage s live in the drained score columns of the other stage "
                         "(S0..O1 take all columns); copying them waits for that stage's S to be drained")
    unknown = sorted(set(explicit) - set(known))
    if unknown:
        name = unknown[0]
        raise PlanError(f"unknown TMEM region '{name}'", spec.loc(f"schedule.tmem.{name}") or spec.loc("schedule.tmem"),
                        [f"this plan has regions {', '.join(known)}"])
    # Explicitly placed sub-regions that left their parent are no longer aliases.
    fixed = []
    byname = {r.name: r for r in regions}
    for r in regions:
        if r.alias_of is not None:
            p = byname[r.alias_of]
            if not (p.first_col <= r.first_col and r.last_col <= p.last_col):
                r = replace(r, alias_of=None)
        fixed.append(r)
    extent = max(r.last_col for r in fixed) + 1
    if extent > TMEM_COLUMNS:
        raise PlanError(f"TMEM plan needs {extent} columns but sm100a has {TMEM_COLUMNS} per SM",
                        spec.loc("schedule.tmem") or spec.loc("head_dim"),
                        ["the scale factors of a single-stage plan need columns after O0"])
    tm = TmemPlan(tuple(fixed), total_columns=extent, alloc_columns=_pow2_alloc(extent), notes=tuple(notes))
    out = replace(plan, tmem=tm)
    from .verify import check_tmem  # explicit regions are checked here, with their spec locations
    check_tmem(out)
    return out
