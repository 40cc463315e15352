"""Spec text -> parse tree (lark, LALR), with syntax errors as diagnostics.

Recovery: after a syntax error, the statement holding it is blanked (its
braces kept, so the block structure stays as written) and the text parsed
again, so independent syntax errors are all reported in one run. Recovery
stops at errors that break the structure (a missing '{' or '}', end of file).
A kernel whose lines held a syntax error is not checked further (its missing
fields would only be noise); the other kernels of the file are.
"""
from __future__ import annotations

import functools
import re
from importlib import resources

import lark
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from fp4gen.ir.spec import SourceLoc

from .diagnostics import Diagnostic, Note, did_you_mean

MAX_SYNTAX_ERRORS = 20


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    grammar = resources.files(__package__).joinpath("attn.lark").read_text(encoding="utf-8")
    return lark.Lark(grammar, parser="lalr", lexer="contextual", propagate_positions=True,
                     maybe_placeholders=True)


def split_lines(text: str) -> list[str]:
    """Source lines numbered the way lark numbers them (only '\\n' ends a line)."""
    return [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]


# Friendly names of the terminals that have no literal spelling.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "SIGNED_NUMBER": "a number",
    "_NL": "end of line",
    "$END": "end of file",
    "TIMES": "'x'",
}


@functools.lru_cache(maxsize=None)
def _literal(term: str):
    """The literal text of an anonymous string terminal ('target', '{'), else None."""
    for t in _parser().terminals:
        if t.name == term and t.pattern.type == "str":
            return t.pattern.value
    return None


def _describe_expected(expected) -> tuple[str, list[str]]:
    """('a name, '=' or ')'', [keyword literals]) for an expected-terminal set."""
    words, keywords = [], []
    for term in sorted(expected):
        if term in _TERMINAL_WORDS:
            words.append(_TERMINAL_WORDS[term].strip("'") if term == "TIMES" else _TERMINAL_WORDS[term])
            continue
        lit = _literal(term)
        if lit is None:
            continue
        if re.fullmatch(r"[A-Za-z_]\w*", lit):
            keywords.append(lit)
        words.append(lit)
    def quote(w: str) -> str:
        return w if w.startswith(("a ", "an ", "end ")) else f"'{w}'"

    def join(items: list[str]) -> str:
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]

    # Statement starts accept every keyword of the block plus NAME: say so briefly.
    if "NAME" in expected and len(keywords) >= 3:
        rest = [quote(w) for w in words if w not in keywords and w != "a name"]
        desc = "a statement (" + ", ".join(f"'{k}'" for k in keywords) + ", or an operand like 'Q : bf16')"
        return join([desc] + rest), keywords
    return join([quote(w) for w in words] or ["something else"]), keywords


def _describe_token(tok) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    if tok.type == "NAME":
        return f"name '{tok.value}'"
    if tok.type in ("INT", "SIGNED_NUMBER"):
        return f"number '{tok.value}'"
    return f"'{tok.value}'"


def _unclosed_braces(text: str, filename: str) -> list[SourceLoc]:
    """Positions of '{' that no '}' closes (comments skipped)."""
    stack = []
    for ln, line in enumerate(split_lines(text), 1):
        code = line.split("#", 1)[0]
        for col, ch in enumerate(code, 1):
            if ch == "{":
                stack.append(SourceLoc(filename, ln, col))
            elif ch == "}" and stack:
                stack.pop()
    return stack


def misplaced_keyword(word: str, expected=()) -> str:
    from .builder import BLOCK_HOME, KERNEL_KEYWORDS

    if word == "attention":
        return "kernels cannot be nested: is a '}' missing above?"
    if word in BLOCK_HOME:
        return f"'{word}' belongs in a {BLOCK_HOME[word]} {{ }} block"
    if word in KERNEL_KEYWORDS:
        return f"'{word}' belongs directly in the attention block"
    if word == "via":
        return "'via' follows P's format, as in 'P : mxfp4 via direct_p'"
    if word == "cols":
        return "'cols' is used in a tmem block, as in 'S0 cols 0..127'"
    return f"'{word}' is a keyword and cannot be used here"


