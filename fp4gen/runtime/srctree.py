"""Import fp4gen from a source checkout that is not pip-installed (e.g. on the GPU machine).

``pyproject.toml`` maps ``ir/``, ``cli/``, ``generated/`` and ``templates/``
into the ``fp4gen`` namespace; plain ``sys.path`` manipulation cannot express
that. ``use_source_tree(root)`` registers those packages by hand, once, when
``fp4gen.ir`` is not importable already.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

MAPPED = ("ir", "cli", "generated", "templates")


def use_source_tree(root) -> None:
    root = Path(root).resolve()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import fp4gen  # noqa: F401  (the fp4gen/ folder itself is a plain package)

    for sub in MAPPED:
        name = f"fp4gen.{sub}"
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        init = root / sub / "__init__.py"
        if not init.is_file():
            continue
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(root / sub)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(sys.modules["fp4gen"], sub, mod)
