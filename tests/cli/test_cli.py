"""The ``fp4gen`` command's contracts: exit codes, stderr format, outputs."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FA4 = EXAMPLES / "fa4_fp4_d128.attn"


def write(tmp_path: Path, text: str, name: str = "spec.attn") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def import_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"gen_{path.stem}_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- check


def test_check_examples_ok(cli):
    files = sorted(EXAMPLES.glob("*.attn"))
    r = cli("check", *files)
    assert r.rc == 0, r.err
    assert r.err == ""
    assert f"ok: {FA4}: 1 kernel (fa4_fp4_d128)" in r.out.splitlines()
    assert re.search(rf"^ok: \d+ kernels in {len(files)} files$", r.out, re.M)


def test_check_bad_spec_prints_clang_style_diagnostic(cli, tmp_path):
    p = write(tmp_path, "attention k {\n  target sm100\n  head_dim 128\n}\n")
    r = cli("check", p)
    assert r.rc == 1
    assert r.out == ""
    lines = r.err.splitlines()
    assert lines[0] == f"{p}:2:10: error: unknown target 'sm100'; expected 'sm100a', 'sm90a' or 'reference'"
    assert lines[1] == "      target sm100"
    assert lines[2] == "             ^~~~~"
    assert lines[3] == "hint: did you mean 'sm100a'?"
    assert lines[-1] == "fp4gen: 1 error in 1 of 1 file"
    assert "Traceback" not in r.err


def test_check_reports_planner_errors_with_a_caret(cli, tmp_path):
    # sm90a has no FP4 tensor cores: the planner refuses Q : nvfp4 and points at it
    p = write(tmp_path, "attention k {\n  target sm90a\n  head_dim 128\n  Q : nvfp4\n}\n")
    r = cli("check", p)
    assert r.rc == 1
    lines = r.err.splitlines()
    assert lines[0].startswith(f"{p}:4:7: error: kernel 'k' (sm90a): ")
    assert lines[1] == "      Q : nvfp4"
    assert lines[2] == "          ^~~~~"


def test_check_target_override(cli):
    assert cli("check", EXAMPLES / "sm90_bf16_d128.attn", "--target", "reference").rc == 0
    r = cli("check", FA4, "--target", "sm90a")  # FP4 operands cannot run on Hopper
    assert r.rc == 1 and f"{FA4}:15:7: error:" in r.err
    r = cli("check", FA4, "--target", "sm80")  # a bad option value is a command-line error
    assert r.rc == 2 and r.err.splitlines()[-1] == (
        "fp4gen check: error: argument --target: unknown target 'sm80'; known targets: sm100a, sm90a, reference")


def test_check_keeps_going_across_files(cli, tmp_path):
    bad = write(tmp_path, "attention k { target x; head_dim 64 }\n", "bad.attn")
    r = cli("check", FA4, bad, tmp_path / "missing.attn")
    assert r.rc == 1
    assert f"ok: {FA4}: 1 kernel" in r.out
    assert f"{bad}:1:22: error: unknown target 'x'" in r.err
    assert f"fp4gen: error: {tmp_path / 'missing.attn'}: no such spec file" in r.err
    assert r.err.splitlines()[-1] == "fp4gen: 2 errors in 2 of 3 files"


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "nope.attn", "nope.attn: no such spec file"),
    (lambda d: d, ": is a directory, not a spec file"),
    (lambda d: (d / "bin.attn").write_bytes(b"\xff\xfe\x00bad") and d / "bin.attn", "bin.attn: not UTF-8 text"),
])
def test_bad_paths_are_one_line_errors(cli, tmp_path, make, message):
    path = make(tmp_path)
    for argv in (("check", path), ("schedule", path), ("compile", path, "-o", tmp_path / "o"),
                 ("accuracy", path)):
        r = cli(*argv)
        assert r.rc == 1, (argv, r)
        assert r.err.startswith(f"fp4gen: error: {tmp_path}") and message in r.err, r.err
        assert "Traceback" not in r.err


def test_usage_errors_exit_2(cli):
    assert cli().rc == 2
    assert cli("frobnicate").rc == 2
    assert cli("compile", FA4).rc == 2  # -o missing
    assert cli("accuracy", FA4, "--seqlen", "-4").rc == 2
    r = cli("compile", FA4, "-o", "x", "--emit", "py,elf")
    assert r.rc == 2 and "--emit takes" in r.err
    assert cli("--help").rc == 0


def test_internal_errors_exit_3_without_traceback(cli, monkeypatch):
    import fp4gen.cli.main as m

    def boom(args):
        raise ZeroDivisionError("planner bug")

    monkeypatch.setattr(m, "cmd_check", boom)
    monkeypatch.delenv("FP4GEN_TRACEBACK", raising=False)
    r = cli("check", FA4)
    assert r.rc == 3
    assert r.err.startswith("fp4gen: internal error: ZeroDivisionError: planner bug")
    assert "Traceback" not in r.err and "FP4GEN_TRACEBACK=1" in r.err
    monkeypatch.setenv("FP4GEN_TRACEBACK", "1")
    r = cli("check", FA4)
    assert r.rc == 3 and "Traceback" in r.err


def test_console_script_and_module_entry_points(tmp_path):
    p = write(tmp_path, "attention k { target reference; head_dim 64 }\n")
    res = subprocess.run([sys.executable, "-m", "fp4gen.cli.main", "check", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == f"ok: {p}: 1 kernel (k)"
    res = subprocess.run([sys.executable, "-m", "fp4gen.cli.main", "check", str(tmp_path / "x.attn")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr


# ---------------------------------------------------------------- schedule


def _dump_available(name: str) -> bool:
    try:
        from fp4gen.ir import dump
    except ImportError:
        return False
    return hasattr(dump, name)


@pytest.mark.skipif(not _dump_available("to_text"), reason="fp4gen.ir.dump.to_text not written yet")
def test_schedule_text_and_json(cli, tmp_path):
    r = cli("schedule", FA4)
    assert r.rc == 0, r.err
    assert "fa4_fp4_d128" in r.out
    out = tmp_path / "plan.json"
    r = cli("schedule", FA4, "--format", "json", "-o", out)
    assert r.rc == 0, r.err
    assert isinstance(json.loads(out.read_text()), dict)


def test_schedule_several_kernels_needs_kernel_for_json(cli):
    r = cli("schedule", EXAMPLES / "sm90_bf16_d128.attn", "--format", "json")
    assert r.rc == 2
    assert "choose one with --kernel" in r.err
    r = cli("schedule", EXAMPLES / "sm90_bf16_d128.attn", "--kernel", "sm90_bf16_d12")
    assert r.rc == 1
    assert "no kernel 'sm90_bf16_d12'" in r.err and "did you mean 'sm90_bf16_d128'?" in r.err


# ---------------------------------------------------------------- compile


def test_compile_reference_module_contract(cli, tmp_path):
    out = tmp_path / "out"
    r = cli("compile", FA4, "-o", out, "--target", "reference")
    assert r.rc == 0, r.err
    path = out / "fa4_fp4_d128_reference.py"
    assert r.out.strip() == f"wrote {path}"
    mod = import_file(path)
    assert mod.KERNEL_NAME == "fa4_fp4_d128"
    assert mod.TARGET == "reference"
    assert mod.SPEC_FILE == str(FA4)
    assert isinstance(json.loads(mod.PLAN_JSON), dict)
    assert callable(mod.forward) and callable(mod.backward)
    # the embedded spec is the parsed one, retargeted
    from fp4gen.frontend import parse_file
    from fp4gen.ir.spec import Target

    (spec,) = parse_file(str(FA4))
    assert mod.SPEC == spec.with_target(Target.REFERENCE)
    assert mod.SPEC.locs == spec.locs


def test_compile_forward_only_spec_has_no_backward(cli, tmp_path):
    r = cli("compile", EXAMPLES / "sm90_fp8_directp_d128.attn", "-o", tmp_path, "--target", "reference",
            "--kernel", "sm90_fp8_directp_causal_d128")
    assert r.rc == 0, r.err
    mod = import_file(tmp_path / "sm90_fp8_directp_causal_d128_reference.py")
    assert not hasattr(mod, "backward")
    assert [p.name for p in tmp_path.iterdir()] == ["sm90_fp8_directp_causal_d128_reference.py"]


def test_generated_reference_module_imports_without_the_compiler(cli, tmp_path):
    assert cli("compile", FA4, "-o", tmp_path, "--target", "reference").rc == 0
    code = ("import sys, importlib.util\n"
            f"s = importlib.util.spec_from_file_location('m', {str(tmp_path / 'fa4_fp4_d128_reference.py')!r})\n"
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            "bad = [n for n in ('lark', 'jinja2', 'fp4gen.frontend.parser', 'fp4gen.ir.passes') if n in sys.modules]\n"
            "assert not bad, bad\n"
            "print(m.SPEC.name)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "fa4_fp4_d128"


def test_import_fp4gen_is_light():
    code = ("import sys, fp4gen\n"
            "fp4gen.SpecError\n"
            "heavy = [n for n in ('lark', 'jinja2', 'torch', 'fp4gen.ir.passes') if n in sys.modules]\n"
            "assert not heavy, heavy\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_compile_errors(cli, tmp_path):
    f = write(tmp_path, "x", "file")
    r = cli("compile", FA4, "-o", f, "--target", "reference")
    assert r.rc == 1 and "exists and is not a directory" in r.err
    r = cli("compile", FA4, "-o", tmp_path / "o", "--target", "sm90a")
    assert r.rc == 1 and f"{FA4}:15:7: error:" in r.err  # the planner refuses FP4 on Hopper
    assert not (tmp_path / "o").exists()  # nothing written for a refused spec
    r = cli("compile", FA4, "-o", tmp_path / "o", "--target", "reference", "--emit", "py,ptx")
    assert r.rc == 1 and "target reference produces no ptx" in r.err


def test_public_api_compile_spec(tmp_path):
    import fp4gen

    paths = fp4gen.compile_spec(str(EXAMPLES / "sm90_fp8_exp_d128.attn"), tmp_path, target="reference")
    assert sorted(p.name for p in paths) == ["sm90_fp8_exp_causal_d128_reference.py",
                                             "sm90_fp8_exp_d128_reference.py"]
    specs = fp4gen.parse_file(str(FA4))
    assert fp4gen.plan(specs[0]).spec == specs[0]
    with pytest.raises(fp4gen.SpecError):
        fp4gen.parse_text("attention {")


WRITER = """
import sys
from fp4gen.cli.main import main
for _ in range(int(sys.argv[3])):
    rc = main(["compile", sys.argv[1], "-o", sys.argv[2], "--target", "reference"])
    assert rc == 0, rc
