"""``fp4gen verify``: the static proofs of compiled kernels, one table, exit 1 when one fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_kernels_without_sm100a_code_are_reported_as_skipped(cli):
    r = cli("verify", EXAMPLES / "sm90_bf16_d128.attn", "--json")
    assert r.rc == 0, r.err
    rows = json.loads(r.out)
    assert {row["check"] for row in rows} == {"skipped"} and all(row["ok"] for row in rows)
    assert "H200" in rows[0]["detail"]


def test_a_spec_error_is_a_user_error(cli, tmp_path):
    p = tmp_path / "bad.attn"
    p.write_text("attention k {\n  target sm100a\n  head_dim 128\n  Q : fp8e4m3(block=3)\n}\n")
    r = cli("verify", p)
    assert r.rc == 1 and f"{p}:4:" in r.err and "Traceback" not in r.err


def test_a_kernel_the_lowering_refuses_is_a_user_error(cli, tmp_path):
    p = tmp_path / "d64.attn"
    p.write_text("attention k {\n  target sm100a\n  head_dim 64\n}\n")
    r = cli("verify", p)
    assert r.rc == 1 and "Traceback" not in r.err
    assert r.err.splitlines()[0] == (f"{p}:3:12: error: kernel 'k' (sm100a): cannot compile for sm100a: "
                                     "sm100a lowering implements head_dim 128 only (not yet 64)")


def test_no_ptxas_is_a_clear_error(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("FP4GEN_PTXAS", str(tmp_path / "nope"))
    r = cli("verify", EXAMPLES / "fa4_fp4_d128.attn")
    assert r.rc == 1 and "FP4GEN_PTXAS" in r.err and "Traceback" not in r.err


@pytest.mark.slow
def test_forward_and_backward_of_the_backward_example(cli):
    r = cli("verify", EXAMPLES / "sm100_bwd_d128.attn", "--kernel", "sm100_bwd_causal_d128", "--json")
    assert r.rc == 0, r.out + r.err
    rows = {(x["part"], x["check"]): x for x in json.loads(r.out)}
    assert set(rows) == {(part, check) for part in ("forward", "backward")
                         for check in ("conformance", "descriptors", "registers", "cute-warnings")} | {
        ("forward", "emulator"), ("forward", "protocol"), ("backward", "emulator")}
    assert all(x["ok"] for x in rows.values())
    assert "spills 0 B st + 0 B ld (budget 0)" in rows[("backward", "registers")]["detail"]
