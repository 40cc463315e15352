"""The protocol model checker (fp4gen.lowering.protocol) on hand-built traces.

A small producer/consumer pipeline shaped like the sm100a forward: the load warp TMAs K/V
tiles into a 2-stage SMEM ring (full/empty barriers), the MMA warp runs QK^T into S,
commits S-full, waits for P, copies P's scale factors to TMEM and runs PV (P, SFP inside S's
columns) into O, commits the stage's empty barrier; two softmax warps tmem_ld S, release S,
write scale bytes to SMEM, tmem_st P, arrive P-full; an epilogue warp reads O at the end.
The correct pipeline passes; each planted fault must produce its own finding. Expected
findings are derived from the protocol by hand (comments), not from the checker's output.
"""
from __future__ import annotations

import pytest

from fp4gen.lowering import protocol
from fp4gen.lowering.emulator.trace import (
    Access, Arrive, AsyncOp, BarrierInit, Commit, Fence, NamedBarrier, SmemSpan, TmemSpan,
    TmemWait, Trace, Wait)

# PTX "lines" of the code sites
L_INIT, L_SYNC = 10, 11
L_WAIT_EMPTY, L_ARRIVE_FULL, L_TMA = 20, 21, 22
L_WAIT_FULL, L_WAIT_SFREE, L_QK, L_COMMIT_S, L_WAIT_P, L_CP, L_PV, L_COMMIT_E, L_COMMIT_O = \
    30, 31, 32, 33, 34, 35, 36, 37, 38
L_WAIT_S, L_LD, L_WAIT_LD, L_ARRIVE_SFREE, L_ST_SF, L_FENCE, L_ST, L_WAIT_ST, L_ARRIVE_P = \
    40, 41, 42, 43, 44, 45, 46, 47, 48
L_WAIT_O, L_LD_O, L_WAIT_LD_O = 50, 51, 52

FULL, EMPTY = (0x100, 0x108), (0x110, 0x118)
S_FULL, S_FREE, P_FULL, O_FULL = 0x120, 0x128, 0x130, 0x138
KV = [SmemSpan(0x1000 + s * 0x4000, 0x5000 + s * 0x4000) for s in range(2)]
SF_SMEM = SmemSpan(0x9000, 0x9100)
BYTES = 0x4000
LANES = 64  # two softmax warps, 32 rows each
S = TmemSpan(0, LANES, 0, 128)
P = TmemSpan(0, LANES, 64, 80)  # inside S (the plan's P0 at columns 64-79)
SFP = TmemSpan(0, LANES, 80, 84)  # inside S
O = TmemSpan(0, LANES, 256, 384)
SOFTMAX, EPI, MMA, LOAD = (0, 1), 8, 12, 13


