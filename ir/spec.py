"""The spec-level IR: what a user asked for, after parsing, before planning.

A ``KernelSpec`` is an immutable value built by the front end
(``fp4gen.frontend``) from one ``attention NAME { ... }`` block. The planning
passes (``fp4gen.ir.passes``) turn it into a ``KernelPlan``. Nothing here
imports the front end, jinja2 or torch.

Every field that came from the spec text carries a ``SourceLoc`` in
``KernelSpec.locs`` (keyed by a dotted field path such as ``"Q"``,
``"mask"``, ``"schedule.tile"``, ``"backward.dO"``), so that later passes can
report errors at the right place and generated kernels can say which spec
line produced each choice.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import Mapping, Optional


class Target(str, Enum):
    SM100A = "sm100a"
    SM90A = "sm90a"
    REFERENCE = "reference"


class Format(str, Enum):
    """Element formats of operands and of block scales."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8E4M3 = "fp8e4m3"  # OCP E4M3FN: no Inf, one NaN pattern, max 448
    FP8E5M2 = "fp8e5m2"  # OCP E5M2: IEEE-like, max 57344
    NVFP4 = "nvfp4"  # E2M1 payload, 1x16 blocks, E4M3 block scales
    MXFP4 = "mxfp4"  # E2M1 payload, 1x32 blocks, E8M0 block scales
    # scale-only formats
    E8M0 = "e8m0"  # power-of-two scale (OCP MX), 127 bias, 0xFF = NaN
    E4M3 = "e4m3"  # E4M3 used as a block scale (NVFP4)

    @property
    def bits(self) -> int:
        return {"fp32": 32, "bf16": 16, "fp16": 16, "fp8e4m3": 8, "fp8e5m2": 8,
                "nvfp4": 4, "mxfp4": 4, "e8m0": 8, "e4m3": 8}[self.value]

    @property
    def is_fp4(self) -> bool:
        return self in (Format.NVFP4, Format.MXFP4)

    @property
    def is_fp8(self) -> bool:
        return self in (Format.FP8E4M3, Format.FP8E5M2)

    @property
    def is_high_precision(self) -> bool:
        return self in (Format.FP32, Format.BF16, Format.FP16)


class ScaleGranularity(str, Enum):
    """How an operand's scale factors are shared."""

    NONE = "none"  # no scale (bf16, fp16, fp32)
    TENSOR = "tensor"  # one fp32 scale per (batch, head) tensor slice
    TOKEN = "token"  # one fp32 scale per row (token)
    BLOCK = "block"  # one scale per `block` contiguous elements along the reduction dim


@dataclass(frozen=True)
class SourceLoc:
    file: str
    line: int  # 1-based
    col: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class OperandFormat:
    """The number format of one operand.

    ``block`` is the number of elements that share one scale; ``scale`` is
    that scale's format. For the microscaling formats (nvfp4: block=16,
    scale=e4m3; mxfp4: block=32, scale=e8m0) the block runs along the
    dimension the consuming MMA reduces over. For fp8 with
    ``granularity=block`` the block is a run of ``block`` tokens (a whole
    ``block x head_dim`` tile shares one fp32 scale, as the Hopper kernels
    consume it). A bare fp8 format means one fp32 scale per (batch, head).
    """

    format: Format
    granularity: ScaleGranularity = ScaleGranularity.NONE
    block: Optional[int] = None
    scale: Optional[Format] = None

    def __str__(self) -> str:
        s = self.format.value
        if self.granularity is ScaleGranularity.BLOCK:
            s += f"(block={self.block}, scale={self.scale.value if self.scale else 'fp32'})"
        elif self.granularity in (ScaleGranularity.TENSOR, ScaleGranularity.TOKEN):
            s += f"(scale={self.granularity.value})"
        return s


def default_operand_format(fmt: Format) -> OperandFormat:
    """The format with its conventional scaling (what a bare `Q : nvfp4` means)."""
    if fmt is Format.NVFP4:
        return OperandFormat(fmt, ScaleGranularity.BLOCK, 16, Format.E4M3)
    if fmt is Format.MXFP4:
        return OperandFormat(fmt, ScaleGranularity.BLOCK, 32, Format.E8M0)
    if fmt.is_fp8:
        return OperandFormat(fmt, ScaleGranularity.TENSOR, None, Format.FP32)
    return OperandFormat(fmt)


