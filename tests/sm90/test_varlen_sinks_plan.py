"""sm90a forward with ``sinks learned`` and ``layout varlen`` without a GPU: the config the
lowering derives (BF16 and FP8 varlen), what it refuses (varlen with a backward block, at the
spec's layout line, in ``fp4gen check`` as in ``compile``), the rendered entry points, the host's argument checks on the packed layout
and the sinks, and where ``fp4gen.attention_varlen`` / ``attention`` would run on an sm90a GPU.
The kernels themselves: test_varlen_sinks_gpu.py (H200) and the CPU compile below."""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import load_module, make_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VARLEN_EXAMPLE = ROOT / "examples" / "sm90_bf16_varlen_d128.attn"
SINKS_EXAMPLE = ROOT / "examples" / "sm90_sinks_d128.attn"


def _config(**kw):
    from fp4gen.lowering.sm90 import config

    return config(make_plan(**kw))


def test_config_fields_follow_the_spec():
    c = _config(variant="bf16", causal=True, varlen=True)
    assert (c.varlen, c.sinks, c.extended) == (True, False, True)
    c = _config(variant="fp8_directp", sinks=True)
    assert (c.varlen, c.sinks, c.extended) == (False, True, True)
    c = _config(variant="fp8_exp")
    assert (c.varlen, c.sinks, c.extended) == (False, False, False)


def test_fp8_varlen_config_follows_the_spec():
    """The FP8 recipes take the varlen layout (per-sequence scales, docs/runtime.md)."""
    for variant in ("fp8_exp", "fp8_directp"):
        c = _config(variant=variant, causal=True, varlen=True)
        assert (c.in_fp8, c.varlen, c.extended, c.quant_block) == (True, True, True, 128)


def test_check_and_compile_accept_the_fp8_varlen_example(tmp_path):
    from fp4gen.cli.main import main

    example = ROOT / "examples" / "sm90_fp8_varlen_d128.attn"
    assert main(["check", str(example)]) == 0
    assert main(["compile", str(example), "--kernel", "sm90_fp8_exp_varlen_causal_d128", "-o", str(tmp_path)]) == 0


def _fp8_varlen_with_backward(tmp_path):
    """The FP8 exp example with layout varlen and a backward block: the sm90a backward has no
    varlen (ir/passes/legalize.py BACKWARD_EXTENSIONS), so check and compile refuse it."""
    text = (ROOT / "examples" / "sm90_fp8_exp_d128.attn").read_text().replace(
        "mask     none", "mask     none\n  layout   varlen", 1).replace(
        "    tile 128 x 128\n  }\n}", "    tile 128 x 128\n  }\n  backward {\n    reuse q k lse\n  }\n}", 1)
    spec = tmp_path / "fp8_varlen_bwd.attn"
    spec.write_text(text)
    return spec, text.splitlines().index("  layout   varlen") + 1


