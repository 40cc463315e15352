"""On-disk compile cache: generated module sources and compiled CuTe DSL kernels.

Location: ``$FP4GEN_CACHE_DIR`` if set, else ``~/.cache/fp4gen``. Layout::

    <root>/modules/<key[:2]>/<kernel>_<target>_<key[:16]>.py        generated module source
    <root>/kernels/<key[:2]>/<name>_<key[:16]>/kernel.{o,h,sha256}  a compiled kernel (CuTe AOT export)

Keys are sha256 digests of everything that changes the output: for a module,
(spec text hash, kernel name, target, CuTe DSL version, fp4gen version); for a
compiled kernel, the module's key plus the variant (the compile-time
specialisation: dtypes, causal, head dim, tile, arch...).

Integrity: every entry carries one header line, ``# fp4gen cache entry
v<format> key=<key> sha256=<digest of the content>``: a module file starts
with it (a comment, so the file is still plain Python), a kernel directory
holds it as ``kernel.sha256`` beside the object file. Readers check it before
anything in the entry is imported or loaded; an entry that fails (truncated,
bit-flipped, edited, copied from another key) raises ``CacheEntryError`` and
the caller discards and rebuilds it.

Concurrency: every entry is written to a temporary name in its final
directory and published with one ``os.replace`` (files) or ``os.rename``
(the directory holding a kernel's files). Readers therefore see either
nothing or a whole entry; two processes compiling the same kernel both
succeed and one of their identical results stays. Files and directories are
created with the process's umask.

Compiled kernels: CuTe DSL 4.8.1 can persist a ``cute.compile`` result with
``JitCompiledFunction.export_to_c(dir, name)`` (an object file with the host
launcher and the embedded cubin) and load it in another process with
``cute.runtime.load_module(path)``, which skips tracing and the MLIR/ptxas
pipeline. ``compiled_kernel`` below uses that; where export or load fails
(another DSL back end, TVM-FFI functions) it falls back to the in-process JIT
result, so the compile then happens once per process.

This module imports only the standard library at import time.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import stat
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

# The one atomic writer; driver.py, lowering/regenerate.py and cli/main.py import it from here.
from .fileio import atomic_write

ENV_VAR = "FP4GEN_CACHE_DIR"
# Bump when the layout, the entry header or the meaning of a key changes.
CACHE_FORMAT = 2


class CacheWarning(RuntimeWarning):
    """The cache skipped or rebuilt something (a bad entry, an unwritable root); loads still work."""


class CacheEntryError(Exception):
    """A cache entry that must not be used; the caller discards and rebuilds it."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def cache_dir() -> Path:
    """The cache root (not created here)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fp4gen"


# ---------------------------------------------------------------------------
# versions that belong in keys


def _dist_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cute_dsl_version() -> str:
    """Version of nvidia-cutlass-dsl, read from its metadata (no import of cutlass)."""
    v = _dist_version("nvidia-cutlass-dsl")
    if v:
        return v
    try:  # unpacked wheels without metadata: ask the module itself
        import cutlass  # noqa: F401

        return str(getattr(cutlass, "__version__", "unknown"))
    except Exception:
        return "none"


_SOURCE_SUFFIXES = (".py", ".j2", ".lark", ".jinja", ".jinja2")
_fingerprint_memo: dict = {}


def source_fingerprint(roots) -> str:
    """sha256 over the compiler's source files (paths and contents) under ``roots``.

    A development checkout keeps one version number while its templates and
    passes change; including this fingerprint keeps the cache from serving a
    module rendered by older compiler code.
    """
    roots = tuple(str(Path(r).resolve()) for r in roots)
    if roots in _fingerprint_memo:
        return _fingerprint_memo[roots]
    h = hashlib.sha256()
    for root in roots:
        base = Path(root)
        if not base.exists():
            continue
        files = sorted(p for p in base.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES
                       and "__pycache__" not in p.parts)
        for p in files:
            h.update(str(p.relative_to(base)).encode())
            h.update(b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
    fp = h.hexdigest()
    _fingerprint_memo[roots] = fp
    return fp


def _compiler_roots() -> list:
    """Folders of fp4gen's own sources, found without importing them (no jinja2/lark)."""
    import importlib.util

    roots = []
    for name in ("fp4gen", "fp4gen.ir", "fp4gen.templates"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            roots.extend(spec.submodule_search_locations)
    return roots


def fp4gen_version(include_sources: bool = True) -> str:
    """'0.1.0+src.<12 hex>': distribution version plus the source fingerprint of
    fp4gen/, ir/ and templates/ (the runtime and device helpers that kernels
    trace live in fp4gen/, so they count too)."""
    v = _dist_version("fp4gen") or "0+unknown"
    if not include_sources:
        return v
    return f"{v}+src.{source_fingerprint(_compiler_roots())[:12]}"


# ---------------------------------------------------------------------------
# keys


def text_hash(text: Union[str, bytes]) -> str:
    if isinstance(text, str):
        text = text.encode()
    return hashlib.sha256(text).hexdigest()


def _digest(parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\x1f")  # unit separator: ('ab','c') and ('a','bc') differ
    return h.hexdigest()


def module_key(spec_text: Union[str, bytes], kernel: str, target: str, *,
               dsl_version: Optional[str] = None, fp4gen_ver: Optional[str] = None) -> str:
    """Key of one generated module: (spec text hash, kernel, target, CuTe DSL version, fp4gen version)."""
    return _digest((
        f"fp4gen-cache-v{CACHE_FORMAT}", "module", text_hash(spec_text), kernel, target,
        dsl_version if dsl_version is not None else cute_dsl_version(),
        fp4gen_ver if fp4gen_ver is not None else fp4gen_version(),
    ))


# What a generated module may import from fp4gen (see fp4gen.lowering's contract):
# the code a kernel traces, besides its own source.
KERNEL_DEPENDENCIES = ("device", "numerics", "runtime")


def kernel_deps_version() -> str:
    """Distribution version plus a fingerprint of fp4gen/{device,numerics,runtime}."""
    import importlib.util

    v = _dist_version("fp4gen") or "0+unknown"
    spec = importlib.util.find_spec("fp4gen")
    roots = [Path(loc) / sub for loc in (spec.submodule_search_locations or []) for sub in KERNEL_DEPENDENCIES] \
        if spec is not None else []
    return f"{v}+dev.{source_fingerprint(roots)[:12]}"


def kernel_key(module_key_or_source: str, name: str, variant: str, *, dsl_version: Optional[str] = None,
               deps_version: Optional[str] = None) -> str:
    """Key of one compiled kernel: its module (key or source hash), its name, its
    specialisation, the CuTe DSL version and the fp4gen code it traces."""
    return _digest((
        f"fp4gen-cache-v{CACHE_FORMAT}", "kernel", module_key_or_source, name, variant,
        dsl_version if dsl_version is not None else cute_dsl_version(),
        deps_version if deps_version is not None else kernel_deps_version(),
    ))


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _safe(name: str) -> str:
    return _SAFE.sub("_", name)[:80] or "x"


# ---------------------------------------------------------------------------
# entry headers: what binds an entry's content to its key

_HEADER = "# fp4gen cache entry v{fmt} key={key} sha256={digest}\n"
_HEADER_RE = re.compile(rb"# fp4gen cache entry v%d key=([0-9a-f]{64}) sha256=([0-9a-f]{64})\n" % CACHE_FORMAT)
# Far above any real entry (modules ~100 KB, kernel objects a few MB): a reader never
# pulls a huge planted file into memory.
MAX_ENTRY_BYTES = 256 * 1024 * 1024


def entry_header(key: str, content: bytes) -> str:
    return _HEADER.format(fmt=CACHE_FORMAT, key=key, digest=hashlib.sha256(content).hexdigest())


def _check_header(path: Path, header: bytes, key: str, content: bytes) -> None:
    m = _HEADER_RE.fullmatch(header)
    if m is None:
        raise CacheEntryError(path, "no fp4gen entry header (truncated, overwritten or another cache format)")
    if m[1].decode() != key:
        raise CacheEntryError(path, f"stored under key {m[1][:16].decode()}..., not {key[:16]}... "
                                    f"(another entry copied in its place)")
    if hashlib.sha256(content).hexdigest() != m[2].decode():
        raise CacheEntryError(path, "content does not match its sha256 (truncated, bit-flipped or edited)")


def _read_entry(path: Path) -> Optional[bytes]:
    """The bytes of one cache file, or None when there is none.

    Something other than a regular file in its place is a bad entry; O_NONBLOCK
    keeps a planted FIFO from blocking the open. Other ``OSError`` (the root is a
    file, no permission) propagates: the cache as a whole cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheEntryError(path, "is a symbolic link") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CacheEntryError(path, "is not a regular file")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(MAX_ENTRY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_ENTRY_BYTES:
        raise CacheEntryError(path, f"larger than {MAX_ENTRY_BYTES} bytes, more than fp4gen ever writes")
    return data


def discard_entry(entry: Path) -> None:
    """Remove a published entry (file or directory): renamed out of the way first, so
    that readers see it whole or not at all; a no-op if it is already gone."""
    trash = entry.with_name(f".trash-{entry.name}-{secrets.token_hex(4)}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # already gone, or the cache is read-only
    if trash.is_dir() and not trash.is_symlink():
        _rmtree(trash)
    else:
        trash.unlink(missing_ok=True)


# ---------------------------------------------------------------------------
# generated module sources


def module_path(key: str, kernel: str, target: str, root: Optional[Path] = None) -> Path:
    root = Path(root) if root is not None else cache_dir()
    return root / "modules" / key[:2] / f"{_safe(kernel)}_{_safe(target)}_{key[:16]}.py"


def module_text(key: str, source: str) -> str:
    """A module entry as stored: the header line, then the generated source."""
    return entry_header(key, source.encode()) + source


def read_module(key: str, kernel: str, target: str, root: Optional[Path] = None) -> Optional[str]:
    """The text of a module entry whose header checks out, or None when there is none.

    Raises ``CacheEntryError`` for a bad entry and ``OSError`` when the cache
    cannot be read. Only the header is checked here; what the module must define
    is the loader's business.
    """
    path = module_path(key, kernel, target, root)
    data = _read_entry(path)
    if data is None:
        return None
    end = data.find(b"\n") + 1
    _check_header(path, data[:end], key, data[end:])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # only a file forged with a matching hash gets here
        raise CacheEntryError(path, "not UTF-8 text") from None


def store_module(key: str, kernel: str, target: str, source: str, root: Optional[Path] = None) -> Path:
    """Store a generated module's source under its header; returns its path. Idempotent and race-safe.

    Raises ``OSError``/``fileio.OutputFileError`` when the cache cannot be written.
    """
    path = module_path(key, kernel, target, root)
    try:
        return atomic_write(path, module_text(key, source), parents=True)
    except FileNotFoundError:
        # a concurrent clear of the cache removed the directory between mkdir and rename
        return atomic_write(path, module_text(key, source), parents=True)


# ---------------------------------------------------------------------------
# compiled kernels (CuTe DSL AOT export)


def kernel_dir(key: str, name: str, root: Optional[Path] = None) -> Path:
    root = Path(root) if root is not None else cache_dir()
    return root / "kernels" / key[:2] / f"{_safe(name)}_{key[:16]}"


def publish_dir(tmp_dir: Path, final_dir: Path) -> Path:
    """Move a fully written directory into place; if another process won the race, keep theirs."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        # final_dir exists (ENOTEMPTY/EEXIST): someone published the same entry first.
        if not final_dir.is_dir():
            raise
        _rmtree(tmp_dir)
    return final_dir


def _temp_dir(parent: Path, prefix: str) -> Path:
    """A new empty directory in ``parent``. ``os.mkdir`` applies the umask
    (``tempfile.mkdtemp`` would force 0o700 on the published entry)."""
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


_memo: dict = {}
_memo_lock = threading.Lock()
_warned: set = set()
KERNEL_MANIFEST = "kernel.sha256"  # the entry header of kernel.o


def tvm_ffi_available() -> bool:
    """Whether kernels compile and launch through TVM-FFI (the ``tvm_ffi`` package is
    importable): the one test every compile path uses to pick its calling convention."""
    import importlib.util

    return importlib.util.find_spec("tvm_ffi") is not None


def _symbol(name: str, key: str) -> str:
    # a C identifier, unique per entry so several kernels can share a process
    return re.sub(r"[^A-Za-z0-9_]", "_", f"fp4gen_{name}_{key[:12]}")


def compiled_kernel(
    name: str,
    variant: str,
    build: Callable[[], object],
    *,
    module_source: str = "",
    root: Optional[Path] = None,
    persist: bool = True,
    enable_tvm_ffi: bool = False,
):
    """Return a callable compiled kernel, from memory, from disk, or by calling ``build()``.

    ``build`` returns what ``cute.compile(...)`` returns. ``variant`` is every
    compile-time choice that the compiled code depends on (dtypes, causal,
    head dim, static shapes, arch): two calls with equal (name, variant,
    module_source) must be interchangeable. On a miss the result is exported
    with ``export_to_c`` and published atomically; on a hit the object file is
    checked against its ``kernel.sha256`` and loaded with
    ``cute.runtime.load_module``, with no tracing or compilation.

    Loaded kernels take the same arguments as the ``cute.compile`` result
    (CuTe tensors / ``cute.runtime.from_dlpack`` views and a stream).
    """
    key = kernel_key(text_hash(module_source), name, variant)
    with _memo_lock:
        fn = _memo.get(key)
    if fn is not None:
        return fn
    kdir = kernel_dir(key, name, root)
    sym = _symbol(name, key)
    fn = _load_entry(kdir, key, name, sym, enable_tvm_ffi) if persist else None
    if fn is None:
        compiled = build()
        fn = compiled
        if persist:
            try:
                _export(compiled, kdir, key, sym, enable_tvm_ffi)
            except Exception as e:
                _warn_once(("export", name),
                           f"fp4gen cache: cannot persist compiled kernel {name!r} ({type(e).__name__}: {e}); "
                           f"it will be compiled once per process")
    with _memo_lock:
        fn = _memo.setdefault(key, fn)
    return fn


def module_source(defined_in) -> str:
    """The text of a generated module, given its path or a function it defines ('' when it
    cannot be read): what keys that module's compiled kernels on disk."""
    import inspect

    try:
        path = defined_in if isinstance(defined_in, (str, os.PathLike)) else inspect.getsourcefile(defined_in)
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, TypeError):
        return ""


def module_kernel(name: str, variant: str, build: Callable[[], object], source: str, *,
                  enable_tvm_ffi: bool = False):
    """``compiled_kernel`` for a kernel of the generated module whose text is ``source`` (the
    compile memo every runtime host uses). Without a source there is no safe disk key (two
    modules would share one entry): the kernel is then compiled in memory only."""
    return compiled_kernel(name, variant, build, module_source=source, persist=bool(source),
                           enable_tvm_ffi=enable_tvm_ffi)


def host_kernel(memo: dict, key, make: Callable[[], tuple], *, gpu_arch: str, tvm_ffi: bool, here: bool,
                name: str, variant: str, source_of) -> object:
    """One runtime host's compiled kernel ``key``, compiled once into ``memo``. ``make()`` gives
    (the kernel object, its fake arguments); the compile targets ``gpu_arch`` whatever GPU is
    present (CI compiles on CPUs). ``here`` (compile_only): a plain compile in memory; else
    ``module_kernel`` (memory, then a verified disk entry keyed by ``module_source(source_of)``,
    the generated module's text). The compile and cache path every sm90 host uses."""
    if key not in memo:
        def build():
            import cutlass.cute as cute

            kernel, args = make()
            stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
            opts = f"--gpu-arch {gpu_arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
            return cute.compile(kernel, *args, stream, options=opts)

        memo[key] = build() if here else module_kernel(name, variant, build, module_source(source_of),
                                                       enable_tvm_ffi=tvm_ffi)
    return memo[key]


def _load_entry(kdir: Path, key: str, name: str, sym: str, enable_tvm_ffi: bool):
    """The kernel of a cache entry, or None: absent, unreadable, or bad (then discarded)."""
    obj = kdir / "kernel.o"
    try:
        data = _read_entry(obj)
        if data is None:
            return None
        _check_header(obj, _read_entry(kdir / KERNEL_MANIFEST) or b"", key, data)
    except CacheEntryError as e:
        _warn_once(("load", name), f"fp4gen cache: discarding {e}; recompiling")
        discard_entry(kdir)
        return None
    except OSError:
        return None  # the cache cannot be read: compile, and exporting will say why it cannot persist
    try:
        return _load_exported(obj, sym, enable_tvm_ffi)
    except Exception as e:  # an object this DSL version cannot load: discard it and rebuild
        _warn_once(("load", name), f"fp4gen cache: could not load {obj} ({e}); recompiling")
        discard_entry(kdir)
        return None


def _export(compiled, final_dir: Path, key: str, sym: str, enable_tvm_ffi: bool = False) -> None:
    tmp = _temp_dir(final_dir.parent, f".{final_dir.name}.")
    try:
        if enable_tvm_ffi:
            # TVM-FFI functions export one object file exposing __tvm_ffi_<sym>
            compiled.export_to_c(str(tmp / "kernel.o"), function_name=sym)
        else:
            # CuTe ABI: <dir>/<name>.o and .h, symbols prefixed with sym
            compiled.export_to_c(str(tmp), "kernel", sym)
        if not (tmp / "kernel.o").is_file():
            raise RuntimeError("export_to_c wrote no kernel.o")
        (tmp / KERNEL_MANIFEST).write_text(entry_header(key, (tmp / "kernel.o").read_bytes()))
        publish_dir(tmp, final_dir)
    finally:
        if tmp.exists():
            _rmtree(tmp)


def _load_exported(path: Path, sym: str, enable_tvm_ffi: bool):
    import cutlass.cute as cute

    if enable_tvm_ffi:
        mod = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    else:
        mod = cute.runtime.load_module(str(path))
    return getattr(mod, sym)


def _warn_once(tag, msg: str) -> None:
    if tag in _warned:
        return
    _warned.add(tag)
    warnings.warn(msg, CacheWarning, stacklevel=3)


def clear_memory_cache() -> None:
    """Forget in-process compiled kernels and warnings given (tests; the disk cache stays)."""
    with _memo_lock:
        _memo.clear()
        _warned.clear()