class PKind(str, Enum):
    EXP = "exp"  # p = exp2(s*log2e - m), then converted to P's format
    DIRECT_P = "direct_p"  # scores straight to P's codes (paper's Direct-P)
    TWO_LEVEL = "two_level"  # SageAttention3: per-row rescale to [0, 448*6], then fp4


class DirectPPolicy(str, Enum):
    FAST = "fast"  # affine classifier max(0, a*x + b)
    ACCURATE = "accurate"  # hardware ex2 on part of the path


@dataclass(frozen=True)
class PProduction:
    kind: PKind = PKind.EXP
    policy: DirectPPolicy = DirectPPolicy.FAST
    a: float = 1.50
    b: float = 1.20


class GuardKind(str, Enum):
    NONE = "none"
    SAMPLE = "sample"


@dataclass(frozen=True)
class Guard:
    """The paper's extreme-logit guard (Algorithm 3), constants (M, L)."""

    kind: GuardKind = GuardKind.NONE
    m: int = 0
    l: int = 0


class Mask(str, Enum):
    """Which keys a query row sees. ``WINDOW`` carries its sizes in ``KernelSpec.window``;
    ``mask_for_window`` maps FlashAttention's ``window_size`` to the three."""

    NONE = "none"
    CAUSAL = "causal"  # window(-1, 0)
    WINDOW = "window"  # window(left, right), at least one side bounded and not (-1, 0)


class Sinks(str, Enum):
    """Attention sinks: ``LEARNED`` is GPT-OSS's per-head sink logit, one extra term
    ``exp(sink[h])`` in each row's softmax denominator with no value row (an input tensor (H,)
    in the units of the scaled scores)."""

    NONE = "none"
    LEARNED = "learned"


class Layout(str, Enum):
    """How a batch is laid out: ``DENSE`` (B, S, H, D) tensors, or ``VARLEN`` sequences packed
    into (total_tokens, H, D) tensors with ``cu_seqlens`` offsets (flash_attn's varlen)."""

    DENSE = "dense"
    VARLEN = "varlen"


# window(left, right): -1 (unbounded) or a key count; larger than any sequence is unbounded anyway
WINDOW_RANGE = range(-1, 1 << 31)


def mask_for_window(left: int, right: int) -> "tuple[Mask, Optional[tuple[int, int]]]":
    """(mask, window) for FlashAttention's ``window_size=(left, right)``: (-1, -1) is no mask,
    (-1, 0) is causal, anything else a window. One spelling per mask, so that ``window(-1, 0)``
    and ``causal`` are one spec (and run one kernel)."""
    if (left, right) == (-1, -1):
        return Mask.NONE, None
    if (left, right) == (-1, 0):
        return Mask.CAUSAL, None
    return Mask.WINDOW, (left, right)


class KvStorage(str, Enum):
    """How a KV cache holds each sequence's tokens: ``CONTIGUOUS`` (one row of
    ``seqlen_cache`` slots per sequence, flash_attn's ``(batch, seqlen_cache, Hkv, D)``) or
    ``PAGED`` (pages of ``page_size`` tokens, ``(num_pages, page_size, Hkv, D)``, found through
    a ``page_table`` (batch, pages_per_sequence) of page indices in any order)."""

    CONTIGUOUS = "contiguous"
    PAGED = "paged"


