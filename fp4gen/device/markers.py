"""Performance-monitor markers a kernel emits (PTX ``pmevent N``, SASS ``PMTRIG 1 << N``) so
that the static performance model (``fp4gen.lowering.perf``) can tell code apart that the
SASS structure alone cannot. One instruction each, outside the per-score code.

- ``PER_CTA_LOOP``: inside a loop that runs a fixed number of times per CTA (the epilogue
  over query stages), so the model does not take it for a per-KV-tile loop;
- ``REBASE``: at the head of the guard's rare headroom-rebase branch (a cold region).
"""
from __future__ import annotations

PER_CTA_LOOP = 6
REBASE = 7


def pmtrig_events(operands: str) -> set:
    """The event numbers a SASS ``PMTRIG`` instruction's first operand (a bit mask) raises."""
    try:
        mask = int(operands.split(",")[0].strip().rstrip(";").strip(), 0)
    except ValueError:
        return set()
    return {bit for bit in range(16) if mask >> bit & 1}
