"""numerics.capture through transformers' AttentionInterface (issue 21).

A tiny randomly initialised Llama config is the plumbing test (no weights needed; it says
nothing about real activations): the recorded q/k/v reproduce the model's attention output,
the model's logits do not change under the hook, dO is the gradient of the attention output,
and the files read back through ``activations.load``. The committed real activations
(tests/data/activations, SmolLM2-135M) are checked for what they claim to be.
"""
from pathlib import Path

import pytest
import torch

from fp4gen.numerics import activations

DATA = Path(__file__).resolve().parents[1] / "data" / "activations"


def _tiny_llama():
    tr = pytest.importorskip("transformers")
    if not hasattr(tr, "AttentionInterface"):
        pytest.skip("transformers < 4.48 has no AttentionInterface")
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64)
    m = tr.LlamaForCausalLM(cfg).eval()
    m.set_attn_implementation("sdpa")
    return m


class _Tok:
    """A stand-in tokenizer: fixed ids (the tiny model has no vocabulary)."""

    def __call__(self, text, return_tensors="pt"):
        return {"input_ids": torch.tensor([[(7 * i + len(text)) % 97 for i in range(24)]])}


def _attention(q, k, v, scale):  # (B, S, H, D), causal, GQA; float64, written out here
    H, hk = q.shape[2], k.shape[2]
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(H // hk, 1) for x in (k, v))
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(torch.ones(q.shape[2], k.shape[2]).triu(1).bool(),
                                                      float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def test_recorded_qkv_reproduce_the_attention_and_leave_the_model_alone(tmp_path):
    from fp4gen.numerics import capture

    m = _tiny_llama()
    ids = _Tok()("x")["input_ids"]
    with torch.no_grad():
        before = m(input_ids=ids).logits
    seen = {}
    # o_proj's input is the attention output: record it to compare with attention(q, k, v)
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda mod, a, i=i: seen.__setitem__(i, a[0].detach())) for i, layer in enumerate(m.model.layers)]
    cases = capture.record(m, _Tok(), "x", layers=[0, 2], grad=True, model_name="tiny")
    for h in hooks:
        h.remove()
    assert [c.name for c in cases] == ["layer00", "layer02"]
    for c in cases:
        assert c.q.shape == (1, 24, 4, 16) and c.k.shape == c.v.shape == (1, 24, 2, 16)
        assert c.meta["causal"] is True and c.meta["scale"] == pytest.approx(0.25)
        o = _attention(c.q, c.k, c.v, c.meta["scale"]).reshape(1, 24, 64)
        assert torch.allclose(o.float(), seen[c.meta["layer"]], atol=1e-5)
        assert c.do is not None and c.do.shape == c.q.shape and float(c.do.abs().max()) > 0
    assert m.config._attn_implementation == "sdpa"  # restored
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, before)
    assert all(p.grad is None for p in m.parameters())
    paths = capture.write(cases, tmp_path)
    back = activations.load(tmp_path)
    assert [p.name for p in paths] == ["layer00.pt", "layer02.pt"] and len(back) == 2
    assert torch.allclose(back[0].q, cases[0].q, rtol=1e-3, atol=1e-4)
    assert back[1].meta["layer"] == 2 and back[1].meta["model"] == "tiny"


def test_do_is_the_gradient_of_the_attention_output():
    """Planted check: dO from the hook equals autograd's gradient at o_proj's input."""
    from fp4gen.numerics import capture

    m = _tiny_llama()
    grads = {}

    def keep(mod, a, i):
        a[0].register_hook(lambda g: grads.__setitem__(i, g.detach()))

    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, a, i=i: keep(mod, a, i))
             for i, layer in enumerate(m.model.layers)]
    cases = capture.record(m, _Tok(), "x", layers=[1], grad=True)
    for h in hooks:
        h.remove()
    assert torch.allclose(cases[0].do.reshape(1, 24, 64), grads[1], atol=1e-7, rtol=1e-5)


def test_bad_model_names_are_clear():
    from fp4gen.numerics import capture

    with pytest.raises(capture.CaptureError, match="no such model directory"):
        capture.resolve_model("no_such_package_fp4gen")
    with pytest.raises(capture.CaptureError, match="a .gguf file"):
        capture.resolve_model(__file__)
    with pytest.raises(capture.CaptureError, match="no attention call"):
        capture.record(_tiny_llama(), _Tok(), "x", layers=[9], grad=False)


def test_committed_real_activations():
    """tests/data/activations: SmolLM2-135M's q/k/v/dO at layers 0, 14, 29 of one text."""
    files = sorted(DATA.glob("smollm2_*.pt"))
    assert [f.name for f in files] == ["smollm2_layer00.pt", "smollm2_layer14.pt", "smollm2_layer29.pt"]
    assert sum(f.stat().st_size for f in DATA.iterdir()) < 2 << 20
    cases = activations.load(DATA)
    for c in cases:
        assert c.q.shape == (1, 160, 9, 64) and c.k.shape == (1, 160, 3, 64) and c.do.shape == c.q.shape
        assert c.meta["causal"] is True and c.meta["scale"] == 0.125 and "SmolLM2" in c.meta["model"]
    # a real model's structure: the later layers put much of every row's mass on token 0 (a sink)
    c = cases[1]
    s = torch.einsum("bqhd,bkhd->bhqk", c.q, c.k.repeat_interleave(3, 2)) * 0.125
    p = torch.softmax(s.masked_fill(torch.ones(160, 160).triu(1).bool(), float("-inf")), -1)
    assert float(p[..., 0].mean()) > 0.3
