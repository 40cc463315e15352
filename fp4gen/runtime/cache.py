"""On-disk compile cache: generated module sources and compiled CuTe DSL kernels.

Location: ``$FP4GEN_CACHE_DIR`` if set, else ``~/.cache/fp4gen``. Layout::

    <root>/modules/<key[:2]>/<kernel>_<target>_<key[:16]>.py   generated module source
    <root>/kernels/<key[:2]>/<name>_<key[:16]>/kernel.{o,h}    a compiled kernel (CuTe AOT export)

Keys are sha256 digests of everything that changes the output: for a module,
(spec text hash, kernel name, target, CuTe DSL version, fp4gen version); for a
compiled kernel, the module's key plus the variant (the compile-time
specialisation: dtypes, causal, head dim, tile, arch...).

Concurrency: every entry is written to a temporary name in its final
directory and published with one ``os.replace`` (files) or ``os.rename``
(the directory holding a kernel's ``.o``/``.h`` pair). Readers therefore see
either nothing or a whole entry; two processes compiling the same kernel
both succeed and one of their identical results stays.

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

import hashlib
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

ENV_VAR = "FP4GEN_CACHE_DIR"
# Bump when the layout or the meaning of a key changes.
CACHE_FORMAT = 1


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
# atomic writes


def atomic_write(path: Union[str, Path], data: Union[str, bytes]) -> Path:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The temporary file lives in the destination directory (``os.replace`` is
    atomic only within one file system) and is fsynced before the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


# ---------------------------------------------------------------------------
# generated module sources


def module_path(key: str, kernel: str, target: str, root: Optional[Path] = None) -> Path:
    root = Path(root) if root is not None else cache_dir()
    return root / "modules" / key[:2] / f"{_safe(kernel)}_{_safe(target)}_{key[:16]}.py"


def lookup_module(key: str, kernel: str, target: str, root: Optional[Path] = None) -> Optional[Path]:
    p = module_path(key, kernel, target, root)
    return p if p.is_file() else None


def store_module(key: str, kernel: str, target: str, source: str, root: Optional[Path] = None) -> Path:
    """Store a generated module's source; returns its path. Idempotent and race-safe."""
    return atomic_write(module_path(key, kernel, target, root), source)


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


def _discard(entry: Path) -> None:
    """Remove a published entry: first rename it out of the way (atomic), then delete."""
    trash = entry.with_name(f".trash-{entry.name}-{os.getpid()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # already gone, or another process replaced it
    _rmtree(trash)


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


_memo: dict = {}
_memo_lock = threading.Lock()
_warned: set = set()


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
    loaded with ``cute.runtime.load_module``, with no tracing or compilation.

    Loaded kernels take the same arguments as the ``cute.compile`` result
    (CuTe tensors / ``cute.runtime.from_dlpack`` views and a stream).
    """
    key = kernel_key(text_hash(module_source), name, variant)
    with _memo_lock:
        fn = _memo.get(key)
    if fn is not None:
        return fn
    fn = None
    kdir = kernel_dir(key, name, root)
    sym = _symbol(name, key)
    if persist and (kdir / "kernel.o").is_file():
        try:
            fn = _load_exported(kdir / "kernel.o", sym, enable_tvm_ffi)
        except Exception as e:  # stale or foreign file: discard it and rebuild below
            _warn_once(("load", name), f"fp4gen cache: could not load {kdir / 'kernel.o'} ({e}); recompiling")
            _discard(kdir)
            fn = None
    if fn is None:
        compiled = build()
        fn = compiled
        if persist:
            try:
                _export(compiled, kdir, sym, enable_tvm_ffi)
            except Exception as e:
                _warn_once(("export", name),
                           f"fp4gen cache: cannot persist compiled kernel {name!r} ({type(e).__name__}: {e}); "
                           f"it will be compiled once per process")
    with _memo_lock:
        fn = _memo.setdefault(key, fn)
    return fn


def _export(compiled, final_dir: Path, sym: str, enable_tvm_ffi: bool = False) -> None:
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
    try:
        if enable_tvm_ffi:
            # TVM-FFI functions export one object file exposing __tvm_ffi_<sym>
            compiled.export_to_c(str(tmp / "kernel.o"), function_name=sym)
        else:
            # CuTe ABI: <dir>/<name>.o and .h, symbols prefixed with sym
            compiled.export_to_c(str(tmp), "kernel", sym)
        if not (tmp / "kernel.o").is_file():
            raise RuntimeError("export_to_c wrote no kernel.o")
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
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def clear_memory_cache() -> None:
    """Forget in-process compiled kernels and warnings given (tests; the disk cache stays)."""
    with _memo_lock:
        _memo.clear()
        _warned.clear()
