"""``sink_tokens N`` around the real sm90a FP8 training kernels (forward and the generated
backward) on a Hopper GPU: the spec's steps (keys N.. to the kernels, the first N exact, merged
by their log-sum-exps; the backward handed the merged O and LSE) agree with float64 attention
as closely as the recipe does without the option, and fix the sink case the option exists for.

    python3 -m pytest -q -m gpu tests/torch_ops/test_sink_tokens_gpu.py

Not yet run on a GPU (written 2026-12-07, when no machine could be started): its bounds are the
recipe's own (the option must not cost accuracy on randn, must not lose it on the sink case),
not numbers seen on the hardware. The first GPU session runs it and records the printed errors.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.numerics import activations
from fp4gen.torch_ops import attention

from .conftest import plain_attention64

ROOT = Path(__file__).resolve().parents[2]
SPEC_FILE = ROOT / "examples" / "sm90_fp8_train_d128.attn"
KERNEL = "sm90_fp8_train_causal_d128"
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    """The example's spec as it is and with ``sink_tokens 1`` added (a new spec file: its
    module is rendered and compiled on first use)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    text = SPEC_FILE.read_text()
    head = f"attention {KERNEL} {{"
    assert head in text
    sink = tmp_path_factory.mktemp("sink") / "sink_tokens.attn"
    sink.write_text(text.replace(head, head + "\n  sink_tokens 1", 1))
    plain, with_sink = f"{SPEC_FILE}::{KERNEL}", f"{sink}::{KERNEL}"
    for s in (plain, with_sink):
        info = torch_ops.explain(s, "cuda", causal=True)
        if not (info["forward"].startswith("generated") and info["backward"].startswith("generated")):
            pytest.skip(f"no generated sm90a kernels for {s}: {info}")
    return plain, with_sink


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


def _run(spec, q, k, v, w):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    torch_ops.reset_dispatch_counts()
    o = attention(*leaves, spec=spec, causal=True, backend="generated")
    (o.float() * w).sum().backward()
    counts = torch_ops.dispatch_counts()
    return o.detach(), [t.grad for t in leaves], counts


def _f64(q, k, v, w):
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    o = plain_attention64(*leaves, scale=128 ** -0.5, causal=True)
    (o * w.double().cpu()).sum().backward()
    return o.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("kind", ["randn", "sink"])
def test_forward_and_backward_through_the_kernels(specs, kind):
    plain, with_sink = specs
    c = activations.synthetic(kind, seqlen=1024, heads=4, seed=0)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in (c.q, c.k, c.v))  # (1, S, H, D)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).cuda()
    o64, g64 = _f64(q, k, v, w)
    errs = {}
    for name, spec in (("plain", plain), ("sink_tokens", with_sink)):
        o, grads, counts = _run(spec, q, k, v, w)
        assert counts.get("fwd/generated") == 1 and counts.get("bwd/generated") == 1, counts
        assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)
        errs[name] = [_rel(o, o64)] + [_rel(g, r) for g, r in zip(grads, g64)]
    print(kind, {n: [round(e, 4) for e in v] for n, v in errs.items()})
    if kind == "randn":  # nothing to fix: the option costs no accuracy (O, dq, dk, dv)
        for e_s, e_p in zip(errs["sink_tokens"], errs["plain"]):
            assert e_s < 1.25 * e_p + 1e-3, errs
    else:  # the sink row shares V's scale no more: O at least as accurate as without the option
        assert errs["sink_tokens"][0] <= errs["plain"][0] * 1.05, errs
    assert max(errs["sink_tokens"]) < 0.1, errs
