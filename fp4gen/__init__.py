"""fp4gen: compiles attention specs (*.attn) into FP4/FP8 FlashAttention kernels.

    import fp4gen
    specs = fp4gen.parse_file("examples/fa4_fp4_d128.attn")
    plan = fp4gen.plan(specs[0])
    paths = fp4gen.compile_spec("examples/fa4_fp4_d128.attn", "out/", target="reference")
    mod = fp4gen.load("examples/fa4_fp4_d128.attn", target="reference")

Everything here is imported lazily: ``import fp4gen`` loads only this file, so
generated kernels (which import ``fp4gen.runtime``) never pull in lark, jinja2
or the planner.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["parse_file", "parse_text", "SpecError", "plan", "compile_spec", "load", "attention",
           "attention_varlen", "attention_with_kvcache", "allocate_kv_cache", "kv_cache_from", "NoKernelError",
           "__version__"]


def attention(q, k, v, **kw):
    """fp4gen attention for torch tensors (B, S, H, D), differentiable, ``torch.compile``-able,
    with flash_attn's arguments: ``fp4gen.attention(q, k, v, spec="examples/x.attn::name",
    causal=True, window_size=(-1, -1), softcap=0.0, softmax_scale=None, sinks=None,
    return_lse=False, backend="auto")``. See ``fp4gen.torch_ops.attention``."""
    from fp4gen.torch_ops import attention as _attention

    return _attention(q, k, v, **kw)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    """``attention`` on packed sequences, (total_tokens, H, D) tensors with int32 ``cu_seqlens``
    (flash_attn_varlen_func). See ``fp4gen.torch_ops.attention_varlen``."""
    from fp4gen.torch_ops import attention_varlen as _attention_varlen

    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, **kw):
    """Decode against a KV cache (flash_attn_with_kvcache): appends k, v at ``cache_seqlens``
    (quantized into the cache's format), attends, returns o (and the LSE). ``fp4gen.attention_with_kvcache(q,
    k_cache, v_cache, k, v, cache_seqlens=..., page_table=None, spec=..., causal=None,
    window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False, num_splits=None,
    backend="auto")``. See ``fp4gen.api.attention_with_kvcache`` and docs/decode.md."""
    from fp4gen.api import attention_with_kvcache as _f

    return _f(q, k_cache, v_cache, k, v, **kw)


def allocate_kv_cache(spec, **kw):
    """An empty cache (k_cache, v_cache) in a kv_cache spec's format (``fp4gen.api.allocate_kv_cache``)."""
    from fp4gen.api import allocate_kv_cache as _f

    return _f(spec, **kw)


def kv_cache_from(k, v, spec, **kw):
    """(k_cache, v_cache, page_table) holding float K/V (B, S, Hkv, D) in a kv_cache spec's
    format (``fp4gen.api.kv_cache_from``)."""
    from fp4gen.api import kv_cache_from as _f

    return _f(k, v, spec, **kw)


def parse_file(path):
    """Parse a spec file -> list of ``KernelSpec`` (raises ``SpecError``)."""
    from fp4gen.frontend import parse_file as _parse_file

    return _parse_file(path)


def parse_text(text, filename="<string>"):
    """Parse spec text -> list of ``KernelSpec`` (raises ``SpecError``)."""
    from fp4gen.frontend import parse_text as _parse_text

    return _parse_text(text, filename)


def plan(spec):
    """Plan one ``KernelSpec`` -> ``KernelPlan`` (raises ``fp4gen.ir.passes.PlanError``)."""
    from fp4gen.ir.passes import plan_kernel

    return plan_kernel(spec)


def compile_spec(spec, out_dir, *, target=None, kernel=None):
    """Compile a spec (a path, or a ``KernelSpec`` / list of them) into ``out_dir``.

    Writes one importable module per kernel (atomically) and returns their paths.
    ``target`` overrides the spec's own target; ``kernel`` picks one kernel by name.
    """
    from fp4gen.driver import compile_specs, select_specs

    specs = parse_file(spec) if isinstance(spec, (str, bytes)) or hasattr(spec, "__fspath__") else spec
    if not isinstance(specs, (list, tuple)):
        specs = [specs]
    return compile_specs(select_specs(specs, kernel), out_dir, target=target)


def load(spec_or_module, **kwargs):
    """A kernel module from a ``.attn`` spec (compiled and cached) or a generated module (see
    ``fp4gen.api.load``)."""
    from fp4gen.api import load as _load

    return _load(spec_or_module, **kwargs)


def __getattr__(name):
    # SpecError is a class users catch; import the front end only when asked for it.
    if name == "SpecError":
        from fp4gen.frontend.diagnostics import SpecError

        return SpecError
    if name == "NoKernelError":  # what backend="auto" raises on a GPU without a kernel for the spec
        from fp4gen.torch_ops import NoKernelError

        return NoKernelError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
