"""Issue 15: a compile cache that verifies itself. Every corruption of an entry is caught
before anything in it runs; the load rebuilds the entry with one CacheWarning naming why and
computes what the spec says. Reference-target modules and a stand-in for cute.compile: no
GPU, no CuTe compile."""
from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.runtime import cache, loader

SPEC = ("attention r {\n  target reference\n  head_dim 64\n  mask causal\n"
        "  backward {\n    dO : bf16\n  }\n}\n")
OTHER = SPEC.replace("mask causal", "mask none")  # another key, the same kernel name


def forget():
    """Drop the modules load() imported, so the next load reads the cache again."""
    for name in [n for n in sys.modules if n.startswith(loader.LOADED_PREFIX + ".")]:
        del sys.modules[name]


def load(path):
    """(module, messages of the CacheWarnings) of a load in a fresh process state."""
    forget()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = fp4gen.load(path)
    return mod, [str(w.message) for w in caught if issubclass(w.category, cache.CacheWarning)]


def inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 16, 2, 64, generator=g) for _ in range(3)]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The spec, its cache entry's key and path, the good entry's bytes and the good output."""
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = tmp_path / "r.attn"
    spec.write_text(SPEC)
    mod, warned = load(spec)
    assert warned == []
    key = cache.module_key(SPEC, "r", "reference")
    entry = cache.module_path(key, "r", "reference")
    assert mod.__file__ == str(entry)
    yield dict(spec=spec, key=key, entry=entry, good=entry.read_bytes(), out=mod.forward(*inputs()),
               tmp=tmp_path)
    forget()


def body_of(data: bytes) -> bytes:
    return data.split(b"\n", 1)[1]


def forged(key: str, body: bytes) -> bytes:
    """``body`` under a header that matches it: what only a deliberate forgery produces."""
    return cache.entry_header(key, body).encode() + body


def with_spec_json(data: bytes, edit) -> bytes:
    """The entry with its SPEC_JSON literal changed by ``edit(dict)``."""
    lines = data.decode().split("\n")
    i = next(i for i, ln in enumerate(lines) if ln.startswith("SPEC_JSON = "))
    d = json.loads(ast.literal_eval(lines[i][len("SPEC_JSON = "):]))
    edit(d)
    lines[i] = f"SPEC_JSON = {json.dumps(d, sort_keys=True)!r}"
    return "\n".join(lines).encode()


def check_rebuilt(env, reason: str):
    """One load: one warning naming the entry and ``reason``, the right output, a good entry again."""
    mod, warned = load(env["spec"])
    assert warned == [f"fp4gen cache: discarding {env['entry']}: {reason}; rebuilding it"]
    assert mod.SPEC.mask.value == "causal" and callable(mod.backward)
    torch.testing.assert_close(mod.forward(*inputs()), env["out"], rtol=0, atol=0)
    assert env["entry"].read_bytes() == env["good"]
    assert [p.name for p in env["entry"].parent.iterdir()] == [env["entry"].name]  # no temporary or trash left
    assert load(env["spec"])[1] == []  # and the rebuilt entry is used silently


SHA = "content does not match its sha256 (truncated, bit-flipped or edited)"
NO_HEADER = "no fp4gen entry header (truncated, overwritten or another cache format)"


def _flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) * 2 // 3] ^= 0x01
    return bytes(b)


CORRUPTIONS = [
    ("truncated-half", lambda e: e["good"][:len(e["good"]) // 2], SHA),
    ("truncated-to-header", lambda e: e["good"][:e["good"].index(b"\n") + 1], SHA),
    ("truncated-in-header", lambda e: e["good"][:40], NO_HEADER),
    ("empty", lambda e: b"", NO_HEADER),
    ("bit-flipped", lambda e: _flip(e["good"]), SHA),
    ("nul-filled", lambda e: b"\0" * len(e["good"]), NO_HEADER),
    ("format-1-entry", lambda e: body_of(e["good"]), NO_HEADER),  # the same module, as CACHE_FORMAT 1 stored it
    ("other-format-header", lambda e: e["good"].replace(b"entry v2 key=", b"entry v9 key=", 1), NO_HEADER),
    ("edited-mask", lambda e: with_spec_json(e["good"], lambda d: d.update(mask="none")), SHA),
    ("edited-scale", lambda e: with_spec_json(e["good"], lambda d: d.update(softmax_scale=0.5)), SHA),
    ("edited-q-format", lambda e: with_spec_json(e["good"], lambda d: d["operands"]["Q"].update(format="fp8e4m3")),
     SHA),
]


@pytest.mark.parametrize("make, reason", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_module_entry_is_rebuilt(env, make, reason):
    env["entry"].write_bytes(make(env))
    check_rebuilt(env, reason)


FORGERIES = [  # a header recomputed over the bad content: the module contract catches these
    ("edited-mask", lambda d: d.update(mask="none")),
    ("edited-scale", lambda d: d.update(softmax_scale=0.5)),
    ("edited-q-format", lambda d: d["operands"]["Q"].update(format="fp8e4m3")),
    ("edited-guard", lambda d: d.update(guard={"kind": "sample", "m": 110, "l": 16})),
]


@pytest.mark.parametrize("edit", [c[1] for c in FORGERIES], ids=[c[0] for c in FORGERIES])
def test_forged_entry_with_an_edited_spec_is_rebuilt(env, edit):
    env["entry"].write_bytes(forged(env["key"], body_of(with_spec_json(env["good"], edit))))
    check_rebuilt(env, "its embedded spec (SPEC_JSON) differs from the spec being loaded")


def test_forged_entry_that_lost_its_backward_is_rebuilt(env):
    body = body_of(env["good"]).replace(b"\ndef backward(", b"\ndef _gone(")
    env["entry"].write_bytes(forged(env["key"], body))
    check_rebuilt(env, "the module lacks backward")


@pytest.mark.parametrize("body, reason", [
    (b"KERNEL_NAME = 'r'\nTARGET = 'reference'\n", "the module lacks SPEC_FILE, PLAN_JSON, forward, backward"),
    (b"def forward(:\n", "not valid Python (invalid syntax (<unknown>, line 3))"),  # after the header and payload
    (b"X = 1\0\n", "not valid Python (source code string cannot contain null bytes)"),
], ids=["no-contract", "syntax-error", "nul-byte"])
def test_forged_entry_of_another_schema_is_rebuilt_without_running(env, body, reason):
    marker = env["tmp"] / "RAN"
    body = f"__import__('pathlib').Path({str(marker)!r}).touch()\n".encode() + body
    env["entry"].write_bytes(forged(env["key"], body))
    check_rebuilt(env, reason)
    assert not marker.exists()


@pytest.fixture
def other_entry(env):
    """The entry of another spec (same kernel name and target, mask none): its bytes and key."""
    other = env["tmp"] / "other.attn"
    other.write_text(OTHER)
    load(other)
    key = cache.module_key(OTHER, "r", "reference")
    return cache.module_path(key, "r", "reference").read_bytes(), key


def test_another_keys_entry_copied_in_is_rebuilt(env, other_entry):
    data, key = other_entry
    env["entry"].write_bytes(data)
    check_rebuilt(env, f"stored under key {key[:16]}..., not {env['key'][:16]}... (another entry copied in its place)")


def test_another_keys_entry_under_a_forged_header_is_rebuilt_without_running(env, other_entry):
    marker = env["tmp"] / "RAN"
    body = body_of(other_entry[0]) + f"\n__import__('pathlib').Path({str(marker)!r}).touch()\n".encode()
    env["entry"].write_bytes(forged(env["key"], body))
    check_rebuilt(env, "its embedded spec (SPEC_JSON) differs from the spec being loaded")
    assert not marker.exists()


def test_another_kernels_entry_under_a_forged_header_is_rebuilt(env):
    body = body_of(env["good"]).replace(b"\nKERNEL_NAME = 'r'\n", b"\nKERNEL_NAME = 'x'\n")
    env["entry"].write_bytes(forged(env["key"], body))
    check_rebuilt(env, "holds kernel 'x' for 'reference', not 'r' for 'reference'")


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_non_file_in_the_entrys_place_is_rebuilt(env, other_entry, kind):
    entry = env["entry"]
    entry.unlink()
    if kind == "symlink":  # even to a good entry: the cache never follows links
        entry.symlink_to(cache.module_path(other_entry[1], "r", "reference"))
    elif kind == "directory":
        entry.mkdir()
    else:
        os.mkfifo(entry)  # opened non-blocking: the load does not hang
    reason = "is a symbolic link" if kind == "symlink" else "is not a regular file"
    check_rebuilt(env, reason)


def test_entry_vanishing_mid_read_is_rebuilt_silently(env, monkeypatch):
    real = cache.read_module

    def vanish_then_read(*a, **kw):
        env["entry"].unlink()  # another process cleared the cache between the lookup and the read
        return real(*a, **kw)

    monkeypatch.setattr(cache, "read_module", vanish_then_read)
    mod, warned = load(env["spec"])
    assert warned == [] and env["entry"].read_bytes() == env["good"]
    torch.testing.assert_close(mod.forward(*inputs()), env["out"], rtol=0, atol=0)


def test_cache_directory_removed_while_storing_is_retried(env, monkeypatch):
    env["entry"].unlink()
    real, calls = cache.atomic_write, []

    def cleared_once(path, data, **kw):
        calls.append(path)
        if len(calls) == 1:
            shutil.rmtree(env["tmp"] / "cache")  # a concurrent `rm -rf` of the cache root
            raise FileNotFoundError(2, "No such file or directory")
        return real(path, data, **kw)

    monkeypatch.setattr(cache, "atomic_write", cleared_once)
    mod, warned = load(env["spec"])
    assert warned == [] and calls == [env["entry"]] * 2 and env["entry"].read_bytes() == env["good"]


def test_loads_survive_a_concurrent_rmtree_of_the_cache(env):
    """The issue's race: 65 of 72 loads failed with FileNotFoundError while the cache was removed."""
    stop = threading.Event()

    def clear():
        while not stop.is_set():
            shutil.rmtree(env["tmp"] / "cache", ignore_errors=True)

    t = threading.Thread(target=clear)
    t.start()
    try:
        errors = []
        for _ in range(20):
            try:
                mod, _ = load(env["spec"])
                torch.testing.assert_close(mod.forward(*inputs()), env["out"], rtol=0, atol=0)
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                errors.append(repr(e))
    finally:
        stop.set()
        t.join()
    assert errors == []


