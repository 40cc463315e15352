"""The tables of docs/numerics.md section 14 reproduce from the commands printed above them.

Each table there is the verbatim output of ``python -m fp4gen.numerics.accuracy --outliers`` /
``--isolate CASE`` at the sizes the section states. The slow tests rerun a part of each at those
sizes (the FP8 exp rows and NV/MX exp's randn/sink rows of the outlier table; NV/MX exp's row of
the isolation tables) and require the same 4-decimal strings; the fast ones run the commands at
tiny sizes and check the doc prints the command and header they print. Section 12's FP8 exp table
(none / smooth_k columns) must agree with section 14's. The planted fault (one changed digit)
shows the comparison fails.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fp4gen.numerics import accuracy

DOC = Path(__file__).resolve().parents[2] / "docs" / "numerics.md"
OUTLIERS_CMD = "python -m fp4gen.numerics.accuracy --outliers --seqlen 1024 --heads 2"
ISOLATE_CMD = "python -m fp4gen.numerics.accuracy --isolate {case} --seqlen 1024 --heads 2"


def section(n: int) -> str:
    text = DOC.read_text()
    m = re.search(rf"^## {n}\. .*?(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docs/numerics.md has no section {n}"
    return m.group(0)


def table_after(text: str, marker: str) -> list[list[str]]:
    """The rows (cells stripped, ** removed) of the first markdown table after ``marker``."""
    i = text.index(marker)
    rows = []
    for line in text[i:].splitlines()[1:]:
        if line.startswith("|"):
            if not set(line) <= set("|-"):
                rows.append([c.strip().replace("**", "") for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows


def outlier_rows(rows) -> dict:
    """(recipe, case) -> the table's cells, as the command prints them."""
    out = {}
    for r in rows:
        out[(r["recipe"], r["case"])] = [f"{r['rel_l2'][o]:.4f} ({r['ratio'][o]:.2f}x)" for o in r["rel_l2"]]
    return out


def doc_outlier_table() -> dict:
    rows = table_after(section(14), OUTLIERS_CMD)
    assert rows[0][:2] == ["recipe", "case"]
    return {(r[0], r[1]): r[2:] for r in rows[1:]}


def mismatches(doc: dict, measured: dict) -> list:
    return [(key, doc.get(key), cells) for key, cells in measured.items() if doc.get(key) != cells]


def test_the_section_prints_its_commands():
    s = section(14)
    assert OUTLIERS_CMD in s and ISOLATE_CMD.format(case="sink") in s and ISOLATE_CMD.format(case="randn") in s
    assert table_after(s, OUTLIERS_CMD)[0] == ["recipe", "case", "none", "smooth_k", "smooth_k+sink_tokens"]


def test_the_commands_run_at_tiny_sizes(capsys):
    assert accuracy.main(["--outliers", "--seqlen", "64", "--heads", "1", "--recipe", "FP8 exp sm90"]) == 0
    out = capsys.readouterr().out
    assert "| recipe | case | none | smooth_k | smooth_k+sink_tokens |" in out and out.count("| FP8 exp sm90 |") == 6
    assert accuracy.main(["--isolate", "sink", "--seqlen", "64", "--heads", "1", "--recipe", "NV/MX exp"]) == 0
    out = capsys.readouterr().out
    assert "| recipe | case | all | Q only | K only | P only | V only |" in out and "| NV/MX exp | sink |" in out


@pytest.mark.slow  # 24 reference forwards at S=1024 (~20 s on one free core)
def test_outlier_table_reproduces():
    doc = doc_outlier_table()
    measured = outlier_rows(accuracy.outlier_table(1024, 2, names=["FP8 exp sm90"]))
    measured.update(outlier_rows(accuracy.outlier_table(1024, 2, names=["NV/MX exp"], cases=("randn", "sink"))))
    assert mismatches(doc, measured) == []


@pytest.mark.slow  # 10 FP4 reference forwards at S=1024
@pytest.mark.parametrize("case", ["randn", "sink"])
def test_isolation_table_reproduces(case):
    rows = table_after(section(14), ISOLATE_CMD.format(case=case))
    doc = {(r[0], r[1]): r[2:] for r in rows[1:]}
    (r,) = accuracy.operand_isolation(case, 1024, 2, names=["NV/MX exp"])
    assert doc[("NV/MX exp", case)] == [f"{r[c]:.4f}" for c in ("all", "q", "k", "p", "v")]


def test_section12_fp8_exp_table_agrees_with_section13():
    """Section 12's FP8 exp synthetic table (S=1024, H=2, seed 0) is section 14's FP8 exp rows."""
    s12 = {r[0]: r[1:] for r in table_after(section(12), "FP8 exp (sm90's FA3-style recipe")[1:]}
    s13 = doc_outlier_table()
    for case in accuracy.OUTLIER_CASES:
        none, smooth = (c.split()[0] for c in s13[("FP8 exp sm90", case)][:2])
        assert s12[case][:2] == [none, smooth], case


def test_planted_fault_one_changed_digit_is_caught():
    doc = doc_outlier_table()
    key = ("FP8 exp sm90", "randn")
    cells = list(doc[key])
    cells[0] = cells[0].replace(cells[0][5], "9" if cells[0][5] != "9" else "8", 1)
    assert mismatches(doc, {key: cells}) != []


BACKWARD_CMD = "python -m fp4gen.numerics.accuracy --backward-table --seqlen 1024"


def backward_cells(rows) -> list[list[str]]:
    return [[r["kernel"], r["gradients"]] + [f"{r[g + '_cosine']:.3f} / {r[g + '_rel_l2']:.3f}"
                                            for g in ("dq", "dk", "dv")] for r in rows]


@pytest.fixture(scope="module")
def backward_rows():
    return backward_cells(accuracy.backward_table(seqlen=1024, heads=2))


def test_backward_table_reproduces_from_its_command(backward_rows):
    """Section 10's backward table is the command's output at S = 1024, H = 2 (~10 s)."""
    text = section(10)
    assert BACKWARD_CMD in text
    assert table_after(text, BACKWARD_CMD)[1:] == backward_rows  # without the header row


def test_backward_table_comparison_can_fail(backward_rows):
    """Planted fault: the doc's table with one digit changed no longer matches the output."""
    text = section(10)
    cell = backward_rows[0][2]  # NV/MX fast, dQ
    planted = text.replace(cell, cell[:-1] + ("1" if cell[-1] != "1" else "2"), 1)
    assert planted != text
    assert table_after(planted, BACKWARD_CMD)[1:] != backward_rows


def test_backward_table_cli_prints_every_recipe(capsys):
    assert accuracy.main(["--backward-table", "--seqlen", "64", "--heads", "1", "--head-dim", "32"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| ") == 1 + len(accuracy.BACKWARD_RECIPES)
