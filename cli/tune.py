"""``fp4gen tune``: measure the sm90a planner's ``auto`` schedule choices and keep the fastest.

What it searches (docs/tune.md): for each sm90a forward kernel of a spec, every
``schedule { tile M x N; kv_stages K }`` the language can write (M a multiple of 64, the
wgmma rows per consumer warpgroup; N in the language's tile range; K in 1..8). Each one is
planned and checked by the backend exactly as ``fp4gen check`` would (``plan_kernel`` and
``lowering.refusal``); what either refuses is listed with its reason and never compiled. The
warpgroup split (``tile_m / 64`` consumers), ping-pong and intra-warpgroup overlap follow from
the tile and head dim in the planner; they are not separate spec choices, so they are not
searched separately.

How it decides: each accepted candidate is compiled (the generated module through
``fp4gen.load``'s path, the kernel through ``runtime.cache.module_kernel``: the same on-disk
cache every load uses), checked against the numerics oracle on a small shape on the GPU (a
candidate that fails is never chosen), and timed on each requested shape; the winner has the
smallest geometric mean over shapes of (its median / the fastest median at that shape).

What it writes (``write_back``): the winner's ``schedule`` block, with a ``# tune:`` comment
naming the device, date and medians, in place of the kernel's old block (or before the
kernel's closing brace); every other byte of the file is kept, the result is re-parsed and
must give the chosen schedule, and the write is refused when the file changed since it was read.

The timer, the checker and the compiler are arguments, so that tests run the search, the
decision and the write-back on a CPU with fake ones.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import re
import statistics
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

# the raw space: tile_m in wgmma's 64-row steps (one consumer warpgroup each) within the
# language's tile range, tile_n over the whole range, kv_stages over the language's range
TILE_M_CHOICES = (64, 128, 192, 256)
KV_STAGE_CHOICES = tuple(range(1, 9))
DEFAULT_SHAPE = (2, 4096, 16)  # B, S, H (the committed H200 bench shape); D is the kernel's
CHECK_SHAPE = (1, 300, 2)  # the correctness shape: ragged (not a multiple of any tile), two heads
# rel-L2 of O against the numerics oracle (fp4gen.numerics.reference) a correct candidate
# stays under: tests/sm90/test_sm90_gpu.py's bounds (measured 1.5e-4 BF16, 3e-3..5.5e-3 FP8)
CHECK_TOL = {"bf16": 1e-3, "fp8": 1.5e-2}
TUNE_COMMENT = "# tune:"  # the write-back's comment lines start with this (replaced on a re-tune)


class TuneError(Exception):
    """A user's mistake (no sm90a kernel, a bad shape, a changed file): exit 1."""


@dataclasses.dataclass
class Candidate:
    kernel: str
    tile_m: int
    tile_n: int
    kv_stages: int
    text: str = ""  # the spec file's text with this schedule written into the kernel
    auto: bool = False  # what the planner chooses for the kernel with every choice left auto
    current: bool = False  # what the spec file as written plans
    status: str = "pending"  # pending, compiled, compile-failed, wrong, timed, not-timed, budget
    detail: str = ""
    medians_ms: dict = dataclasses.field(default_factory=dict)  # "B,S,H,D" -> median ms
    score: Optional[float] = None
    spec: object = dataclasses.field(default=None, repr=False, compare=False)  # the planned spec

    @property
    def label(self) -> str:
        return f"{self.tile_m} x {self.tile_n}, kv_stages {self.kv_stages}"

    def as_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("tile_m", "tile_n", "kv_stages", "auto", "current", "status",
                                           "detail", "medians_ms", "score")}
        return d


@dataclasses.dataclass
class Skipped:
    tile_m: int
    tile_n: int
    kv_stages: Optional[int]  # None: refused with kv_stages auto (so for every count)
    reason: str

    @property
    def label(self) -> str:
        kv = "any kv_stages" if self.kv_stages is None else f"kv_stages {self.kv_stages}"
        return f"{self.tile_m} x {self.tile_n}, {kv}"