def test_unusable_cache_root_falls_back_to_memory_with_one_warning(env, monkeypatch):
    import inspect

    root = env["tmp"] / "not-a-dir"
    root.write_text("a file where the cache root should be\n")
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(root))
    mod, warned = load(env["spec"])
    path = cache.module_path(env["key"], "r", "reference")
    assert warned == [f"fp4gen cache: cannot write {path} ([Errno 20] Not a directory: '{path}'); "
                      "using the module from memory, uncached"]
    assert mod.__file__ == f"<fp4gen: {path.name}, not cached>"
    torch.testing.assert_close(mod.forward(*inputs()), env["out"], rtol=0, atol=0)
    assert "def forward(" in inspect.getsource(mod.forward)  # CuTe DSL traces kernels through their source
    assert root.read_text() == "a file where the cache root should be\n"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_cache_root_falls_back_to_memory(env, monkeypatch):
    root = env["tmp"] / "ro-cache"
    root.mkdir()
    root.chmod(0o555)
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(root))
    try:
        mod, warned = load(env["spec"])
    finally:
        root.chmod(0o755)
    assert len(warned) == 1 and warned[0].endswith("using the module from memory, uncached")
    torch.testing.assert_close(mod.forward(*inputs()), env["out"], rtol=0, atol=0)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_entries_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    key = cache.module_key("spec", "k", "reference", dsl_version="v", fp4gen_ver="v")
    old = os.umask(umask)
    try:
        p = cache.store_module(key, "k", "reference", "X = 1\n", root=tmp_path)
        cache.clear_memory_cache()
        cache.compiled_kernel("fwd", "v", FakeCompiled, root=tmp_path)
    finally:
        os.umask(old)
        cache.clear_memory_cache()
    (kdir,) = (tmp_path / "kernels").glob("*/*")
    assert stat.S_IMODE(p.stat().st_mode) == file_mode and stat.S_IMODE(p.parent.stat().st_mode) == dir_mode
    assert stat.S_IMODE(kdir.stat().st_mode) == dir_mode
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in kdir.iterdir()} == {
        "kernel.o": file_mode, "kernel.h": file_mode, "kernel.sha256": file_mode}