def pipeline(tiles, *, missing_empty_wait=False, full_count=1, wrong_full_parity=False,
             late_tmem_wait=False, commit_before_qk=False):
    ops = iter(range(10_000))
    nwarps = 5
    load = [BarrierInit(L_INIT, b, c) for b, c in
            [(FULL[0], full_count), (FULL[1], 1), (EMPTY[0], 1), (EMPTY[1], 1),
             (S_FULL, 1), (S_FREE, 2), (P_FULL, 2), (O_FULL, 1)]]
    sync = NamedBarrier(L_SYNC, 0, 32 * nwarps)
    load.append(sync)
    mma = [sync]
    soft = {w: [sync] for w in SOFTMAX}
    for i in range(tiles):
        s, ph = i % 2, (i // 2) & 1
        # load warp: a fresh empty barrier's "preceding phase" (parity 1) counts as done
        if not missing_empty_wait:
            load.append(Wait(L_WAIT_EMPTY, EMPTY[s], ph ^ 1))
        load += [Arrive(L_ARRIVE_FULL, FULL[s], 1, BYTES),
                 AsyncOp(L_TMA, next(ops), "tma", writes=(KV[s],), bar=FULL[s], tx=BYTES)]
        # MMA warp
        mma.append(Wait(L_WAIT_FULL, FULL[s], ph ^ 1 if wrong_full_parity else ph))
        if i > 0:
            mma.append(Wait(L_WAIT_SFREE, S_FREE, (i - 1) & 1))
        qk = AsyncOp(L_QK, next(ops), "mma", reads=(KV[s],), writes=(S,))
        mma += [Commit(L_COMMIT_S, S_FULL), qk] if commit_before_qk else \
            [qk, Commit(L_COMMIT_S, S_FULL)]
        mma += [Wait(L_WAIT_P, P_FULL, i & 1),
                AsyncOp(L_CP, next(ops), "cp", reads=(SF_SMEM,), writes=(SFP,)),
                AsyncOp(L_PV, next(ops), "mma", reads=(P, SFP, KV[s]), writes=(O,)),
                Commit(L_COMMIT_E, EMPTY[s])]
        # softmax warps, each on its 32 lanes
        for w in SOFTMAX:
            lo, hi = 32 * w, 32 * w + 32
            ev = soft[w]
            ev += [Wait(L_WAIT_S, S_FULL, i & 1),
                   AsyncOp(L_LD, next(ops), "tmem_ld", reads=(TmemSpan(lo, hi, 0, 128),))]
            if not late_tmem_wait:
                ev.append(TmemWait(L_WAIT_LD, "ld"))
            ev.append(Arrive(L_ARRIVE_SFREE, S_FREE))
            ev += [Access(L_ST_SF, True, (SmemSpan(SF_SMEM.lo + 128 * w, SF_SMEM.lo + 128 * w
                                                   + 128),)),
                   Fence(L_FENCE, "fence.proxy.async.shared::cta"),
                   AsyncOp(L_ST, next(ops), "tmem_st", writes=(TmemSpan(lo, hi, 64, 80),)),
                   TmemWait(L_WAIT_ST, "st"), Arrive(L_ARRIVE_P, P_FULL)]
            if late_tmem_wait:  # tcgen05.wait::ld only after both releases
                ev.append(TmemWait(L_WAIT_LD, "ld"))
    mma.append(Commit(L_COMMIT_O, O_FULL))
    epi = [sync, Wait(L_WAIT_O, O_FULL, 0),
           AsyncOp(L_LD_O, next(ops), "tmem_ld", reads=(O,)), TmemWait(L_WAIT_LD_O, "ld")]
    warps = {SOFTMAX[0]: soft[0], SOFTMAX[1]: soft[1], EPI: epi, MMA: mma, LOAD: load}
    roles = {0: "softmax", 1: "softmax", EPI: "epilogue", MMA: "mma", LOAD: "load"}
    return Trace("toy_pipeline", tiles, warps, roles)


def pairs(report):
    return {frozenset(f.lines) for f in report.races}


@pytest.mark.parametrize("tiles", [1, 2, 3, 4])
def test_correct_pipeline_passes_with_in_order_issue(tiles):
    r = protocol.check_protocol(pipeline(tiles))
    assert r.exhaustive, r.summary()
    assert r.findings == [], r.summary()
    assert r.states > 10 * tiles  # it did interleave


@pytest.mark.parametrize("tiles", [2, 3, 4])
def test_s_column_reuse_relies_on_in_order_issue(tiles):
    # QK^T(i+1) writes S (columns 0-127) while PV(i) may still read P (64-79) and SFP
    # (80-83) there: different accumulators (S vs O), so 9.7.16.6.2 does not order them;
    # every other pair is ordered by a barrier, a commit, or an ISA pipeline pair
    # (QK->QK, PV->PV same accumulator; cp->PV, cp->QK).
    rel = protocol.check_tensor_pipe_reliance(pipeline(tiles))
    assert rel.in_order.ok and rel.without.exhaustive
    assert {frozenset(f.lines) for f in rel.relies_on} == {frozenset((L_QK, L_PV))}
    assert "relies on in-order tensor-pipe issue for:" in rel.summary()
    assert f"L{L_QK}" in rel.summary() and f"L{L_PV}" in rel.summary()


def test_one_tile_needs_no_in_order_issue():
    rel = protocol.check_tensor_pipe_reliance(pipeline(1))
    assert rel.relies_on == [] and rel.without.findings == []


def test_missing_empty_wait_lets_tma_overwrite_a_stage_in_use():
    # tile 2 reuses stage 0 while QK^T(0) / PV(0) may still read it
    r = protocol.check_protocol(pipeline(3, missing_empty_wait=True))
    assert any(L_TMA in p and (L_QK in p or L_PV in p) for p in pairs(r)), r.summary()
    clean = protocol.check_protocol(pipeline(3))
    assert not clean.findings


def test_init_count_one_too_high_deadlocks():
    r = protocol.check_protocol(pipeline(2, full_count=2))
    assert r.exhaustive
    dl = r.deadlocks
    assert dl, r.summary()
    # the MMA warp waits forever for the second arrival on full[0]
    assert all(MMA in f.warps and L_WAIT_FULL in f.lines for f in dl)
    assert "L30 wait" in dl[0].message and "1 of 2 arrivals pending" in dl[0].message
    assert dl[0].interleaving  # it says how it got there
    assert not r.races


def test_wrong_full_parity_reads_the_stage_before_the_tma_lands():
    r = protocol.check_protocol(pipeline(1, wrong_full_parity=True))
    assert frozenset((L_TMA, L_QK)) in pairs(r), r.summary()


def test_tmem_wait_after_the_release_races_with_the_next_qk():
    # the releases let the MMA warp write S's columns (tcgen05.cp of SFP, then QK^T(1))
    # while tcgen05.ld of S(0) is still in flight
    r = protocol.check_protocol(pipeline(2, late_tmem_wait=True))
    assert frozenset((L_LD, L_QK)) in pairs(r), r.summary()
    assert frozenset((L_LD, L_CP)) in pairs(r), r.summary()
    one = protocol.check_protocol(pipeline(1, late_tmem_wait=True))
    # no next QK^T with one tile; the warp's own tcgen05.st of P into S's columns is also
    # unordered with its in-flight tcgen05.ld (needs wait::ld between, 9.7.16.6.4.2)
    assert pairs(one) == {frozenset((L_LD, L_CP)), frozenset((L_LD, L_ST))}


def test_commit_before_the_mma_it_should_cover():
    # S-full arrives without waiting for QK^T: the softmax warps read S while it is written
    r = protocol.check_protocol(pipeline(1, commit_before_qk=True))
    assert frozenset((L_LD, L_QK)) in pairs(r), r.summary()
    f = next(f for f in r.races if set(f.lines) == {L_LD, L_QK})
    assert any("issue mma" in step for step in f.interleaving)
    assert any("issue tmem_ld" in step for step in f.interleaving)


def _fingerprint(report):
    return {(f.kind, frozenset(f.lines)) for f in report.findings}


@pytest.mark.parametrize("fault", [{}, {"missing_empty_wait": True}, {"full_count": 2},
                                   {"wrong_full_parity": True}, {"late_tmem_wait": True},
                                   {"commit_before_qk": True}])
@pytest.mark.parametrize("in_order", [True, False])
def test_reductions_keep_the_findings(fault, in_order):
    # partial-order reduction and warp grouping must find what the plain search finds
    t = pipeline(3, **fault)
    full = protocol.check_protocol(t, in_order_tensor_pipe=in_order, reduce=False,
                                   group_warps=False)
    assert full.exhaustive
    red = protocol.check_protocol(t, in_order_tensor_pipe=in_order)
    assert red.exhaustive
    assert _fingerprint(red) == _fingerprint(full)
    assert red.states < full.states
    assert [0, 1] in red.agents and [0] in full.agents


# --- mbarrier semantics on tiny traces ---------------------------------------------------

B = 0x200


def _tiny(producer, consumer):
    sync = NamedBarrier(1, 0, 64)
    return Trace("tiny", 1, {0: [BarrierInit(2, B, 1), sync] + producer,
                             1: [sync] + consumer})


def test_a_waiter_is_fooled_by_a_phase_two_ahead():
    # two completions before the consumer looks: the phase it waits for (parity 0) reads as
    # not complete (current phase 2 has parity 0), 9.7.13.15.16 -> deadlock in that order
    r = protocol.check_protocol(_tiny([Arrive(3, B), Arrive(4, B)],
                                      [Wait(5, B, 0), Wait(6, B, 1)]))
    assert [f.lines for f in r.deadlocks] == [(5,)], r.summary()
    # with back-pressure (an empty barrier) the same exchange cannot run ahead
    E = 0x208
    sync = NamedBarrier(1, 0, 64)
    t = Trace("tiny", 1, {
        0: [BarrierInit(2, B, 1), BarrierInit(2, E, 1), sync, Arrive(3, B), Wait(7, E, 0),
            Arrive(4, B)],
        1: [sync, Wait(5, B, 0), Arrive(8, E), Wait(6, B, 1)]})
    assert protocol.check_protocol(t).ok


def test_arrivals_beyond_the_expected_count():
    # arrive.expect_tx leaves the phase open for the bytes; a second arrive overshoots
    r = protocol.check_protocol(_tiny([Arrive(3, B, 1, 64), Arrive(4, B),
                                       AsyncOp(5, 0, "tma", writes=(SmemSpan(0, 64),),
                                               bar=B, tx=64)], []))
    assert [f.lines for f in r.misuse] == [(4,)], r.summary()
    assert "beyond" in r.misuse[0].message


def test_tx_count_underflow():
    r = protocol.check_protocol(_tiny([Arrive(3, B, 1, 64),
                                       AsyncOp(5, 0, "tma", writes=(SmemSpan(0, 128),),
                                               bar=B, tx=128)], []))
    assert [f.lines for f in r.misuse] == [(5,)] and "tx-count" in r.misuse[0].message


def test_tx_bytes_short_deadlocks():
    r = protocol.check_protocol(_tiny([Arrive(3, B, 1, 128),
                                       AsyncOp(5, 0, "tma", writes=(SmemSpan(0, 64),),
                                               bar=B, tx=64)], [Wait(6, B, 0)]))
    assert [f.lines for f in r.deadlocks] == [(6,)] and "tx-count 64" in r.deadlocks[0].message


def test_wait_on_an_uninitialised_barrier():
    t = Trace("tiny", 1, {0: [Wait(3, 0x300, 0)]})
    r = protocol.check_protocol(t)
    assert [f.lines for f in r.misuse] == [(3,)] and "never initialised" in r.misuse[0].message
    assert r.deadlocks


def test_named_barrier_orders_plain_shared_accesses():
    span = (SmemSpan(0, 4),)
    ok = Trace("tiny", 1, {0: [Access(1, True, span), NamedBarrier(2, 3, 64)],
                           1: [NamedBarrier(2, 3, 64), Access(3, False, span)]})
    assert protocol.check_protocol(ok).ok
    racy = Trace("tiny", 1, {0: [Access(1, True, span), NamedBarrier(2, 3, 64, arrive=True)],
                             1: [Access(3, False, span), NamedBarrier(2, 3, 64)]})
    assert {f.lines for f in protocol.check_protocol(racy).races} == {(1, 3)}


def test_max_states_is_reported():
    r = protocol.check_protocol(pipeline(3), max_states=50)
    assert not r.exhaustive and r.states <= 50 and not r.ok
