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
import re

from fp4gen.ir.spec import KernelSpec, SourceLoc

from .diagnostics import Diagnostic, Note, SpecError, did_you_mean

__all__ = ["parse_file", "parse_text", "SpecError", "Diagnostic", "Note", "did_you_mean"]

# Control characters other than tab, newline and carriage return. The grammar would skip them
# in comments, and a NUL copied from a comment into a generated module's docstring makes the
# module fail to import; they are never meant, so they are refused wherever they are.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f-\x9f]")


def parse_text(text: str, filename: str = "<string>") -> list[KernelSpec]:
    """Every kernel in ``text``, in file order; raises ``SpecError`` listing all problems."""
    from .builder import build_specs
    from .parser import parse_tree, split_lines

    lines = tuple(split_lines(text))
    bad = _CONTROL.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        col = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
        d = Diagnostic(SourceLoc(filename, line, col), f"control character U+{ord(bad.group()):04X} in the spec",
                       hint="remove it: a spec is text, with tabs, newlines and carriage returns only")
        # the excerpt shows the character as U+FFFD, so that it does not reach the terminal
        raise SpecError([d], tuple(_CONTROL.sub("\ufffd", ln) for ln in lines))
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
    """Read and parse one spec file. A path that is not a readable UTF-8 text file (missing, a
    directory, a device, binary, over 4 MiB) raises ``fp4gen.runtime.fileio.InputFileError``
    (a ``ValueError`` naming the file)."""
    from fp4gen.runtime.fileio import read_text_file

    path = os.fspath(path)
    return parse_text(read_text_file(path), filename=path)
