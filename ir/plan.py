"""The plan-level IR: every decision the planner made, ready for lowering.

``KernelPlan`` is produced by ``fp4gen.ir.passes.plan_kernel(spec)``. Templates
receive a finished plan and nothing else: any choice a generated kernel makes
must be recorded here first.

Target-specific sections: ``tmem`` exists only for sm100a; ``sm90`` only for
sm90a. The reference target has neither (and no pipeline, events or cost).

All values are frozen dataclasses holding tuples, so a plan can be hashed,
compared and shared between passes without copying. ``docs/plan.md`` documents
every field and the JSON form (``fp4gen.ir.serialize.plan_to_dict``, which
``fp4gen.ir.dump.to_json`` completes with the simulation).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .spec import KernelSpec, SourceLoc

# TMEM of one SM (sm100a): 128 lanes x 512 columns of 32 bits.
TMEM_LANES = 128
TMEM_COLUMNS = 512
# Dynamic shared memory one CTA may use (sm90a and sm100a): 227 KiB.
SMEM_LIMIT_BYTES = 227 * 1024
# 64K 32-bit registers per SM.
REGISTERS_PER_SM = 65536


class PlanError(Exception):
    """A spec the planner cannot turn into a kernel for its target.

    ``loc`` points at the spec field that caused it (``spec.loc("Q")`` ...);
    ``notes`` are extra lines (strings) such as the fix or the numbers involved.
    The CLI renders it like a front-end diagnostic (file:line:col, caret).
    """

    def __init__(self, message: str, loc: Optional[SourceLoc] = None, notes: Sequence[str] = ()):
        self.message = message
        self.loc = loc
        self.notes = tuple(notes)
        super().__init__(self.render())

    def render(self, source_lines: Sequence[str] = ()) -> str:
        head = f"{self.loc}: error: {self.message}" if self.loc else f"error: {self.message}"
        out = [head]
        if self.loc is not None and 0 < self.loc.line <= len(source_lines):
            text = source_lines[self.loc.line - 1].rstrip("\r\n")
            pad = "".join("\t" if ch == "\t" else " " for ch in text[: max(self.loc.col - 1, 0)])
            out += ["    " + text, "    " + pad + "^"]
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


# --------------------------------------------------------------------------- legalize


@dataclass(frozen=True)
class MmaChoice:
    """One matrix product of the forward (``QK`` = Q K^T, ``PV`` = P V) and how it is issued.

    ``kind`` is the tcgen05 kind on sm100a (e.g. ``kind::mxf4nvf4.block_scale.block16``),
    the wgmma input type on sm90a (``wgmma.f8`` / ``wgmma.bf16``), or ``torch`` for reference.
    ``block_scaled``: the instruction consumes per-block scale factors (from TMEM on sm100a).
    ``a_source``/``b_source``: where the operands come from (smem, tmem, registers).
    """

    name: str
    a: str
    b: str
    kind: str
    block_scaled: bool
    sf_block: Optional[int]
    sf_dtype: Optional[str]
    a_source: str
    b_source: str
    a_major: str
    b_major: str
    flops_per_clk_sm: int  # dense tensor-core rate the cost model uses for this kind


# --------------------------------------------------------------------------- contracts


@dataclass(frozen=True)
class OperandContract:
    """What the kernel expects of one operand and who produces it."""

    operand: str  # Q K P V O
    payload: str  # element format (Format value)
    bits: int
    block: Optional[int]  # elements sharing one scale (None: no block scale)
    scale_dtype: Optional[str]  # e4m3 e8m0 fp32, None when unscaled
    granularity: str  # none tensor token block token_block
    scale_layout: str  # human readable layout of the scale factors
    major: str  # K-major / MN-major for the consuming MMA
    storage: str  # where the consuming MMA reads it: smem, tmem, registers, global
    quantized_by: str  # offline/host quantizer, producer warp, softmax warps, epilogue
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------- TMEM


@dataclass(frozen=True)
class LiveInterval:
    """When a region holds data that someone will still read, within one KV iteration.

    ``opens``/``closes`` are event names (see ``KernelPlan.events``); ``loop`` says
    whether the region is re-opened every KV tile (``per_tile``) or lives across the
    whole loop (``whole_loop``, accumulators).
    """

    opens: str
    closes: str
    loop: str = "per_tile"


@dataclass(frozen=True)
class TmemRegion:
    name: str
    first_col: int
    last_col: int  # inclusive
    first_lane: int
    last_lane: int  # inclusive
    dtype: str  # fp32, e2m1x8 (8 codes per 32-bit column), e8m0x4, ...
    purpose: str
    stage: Optional[int]
    live: LiveInterval
    alias_of: Optional[str] = None  # name of the region whose columns this one reuses
    explicit: bool = False  # placed by the spec's `tmem { }` block

    @property
    def columns(self) -> int:
        return self.last_col - self.first_col + 1

    def overlaps(self, other: "TmemRegion") -> bool:
        return not (self.last_col < other.first_col or other.last_col < self.first_col) and not (
            self.last_lane < other.first_lane or other.last_lane < self.first_lane)


@dataclass(frozen=True)
class TmemPlan:
    regions: tuple[TmemRegion, ...]
    total_columns: int  # columns the top-level regions span (S0..O1)
    alloc_columns: int  # tcgen05.alloc size: power of two >= 32 covering every region
    limit_columns: int = TMEM_COLUMNS
    notes: tuple[str, ...] = ()

    def region(self, name: str) -> TmemRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)


# --------------------------------------------------------------------------- P publish


@dataclass(frozen=True)
class PublishPart:
    index: int  # 1-based
    keys: tuple[int, int]  # key columns of the tile covered, inclusive
    p_columns: Optional[tuple[int, int]]  # TMEM columns written (sm100a), relative to P's region
    with_scales: bool  # the block scales of the whole tile are written with this part
    barrier: str  # barrier the softmax warps arrive on after writing it (stage suffix added per stage)
    unblocks: str


@dataclass(frozen=True)
class PublishPlan:
    mode: str  # whole | halves
    parts: tuple[PublishPart, ...]
    s_free_after: str  # what must happen before the next QK^T may write this stage's S
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class Sm90Plan:
    """Register/SMEM ownership for the Hopper warp-specialized forward.

    One producer warp(group) issues TMA loads of Q, K, V; ``consumer_warpgroups``
    warpgroups each own ``tile_m // consumer_warpgroups`` query rows (a wgmma
    M-mode is 64 rows per warpgroup), keep S and O in registers, and run the
    online softmax.
    """

    tile_m: int
    tile_n: int
    consumer_warpgroups: int
    kv_stages: int
    # FP8 wgmma needs both operands K-major, so an fp8 V is stored transposed
    # (D x S) for the PV product.
    v_transposed: bool
    # overlap the softmax of one KV tile with the QK^T of the next (FA3 style)
    intra_warpgroup_overlap: bool
    # two consumer warpgroups take turns on the tensor cores (FA3 ping-pong)
    pingpong: bool
    smem_bytes: int
    producer_registers: int
    consumer_registers: int
    # FP8 Direct-P: the normaliser l = sum of the decoded P codes is computed by
    # a second, narrow wgmma (P @ ones) from the same P registers PV reads,
    # instead of per-element integer decodes and adds on the CUDA cores.
    l_from_mma: bool = False


@dataclass(frozen=True)
class WarpRole:
    name: str  # load, mma, softmax0, softmax1, correction, epilogue, producer, consumer0, ...
    warps: int
    registers: int  # per thread (after setmaxnreg)
    does: str

    @property
    def threads(self) -> int:
        return self.warps * 32


@dataclass(frozen=True)
class SmemItem:
    name: str
    bytes: int
    detail: str


@dataclass(frozen=True)
class PipelinePlan:
    tile_m: int  # query rows per stage (sm100a) / per CTA (sm90a)
    tile_n: int
    q_stages: int  # query tiles in flight per CTA (sm90a: consumer warpgroups)
    kv_stages: int
    roles: tuple[WarpRole, ...]
    smem: tuple[SmemItem, ...]
    smem_bytes: int
    smem_limit: int
    registers_total: int
    registers_limit: int
    mma_order: str  # the MMA issue order of one KV iteration, in words
    notes: tuple[str, ...] = ()
    # Spill stores + loads (bytes, ptxas -v) the register gate allows, and why they are not zero
    # (fp4gen/lowering/ptxas.py checks the compiled kernel against it).
    spill_budget_bytes: int = 0
    spill_reason: str = ""

    def role(self, name: str) -> WarpRole:
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(name)


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class BarrierRef:
    """Wait on ``barrier``'s arrival from KV tile ``j + dj`` (dj < 0: an earlier tile).

    A reference to a tile before the first counts as already arrived (barriers
    start in the "empty/free" phase).
    """

    barrier: str
    dj: int = 0


@dataclass(frozen=True)
class Access:
    """A TMEM access: region name and which part (0 whole, 1 first half, 2 second half)."""

    region: str
    part: int = 0


@dataclass(frozen=True)
class Event:
    """One step of one warp role for KV tile ``j + dj`` of one query stage.

    A role runs its events in the order they appear in ``KernelPlan.events``
    (its loop body); ``dj`` lets the MMA warp issue PV of tile j-1 before QK^T of
    tile j, as FA4 does. ``resource``: a unit shared between roles (the tensor
    core on sm90a) that serialises the events using it.
    """

    name: str
    role: str
    stage: Optional[int]
    waits: tuple[BarrierRef, ...]
    signals: tuple[str, ...]
    reads: tuple[Access, ...] = ()
    writes: tuple[Access, ...] = ()
    dj: int = 0
    cost: str = ""  # key into the cost model's per-event cycles
    resource: Optional[str] = None
    last_tile_only: bool = False
    what: str = ""


# --------------------------------------------------------------------------- cost


@dataclass(frozen=True)
class UnitCost:
    unit: str  # mma, mufu, fma, cvt, tmem, smem
    cycles: float
    detail: str


@dataclass(frozen=True)
class PathCost:
    """Predicted cycles per KV tile per SM (all query stages of one CTA) for one P path."""

    path: str  # exp | direct_p_fast | direct_p_accurate | two_level
    units: tuple[UnitCost, ...]
    bottleneck: str
    cycles_per_tile: float  # max over units: everything overlapped perfectly
    serial_cycles: float  # sum over units: nothing overlapped

    def unit(self, name: str) -> UnitCost:
        for u in self.units:
            if u.unit == name:
                return u
        raise KeyError(name)


@dataclass(frozen=True)
class CostModel:
    target: str
    chosen: str  # the path the spec asks for
    paths: tuple[PathCost, ...]
    event_cycles: tuple[tuple[str, float], ...]  # per-event durations for simulate()
    assumptions: tuple[str, ...]

    def path(self, name: str) -> PathCost:
        for p in self.paths:
            if p.path == name:
                return p
        raise KeyError(name)


# --------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class SplitChoice:
    """The split-KV choice for one decode shape: ``ctas`` = batch x kv_heads x row tiles before
    splitting, ``key_tiles`` per sequence, ``splits`` per sequence, and the HBM-bound time of
    reading the cache once (``hbm_us``, at ``DecodePlan.hbm_bytes_per_s``)."""

    batch: int
    kv_heads: int
    cache_len: int
    ctas: int
    key_tiles: int
    splits: int
    cache_bytes: int
    hbm_us: float


@dataclass(frozen=True)
class DecodePlan:
    """Decode against a KV cache (a ``kv_cache`` block): how query rows are packed, how the
    keys are split (flash-decoding) and combined. The split count depends on the batch and the
    cache length, known at run time: the plan records the rule (``numerics.kvcache.split_count``
    with these constants) and its choice for representative shapes (``examples``)."""

    storage: str  # contiguous | paged
    page_size: Optional[int]
    cache_format: str
    q_tokens: int
    gqa: int
    rows_per_cta: int  # gqa x q_tokens query rows share one KV head's tiles: packed into one CTA
    row_tile: int  # rows per MMA tile (a wgmma M of 64 on sm90a)
    row_tiles: int
    tile_n: int  # keys per tile
    sm_count: int
    device: str
    split_rule: str
    min_tiles_per_split: int
    max_splits: int
    split_efficiency: float
    combine: str
    cache_bytes_per_token: float  # K and V of one token and KV head, scales included
    hbm_bytes_per_s: float
    examples: tuple[SplitChoice, ...] = ()
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------- transforms


# The HBM copy bandwidth of the H200 that the decode planner also uses (ir/passes/decode.py)
TRANSFORM_HBM_BYTES_PER_S = 4.3e12
# the shape the record prices as an example: the committed H200 forward rows (bench/results/
# attention-sm90-fwd-d128-fusedquant-h200.json): batch 2, 16 heads (MHA), 16k tokens
TRANSFORM_EXAMPLE = (2, 16, 16384)
TRANSFORM_INPUT_BYTES = 2  # bf16 q, k, v and O


@dataclass(frozen=True)
class TransformPass:
    """One separate pass over HBM that an outlier transform adds around the kernel (the kernels
    do not fuse them yet): what it reads and writes, in bytes per row of ``per`` (a key token of
    one KV head, or a query token of one query head), for bf16 inputs."""

    transform: str  # smooth_k | channel_scale_v | hadamard | sink_tokens
    step: str
    per: str  # "key" (per key token and KV head) | "query" (per query token and query head)
    bytes_read: int
    bytes_written: int


@dataclass(frozen=True)
class TransformsPlan:
    """The spec's outlier transforms as torch steps before and after the attention
    (``fp4gen.torch_ops``), with the HBM bytes of each pass and the time they predict at
    ``example`` = (batch, heads, seqlen) at ``hbm_bytes_per_s`` (a prediction from bytes alone:
    not measured, launch overheads and eager float32 temporaries not counted)."""

    transforms: tuple[str, ...]
    passes: tuple[TransformPass, ...]
    example: tuple[int, int, int]
    example_bytes: int
    hbm_bytes_per_s: float
    example_us: float
    fused: bool = False
    notes: tuple[str, ...] = ()


def transforms_plan(spec: KernelSpec) -> Optional[TransformsPlan]:
    """The ``transforms`` record of ``spec``'s plan (None when it asks for none). Each pass is the
    least one separate pass moves: it reads its input once in bf16 and writes its output once."""
    t = spec.transforms
    if not t:
        return None
    row = spec.head_dim * TRANSFORM_INPUT_BYTES  # one token of one head
    passes: list[TransformPass] = []
    if t.smooth_k:
        passes += [TransformPass("smooth_k", "mean of K over tokens", "key", row, 0),
                   TransformPass("smooth_k", "K - mean", "key", row, row),
                   TransformPass("smooth_k", "LSE shift scale * q . mean", "query", row, 4),
                   TransformPass("smooth_k", "LSE + shift", "query", 4 + 4, 4)]
    if t.hadamard:
        passes += [TransformPass("hadamard", "Q R", "query", row, row),
                   TransformPass("hadamard", "K R", "key", row, row)]
    if t.channel_scale_v:
        passes += [TransformPass("channel_scale_v", "amax of V's channels over tokens", "key", row, 0),
                   TransformPass("channel_scale_v", "V / c", "key", row, row),
                   TransformPass("channel_scale_v", "O * c", "query", row, row)]
    if t.sink_tokens:
        # the kernel runs on keys n..: K and V without their first n rows, a copy for a kernel that
        # reads compact K/V (the sm90a FP8 quantizer reads the view in place); then the n sink keys
        # attended in float32 (a read of Q: the n keys themselves are a few rows) and the merge of
        # O and LSE with their part (O and LSE read and written once)
        passes += [TransformPass("sink_tokens", "K, V without the first n keys", "key", 2 * row, 2 * row),
                   TransformPass("sink_tokens", "Q . K_sink (n keys, float32)", "query", row, 0),
                   TransformPass("sink_tokens", "merge O and LSE with the sinks", "query", row + 4, row + 4)]
    b, h, s = TRANSFORM_EXAMPLE
    nbytes = sum((p.bytes_read + p.bytes_written) * b * h * s for p in passes)  # MHA: as many K rows as Q rows
    return TransformsPlan(
        transforms=t.names, passes=tuple(passes), example=TRANSFORM_EXAMPLE, example_bytes=nbytes,
        hbm_bytes_per_s=TRANSFORM_HBM_BYTES_PER_S, example_us=round(nbytes / TRANSFORM_HBM_BYTES_PER_S * 1e6, 1),
        notes=("separate torch passes around the kernel, not fused into it (future work): each costs HBM "
               "traffic the kernel does not have",
               "example_us is predicted from the bytes at the HBM bandwidth, not measured"))


@dataclass(frozen=True)
class KernelPlan:
    spec: KernelSpec
    sm90: Optional[Sm90Plan] = None
    # Sections below are filled by the planning passes (see fp4gen.ir.passes).
    contracts: tuple = field(default=())  # tuple[OperandContract, ...]
    tmem: Optional[object] = None  # TmemPlan (sm100a)
    publish: Optional[object] = None  # PublishPlan
    pipeline: Optional[object] = None  # PipelinePlan
    events: tuple = field(default=())  # tuple[Event, ...]
    cost: Optional[object] = None  # CostModel
    mma: tuple = field(default=())  # tuple[MmaChoice, ...] (from legalize)
    notes: tuple = field(default=())  # planner remarks worth showing the user
    backward: Optional[object] = None  # BackwardPlan (sm90a specs with a backward block)
    decode: Optional[DecodePlan] = None  # a kv_cache spec's decode plan (ir/passes/decode.py)

    @property
    def transforms(self) -> Optional[TransformsPlan]:
        """The outlier transforms' record (``transforms_plan``), derived from the spec."""
        return transforms_plan(self.spec)

    def contract(self, operand: str) -> OperandContract:
        for c in self.contracts:
            if c.operand == operand:
                return c
        raise KeyError(operand)

    def mma_choice(self, name: str) -> MmaChoice:
        for m in self.mma:
            if m.name == name:
                return m
        raise KeyError(name)