"""

READER = """
import sys, time, pathlib
p = pathlib.Path(sys.argv[1]); want = pathlib.Path(sys.argv[2]).read_bytes()
seen = 0
# the reading window opens when the first write lands: on a loaded machine the writers' imports
# alone can outlast a window counted from the reader's start (seen = 0 failed the test once)
first = time.time() + 240
while not p.exists() and time.time() < first:
    time.sleep(0.001)
deadline = time.time() + float(sys.argv[3])
while time.time() < deadline:
    try:
        got = p.read_bytes()
    except FileNotFoundError:
        continue
    seen += 1
    assert got == want, "reader saw a partial or mixed file"
print(seen)
"""


def test_concurrent_compiles_never_corrupt_output(cli, tmp_path):
    spec = EXAMPLES / "sm90_fp8_directp_d128.attn"
    ref_dir = tmp_path / "ref"
    assert cli("compile", spec, "-o", ref_dir, "--target", "reference").rc == 0
    out = tmp_path / "out"
    name = "sm90_fp8_directp_d128_reference.py"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(spec), str(out), "15"],
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    reader = subprocess.Popen([sys.executable, "-c", READER, str(out / name), str(ref_dir / name), "6"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for w in writers:
        _, err = w.communicate(timeout=300)
        assert w.returncode == 0, err
    rout, rerr = reader.communicate(timeout=300)
    assert reader.returncode == 0, rerr
    assert int(rout) > 0  # the reader did observe the file while writers ran
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref_dir.iterdir())  # no temp files left
    for p in ref_dir.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()


# ---------------------------------------------------------------- accuracy / demo


def _numerics_available() -> bool:
    return importlib.util.find_spec("fp4gen.numerics.accuracy") is not None


@pytest.mark.skipif(not _numerics_available(), reason="fp4gen.numerics.accuracy not written yet")
def test_accuracy_json_and_text(cli):
    r = cli("accuracy", EXAMPLES / "sm90_fp8_directp_d128.attn", "--kernel", "sm90_fp8_directp_d128",
            "--seqlen", "64", "--heads", "1", "--seed", "1", "--json")
    assert r.rc == 0, r.err
    rep = json.loads(r.out)
    assert rep["kernel"] == "sm90_fp8_directp_d128"
    assert 0.9 < rep["cosine"] <= 1.0 and 0 <= rep["rel_l2"] < 0.2
    r = cli("accuracy", EXAMPLES / "sm90_bf16_d128.attn", "--kernel", "sm90_bf16_d128", "--seqlen", "32",
            "--heads", "1")
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == "sm90_bf16_d128:"
    assert lines[1].startswith("  cosine: ") and lines[2].startswith("  rel_l2: ")


def test_demo_is_one_command(cli, tmp_path):
    if not (_numerics_available() and _dump_available("to_text")):
        pytest.skip("needs the planner's text dump and the numerics' accuracy report")
    r = cli("demo", "-o", tmp_path / "demo", "--seqlen", "64", "--heads", "1")
    assert r.rc == 0, r.err
    assert (tmp_path / "demo" / "fa4_fp4_d128_reference.py").is_file()
    assert "== fp4gen schedule" in r.out and "cosine:" in r.out


@pytest.mark.slow
def test_compile_emits_ptx_for_a_cute_dsl_target(cli, tmp_path):
    from fp4gen.lowering.regenerate import backend_available

    if not backend_available("sm90a"):
        pytest.skip("no sm90a backend yet")
    r = cli("compile", EXAMPLES / "sm90_bf16_d128.attn", "-o", tmp_path, "--kernel", "sm90_bf16_d128",
            "--emit", "py,ptx")
    assert r.rc == 0, r.err
    ptx = sorted((tmp_path / "sm90_bf16_d128_sm90a.artifacts").glob("*.ptx"))
    assert ptx, r.out
    assert ".target sm_90a" in ptx[0].read_text()
    assert f"wrote {ptx[0]}" in r.out


@pytest.mark.skipif(not _numerics_available(), reason="fp4gen.numerics.accuracy not written yet")
def test_run_on_the_reference_backend(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "cache"))
    r = cli("run", EXAMPLES / "sm90_bf16_d128.attn", "--kernel", "sm90_bf16_causal_d128", "--target", "reference",
            "--seqlen", "32", "--heads", "1", "--backward")
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith("sm90_bf16_causal_d128 (reference, cpu): B=1 S=32 H=1 D=128, forward+backward in ")
    assert [ln.split(":")[0].strip() for ln in lines[1:]] == ["o", "dq", "dk", "dv"]
    # bf16 operands, float64 oracle on the same bf16 inputs: close, not exact
    cos = [float(ln.split("cosine ")[1].split()[0]) for ln in lines[1:]]
    assert all(0.999 < c <= 1.0 for c in cos), cos


def test_run_refuses_gpu_targets_without_a_gpu(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = cli("run", EXAMPLES / "sm90_bf16_d128.attn", "--kernel", "sm90_bf16_d128")
    assert r.rc == 1
    assert "none is available here" in r.err
    r = cli("run", EXAMPLES / "sm90_fp8_exp_d128.attn", "--kernel", "sm90_fp8_exp_d128", "--target", "reference",
            "--backward")
    assert r.rc == 2 and "has no backward block" in r.err


def test_perf_subcommand_is_the_models_own_command_line(cli, tmp_path):
    r = cli("perf", "--help")
    assert r.rc == 0 and "fp4gen perf" in r.out and "--gpu" in r.out
    assert cli("perf").rc == 2  # no spec: usage error
    r = cli("perf", tmp_path / "missing.attn")
    assert r.rc == 1 and "missing.attn" in r.err and "Traceback" not in r.err