@dataclasses.dataclass
class KernelResult:
    kernel: str
    candidates: list
    skipped: list
    winner: Optional[Candidate] = None
    note: str = ""

    def as_json(self) -> dict:
        return {"kernel": self.kernel, "winner": None if self.winner is None else self.winner.as_json(),
                "note": self.note, "candidates": [c.as_json() for c in self.candidates],
                "skipped": [dataclasses.asdict(s) for s in self.skipped]}


# ---------------------------------------------------------------------------------------------
# the spec text: where each kernel's block and schedule block are (comments skipped)


@dataclasses.dataclass
class _Block:
    name: str
    open: int  # offset of the kernel's "{"
    close: int  # offset of its "}"
    schedule: Optional[tuple] = None  # (offset of the word "schedule", offset of its "}")


_TOKEN = re.compile(r"#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|[{}]|\s+|.", re.S)


def kernel_blocks(text: str) -> dict:
    """name -> _Block for every ``attention NAME { ... }`` of ``text``, by a scan that skips
    comments and matches braces (the parser holds no end positions; re-parsing the result of
    every edit is the check that this scan found the right spans)."""
    blocks, depth, words, cur, sched_start, sched_depth = {}, 0, [], None, None, None
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok.startswith("#") or tok.isspace():
            continue
        if tok == "{":
            if depth == 0 and len(words) >= 2 and words[-2] == "attention":
                cur = _Block(words[-1], m.start(), -1)
            elif cur is not None and depth == 1 and words and words[-1][0] == "schedule":
                sched_start, sched_depth = words[-1][1], depth + 1
            depth += 1
            words = []
            continue
        if tok == "}":
            if cur is not None and sched_depth is not None and depth == sched_depth:
                cur.schedule = (sched_start, m.start())
                sched_depth = None
            depth -= 1
            if depth == 0 and cur is not None:
                cur.close = m.start()
                blocks[cur.name] = cur
                cur = None
            words = []
            continue
        if depth == 0:
            words.append(tok)
        else:
            words = [(tok, m.start())]
    return blocks


def _line_start(text: str, pos: int) -> int:
    return text.rfind("\n", 0, pos) + 1


def _indent_of(text: str, pos: int) -> str:
    start = _line_start(text, pos)
    line = text[start:pos]
    return line if line.strip() == "" else re.match(r"[ \t]*", line).group()


def _kernel_indent(text: str, block: _Block) -> str:
    """The indentation of the kernel's first statement line (two spaces if there is none)."""
    for line in text[block.open + 1:block.close].split("\n")[1:]:
        if line.strip() and not line.strip().startswith("#"):
            return re.match(r"[ \t]*", line).group()
    return "  "


_TUNED_WORDS = ("tile", "kv_stages", "q_stages")


def _kept_statements(inner: str) -> list:
    """The lines of an old schedule block that tune does not choose (p_publish, comments the user
    wrote), each stripped; tile / kv_stages / q_stages statements and old ``# tune:`` lines go."""
    kept = []
    for line in inner.split("\n"):
        code, hash_, comment = line.partition("#")
        if not code.strip():
            if hash_ and not line.strip().startswith(TUNE_COMMENT):
                kept.append(line.strip())
            continue
        stmts = [s.strip() for s in code.split(";") if s.strip()]
        keep = [s for s in stmts if s.split()[0] not in _TUNED_WORDS]
        if keep:
            kept.append("; ".join(keep) + (f"  #{comment}" if hash_ and len(keep) == len(stmts) else ""))
    return kept


