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


# --- an FA4-shaped trace: the layout of docs/sm100.md ---------------------------------------
# Two query stages j (softmax warps 4j..4j+3), correction warps 8-11, MMA warp 12, load warp 13;
# K and V rings; S_j / P_j / SFP_j / SFV_j in S_j's columns, O_j at 256 + 128 j; the QK^T
# scales of stage j (SFQ_j, SFK_j) in the other stage's S columns, copied after "S_{1-j}
# drained"; MMA order QK_0(0) QK_1(0), then PV_j(i-1) QK_j(i), then PV_0 PV_1 of the last tile.


def fa4_like(tiles, kv_stages=2, chunks=4, skip_other_drained=False):
    """(trace, {site name: line}) of the FA4 shape above."""
    ops = iter(range(100000))
    lines = {}

    def ln(name):  # one PTX "line" per code site
        return lines.setdefault(name, 100 + len(lines))
    bars = {}

    def bar(name, count):
        bars[name] = (0x100 + 8 * len(bars), count)
        return bars[name][0]

    def per(prefix, n, count):
        return [bar(f"{prefix}{x}", count) for x in range(n)]
    q_full = per("qf", 2, 1)
    k_full, k_empty = per("kf", kv_stages, 1), per("ke", kv_stages, 1)
    v_full, v_empty = per("vf", kv_stages, 1), per("ve", kv_stages, 1)
    s_full, s_drained = per("sf", 2, 1), per("se", 2, 128)
    p_full, p_empty = per("pf", 2, 128), per("pe", 2, 1)
    o_full, t_full = per("of", 2, 1), per("tf", 2, 128)

    def smem(base, size, n):
        return [SmemSpan(base + size * x, base + size * (x + 1)) for x in range(n)]
    QS, KS, VS = smem(0x1000, 0x2000, 2), smem(0x10000, 0x2000, kv_stages), \
        smem(0x20000, 0x2000, kv_stages)
    SFPS, STATS = smem(0x30000, 0x200, 2), smem(0x31000, 0x400, 2)

    def tm(lo, hi, lanes=(0, 128)):
        return TmemSpan(lanes[0], lanes[1], lo, hi)
    S = [tm(128 * j, 128 * j + 128) for j in range(2)]
    P = [tm(128 * j + 64, 128 * j + 80) for j in range(2)]
    SFP = [tm(128 * j + 80, 128 * j + 84) for j in range(2)]
    SFV = [tm(128 * j + 84, 128 * j + 88) for j in range(2)]
    O = [tm(256 + 128 * j, 384 + 128 * j) for j in range(2)]
    SFQK = [tm(128 * (1 - j), 128 * (1 - j) + 16) for j in range(2)]  # in the other S

    def op(site, kind, reads=(), writes=(), **kw):
        return AsyncOp(ln(site), next(ops), kind, reads=reads, writes=writes, **kw)
    sync = NamedBarrier(ln("sync"), 1, 16 * 32)
    warps = {}
    # load warp 13
    ld = [BarrierInit(ln("init"), a, c) for a, c in bars.values()] + [sync]
    for j in range(2):
        ld += [Arrive(ln("q_arrive"), q_full[j], 1, 0x2000),
               op("q_tma", "tma", writes=(QS[j],), bar=q_full[j], tx=0x2000)]
    for i in range(tiles):
        s, ph = i % kv_stages, (i // kv_stages) & 1
        ld += [Wait(ln("k_empty"), k_empty[s], ph ^ 1),
               Arrive(ln("k_arrive"), k_full[s], 1, 0x2000),
               op("k_tma", "tma", writes=(KS[s],), bar=k_full[s], tx=0x2000),
               Wait(ln("v_empty"), v_empty[s], ph ^ 1),
               Arrive(ln("v_arrive"), v_full[s], 1, 0x2000),
               op("v_tma", "tma", writes=(VS[s],), bar=v_full[s], tx=0x2000)]
    warps[13] = ld
    # MMA warp 12
    qks, pvs = [0, 0], [0, 0]  # QK^T / PV issued per stage

    def qk(j, i):
        s, ph = i % kv_stages, (i // kv_stages) & 1
        ev = [Wait(ln("mk_full"), k_full[s], ph)] if j == 0 else []
        if i == 0:
            ev.append(Wait(ln("mq_full"), q_full[j], 0))
        if not skip_other_drained:  # SFQ_j/SFK_j go into S_{1-j}
            ev.append(Wait(ln("s_other"), s_drained[1 - j], (qks[1 - j] & 1) ^ 1))
        ev += [Wait(ln("s_own"), s_drained[j], (qks[j] & 1) ^ 1),
               op("cp_sfqk", "cp", reads=(QS[j],), writes=(SFQK[j],))]
        ev += [op("qk", "mma", reads=(QS[j], KS[s], SFQK[j]), writes=(S[j],)) for _ in range(2)]
        ev.append(Commit(ln("qk_commit"), s_full[j]))
        qks[j] += 1
        if j == 1:
            ev.append(Commit(ln("k_release"), k_empty[s]))
        return ev

    def pv(j, i):
        s, ph = i % kv_stages, (i // kv_stages) & 1
        ev = [Wait(ln("mv_full"), v_full[s], ph)] if j == 0 else []
        ev += [Wait(ln("p_full"), p_full[j], pvs[j] & 1),
               op("cp_sfp", "cp", reads=(SFPS[j],), writes=(SFP[j],)),
               op("cp_sfv", "cp", reads=(VS[s],), writes=(SFV[j],))]
        ev += [op("pv", "mma", reads=(P[j], SFP[j], SFV[j], VS[s]), writes=(O[j],))
               for _ in range(2)]
        ev.append(Commit(ln("p_release"), p_empty[j]))
        pvs[j] += 1
        if j == 1:
            ev.append(Commit(ln("v_release"), v_empty[s]))
        return ev
    m = [sync] + qk(0, 0) + qk(1, 0)
    for i in range(1, tiles):
        for j in range(2):
            m += pv(j, i - 1) + qk(j, i)
    m += pv(0, tiles - 1) + pv(1, tiles - 1)
    m += [Commit(ln("o_commit"), o_full[0]), Commit(ln("o_commit1"), o_full[1])]
    warps[12] = m
    # softmax warps 4j..4j+3, 32 rows each
    for j in range(2):
        for w in range(4):
            lanes = (32 * w, 32 * w + 32)
            ev = [sync]
            for i in range(tiles):
                ev.append(Wait(ln("sm_s_full"), s_full[j], i & 1))
                ev += [op("sm_ld", "tmem_ld", reads=(tm(128 * j + 32 * c, 128 * j + 32 * c + 32,
                                                         lanes),)) for c in range(chunks)]
                ev += [TmemWait(ln("sm_wait_ld"), "ld"),
                       Fence(ln("f1"), "tcgen05.fence::before_thread_sync"),
                       Arrive(ln("sm_s_release"), s_drained[j], 32)]
                if i > 0:
                    ev.append(Wait(ln("sm_p_empty"), p_empty[j], (i - 1) & 1))
                sf = SmemSpan(SFPS[j].lo + 128 * w, SFPS[j].lo + 128 * w + 128)
                ev += [Access(ln("sm_st_sfp"), True, (sf,)),
                       op("sm_st_p", "tmem_st", writes=(tm(128 * j + 64, 128 * j + 80, lanes),)),
                       TmemWait(ln("sm_wait_st"), "st"),
                       Fence(ln("f2"), "fence.proxy.async.shared::cta"),
                       Arrive(ln("sm_p_arrive"), p_full[j], 32)]
            stats = SmemSpan(STATS[j].lo + 256 * w, STATS[j].lo + 256 * w + 256)
            ev += [Access(ln("sm_stats"), True, (stats,)), Arrive(ln("sm_t_arrive"), t_full[j], 32)]
            warps[4 * j + w] = ev
    # correction warps 8-11: both stages' epilogues
    for w in range(4):
        lanes = (32 * w, 32 * w + 32)
        ev = [sync]
        for j in range(2):
            stats = SmemSpan(STATS[j].lo + 256 * w, STATS[j].lo + 256 * w + 256)
            ev += [Wait(ln("c_t_full"), t_full[j], 0), Access(ln("c_stats"), False, (stats,)),
                   Wait(ln("c_o_full"), o_full[j], 0)]
            ev += [op("c_ld", "tmem_ld", reads=(tm(256 + 128 * j + 32 * c, 288 + 128 * j + 32 * c,
                                                   lanes),)) for c in range(4)]
            ev.append(TmemWait(ln("c_wait"), "ld"))
        warps[8 + w] = ev
    warps[14] = [sync]
    warps[15] = [sync]
    return Trace("fa4_like", tiles, warps, {}), lines


def _named(report, names):
    inv = {v: k for k, v in names.items()}
    return {frozenset(inv[l] for l in f.lines) for f in report.races}


def test_fa4_shaped_trace_relies_on_in_order_issue_only_for_s_reuse():
    t, names = fa4_like(2)
    assert [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] == \
        protocol.check_protocol(t, max_states=1).agents[:3]  # the softmax / correction groups
    rel = protocol.check_tensor_pipe_reliance(t)
    assert rel.in_order.ok, rel.in_order.summary()
    assert rel.without.exhaustive
    # QK_j(i) overwrites S_j while PV_j(i-1) reads P_j / SFP_j / SFV_j there (S vs O: no
    # 9.7.16.6.2 pair); everything else is ordered by barriers, commits or ISA pairs
    assert _named(rel.without, names) == {frozenset(("qk", "pv"))}


def test_fa4_shaped_trace_needs_the_other_stage_drained():
    # without "S_{1-j} drained" the MMA warp copies SFQ_j/SFK_j into S_{1-j}'s columns while
    # softmax_{1-j} may still be loading its scores from there
    t, names = fa4_like(1, skip_other_drained=True)
    r = protocol.check_protocol(t)
    assert frozenset(("cp_sfqk", "sm_ld")) in _named(r, names), r.summary()


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("in_order", [True, False])
def test_fa4_shaped_reduction_keeps_the_findings(in_order, skip):
    # the persistent sets against the plain search on the 16-warp shape (one tile)
    t, _ = fa4_like(1, skip_other_drained=skip)
    full = protocol.check_protocol(t, in_order_tensor_pipe=in_order, reduce=False)
    red = protocol.check_protocol(t, in_order_tensor_pipe=in_order)
    assert full.exhaustive and red.exhaustive
    assert _fingerprint(red) == _fingerprint(full)
    assert bool(full.findings) == skip
    assert red.states * 5 < full.states


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


def test_init_of_an_initialised_barrier():
    r = protocol.check_protocol(Trace("tiny", 1, {0: [BarrierInit(2, B, 1), BarrierInit(3, B, 1)]}))
    assert [f.lines for f in r.misuse] == [(3,)] and "already initialised" in r.misuse[0].message


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


# --- the real traces: fa4_fp4_d128 run by the emulator ---------------------------------------
# One emulation per KV-tile count and session (~30 s of CPU each, plus one cached compile).

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
_REAL = {}


def _real_trace(tiles):
    run = pytest.importorskip("fp4gen.lowering.emulator.run")
    if tiles not in _REAL:
        src = (ROOT / "generated" / "fa4_fp4_d128_sm100a.py").read_text()
        _REAL[tiles] = run.emulate_forward(src, seqlen_q=256, seqlen_k=128 * tiles,
                                           strict_aligned=False).trace
    return _REAL[tiles]


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [1, 2, 3, 4])
def test_fa4_fp4_real_trace_passes_with_in_order_issue(tiles):
    t = _real_trace(tiles)
    # docs/sm100.md: 4 QK^T + 4 PV MMAs per KV tile for FP4
    mma = [e for e in t.warps[12] if isinstance(e, AsyncOp) and e.kind == "mma"]
    assert len(mma) == 8 * tiles
    r = protocol.check_protocol(t)
    assert r.exhaustive and r.findings == [], r.summary()
    # the four softmax warps of each stage and the correction warps act as one agent each
    assert [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] == [g for g in r.agents if len(g) == 4]


@pytest.mark.slow
def test_fa4_fp4_real_trace_relies_on_in_order_issue_for_s_reuse_only():
    t = _real_trace(2)
    rel = protocol.check_tensor_pipe_reliance(t)
    assert rel.in_order.ok and rel.without.exhaustive, rel.without.summary()
    by_line = {e.line: e for e in t.warps[12] if isinstance(e, AsyncOp)}

    def cols(spans):
        return [(s.col_lo, s.col_hi) for s in spans if isinstance(s, TmemSpan)]

    def stage_of_qk(e):  # writes all of S_j (docs/sm100.md: S0 0-127, S1 128-255)
        return {j for j in (0, 1) if (128 * j, 128 * j + 128) in cols(e.writes)}

    def stage_of_pv(e):  # writes O_j (256 + 128 j) and reads P_j's columns inside S_j
        return {j for j in (0, 1) if (256 + 128 * j, 384 + 128 * j) in cols(e.writes)
                and any(128 * j + 64 <= lo and hi <= 128 * j + 80 for lo, hi in cols(e.reads))}
    stages = set()
    assert rel.relies_on
    for f in rel.relies_on:
        a, b = (by_line[l] for l in f.lines)
        assert a.kind == b.kind == "mma", f
        qk, pv = (a, b) if stage_of_qk(a) else (b, a)
        assert stage_of_qk(qk) and stage_of_qk(qk) == stage_of_pv(pv), f
        stages |= stage_of_qk(qk)
    assert stages == {0, 1}


@pytest.mark.slow
def test_fa4_fp4_real_trace_with_the_ld_wait_after_the_release():
    # planted in the real trace: every softmax warp's tcgen05.wait::ld moved behind the arrive
    # that follows it (the "S drained" release), so the MMA warp may write S_j's columns
    # while the scores are still being loaded
    t = _real_trace(2)
    warps = {}
    moved = 0
    for w, evs in t.warps.items():
        evs = list(evs)
        if w < 8:
            for i in range(len(evs) - 1):
                if isinstance(evs[i], TmemWait) and evs[i].kind == "ld" and \
                        isinstance(evs[i + 1], Arrive):
                    evs[i], evs[i + 1] = evs[i + 1], evs[i]
                    moved += 1
        warps[w] = evs
    assert moved == 8 * 2  # each softmax warp, each tile
    r = protocol.check_protocol(Trace(t.kernel, t.kv_tiles, warps, t.roles))
    lds = {e.line for w in range(8) for e in t.warps[w]
           if isinstance(e, AsyncOp) and e.kind == "tmem_ld"}
    mma_warp = {e.line for e in t.warps[12] if isinstance(e, AsyncOp)}
    hits = [f for f in r.races if set(f.lines) & lds and set(f.lines) & mma_warp]
    assert hits, r.summary()


# Found by this checker (2026-12-02) on the emulator's traces: in the kernels with an online
# max (FP8 P, two-level P) the softmax warps' O rescale issued tcgen05.ld of O_j, then
# tcgen05.st of the rescaled chunk, with no tcgen05.wait::ld between them (PTX ISA 9.7.16.8.3:
# the destination registers are valid only after tcgen05.wait::ld) and none before the P_j
# arrive that lets PV_j write O_j: races ld/st and PV/ld. The path is data dependent (only
# stages whose max grew rescale), so the trace shows it where the emulated data took it.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128"])
def test_other_sm100a_forwards_pass_with_in_order_issue(name):
    run = pytest.importorskip("fp4gen.lowering.emulator.run")
    src = (ROOT / "generated" / f"{name}_sm100a.py").read_text()
    t = run.emulate_forward(src, seqlen_q=256, seqlen_k=256, strict_aligned=False).trace
    r = protocol.check_protocol(t)
    assert r.exhaustive and r.findings == [], r.summary()


# --- the real backward traces: sm100_bwd_causal_d128, every CTA of a 256 x 256 causal problem -----
# (~80 s of emulation, once per session, plus one cached compile)
_BWD = {}


def _backward_traces():
    run = pytest.importorskip("fp4gen.lowering.emulator.run")
    if not _BWD:
        src = (ROOT / "generated" / "sm100_bwd_causal_d128_sm100a.py").read_text()
        _BWD["traces"] = run.emulate_backward(src, seqlen_q=256, seqlen_k=256, seed=0).traces
    return _BWD["traces"]


@pytest.mark.slow
def test_sm100_backward_real_traces_pass_with_in_order_issue():
    traces = _backward_traces()
    assert len(traces) == 2  # one CTA per 128 keys
    for t in traces:
        r = protocol.check_protocol(t)
        assert r.exhaustive and r.findings == [], r.summary()


@pytest.mark.slow
def test_sm100_backward_trace_without_the_compute_warps_first_arrive_deadlocks():
    # planted in the last CTA's trace (one query tile): the compute warps' first mbarrier arrive
    # is dropped. The MMA warp waits on that barrier (its init count is the compute warps'
    # 4 x 32 lanes), so it blocks there for ever: a deadlock naming that wait.
    t = _backward_traces()[-1]
    compute = [w for w, role in t.roles.items() if role == "compute"]
    (mma,) = [w for w, role in t.roles.items() if role == "mma"]
    first = next(e for e in t.warps[compute[0]] if isinstance(e, Arrive))
    waits = [e for e in t.warps[mma] if isinstance(e, Wait) and e.bar == first.bar]
    assert waits, "the MMA warp waits on the compute warps' first arrive's barrier"
    warps = {}
    for w, evs in t.warps.items():
        if w in compute:
            i = next(i for i, e in enumerate(evs) if isinstance(e, Arrive))
            assert evs[i].bar == first.bar
            evs = evs[:i] + evs[i + 1:]
        warps[w] = list(evs)
    r = protocol.check_protocol(Trace(t.kernel, t.kv_tiles, warps, t.roles))
    assert r.exhaustive and r.deadlocks, r.summary()
    assert any(waits[0].line in f.lines and mma in f.warps for f in r.deadlocks), r.summary()
