"""plan_pipeline: warp roles, register budgets (setmaxnreg) and the shared-memory budget.

sm100a (FA4's warp specialization, 16 warps = 4 warpgroups):
  softmax0, softmax1 (one warpgroup per query stage), correction (rescales O, epilogue
  TMEM reads), and one warpgroup of single warps: load (TMA), mma (issues tcgen05.mma /
  tcgen05.cp), epilogue (TMA store), one spare.
sm90a (FA3's): one producer warpgroup (TMA loads; setmaxnreg down) and tile_m/64
  consumer warpgroups (wgmma + softmax in registers; setmaxnreg up).
"""
from __future__ import annotations

from dataclasses import replace

from ..plan import (
    REGISTERS_PER_SM, SMEM_LIMIT_BYTES, KernelPlan, PipelinePlan, PlanError, SmemItem, Sm90Plan, WarpRole,
)
from ..spec import PKind, Target
from .contracts import sf_atoms

SF_ATOM_BYTES = 512  # 128 rows x 4 one-byte scales
MBARRIER_BYTES = 8


def _bytes(rows: int, cols: int, bits: int) -> int:
    return rows * cols * bits // 8


def _loc(spec):
    return spec.loc("schedule.kv_stages") or spec.loc("schedule.tile") or spec.loc("schedule")


def _sm100(plan: KernelPlan) -> PipelinePlan:
    spec = plan.spec
    s, d = spec.schedule, spec.head_dim
    q, m, n = s.q_stages, s.tile_m, s.tile_n
    qk, pv = plan.mma_choice("QK"), plan.mma_choice("PV")
    # Register budgets (setmaxnreg) from what each role keeps live (sm100_register_budgets says why).
    regs = sm100_register_budgets(n, d, spec.p.format.bits)
    roles = [WarpRole(f"softmax{st}", 4, regs["softmax"][0],
                      f"loads S{st}, row max, P (exp or Direct-P), publishes P{st}") for st in range(q)]
    roles += [WarpRole("correction", 4, regs["correction"][0],
                       "rescales O when the row max moves; reads O for the epilogue"),
              WarpRole("mma", 1, regs["other"][0], "issues tcgen05.mma (QK^T, PV) and tcgen05.cp (scale factors)"),
              WarpRole("load", 1, regs["other"][0], "TMA loads of Q, K, V and their scale factors"),
              WarpRole("epilogue", 1, regs["other"][0], "TMA store of O"),
              WarpRole("spare", 1, regs["other"][0], "idle (keeps the warpgroup whole for setmaxnreg)")]

    def smem(kv: int, o_in_q: bool) -> list[SmemItem]:
        items = [SmemItem("Q", q * _bytes(m, d, spec.q.format.bits), f"{q} x {m}x{d} {spec.q.format.value}"),
                 SmemItem("K", kv * _bytes(n, d, spec.k.format.bits), f"{kv} x {n}x{d} {spec.k.format.value}"),
                 SmemItem("V", kv * _bytes(n, d, spec.v.format.bits), f"{kv} x {n}x{d} {spec.v.format.value}")]
        if qk.block_scaled:
            items.append(SmemItem("SFQ+SFK", (q * sf_atoms(m, d, qk.sf_block) + kv * sf_atoms(n, d, qk.sf_block))
                                  * SF_ATOM_BYTES, "scale-factor atoms staged for tcgen05.cp"))
        if pv.block_scaled:
            items.append(SmemItem("SFV", kv * sf_atoms(d, n, pv.sf_block) * SF_ATOM_BYTES,
                                  "scale-factor atoms staged for tcgen05.cp"))
        if pv.a_source == "smem":
            # p_source smem: one P tile per query stage, the A operand of the SS PV MMA
            items.append(SmemItem("P", q * _bytes(m, n, spec.p.format.bits),
                                  f"{q} x {m}x{n} {spec.p.format.value} (PV's A operand, K-major, swizzled)"))
        if not o_in_q:
            items.append(SmemItem("O", q * _bytes(m, d, spec.o.format.bits), f"{q} x {m}x{d} {spec.o.format.value} (epilogue staging)"))
        nbar = 4 * kv + 8 * q + 2
        items.append(SmemItem("barriers", nbar * MBARRIER_BYTES, f"{nbar} mbarriers"))
        return items

    why = "; ".join(f"{role} {n}: {reason}" for role, (n, reason) in regs.items())
    return _finish(spec, roles, smem, (4, 3, 2), q, m, n,
                   "per KV tile j, for each stage s: PV_s(j-1) then QK_s(j) (FA4 order: P's columns are "
                   "consumed before QK^T rewrites S; the tensor pipe runs tcgen05 ops in issue order)",
                   (f"register budgets per thread (setmaxnreg), from each role's peak live values; "
                    f"the register gate allows no spills: {why}",))


