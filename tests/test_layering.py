"""Imports go one way (issue 17): each package imports only its own layer and those below.

Every ``import`` of an fp4gen module in fp4gen/, ir/ and cli/ counts, inside functions too
(a lazy import is still a dependency). The root package ``fp4gen`` itself may be imported
from anywhere: Python imports it as the parent of every submodule, and its ``__init__``
imports nothing eagerly.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"fp4gen": "fp4gen", "ir": "fp4gen.ir", "cli": "fp4gen.cli"}  # pyproject's package-dir

# lowest first; a module may import its own layer and any layer before it
LAYERS = [
    ("ir data", ("fp4gen.ir.spec", "fp4gen.ir.plan", "fp4gen.ir.serialize", "fp4gen.ir")),
    ("numerics (the oracle)", ("fp4gen.numerics",)),
    ("runtime (what generated kernels import)", ("fp4gen.runtime",)),
    ("device (CuTe DSL helpers)", ("fp4gen.device",)),
    ("front end", ("fp4gen.frontend",)),
    ("planner", ("fp4gen.ir.passes",)),
    ("plan dumps", ("fp4gen.ir.dump",)),
    ("lowering", ("fp4gen.lowering",)),
    ("drivers", ("fp4gen.driver", "fp4gen.api", "fp4gen.selftest")),
    ("torch op", ("fp4gen.torch_ops",)),
    # context parallelism runs torch_ops' per-block ops over torch.distributed and nothing in
    # the library builds on it: its own layer above torch_ops, so that torch_ops (or anything
    # below) importing it is an upward import, not a sideways one the test would let through
    ("context parallel", ("fp4gen.parallel",)),
    ("command line", ("fp4gen.cli",)),
]


def layer_of(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py: add it")
    return best[0]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = FOLDERS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_of(p) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}


def imports():
    """(importer, imported, file:line) for every fp4gen import in the source tree."""
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            mod = module_of(path)
            package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                targets = []
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = package.split(".")[: len(package.split(".")) - node.level + 1]
                        source = ".".join(base + ([node.module] if node.module else []))
                    else:
                        source = node.module or ""
                    # `from pkg import mod` depends on pkg.mod, not on pkg's __init__
                    targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                               for a in node.names]
                for t in targets:
                    if t.startswith("fp4gen") and t != "fp4gen":
                        yield mod, t, f"{path.relative_to(ROOT)}:{node.lineno}"


def test_every_import_goes_down_or_sideways():
    bad = [f"{where}: {a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
           for a, b, where in imports() if a != "fp4gen" and layer_of(b) > layer_of(a)]
    assert bad == [], "\n".join(bad)


def test_no_two_modules_import_each_other():
    edges = {}
    for a, b, where in imports():
        edges.setdefault(a, {})[b] = where
    cycles = [f"{a} <-> {b} ({edges[a][b]}, {edges[b][a]})"
              for a in edges for b in edges[a] if a < b and a in edges.get(b, {})]
    assert cycles == [], "\n".join(cycles)


@pytest.mark.parametrize("importer, imported", [
    ("fp4gen.runtime.loader", "fp4gen.lowering"),  # the planted faults the checks must catch
    ("fp4gen.numerics.reference", "fp4gen.ir.passes"),
    ("fp4gen.torch_ops", "fp4gen.parallel"),
])
def test_an_upward_import_is_caught(importer, imported):
    assert layer_of(imported) > layer_of(importer)
