"""The front end: spec text (*.attn) -> ``fp4gen.ir.spec.KernelSpec`` values.

    >>> from fp4gen.frontend import parse_text
    >>> [k.name for k in parse_text("attention a { target reference; head_dim 64 }")]
    ['a']

Errors raise ``SpecError``; its ``diagnostics`` list holds one ``Diagnostic``
per problem (``file:line:col``, message, notes, hint) and ``render()`` gives
the clang-style text the CLI prints.
"""
from __future__ import annotations

import os

from fp4gen.ir.spec import KernelSpec, SourceLoc

from .diagnostics import Diagnostic, Note, SpecError, did_you_mean

__all__ = ["parse_file", "parse_text", "SpecError", "Diagnostic", "Note", "did_you_mean"]


def parse_text(text: str, filename: str = "<string>") -> list[KernelSpec]:
    """Every kernel in ``text``, in file order; raises ``SpecError`` listing all problems."""
    from .builder import build_specs
    from .parser import parse_tree, split_lines

    lines = tuple(split_lines(text))
    tree, diags, bad_lines = parse_tree(text, filename)
    specs: list[KernelSpec] = []
    if tree is not None:
        specs, more = build_specs(tree, filename, lines, frozenset(bad_lines))
        diags = diags + more
        if not specs and not diags and not tree.children:
            diags.append(Diagnostic(SourceLoc(filename, 1, 1), "no kernels in this file",
                                    hint="a spec starts with 'attention NAME { ... }'"))
    if diags:
        diags.sort(key=lambda d: (d.loc.line, d.loc.col) if d.loc else (0, 0))
        raise SpecError(diags, lines)
    return specs


def parse_file(path: "str | os.PathLike[str]") -> list[KernelSpec]:
    """Read and parse one spec file. ``OSError``/``UnicodeDecodeError`` propagate for bad paths."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return parse_text(text, filename=path)
