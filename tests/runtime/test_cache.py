"""fp4gen.runtime.cache: keys, location, atomic and race-safe writes, compiled-kernel persistence."""
import hashlib
import multiprocessing as mp
import os
from pathlib import Path

import pytest

from fp4gen.runtime import cache


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("FP4GEN_CACHE_DIR")
    assert cache.cache_dir() == Path.home() / ".cache" / "fp4gen"


def test_module_key_depends_on_every_part():
    base = dict(spec_text="attention a {}", kernel="a", target="sm90a", dsl_version="4.8.1", fp4gen_ver="0.1.0")

    def key(**over):
        kw = {**base, **over}
        return cache.module_key(kw.pop("spec_text"), kw.pop("kernel"), kw.pop("target"),
                                dsl_version=kw["dsl_version"], fp4gen_ver=kw["fp4gen_ver"])

    k0 = key()
    assert k0 == key() and len(k0) == 64
    variants = [key(spec_text="attention a { }"), key(kernel="b"), key(target="sm100a"),
                key(dsl_version="4.9.0"), key(fp4gen_ver="0.1.1")]
    assert len({k0, *variants}) == 6


def test_key_parts_do_not_run_together():
    a = cache.module_key("x", "ab", "c", dsl_version="1", fp4gen_ver="1")
    b = cache.module_key("x", "a", "bc", dsl_version="1", fp4gen_ver="1")
    assert a != b


def test_default_versions_are_real():
    assert cache.cute_dsl_version() == "4.8.1"  # the pinned nvidia-cutlass-dsl of this project
    v = cache.fp4gen_version()
    assert v.startswith("0.") and "+src." in v


