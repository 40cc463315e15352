"""The sm90a decode kernel on the CPU (issue 22): the example plans, renders and compiles for
sm_90a with zero spills; the lowering refuses what the kernel does not read at the spec line
behind it; the host's argument checks say what is wrong. The GPU runs: test_decode_gpu.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.frontend import parse_file, parse_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.lowering import LoweringError, refusal, render
from fp4gen.runtime.checks import AttentionInputError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_emulator
EXAMPLES = ("examples/sm90_decode_bf16_d128.attn", "examples/sm90_decode_fp8_d128.attn",
            "examples/sm90_decode_nvfp4_d128.attn")


def spec_of(body="format bf16\n    q_tokens 8\n    gqa 8", extra="", head_dim=128, mask="causal"):
    return parse_text(f"""attention t {{
  target sm90a
  head_dim {head_dim}
  mask {mask}
{extra}  kv_cache {{
    {body}
  }}
}}""", filename="t.attn")[0]


@pytest.fixture(scope="module")
def example(request):
    import os

    old = os.getcwd()
    os.chdir(ROOT)
    try:
        yield [plan_kernel(s) for ex in EXAMPLES for s in parse_file(ex)]
    finally:
        os.chdir(old)


def test_example_plans_and_renders_its_config(example):
    from fp4gen.lowering.sm90_decode import config

    assert [p.spec.name for p in example] == ["sm90_decode_bf16_d128", "sm90_decode_bf16_paged_d128",
                                               "sm90_decode_bf16_nomask_d64", "sm90_decode_fp8_token_paged_d128",
                                               "sm90_decode_fp8_tensor_d128", "sm90_decode_nvfp4_paged_d128",
                                               "sm90_decode_nvfp4_two_level_d64"]
    for plan in example:
        spec, c = plan.spec, plan.spec.kv_cache
        cfg = config(plan)
        assert cfg.cache_format == str(c.format)
        assert cfg.fp8 == (c.format.format.value == "fp8e4m3")
        assert cfg.token_scale == (cfg.fp8 and c.format.granularity.value == "token")
        assert cfg.nvfp4 == (c.format.format.value == "nvfp4") and cfg.tensor_scale == bool(c.format.tensor_scale)
        assert (cfg.head_dim, cfg.gqa, cfg.q_tokens, cfg.tile_n) == (spec.head_dim, c.gqa, c.q_tokens,
                                                                     spec.schedule.tile_n)
        assert cfg.causal == (spec.mask.value == "causal")
        assert cfg.paged == (c.page_size is not None) and cfg.page_size == c.page_size
        src = render(plan)
        assert "CONFIG = DecodeConfig(" in src and "def forward(" in src and "decode, _check = " in src
        committed = (ROOT / "generated" / f"{spec.name}_sm90a.py").read_text()
        assert committed == src  # `fp4gen regenerate` wrote exactly this


@pytest.mark.parametrize("body,extra,mask,path,line,match", [
    ("format bf16\n    q_tokens 8\n    gqa 16", "", "causal", "kv_cache.gqa", 8, "at most 64"),
    ("format bf16", "  softcap 30\n", "causal", "softcap", 5, "softcap"),
    ("format bf16", "", "window(64, 0)", "mask", 4, "causal or nothing"),
])
def test_what_the_kernel_does_not_read_is_refused_at_its_line(body, extra, mask, path, line, match):
    spec = spec_of(body, extra, mask=mask)
    err = refusal(plan_kernel(spec))
    assert isinstance(err, LoweringError) and err.path == path and match in str(err), err
    assert spec.loc(path).line == line
    with pytest.raises(LoweringError, match=match):
        render(plan_kernel(spec))


def test_sm100a_is_refused_at_the_kv_cache_line():
    from fp4gen.ir.passes import PlanError

    spec = parse_text("attention t {\n  target sm100a\n  head_dim 128\n  kv_cache {\n    format bf16\n  }\n}\n")[0]
    with pytest.raises(PlanError, match="sm100a has no decode kernel") as e:
        plan_kernel(spec)
    assert e.value.loc.line == 4


def test_every_variant_fits_the_smem_of_one_sm():
    """Hopper gives a CTA at most 227 KB of SMEM: every format x head dim x tile with 1 or 2
    stages fits; deeper rings fit or are refused, and the config's bound is the kernel's size."""
    from fp4gen.device.sm90.decode import DecodeKernel
    from fp4gen.device.sm90.decode_config import CACHE_FORMATS, MAX_KV_STAGES, DecodeConfig

    refused = 0
    for fmt in CACHE_FORMATS:
        for d in (64, 128):
            for tile_n in (64, 128):
                for stages in range(1, MAX_KV_STAGES + 1):
                    try:
                        cfg = DecodeConfig("t", d, True, fmt, False, None, 8, 8, tile_n, kv_stages=stages)
                    except ValueError as e:
                        assert stages > 2 and "SMEM" in str(e), (fmt, d, tile_n, stages)
                        refused += 1
                        continue
                    size = DecodeKernel(cfg).shared_storage().size_in_bytes()
                    assert size <= cfg.smem_bytes <= 227 * 1024, (cfg, size)
                    assert cfg.smem_bytes - size < 1024, (cfg, size)  # a bound, not a guess
    assert refused  # D 128 x 128 keys with a deep ring does not fit


def test_kv_stages_comes_from_the_spec_and_renders_only_when_set():
    from fp4gen.lowering.sm90_decode import config

    two = spec_of("format bf16", extra="  schedule {\n    kv_stages 2\n  }\n")
    assert config(plan_kernel(two)).kv_stages == 2 and "kv_stages=2,  # t.attn:6: kv_stages 2" in render(plan_kernel(two))
    assert config(plan_kernel(spec_of("format bf16"))).kv_stages == 1
    assert "kv_stages" not in render(plan_kernel(spec_of("format bf16"))).split("CONFIG = ")[1]
    four = spec_of("format bf16", extra="  schedule {\n    tile 128 x 64\n    kv_stages 4\n  }\n")
    assert config(plan_kernel(four)).kv_stages == 4
    five = spec_of("format bf16", extra="  schedule {\n    kv_stages 5\n  }\n")
    err = refusal(plan_kernel(five))
    assert err is not None and err.path == "schedule.kv_stages" and five.loc(err.path).line == 6
    # a ring that fits the stage count but not SMEM (D 128, 128 keys a tile: 3 bf16 stages > 227 KB)
    deep = spec_of("format bf16", extra="  schedule {\n    kv_stages 3\n  }\n")
    err = refusal(plan_kernel(deep))
    assert err is not None and err.path == "schedule.kv_stages" and "SMEM" in str(err), err


def test_config_refuses_values_the_kernel_cannot_run():
    from fp4gen.device.sm90.decode_config import DecodeConfig

    ok = dict(kernel_name="t", head_dim=128, causal=True, cache_format="bf16", paged=False, page_size=None,
              q_tokens=8, gqa=8, tile_n=128)
    DecodeConfig(**ok)
    for bad, match in ((dict(head_dim=96), "head_dim"), (dict(cache_format="fp8e4m3"), "cache format"),
                       (dict(cache_format="nvfp4"), "cache format"),
                       (dict(gqa=16), "64-row"), (dict(paged=True), "page_size"),
                       (dict(paged=True, page_size=48), "power of two"), (dict(tile_n=256), "tile_n"),
                       (dict(kv_stages=5), "kv_stages"), (dict(kv_stages=3), "SMEM")):
        with pytest.raises(ValueError, match=match):
            DecodeConfig(**{**ok, **bad})


# ------------------------------------------------------------------ host checks (CPU tensors)

def _host(paged=False, fmt="bf16"):
    from fp4gen.device.sm90.decode_config import DecodeConfig
    from fp4gen.runtime.sm90_decode_host import DecodeHost

    cfg = DecodeConfig("t", 64, True, fmt, paged, 16 if paged else None, 4, 2, 128)
    return DecodeHost(cfg, build=None)


def _args(paged=False):
    bf = torch.bfloat16
    q = torch.zeros(2, 3, 4, 64, dtype=bf)
    kc = torch.zeros(4 if paged else 2, 16 if paged else 40, 2, 64, dtype=bf)
    pt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32) if paged else None
    return dict(q=q, k_cache=kc, v_cache=kc.clone(), seqlens_k=torch.tensor([5, 30], dtype=torch.int32),
                page_table=pt, num_splits=2, softmax_scale=None)


@pytest.mark.parametrize("paged,change,match", [
    (False, dict(q=torch.zeros(2, 3, 4, 64)), "q must be a bf16"),
    (False, dict(q=torch.zeros(2, 5, 4, 64, dtype=torch.bfloat16)), "1 to q_tokens 4"),
    (False, dict(q=torch.zeros(2, 3, 6, 64, dtype=torch.bfloat16)), "gqa 2"),
    (False, dict(k_cache=torch.zeros(2, 2, 40, 64, dtype=torch.bfloat16).transpose(1, 2)), "contiguous"),
    (False, dict(v_cache=torch.zeros(2, 40, 2, 64, dtype=torch.uint8)), "bf16 cache"),
    (False, dict(page_table=torch.zeros(2, 3, dtype=torch.int32)), "takes no page_table"),
    (False, dict(seqlens_k=torch.tensor([5, 30, 1], dtype=torch.int32)), "seqlens_k"),
    (False, dict(num_splits=0), "num_splits"),
    (True, dict(page_table=None), "needs page_table"),
    (True, dict(k_cache=torch.zeros(2, 32, 2, 64, dtype=torch.bfloat16),
                v_cache=torch.zeros(2, 32, 2, 64, dtype=torch.bfloat16)), "page_size is 16"),
    (False, {}, "runs on a CUDA device"),  # every check passes; the CPU tensors are the last refusal
])
def test_host_checks_say_what_is_wrong(paged, change, match):
    args = {**_args(paged), **change}
    with pytest.raises(AttentionInputError, match=match):
        _host(paged).check(**args)


def _args8(token):
    kc = torch.zeros(2, 40, 2, 64, dtype=torch.uint8)
    sc = (torch.ones(2, 40, 2) if token else torch.ones(2))
    return {**_args(), "k_cache": kc, "v_cache": kc.clone(), "k_scale": sc, "v_scale": sc.clone()}


@pytest.mark.parametrize("token,change,match", [
    (True, dict(k_cache=torch.zeros(2, 40, 2, 64, dtype=torch.bfloat16)), "uint8"),
    (True, dict(k_scale=None), "k_scale must be a float32 tensor \\(2, 40, 2\\)"),
    (True, dict(v_scale=torch.ones(2)), "v_scale must be"),
    (False, dict(k_scale=torch.ones(2, 40, 2)), "k_scale must be a float32 tensor \\(2,\\)"),
    (False, dict(v_scale=torch.ones(2, dtype=torch.float64)), "v_scale must be"),
    (True, {}, "runs on a CUDA device"),
    (False, {}, "runs on a CUDA device"),
])
def test_fp8_host_checks_the_scales(token, change, match):
    fmt = "fp8e4m3(scale=token)" if token else "fp8e4m3(scale=tensor)"
    with pytest.raises(AttentionInputError, match=match):
        _host(fmt=fmt).check(**{**_args8(token), **change})


def test_the_e2m1_table_is_the_numerics_one():
    from fp4gen.device.sm90.decode import E2M1_VALUES
    from fp4gen.numerics.formats import E2M1, decode

    want = decode(torch.arange(16, dtype=torch.uint8), E2M1)
    got = torch.tensor(E2M1_VALUES)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def _args4(two_level):
    kc = torch.zeros(2, 40, 2, 32, dtype=torch.uint8)
    sc = torch.zeros(2, 40, 2, 4, dtype=torch.uint8)
    g = {"k_tensor_scale": torch.ones(2), "v_tensor_scale": torch.ones(2)} if two_level else {}
    return {**_args(), "k_cache": kc, "v_cache": kc.clone(), "k_scale": sc, "v_scale": sc.clone(), **g}


@pytest.mark.parametrize("two_level,change,match", [
    (False, dict(k_cache=torch.zeros(2, 40, 2, 64, dtype=torch.uint8)), "two E2M1 codes a byte"),
    (False, dict(k_scale=torch.zeros(2, 40, 2, 4)), "k_scale must be a uint8 tensor \\(2, 40, 2, 4\\)"),
    (False, dict(v_scale=torch.zeros(2, 40, 2, 8, dtype=torch.uint8)), "v_scale must be"),
    (False, dict(k_tensor_scale=torch.ones(2)), "no per-KV-head tensor scale"),
    (True, dict(v_tensor_scale=None), "v_tensor_scale must be a float32 tensor \\(2,\\)"),
    (True, {}, "runs on a CUDA device"),
    (False, {}, "runs on a CUDA device"),
])
def test_nvfp4_host_checks_the_block_scales(two_level, change, match):
    fmt = "nvfp4(block=16, scale=e4m3" + (", tensor_scale=fp32)" if two_level else ")")
    with pytest.raises(AttentionInputError, match=match):
        _host(fmt=fmt).check(**{**_args4(two_level), **change})


def test_a_bf16_cache_takes_no_scales():
    with pytest.raises(AttentionInputError, match="no scales"):
        _host().check(**_args(), k_scale=torch.ones(2))


def test_the_module_forward_points_to_the_decode_entry():
    mod = fp4gen.load("sm90_decode_bf16_d128_sm90a")
    with pytest.raises(AttentionInputError, match="attention_with_kvcache"):
        mod.forward(None, None, None)


def test_cpu_auto_runs_the_reference_for_an_sm90a_spec():
    spec = spec_of("storage paged(page_size=16)\n    format bf16\n    q_tokens 2\n    gqa 2", head_dim=64)
    k = torch.randn(2, 40, 2, 64)
    kc, vc, pt = fp4gen.kv_cache_from(k, k.clone(), spec, capacity=64)
    o = fp4gen.attention_with_kvcache(torch.randn(2, 1, 4, 64), kc, vc, cache_seqlens=40, page_table=pt, spec=spec)
    assert o.shape == (2, 1, 4, 64) and torch.isfinite(o).all()


# ------------------------------------------------------------------ compile for sm_90a

@pytest.mark.slow
def test_example_compiles_for_sm90a_with_zero_spills(example):
    """Every decode module compiles for sm_90a on the CPU; ptxas reports no spill, no stack use
    beyond the local fragment arrays, no setmaxnreg (the kernel has no warp roles)."""
    from fp4gen.lowering import ptxas

    for plan in example:
        kept = ptxas.compile_kept(render(plan), "sm_90a")
        assert [k.name for k in kept] == [plan.spec.name]
        reports = ptxas.assemble(kept[0].ptx)
        assert ptxas.check_helper(kept[0].ptx, reports) == [], plan.spec.name
        assert all(r.spills == 0 for r in reports)
        assert "mma.sync.aligned.m16n8k16" in kept[0].ptx and "cp.async" in kept[0].ptx


def test_the_spill_gate_can_fail():
    """A planted report with spills fails the same gate."""
    from fp4gen.lowering import ptxas

    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : Function properties for k\n"
           "    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 255 registers\n")
    reports = ptxas.parse_report(log)
    assert reports and ptxas.check_helper("", reports) != []


def test_the_api_renders_and_loads_a_module_for_any_decode_spec(tmp_path, monkeypatch):
    """attention_with_kvcache's kernel path: a spec (here one no example holds) is planned,
    rendered, stored in the module cache and imported; its decode refuses CPU tensors."""
    from fp4gen.api import _kv_module

    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path))
    spec = spec_of("storage paged(page_size=32)\n    format nvfp4(tensor_scale=fp32)\n    q_tokens 2\n    gqa 3",
                   head_dim=64, mask="none")
    mod = _kv_module(spec)
    assert mod.KERNEL_NAME == "t" and mod.CONFIG.gqa == 3 and mod.CONFIG.page_size == 32 and mod.CONFIG.tensor_scale
    assert list(tmp_path.glob("modules/*/t_sm90a_*.py"))
    assert _kv_module(spec) is mod
    kc = torch.zeros(4, 32, 1, 32, dtype=torch.uint8)
    sc = torch.zeros(4, 32, 1, 4, dtype=torch.uint8)
    with pytest.raises(AttentionInputError, match="runs on a CUDA device"):
        mod.decode(torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16), kc, kc, torch.tensor([5], dtype=torch.int32),
                   k_scale=sc, v_scale=sc, k_tensor_scale=torch.ones(1), v_tensor_scale=torch.ones(1),
                   page_table=torch.zeros(1, 4, dtype=torch.int32))


def test_what_no_kernel_runs_raises_no_kernel_with_the_line():
    from fp4gen.api import _kv_module

    spec = spec_of("format bf16\n    q_tokens 8\n    gqa 16")
    with pytest.raises(fp4gen.NoKernelError, match=r"at most 64.*spec line t.attn:8.*backend='reference'"):
        _kv_module(spec)


# ------------------------------------------------------------------ the PTX on the CPU emulator

_EMU_CASES = [  # (cache format, paged, D, tile_n, kv_stages, gqa, q_tokens, lengths, Sq, splits)
    ("bf16", True, 64, 64, 1, 8, 8, (70, 150, 1), 3, 2),
    ("bf16", False, 128, 128, 2, 4, 8, (300, 17), 8, 2),
    ("fp8e4m3(scale=token)", True, 128, 128, 2, 8, 8, (400, 60), 5, 2),
    ("fp8e4m3(scale=tensor)", True, 64, 64, 1, 1, 8, (100, 33), 8, 3),
    ("nvfp4(block=16, scale=e4m3)", False, 64, 64, 1, 8, 4, (130,), 1, 1),
    ("nvfp4(block=16, scale=e4m3, tensor_scale=fp32)", True, 128, 64, 2, 2, 8, (200, 70), 2, 3),
    # deeper rings: the prologue, the stage index and the short splits (fewer tiles than stages)
    ("bf16", True, 64, 64, 4, 8, 1, (520, 90, 1), 1, 2),
    ("fp8e4m3(scale=token)", False, 128, 64, 3, 8, 1, (300, 130), 1, 3),
    ("nvfp4(block=16, scale=e4m3)", True, 64, 64, 3, 4, 2, (333,), 2, 1),
]


def _emu_case(fmt, paged, d, tile_n, stages, gqa, q_tokens, lengths, sq, splits, seed=0):
    from fp4gen.device.sm90.decode_config import DecodeConfig
    from fp4gen.numerics import kvcache as kv

    from decode_emulator import compile_ptx  # tests/kvcache, on sys.path (rootdir-less test dirs)

    cfg = DecodeConfig("t", d, True, fmt, paged, 16 if paged else None, q_tokens, gqa, tile_n, kv_stages=stages)
    storage = "storage paged(page_size=16)\n    " if paged else ""
    ref = parse_text(f"""attention r {{
  target reference
  head_dim {d}
  mask causal
  schedule {{
    tile 128 x {tile_n}
  }}
  kv_cache {{
    {storage}format {fmt.replace('block=16, scale=e4m3, ', '').replace('(block=16, scale=e4m3)', '')}
    q_tokens {q_tokens}
    gqa {gqa}
  }}
}}""")[0]
    assert str(ref.kv_cache.format) == fmt
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    k, v = (torch.randn(B, S, 1, d, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(B, sq, gqa, d, generator=g).to(torch.bfloat16)
    pt = torch.randperm(B * -(-S // 16), generator=g).to(torch.int32).reshape(B, -1) if paged else None
    kc, vc, pt = fp4gen.kv_cache_from(k, v, ref, cache_seqlens=torch.tensor(lengths, dtype=torch.int32), page_table=pt)
    o_ref, lse_ref = kv.decode(q, kc, vc, list(lengths), ref, page_table=pt, num_splits=splits)
    ptx, mlir = compile_ptx(cfg)
    return (cfg, ptx, mlir, q, kc, vc, pt), o_ref, lse_ref


def _emu_close(o, lse, o_ref, lse_ref):
    fin = torch.isfinite(lse_ref)
    return (torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)) and bool(torch.isfinite(o).all())
            and (lse - lse_ref)[fin].abs().max().item() < 1e-4
            and (o - o_ref).abs().max().item() <= 4e-3 * o_ref.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("case", _EMU_CASES, ids=lambda c: f"{c[0]}-{'paged' if c[1] else 'contig'}-d{c[2]}-n{c[3]}-s{c[4]}")
def test_the_kernel_ptx_matches_the_reference_on_the_cpu_emulator(case):
    """Every CTA of the compiled kernel, run by the CPU emulator (decode_emulator.py), against
    numerics.kvcache.decode on the same cache: O within a bf16 rounding of P (the two exp2s
    differ in the last bits), LSE within 1e-4, the rows without keys the same."""
    (cfg, ptx, mlir, q, kc, vc, pt), o_ref, lse_ref = _emu_case(*case)
    from decode_emulator import run_decode

    o, lse = run_decode(cfg, ptx, mlir, q, kc, vc, case[7], pt, case[9])
    assert _emu_close(o, lse, o_ref, lse_ref), ((o - o_ref).abs().max(), (lse - lse_ref).abs().max())


@pytest.mark.slow
def test_the_emulator_check_fails_for_a_planted_page_table():
    """The same kernel given the page table with its sequences swapped: the check must fail."""
    (cfg, ptx, mlir, q, kc, vc, pt), o_ref, lse_ref = _emu_case(*_EMU_CASES[0][:7], (150, 150), 3, 2)
    from decode_emulator import run_decode

    assert _emu_close(*run_decode(cfg, ptx, mlir, q, kc, vc, (150, 150), pt, 2), o_ref, lse_ref)
    assert not _emu_close(*run_decode(cfg, ptx, mlir, q, kc, vc, (150, 150), pt.flip(0).contiguous(), 2),
                          o_ref, lse_ref)
