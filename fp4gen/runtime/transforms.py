"""The spec's outlier transforms (issue 21) on every entry point of a generated module.

``fp4gen.attention`` runs a spec's transforms (``K : ... smooth``, ``V : ... channel_scale``,
``rotate qk hadamard``, ``sink_tokens N``) as torch steps around whatever backend it picks
(``before`` below, ``fp4gen.numerics.outliers.apply`` and its ``Post``). A generated module of
such a spec must mean the same when called directly, so its template ends with
``install(__name__, PLAN_JSON)`` (rendered only when the plan has transforms: every other
module stays as it was). ``install``
makes the module's public ``forward``, ``forward_varlen`` and ``backward`` apply the transforms
around the functions the module defines, which stay reachable as ``forward_untransformed``,
``forward_varlen_untransformed`` and ``backward_untransformed``: the kernel on inputs already
transformed. ``fp4gen.attention`` calls those (``untransformed``): it has applied the transforms
itself, as steps autograd differentiates through, for the reference backend too.

Why a module class and not wrapper functions in the template: a module's backward section is a
separate template appended after the forward one and does not know the plan's transforms, so
the forward part cannot wrap a ``backward`` defined below it; a property of the module's class
can (it reads the module's own ``backward`` when asked, after the whole file ran).
"""
from __future__ import annotations

import functools
import sys
import types
from typing import Optional

import torch

# entry point -> the name its kernel-only original keeps
ENTRY_POINTS = {"forward": "forward_untransformed", "forward_varlen": "forward_varlen_untransformed",
                "backward": "backward_untransformed"}
_VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def before(spec, q, k, v, scale: float, sinks=None, packed: bool = False):
    """``spec``'s transforms applied to q, k, v: (q', k', v', post) with q', k', v' in q's dtype
    and ``post`` (an ``outliers.Post``) mapping the transformed attention's (O, LSE) back; None
    for ``post`` when the spec has none. The LSE shift is detached (the attention's LSE carries
    no gradient), except with sink_tokens, whose merged O depends on it (``SinkTokens.grads``).
    ``packed``: varlen (total, H, D) tensors, taken as one sequence of all tokens (one mean, one
    scale per channel: still exact, every row's keys get the same shift).
    ``sink_tokens N``: k' and v' are keys N.. and ``post.sinks`` attends the first N exactly with
    the spec's mask and softcap; ``post.apply`` (not ``post.o``/``post.lse``) merges them.
    ValueError for what the transforms refuse (smoothing with softcap or sinks; sink_tokens with
    packed sequences, or with no more keys than N)."""
    if not spec.transforms:
        return q, k, v, None
    from fp4gen.numerics import outliers

    t = spec.transforms
    dtype = q.dtype
    if packed and t.sink_tokens:
        raise ValueError(f"sink_tokens {t.sink_tokens} with packed (varlen) sequences is not built: the first "
                         "keys of every sequence would have to leave the kernel's keys; use fp4gen.attention")
    if packed:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    q2, k2, v2, post = outliers.apply(q, k, v, t.names, scale, softcap=spec.softcap, sinks=sinks,
                                      hadamard_seed=t.hadamard_seed, sink_tokens=t.sink_tokens or 1,
                                      window=spec.window_size)
    if post.lse_add is not None and post.sinks is None:  # (the merge of sink_tokens takes its gradient)
        post.lse_add = post.lse_add.detach()
    if packed:
        q2, k2, v2 = q2[0], k2[0], v2[0]
        post = PackedPost(post)
    return q2.to(dtype), k2.to(dtype), v2.to(dtype), post


class PackedPost:
    """``outliers.Post`` for varlen outputs: O (total, H, D), LSE (H, total)."""

    def __init__(self, post):
        self.post = post

    def o(self, o):
        return self.post.o(o.unsqueeze(0))[0]

    def lse(self, lse):
        return self.post.lse(lse.unsqueeze(0))[0]

    def kernel_frame(self, o, lse, do):
        return tuple(x[0] for x in self.post.kernel_frame(o.unsqueeze(0), lse.unsqueeze(0), do.unsqueeze(0)))


