"""torch_ops.explain on a kv_cache spec (issue 22): "decode" names what
fp4gen.attention_with_kvcache runs, forward/backward say that fp4gen.attention refuses the spec
where it finds the decode module. Each claim is checked against the thing itself: the module
named decodes (a callable ``decode``) and its forward raises, naming attention_with_kvcache."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.runtime.checks import AttentionInputError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DECODE = f"{EXAMPLES / 'sm90_decode_bf16_d128.attn'}::sm90_decode_bf16_d128"
DENSE = f"{EXAMPLES / 'sm90_bf16_d128.attn'}::sm90_bf16_causal_d128"


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a" if torch.device(device).type == "cuda" else None)


def test_decode_spec_on_an_h200(h200):
    info = torch_ops.explain(DECODE, "cuda")
    assert info["forward"] == info["backward"] == "refused"
    assert info["decode"].startswith("generated:")
    assert "attention_with_kvcache runs the sm90a decode kernel" in info["reason"]
    assert "fp4gen.attention refuses it" in info["reason"]
    mod = importlib.import_module(info["decode"][len("generated:"):])
    assert callable(mod.decode) and mod.TARGET == "sm90a"
    # the refusal explain reports is the module attention would run: its forward raises
    found, _ = torch_ops._choose(torch_ops._entry(info["spec_key"]), torch.device("cuda"), "auto")
    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(AttentionInputError, match="attention_with_kvcache"):
        found.forward(q, q, q)


def test_decode_spec_with_the_reference_backend_and_on_the_cpu(h200):
    info = torch_ops.explain(DECODE, "cuda", backend="reference")
    assert info["decode"] == "reference" and info["forward"] == "reference"
    assert "attention_with_kvcache runs the reference decode" in info["reason"]
    info = torch_ops.explain(DECODE, "cpu")
    assert info["decode"] == "reference" and info["forward"] == "reference"


def test_decode_spec_on_another_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm100a")
    info = torch_ops.explain(DECODE, "cuda")
    assert info["decode"] == "none: the spec targets sm90a, this GPU is sm100a"
    assert "refused" not in info["forward"]


def test_dense_spec_is_unchanged(h200):
    info = torch_ops.explain(DENSE, "cuda")
    assert "decode" not in info and info["forward"].startswith("generated:")
