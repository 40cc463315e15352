"""``fp4gen.load``: a kernel module from a ``.attn`` spec (parsed, planned, rendered, cached)
or from anything ``fp4gen.runtime.load`` takes.

The one layer that imports both the compiler and the runtime: the runtime itself imports no
compiler stage, because generated kernels import it where only torch and CuTe DSL exist.
The cache entry checks (header, module contract) are the runtime's (``runtime/loader.py``,
``runtime/cache.py``); compiling on a miss is this module's.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

from fp4gen.frontend import parse_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.spec import Target
from fp4gen.lowering import module_name, render
from fp4gen.runtime import cache, fileio, loader
from fp4gen.runtime.loader import LoadError

__all__ = ["load", "LoadError", "attention_with_kvcache", "allocate_kv_cache", "kv_cache_from"]


def load(spec_or_module: Union[str, os.PathLike, ModuleType], *, kernel: Optional[str] = None,
         target: Optional[str] = None) -> ModuleType:
    """Return an imported generated-kernel module.

    ``spec_or_module`` is a path to a ``.attn`` spec (compiled; the module source cached on
    disk, see ``fp4gen.runtime.cache``; ``kernel`` picks one ``attention`` block when the file
    has several, ``target`` (``"sm90a"``, ``"sm100a"``, ``"reference"``) overrides the spec's),
    or what ``fp4gen.runtime.load`` takes: a generated ``.py`` path, a module name under
    ``fp4gen.generated`` or a module.
    """
    if isinstance(spec_or_module, (str, os.PathLike)):
        text = os.fspath(spec_or_module)
        path = Path(text).expanduser()
        if path.suffix == ".attn":
            if not path.exists():
                raise LoadError(f"fp4gen.load: spec file {text!r} does not exist")
            return _load_spec(path, loader._read_input(path, "spec"), kernel, target)
    return loader.load(spec_or_module, kernel=kernel, target=target)


def _specs_from_parse(result) -> list:
    """The front end may return one KernelSpec, a sequence, or an object holding them."""
    if isinstance(result, (list, tuple)):
        return list(result)
    for attr in ("kernels", "specs"):
        if hasattr(result, attr):
            val = getattr(result, attr)
            return list(val.values()) if isinstance(val, dict) else list(val)
    return [result]


def _load_spec(path: Path, spec_text: str, kernel: Optional[str], target: Optional[str]) -> ModuleType:
    # parse the very text the cache key hashes (reading the file twice could pair two versions)
    specs = _specs_from_parse(parse_text(spec_text, filename=str(path)))
    if not specs:
        raise LoadError(f"fp4gen.load: {path} defines no attention kernel")
    if kernel is None:
        if len(specs) > 1:
            names = ", ".join(s.name for s in specs)
            raise LoadError(f"fp4gen.load: {path} defines several kernels ({names}); pass kernel=NAME")
        spec = specs[0]
    else:
        found = [s for s in specs if s.name == kernel]
        if not found:
            names = ", ".join(s.name for s in specs)
            raise LoadError(f"fp4gen.load: {path} has no kernel {kernel!r}; it defines: {names}")
        spec = found[0]
    if target is not None:
        try:
            tgt = Target(loader._norm_target(target))
        except ValueError:
            known = ", ".join(t.value for t in Target)
            raise LoadError(f"fp4gen.load: unknown target {target!r}; known targets: {known}") from None
        spec = spec.with_target(tgt)
    tname = spec.target.value

    key = cache.module_key(spec_text, spec.name, tname)
    name = f"{loader.LOADED_PREFIX}.{module_name(spec.name, tname)}_{key[:16]}"
    mod = sys.modules.get(name)
    if mod is None:
        mod = loader._exec_module(name, *_module_source(spec, tname, key))
    return loader._checked(mod, None, None, origin=f"{path} ({spec.name}, {tname})")


def _module_source(spec, tname: str, key: str) -> tuple[str, str]:
    """(file name, text) of the generated module: the cache entry if it passes every
    check, else a fresh render, stored when the cache can be written."""
    path = cache.module_path(key, spec.name, tname)
    try:
        text = cache.read_module(key, spec.name, tname)
        if text is not None:
            loader._check_contract(path, text, spec, tname)
            return str(path), text
    except cache.CacheEntryError as e:
        loader._warn(f"fp4gen cache: discarding {e}; rebuilding it")
        cache.discard_entry(path)
    except OSError:
        pass  # the cache cannot be read: rebuild; storing below says why it cannot be used
    source = render(plan_kernel(spec))
    try:
        filename = str(cache.store_module(key, spec.name, tname, source))
    except (OSError, fileio.OutputFileError) as e:
        loader._warn(f"fp4gen cache: cannot write {path} ({e}); using the module from memory, uncached")
        filename = f"<fp4gen: {path.name}, not cached>"
    return filename, cache.module_text(key, source)




# ---------------------------------------------------------------------------------------------
# Decode against a KV cache (issue 22): flash_attn_with_kvcache's conventions. The numerics
# (cache formats, appends, the split-KV decode) are fp4gen.numerics.kvcache's; docs/decode.md.
# ---------------------------------------------------------------------------------------------

_KV_WHO = "fp4gen.attention_with_kvcache"
_KV_PLANS: dict = {}


def _kv_spec(spec, who: str):
    """A kv_cache spec from a KernelSpec, an ``.attn`` path (``"file.attn::NAME"`` picks a
    block) or a generated module (its SPEC, else its PLAN_JSON's spec)."""
    from fp4gen.ir.spec import KernelSpec
    from fp4gen.runtime.checks import AttentionInputError

    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        name = None
        if "::" in text:
            text, name = text.rsplit("::", 1)
        path = Path(text).expanduser()
        if not path.is_file():
            raise AttentionInputError(f"{who}: spec file {text!r} does not exist")
        specs = _specs_from_parse(parse_text(loader._read_input(path, "spec"), filename=str(path)))
        found = [s for s in specs if name is None or s.name == name]
        if len(found) != 1:
            names = ", ".join(s.name for s in specs)
            raise AttentionInputError(f"{who}: {path} defines {names or 'no kernel'}; "
                                      + (f"it has no kernel {name!r}" if name else "pick one with 'file.attn::NAME'"))
        spec = found[0]
    elif isinstance(spec, ModuleType):
        from fp4gen.runtime.specjson import spec_from_plan_json

        mspec = getattr(spec, "SPEC", None)
        spec = mspec if isinstance(mspec, KernelSpec) else spec_from_plan_json(spec.PLAN_JSON)
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"{who}: spec must be a KernelSpec, an .attn path or a generated module, "
                        f"got {type(spec).__name__}")
    if spec.kv_cache is None:
        raise AttentionInputError(f"{who}: spec {spec.name!r} has no kv_cache block (write one, e.g. "
                                  "'kv_cache { storage paged(page_size=64); format fp8e4m3(scale=token) }'); "
                                  "attention without a cache is fp4gen.attention")
    return spec


def _kv_plan(spec):
    """The plan of a kv_cache spec planned for the reference target (its decode section holds
    the split rule's machine), memoized per spec."""
    from dataclasses import replace

    key = spec
    try:
        hit = _KV_PLANS.get(key)
    except TypeError:  # an unhashable spec: plan it every time
        key, hit = None, None
    if hit is None:
        hit = plan_kernel(spec if spec.target is Target.REFERENCE else replace(spec, target=Target.REFERENCE))
        if key is not None:
            _KV_PLANS[key] = hit
    return hit


def _kv_tensor_scale(fmt, given, x, lengths, who: str, name: str):
    """The per-KV-head tensor scale of a cache format that fixes one: ``given`` (Hkv,), else
    derived from the first ``lengths[b]`` tokens of each sequence of ``x`` (B, S, Hkv, D)."""
    import torch

    from fp4gen.numerics import kvcache as kv

    if not fmt.has_tensor_scale:
        if given is not None:
            raise TypeError(f"{who}: a {fmt} cache has no tensor scale; drop {name}")
        return None
    if given is not None:
        return given.to(torch.float32)
    if x is None:
        raise TypeError(f"{who}: a {fmt} cache fixes one scale per KV head when it is allocated: pass {name} "
                        "(a float32 tensor (Hkv,)), or allocate it from data with fp4gen.kv_cache_from")
    valid = torch.cat([x[b, :L] for b, L in enumerate(lengths)], 0)
    return kv.tensor_scales(fmt, valid)


def allocate_kv_cache(spec, *, kv_heads: int, slots: int, seqlen: Optional[int] = None, device=None,
                      k_scale=None, v_scale=None):
    """An empty (all-zero) cache in the format of ``spec``'s kv_cache block -> (k_cache, v_cache),
    ``fp4gen.numerics.kvcache.CacheTensor`` values in flash_attn's ``(slots, page, Hkv, D)``
    addressing: contiguous, ``slots`` sequences of ``seqlen`` tokens; paged, ``slots`` pages of
    the spec's page_size (``seqlen`` not given). ``k_scale``/``v_scale`` (Hkv,): the per-KV-head
    scales an ``fp8e4m3(scale=tensor)`` or a two-level nvfp4 cache fixes (required there).
    The layout of data and scales: docs/decode.md."""
    from fp4gen.ir.spec import KvStorage
    from fp4gen.numerics import kvcache as kv

    who = "fp4gen.allocate_kv_cache"
    spec = _kv_spec(spec, who)
    c = spec.kv_cache
    if c.storage is KvStorage.PAGED:
        if seqlen is not None:
            raise TypeError(f"{who}: a paged cache's pages hold page_size={c.page_size} tokens: drop seqlen")
        page = c.page_size
    else:
        if seqlen is None:
            raise TypeError(f"{who}: a contiguous cache needs seqlen (tokens per sequence)")
        page = seqlen
    ks = _kv_tensor_scale(c.format, k_scale, None, (), who, "k_scale")
    vs = _kv_tensor_scale(c.format, v_scale, None, (), who, "v_scale")
    try:
        return (kv.CacheTensor.allocate(c.format, slots, page, kv_heads, spec.head_dim, device=device, tensor_scale=ks),
                kv.CacheTensor.allocate(c.format, slots, page, kv_heads, spec.head_dim, device=device, tensor_scale=vs))
    except kv.KVCacheError as e:
        from fp4gen.runtime.checks import AttentionInputError

        raise AttentionInputError(f"{who}: {e}") from None


def kv_cache_from(k, v, spec, *, cache_seqlens=None, capacity: Optional[int] = None, page_table=None,
                  num_pages: Optional[int] = None, k_scale=None, v_scale=None):
    """A cache holding bf16 (or any float) K/V ``(B, S, Hkv, D)`` in ``spec``'s cache format ->
    (k_cache, v_cache, page_table). Sequence b holds its first ``cache_seqlens[b]`` tokens
    (default S). ``capacity``: tokens each sequence can hold (default S; appends beyond it
    fail). Paged: ``page_table`` (B, ceil(capacity / page_size)) int32 page indices (default:
    pages in order), ``num_pages`` (default B x pages per sequence); contiguous: page_table is
    None. A format with a per-KV-head scale takes it from ``k_scale``/``v_scale`` or from the
    cached tokens (``numerics.kvcache.tensor_scales``)."""
    import torch

    from fp4gen.ir.spec import KvStorage
    from fp4gen.numerics import kvcache as kv
    from fp4gen.runtime.checks import AttentionInputError

    who = "fp4gen.kv_cache_from"
    spec = _kv_spec(spec, who)
    c = spec.kv_cache
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not torch.is_floating_point(x):
            raise AttentionInputError(f"{who}: {name} must be a float (B, S, Hkv, D) tensor")
    if k.shape != v.shape:
        raise AttentionInputError(f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    B, S, Hkv, D = k.shape
    lengths = [S] * B if cache_seqlens is None else (
        [int(cache_seqlens)] * B if isinstance(cache_seqlens, int) else [int(x) for x in cache_seqlens.tolist()])
    if len(lengths) != B or any(not 0 <= L <= S for L in lengths):
        raise AttentionInputError(f"{who}: cache_seqlens must be B={B} lengths from 0 to S={S}, got {lengths[:8]}")
    capacity = S if capacity is None else capacity
    if capacity < max(lengths, default=0):
        raise AttentionInputError(f"{who}: capacity {capacity} is less than the longest sequence {max(lengths)}")
    paged = c.storage is KvStorage.PAGED
    page = c.page_size if paged else capacity
    if paged and page_table is None:
        pps = -(-capacity // page)
        page_table = torch.arange(B * pps, dtype=torch.int32, device=k.device).reshape(B, pps)
    if paged:
        num_pages = int(page_table.max()) + 1 if num_pages is None else num_pages
    slots = num_pages if paged else B
    ks = _kv_tensor_scale(c.format, k_scale, k, lengths, who, "k_scale")
    vs = _kv_tensor_scale(c.format, v_scale, v, lengths, who, "v_scale")
    try:
        kc = kv.CacheTensor.allocate(c.format, slots, page, Hkv, D, device=k.device, tensor_scale=ks)
        vc = kv.CacheTensor.allocate(c.format, slots, page, Hkv, D, device=k.device, tensor_scale=vs)
        kv.check_layout(kc, vc, torch.tensor(lengths, dtype=torch.int32), page_table if paged else None, B, 0, spec)
        for b, (rows, cols) in enumerate(kv.token_slots(lengths, page, page_table if paged else None, slots,
                                                        k.device)):
            kc.write(rows, cols, k[b, :lengths[b]])
            vc.write(rows, cols, v[b, :lengths[b]])
    except kv.KVCacheError as e:
        raise AttentionInputError(f"{who}: {e}") from None
    return kc, vc, (page_table if paged else None)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, page_table=None, spec,
                           softmax_scale: Optional[float] = None, causal: Optional[bool] = None,
                           window_size=(-1, -1), softcap: float = 0.0, sinks=None, return_lse: bool = False,
                           num_splits: Optional[int] = None, backend: str = "auto"):
    """Decode (or a few speculative tokens) against a KV cache, flash_attn_with_kvcache's way.

    q (B, Sq, H, D), Sq at most the spec's q_tokens, H = gqa x Hkv. k_cache, v_cache: the
    cache (``allocate_kv_cache`` / ``kv_cache_from``; a bf16 cache may be a plain (slots, page,
    Hkv, D) bf16 tensor). k, v (B, Sn, Hkv, D), optional: new tokens, quantized into the cache at
    positions cache_seqlens[b] .. + Sn - 1 (in place) before attending. cache_seqlens: int or
    int32 (B,), the tokens cached before this call. page_table (B, pages per sequence) int32 for
    a paged cache, page indices in any order. Each query attends to cache_seqlens[b] + Sn keys;
    masks are bottom-right aligned (the last query sees the last key).

    causal, window_size, softcap, sinks, softmax_scale: as ``fp4gen.attention`` (None, (-1, -1),
    0.0 keep the spec's). num_splits: None = the planner's split-KV rule, or a count of key
    splits per sequence (the result is the same up to float32 rounding). backend: "auto" (the
    reference on the CPU or for a ``target reference`` spec; on CUDA for a ``target sm90a`` spec the
    sm90a decode kernel, ``fp4gen.device.sm90.decode``: bf16, fp8 and nvfp4 caches, causal or no mask; what it
    does not run raises NoKernelError saying why), "reference", "generated" (the kernel or
    NoKernelError). With the kernel, new tokens are written by the reference's quantizer first.
    Returns o (B, Sq, H, D) in q's dtype, and with return_lse (o, lse (B, H, Sq) float32).
    """
    from dataclasses import replace

    import torch

    from fp4gen.ir.spec import SOFTCAP_RANGE, Sinks, bound_text, mask_for_window
    from fp4gen.numerics import kvcache as kv
    from fp4gen.numerics.masking import check_window
    from fp4gen.runtime import checks
    from fp4gen.runtime.checks import AttentionInputError

    who = _KV_WHO
    if backend not in ("auto", "reference", "generated"):
        raise AttentionInputError(f"{who}: backend must be 'auto', 'reference' or 'generated'; got {backend!r}")
    checks.check_causal(who, causal)
    checks.check_softmax_scale(who, softmax_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"{who}: return_lse must be True or False, got {return_lse!r}")
    spec = _kv_spec(spec, who)
    try:
        left, right = check_window(who, window_size)
    except ValueError as e:
        raise AttentionInputError(str(e)) from None
    kw = {}
    if causal is not None or (left, right) != (-1, -1):
        kw["mask"], kw["window"] = mask_for_window(left, 0 if causal else right)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise AttentionInputError(f"{who}: softcap must be 0.0 (the spec's) or a positive number, got {softcap!r}")
    if softcap:
        lo, hi = SOFTCAP_RANGE
        if not lo <= softcap <= hi:
            raise AttentionInputError(f"{who}: softcap must be from {bound_text(lo)} to {bound_text(hi)}, got {softcap!r}")
        kw["softcap"] = float(softcap)
    if sinks is not None:
        kw["sinks"] = Sinks.LEARNED
    if softmax_scale is not None:
        kw["softmax_scale"] = float(softmax_scale)
    spec = replace(spec, **kw) if kw else spec
    c = spec.kv_cache

    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not torch.is_floating_point(q):
        got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise AttentionInputError(f"{who}: q must be a float (B, Sq, H, D) tensor, got {got}")
    B, Sq, H, D = q.shape
    if D != spec.head_dim:
        raise AttentionInputError(f"{who}: q has head dim {D}, spec {spec.name!r} has head_dim {spec.head_dim}")
    if not 1 <= Sq <= c.q_tokens:
        raise AttentionInputError(f"{who}: q holds {Sq} tokens per sequence; the spec's kv_cache takes 1 to "
                                  f"q_tokens {c.q_tokens}")
    try:
        kc, vc = kv.as_cache(k_cache, "k_cache"), kv.as_cache(v_cache, "v_cache")
    except kv.KVCacheError as e:
        raise AttentionInputError(f"{who}: {e}") from None
    Hkv = kc.kv_heads
    if kc.head_dim != D:
        raise AttentionInputError(f"{who}: the cache has head dim {kc.head_dim}, q {D}")
    if H % Hkv or H // Hkv != c.gqa:
        raise AttentionInputError(f"{who}: q has {H} heads and the cache {Hkv} KV heads; the spec's kv_cache has "
                                  f"gqa {c.gqa} (query heads per KV head)")
    for name, t in (("k_cache", kc.data), ("v_cache", vc.data)):
        if t.device != q.device:
            raise AttentionInputError(f"{who}: {name} is on {t.device}, q on {q.device}")
    if (k is None) != (v is None):
        raise AttentionInputError(f"{who}: pass both k and v (the new tokens) or neither")
    Sn = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or not torch.is_floating_point(t) or t.dim() != 4 or \
                    t.shape[0] != B or t.shape[2:] != (Hkv, D) or t.device != q.device:
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise AttentionInputError(f"{who}: {name} must be a float (B={B}, Sn, Hkv={Hkv}, D={D}) tensor on "
                                          f"{q.device}, got {got}")
        if k.shape != v.shape:
            raise AttentionInputError(f"{who}: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        Sn = k.shape[1]
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (H,)
                              or not torch.is_floating_point(sinks) or sinks.device != q.device):
        raise AttentionInputError(f"{who}: sinks must be a float tensor ({H},) on {q.device}")
    if sinks is None and spec.sinks is not Sinks.NONE:
        raise AttentionInputError(f"{who}: the spec has learned sinks: pass sinks=, a float tensor ({H},)")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= kv.MAX_SPLITS):
        raise AttentionInputError(f"{who}: num_splits must be None (the planner's rule) or 1 to {kv.MAX_SPLITS}, "
                                  f"got {num_splits!r}")
    try:
        lengths = kv.check_layout(kc, vc, cache_seqlens, page_table, B, Sn, spec)
    except kv.KVCacheError as e:
        raise AttentionInputError(f"{who}: {e}") from None

    kernel = backend == "generated" or (backend == "auto" and q.is_cuda and spec.target is not Target.REFERENCE)
    mod = None
    if kernel:
        if not q.is_cuda or spec.target is Target.REFERENCE:
            from fp4gen import NoKernelError  # the public class (fp4gen.torch_ops defines it)

            raise NoKernelError(
                f"{who}: no {spec.target.value} decode kernel runs spec {spec.name!r} on {q.device} (the sm90a "
                "kernel runs a 'target sm90a' spec on an H100/H200). Pass backend='reference' (or 'auto') to run "
                "the reference decode")
        mod = _kv_module(spec)
    plan = _kv_plan(spec)
    if num_splits is None:
        dp = plan.decode
        ctas = B * Hkv * -(-((H // Hkv) * Sq) // dp.row_tile)
        num_splits = kv.split_count(ctas, -(-(max(lengths, default=0) + Sn) // dp.tile_n), dp.sm_count)
    if mod is not None:
        if k is not None:  # the new tokens go in by the reference's quantizer: both backends store the same bits
            kv.append(kc, vc, lengths, page_table, k, v)
        ends = torch.tensor([L + Sn for L in lengths], dtype=torch.int32, device=q.device)
        # the cache as stored: codes with their per-token / per-block scales, or fp8's per-KV-head
        # scale; a two-level nvfp4 cache's g beside its block scales
        nvfp4 = c.format.format.value == "nvfp4"
        ks, vs = (kc.scale, vc.scale) if kc.scale is not None else (kc.tensor_scale, vc.tensor_scale)
        gk, gv = (kc.tensor_scale, vc.tensor_scale) if nvfp4 else (None, None)
        o, lse = mod.decode(q.to(torch.bfloat16), kc.data, vc.data, ends, k_scale=ks, v_scale=vs, k_tensor_scale=gk,
                            v_tensor_scale=gv, page_table=page_table, num_splits=num_splits,
                            softmax_scale=spec.softmax_scale, return_lse=True)
    else:
        o, lse = kv.decode(q, kc, vc, lengths, spec, page_table=page_table, k_new=k, v_new=v, sinks=sinks,
                           num_splits=num_splits)
    o = o.to(q.dtype)
    return (o, lse) if return_lse else o


_KV_MODULES: dict = {}


def _kv_module(spec):
    """The generated decode module that runs ``spec`` (its target's decode kernel), memoized per
    spec: planned and rendered here, its source stored in the module cache (so its compiled kernel
    is cached on disk under the module's text, ``runtime.cache``); NoKernelError saying why when
    the planner or the lowering refuses the spec."""
    from fp4gen import NoKernelError
    from fp4gen.ir.passes import PlanError
    from fp4gen.lowering import LoweringError, refusal

    try:
        hit = _KV_MODULES.get(spec)
    except TypeError:
        hit = None
    if hit is not None:
        return hit
    hint = ("Pass backend='reference' to run the reference decode on this GPU (exact numerics, slow), or "
            "write 'target reference' in the spec")
    try:
        plan = plan_kernel(spec)
        err = refusal(plan)
    except PlanError as e:
        where = f" (spec line {e.loc})" if e.loc else ""
        raise NoKernelError(f"{_KV_WHO}: no {spec.target.value} decode kernel runs spec {spec.name!r}: "
                            f"{e.message}{where}. {hint}") from None
    if err is not None:
        loc = spec.loc(err.path) if err.path else None
        where = f" (spec line {loc})" if loc else ""
        raise NoKernelError(f"{_KV_WHO}: no {spec.target.value} decode kernel runs spec {spec.name!r}: {err}{where}. "
                            f"{hint}")
    tname = spec.target.value
    try:
        source = render(plan)
    except LoweringError as e:
        raise NoKernelError(f"{_KV_WHO}: no {tname} decode kernel runs spec {spec.name!r}: {e}. {hint}") from None
    key = cache.module_key(source, spec.name, tname)  # keyed by the rendered text: it is the module
    path = cache.module_path(key, spec.name, tname)
    try:
        filename = str(cache.store_module(key, spec.name, tname, source))
    except (OSError, fileio.OutputFileError) as e:
        loader._warn(f"fp4gen cache: cannot write {path} ({e}); using the module from memory, uncached")
        filename = f"<fp4gen: {path.name}, not cached>"
    mod = loader._exec_module(f"{loader.LOADED_PREFIX}.{module_name(spec.name, tname)}_{key[:16]}", filename,
                              cache.module_text(key, source))
    try:
        _KV_MODULES[spec] = mod
    except TypeError:
        pass
    return mod
