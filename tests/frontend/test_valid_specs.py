"""Valid specs parse to the KernelSpec values written out here by hand."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType

import pytest

from fp4gen.frontend import parse_file, parse_text
from fp4gen.ir.spec import (
    Backward, DirectPPolicy, Format, Guard, GuardKind, KernelSpec, Mask, OperandFormat, PKind,
    PProduction, PPublish, ScaleGranularity, Schedule, SourceLoc, Target, TmemRegionRequest,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

NVFP4 = OperandFormat(Format.NVFP4, ScaleGranularity.BLOCK, 16, Format.E4M3)
MXFP4 = OperandFormat(Format.MXFP4, ScaleGranularity.BLOCK, 32, Format.E8M0)
BF16 = OperandFormat(Format.BF16)
E4M3_T = OperandFormat(Format.FP8E4M3, ScaleGranularity.TENSOR, None, Format.FP32)
E5M2_T = OperandFormat(Format.FP8E5M2, ScaleGranularity.TENSOR, None, Format.FP32)
E4M3_B128 = OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 128, Format.FP32)


def one(text: str) -> KernelSpec:
    specs = parse_text(text, "t.attn")
    assert len(specs) == 1
    return specs[0]


def test_paper_recipe_example():
    (k,) = parse_file(str(EXAMPLES / "fa4_fp4_d128.attn"))
    assert k.name == "fa4_fp4_d128"
    assert k.target is Target.SM100A
    assert k.head_dim == 128
    assert k.mask is Mask.CAUSAL
    assert k.softmax_scale is None and k.scale == pytest.approx(128 ** -0.5)
    assert (k.q, k.k, k.p, k.v, k.o) == (NVFP4, NVFP4, MXFP4, MXFP4, BF16)
    assert k.p_production == PProduction(PKind.DIRECT_P, DirectPPolicy.FAST, 1.5, 1.2)
    assert k.guard == Guard(GuardKind.SAMPLE, 110, 16)
    assert k.schedule == Schedule(tile_m=128, tile_n=128, q_stages=2, p_publish=PPublish.HALVES,
                                  tmem_regions=None, kv_stages=None)
    assert k.backward is not None
    assert k.backward.reuse == frozenset({"q", "k", "lse", "scales"})
    assert dict(k.backward.formats) == {"dO": E5M2_T, "dP": E4M3_T, "dS": E4M3_T,
                                        "dQ": BF16, "dK": BF16, "dV": BF16}
    assert k.backward.deterministic is False


def test_paper_recipe_locations():
    path = str(EXAMPLES / "fa4_fp4_d128.attn")
    (k,) = parse_file(path)
    assert k.source_file == path
    # positions counted by hand in examples/fa4_fp4_d128.attn
    expect = {
        "name": (9, 11), "target": (10, 12), "head_dim": (11, 12), "mask": (12, 12), "scale": (13, 12),
        "Q": (15, 7), "Q.block": (15, 13), "Q.scale": (15, 23), "K": (16, 7), "P": (17, 7),
        "P.via": (17, 17), "P.via.policy": (17, 26), "V": (18, 7), "O": (19, 7), "guard": (21, 9),
        "schedule": (23, 3), "schedule.tile": (24, 15), "schedule.q_stages": (25, 15),
        "schedule.p_publish": (26, 15), "schedule.tmem": (27, 15), "backward": (30, 3),
        "backward.dO": (32, 10), "backward.deterministic": (38, 19),
    }
    for key, (line, col) in expect.items():
        assert k.loc(key) == SourceLoc(path, line, col), key
    assert "schedule.kv_stages" not in k.locs  # not written: no location
    assert k.source_lines[16].strip().startswith("P : mxfp4 via direct_p")
    assert k.origin("P").endswith("P : mxfp4 via direct_p(policy=fast, a=1.50, b=1.20)")


def test_sm90_directp_example_has_two_kernels():
    a, b = parse_file(str(EXAMPLES / "sm90_fp8_directp_d128.attn"))
    assert (a.name, b.name) == ("sm90_fp8_directp_d128", "sm90_fp8_directp_causal_d128")
    for k in (a, b):
        assert k.target is Target.SM90A and k.head_dim == 128
        assert (k.q, k.k, k.p, k.v, k.o) == (E4M3_B128, E4M3_B128, E4M3_T, E4M3_T, BF16)
        assert k.p_production.kind is PKind.DIRECT_P
        assert k.backward is None
    assert (a.mask, b.mask) == (Mask.NONE, Mask.CAUSAL)


def test_every_example_parses_and_names_are_unique():
    names = []
    for path in sorted(EXAMPLES.glob("*.attn")):
        names += [k.name for k in parse_file(str(path))]
    assert len(names) == len(set(names))
    # names other engineers generate kernels from
    for n in ("fa4_fp4_d128", "sm90_fp8_directp_d128", "sm90_fp8_directp_causal_d128",
              "sm90_fp8_exp_d128", "sm90_bf16_d128"):
        assert n in names


def test_defaults_when_only_required_fields_are_written():
    k = one("attention tiny { target reference; head_dim 64 }")
    assert k == KernelSpec(name="tiny", target=Target.REFERENCE, head_dim=64, source_file="t.attn")
    assert set(k.locs) == {"name", "target", "head_dim"}


def test_bare_formats_take_their_conventional_scaling():
    k = one("""attention f {
      target sm100a; head_dim 128
      Q : nvfp4; K : mxfp4; V : fp8e5m2; P : fp8e4m3; O : fp16
    }""")
    assert (k.q, k.k, k.v, k.p, k.o) == (NVFP4, MXFP4, E5M2_T, E4M3_T, OperandFormat(Format.FP16))


@pytest.mark.parametrize("text, expected", [
    ("fp8e4m3(scale=tensor)", E4M3_T),
    ("fp8e4m3(scale=token)", OperandFormat(Format.FP8E4M3, ScaleGranularity.TOKEN, None, Format.FP32)),
    ("fp8e4m3(scale=none)", OperandFormat(Format.FP8E4M3, ScaleGranularity.NONE, None, None)),
    ("fp8e4m3(block=128)", E4M3_B128),
    ("fp8e4m3(block=32, scale=e8m0)", OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 32, Format.E8M0)),
    ("fp8e5m2(64)", OperandFormat(Format.FP8E5M2, ScaleGranularity.BLOCK, 64, Format.FP32)),
    ("nvfp4(16, e4m3)", NVFP4),
    ("mxfp4(block=32)", MXFP4),
    ("fp32", OperandFormat(Format.FP32)),
])
def test_format_arguments(text, expected):
    k = one(f"attention f {{ target sm90a; head_dim 128; K : {text} }}")
    assert k.k == expected


def test_p_production_variants():
    assert one("attention a { target sm100a; head_dim 128; P : mxfp4 via exp }").p_production == PProduction()
    assert one("attention a { target sm100a; head_dim 128; P : nvfp4 via two_level }").p_production.kind \
        is PKind.TWO_LEVEL
    k = one("attention a { target sm100a; head_dim 128; P : mxfp4 via direct_p(accurate, 1.6, 0.95) }")
    assert k.p_production == PProduction(PKind.DIRECT_P, DirectPPolicy.ACCURATE, 1.6, 0.95)
    k = one("attention a { target sm100a; head_dim 128; P : mxfp4 via direct_p }")
    assert k.p_production == PProduction(PKind.DIRECT_P, DirectPPolicy.FAST, 1.5, 1.2)


def test_schedule_block_with_explicit_tmem_regions():
    k = one("""attention a {
      target sm100a
      head_dim 128
      schedule {
        tile 128x64
        q_stages 1
        kv_stages 3
        p_publish whole
        tmem {
          S0 cols 0..127    # scores
          O0 cols 128..255
        }
      }
    }""")
    assert k.schedule == Schedule(tile_m=128, tile_n=64, q_stages=1, p_publish=PPublish.WHOLE,
                                  tmem_regions=(TmemRegionRequest("S0", 0, 127),
                                                TmemRegionRequest("O0", 128, 255)),
                                  kv_stages=3)
    assert k.loc("schedule.tmem.O0") == SourceLoc("t.attn", 11, 11)
    assert one("attention a { target sm100a; head_dim 128; schedule { kv_stages auto } }").schedule.kv_stages is None
    k = one("attention a { target sm100a; head_dim 128; schedule { tmem { S0 cols 0..127  S1 cols 128..255 } } }")
    assert k.schedule.tmem_regions == (TmemRegionRequest("S0", 0, 127), TmemRegionRequest("S1", 128, 255))


def test_backward_block_variants():
    k = one("attention a { target sm90a; head_dim 64; mask causal; backward { reuse none; deterministic true } }")
    assert k.backward == Backward(reuse=frozenset(), deterministic=True)
    k = one("attention a { target sm90a; head_dim 64; backward { } }")
    assert k.backward == Backward()
    assert k.backward.format_of("dQ") == BF16


def test_scale_guard_and_layout_freedom():
    k = one("attention a{target reference;head_dim 96;scale 0.088;guard sample(112, 14)}")
    assert k.softmax_scale == pytest.approx(0.088)
    assert k.guard == Guard(GuardKind.SAMPLE, 112, 14)
    assert one("attention a { target reference; head_dim 64; guard none }").guard == Guard()


def test_crlf_comments_and_blank_lines():
    text = "# header\r\n\r\nattention a   # trailing\r\n{\r\n  # inside\r\n  target reference\r\n\r\n  head_dim 64 # x\r\n}\r\n"
    k = one(text)
    assert k.head_dim == 64
    assert k.loc("head_dim") == SourceLoc("t.attn", 8, 12)


def test_several_kernels_keep_file_order_and_keyword_like_names():
    specs = parse_text("attention scale { target reference; head_dim 64 }\n"
                       "attention target { target sm90a; head_dim 128 }\n", "t.attn")
    assert [s.name for s in specs] == ["scale", "target"]


def test_specs_are_immutable():
    k = one("attention a { target reference; head_dim 64; backward { dO : fp8e5m2 } }")
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.head_dim = 32  # type: ignore[misc]
    assert isinstance(k.locs, MappingProxyType)
    with pytest.raises(TypeError):
        k.locs["x"] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        k.backward.formats["dQ"] = BF16  # type: ignore[index]
