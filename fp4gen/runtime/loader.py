"""``fp4gen.runtime.load``: a generated file or a generated module name -> the module.

The runtime imports no compiler stage (generated kernels import it, where only
torch and CuTe DSL are installed): a ``.attn`` spec is compiled and loaded by
``fp4gen.load`` (``fp4gen/api.py``), which uses the cache checks here.

A cached module is used only after its header (``fp4gen.runtime.cache``) and
the module contract (``fp4gen.lowering``) check out, read without running it;
a bad entry is rebuilt with one ``cache.CacheWarning``, and a cache that cannot
be written leaves the module in memory. Every module is executed from the text
that was read and checked, never by re-reading its file.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import linecache
import os
import pkgutil
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

from . import cache as _cache
from . import fileio

GENERATED_PACKAGE = "fp4gen.generated"
# Modules imported from files (cache entries, loose .py files) live under this
# prefix in sys.modules, one name per file content, so two versions of one
# kernel never shadow each other and CuTe DSL's inspect.getsource finds the file.
LOADED_PREFIX = "fp4gen_loaded"

_lock = threading.RLock()


class LoadError(Exception):
    """``load`` could not produce a usable generated module (the message says why)."""


def load(spec_or_module: Union[str, os.PathLike, ModuleType], *, kernel: Optional[str] = None,
         target: Optional[str] = None) -> ModuleType:
    """Return an imported generated-kernel module.

    ``spec_or_module`` is one of:

    - a path to a generated ``.py`` module (a ``.attn`` spec: ``fp4gen.load``);
    - a module name under ``fp4gen.generated`` (``"fa4_fp8_sm90a"`` or
      ``"fp4gen.generated.fa4_fp8_sm90a"``);
    - an already imported module (checked and returned).

    ``kernel``/``target``, if given, must match the
    module's ``KERNEL_NAME``/``TARGET``. The module exposes ``forward`` and,
    when its spec has a backward block, ``backward`` (contract in
    ``fp4gen.lowering``).
    """
    if isinstance(spec_or_module, ModuleType):
        return _checked(spec_or_module, kernel, target, origin=spec_or_module.__name__)
    if not isinstance(spec_or_module, (str, os.PathLike)):
        raise TypeError(
            f"fp4gen.load: expected a path to a .attn spec or .py module, a module name, or a module; "
            f"got {type(spec_or_module).__name__}"
        )
    text = os.fspath(spec_or_module)
    path = Path(text).expanduser()
    kind = {".attn": "spec", ".py": "module"}.get(path.suffix)
    if kind is None and not path.exists():
        return _checked(_import_generated(text), kernel, target, origin=text)
    if not path.exists():
        raise LoadError(f"fp4gen.load: {kind} file {text!r} does not exist")
    if kind == "spec":
        raise LoadError(f"fp4gen.runtime.load imports generated modules; {text!r} is a spec: compile and load "
                        f"it with fp4gen.load({text!r})")
    source = _read_input(path, kind or "spec")  # refuses directories, devices, binary and huge files
    if kind == "module":
        return _checked(_import_file(path, source), kernel, target, origin=str(path))
    raise LoadError(f"fp4gen.load: {text!r} is neither a .attn spec nor a .py module")


def _read_input(path: Path, what: str) -> str:
    try:
        return fileio.read_text_file(path, what=what)
    except fileio.InputFileError as e:
        raise LoadError(f"fp4gen.load: {e}") from None


# ---------------------------------------------------------------------------


def _checked(mod: ModuleType, kernel: Optional[str], target: Optional[str], origin: str) -> ModuleType:
    if not callable(getattr(mod, "forward", None)):
        raise LoadError(f"fp4gen.load: {origin} is not a generated kernel module (it has no forward function)")
    got_kernel = getattr(mod, "KERNEL_NAME", None)
    got_target = getattr(mod, "TARGET", None)
    if kernel is not None and got_kernel is not None and kernel != got_kernel:
        raise LoadError(f"fp4gen.load: {origin} holds kernel {got_kernel!r}, not {kernel!r}")
    if target is not None and got_target is not None and _norm_target(target) != got_target:
        raise LoadError(f"fp4gen.load: {origin} was generated for target {got_target!r}, not {target!r}")
    return mod


def _norm_target(t: str) -> str:
    return t.strip().lower().replace("_", "")  # 'sm_90a' -> 'sm90a'


def _generated_names() -> list[str]:
    try:
        pkg = importlib.import_module(GENERATED_PACKAGE)
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(getattr(pkg, "__path__", [])) if not m.name.startswith("_"))


def _import_generated(name: str) -> ModuleType:
    full = name if name.startswith(GENERATED_PACKAGE + ".") else f"{GENERATED_PACKAGE}.{name}"
    short = full[len(GENERATED_PACKAGE) + 1:]
    if not short.replace(".", "").replace("_", "").isalnum():
        raise LoadError(f"fp4gen.load: {name!r} is not a spec path, a .py path or a generated module name")
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name not in (full, GENERATED_PACKAGE):
            raise  # the module exists but one of its own imports is missing: show that
        known = _generated_names()
        hint = ", ".join(known) if known else "none yet; run `fp4gen compile` on a spec"
        raise LoadError(
            f"fp4gen.load: no file {name!r} and no generated module {full!r}; generated modules: {hint}"
        ) from None


def _import_file(path: Path, source: str) -> ModuleType:
    """Import a loose Python file under a name derived from its path and content."""
    path = path.resolve()
    digest = hashlib.sha256(str(path).encode() + b"\0" + source.encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c == "_" else "_" for c in path.stem)
    return _exec_module(f"{LOADED_PREFIX}.{stem}_{digest}", str(path), source)


def exec_file(module_name: str, path) -> ModuleType:
    """Run the module file ``path`` as ``module_name``, registered in ``sys.modules`` as an import
    registers it: what the compile-and-inspect runners (verify, compile --emit, perf, the
    fingerprint and compile-time scripts) use, since a generated module with outlier transforms
    installs them on itself by name (``runtime.transforms.install``)."""
    path = str(path)
    return _exec_module(module_name, path, Path(path).read_text(encoding="utf-8"))


def _exec_module(module_name: str, filename: str, source: str) -> ModuleType:
    """Run ``source`` as module ``module_name`` whose file is ``filename``.

    The text run is the one the caller read and checked: the file is not read
    again, so a file swapped or deleted meanwhile changes nothing. linecache gets
    the same text, so that ``inspect.getsource`` (CuTe DSL traces kernels through
    it) works for in-memory modules and after the cache is cleared.
    """
    with _lock:
        if module_name in sys.modules:
            return sys.modules[module_name]
        _ensure_prefix_package()
        spec = importlib.util.spec_from_file_location(module_name, filename)
        if spec is None:  # "<fp4gen: ..., not cached>": no file, so no file loader; the text is in linecache
            spec = importlib.machinery.ModuleSpec(module_name, None, origin=filename)
        mod = importlib.util.module_from_spec(spec)
        mod.__file__ = filename  # inspect.getsource (CuTe DSL tracing) finds the text through it
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        # registered before executing: dataclasses, pickling and CuTe DSL's
        # source inspection look the module up by name
        sys.modules[module_name] = mod
        try:
            exec(compile(source, filename, "exec", dont_inherit=True), mod.__dict__)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        return mod


def _ensure_prefix_package() -> None:
    if LOADED_PREFIX not in sys.modules:
        pkg = ModuleType(LOADED_PREFIX)
        pkg.__path__ = []  # a namespace-like parent with no files of its own
        sys.modules[LOADED_PREFIX] = pkg


def _warn(msg: str) -> None:
    warnings.warn(msg, _cache.CacheWarning, stacklevel=5)  # at the caller of load()


# What every generated module defines (the contract in fp4gen.lowering's docstring).
_CONTRACT_NAMES = ("KERNEL_NAME", "TARGET", "SPEC_FILE", "PLAN_JSON")
# sm100a renders no backward for a backward block its backward planner refuses
# (the module's docstring lists that gap), so there the name is optional.
_BACKWARD_OPTIONAL = ("sm100a",)


def _check_contract(path: Path, text: str, spec, tname: str) -> None:
    """Raise ``CacheEntryError`` unless ``text`` is a module for ``spec`` on ``tname``.

    Read with ``ast``, so nothing in the file runs before it passes: the header
    only proves the file is what was stored; this catches a forged header and
    what a naive cache would import silently (another kernel, an edited spec).
    """
    from fp4gen.ir.serialize import computed_fields, spec_to_dict

    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as e:  # ValueError: NUL bytes
        raise _cache.CacheEntryError(path, f"not valid Python ({e})") from None
    consts: dict = {}
    funcs = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            consts.update((t.id, node.value.value) for t in node.targets if isinstance(t, ast.Name))
    wanted = ["forward"] + (["backward"] if spec.backward is not None and tname not in _BACKWARD_OPTIONAL else [])
    missing = [n for n in _CONTRACT_NAMES if not isinstance(consts.get(n), str)] + [f for f in wanted if f not in funcs]
    if missing:
        raise _cache.CacheEntryError(path, f"the module lacks {', '.join(missing)}")
    if (consts["KERNEL_NAME"], consts["TARGET"]) != (spec.name, tname):
        raise _cache.CacheEntryError(path, f"holds kernel {consts['KERNEL_NAME']!r} for {consts['TARGET']!r}, "
                                           f"not {spec.name!r} for {tname!r}")
    if "SPEC_JSON" in consts:  # the reference backend computes from its embedded spec
        try:
            embedded = computed_fields(json.loads(consts["SPEC_JSON"]))
        except (TypeError, ValueError, AttributeError):
            embedded = None
        if embedded != computed_fields(spec_to_dict(spec)):
            raise _cache.CacheEntryError(path, "its embedded spec (SPEC_JSON) differs from the spec being loaded")
