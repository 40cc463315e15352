"""A generated module of a spec with outlier transforms applies them on its own entry points
(``forward``, ``forward_varlen``, ``backward``: fp4gen.runtime.transforms), so that the spec means
the same there as in fp4gen.attention; fp4gen.attention calls the module's kernel-only entry
points (``*_untransformed``), so the transforms run once. On the CPU: the reference template
rendered from specs with transforms, and the sm90a template's module with a stand-in kernel
(the reference of the spec without transforms) where its CUDA kernel would run."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.frontend import parse_file, parse_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.spec import Transforms
from fp4gen.lowering import reference as ref_lowering
from fp4gen.lowering import sm90 as sm90_lowering
from fp4gen.lowering import sm100 as sm100_lowering
from fp4gen.numerics import outliers, reference
from fp4gen.runtime import transforms
from fp4gen.runtime.checks import AttentionInputError
from fp4gen.runtime.loader import exec_file
from fp4gen.torch_ops import attention, attention_varlen

ROOT = Path(__file__).resolve().parents[2]
FP8 = "Q : fp8e4m3(block=128); K : fp8e4m3(block=128){smooth}; P : fp8e4m3 via exp; V : fp8e4m3{chan}; O : bf16"
FP32_BWD = ("Q : fp32; K : fp32{smooth}; P : fp32; V : fp32{chan}; O : fp32; "
            "backward {{ dO : fp32; dS : fp32; dP : fp32; dQ : fp32; dK : fp32; dV : fp32 }}")
OPTIONS = {
    "smooth_k": dict(smooth=" smooth"),
    "channel_scale_v": dict(chan=" channel_scale"),
    "hadamard": dict(rotate="rotate qk hadamard(seed=5)"),
    "all": dict(smooth=" smooth", chan=" channel_scale", rotate="rotate qk hadamard(seed=3)"),
}
_LOADED = []


def spec_text(option: str, recipe: str = FP8, extra: str = "", name: str = "tr") -> str:
    o = {"smooth": "", "chan": "", "rotate": "", **OPTIONS.get(option, {})}
    body = recipe.format(smooth=o["smooth"], chan=o["chan"])
    return f"attention {name} {{ target reference; head_dim 64; {body}; {o['rotate']}; {extra} }}"


def load(source: str, tmp_path: Path, stem: str):
    """Import rendered module text as a module (runtime.loader.exec_file: registered in sys.modules)."""
    path = tmp_path / f"{stem}.py"
    path.write_text(source)
    name = f"h10_transforms_{stem}_{len(_LOADED)}"
    mod = exec_file(name, path)
    _LOADED.append(name)
    return mod


def reference_module(option, tmp_path, recipe=FP8, extra=""):
    (s,) = parse_text(spec_text(option, recipe, extra))
    return load(ref_lowering.render(plan_kernel(s)), tmp_path, f"ref_{option}")


def inputs(b=1, sq=96, sk=128, h=4, hkv=2, d=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, generator=g, dtype=dtype) + 3.0  # a common offset: smoothing's LSE shift shows
    v = torch.randn(b, sk, hkv, d, generator=g, dtype=dtype)
    v[..., :3] *= 20  # large channels: channel_scale's c differs from 1
    return q, k, v


@pytest.fixture(autouse=True)
def _unload():
    yield
    while _LOADED:
        sys.modules.pop(_LOADED.pop(), None)


def count_applications(monkeypatch) -> list:
    """A list that grows by one per outliers.apply call (every path applies the transforms through it)."""
    calls = []
    real = outliers.apply

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(outliers, "apply", spy)
    return calls


@pytest.mark.parametrize("option", list(OPTIONS))
def test_reference_module_forward_is_attention_bit_for_bit(option, tmp_path, monkeypatch):
    mod = reference_module(option, tmp_path)
    assert type(mod).__name__ == "TransformedModule"
    q, k, v = inputs()
    calls = count_applications(monkeypatch)
    o, lse = mod.forward(q, k, v, return_lse=True)
    assert len(calls) == 1
    for spec in (mod, parse_text(spec_text(option))[0]):  # the module itself and its KernelSpec
        del calls[:]
        oa, la = attention(q, k, v, spec=spec, return_lse=True)
        assert len(calls) == 1, "fp4gen.attention must apply the transforms exactly once"
        assert torch.equal(o, oa) and torch.equal(lse, la)
    # ... and the transforms did run: the kernel alone on the same inputs is another result
    ou, lu = mod.forward_untransformed(q, k, v, return_lse=True)
    assert not (torch.equal(o, ou) and torch.equal(lse, lu))


def test_planted_double_application_is_caught(tmp_path, monkeypatch):
    """fp4gen.attention calling the module's transforming forward (the bug the untransformed
    entry points prevent): the transforms run twice, and with a seeded rotation (R applied twice
    is not R) the quantized result is no longer the module's own."""
    mod = reference_module("hadamard", tmp_path)
    q, k, v = inputs()
    o = mod.forward(q, k, v)
    monkeypatch.setattr(torch_ops, "_untransformed", lambda m, entry: getattr(m, entry))
    calls = count_applications(monkeypatch)
    o2 = attention(q, k, v, spec=mod)
    assert len(calls) == 2
    assert not torch.equal(o, o2)