def untransformed(mod, entry: str):
    """``mod``'s kernel-only ``entry`` (``forward``, ``forward_varlen``, ``backward``): the one
    that does not apply the spec's transforms (for a caller that applied them already); the
    entry itself for a module whose spec has none."""
    return getattr(mod, ENTRY_POINTS[entry], None) or getattr(mod, entry)


class ModuleTransforms:
    """The transforms of one generated module's spec, around its entry points."""

    def __init__(self, kernel_name: str, plan_json: str):
        from fp4gen.runtime.specjson import spec_from_plan_json

        self.kernel_name = kernel_name
        self.spec = spec_from_plan_json(plan_json)
        if not self.spec.transforms:
            raise ValueError(f"{kernel_name}: its plan has no outlier transforms; nothing to install")

    def _scale(self, softmax_scale) -> float:
        from fp4gen.runtime.checks import check_softmax_scale

        check_softmax_scale(self.kernel_name, softmax_scale)
        return float(softmax_scale) if softmax_scale is not None else self.spec.scale

    def _refuse_prepared(self, kw: dict) -> None:
        if kw.get("prepared") is not None:
            # prepared operands are the quantized inputs of the kernel, i.e. of the transformed q, k, v
            raise TypeError(f"{self.kernel_name}: prepared= holds quantized kernel inputs, which with this "
                            "spec's outlier transforms are the transformed q, k, v: pass them to "
                            "forward_untransformed/backward_untransformed (with inputs you transformed), "
                            "or call forward/backward without prepared=")

    def _before(self, q, k, v, scale, sinks, packed):
        try:
            return before(self.spec, q, k, v, scale, sinks, packed)
        except ValueError as e:
            from fp4gen.runtime.checks import AttentionInputError

            raise AttentionInputError(f"{self.kernel_name}: the spec's transforms ({self.spec.transforms}): "
                                      f"{e}") from None

    def forward(self, raw, q, k, v, *args, softmax_scale=None, return_lse=False, packed=False, **kw):
        """``raw`` (the module's own forward) on the transformed q, k, v, its (O, LSE) mapped back:
        what ``fp4gen.attention`` returns for this spec."""
        self._refuse_prepared(kw)
        packed = packed or any(kw.get(n) is not None for n in _VARLEN_ARGS)
        q2, k2, v2, post = self._before(q, k, v, self._scale(softmax_scale), kw.get("sinks"), packed)
        o, lse = raw(q2, k2, v2, *args, softmax_scale=softmax_scale, return_lse=True, **kw)
        if getattr(post, "sinks", None) is not None:  # sink_tokens: O and LSE merged together
            o, lse = post.apply(o, lse)
            o = o.to(q.dtype)
        else:
            o, lse = post.o(o).to(q.dtype), post.lse(lse)
        return (o, lse) if return_lse else o

    def backward(self, raw, q, k, v, o, lse, do, *, softmax_scale=None, **kw):
        """Gradients at the original q, k, v of ``forward`` (o, lse: its outputs): ``raw`` (the
        module's own backward) at the transformed inputs, on the transformed attention's o, lse
        and dO (Post undone, ``Post.kernel_frame``: O / c, dO * c, LSE - shift), then the
        transforms' own chain rule by autograd through ``before`` (the same steps, so no second
        derivation of them). ``sink_tokens``: ``raw`` runs on keys N.. with the merged O and LSE
        (exact, ``outliers.Post.kernel_frame``), the N exact keys' share beside it
        (``SinkTokens.grads``)."""
        self._refuse_prepared(kw)
        packed = any(kw.get(n) is not None for n in _VARLEN_ARGS)
        scale = self._scale(softmax_scale)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            q2, k2, v2, post = self._before(*leaves, scale, kw.get("sinks"), packed)
        o2, lse2, do2 = post.kernel_frame(o, lse, do)  # O = O' c, so dL/dO' = dL/dO c; c a power of two
        dq2, dk2, dv2 = raw(q2.detach(), k2.detach(), v2.detach(), o2, lse2, do2, softmax_scale=softmax_scale,
                            **kw)
        outs = [(t, g) for t, g in zip((q2, k2, v2), (dq2, dk2, dv2)) if t.requires_grad]
        sink = getattr(post, "sinks", None)
        dq_sink = None
        if sink is not None:  # the exact keys: their k and v rows (graph to k, v), and q's share directly
            dq_sink, dk_s, dv_s, dlse = sink.grads(o, lse, do)
            outs += [(t, g) for t, g in ((sink.k, dk_s), (sink.v, dv_s), (post.lse_add, dlse))
                     if t is not None and t.requires_grad]
        grads = torch.autograd.grad([t for t, _ in outs], leaves, [g.to(t.dtype) for t, g in outs],
                                    allow_unused=True)
        grads = [torch.zeros_like(x, dtype=torch.float32) if g is None else g for x, g in zip(leaves, grads)]
        if dq_sink is not None:
            grads[0] = grads[0].to(torch.float32) + dq_sink
        return tuple(g.to(x.dtype) for x, g in zip((q, k, v), grads))


