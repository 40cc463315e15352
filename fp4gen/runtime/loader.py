"""``fp4gen.runtime.load``: a spec, a generated file or a generated module name -> the module.

The compiler (front end, planner, lowering) is imported inside ``load`` and
only for ``.attn`` inputs, so that importing ``fp4gen.runtime`` (which every
generated kernel does) never pulls in lark or jinja2.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pkgutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

from . import cache as _cache

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

    - a path to a ``.attn`` spec: parsed, planned and rendered, the module
      source cached on disk (see ``fp4gen.runtime.cache``) and imported.
      ``kernel`` picks one ``attention`` block when the file has several;
      ``target`` (``"sm90a"``, ``"sm100a"``, ``"reference"``) overrides the
      spec's own target;
    - a path to a generated ``.py`` module;
    - a module name under ``fp4gen.generated`` (``"fa4_fp8_sm90a"`` or
      ``"fp4gen.generated.fa4_fp8_sm90a"``);
    - an already imported module (checked and returned).

    For the last three, ``kernel``/``target`` if given must match the
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
    if path.suffix == ".attn":
        if not path.is_file():
            raise LoadError(f"fp4gen.load: spec file {text!r} does not exist")
        return _load_spec(path, kernel, target)
    if path.suffix == ".py":
        if not path.is_file():
            raise LoadError(f"fp4gen.load: module file {text!r} does not exist")
        mod = _import_file(path)
        return _checked(mod, kernel, target, origin=str(path))
    if path.is_file():
        raise LoadError(f"fp4gen.load: {text!r} is neither a .attn spec nor a .py module")
    return _checked(_import_generated(text), kernel, target, origin=text)


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


def _import_file(path: Path, module_name: Optional[str] = None) -> ModuleType:
    """Import a Python file under a name derived from its path and content."""
    path = path.resolve()
    data = path.read_bytes()
    if module_name is None:
        digest = hashlib.sha256(str(path).encode() + b"\0" + data).hexdigest()[:16]
        stem = "".join(c if c.isalnum() or c == "_" else "_" for c in path.stem)
        module_name = f"{LOADED_PREFIX}.{stem}_{digest}"
    with _lock:
        if module_name in sys.modules:
            return sys.modules[module_name]
        _ensure_prefix_package()
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise LoadError(f"fp4gen.load: cannot import {path}")
        mod = importlib.util.module_from_spec(spec)
        # registered before executing: dataclasses, pickling and CuTe DSL's
        # source inspection look the module up by name
        sys.modules[module_name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        return mod


def _ensure_prefix_package() -> None:
    if LOADED_PREFIX not in sys.modules:
        pkg = ModuleType(LOADED_PREFIX)
        pkg.__path__ = []  # a namespace-like parent with no files of its own
        sys.modules[LOADED_PREFIX] = pkg


# ---------------------------------------------------------------------------
# .attn specs


def _specs_from_parse(result) -> list:
    """The front end may return one KernelSpec, a sequence, or an object holding them."""
    if isinstance(result, (list, tuple)):
        return list(result)
    for attr in ("kernels", "specs"):
        if hasattr(result, attr):
            val = getattr(result, attr)
            return list(val.values()) if isinstance(val, dict) else list(val)
    return [result]


def _load_spec(path: Path, kernel: Optional[str], target: Optional[str]) -> ModuleType:
    # The compiler is imported here, not at module level (see module docstring).
    from fp4gen.frontend import parse_file
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.ir.spec import Target
    from fp4gen.lowering import module_name, render

    spec_text = path.read_text()
    specs = _specs_from_parse(parse_file(str(path)))
    if not specs:
        raise LoadError(f"fp4gen.load: {path} defines no attention kernel")
    if kernel is None:
        if len(specs) > 1:
            names = ", ".join(s.name for s in specs)
            raise LoadError(f"fp4gen.load: {path} defines several kernels ({names}); pass kernel=NAME")
        spec = specs[0]
    else:
        found = [s for s in specs if s.name == kernel]
        if not found:
            names = ", ".join(s.name for s in specs)
            raise LoadError(f"fp4gen.load: {path} has no kernel {kernel!r}; it defines: {names}")
        spec = found[0]
    if target is not None:
        try:
            tgt = Target(_norm_target(target))
        except ValueError:
            known = ", ".join(t.value for t in Target)
            raise LoadError(f"fp4gen.load: unknown target {target!r}; known targets: {known}") from None
        spec = spec.with_target(tgt)
    tname = spec.target.value

    key = _cache.module_key(spec_text, spec.name, tname)
    cached = _cache.lookup_module(key, spec.name, tname)
    if cached is None:
        source = render(plan_kernel(spec))
        cached = _cache.store_module(key, spec.name, tname, source)
    mod = _import_file(cached, module_name=f"{LOADED_PREFIX}.{module_name(spec.name, tname)}_{key[:16]}")
    return _checked(mod, None, None, origin=f"{path} ({spec.name}, {tname})")