# The sm100a forward's register budget per role (setmaxnreg: a multiple of 8 in 24..256, PTX ISA
# 9.7.19.5; the warps of one warpgroup share it) and why, from the values each role keeps live
# at its peak. At these budgets ptxas 13.5 spills nothing in the four forward kernels (2026-12-01;
# fp4gen/lowering/ptxas.py allows no spill bytes: PipelinePlan.spill_budget_bytes stays 0). The
# softmax warps hold the largest live set and get every register the others leave: 8 x 192 +
# 4 x 80 + 4 x 48 = 2048 per lane = the SM's 64K registers, so a larger budget for one role is
# a smaller one for another. Measured (SASS): the softmax code's highest register is R177-R187
# in the four kernels; the single-thread roles keep most of their state in uniform registers.
def sm100_register_budgets(tile_n: int, head_dim: int, p_bits: int) -> dict:
    """role group -> (registers per thread, the live values that need them)."""
    return {
        "softmax": (192, f"one query row per thread: the tile's {tile_n} fp32 scores ({tile_n // 32} "
                         f"tcgen05.ld x32), then P's {tile_n * p_bits // 32} packed words or one "
                         "32-column chunk of O for the rescale (never beside the scores), m, l, addresses"),
        "correction": (80, f"the epilogue's 32-column chunk of O ({head_dim // 32} tcgen05.ld x32 per "
                           "row), 1/l, the row index and the output addresses"),
        "other": (48, "single-thread issue loops (TMA, tcgen05.mma / tcgen05.cp): descriptors, stage "
                      "indices, barrier addresses, mostly in uniform registers"),
    }


def _finish(spec, roles, smem, kv_choices, q, m, n, order, extra_notes=()) -> PipelinePlan:
    s = spec.schedule
    notes = list(extra_notes)
    choice = None
    candidates = [(s.kv_stages, False), (s.kv_stages, True)] if s.kv_stages else \
        [(kv, False) for kv in kv_choices] + [(kv, True) for kv in kv_choices]
    for kv, o_in_q in candidates:
        items = smem(kv, o_in_q)
        if sum(i.bytes for i in items) <= SMEM_LIMIT_BYTES:
            choice = (kv, o_in_q, items)
            break
    if choice is None:
        kv = s.kv_stages or kv_choices[-1]
        items = smem(kv, True)
        total = sum(i.bytes for i in items)
        raise PlanError(f"shared memory plan needs {total} bytes ({', '.join(f'{i.name} {i.bytes}' for i in items)}) "
                        f"but a CTA may use {SMEM_LIMIT_BYTES}", _loc(spec),
                        ["use fewer kv_stages, a smaller tile, or narrower K/V formats"])
    kv, o_in_q, items = choice
    if o_in_q:
        notes.append("O is staged for the epilogue in Q's shared memory (Q is dead after the last QK^T)")
    regs = sum(r.threads * r.registers for r in roles)
    if regs > REGISTERS_PER_SM:
        raise PlanError(f"register plan needs {regs} registers but an SM has {REGISTERS_PER_SM}", _loc(spec))
    return PipelinePlan(m, n, q, kv, tuple(roles), tuple(items), sum(i.bytes for i in items), SMEM_LIMIT_BYTES,
                        regs, REGISTERS_PER_SM, order, tuple(notes))


# FA3's setmaxnreg splits (producer, consumer) per consumer warpgroup count (total <= 64K registers).
SM90_REGISTER_SPLIT = {1: (56, 256), 2: (24, 240), 3: (32, 160)}
# The sm90a forward's key tiles to try, largest first, when the spec writes no tile: a
# multiple of 16 keys (the bf16 PV's K step; FP8 takes 128 only, one K scale block per tile).
SM90_TILE_N_CHOICES = (128, 112, 96, 80, 64)
# Registers a consumer thread keeps live beside the accumulators: row max / sum / scale / LSE
# of its 2 rows, the MMA descriptors, loop state, addresses and the softmax's temporaries
# (24 in all). An estimate, calibrated on the largest kernel: FP8 Direct-P at head_dim 256,
# 128 x 128 (estimate 236) compiles with zero spills under 240 (ptxas 13.5, 2026-12-02); the
# register gate (fp4gen verify: ptxas, zero spills) is the proof for each module.
SM90_CONSUMER_OVERHEAD_REGS = 24