class TransformedModule(types.ModuleType):
    """A generated module whose spec has outlier transforms: ``forward``, ``forward_varlen`` and
    ``backward`` apply them around the module's own functions (``*_untransformed``)."""


def _entry_property(entry: str, wrap) -> property:
    def get(mod):
        raw = mod.__dict__.get(entry)
        if raw is None:
            raise AttributeError(f"module {mod.__name__!r} has no attribute {entry!r}")
        cache = mod.__dict__.setdefault("_FP4GEN_TRANSFORMED", {})
        if cache.get(entry, (None,))[0] is not raw:  # (re)wrap when the module's own one changed
            @functools.wraps(raw)
            def entry_point(*args, **kwargs):
                return wrap(mod.__dict__["_TRANSFORMS"], raw, *args, **kwargs)

            names = mod.__dict__["_TRANSFORMS"].spec.transforms
            entry_point.__doc__ = ((raw.__doc__ or "").rstrip() + f"\n\n    With the spec's outlier transforms "
                                   f"({names}) around the kernel;\n    ``{ENTRY_POINTS[entry]}`` runs it "
                                   "without them.\n")
            cache[entry] = (raw, entry_point)
        return cache[entry][1]

    def set_(mod, value):  # monkeypatching the entry point replaces the module's own function
        mod.__dict__[entry] = value

    return property(get, set_)


def _raw_property(entry: str) -> property:
    def get(mod):
        raw = mod.__dict__.get(entry)
        if raw is None:
            raise AttributeError(f"module {mod.__name__!r} has no attribute {ENTRY_POINTS[entry]!r}")
        return raw

    return property(get)


_WRAPS = {
    "forward": lambda t, raw, *a, **kw: t.forward(raw, *a, **kw),
    "forward_varlen": lambda t, raw, *a, **kw: t.forward(raw, *a, packed=True, **kw),
    "backward": lambda t, raw, *a, **kw: t.backward(raw, *a, **kw),
}
for _entry, _raw_name in ENTRY_POINTS.items():
    setattr(TransformedModule, _entry, _entry_property(_entry, _WRAPS[_entry]))
    setattr(TransformedModule, _raw_name, _raw_property(_entry))
del _entry, _raw_name


def install(module_name: str, plan_json: str, kernel_name: Optional[str] = None) -> None:
    """Make module ``module_name`` (being executed: registered in ``sys.modules``) apply the
    transforms of the spec in ``plan_json`` on its entry points. Rendered by the templates only
    for a plan with transforms."""
    mod = sys.modules.get(module_name)
    if mod is None:
        raise RuntimeError(f"fp4gen: generated module {module_name} must be imported (registered in "
                           "sys.modules) to install its spec's outlier transforms")
    mod.__dict__["_TRANSFORMS"] = ModuleTransforms(kernel_name or module_name, plan_json)
    mod.__class__ = TransformedModule
