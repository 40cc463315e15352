"""The sm90a split-KV decode kernel on the GPU against the reference decode (issue 22).

Run on an H100/H200:  python3 -m pytest -q -m gpu tests/kvcache/test_decode_gpu.py

Each case builds one cache from random bf16 K/V (``fp4gen.kv_cache_from``), ragged lengths
across the batch, and compares ``attention_with_kvcache(..., backend="generated")`` (the
kernel) with ``backend="reference"`` (``numerics.kvcache.decode``: the same cache, the same
split count) on a copy of the same cache. The tolerance is what the two arithmetics leave
apart: both accumulate in fp32 and round P to bf16 for PV; the kernel's exp2 is MUFU's
(relative error ~2^-22) and its sums run in another order, so an element of P may round to
the neighbouring bf16 value. The planted faults show the check fails for a wrong split
combine and for pages read in the wrong order.
"""
from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.frontend import parse_text

pytestmark = pytest.mark.gpu

HKV = 2
LENGTHS = (1, 17, 1000, 4096)  # ragged across the batch


def _ident(text):
    return "".join(ch if ch.isalnum() else "_" for ch in text)


def spec_of(*, head_dim=128, mask="causal", storage=None, gqa=8, q_tokens=8, fmt="bf16", tile_n=128, kv_stages=1):
    store = f"    storage  {storage}\n" if storage else ""
    name = _ident(f"dec_{head_dim}_{mask}_{gqa}_{q_tokens}_{storage or 'contig'}_{fmt}_{tile_n}_{kv_stages}")
    return parse_text(f"""attention {name} {{
  target   sm90a
  head_dim {head_dim}
  mask     {mask}
  schedule {{
    tile 128 x {tile_n}
    kv_stages {kv_stages}
  }}
  kv_cache {{
{store}    format   {fmt}
    q_tokens {q_tokens}
    gqa      {gqa}
  }}
}}""", filename="test_decode_gpu.attn")[0]