@dataclass(frozen=True)
class CacheFormat:
    """How K or V is stored in a KV cache, one token at a time (so every scale is fixed when
    the token is written; nothing is re-quantized when later tokens arrive):

    - ``bf16``: unscaled.
    - ``fp8e4m3`` with ``granularity`` ``TENSOR``: one fp32 scale per KV head for the whole
      cache, fixed when it is allocated (appended tokens saturate at +-448 x scale); ``TOKEN``:
      one fp32 scale per (token, KV head) over the head dim, taken when the token is written.
    - ``nvfp4``: E2M1 codes, one E4M3 scale per 16 elements along the head dim (for V too: the
      blocks run along D, not along the keys as a prefill's V does), and with ``tensor_scale``
      a power-of-two fp32 scale per KV head under the block scales (two-level), fixed at
      allocation. Definitions and layouts: ``fp4gen.numerics.kvcache``, docs/decode.md.
    """

    format: Format = Format.BF16
    granularity: ScaleGranularity = ScaleGranularity.NONE
    tensor_scale: bool = False

    def __str__(self) -> str:
        if self.format is Format.FP8E4M3:
            return f"fp8e4m3(scale={self.granularity.value})"
        if self.format is Format.NVFP4:
            return "nvfp4(block=16, scale=e4m3" + (", tensor_scale=fp32)" if self.tensor_scale else ")")
        return self.format.value

    @property
    def has_tensor_scale(self) -> bool:
        """Whether the cache fixes one fp32 scale per KV head when it is allocated."""
        return ((self.format is Format.FP8E4M3 and self.granularity is ScaleGranularity.TENSOR)
                or (self.format is Format.NVFP4 and self.tensor_scale))

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes one token of one KV head occupies (K or V), its scales included: what a
        memory-bound decode reads."""
        if self.format is Format.NVFP4:
            return head_dim / 2 + head_dim / 16
        if self.format is Format.FP8E4M3:
            return head_dim + (4 if self.granularity is ScaleGranularity.TOKEN else 0)
        return 2 * head_dim


@dataclass(frozen=True)
class KvCache:
    """The ``kv_cache { ... }`` block: decode against a cache (issue 22). ``q_tokens``: query
    tokens per sequence per step, at most (1 = decode, up to 8 for speculative decoding);
    ``gqa``: query heads per KV head (the group a decode kernel packs into one tile's rows)."""

    storage: KvStorage = KvStorage.CONTIGUOUS
    page_size: Optional[int] = None  # PAGED only
    format: CacheFormat = CacheFormat()
    q_tokens: int = 1
    gqa: int = 1

    def __str__(self) -> str:
        st = f"paged(page_size={self.page_size})" if self.storage is KvStorage.PAGED else "contiguous"
        return f"kv_cache {st}, {self.format}, q_tokens {self.q_tokens}, gqa {self.gqa}"


KV_CACHE_FORMATS = (Format.BF16, Format.FP8E4M3, Format.NVFP4)
# page_size: a power of two; at least one PV MMA K-step of 16 keys, at most 8192 tokens
KV_PAGE_SIZES = tuple(1 << i for i in range(4, 14))
KV_Q_TOKENS_RANGE = range(1, 9)  # decode (1) to speculative decoding's drafts (8)
KV_GQA_RANGE = range(1, 129)  # query heads per KV head: 1 (MHA) .. 128 (MQA of 128 heads)


class PPublish(str, Enum):
    WHOLE = "whole"
    HALVES = "halves"


class PSource(str, Enum):
    """Where the sm100a PV MMA reads P (its A operand) from."""

    TMEM = "tmem"  # tcgen05.mma with A in TMEM (P inside its stage's S columns)
    SMEM = "smem"  # the SS form: P's codes in an SMEM tile, A through a matrix descriptor


@dataclass(frozen=True)
class TmemRegionRequest:
    """An explicit TMEM region from `tmem { NAME cols A..B }` (inclusive)."""

    name: str
    first_col: int
    last_col: int


@dataclass(frozen=True)
class Schedule:
    tile_m: int = 128
    tile_n: int = 128
    q_stages: int = 2
    p_publish: PPublish = PPublish.HALVES
    # None = automatic; otherwise the explicit regions, checked by the planner
    tmem_regions: Optional[tuple[TmemRegionRequest, ...]] = None
    kv_stages: Optional[int] = None  # None = planner decides
    p_source: PSource = PSource.TMEM


# ---- bounds of the numeric fields ----------------------------------------------------------
# The language's limits, whatever the target: each holds every value some backend takes (each
# target's planner narrows it further), and none lets a spec make a backend allocate or loop
# without bound (an fp8 block of 2**31 tokens once padded a tensor to 2 TiB). The front end
# refuses a value outside them at its spec line; fp4gen/frontend/LANGUAGE.md lists them.
HEAD_DIM_RANGE = range(16, 257, 16)
TILE_RANGE = range(16, 257, 16)  # tile M and N (the reference's row block and key chunk too)
Q_STAGES_RANGE = range(1, 4)  # sm100a: 1-2 softmax warpgroups; sm90a: tile_m / 64 consumers
KV_STAGES_RANGE = range(1, 9)
FP8_TOKEN_BLOCKS = (16, 32, 64, 128, 256)  # fp8(block=N) with fp32 scales: one scale per N tokens
MX_BLOCK = 32  # fp8 with e8m0 block scales is OCP MX: one scale per 32 elements
GUARD_M_RANGE = range(1, 128)  # |max score| threshold in log2 units; E8M0 spans 2**-127..2**127
GUARD_L_RANGE = range(1, 65)  # sampled keys per row: a loop per CTA, a table per row
# also the bound of softmax_scale= in fp4gen.attention and generated forwards (runtime/checks.py)
SOFTMAX_SCALE_RANGE = (1e-6, 1e6)
# softcap c (scores become c * tanh(s / c)): Gemma-2 uses 50 and 30; 0 (the default) is none
SOFTCAP_RANGE = (1e-2, 1e4)


def bound_text(x: float) -> str:
    """A bound as a user would write it in a spec: 1e-06 -> '1e-6', 1000000.0 -> '1e6'."""
    return f"{x:g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")


