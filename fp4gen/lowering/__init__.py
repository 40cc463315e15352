"""Lowering: a finished ``KernelPlan`` -> the source text of one Python module.

One module per (kernel, target). The backends live beside this file:

- ``reference.py``: a module that runs the spec through ``fp4gen.numerics.reference``.
- ``sm90.py``: a CuTe DSL Hopper kernel rendered from ``templates/sm90/``.
- ``sm100.py``: a CuTe DSL Blackwell kernel rendered from ``templates/sm100/``.

Each backend exposes ``render(plan) -> str``. The renderer makes no decision the
plan did not record; it only turns plan fields into a jinja2 context.

The contract every generated module keeps (tests and ``fp4gen.load`` rely on it):

- ``KERNEL_NAME: str``, ``TARGET: str`` (``"sm90a"``, ``"sm100a"``, ``"reference"``),
  ``SPEC_FILE: str``, ``PLAN_JSON: str`` (the plan it was rendered from, ``plan_json``: the
  ``fp4gen.plan/1`` schema on several lines; ``fp4gen.ir.serialize.spec_from_plan_json`` reads
  the spec back from it).
- ``forward(q, k, v, *, softmax_scale=None, return_lse=False)`` with torch tensors
  ``q: (B, Sq, H, D)``, ``k, v: (B, Sk, Hkv, D)`` (``H % Hkv == 0``); returns ``o``
  ``(B, Sq, H, D)`` or ``(o, lse)`` with ``lse: (B, H, Sq)`` float32 (natural log).
- ``backward(q, k, v, o, lse, do, *, softmax_scale=None)`` -> ``(dq, dk, dv)``, only when
  the spec has a backward block (otherwise the name is absent).
- ``compile_only(arch: str) -> list[str]`` (CuTe DSL targets only): compiles every
  kernel variant for ``arch`` (``"sm_90a"``/``"sm_100a"``) without a GPU and returns
  the names compiled. CI calls it for every generated module.
- Generated modules import torch, CuTe DSL and ``fp4gen.runtime`` / ``fp4gen.numerics``
  / ``fp4gen.device`` only: never the front end, the IR passes, lark or jinja2.

Spec text never becomes code. Every ``{{ }}`` goes through one ``finalize``
(``template_env``): numbers and bools as their repr, ``Code`` (fragments the lowering
built) as is, ``Comment`` (spec lines, paths, names, planner prose) escaped onto one
line that can close neither a comment nor a docstring, ``| pyrepr`` for Python
literals (``| pyrepr_lines`` for a long text: the same literal, one line of source per
line of text), and a plain ``str`` only when it is a quote-free one-line token. ``render``
then parses the module and checks that its shape does not depend on the spec's free
text (``check_shape``).
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import math
import re
from typing import Optional
from types import MappingProxyType

BACKENDS = {"reference": "reference", "sm90a": "sm90", "sm100a": "sm100"}
# a plan with a decode section (a kv_cache spec) renders with its target's decode backend
DECODE_BACKENDS = {"sm90a": "sm90_decode"}


def _backend(plan) -> "Optional[str]":
    target = plan.spec.target.value
    if getattr(plan, "decode", None) is not None and target in DECODE_BACKENDS:
        return DECODE_BACKENDS[target]
    return BACKENDS.get(target)


class LoweringError(Exception):
    """A plan that this backend cannot render. ``path`` names the spec field behind a refusal
    of what the user wrote (``"head_dim"``, ``"V"``, ...), so that ``fp4gen check`` and
    ``compile`` report it at that line; None for a plan the planner should not have made."""

    def __init__(self, message: str, path: Optional[str] = None):
        super().__init__(message)
        self.path = path


def refusal(plan) -> "Optional[LoweringError]":
    """What the backend of ``plan.spec.target`` would refuse, without rendering: its template
    contexts (forward, and backward when the plan has one). ``fp4gen check`` runs this so that
    check accepts exactly what compile accepts."""
    backend = _backend(plan)
    if backend is None or backend == "reference":
        return None
    mod = importlib.import_module(f"{__name__}.{backend}")
    if backend in DECODE_BACKENDS.values():
        try:
            mod.context(plan)
        except LoweringError as e:
            return e
        return None
    bwd = importlib.import_module(f"{__name__}.{backend}_bwd")
    try:
        mod.context(plan)
        if getattr(plan, "backward", None) is not None:
            bwd.context(plan)
    except LoweringError as e:
        return e
    return None


class Code(str):
    """A fragment of Python the lowering built from plan values (a literal, an identifier):
    templates paste it as is. Never wrap spec text in it."""


class Comment(str):
    """Free text for a ``#`` comment or a docstring (a spec line, a path, a kernel name,
    planner prose): rendered by ``comment_text``. ``| pyrepr`` gives its literal for code."""


# A plain str a template may paste: the words, numbers and punctuation of the code and prose
# fragments the lowering picks (", (tiled_mma_l, sOnes)", "kind::f8f6f4"). No quote, '#',
# backslash or line break, so it can neither open a string nor end a comment or a line.
PLAIN_TOKEN = re.compile(r"[\w ,.:;()\[\]{}+\-*/=<>^|~%!?@&]*", re.ASCII)


def comment_text(text: str) -> str:
    """``text`` on one line that cannot end a ``#`` comment or a docstring: every character
    that is not printable is written as its escape, which covers all line breaks (\\n \\r \\v
    \\f \\x1c-\\x1e \\x85 U+2028 U+2029), NUL, other controls, bidi overrides and lone
    surrogates; backslashes and double quotes are escaped (templates write docstrings in triple
    double quotes only, so a single quote stays as typed). A docstring's value reads back the text."""
    return "".join("\\" + c if c in "\\\"" else c if c.isprintable() else repr(c)[1:-1]
                   for c in text)