def schedule_block(text: str, kernel: str, tile_m: int, tile_n: int, kv_stages: Optional[int],
                   comment: Sequence[str] = ()) -> str:
    """``text`` with kernel ``kernel``'s schedule block replaced by (or, without one, a new block
    before the kernel's closing brace holding) ``tile M x N``, ``kv_stages K`` and the
    ``# tune:`` comment lines; every byte outside that block is kept."""
    blocks = kernel_blocks(text)
    if kernel not in blocks:
        raise TuneError(f"kernel '{kernel}' not found in the spec text")
    b = blocks[kernel]
    ind = _kernel_indent(text, b)
    inner_ind = ind + "  "
    body = [f"{TUNE_COMMENT} {c}" for c in comment]
    if b.schedule is not None:
        s0, s1 = b.schedule
        brace = text.index("{", s0)
        body += _kept_statements(text[brace + 1:s1])
    body += [f"tile      {tile_m} x {tile_n}", f"kv_stages {'auto' if kv_stages is None else kv_stages}"]
    lines = "".join(f"{inner_ind}{x}\n" for x in body)
    if b.schedule is not None:
        s0, s1 = b.schedule
        col = _indent_of(text, s0)
        col = col if _line_start(text, s0) + len(col) == s0 else ind  # "schedule" starts its line?
        new = "schedule {\n" + lines + col + "}"
        return text[:s0] + new + text[s1 + 1:]
    close = b.close
    head = text[_line_start(text, close):close]
    new = f"{ind}schedule {{\n{lines}{ind}}}\n"
    if head.strip() == "":  # the closing brace starts its line: the block goes on the lines before
        at = _line_start(text, close)
        return text[:at] + new + text[at:]
    return text[:close] + "\n" + new + text[close:]


# ---------------------------------------------------------------------------------------------
# enumeration


def _parse(text: str, filename: str):
    import fp4gen

    return {s.name: s for s in fp4gen.parse_text(text, filename=filename)}


def _plan_or_reason(text: str, filename: str, kernel: str):
    """(plan, None) when the planner and the backend accept the kernel in ``text``, else (None, why)."""
    from fp4gen.frontend import SpecError
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.ir.plan import PlanError
    from fp4gen.lowering import refusal

    try:
        spec = _parse(text, filename)[kernel]
        plan = plan_kernel(spec)
    except PlanError as e:
        return None, e.message
    except SpecError as e:
        return None, str(e).split("\n")[0]
    err = refusal(plan)
    if err is not None:
        return None, f"the sm90a backend: {err}"
    return plan, None


def tunable(spec) -> Optional[str]:
    """Why kernel ``spec`` has nothing to tune here, or None."""
    from fp4gen.ir.spec import Target

    if spec.target is not Target.SM90A:
        return f"target {spec.target.value}: tune searches sm90a kernels only"
    if spec.kv_cache is not None:
        return "a kv_cache (decode) kernel: its split rule is the planner's, no schedule to search"
    return None


def enumerate_candidates(text: str, filename: str, kernel: str) -> tuple:
    """(candidates the planner and backend accept, skipped with reasons) for ``kernel``."""
    from fp4gen.ir.spec import TILE_RANGE

    specs = _parse(text, filename)
    if kernel not in specs:
        raise TuneError(f"no kernel '{kernel}' in {filename}")
    why = tunable(specs[kernel])
    if why:
        raise TuneError(f"kernel '{kernel}': {why}")
    # the planner's own choice (every schedule field auto) and the file's (as written)
    auto_text = _without_schedule(text, kernel)
    auto_plan, auto_why = _plan_or_reason(auto_text, filename, kernel)
    cur_plan, cur_why = _plan_or_reason(text, filename, kernel)
    if cur_plan is None and auto_plan is None:
        raise TuneError(f"kernel '{kernel}': the planner refuses it whatever the schedule: {cur_why}")
    auto_key = _key(auto_plan)
    cur_key = _key(cur_plan)
    skipped, tiles = [], []
    for m in TILE_M_CHOICES:  # a tile refused with kv_stages auto (the fewest stages) is refused for any
        for n in TILE_RANGE:
            plan, why = _plan_or_reason(_with_schedule(text, kernel, m, n, None), filename, kernel)
            if plan is None:
                skipped.append(Skipped(m, n, None, why))
            else:
                tiles.append((m, n))
    cands = []
    for m, n in tiles:
        for kv in KV_STAGE_CHOICES:
            t = _with_schedule(text, kernel, m, n, kv)
            plan, why = _plan_or_reason(t, filename, kernel)
            if plan is None:
                skipped.append(Skipped(m, n, kv, why))
                continue
            key = _key(plan)
            if key != (m, n, kv):  # the planner changed a written choice: not this candidate
                skipped.append(Skipped(m, n, kv, f"the planner plans {key} for it"))
                continue
            cands.append(Candidate(kernel, m, n, kv, t, auto=key == auto_key, current=key == cur_key,
                                   spec=plan.spec))
    # the planner's choice first: with a small budget it is the baseline the others must beat
    cands.sort(key=lambda c: (not c.auto, not c.current, -c.tile_n, c.kv_stages, c.tile_m))
    return cands, skipped