def test_check_and_compile_refuse_fp8_varlen_backward_at_the_layout_line(tmp_path, capsys):
    from fp4gen.cli.main import main

    spec, line = _fp8_varlen_with_backward(tmp_path)
    capsys.readouterr()
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    assert f"{spec}:{line}:" in err and "varlen" in err and "backward" in err, err
    assert main(["compile", str(spec), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"{spec}:{line}:" in err, err


def test_config_takes_fp8_varlen_directly():
    import dataclasses

    c = dataclasses.replace(_config(variant="fp8_exp"), varlen=True)
    assert c.extended and c.in_fp8


@pytest.mark.parametrize("path, names, funcs", [
    (VARLEN_EXAMPLE, ("sm90_bf16_varlen_d128", "sm90_bf16_varlen_causal_d128"),
     {"_build", "forward", "forward_varlen", "compile_only"}),
    (SINKS_EXAMPLE, ("sm90_bf16_sinks_window_d128", "sm90_fp8_exp_sinks_causal_d128", "sm90_fp8_directp_sinks_d128"),
     {"_build", "forward", "compile_only"}),
])
def test_example_modules_render_their_entry_points(path, names, funcs):
    for name in names:
        src = (ROOT / "generated" / f"{name}_sm90a.py").read_text()
        tree = ast.parse(src)
        assert {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} == funcs
        fwd = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
        kwonly = [a.arg for a in fwd.args.kwonlyargs]
        assert ("sinks" in kwonly) == (path == SINKS_EXAMPLE), name
        assert ("varlen=True" in src) == (path == VARLEN_EXAMPLE)
        assert ("sinks=True" in src) == (path == SINKS_EXAMPLE)


def test_existing_modules_render_no_new_field():
    """Modules of specs without sinks or varlen keep their config literal (and so their PTX)."""
    for p in (ROOT / "generated").glob("sm90_*_sm90a.py"):
        src = p.read_text()
        if "varlen" in p.name or "sinks" in p.name or "CONFIG = ForwardConfig(" not in src:
            continue  # not a forward module without them (decode modules render a DecodeConfig)
        assert "sinks=" not in src.split("CONFIG = ForwardConfig(", 1)[1].split(")\n", 1)[0], p.name
        assert "varlen=" not in src and "def forward_varlen" not in src, p.name


# ---- the host's checks (CPU tensors: everything before the device is checked) ----------------


@pytest.fixture(scope="module")
def varlen_mod(tmp_path_factory):
    return load_module(make_plan("bf16", 128, True, varlen=True), str(tmp_path_factory.mktemp("vl")))


@pytest.fixture(scope="module")
def sinks_mod(tmp_path_factory):
    return load_module(make_plan("bf16", 128, True, sinks=True), str(tmp_path_factory.mktemp("sk")))


def _packed(lens_q, lens_k, H=2, Hkv=1, D=128, cu_dtype=torch.int32):
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.zeros(tq, H, D, dtype=torch.bfloat16)
    k = torch.zeros(tk, Hkv, D, dtype=torch.bfloat16)
    v = torch.zeros(tk, Hkv, D, dtype=torch.bfloat16)
    cq = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=cu_dtype)
    ck = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=cu_dtype)
    return q, k, v, cq, ck


@pytest.mark.parametrize("mutate, match", [
    (lambda a: a.update(cq=torch.tensor([0, 5, 3, 8], dtype=torch.int32)), "never decrease"),
    (lambda a: a.update(cq=a["cq"].float()), "1-D int32 tensor of B \\+ 1 offsets"),
    (lambda a: a.update(ck=a["ck"].clone().index_fill_(0, torch.tensor([3]), 9)), "ends at 9, but the packed tensor has 8"),
    (lambda a: a.update(cq=torch.tensor([1, 3, 5, 8], dtype=torch.int32)), "start at 0"),
    (lambda a: a.update(ck=torch.tensor([0, 8], dtype=torch.int32)), "cu_seqlens_q has 4 offsets and cu_seqlens_k 2"),
    (lambda a: a.update(cq=torch.tensor([0], dtype=torch.int32)), "B \\+ 1 >= 2"),
    (lambda a: a.update(max_q=2), "more than max_seqlen_q=2"),
    (lambda a: a.update(max_k=-1), "max_seqlen_k must be an int >= 0"),
    (lambda a: a.update(q=a["q"].float()), "wrong dtype"),
    (lambda a: a.update(q=a["q"][None]), "expected 3 dimensions"),
    (lambda a: a.update(k=a["k"][:, :, :64], v=a["v"][:, :, :64]), "head dim 64 != 128"),
    (lambda a: a.update(v=a["v"][:-1]), "k and v must have one shape"),
    (lambda a: a.update(q=torch.zeros(8, 3, 128, dtype=torch.bfloat16), k=torch.zeros(8, 2, 128, dtype=torch.bfloat16),
                        v=torch.zeros(8, 2, 128, dtype=torch.bfloat16)), "positive multiple"),
])
def test_varlen_argument_errors(varlen_mod, mutate, match):
    from fp4gen.runtime.checks import AttentionInputError

    q, k, v, cq, ck = _packed([3, 2, 3], [2, 0, 6])
    a = dict(q=q, k=k, v=v, cq=cq, ck=ck, max_q=None, max_k=None)
    mutate(a)
    with pytest.raises((AttentionInputError, TypeError), match=match):
        varlen_mod.forward_varlen(a["q"], a["k"], a["v"], a["cq"], a["ck"], a["max_q"], a["max_k"])