# ---------------------------------------------------------------- compiled kernels (kernel.o + kernel.sha256)


class FakeCompiled:
    """Stands in for a cute.compile result: callable, exports kernel.o/kernel.h."""

    payload = b"\x7fELF fake object " * 64

    def __call__(self, x):
        return x + 1

    def export_to_c(self, file_path, file_name, function_prefix=""):
        Path(file_path, file_name + ".o").write_bytes(self.payload)
        Path(file_path, file_name + ".h").write_text(f"// {function_prefix}\n")


@pytest.fixture
def kernel_entry(tmp_path, monkeypatch):
    """A published kernel entry; ``loads`` records what _load_exported was asked to load."""
    cache.clear_memory_cache()
    cache.compiled_kernel("fwd", "v1", FakeCompiled, module_source="src", root=tmp_path)
    cache.clear_memory_cache()
    (kdir,) = (tmp_path / "kernels").glob("*/*")
    loads = []
    monkeypatch.setattr(cache, "_load_exported", lambda path, sym, tvm: loads.append(path.read_bytes()) or "LOADED")
    yield kdir, loads
    cache.clear_memory_cache()


def rebuild(kdir):
    builds = []

    def build():
        builds.append(1)
        return FakeCompiled()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = cache.compiled_kernel("fwd", "v1", build, module_source="src", root=kdir.parent.parent.parent)
    return fn, builds, [str(w.message) for w in caught if issubclass(w.category, cache.CacheWarning)]


