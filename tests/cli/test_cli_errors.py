"""Issue 15's command-line cases: outputs written safely, and every user mistake a one-line
error with exit 1 (spec, input) or 2 (command line), never 3. No GPU, no CuTe compile."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TWO_KERNELS = EXAMPLES / "sm90_bf16_d128.attn"  # sm90_bf16_d128 and sm90_bf16_causal_d128

REF = "attention r {\n  target reference\n  head_dim 64\n  mask causal\n}\n"


@pytest.fixture
def ref_spec(tmp_path):
    p = tmp_path / "ref.attn"
    p.write_text(REF)
    return p


def one_line_error(r, rc: int, line: str) -> None:
    assert r.rc == rc, r
    assert r.err.splitlines() == [line], r.err


# ---------------------------------------------------------------- outputs


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_output_to_a_device_is_refused_and_the_device_kept(cli, ref_spec):
    before = os.stat("/dev/full")
    r = cli("schedule", ref_spec, "-o", "/dev/full")
    one_line_error(r, 1, "fp4gen: error: /dev/full: is not a regular file (device, FIFO or socket); "
                         "fp4gen does not write there")
    after = os.stat("/dev/full")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_output_to_a_fifo_is_refused(cli, ref_spec, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = cli("schedule", ref_spec, "-o", fifo)
    one_line_error(r, 1, f"fp4gen: error: {fifo}: is not a regular file (device, FIFO or socket); "
                         "fp4gen does not write there")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("dangling", [False, True])
def test_output_through_a_symlink_is_refused(cli, ref_spec, tmp_path, dangling):
    target = tmp_path / "target.txt"
    if not dangling:
        target.write_text("keep me\n")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    r = cli("schedule", ref_spec, "-o", link)
    one_line_error(r, 1, f"fp4gen: error: {link}: is a symbolic link; fp4gen replaces only regular files")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "keep me\n" if not dangling else not target.exists()


def test_output_over_a_read_only_file_is_refused(cli, ref_spec, tmp_path):
    """Refused by its mode bits, also for root (whom os.access lets write anything)."""
    out = tmp_path / "ro.txt"
    out.write_text("old\n")
    out.chmod(0o444)
    r = cli("schedule", ref_spec, "-o", out)
    one_line_error(r, 1, f"fp4gen: error: {out}: is read-only; remove it or make it writable first")
    assert out.read_text() == "old\n" and stat.S_IMODE(out.stat().st_mode) == 0o444


def test_missing_parent_directory_needs_parents(cli, ref_spec, tmp_path):
    out = tmp_path / "a" / "b" / "plan.txt"
    r = cli("schedule", ref_spec, "-o", out)
    one_line_error(r, 1, f"fp4gen: error: {out}: directory '{out.parent}' does not exist "
                         "(create it, or pass --parents)")
    assert not (tmp_path / "a").exists()
    r = cli("schedule", ref_spec, "-o", out, "--parents")
    assert r.rc == 0 and r.out == f"wrote {out}\n" and out.read_text().startswith("kernel r")


def test_compile_missing_parent_directory_needs_parents(cli, ref_spec, tmp_path):
    out = tmp_path / "a" / "mods"
    r = cli("compile", ref_spec, "-o", out)
    one_line_error(r, 1, f"fp4gen: error: {out}: directory '{out.parent}' does not exist "
                         "(create it, or pass --parents)")
    assert not (tmp_path / "a").exists()
    r = cli("compile", ref_spec, "-o", out, "--parents")
    assert r.rc == 0 and sorted(p.name for p in out.iterdir()) == ["r_reference.py"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_follow_the_umask(cli, ref_spec, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert cli("schedule", ref_spec, "-o", tmp_path / "plan.txt").rc == 0
        assert cli("compile", ref_spec, "-o", tmp_path / "mods").rc == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan.txt").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "mods" / "r_reference.py").stat().st_mode) == mode


@pytest.mark.parametrize("fault, rc, last", [
    (OSError(28, "No space left on device"), 1, "fp4gen: error: cannot write to '{out}': No space left on device"),
    (KeyboardInterrupt(), 130, "fp4gen: interrupted"),
])
def test_interrupted_multi_kernel_compile_says_how_far_it_got(cli, tmp_path, monkeypatch, fault, rc, last):
    from fp4gen.runtime import fileio

    real, calls = fileio.atomic_write, []

    def second_write_fails(path, data, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise fault
        return real(path, data, **kw)

    monkeypatch.setattr(fileio, "atomic_write", second_write_fails)
    out = tmp_path / "mods"
    r = cli("compile", TWO_KERNELS, "-o", out, "--target", "reference")
    assert r.rc == rc, r
    assert r.err.splitlines() == [
        f"fp4gen: compile stopped: wrote 1 of 2 modules to {out} (sm90_bf16_d128_reference.py)",
        last.format(out=out)]
    assert sorted(p.name for p in out.iterdir()) == ["sm90_bf16_d128_reference.py"]  # no temporary left


# ---------------------------------------------------------------- spec mistakes: exit 1, never 3


def kernel(*lines: str, target: str = "reference") -> str:
    return "\n".join(["attention k {", f"  target {target}", "  head_dim 64", *lines, "}"]) + "\n"


SPEC_MISTAKES = [
    # (id, spec text, the first line of stderr)
    ("huge-int-head_dim", "attention k {\n  target reference\n  head_dim " + "9" * 5000 + "\n}\n",
     "spec.attn:3:12: error: head_dim is a number of 5000 characters; at most 40 are read"),
    ("huge-int-guard_m", kernel("  guard sample(m=" + "1" * 4400 + ", l=4)"),
     "spec.attn:4:18: error: guard m is a number of 4400 characters; at most 40 are read"),
    ("huge-int-tmem", kernel("  schedule { tmem { S0 cols 0.." + "1" * 4301 + " } }", target="sm100a"),
     "spec.attn:4:32: error: last column is a number of 4301 characters; at most 40 are read"),
    ("huge-float-scale", kernel("  scale 0." + "1" * 5000),
     "spec.attn:4:9: error: the softmax scale is a number of 5002 characters; at most 40 are read"),
    ("guard-l-overflow", kernel("  guard sample(m=110, l=18446744073709551617)"),
     "spec.attn:4:25: error: guard l must be from 1 to 64, got 18446744073709551617"),
    ("guard-m-zero", kernel("  guard sample(m=0, l=16)"),
     "spec.attn:4:18: error: guard m must be from 1 to 127, got 0"),
    ("huge-block", kernel("  Q : fp8e4m3(block=2147483648)"),
     "spec.attn:4:21: error: the block of fp8e4m3 must be 16, 32, 64, 128 or 256, got 2147483648"),
    ("mx-block", kernel("  Q : fp8e4m3(block=64, scale=e8m0)"),
     "spec.attn:4:21: error: the block of fp8e4m3 with e8m0 scales (OCP MX) must be 32, got 64"),
    ("direct_p-fp8e5m2", kernel("  P : fp8e5m2 via direct_p"),
     "spec.attn:4:15: error: direct_p produces mxfp4 or fp8e4m3 codes, but P is fp8e5m2"),
    ("direct_p-nvfp4", kernel("  P : nvfp4 via direct_p"),
     "spec.attn:4:13: error: direct_p produces mxfp4 or fp8e4m3 codes, but P is nvfp4"),
    ("fp4-gradient", kernel("  backward { dO : nvfp4 }"),
     "spec.attn:4:19: error: gradient operand dO cannot be nvfp4"),
    ("scale-1e300", kernel("  scale 1e300"),
     "spec.attn:4:9: error: the softmax scale must be from 1e-6 to 1e6, got 1e300"),
    ("scale-tiny", kernel("  scale 1e-7"),
     "spec.attn:4:9: error: the softmax scale must be from 1e-6 to 1e6, got 1e-7"),
    ("head_dim-huge", "attention k {\n  target reference\n  head_dim 4096\n}\n",
     "spec.attn:3:12: error: head_dim must be a multiple of 16 from 16 to 256, got 4096"),
    ("tile-huge", kernel("  schedule { tile 100000 x 128 }"),
     "spec.attn:4:19: error: tile M must be a multiple of 16 from 16 to 256, got 100000"),
    ("kv_stages-huge", kernel("  schedule { kv_stages 1000 }"),
     "spec.attn:4:24: error: kv_stages must be from 1 to 8, got 1000"),
    ("tmem-col-past-512", kernel("  schedule { tmem { S0 cols 0..512 } }", target="sm100a"),
     "spec.attn:4:32: error: last column must be from 0 to 511, got 512"),
    # found by scripts/fuzz_specs.py 10000 --seed 15: `run --target reference` exited 3 (PlanError)
    ("direct_p-a-huge", kernel("  P : mxfp4 via direct_p(a=1e308)"),
     "spec.attn:4:28: error: direct_p's a must be from 0.001 to 8, got 1e308"),
    ("nul-in-comment", kernel("  mask none  # a\x00b"),
     "spec.attn:4:17: error: control character U+0000 in the spec"),
]


@pytest.mark.parametrize("text, first", [c[1:] for c in SPEC_MISTAKES], ids=[c[0] for c in SPEC_MISTAKES])
def test_spec_mistakes_exit_1_at_their_line(cli, tmp_path, monkeypatch, text, first):
    monkeypatch.chdir(tmp_path)
    Path("spec.attn").write_text(text)
    r = cli("check", "spec.attn")
    assert r.rc == 1, r
    assert r.err.splitlines()[0] == first
    assert "Traceback" not in r.err and "internal error" not in r.err
    for argv in (("compile", "spec.attn", "-o", "out"), ("run", "spec.attn", "--seqlen", "8", "--heads", "1")):
        r = cli(*argv)
        assert r.rc == 1 and r.err.splitlines()[0] == first, (argv, r)
    assert not Path("out").exists()  # nothing compiled, not even a module that would fail to import


def test_huge_int_in_a_gpu_spec(cli, tmp_path):
    """The same in an sm90a spec (checked, not compiled), with the file named as given."""
    spec = tmp_path / "g.attn"
    spec.write_text(kernel("  Q : fp8e4m3(block=" + "7" * 4400 + ")", target="sm90a"))
    r = cli("check", spec)
    assert r.rc == 1 and r.err.splitlines()[0] == (
        f"{spec}:4:21: error: the block of fp8e4m3 is a number of 4400 characters; at most 40 are read")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
@pytest.mark.parametrize("command", ["check", "schedule", "compile", "accuracy", "run"])
def test_dev_zero_as_a_spec_is_refused_without_reading_it(cli, tmp_path, command):
    argv = [command, "/dev/zero"] + (["-o", tmp_path / "o"] if command == "compile" else [])
    r = cli(*argv)
    assert r.rc == 1, r
    assert r.err.splitlines()[0] == ("fp4gen: error: /dev/zero: is not a regular file (device, FIFO or socket); "
                                     "give a spec file")


def test_a_spec_over_4_mib_is_refused(cli, tmp_path):
    from fp4gen.runtime.fileio import MAX_SPEC_BYTES

    spec = tmp_path / "big.attn"
    spec.write_text(REF + "#" * MAX_SPEC_BYTES)
    r = cli("check", spec)
    assert r.rc == 1 and r.err.splitlines()[0] == (
        f"fp4gen: error: {spec}: {MAX_SPEC_BYTES + len(REF)} bytes is larger than the {MAX_SPEC_BYTES}-byte limit "
        "for a spec file")


# ---------------------------------------------------------------- command-line mistakes: exit 2


@pytest.mark.parametrize("option, value, message", [
    ("--seed", "99999999999999999999999", "expected an integer in 0..9223372036854775807, got 99999999999999999999999"),
    ("--seed", "-1", "expected an integer in 0..9223372036854775807, got -1"),
    ("--seqlen", "99999999999", "expected an integer in 1..1048576, got 99999999999"),
    ("--heads", "99999999999", "expected an integer in 1..1024, got 99999999999"),
    ("--batch", "0", "expected an integer in 1..65536, got 0"),
])
@pytest.mark.parametrize("command", ["run", "accuracy"])
def test_out_of_range_shape_options_are_usage_errors(cli, ref_spec, command, option, value, message):
    r = cli(command, ref_spec, option, value)
    assert r.rc == 2, r
    assert r.err.splitlines()[-1] == f"fp4gen {command}: error: argument {option}: {message}"


def test_too_many_rows_is_a_usage_error(cli, ref_spec):
    r = cli("run", ref_spec, "--seqlen", "1048576", "--heads", "1024")
    one_line_error(r, 2, "fp4gen run: error: --batch x --seqlen x --heads is 1073741824 rows of random inputs; "
                         "the limit is 4194304")


@pytest.mark.parametrize("device, message", [
    ("bogus", "--device: unknown device 'bogus'; use cpu or cuda[:N]"),
    ("meta", "--device meta: fp4gen runs on cpu or cuda[:N]"),
    ("mps", "--device mps: fp4gen runs on cpu or cuda[:N]"),
])
def test_bad_run_devices_are_usage_errors(cli, ref_spec, device, message):
    one_line_error(cli("run", ref_spec, "--device", device), 2, f"fp4gen run: error: {message}")


def test_gpu_target_with_run_device_cpu_is_a_usage_error(cli):
    r = cli("run", TWO_KERNELS, "--kernel", "sm90_bf16_d128", "--device", "cpu", "--seqlen", "8", "--heads", "1")
    one_line_error(r, 2, "fp4gen run: error: target sm90a runs on a CUDA GPU, not on the CPU; "
                         "use --target reference or a GPU")


def test_regenerate_root_that_is_not_a_checkout(cli, tmp_path):
    """Not "up to date (0 modules)": a --root without examples/ and generated/ is refused."""
    for argv in (("regenerate", "--check", "--root", tmp_path), ("regenerate", "--root", tmp_path)):
        r = cli(*argv)
        one_line_error(r, 1, f"fp4gen: error: --root {tmp_path}: not an fp4gen checkout "
                             "(it has no examples/ and generated/ directories)")
    assert list(tmp_path.iterdir()) == []  # wrote nothing there


# ---------------------------------------------------------------- check accepts what compile accepts

BACKEND_REFUSALS = [
    # (spec lines after target/head_dim, head_dim, first line of stderr after "spec.attn:")
    ((), 64, "3:12: error: kernel 'k' (sm100a): cannot compile for sm100a: "
             "sm100a lowering implements head_dim 128 only (not yet 64)"),
    (("  V : mxfp4(block=16, scale=e4m3)",), 128, None),  # refused by the planner already, at V
]


@pytest.mark.parametrize("lines, d, first", BACKEND_REFUSALS)
def test_check_refuses_what_compile_refuses_at_the_same_line(cli, tmp_path, monkeypatch, lines, d, first):
    monkeypatch.chdir(tmp_path)
    Path("spec.attn").write_text("\n".join(["attention k {", "  target sm100a", f"  head_dim {d}", *lines, "}"]) + "\n")
    checked, compiled = cli("check", "spec.attn"), cli("compile", "spec.attn", "-o", "out")
    assert checked.rc == compiled.rc == 1, (checked, compiled)
    assert checked.err.splitlines()[0] == compiled.err.splitlines()[0]
    if first is not None:
        assert checked.err.splitlines()[0] == "spec.attn:" + first
    assert not Path("out").exists()
