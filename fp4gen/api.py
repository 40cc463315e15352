"""``fp4gen.load``: a kernel module from a ``.attn`` spec (parsed, planned, rendered, cached)
or from anything ``fp4gen.runtime.load`` takes.

The one layer that imports both the compiler and the runtime: the runtime itself imports no
compiler stage, because generated kernels import it where only torch and CuTe DSL exist.
The cache entry checks (header, module contract) are the runtime's (``runtime/loader.py``,
``runtime/cache.py``); compiling on a miss is this module's.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional, Union

from fp4gen.frontend import parse_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.spec import Target
from fp4gen.lowering import module_name, render
from fp4gen.runtime import cache, fileio, loader
from fp4gen.runtime.loader import LoadError

__all__ = ["load", "LoadError"]


def load(spec_or_module: Union[str, os.PathLike, ModuleType], *, kernel: Optional[str] = None,
         target: Optional[str] = None) -> ModuleType:
    """Return an imported generated-kernel module.

    ``spec_or_module`` is a path to a ``.attn`` spec (compiled; the module source cached on
    disk, see ``fp4gen.runtime.cache``; ``kernel`` picks one ``attention`` block when the file
    has several, ``target`` (``"sm90a"``, ``"sm100a"``, ``"reference"``) overrides the spec's),
    or what ``fp4gen.runtime.load`` takes: a generated ``.py`` path, a module name under
    ``fp4gen.generated`` or a module.
    """
    if isinstance(spec_or_module, (str, os.PathLike)):
        text = os.fspath(spec_or_module)
        path = Path(text).expanduser()
        if path.suffix == ".attn":
            if not path.exists():
                raise LoadError(f"fp4gen.load: spec file {text!r} does not exist")
            return _load_spec(path, loader._read_input(path, "spec"), kernel, target)
    return loader.load(spec_or_module, kernel=kernel, target=target)


def _specs_from_parse(result) -> list:
    """The front end may return one KernelSpec, a sequence, or an object holding them."""
    if isinstance(result, (list, tuple)):
        return list(result)
    for attr in ("kernels", "specs"):
        if hasattr(result, attr):
            val = getattr(result, attr)
            return list(val.values()) if isinstance(val, dict) else list(val)
    return [result]


def _load_spec(path: Path, spec_text: str, kernel: Optional[str], target: Optional[str]) -> ModuleType:
    # parse the very text the cache key hashes (reading the file twice could pair two versions)
    specs = _specs_from_parse(parse_text(spec_text, filename=str(path)))
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
            tgt = Target(loader._norm_target(target))
        except ValueError:
            known = ", ".join(t.value for t in Target)
            raise LoadError(f"fp4gen.load: unknown target {target!r}; known targets: {known}") from None
        spec = spec.with_target(tgt)
    tname = spec.target.value

    key = cache.module_key(spec_text, spec.name, tname)
    name = f"{loader.LOADED_PREFIX}.{module_name(spec.name, tname)}_{key[:16]}"
    mod = sys.modules.get(name)
    if mod is None:
        mod = loader._exec_module(name, *_module_source(spec, tname, key))
    return loader._checked(mod, None, None, origin=f"{path} ({spec.name}, {tname})")


def _module_source(spec, tname: str, key: str) -> tuple[str, str]:
    """(file name, text) of the generated module: the cache entry if it passes every
    check, else a fresh render, stored when the cache can be written."""
    path = cache.module_path(key, spec.name, tname)
    try:
        text = cache.read_module(key, spec.name, tname)
        if text is not None:
            loader._check_contract(path, text, spec, tname)
            return str(path), text
    except cache.CacheEntryError as e:
        loader._warn(f"fp4gen cache: discarding {e}; rebuilding it")
        cache.discard_entry(path)
    except OSError:
        pass  # the cache cannot be read: rebuild; storing below says why it cannot be used
    source = render(plan_kernel(spec))
    try:
        filename = str(cache.store_module(key, spec.name, tname, source))
    except (OSError, fileio.OutputFileError) as e:
        loader._warn(f"fp4gen cache: cannot write {path} ({e}); using the module from memory, uncached")
        filename = f"<fp4gen: {path.name}, not cached>"
    return filename, cache.module_text(key, source)


