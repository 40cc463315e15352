"""Issue 22's kv_cache block: storage, the cache format, q_tokens, gqa; each bad value at its
file:line:col, what a cache rules out in the rest of the kernel, the round trip through JSON,
and plans without a cache keeping their bytes (no 'kv_cache' or 'decode' key)."""
from __future__ import annotations

import json

import pytest

from fp4gen.frontend import SpecError, parse_text
from fp4gen.ir.dump import to_json
from fp4gen.ir.dump.text import to_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.serialize import spec_from_dict, spec_from_plan_dict, spec_to_dict
from fp4gen.ir.spec import CacheFormat, Format, KvCache, KvStorage, ScaleGranularity


def kernel(block: str, extra: str = ""):
    return f"attention k {{\n  target reference\n  head_dim 64\n{extra}  kv_cache {{\n{block}\n  }}\n}}\n"


def one(block: str, extra: str = ""):
    (k,) = parse_text(kernel(block, extra), "kv.attn")
    return k


def only_error(block: str, extra: str = ""):
    with pytest.raises(SpecError) as exc:
        parse_text(kernel(block, extra), "kv.attn")
    (d,) = exc.value.diagnostics
    return d


def test_defaults():
    k = one("")
    assert k.kv_cache == KvCache() and k.kv_cache.format == CacheFormat()
    assert (k.kv_cache.storage, k.kv_cache.q_tokens, k.kv_cache.gqa) == (KvStorage.CONTIGUOUS, 1, 1)


@pytest.mark.parametrize("line, want", [
    ("format bf16", CacheFormat()),
    ("format fp8e4m3", CacheFormat(Format.FP8E4M3, ScaleGranularity.TENSOR)),
    ("format fp8e4m3(scale=token)", CacheFormat(Format.FP8E4M3, ScaleGranularity.TOKEN)),
    ("format fp8e4m3(tensor)", CacheFormat(Format.FP8E4M3, ScaleGranularity.TENSOR)),
    ("format nvfp4", CacheFormat(Format.NVFP4, ScaleGranularity.BLOCK)),
    ("format nvfp4(block=16, scale=e4m3)", CacheFormat(Format.NVFP4, ScaleGranularity.BLOCK)),
    ("format nvfp4(block=16, scale=e4m3, tensor_scale=fp32)", CacheFormat(Format.NVFP4, ScaleGranularity.BLOCK, True)),
    ("format nvfp4(tensor_scale=none)", CacheFormat(Format.NVFP4, ScaleGranularity.BLOCK)),
])
def test_formats(line, want):
    k = one(f"    {line}")
    assert k.kv_cache.format == want
    assert (k.loc("kv_cache.format").line, k.loc("kv_cache.format").col) == (5, 12)


def test_everything_set_and_located():
    k = one("    storage paged(page_size=256)\n    format nvfp4\n    q_tokens 4; gqa 8")
    c = k.kv_cache
    assert (c.storage, c.page_size, c.q_tokens, c.gqa) == (KvStorage.PAGED, 256, 4, 8)
    assert [(k.loc(f).line, k.loc(f).col) for f in ("kv_cache", "kv_cache.storage", "kv_cache.page_size",
                                                   "kv_cache.q_tokens", "kv_cache.gqa")] == \
        [(4, 3), (5, 13), (5, 19), (7, 14), (7, 21)]


