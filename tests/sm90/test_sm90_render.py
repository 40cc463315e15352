"""sm90a backend on the CPU: rendering, plan refusal, compile for sm_90a without a GPU,
and the arithmetic of the shared device helpers (emulated in torch).

The compile tests take 3-25 s per variant (CuTe DSL tracing + MLIR + ptxas); one per P
mode runs by default, the full matrix (3 modes x D 64/128 x causal) is marked ``slow``.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import VARIANTS, load_module, make_plan  # noqa: E402

from fp4gen.ir.spec import Format, OperandFormat, PKind, PProduction  # noqa: E402
from fp4gen.lowering import LoweringError  # noqa: E402
from fp4gen.lowering.sm90 import config as sm90_config  # noqa: E402
from fp4gen.lowering.sm90 import render  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

MATRIX = [(v, d, c) for v in VARIANTS for d in (64, 128) for c in (False, True)]
FAST = [("bf16", 64, False), ("fp8_exp", 64, False), ("fp8_directp", 64, False)]


# ----------------------------------------------------------------- rendering


@pytest.mark.parametrize("variant,d,causal", MATRIX)
def test_render_contract(variant, d, causal):
    plan = make_plan(variant, d, causal)
    src = render(plan)
    tree = ast.parse(src)  # valid Python
    for name in ("KERNEL_NAME", "TARGET", "SPEC_FILE", "PLAN_JSON", "def forward(", "def compile_only("):
        assert name in src
    assert 'TARGET = "sm90a"' in src
    assert f"    head_dim={d},  #" in src and f"    causal={causal},  #" in src
    # generated code imports no compiler stage
    for banned in ("fp4gen.ir", "fp4gen.frontend", "jinja2", "lark", "fp4gen.lowering"):
        assert banned not in src
    # the spec lines behind each choice are quoted
    assert "Spec lines behind the choices" in src and "P: " in src
    # no kernel and no host code: the library class and fp4gen.runtime.sm90_host hold them
    assert not any(isinstance(n, ast.ClassDef) for n in ast.walk(tree))
    assert {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} == {"_build", "forward", "compile_only"}
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert imported <= {"fp4gen.device.sm90.config", "fp4gen.device.sm90.forward", "fp4gen.runtime.sm90_host",
                        "fp4gen.device"}, imported


def rendered_config(src: str) -> dict:
    """The keyword values of the module's ``CONFIG = ForwardConfig(...)`` literal, read with ast
    (``kernel_name=KERNEL_NAME`` resolved), fields it leaves out at their defaults: what the
    module's kernel and host run with."""
    from fp4gen.device.sm90.config import ForwardConfig

    tree = ast.parse(src)
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
    (call,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
               and [getattr(t, "id", None) for t in n.targets] == ["CONFIG"]]
    assert isinstance(call, ast.Call) and call.func.id == "ForwardConfig" and not call.args
    given = {kw.arg: consts[kw.value.id] if isinstance(kw.value, ast.Name) else ast.literal_eval(kw.value)
             for kw in call.keywords}
    defaults = {f.name: f.default for f in dataclasses.fields(ForwardConfig) if f.default is not dataclasses.MISSING}
    return {**defaults, **given}


@pytest.mark.parametrize("variant,d,causal", MATRIX)
def test_rendered_config_is_the_lowerings(variant, d, causal):
    plan = make_plan(variant, d, causal)
    assert rendered_config(render(plan)) == dataclasses.asdict(sm90_config(plan))


# the forward modules (the decode modules render a DecodeConfig: tests/kvcache check them)
GENERATED = sorted(p for p in (ROOT / "generated").glob("*_sm90a.py")
                   if "CONFIG = ForwardConfig(" in p.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.stem)
