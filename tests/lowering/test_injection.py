"""Spec text never becomes code (issue 15): comments, paths, kernel names and numbers from a
spec reach a generated module only as escaped comment text or as Python literals.

Rendering only (no CuTe compile). Each case renders a mutated example spec for its target,
then checks: the render succeeds or raises a clean user/lowering error; the module's AST shape
(string constants blanked) equals the unmutated spec's; importing the module runs no payload
(every payload tries to create a marker file, which must not exist afterwards).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4gen.frontend import parse_text
from fp4gen.frontend.diagnostics import SpecError
from fp4gen.ir.passes import PlanError, plan_kernel
from fp4gen.lowering import Code, LoweringError, module_shape, render
from fp4gen.lowering import sm90 as sm90_backend

ROOT = Path(__file__).resolve().parents[2]
CLEAN_ERRORS = (SpecError, PlanError, LoweringError)

# every character Python, str.splitlines or an editor reads as a line break, NUL, and the
# characters that end a string or a comment
BREAKS = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\x00"]
QUOTES = ["", "'", '"', "'''", '"""', "\\", '\\"""', "#", ")", "]}"]
SPECIALS = BREAKS + QUOTES + ["\t", "\ud800", "\u202e", "+AAo-", "coding:utf_7", "{{ x }}", "{%"]

# (example file, kernel, target to render it for): every target, with and without a backward
CASES = [
    ("sm90_fp8_directp_d128.attn", "sm90_fp8_directp_d128", "sm90a"),
    ("sm90_fp8_train_d128.attn", "sm90_fp8_train_causal_d128", "sm90a"),
    ("fa4_fp4_d128.attn", "fa4_fp4_d128", "sm100a"),  # backward refused: listed in the docstring
    ("sm100_bwd_d128.attn", "sm100_bwd_causal_d128", "sm100a"),
    ("sm90_fp8_directp_d128.attn", "sm90_fp8_directp_d128", "reference"),
    ("fa4_fp4_d128.attn", "fa4_fp4_d128", "reference"),
]
CASE_IDS = [f"{kernel}-{target}" for _, kernel, target in CASES]
_module_ids = itertools.count()


def kernel_lines(example: str, kernel: str, target: str) -> list[str]:
    """The lines of one kernel block of an example, retargeted."""
    lines = (ROOT / "examples" / example).read_text().splitlines()
    start = lines.index(f"attention {kernel} {{")
    block = lines[start:lines.index("}", start) + 1]
    return [re.sub(r"^(\s*target\s+)\w+", rf"\g<1>{target}", ln) for ln in block]


def shape(src: str) -> str:
    """module_shape with the class names built from the kernel name made neutral."""
    return re.sub(r"'\w*(Sm90(?:Fwd|Bwd))'", r"'K\1'", module_shape(src))


def render_text(text: str, path: str = "spec.attn"):
    """(spec, module source) of the one kernel in ``text``."""
    (spec,) = parse_text(text, filename=path)
    return spec, render(plan_kernel(spec))


def import_module(src: str, tmp_path: Path):
    """Import ``src`` from a file, as ``fp4gen.load`` does (bytes, so a coding cookie counts)."""
    path = tmp_path / f"gen_{next(_module_ids)}.py"
    path.write_bytes(src.encode("utf-8"))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def payload_code(marker: Path) -> str:
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


def attacks(marker: Path):
    """Text that would run ``payload_code`` if it closed its comment, docstring or string."""
    code = payload_code(marker)
    return st.builds(lambda q, b, pre, post: f"{pre}{q}{b}{code}{b}{q}{post}", st.sampled_from(QUOTES),
                     st.sampled_from(BREAKS + [";", " "]), noise(), noise())


def noise():
    """Any Unicode, with the special characters and strings above drawn often."""
    return st.lists(st.one_of(st.characters(), st.sampled_from(SPECIALS)), max_size=8).map("".join)


@functools.cache
def base(case):
    """(lines, spec, module shape) of the unmutated kernel."""
    lines = kernel_lines(*case)
    spec, src = render_text("\n".join(lines) + "\n")
    return lines, spec, shape(src)


def check(text: str, path: str, case, tmp_path: Path, marker: Path, same_spec: bool = True):
    """Render the mutated ``text``; a clean error is fine, a module must keep the base's shape
    (when the mutation left the spec's meaning alone) and import without running the payload."""
    try:
        spec, src = render_text(text, path)
    except CLEAN_ERRORS as e:
        assert "internal error" not in str(e)  # render's own checks (parse, shape) must never fire
        return None
    _, base_spec, base_shape = base(case)
    if same_spec and dataclasses.replace(spec, source_file=base_spec.source_file, name=base_spec.name) == base_spec:
        assert shape(src) == base_shape
    import_module(src, tmp_path)
    assert not marker.exists(), "spec text ran as code"
    return src


FUZZ = settings(max_examples=8, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@FUZZ
@given(data=st.data())
def test_comments_on_every_line(case, tmp_path, data):
    marker = tmp_path / "OWNED"
    lines = base(case)[0]
    comments = data.draw(st.lists(st.one_of(st.none(), attacks(marker), noise()),
                                  min_size=len(lines), max_size=len(lines)))
    text = "\n".join(ln if c is None else f"{ln}  # {c}" for ln, c in zip(lines, comments)) + "\n"
    check(text, "spec.attn", case, tmp_path, marker)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@FUZZ
@given(data=st.data())
def test_spec_path(case, tmp_path, data):
    marker = tmp_path / "OWNED"
    path = data.draw(st.one_of(attacks(marker), noise()))
    src = check("\n".join(base(case)[0]) + "\n", path, case, tmp_path, marker)
    assert src is not None, "a path never makes a valid spec invalid"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@FUZZ
@given(name=st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,16}", fullmatch=True),
                      st.sampled_from(["None", "class", "_", "__import__", "KERNEL_NAME", "forward", "os"])))
