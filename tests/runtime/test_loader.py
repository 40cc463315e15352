"""fp4gen.load / fp4gen.runtime.load: specs, generated files, generated module names; and import lightness."""
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from fp4gen.api import load  # specs and everything fp4gen.runtime.load takes
from fp4gen.runtime import LoadError, loader

FAKE_MODULE = '''
KERNEL_NAME = "toy"
TARGET = "reference"
SPEC_FILE = "toy.attn"
PLAN_JSON = "{}"
CALLS = []

def forward(q, k, v, *, softmax_scale=None, return_lse=False):
    CALLS.append(1)
    return q
'''

SPEC = textwrap.dedent("""\
    attention toy_a {
      target   sm90a
      head_dim 64
      mask     none
      Q : bf16
      K : bf16
      P : bf16
      V : bf16
      O : bf16
    }

    attention toy_b {
      target   reference
      head_dim 64
      mask     causal
    }
    """)


def test_import_runtime_pulls_in_no_compiler():
    code = ("import sys, fp4gen.runtime, fp4gen.runtime.cache, fp4gen.runtime.loader, fp4gen.runtime.checks, "
            "fp4gen.runtime.sm100_host, fp4gen.runtime.sm100_bwd_host; "
            "bad = [m for m in ('lark', 'jinja2', 'fp4gen.frontend', 'fp4gen.ir.passes', 'fp4gen.lowering') "
            "if m in sys.modules]; print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_load_py_file(tmp_path):
    p = tmp_path / "toy_reference.py"
    p.write_text(FAKE_MODULE)
    mod = load(p)
    assert mod.KERNEL_NAME == "toy" and mod.forward(1, 2, 3) == 1
    assert mod.__name__.startswith(loader.LOADED_PREFIX + ".toy_reference_")
    assert sys.modules[mod.__name__] is mod
    assert load(str(p)) is mod  # same file and content: same module object
    assert load(p, kernel="toy", target="reference") is mod


def test_changed_file_gives_new_module(tmp_path):
    p = tmp_path / "toy_reference.py"
    p.write_text(FAKE_MODULE)
    m1 = load(p)
    p.write_text(FAKE_MODULE + "\nEXTRA = 1\n")
    m2 = load(p)
    assert m1 is not m2 and m2.EXTRA == 1


def test_load_py_mismatch_errors(tmp_path):
    p = tmp_path / "toy_reference.py"
    p.write_text(FAKE_MODULE)
    with pytest.raises(LoadError, match="holds kernel 'toy', not 'other'"):
        load(p, kernel="other")
    with pytest.raises(LoadError, match="generated for target 'reference', not 'sm_90a'"):
        load(p, target="sm_90a")


def test_load_py_without_forward(tmp_path):
    p = tmp_path / "helper.py"
    p.write_text("X = 1\n")
    with pytest.raises(LoadError, match="is not a generated kernel module"):
        load(p)


def test_missing_files():
    with pytest.raises(LoadError, match="spec file '/nonexistent/x.attn' does not exist"):
        load("/nonexistent/x.attn")
    with pytest.raises(LoadError, match="module file '/nonexistent/x.py' does not exist"):
        load("/nonexistent/x.py")


@pytest.mark.parametrize("name", ["dir.attn", "dir.py", "plain_dir"])
def test_a_directory_is_named_in_the_error(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    with pytest.raises(LoadError) as e:
        load(d)
    what = "module" if name.endswith(".py") else "spec"
    assert str(e.value) == f"fp4gen.load: {d}: is a directory, not a {what} file"


@pytest.mark.parametrize("name", ["bin.attn", "bin.py"])
def test_a_binary_file_is_named_in_the_error(tmp_path, name):
    p = tmp_path / name
    p.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(LoadError) as e:
        load(p)
    assert str(e.value) == f"fp4gen.load: {p}: not UTF-8 text (byte 0: b'\\xff'); is this a binary file?"


def test_a_device_is_refused_without_reading_it(tmp_path):
    dev = Path("/dev/zero")
    if not dev.exists():
        pytest.skip("no /dev/zero")
    link = tmp_path / "zero.attn"  # a .attn name for it: still refused before anything is read
    link.symlink_to(dev)
    with pytest.raises(LoadError) as e:
        load(link)
    assert str(e.value) == f"fp4gen.load: {link}: is not a regular file (device, FIFO or socket); give a spec file"


def test_wrong_argument_type():
    with pytest.raises(TypeError, match="got int"):
        load(42)


def test_already_imported_module_is_checked():
    m = ModuleType("m")
    with pytest.raises(LoadError, match="has no forward"):
        load(m)
    m.forward = lambda q, k, v, **kw: q
    assert load(m) is m


@pytest.fixture
def fake_generated(tmp_path, monkeypatch):
    pkg = tmp_path / "fakegen_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "toy_reference.py").write_text(FAKE_MODULE)
    (pkg / "broken_reference.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(loader, "GENERATED_PACKAGE", "fakegen_pkg")
    yield "fakegen_pkg"
    for name in [n for n in sys.modules if n.startswith("fakegen_pkg")]:
        del sys.modules[name]


def test_load_generated_module_by_name(fake_generated):
    m = load("toy_reference")
    assert m.__name__ == "fakegen_pkg.toy_reference"
    assert load("fakegen_pkg.toy_reference") is m


def test_unknown_generated_module_lists_known(fake_generated):
    with pytest.raises(LoadError, match=r"no generated module 'fakegen_pkg.nope'; generated modules: "
                                        r"broken_reference, toy_reference"):
        load("nope")


def test_generated_module_with_missing_dependency_says_which(fake_generated):
    # the module exists; its own import failing must not read as "no such module"
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        load("broken_reference")


# --- .attn specs through the real front end, planner and lowering ----------------


@pytest.fixture
def spec_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "cache"))
    # load() serves a module this process already imported for the same key from memory, without
    # touching the cache: forget the toy modules earlier tests loaded, so each test sees its cache
    for name in [n for n in sys.modules if n.startswith(loader.LOADED_PREFIX + ".toy_")]:
        del sys.modules[name]
    p = tmp_path / "toy.attn"
    p.write_text(SPEC)
    return p


def test_spec_needs_kernel_when_several(spec_file):
    with pytest.raises(LoadError, match=r"defines several kernels \(toy_a, toy_b\); pass kernel=NAME"):
        load(spec_file)
    with pytest.raises(LoadError, match="has no kernel 'toy_c'; it defines: toy_a, toy_b"):
        load(spec_file, kernel="toy_c")
    with pytest.raises(LoadError, match="unknown target 'sm_75'; known targets:"):
        load(spec_file, kernel="toy_a", target="sm_75")


def test_spec_renders_caches_and_reuses(spec_file, tmp_path, monkeypatch):
    pytest.importorskip("lark")
    pytest.importorskip("jinja2")
    mod = load(spec_file, kernel="toy_b")
    assert (mod.KERNEL_NAME, mod.TARGET) == ("toy_b", "reference")
    assert callable(mod.forward)
    cached = list((tmp_path / "cache" / "modules").rglob("*.py"))
    assert len(cached) == 1 and cached[0].name.startswith("toy_b_reference_")
    assert mod.__file__ == str(cached[0])

    # a second load in a fresh interpreter state must come from the cache, not the renderer
    import fp4gen.lowering

    def no_render(plan):
        raise AssertionError("render called although the module is cached")

    monkeypatch.setattr(fp4gen.lowering, "render", no_render)
    for name in [n for n in sys.modules if n.startswith(loader.LOADED_PREFIX + ".toy_b_")]:
        del sys.modules[name]
    mod2 = load(spec_file, kernel="toy_b")
    assert mod2.__file__ == str(cached[0])


def test_spec_target_override(spec_file, tmp_path):
    pytest.importorskip("lark")
    mod = load(spec_file, kernel="toy_a", target="reference")
    assert mod.TARGET == "reference" and mod.KERNEL_NAME == "toy_a"


def test_spec_change_invalidates_cache(spec_file, tmp_path):
    pytest.importorskip("lark")
    m1 = load(spec_file, kernel="toy_b")
    changed = SPEC.replace("head_dim 64\n  mask     causal", "head_dim 128\n  mask     causal")
    assert changed != SPEC
    spec_file.write_text(changed)
    m2 = load(spec_file, kernel="toy_b")
    assert m1.__file__ != m2.__file__ and (m1.SPEC.head_dim, m2.SPEC.head_dim) == (64, 128)
    assert sorted(str(p) for p in (tmp_path / "cache" / "modules").rglob("*.py")) == sorted([m1.__file__, m2.__file__])
    spec_file.write_text(SPEC)
    assert load(spec_file, kernel="toy_b") is m1  # the first text again: the module already imported


def test_spec_syntax_error_is_the_front_ends_error(spec_file):
    pytest.importorskip("lark")
    from fp4gen.frontend import SpecError

    spec_file.write_text("attention broken {\n  head_dim\n}\n")
    with pytest.raises(SpecError):
        load(spec_file)


def test_the_runtime_loads_no_spec(tmp_path):
    """A spec needs the compiler, which the runtime never imports: fp4gen.load compiles it."""
    from fp4gen.runtime import load as runtime_load

    p = tmp_path / "k.attn"
    p.write_text("attention k {\n  target reference\n  head_dim 64\n}\n")
    with pytest.raises(LoadError, match=r"is a spec: compile and load it with fp4gen.load\("):
        runtime_load(p)


def test_exec_file_registers_the_module_while_it_runs(tmp_path):
    """A generated module with outlier transforms installs them on itself by name
    (runtime.transforms.install looks it up in sys.modules), so the compile-and-inspect runners
    (verify, compile --emit, perf, ptx_fingerprint) load modules through exec_file, which
    registers them as an import does. `fp4gen verify examples/*.attn` died with exit 3 on the
    outlier example before (2026-12-07)."""
    import importlib.util
    import sys

    from fp4gen.runtime.loader import exec_file

    path = tmp_path / "needs_its_name.py"
    path.write_text("import sys\nassert __name__ in sys.modules, 'not registered'\nOK = True\n")
    mod = exec_file("fp4gen_test_exec_file_module", path)
    assert mod.OK and sys.modules["fp4gen_test_exec_file_module"] is mod
    # planted fault: the plain spec_from_file_location + exec_module the runners had
    spec = importlib.util.spec_from_file_location("fp4gen_test_exec_file_plain", path)
    with pytest.raises(AssertionError, match="not registered"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