def test_generated_config_agrees_with_its_plan(path):
    """A generated module cannot disagree with its plan: the CONFIG it renders is the one the
    lowering derives from the plan of the spec in its PLAN_JSON, and that plan is the one
    PLAN_JSON records."""
    from fp4gen.ir.dump import to_json
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.ir.serialize import spec_from_plan_json

    src = path.read_text(encoding="utf-8")
    plan_json = next(ast.literal_eval(n.value) for n in ast.parse(src).body if isinstance(n, ast.Assign)
                     and [getattr(t, "id", None) for t in n.targets] == ["PLAN_JSON"])
    plan = plan_kernel(spec_from_plan_json(plan_json))
    assert json.loads(plan_json)["sm90"] == to_json(plan)["sm90"]
    assert rendered_config(src) == dataclasses.asdict(sm90_config(plan))


def test_variants_differ_only_in_their_config():
    def cfg(variant, **kw):
        return sm90_config(make_plan(variant, **kw))

    bf16, exp, dp = cfg("bf16"), cfg("fp8_exp"), cfg("fp8_directp")
    assert (bf16.in_fp8, bf16.p_mode, bf16.quant_block) == (False, "bf16", None)
    assert (exp.in_fp8, exp.p_mode, exp.quant_block) == (True, "fp8_exp", 128)
    assert dp.p_mode == "fp8_directp" and dp.softmax_mode == "fp8_directp"
    assert "quantize_inputs" not in render(make_plan("bf16")) and "quantize_inputs" in render(make_plan("fp8_exp"))
    assert "p_mode='fp8_directp',  #" in render(make_plan("fp8_directp"))  # rendered with | pyrepr
    assert cfg("bf16", pingpong=False).pingpong is False and bf16.pingpong is True
    assert cfg("bf16", overlap=False).intra_wg_overlap is False
    lmma = cfg("fp8_directp", l_from_mma=True)
    assert lmma.l_from_mma and lmma.softmax_mode == "fp8_directp_l_mma" and not dp.l_from_mma
    # l_from_mma only changes Direct-P (the exp path's l sums the unrounded p)
    assert not cfg("fp8_exp", l_from_mma=True).l_from_mma


@pytest.mark.parametrize("change,msg", [
    (dict(p_mode="bf16"), "p_mode 'bf16' with in_fp8=True"),
    (dict(p_mode="fp8_exp", l_from_mma=True), "l_from_mma needs"),
    (dict(quant_block=64), "must be key tiles"),
    (dict(p_mode="fp4"), "p_mode must be one of"),
])
def test_forward_config_refuses_inconsistent_values(change, msg):
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(sm90_config(make_plan("fp8_directp", l_from_mma=True)), **change)


def _with(plan, **spec_changes):
    return dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, **spec_changes))


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda p: _with(p, head_dim=80), "head_dim 64, 96, 128, 192, 256"),
        (lambda p: _with(p, q=OperandFormat(Format.NVFP4)), "bf16 or all fp8e4m3"),
        (lambda p: _with(p, o=OperandFormat(Format.FP8E4M3)), "writes O as bf16"),
        (lambda p: _with(p, p_production=PProduction(kind=PKind.TWO_LEVEL)), "two_level"),
        (lambda p: dataclasses.replace(p, sm90=dataclasses.replace(p.sm90, tile_m=64, consumer_warpgroups=1)),
         "128-row query tiles"),
        (lambda p: dataclasses.replace(p, sm90=dataclasses.replace(p.sm90, tile_n=64)), "FP8 runs 128-key tiles"),
        (lambda p: dataclasses.replace(p, sm90=dataclasses.replace(p.sm90, tile_n=72)), "steps of 16"),
        (lambda p: dataclasses.replace(p, sm90=dataclasses.replace(p.sm90, tile_n=144)), "64..128 keys"),
        (lambda p: dataclasses.replace(p, sm90=dataclasses.replace(p.sm90, kv_stages=1)), "2 K/V stages"),
        (lambda p: dataclasses.replace(p, sm90=dataclasses.replace(p.sm90, v_transposed=False)), "transposed"),
        (lambda p: _with(p, v=make_plan("fp8_exp").spec.q), "one scale per tensor"),
        (lambda p: _with(p, q=make_plan("fp8_exp").spec.v), "128-token block"),
        (lambda p: dataclasses.replace(p, sm90=None), "no sm90 section"),
    ],
)
def test_render_refuses(mutate, msg):
    with pytest.raises(LoweringError, match=msg):
        render(mutate(make_plan("fp8_directp")))