def make_case(spec, lengths, sq, *, capacity=None, shuffle_pages=False, seed=0):
    """(q, kc, vc, page_table, lens) on CUDA, and a clone of the cache for the reference."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    c = spec.kv_cache
    B, D = len(lengths), spec.head_dim
    S = max(lengths)
    capacity = capacity or S
    k = torch.randn(B, S, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(B, S, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(B, sq, HKV * c.gqa, D, device="cuda", generator=g).to(torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    pt = None
    if c.page_size:
        pps = -(-capacity // c.page_size)
        order = torch.randperm(B * pps, generator=torch.Generator().manual_seed(seed)) if shuffle_pages \
            else torch.arange(B * pps)
        pt = order.to(torch.int32).reshape(B, pps).cuda()
    kc, vc, pt = fp4gen.kv_cache_from(k, v, spec, cache_seqlens=lens, capacity=capacity, page_table=pt,
                                      num_pages=None)
    return q, kc, vc, pt, lens


def clone_cache(c):
    from dataclasses import replace

    return replace(c, data=c.data.clone(), scale=None if c.scale is None else c.scale.clone())


def run(q, kc, vc, pt, lens, spec, backend, **kw):
    return fp4gen.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=pt, spec=spec,
                                         return_lse=True, backend=backend, **kw)


def assert_close(o, lse, o_ref, lse_ref, what=""):
    """O within bf16 rounding of P (max |diff| <= 2e-2 of the largest |O|, rel-L2 <= 4e-3), LSE
    within 2e-3 where finite, and -inf (no visible key) at exactly the same rows."""
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape, what
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), f"{what}: rows without keys differ"
    fin = torch.isfinite(lse_ref)
    assert torch.isfinite(o).all(), f"{what}: non-finite O"
    assert (lse[fin] - lse_ref[fin]).abs().max().item() <= 2e-3, f"{what}: LSE off by " \
        f"{(lse[fin] - lse_ref[fin]).abs().max().item():.3g}"
    of, rf = o.float(), o_ref.float()
    scale = max(rf.abs().max().item(), 1e-6)
    err = (of - rf).abs().max().item()
    rel = ((of - rf).norm() / rf.norm().clamp_min(1e-12)).item()
    assert err <= 2e-2 * scale and rel <= 4e-3, f"{what}: O max |diff| {err:.3g} (of {scale:.3g}), rel-L2 {rel:.3g}"


def compare(spec, lengths, sq, splits, **case):
    q, kc, vc, pt, lens = make_case(spec, lengths, sq, **case)
    kr, vr = clone_cache(kc), clone_cache(vc)
    o, lse = run(q, kc, vc, pt, lens, spec, "generated", num_splits=splits)
    o_ref, lse_ref = run(q, kr, vr, pt, lens, spec, "reference", num_splits=splits)
    assert_close(o, lse, o_ref, lse_ref, f"{spec.name} Sq={sq} splits={splits}")
    return o, lse


@pytest.mark.parametrize("storage", [None, "paged(page_size=64)"], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("sq", [1, 3, 8])
@pytest.mark.parametrize("splits", [1, 5])
def test_d128_causal_matches_the_reference(storage, gqa, sq, splits):
    compare(spec_of(storage=storage, gqa=gqa), LENGTHS, sq, splits)


@pytest.mark.parametrize("storage", [None, "paged(page_size=16)"], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("sq,splits", [(1, 1), (4, 3), (2, 7)])
def test_d64_no_mask_matches_the_reference(storage, sq, splits):
    compare(spec_of(head_dim=64, mask="none", storage=storage, gqa=4, q_tokens=4), LENGTHS, sq, splits)


FP8 = ["fp8e4m3(scale=token)", "fp8e4m3(scale=tensor)"]


@pytest.mark.parametrize("fmt", FP8, ids=["token", "tensor"])
@pytest.mark.parametrize("storage", [None, "paged(page_size=64)"], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("sq,splits", [(1, 1), (8, 5), (3, None)])
def test_fp8_cache_matches_the_reference(fmt, storage, sq, splits):
    compare(spec_of(storage=storage, gqa=8, fmt=fmt), LENGTHS, sq, splits, shuffle_pages=True)


def test_fp8_d64_token_paged16_no_mask():
    compare(spec_of(head_dim=64, mask="none", storage="paged(page_size=16)", gqa=4, q_tokens=4, fmt=FP8[0]),
            LENGTHS, 4, 3, shuffle_pages=True, seed=2)


@pytest.mark.parametrize("fmt", FP8, ids=["token", "tensor"])
def test_fp8_appends_are_the_reference_bits(fmt):
    """New tokens quantized into the cache (the reference's quantizer), crossing a page, then attended."""
    spec = spec_of(storage="paged(page_size=16)", gqa=4, fmt=fmt)
    q, kc, vc, pt, lens = make_case(spec, (14, 30, 200), 3, capacity=256, shuffle_pages=True, seed=7)
    kr, vr = clone_cache(kc), clone_cache(vc)
    g = torch.Generator(device="cuda").manual_seed(11)
    kn, vn = (torch.randn(3, 3, HKV, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    o, lse = fp4gen.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, page_table=pt, spec=spec,
                                           return_lse=True, num_splits=2)
    o_ref, lse_ref = fp4gen.attention_with_kvcache(q, kr, vr, kn, vn, cache_seqlens=lens, page_table=pt, spec=spec,
                                                   return_lse=True, num_splits=2, backend="reference")
    assert torch.equal(kc.data, kr.data) and torch.equal(vc.data, vr.data)  # the same codes appended
    if kc.scale is not None:
        assert torch.equal(kc.scale, kr.scale) and torch.equal(vc.scale, vr.scale)
    assert_close(o, lse, o_ref, lse_ref, f"{fmt} append")


NVFP4 = ["nvfp4", "nvfp4(tensor_scale=fp32)"]


@pytest.mark.parametrize("fmt", NVFP4, ids=["nvfp4", "two_level"])
@pytest.mark.parametrize("storage", [None, "paged(page_size=64)"], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("sq,splits", [(1, 1), (8, 5), (3, None)])
def test_nvfp4_cache_matches_the_reference(fmt, storage, sq, splits):
    compare(spec_of(storage=storage, gqa=8, fmt=fmt), LENGTHS, sq, splits, shuffle_pages=True)


def test_nvfp4_two_level_d64_paged16():
    compare(spec_of(head_dim=64, storage="paged(page_size=16)", gqa=4, q_tokens=4, fmt=NVFP4[1]),
            LENGTHS, 2, 4, shuffle_pages=True, seed=4)


@pytest.mark.parametrize("fmt", NVFP4, ids=["nvfp4", "two_level"])
def test_nvfp4_appends_are_the_reference_bits(fmt):
    test_fp8_appends_are_the_reference_bits(fmt)


def test_planted_fp8_scale_ignored_is_caught():
    """The kernel given all-ones V scales (as if it dropped them): the check must fail."""
    spec = spec_of(gqa=8, fmt=FP8[0])
    q, kc, vc, pt, lens = make_case(spec, (1000, 300), 1)
    o_ref, lse_ref = run(q, clone_cache(kc), clone_cache(vc), pt, lens, spec, "reference", num_splits=2)
    o, lse = _module(spec).decode(q, kc.data, vc.data, lens, k_scale=kc.scale, v_scale=torch.ones_like(vc.scale),
                                  num_splits=2, return_lse=True)
    with pytest.raises(AssertionError):
        assert_close(o, lse, o_ref, lse_ref, "planted V scale")


def test_planted_nvfp4_nibble_order_is_caught():
    """The cache's bytes with their two E2M1 nibbles swapped (the other packing order): the check fails."""
    spec = spec_of(gqa=8, fmt=NVFP4[0])
    q, kc, vc, pt, lens = make_case(spec, (1000, 300), 1)
    o_ref, lse_ref = run(q, clone_cache(kc), clone_cache(vc), pt, lens, spec, "reference", num_splits=2)
    swap = lambda x: ((x >> 4) | (x << 4)).to(torch.uint8)  # noqa: E731
    o, lse = _module(spec).decode(q, swap(kc.data), swap(vc.data), lens, k_scale=kc.scale, v_scale=vc.scale,
                                  num_splits=2, return_lse=True)
    with pytest.raises(AssertionError):
        assert_close(o, lse, o_ref, lse_ref, "planted nibble order")


@pytest.mark.parametrize("fmt", ["bf16", FP8[0], NVFP4[1]], ids=["bf16", "fp8_token", "nvfp4_two_level"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_key_tiles_of_64(fmt, head_dim):
    """schedule tile 128 x 64: 64-key tiles (the reference splits by the same tiles)."""
    compare(spec_of(head_dim=head_dim, storage="paged(page_size=16)", gqa=8, fmt=fmt, tile_n=64), LENGTHS, 5, 3,
            shuffle_pages=True, seed=6)


@pytest.mark.parametrize("fmt", ["bf16", FP8[0], FP8[1], NVFP4[1]], ids=["bf16", "fp8_token", "fp8_tensor", "nvfp4_2l"])
@pytest.mark.parametrize("storage", [None, "paged(page_size=64)"], ids=["contiguous", "paged64"])
@pytest.mark.parametrize("sq,splits", [(1, 1), (3, 2)])
def test_two_stage_load_ring(fmt, storage, sq, splits):
    """schedule kv_stages 2: tile t + 1's copies fly while tile t computes (opt-in until it has run)."""
    compare(spec_of(storage=storage, gqa=8, fmt=fmt, kv_stages=2), LENGTHS, sq, splits, shuffle_pages=True, seed=8)


@pytest.mark.parametrize("fmt,tile_n,stages", [("bf16", 64, 4), ("bf16", 128, 2), (FP8[0], 128, 3), (FP8[1], 64, 4),
                                               (NVFP4[0], 128, 3), (NVFP4[1], 64, 4)],
                         ids=["bf16-n64-s4", "bf16-n128-s2", "fp8_token-n128-s3", "fp8_tensor-n64-s4",
                              "nvfp4-n128-s3", "nvfp4_2l-n64-s4"])
@pytest.mark.parametrize("storage", [None, "paged(page_size=16)"], ids=["contiguous", "paged16"])
def test_deep_load_rings(fmt, tile_n, stages, storage):
    """schedule kv_stages 3 / 4: the ring's prologue, wait depth and stage reuse on hardware (the
    CPU emulator lands every copy at once, so it cannot see a read before its copy landed);
    splits 3 give runs shorter than the ring next to long ones."""
    compare(spec_of(storage=storage, gqa=8, fmt=fmt, tile_n=tile_n, kv_stages=stages), LENGTHS, 2, 3,
            shuffle_pages=True, seed=9)


def test_planner_split_and_pages_out_of_order():
    spec = spec_of(storage="paged(page_size=64)", gqa=8)
    compare(spec, (4096, 33, 2500), 2, None, shuffle_pages=True, seed=3)


def test_short_caches_and_more_queries_than_keys():
    """Sq 8 against caches of 1 and 3 keys: causal rows that see no key get o = 0, lse = -inf."""
    spec = spec_of(gqa=4)
    o, lse = compare(spec, (1, 3, 130), 8, 2)
    assert torch.isneginf(lse[0, :, :7]).all() and (o[0, :7] == 0).all()


def test_appends_across_a_page_boundary():
    """New tokens written (the reference's quantizer) then attended, crossing page 0 -> 1."""
    spec = spec_of(storage="paged(page_size=16)", gqa=4)
    q, kc, vc, pt, lens = make_case(spec, (14, 30, 200), 3, capacity=256, shuffle_pages=True, seed=5)
    kr, vr = clone_cache(kc), clone_cache(vc)
    g = torch.Generator(device="cuda").manual_seed(9)
    kn = torch.randn(3, 3, HKV, 128, device="cuda", generator=g).to(torch.bfloat16)
    vn = torch.randn(3, 3, HKV, 128, device="cuda", generator=g).to(torch.bfloat16)
    o, lse = fp4gen.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, page_table=pt, spec=spec,
                                           return_lse=True, num_splits=2)
    o_ref, lse_ref = fp4gen.attention_with_kvcache(q, kr, vr, kn, vn, cache_seqlens=lens, page_table=pt, spec=spec,
                                                   return_lse=True, num_splits=2, backend="reference")
    assert torch.equal(kc.data, kr.data) and torch.equal(vc.data, vr.data)  # the same bits appended
    assert_close(o, lse, o_ref, lse_ref, "append")


def test_splits_agree_with_one_split():
    spec = spec_of(gqa=8)
    q, kc, vc, pt, lens = make_case(spec, LENGTHS, 4)
    o1, l1 = run(q, kc, vc, pt, lens, spec, "generated", num_splits=1)
    o7, l7 = run(q, kc, vc, pt, lens, spec, "generated", num_splits=7)
    assert_close(o7, l7, o1, l1, "7 splits vs 1")


def _module(spec):
    from fp4gen.api import _kv_module

    return _kv_module(spec)


def test_planted_wrong_combine_is_caught():
    """Partials combined without their LSE weights (a plain mean of o_s): the check must fail."""
    from fp4gen.numerics import kvcache as kv

    spec = spec_of(gqa=8)
    q, kc, vc, pt, lens = make_case(spec, LENGTHS, 2)
    o_ref, lse_ref = run(q, clone_cache(kc), clone_cache(vc), pt, lens, spec, "reference", num_splits=4)
    o_s, lse_s = _module(spec).decode(q, kc.data, vc.data, lens, num_splits=4, partials=True)
    # the right combine passes ...
    o, lse2 = kv.combine(o_s, lse_s)
    assert_close(o.permute(0, 2, 1, 3).to(torch.bfloat16), lse2 * kv.LN2, o_ref, lse_ref, "combine")
    # ... a wrong one (equal weights for the splits that saw keys) does not
    seen = torch.isfinite(lse_s)
    bad = (o_s * seen[..., None]).sum(0) / seen.sum(0).clamp_min(1)[..., None]
    with pytest.raises(AssertionError):
        assert_close(bad.permute(0, 2, 1, 3).to(torch.bfloat16), lse2 * kv.LN2, o_ref, lse_ref, "planted combine")


def test_planted_wrong_page_order_is_caught():
    """The kernel given a page table with two sequences' pages swapped reads other keys: the check fails."""
    spec = spec_of(storage="paged(page_size=64)", gqa=4)
    q, kc, vc, pt, lens = make_case(spec, (1000, 1000), 1, shuffle_pages=True, seed=1)
    o_ref, lse_ref = run(q, clone_cache(kc), clone_cache(vc), pt, lens, spec, "reference", num_splits=1)
    o, lse = run(q, kc, vc, pt.flip(0).contiguous(), lens, spec, "generated", num_splits=1)
    with pytest.raises(AssertionError):
        assert_close(o, lse, o_ref, lse_ref, "planted page table")