# Direct-P's FP4 classifier x = a (u - m) + b (docs/numerics.md); the paper uses a in [1.5, 1.6]
DIRECT_P_A_RANGE = (1e-3, 8.0)
DIRECT_P_B_RANGE = (-8.0, 8.0)
# the P formats Direct-P writes (numerics.reference, sm100a: mxfp4, sm90a: fp8e4m3)
DIRECT_P_FORMATS = (Format.MXFP4, Format.FP8E4M3)


@dataclass(frozen=True)
class Transforms:
    """Outlier-robust transforms the spec asks for (issue 21; ``fp4gen.numerics.outliers``), each
    exact in real arithmetic and run as torch steps around the attention (``fp4gen.torch_ops``):

    - ``smooth_k`` (``K : ... smooth``): K minus its mean over tokens per (batch, kv head); the
      LSE gets ``scale * q . mean`` back.
    - ``channel_scale_v`` (``V : ... channel_scale``): V's channels divided by a power of two
      per (batch, kv head, channel), O's columns multiplied back.
    - ``hadamard`` (``rotate qk hadamard(seed=N)``): Q and K times one orthonormal Hadamard
      matrix (random column signs from ``hadamard_seed``, None = no signs).
    - ``sink_tokens`` (``sink_tokens N``): the first N keys of every sequence (attention sinks)
      are left out of the quantized attention, so that their V rows share no FP4/FP8 scale with
      the others, and attended exactly in float32 beside it; the two parts are merged by their
      log-sum-exps (``outliers.Post.apply``). 0 = off.

    All off by default; a spec that sets none serializes as before the field existed (and one
    without ``sink_tokens`` as before that field existed)."""

    smooth_k: bool = False
    channel_scale_v: bool = False
    hadamard: bool = False
    hadamard_seed: Optional[int] = None
    sink_tokens: int = 0  # leading keys attended exactly outside the quantized attention; 0 = none

    @property
    def names(self) -> tuple[str, ...]:
        """The ``outliers.ALL_TRANSFORMS`` names that are on (``outliers.apply`` runs them in its
        own fixed order, sink_tokens first)."""
        return tuple(n for n in ("smooth_k", "channel_scale_v", "hadamard", "sink_tokens") if getattr(self, n))

    def __bool__(self) -> bool:
        return bool(self.names)

    def __str__(self) -> str:
        parts = [n for n in ("smooth_k", "channel_scale_v") if getattr(self, n)]
        if self.hadamard:
            parts.append("hadamard" + (f"(seed={self.hadamard_seed})" if self.hadamard_seed is not None else ""))
        if self.sink_tokens:
            parts.append(f"sink_tokens({self.sink_tokens})")
        return ", ".join(parts) or "none"


# rotate qk hadamard(seed=N): a torch.Generator seed (numerics.outliers.hadamard_matrix)
HADAMARD_SEED_RANGE = range(0, 1 << 31)
# sink_tokens N: StreamingLLM keeps 4; the exact part costs a float32 (Sq x N) score block per head
SINK_TOKENS_RANGE = range(1, 129)