def test_valid_varlen_arguments_reach_the_device_check(varlen_mod):
    """The same call with good offsets (int64 ones too) passes every check but the GPU's."""
    from fp4gen.runtime.checks import UnsupportedDeviceError

    for dt in (torch.int32, torch.int64):
        q, k, v, cq, ck = _packed([3, 2, 3], [2, 0, 6], cu_dtype=dt)
        with pytest.raises((UnsupportedDeviceError, Exception)) as exc:
            varlen_mod.forward_varlen(q, k, v, cq, ck, 3, 6)
        assert "never decrease" not in str(exc.value) and "offsets" not in str(exc.value)
        assert "CUDA" in str(exc.value) or "GPU" in str(exc.value) or "cuda" in str(exc.value)


def test_dense_and_varlen_entries_refuse_each_other(varlen_mod, sinks_mod):
    from fp4gen.runtime.checks import AttentionInputError

    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(AttentionInputError, match="call forward_varlen"):
        varlen_mod.forward(q, q, q)
    with pytest.raises(AttentionInputError, match="takes dense"):
        sinks_mod._HOST.forward_varlen(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                       torch.tensor([0, 8], dtype=torch.int32), sinks=torch.zeros(2))


@pytest.mark.parametrize("sinks, match", [
    (None, "pass sinks="),
    (torch.zeros(3), "one logit per query head, shape \\(2,\\)"),
    (torch.zeros(2, dtype=torch.int32), "1-D float tensor"),
    (torch.zeros(2, 1), "1-D float tensor"),
])
def test_sinks_argument_errors(sinks_mod, sinks, match):
    from fp4gen.runtime.checks import AttentionInputError

    host = sinks_mod._HOST
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(AttentionInputError, match=match):
        host.check_sinks(sinks, q, 2)


def test_a_kernel_without_sinks_refuses_them(varlen_mod):
    from fp4gen.runtime.checks import AttentionInputError

    with pytest.raises(AttentionInputError, match="has no sinks"):
        varlen_mod._HOST.check_sinks(torch.zeros(2), torch.zeros(1), 2)


# ---- where a call runs on an sm90a GPU (no GPU: the choice only) -----------------------------


def _choose(spec, monkeypatch, **overrides):
    from fp4gen import torch_ops

    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a")
    entry = torch_ops._entry(torch_ops.spec_key(spec, **overrides))
    return torch_ops._choose(entry, torch.device("cuda"), "auto", strict=True)


def test_the_varlen_example_runs_its_generated_kernel(monkeypatch):
    import fp4gen

    (causal,) = [s for s in fp4gen.parse_file(VARLEN_EXAMPLE) if s.name == "sm90_bf16_varlen_causal_d128"]
    mod, _ = _choose(causal, monkeypatch, layout="varlen")
    assert mod is not None and mod.KERNEL_NAME == "sm90_bf16_varlen_causal_d128"
    assert callable(mod.forward_varlen)


def test_the_sinks_example_runs_its_generated_kernel(monkeypatch):
    import fp4gen

    (s,) = [s for s in fp4gen.parse_file(SINKS_EXAMPLE) if s.name == "sm90_fp8_directp_sinks_d128"]
    mod, _ = _choose(s, monkeypatch, sinks=True)
    assert mod is not None and mod.CONFIG.sinks


def test_the_fp8_varlen_example_runs_its_generated_kernel(monkeypatch):
    import fp4gen

    example = ROOT / "examples" / "sm90_fp8_varlen_d128.attn"
    (s,) = [s for s in fp4gen.parse_file(example) if s.name == "sm90_fp8_directp_varlen_causal_d128"]
    mod, _ = _choose(s, monkeypatch, layout="varlen")
    assert mod is not None and mod.KERNEL_NAME == "sm90_fp8_directp_varlen_causal_d128"
    assert mod.CONFIG.in_fp8 and mod.CONFIG.varlen and callable(mod.forward_varlen)


def test_the_varlen_kernel_compiles_on_the_cpu(varlen_mod):
    assert varlen_mod.compile_only("sm_90a") == [varlen_mod.KERNEL_NAME]
