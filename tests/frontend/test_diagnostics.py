"""Invalid specs: every diagnostic's position, message and hint, written by hand."""
from __future__ import annotations

import pytest

from fp4gen.frontend import Diagnostic, SpecError, parse_text
from fp4gen.ir.spec import SourceLoc


def diags(text: str) -> list[Diagnostic]:
    with pytest.raises(SpecError) as exc:
        parse_text(text, "bad.attn")
    return exc.value.diagnostics


def only(text: str) -> Diagnostic:
    ds = diags(text)
    assert len(ds) == 1, [d.render() for d in ds]
    return ds[0]


def kernel(body: str) -> str:
    """A kernel whose line 2 onward is ``body`` (line 1 is the header)."""
    return "attention k {\n" + body + "\n}\n"


BASE = "  target sm100a\n  head_dim 128\n"  # lines 2-3; the case under test starts on line 4

CASES = [
    # (id, text, line, col, message fragment, hint fragment or None)
    ("target", kernel("  target sm100\n  head_dim 128"), 2, 10, "unknown target 'sm100'", "did you mean 'sm100a'?"),
    ("format", kernel(BASE + "  Q : nvfp5"), 4, 7, "unknown format 'nvfp5'", "did you mean 'nvfp4'?"),
    ("format-e4m3", kernel(BASE + "  K : e4m3"), 4, 7, "unknown format 'e4m3'", "did you mean 'fp8e4m3'?"),
    ("nvfp4-block", kernel(BASE + "  K : nvfp4(block=32)"), 4, 19, "nvfp4 uses blocks of 16 elements, not 32",
     "use mxfp4"),
    ("mxfp4-scale", kernel(BASE + "  V : mxfp4(scale=e4m3)"), 4, 19, "mxfp4 block scales are e8m0, not e4m3", None),
    ("fp8-scale-needs-block", kernel(BASE + "  V : fp8e4m3(scale=e8m0)"), 4, 21, "scale=e8m0 needs a block size",
     "write fp8e4m3(block=32, scale=e8m0)"),  # e8m0 scales are OCP MX: blocks of 32 (MX_BLOCK)
    ("fp8-fp32-scale-needs-block", kernel(BASE + "  V : fp8e4m3(scale=fp32)"), 4, 21, "scale=fp32 needs a block size",
     "write fp8e4m3(block=128, scale=fp32)"),
    ("fp8-block-tensor", kernel(BASE + "  V : fp8e4m3(block=128, scale=tensor)"), 4, 32,
     "a per-block scale of fp8e4m3 is fp32 or e8m0, not tensor", "drop block="),
    ("scale-word", kernel(BASE + "  V : fp8e4m3(scale=tensr)"), 4, 21, "unknown scale 'tensr'",
     "did you mean 'tensor'?"),
    ("bf16-args", kernel(BASE + "  O : bf16(block=16)"), 4, 12, "bf16 takes no block or scale", None),
    ("block-zero", kernel(BASE + "  K : fp8e4m3(block=0)"), 4, 21,
     "the block of fp8e4m3 must be 16, 32, 64, 128 or 256, got 0", None),
    ("block-float", kernel(BASE + "  K : fp8e4m3(block=1.5)"), 4, 21,
     "the block of fp8e4m3 must be an integer, got '1.5'", None),
    ("too-many-args", kernel(BASE + "  Q : nvfp4(16, e4m3, 7)"), 4, 23, "nvfp4 takes at most 2 arguments", None),
    ("unknown-arg", kernel(BASE + "  Q : nvfp4(blok=16)"), 4, 13, "nvfp4 has no parameter 'blok'",
     "did you mean 'block'?"),
    ("twice-arg", kernel(BASE + "  Q : nvfp4(block=16, block=16)"), 4, 23, "argument 'block' of nvfp4 is given twice",
     None),
    ("positional-after-named", kernel(BASE + "  Q : nvfp4(block=16, e4m3)"), 4, 23,
     "positional argument after a named one", None),
    ("policy", kernel(BASE + "  P : mxfp4 via direct_p(policy=fats)"), 4, 33, "unknown policy 'fats'",
     "did you mean 'fast'?"),
    ("direct_p-param", kernel(BASE + "  P : mxfp4 via direct_p(c=1)"), 4, 26, "direct_p has no parameter 'c'", None),
    ("direct_p-a", kernel(BASE + "  P : mxfp4 via direct_p(a=0)"), 4, 28, "direct_p's a must be from 0.001 to 8, got 0", None),
    ("direct_p-a-huge", kernel(BASE + "  P : mxfp4 via direct_p(a=1e308)"), 4, 28, "direct_p's a must be from 0.001 to 8, got 1e308", None),
    ("via-kind", kernel(BASE + "  P : mxfp4 via exps"), 4, 17, "unknown way to produce P 'exps'",
     "did you mean 'exp'?"),
    ("exp-args", kernel(BASE + "  P : mxfp4 via exp(1)"), 4, 21, "exp takes no arguments", None),
    ("via-not-P", kernel(BASE + "  Q : bf16 via exp"), 4, 12, "only P takes 'via'", None),
    ("direct_p-bf16", kernel(BASE + "  P : bf16 via direct_p"), 4, 12,
     "direct_p produces mxfp4 or fp8e4m3 codes, but P is bf16", "make P mxfp4 or fp8e4m3, or use 'via exp'"),
    ("two_level-fp8", kernel(BASE + "  P : fp8e4m3 via two_level"), 4, 15, "two_level quantizes P to FP4", None),
    ("mask", kernel(BASE + "  mask causl"), 4, 8, "unknown mask 'causl'", "did you mean 'causal'?"),
    ("scale-zero", kernel(BASE + "  scale 0"), 4, 9, "the softmax scale must be from 1e-6 to 1e6, got 0", None),
    ("scale-word", kernel(BASE + "  scale automatic"), 4, 9, "unknown softmax scale 'automatic'",
     "did you mean 'auto'?"),
    ("scale-dot", kernel(BASE + "  scale .5"), 4, 9, "a number needs a digit before the decimal point", "0.5"),
    ("guard-missing-l", kernel(BASE + "  guard sample(m=110)"), 4, 9, "guard sample needs l", "sample(m=110, l=16)"),
    ("guard-kind", kernel(BASE + "  guard sampel(m=1, l=2)"), 4, 9, "unknown guard 'sampel'",
     "did you mean 'sample'?"),
    ("guard-none-args", kernel(BASE + "  guard none(1)"), 4, 14, "guard none takes no arguments", None),
    ("unknown-stmt", kernel("  targt sm100a\n  head_dim 128"), 2, 3, "unknown statement 'targt' in attention block",
     "did you mean 'target'?"),
    ("missing-colon", kernel(BASE + "  Q nvfp4"), 4, 3, "expected ':' after operand name 'Q'", "Q : bf16"),
    ("operand-name", kernel(BASE + "  q : nvfp4"), 4, 3, "unknown operand 'q'", "did you mean 'Q'?"),
    ("grad-at-top", kernel(BASE + "  dO : fp8e5m2"), 4, 3, "gradient operand 'dO' belongs in a backward { } block",
     None),
    ("fwd-in-backward", kernel(BASE + "  backward { Q : bf16 }"), 4, 14, "forward operand 'Q' is set in the attention",
     None),
    ("grad-name", kernel(BASE + "  backward {\n    dX : fp8e4m3\n  }"), 5, 5, "unknown gradient operand 'dX'", None),
    ("reuse", kernel(BASE + "  backward { reuse q k lce }"), 4, 24, "unknown reusable state 'lce'",
     "did you mean 'lse'?"),
    ("reuse-twice", kernel(BASE + "  backward { reuse q q }"), 4, 22, "'q' is listed twice", None),
    ("deterministic", kernel(BASE + "  backward { deterministic yes }"), 4, 28, "unknown value for deterministic 'yes'",
     None),
    ("p_publish", kernel(BASE + "  schedule { p_publish halfs }"), 4, 24, "unknown p_publish mode 'halfs'",
     "did you mean 'halves'?"),
    ("tmem-word", kernel(BASE + "  schedule { tmem automatic }"), 4, 19, "unknown tmem setting 'automatic'",
     "did you mean 'auto'?"),
    ("tmem-empty", kernel(BASE + "  schedule { tmem { } }"), 4, 14, "empty tmem block", "tmem auto"),
    ("tmem-backwards", kernel(BASE + "  schedule { tmem { S0 cols 10..5 } }"), 4, 29,
     "region 'S0' ends (column 5) before it starts (column 10)", None),
    ("tmem-twice", kernel(BASE + "  schedule {\n    tmem {\n      S0 cols 0..127\n      S0 cols 128..255\n    }\n  }"),
     7, 7, "tmem region 'S0' is listed twice", None),
    ("tmem-col", kernel(BASE + "  schedule { tmem { S0 col 0..127 } }"), 4, 24, "unexpected name 'col'; expected 'cols'",
     "did you mean 'cols'?"),
    ("q_stages-zero", kernel(BASE + "  schedule { q_stages 0 }"), 4, 23, "q_stages must be from 1 to 3, got 0", None),
    ("q_stages-word", kernel(BASE + "  schedule { q_stages two }"), 4, 23, "unexpected name 'two'; expected an integer",
     None),
    ("tile-by", kernel(BASE + "  schedule { tile 128 by 128 }"), 4, 23, "unexpected name 'by'; expected 'x'", None),
    ("tile-at-top", kernel(BASE + "  tile 64 x 64"), 4, 3, "'tile' belongs in a schedule { } block", None),
    ("target-in-schedule", kernel(BASE + "  schedule {\n    target sm90a\n  }"), 5, 5,
     "'target' belongs directly in the attention block", None),
    ("unknown-block", kernel(BASE + "  schedul { tile 1 x 1 }"), 4, 3, "unknown block 'schedul' in attention block",
     "did you mean 'schedule'?"),
    ("unknown-in-schedule", kernel(BASE + "  schedule { tiles 1 x 1 }"), 4, 14,
     "unknown statement 'tiles' in schedule block", "did you mean 'tile'?"),
    ("two-statements-one-line", kernel("  target sm100a head_dim 128"), 2, 17,
     "unexpected 'head_dim'; expected '}', ';' or end of line", "separate statements with ';'"),
    ("missing-paren", kernel(BASE + "  guard sample(m=110, l=16"), 4, 27, "unexpected end of line; expected ',' or ')'",
     None),
    ("bad-char", kernel(BASE + "  Q : nvfp4 @"), 4, 13, "unexpected character '@'", None),
    ("missing-target", "attention k {\n  head_dim 64\n}\n", 1, 11, "kernel 'k' does not set target",
     "target sm100a"),
    ("missing-both", "attention k { }", 1, 11, "kernel 'k' does not set target or head_dim", "head_dim 128"),
    ("empty-file", "# nothing here\n", 1, 1, "no kernels in this file", "attention NAME"),
    ("not-a-kernel", "kernel k { }\n", 1, 1, "unexpected name 'kernel'; expected 'attention'", None),
    ("stray-brace", "attention a { target reference; head_dim 64 }\n}\n", 2, 1, "unmatched '}'", "one '}' too many"),
    ("nested-kernel", kernel(BASE + "  attention j { }"), 4, 3, "kernels cannot be nested", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_single_error(case):
    _, text, line, col, message, hint = case
    d = only(text)
    assert (d.loc.file, d.loc.line, d.loc.col) == ("bad.attn", line, col), d.render()
    assert message in d.message, d.message
    if hint is None:
        return
    assert d.hint is not None and hint in d.hint, d.hint


def test_duplicate_statement_points_at_both():
    d = only(kernel(BASE + "  target sm90a"))
    assert (d.loc.line, d.loc.col) == (4, 3)
    assert d.message == "the target is set twice"
    assert [(n.message, n.loc) for n in d.notes] == [("first set here", SourceLoc("bad.attn", 2, 3))]


def test_duplicate_kernel_name():
    d = only("attention a { target reference; head_dim 64 }\nattention a { target sm90a; head_dim 64 }\n")
    assert (d.loc.line, d.loc.col) == (2, 11)
    assert d.message == "kernel 'a' is defined twice"
    assert d.notes[0].loc == SourceLoc("bad.attn", 1, 11)


def test_unclosed_brace_at_end_of_file():
    d = only("attention a {\n  target reference\n  head_dim 64\n")
    assert d.message == "unexpected end of file; expected '}'"
    assert (d.loc.line, d.loc.col) == (3, 14)
    assert d.notes[0].message == "this '{' is never closed"
    assert d.notes[0].loc == SourceLoc("bad.attn", 1, 13)


def test_many_independent_errors_in_one_run():
    text = (
        "attention a {\n"            # 1
        "  target sm100\n"           # 2  value error
        "  head_dim 128\n"           # 3
        "  Q : nvfp5\n"              # 4  value error
        "  schedule { tile 128 by 128 }\n"  # 5  syntax error
        "}\n"                        # 6
        "attention b {\n"            # 7
        "  target reference\n"       # 8
        "  head_dim 64\n"            # 9
        "  mask causl\n"             # 10 value error
        "  guard sample(m=1\n"       # 11 syntax error
        "  P : bf16 via direct_p\n"  # 12 value error
        "}\n"
    )
    got = [(d.loc.line, d.loc.col) for d in diags(text)]
    # Kernel a has a syntax error, so only its syntax error is reported (its
    # values were not checked); kernel b likewise. The syntax errors of both
    # kernels are found in one run.
    assert got == [(5, 23), (11, 19)]


def test_value_errors_of_separate_kernels_are_all_reported():
    text = (
        "attention a {\n"
        "  target sm100\n"
        "  head_dim 128\n"
        "  Q : nvfp5\n"
        "}\n"
        "attention b {\n"
        "  target reference\n"
        "  head_dim 0\n"
        "  mask causl\n"
        "  P : bf16 via direct_p\n"
        "}\n"
    )
    got = [(d.loc.line, d.loc.col, d.message.split(";")[0]) for d in diags(text)]
    assert got == [
        (2, 10, "unknown target 'sm100'"),
        (4, 7, "unknown format 'nvfp5'"),
        (8, 12, "head_dim must be a multiple of 16 from 16 to 256, got 0"),
        (9, 8, "unknown mask 'causl'"),
        (10, 12, "direct_p produces mxfp4 or fp8e4m3 codes, but P is bf16"),
    ]


def test_render_is_clang_style():
    d = only(kernel(BASE + "  Q : nvfp5"))
    text = d.render(("attention k {", "  target sm100a", "  head_dim 128", "  Q : nvfp5", "}"))
    assert text == (
        "bad.attn:4:7: error: unknown format 'nvfp5'; expected 'fp32', 'bf16', 'fp16', 'fp8e4m3', "
        "'fp8e5m2', 'nvfp4' or 'mxfp4'\n"
        "      Q : nvfp5\n"
        "          ^~~~~\n"
        "hint: did you mean 'nvfp4'?"
    )


def test_render_keeps_tabs_under_the_caret():
    d = only("attention k {\n\ttarget sm100\n\thead_dim 128\n}\n")
    lines = d.render(("attention k {", "\ttarget sm100", "\thead_dim 128", "}")).splitlines()
    assert lines[1] == "    \ttarget sm100"
    assert lines[2] == "    \t       ^~~~~"


def test_spec_error_render_lists_all_and_counts():
    with pytest.raises(SpecError) as exc:
        parse_text(kernel("  target sm100\n  head_dim 0"), "bad.attn")
    text = exc.value.render()
    assert text.startswith("bad.attn:2:10: error: unknown target 'sm100'")
    assert "bad.attn:3:12: error: head_dim must be a multiple of 16 from 16 to 256, got 0\n" in text
    assert text.endswith("2 errors")