@pytest.mark.parametrize("block, line, col, message", [
    ("    storage paged(page_size=48)", 5, 29, "power of two from 16 to 8192, got 48 (not a power of two)"),
    ("    storage paged(page_size=8)", 5, 29, "got 8 (a page holds at least one 16-key step"),
    ("    storage paged(page_size=16384)", 5, 29, "got 16384"),
    ("    storage paged(page_size=-16)", 5, 29, "got -16"),
    ("    storage paged", 5, 13, "paged needs page_size"),
    ("    storage contiguous(page_size=16)", 5, 24, "contiguous takes no arguments"),
    ("    storage pagd(page_size=16)", 5, 13, "unknown cache storage 'pagd'"),
    ("    q_tokens 9", 5, 14, "must be from 1 to 8, got 9"),
    ("    q_tokens 0", 5, 14, "must be from 1 to 8, got 0"),
    ("    gqa 0", 5, 9, "gqa (query heads per KV head) must be from 1 to 128, got 0"),
    ("    gqa 129", 5, 9, "got 129"),
    ("    format fp8e4m4", 5, 12, "unknown cache format 'fp8e4m4'"),
    ("    format mxfp4", 5, 12, "a KV cache holds 'bf16', 'fp8e4m3' or 'nvfp4', not mxfp4"),
    ("    format fp8e5m2", 5, 12, "not fp8e5m2"),
    ("    format fp8e4m3(block=128)", 5, 20, "cannot cover a block of tokens"),
    ("    format fp8e4m3(scale=none)", 5, 26, "unknown fp8e4m3 cache scale 'none'"),
    ("    format nvfp4(block=32)", 5, 24, "the block of nvfp4 must be 16, got 32"),
    ("    format nvfp4(scale=e8m0)", 5, 24, "unknown nvfp4 block scale 'e8m0'"),
    ("    format nvfp4(tensor_scale=e4m3)", 5, 31, "unknown nvfp4 tensor_scale 'e4m3'"),
    ("    format bf16(scale=tensor)", 5, 17, "bf16 takes no arguments"),
    ("    K : fp8e4m3", 5, 5, "one 'format' line for K and V"),
    ("    pagesize 16", 5, 5, "unknown statement 'pagesize' in kv_cache block"),
    ("    q_tokens 2\n    q_tokens 3", 6, 5, "q_tokens is set twice"),
])
def test_errors_at_their_column(block, line, col, message):
    d = only_error(block)
    assert (d.loc.line, d.loc.col) == (line, col), d
    assert message in d.message, d.message


@pytest.mark.parametrize("extra, line, message", [
    ("  K : fp8e4m3\n", 4, "with a kv_cache block, K is read from the cache"),
    ("  V : bf16\n", 4, "with a kv_cache block, V is read from the cache"),
    ("  layout varlen\n", 4, "layout varlen with a kv_cache block"),
    ("  backward {\n    reuse q k lse\n  }\n", 4, "has no backward"),
])
def test_what_a_cache_rules_out(extra, line, message):
    d = only_error("    format bf16", extra)
    assert d.loc.line == line and message in d.message, d


def test_misplaced_statements_and_blocks():
    with pytest.raises(SpecError, match="'q_tokens' belongs in a kv_cache"):
        parse_text("attention k {\n target reference\n head_dim 64\n q_tokens 2\n}\n", "kv.attn")
    with pytest.raises(SpecError, match="kv_cache block is set twice"):
        parse_text(kernel("", "  kv_cache {\n  }\n"), "kv.attn")


def test_round_trip_and_plan_json():
    k = one("    storage paged(page_size=64)\n    format fp8e4m3(scale=token)\n    q_tokens 2\n    gqa 8")
    assert spec_from_dict(spec_to_dict(k)) == k
    d = json.loads(json.dumps(to_json(plan_kernel(k))))
    assert spec_from_plan_dict(d) == k
    assert d["decode"]["gqa"] == 8 and d["decode"]["rows_per_cta"] == 16 and d["decode"]["examples"]
    text = to_text(plan_kernel(k))
    assert "Decode (kv_cache): paged(page_size=64), fp8e4m3(scale=token)" in text and "combine:" in text


def test_a_spec_without_a_cache_serializes_without_it():
    (k,) = parse_text("attention k {\n target reference\n head_dim 64\n}\n", "kv.attn")
    assert "kv_cache" not in spec_to_dict(k)
    assert "decode" not in to_json(plan_kernel(k))