def sm90_consumer_registers(d: int, n: int, p_bits: int, l_from_mma: bool) -> tuple[int, str]:
    """(estimated live registers per consumer thread at its peak, the sum in words): a
    warpgroup's 64 x d fp32 O accumulator over 128 threads (d/2), the next tile's 64 x n
    scores (n/2) in flight beside the previous tile's packed P (n x p_bits / 64), the
    Direct-P l accumulator (64 x 8 fp32: 4), the overhead above."""
    o, s, p = d // 2, n // 2, n * p_bits // 64
    lacc = 4 if l_from_mma else 0
    total = o + s + p + lacc + SM90_CONSUMER_OVERHEAD_REGS
    return total, (f"O {o} (64 x {d} fp32 / 128 threads) + S {s} + P {p} ({p_bits}-bit)"
                   + (f" + l {lacc}" if lacc else "") + f" + {SM90_CONSUMER_OVERHEAD_REGS} other = {total}")


def _sm90(plan: KernelPlan) -> tuple[PipelinePlan, Sm90Plan]:
    spec = plan.spec
    s, d = spec.schedule, spec.head_dim
    m, n = s.tile_m, s.tile_n  # tile_n: the spec's or legalize's choice (sm90_forward_tile)
    wgs = m // 64
    producer, consumer = SM90_REGISTER_SPLIT[wgs]
    l_from_mma = spec.p_production.kind is PKind.DIRECT_P and spec.p.format.is_fp8
    _, tile_note = sm90_forward_tile(spec)
    roles = [WarpRole("producer", 4, producer, "one warp issues TMA loads of Q, K, V (the others idle)")]
    roles += [WarpRole(f"consumer{w}", 4, consumer, f"wgmma QK^T / PV on query rows {64 * w}..{64 * w + 63}, "
                                                    f"softmax and P in registers") for w in range(wgs)]

    def smem(kv: int, o_in_q: bool) -> list[SmemItem]:
        items = [SmemItem("Q", _bytes(m, d, spec.q.format.bits), f"{m}x{d} {spec.q.format.value}"),
                 SmemItem("K", kv * _bytes(n, d, spec.k.format.bits), f"{kv} x {n}x{d} {spec.k.format.value}"),
                 SmemItem("V", kv * _bytes(n, d, spec.v.format.bits),
                          f"{kv} x {d}x{n} {spec.v.format.value} (transposed)" if spec.v.format.is_fp8
                          else f"{kv} x {n}x{d} {spec.v.format.value}")]
        if not o_in_q:
            items.append(SmemItem("O", _bytes(m, d, spec.o.format.bits), f"{m}x{d} {spec.o.format.value} (epilogue staging)"))
        nbar = 4 * kv + 2
        items.append(SmemItem("barriers", nbar * MBARRIER_BYTES, f"{nbar} mbarriers"))
        return items

    pingpong = wgs == 2 and d == 128
    order = ("per consumer warpgroup and KV tile j: issue QK(j), issue PV(j-1), softmax(j) under PV(j-1) "
             "(intra-warpgroup overlap)" + ("; the two consumers take turns on the tensor core (ping-pong)"
                                             if pingpong else ""))
    kv_default = (s.kv_stages or 2,)
    pp = _finish(spec, roles, smem, kv_default, wgs, m, n, order, (tile_note,) if tile_note else ())
    sm90 = Sm90Plan(tile_m=m, tile_n=n, consumer_warpgroups=wgs, kv_stages=pp.kv_stages,
                    v_transposed=spec.v.format.is_fp8, intra_warpgroup_overlap=True, pingpong=pingpong,
                    smem_bytes=pp.smem_bytes, producer_registers=producer, consumer_registers=consumer,
                    l_from_mma=l_from_mma)
    return pp, sm90


def _sm90_smem_bytes(spec, m: int, n: int, kv: int) -> int:
    """Q, kv K/V stages and the mbarriers (O is staged in Q's space when nothing else fits)."""
    d = spec.head_dim
    return (_bytes(m, d, spec.q.format.bits) + kv * (_bytes(n, d, spec.k.format.bits) + _bytes(n, d, spec.v.format.bits))
            + (4 * kv + 2) * MBARRIER_BYTES)


