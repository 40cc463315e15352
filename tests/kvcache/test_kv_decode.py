"""Decode against a cache on the reference backend (fp4gen.attention_with_kvcache): against
the float64 oracle (numerics/exact.py) on the tokens as the cache stores them, built here
from the original tokens without the cache's addressing, so a wrong page, row or length shows;
the split-KV combine against one split; ragged lengths (0 too), page tables out of order,
appends that cross a page boundary, GQA 1 and 8, Sq 1..8 bottom-right, window, softcap,
sinks, LSE; and a planted wrong page index that the comparison catches."""
from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.frontend import parse_text
from fp4gen.numerics import exact, kvcache as kv, reference as ref

FORMATS = ("bf16", "fp8e4m3(scale=token)", "fp8e4m3(scale=tensor)", "nvfp4", "nvfp4(tensor_scale=fp32)")


def make_spec(fmt="bf16", storage="paged(page_size=16)", q_tokens=8, gqa=1, mask="causal", extra="", D=64):
    return parse_text(f"""attention t {{
  target reference
  head_dim {D}
  mask {mask}
  {extra}
  Q : fp32
  P : fp32
  O : fp32
  kv_cache {{
    storage {storage}
    format {fmt}
    q_tokens {q_tokens}
    gqa {gqa}
  }}
}}""")[0]