def _key(plan):
    return None if plan is None else (plan.sm90.tile_m, plan.sm90.tile_n, plan.sm90.kv_stages)


def _with_schedule(text, kernel, m, n, kv):
    """``text`` with a candidate's block (kv None: ``kv_stages auto``)."""
    return schedule_block(text, kernel, m, n, kv)


def _without_schedule(text, kernel):
    """``text`` with kernel's schedule block removed (every schedule choice auto)."""
    b = kernel_blocks(text)[kernel]
    if b.schedule is None:
        return text
    s0, s1 = b.schedule
    return text[:s0] + text[s1 + 1:]


# ---------------------------------------------------------------------------------------------
# compile, check, time (the defaults; each injectable)


def compile_candidate(cand: Candidate, filename: str):
    """The candidate's generated module with its forward compiled, through the on-disk cache
    (``fp4gen.load``'s module cache, ``runtime.cache.module_kernel`` for the kernel)."""
    from fp4gen.api import _load_spec

    from fp4gen.runtime.cache import CacheWarning

    mod = _load_spec(Path(filename), cand.text, cand.kernel, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        mod._compile()
    if any(issubclass(w.category, CacheWarning) for w in caught):
        # e.g. CuTe's C export without TVM-FFI: the kernel works, a later process compiles it again
        cand.detail = "compiled in memory only (the disk cache could not keep it)"
    return mod


def _inputs(spec, shape, device, gen):
    import torch

    B, S, H, D = shape
    q, k, v = (torch.randn(B, S, H, D, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(3))
    return q, k, v


def _call(mod, spec, q, k, v, sinks=None, prepared=None, return_lse=False):
    """The module's forward on dense (B, S, H, D) inputs (a varlen kernel gets them packed as
    B sequences of S tokens)."""
    from fp4gen.ir.spec import Layout

    kw = {}
    if sinks is not None:
        kw["sinks"] = sinks
    if spec.layout is Layout.VARLEN:
        import torch

        B, S, H, D = q.shape
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)
        return mod.forward_varlen(q.reshape(B * S, H, D), k.reshape(B * S, H, D), v.reshape(B * S, H, D),
                                  cu, cu, S, S, return_lse=return_lse, **kw)
    if prepared is not None:
        kw["prepared"] = prepared
    return mod.forward(q, k, v, return_lse=return_lse, **kw)


def check_candidate(mod, spec, device, shape=None) -> tuple:
    """(ok, detail): the candidate's O on a small ragged shape against the numerics oracle
    (``fp4gen.numerics.reference``, with the candidate's own tile), NaN-free and within
    ``CHECK_TOL``. ``spec``: the candidate's spec (its module's plan)."""
    import torch

    from fp4gen.ir.spec import Layout, Sinks
    from fp4gen.numerics import reference

    B, S, H = shape or CHECK_SHAPE
    gen = torch.Generator().manual_seed(20)
    q, k, v = _inputs(spec, (B, S, H, spec.head_dim), device, gen)
    sinks = (torch.randn(H, generator=gen).to(device) if spec.sinks is Sinks.LEARNED else None)
    o = _call(mod, spec, q, k, v, sinks=sinks)
    if spec.layout is Layout.VARLEN:
        o = o.reshape(B, S, H, spec.head_dim)
        dense = dataclasses.replace(spec, layout=Layout.DENSE)
    else:
        dense = spec
    o_ref, _ = reference.forward(q, k, v, dense, sinks=sinks)
    o, o_ref = o.double(), o_ref.double()
    if not torch.isfinite(o).all():
        return False, "O has NaN or inf"
    err = float((o - o_ref).norm() / o_ref.norm().clamp_min(1e-30))
    tol = CHECK_TOL["fp8" if spec.q.format.is_fp8 else "bf16"]
    ok = err < tol
    return ok, f"rel-L2 {err:.2e} vs the oracle at B,S,H {B},{S},{H} ({'<' if ok else '>='} {tol:g})"


def l2_bytes(device) -> int:
    import torch

    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20))