# --------------------------------------------------- device helper arithmetic


def test_fp8_p_key_permutation_matches_register_packing():
    """A-operand byte slot p of thread q holds the accumulator element that layout.pack_p_fp8
    picks; that element's key column must be FP8_P_KEY_PERM[p] (V is permuted to match)."""
    from fp4gen.device.layout import FP8_P_KEY_PERM

    assert sorted(FP8_P_KEY_PERM) == list(range(32))
    for q in range(4):  # thread within a quad
        for kb in range(4):
            for kh in range(2):
                for i in range(4):
                    j = 4 * kb + 2 * kh + (i >> 1)  # accumulator 8-column chunk
                    col = 8 * j + 2 * q + (i & 1)  # accumulator column of that element
                    slot = 16 * kh + 4 * q + i  # wgmma k32 A-operand position
                    assert col - 32 * kb == FP8_P_KEY_PERM[slot]


def _f32(x):
    return torch.as_tensor(x, dtype=torch.float64).to(torch.float32)


def _bits(x32):
    return x32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _emulate_code(s, c, m_use):
    """The PTX of directp.code/offset, emulated: FFMA.SAT then FFMA with the magic constant."""
    c16 = _f32(c.double() * 0.0625)
    b128 = _f32_round_down((120.0 - 8.0 * m_use.double()) / 128.0)
    u = _f32(s.double() * c16.double() + b128.double()).clamp(0.0, 1.0)
    y = _f32(u.double() * 128.0 + 12582912.0)
    return _bits(y) & 0xFF


def _f32_round_down(x64):
    r = x64.to(torch.float32)
    too_big = r.double() > x64
    return torch.where(too_big, torch.nextafter(r, torch.tensor(-float("inf"))), r)


def test_direct_p_codes_match_numerics_oracle():
    from fp4gen.numerics.directp import fp8_direct_p_codes

    g = torch.Generator().manual_seed(0)
    s = torch.randn(20000, generator=g, dtype=torch.float64).to(torch.float32) * 40
    c = _f32(0.0883883 * 1.4426950408889634)
    smax = s.max()
    m = _f32(smax.double() * c.double())
    m_up = torch.where(m.double() < smax.double() * c.double(), torch.nextafter(m, torch.tensor(float("inf"))), m)
    ours = _emulate_code(s, c, m_up)
    x = _f32(s.double() * c.double()) - m  # the oracle's x = t - m
    ref = fp8_direct_p_codes(x).to(torch.int64)
    assert int(ours.max()) <= 120 and int(ours.min()) >= 0
    # arithmetic order differs (one fused rounding vs. two): codes may differ by one step at
    # rounding ties only
    diff = (ours - ref).abs()
    assert int(diff.max()) <= 1
    assert float((diff > 0).double().mean()) < 1e-3
    # masked scores
    assert int(_emulate_code(torch.tensor([-float("inf")]), c, m_up)[0]) == 0


def test_direct_p_decode_is_e4m3_exact():
    """decode(code) = bits(code << 20) * 2^120, subnormals included (what the PTX computes)."""
    from fp4gen.numerics.formats import E4M3, decode

    codes = torch.arange(0, 121, dtype=torch.int64)
    f = (codes << 20).to(torch.int32).view(torch.float32).double() * 2.0 ** 120
    ref = decode(codes.to(torch.uint8), E4M3).double()
    assert torch.equal(f, ref)
    assert f[120] == 256.0 and f[1] == 2.0 ** -9


# ------------------------------------------------------------ compile (CPU)


