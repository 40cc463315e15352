"""Diagnostics: clang-style error messages for spec files.

A ``Diagnostic`` renders as::

    examples/bad.attn:7:7: error: unknown format 'nvfp5'
        Q : nvfp5
            ^~~~~
    hint: did you mean 'nvfp4'?

This module imports nothing heavy (no lark), so the CLI and the planner's
error path can use it freely.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from fp4gen.ir.spec import SourceLoc


@dataclass(frozen=True)
class Note:
    """A secondary message, optionally pointing somewhere ("first defined here")."""

    message: str
    loc: Optional[SourceLoc] = None
    span: int = 1


NoteLike = Union[Note, str]


@dataclass(frozen=True)
class Diagnostic:
    loc: Optional[SourceLoc]
    message: str
    notes: tuple = ()
    hint: Optional[str] = None
    # how many columns the caret line underlines (^~~~)
    span: int = 1
    severity: str = "error"

    def render(self, source_lines: Sequence[str] = ()) -> str:
        """``file:line:col: error: msg``, the source line, a caret, notes and hint."""
        out = [_header(self.loc, self.severity, self.message)]
        out += _excerpt(self.loc, self.span, source_lines)
        for n in self.notes:
            if isinstance(n, Note):
                out.append(_header(n.loc, "note", n.message))
                out += _excerpt(n.loc, n.span, source_lines)
            else:
                out.append(f"note: {n}")
        if self.hint:
            out.append(f"hint: {self.hint}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.render()


def _header(loc: Optional[SourceLoc], severity: str, message: str) -> str:
    return f"{loc}: {severity}: {message}" if loc is not None else f"{severity}: {message}"


def _excerpt(loc: Optional[SourceLoc], span: int, lines: Sequence[str]) -> list[str]:
    if loc is None or not (0 < loc.line <= len(lines)):
        return []
    text = lines[loc.line - 1].rstrip("\r\n")
    # Keep tabs in the caret line so the caret stays under the right character.
    pad = "".join("\t" if ch == "\t" else " " for ch in text[: max(loc.col - 1, 0)])
    width = max(1, min(span, max(len(text) - loc.col + 1, 1)))
    return ["    " + text, "    " + pad + "^" + "~" * (width - 1)]


class SpecError(Exception):
    """One or more diagnostics for a spec file (syntax, values, or planning)."""

    def __init__(self, diagnostics: Iterable[Diagnostic], source_lines: Sequence[str] = ()):
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        self.source_lines: tuple[str, ...] = tuple(source_lines)
        first = self.diagnostics[0] if self.diagnostics else None
        super().__init__(first.render() if first else "spec error")

    def render(self) -> str:
        """Every diagnostic, each with its source excerpt, separated by blank-free lines."""
        text = "\n".join(d.render(self.source_lines) for d in self.diagnostics)
        n = len(self.diagnostics)
        if n > 1:
            text += f"\n{n} errors"
        return text


def did_you_mean(word: str, choices: Iterable[str]) -> Optional[str]:
    """'did you mean 'x'?' for the closest choice, or None when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered and lowered[word.lower()] != word:
        return f"did you mean '{lowered[word.lower()]}'?"
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = [lowered[c] for c in difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)]
    return f"did you mean '{close[0]}'?" if close else None


def one_of(choices: Iterable[str]) -> str:
    """'a, b or c' for messages."""
    items = [f"'{c}'" for c in choices]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


# ---------------------------------------------------------------------------- planner errors
# The planner reports PlanError(message, loc, notes); shown to users as spec diagnostics.

def _note(n) -> "Note | str":
    """Planner notes may be strings, (message, loc) pairs or objects with .message/.loc."""
    if isinstance(n, (Note, str)):
        return n
    if isinstance(n, tuple) and len(n) == 2:
        a, b = n
        if isinstance(a, SourceLoc):
            a, b = b, a
        return Note(str(a), b if isinstance(b, SourceLoc) else None)
    msg = getattr(n, "message", None)
    if msg is not None:
        loc = getattr(n, "loc", None)
        return Note(str(msg), loc if isinstance(loc, SourceLoc) else None)
    return str(n)


def plan_error_to_spec_error(err, spec) -> SpecError:
    """A planner ``PlanError`` rendered like a spec diagnostic (file:line:col + caret)."""
    notes = tuple(_note(n) for n in (getattr(err, "notes", None) or ()))
    return kernel_error(spec, getattr(err, "message", None) or str(err), getattr(err, "loc", None),
                        notes, getattr(err, "hint", None))


def kernel_error(spec, message: str, loc=None, notes=(), hint=None) -> SpecError:
    """An error about one kernel of a spec (the planner's or a backend's), at ``loc`` if given."""
    span = 1
    if isinstance(loc, SourceLoc) and 0 < loc.line <= len(spec.source_lines):
        # underline the word the planner points at
        rest = spec.source_lines[loc.line - 1][loc.col - 1:]
        word = rest.split()[0] if rest.split() else ""
        span = max(1, len(word.split("(")[0]))
    prefix = f"kernel '{spec.name}' ({spec.target.value}): "
    return SpecError([Diagnostic(loc if isinstance(loc, SourceLoc) else None, prefix + message, notes, hint, span)],
                     spec.source_lines)