def test_reference_module_backward_matches_autograd(tmp_path):
    """module.backward at (q, k, v) with the forward's (o, lse): the gradients autograd takes
    through fp4gen.attention (its transforms' steps and the op's backward). Not bit for bit:
    the module undoes Post on o and lse (lse - shift rounds), attention's op kept its own."""
    mod = reference_module("all", tmp_path, FP32_BWD)
    q, k, v = inputs(seed=1)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    o, lse = mod.forward(q, k, v, return_lse=True)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    oa = attention(*leaves, spec=mod)
    assert torch.equal(o, oa.detach())
    oa.backward(do)
    for name, g, ga in zip("qkv", (dq, dk, dv), (x.grad for x in leaves)):
        rel = float((g - ga).norm() / ga.norm())
        assert rel < 1e-5, f"d{name} rel-L2 {rel:.3g} against autograd through fp4gen.attention"  # measured 2-3e-7
    # planted: a backward that forgets the transforms' chain rule (the kernel's gradients at the
    # transformed inputs, returned as they are: dQ R^T, dK R^T, dV / c missing) fails that bound
    q2, k2, v2, post = transforms.before(mod.SPEC, q, k, v, mod.SPEC.scale)
    c = post.o(torch.ones_like(o))
    wrong = mod.backward_untransformed(q2, k2, v2, o / c, lse - post.lse(torch.zeros_like(lse)), do * c)
    for g, ga in zip(wrong, (x.grad for x in leaves)):
        assert float((g - ga).norm() / ga.norm()) > 1e-2


def test_reference_module_varlen_is_attention_varlen(tmp_path):
    mod = reference_module("all", tmp_path, extra="layout varlen")
    q, k, v = (x[0] for x in inputs(b=1, sq=80, sk=80))
    cu = torch.tensor([0, 30, 80], dtype=torch.int32)
    args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=50, max_seqlen_k=50)
    o, lse = mod.forward(q, k, v, return_lse=True, **args)
    oa, la = attention_varlen(q, k, v, cu, cu, 50, 50, spec=mod, return_lse=True)
    assert torch.equal(o, oa) and torch.equal(lse, la)


def test_transformed_module_refuses_prepared_and_smoothing_with_sinks(tmp_path):
    mod = reference_module("smooth_k", tmp_path)
    q, k, v = inputs()
    with pytest.raises(TypeError, match="prepared= holds quantized kernel inputs"):
        mod.forward(q, k, v, prepared=(q, k, v))
    with pytest.raises(AttentionInputError, match="smooth_k shifts every key's logit but not the sink"):
        mod.forward(q, k, v, sinks=torch.zeros(q.shape[2]))


# ---------------------------------------------------------------- the kernel templates' modules


def _with_smooth(path: str) -> list:
    text = (ROOT / path).read_text().replace("K : fp8e4m3(block=128)", "K : fp8e4m3(block=128) smooth")
    specs = parse_text(text)
    assert all(s.transforms for s in specs)
    return specs


def test_sm90_module_with_transforms_runs_them_around_its_kernel(tmp_path, monkeypatch):
    """The sm90a forward + backward module of a spec with smoothing (the train example plus
    ``smooth``), its CUDA kernel replaced by the reference of the spec without transforms:
    forward is fp4gen.attention's reference result bit for bit, backward its gradients."""
    s = _with_smooth("examples/sm90_fp8_train_d128.attn")[0]
    mod = load(sm90_lowering.render(plan_kernel(s)), tmp_path, "sm90")
    plain = dataclasses.replace(s, transforms=Transforms())

    def fake_forward(q, k, v, *, softmax_scale=None, return_lse=False, prepared=None):
        assert prepared is None
        o, lse = reference.forward(q, k, v, plain)
        return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)

    def fake_backward(q, k, v, o, lse, do, *, softmax_scale=None, prepared=None):
        return reference.backward(q, k, v, o, lse, do, plain)

    mod.forward, mod.backward = fake_forward, fake_backward  # the module's own (kernel) functions
    assert mod.forward_untransformed is fake_forward and mod.backward_untransformed is fake_backward
    q, k, v = inputs(d=128, sq=128, sk=256, seed=2, dtype=torch.bfloat16)
    o, lse = mod.forward(q, k, v, return_lse=True)
    oa, la = attention(q, k, v, spec=s, backend="reference", return_lse=True)
    assert torch.equal(o, oa) and torch.equal(lse, la)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q.dtype)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    attention(*leaves, spec=s, backend="reference").backward(do)
    for name, g, ga in zip("qkv", (dq, dk, dv), (x.grad for x in leaves)):
        rel = float((g.float() - ga.float()).norm() / ga.float().norm())
        # bf16 gradients; measured 3.7e-5 (dQ), 2.0e-5 (dK), 0 (dV) on 2026-12-02
        assert rel < 1e-3, f"d{name} rel-L2 {rel:.3g} against autograd through fp4gen.attention"


@pytest.mark.parametrize("render, path", [
    (sm90_lowering.render, "examples/sm90_fp8_exp_d128.attn"),
    (sm100_lowering.render, "examples/fa4_nvfp8_d128.attn"),
    (ref_lowering.render, "examples/ref_window_softcap_sinks.attn"),
])
def test_the_install_line_is_rendered_only_with_transforms(render, path):
    """A spec without transforms renders no transforms code (its committed module, byte for
    byte, is `fp4gen regenerate --check`'s business); the same spec with one gets the line."""
    (s, *_) = parse_file(ROOT / path)
    assert not s.transforms
    assert "_install_transforms" not in render(plan_kernel(s))
    t = dataclasses.replace(s, transforms=Transforms(hadamard=True))
    assert "_install_transforms(__name__, PLAN_JSON, KERNEL_NAME)" in render(plan_kernel(t))


def test_committed_modules_install_exactly_for_specs_with_transforms():
    for path in sorted((ROOT / "generated").glob("*.py")):
        if path.name == "__init__.py":
            continue
        text = path.read_text()
        assert ("_install_transforms(" in text) == ('"transforms": ' in text), path.name