def cuda_timer(mod, spec, shape, device, *, warmup: int = 5, reps: int = 21) -> float:
    """Milliseconds of one forward at ``shape`` (B, S, H, D): the median over ``reps`` samples,
    each CUDA events around one pass over the input sets (divided by their number), after
    ``warmup`` calls; enough sets that a call's inputs are not in L2 from the call before
    (sets x bytes >= 2 x L2). FP8 kernels time the kernel alone,
    on inputs quantized beforehand (the schedule does not change the quantization)."""
    import torch

    from fp4gen.ir.spec import Layout, Sinks

    B, S, H, D = shape
    per_set = 3 * B * S * H * D * (1 if spec.q.format.is_fp8 else 2)  # what the kernel reads: fp8 or bf16 q, k, v
    nsets = max(2, min(32, math.ceil(2 * l2_bytes(device) / per_set)))
    gen = torch.Generator().manual_seed(1)
    sets = []
    for _ in range(nsets):
        q, k, v = _inputs(spec, shape, device, gen)
        sinks = torch.randn(H, generator=gen).to(device) if spec.sinks is Sinks.LEARNED else None
        prepared = None
        if hasattr(mod, "bench_inputs") and spec.layout is Layout.DENSE and spec.q.format.is_fp8:
            _, kw = mod.bench_inputs(q, k, v)
            prepared = kw.get("prepared")
        sets.append((q, k, v, sinks, prepared))

    def once(i):
        q, k, v, sinks, prepared = sets[i % nsets]
        _call(mod, spec, q, k, v, sinks=sinks, prepared=prepared)

    for i in range(warmup):
        once(i)
    torch.cuda.synchronize(device)
    times = []
    # one sample: a pass over every set, back to back, so that the launches queue behind the
    # running kernel and the host's per-call work is not timed as GPU idle time
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(nsets):
            once(i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / nsets)
    return statistics.median(times)


def gpu_checker(device) -> Callable:
    """``checker(module, cand)`` for ``tune_kernel``: ``check_candidate`` on ``device``."""
    return lambda mod, cand: check_candidate(mod, cand.spec, device)


def gpu_timer(device) -> Callable:
    """``timer(module, cand, shape)`` for ``tune_kernel``: ``cuda_timer`` on ``device``."""
    return lambda mod, cand, shape: cuda_timer(mod, cand.spec, shape, device)


