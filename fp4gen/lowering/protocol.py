"""Model check of an sm100a CTA's synchronisation protocol over emulator traces (issue 16, item 4).

Input: a ``fp4gen.lowering.emulator.trace.Trace`` -- per warp, in program order, the events
that synchronise or touch shared / tensor memory. ``check_protocol`` explores every
interleaving of those events (and of the completions of the asynchronous operations they
issue) that the PTX ISA allows, and reports

* **deadlock**: a reachable state with no enabled transition while a warp has not finished;
  each blocked warp is named with its blocking event and PTX line;
* **race**: two accesses to overlapping SMEM bytes / TMEM cells, one a write, that can be
  under way at the same time -- an in-flight asynchronous operation against another one or
  against a synchronous access (``Access``) of any warp, or two synchronous accesses of
  different warps that can be executed from the same state; reported once per pair of PTX
  lines with an interleaving that reaches it. A read of data before its producer completed
  is such a race (the producer is in flight while the reader is under way);
* **barrier misuse**: more arrivals than the phase expects, a tx-count driven below zero,
  an arrive / expect-tx / wait on an mbarrier that was never initialised, a named barrier
  passed by more threads than its count.

Semantics (each rule with the PTX ISA 9.x section it implements):

* mbarrier (9.7.13.15): ``init`` sets phase 0, pending arrivals = expected = count, tx-count 0
  (9.7.13.15.9; init of a barrier that is already initialised is undefined, reported); an
  arrive-on by ``count`` lanes lowers the pending count (9.7.13.15.7, .13);
  ``arrive.expect_tx`` performs the expect-tx before the arrive-on (9.7.13.15.13);
  expect-tx raises and complete-tx lowers the tx-count (9.7.13.15.5); the phase completes
  when pending == 0 and tx-count == 0, then the barrier moves to the next phase and the
  pending count is reset to the expected count (9.7.13.15.6); any other operation on an
  uninitialised barrier is undefined (9.7.13.15). ``try_wait.parity p`` /
  ``test_wait.parity p`` succeeds once the phase of parity p has completed, i.e. while the
  current phase's parity differs from p (9.7.13.15.16). Only the parity is observable, so
  the state keeps the parity, and a waiter whose barrier ran two phases ahead reads its
  phase as not complete -- the search explores that interleaving like any other.
* TMA (``cp.async.bulk.tensor``, 9.7.9.25.5.2; mbarrier completion 9.7.9.25.1.2): reads and
  writes between issue and its complete-tx of ``tx`` bytes on its barrier, which may happen
  at any later time.
* tcgen05.mma / tcgen05.cp: asynchronous; they "may execute and complete in a different
  order than they were issued" except for the pipelined pairs of 9.7.16.6.2 --
  mma -> mma with the same accumulator (and shape) and cp -> mma. With
  ``in_order_tensor_pipe=True`` (the assumption FA4 makes) every tcgen05 op of one issuing
  warp runs only once all its earlier ones completed (it is the oldest incomplete one while
  it reads or writes). With ``False`` only the 9.7.16.6.2 pairs are ordered; any other
  earlier op may still be running. (Dropping even those pairs would flag every two-step
  accumulation, which the ISA guarantees; "same accumulator" is read as equal write spans
  -- the trace carries no MMA shape, and these kernels use one shape per accumulator.)
* ``tcgen05.commit`` (9.7.16.12.1): one arrive-on on its barrier once every mma / cp the
  warp issued before it has completed (9.7.16.6.2.1: commit tracks ``tcgen05.{mma,cp,
  shift}``, ``tcgen05.wait`` tracks ``tcgen05.{ld,st}``).
* ``tcgen05.ld`` / ``tcgen05.st`` (9.7.16.8.3, .4): in flight until the warp's next
  ``tcgen05.wait::ld`` / ``::st`` (9.7.16.8.5, pattern 9.7.16.6.4.2).
* ``bar.sync`` / ``bar.arrive`` (9.7.13.1): a warp contributes its 32 threads; ``bar.sync``
  blocks until ``count`` threads arrived at that barrier id, ``bar.arrive`` does not block.
* Fences (``fence.proxy.async``, ``tcgen05.fence::*``) are not modelled: the checker assumes
  the kernel places them where the ISA asks (a limitation; the emulator records them for a
  separate check). Memory ordering *within* a synchronised pair is therefore not checked,
  only whether the two accesses can overlap in time.

Reductions (why each is sound, or what it gives up):

1. Memoisation: the state is (each agent's position, each mbarrier's (parity, pending,
   tx-count, expected), the set of in-flight ops and pending commits, named-barrier
   arrivals); a state's future depends on nothing else.
2. Accesses with no possible conflict partner (no overlapping span with a write on either
   side, ignoring pairs program order rules out) are dropped, and fences with them.
3. Partial-order reduction by persistent sets (Godefroid, "Partial-Order Methods for the
   Verification of Concurrent Systems", ch. 4): from each state only the enabled
   transitions of a set S of threads are explored -- a thread is a warp's program, an
   in-flight TMA / mma / cp (its completion) or a pending commit (its arrival) -- where no
   thread outside S can, on a path that executes nothing of S, execute a transition
   dependent on a current transition of S (``_Search._persistent``). Dependent
   (``_Model._footprints``): on one mbarrier unless both read it (parity waits) or both only
   arrive on it; on one named barrier; or one starts the activity of an access that the
   other ends, or of one conflicting with it. A thread's current transition includes its
   blocked wait, so every thread that could complete that phase joins S, and a blocked op or
   commit brings the ops it waits for; a program's future is read up to its first wait that
   is blocked now on an mbarrier only threads of S can still change (S is frozen on such
   paths). Every path of the full graph then has an equivalent one (same order of every two
   dependent transitions) in the reduced graph, possibly extended by transitions
   independent of it, so every deadlock is kept, every misuse (a barrier transition in a
   given barrier state), and every race: two conflicting accesses are active together iff
   each starts before the other ends, an order between dependent transitions. The state
   graph is acyclic (every transition advances a position or retires an op), so no cycle
   proviso is needed. The tests check the reduced search against the plain one on every
   planted fault of the hand-built pipeline.
4. Optional (``group_warps=True``): warps whose traces show the same event sequence on the
   same barriers (same opcodes, lines, barriers, parities; spans may differ, e.g. the four
   softmax warps of a stage) are one agent: arrival counts, tx bytes and named-barrier
   threads are added, spans united. This runs the group in lock step, so it does NOT
   explore interleavings among the group's own warps (a race between two warps of one
   group, or one that needs one warp of a group to run ahead of another, is not seen);
   barriers that count every warp of the group make most of those interleavings
   equivalent anyway. A member's own synchronous accesses and mbarrier inits (the elected
   warp that initialises the barriers or writes the block's vote) are steps of that member
   alone within the lock step. ``group_warps=False`` checks without it.

Limitations (stated, not hidden):

* One trace per run: the trace is the control flow of one run of the emulator on one input;
  a kernel whose control flow depends on timing is outside this check (the emulator compares
  two schedules for that), and a data-dependent path (e.g. an O rescale only where the row
  max grew) is checked only where that input took it.
* Fences and proxies are not modelled (above); neither are tcgen05.alloc / dealloc,
  tcgen05.shift, clusters or multicast (the traces have none of them).
* "Same accumulator" is equal write spans; MMA shape is not in the trace.
* Warp grouping is a lock-step under-approximation of the group's own interleavings; without
  it the real 16-warp traces are far beyond a few 1e5 states.
* ``in_order_tensor_pipe=False`` keeps far more ops active at once: the real fa4_fp4 trace
  needs ~7e4 states at 2 KV tiles and ~5e5 at 4 (minutes), against 3e3-6e3 with in-order
  issue (seconds).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fp4gen.lowering.emulator import trace as T

__all__ = ["Finding", "ProtocolReport", "TensorPipeReliance", "check_protocol",
           "check_tensor_pipe_reliance"]

_TCGEN05 = ("mma", "cp")


@dataclass(frozen=True)
class Finding:
    kind: str  # "deadlock" | "race" | "barrier_misuse"
    message: str
    lines: tuple  # PTX lines involved (a race: the two accesses, sorted)
    warps: tuple  # warps involved
    interleaving: tuple = ()  # the transitions from the initial state that reach it
    accesses: tuple = ()  # a race: the two accesses in short ("L1266 mma of w12")

    def __str__(self):
        return f"{self.kind}: {self.message}"


@dataclass
class ProtocolReport:
    kernel: str
    kv_tiles: int
    in_order_tensor_pipe: bool
    findings: list
    states: int  # distinct states explored
    exhaustive: bool  # the whole reachable (reduced) state space was explored
    agents: list  # per agent, the warps it stands for
    reductions: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exhaustive and not self.findings

    def of_kind(self, kind):
        return [f for f in self.findings if f.kind == kind]

    @property
    def races(self):
        return self.of_kind("race")

    @property
    def deadlocks(self):
        return self.of_kind("deadlock")

    @property
    def misuse(self):
        return self.of_kind("barrier_misuse")

    def summary(self) -> str:
        head = (f"{self.kernel} kv_tiles={self.kv_tiles} in_order_tensor_pipe="
                f"{self.in_order_tensor_pipe}: {self.states} states, "
                f"{'exhaustive' if self.exhaustive else 'NOT exhaustive (max_states)'}, "
                f"{len(self.findings)} finding(s)")
        return "\n".join([head] + [f"  {f}" for f in self.findings])


@dataclass
class TensorPipeReliance:
    in_order: ProtocolReport
    without: ProtocolReport
    relies_on: list  # races found only without in-order tensor-pipe issue

    def summary(self) -> str:
        if not self.relies_on:
            return "relies on in-order tensor-pipe issue for: nothing"
        return "relies on in-order tensor-pipe issue for: " + "; ".join(
            " vs ".join(f.accesses) if f.accesses else f.message for f in self.relies_on)


# ---------------------------------------------------------------------------------------
# compiled form of a trace

@dataclass
class _Op:
    kind: str
    agent: int
    line: int
    bar: int | None  # barrier index (tma)
    tx: int
    preds: frozenset = frozenset()  # ops that must complete before this one runs
    acc: int | None = None  # access id when it has a conflict partner


@dataclass
class _Commit:
    agent: int
    line: int
    bar: int
    count: int
    needs: frozenset  # the agent's earlier mma/cp ops


@dataclass
class _Access:
    agent: int
    line: int
    reads: tuple
    writes: tuple
    pos: int  # position in the agent's program (for program-order exclusions)
    op: int | None  # op index, or None for a synchronous access
    what: str


def _span_str(s):
    if isinstance(s, T.SmemSpan):
        return f"SMEM[{s.lo:#x},{s.hi:#x})"
    return f"TMEM lanes[{s.lane_lo},{s.lane_hi}) cols[{s.col_lo},{s.col_hi})"


_OPTIONAL = (T.Access, T.BarrierInit)  # events one warp of a group may have alone


def _signature(events):
    """A warp's event sequence without spans and op numbers, fences, and the events one warp of
    a group may execute alone (synchronous accesses, mbarrier.init: e.g. the elected warp
    that initialises the barriers or writes the block's vote)."""
    out = []
    for e in events:
        if isinstance(e, (T.Fence,) + _OPTIONAL):
            continue
        d = {k: v for k, v in vars(e).items() if k not in ("reads", "writes", "spans", "op")}
        out.append((type(e).__name__, tuple(sorted(d.items()))))
    return tuple(out)


def _group(trace, group_warps):
    warps = sorted(w for w, evs in trace.warps.items())
    if not group_warps:
        return [[w] for w in warps]
    by_sig = {}
    for w in warps:
        by_sig.setdefault(_signature(trace.warps[w]), []).append(w)
    return sorted(by_sig.values())


def _align(seqs):
    """The lock-step program of a group: tuples of the members' events executed as one step.
    Optional events (``_OPTIONAL``) of some members are steps of those members alone, merged
    when they are the same instruction; every other event is common to all members (the
    signatures agree)."""
    seqs = [[e for e in s if not isinstance(e, T.Fence)] for s in seqs]
    n = len(seqs)
    idx = [0] * n
    out = []

    def key(e):
        return (type(e).__name__, e.line, getattr(e, "write", None), getattr(e, "bar", None))
    while any(idx[i] < len(seqs[i]) for i in range(n)):
        nxt = [seqs[i][idx[i]] if idx[i] < len(seqs[i]) else None for i in range(n)]
        opt = [i for i in range(n) if isinstance(nxt[i], _OPTIONAL)]
        if opt:
            k = key(nxt[opt[0]])
            members = [i for i in opt if key(nxt[i]) == k]
        else:
            members = list(range(n))
            assert all(e is not None for e in nxt), "group members' traces disagree"
        out.append(tuple(nxt[i] for i in members))
        for i in members:
            idx[i] += 1
    return out


class _Model:
    def __init__(self, trace, in_order, group_warps):
        self.trace = trace
        self.in_order = in_order
        self.groups = _group(trace, group_warps)
        self.bar_index = {}
        self.bar_addr = []
        self.ops: list[_Op] = []
        self.commits: list[_Commit] = []
        self.accesses: list[_Access] = []
        self._op_writes = []  # per op, its write spans (the accumulator of an mma)
        self.programs = []  # per agent: list of (code, line, *args)
        for a, warps in enumerate(self.groups):
            self.programs.append(self._compile(a, [trace.warps[w] for w in warps]))
        self._relevance()

    def _bar(self, addr):
        if addr not in self.bar_index:
            self.bar_index[addr] = len(self.bar_addr)
            self.bar_addr.append(addr)
        return self.bar_index[addr]

    def agent_name(self, a):
        ws = self.groups[a]
        role = self.trace.roles.get(ws[0])
        name = "w" + (str(ws[0]) if len(ws) == 1 else f"{ws[0]}-{ws[-1]}" if
                      ws == list(range(ws[0], ws[-1] + 1)) else ",".join(map(str, ws)))
        return f"{name}({role})" if role else name

    def _compile(self, a, seqs):
        prog = []
        tc_ops = []  # this agent's tcgen05 ops so far
        tmem_open = {"ld": [], "st": []}
        for j, evs in enumerate(_align(seqs)):
            e = evs[0]
            n = len(evs)
            if isinstance(e, T.BarrierInit):
                prog.append(("init", e.line, self._bar(e.bar), e.count))
            elif isinstance(e, T.Arrive):
                prog.append(("arrive", e.line, self._bar(e.bar), sum(x.count for x in evs),
                             sum(x.tx for x in evs)))
            elif isinstance(e, T.ExpectTx):
                prog.append(("expect", e.line, self._bar(e.bar), sum(x.tx for x in evs)))
            elif isinstance(e, T.Wait):
                prog.append(("wait", e.line, self._bar(e.bar), e.parity & 1))
            elif isinstance(e, T.AsyncOp):
                reads = tuple(s for x in evs for s in x.reads)
                writes = tuple(s for x in evs for s in x.writes)
                k = len(self.ops)
                bar = self._bar(e.bar) if e.bar is not None else None
                op = _Op(e.kind, a, e.line, bar, sum(x.tx for x in evs))
                if e.kind in _TCGEN05:
                    if self.in_order:
                        preds = set(tc_ops)
                    elif e.kind == "mma":
                        # 9.7.16.6.2: cp -> mma, and mma -> mma on the same accumulator
                        preds = {q for q in tc_ops if self.ops[q].kind == "cp"
                                 or self._writes_of(q) == writes}
                    else:
                        preds = set()
                    # keep the immediate ones: a pred of a pred completes before it, so the
                    # op is active iff its immediate preds completed (same activity, and the
                    # completion that starts it is always one of those)
                    for q in list(preds):
                        preds -= self.ops[q].preds
                    op.preds = frozenset(preds)
                    tc_ops.append(k)
                elif e.kind in ("tmem_ld", "tmem_st"):
                    tmem_open[e.kind[5:]].append(k)
                elif e.kind != "tma":
                    raise ValueError(f"line {e.line}: unknown async op kind {e.kind!r}")
                self.ops.append(op)
                self._op_writes.append(writes)
                self.accesses.append(_Access(a, e.line, reads, writes, j, k,
                                             f"{e.kind} op {e.op}"))
                prog.append(("op", e.line, k))
            elif isinstance(e, T.Commit):
                c = len(self.commits)
                self.commits.append(_Commit(a, e.line, self._bar(e.bar), n, frozenset(tc_ops)))
                prog.append(("commit", e.line, c))
            elif isinstance(e, T.TmemWait):
                done = frozenset(tmem_open[e.kind])
                tmem_open[e.kind] = []
                prog.append(("tmwait", e.line, done, e.kind))
            elif isinstance(e, T.Access):
                spans = tuple(s for x in evs for s in x.spans)
                acc = len(self.accesses)
                self.accesses.append(_Access(a, e.line, () if e.write else spans,
                                             spans if e.write else (), j, None,
                                             "st.shared" if e.write else "ld.shared"))
                prog.append(("access", e.line, acc))
            elif isinstance(e, T.NamedBarrier):
                prog.append(("nbar", e.line, e.id, e.count, 32 * n, e.arrive))
            else:
                raise ValueError(f"unknown trace event {e!r}")
        return prog

    def _writes_of(self, q):
        return self._op_writes[q]

    def _relevance(self):
        """Access ids that have a conflict partner; ``conflicts[i]`` = the set of partners."""
        buckets = {}
        for i, x in enumerate(self.accesses):
            for s, w in [(s, True) for s in x.writes] + [(s, False) for s in x.reads]:
                for b in _buckets(s):
                    buckets.setdefault(b, []).append((i, s, w))
        conf = {}
        for entries in buckets.values():
            for p in range(len(entries)):
                i, si, wi = entries[p]
                for q in range(p + 1, len(entries)):
                    j, sj, wj = entries[q]
                    if i == j or not (wi or wj) or not si.overlaps(sj):
                        continue
                    if self._ordered_by_program(i, j):
                        continue
                    conf.setdefault(i, set()).add(j)
                    conf.setdefault(j, set()).add(i)
        self.conflicts = {i: frozenset(v) for i, v in conf.items()}
        for op in self.ops:
            op.acc = None
        for i, x in enumerate(self.accesses):
            if x.op is not None and i in self.conflicts:
                self.ops[x.op].acc = i
        # synchronous accesses without a partner leave the programs
        for a, prog in enumerate(self.programs):
            self.programs[a] = [ev for ev in prog
                                if ev[0] != "access" or ev[2] in self.conflicts]
        self._footprints()

    def _footprints(self):
        """Static parts of each transition's footprint, for the persistent sets.

        On an mbarrier a transition either reads it (a parity wait: R), arrives on it
        without tx (``mbarrier.arrive``, a commit's arrival: A) or otherwise changes it
        (init, expect-tx, arrive.expect_tx, a TMA's complete-tx: W); a bar.sync is W on its
        named barrier. Arrive-ons commute with each other (the counts add up and the phase
        completes once either way), so A-A and R-R are independent, every other pair on one
        barrier is dependent. Beyond barriers a transition may start or end the activity of
        accesses (an issue or a predecessor's completion starts an op, its completion or the
        tcgen05.wait ends it; stepping in front of a synchronous access starts it, executing
        it ends it). Whether two conflicting accesses are ever active together is decided by
        the order of the start of each against the end of the other, so a transition that
        starts x is dependent on one that ends x or an access conflicting with x, and vice
        versa (two starts, or two ends, commute for this property)."""
        nb = len(self.bar_addr)
        nbar_ids = {}

        def nres(i):
            return nb + nbar_ids.setdefault(i, len(nbar_ids))
        conf = self.conflicts
        E = frozenset()

        def closure(ts):
            out = set(ts)
            for x in ts:
                out |= conf.get(x, ())
            return frozenset(out)
        # accesses that a named-barrier release may put an agent in front of
        after_nbar = {}
        for prog in self.programs:
            for k, ev in enumerate(prog):
                if ev[0] == "nbar" and k + 1 < len(prog) and prog[k + 1][0] == "access":
                    after_nbar.setdefault(ev[2], set()).add(prog[k + 1][2])
        # per op: its completion's barrier writes, starts (successors it may activate) and
        # ends (itself), and their conflict closures
        self.op_w, self.op_s, self.op_e, self.op_cs, self.op_ce = [], [], [], [], []
        succs = {}
        for q, op in enumerate(self.ops):
            for p in op.preds:
                succs.setdefault(p, []).append(q)
        for p, op in enumerate(self.ops):
            st = frozenset(self.ops[q].acc for q in succs.get(p, ()) if self.ops[q].acc is not None)
            en = frozenset({op.acc}) if op.acc is not None and op.kind not in (
                "tmem_ld", "tmem_st") else E
            self.op_s.append(st)
            self.op_e.append(en)
            self.op_cs.append(closure(st))
            self.op_ce.append(closure(en))
            self.op_w.append(frozenset({op.bar}) if op.kind == "tma" else E)
        self.commit_a = [frozenset({c.bar}) for c in self.commits]
        # per agent and position: the event's own (W, A, R, starts, ends), and the future
        # split into segments between waits: seg[k] = (W, A, R, closure of starts, closure of
        # ends) of the events from k up to the next wait next_wait[k] (op completions and
        # commit arrivals included); fut_bw[k] = the barriers the agent may change from k on
        self.ev_fp, self.seg, self.next_wait, self.fut_bw, self.wait_c = [], [], [], [], []
        for prog in self.programs:
            n = len(prog)
            evfp = []
            for k, ev in enumerate(prog):
                w, a_, r, ts, te = set(), set(), set(), set(), set()
                code = ev[0]
                if code == "wait":
                    r.add(ev[2])
                elif code == "arrive" and ev[4] == 0:
                    a_.add(ev[2])
                elif code in ("init", "arrive", "expect"):
                    w.add(ev[2])
                elif code == "nbar":
                    w.add(nres(ev[2]))
                    ts |= after_nbar.get(ev[2], set())
                elif code == "access":
                    te.add(ev[2])
                elif code == "op":
                    if self.ops[ev[2]].acc is not None:
                        ts.add(self.ops[ev[2]].acc)
                elif code == "tmwait":
                    te |= {self.ops[q].acc for q in ev[2] if self.ops[q].acc is not None}
                if k + 1 < n and prog[k + 1][0] == "access":
                    ts.add(prog[k + 1][2])  # the agent now stands before that access
                evfp.append((frozenset(w), frozenset(a_), frozenset(r), frozenset(ts),
                             frozenset(te)))
            seg, nxt, fbw = [None] * (n + 1), [n] * (n + 1), [E] * (n + 1)
            seg[n] = (E, E, E, E, E)
            fw, fa, fr, fs, fe = set(), set(), set(), set(), set()
            bw = set()
            for k in range(n - 1, -1, -1):
                ev = prog[k]
                w, a_, r, ts, te = evfp[k]
                if ev[0] == "op":
                    w = w | self.op_w[ev[2]]
                    ts = ts | self.op_s[ev[2]]
                    te = te | self.op_e[ev[2]]
                elif ev[0] == "commit":
                    a_ = a_ | self.commit_a[ev[2]]
                bw |= w | a_
                fbw[k] = frozenset(bw)
                if ev[0] == "wait":
                    fw, fa, fr, fs, fe = set(), set(), set(), set(), set()
                    seg[k] = (E, E, E, E, E)
                    nxt[k] = k
                    continue
                nxt[k] = nxt[k + 1]
                fw |= w
                fa |= a_
                fr |= r
                fs |= ts
                fe |= te
                seg[k] = (frozenset(fw), frozenset(fa), frozenset(fr), closure(fs), closure(fe))
            self.ev_fp.append(evfp)
            self.seg.append(seg)
            self.next_wait.append(nxt)
            self.fut_bw.append(fbw)
            self.wait_c.append([closure(fp[3]) if prog[k][0] == "wait" else None
                                for k, fp in enumerate(evfp)])

    def _ordered_by_program(self, i, j):
        x, y = self.accesses[i], self.accesses[j]
        if x.agent != y.agent:
            return False
        if x.op is None and y.op is None:
            return True  # two synchronous accesses of one warp
        # a synchronous access and an op the warp issues after it
        if x.op is None and y.pos > x.pos:
            return True
        if y.op is None and x.pos > y.pos:
            return True
        return False


def _buckets(s):
    if isinstance(s, T.SmemSpan):
        return [("s", b) for b in range(s.lo >> 10, ((max(s.hi, s.lo + 1) - 1) >> 10) + 1)]
    return [("t", b) for b in range(s.col_lo >> 4, ((max(s.col_hi, s.col_lo + 1) - 1) >> 4) + 1)]


# ---------------------------------------------------------------------------------------
# search

class _Search:
    def __init__(self, m: _Model, max_states, reduce):
        self.m = m
        self.max_states = max_states
        self.reduce = reduce
        self.n_ops = len(m.ops)
        self.findings = {}
        self.parents = []  # per state index: (parent index, label)
        self.seen = {}

    # a state: (pos, bars, pend, nb_arrived, nb_waiting)
    def initial(self):
        m = self.m
        return (tuple(0 for _ in m.programs), tuple(None for _ in m.bar_addr), frozenset(),
                (), frozenset())

    def _active(self, p, pend):
        op = self.m.ops[p]
        return not (op.preds & pend)

    def _record(self, key, make, sidx, extra_label=None):
        if key in self.findings:
            return
        self.findings[key] = make(self._path(sidx, extra_label))

    def _path(self, sidx, extra=None):
        labels = []
        while sidx is not None and sidx >= 0:
            parent, label = self.parents[sidx]
            if label is not None:
                labels.append(label)
            sidx = parent
        labels.reverse()
        if extra is not None:
            labels.append(extra)
        return tuple(self._label_str(l) for l in labels)

    def _label_str(self, label):
        m = self.m
        code = label[0]
        if code == "w":
            a, pos = label[1], label[2]
            ev = m.programs[a][pos]
            return f"{m.agent_name(a)} L{ev[1]} {self._ev_str(ev)}"
        if code == "c":
            op = m.ops[label[1]]
            return f"complete {op.kind} of {m.agent_name(op.agent)} L{op.line}" + (
                f" (complete_tx {op.tx} on bar {m.bar_addr[op.bar]:#x})" if op.kind == "tma" else "")
        if code == "f":
            c = m.commits[label[1]]
            return (f"commit of {m.agent_name(c.agent)} L{c.line} arrives on bar "
                    f"{m.bar_addr[c.bar]:#x}")
        return str(label)

    def _ev_str(self, ev):
        m = self.m
        code = ev[0]
        if code == "init":
            return f"mbarrier.init bar {m.bar_addr[ev[2]]:#x} count {ev[3]}"
        if code == "arrive":
            return f"arrive bar {m.bar_addr[ev[2]]:#x} count {ev[3]}" + (
                f" expect_tx {ev[4]}" if ev[4] else "")
        if code == "expect":
            return f"expect_tx bar {m.bar_addr[ev[2]]:#x} {ev[3]}"
        if code == "wait":
            return f"wait bar {m.bar_addr[ev[2]]:#x} parity {ev[3]}"
        if code == "op":
            op = m.ops[ev[2]]
            return f"issue {op.kind}"
        if code == "commit":
            return f"tcgen05.commit bar {m.bar_addr[m.commits[ev[2]].bar]:#x}"
        if code == "tmwait":
            return f"tcgen05.wait::{ev[3]}"
        if code == "access":
            return m.accesses[ev[2]].what
        if code == "nbar":
            return f"bar.{'arrive' if ev[5] else 'sync'} {ev[2]}, {ev[3]}"
        return str(ev)

    # --- race check of one state -----------------------------------------------------
    def _check_races(self, state, sidx):
        m = self.m
        pos, bars, pend, _, nbw = state
        cand = []
        for p in pend:
            if p < self.n_ops:
                op = m.ops[p]
                if op.acc is not None and not (op.preds & pend):
                    cand.append(op.acc)
        for a, prog in enumerate(m.programs):
            if pos[a] < len(prog) and prog[pos[a]][0] == "access":
                cand.append(prog[pos[a]][2])
        if len(cand) < 2:
            return
        conf = m.conflicts
        for i in range(len(cand)):
            ci = conf.get(cand[i])
            if not ci:
                continue
            for j in range(i + 1, len(cand)):
                if cand[j] in ci:
                    self._race(cand[i], cand[j], sidx)

    def _race(self, i, j, sidx):
        m = self.m
        x, y = m.accesses[i], m.accesses[j]
        if (x.line, x.agent) > (y.line, y.agent):
            x, y = y, x
        key = ("race", x.line, y.line)
        if key in self.findings:
            return

        def desc(z):
            rw = [f"reads {_span_str(s)}" for s in z.reads[:2]] + \
                 [f"writes {_span_str(s)}" for s in z.writes[:2]]
            more = len(z.reads) + len(z.writes) - len(rw)
            return (f"L{z.line} {z.what} of {m.agent_name(z.agent)} ({', '.join(rw)}"
                    f"{f', +{more} spans' if more > 0 else ''})")
        msg = f"{desc(x)} can overlap {desc(y)}"
        short = tuple(f"L{z.line} {z.what.split(' op ')[0]} of {m.agent_name(z.agent)}"
                      for z in (x, y))
        self._record(key, lambda path: Finding(
            "race", msg, (x.line, y.line),
            tuple(sorted(set(m.groups[x.agent]) | set(m.groups[y.agent]))), path, short), sidx)

    # --- transitions -------------------------------------------------------------------
    def successors(self, state, sidx):
        """(label, new state) pairs of the transitions to explore from ``state``, and whether
        any transition is enabled at all; records misuse findings."""
        m = self.m
        pos, bars, pend, nba, nbw = state
        enabled = []  # transitions, each named by its thread: ("w", agent) a warp's next
        # event, ("c", op) an op's completion, ("f", commit) a commit's arrival
        for a, prog in enumerate(m.programs):
            if pos[a] >= len(prog) or a in nbw:
                continue
            ev = prog[pos[a]]
            if ev[0] == "wait":
                b = bars[ev[2]]
                if b is None:
                    self._misuse(("uninit-wait", ev[1]), a, ev,
                                 "wait on an mbarrier that was never initialised", sidx)
                    continue
                if b[0] == ev[3]:
                    continue  # the phase of this parity has not completed (9.7.13.15.16)
            enabled.append(("w", a))
        for p in pend:
            if p < self.n_ops:
                op = m.ops[p]
                if op.kind in ("tmem_ld", "tmem_st") or (op.preds & pend):
                    continue
                enabled.append(("c", p))
            else:
                c = m.commits[p - self.n_ops]
                if not (c.needs & pend):
                    enabled.append(("f", p - self.n_ops))
        if not enabled:
            return [], False
        trans = self._persistent(state, enabled) if self.reduce and len(enabled) > 1 else enabled
        out = []
        for t in trans:
            r = self._apply(state, t, sidx)
            if r is not None:
                out.append(r)
        return out, True

    def _persistent(self, state, enabled):
        """A persistent set (Godefroid): the enabled transitions of a set S of threads such that
        no thread outside S can, on a path that executes nothing of S, execute a transition
        dependent on a current transition of a thread in S. Threads: each warp's program (its
        next event -- a blocked wait too, so every thread that could complete that phase joins
        S), each in-flight TMA / mma / cp (its completion) and each pending commit (its
        arrival); a blocked op or commit brings the ops it waits for. A program thread's future
        is read up to its first wait that is blocked now on an mbarrier that only threads of S
        can still change (S is frozen on such paths, so that wait stays blocked). Exploring only
        the set keeps every deadlock and the relative order of every two dependent transitions
        -- among them the start and end of every two conflicting accesses, which decides
        whether both are active in one state."""
        m = self.m
        pos, bars, pend, nba, nbw = state
        E = frozenset()
        n_ops = self.n_ops
        units = []
        cur, fut_static = {}, {}  # thread -> (W, A, R, starts, ends) / (W, A, R, CS, CE)
        for a, prog in enumerate(m.programs):
            if pos[a] < len(prog):
                u = ("w", a)
                units.append(u)
                cur[u] = m.ev_fp[a][pos[a]]
        blockers = {}  # a blocked op / commit thread -> the op threads it waits for
        changes = {}  # thread -> the barriers it may still change
        for p in pend:
            if p < n_ops:
                op = m.ops[p]
                if op.kind in ("tmem_ld", "tmem_st"):
                    continue  # retired by its warp's tcgen05.wait: part of the program thread
                u = ("c", p)
                cur[u] = (m.op_w[p], E, E, m.op_s[p], m.op_e[p])
                fut_static[u] = (m.op_w[p], E, E, m.op_cs[p], m.op_ce[p])
                changes[u] = m.op_w[p]
                if op.preds & pend:
                    blockers[u] = [("c", q) for q in op.preds & pend]
            else:
                j = p - n_ops
                u = ("f", j)
                cur[u] = fut_static[u] = (E, m.commit_a[j], E, E, E)
                changes[u] = m.commit_a[j]
                need = m.commits[j].needs & pend
                if need:
                    blockers[u] = [("c", q) for q in need]
            units.append(u)
        for u in units:
            if u[0] == "w":
                changes[u] = m.fut_bw[u[1]][pos[u[1]]]
        changers = {}  # barrier -> the threads that may still change it

        def dep(C, f):
            CW, CA, CR, CS, CE = C
            fw, fa, fr, fcs, fce = f
            return bool((CW & (fw | fa | fr)) or (CA & (fw | fr)) or (CR & (fw | fa))
                        or (CS & fce) or (CE & fcs))

        def dependent(u, S, C):
            if u[0] != "w":
                return dep(C, fut_static[u])
            b = u[1]
            prog = m.programs[b]
            seg, nxt, wait_c = m.seg[b], m.next_wait[b], m.wait_c[b]
            k, n = pos[b], len(prog)
            while k < n:
                if dep(C, seg[k]):
                    return True
                k = nxt[k]
                if k >= n:
                    return False
                _, _, bar, parity = prog[k]
                st = bars[bar]
                if st is None or st[0] == parity:
                    ch = changers.get(bar)
                    if ch is None:
                        ch = changers[bar] = frozenset(v for v in units if bar in changes[v])
                    if ch <= S:
                        return False  # blocked until a thread of S moves
                if ((C[0] | C[1]) & {bar}) or (C[4] & wait_c[k]):  # W/A vs this wait's R
                    return True
                k += 1
            return False

        def add(C, v):
            return tuple(x | y for x, y in zip(C, cur[v]))

        en = set(enabled)
        best, best_n = None, None
        for seed in enabled:
            S = {seed}
            C = cur[seed]
            work = [seed]
            grew = True
            while grew:
                grew = False
                while work:  # a blocked op / commit brings what it waits for
                    u = work.pop()
                    for v in blockers.get(u, ()):
                        if v not in S:
                            S.add(v)
                            work.append(v)
                            C = add(C, v)
                for v in units:
                    if v not in S and dependent(v, S, C):
                        S.add(v)
                        work.append(v)
                        C = add(C, v)
                        grew = True
                if work:
                    grew = True
            n = len(S & en)
            if best_n is None or n < best_n:
                best, best_n = S, n
                if n == 1:
                    break
        return [t for t in enabled if t in best]

    def _misuse(self, key, a, ev, msg, sidx, label=None):
        m = self.m
        key = ("misuse",) + key
        if key in self.findings:
            return
        text = f"L{ev[1]} {self._ev_str(ev)} by {m.agent_name(a)}: {msg}"
        self._record(key, lambda path: Finding(
            "barrier_misuse", text, (ev[1],), tuple(m.groups[a]), path), sidx, label)

    def _arrive(self, bars, b, count, tx, who, ev, sidx, label):
        """Arrive-on (and expect-tx) on barrier b; returns new bars or None on misuse."""
        st = bars[b]
        if st is None:
            self._misuse(("uninit", ev[1]), who, ev,
                         "arrive / expect_tx on an mbarrier that was never initialised",
                         sidx, label)
            return None
        par, pending, txc, expected = st
        txc += tx  # 9.7.13.15.13: expect-tx before the arrive-on
        pending -= count
        if pending < 0:
            self._misuse(("over", ev[1]), who, ev,
                         f"{-pending} arrival(s) beyond the {expected} the phase expects",
                         sidx, label)
            return None
        return self._maybe_complete(bars, b, par, pending, txc, expected)

    @staticmethod
    def _maybe_complete(bars, b, par, pending, txc, expected):
        if pending == 0 and txc == 0:  # 9.7.13.15.6
            par, pending = par ^ 1, expected
        return bars[:b] + ((par, pending, txc, expected),) + bars[b + 1:]

    def _apply(self, state, t, sidx):
        m = self.m
        pos, bars, pend, nba, nbw = state
        if t[0] == "c":
            p = t[1]
            op = m.ops[p]
            pend2 = pend - {p}
            if op.kind == "tma":
                st = bars[op.bar]
                if st is None:
                    self._misuse(("uninit-tma", op.line), op.agent, ("op", op.line, p),
                                 "TMA completes on an mbarrier that was never initialised",
                                 sidx, t)
                    return None
                par, pending, txc, expected = st
                txc -= op.tx
                if txc < 0:
                    self._misuse(("underflow", op.line), op.agent, ("op", op.line, p),
                                 f"complete_tx of {op.tx} bytes drives the tx-count to {txc} "
                                 f"(more bytes than the phase expects)", sidx, t)
                    return None
                bars = self._maybe_complete(bars, op.bar, par, pending, txc, expected)
            return t, (pos, bars, pend2, nba, nbw)
        if t[0] == "f":
            c = m.commits[t[1]]
            bars2 = self._arrive(bars, c.bar, c.count, 0, c.agent,
                                 ("commit", c.line, t[1]), sidx, t)
            if bars2 is None:
                return None
            return t, (pos, bars2, pend - {self.n_ops + t[1]}, nba, nbw)
        a = t[1]
        ev = m.programs[a][pos[a]]
        label = ("w", a, pos[a])
        pos2 = pos[:a] + (pos[a] + 1,) + pos[a + 1:]
        code = ev[0]
        if code == "init":
            if ev[3] < 1:
                self._misuse(("init0", ev[1]), a, ev, "expected count below 1", sidx, label)
                return None
            b = ev[2]
            if bars[b] is not None:  # 9.7.13.15.9: undefined on a valid mbarrier object
                self._misuse(("reinit", ev[1]), a, ev,
                             "mbarrier.init of a barrier that is already initialised", sidx,
                             label)
                return None
            bars = bars[:b] + ((0, ev[3], 0, ev[3]),) + bars[b + 1:]
        elif code == "arrive":
            bars = self._arrive(bars, ev[2], ev[3], ev[4], a, ev, sidx, label)
            if bars is None:
                return None
        elif code == "expect":
            st = bars[ev[2]]
            if st is None:
                self._misuse(("uninit", ev[1]), a, ev,
                             "expect_tx on an mbarrier that was never initialised", sidx, label)
                return None
            par, pending, txc, expected = st
            bars = self._maybe_complete(bars, ev[2], par, pending, txc + ev[3], expected)
        elif code == "wait":
            pass
        elif code == "op":
            pend = pend | {ev[2]}
        elif code == "commit":
            pend = pend | {self.n_ops + ev[2]}
        elif code == "tmwait":
            pend = pend - ev[2]
        elif code == "access":
            pass
        elif code == "nbar":
            _, line, bid, count, threads, arrive_only = ev
            arrived = dict(nba)
            n = arrived.get(bid, 0) + threads
            if n > count:
                self._misuse(("nbar-over", line), a, ev,
                             f"{n} threads reach a named barrier of {count}", sidx, label)
                return None
            if n == count:
                arrived.pop(bid, None)
                released = [w for w in nbw if m.programs[w][pos[w]][2] == bid]
                lp = list(pos2 if arrive_only else pos)
                for w in released:
                    lp[w] += 1
                if not arrive_only:
                    lp[a] += 1
                pos2 = tuple(lp)
                nbw = nbw - set(released)
            else:
                arrived[bid] = n
                if not arrive_only:
                    pos2 = pos
                    nbw = nbw | {a}
            nba = tuple(sorted(arrived.items()))
        return label, (pos2, bars, pend, nba, nbw)

    def _deadlock(self, state, sidx):
        m = self.m
        pos, bars, pend, nba, nbw = state
        blocked = []
        for a, prog in enumerate(m.programs):
            if pos[a] >= len(prog):
                continue
            ev = prog[pos[a]]
            extra = ""
            if ev[0] == "wait":
                st = bars[ev[2]]
                extra = (" (never initialised)" if st is None else
                         f" (barrier at parity {st[0]}, {st[1]} of {st[3]} arrivals pending,"
                         f" tx-count {st[2]})")
            elif ev[0] == "nbar":
                extra = f" ({dict(nba).get(ev[2], 0)} of {ev[3]} threads arrived)"
            blocked.append((a, ev, extra))
        key = ("deadlock",) + tuple((a, ev[1]) for a, ev, _ in blocked)
        msg = "no transition enabled; " + "; ".join(
            f"{m.agent_name(a)} blocked at L{ev[1]} {self._ev_str(ev)}{x}"
            for a, ev, x in blocked)
        lines = tuple(ev[1] for _, ev, _ in blocked)
        warps = tuple(w for a, _, _ in blocked for w in m.groups[a])
        self._record(key, lambda path: Finding("deadlock", msg, lines, warps, path), sidx)

    def run(self):
        s0 = self.initial()
        self.seen[s0] = 0
        self.parents.append((None, None))
        stack = [(s0, 0)]
        exhaustive = True
        while stack:
            state, sidx = stack.pop()
            self._check_races(state, sidx)
            succ, any_enabled = self.successors(state, sidx)
            if not succ:
                pos = state[0]
                if not any_enabled and any(pos[a] < len(p) for a, p in enumerate(self.m.programs)):
                    self._deadlock(state, sidx)
                continue
            for label, ns in succ:
                if ns in self.seen:
                    continue
                if len(self.seen) >= self.max_states:
                    exhaustive = False
                    continue
                self.seen[ns] = len(self.parents)
                self.parents.append((sidx, label))
                stack.append((ns, self.seen[ns]))
        return exhaustive


def check_protocol(trace: T.Trace, *, in_order_tensor_pipe: bool = True,
                   max_states: int = 500_000, group_warps: bool = True,
                   reduce: bool = True) -> ProtocolReport:
    """Explore the interleavings of ``trace`` the ISA allows; see the module docstring.

    ``reduce=False`` turns the partial-order reduction off (for checking the reduction)."""
    m = _Model(trace, in_order_tensor_pipe, group_warps)
    s = _Search(m, max_states, reduce)
    exhaustive = s.run()
    order = {"deadlock": 0, "barrier_misuse": 1, "race": 2}
    findings = sorted(s.findings.values(), key=lambda f: (order[f.kind], f.lines))
    reductions = ["memoised states", "partner-less accesses and fences dropped"]
    if reduce:
        reductions.append("persistent sets")
    if any(len(g) > 1 for g in m.groups):
        reductions.append("lock-step groups: " + ", ".join(
            m.agent_name(a) for a, g in enumerate(m.groups) if len(g) > 1))
    return ProtocolReport(trace.kernel, trace.kv_tiles, in_order_tensor_pipe, findings,
                          len(s.seen), exhaustive, [list(g) for g in m.groups], reductions)


def check_tensor_pipe_reliance(trace: T.Trace, **kw) -> TensorPipeReliance:
    """Check ``trace`` with and without in-order tensor-pipe issue; the races that exist only
    without it are what the kernel relies on the assumption for."""
    with_ = check_protocol(trace, in_order_tensor_pipe=True, **kw)
    without = check_protocol(trace, in_order_tensor_pipe=False, **kw)
    have = {f.lines for f in with_.races}
    only = [f for f in without.races if f.lines not in have]
    return TensorPipeReliance(with_, without, only)
