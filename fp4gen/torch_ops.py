"""fp4gen attention as a PyTorch operator: custom ops, autograd, torch.compile.

Public entry points (flash_attn's names and conventions)::

    from fp4gen.torch_ops import attention, attention_varlen
    o = attention(q, k, v, spec=spec)        # q: (B, S, H, D), k/v: (B, S, Hkv, D)
    o.sum().backward()                        # gradients flow to q, k, v
    o, lse = attention(q, k, v, spec=spec, window_size=(128, 0), softcap=30.0, return_lse=True)
    o = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, spec=spec)  # (total, H, D)

Keyword arguments override the spec (``causal``, ``window_size``, ``softcap``, ``sinks``; the
varlen entry point sets ``layout varlen``): the call runs the *effective* spec, and a generated
kernel only when that is exactly the spec it was generated from (``effective_spec``).

``spec`` is a ``KernelSpec``, the path of an ``.attn`` file holding one
attention block (``"file.attn::NAME"`` picks one of several), or a generated
kernel module (see ``fp4gen.lowering``) or its ``.py`` path. The user guide is
docs/training.md.

Two operators are registered with ``torch.library`` so that ``torch.compile``
and ``torch.export`` see one opaque node per call instead of tracing into the
kernels:

- ``fp4gen::attention_fwd(q, k, v, spec_key, softmax_scale, backend, sinks=None, cu_seqlens_q=None,
  cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0) -> (o, lse, state)``
- ``fp4gen::attention_bwd(q, k, v, o, lse, do, state, spec_key, softmax_scale, backend, sinks=None,
  ...the same varlen arguments) -> (dq, dk, dv)``

The learned sinks' gradient is ``fp4gen.numerics.reference.sinks_grad`` of o, lse and dO (plain
torch ops in the autograd formula), so the backward op returns the three input gradients only.

``state`` is empty, except for a generated module whose backward recomputes S from the
forward's FP8 Q/K (``BWD_S_FP8``): then it holds the forward's Q/K payloads (as bytes) and
the Q, K and V scales, which the backward takes as ``prepared=`` instead of quantizing q
and k again (the paper's reuse of the forward's quantized state).

A custom op's arguments must be tensors or plain scalars, so a spec travels as
a string key into a process-wide registry (``spec_key``). The key is a hash of
the spec's content (not of where it was written), so equal specs share one key
and the key is the same in every process.

Where it runs (decided per call, from the tensors' device):

- CPU, or a spec whose target is ``reference``: the reference backend
  ``fp4gen.numerics.reference`` (exact torch emulation of the spec's numerics).
- CUDA, when a generated module for the spec exists, its ``TARGET`` is the
  GPU's architecture (``sm90a`` on Hopper, ``sm100a`` on Blackwell) and it was
  generated from exactly this spec: the module's ``forward`` / ``backward``.
- otherwise, under ``backend="auto"``, a ``NoKernelError`` saying why and what
  to change; ``backend="reference"`` runs the reference on the GPU (correct,
  slow) on purpose. A spec without a ``backward`` block has no generated
  backward: its backward raises likewise.

``explain(spec, device)`` says which one a call would use and why;
``dispatch_counts()`` counts what actually ran.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

import torch

from fp4gen.ir.spec import KernelSpec, Layout, Mask, Sinks, Target, mask_for_window
from fp4gen.runtime import checks
from fp4gen.runtime.checks import AttentionInputError

__all__ = [
    "attention",
    "attention_varlen",
    "effective_spec",
    "AttentionInputError",
    "spec_key",
    "spec_for_key",
    "explain",
    "dispatch_counts",
    "reset_dispatch_counts",
    "BACKENDS",
    "NoKernelError",
]

# "auto" picks a generated kernel where one applies, else the reference.
BACKENDS = ("auto", "reference", "generated")

# The GPU architectures generated modules target, by CUDA compute capability.
_ARCH_BY_CAPABILITY = {(9, 0): "sm90a", (10, 0): "sm100a", (10, 3): "sm100a"}


# ---------------------------------------------------------------------------
# The spec registry
# ---------------------------------------------------------------------------


class NoKernelError(RuntimeError):
    """backend="auto" on a GPU where no generated kernel applies to the spec: the message says
    why and which spec line or option fixes it (no silent slow path)."""


@dataclasses.dataclass
class _Entry:
    # the spec the reference backend runs (None: a generated module whose spec
    # could not be recovered; then only that module can run)
    spec: Optional[KernelSpec]
    # a generated module the caller handed over explicitly (spec=module)
    module: Optional[ModuleType] = None
    # generated-module lookups by architecture: arch -> (module or None, reason); also the ops'
    # per-call plans (``_plan``), under tuple keys, so that clearing the lookups drops them too
    found: dict = dataclasses.field(default_factory=dict)


_REGISTRY: dict[str, _Entry] = {}
_LOCK = threading.Lock()
_COUNTS: Counter = Counter()
# parsed .attn files: (realpath, mtime_ns, size) -> KernelSpec
_PARSED: dict[tuple, KernelSpec] = {}

def _fingerprint(spec: KernelSpec) -> str:
    """A hash of what ``spec`` computes (``computed_fields``: not where it was written)."""
    from fp4gen.ir.serialize import computed_fields, spec_to_dict

    text = json.dumps(computed_fields(spec_to_dict(spec)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _register(key: str, entry: _Entry) -> str:
    with _LOCK:
        _REGISTRY.setdefault(key, entry)
    return key


def _entry(key: str) -> _Entry:
    try:
        return _REGISTRY[key]
    except KeyError:
        raise RuntimeError(
            f"fp4gen attention: spec key {key!r} is not registered in this process; "
            "call fp4gen.torch_ops.attention (or spec_key(spec)) with the spec first"
        ) from None


def spec_for_key(key: str) -> Optional[KernelSpec]:
    """The spec registered under ``key`` (None for a module whose spec is unknown)."""
    return _entry(key).spec


def _parse_attn_file(path: Path, kernel: Optional[str]) -> KernelSpec:
    from fp4gen.runtime.fileio import InputFileError, read_text_file

    try:
        st = path.stat()
    except OSError as e:
        raise AttentionInputError(f"cannot read spec file {str(path)!r}: {e.strerror}") from None
    cache_key = (str(path.resolve()), st.st_mtime_ns, st.st_size, kernel)
    if cache_key in _PARSED:
        return _PARSED[cache_key]
    try:
        text = read_text_file(path)  # directories, devices, binary and huge files: named errors
    except InputFileError as e:
        raise AttentionInputError(str(e)) from None
    from fp4gen.frontend import parse_text

    spec = _pick_kernel(parse_text(text, filename=str(path)), str(path), kernel)  # SpecError is the user's
    _PARSED[cache_key] = spec
    return spec


def _pick_kernel(parsed, where: str, kernel: Optional[str]) -> KernelSpec:
    """parse_file returns every block of a file; pick one (by name if given)."""
    specs = [parsed] if isinstance(parsed, KernelSpec) else list(parsed)
    names = ", ".join(s.name for s in specs)
    if kernel is not None:
        for s in specs:
            if s.name == kernel:
                return s
        raise AttentionInputError(f"{where} has no attention block {kernel!r}; it defines: {names}")
    if len(specs) != 1:
        raise AttentionInputError(
            f"{where} holds {len(specs)} attention blocks ({names}); "
            f"pick one with '{where}::NAME' or pass its KernelSpec")
    return specs[0]


def _load_module_file(path: Path) -> ModuleType:
    from fp4gen.runtime import LoadError, load
    try:
        return load(path)
    except LoadError as e:
        raise AttentionInputError(str(e)) from None


def _spec_of_module(mod: ModuleType) -> Optional[KernelSpec]:
    """The KernelSpec a generated module was rendered from: its ``SPEC`` when it holds one
    (the reference backend), else the ``kernel_spec`` of its ``PLAN_JSON``
    (``fp4gen.ir.serialize.spec_from_plan_json``; without ``locs``/``source_lines``). None
    only for a module without ``PLAN_JSON``; an ``AttentionInputError`` saying why for a
    ``PLAN_JSON`` that holds no spec this version reads (not JSON, another schema, written
    before plans recorded their spec: regenerate the module)."""
    s = getattr(mod, "SPEC", None)
    if isinstance(s, KernelSpec):
        return s
    plan_json = getattr(mod, "PLAN_JSON", None)
    if plan_json is None:
        return None
    from fp4gen.ir.serialize import PlanJsonError, spec_from_plan_json

    try:
        return spec_from_plan_json(plan_json)
    except PlanJsonError as e:
        name = getattr(mod, "KERNEL_NAME", mod.__name__)
        raise AttentionInputError(
            f"generated module {name} ({getattr(mod, '__file__', None) or mod.__name__}): its PLAN_JSON "
            f"holds no spec fp4gen can read: {e}; regenerate it (fp4gen compile / fp4gen regenerate)"
        ) from None


def _is_generated_module(obj) -> bool:
    return isinstance(obj, ModuleType) and hasattr(obj, "TARGET") and callable(getattr(obj, "forward", None))


# spec_key is called on every eager attention call: remember its answers.
# KernelSpec values and modules are immutable as far as we are concerned, so
# they are cached by identity (the cache holds them, so an id is never reused);
# a path is cached with its file's mtime and size, so an edited file is re-read.
_KEY_CACHE: dict = {}


@dataclasses.dataclass(frozen=True)
class Overrides:
    """What a call's keyword arguments change in its spec; the defaults change nothing.

    ``causal`` None and ``window_size`` (-1, -1) keep the spec's mask; otherwise the mask is what
    ``flash_attn_func(causal=bool(causal), window_size=window_size)`` means (causal sets the
    window's right side to 0). ``softcap`` 0.0 keeps the spec's, another value replaces it.
    ``sinks`` True: the call passes sink logits (the spec becomes ``sinks learned``).
    ``layout`` None keeps the spec's (``attention``: dense; ``attention_varlen``: varlen)."""

    causal: Optional[bool] = None
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    layout: Optional[str] = None

    def __post_init__(self):  # a list window_size too; the value is a cache key, so hashable
        object.__setattr__(self, "window_size", tuple(self.window_size))

    def apply(self, spec: KernelSpec) -> KernelSpec:
        kw: dict = {}
        if self.causal is not None or tuple(self.window_size) != (-1, -1):
            left, right = self.window_size
            mask, window = mask_for_window(left, 0 if self.causal else right)
            kw.update(mask=mask, window=window)
        if self.softcap:
            kw["softcap"] = float(self.softcap)
        if self.sinks:
            kw["sinks"] = Sinks.LEARNED
        if self.layout is not None:
            kw["layout"] = Layout(self.layout)
        changed = {k: v for k, v in kw.items() if getattr(spec, k) != v}
        return dataclasses.replace(spec, **changed) if changed else spec


def effective_spec(spec: KernelSpec, **overrides) -> KernelSpec:
    """``spec`` with a call's keyword arguments applied (``Overrides``): what the call runs."""
    return Overrides(**overrides).apply(spec)


def spec_key(spec, causal: Optional[bool] = None, **overrides) -> str:
    """Register ``spec`` (KernelSpec, .attn path, generated module or its .py path) and
    return the string key the custom ops take. ``causal`` and ``overrides`` (``Overrides``:
    window_size, softcap, sinks, layout) change the spec as a call's keyword arguments do."""
    ov = Overrides(causal=causal, **overrides)
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        try:
            st = os.stat(text.rsplit("::", 1)[0])
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            return _spec_key(spec, ov)  # raises the clear error
        ck = ("path", os.path.abspath(text), ov)
        hit = _KEY_CACHE.get(ck)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        key = _spec_key(spec, ov)
        _KEY_CACHE[ck] = (stamp, key)
        return key
    ck = ("obj", id(spec), ov)
    hit = _KEY_CACHE.get(ck)
    if hit is not None and hit[0] is spec:
        return hit[1]
    key = _spec_key(spec, ov)
    _KEY_CACHE[ck] = (spec, key)
    return key


def _spec_key(spec, ov: Overrides) -> str:
    causal = ov.causal
    if isinstance(spec, (str, os.PathLike)):
        text, kernel = os.fspath(spec), None
        if "::" in text:  # "file.attn::kernel_name" picks one block of a file
            text, kernel = text.rsplit("::", 1)
        path = Path(text).expanduser()
        if path.suffix == ".py":
            spec = _load_module_file(path)
        else:
            spec = _parse_attn_file(path, kernel)

    if isinstance(spec, KernelSpec):
        spec = ov.apply(spec)
        return _register(f"{spec.name}@{_fingerprint(spec)}", _Entry(spec=spec))

    if _is_generated_module(spec):
        mod = spec
        mspec = _spec_of_module(mod)
        if causal is not None and mspec is not None and (mspec.mask is Mask.CAUSAL) != causal:
            raise AttentionInputError(
                f"generated kernel {getattr(mod, 'KERNEL_NAME', mod.__name__)} was compiled with "
                f"mask {mspec.mask.value}; it cannot run causal={causal}. Pass causal=None, or pass "
                "the KernelSpec to run another mask on the reference backend"
            )
        if causal is not None and mspec is None:
            raise AttentionInputError(
                f"the mask of generated module {mod.__name__} is unknown (no spec recoverable); "
                "pass causal=None"
            )
        if mspec is not None and ov.apply(mspec) != mspec:
            changed = _differing_fields(mspec, ov.apply(mspec))
            raise AttentionInputError(
                f"generated kernel {getattr(mod, 'KERNEL_NAME', mod.__name__)} was compiled for another "
                f"{', '.join(changed)}; it cannot run this call's. Drop those arguments, or pass the KernelSpec "
                "to run the effective spec on the reference backend (backend='reference')"
            )
        if mspec is None and ov != Overrides(causal=causal):
            raise AttentionInputError(
                f"the spec of generated module {mod.__name__} is unknown (no spec recoverable); "
                "pass no window_size, softcap, sinks or varlen arguments"
            )
        ident = mspec and _fingerprint(mspec)
        ident = ident or hashlib.sha256(str(getattr(mod, "PLAN_JSON", mod.__name__)).encode()).hexdigest()[:16]
        name = getattr(mod, "KERNEL_NAME", mod.__name__)
        key = f"{name}:{mod.TARGET}@{ident}"
        return _register(key, _Entry(spec=mspec, module=mod))

    raise AttentionInputError(
        "spec must be a fp4gen KernelSpec, the path of an .attn file, or a generated kernel "
        f"module; got {type(spec).__name__}"
    )


# torch.compile: resolving a spec (hashing, maybe parsing a file) is not
# traceable, but its result is a constant for a given spec, so Dynamo runs it
# once at trace time and guards on the spec object instead of breaking the graph.
@torch.compiler.assume_constant_result
def _resolve_for_trace(spec, causal, window_size, softcap, sinks, layout):
    key = spec_key(spec, causal, window_size=window_size, softcap=softcap, sinks=sinks, layout=layout)
    s = _REGISTRY[key].spec
    head_dim = s.head_dim if s is not None else -1
    return key, head_dim


def _differing_fields(a: KernelSpec, b: KernelSpec) -> list[str]:
    """The spec_to_dict fields in which two specs differ ("mask", "window", "softcap", ...)."""
    from fp4gen.ir.serialize import computed_fields, spec_to_dict

    da, db = computed_fields(spec_to_dict(a)), computed_fields(spec_to_dict(b))
    return sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def _reference():
    """The reference backend module (a function so tests can substitute it)."""
    try:
        from fp4gen.numerics import reference
    except ImportError as e:
        raise RuntimeError(
            "fp4gen's reference backend (fp4gen.numerics.reference) is not available: " + str(e)
        ) from None
    return reference


_ARCH_BY_DEVICE: dict = {}


def _arch_of(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return None
    arch = _ARCH_BY_DEVICE.get(device)  # a device's capability never changes: ask CUDA once
    if arch is None:
        arch = _ARCH_BY_DEVICE[device] = _ARCH_BY_CAPABILITY.get(torch.cuda.get_device_capability(device), "")
    return arch or None


def _find_generated(entry: _Entry, arch: str):
    """(module, None) when a generated kernel for this spec runs on ``arch``,
    else (None, reason)."""
    if arch in entry.found:
        return entry.found[arch]
    if entry.module is not None:
        mod = entry.module
        result = (mod, None) if mod.TARGET == arch else (
            None, f"generated module targets {mod.TARGET}, this GPU is {arch}")
    else:
        result = _lookup_generated(entry.spec, arch)
    entry.found[arch] = result
    return result


def _lookup_generated(spec: KernelSpec, arch: str):
    """Find the generated module for ``spec`` on ``arch``: the committed one in
    ``fp4gen.generated``, else one rendered from the spec's own .attn file by
    ``fp4gen.load`` (cached on disk). Only a module generated from an
    identical spec is used."""
    if spec.target.value != arch:
        return None, f"spec target is {spec.target.value}, this GPU is {arch}"
    if spec.uses_extensions:  # kernels implement some of them: say where the planner or the lowering refuses
        from fp4gen.ir.passes import PlanError, legalize, plan_kernel
        from fp4gen.lowering import refusal

        try:
            legalize(spec)
            err = refusal(plan_kernel(spec))
        except PlanError as e:
            where = f" (spec line {e.loc})" if e.loc else ""
            return None, f"no {arch} kernel implements it: {e.message}{where}"
        if err is not None:
            where = f" (spec line {spec.loc(err.path)})" if err.path and spec.loc(err.path) else ""
            return None, f"no {arch} kernel implements it: {err}{where}"
    from fp4gen.lowering import module_name
    from fp4gen.api import LoadError, load
    stem = module_name(spec.name, arch)
    tried = []
    candidates = [stem]
    if spec.source_file.endswith(".attn") and Path(spec.source_file).is_file():
        candidates.append(spec.source_file)
    for cand in candidates:
        try:
            mod = load(cand, kernel=spec.name, target=arch)
        except LoadError as e:
            tried.append(str(e))
            continue
        except Exception as e:  # a broken generated file must not stop training on the reference
            tried.append(f"{cand}: {type(e).__name__}: {e}")
            continue
        try:
            mspec = _spec_of_module(mod)
        except AttentionInputError as e:  # its PLAN_JSON holds no readable spec: say so, use the reference
            tried.append(str(e))
            continue
        if mspec is None:
            tried.append(f"{mod.__name__} does not say which spec it was generated from")
        elif _fingerprint(mspec.with_target(Target(arch))) != _fingerprint(spec):
            diff = ", ".join(_differing_fields(mspec.with_target(Target(arch)), spec))
            tried.append(f"{mod.__name__} was generated from a different spec (it differs in {diff}: stale, "
                         "or this call's arguments change the spec)")
        else:
            return mod, None
    return None, "; ".join(tried) or "no generated module"


def _no_kernel_message(entry: _Entry, device, need_backward: bool, reason: str) -> str:
    spec = entry.spec
    name = spec.name if spec is not None else "this kernel"
    where = f" ({spec.source_file})" if spec is not None and spec.source_file else ""
    if need_backward and "no backward" in (reason or ""):
        fix = f"add a `backward {{ ... }}` block to {name}{where} (docs/backward.md)"
    elif reason and "kernel implements it" in reason:
        fix = ("for a generated kernel use mask none or causal, no softcap or sinks and the dense layout "
               f"(in {name}{where} and in the call's arguments), or on sm90a a forward-only spec (its forward "
               "implements window, softcap, sinks and BF16 varlen; no backward does)")
    elif reason and reason.startswith("spec target is"):
        fix = f"set `target` in {name}{where} to this GPU's architecture"
    elif "unsupported GPU architecture" in (reason or ""):
        fix = "run on a GPU fp4gen generates for (sm90a: H100/H200; sm100a: B200/GB200)"
    else:
        fix = f"regenerate the module from {name}{where} (`fp4gen compile`, or `fp4gen regenerate` for examples/)"
    return (f"fp4gen: no generated {'backward' if need_backward else 'forward'} kernel for {name} on "
            f"{device}: {reason}. Fix: {fix}; or pass backend='reference' to run the exact but slow "
            "reference backend on purpose. fp4gen.torch_ops.explain(spec, device) shows the choice.")


def _choose(entry: _Entry, device: torch.device, backend: str, need_backward: bool = False, *,
            strict: bool = False):
    """-> (module or None for reference, reason text). ``strict`` (the ops): under
    backend="auto" a CUDA call with no generated kernel raises NoKernelError instead of
    running the reference; explain() calls without it to report the choice."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    mod, reason = None, None
    arch = _arch_of(device)
    if backend != "reference":
        if entry.module is not None and entry.module.TARGET == "reference":
            mod = entry.module  # a reference-target module runs anywhere
        elif arch is None:
            reason = f"no generated kernel runs on {device.type}" + (
                " (unsupported GPU architecture)" if device.type == "cuda" else "")
        else:
            mod, reason = _find_generated(entry, arch)
        if mod is not None and need_backward and not callable(getattr(mod, "backward", None)):
            mod, reason = None, "the generated module has no backward (spec without a backward block)"
    if mod is None and entry.spec is None:
        raise RuntimeError(
            f"cannot run this generated kernel on {device}: {reason}; and its spec is unknown, "
            "so the reference backend cannot stand in")
    if mod is None and backend == "generated":
        raise RuntimeError(f"backend='generated' but no generated kernel applies: {reason}")
    if strict and mod is None and backend == "auto" and device.type == "cuda":
        raise NoKernelError(_no_kernel_message(entry, device, need_backward, reason))
    return mod, reason or "reference backend requested"


def _ref_spec(entry: _Entry, softmax_scale: Optional[float]) -> KernelSpec:
    s = entry.spec
    if softmax_scale is not None and softmax_scale != s.softmax_scale:
        s = dataclasses.replace(s, softmax_scale=softmax_scale)
    return s


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What an op call runs, derived only from (spec key, device, backend, pass, sinks given,
    varlen): the module (None: the reference) and the module's forward-state options."""

    mod: Optional[ModuleType]
    keeps_state: bool
    state_opts: dict
    # the module's forward / backward take q, k, v as they lie (``_forward_operands``, ``_bwd_run``)
    strided_fwd: bool = False
    strided_bwd: bool = False


def _plan(entry: _Entry, device: torch.device, backend: str, need_backward: bool, has_sinks: bool,
          varlen: bool) -> _Plan:
    """``_choose`` + ``_module_for_extras`` + the state flags, once per key: the ops run this on
    every call (issue 24: no per-call Python work that can be cached). Kept in ``entry.found``
    (cleared with the lookups it derives from) and keyed on ``_arch_of`` too (tests replace it).
    A refusal raises every time (not cached)."""
    ck = ("plan", device, backend, need_backward, has_sinks, varlen, _arch_of)
    plan = entry.found.get(ck)
    if plan is None:
        mod, _ = _choose(entry, device, backend, need_backward=need_backward, strict=True)
        mod = _module_for_extras(mod, True if has_sinks else None, True if varlen else None,
                                 backward=need_backward)
        plan = _Plan(mod, _keeps_forward_state(mod), forward_state_options(mod) if mod is not None else {},
                     _forward_takes_strides(mod), _backward_takes_strides(mod))
        entry.found[ck] = plan
    return plan


# ---------------------------------------------------------------------------
# The custom ops
# ---------------------------------------------------------------------------


def _forward_takes_strides(mod) -> bool:
    """Whether ``mod``'s forward reads q, k and v only through the fused FP8 quantizer, which reads
    any 16-byte strides in place (``fp4gen.device.quantize.strided_view``): an sm90a FP8-input
    dense forward, whose attention kernel reads only the quantized copies. Then a fused QKV
    projection's views go in without a copy (issue 24: 3 copies per layer and step)."""
    from fp4gen.runtime.sm90_host import ForwardHost

    host = getattr(mod, "_HOST", None)
    return isinstance(host, ForwardHost) and host.config.in_fp8 is True and not host.config.varlen


def _backward_takes_strides(mod) -> bool:
    """Whether ``mod``'s backward is the sm90a ``BackwardHost``, which copies only the operands its
    kernels read as compact rows (``sm90_bwd_host.BackwardHost.backward``): the rest go as they lie."""
    from fp4gen.runtime.sm90_bwd_host import BackwardHost

    return isinstance(getattr(mod, "_BWD_HOST", None), BackwardHost)


def _empty_like_is_compact(t) -> bool:
    """Whether ``torch.empty_like(t)`` is contiguous. It follows the order of t's strides (a
    permuted t, e.g. SDPA's (B, H, S, D) transposed, gives a permuted tensor; a fused QKV
    projection's views a contiguous one); torch's rules for size-1 and stride-0 dims are
    intricate, so ask torch itself, on the meta device (no memory, ~3 us)."""
    return t.is_contiguous() or torch.empty_like(t, device="meta").is_contiguous()


def _forward_operands(plan: _Plan, q, k, v):
    """q, k, v for the generated forward. The compiled kernels load compact tensors through TMA,
    so in general each is copied (``.contiguous()``: a no-op for a compact one); the BF16 sm90a
    kernels' descriptors would take a fused QKV's row strides too, but that has not run on a GPU
    (tests/torch_ops/test_strided_gpu.py), so they keep the copy. A forward that reads its inputs
    only through the fused FP8 quantizer (``_forward_takes_strides``) gets them as they lie when
    its own TMA-layout check accepts them (else the copy, as before); q also when the module's
    ``torch.empty_like(q)`` output is then compact, as its kernel writes O (a permuted q
    would give a permuted O)."""
    if not plan.strided_fwd:
        return q.contiguous(), k.contiguous(), v.contiguous()
    return (q if checks.tma_loadable(q) and _empty_like_is_compact(q) else q.contiguous(),
            k if checks.tma_loadable(k) else k.contiguous(), v if checks.tma_loadable(v) else v.contiguous())


def _keeps_forward_state(mod) -> bool:
    """Whether ``mod``'s backward recomputes S from the FP8 Q/K its forward quantized, so that the
    forward hands them over (``prepared=``) instead of the backward quantizing q and k again."""
    return (mod is not None and getattr(mod, "BWD_S_FP8", False) is True
            and callable(getattr(mod, "backward", None)) and callable(getattr(mod, "quantize_inputs", None)))


def _keeps_v_payload(mod) -> bool:
    """Whether ``mod``'s backward also runs dP = dO V^T in FP8: the forward then writes V's FP8
    payload in V's own layout too (``quantize_inputs(..., for_backward=True)``), in the pass that
    quantizes V anyway, and the backward reads it instead of quantizing V again."""
    return getattr(mod, "BWD_DO_FP8", False) is True


def _keeps_qk_transposed(mod) -> bool:
    """Whether ``mod``'s backward runs dK = dS^T Q and dQ = dS K in FP8 (``dS : fp8e4m3``): the
    forward's Q and K passes then also write transposed copies of their payloads
    (``quantize_inputs(..., transposed_qk=True)``), the K-major operands those MMAs read."""
    return getattr(mod, "BWD_DS_FP8", False) is True


def forward_state_options(mod) -> dict:
    """The ``quantize_inputs`` options under which ``mod``'s forward writes everything its FP8
    backward reads (``prepared=``): V's natural payload for FP8 dP, the transposed Q/K payloads
    for FP8 dS. Used by the op below and by the benchmarks."""
    if _keeps_qk_transposed(mod):
        return {"for_backward": True, "transposed_qk": True}
    return {"for_backward": True} if _keeps_v_payload(mod) else {}


def _forward_state(prepared) -> list:
    """The forward state saved for the backward, from ``quantize_inputs``'s (q8, k8, vt8,
    scale_q, scale_k, scale_v[, v8[, qt8, kt8]]): the Q/K payloads as uint8 (an FP8 output would be
    summed by autograd's checks; bytes are plainly non-differentiable), the three scales, V's
    natural payload and Q's and K's transposed payloads when the forward wrote them. V^T (vt8) is
    the PV operand's layout, which the backward does not read."""
    q8, k8, _vt8, scale_q, scale_k, scale_v = prepared[:6]
    return [q8.view(torch.uint8), k8.view(torch.uint8), scale_q, scale_k, scale_v] + \
        [t.view(torch.uint8) for t in prepared[6:]]


def _prepared_from_state(state):
    """``prepared`` for a generated backward from ``_forward_state``'s list."""
    q8, k8, scale_q, scale_k, scale_v = state[:5]
    fp8 = torch.float8_e4m3fn
    return (q8.view(fp8), k8.view(fp8), None, scale_q, scale_k, scale_v) + tuple(t.view(fp8) for t in state[5:])


def _untransformed(mod, entry: str):
    """``mod``'s ``entry`` without the spec's outlier transforms: ``attention`` applied them already
    (``_transforms_before``, as steps autograd differentiates through), so the module's own
    transforming entry point would apply them twice (fp4gen.runtime.transforms)."""
    from fp4gen.runtime.transforms import untransformed

    return untransformed(mod, entry)


def _module_for_extras(mod, sinks, cu_seqlens_q, backward: bool = False):
    """The module to run a call with sinks or cu_seqlens on: a reference-target module's forward
    and backward take neither, so its spec runs on the reference backend itself (the very same
    numerics: None). A GPU module was generated from exactly the call's spec (``sinks learned``,
    ``layout varlen``), so its forward takes them (``forward(..., sinks=)``, ``forward_varlen``);
    no backward kernel implements them (legalize refuses the specs): reaching one is a bug."""
    if mod is None or (sinks is None and cu_seqlens_q is None):
        return mod
    if mod.TARGET == "reference":
        return None
    if not backward and (cu_seqlens_q is None or callable(getattr(mod, "forward_varlen", None))):
        return mod
    raise RuntimeError(f"fp4gen: generated module {mod.__name__} cannot take sinks or cu_seqlens"
                       f"{' in its backward' if backward else ''}")


def _fwd_run(q, k, v, spec_key, softmax_scale, backend, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k):
    """The forward op's work: (o, lse, prepared), ``prepared`` the forward state as the backward
    takes it (V^T dropped: the backward does not read it), None when it keeps none."""
    entry = _entry(spec_key)
    plan = _plan(entry, q.device, backend, False, sinks is not None, cu_seqlens_q is not None)
    mod = plan.mod
    prepared = None
    sink_kw = {"sinks": sinks} if sinks is not None else {}
    if cu_seqlens_q is not None and mod is not None:  # the generated varlen kernel
        o, lse = _untransformed(mod, "forward_varlen")(
            q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            softmax_scale=softmax_scale, return_lse=True, **sink_kw)
        _COUNTS[("fwd", "generated")] += 1
    elif cu_seqlens_q is not None:  # varlen: (total, H, D); lse (H, total_q)
        o, lse = _reference().forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, _ref_spec(entry, softmax_scale),
                                             sinks=sinks, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        _COUNTS[("fwd", "reference")] += 1
    elif mod is not None:
        q, k, v = _forward_operands(plan, q, k, v)
        if plan.keeps_state:
            prepared = mod.quantize_inputs(q, k, v, **plan.state_opts)
        kw = {"prepared": prepared} if prepared is not None else {}
        o, lse = _untransformed(mod, "forward")(q, k, v, softmax_scale=softmax_scale, return_lse=True, **kw, **sink_kw)
        if prepared is not None:
            prepared = (prepared[0], prepared[1], None) + tuple(prepared[3:])
        _COUNTS[("fwd", "generated")] += 1
    else:
        extra = {"sinks": sinks} if sinks is not None else {}  # (the tests' stand-in backend takes none)
        o, lse = _reference().forward(q, k, v, _ref_spec(entry, softmax_scale), **extra)
        _COUNTS[("fwd", "reference")] += 1
    # The op's contract (its fake below): o like q, contiguous; lse float32 (B, H, Sq), varlen
    # (H, total_q); the forward state (empty unless the backward reuses the forward's FP8 Q/K).
    # No-ops for the kernels' outputs (q's dtype, compact), which is what the backends return.
    return o.to(q.dtype).contiguous(), lse.to(torch.float32).contiguous(), prepared


def _attention_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec_key: str,
                        softmax_scale: Optional[float], backend: str, sinks: Optional[torch.Tensor] = None,
                        cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                        max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                        ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    o, lse, prepared = _fwd_run(q, k, v, spec_key, softmax_scale, backend, sinks, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k)
    return o, lse, (_forward_state(prepared) if prepared is not None else [])


attention_fwd = torch.library.custom_op("fp4gen::attention_fwd", mutates_args=())(_attention_fwd_impl)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, spec_key, softmax_scale, backend, sinks=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    if cu_seqlens_q is not None:
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32), []
    b, sq, h, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    state = []
    mod, _ = _choose(_entry(spec_key), q.device, backend)
    if _keeps_forward_state(mod):
        blk = int(mod.QUANT_BLOCK)
        f32 = torch.float32
        state = [q.new_empty(q.shape, dtype=torch.uint8), k.new_empty(k.shape, dtype=torch.uint8),
                 q.new_empty((b, h, -(-sq // blk)), dtype=f32), q.new_empty((b, hkv, -(-sk // blk)), dtype=f32),
                 q.new_empty((b, hkv), dtype=f32)]
        opts = forward_state_options(mod)  # what quantize_inputs appends: v8, then qt8 and kt8
        if opts.get("for_backward"):
            state.append(v.new_empty(v.shape, dtype=torch.uint8))
        if opts.get("transposed_qk"):
            from fp4gen.device.quantize import transposed_shape

            state += [x.new_empty(transposed_shape(x.shape, op), dtype=torch.uint8) for x, op in ((q, "q"), (k, "k"))]
    return q.new_empty(q.shape), q.new_empty((b, h, sq), dtype=torch.float32), state


def _attention_bwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, do: torch.Tensor, state: list[torch.Tensor], spec_key: str,
                        softmax_scale: Optional[float], backend: str, sinks: Optional[torch.Tensor] = None,
                        cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_k: Optional[torch.Tensor] = None,
                        max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_run(q, k, v, o, lse, do, _prepared_from_state(state) if state else None, spec_key, softmax_scale,
                    backend, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _bwd_run(q, k, v, o, lse, do, prepared, spec_key, softmax_scale, backend, sinks, cu_seqlens_q, cu_seqlens_k,
             max_seqlen_q, max_seqlen_k):
    """The backward op's work; ``prepared`` as ``_fwd_run`` returns it."""
    entry = _entry(spec_key)
    plan = _plan(entry, q.device, backend, True, sinks is not None, cu_seqlens_q is not None)
    mod = plan.mod
    if cu_seqlens_q is not None:
        dq, dk, dv = _reference().backward_varlen(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k,
                                                  _ref_spec(entry, softmax_scale), sinks=sinks,
                                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        _COUNTS[("bwd", "reference")] += 1
    elif mod is not None:
        kw = {"prepared": prepared} if (prepared is not None and plan.keeps_state) else {}
        if not plan.strided_bwd:  # other hosts' kernels take compact tensors; the sm90a host copies what it must
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        dq, dk, dv = _untransformed(mod, "backward")(q, k, v, o, lse, do, softmax_scale=softmax_scale, **kw)
        _COUNTS[("bwd", "generated")] += 1
    else:
        extra = {"sinks": sinks} if sinks is not None else {}
        dq, dk, dv = _reference().backward(q, k, v, o, lse, do, _ref_spec(entry, softmax_scale), **extra)
        _COUNTS[("bwd", "reference")] += 1
    # no-ops for the backends' gradients (compact, in the inputs' dtypes)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(),
            dv.to(v.dtype).contiguous())


attention_bwd = torch.library.custom_op("fp4gen::attention_bwd", mutates_args=())(_attention_bwd_impl)


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, o, lse, do, state, spec_key, softmax_scale, backend, sinks=None,
                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, key, softmax_scale, backend = inputs[:6]
    sinks, cu_q, cu_k, max_q, max_k = (list(inputs[6:]) + [None, None, None, 0, 0][len(inputs) - 6:])
    o, lse, state = output
    ctx.save_for_backward(q, k, v, o, lse, sinks, cu_q, cu_k, *state)
    ctx.spec_key, ctx.softmax_scale, ctx.backend = key, softmax_scale, backend
    ctx.max_seqlen = (max_q, max_k)
    # lse and the forward state are by-products for the backward pass; no gradient flows
    # through them.
    ctx.mark_non_differentiable(lse, *state)


def _backward(ctx, do, dlse, dstate):
    q, k, v, o, lse, sinks, cu_q, cu_k, *state = ctx.saved_tensors
    do = do.contiguous()  # the backward's preprocessing reads compact rows; autograd's dO usually is (a no-op)
    dq, dk, dv = torch.ops.fp4gen.attention_bwd(
        q, k, v, o, lse, do, list(state), ctx.spec_key, ctx.softmax_scale, ctx.backend,
        sinks, cu_q, cu_k, *ctx.max_seqlen)
    dsinks = None
    if sinks is not None and len(ctx.needs_input_grad) > 6 and ctx.needs_input_grad[6]:
        dsinks = _reference().sinks_grad(o, lse, do, sinks).to(sinks.dtype)
    # one gradient (or None) per argument as the caller passed them (the trailing defaults are not inputs)
    return (dq, dk, dv, None, None, None, dsinks, None, None, None, None)[:len(ctx.needs_input_grad)]


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# Eager calls skip the custom op's dispatch: torch.library's Python autograd wrapper (argument
# flattening, default filling, alias checks) costs more per call than fp4gen's own host work
# (bench/host_overhead.py). The same implementation and autograd formula run through a plain
# autograd.Function instead; whatever must see one opaque node (torch.compile, export, a dispatch
# or function mode, tensor subclasses such as fake tensors, functorch transforms) gets the op.
def _eager_fast_path(*tensors) -> bool:
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    return all(t is None or type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key, softmax_scale, backend, sinks, cu_q, cu_k, max_q, max_k):
        # the forward state stays in its FP8 dtypes here (the op passes it as bytes, _forward_state)
        o, lse, prepared = _fwd_run(q, k, v, key, softmax_scale, backend, sinks, cu_q, cu_k, max_q, max_k)
        ctx.save_for_backward(q, k, v, o, lse, sinks, cu_q, cu_k, *(prepared or ()))
        ctx.spec_key, ctx.softmax_scale, ctx.backend, ctx.max_seqlen = key, softmax_scale, backend, (max_q, max_k)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # as the op: its backward has no backward
    def backward(ctx, do, dlse):
        q, k, v, o, lse, sinks, cu_q, cu_k, *prepared = ctx.saved_tensors
        dq, dk, dv = _bwd_run(q, k, v, o, lse, do.contiguous(), tuple(prepared) or None, ctx.spec_key,
                              ctx.softmax_scale, ctx.backend, sinks, cu_q, cu_k, *ctx.max_seqlen)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[6]:
            dsinks = _reference().sinks_grad(o, lse, do, sinks).to(sinks.dtype)
        return dq, dk, dv, None, None, None, dsinks, None, None, None, None


class _SinkTokensAttention(torch.autograd.Function):
    """A spec with ``sink_tokens N`` (``outliers.SinkTokens``): the attention op on the transformed
    keys N.. (q2, k2, v2), its (O', LSE') mapped back and merged with the N exact keys
    (``Post.apply``), as one autograd node. Not the op followed by the merge: the merge depends on
    LSE', through which the op passes no gradient. The backward runs the op's backward on keys N..
    with the merged O and LSE (``Post.kernel_frame``: exact without an LSE gradient, see
    ``outliers.SinkTokens``) and adds the exact keys' share (``SinkTokens.grads``): dq2, dk2, dv2
    for the transform steps before it (autograd takes them to q, k, v), dq, dk_sink, dv_sink for
    the exact keys' inputs (q itself, k[:, :N], v[:, :N] in float32), and dL/d(smoothing's LSE
    shift), which the merge adds to LSE' (``SinkTokens.grads``). The returned LSE carries no
    gradient, as the op's."""

    @staticmethod
    def forward(ctx, q2, k2, v2, q, ks, vs, lse_add, sinks, post, key, softmax_scale, backend):
        ctx.fast = _eager_fast_path(q2, k2, v2, sinks)
        fwd = _attention_fwd_impl if ctx.fast else torch.ops.fp4gen.attention_fwd
        o2, lse2, state = fwd(q2, k2, v2, key, softmax_scale, backend, sinks)
        o, lse = post.apply(o2, lse2)
        o = o.to(q.dtype)
        ctx.save_for_backward(q2, k2, v2, o, lse, sinks, *state)
        ctx.post, ctx.key, ctx.softmax_scale, ctx.backend = post, key, softmax_scale, backend
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlse):
        q2, k2, v2, o, lse, sinks, *state = ctx.saved_tensors
        post = ctx.post
        do = do.contiguous()
        o2, lse2, do2 = post.kernel_frame(o, lse, do)
        bwd = _attention_bwd_impl if ctx.fast else torch.ops.fp4gen.attention_bwd
        dq2, dk2, dv2 = bwd(q2, k2, v2, o2.contiguous(), lse2.contiguous(), do2.contiguous(), list(state),
                            ctx.key, ctx.softmax_scale, ctx.backend, sinks)
        dq, dks, dvs, dlse_add = post.sinks.grads(o, lse, do)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[7]:  # the learned sink's share of the merged row
            dsinks = _reference().sinks_grad(o, lse, do, sinks).to(sinks.dtype)
        dlse_add = dlse_add if ctx.needs_input_grad[6] else None  # no smoothing (None), or detached
        return dq2, dk2, dv2, dq.to(o.dtype), dks, dvs, dlse_add, dsinks, None, None, None, None


def _sink_tokens_attention(q2, k2, v2, post, key, softmax_scale, backend, sinks):
    """(o, lse) of a spec with sink_tokens (``_SinkTokensAttention``); o in q2's dtype."""
    st = post.sinks
    return _SinkTokensAttention.apply(q2, k2, v2, st.q, st.k, st.v, post.lse_add, sinks, post, key, softmax_scale,
                                      backend)


def _attention_op(q, k, v, key, softmax_scale, backend, sinks=None, cu_q=None, cu_k=None, max_q=0, max_k=0):
    """(o, lse) of one call: the custom op, or in plain eager mode the same work without its dispatch."""
    if _eager_fast_path(q, k, v, sinks, cu_q, cu_k):
        return _EagerAttention.apply(q, k, v, key, softmax_scale, backend, sinks, cu_q, cu_k, max_q, max_k)
    if cu_q is None:
        o, lse, _ = torch.ops.fp4gen.attention_fwd(q, k, v, key, softmax_scale, backend, sinks)
    else:
        o, lse, _ = torch.ops.fp4gen.attention_fwd(q, k, v, key, softmax_scale, backend, sinks, cu_q, cu_k,
                                                    max_q, max_k)
    return o, lse


# ---------------------------------------------------------------------------
# The public function
# ---------------------------------------------------------------------------


_WHO = "fp4gen.attention"


def _check_inputs(q, k, v, head_dim: int) -> None:
    """The checks every generated module's ``forward`` runs (runtime/checks.py), under this
    function's name: both refuse the same arguments with the same message. The device and TMA
    layout are checked by the backend that runs (a generated module or the reference)."""
    checks.check_qkv(_WHO, q, k, v, dtypes=checks.FLOAT_DTYPES, head_dim=head_dim if head_dim > 0 else None,
                     device_type=None, tma=False)


def _check_layout(q, k) -> None:
    """Refuse the obvious (B, H, S, D) mix-up: k's heads do not divide q's in fp4gen's (B, S, H, D)
    reading, but would as GQA in SDPA's (B, H, S, D). (Without GQA, equal shapes as in
    self-attention cannot be told apart: the layout is documented, docs/training.md.)"""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == k.dim() == 4):
        return
    h, hkv = q.shape[2], k.shape[2]
    h_other, hkv_other = q.shape[1], k.shape[1]
    # only a GQA-looking fit in the other reading is "obvious": with q.shape[1] == k.shape[1] it
    # would fit whenever Sq == Sk, which says nothing
    if hkv and h % hkv and hkv_other and h_other != hkv_other and h_other % hkv_other == 0:
        raise AttentionInputError(
            f"{_WHO}: q {tuple(q.shape)} and k {tuple(k.shape)} read as fp4gen's (B, S, H, D) layout have "
            f"H={h} query heads and Hkv={hkv} key/value heads, which does not divide; read as SDPA's (B, H, S, D) "
            f"they would fit (H={h_other}, Hkv={hkv_other}). fp4gen (like flash_attn) takes (B, S, H, D): pass "
            "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)")


# The argument checks' verdicts: a key (``_checked_key``) is here when every check passed for
# tensors of those shapes, strides, dtypes and devices with that spec key: the checks read
# nothing else (tma=False: no data pointer), so an identical call skips them (issue 24: ~30 us
# of Python per call). Bounded: a workload that keeps changing shapes starts over.
_CHECKED: set = set()
_CHECKED_MAX = 4096


def _signature(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _checked_key(kind: str, key: str, head_dim: int, tensors: tuple, extra: tuple = ()):
    """The cache key of a call's checks, or None (not cached: tracing (torch.compile, export, fake
    or symbolic shapes, which may not hash), or an argument that is not a tensor, whose check must
    raise): the calls ``_eager_fast_path`` takes."""
    if not _eager_fast_path(*tensors):
        return None
    ck = (kind, key, head_dim, tuple(_signature(t) for t in tensors), extra)
    try:
        hash(ck)
    except TypeError:  # e.g. max_seqlen_q=[64]: its check names it
        return None
    return ck


def _remember_checked(ck) -> None:
    if ck is None:
        return
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED.add(ck)


def _check_overrides(window_size, softcap, sinks, return_lse) -> tuple:
    from fp4gen.numerics.masking import check_window

    try:
        window_size = check_window(_WHO, window_size)
    except ValueError as e:
        raise AttentionInputError(str(e)) from None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (softcap == 0 or softcap > 0):
        raise AttentionInputError(f"{_WHO}: softcap must be 0.0 (the spec's) or a positive number, got {softcap!r}")
    if softcap:
        from fp4gen.ir.spec import SOFTCAP_RANGE, bound_text

        lo, hi = SOFTCAP_RANGE
        if not lo <= softcap <= hi:
            raise AttentionInputError(f"{_WHO}: softcap must be from {bound_text(lo)} to {bound_text(hi)}, "
                                      f"got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1
                              or not torch.is_floating_point(sinks)):
        got = f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise AttentionInputError(f"{_WHO}: sinks must be a 1-D float tensor (H,) of sink logits, got {got}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"{_WHO}: return_lse must be True or False, got {return_lse!r}")
    return window_size, float(softcap)


def _check_sinks_shape(sinks, q, heads_dim: int, spec_has_sinks: bool) -> None:
    if sinks is None:
        if spec_has_sinks:
            raise AttentionInputError(f"{_WHO}: the spec has learned sinks ('sinks learned'): pass sinks=, "
                                      f"a float tensor ({q.shape[heads_dim]},) of sink logits per query head")
        return
    if sinks.shape != (q.shape[heads_dim],):
        raise AttentionInputError(f"{_WHO}: sinks must have one logit per query head, shape "
                                  f"({q.shape[heads_dim]},); got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise AttentionInputError(f"{_WHO}: sinks are on {sinks.device}, q on {q.device}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              spec: Union[KernelSpec, str, os.PathLike, ModuleType],
              causal: Optional[bool] = None, window_size: tuple = (-1, -1), softcap: float = 0.0,
              softmax_scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
              return_lse: bool = False, backend: str = "auto"):
    """Attention with the numerics of ``spec``; differentiable in q, k, v (and ``sinks``).

    q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D) with H a multiple of Hkv (GQA/MQA): flash_attn's
    layout, not SDPA's (B, H, S, D). Returns o: (B, Sq, H, D) in q's dtype, and with
    ``return_lse=True`` (o, lse), lse (B, H, Sq) float32, natural log, as flash_attn returns it.

    causal, window_size: None and (-1, -1) keep the spec's mask; otherwise the mask is what
    flash_attn_func(causal=..., window_size=...) means (bottom-right aligned; causal is (-1, 0)).
    softcap: 0.0 keeps the spec's; c > 0 caps the scaled scores to c * tanh(s / c).
    sinks: (H,) learned sink logits (GPT-OSS; the spec becomes ``sinks learned``; required when
    the spec has them). A generated kernel is only used when the effective spec is the one it
    was compiled from; otherwise CUDA with backend="auto" raises NoKernelError saying why.
    softmax_scale: None = the spec's (1/sqrt(D) unless the spec sets one).
    backend: "auto" (generated kernel where one applies; on the CPU the reference), "reference",
    or "generated" (error if no generated kernel applies).
    """
    if backend not in BACKENDS:
        raise AttentionInputError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    checks.check_causal(_WHO, causal)  # before they select a spec: causal="yes" is not True
    checks.check_softmax_scale(_WHO, softmax_scale)
    window_size, softcap = _check_overrides(window_size, softcap, sinks, return_lse)
    key, head_dim = _resolve_for_trace(spec, causal, window_size, softcap, sinks is not None, "dense")
    ck = _checked_key("dense", key, head_dim, (q, k, v, sinks))
    if ck is None or ck not in _CHECKED:
        _check_not_decode(key, _WHO)
        _check_layout(q, k)
        _check_inputs(q, k, v, head_dim)
        _check_sinks_shape(sinks, q, 2, _spec_has_sinks(key))
        _remember_checked(ck)
    dtype = q.dtype
    q, k, v, post = _transforms_before(key, q, k, v, softmax_scale, sinks)
    if post is not None and post.sinks is not None:  # sink_tokens: op and merge as one autograd node
        o, lse = _sink_tokens_attention(q, k, v, post, key, softmax_scale, backend, sinks)
        return (o.to(dtype), lse) if return_lse else o.to(dtype)
    o, lse = _attention_op(q, k, v, key, softmax_scale, backend, sinks)
    if post is not None:
        o, lse = post.o(o).to(dtype), post.lse(lse)
    return (o, lse) if return_lse else o


def _transforms_before(key: str, q, k, v, softmax_scale, sinks, packed: bool = False):
    """The spec's outlier transforms (``transforms``: ``K : ... smooth``, ``V : ...
    channel_scale``, ``rotate qk hadamard``) as torch steps before the attention op: (q', k', v',
    Post), Post mapping the op's (O, LSE) back (None when the spec has none). Every backend then
    runs on the transformed inputs: the kernels do not know about them (separate passes, their
    HBM bytes in the plan's ``transforms`` record). Autograd differentiates through the steps
    (shifts and linear maps; the power-of-two V scales are constants). The LSE shift is detached:
    the op's LSE carries no gradient either. ``packed``: varlen (total, H, D) tensors, taken as
    one sequence of total tokens (one mean, one scale per channel over all of them: still exact,
    since every row's keys get the same shift)."""
    spec = _REGISTRY[key].spec
    if spec is None or not spec.transforms:
        return q, k, v, None
    from fp4gen.runtime import transforms  # the steps a generated module's own entry points run too

    scale = softmax_scale if softmax_scale is not None else spec.scale
    try:
        return transforms.before(spec, q, k, v, scale, sinks, packed)
    except ValueError as e:  # smoothing with a call's softcap or sinks
        raise AttentionInputError(f"{_WHO}: the spec's transforms ({spec.transforms}): {e}") from None


def _check_not_decode(key: str, who: str) -> None:
    """A kv_cache spec describes decode against a cache: its K and V come from the cache's
    format, which dense attention would ignore."""
    s = _REGISTRY[key].spec
    if s is not None and s.kv_cache is not None:
        raise AttentionInputError(
            f"{who}: spec {s.name!r} has a kv_cache block (decode against a cache, {s.origin('kv_cache')}); "
            "use fp4gen.attention_with_kvcache(q, k_cache, v_cache, ..., spec=...) for it, or a spec "
            "without kv_cache for dense attention")


def _spec_has_sinks(key: str) -> bool:
    s = _REGISTRY[key].spec
    return s is not None and s.sinks is not Sinks.NONE


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dim: int) -> None:
    """The packed layout: q (total_q, H, D), k and v (total_k, Hkv, D), one float dtype and device,
    int32 cu_seqlens of one length on that device, int max_seqlen; the offsets themselves are read
    (and checked) by the backend that runs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_WHO}_varlen: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            hint = " (a (B, S, H, D) batch goes to fp4gen.attention)" if t.dim() == 4 else ""
            raise AttentionInputError(f"{_WHO}_varlen: {name} must be packed (total_tokens, H, D), got shape "
                                      f"{tuple(t.shape)}{hint}")
        if t.dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"{_WHO}_varlen: {name} must be a floating-point tensor, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"{_WHO}_varlen: q, k and v must have one dtype; got {q.dtype}, {k.dtype} and {v.dtype}")
    checks.check_same_device(f"{_WHO}_varlen", q=q, k=k, v=v)
    if k.shape != v.shape:
        raise AttentionInputError(f"{_WHO}_varlen: k and v must have one shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if head_dim > 0 and q.shape[2] != head_dim:
        raise AttentionInputError(f"{_WHO}_varlen: the spec has head_dim {head_dim}, q has D={q.shape[2]}")
    if k.shape[2] != q.shape[2]:
        raise AttentionInputError(f"{_WHO}_varlen: k must have the head dim of q ({q.shape[2]}); got {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise AttentionInputError(f"{_WHO}_varlen: the number of query heads ({q.shape[1]}) must be a multiple of "
                                  f"the number of key/value heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise AttentionInputError(f"{_WHO}_varlen: {name} must be a 1-D int32 tensor of B + 1 offsets, got {got}")
        if cu.device != q.device:
            raise AttentionInputError(f"{_WHO}_varlen: {name} is on {cu.device}, q on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise AttentionInputError(f"{_WHO}_varlen: cu_seqlens_q has {cu_seqlens_q.numel()} offsets and cu_seqlens_k "
                                  f"{cu_seqlens_k.numel()}: B + 1 each")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise AttentionInputError(f"{_WHO}_varlen: {name} must be an int >= 0 (the longest sequence), got {m!r}")


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     spec: Union[KernelSpec, str, os.PathLike, ModuleType],
                     causal: Optional[bool] = None, window_size: tuple = (-1, -1), softcap: float = 0.0,
                     softmax_scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     return_lse: bool = False, backend: str = "auto"):
    """``attention`` on sequences of different lengths packed together (flash_attn_varlen_func).

    q: (total_q, H, D), k, v: (total_k, Hkv, D); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v (int32 (B + 1,), from 0 to total);
    max_seqlen_q/k bound the lengths (checked). Masks align per sequence (bottom-right). Returns o
    (total_q, H, D), with ``return_lse`` (o, lse), lse (H, total_q) float32 as flash_attn's varlen.
    The spec runs with ``layout varlen``; the other arguments are ``attention``'s.
    """
    if backend not in BACKENDS:
        raise AttentionInputError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    checks.check_causal(_WHO, causal)
    checks.check_softmax_scale(_WHO, softmax_scale)
    window_size, softcap = _check_overrides(window_size, softcap, sinks, return_lse)
    key, head_dim = _resolve_for_trace(spec, causal, window_size, softcap, sinks is not None, "varlen")
    ck = _checked_key("varlen", key, head_dim, (q, k, v, sinks, cu_seqlens_q, cu_seqlens_k),
                      (type(max_seqlen_q), max_seqlen_q, type(max_seqlen_k), max_seqlen_k))
    if ck is None or ck not in _CHECKED:
        _check_not_decode(key, "fp4gen.attention_varlen")
        _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dim)
        _check_sinks_shape(sinks, q, 1, _spec_has_sinks(key))
        _remember_checked(ck)
    dtype = q.dtype
    q, k, v, post = _transforms_before(key, q, k, v, softmax_scale, sinks, packed=True)
    o, lse = _attention_op(q, k, v, key, softmax_scale, backend, sinks, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k)
    if post is not None:
        o, lse = post.o(o).to(dtype), post.lse(lse)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------
# Introspection
# ---------------------------------------------------------------------------


def explain(spec, device: Union[str, torch.device] = "cuda", *, causal: Optional[bool] = None,
            backend: str = "auto", **overrides) -> dict:
    """Which implementation ``attention`` would run for ``spec`` on ``device``, and why
    (``overrides``: window_size, softcap, sinks, layout, as a call's arguments).

    Returns {"spec_key", "forward", "backward", "reason"} where forward/backward
    are "generated:<module>" or "reference", and "transforms" (the outlier transforms run as torch
    steps around either) when the spec has any. A kv_cache spec adds "decode": what
    ``fp4gen.attention_with_kvcache`` runs ("generated:<module>", "reference" or "none: <why>");
    its forward/backward are "refused" where ``attention`` finds its decode module (whose
    forward refuses every call)."""
    key = spec_key(spec, causal, **overrides)
    entry = _entry(key)
    out = _explain(key, entry, device, backend)
    if entry.spec is not None and entry.spec.kv_cache is not None:
        _explain_decode(out, entry.spec, torch.device(device), backend)
    if entry.spec is not None and entry.spec.transforms:
        out["transforms"] = list(entry.spec.transforms.names)
    return out


def _explain_decode(out: dict, spec: KernelSpec, device: torch.device, backend: str) -> None:
    """``out`` for a kv_cache spec: the decode path as ``fp4gen.api.attention_with_kvcache``
    chooses it (its kernel on CUDA for a non-reference target unless backend="reference"), and
    ``attention``'s refusal where it would run the decode module's forward."""
    from fp4gen import NoKernelError
    from fp4gen.api import _kv_module

    if out["forward"].startswith("generated:"):  # the decode module: its forward raises
        out["forward"] = out["backward"] = "refused"
    kernel = backend == "generated" or (backend == "auto" and device.type == "cuda"
                                        and spec.target is not Target.REFERENCE)
    tgt = spec.target.value
    if not kernel:
        out["decode"] = "reference"
    elif device.type != "cuda" or not torch.cuda.is_available():
        out["decode"] = f"none: the {tgt} decode kernel needs a CUDA device"
    elif _arch_of(device) != tgt:
        out["decode"] = f"none: the spec targets {tgt}, this GPU is {_arch_of(device) or 'of no fp4gen target'}"
    else:
        try:
            out["decode"] = f"generated:{_kv_module(spec).__name__}"
        except NoKernelError as e:
            out["decode"] = f"none: {e}"
    runs = (f"the {tgt} decode kernel ({out['decode'][len('generated:'):]})" if out["decode"].startswith("generated:")
            else "the reference decode" if out["decode"] == "reference" else "nothing here")
    out["reason"] = (f"a kv_cache spec: fp4gen.attention_with_kvcache runs {runs}"
                     + ("; fp4gen.attention refuses it (the decode module's forward raises)"
                        if out["forward"] == "refused" else ""))


def _explain(key: str, entry: _Entry, device, backend: str) -> dict:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"spec_key": key, "forward": "reference", "backward": "reference",
                "reason": "CUDA is not available here"}
    out = {"spec_key": key}
    for pass_, need_bwd in (("forward", False), ("backward", True)):
        mod, reason = _choose(entry, device, backend, need_backward=need_bwd)
        out[pass_] = f"generated:{mod.__name__}" if mod is not None else "reference"
        if mod is None:
            out.setdefault("reason", reason)
    return out


def dispatch_counts() -> dict:
    """{"fwd/reference": n, "fwd/generated": n, "bwd/...": n}: what the ops actually ran."""
    return {f"{p}/{b}": n for (p, b), n in sorted(_COUNTS.items())}


def reset_dispatch_counts() -> None:
    _COUNTS.clear()