def _syntax_diagnostic(e: UnexpectedInput, text: str, filename: str) -> Diagnostic:
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        loc = SourceLoc(filename, e.line, e.column)
        if ch == "." and re.match(r"\.\d", text[e.pos_in_stream:]):
            return Diagnostic(loc, "a number needs a digit before the decimal point",
                              hint=f"write 0{text[e.pos_in_stream:e.pos_in_stream + 4].split()[0]}")
        shown = repr(ch)[1:-1] if ch else "end of file"
        return Diagnostic(loc, f"unexpected character '{shown}'")
    if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
        lines = split_lines(text)
        last = len(lines)
        while last > 1 and not lines[last - 1].strip():
            last -= 1
        loc = SourceLoc(filename, last, len(lines[last - 1]) + 1)
        notes = tuple(Note("this '{' is never closed", b) for b in _unclosed_braces(text, filename)[-1:])
        expected = getattr(e, "expected", None) or ()
        want = "'}'" if not expected or "RBRACE" in expected else _describe_expected(expected)[0]
        return Diagnostic(loc, f"unexpected end of file; expected {want}", notes=notes)
    assert isinstance(e, UnexpectedToken)
    tok = e.token
    loc = SourceLoc(filename, tok.line, tok.column)
    span = len(tok.value) if tok.type not in ("_NL", "$END") else 1
    if tok.type not in ("NAME", "_NL") and re.fullmatch(r"[A-Za-z_]\w*", tok.value) and "NAME" in e.expected:
        # A keyword of another block: LALR lookahead merging lets the lexer
        # see it as a keyword here, so the builder never gets to say this.
        return Diagnostic(loc, misplaced_keyword(tok.value, e.expected), span=span)
    if "RBRACE" in e.expected and tok.type == "$END":
        return Diagnostic(loc, "unexpected end of file; expected '}'")
    if "ATTENTION" in e.expected and tok.type == "RBRACE":
        return Diagnostic(loc, "unmatched '}'", hint="is there one '}' too many, or a '{' missing above?")
    if "ATTENTION" in e.expected:  # between kernels only 'attention' may start something
        return Diagnostic(loc, f"unexpected {_describe_token(tok)}; expected 'attention'", span=span,
                          hint="a kernel starts with 'attention NAME {'")
    want, keywords = _describe_expected(e.expected)
    hint = None
    if tok.type == "NAME" and keywords:
        hint = did_you_mean(tok.value, keywords)
    starts_statement = tok.type == "NAME" or (
        re.fullmatch(r"[A-Za-z_]\w*", str(tok.value)) is not None and tok.type != "_NL")
    if hint is None and "_NL" in e.expected and starts_statement:
        hint = "put each statement on its own line, or separate statements with ';'"
    if tok.type == "RBRACE" and "RPAR" in e.expected:
        hint = "a '(' on this line is not closed"
    return Diagnostic(loc, f"unexpected {_describe_token(tok)}; expected {want}", hint=hint, span=span)


def _blank_segment(line: str, col: int):
    """``line`` with the statement at column ``col`` blanked out, or None if there is none.

    A statement is bounded by ';', '{', '}' or the ends of the line. Braces are
    never blanked, so the file's block structure stays as written.
    """
    code = line.split("#", 1)[0]
    i = min(max(col - 1, 0), len(code))
    lo = max(code.rfind(c, 0, i) for c in ";{}") + 1
    if i < len(code) and code[i] == "}":
        hi = i  # the statement before this '}' was cut short
    elif i < len(code) and code[i] == "{":
        return None
    else:
        ends = [j for j in (code.find(c, i) for c in ";{}") if j >= 0]
        hi = min(ends) if ends else len(code)
        if hi < len(code) and code[hi] == "{":
            return None  # a broken block header: its body would only add noise
    if not code[lo:hi].strip():
        return None
    return line[:lo] + " " * (hi - lo) + line[hi:]


def parse_tree(text: str, filename: str):
    """Parse ``text``; returns (tree or None, syntax diagnostics, set of errored lines)."""
    diags: list[Diagnostic] = []
    bad_lines: set[int] = set()
    work = text
    while True:
        try:
            tree = _parser().parse(work)
            return tree, diags, bad_lines
        except UnexpectedInput as e:
            d = _syntax_diagnostic(e, work, filename)
            diags.append(d)
            line = d.loc.line if d.loc else 0
            bad_lines.add(line)
            at_eof = isinstance(e, UnexpectedEOF) or (
                isinstance(e, UnexpectedToken) and e.token.type == "$END")
            lines = work.split("\n")
            if at_eof or not (0 < line <= len(lines)) or len(diags) >= MAX_SYNTAX_ERRORS:
                return None, diags, bad_lines
            if isinstance(e, UnexpectedToken) and "LBRACE" in e.expected and "NAME" not in e.expected:
                # a block header without its '{': every line of the body would be an error
                return None, diags, bad_lines
            # Blank the offending statement and parse again to find independent errors.
            fixed = _blank_segment(lines[line - 1], d.loc.col)
            if fixed is None or fixed == lines[line - 1]:
                return None, diags, bad_lines
            lines[line - 1] = fixed
            work = "\n".join(lines)