def test_kernel_name(case, tmp_path, name):
    lines = base(case)[0]
    text = "\n".join([re.sub(r"^attention \w+", f"attention {name}", lines[0])] + lines[1:]) + "\n"
    check(text, "spec.attn", case, tmp_path, tmp_path / "OWNED")


NUMBER_FIELDS = [r"(head_dim\s+)\d+", r"(a=)[\d.]+", r"(b=)[\d.]+", r"(m=)\d+", r"(l=)\d+", r"(tile\s+)\d+",
                 r"(scale\s+)auto", r"(block=)\d+", r"(q_stages\s+)\d+"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@FUZZ
@given(data=st.data())
def test_numeric_fields(case, tmp_path, data):
    """Numbers the grammar accepts (and some it does not) in every numeric field: a clean
    error or a module whose literals are finite and whose import runs nothing."""
    text = "\n".join(base(case)[0]) + "\n"
    number = st.one_of(st.integers(-2 ** 70, 2 ** 70).map(str), st.floats().map(repr),
                       st.sampled_from(["1e999", "-1e999", "0", "-0.0", "1e-320", "9" * 400, "nan", "0x10", "1_0"]))
    for field in NUMBER_FIELDS:
        if data.draw(st.booleans()):
            text = re.sub(field, lambda m: m.group(1) + data.draw(number), text, count=1)
    check(text, "spec.attn", case, tmp_path, tmp_path / "OWNED", same_spec=False)


# ---- the reported vectors -------------------------------------------------------------

def test_triple_quote_comment_does_not_run(tmp_path, monkeypatch):
    """The issue's spec: a docstring-closing comment on the mask line, loaded with fp4gen.load."""
    import fp4gen

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "inj.attn").write_text(
        'attention inj_a {\n  target sm90a\n  head_dim 128\n'
        '  mask causal   # """;__import__("os").system("touch OWNED");"""\n'
        '  schedule { tile 128 x 128 }\n}\n')
    mod = fp4gen.load("inj.attn")
    assert mod.KERNEL_NAME == "inj_a"
    assert '"""' in mod.__doc__  # the docstring quotes the comment as written
    assert not (tmp_path / "OWNED").exists()