def _expected_names(mod):
    # FP8 modules also compile the fused input quantizer (fp4gen.device.quantize)
    kinds = ("block", "amax", "vt", "vt_nat", "block_qt", "block_kt")
    quant = [f"fp8_quantize_{k}_d{mod.HEAD_DIM}" for k in kinds] if mod.IN_FP8 else []
    return [mod.KERNEL_NAME] + quant


def _compile(variant, d, causal, tmp_path):
    mod = load_module(make_plan(variant, d, causal), str(tmp_path))
    assert mod.compile_only("sm_90a") == _expected_names(mod)
    with pytest.raises(ValueError, match="sm_90a"):
        mod.compile_only("sm_100a")


@pytest.mark.parametrize("variant,d,causal", FAST)
def test_compile_sm90a(variant, d, causal, tmp_path):
    _compile(variant, d, causal, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("variant,d,causal", [m for m in MATRIX if m not in FAST])
def test_compile_sm90a_all(variant, d, causal, tmp_path):
    _compile(variant, d, causal, tmp_path)


def _ptx_counts(variant, tmp_path):
    """Compile one variant in a fresh process (the DSL reads CUTE_DSL_* at import) and count
    PTX instructions of interest."""
    d = tmp_path / variant
    d.mkdir()
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from plans import load_module, make_plan
        load_module(make_plan({variant!r}, 128, False), {str(d)!r}).compile_only("sm_90a")
    """)
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(d))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ptx = [f for f in os.listdir(d) if f.endswith(".ptx") and "quantize" not in f]
    assert len(ptx) == 1, os.listdir(d)
    text = (d / ptx[0]).read_text()
    return (text.count("ex2.approx"), text.count("wgmma.mma_async"), text.count("cvt.rn.satfinite.e4m3x2"))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_compile_direct_p_l_from_mma(causal, tmp_path):
    mod = load_module(make_plan("fp8_directp", 128, causal, l_from_mma=True), str(tmp_path))
    assert mod.compile_only("sm_90a") == _expected_names(mod)


@pytest.mark.slow
def test_direct_p_ptx_has_no_ex2_in_p_path(tmp_path):
    """Direct-P keeps MUFU.EX2 only for the per-row rescale factors; the exp path has one per score."""
    dp_ex2, dp_mma, dp_cvt = _ptx_counts("fp8_directp", tmp_path)
    exp_ex2, exp_mma, exp_cvt = _ptx_counts("fp8_exp", tmp_path)
    # 2 rows per thread x (unmasked loop, masked loop) rescale factors, nothing per score
    assert dp_ex2 <= 4, dp_ex2
    assert exp_ex2 >= 64 * 2, exp_ex2  # 64 scores per thread per tile, per loop copy
    assert dp_cvt == 0 and exp_cvt > 0  # Direct-P packs codes with PRMT, no f32 -> e4m3 cvt
    assert dp_mma == exp_mma > 0


@pytest.mark.parametrize("lines,path,line", [
    (["Q : fp8e4m3", "K : fp8e4m3(block=128)", "V : fp8e4m3(scale=tensor)", "P : fp8e4m3 via exp"], "Q", 4),
    (["Q : fp8e4m3(block=128)", "K : fp8e4m3", "V : fp8e4m3(scale=tensor)", "P : fp8e4m3 via exp"], "K", 5),
])
def test_sm90_refusals_name_the_spec_field(lines, path, line):
    """check == compile: what the sm90a lowering refuses is reported at the line the user wrote
    (the planner refuses most other mistakes itself, with their location)."""
    from fp4gen.frontend import parse_text
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.lowering import LoweringError, refusal

    text = "attention k {\n  target sm90a\n  head_dim 128\n" + "".join(f"  {ln}\n" for ln in lines) + "}\n"
    spec = parse_text(text, "t.attn")[0]
    err = refusal(plan_kernel(spec))
    assert isinstance(err, LoweringError) and err.path == path, err
    assert spec.loc(path).line == line
