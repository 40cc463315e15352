"""Execute one CTA of a parsed PTX kernel (``ptx.Module``) on the CPU.

Execution model: one ``Warp`` object per 32 threads, registers as numpy vectors of 32 lanes
(``uint32`` for ``.b32``/``.f32``, bools for predicates, ...). A warp executes the
instruction at the smallest program counter of its live lanes, for the lanes that are there
(min-PC reconvergence: for the forward-branching, structured code NVVM emits, lanes that split
at a branch meet again at the join point, which has the higher address). Warp-collective
instructions (``.sync.aligned``: tcgen05.ld/st/alloc, shfl.sync, elect.sync, vote) run once for
the lanes present.

Scheduling: round-robin over the 16 warps, each for a quantum of instructions or until it
blocks. A wait that does not succeed (``mbarrier.try_wait``, ``bar.sync``) is not retired: the
warp is parked with a readiness test and the instruction is executed again once the test
passes, so a try_wait loop never spins. ``mbarrier.test_wait`` (non-blocking by definition)
returns its result; a failing test_wait parks the warp until some shared state changes.
If every live warp is parked and no asynchronous operation is pending, ``EmulationError``
names each warp's PTX line and what it waits for.

Asynchronous operations (TMA loads, tcgen05.mma/cp/commit, and with the ``lazy`` schedule
tcgen05.st) complete in issue order per issuing warp (PTX ISA 9.7.16.6.2 "Pipelined tcgen05
instructions": mma/cp/commit of one thread execute in order; 9.7.9.25.1.2 "mbarrier based
mechanism" for the TMA's complete_tx). ``schedule="eager"`` completes each at issue;
``schedule="lazy"`` completes one only when no warp can run (the oldest first), i.e. as late as
the synchronisation allows, so a read that is not ordered after its producer sees stale data;
a lazy tcgen05.st lands at its warp's ``tcgen05.wait::st`` (9.7.16.8.5), or at the latest when
the warp exits or TMEM is deallocated. tcgen05.ld reads TMEM at issue (its registers are
ordered by true dependencies, 9.7.16.6.4.5; the anti-dependency its wait::ld covers is the
protocol checker's business, from the trace).

``.aligned`` instructions (tcgen05.ld/st/alloc/wait, bar.sync, setmaxnreg, ...) must be executed
by the whole warp; executed by part of it (a per-thread branch around them) they raise
``EmulationError``, or with ``strict_aligned=False`` run for the lanes present and are listed in
``divergent_aligned``.

Arithmetic follows the PTX ISA per instruction (section named at each handler); fp32 through
numpy float32, which rounds to nearest even like ``.rn``. Deviations stated, not hidden:

* ``ex2.approx``/``lg2.approx`` use numpy's float32 ``exp2``/``log2`` (within about an ulp of
  the exact value); the hardware's approximation error (bounded in the PTX ISA's ex2 / lg2
  sections, not reproduced) is a tolerance of the comparison, so a result that hinges on the
  last bit of an ex2 (a code at an E2M1 rounding midpoint) may differ from the hardware's;
* ``add``/``mul`` without a rounding modifier are rounded separately; ptxas may contract them
  into an FMA on the hardware (a difference only at rounding ties);
* ``fma.rn.f32`` is computed exactly (a double-precision sum with its two-sum error term).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from . import ptx as P
from . import trace as T

W = 32  # lanes per warp
LANES = np.arange(W, dtype=np.uint32)
ALL = np.ones(W, dtype=bool)
PARAM_GENERIC = 0x7F00_0000_0000  # generic address of the kernel parameter space
SHARED_GENERIC = 0x7E00_0000_0000  # generic address of the CTA's shared window
LOCAL_GENERIC = 0x7D00_0000_0000  # generic address of the executing thread's local window


# floating-point exceptions are the kernel's business (NaN/inf propagate as on the hardware):
# numpy's warnings are silenced once in Machine.run, not per instruction
_QUIET = contextlib.nullcontext()


class EmulationError(RuntimeError):
    pass


class _Block:
    """Returned by a handler that cannot retire yet: ``ready()`` says when to retry."""
    __slots__ = ("what", "ready")

    def __init__(self, what: str, ready: Callable[[], bool]):
        self.what, self.ready = what, ready


_DT = {"pred": np.bool_, "b8": np.uint8, "u8": np.uint8, "s8": np.int8, "b16": np.uint16,
       "u16": np.uint16, "s16": np.int16, "f16": np.float16, "bf16": np.uint16, "b32": np.uint32,
       "u32": np.uint32, "s32": np.int32, "f32": np.float32, "b64": np.uint64, "u64": np.uint64,
       "s64": np.int64, "f64": np.float64, "f32x2": np.uint64, "bf16x2": np.uint32,
       "f16x2": np.uint32, "e4m3x2": np.uint16, "e5m2x2": np.uint16, "e2m1x2": np.uint8,
       "ue8m0x2": np.uint16}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_STORE = {"pred": np.bool_, "b8": np.uint8, "u8": np.uint8, "s8": np.uint8, "b16": np.uint16,
          "u16": np.uint16, "s16": np.uint16, "f16": np.uint16, "bf16": np.uint16, "b32": np.uint32,
          "u32": np.uint32, "s32": np.uint32, "f32": np.uint32, "b64": np.uint64, "u64": np.uint64,
          "s64": np.uint64, "f64": np.uint64}


def _conv(a: np.ndarray, dt) -> np.ndarray:
    """Reinterpret/resize raw bits ``a`` as ``dt`` (truncate or zero/sign-extend by ``a``'s type)."""
    dt = np.dtype(dt)
    if a.dtype == dt:
        return a
    if dt == np.bool_:
        return a != 0
    if a.dtype == np.bool_:
        return a.astype(dt)
    if a.dtype.itemsize == dt.itemsize:
        return a.view(dt)
    if a.dtype.kind == "f":
        a = a.view(_UNSIGNED[a.dtype.itemsize])
    tmp = a.astype(_SIGNED[dt.itemsize] if a.dtype.kind == "i" else _UNSIGNED[dt.itemsize])
    return tmp.view(dt)


def _ftz(x: np.ndarray) -> np.ndarray:
    # .ftz: subnormal inputs and results become sign-preserving zero (PTX ISA 9.7.3 "Floating
    # point instructions", subnormal numbers)
    return np.where(np.abs(x) < np.float32(2.0 ** -126), np.copysign(np.float32(0), x), x).astype(np.float32)


def _fma_f32(a, b, c) -> np.ndarray:
    """fma.rn.f32 (PTX ISA 9.7.3.6 fma): a*b+c rounded once. The product is exact in float64;
    the float64 sum is corrected by its two-sum error where it would round to a float32 tie."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    with _QUIET:
        s = p + c64
        bp = s - p
        err = (p - (s - bp)) + (c64 - bp)
        r = s.astype(np.float32)
        # a tie in float32 rounding that the double rounding decided without the error term
        lo = np.nextafter(r, np.float32(-np.inf)).astype(np.float64)
        hi = np.nextafter(r, np.float32(np.inf)).astype(np.float64)
        r64 = r.astype(np.float64)
        tie = ((s == (r64 + lo) / 2) | (s == (r64 + hi) / 2)) & (err != 0) & np.isfinite(s)
        if tie.any():
            s2 = np.where(tie, np.nextafter(s, s + err), s)
            r = np.where(tie, s2.astype(np.float32), r)
    return r.astype(np.float32)


def _fma_f64(a, b, c) -> np.ndarray:
    """fma.rn.f64: a*b+c rounded once, per lane in exact rational arithmetic (rare: the
    correctly rounded divisions of the two-level P path)."""
    from fractions import Fraction

    out = np.empty(W, dtype=np.float64)
    for i in range(a.size):
        x, y, z = float(a[i]), float(b[i]), float(c[i])
        if all(map(np.isfinite, (x, y, z))):
            try:
                out[i] = float(Fraction(x) * Fraction(y) + Fraction(z))
            except OverflowError:
                out[i] = x * y + z
        else:
            out[i] = x * y + z
    return out


class MBarrier:
    """PTX ISA 9.7.13.15 (mbarrier): a phase completes when its pending arrival count and its
    transaction count are both zero; the count then resets to the init count and the phase
    number advances. ``try_wait.parity p`` succeeds once the phase of parity p is complete,
    i.e. while the current phase's parity differs from p."""
    __slots__ = ("addr", "count", "pending", "tx", "phase")

    def __init__(self, addr, count):
        self.addr, self.count, self.pending, self.tx, self.phase = addr, count, count, 0, 0

    def _check(self):
        if self.pending <= 0 and self.tx == 0:
            if self.pending < 0:
                raise EmulationError(f"mbarrier 0x{self.addr:x}: {-self.pending} arrivals more than "
                                     f"its count {self.count} in phase {self.phase}")
            self.phase += 1
            self.pending = self.count

    def arrive(self, n=1, tx=0):
        self.tx += tx  # expect-tx before the arrive-on (arrive.expect_tx)
        self.pending -= n
        self._check()

    def expect_tx(self, tx):
        self.tx += tx

    def complete_tx(self, tx):
        self.tx -= tx
        self._check()

    def done(self, parity: int) -> bool:
        return (self.phase & 1) != (parity & 1)

    def __str__(self):
        return (f"mbarrier 0x{self.addr:x} (phase {self.phase}, {self.pending} of {self.count} "
                f"arrivals pending, tx {self.tx})")


class Warp:
    def __init__(self, idx: int):
        self.idx = idx
        self.regs: dict = {}
        self.live = ALL.copy()
        self.uniform = True
        self.pc = 0
        self.lane_pc = np.zeros(W, dtype=np.int64)
        self.blocked: Optional[_Block] = None
        self.blocked_at = 0
        self.events: list = []
        self.count = 0  # warp instructions executed
        self.st_queue: list = []  # lazy tcgen05.st awaiting wait::st
        self.bulk_groups: list = [[]]  # lazy TMA stores by bulk group; the last one is open
        self.setmaxnreg: list = []
        self.park_after: Optional[_Block] = None
        self.local: Optional[np.ndarray] = None  # (32, local bytes): each thread's .local memory

    @property
    def done(self):
        return not self.live.any()


@dataclasses.dataclass
class _Async:
    op: int
    warp: int
    kind: str
    run: Callable  # () -> None; completes the operation
    event_index: Optional[int] = None


class GlobalMemory:
    """A flat byte array at a high base address (so 32-bit truncation of a pointer faults)."""

    BASE = 0x1_0000_0000

    def __init__(self):
        self.chunks = []
        self.size = 0
        self.buf = np.zeros(0, dtype=np.uint8)

    def alloc(self, data: bytes | np.ndarray, align: int = 256) -> int:
        off = (self.size + align - 1) // align * align
        arr = np.frombuffer(bytes(data), dtype=np.uint8) if not isinstance(data, np.ndarray) else \
            data.reshape(-1).view(np.uint8)
        new = np.zeros(off + arr.size, dtype=np.uint8)
        new[:self.size] = self.buf[:self.size]
        new[off:off + arr.size] = arr
        self.buf, self.size = new, off + arr.size
        return self.BASE + off

    def _idx(self, addrs: np.ndarray, n: int) -> np.ndarray:
        off = addrs.astype(np.int64) - self.BASE
        if off.size and (off.min() < 0 or off.max() + n > self.size):
            bad = [hex(int(a)) for a in addrs[(off < 0) | (off + n > self.size)][:4]]
            raise EmulationError(f"global access outside every allocation at {bad}")
        return off

    def read(self, addr: int, n: int) -> bytes:
        off = self._idx(np.array([addr], dtype=np.uint64), n)[0]
        return self.buf[off:off + n].tobytes()

    def write(self, addr: int, data: bytes):
        off = self._idx(np.array([addr], dtype=np.uint64), len(data))[0]
        self.buf[off:off + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def gather(self, addrs: np.ndarray, n: int) -> np.ndarray:
        off = self._idx(addrs, n)
        return self.buf[off[:, None] + np.arange(n)]

    def scatter(self, addrs: np.ndarray, data: np.ndarray):
        off = self._idx(addrs, data.shape[1])
        self.buf[off[:, None] + np.arange(data.shape[1])] = data

    def view(self, addr: int, n: int) -> np.ndarray:
        off = addr - self.BASE
        return self.buf[off:off + n]


def _spans(addrs: np.ndarray, n: int) -> tuple:
    """Merged half-open byte spans touched by accesses of ``n`` bytes at ``addrs``."""
    if addrs.size == 0:
        return ()
    a = np.unique(addrs.astype(np.int64))
    out, lo, hi = [], int(a[0]), int(a[0]) + n
    for x in a[1:]:
        x = int(x)
        if x <= hi:
            hi = max(hi, x + n)
        else:
            out.append(T.SmemSpan(lo, hi))
            lo, hi = x, x + n
    out.append(T.SmemSpan(lo, hi))
    return tuple(out)


class _TensorOps:
    """The tensor-memory / TMA semantics (emu-tensor's modules), looked up when first used so
    a test can run the machine on snippets without them."""

    def __getattr__(self, name):
        if name in ("tmem_load", "tmem_store", "tmem_copy", "mma"):
            from . import tensor
            return getattr(tensor, name)
        if name == "tma_load":
            from . import tma
            return tma.tma_load
        raise AttributeError(name)


class Machine:
    """One CTA of ``module``.

    smem: an object with ``.data`` (bytearray of the shared window), ``read``, ``write``;
    tmem: emu-tensor's ``TensorMemory`` (or anything the ``ops`` functions accept);
    gmem: ``GlobalMemory``; params: the kernel parameter bytes in the PTX's parameter layout
    (``param_offsets``); tensor_maps: param index -> tensor map for ``cp.async.bulk.tensor``;
    ops: an object with ``tmem_load``, ``tmem_store``, ``tmem_copy``, ``mma``, ``tma_load``.
    """

    def __init__(self, module: P.Module, *, smem, tmem=None, gmem: Optional[GlobalMemory] = None,
                 params: bytes = b"", ctaid=(0, 0, 0), nctaid=(1, 1, 1), ntid=None,
                 schedule: str = "eager", tensor_maps: Optional[dict] = None, ops=None,
                 trace: Optional[T.Trace] = None, quantum: int = 2000,
                 max_instructions: int = 50_000_000, strict_aligned: bool = True):
        if schedule not in ("eager", "lazy"):
            raise ValueError(f"schedule must be 'eager' or 'lazy', not {schedule!r}")
        self.m = module
        self.smem = smem
        self.sview = np.frombuffer(smem.data, dtype=np.uint8) if smem is not None else None
        self.tmem = tmem
        self.gmem = gmem or GlobalMemory()
        self.ntid = ntid or (module.reqntid[0] if module.reqntid else 512)
        self.params = bytearray(params)
        self.param_off = param_offsets(module)
        need = max((self.param_off[p.name] + p.size for p in module.params), default=0)
        if len(self.params) < need:
            self.params += bytes(need - len(self.params))
        self.ctaid, self.nctaid = ctaid, nctaid
        self.schedule = schedule
        self.tensor_maps = tensor_maps or {}
        self.ops = ops or _TensorOps()
        self.trace = trace if trace is not None else T.Trace(kernel=module.entry, kv_tiles=0)
        self.quantum = quantum
        # .aligned (PTX ISA 9.7.16.8.3 tcgen05.ld, 9.7.16.8.4 tcgen05.st, 9.7.16.7.1 alloc,
        # 9.7.13 bar/barrier): every thread of the warp executes the same instruction; in
        # divergent code the behaviour is undefined. strict: a partial warp is an error; not
        # strict: the lanes present act alone (tcgen05.st leaves the other lanes' cells as they
        # were), what the source presumably meant.
        self.strict_aligned = strict_aligned
        self.max_instructions = max_instructions
        self.nwarps = (self.ntid + W - 1) // W
        self.warps = [Warp(i) for i in range(self.nwarps)]
        for w in self.warps:
            n = min(W, self.ntid - W * w.idx)
            w.live[n:] = False
            self.trace.warps.setdefault(w.idx, w.events)
            w.events = self.trace.warps[w.idx]
        self.mbars: dict = {}
        self.named: dict = {}  # barrier id -> [arrived, expected, generation]
        self.pending: deque = deque()  # _Async in issue order
        self.op_counter = 0
        self.progress = 0  # bumped by every shared-state change (test_wait parking)
        self.shared_sym = shared_layout(module)
        self.local_sym, self.local_size = local_layout(module)
        self.log: list = []  # (warp, line, note) for setmaxnreg and other recorded no-ops
        self.divergent_aligned: list = []  # messages: .aligned instructions run by partial warps
        self._store_dt = {}
        self.code = [self._compile(i) for i in module.instrs]

    # ------------------------------------------------------------------ registers

    def _store_type(self, name: str):
        dt = self._store_dt.get(name)
        if dt is None:
            t = self.m.reg_type(name)[1:]
            dt = self._store_dt[name] = np.dtype(_STORE[t])
        return dt

    def _reader(self, op, dt) -> Callable:
        dt = np.dtype(dt)
        if isinstance(op, P.Reg):
            name = op.name
            sdt = self._store_type(name)
            zero = np.zeros(W, dtype=sdt)

            if sdt == dt:
                def rd_same(w):
                    a = w.regs.get(name)
                    return zero if a is None else a
                return rd_same

            if sdt.itemsize == dt.itemsize and sdt != np.bool_ and dt != np.bool_:
                zv = zero.view(dt)

                def rd_view(w):
                    a = w.regs.get(name)
                    return zv if a is None else a.view(dt)
                return rd_view

            def rd(w):
                a = w.regs.get(name)
                return _conv(zero if a is None else a, dt)
            return rd
        if isinstance(op, P.Imm):
            if op.float_bits == 32:
                v = np.full(W, op.value, dtype=np.uint32).view(np.float32)
            elif op.float_bits == 64:
                v = np.full(W, op.value, dtype=np.uint64).view(np.float64)
            else:
                v = None
            if v is not None:
                const = v.astype(dt) if dt.kind == "f" else _conv(v, dt)
            elif dt.kind == "f":
                const = np.full(W, op.value, dtype=dt)
            elif dt == np.bool_:
                const = np.full(W, bool(op.value))
            else:
                const = np.full(W, op.value & ((1 << (8 * dt.itemsize)) - 1),
                                dtype=_UNSIGNED[dt.itemsize]).view(dt)
            return lambda w: const
        if isinstance(op, P.Sym):
            return self._sym_reader(op.name, dt)
        if isinstance(op, P.Not):
            inner = self._reader(op.reg, np.bool_)
            return lambda w: ~inner(w)
        if isinstance(op, P.Vec):  # mov.b64 d, {a, b}: a in the low half
            parts = [self._reader(x, _UNSIGNED[dt.itemsize // len(op.items)]) for x in op.items]
            sh = 8 * dt.itemsize // len(op.items)
            udt = _UNSIGNED[dt.itemsize]

            def rdv(w):
                acc = np.zeros(W, dtype=udt)
                for i, r in enumerate(parts):
                    acc |= r(w).astype(udt) << udt(i * sh)
                return acc.view(dt)
            return rdv
        raise EmulationError(f"cannot read operand {op}")

    def _sym_reader(self, name, dt):
        m = P.SPECIAL_REGS.match(name)
        if m:
            base, axis = m.group(1), (m.group(2) or ".x")[1:]
            ax = "xyz".index(axis)

            def special(w):
                if base == "tid":
                    v = (w.idx * W + LANES) if ax == 0 else np.zeros(W, np.uint32)
                elif base == "ntid":
                    v = np.full(W, self.ntid if ax == 0 else 1, np.uint32)
                elif base == "ctaid":
                    v = np.full(W, self.ctaid[ax], np.uint32)
                elif base == "nctaid":
                    v = np.full(W, self.nctaid[ax], np.uint32)
                elif base == "laneid":
                    v = LANES.copy()
                elif base == "warpid":
                    v = np.full(W, w.idx, np.uint32)
                elif base in ("clock", "clock64", "globaltimer"):
                    v = np.full(W, sum(x.count for x in self.warps), np.uint64)
                elif base == "dynamic_smem_size":
                    v = np.full(W, len(self.smem.data), np.uint32)
                else:
                    raise EmulationError(f"special register {name} is not emulated")
                return _conv(v.astype(np.uint64), dt) if dt.itemsize == 8 else _conv(v.astype(np.uint32), dt)
            return special
        if name in self.param_off:
            v = np.full(W, self.param_off[name], dtype=np.uint64)
            return lambda w: _conv(v, dt)
        if name in self.shared_sym:
            v = np.full(W, self.shared_sym[name], dtype=np.uint64)
            return lambda w: _conv(v, dt)
        if name in self.local_sym:
            v = np.full(W, self.local_sym[name], dtype=np.uint64)
            return lambda w: _conv(v, dt)
        raise EmulationError(f"unknown symbol {name}")

    def _writer(self, op) -> Callable:
        if isinstance(op, P.Sym) and op.name == "_":
            return lambda w, val, m, full: None
        if not isinstance(op, P.Reg):
            raise EmulationError(f"cannot write operand {op}")
        name = op.name
        sdt = self._store_type(name)
        isz, pred = sdt.itemsize, sdt == np.bool_

        def wr(w, val, m, full):
            # register arrays are never modified in place, so they may be shared
            vd = val.dtype
            if vd == sdt:
                v = val
            elif vd.itemsize == isz and vd != np.bool_ and not pred:
                v = val.view(sdt)
            else:
                v = _conv(val, sdt)
            if full:
                w.regs[name] = v
            else:
                old = w.regs.get(name)
                if old is None:
                    old = np.zeros(W, dtype=sdt)
                w.regs[name] = np.where(m, v, old)
        return wr

    # ------------------------------------------------------------------ compile

    def _compile(self, ins: P.Instr):
        """-> (kind, handler): kind 'op' | 'bra' | 'exit'."""
        op = ins.opcode
        head = op.split(".")[0]
        if head == "bra":
            return ("bra", None)
        if head in ("ret", "exit"):
            return ("exit", None)
        fn = getattr(self, "_c_" + head.replace("::", "_"), None)
        if head == "tcgen05":
            fn = self._c_tcgen05
        elif head in ("cp",) and op.startswith("cp.async.bulk.tensor") and ins.parts[5] == "global":
            fn = self._c_tma_store
        elif head in ("cp",) and op.startswith("cp.async.bulk.tensor"):
            fn = self._c_tma
        elif op.startswith(("cp.async.bulk.commit_group", "cp.async.bulk.wait_group")):
            fn = self._c_bulk_group
        if fn is None:
            return ("op", self._unsupported(ins))
        try:
            return ("op", fn(ins))
        except NotImplementedError as e:
            return ("op", self._unsupported(ins, str(e)))

    def _unsupported(self, ins, why=""):
        def h(w, m, full):
            raise EmulationError(f"warp {w.idx}, PTX line {ins.line}: `{ins.text}` is not emulated"
                                 + (f" ({why})" if why else ""))
        return h

    # --- integer / float arithmetic (PTX ISA 9.7.1 integer, 9.7.3 floating point) --------

    def _arith(self, ins, nsrc, f, dt=None):
        parts = ins.parts
        dt = dt or _DT[parts[-1]]
        srcs = [self._reader(o, dt) for o in ins.operands[1:1 + nsrc]]
        wr = self._writer(ins.operands[0])
        mods = set(parts[1:-1])
        ftz = "ftz" in mods and np.dtype(dt) == np.float32
        sat = "sat" in mods and np.dtype(dt) == np.float32
        if np.dtype(dt).kind == "f" and mods & {"rz", "rm", "rp"}:
            raise NotImplementedError(f"rounding {mods & {'rz', 'rm', 'rp'}} of {ins.opcode}")

        if not (ftz or sat):
            if nsrc == 2:
                s0, s1 = srcs

                def h2(w, m, full):
                    wr(w, f(s0(w), s1(w)), m, full)
                return h2
            if nsrc == 1:
                s0 = srcs[0]

                def h1(w, m, full):
                    wr(w, f(s0(w)), m, full)
                return h1

        def h(w, m, full):
            a = [s(w) for s in srcs]
            if ftz:
                a = [_ftz(x) for x in a]
            r = f(*a)
            if ftz:
                r = _ftz(r)
            if sat:  # .sat: clamp to [0, 1], NaN -> 0
                r = np.where(np.isnan(r), np.float32(0), np.clip(r, 0, 1)).astype(np.float32)
            wr(w, r, m, full)
        return h

    def _c_add(self, ins):
        if ins.parts[-1] == "f32x2":
            return self._f32x2(ins, 2, lambda a, b: a + b)
        return self._arith(ins, 2, lambda a, b: a + b)

    def _c_sub(self, ins):
        if ins.parts[-1] == "f32x2":
            return self._f32x2(ins, 2, lambda a, b: a - b)
        return self._arith(ins, 2, lambda a, b: a - b)

    def _f32x2(self, ins, nsrc, f):
        """Packed .f32x2 (PTX ISA 9.7.3 add/sub/mul/fma .f32x2, sm_100a): two fp32 lanes in a
        .b64 register, element 0 in the low 32 bits."""
        srcs = [self._reader(o, np.uint64) for o in ins.operands[1:1 + nsrc]]
        wr = self._writer(ins.operands[0])
        if "ftz" in ins.parts:
            raise NotImplementedError(".ftz f32x2")

        def h(w, m, full):
            a = [s(w).view(np.float32).reshape(W, 2) for s in srcs]
            with _QUIET:
                r = f(*a).astype(np.float32)
            wr(w, np.ascontiguousarray(r).reshape(-1).view(np.uint64), m, full)
        return h

    def _c_mul(self, ins):
        parts = ins.parts
        t = parts[-1]
        if t == "f32x2":
            return self._f32x2(ins, 2, lambda a, b: a * b)
        if "wide" in parts:
            dt = _DT[t]
            wide = _SIGNED[2 * np.dtype(dt).itemsize] if t[0] == "s" else _UNSIGNED[2 * np.dtype(dt).itemsize]
            srcs = [self._reader(o, dt) for o in ins.operands[1:3]]
            wr = self._writer(ins.operands[0])

            def h(w, m, full):
                wr(w, srcs[0](w).astype(wide) * srcs[1](w).astype(wide), m, full)
            return h
        if "hi" in parts:
            dt = np.dtype(_DT[t])
            bits = 8 * dt.itemsize
            if bits == 64:
                raise NotImplementedError("mul.hi.64")
            big = np.int64 if t[0] == "s" else np.uint64
            return self._arith(ins, 2, lambda a, b: ((a.astype(big) * b.astype(big)) >> big(bits)).astype(dt))
        return self._arith(ins, 2, lambda a, b: a * b)

    def _c_mad(self, ins):
        parts = ins.parts
        t = parts[-1]
        if "wide" in parts:
            dt = _DT[t]
            isz = np.dtype(dt).itemsize
            wide = _SIGNED[2 * isz] if t[0] == "s" else _UNSIGNED[2 * isz]
            srcs = [self._reader(o, d) for o, d in zip(ins.operands[1:4], (dt, dt, wide))]
            wr = self._writer(ins.operands[0])

            def h(w, m, full):
                a, b, c = (s(w) for s in srcs)
                wr(w, a.astype(wide) * b.astype(wide) + c, m, full)
            return h
        if "hi" in parts:
            raise NotImplementedError("mad.hi")
        if t == "f32":
            return self._c_fma(ins)
        return self._arith(ins, 3, lambda a, b, c: a * b + c)

    def _c_fma(self, ins):
        if ins.parts[-1] == "f32x2":
            return self._f32x2(ins, 3, lambda a, b, c: _fma_f32(a.reshape(-1), b.reshape(-1), c.reshape(-1)).reshape(W, 2))
        if ins.parts[-1] == "f64":
            return self._arith(ins, 3, _fma_f64)
        return self._arith(ins, 3, _fma_f32)

    def _c_div(self, ins):
        t = ins.parts[-1]
        if t in ("s32", "s64", "s16"):
            def f(a, b):
                bb = np.where(b == 0, 1, b)
                q = np.abs(a.astype(np.int64)) // np.abs(bb.astype(np.int64))
                q = np.where((a < 0) != (bb < 0), -q, q)
                return q.astype(a.dtype)  # truncation toward zero (PTX ISA 9.7.1 div)
            return self._arith(ins, 2, f)
        if t[0] == "u":
            return self._arith(ins, 2, lambda a, b: a // np.where(b == 0, 1, b))
        return self._arith(ins, 2, lambda a, b: a / b)  # div.rn / div.full / div.approx: IEEE

    def _c_rem(self, ins):
        t = ins.parts[-1]
        if t[0] == "s":
            def f(a, b):
                bb = np.where(b == 0, 1, b).astype(np.int64)
                r = np.abs(a.astype(np.int64)) % np.abs(bb)
                return np.where(a < 0, -r, r).astype(a.dtype)  # sign of the dividend
            return self._arith(ins, 2, f)
        return self._arith(ins, 2, lambda a, b: a % np.where(b == 0, 1, b))

    def _c_min(self, ins):
        if ins.parts[-1] in ("f32", "f64"):
            if "NaN" in ins.parts:
                return self._arith(ins, 2, np.minimum)
            return self._arith(ins, 2, np.fmin)  # a NaN operand yields the other (PTX ISA min)
        return self._arith(ins, 2, np.minimum)

    def _c_max(self, ins):
        if ins.parts[-1] in ("f32", "f64"):
            if "NaN" in ins.parts:
                return self._arith(ins, 2, np.maximum)
            return self._arith(ins, 2, np.fmax)
        return self._arith(ins, 2, np.maximum)

    def _c_neg(self, ins):
        t = ins.parts[-1]
        if t == "f32":  # sign bit flip, NaN included
            return self._arith(ins, 1, lambda a: (a.view(np.uint32) ^ np.uint32(0x80000000)).view(np.float32))
        return self._arith(ins, 1, lambda a: -a)

    def _c_abs(self, ins):
        t = ins.parts[-1]
        if t == "f32":
            return self._arith(ins, 1, lambda a: (a.view(np.uint32) & np.uint32(0x7FFFFFFF)).view(np.float32))
        return self._arith(ins, 1, np.abs)

    def _c_ex2(self, ins):
        if "approx" not in ins.parts:
            raise NotImplementedError(ins.opcode)
        return self._arith(ins, 1, lambda a: np.exp2(a).astype(np.float32))

    def _c_lg2(self, ins):
        return self._arith(ins, 1, lambda a: np.log2(a).astype(np.float32))

    def _c_rcp(self, ins):
        # rcp.rn / rcp.approx: the IEEE quotient in the operand's precision (the approximation
        # of rcp.approx.ftz.f64 is refined by the Newton steps that follow it in these kernels)
        return self._arith(ins, 1, lambda a: (a.dtype.type(1) / a).astype(a.dtype))

    def _c_sqrt(self, ins):
        return self._arith(ins, 1, lambda a: np.sqrt(a).astype(a.dtype))

    def _c_rsqrt(self, ins):
        return self._arith(ins, 1, lambda a: (a.dtype.type(1) / np.sqrt(a)).astype(a.dtype))

    # --- logic and shifts (PTX ISA 9.7.8) -------------------------------------------------

    def _c_and(self, ins):
        return self._arith(ins, 2, lambda a, b: a & b)

    def _c_or(self, ins):
        return self._arith(ins, 2, lambda a, b: a | b)

    def _c_xor(self, ins):
        return self._arith(ins, 2, lambda a, b: a ^ b)

    def _c_not(self, ins):
        if ins.parts[-1] == "pred":
            return self._arith(ins, 1, lambda a: ~a)
        return self._arith(ins, 1, lambda a: ~a)

    def _c_cnot(self, ins):
        return self._arith(ins, 1, lambda a: (a == 0).astype(a.dtype))

    def _c_popc(self, ins):
        dt = _DT[ins.parts[-1]]
        src = self._reader(ins.operands[1], dt)
        wr = self._writer(ins.operands[0])

        def h(w, m, full):
            a = src(w).astype(np.uint64)
            c = np.array([bin(int(x)).count("1") for x in a], dtype=np.uint32)
            wr(w, c, m, full)
        return h

    def _shift(self, ins, left):
        t = ins.parts[-1]
        dt = np.dtype(_DT[t])
        bits = 8 * dt.itemsize
        a_rd = self._reader(ins.operands[1], dt)
        b_rd = self._reader(ins.operands[2], np.uint32)
        wr = self._writer(ins.operands[0])
        signed = t[0] == "s"

        def h(w, m, full):
            # shift amounts >= the width give 0 (shl, shr.u) or the sign (shr.s): PTX ISA shl/shr
            a, b = a_rd(w), b_rd(w)
            big = b >= bits
            bb = np.minimum(b, bits - 1).astype(dt)
            if left:
                r = np.where(big, dt.type(0), a << bb)
            elif signed:
                r = a >> bb
            else:
                r = np.where(big, dt.type(0), a >> bb)
            wr(w, r.astype(dt), m, full)
        return h

    def _c_shl(self, ins):
        return self._shift(ins, True)

    def _c_shr(self, ins):
        return self._shift(ins, False)

    def _c_bfi(self, ins):
        """bfi.b32 d, a, b, pos, len: a's low len bits into b at pos (PTX ISA 9.7.8 bfi)."""
        dt = np.dtype(_DT[ins.parts[-1]])
        bits = 8 * dt.itemsize
        a_rd, b_rd = self._reader(ins.operands[1], dt), self._reader(ins.operands[2], dt)
        c_rd, d_rd = self._reader(ins.operands[3], np.uint32), self._reader(ins.operands[4], np.uint32)
        wr = self._writer(ins.operands[0])

        def h(w, m, full):
            a = a_rd(w).astype(np.uint64)
            b = b_rd(w).astype(np.uint64)
            pos = (c_rd(w) & 0xFF).astype(np.uint64)
            ln = (d_rd(w) & 0xFF).astype(np.uint64)
            full_mask = np.uint64((1 << bits) - 1)
            ok = (ln > 0) & (pos < bits)
            ln = np.minimum(ln, np.uint64(bits))
            fmask = np.where(ln >= 64, np.uint64(2 ** 64 - 1), (np.uint64(1) << ln) - np.uint64(1))
            ps = np.minimum(pos, np.uint64(bits - 1))
            msk = (fmask << ps) & full_mask
            r = np.where(ok, (b & ~msk) | ((a << ps) & msk), b) & full_mask
            wr(w, r.astype(_UNSIGNED[dt.itemsize]).view(dt), m, full)
        return h

    def _c_bfe(self, ins):
        """bfe.{u32,s32} d, a, pos, len (PTX ISA 9.7.8 bfe)."""
        t = ins.parts[-1]
        dt = np.dtype(_DT[t])
        bits = 8 * dt.itemsize
        a_rd = self._reader(ins.operands[1], _UNSIGNED[dt.itemsize])
        b_rd, c_rd = self._reader(ins.operands[2], np.uint32), self._reader(ins.operands[3], np.uint32)
        wr = self._writer(ins.operands[0])
        signed = t[0] == "s"

        def h(w, m, full):
            a = a_rd(w).astype(np.uint64)
            pos = (b_rd(w) & 0xFF).astype(np.int64)
            ln = (c_rd(w) & 0xFF).astype(np.int64)
            out = np.zeros(W, dtype=np.uint64)
            for i in range(W):
                p, l, x = int(pos[i]), int(ln[i]), int(a[i])
                if signed:
                    msb = min(p + l - 1, bits - 1)
                    sbit = 0 if l == 0 else (x >> msb) & 1
                else:
                    sbit = 0
                v = 0
                for k in range(bits):
                    bit = ((x >> (p + k)) & 1) if (k < l and p + k <= bits - 1) else sbit
                    v |= bit << k
                out[i] = v
            wr(w, out.astype(_UNSIGNED[dt.itemsize]).view(dt), m, full)
        return h

    def _c_prmt(self, ins):
        """prmt.b32 d, a, b, c (default mode): byte i of d is byte (c >> 4i) & 7 of {b, a}
        (a = bytes 0-3), replicated sign when bit 3 of the selector is set (PTX ISA prmt)."""
        if len(ins.parts) > 2:
            raise NotImplementedError(f"prmt mode {ins.parts[2]}")
        a_rd, b_rd, c_rd = (self._reader(o, np.uint32) for o in ins.operands[1:4])
        wr = self._writer(ins.operands[0])

        shifts = np.array([0, 4, 8, 12], dtype=np.uint64)
        outsh = np.array([0, 8, 16, 24], dtype=np.uint64)

        def h(w, m, full):
            a, b, c = a_rd(w), b_rd(w), c_rd(w)
            src = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
            sel = (c.astype(np.uint64)[:, None] >> shifts) & np.uint64(0xF)
            byte = (src[:, None] >> ((sel & np.uint64(7)) << np.uint64(3))) & np.uint64(0xFF)
            sign = sel >= 8
            if sign.any():
                byte = np.where(sign, np.where(byte >= 0x80, np.uint64(0xFF), np.uint64(0)), byte)
            wr(w, np.bitwise_or.reduce(byte << outsh, axis=1).astype(np.uint32), m, full)
        return h

    # --- comparison and selection (PTX ISA 9.7.7) -----------------------------------------

    _FCMP = {
        "eq": lambda a, b: a == b, "ne": lambda a, b: (a != b) & ~np.isnan(a) & ~np.isnan(b),
        "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
        "ge": lambda a, b: a >= b,
        "equ": lambda a, b: (a == b) | np.isnan(a) | np.isnan(b), "neu": lambda a, b: ~(a == b),
        "ltu": lambda a, b: ~(a >= b), "leu": lambda a, b: ~(a > b), "gtu": lambda a, b: ~(a <= b),
        "geu": lambda a, b: ~(a < b), "num": lambda a, b: ~np.isnan(a) & ~np.isnan(b),
        "nan": lambda a, b: np.isnan(a) | np.isnan(b),
    }
    _ICMP = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
             "gt": np.greater, "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal,
             "hi": np.greater, "hs": np.greater_equal}

    def _c_dp4a(self, ins):
        """dp4a.atype.btype d, a, b, c: d = c + the sum of the four byte products of a and b,
        each byte signed for .s32 and unsigned for .u32 (PTX ISA dp4a); d wraps mod 2^32."""
        a_t, b_t = ins.parts[1], ins.parts[2]
        a_rd, b_rd = (self._reader(o, np.uint32) for o in ins.operands[1:3])
        c_rd = self._reader(ins.operands[3], np.uint32)
        wr = self._writer(ins.operands[0])
        sh = np.arange(4, dtype=np.uint32) * np.uint32(8)

        def bytes_of(x, t):
            v = ((x[:, None] >> sh) & np.uint32(0xFF)).astype(np.int64)
            return np.where(v >= 128, v - 256, v) if t == "s32" else v

        def h(w, m, full):
            dot = (bytes_of(a_rd(w), a_t) * bytes_of(b_rd(w), b_t)).sum(axis=1)
            r = (c_rd(w).astype(np.int64) + dot) & 0xFFFFFFFF
            wr(w, r.astype(np.uint32), m, full)
        return h

    def _c_setp(self, ins):
        parts = ins.parts
        cmp, t = parts[1], parts[-1]
        boolop = next((p for p in parts[2:-1] if p in ("and", "or", "xor")), None)
        dt = np.dtype(_DT[t])
        if cmp in ("lo", "ls", "hi", "hs") and dt.kind == "i":
            dt = np.dtype(_UNSIGNED[dt.itemsize])
        if dt.kind == "f":
            f = self._FCMP[cmp]
        else:
            if t.startswith("b") and cmp not in ("eq", "ne"):
                dt = np.dtype(_UNSIGNED[dt.itemsize])
            f = self._ICMP[cmp]
        ftz = "ftz" in parts
        dst = ins.operands[0]
        pw = self._writer(dst.value if isinstance(dst, P.Pair) else dst)
        qw = self._writer(dst.pred) if isinstance(dst, P.Pair) else None
        a_rd, b_rd = self._reader(ins.operands[1], dt), self._reader(ins.operands[2], dt)
        c_rd = None
        if boolop:
            c = ins.operands[3]
            c_rd = self._reader(c, np.bool_)
        bop = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}.get(boolop)

        def h(w, m, full):
            a, b = a_rd(w), b_rd(w)
            if ftz:
                a, b = _ftz(a), _ftz(b)
            with _QUIET:
                r = np.asarray(f(a, b), dtype=bool)
            if bop is not None:
                cv = c_rd(w)
                pw(w, bop(r, cv), m, full)
                if qw:
                    qw(w, bop(~r, cv), m, full)
            else:
                pw(w, r, m, full)
                if qw:
                    qw(w, ~r, m, full)
        return h

    def _c_selp(self, ins):
        dt = _DT[ins.parts[-1]]
        a_rd, b_rd = self._reader(ins.operands[1], dt), self._reader(ins.operands[2], dt)
        c_rd = self._reader(ins.operands[3], np.bool_)
        wr = self._writer(ins.operands[0])

        def h(w, m, full):
            wr(w, np.where(c_rd(w), a_rd(w), b_rd(w)), m, full)
        return h

    # --- data movement (PTX ISA 9.7.9) ---------------------------------------------------

    def _c_mov(self, ins):
        t = ins.parts[-1]
        dt = np.dtype(_DT[t])
        dst, src = ins.operands[0], ins.operands[1]
        if isinstance(dst, P.Vec):  # mov.b64 {a, b}, d: a gets the low half
            n = len(dst.items)
            piece = _UNSIGNED[dt.itemsize // n]
            sh = 8 * dt.itemsize // n
            rd = self._reader(src, _UNSIGNED[dt.itemsize])
            wrs = [self._writer(x) for x in dst.items]
            udt = _UNSIGNED[dt.itemsize]

            def hv(w, m, full):
                v = rd(w)
                for i, wr in enumerate(wrs):
                    wr(w, ((v >> udt(i * sh)) & udt((1 << sh) - 1)).astype(piece), m, full)
            return hv
        rd = self._reader(src, dt)
        wr = self._writer(dst)

        def h(w, m, full):
            wr(w, rd(w), m, full)
        return h

    def _c_cvta(self, ins):
        """cvta{.to}.space: between a state space's address and the generic address
        (PTX ISA 9.7.9.20 cvta); param and shared spaces sit at fixed generic bases here."""
        parts = ins.parts
        to = "to" in parts
        space = next(p for p in parts[1:] if p in ("param", "shared", "global", "local", "const"))
        base = {"param": PARAM_GENERIC, "shared": SHARED_GENERIC, "local": LOCAL_GENERIC}.get(space, 0)
        dt = np.dtype(_DT[parts[-1]])
        rd = self._reader(ins.operands[1], np.uint64)
        wr = self._writer(ins.operands[0])

        def h(w, m, full):
            v = rd(w)
            v = v - np.uint64(base) if to else v + np.uint64(base)
            wr(w, v.astype(dt), m, full)
        return h

    def _c_cvt(self, ins):
        """cvt (PTX ISA 9.7.9.21): integer/float conversions, rounding modifiers, and the packed
        forms (bf16x2, e4m3x2, e2m1x2, ue8m0x2: the value from ``a`` in the upper half)."""
        parts = ins.parts
        dt_name, at_name = parts[-2], parts[-1]
        mods = set(parts[1:-2])
        if dt_name in ("bf16x2", "f16x2", "e4m3x2", "e5m2x2", "e2m1x2", "ue8m0x2") and at_name == "f32":
            return self._cvt_packed(ins, dt_name, mods)
        if at_name in ("bf16x2", "e4m3x2", "e2m1x2", "f16x2", "e5m2x2"):
            raise NotImplementedError(f"cvt from {at_name}")
        adt, ddt = np.dtype(_DT[at_name]), np.dtype(_DT[dt_name])
        if at_name == "bf16" or dt_name == "bf16":
            return self._cvt_bf16(ins, at_name, dt_name, mods)
        rd = self._reader(ins.operands[1], adt)
        wr = self._writer(ins.operands[0])
        dst_reg_dt = self._store_type(ins.operands[0].name) if isinstance(ins.operands[0], P.Reg) else ddt
        ftz = "ftz" in mods
        sat = "sat" in mods
        rnd = next((x for x in mods if x in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi")), None)

        def fround(x, r):
            if r in ("rni", "rn"):
                return np.rint(x)
            if r in ("rzi", "rz"):
                return np.trunc(x)
            if r in ("rmi", "rm"):
                return np.floor(x)
            if r in ("rpi", "rp"):
                return np.ceil(x)
            return x

        def h(w, m, full):
            a = rd(w)
            with _QUIET:
                if adt.kind == "f" and ddt.kind == "f":
                    if ftz and adt == np.float32:
                        a = _ftz(a)
                    if rnd in ("rni", "rzi", "rmi", "rpi"):
                        r = fround(a, rnd).astype(ddt)
                    elif rnd in (None, "rn") or ddt.itemsize >= adt.itemsize:
                        r = a.astype(ddt)
                    else:
                        raise EmulationError(f"line {ins.line}: rounding {rnd} of {ins.opcode}")
                    if ftz and ddt == np.float32:
                        r = _ftz(r)
                    if sat:
                        r = np.where(np.isnan(r), 0, np.clip(r, 0, 1)).astype(ddt)
                elif adt.kind == "f":  # float -> int: round, saturate, NaN -> 0 (cvt)
                    if ftz and adt == np.float32:
                        a = _ftz(a)
                    x = fround(a.astype(np.float64), rnd or "rzi")
                    info = np.iinfo(ddt)
                    x = np.where(np.isnan(x), 0, np.clip(x, info.min, info.max))
                    r = x.astype(ddt)
                elif ddt.kind == "f":
                    if rnd not in (None, "rn"):
                        raise EmulationError(f"line {ins.line}: rounding {rnd} of {ins.opcode}")
                    r = a.astype(ddt)  # int -> float, round to nearest even
                else:
                    if sat:
                        info = np.iinfo(ddt)
                        r = np.clip(a.astype(np.int64) if adt.kind == "i" else a.astype(np.uint64),
                                    info.min, info.max).astype(ddt)
                    else:
                        r = a.astype(ddt)  # wraps (truncates) like the ISA
            # a result narrower than its register is sign/zero-extended by the destination type
            if ddt.itemsize < dst_reg_dt.itemsize and ddt.kind in "iu":
                r = r.astype(_SIGNED[dst_reg_dt.itemsize] if ddt.kind == "i" else _UNSIGNED[dst_reg_dt.itemsize])
            wr(w, r, m, full)
        return h

    def _cvt_bf16(self, ins, at_name, dt_name, mods):
        rd = self._reader(ins.operands[1], _DT[at_name] if at_name != "bf16" else np.uint16)
        wr = self._writer(ins.operands[0])
        if at_name == "bf16" and dt_name == "f32":
            def h(w, m, full):
                wr(w, (rd(w).astype(np.uint32) << np.uint32(16)).view(np.float32), m, full)
            return h
        if dt_name == "bf16" and at_name == "f32":
            def h2(w, m, full):
                wr(w, _f32_to_bf16(rd(w)), m, full)
            return h2
        raise NotImplementedError(ins.opcode)

    def _cvt_packed(self, ins, dt_name, mods):
        a_rd = self._reader(ins.operands[1], np.float32)
        b_rd = self._reader(ins.operands[2], np.float32)
        wr = self._writer(ins.operands[0])
        if "relu" in mods:
            raise NotImplementedError(".relu")

        if dt_name == "bf16x2":
            def h(w, m, full):
                hi, lo = _f32_to_bf16(a_rd(w)), _f32_to_bf16(b_rd(w))
                wr(w, (hi.astype(np.uint32) << np.uint32(16)) | lo.astype(np.uint32), m, full)
            return h
        if dt_name == "f16x2":
            def hf(w, m, full):
                hi = a_rd(w).astype(np.float16).view(np.uint16)
                lo = b_rd(w).astype(np.float16).view(np.uint16)
                wr(w, (hi.astype(np.uint32) << np.uint32(16)) | lo.astype(np.uint32), m, full)
            return hf
        if dt_name in ("e4m3x2", "e5m2x2", "e2m1x2"):
            # .satfinite: finite results clamp to the format's max; NaN -> NaN (e4m3/e5m2) and
            # -> +MAX_NORM for e2m1 (PTX ISA 9.7.9.21 cvt, .satfinite); RNE. The encoder is
            # fp4gen.numerics.formats.encode (tested against these rules).
            import torch

            from fp4gen.numerics import formats
            fmt = {"e4m3x2": formats.E4M3, "e5m2x2": formats.E5M2, "e2m1x2": formats.E2M1}[dt_name]
            bits = 4 if dt_name == "e2m1x2" else 8

            def enc(x):
                return formats.encode(torch.from_numpy(x.copy()), fmt, saturate=True).numpy().astype(np.uint32)

            def hq(w, m, full):
                hi, lo = enc(a_rd(w)), enc(b_rd(w))
                wr(w, (hi << np.uint32(bits)) | lo, m, full)
            return hq
        if dt_name == "ue8m0x2":
            # .rz -> the power of two at or below, .rp -> at or above (formats.encode_e8m0 "down" /
            # "up"); NaN -> 0xFF, beyond 2^127 -> 0xFE (ISA 9.7.9.21 .satfinite). Unused by the
            # generated kernels; negative inputs follow the encoder (0xFF), where the ISA says
            # only that the format has no sign.
            import torch

            from fp4gen.numerics import formats
            rnd = "down" if "rz" in mods else "up" if "rp" in mods else None
            if rnd is None:
                raise NotImplementedError("ue8m0x2 rounding other than .rz/.rp")

            def enc8(x):
                return formats.encode_e8m0(torch.from_numpy(x.copy()), rounding=rnd).numpy().astype(np.uint32)

            def he(w, m, full):
                wr(w, (enc8(a_rd(w)) << np.uint32(8)) | enc8(b_rd(w)), m, full)
            return he
        raise NotImplementedError(ins.opcode)

    # --- warp-level (PTX ISA 9.7.9.6 shfl.sync, 9.7.13 elect.sync / vote.sync) -----------

    def _c_shfl(self, ins):
        parts = ins.parts
        mode = parts[2]
        dst = ins.operands[0]
        dw = self._writer(dst.value if isinstance(dst, P.Pair) else dst)
        pw = self._writer(dst.pred) if isinstance(dst, P.Pair) else None
        a_rd, b_rd, c_rd = (self._reader(o, np.uint32) for o in ins.operands[1:4])

        def h(w, m, full):
            a, b, c = a_rd(w), b_rd(w).astype(np.int64) & 31, c_rd(w).astype(np.int64)
            lane = LANES.astype(np.int64)
            clamp, segmask = c & 0x1F, (c >> 8) & 0x1F
            min_lane = lane & segmask
            max_lane = min_lane | (clamp & ~segmask)
            if mode == "idx":
                j = min_lane | (b & ~segmask)
                ok = j <= max_lane
            elif mode == "up":
                j = lane - b
                ok = j >= max_lane
            elif mode == "down":
                j = lane + b
                ok = j <= max_lane
            elif mode == "bfly":
                j = lane ^ b
                ok = j <= max_lane
            else:
                raise EmulationError(f"shfl mode {mode}")
            j = np.where(ok, j, lane) & 31
            src_ok = m[j]  # reading an inactive lane is undefined: report it
            if not src_ok[m].all():
                raise EmulationError(f"warp {w.idx}, line {ins.line}: shfl.sync reads an inactive lane")
            dw(w, a[j], m, False)
            if pw:
                pw(w, ok & src_ok, m, False)
        return h

    def _c_elect(self, ins):
        dst = ins.operands[0]
        dw = self._writer(dst.value if isinstance(dst, P.Pair) else dst)
        pw = self._writer(dst.pred) if isinstance(dst, P.Pair) else None
        mrd = self._reader(ins.operands[1], np.uint32)

        def h(w, m, full):
            member = ((int(mrd(w)[0]) >> LANES) & 1).astype(bool) & m
            if not member.any():
                raise EmulationError(f"warp {w.idx}, line {ins.line}: elect.sync with no member lane")
            leader = int(np.argmax(member))
            dw(w, np.full(W, leader, np.uint32), m, False)
            if pw:
                pw(w, LANES == leader, m, False)
        return h

    def _c_vote(self, ins):
        mode = ins.parts[-2] if ins.parts[-1] in ("pred", "b32") else ins.parts[-1]
        dst = ins.operands[0]
        wr = self._writer(dst)
        p_rd = self._reader(ins.operands[1], np.bool_)
        neg = False

        def h(w, m, full):
            p = p_rd(w) ^ neg
            if mode == "all":
                wr(w, np.full(W, bool(p[m].all())), m, False)
            elif mode == "any":
                wr(w, np.full(W, bool(p[m].any())), m, False)
            elif mode == "uni":
                wr(w, np.full(W, bool(p[m].all() or not p[m].any())), m, False)
            elif mode == "ballot":
                bits = int(np.sum((p & m).astype(np.uint64) << LANES.astype(np.uint64)))
                wr(w, np.full(W, bits, np.uint32), m, False)
            else:
                raise EmulationError(f"vote mode {mode}")
        return h

    # --- memory (PTX ISA 9.7.9.8 ld, 9.7.9.10 st) -----------------------------------------

    def _space(self, parts):
        for p in parts[1:]:
            s = p.split("::")[0]
            if s in ("param", "shared", "global", "local", "const"):
                return s
        return "generic"

    def _addr(self, a: P.Addr, space):
        off = np.uint64(a.offset & (2 ** 64 - 1))
        if isinstance(a.base, P.Sym):
            if a.base.name in self.param_off:
                v = np.full(W, self.param_off[a.base.name] + a.offset, np.uint64)
                return lambda w: v
            if a.base.name in self.shared_sym:
                v = np.full(W, self.shared_sym[a.base.name] + a.offset, np.uint64)
                return lambda w: v
            if a.base.name in self.local_sym:
                v = np.full(W, self.local_sym[a.base.name] + a.offset, np.uint64)
                return lambda w: v
            raise EmulationError(f"unknown address symbol {a.base.name}")
        if a.base is None:
            v = np.full(W, a.offset, np.uint64)
            return lambda w: v
        rd = self._reader(a.base, np.uint64)
        return lambda w: rd(w) + off

    def _local(self, w, addrs, n, lanes):
        if w.local is None:
            w.local = np.zeros((W, self.local_size), dtype=np.uint8)
        off = addrs.astype(np.int64)
        if off.size and (off.min() < 0 or off.max() + n > self.local_size):
            raise EmulationError(f"warp {w.idx}: local access at {int(off.max())} outside the "
                                 f"{self.local_size}-byte .local window")
        return lanes[:, None], off[:, None] + np.arange(n)

    def _mem_read(self, space, addrs: np.ndarray, n: int, w=None, lanes=None) -> np.ndarray:
        """(len(addrs), n) bytes; ``w``/``lanes``: the threads, for their .local memory."""
        if space == "generic":
            a0 = int(addrs[0]) if addrs.size else 0
            if a0 >= PARAM_GENERIC:
                return self._mem_read("param", addrs - np.uint64(PARAM_GENERIC), n)
            if a0 >= SHARED_GENERIC:
                return self._mem_read("shared", addrs - np.uint64(SHARED_GENERIC), n)
            if a0 >= LOCAL_GENERIC:
                return self._mem_read("local", addrs - np.uint64(LOCAL_GENERIC), n, w, lanes)
            space = "global"
        if space == "local":
            r, c = self._local(w, addrs, n, lanes)
            return w.local[r, c]
        if space == "param":
            pv = np.frombuffer(bytes(self.params), dtype=np.uint8)
            off = addrs.astype(np.int64)
            if off.size and off.max() + n > pv.size:
                raise EmulationError("param access outside the parameters")
            return pv[off[:, None] + np.arange(n)]
        if space == "shared":
            off = addrs.astype(np.int64) & 0xFFFFFFFF
            if off.size and off.max() + n > self.sview.size:
                raise EmulationError(f"shared access at 0x{int(off.max()):x} outside the window")
            return self.sview[off[:, None] + np.arange(n)]
        if space == "global":
            return self.gmem.gather(addrs, n)
        raise EmulationError(f"{space} memory is not emulated")

    def _mem_write(self, space, addrs: np.ndarray, data: np.ndarray, w=None, lanes=None):
        if space == "generic":
            a0 = int(addrs[0]) if addrs.size else 0
            if a0 >= PARAM_GENERIC:
                raise EmulationError("store to the parameter space")
            if a0 >= SHARED_GENERIC:
                return self._mem_write("shared", addrs - np.uint64(SHARED_GENERIC), data)
            if a0 >= LOCAL_GENERIC:
                return self._mem_write("local", addrs - np.uint64(LOCAL_GENERIC), data, w, lanes)
            space = "global"
        if space == "local":
            r, c = self._local(w, addrs, data.shape[1], lanes)
            w.local[r, c] = data
            return
        if space == "shared":
            off = addrs.astype(np.int64) & 0xFFFFFFFF
            n = data.shape[1]
            if off.size and off.max() + n > self.sview.size:
                raise EmulationError(f"shared access at 0x{int(off.max()):x} outside the window")
            self.sview[off[:, None] + np.arange(n)] = data
            self.progress += 1
            return
        if space == "global":
            return self.gmem.scatter(addrs, data)
        raise EmulationError(f"store to {space} memory is not emulated")

    def _c_ld(self, ins):
        parts = ins.parts
        space = self._space(parts)
        t = parts[-1]
        dt = np.dtype(_DT[t])
        vec = next((int(p[1:]) for p in parts if p in ("v2", "v4", "v8")), 1)
        dst = ins.operands[0]
        dsts = list(dst.items) if isinstance(dst, P.Vec) else [dst]
        if len(dsts) != vec:
            raise EmulationError(f"line {ins.line}: {len(dsts)} registers for .v{vec}")
        wrs = [self._writer(d) for d in dsts]
        reg_dts = [self._store_type(d.name) if isinstance(d, P.Reg) else dt for d in dsts]
        addr = self._addr(ins.operands[1], space)
        n = dt.itemsize
        line = ins.line

        def h(w, m, full):
            a = addr(w)
            idx = np.nonzero(m)[0]
            raw = self._mem_read(space, a[idx], n * vec, w, idx)
            if space == "shared":
                self._record(w, T.Access(line, False, _spans(a[idx] & np.uint64(0xFFFFFFFF), n * vec)))
            for k, wr in enumerate(wrs):
                vals = np.zeros(W, dtype=dt)
                vals[idx] = np.ascontiguousarray(raw[:, k * n:(k + 1) * n]).view(dt).reshape(-1)
                rdt = reg_dts[k]
                if dt.itemsize < rdt.itemsize:  # ld.s8 into a 16-bit register: sign-extended
                    vals = vals.astype(_SIGNED[rdt.itemsize] if dt.kind == "i" else _UNSIGNED[rdt.itemsize])
                wr(w, vals, m, False)
        return h

    def _c_st(self, ins):
        parts = ins.parts
        space = self._space(parts)
        t = parts[-1]
        dt = np.dtype(_DT[t])
        vec = next((int(p[1:]) for p in parts if p in ("v2", "v4", "v8")), 1)
        src = ins.operands[1]
        srcs = list(src.items) if isinstance(src, P.Vec) else [src]
        rds = [self._reader(s, _UNSIGNED[dt.itemsize] if dt.kind != "f" else dt) for s in srcs]
        addr = self._addr(ins.operands[0], space)
        n = dt.itemsize
        line = ins.line

        def h(w, m, full):
            a = addr(w)
            idx = np.nonzero(m)[0]
            if idx.size == 0:
                return
            data = np.concatenate([np.ascontiguousarray(r(w)[idx]).view(np.uint8).reshape(idx.size, n)
                                   for r in rds], axis=1)
            self._mem_write(space, a[idx], data, w, idx)
            if space == "shared":
                self._record(w, T.Access(line, True, _spans(a[idx] & np.uint64(0xFFFFFFFF), n * vec)))
        return h

    def _c_red(self, ins):
        """``red{.sem}{.scope}{.global}.add{.v2,.v4}.{f32,u32,s32,u64}`` (PTX ISA 9.7.13.6 red):
        an atomic read-modify-write with no result. Each active lane's update is applied one
        after another in lane order (atomic per element: lanes that hit the same address all
        count). ``.add.f32`` rounds to nearest even and flushes subnormal inputs and results to
        sign-preserving zero (9.7.13.6); the vector forms (``.v4.f32``, sm_90, ``.global``
        only) apply each element as its own atomic. The memory-order qualifiers (``.release``,
        ``.relaxed``, scopes) order nothing here: one CTA runs at a time and its memory
        operations take effect when executed."""
        parts = ins.parts
        space = self._space(parts)
        if space not in ("global", "generic"):
            raise NotImplementedError(f"red on .{space}")
        if "add" not in parts:
            raise NotImplementedError("red with an operation other than .add")
        t = parts[-1]
        if t not in ("f32", "u32", "s32", "u64"):
            raise NotImplementedError(f"red.add.{t}")
        dt = np.dtype(_DT[t])
        vec = next((int(p[1:]) for p in parts if p in ("v2", "v4", "v8")), 1)
        src = ins.operands[1]
        srcs = list(src.items) if isinstance(src, P.Vec) else [src]
        if len(srcs) != vec:
            raise EmulationError(f"line {ins.line}: {len(srcs)} registers for .v{vec}")
        rds = [self._reader(s, dt) for s in srcs]
        addr = self._addr(ins.operands[0], space)
        n = dt.itemsize

        def h(w, m, full):
            a = addr(w)
            vals = [r(w) for r in rds]
            for lane in np.nonzero(m)[0]:
                for k in range(vec):
                    at = np.array([a[lane] + np.uint64(k * n)], dtype=np.uint64)
                    old = np.ascontiguousarray(self._mem_read(space, at, n, w, np.array([lane]))).view(dt)
                    if t == "f32":
                        new = _ftz(_ftz(old) + _ftz(np.array([vals[k][lane]], dtype=np.float32)))
                    else:
                        new = (old + np.array([vals[k][lane]], dtype=dt)).astype(dt)
                    self._mem_write(space, at, new.view(np.uint8).reshape(1, n), w, np.array([lane]))
        return h

    def _c_prefetch(self, ins):
        return lambda w, m, full: None  # a hint (PTX ISA prefetch): no architectural effect

    def _c_setmaxnreg(self, ins):
        cnt = ins.operands[0].value
        line = ins.line

        def h(w, m, full):
            w.setmaxnreg.append((line, ins.parts[1], cnt))  # a register budget: no effect here
        return h

    def _c_fence(self, ins):
        kind = ins.opcode

        def h(w, m, full):
            self._record(w, T.Fence(ins.line, kind))
        return h

    _c_membar = _c_fence

    def _c_pmevent(self, ins):
        """pmevent (PTX ISA: Miscellaneous Instructions): a performance-monitor marker
        (fp4gen.device.markers) with no effect on the program's state."""
        def h(w, m, full):
            pass
        return h

    # --- named barriers (PTX ISA 9.7.13.1 bar, barrier) ----------------------------------

    def _c_bar(self, ins):
        parts = ins.parts
        op = parts[1] if len(parts) > 1 else "sync"
        if op == "warp":
            return lambda w, m, full: None  # bar.warp.sync: lanes of a warp run together here
        if op not in ("sync", "arrive", "cta"):
            raise NotImplementedError(f"bar.{op}")
        if op == "cta":
            op = parts[2]
        arrive = op == "arrive"
        id_rd = self._reader(ins.operands[0], np.uint32)
        cnt_rd = self._reader(ins.operands[1], np.uint32) if len(ins.operands) > 1 else None
        line = ins.line

        def h(w, m, full):
            if w.blocked_at == id(h):  # re-executed after the release this warp waited for
                w.blocked_at = 0
                return None
            bid = int(id_rd(w)[0])
            expected = int(cnt_rd(w)[0]) if cnt_rd else self.ntid
            st = self.named.setdefault(bid, [0, expected, 0])
            if st[0] == 0:
                st[1] = expected
            elif st[1] != expected:
                raise EmulationError(f"warp {w.idx}, line {line}: barrier {bid} with {expected} threads "
                                     f"while {st[1]} are expected")
            # the arrival is the warp's (PTX ISA 9.7.13.1: the instruction waits for the
            # non-exited threads of its warp and marks the warp's arrival; thread counts are
            # multiples of the warp size): a warp counts 32 threads
            st[0] += W
            self._record(w, T.NamedBarrier(line, bid, expected, arrive))
            self.progress += 1
            if st[0] >= expected:
                st[0] = 0
                st[2] += 1
                return None
            if arrive:
                return None
            gen = st[2]
            w.blocked_at = id(h)
            return _Block(f"bar.sync {bid} ({st[0]} of {expected} threads arrived)",
                          lambda: self.named[bid][2] != gen)
        return h

    _c_barrier = _c_bar

    # --- mbarrier (PTX ISA 9.7.13.15) ----------------------------------------------------

    def _c_mbarrier(self, ins):
        parts = ins.parts
        op = parts[1]
        line = ins.line
        ops = ins.operands
        if op == "init":
            a_rd = self._addr(ops[0], "shared")
            c_rd = self._reader(ops[1], np.uint32)

            def h_init(w, m, full):
                for i in np.nonzero(m)[0]:
                    addr = int(a_rd(w)[i]) & 0xFFFFFFFF
                    cnt = int(c_rd(w)[i])
                    self.mbars[addr] = MBarrier(addr, cnt)
                    self._record(w, T.BarrierInit(line, addr, cnt))
                self.progress += 1
            return h_init
        if op == "inval":
            a_rd = self._addr(ops[0], "shared")

            def h_inval(w, m, full):
                for i in np.nonzero(m)[0]:
                    self.mbars.pop(int(a_rd(w)[i]) & 0xFFFFFFFF, None)
            return h_inval
        if op == "arrive" or op == "arrive_drop":
            expect = "expect_tx" in parts
            # forms: arrive{.expect_tx} state, [addr]{, count|tx}; with '_' as state sink
            state_w = self._writer(ops[0]) if not isinstance(ops[0], P.Addr) else None
            k = 0 if isinstance(ops[0], P.Addr) else 1
            a_rd = self._addr(ops[k], "shared")
            x_rd = self._reader(ops[k + 1], np.uint32) if len(ops) > k + 1 else None

            def h_arrive(w, m, full):
                a = a_rd(w)
                x = x_rd(w) if x_rd else None
                per_bar = {}  # one trace event per barrier and warp instruction
                for i in np.nonzero(m)[0]:
                    bar = self._mbar(w, int(a[i]) & 0xFFFFFFFF, line)
                    tot = per_bar.setdefault(bar.addr, [0, 0])
                    if expect:
                        tx = int(x[i]) if x is not None else 0
                        bar.arrive(1, tx)
                        tot[0] += 1
                        tot[1] += tx
                    else:
                        n = int(x[i]) if x is not None else 1
                        bar.arrive(n)
                        tot[0] += n
                for addr, (n, tx) in per_bar.items():
                    self._record(w, T.Arrive(line, addr, n, tx))
                self.progress += 1
                if state_w:
                    state_w(w, np.zeros(W, np.uint64), m, False)
            return h_arrive
        if op == "expect_tx":
            a_rd = self._addr(ops[0], "shared")
            x_rd = self._reader(ops[1], np.uint32)

            def h_expect(w, m, full):
                for i in np.nonzero(m)[0]:
                    bar = self._mbar(w, int(a_rd(w)[i]) & 0xFFFFFFFF, line)
                    bar.expect_tx(int(x_rd(w)[i]))
                    self._record(w, T.ExpectTx(line, bar.addr, int(x_rd(w)[i])))
            return h_expect
        if op in ("try_wait", "test_wait"):
            if "parity" not in parts:
                raise NotImplementedError(f"mbarrier.{op} without .parity")
            p_w = self._writer(ops[0])
            a_rd = self._addr(ops[1], "shared")
            par_rd = self._reader(ops[2], np.uint32)
            blocking = op == "try_wait"

            def h_wait(w, m, full):
                idx = np.nonzero(m)[0]
                if idx.size == 0:
                    return None
                a, par = a_rd(w), par_rd(w)
                bars = [(self._mbar(w, int(a[i]) & 0xFFFFFFFF, line), int(par[i]) & 1) for i in idx]
                ok = all(b.done(p) for b, p in bars)
                if not ok and blocking:
                    b, p = next((b, p) for b, p in bars if not b.done(p))
                    return _Block(f"mbarrier.try_wait.parity {p} on {b}", lambda: all(x.done(q) for x, q in bars))
                res = np.zeros(W, dtype=bool)
                for i, (b, p) in zip(idx, bars):
                    res[i] = b.done(p)
                p_w(w, res, m, False)
                if ok:
                    b0, p0 = bars[0]
                    self._record(w, T.Wait(line, b0.addr, p0))
                    return None
                prog = self.progress
                b, p = next((b, p) for b, p in bars if not b.done(p))
                # test_wait failed: the warp would spin; park it until any shared state changes
                w.park_after = _Block(f"mbarrier.test_wait.parity {p} on {b}",
                                      lambda: self.progress != prog or all(x.done(q) for x, q in bars))
                return None
            return h_wait
        raise NotImplementedError(f"mbarrier.{op}")

    def _mbar(self, w, addr, line) -> MBarrier:
        b = self.mbars.get(addr)
        if b is None:
            raise EmulationError(f"warp {w.idx}, PTX line {line}: mbarrier at shared 0x{addr:x} "
                                 f"used before mbarrier.init")
        return b

    # --- asynchronous operations ---------------------------------------------------------

    def _issue(self, w, kind, run, event: Optional[T.AsyncOp]):
        """Issue an async op of warp ``w``; ``run() -> (reads, writes)`` completes it."""
        op = self.op_counter
        self.op_counter += 1
        idx = None
        if event is not None:
            event = dataclasses.replace(event, op=op)
            idx = self._record(w, event)
        a = _Async(op, w.idx, kind, run, idx)
        if self.schedule == "eager":
            self._complete(a)
        else:
            self.pending.append(a)
        return op

    def _complete(self, a: _Async):
        res = a.run()  # None, (reads, writes) or a dict of event fields
        if a.event_index is not None and res is not None:
            if not isinstance(res, dict):
                res = {"reads": tuple(res[0]), "writes": tuple(res[1])}
            evs = self.trace.warps[a.warp]
            evs[a.event_index] = dataclasses.replace(evs[a.event_index], **res)
        self.progress += 1

    def _flush_tmem_stores(self, warps=None):
        for w in (warps or self.warps):
            for a in w.st_queue:
                self._complete(a)
            w.st_queue = []

    def _complete_one(self) -> bool:
        """Lazy schedule: complete the oldest pending op (ops of one warp stay in order)."""
        if not self.pending:
            return False
        self._complete(self.pending.popleft())
        return True

    def _c_tma(self, ins):
        """cp.async.bulk.tensor.Nd.shared::cta.global.tile.mbarrier::complete_tx::bytes
        [dst], [tmap, {coords}], [mbar]{, cache hint} (PTX ISA 9.7.9.25.5.2): the tile lands
        in shared memory and its byte count is complete_tx'd on the mbarrier."""
        parts = ins.parts
        if "global" not in parts or not any(p.startswith("shared") for p in parts):
            raise NotImplementedError("only global -> shared tensor copies")
        if "tile" not in parts:
            raise NotImplementedError("only .tile mode")
        if "multicast::cluster" in parts:
            raise NotImplementedError(".multicast::cluster")
        ops = ins.operands
        d_rd = self._addr(ops[0], "shared")
        t_rd, c_rds = self._tensor_operand(ops[1])
        b_rd = self._addr(ops[2], "shared")
        line = ins.line

        def h(w, m, full):
            d, t, b = d_rd(w), t_rd(w), b_rd(w)
            cs = [c(w) for c in c_rds]
            for i in np.nonzero(m)[0]:
                tmap = self._tensor_map_at(int(t[i]), w, line)
                coords = tuple(int(c[i]) for c in cs)
                dst = int(d[i]) & 0xFFFFFFFF
                bar = self._mbar(w, int(b[i]) & 0xFFFFFFFF, line)

                def run(tmap=tmap, coords=coords, dst=dst, bar=bar):
                    nbytes, spans = self.ops.tma_load(self.smem, self.gmem.read, tmap, coords, dst)
                    bar.complete_tx(nbytes)
                    return {"writes": tuple(spans), "tx": int(nbytes)}
                self._issue(w, "tma", run, T.AsyncOp(line, 0, "tma", bar=bar.addr))
        return h

    def _tensor_operand(self, src):
        """Readers of a ``[tmap, {coords}]`` operand: the map's (generic) address, each coordinate."""
        return (self._addr(P.Addr(src.base, src.offset), "generic"),
                [self._reader(c, np.int32) for c in src.coords.items])

    def _tensor_map_at(self, taddr: int, w, line):
        """The tensor map a ``cp.async.bulk.tensor`` names by the (generic) address of its
        kernel parameter."""
        poff = taddr - PARAM_GENERIC if taddr >= PARAM_GENERIC else taddr
        pidx = self._param_at(poff)
        tmap = self.tensor_maps.get(pidx)
        if tmap is None:
            raise EmulationError(f"warp {w.idx}, line {line}: no tensor map for param {pidx}")
        return tmap

    def _c_tma_store(self, ins):
        """cp.async.bulk.tensor.Nd.global.shared::cta.tile.bulk_group [tmap, {coords}], [src]
        {, cache hint} (PTX ISA 9.7.9.25.5.2): the box is read from shared memory and written
        to the tensor (out-of-bounds elements dropped) at some time before this warp's
        ``cp.async.bulk.wait_group.read`` covering its group; eager: at issue."""
        parts = ins.parts
        if "tile" not in parts or "bulk_group" not in parts:
            raise NotImplementedError("only .tile .bulk_group tensor stores")
        ops = ins.operands
        t_rd, c_rds = self._tensor_operand(ops[0])
        s_rd = self._addr(ops[1], "shared")
        line = ins.line

        def h(w, m, full):
            t, sa = t_rd(w), s_rd(w)
            cs = [c(w) for c in c_rds]
            for i in np.nonzero(m)[0]:
                tmap = self._tensor_map_at(int(t[i]), w, line)
                coords = tuple(int(c[i]) for c in cs)
                smem_at = int(sa[i]) & 0xFFFFFFFF

                def run(tmap=tmap, coords=coords, smem_at=smem_at):
                    from . import tma
                    tma.tma_store(self.smem, self.gmem.write, tmap, coords, smem_at)
                if self.schedule == "eager":
                    run()
                else:
                    w.bulk_groups[-1].append(run)
        return h

    def _c_bulk_group(self, ins):
        """cp.async.bulk.commit_group: the warp's TMA stores issued since the last commit form a
        group; cp.async.bulk.wait_group{.read} N: all but the N most recent groups complete (the
        lazy schedule runs their stores here, the latest point the ISA allows)."""
        if ins.opcode.startswith("cp.async.bulk.commit_group"):
            def h(w, m, full):
                w.bulk_groups.append([])
            return h
        n = int(ins.operands[0].value)

        def h(w, m, full):
            done = w.bulk_groups[:-1]
            keep = max(len(done) - n, 0)
            for g in done[:keep]:
                for run in g:
                    run()
            w.bulk_groups = done[keep:] + [w.bulk_groups[-1]]
        return h

    def _param_at(self, off):
        for p in self.m.params:
            o = self.param_off[p.name]
            if o <= off < o + p.size:
                return p.index
        raise EmulationError(f"address 0x{off:x} is not in a kernel parameter")

    def _c_tcgen05(self, ins):
        parts = ins.parts
        sub = parts[1]
        ops = ins.operands
        line = ins.line
        if sub.startswith("fence") or sub.startswith("wait"):
            kind = ins.opcode
            if sub.startswith("wait"):
                wk = "ld" if "ld" in sub else "st"

                def h_wait(w, m, full):
                    if wk == "st" and w.st_queue:  # lazy tcgen05.st completes here at the latest
                        for a in w.st_queue:
                            self._complete(a)
                        w.st_queue = []
                    self._record(w, T.TmemWait(line, wk))
                return h_wait

            def h_fence(w, m, full):
                self._record(w, T.Fence(line, kind))
            return h_fence
        if sub == "alloc":
            a_rd = self._addr(ops[0], "shared")
            n_rd = self._reader(ops[1], np.uint32)

            def h_alloc(w, m, full):
                ncols = int(n_rd(w)[np.argmax(m)])
                taddr = self.tmem.alloc(ncols)
                dst = int(a_rd(w)[np.argmax(m)]) & 0xFFFFFFFF
                self.sview[dst:dst + 4] = np.frombuffer(np.uint32(taddr).tobytes(), np.uint8)
                self._record(w, T.Access(line, True, (T.SmemSpan(dst, dst + 4),)))
                self.progress += 1
            return h_alloc
        if sub == "dealloc":
            t_rd = self._reader(ops[0], np.uint32)
            n_rd = self._reader(ops[1], np.uint32)

            def h_dealloc(w, m, full):
                self._flush_tmem_stores()  # a store nobody waited for lands before the memory goes
                i = np.argmax(m)
                self.tmem.dealloc(int(t_rd(w)[i]), int(n_rd(w)[i]))
            return h_dealloc
        if sub == "relinquish_alloc_permit":
            return lambda w, m, full: None
        if sub in ("ld", "st"):
            shape = next(p for p in parts if "x" in p and p[0].isdigit())
            num = next((int(p[1:]) for p in parts if p.startswith("x") and p[1:].isdigit()), 1)
            if any(p.startswith(("pack", "unpack")) for p in parts):
                raise NotImplementedError(".pack::16b / .unpack::16b")
            if sub == "ld":
                regs = ops[0].items
                wrs = [self._writer(r) for r in regs]
                t_rd = self._reader(ops[1].base, np.uint32)
                toff = ops[1].offset

                def h_ld(w, m, full):
                    taddr = self._uniform(w, m, t_rd(w), line) + toff
                    vals, spans = self.ops.tmem_load(self.tmem, shape, num, taddr, w.idx)
                    vals = np.asarray(vals, dtype=np.uint32)
                    for k, wr in enumerate(wrs):
                        wr(w, vals[:, k], m, full)
                    op = self.op_counter
                    self.op_counter += 1
                    self._record(w, T.AsyncOp(line, op, "tmem_ld", reads=tuple(spans)))
                return h_ld
            regs = ops[1].items
            rds = [self._reader(r, np.uint32) for r in regs]
            t_rd = self._reader(ops[0].base, np.uint32)
            toff = ops[0].offset

            def h_st(w, m, full):
                taddr = self._uniform(w, m, t_rd(w), line) + toff
                vals = np.stack([r(w) for r in rds], axis=1).astype(np.uint32)
                if not m.all():  # a partial warp (non-strict): absent lanes keep their cells
                    old, _ = self.ops.tmem_load(self.tmem, shape, num, taddr, w.idx)
                    vals = np.where(m[:, None], vals, np.asarray(old, dtype=np.uint32))
                op = self.op_counter
                self.op_counter += 1
                idx = self._record(w, T.AsyncOp(line, op, "tmem_st"))
                wi = w.idx

                def run():
                    spans = self.ops.tmem_store(self.tmem, shape, num, taddr, wi, vals)
                    return (), tuple(spans)
                a = _Async(op, wi, "tmem_st", run, idx)
                if self.schedule == "eager":
                    self._complete(a)
                else:
                    w.st_queue.append(a)
            return h_st
        if sub == "cp":
            shape = parts[2] if not parts[2].startswith("cta_group") else parts[3]
            mc = next((p for p in parts if p.startswith("warpx") or p.startswith("multicast")), None)
            if any("b6x16" in p or "b4x16" in p for p in parts):
                raise NotImplementedError("tcgen05.cp decompression")
            t_rd = self._reader(ops[0].base, np.uint32)
            toff = ops[0].offset
            s_rd = self._reader(ops[1], np.uint64)

            def h_cp(w, m, full):
                t, s = t_rd(w), s_rd(w)
                for i in np.nonzero(m)[0]:
                    taddr, sdesc = int(t[i]) + toff, int(s[i])

                    def run(taddr=taddr, sdesc=sdesc):
                        return self.ops.tmem_copy(self.tmem, self.smem, shape, mc, taddr, sdesc)
                    self._issue(w, "cp", run, T.AsyncOp(line, 0, "cp"))
            return h_cp
        if sub == "mma":
            return self._c_mma(ins)
        if sub == "commit":
            if any(p.startswith("multicast") for p in parts):
                raise NotImplementedError("tcgen05.commit multicast")
            b_rd = self._addr(ops[0], "shared")

            def h_commit(w, m, full):
                b = b_rd(w)
                for i in np.nonzero(m)[0]:
                    bar = self._mbar(w, int(b[i]) & 0xFFFFFFFF, line)
                    self._record(w, T.Commit(line, bar.addr))

                    def run(bar=bar):
                        bar.arrive(1)  # .mbarrier::arrive::one (PTX ISA 9.7.16.12.1 tcgen05.commit)
                        return None
                    self._issue(w, "commit", run, None)
            return h_commit
        raise NotImplementedError(f"tcgen05.{sub}")

    def _c_mma(self, ins):
        """tcgen05.mma{.cta_group}.kind [d], a, b-desc, idesc, {[sfa], [sfb],} enable-input-d
        (PTX ISA 9.7.16.10.9.1): a is an SMEM descriptor or ``[tmem]``."""
        parts = ins.parts
        kind = next(p for p in parts if p.startswith("kind::"))
        kind_i = parts.index(kind)
        kind_full = ".".join([kind[6:]] + [p for p in parts[kind_i + 1:] if p.startswith(("block_scale", "block", "scale_vec"))])
        mods = tuple(p for p in parts[kind_i + 1:] if not p.startswith(("block_scale", "block", "scale_vec")))
        if any(p in ("sp", "ws") for p in parts):
            raise NotImplementedError("tcgen05.mma.sp / .ws")
        ops = ins.operands
        line = ins.line
        d_rd = self._reader(ops[0].base, np.uint32)
        d_off = ops[0].offset
        a_in_tmem = isinstance(ops[1], P.Addr)
        a_rd = self._reader(ops[1].base, np.uint32) if a_in_tmem else self._reader(ops[1], np.uint64)
        a_off = ops[1].offset if a_in_tmem else 0
        b_rd = self._reader(ops[2], np.uint64)
        i_rd = self._reader(ops[3], np.uint32)
        block_scaled = "block_scale" in parts
        rest = list(ops[4:])
        sfa_rd = sfb_rd = None
        if block_scaled:
            sfa_rd = self._reader(rest[0].base, np.uint32)
            sfb_rd = self._reader(rest[1].base, np.uint32)
            sfa_off, sfb_off = rest[0].offset, rest[1].offset
            rest = rest[2:]
        # optional disable-output-lane vector before enable-input-d (9.7.16.10.9.1: 4 x 32 bits
        # for cta_group::1, bit i disables D's lane i); handed to the MMA when present
        dis_rds = []
        if rest and isinstance(rest[0], P.Vec):
            dis_rds = [self._reader(x, np.uint32) for x in rest[0].items]
            rest = rest[1:]
        if len(rest) != 1:
            raise NotImplementedError("tcgen05.mma with scale-input-d")
        e_rd = self._reader(rest[0], np.bool_)

        def h(w, m, full):
            d, a, b, i_, e = d_rd(w), a_rd(w), b_rd(w), i_rd(w), e_rd(w)
            sa = sfa_rd(w) if sfa_rd else None
            sb = sfb_rd(w) if sfb_rd else None
            dis = [r(w) for r in dis_rds]
            for j in np.nonzero(m)[0]:
                kw = dict(kind=kind_full, modifiers=mods, d_taddr=int(d[j]) + d_off,
                          a=int(a[j]) + a_off, a_in_tmem=a_in_tmem, b_desc=int(b[j]),
                          idesc=int(i_[j]), enable_input_d=bool(e[j]))
                if block_scaled:
                    kw["scale_a_taddr"] = int(sa[j]) + sfa_off
                    kw["scale_b_taddr"] = int(sb[j]) + sfb_off
                if dis and any(int(x[j]) for x in dis):  # an all-zero mask: the plain form
                    kw["disable_output_lane"] = tuple(int(x[j]) for x in dis)

                def run(kw=kw):
                    return self.ops.mma(self.tmem, self.smem, **kw)
                self._issue(w, "mma", run, T.AsyncOp(line, 0, "mma"))
        return h

    def _uniform(self, w, m, vals, line) -> int:
        v = vals[m]
        if v.size == 0:
            raise EmulationError(f"warp {w.idx}, line {line}: collective with no active lane")
        if (v != v[0]).any():
            raise EmulationError(f"warp {w.idx}, line {line}: TMEM address not warp-uniform")
        return int(v[0])

    def _record(self, w, ev) -> int:
        w.events.append(ev)
        return len(w.events) - 1

    # ------------------------------------------------------------------ run

    def _run_warp(self, w: Warp, budget: int) -> int:
        code, instrs = self.code, self.m.instrs
        n = len(code)
        done = 0
        while done < budget:
            if w.uniform:
                pc = w.pc
                mask = w.live
                full = True
            else:
                lp = w.lane_pc
                pc = int(lp[w.live].min())
                mask = w.live & (lp == pc)
                full = False
            if pc >= n:  # fell off the end: those lanes exit
                w.live = w.live & ~mask
                if not w.live.any():
                    self._flush_tmem_stores([w])
                    return done
                self._recheck(w)
                continue
            kind, h = code[pc]
            ins = instrs[pc]
            m = mask
            g = ins.guard
            if g is not None:
                gv = w.regs.get(g[0])
                if gv is None:
                    gv = np.zeros(W, bool)
                m = mask & ~gv if g[1] else mask & gv
                if full and np.count_nonzero(m) != np.count_nonzero(mask):
                    full = False
            done += 1
            w.count += 1
            if kind == "bra":
                self._branch(w, pc, mask, m, ins.target)
                continue
            if kind == "exit":
                w.live = w.live & ~m
                if not w.live.any():  # an exiting warp's outstanding tcgen05.st land now
                    self._flush_tmem_stores([w])
                    return done
                self._advance(w, pc, mask & ~m)
                continue
            if g is None or m.any():
                if ins.aligned and not (full or np.array_equal(m, w.live)):
                    self._partial_aligned(w, ins, m)
                r = h(w, m, full)
                if r is not None:  # blocked: the instruction retires on a later try
                    w.blocked = r
                    w.count -= 1
                    return done - 1
                pa = w.park_after
                if pa is not None:
                    w.park_after = None
                    self._advance(w, pc, mask)
                    w.blocked = pa
                    return done
            self._advance(w, pc, mask)
        return done

    def _advance(self, w, pc, mask):
        if w.uniform:
            w.pc = pc + 1
        else:
            w.lane_pc[mask] = pc + 1
            self._recheck(w)

    def _branch(self, w, pc, mask, taken, target):
        if w.uniform:
            if (taken == mask).all():
                w.pc = target
                return
            if not taken.any():
                w.pc = pc + 1
                return
            w.uniform = False
            w.lane_pc[:] = pc
        w.lane_pc[taken] = target
        w.lane_pc[mask & ~taken] = pc + 1
        self._recheck(w)

    def _recheck(self, w):
        if w.uniform:
            return
        live = w.live
        if not live.any():
            return
        p = w.lane_pc[live]
        if (p == p[0]).all():
            w.uniform = True
            w.pc = int(p[0])

    def run(self):
        """Run the CTA to completion; returns self (``trace``, ``log``, ``seconds``)."""
        t0 = time.time()
        total = 0
        old = np.seterr(all="ignore")
        try:
            self._schedule()
        finally:
            np.seterr(**old)
        self.trace.setmaxnreg = {w.idx: list(w.setmaxnreg) for w in self.warps if w.setmaxnreg}
        self.trace.schedule = self.schedule
        self.seconds = time.time() - t0
        return self

    def _schedule(self):
        total = 0
        while True:
            ran = False
            for w in self.warps:
                if w.done:
                    continue
                if w.blocked is not None:
                    if not w.blocked.ready():
                        continue
                    w.blocked = None
                k = self._run_warp(w, self.quantum)
                total += k
                ran = ran or k > 0 or w.blocked is None
            if all(w.done for w in self.warps):
                break
            if total > self.max_instructions:
                raise EmulationError(f"more than {self.max_instructions} warp instructions: a livelock?")
            if not ran:
                if self._complete_one():
                    continue
                raise EmulationError(self._deadlock_report())
        while self._complete_one():  # ops still in flight when every thread has exited
            pass
        self._flush_tmem_stores()
        self.instructions = total

    def _partial_aligned(self, w, ins, m):
        n = int(np.count_nonzero(m))
        note = (f"warp {w.idx}, PTX line {ins.line}: `{ins.text}` (.aligned) executed by {n} of the "
                f"warp's {int(np.count_nonzero(w.live))} threads (lanes {np.nonzero(m)[0].tolist()[:8]}"
                f"{'...' if n > 8 else ''}): divergent code around a warp-collective instruction is "
                f"undefined behaviour")
        self.divergent_aligned.append(note)
        if self.strict_aligned:
            raise EmulationError(note)

    def _deadlock_report(self) -> str:
        lines = ["deadlock: every live warp is blocked and no asynchronous operation is pending"]
        for w in self.warps:
            if w.done:
                continue
            pc = w.pc if w.uniform else int(w.lane_pc[w.live].min())
            ins = self.m.instrs[pc] if pc < len(self.m.instrs) else None
            where = f"PTX line {ins.line} `{ins.text}`" if ins else "end"
            lines.append(f"  warp {w.idx}: {where}: waits for {w.blocked.what if w.blocked else '?'}")
        return "\n".join(lines)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even; NaN stays NaN (PTX ISA 9.7.9.21 cvt .rn.bf16)."""
    b = x.astype(np.float32).view(np.uint32)
    nan = np.isnan(x)
    r = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(nan, ((b >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16), r)


def param_offsets(module: P.Module) -> dict:
    """Byte offset of each kernel parameter in the parameter buffer (each aligned to its .align)."""
    out, off = {}, 0
    for p in module.params:
        off = (off + p.align - 1) // p.align * p.align
        out[p.name] = off
        off += p.size
    return out


def local_layout(module: P.Module):
    """Local-space offsets of the module's .local variables and the window's size (bytes)."""
    out, off = {}, 0
    for s in module.local:
        off = (off + s.align - 1) // s.align * s.align
        out[s.name] = off
        off += s.size
    return out, off


def shared_layout(module: P.Module) -> dict:
    """Shared addresses of the module's shared variables: static ones first, then the dynamic
    (extern) window, aligned (as the driver lays out a CTA's shared memory)."""
    out, off = {}, 0
    for s in module.shared:
        if s.size is not None:
            off = (off + s.align - 1) // s.align * s.align
            out[s.name] = off
            off += s.size
    for s in module.shared:
        if s.size is None:
            off = (off + s.align - 1) // s.align * s.align
            out[s.name] = off
    return out
