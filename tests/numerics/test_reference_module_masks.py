"""A reference-target module takes ``sinks=`` and, for a ``layout varlen`` spec, the varlen
arguments by name, computing what ``fp4gen.numerics.reference`` computes; missing or
misplaced arguments fail with a message that names them."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.numerics import reference

ROOT = Path(__file__).resolve().parents[2]
FP32 = ("Q : fp32; K : fp32; P : fp32; V : fp32; O : fp32; "
        "backward { dO : fp32; dS : fp32; dP : fp32; dQ : fp32; dK : fp32; dV : fp32 }")


def module(tmp_path, fields: str):
    path = tmp_path / "m.attn"
    path.write_text(f"attention m {{ target reference; head_dim 16; {FP32}; {fields} }}\n")
    return fp4gen.load(path)


def rnd(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_dense_sinks_forward_and_backward(tmp_path):
    mod = module(tmp_path, "mask window(4, 0); softcap 3; sinks learned")
    q, k, v, do = (rnd(2, 9, 2, 16, seed=s) for s in range(4))
    sinks = rnd(2, seed=5)
    o, lse = mod.forward(q, k, v, sinks=sinks, return_lse=True)
    want_o, want_lse = reference.forward(q, k, v, mod.SPEC, sinks=sinks)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)
    got = mod.backward(q, k, v, o, lse, do, sinks=sinks)
    want = reference.backward(q, k, v, want_o, want_lse, do, mod.SPEC, sinks=sinks)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="learned sinks: pass sinks"):
        mod.forward(q, k, v)


def test_dense_spec_refuses_varlen_arguments(tmp_path):
    mod = module(tmp_path, "mask causal")
    q = rnd(1, 4, 1, 16, seed=0)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"cu_seqlens_q, max_seqlen_q: the spec is layout dense"):
        mod.forward(q, q, q, cu_seqlens_q=cu, max_seqlen_q=4)
    with pytest.raises(TypeError, match=r"cu_seqlens_k: the spec is layout dense"):
        mod.backward(q, q, q, q, torch.zeros(1, 1, 4), q, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="has no sinks"):
        mod.forward(q, q, q, sinks=torch.zeros(1))


def test_varlen_forward_and_backward(tmp_path):
    mod = module(tmp_path, "layout varlen; mask causal; sinks learned")
    cq = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)  # an empty sequence and one of length 1
    ck = torch.tensor([0, 5, 6, 7, 12], dtype=torch.int32)
    q, do = rnd(9, 2, 16, seed=1), rnd(9, 2, 16, seed=2)
    k, v = rnd(12, 1, 16, seed=3), rnd(12, 1, 16, seed=4)
    sinks = rnd(2, seed=5)
    packing = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=5, max_seqlen_k=5)
    o, lse = mod.forward(q, k, v, sinks=sinks, return_lse=True, **packing)
    want_o, want_lse = reference.forward_varlen(q, k, v, cq, ck, mod.SPEC, sinks=sinks, max_seqlen_q=5,
                                                max_seqlen_k=5)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse) and lse.shape == (2, 9)
    got = mod.backward(q, k, v, o, lse, do, sinks=sinks, **packing)
    want = reference.backward_varlen(q, k, v, want_o, want_lse, do, cq, ck, mod.SPEC, sinks=sinks)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(TypeError, match=r"layout varlen: pass max_seqlen_q, max_seqlen_k"):
        mod.forward(q, k, v, sinks=sinks, cu_seqlens_q=cq, cu_seqlens_k=ck)
    with pytest.raises(TypeError, match=r"layout varlen: pass cu_seqlens_q, cu_seqlens_k, max_seqlen_q"):
        mod.backward(q, k, v, o, lse, do, sinks=sinks)
    with pytest.raises(ValueError, match=r"q must be .*shape \(total, H, 16\).*expected 3 dimensions"):
        mod.forward(q[None], k, v, sinks=sinks, **packing)
    with pytest.raises(ValueError, match="more than max_seqlen_q=4"):
        mod.forward(q, k, v, sinks=sinks, **{**packing, "max_seqlen_q": 4})


def test_the_example_module_runs_its_window_softcap_sinks():
    path = ROOT / "generated" / "ref_window_softcap_sinks_reference.py"
    spec = importlib.util.spec_from_file_location("ref_window_softcap_sinks_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.SPEC.window_size == (128, 0) and mod.SPEC.softcap == 50 and mod.SPEC.sinks.value == "learned"
    q, k, v, do = (rnd(1, 200, 2, 64, seed=s).bfloat16() for s in range(4))
    sinks = rnd(2, seed=9)
    o, lse = mod.forward(q, k, v, sinks=sinks, return_lse=True)
    want_o, want_lse = reference.forward(q, k, v, mod.SPEC, sinks=sinks)
    assert o.dtype == torch.bfloat16 and torch.equal(o, want_o.bfloat16()) and torch.equal(lse, want_lse)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do, sinks=sinks)
    assert dq.shape == q.shape and torch.isfinite(dq).all() and torch.isfinite(dk).all()
