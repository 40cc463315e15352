"""The synchronisation trace of one emulated CTA: what each warp did, in program order.

The emulator (``machine``) records one ``Event`` per warp instruction that synchronises or
touches shared or tensor memory; ``fp4gen.lowering.protocol`` replays the traces under every
interleaving the ISA allows. A trace is schedule-independent as long as no warp's control
flow depends on timing (true of these kernels: every wait is a blocking parity wait); the
emulator checks that by comparing traces from two different schedules.

Spans are half-open. Shared memory is addressed in bytes of the CTA's shared window;
tensor memory as (lanes, columns) rectangles of 32-bit cells, columns relative to column 0
of the allocation (not to the allocated base address).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SmemSpan:
    lo: int
    hi: int  # bytes, half-open

    def overlaps(self, other) -> bool:
        return isinstance(other, SmemSpan) and self.lo < other.hi and other.lo < self.hi


@dataclass(frozen=True)
class TmemSpan:
    lane_lo: int
    lane_hi: int
    col_lo: int
    col_hi: int  # half-open in both

    def overlaps(self, other) -> bool:
        return (isinstance(other, TmemSpan) and self.lane_lo < other.lane_hi
                and other.lane_lo < self.lane_hi and self.col_lo < other.col_hi
                and other.col_lo < self.col_hi)


Span = SmemSpan | TmemSpan


@dataclass(frozen=True)
class Event:
    """Base: ``line`` is the PTX source line of the instruction, for messages."""
    line: int


@dataclass(frozen=True)
class BarrierInit(Event):
    bar: int  # shared-memory byte address of the mbarrier
    count: int  # expected arrivals per phase


@dataclass(frozen=True)
class Arrive(Event):
    """mbarrier.arrive[.expect_tx] by ``count`` lanes; ``tx`` bytes expected (arrive.expect_tx)."""
    bar: int
    count: int = 1
    tx: int = 0


@dataclass(frozen=True)
class ExpectTx(Event):
    bar: int
    tx: int


@dataclass(frozen=True)
class Wait(Event):
    """A blocking wait (try_wait/test_wait loop) on the phase of parity ``parity``."""
    bar: int
    parity: int


@dataclass(frozen=True)
class AsyncOp(Event):
    """An asynchronous operation issued by this warp: it reads and writes its spans at some
    time between issue and completion.

    kind: "tma" (completes by complete_tx of ``tx`` bytes on ``bar``), "mma" and "cp"
    (tcgen05 ops of the tensor pipe: complete before the next ``Commit`` of this warp
    arrives), "tmem_ld"/"tmem_st" (complete at this warp's next ``TmemWait`` of that kind).
    ``op`` numbers the CTA's async ops in issue order."""
    op: int
    kind: str
    reads: tuple = ()
    writes: tuple = ()
    bar: int | None = None
    tx: int = 0


@dataclass(frozen=True)
class Commit(Event):
    """tcgen05.commit: one arrival on ``bar`` once every tcgen05 op this warp issued before it
    has completed."""
    bar: int


@dataclass(frozen=True)
class TmemWait(Event):
    kind: str  # "ld" | "st"


@dataclass(frozen=True)
class Access(Event):
    """A synchronous access by the warp's threads (ld/st.shared, st to SMEM before a fence)."""
    write: bool
    spans: tuple = ()


@dataclass(frozen=True)
class NamedBarrier(Event):
    """bar.sync / bar.arrive on barrier ``id`` with ``count`` threads (``arrive``: no wait)."""
    id: int
    count: int
    arrive: bool = False


@dataclass(frozen=True)
class Fence(Event):
    kind: str  # the PTX opcode, e.g. "fence.proxy.async.shared::cta", "tcgen05.fence::before_thread_sync"


@dataclass
class Trace:
    """Per warp (0..15), the events in program order, plus what the run was."""
    kernel: str
    kv_tiles: int
    warps: dict[int, list[Event]] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)  # warp -> role name, when known
    # warp -> [(PTX line, "inc" | "dec", registers)] of its setmaxnreg (no effect in the emulator)
    setmaxnreg: dict[int, list] = field(default_factory=dict)
    schedule: str = ""  # the emulator's async-completion schedule ("eager" | "lazy"), when emulated