def test_good_kernel_entry_is_loaded_without_building(kernel_entry):
    kdir, loads = kernel_entry
    fn, builds, warned = rebuild(kdir)
    assert (fn, builds, warned, loads) == ("LOADED", [], [], [FakeCompiled.payload])


@pytest.mark.parametrize("corrupt, reason", [
    (lambda d: (d / "kernel.o").write_bytes(FakeCompiled.payload[:100]), SHA),
    (lambda d: (d / "kernel.o").write_bytes(_flip(FakeCompiled.payload)), SHA),
    (lambda d: (d / "kernel.o").write_bytes(b"\0" * len(FakeCompiled.payload)), SHA),
    (lambda d: (d / "kernel.sha256").unlink(), NO_HEADER),
    (lambda d: (d / "kernel.sha256").write_text(""), NO_HEADER),
    (lambda d: (d / "kernel.sha256").write_text(
        cache.entry_header("0" * 64, FakeCompiled.payload)),
     "stored under key 0000000000000000..., not {key}... (another entry copied in its place)"),
], ids=["truncated", "bit-flipped", "nul-filled", "no-manifest", "empty-manifest", "other-key"])
def test_corrupted_kernel_entry_is_discarded_and_rebuilt_without_loading_it(kernel_entry, corrupt, reason):
    kdir, loads = kernel_entry
    corrupt(kdir)
    key = cache.kernel_key(cache.text_hash("src"), "fwd", "v1")
    fn, builds, warned = rebuild(kdir)
    assert isinstance(fn, FakeCompiled) and builds == [1] and loads == []  # the bad object was never loaded
    assert warned == [f"fp4gen cache: discarding {kdir / 'kernel.o'}: {reason.format(key=key[:16])}; recompiling"]
    assert (kdir / "kernel.o").read_bytes() == FakeCompiled.payload  # republished whole
    assert (kdir / "kernel.sha256").read_text() == cache.entry_header(key, FakeCompiled.payload)
    assert not [p for p in kdir.parent.iterdir() if p.name.startswith(".")]  # no trash left