def setup(spec, lens=(0, 15, 47, 100), Sq=3, Sn=3, Hkv=2, S=128, seed=0, shuffle=True):
    """Caches from K/V (B, S, Hkv, D) holding lens[b] tokens, a shuffled page table with room
    for the appends, q (B, Sq, H, D) and new tokens (B, Sn, Hkv, D), all float32."""
    g = torch.Generator().manual_seed(seed)
    B, D, H = len(lens), spec.head_dim, Hkv * spec.kv_cache.gqa
    K, V = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    page_table = None
    if spec.kv_cache.page_size:
        pps = -(-S // spec.kv_cache.page_size)
        perm = torch.randperm(B * pps, generator=g) if shuffle else torch.arange(B * pps)
        page_table = perm.reshape(B, pps).to(torch.int32)
    lengths = torch.tensor(lens, dtype=torch.int32)
    kc, vc, pt = fp4gen.kv_cache_from(K, V, spec, cache_seqlens=lengths, capacity=S, page_table=page_table)
    q = torch.randn(B, Sq, H, D, generator=g)
    kn, vn = (torch.randn(B, Sn, Hkv, D, generator=g) for _ in range(2)) if Sn else (None, None)
    return dict(K=K, V=V, kc=kc, vc=vc, pt=pt, lengths=lengths, q=q, kn=kn, vn=vn)


def stored(cache: kv.CacheTensor, tokens: torch.Tensor) -> torch.Tensor:
    """Tokens (T, Hkv, D) as the cache's format stores them (its quantizer on the tokens in
    order: no slots, no page table)."""
    data, scale = kv.quantize_tokens(cache.fmt, tokens, cache.tensor_scale)
    return kv.dequantize_rows(cache.fmt, data, scale, cache.tensor_scale)


def oracle(spec, d, window, softcap=0.0, sinks=None):
    """Per sequence: exact float64 attention on the stored tokens of the cache and the appends."""
    outs, lses = [], []
    for b, L in enumerate(d["lengths"].tolist()):
        kt, vt = d["K"][b, :L], d["V"][b, :L]
        if d["kn"] is not None:
            kt, vt = torch.cat([kt, d["kn"][b]]), torch.cat([vt, d["vn"][b]])
        o, lse = exact.attention(d["q"][b:b + 1], stored(d["kc"], kt)[None], stored(d["vc"], vt)[None],
                                 scale=spec.scale, window=window, softcap=softcap, sinks=sinks)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def run(spec, d, **kw):
    return fp4gen.attention_with_kvcache(d["q"], d["kc"], d["vc"], d["kn"], d["vn"], cache_seqlens=d["lengths"],
                                         page_table=d["pt"], spec=spec, return_lse=True, **kw)


def close(o, lse, oe, le, tol=2e-5):
    fin = torch.isfinite(le)
    assert torch.equal(fin, torch.isfinite(lse)), "rows without keys differ"
    err_o = (o.double() - oe).abs().max().item()
    err_l = (lse.double() - le)[fin].abs().max().item() if fin.any() else 0.0
    return err_o <= tol and err_l <= tol, (err_o, err_l)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("storage", ["paged(page_size=16)", "contiguous"])
def test_matches_exact_on_the_stored_cache(fmt, storage):
    spec = make_spec(fmt, storage)
    d = setup(spec)
    o, lse = run(spec, d)
    ok, errs = close(o, lse, *oracle(spec, d, (-1, 0)))
    assert ok, errs


@pytest.mark.parametrize("gqa", [1, 8])
@pytest.mark.parametrize("Sq", [1, 2, 5, 8])
def test_gqa_and_query_tokens_bottom_right(gqa, Sq):
    spec = make_spec("fp8e4m3(scale=token)", gqa=gqa)
    d = setup(spec, Sq=Sq, Sn=Sq, Hkv=1 if gqa == 8 else 2)
    o, lse = run(spec, d)
    ok, errs = close(o, lse, *oracle(spec, d, (-1, 0)))
    assert ok, errs


def test_window_softcap_sinks():
    spec = make_spec("nvfp4", mask="window(20, 0)", extra="softcap 30")
    d = setup(spec, lens=(0, 7, 60, 120), Sq=4, Sn=4)
    sinks = torch.tensor([0.5, -1.0])
    o, lse = run(spec, d, sinks=sinks)
    ok, errs = close(o, lse, *oracle(spec, d, (20, 0), softcap=30.0, sinks=sinks))
    assert ok, errs
    # a row with no key but a sink: o = 0, lse = the sink (the empty sequence's queries see the 4 new keys)
    d0 = setup(spec, lens=(0,), Sq=2, Sn=0)
    o0, l0 = run(spec, d0, sinks=sinks)
    assert torch.equal(o0, torch.zeros_like(o0)) and torch.allclose(l0[0], sinks[:, None].expand(2, 2))


def test_call_overrides_the_mask():
    spec = make_spec("bf16", mask="none")
    d = setup(spec, Sq=4, Sn=2)
    o, lse = run(spec, d, window_size=(8, 0))
    ok, errs = close(o, lse, *oracle(spec, d, (8, 0)))
    assert ok, errs
    o2, _ = run(spec, d)  # mask none: the first query sees the last new key too
    assert not torch.allclose(o, o2)


def test_cache_without_new_tokens_and_empty_sequences():
    spec = make_spec("fp8e4m3(scale=tensor)")
    d = setup(spec, lens=(0, 1, 16, 17), Sq=1, Sn=0)
    o, lse = run(spec, d)
    oe, le = oracle(spec, d, (-1, 0))
    ok, errs = close(o, lse, oe, le)
    assert ok, errs
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(lse[0]).all()


def test_appends_cross_page_boundaries_and_land_in_the_table_order():
    spec = make_spec("nvfp4(tensor_scale=fp32)")
    d = setup(spec, lens=(14, 31, 0), Sq=5, Sn=5)  # 14 -> 19 and 31 -> 36 cross pages of 16
    run(spec, d)
    page = 16
    for b, L in enumerate(d["lengths"].tolist()):
        for t in range(L, L + 5):
            slot = int(d["pt"][b, t // page])
            got = d["kc"].read(torch.tensor([slot]), torch.tensor([t % page]))
            assert torch.equal(got[0], stored(d["kc"], d["kn"][b, t - L:t - L + 1])[0]), (b, t)


def test_one_split_is_the_reference_forward_bit_for_bit():
    spec = make_spec("fp8e4m3(scale=token)", extra="softcap 20")
    d = setup(spec, lens=(300, 90), S=320, Sq=2, Sn=2)
    o, lse = run(spec, d, num_splits=1)
    ends = [L + 2 for L in d["lengths"].tolist()]
    ks, vs = kv.gather(d["kc"], ends, d["pt"]), kv.gather(d["vc"], ends, d["pt"])
    for b in range(2):
        o_r, l_r = ref.forward(d["q"][b:b + 1], ks[b], vs[b], kv._inner_spec(spec))
        assert torch.equal(o[b], o_r[0]) and torch.equal(lse[b], l_r[0])


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_kv_combine_equals_one_split(splits):
    spec = make_spec("nvfp4", mask="window(200, 0)", extra="softcap 40")
    d = setup(spec, lens=(0, 100, 700, 1000), S=1024, Sq=3, Sn=3)
    sinks = torch.tensor([1.0, 0.0])
    o1, l1 = run(spec, d, num_splits=1, sinks=sinks)
    o2, l2 = run(spec, d, num_splits=splits, sinks=sinks)  # appends the same tokens to the same slots again
    assert (o1 - o2).abs().max() <= 1e-6 and (l1 - l2).abs().max() <= 1e-6


def test_split_rule():
    # two CTAs an SM (kv.CTAS_PER_SM): 264 slots on 132 SMs
    assert kv.CTAS_PER_SM == 2
    assert kv.split_count(512, 256, 132) == 1  # the CTAs fill the slots (batch 64 x 8 KV heads)
    assert kv.split_count(264, 256, 132) == 1
    assert kv.split_count(132, 256, 132) == 2  # one CTA an SM is not enough: 264 of 264 slots
    assert kv.split_count(8, 256, 132) == 30  # batch 1, 8 KV heads: 240 of 264 slots (29 gives 0.88)
    assert kv.split_count(8, 2, 132) == 1  # too few tiles to split
    assert kv.split_count(64, 64, 132) == 4  # batch 8 x 8 KV heads: 256 of 264
    assert [len(r) for r in kv.split_tiles(10, 4)] == [3, 3, 3, 1]


def test_planted_wrong_page_index_is_caught(monkeypatch):
    """The check must fail when the addressing is wrong: read every sequence's last page from
    the page after it in the table."""
    spec = make_spec("bf16")
    d = setup(spec, lens=(40, 70), Sq=2, Sn=2)
    real = kv.token_slots

    def off_by_one(lengths, page, page_table, slots, device):
        out = real(lengths, page, page_table, slots, device)
        faulty = []
        for b, (rows, cols) in enumerate(out):
            if len(rows):
                last = (lengths[b] - 1) // page
                bad = page_table[b, (last + 1) % page_table.shape[1]].to(torch.long)
                rows = torch.where(torch.arange(len(rows)) // page == last, bad, rows)
            faulty.append((rows, cols))
        return faulty

    monkeypatch.setattr(kv, "token_slots", off_by_one)
    o, lse = run(spec, d)
    ok, errs = close(o, lse, *oracle(spec, d, (-1, 0)))
    assert not ok and errs[0] > 1e-2, errs
