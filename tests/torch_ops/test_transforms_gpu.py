"""The spec's outlier transforms around the generated sm90a FP8 forward on an H200 (skipped without
a Hopper GPU): the example spec runs its generated module on transformed inputs, agrees with the
reference backend on the GPU, and on the synthetic outlier cases stays within 2x of its randn
error (issue 21's criterion), where the same kernel without smoothing does not on massive K.

    .venv/bin/python -m pytest -q -m gpu tests/torch_ops/test_transforms_gpu.py
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.numerics import activations, exact
from fp4gen.torch_ops import attention

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROBUST = str(EXAMPLES / "sm90_fp8_outlier_robust_d128.attn")
PLAIN = f"{EXAMPLES / 'sm90_fp8_exp_d128.attn'}::sm90_fp8_exp_d128"
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    for spec in (ROBUST, PLAIN):
        info = torch_ops.explain(spec, "cuda")
        if not info["forward"].startswith("generated"):
            pytest.skip(f"no generated sm90a forward for {spec}: {info.get('reason')}")


def _case(kind, seqlen=1024, heads=4, seed=0):
    c = activations.synthetic(kind, seqlen=seqlen, heads=heads, seed=seed)
    return c, [x.to("cuda", torch.bfloat16) for x in (c.q, c.k, c.v)]


def _rel(o, c):
    """rel-L2 against float64 attention of the bf16-rounded inputs the kernel was given."""
    q, k, v = (x.to(torch.bfloat16).double() for x in (c.q, c.k, c.v))
    oe, _ = exact.attention(q, k, v, scale=128 ** -0.5)
    return float((o.double().cpu() - oe).norm() / oe.norm())


def test_generated_kernel_runs_the_transformed_inputs():
    c, (q, k, v) = _case("massive_k")
    torch_ops.reset_dispatch_counts()
    o, lse = attention(q, k, v, spec=ROBUST, return_lse=True)
    assert torch_ops.dispatch_counts()["fwd/generated"] == 1
    assert torch_ops.explain(ROBUST, "cuda")["transforms"] == ["smooth_k"]
    ref, lref = attention(q, k, v, spec=ROBUST, backend="reference", return_lse=True)
    cos = torch.nn.functional.cosine_similarity(o.double().flatten(), ref.double().flatten(), 0).item()
    assert cos > 0.995
    assert (lse - lref).abs().max().item() < 0.05


@pytest.mark.parametrize("kind", ["massive_k", "sink", "outlier_v_rows", "outlier_v_channels", "llm_mix"])
def test_within_2x_of_randn(kind):
    _, (q, k, v) = _case("randn")
    c0, _ = _case("randn")
    base = _rel(attention(q, k, v, spec=ROBUST), c0)
    c, (q, k, v) = _case(kind)
    err = _rel(attention(q, k, v, spec=ROBUST), c)
    assert err < 2.0 * base, f"{kind}: rel-L2 {err:.4f} vs randn {base:.4f}"


def test_smoothing_beats_the_plain_kernel_on_massive_k():
    c, (q, k, v) = _case("massive_k")
    plain = _rel(attention(q, k, v, spec=PLAIN), c)
    robust = _rel(attention(q, k, v, spec=ROBUST), c)
    assert robust < 0.6 * plain, (robust, plain)  # the reference: 0.40x (tests/numerics/test_transforms_accuracy.py)


def test_generated_module_forward_applies_the_transforms_once(monkeypatch):
    """The generated module's own forward (fp4gen.runtime.transforms) is fp4gen.attention's result
    bit for bit (the same smoothing steps, then the same deterministic kernel), and attention calls
    the module's untransformed forward: outliers.apply runs once per call on either path."""
    import importlib

    from fp4gen.numerics import outliers

    mod = importlib.import_module("generated.sm90_fp8_outlier_robust_d128_sm90a")
    _, (q, k, v) = _case("massive_k")
    calls, real = [], outliers.apply
    monkeypatch.setattr(outliers, "apply", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    o, lse = mod.forward(q, k, v, return_lse=True)
    assert len(calls) == 1
    oa, la = attention(q, k, v, spec=ROBUST, return_lse=True)
    assert len(calls) == 2
    assert torch.equal(o, oa) and torch.equal(lse, la)
    ou, lu = mod.forward_untransformed(q, k, v, return_lse=True)  # the kernel alone: no LSE shift added back
    assert not torch.equal(lse, lu)