def _literal(value):
    """``value`` as a plain Python value whose repr is a literal, or a LoweringError."""
    if value is None or type(value) in (bool, int):
        return value
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, str) and not isinstance(value, enum.Enum):
        return str(value)  # the text itself, not a Comment/Code marker
    if type(value) in (tuple, list):
        return type(value)(_literal(v) for v in value)
    raise LoweringError(f"no Python literal for {type(value).__name__} {value!r:.80}")


def pyrepr(value) -> Code:
    """The template filter for literals in code: ``SPEC_FILE = {{ spec_file | pyrepr }}``.
    str (markers included), bool, int, finite float, None, tuples and lists of them; a str's
    repr escapes quotes, backslashes and every unprintable character, so it stays one literal."""
    return Code(repr(_literal(value)))


def pyrepr_lines(value) -> Code:
    """The literal of a str, written as one ``pyrepr`` literal per line of the text inside
    parentheses (``PLAN_JSON = {{ plan_json | pyrepr_lines }}``). Python joins adjacent
    literals when it parses, so the value, and the AST that ``check_shape`` compares, are
    those of ``| pyrepr``; a text of at most one line is rendered as ``| pyrepr``."""
    text = _literal(value)
    if not isinstance(text, str):
        raise LoweringError(f"pyrepr_lines takes a str, not {type(value).__name__}")
    pieces = re.findall(r"[^\n]*\n|[^\n]+", text)
    if len(pieces) <= 1:
        return pyrepr(text)
    return Code("(\n" + "".join(f"    {p!r}\n" for p in pieces) + ")")


def plan_json(plan) -> str:
    """A generated module's ``PLAN_JSON``: ``fp4gen.ir.dump.to_json(plan)`` (the
    ``fp4gen.plan/1`` schema) as ``fp4gen.ir.serialize.json_text``, for ``| pyrepr_lines``."""
    from fp4gen.ir.dump import to_json
    from fp4gen.ir.serialize import json_text

    return json_text(to_json(plan))