def cuda_device():
    """(torch device, name) of the GPU that times candidates, or (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA GPU here"
    cap = torch.cuda.get_device_capability(0)
    name = torch.cuda.get_device_name(0)
    if cap != (9, 0):
        return None, f"{name} is sm_{cap[0]}{cap[1]}; sm90a kernels run on sm_90 (Hopper)"
    return torch.device("cuda", 0), name


# ---------------------------------------------------------------------------------------------
# the search


def shape_key(shape) -> str:
    return ",".join(map(str, shape))


def choose(cands: Sequence[Candidate]) -> Optional[Candidate]:
    """The fastest correct candidate: among those timed on every shape, the smallest geometric
    mean over shapes of median / (the fastest median at that shape). Sets ``score``."""
    timed = [c for c in cands if c.status == "timed"]
    if not timed:
        return None
    shapes = list(timed[0].medians_ms)
    best = {s: min(c.medians_ms[s] for c in timed) for s in shapes}
    for c in timed:
        c.score = math.exp(sum(math.log(c.medians_ms[s] / best[s]) for s in shapes) / len(shapes))
    return min(timed, key=lambda c: (c.score, not c.auto))


def tune_kernel(text: str, filename: str, kernel: str, shapes: Sequence[tuple], *,
                compiler: Optional[Callable] = None, checker: Optional[Callable] = None,
                timer: Optional[Callable] = None, budget_s: Optional[float] = None, limit: Optional[int] = None,
                log: Callable = lambda s: None, clock: Callable = time.monotonic) -> KernelResult:
    """Enumerate, compile, check and (with a ``timer``) time one kernel's candidates.

    ``compiler(cand) -> module``; ``checker(module, cand) -> (ok, detail)``;
    ``timer(module, cand, shape) -> median ms``. Without a timer (no GPU) the candidates are
    compiled and left ``not-timed``. ``budget_s`` bounds the wall time of the compiles and timings;
    candidates past it are marked ``budget``; ``limit`` tries only the first ``limit`` (the
    planner's own choice first)."""
    if timer is not None and checker is None:
        raise ValueError("tune_kernel: timing without a correctness checker could choose a wrong candidate")
    t0 = clock()
    cands, skipped = enumerate_candidates(text, filename, kernel)
    if limit is not None:
        for c in cands[limit:]:
            c.status, c.detail = "budget", f"not tried: --limit {limit}"
    compiler = compiler or (lambda c: compile_candidate(c, filename))
    for i, c in enumerate(cands, 1):
        if c.status == "budget":
            continue
        if budget_s is not None and clock() - t0 > budget_s:
            c.status, c.detail = "budget", f"not tried: the {budget_s:g} s budget was spent"
            continue
        log(f"[{i}/{len(cands)}] {kernel}: {c.label}: compiling")
        try:
            mod = compiler(c)
        except Exception as e:  # a candidate the compiler fails on is reported, never chosen
            c.status, c.detail = "compile-failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        c.status = "compiled"
        if timer is None:
            c.status, c.detail = "not-timed", (c.detail or "compiled") + "; timing needs an sm_90 GPU"
            continue
        ok, detail = checker(mod, c)
        c.detail = detail
        if not ok:
            c.status = "wrong"
            continue
        for s in shapes:
            c.medians_ms[shape_key(s)] = float(timer(mod, c, s))
        c.status = "timed"
    res = KernelResult(kernel, cands, skipped)
    res.winner = choose(cands)
    if timer is None:
        res.note = "timing needs an sm_90 GPU: candidates listed and compiled, nothing chosen"
    elif res.winner is None:
        res.note = "no candidate was compiled, checked and timed: nothing chosen"
    return res


def tune_comment(res: KernelResult, device_name: str, shapes, when: Optional[datetime.datetime] = None) -> list:
    """The ``# tune:`` lines the write-back puts in the block: device, date, medians."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    w = res.winner
    lines = [f"fp4gen tune on {device_name}, {when:%Y-%m-%d %H:%M} UTC, median ms per B,S,H,D"]
    auto = next((c for c in res.candidates if c.auto and c.status == "timed"), None)
    for s in shapes:
        k = shape_key(s)
        line = f"  {k}: {w.medians_ms[k]:.4f}"
        if auto is w:
            line += " (the planner's auto choice)"
        elif auto is not None:
            line += f" (planner's auto {auto.tile_m} x {auto.tile_n}, kv_stages {auto.kv_stages}: {auto.medians_ms[k]:.4f})"
        lines.append(line)
    n = sum(c.status == "timed" for c in res.candidates)
    lines.append(f"  fastest of {n} correct candidates (docs/tune.md)")
    return lines


# ---------------------------------------------------------------------------------------------
# write-back


def read_spec(path) -> tuple:
    """(text, sha256 of its bytes) of the spec file."""
    from fp4gen.runtime.fileio import read_text_file

    text = read_text_file(path)
    return text, hashlib.sha256(text.encode("utf-8")).hexdigest()


def rewrite(text: str, filename: str, results: Sequence[KernelResult], comments: dict) -> str:
    """``text`` with each result's winner written into its kernel; re-parsed, and refused
    (RuntimeError: a bug) unless every kernel is what it was except the chosen schedules."""
    new = text
    for r in results:
        if r.winner is not None:
            w = r.winner
            new = schedule_block(new, r.kernel, w.tile_m, w.tile_n, w.kv_stages, comments.get(r.kernel, ()))
    old_specs, new_specs = _parse(text, filename), _parse(new, filename)
    if list(old_specs) != list(new_specs):
        raise RuntimeError("tune's rewrite changed the kernels of the file")
    chosen = {r.kernel: r.winner for r in results if r.winner is not None}
    for name, old in old_specs.items():
        nw = new_specs[name]
        if name in chosen:
            w = chosen[name]
            got = (nw.schedule.tile_m, nw.schedule.tile_n, nw.schedule.kv_stages)
            if got != (w.tile_m, w.tile_n, w.kv_stages) or dataclasses.replace(old, schedule=nw.schedule) != nw:
                raise RuntimeError(f"tune's rewrite of kernel '{name}' does not parse to the chosen schedule")
        elif nw != old:
            raise RuntimeError(f"tune's rewrite changed kernel '{name}', which it did not tune")
    return new


def write_back(path, text: str, digest: str, results: Sequence[KernelResult], comments: dict) -> str:
    """Rewrite the spec file at ``path`` (read as ``text`` with ``digest``) with the winners,
    atomically; TuneError when the file changed since it was read."""
    from fp4gen.runtime.fileio import atomic_write

    new = rewrite(text, str(path), results, comments)
    now, now_digest = read_spec(path)
    if now_digest != digest:
        raise TuneError(f"{path} changed since tune read it; nothing written (run tune again)")
    atomic_write(path, new)
    return new


# ---------------------------------------------------------------------------------------------
# reports


def table(res: KernelResult, shapes) -> str:
    keys = [shape_key(s) for s in shapes]
    head = f"{'tile':>10} {'kv':>3}  {'status':<14}" + "".join(f" {k + ' ms':>18}" for k in keys) + "  note"
    rows = [f"kernel {res.kernel}: {len(res.candidates)} candidates, {len(res.skipped)} refused by the planner",
            head]
    for c in res.candidates:
        tag = ("*" if c is res.winner else " ") + ("a" if c.auto else " ") + ("c" if c.current else " ")
        meds = "".join(f" {c.medians_ms[k]:>18.4f}" if k in c.medians_ms else f" {'-':>18}" for k in keys)
        rows.append(f"{c.tile_m:>4} x {c.tile_n:<3} {c.kv_stages:>3}  {c.status:<14}{meds}  {tag} {c.detail}")
    rows.append("(* chosen, a the planner's auto choice, c the file's current schedule)")
    if res.winner is not None:
        rows.append(f"chosen: tile {res.winner.tile_m} x {res.winner.tile_n}, kv_stages {res.winner.kv_stages}"
                    f" (score {res.winner.score:.3f}: geometric mean of median / fastest over shapes)")
    if res.note:
        rows.append(res.note)
    if res.skipped:
        # one line per kind of refusal (the reason with its numbers blanked); --json lists each
        groups: dict = {}
        for s in res.skipped:
            groups.setdefault(re.sub(r"\d+", "#", s.reason), []).append(s)
        rows.append(f"refused by the planner or the sm90a backend ({len(res.skipped)}; each in --json):")
        for group in groups.values():
            first = group[0]
            more = f" and {len(group) - 1} more like it" if len(group) > 1 else ""
            rows.append(f"  {first.label}{more}: {first.reason}")
    return "\n".join(rows)