def sm90_forward_tile(spec) -> tuple:
    """(spec with its key tile, the note recording why) for the sm90a forward. ``legalize``
    calls it first, so that every pass plans the chosen tile; ``_sm90`` again, for the note
    (the choice is a fixed point: the chosen tile is chosen again)."""
    consumer = SM90_REGISTER_SPLIT[spec.schedule.tile_m // 64][1]
    l_from_mma = spec.p_production.kind is PKind.DIRECT_P and spec.p.format.is_fp8
    n, note = _sm90_tile_n(spec, consumer, l_from_mma)
    if n != spec.schedule.tile_n:
        spec = replace(spec, schedule=replace(spec.schedule, tile_n=n))
    return spec, note


def _sm90_tile_n(spec, consumer: int, l_from_mma: bool) -> tuple[int, str]:
    """(keys per tile, the note recording why) for the sm90a forward.

    A tile the spec writes is kept when the consumers' registers hold it (the SMEM budget is
    ``_finish``'s, refused there with its items); else refused at the tile line with the sum.
    With no tile written, the largest of ``SM90_TILE_N_CHOICES`` whose Q + 2 K/V stages fit
    the SMEM limit and whose live registers fit the consumers' setmaxnreg budget (FP8: 128,
    the K scale block). The note gives both sums (and what the larger tiles need); none for
    a written 128 x 128, the language's default, so that the plans of those specs read as before."""
    s, d, m = spec.schedule, spec.head_dim, spec.schedule.tile_m
    p_bits = spec.p.format.bits
    kv = s.kv_stages or 2

    def budget(n: int) -> tuple[int, int, str]:
        need, why = sm90_consumer_registers(d, n, p_bits, l_from_mma)
        smem = _sm90_smem_bytes(spec, m, n, kv)
        return smem, need, (f"{kv} K/V stages + Q need {smem} of {SMEM_LIMIT_BYTES} SMEM bytes and ~{need} of "
                            f"{consumer} registers per consumer thread ({why})")

    if spec.loc("schedule.tile") is not None:
        smem, need, text = budget(s.tile_n)
        over = ([f"Q + {kv} K/V stages need {smem} B of SMEM (a CTA may use {SMEM_LIMIT_BYTES})"]
                if smem > SMEM_LIMIT_BYTES else [])
        if need > consumer:
            over.append(f"a consumer thread needs ~{need} registers ({text.split('(', 1)[1][:-1]}) but its "
                        f"setmaxnreg budget is {consumer}")
        if over:
            raise PlanError(f"tile {m} x {s.tile_n} at head_dim {d}: " + "; ".join(over), _loc(spec),
                            [f"use fewer keys per tile (tile {m} x N, N a multiple of 16) or fewer kv_stages, "
                             "or drop the tile line and let the planner choose"])
        if (m, s.tile_n) == (128, 128):
            return s.tile_n, ""
        return s.tile_n, f"tile {m} x {s.tile_n} (the spec's) at head_dim {d}: {text}"
    choices = (128,) if spec.k.format.is_fp8 else SM90_TILE_N_CHOICES
    refused = []
    for n in choices:
        smem, need, text = budget(n)
        if smem <= SMEM_LIMIT_BYTES and need <= consumer:
            return n, (f"tile {m} x {n} chosen for head_dim {d}"
                       + (" (FP8: one K scale block per key tile)" if spec.k.format.is_fp8 else "")
                       + f": {text}" + "".join(f"; {r}" for r in refused))
        refused.append(f"{m} x {n} needs {smem} B SMEM, ~{need} registers")
    raise PlanError(f"head_dim {d} on sm90a: no key tile fits the budgets ({'; '.join(refused)}; limits "
                    f"{SMEM_LIMIT_BYTES} B SMEM per CTA, {consumer} registers per consumer thread)",
                    spec.loc("head_dim"),
                    ["use a smaller head_dim, fewer kv_stages, or narrower Q/K/V formats"])


def plan_pipeline(plan: KernelPlan) -> KernelPlan:
    t = plan.spec.target
    if t is Target.SM100A:
        return replace(plan, pipeline=_sm100(plan))
    if t is Target.SM90A:
        pp, sm90 = _sm90(plan)
        return replace(plan, pipeline=pp, sm90=sm90)
    return plan