@pytest.mark.parametrize("vector", ["newline", "quotes", "coding"])
@pytest.mark.parametrize("target", ["sm90a", "sm100a", "reference"])
def test_spec_path_vectors(tmp_path, monkeypatch, vector, target):
    """A path with a newline (the sm90a header comment), with \"\"\" (the sm100a docstring) or with
    a coding cookie (UTF-7 would turn the comment's +AAo- into a newline) is only ever text."""
    import fp4gen

    monkeypatch.chdir(tmp_path)  # the payload names its marker relative to here: no '/' in a dir name
    marker = tmp_path / "OWNED"
    code = payload_code(Path("OWNED"))
    dirname = {"newline": f"x\n{code}\n#", "quotes": f'x"""\n{code}\n"""', "coding": "coding:utf_7"}[vector]
    spec_dir = tmp_path / dirname
    spec_dir.mkdir()
    case = next(c for c in CASES if c[2] == target)
    lines = kernel_lines(*case)
    lines[2] += f"  # +AAo-{code}+AAo-"
    path = spec_dir / "inj.attn"
    path.write_text("\n".join(lines) + "\n")
    (out,) = fp4gen.compile_spec(path, tmp_path / "out")
    mod = import_module(out.read_text(encoding="utf-8"), tmp_path)
    assert mod.SPEC_FILE == str(path)
    assert not marker.exists()


def test_lone_cr_in_backward_comment(tmp_path):
    """Python reads a lone \\r as a newline inside the `# {{ origins.backward }}` comment."""
    import fp4gen

    marker = tmp_path / "OWNED"
    lines = kernel_lines("sm90_fp8_train_d128.attn", "sm90_fp8_train_causal_d128", "sm90a")
    i = next(i for i, ln in enumerate(lines) if ln.strip() == "backward {")
    lines[i] += f"  # \r{payload_code(marker)}\r#"
    (out,) = fp4gen.compile_spec(fp4gen.parse_text("\n".join(lines) + "\n", "cr.attn"), tmp_path / "out")
    src = out.read_text(encoding="utf-8")
    assert "\r" not in src and "\\r" in src
    import_module(src, tmp_path)
    assert not marker.exists()


def test_shape_check_catches_a_raw_string(monkeypatch):
    """Planted fault: a backend that passes the spec path as trusted Code puts it in the module
    docstring unescaped; the module still parses, but render's shape check refuses it."""
    context = sm90_backend.context

    def leaky_context(plan):
        return dict(context(plan), spec_file=Code(plan.spec.source_file))  # the fault

    monkeypatch.setattr(sm90_backend, "context", leaky_context)
    text = "\n".join(kernel_lines("sm90_fp8_directp_d128.attn", "sm90_fp8_directp_d128", "sm90a")) + "\n"
    render_text(text, "spec.attn")  # harmless text: same shape
    with pytest.raises(LoweringError, match="depends on the spec's free text"):
        render_text(text, 'x"""\nimport os\n"""')


def test_plain_strings_are_tokens_only():
    """The finalize refuses a plain str that could open a string or end a line, and non-finite
    floats; spec text has to be a Comment or go through | pyrepr."""
    from fp4gen.lowering import template_env

    tpl = template_env("sm90").from_string("x = {{ v }}")
    assert tpl.render(v=", (tiled_mma_l, sOnes)") == "x = , (tiled_mma_l, sOnes)"
    for bad in ['"', "'", "#", "\\", "a\nb", "a\rb", "\u2028", float("nan"), float("inf"), None, b"x", 1j]:
        with pytest.raises(LoweringError):
            tpl.render(v=bad)


@pytest.mark.parametrize("text", ["", "one line", "a\nb", "{\n \"k\": \"'\\\"\\\\\"\n}\n", "x\r\ny\u2028z\n\n"]
                         + [f"a{b}b\nc{q}" for b in BREAKS for q in QUOTES])
def test_pyrepr_lines_is_the_literal(text):
    """``| pyrepr_lines`` (PLAN_JSON) gives the same literal, and the same AST, as ``| pyrepr``."""
    import ast

    from fp4gen.lowering import pyrepr, pyrepr_lines

    src = f"X = {pyrepr_lines(text)}\n"
    (node,) = ast.parse(src).body
    assert isinstance(node.value, ast.Constant) and node.value.value == text
    assert module_shape(src) == module_shape(f"X = {pyrepr(text)}\n")
    pieces = text.count("\n") + (not text.endswith("\n"))  # one source line each, inside ( )
    assert src.count("\n") == (pieces + 2 if pieces > 1 else 1)
