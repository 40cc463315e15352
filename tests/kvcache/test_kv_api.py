"""fp4gen.attention_with_kvcache / allocate_kv_cache / kv_cache_from: bad arguments get an
error that says what to change; no silent fallback where no decode kernel exists."""
from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.frontend import parse_text
from fp4gen.runtime.checks import AttentionInputError


def spec_of(fmt="fp8e4m3(scale=token)", storage="paged(page_size=16)", target="reference", q_tokens=2, gqa=2):
    return parse_text(f"""attention t {{
  target {target}
  head_dim 64
  mask causal
  kv_cache {{
    storage {storage}
    format {fmt}
    q_tokens {q_tokens}
    gqa {gqa}
  }}
}}""")[0]


@pytest.fixture
def paged():
    spec = spec_of()
    k = torch.randn(2, 40, 2, 64)
    kc, vc, pt = fp4gen.kv_cache_from(k, k.clone(), spec, cache_seqlens=torch.tensor([10, 40], dtype=torch.int32),
                                      capacity=64)
    q = torch.randn(2, 1, 4, 64)
    return spec, kc, vc, pt, q


def call(spec, kc, vc, pt, q, **kw):
    kw.setdefault("cache_seqlens", torch.tensor([10, 40], dtype=torch.int32))
    return fp4gen.attention_with_kvcache(q, kc, vc, page_table=pt, spec=spec, **kw)


def test_runs_and_returns_q_dtype(paged):
    spec, kc, vc, pt, q = paged
    o, lse = call(spec, kc, vc, pt, q.bfloat16(), return_lse=True)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.shape == (2, 4, 1) and lse.dtype == torch.float32


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.randn(2, 3, 4, 64)), "q_tokens 2"),
    (dict(q=torch.randn(2, 1, 8, 64)), "gqa 2"),
    (dict(q=torch.randn(2, 1, 4, 32)), "head dim 32"),
    (dict(pt=None), "paged cache: pass page_table"),
    (dict(cache_seqlens=torch.tensor([10, 70], dtype=torch.int32)), "do not fit in 64"),
    (dict(cache_seqlens=torch.tensor([10.0, 4.0])), "cache_seqlens must be"),
    (dict(pt=torch.tensor([[99, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)), "page index outside"),
    (dict(k=torch.randn(2, 1, 2, 64)), "both k and v"),
    (dict(num_splits=0), "num_splits"),
    (dict(backend="fast"), "backend must be"),
    (dict(softcap=-1.0), "softcap"),
    (dict(window_size=(-2, 0)), "window_size"),
])
def test_bad_arguments(paged, change, match):
    spec, kc, vc, pt, q = paged
    args = dict(spec=spec, kc=kc, vc=vc, pt=pt, q=q)
    args.update({k: change.pop(k) for k in list(change) if k in args})
    with pytest.raises((AttentionInputError, TypeError), match=match):
        call(args["spec"], args["kc"], args["vc"], args["pt"], args["q"], **change)


def test_cache_of_another_format_is_refused(paged):
    spec, kc, vc, pt, q = paged
    other = spec_of("nvfp4")
    with pytest.raises(AttentionInputError, match="the spec's cache is nvfp4"):
        call(other, kc, vc, pt, q)


def test_spec_without_a_cache_is_refused(paged):
    _, kc, vc, pt, q = paged
    plain = parse_text("attention p {\n target reference\n head_dim 64\n}")[0]
    with pytest.raises(AttentionInputError, match="no kv_cache block"):
        call(plain, kc, vc, pt, q)


def test_no_decode_kernel_is_an_error_not_a_fallback(paged):
    spec, kc, vc, pt, q = paged
    with pytest.raises(fp4gen.NoKernelError, match="no reference decode kernel|backend='reference'"):
        call(spec, kc, vc, pt, q, backend="generated")


def test_allocate_and_a_plain_bf16_tensor_cache():
    spec = spec_of("bf16", "contiguous")
    kc, vc = fp4gen.allocate_kv_cache(spec, kv_heads=2, slots=3, seqlen=32)
    assert kc.data.shape == (3, 32, 2, 64) and kc.data.dtype == torch.bfloat16
    k_plain, v_plain = torch.zeros(3, 32, 2, 64, dtype=torch.bfloat16), torch.zeros(3, 32, 2, 64, dtype=torch.bfloat16)
    new = torch.randn(3, 2, 2, 64)
    q = torch.randn(3, 2, 4, 64)
    o1 = fp4gen.attention_with_kvcache(q, kc, vc, new, new, cache_seqlens=5, spec=spec)
    o2 = fp4gen.attention_with_kvcache(q, k_plain, v_plain, new, new, cache_seqlens=5, spec=spec)
    assert torch.equal(o1, o2)
    assert torch.equal(k_plain[:, 5:7], new.bfloat16())  # written in place, flash_attn's way
    with pytest.raises(TypeError, match="seqlen"):
        fp4gen.allocate_kv_cache(spec, kv_heads=2, slots=3)
    with pytest.raises(TypeError, match="k_scale"):
        fp4gen.allocate_kv_cache(spec_of("fp8e4m3(scale=tensor)"), kv_heads=2, slots=3)


