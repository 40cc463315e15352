"""plan_events + simulate: the paper's schedule runs; broken schedules are caught."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fp4gen.ir.passes import SimulationError, plan_kernel, simulate
from fp4gen.ir.plan import BarrierRef

import specs


@pytest.fixture(scope="module")
def paper():
    return plan_kernel(specs.paper_fp4(), debug=True)


def one(sim, name, stage, tile):
    (s,) = sim.of(name, stage, tile)
    return s


def test_paper_schedule_simulates(paper):
    sim = simulate(paper, 4)
    assert len(sim.of("QK")) == 8 and len(sim.of("PV_2")) == 8 and len(sim.of("EPILOGUE")) == 2


def test_halves_let_pv_start_before_the_second_half(paper):
    sim = simulate(paper, 3)
    for s in (0, 1):
        pv1, pub2 = one(sim, "PV_1", s, 0), one(sim, "PUBLISH_P2", s, 0)
        assert pv1.start < pub2.end  # PV on keys 0..63 overlaps writing keys 64..127
        # TMEM ownership: the next QK^T of the stage writes S only after PV consumed both halves
        assert one(sim, "QK", s, 1).start >= one(sim, "PV_2", s, 0).end


def test_two_stages_overlap(paper):
    sim = simulate(paper, 3)
    # softmax of stage 1 runs while stage 0's P is consumed (ping-pong)
    assert one(sim, "LOAD_S", 1, 0).start < one(sim, "PV_2", 0, 0).start


def test_whole_publish_waits_for_all_of_p():
    p = plan_kernel(specs.sage3(), debug=True)
    sim = simulate(p, 3)
    assert one(sim, "PV", 0, 0).start >= one(sim, "PUBLISH_P", 0, 0).end


def _mutate(plan, fn):
    return replace(plan, events=tuple(fn(e) for e in plan.events))


def test_missing_signal_deadlocks(paper):
    bad = _mutate(paper, lambda e: replace(e, signals=()) if e.name == "PUBLISH_P2" else e)
    with pytest.raises(SimulationError, match="deadlock") as ei:
        simulate(bad, 3)
    assert any("P_full" in n for n in ei.value.notes)


def test_qk_before_pv_is_a_write_after_read(paper):
    # Issue QK^T of tile j before PV of tile j-1 and drop the S_free wait: QK^T overwrites
    # S while P of the previous tile still lives there.
    mma = [e for e in paper.events if e.role == "mma"]
    others = [e for e in paper.events if e.role != "mma"]
    reordered = []
    for s in (0, 1):
        mine = [e for e in mma if e.stage == s]
        qk = [replace(e, waits=tuple(w for w in e.waits if not w.barrier.startswith("S_free")))
              for e in mine if e.name in ("CP_SF_QK", "QK")]
        reordered += qk + [e for e in mine if e.name not in ("CP_SF_QK", "QK")]
    bad = replace(paper, events=tuple(reordered + others))
    with pytest.raises(SimulationError, match="hazard") as ei:
        simulate(bad, 3)
    text = str(ei.value)
    assert "write-after-read" in text and "QK[0](j=1) writes S0" in text


def test_pv_without_p_barrier_is_a_read_after_write(paper):
    bad = _mutate(paper, lambda e: replace(e, waits=tuple(w for w in e.waits if not w.barrier.startswith("P_half1")))
                  if e.name == "PV_1" else e)
    with pytest.raises(SimulationError, match="read-after-write"):
        simulate(bad, 3)


def test_scale_copy_without_drain_wait_is_caught(paper):
    # copying stage 1's QK scales into S0 before softmax 0 has read its scores
    bad = _mutate(paper, lambda e: replace(e, waits=(BarrierRef("K_full"),)) if e.name == "CP_SF_QK" else e)
    with pytest.raises(SimulationError, match="hazard"):
        simulate(bad, 3)


def test_sm90_schedule():
    p = plan_kernel(specs.sm90_fp8(), debug=True)
    sim = simulate(p, 3)
    # the tensor core is shared: no two wgmma events overlap in time
    mm = sorted((s for s in sim.spans if s.event.resource == "tensor"), key=lambda s: s.start)
    assert all(a.end <= b.start for a, b in zip(mm, mm[1:]))
    # intra-warpgroup overlap: PV(j-1) is issued after QK(j)
    assert one(sim, "PV", 0, 0).start >= one(sim, "QK", 0, 1).end


def test_reference_has_no_events():
    p = plan_kernel(specs.reference())
    assert p.events == () and simulate(p).spans == ()
