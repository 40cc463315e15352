"""``fp4gen verify``: the static proofs of compiled kernels, one table, exit 1 when one fails."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_a_reference_kernel_is_reported_as_skipped(cli, tmp_path):
    p = tmp_path / "ref.attn"
    p.write_text("attention k {\n  target reference\n  head_dim 128\n}\n")
    r = cli("verify", p, "--json")
    assert r.rc == 0, r.err
    (row,) = json.loads(r.out)
    assert (row["check"], row["ok"]) == ("skipped", True) and "compiles nothing" in row["detail"]


@pytest.mark.slow
def test_sm90_kernels_get_the_register_gate_cute_warnings_and_a_skipped_row(cli):
    """The sm90a forward alone (no backward, no quantizer): its registers and cute-warnings
    rows, and the row that says which checks are sm100a-only."""
    r = cli("verify", EXAMPLES / "sm90_bf16_d128.attn", "--kernel", "sm90_bf16_d128", "--json")
    assert r.rc == 0, r.out + r.err
    rows = {(x["part"], x["check"]): x for x in json.loads(r.out)}
    assert set(rows) == {("forward", "registers"), ("forward", "cute-warnings"), ("all", "skipped")}
    assert all(x["ok"] for x in rows.values())
    assert "spills 0 B st + 0 B ld (budget 0)" in rows[("forward", "registers")]["detail"]
    assert rows[("forward", "cute-warnings")]["detail"] == "1 kernels, 0 warnings (none)"
    assert "H200" in rows[("all", "skipped")]["detail"] and "cute-warnings" not in rows[("all", "skipped")]["detail"]


@pytest.mark.slow
def test_every_kernel_of_the_sm90_training_example_passes_the_gate(cli):
    """Forward, both backward variants, the six input quantizers and the five backward
    pre/post-processing kernels: zero spills, the plan's setmaxnreg budgets, no C7508, every
    CuTe checker warning triaged."""
    r = cli("verify", EXAMPLES / "sm90_fp8_train_d128.attn", "--kernel", "sm90_fp8_train_causal_d128", "--json")
    assert r.rc == 0, r.out + r.err
    rows = {(x["part"], x["check"]): x for x in json.loads(r.out)}
    parts = ("forward", "backward", "quantizers", "bwd-prep")
    assert set(rows) == {(p, c) for p in parts for c in ("registers", "cute-warnings")} | {("all", "skipped")}
    assert all(x["ok"] for x in rows.values())
    fwd, bwd = rows[("forward", "registers")]["detail"], rows[("backward", "registers")]["detail"]
    assert "setmaxnreg [240] up / [24] down, spills 0 B st + 0 B ld (budget 0)" in fwd
    assert bwd.startswith("backward, backward_gqa: ") and "spills 0 B st + 0 B ld" in bwd
    assert rows[("quantizers", "registers")]["detail"].startswith("6 kernels, ")
    assert rows[("bwd-prep", "registers")]["detail"].startswith("5 kernels, ")
    assert [rows[(p, "cute-warnings")]["detail"].split(",")[0] for p in parts] == [
        "1 kernels", "2 kernels", "6 kernels", "5 kernels"]


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


@pytest.mark.parametrize("example", ["fa4_fp4_d128.attn", "sm90_bf16_d128.attn"])
def test_no_ptxas_is_a_clear_error_before_anything_compiles(cli, monkeypatch, tmp_path, example):
    monkeypatch.setenv("FP4GEN_PTXAS", str(tmp_path / "nope"))
    monkeypatch.setattr("fp4gen.lowering.ptxas.compile_kept", lambda *a, **k: pytest.fail("compiled"))
    monkeypatch.setattr("fp4gen.lowering.conformance.compile_artifacts", lambda *a, **k: pytest.fail("compiled"))
    r = cli("verify", EXAMPLES / example)
    assert r.rc == 1 and "FP4GEN_PTXAS" in r.err and "Traceback" not in r.err


@pytest.mark.slow
def test_forward_and_backward_of_the_backward_example(cli):
    r = cli("verify", EXAMPLES / "sm100_bwd_d128.attn", "--kernel", "sm100_bwd_causal_d128", "--json")
    assert r.rc == 0, r.out + r.err
    rows = {(x["part"], x["check"]): x for x in json.loads(r.out)}
    assert set(rows) == {(part, check) for part in ("forward", "backward")
                         for check in ("conformance", "descriptors", "registers", "cute-warnings")} | {
        ("forward", "emulator"), ("forward", "protocol"), ("backward", "emulator"), ("backward", "protocol")}
    assert all(x["ok"] for x in rows.values())
    assert "spills 0 B st + 0 B ld (budget 0)" in rows[("backward", "registers")]["detail"]
    assert rows[("backward", "protocol")]["detail"].startswith("2 CTAs, ")  # Sk 256: two key tiles