def test_source_fingerprint_changes_with_content(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    fp1 = cache.source_fingerprint([tmp_path])
    cache._fingerprint_memo.clear()
    (tmp_path / "a.py").write_text("x = 2\n")
    fp2 = cache.source_fingerprint([tmp_path])
    cache._fingerprint_memo.clear()
    assert fp1 != fp2


def test_store_and_read_module(tmp_path):
    key = cache.module_key("spec", "k", "reference", dsl_version="v", fp4gen_ver="v")
    assert cache.read_module(key, "k", "reference", root=tmp_path) is None
    p = cache.store_module(key, "k", "reference", "X = 1\n", root=tmp_path)
    assert p == cache.module_path(key, "k", "reference", root=tmp_path)
    # the entry is the header line binding it to its key and content, then the source
    digest = hashlib.sha256("X = 1\n".encode()).hexdigest()
    header = f"# fp4gen cache entry v{cache.CACHE_FORMAT} key={key} sha256={digest}\n"
    assert p.read_text() == header + "X = 1\n" == cache.module_text(key, "X = 1\n")
    assert cache.read_module(key, "k", "reference", root=tmp_path) == header + "X = 1\n"
    assert p.parent.parent == tmp_path / "modules" and p.name.startswith("k_reference_")
    # no temporary files left behind
    assert [f.name for f in p.parent.iterdir()] == [p.name]


def test_atomic_write_failure_leaves_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f.txt"
    cache.atomic_write(target, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        cache.atomic_write(target, "new")
    assert target.read_text() == "old"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["f.txt"]


# --- two processes racing to write the same entry ---------------------------

PAYLOAD_LINES = 20000


def _race_writer(root, barrier, tag, q):
    try:
        barrier.wait(timeout=30)
        # identical content as two compilations of one kernel would produce, but
        # large enough (~1 MB) that an interleaved or torn write would show
        src = "".join(f"LINE_{i} = {i}  # generated\n" for i in range(PAYLOAD_LINES))
        key = cache.module_key("spec-text", "racer", "sm90a", dsl_version="4.8.1", fp4gen_ver="t")
        for _ in range(5):
            cache.store_module(key, "racer", "sm90a", src, root=Path(root))
        q.put((tag, "ok"))
    except Exception as e:  # pragma: no cover - reported to the parent
        q.put((tag, repr(e)))


def test_concurrent_writers_leave_one_intact_file(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    q = ctx.Queue()
    procs = [ctx.Process(target=_race_writer, args=(str(tmp_path), barrier, i, q)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    results = sorted(q.get(timeout=5) for _ in procs)
    assert results == [(0, "ok"), (1, "ok")]
    assert all(p.exitcode == 0 for p in procs)
    files = [f for f in (tmp_path / "modules").rglob("*") if f.is_file()]
    assert len(files) == 1, files  # one entry, no stray temporaries
    text = files[0].read_text()
    key = cache.module_key("spec-text", "racer", "sm90a", dsl_version="4.8.1", fp4gen_ver="t")
    src = "".join(f"LINE_{i} = {i}  # generated\n" for i in range(PAYLOAD_LINES))
    assert text == cache.module_text(key, src)
    assert cache.read_module(key, "racer", "sm90a", root=tmp_path) == text  # its header checks out


# --- compiled kernels: export/publish protocol with a stand-in for cute.compile ----


class FakeCompiled:
    """Stands in for a JitCompiledFunction: callable, and exports a kernel.o."""

    def __init__(self, payload=b"\x7fELF fake object", fail_export=False):
        self.payload, self.fail_export, self.calls = payload, fail_export, 0

    def __call__(self, x):
        self.calls += 1
        return x + 1

    def export_to_c(self, file_path, file_name, function_prefix=""):
        if self.fail_export:
            raise NotImplementedError("export_to_c is not supported by this back end")
        Path(file_path, file_name + ".o").write_bytes(self.payload)
        Path(file_path, file_name + ".h").write_text(f"// {function_prefix}\n")


def test_compiled_kernel_exports_memoizes_and_reloads(tmp_path, monkeypatch):
    cache.clear_memory_cache()
    builds = []

    def build():
        builds.append(1)
        return FakeCompiled()

    fn = cache.compiled_kernel("fwd", "bf16,causal,d128", build, module_source="src", root=tmp_path)
    assert fn(1) == 2 and len(builds) == 1
    entries = list((tmp_path / "kernels").glob("*/*"))
    assert len(entries) == 1 and sorted(p.name for p in entries[0].iterdir()) == ["kernel.h", "kernel.o",
                                                                                   "kernel.sha256"]
    # kernel.sha256 is the entry header of kernel.o: its key and its content's digest
    kkey = cache.kernel_key(cache.text_hash("src"), "fwd", "bf16,causal,d128")
    assert (entries[0] / "kernel.sha256").read_text() == (
        f"# fp4gen cache entry v{cache.CACHE_FORMAT} key={kkey} "
        f"sha256={hashlib.sha256(FakeCompiled().payload).hexdigest()}\n")
    sym_in_header = (entries[0] / "kernel.h").read_text()
    assert "fp4gen_fwd_" in sym_in_header
    # same process: served from memory, no rebuild
    assert cache.compiled_kernel("fwd", "bf16,causal,d128", build, module_source="src", root=tmp_path) is fn
    # a new process (simulated by clearing memory): loaded from disk, no rebuild
    cache.clear_memory_cache()
    loaded = []
    monkeypatch.setattr(cache, "_load_exported", lambda path, sym, tvm: loaded.append((path, sym)) or "LOADED")
    assert cache.compiled_kernel("fwd", "bf16,causal,d128", build, module_source="src", root=tmp_path) == "LOADED"
    assert len(builds) == 1 and loaded[0][0] == entries[0] / "kernel.o" and loaded[0][1] in sym_in_header
    # another variant is another entry
    cache.compiled_kernel("fwd", "bf16,full,d128", build, module_source="src", root=tmp_path)
    assert len(builds) == 2 and len(list((tmp_path / "kernels").glob("*/*"))) == 2
    cache.clear_memory_cache()


def test_compiled_kernel_falls_back_when_export_unsupported(tmp_path):
    cache.clear_memory_cache()
    c = FakeCompiled(fail_export=True)
    with pytest.warns(RuntimeWarning, match="compiled once per process"):
        fn = cache.compiled_kernel("bwd", "v1", lambda: c, root=tmp_path)
    assert fn is c and fn(3) == 4
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").rglob("kernel.o"))
    leftovers = [p for p in (tmp_path / "kernels").rglob("*")] if (tmp_path / "kernels").exists() else []
    assert all(p.is_dir() and not p.name.startswith(".") for p in leftovers)
    cache.clear_memory_cache()


def test_unloadable_entry_is_replaced(tmp_path, monkeypatch):
    cache.clear_memory_cache()
    cache.compiled_kernel("fwd", "v", lambda: FakeCompiled(payload=b"old"), root=tmp_path)
    cache.clear_memory_cache()

    def bad_load(path, sym, tvm):
        raise RuntimeError("version mismatch")

    monkeypatch.setattr(cache, "_load_exported", bad_load)
    with pytest.warns(RuntimeWarning, match=r"could not load .*\(version mismatch\)"):
        fn = cache.compiled_kernel("fwd", "v", lambda: FakeCompiled(payload=b"new"), root=tmp_path)
    assert fn(1) == 2
    objs = list((tmp_path / "kernels").rglob("kernel.o"))
    assert [o.read_bytes() for o in objs] == [b"new"]
    assert not [p for p in (tmp_path / "kernels").rglob(".*")]
    cache.clear_memory_cache()


def test_publish_dir_race_keeps_first(tmp_path):
    final = tmp_path / "entry"
    a = tmp_path / ".a"
    b = tmp_path / ".b"
    for d, content in ((a, b"A"), (b, b"B")):
        d.mkdir()
        (d / "kernel.o").write_bytes(content)
    cache.publish_dir(a, final)
    cache.publish_dir(b, final)  # loser: its copy is discarded
    assert (final / "kernel.o").read_bytes() == b"A"
    assert not a.exists() and not b.exists()


def _export_racer(root, barrier, q):
    try:
        cache.clear_memory_cache()
        barrier.wait(timeout=30)
        fn = cache.compiled_kernel("racek", "v", lambda: FakeCompiled(payload=b"X" * 500000), root=Path(root))
        q.put("ok" if fn(1) == 2 else "bad")
    except Exception as e:  # pragma: no cover
        q.put(repr(e))


def test_concurrent_kernel_exports(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    q = ctx.Queue()
    procs = [ctx.Process(target=_export_racer, args=(str(tmp_path), barrier, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert sorted(q.get(timeout=5) for _ in procs) == ["ok", "ok"]
    objs = list((tmp_path / "kernels").rglob("kernel.o"))
    assert len(objs) == 1 and objs[0].read_bytes() == b"X" * 500000
    assert not [p for p in (tmp_path / "kernels").rglob(".*")]  # no temp dirs left


# --- the real CuTe DSL export/load, in fresh processes --------------------------

CHILD = Path(__file__).with_name("aot_child.py")


def _child(root, *extra, env_extra=None):
    import json
    import subprocess
    import sys

    env = dict(os.environ, **(env_extra or {}))
    # the child runs as a script: make the checkout's fp4gen importable even when not installed
    checkout = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = checkout + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run([sys.executable, str(CHILD), str(root), *extra], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_real_cute_export_then_load_in_new_process(tmp_path):
    """CuTe DSL 4.8.1 exports a compiled kernel (export_to_c) and a second process
    loads it (cute.runtime.load_module) without compiling. On a machine without
    a GPU the DSL needs CUTE_DSL_ARCH to export (otherwise its host JIT looks for
    the CUDA runtime and fails), as for every CPU-side compile here."""
    pytest.importorskip("cutlass")
    env = {"CUTE_DSL_ARCH": "sm_90a"}
    first = _child(tmp_path, env_extra=env)
    assert first == {"built": True, "objects": 1, "warnings": []}
    second = _child(tmp_path, env_extra=env)
    assert second == {"built": False, "objects": 1, "warnings": []}


@pytest.mark.slow
def test_real_cute_tvm_ffi_export_then_load(tmp_path):
    """The same with a TVM-FFI function (what generated kernels use when tvm_ffi is installed)."""
    pytest.importorskip("cutlass")
    pytest.importorskip("tvm_ffi")
    env = {"CUTE_DSL_ARCH": "sm_90a"}
    assert _child(tmp_path, "--tvm-ffi", env_extra=env) == {"built": True, "objects": 1, "warnings": []}
    assert _child(tmp_path, "--tvm-ffi", env_extra=env) == {"built": False, "objects": 1, "warnings": []}


@pytest.mark.gpu
def test_real_cute_kernel_runs_after_reload(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    first = _child(tmp_path, "--run")
    assert first["built"] and first["values"] == [float(i + 1) for i in range(32)], first
    second = _child(tmp_path, "--run")
    assert not second["built"] and second["values"] == [float(i + 1) for i in range(32)], second


def test_module_source_reads_a_path_or_the_file_of_a_function(tmp_path):
    """The text that keys a generated module's kernels, from its path or a function it
    defines; '' (compile in memory only) when there is no readable file."""
    mod = tmp_path / "gen_mod.py"
    mod.write_text("def _build():\n    pass\n")
    ns = {}
    exec(compile(mod.read_text(), str(mod), "exec"), ns)
    assert cache.module_source(str(mod)) == cache.module_source(ns["_build"]) == mod.read_text()
    exec(compile("def f():\n    pass\n", "<no file>", "exec"), ns)
    assert cache.module_source(ns["f"]) == cache.module_source("") == cache.module_source(None) == ""