BACKWARD_OPERANDS = ("dO", "dS", "dP", "dQ", "dK", "dV")
FORWARD_OPERANDS = ("Q", "K", "P", "V", "O")
REUSABLE_STATE = ("q", "k", "lse", "scales")


@dataclass(frozen=True)
class Backward:
    """The causal training path: which forward state is reused, gradient formats."""

    reuse: frozenset[str] = frozenset({"q", "k", "lse"})
    # hash=False: a mapping is not hashable; equal specs still compare equal
    formats: Mapping[str, OperandFormat] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    deterministic: bool = False

    def format_of(self, name: str) -> OperandFormat:
        """Gradient operands the spec leaves out default to bf16."""
        return self.formats.get(name, OperandFormat(Format.BF16))


@dataclass(frozen=True)
class KernelSpec:
    name: str
    target: Target
    head_dim: int
    mask: Mask = Mask.NONE
    softmax_scale: Optional[float] = None  # None = 1/sqrt(head_dim)
    # (left, right) keys either side of the diagonal when mask is WINDOW, else None
    window: Optional[tuple[int, int]] = None
    softcap: float = 0.0  # c > 0: scores become c * tanh(s / c) (s scaled); 0 = none
    sinks: Sinks = Sinks.NONE
    layout: Layout = Layout.DENSE
    q: OperandFormat = OperandFormat(Format.BF16)
    k: OperandFormat = OperandFormat(Format.BF16)
    p: OperandFormat = OperandFormat(Format.BF16)
    v: OperandFormat = OperandFormat(Format.BF16)
    o: OperandFormat = OperandFormat(Format.BF16)
    p_production: PProduction = PProduction()
    guard: Guard = Guard()
    schedule: Schedule = Schedule()
    backward: Optional[Backward] = None
    kv_cache: Optional[KvCache] = None  # decode against a KV cache (the kv_cache block)
    transforms: Transforms = Transforms()  # outlier-robust pre/post steps (all off by default)
    # where each field came from (dotted path -> location); see module docstring
    locs: Mapping[str, SourceLoc] = field(default_factory=lambda: MappingProxyType({}), compare=False)
    source_file: str = "<spec>"
    # the spec's source lines, 1-based via source_lines[line - 1], for comments in generated code
    source_lines: tuple[str, ...] = field(default=(), compare=False)

    def operand(self, name: str) -> OperandFormat:
        """Format of a forward operand by its spec name (Q, K, P, V, O)."""
        return {"Q": self.q, "K": self.k, "P": self.p, "V": self.v, "O": self.o}[name]

    @property
    def window_size(self) -> tuple[int, int]:
        """The mask as FlashAttention's ``window_size`` (-1 = unbounded): query i (of Sq) sees
        key j (of Sk) iff i + Sk - Sq - left <= j <= i + Sk - Sq + right (bottom-right aligned)."""
        if self.mask is Mask.CAUSAL:
            return (-1, 0)
        if self.mask is Mask.WINDOW and self.window is not None:
            return self.window
        return (-1, -1)

    @property
    def uses_extensions(self) -> tuple[str, ...]:
        """The spec fields beyond dense none/causal attention that it sets (field paths of
        ``locs``: "mask", "softcap", "sinks", "layout"), for the targets that refuse them. A
        ``kv_cache`` block is not among them: the decode pass (``ir/passes/decode.py``) plans it."""
        out = []
        if self.mask is Mask.WINDOW:
            out.append("mask")
        if self.softcap:
            out.append("softcap")
        if self.sinks is not Sinks.NONE:
            out.append("sinks")
        if self.layout is not Layout.DENSE:
            out.append("layout")
        return tuple(out)

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    def loc(self, path: str) -> Optional[SourceLoc]:
        return self.locs.get(path)

    def origin(self, path: str) -> str:
        """'spec.attn:12: P : mxfp4 via direct_p(...)' for comments in generated code."""
        loc = self.locs.get(path)
        if loc is None:
            return f"{self.source_file}: (default for {path})"
        text = self.source_lines[loc.line - 1].strip() if 0 < loc.line <= len(self.source_lines) else ""
        return f"{loc.file}:{loc.line}: {text}"

    def with_target(self, target: Target) -> "KernelSpec":
        return replace(self, target=target)
