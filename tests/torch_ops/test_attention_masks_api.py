"""fp4gen.attention / attention_varlen with flash_attn's arguments (window_size, softcap, sinks,
return_lse, cu_seqlens) on the reference backend on the CPU: values and gradients against the
float64 oracle, the overrides of the spec, and the argument errors."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.frontend import parse_text
from fp4gen.ir.spec import Layout, Mask, Sinks, Target
from fp4gen.numerics import exact
from fp4gen.torch_ops import AttentionInputError, attention, attention_varlen, effective_spec

ROOT = Path(__file__).resolve().parents[2]
FP32 = ("Q : fp32; K : fp32; P : fp32; V : fp32; O : fp32; "
        "backward { dO : fp32; dS : fp32; dP : fp32; dQ : fp32; dK : fp32; dV : fp32 }")


def spec(fields: str = "", target: str = "reference"):
    (k,) = parse_text(f"attention api {{ target {target}; head_dim 16; {FP32}; {fields} }}")
    return k


def leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def grads(out, xs, seed=9):
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, xs, do)


@pytest.mark.parametrize("kw, window, cap", [
    (dict(window_size=(3, 1)), (3, 1), 0.0),
    (dict(causal=True, window_size=(2, 5)), (2, 0), 0.0),  # causal makes the window's right side 0
    (dict(softcap=4.0), (-1, -1), 4.0),
    (dict(causal=True, softcap=2.0), (-1, 0), 2.0),
])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_values_and_gradients_match_the_oracle(kw, window, cap, with_sinks):
    q, k, v, s = leaves((2, 7, 4, 16), (2, 10, 2, 16), (2, 10, 2, 16), (4,))
    sinks = s if with_sinks else None
    o, lse = attention(q, k, v, spec=spec(), sinks=sinks, return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    oe, le = exact.attention(q, k, v, scale=0.25, window=window, softcap=cap, sinks=sinks)
    assert (o - oe).abs().max() < 1e-5 and (lse.double() - le).abs().max() < 1e-5
    xs = [q, k, v] + ([s] if with_sinks else [])
    for g, ge in zip(grads(o, xs), grads(oe, xs)):
        assert (g - ge).abs().max() < 1e-5


def test_spec_fields_apply_without_arguments():
    q, k, v, s = leaves((1, 6, 2, 16), (1, 6, 2, 16), (1, 6, 2, 16), (2,))
    o = attention(q, k, v, spec=spec("mask window(1, 0); softcap 3; sinks learned"), sinks=s)
    oe, _ = exact.attention(q, k, v, scale=0.25, window=(1, 0), softcap=3.0, sinks=s)
    assert (o - oe).abs().max() < 1e-5


@pytest.mark.parametrize("kw, mask, window, cap, sinks", [
    (dict(), Mask.WINDOW, (8, 0), 30.0, Sinks.NONE),  # the defaults change nothing
    (dict(causal=False), Mask.NONE, None, 30.0, Sinks.NONE),  # flash_attn(causal=False, window (-1, -1))
    (dict(causal=True), Mask.CAUSAL, None, 30.0, Sinks.NONE),
    (dict(window_size=(-1, 0)), Mask.CAUSAL, None, 30.0, Sinks.NONE),
    (dict(window_size=(4, 4), causal=True), Mask.WINDOW, (4, 0), 30.0, Sinks.NONE),
    (dict(softcap=5.0, sinks=True), Mask.WINDOW, (8, 0), 5.0, Sinks.LEARNED),
])
def test_overrides(kw, mask, window, cap, sinks):
    e = effective_spec(spec("mask window(8, 0); softcap 30"), **kw)
    assert (e.mask, e.window, e.softcap, e.sinks) == (mask, window, cap, sinks)


def test_window_minus_one_zero_is_the_causal_kernel():
    assert torch_ops.spec_key(spec(), window_size=(-1, 0)) == torch_ops.spec_key(spec("mask causal"))


# ---- varlen -----------------------------------------------------------------------------------


def test_varlen_is_the_dense_call_per_sequence():
    lens_q, lens_k = [4, 0, 6, 2], [5, 3, 6, 0]
    q, k, v, s = leaves((12, 4, 16), (14, 2, 16), (14, 2, 16), (4,))
    cu = lambda lens: torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)  # noqa
    cq, ck = cu(lens_q), cu(lens_k)
    o, lse = attention_varlen(q, k, v, cq, ck, 6, 6, spec=spec(), window_size=(2, 0), sinks=s, return_lse=True)
    assert o.shape == q.shape and lse.shape == (4, 12)
    g = grads(o, [q, k, v, s])
    want_o, want_g = [], [torch.zeros_like(x) for x in (q, k, v, s)]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=o.dtype)
    for b in range(4):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if q1 == q0:
            continue
        if k1 == k0:  # no keys: O = 0 and the LSE is the sink (there is no key to normalise)
            assert (o[q0:q1] == 0).all() and torch.allclose(lse[:, q0:q1], s.detach().float()[:, None].expand(4, q1 - q0))
            continue
        ob = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], spec=spec(), window_size=(2, 0), sinks=s)
        assert torch.allclose(o[q0:q1], ob[0], atol=1e-6)
        gb = torch.autograd.grad(ob, [q, k, v, s], do[None, q0:q1])
        want_g = [a + b_ for a, b_ in zip(want_g, gb)]
    for a, b_ in zip(g, want_g):
        assert (a - b_).abs().max() < 1e-5


def test_varlen_with_torch_compile():
    q, k, v = (t.detach().float() for t in leaves((6, 2, 16), (7, 2, 16), (7, 2, 16)))
    cq, ck = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    sp = spec()

    def f(q, k, v):
        return attention_varlen(q, k, v, cq, ck, 4, 4, spec=sp, causal=True)

    assert torch.allclose(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


def test_dense_with_torch_compile_and_lse():
    q, k, v = (t.detach().float() for t in leaves((1, 5, 2, 16), (1, 5, 2, 16), (1, 5, 2, 16)))
    sp = spec()

    def f(q, k, v):
        return attention(q, k, v, spec=sp, window_size=(2, 0), softcap=10.0, return_lse=True)

    (o1, l1), (o2, l2) = torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v)
    assert torch.allclose(o1, o2) and torch.equal(l1, l2)


# ---- where it runs --------------------------------------------------------------------------


def test_a_gpu_target_spec_with_a_window_raises_no_kernel_on_cuda(monkeypatch):
    (causal,) = [s for s in __import__("fp4gen").parse_file(ROOT / "examples" / "sm90_bf16_d128.attn")
                 if s.mask is Mask.CAUSAL]
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a")
    entry = torch_ops._entry(torch_ops.spec_key(causal, window_size=(128, 0)))
    # sm90a kernels take windows now, but none was generated from this spec: it must raise, not
    # fall back to the reference
    with pytest.raises(torch_ops.NoKernelError, match=r"generated from a different spec \(it differs in mask, "
                       r"window.*backend='reference'"):
        torch_ops._choose(entry, torch.device("cuda"), "auto", strict=True)
    assert torch_ops._choose(entry, torch.device("cuda"), "reference", strict=True)[0] is None


def test_a_generated_module_refuses_overrides():
    from .test_attention_op import _fake_generated

    mod, _ = _fake_generated(spec("mask causal"), "reference")
    q, k, v = (t.detach().float() for t in leaves((1, 4, 2, 16), (1, 4, 2, 16), (1, 4, 2, 16)))
    with pytest.raises(AttentionInputError, match="was compiled for another mask, window; it cannot run"):
        attention(q, k, v, spec=mod, window_size=(2, 0))


# ---- argument errors --------------------------------------------------------------------------

Q4 = (1, 4, 2, 16)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(window_size=(-2, 0)), AttentionInputError, "window_size left must be -1"),
    (dict(window_size=4), AttentionInputError, "window_size must be a pair"),
    (dict(window_size=(1.5, 0)), AttentionInputError, "window_size left must be -1"),
    (dict(softcap=-1.0), AttentionInputError, "softcap must be 0.0"),
    (dict(softcap=1e9), AttentionInputError, "softcap must be from 0.01 to 10000"),
    (dict(sinks=torch.zeros(3)), AttentionInputError, r"one logit per query head, shape \(2,\)"),
    (dict(sinks=torch.zeros(2, dtype=torch.int64)), AttentionInputError, "1-D float tensor"),
    (dict(return_lse="yes"), TypeError, "return_lse must be True or False"),
])
def test_argument_errors(kw, exc, match):
    q, k, v = (torch.randn(Q4) for _ in range(3))
    with pytest.raises(exc, match=match):
        attention(q, k, v, spec=spec(), **kw)


def test_learned_sinks_need_the_tensor():
    q, k, v = (torch.randn(Q4) for _ in range(3))
    with pytest.raises(AttentionInputError, match="pass sinks="):
        attention(q, k, v, spec=spec("sinks learned"))


def test_sdpa_layout_is_refused_naming_both_layouts():
    q = torch.randn(2, 8, 6, 16)  # SDPA's (B, H=8, S=6, D)
    k = v = torch.randn(2, 2, 4, 16)  # (B, Hkv=2, S=4, D)
    with pytest.raises(AttentionInputError, match=r"\(B, S, H, D\).*SDPA's \(B, H, S, D\).*transpose\(1, 2\)"):
        attention(q, k, v, spec=spec())


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.randn(1, 6, 2, 16)), r"packed \(total_tokens, H, D\).*fp4gen.attention"),
    (dict(cq=torch.tensor([0, 2, 6], dtype=torch.float32)), "cu_seqlens_q must be a 1-D int32"),
    (dict(cq=torch.tensor([0, 6], dtype=torch.int32)), "cu_seqlens_q has 2 offsets and cu_seqlens_k 3"),
    (dict(max_q=-1), "max_seqlen_q must be an int >= 0"),
    (dict(max_q=3), "more than max_seqlen_q=3"),
    (dict(cq=torch.tensor([0, 4, 2], dtype=torch.int32)), "never decrease"),
])
def test_varlen_argument_errors(change, match):
    args = dict(q=torch.randn(6, 2, 16), k=torch.randn(7, 2, 16), v=torch.randn(7, 2, 16),
                cq=torch.tensor([0, 2, 6], dtype=torch.int32), ck=torch.tensor([0, 3, 7], dtype=torch.int32),
                max_q=4, max_k=4)
    args.update(change)
    with pytest.raises((AttentionInputError, ValueError), match=match):
        attention_varlen(args["q"], args["k"], args["v"], args["cq"], args["ck"], args["max_q"], args["max_k"],
                         spec=spec())


def test_exported_from_the_package():
    import fp4gen

    q, k, v = (torch.randn(4, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    o = fp4gen.attention_varlen(q, k, v, cu, cu, 4, 4, spec=spec())
    assert torch.allclose(o, fp4gen.attention(q[None], k[None], v[None], spec=spec())[0], atol=1e-6)
    assert not math.isnan(float(o.sum()))


def test_opcheck_with_sinks_and_varlen():
    """The ops' schema, fake impls and autograd registration with the new arguments."""
    sp = spec("sinks learned; mask window(2, 0)")
    key = torch_ops.spec_key(sp, sinks=True)
    q, k, v = (torch.randn(s, requires_grad=True) for s in ((1, 5, 2, 16), (1, 6, 2, 16), (1, 6, 2, 16)))
    s = torch.randn(2, requires_grad=True)
    torch.library.opcheck(torch.ops.fp4gen.attention_fwd.default, (q, k, v, key, None, "auto", s))
    vkey = torch_ops.spec_key(sp, sinks=True, layout="varlen")
    cq, ck = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
    args = (q[0], k[0], v[0], vkey, None, "auto", s, cq, ck, 3, 3)
    torch.library.opcheck(torch.ops.fp4gen.attention_fwd.default, args)
    o, lse, state = torch.ops.fp4gen.attention_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    assert lse.shape == (2, 5)
    torch.library.opcheck(torch.ops.fp4gen.attention_bwd.default,
                          (q[0].detach(), k[0].detach(), v[0].detach(), o, lse, torch.randn_like(o), state, vkey,
                           None, "auto", s.detach(), cq, ck, 3, 3))


def test_a_reference_module_of_a_sinks_varlen_spec_runs(tmp_path):
    """A generated reference-target module's forward takes no sinks or cu_seqlens: its spec runs
    on the reference backend itself."""
    import fp4gen

    path = tmp_path / "s.attn"
    path.write_text(f"attention sv {{ target reference; head_dim 16; {FP32}; sinks learned; layout varlen }}\n")
    mod = fp4gen.load(path)
    q, k, v, s = leaves((6, 2, 16), (7, 2, 16), (7, 2, 16), (2,))
    cq, ck = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    o = attention_varlen(q, k, v, cq, ck, 4, 4, spec=mod, sinks=s)
    want = attention_varlen(q, k, v, cq, ck, 4, 4, spec=spec("sinks learned"), sinks=s)
    assert torch.equal(o, want)
    torch.autograd.grad(o.sum(), [q, k, v, s])
