"""The ring's overlap schedule (gloo, reference backend), in fp4gen.parallel's debug mode.

The ring must issue step s + 1's K/V transfer before step s's block kernels and wait for it
after them (dK/dV in the backward: sent after step s's kernels, waited after step s + 1's).
Timing cannot show that on the CPU, so debug mode records the order (``debug_trace``) and makes
the two ways of getting it wrong observable: a received buffer holds NaN until its wait (a
block that reads it earlier computes NaN), and a send buffer written while in flight raises.
Each check has a planted fault (tests/parallel/harness.py ``_faults``) that it must catch.
"""
from __future__ import annotations

import pytest
import torch

from . import harness
from .test_ring_gloo import _assert_fp32_close


def schedule_errors(trace, world: int) -> list:
    """What in one rank's trace breaks the overlap schedule (empty: none)."""
    pos = {}
    for i, e in enumerate(trace):
        if e in pos:
            return [f"event {e} twice"]
        pos[e] = i
    errs = []

    def order(*events):
        idx = [pos.get(e) for e in events]
        if None in idx:
            errs.append(f"missing {[e for e, i in zip(events, idx) if i is None]}")
        elif idx != sorted(idx):
            errs.append(" < ".join(map(str, events)) + f" does not hold (positions {idx})")

    for phase in ("fwd", "bwd"):  # K/V of step s + 1: issued before step s's kernels, waited after
        for s in range(world - 1):
            order(("start", phase, s), ("compute", phase, s), ("finish", phase, s), ("compute", phase, s + 1))
        if ("start", phase, world - 1) in pos:
            errs.append(f"{phase}: a transfer after the last step")
    for s in range(world - 1):  # dK/dV: after step s's kernels, in flight during step s + 1's
        order(("compute", "bwd", s), ("start", "dkv", s), ("compute", "bwd", s + 1), ("finish", "dkv", s))
    if world > 1:  # the last one brings every block's gradients home
        order(("compute", "bwd", world - 1), ("start", "dkv", world - 1), ("finish", "dkv", world - 1))
    return errs


def _case(name, **kw):
    return dict(dict(name=name, spec="fp32", S=384, H=2, causal=True, mode="ring", debug=True), **kw)


@pytest.mark.parametrize("world", [2, 3])
def test_next_transfer_is_issued_before_the_block(tmp_path, world):
    res = harness.run(world, [_case("t")], tmp_path)["t"]
    traces = res["stats"]["traces"]
    assert len(traces) == world and traces[0] == res["stats"]["trace"]
    for rank, trace in enumerate(traces):
        assert schedule_errors(trace, world) == [], (rank, trace)
    # debug mode's late delivery changed nothing: no block read a buffer before its wait
    _assert_fp32_close(res)


def test_a_blocking_ring_breaks_the_schedule(tmp_path):
    """The planted fault: every transfer waited inside ``start``. Its results are right (that is
    why only the trace can catch it), the schedule check fails."""
    res = harness.run(2, [_case("t")], tmp_path, fault="sync_ring")["t"]
    _assert_fp32_close(res)
    errs = schedule_errors(res["stats"]["trace"], 2)
    assert any("('compute', 'fwd', 0) < ('finish', 'fwd', 0)" in e for e in errs), errs


def test_reading_a_buffer_before_its_wait_is_caught(tmp_path):
    """The planted fault: ``finish`` hands out the receive buffers and waits only later. In debug
    mode they still hold NaN, so the step that reads them computes NaN."""
    res = harness.run(2, [_case("t")], tmp_path, fault="late_wait")["t"]
    assert torch.isnan(res["cp"]["o"]).any() and torch.isnan(res["cp"]["dk"]).any()
    with pytest.raises(AssertionError):
        _assert_fp32_close(res)


def test_writing_a_buffer_in_flight_is_caught(tmp_path):
    """The planted fault: K/V decoded in place, into the buffer that is being sent on."""
    with pytest.raises(Exception, match="changed while it was in flight"):
        harness.run(2, [_case("t")], tmp_path, fault="inplace_decode")


def test_debug_trace_helpers():
    from fp4gen import parallel

    parallel.set_debug(True)
    try:
        parallel._trace("compute", "fwd", 0)
        assert parallel.debug_trace() == [("compute", "fwd", 0)]
        t = torch.zeros(3)
        parallel._poison(t)
        assert torch.isnan(t).all()
        u = torch.zeros(3, dtype=torch.uint8)
        parallel._poison(u)
        assert u.tolist() == [255] * 3
    finally:
        parallel.set_debug(False)
    parallel._trace("compute", "fwd", 1)
    assert parallel.debug_trace() == []


def test_fp8_wire_under_late_delivery(tmp_path):
    """The FP8 exchange in debug mode: payload codes (uint8, poisoned to 0xFF, NaN in E4M3) and
    fp32 amaxes arrive only at the wait, and the result is still bit-for-bit the one of a run
    without debug mode."""
    cases = [_case("dbg", spec="fp8", S=512), _case("plain", spec="fp8", S=512, debug=False)]
    res = harness.run(2, cases, tmp_path)
    dbg, plain = res["dbg"], res["plain"]
    assert dbg["stats"]["exchange_fwd"]["k"].startswith("fp8")
    for trace in dbg["stats"]["traces"]:
        assert schedule_errors(trace, 2) == [], trace
    assert plain["stats"]["trace"] == []
    for n in harness.OUTPUTS:
        assert torch.equal(dbg["cp"][n], plain["cp"][n]), n