def test_spec_from_a_file(tmp_path, paged):
    _, kc, vc, pt, q = paged
    p = tmp_path / "d.attn"
    p.write_text("attention d {\n target reference\n head_dim 64\n kv_cache {\n  storage paged(page_size=16)\n"
                 "  format fp8e4m3(scale=token)\n  q_tokens 2\n  gqa 2\n }\n}\n")
    o = call(str(p), kc, vc, pt, q)
    assert torch.isfinite(o).all()
    with pytest.raises(AttentionInputError, match="no kernel 'x'"):
        call(f"{p}::x", kc, vc, pt, q)


def test_sm100a_decode_spec_is_refused_at_its_line():
    from fp4gen.ir.passes import PlanError, plan_kernel

    with pytest.raises(PlanError, match="sm100a has no decode kernel") as e:
        plan_kernel(spec_of(target="sm100a"))
    assert e.value.loc is not None and e.value.loc.line == 5


def test_sm90a_takes_every_cache_format_and_refuses_softcap_at_its_line():
    """sm90a plans a kv_cache spec; its decode kernel reads every cache format, and refuses what
    it does not implement (softcap here) at that line (what `fp4gen check` reports)."""
    import dataclasses

    from fp4gen.ir.passes import plan_kernel
    from fp4gen.lowering import refusal

    for fmt in ("bf16", "fp8e4m3(scale=token)", "fp8e4m3(scale=tensor)", "nvfp4", "nvfp4(tensor_scale=fp32)"):
        assert refusal(plan_kernel(spec_of(fmt=fmt, target="sm90a"))) is None, fmt
    spec = dataclasses.replace(spec_of(target="sm90a"), softcap=30.0)
    err = refusal(plan_kernel(spec))
    assert err is not None and "softcap" in str(err) and err.path == "softcap"


def test_generated_backend_on_the_cpu_raises_no_kernel():
    spec = spec_of(fmt="bf16", target="sm90a")
    k = torch.randn(2, 40, 2, 64)
    kc, vc, pt = fp4gen.kv_cache_from(k, k.clone(), spec, capacity=64)
    with pytest.raises(fp4gen.NoKernelError, match="backend='reference'"):
        call(spec, kc, vc, pt, torch.randn(2, 1, 4, 64), backend="generated")


@pytest.mark.gpu
def test_cuda_auto_raises_no_kernel_for_a_gpu_target_and_reference_runs():
    spec = spec_of(target="sm90a")
    ref_spec = spec_of()
    k = torch.randn(2, 40, 2, 64, device="cuda")
    kc, vc, pt = fp4gen.kv_cache_from(k, k.clone(), ref_spec, capacity=64)
    q = torch.randn(2, 1, 4, 64, device="cuda")
    with pytest.raises(fp4gen.NoKernelError, match="backend='reference'"):  # no sm90a decode kernel has windows
        fp4gen.attention_with_kvcache(q, kc, vc, cache_seqlens=40, page_table=pt, spec=spec, window_size=(16, 0))
    o = fp4gen.attention_with_kvcache(q, kc, vc, cache_seqlens=40, page_table=pt, spec=ref_spec)
    kc_cpu, vc_cpu, _ = fp4gen.kv_cache_from(k.cpu(), k.cpu().clone(), ref_spec, capacity=64)
    o_cpu = fp4gen.attention_with_kvcache(q.cpu(), kc_cpu, vc_cpu, cache_seqlens=40, page_table=pt.cpu(), spec=ref_spec)
    assert torch.allclose(o.cpu(), o_cpu, atol=1e-5, rtol=1e-5)


def test_dense_attention_refuses_a_kv_cache_spec():
    """A kv_cache spec's K and V come from the cache's format: dense attention would silently
    ignore it (it used to run the reference dense attention on the CPU)."""
    spec = spec_of()
    q, k = torch.randn(1, 8, 4, 64), torch.randn(1, 8, 2, 64)
    with pytest.raises(AttentionInputError, match="attention_with_kvcache"):
        fp4gen.attention(q, k, k, spec=spec)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="kv_cache block"):
        fp4gen.attention_varlen(q[0], k[0], k[0], cu, cu, 8, 8, spec=spec)
    dense = parse_text("attention d {\n  target reference\n  head_dim 64\n  mask causal\n}")[0]
    assert fp4gen.attention(q, k, k, spec=dense).shape == q.shape  # the same call without kv_cache runs