def finalize(value):
    """How every ``{{ }}`` renders (see the module docstring); anything else is an error, so
    a spec-derived value can reach a template only through ``Comment`` or ``| pyrepr``."""
    import jinja2

    if isinstance(value, Code):
        return value
    if isinstance(value, Comment):
        return comment_text(value)
    if isinstance(value, jinja2.Undefined):
        return str(value)  # "" for `{{ x if cond }}` when not cond; StrictUndefined raises
    if type(value) in (bool, int):
        return repr(value)
    if type(value) is float:
        if not math.isfinite(value):
            raise LoweringError(f"a template asks for the non-finite number {value!r}")
        return repr(value)
    if type(value) is str:
        if not PLAIN_TOKEN.fullmatch(value):
            raise LoweringError(f"a template interpolates the plain string {value!r:.80}: spec text must "
                                "be a Comment or go through | pyrepr, code built by the lowering a Code")
        return value
    raise LoweringError(f"a template interpolates {type(value).__name__} {value!r:.80}: "
                        "use | pyrepr, Comment or Code")


def identifier(name: str) -> Code:
    """``name`` as a Python identifier for generated code (class names built from the kernel
    name), or a LoweringError: the grammar only makes identifiers, but specs also come from Python."""
    if not (name.isascii() and name.isidentifier()):
        raise LoweringError(f"{name!r} is not a Python identifier")
    return Code(name)


@functools.lru_cache(maxsize=None)
def template_env(subdir: str):
    """The jinja2 environment every backend renders with: templates/<subdir>/, ``finalize``
    and ``pyrepr`` above, strict undefined names (a context key the template needs but the
    plan lacks is an error, never an empty string), block tags that leave no blank lines
    behind, ``pyrepr_lines`` for long literals. Cached: compiling the large templates costs more than rendering them."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("fp4gen.templates", subdir),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        finalize=finalize,
    )
    env.filters["pyrepr"] = pyrepr
    env.filters["pyrepr_lines"] = pyrepr_lines
    return env


def module_name(kernel_name: str, target: str) -> str:
    """File stem of the generated module for one kernel and target."""
    return f"{kernel_name}_{target}"


def render(plan) -> str:
    """Render the plan's generated module source for ``plan.spec.target``, checked by
    ``check_shape`` against the same plan with the spec's free text made neutral."""
    target = plan.spec.target.value
    backend = _backend(plan)
    if backend is None:
        raise LoweringError(f"no backend for target {target!r}; known: {', '.join(BACKENDS)}")
    try:
        mod = importlib.import_module(f"{__name__}.{backend}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{backend}":
            raise LoweringError(f"the {target} backend is not implemented yet") from None
        raise
    src = mod.render(plan)
    check_shape(src, mod.render(neutral_plan(plan)))
    return src


NEUTRAL_FILE = "spec.attn"


def neutral_plan(plan):
    """``plan`` with the spec's free text (its path, source lines and comments) replaced by a
    neutral placeholder; every value the planner decided on stays. The kernel name stays too:
    the grammar makes it an identifier and ``identifier`` checks it where it becomes code."""
    spec = plan.spec
    locs = {k: dataclasses.replace(loc, file=NEUTRAL_FILE) for k, loc in spec.locs.items()}
    return dataclasses.replace(plan, spec=dataclasses.replace(
        spec, source_file=NEUTRAL_FILE, locs=MappingProxyType(locs), source_lines=("",) * len(spec.source_lines)))


def module_shape(src: str) -> str:
    """The module's AST with every string constant blanked (comments are not in it). Parsed
    from UTF-8 bytes, as the importer reads the file, so a coding cookie takes effect here too."""
    tree = ast.parse(src.encode("utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


def check_shape(src: str, neutral_src: str) -> None:
    """A LoweringError unless ``src`` parses and has the AST shape of ``neutral_src``, the
    render of the same plan without spec text: injected text that changes the code (ends a
    comment or a docstring, adds a statement) is caught even if an escape was forgotten."""
    try:
        shape = module_shape(src)
    except (SyntaxError, ValueError, UnicodeError) as e:  # ValueError: NUL bytes
        raise LoweringError(f"internal error: the generated module does not parse: {e}") from None
    if shape != module_shape(neutral_src):
        raise LoweringError("internal error: the generated module's code depends on the spec's free text "
                            "(a spec-derived string reached a template unescaped)")
