"""The sm90a forward at head dims 96, 192 and 256, no GPU: the planner's key tile per head dim
(from the SMEM and register budgets), what it refuses (at the spec line, with the numbers,
the same in ``fp4gen check`` and ``fp4gen compile``), the config the lowering derives, and
compiles for sm_90a with the register/spill gate (slow).

The kernels themselves: test_head_dims_gpu.py (H200)."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import load_module  # noqa: E402  (first: it maps ir/ to fp4gen.ir on a plain checkout)

from fp4gen.frontend import parse_file, parse_text  # noqa: E402
from fp4gen.ir.passes import PlanError, plan_kernel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NEW_EXAMPLES = ("sm90_bf16_d256.attn", "sm90_bf16_d192.attn", "sm90_fp8_directp_d96.attn",
                "sm90_fp8_wide_heads.attn")
H100_SMEM = 227 * 1024  # bytes of SMEM one CTA may use on sm_90 (CUDA guide, compute capability 9.0)

FORMATS = {
    "bf16": "",
    "fp8_exp": "  Q : fp8e4m3(block=128)\n  K : fp8e4m3(block=128)\n  P : fp8e4m3 via exp\n"
               "  V : fp8e4m3(scale=tensor)\n  O : bf16\n",
    "fp8_directp": "  Q : fp8e4m3(block=128)\n  K : fp8e4m3(block=128)\n  P : fp8e4m3 via direct_p\n"
                   "  V : fp8e4m3(scale=tensor)\n  O : bf16\n",
}


def spec_text(d: int, variant: str = "bf16", mask: str = "none", extra: str = "") -> str:
    return (f"attention k {{\n  target sm90a\n  head_dim {d}\n  mask {mask}\n"
            f"{FORMATS[variant]}{extra}}}\n")


def plan_of(d: int, variant: str = "bf16", mask: str = "none", extra: str = ""):
    return plan_kernel(parse_text(spec_text(d, variant, mask, extra), "t.attn")[0], debug=True)


def largest_bf16_tile(d: int) -> int:
    """Independent of the planner: the most keys per tile (a multiple of 16, at most 128) for
    which a 128 x d bf16 Q plus two stages of n x d bf16 K and V fit one CTA's SMEM (mbarriers
    are 10 x 8 bytes), and the per-thread accumulators O (d/2) + S (n/2) + P (n/4) leave room
    in 240 registers."""
    best = None
    for n in range(64, 129, 16):
        smem = 128 * d * 2 + 2 * 2 * n * d * 2 + 80
        if smem <= H100_SMEM and d // 2 + n // 2 + n // 4 < 240:
            best = n
    return best


@pytest.mark.parametrize("d", [96, 192, 256])
def test_bf16_key_tile_is_the_largest_that_fits(d):
    p = plan_of(d)
    n = largest_bf16_tile(d)
    assert (p.sm90.tile_m, p.sm90.tile_n) == (128, n) == (128, p.spec.schedule.tile_n)
    assert {96: 128, 192: 112, 256: 80}[d] == n  # Q 24/48/64 KiB + 2 x (K + V)
    assert p.pipeline.smem_bytes <= H100_SMEM
    # every pass plans the chosen tile: P's publication, the K/V SMEM items, the dump's header
    from fp4gen.ir.dump import to_text

    text = to_text(p)
    assert f"part 1: keys 0..{n - 1} ->" in text and f"tile 128 x {n}, q_stages" in text
    assert {i.name: i.bytes for i in p.pipeline.smem}["K"] == 2 * n * d * 2


@pytest.mark.parametrize("variant", ["fp8_exp", "fp8_directp"])
@pytest.mark.parametrize("d", [96, 192, 256])
def test_fp8_key_tile_is_the_scale_block(variant, d):
    p = plan_of(d, variant, "causal")
    assert (p.sm90.tile_m, p.sm90.tile_n) == (128, 128)
    assert p.sm90.v_transposed and p.sm90.kv_stages == 2
    note = next(n for n in p.pipeline.notes if n.startswith("tile 128 x 128 chosen"))
    assert "one K scale block per key tile" in note and f"O {d // 2}" in note


def test_the_plan_records_the_choice_with_the_numbers():
    p = plan_of(256)
    note = next(n for n in p.pipeline.notes if n.startswith("tile 128 x 80 chosen for head_dim 256"))
    # the larger tiles it passed over, each with the SMEM it would need (Q + 2 x (K + V))
    for n in (128, 112, 96):
        assert f"128 x {n} needs {128 * 256 * 2 + 4 * n * 256 * 2 + 80} B SMEM" in note
    assert f"of {H100_SMEM} SMEM bytes" in note and "of 240 registers per consumer thread" in note


def test_default_tile_plans_of_d64_d128_carry_no_note():
    """Specs that write the language's 128 x 128 plan as before (their modules' PTX is kept)."""
    for d in (64, 128):
        p = plan_of(d, extra="  schedule { tile 128 x 128 }\n")
        assert not any(n.startswith("tile ") for n in p.pipeline.notes)


@pytest.mark.parametrize("name", NEW_EXAMPLES)
def test_examples_write_the_planners_own_tile(name):
    """The BF16 examples write their tile (so that the plan's spec is the file's); without the
    line the planner picks the same one."""
    for spec in parse_file(EXAMPLES / name):
        p = plan_kernel(spec)
        free = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, tile_n=128),
                                   locs={k: v for k, v in spec.locs.items() if not k.startswith("schedule")})
        assert plan_kernel(free).sm90.tile_n == p.sm90.tile_n == spec.schedule.tile_n, spec.name
        assert spec.head_dim in (96, 192, 256)


# ---------------------------------------------------------------- refusals at the spec line

REFUSED = [
    # (head_dim, variant, extra, spec line, words in the message)
    (320, "bf16", "", 3, ["head_dim must be a multiple of 16 from 16 to 256", "320"]),
    (100, "bf16", "", 3, ["multiple of 16", "100"]),
    (80, "fp8_exp", "", 3, ["sm90a supports head_dim 64, 96, 128, 192, 256, not 80"]),
    (256, "bf16", "  schedule { tile 128 x 128 }\n", 5,
     ["tile 128 x 128 at head_dim 256", "327760 B of SMEM", "232448", "~248 registers", "budget is 240"]),
    (192, "bf16", "  schedule { tile 128 x 128 }\n", 5, ["245840 B of SMEM"]),
    (256, "bf16", "  schedule {\n    tile 128 x 128\n    kv_stages 1\n  }\n", 7,
     ["~248 registers", "O 128", "S 64", "P 32"]),
    (192, "fp8_directp", "  backward {\n    reuse q k lse\n  }\n", 3,
     ["head_dim 192", "backward takes head_dim 64 and 128 only"]),
    (256, "bf16", "  backward {\n    reuse q k lse\n  }\n", 3, ["backward takes head_dim 64 and 128"]),
]


@pytest.mark.parametrize("d,variant,extra,line,words", REFUSED)
def test_check_and_compile_refuse_at_the_line(d, variant, extra, line, words, tmp_path, capsys):
    from fp4gen.cli.main import main

    f = tmp_path / "k.attn"
    f.write_text(spec_text(d, variant, "none", extra))
    outs = []
    for argv in (["check", str(f)], ["compile", str(f), "-o", str(tmp_path / "out"), "--quiet"]):
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 1, (argv, err)
        first = next(ln for ln in err.splitlines() if ": error: " in ln)
        assert first.startswith(f"{f}:{line}:"), first  # file:line:col
        int(first.split(":")[2])  # the column
        for w in words:
            assert w in err, (w, err)
        outs.append(first)
    assert outs[0] == outs[1]  # check says what compile says
    assert not (tmp_path / "out" / "k_sm90a.py").exists()


def test_the_planner_raises_plan_errors():
    with pytest.raises(PlanError, match="327760 B of SMEM") as ei:
        plan_of(256, extra="  schedule { tile 128 x 128 }\n")
    assert ei.value.loc.line == 5


# ---------------------------------------------------------------- lowering and config


@pytest.mark.parametrize("d,variant", [(96, "fp8_directp"), (192, "bf16"), (256, "bf16"), (256, "fp8_directp"),
                                       (192, "fp8_exp")])
def test_config_follows_the_plan(d, variant):
    from fp4gen.lowering.sm90 import config, render

    p = plan_of(d, variant, "causal")
    cfg = config(p)
    assert (cfg.head_dim, cfg.tile_m, cfg.tile_n, cfg.kv_stages) == (d, 128, p.sm90.tile_n, 2)
    assert cfg.causal and cfg.in_fp8 == (variant != "bf16")
    assert cfg.l_from_mma == (variant == "fp8_directp")
    src = render(p)
    assert f"    head_dim={d},  #" in src and f"    tile_n={p.sm90.tile_n},  #" in src


def test_fp8_modules_of_other_head_dims_skip_the_fused_quantizer(tmp_path):
    """The fused FP8 input quantizer takes head dims 16..256 in powers of two: a d=96 module
    quantizes on the torch path, so compile_only lists no quantizer kernel (the host's
    quantize_inputs takes that path for such head dims)."""
    from fp4gen.device import quantize

    assert 96 not in quantize.SUPPORTED_HEAD_DIMS and 192 not in quantize.SUPPORTED_HEAD_DIMS
    assert 256 in quantize.SUPPORTED_HEAD_DIMS


# ---------------------------------------------------------------- compile for sm_90a (slow)

COMPILED = [(256, "bf16", "causal"), (192, "bf16", "none"), (96, "fp8_directp", "causal"),
            (96, "bf16", "none"), (192, "fp8_exp", "none"), (256, "fp8_exp", "causal")]


def _expected_names(mod):
    kinds = ("block", "amax", "vt", "vt_nat", "block_qt", "block_kt")
    from fp4gen.device import quantize

    quant = [f"fp8_quantize_{k}_d{mod.HEAD_DIM}" for k in kinds] \
        if mod.IN_FP8 and mod.HEAD_DIM in quantize.SUPPORTED_HEAD_DIMS else []
    return [mod.KERNEL_NAME] + quant


@pytest.mark.slow
@pytest.mark.parametrize("d,variant,mask", COMPILED)
def test_compile_sm90a(d, variant, mask, tmp_path):
    p = plan_of(d, variant, mask)
    p = dataclasses.replace(p, spec=dataclasses.replace(p.spec, name=f"hd_{variant}_{mask}_d{d}"))
    mod = load_module(p, str(tmp_path))
    assert mod.compile_only("sm_90a") == _expected_names(mod)


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW_EXAMPLES)
def test_register_gate_is_clean(name):
    """``fp4gen verify``'s sm90a rows for the new example modules: zero spills, setmaxnreg
    honoured, no CuTe warnings."""
    from fp4gen.lowering import verify as V

    for spec in parse_file(EXAMPLES / name):
        rows = V.verify_sm90(plan_kernel(spec))
        bad = [r for r in rows if not r.ok]
        assert not bad, V.table(rows)
        assert any(r.check == "registers" and "spills 0 B st + 0 B ld" in r.detail for r in rows), V.table(rows)
