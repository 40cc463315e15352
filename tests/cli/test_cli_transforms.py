"""The outlier transforms of a spec in the CLI: `check` refuses bad ones at file:line:col (exit 1),
`schedule` and `explain` show their cost, `accuracy` (random and --inputs) runs them."""
from __future__ import annotations

import json

import torch

from conftest import EXAMPLES

EXAMPLE = EXAMPLES / "sm90_fp8_outlier_robust_d128.attn"


def _write(tmp_path, body, head_dim=64, name="t.attn"):
    p = tmp_path / name
    p.write_text(f"attention t {{\n  target reference\n  head_dim {head_dim}\n{body}\n}}\n")
    return p


def test_check_refuses_at_the_line(cli, tmp_path):
    p = _write(tmp_path, "  softcap 30\n  K : fp8e4m3 smooth\n  rotate qk hadamard", head_dim=96)
    r = cli("check", p)
    assert r.rc == 1
    assert f"{p}:5:15: error: K smoothing with softcap" in r.err
    assert f"{p}:6:13: error: the Hadamard rotation needs a power-of-two head dim, got 96" in r.err
    assert "2 errors" in r.err


def test_check_accepts_the_example(cli):
    r = cli("check", EXAMPLE)
    assert r.rc == 0 and "sm90_fp8_outlier_robust_d128" in r.out


def test_schedule_lists_the_passes(cli):
    r = cli("schedule", EXAMPLE)
    assert r.rc == 0
    assert "Transforms (torch passes around the kernel, not fused): smooth_k" in r.out
    assert "K - mean" in r.out and "predicted" in r.out and "not measured" in r.out
    j = json.loads(cli("schedule", EXAMPLE, "--format", "json").out)
    assert j["transforms"]["transforms"] == ["smooth_k"]


def test_explain_shows_the_transforms(cli):
    r = cli("explain", EXAMPLE)
    assert r.rc == 0 and "transforms smooth_k: torch passes" in r.out
    rows = json.loads(cli("explain", EXAMPLE, "--json").out)
    assert rows[0]["transforms"]["names"] == ["smooth_k"] and rows[0]["transforms"]["example_us"] > 0
    plain = json.loads(cli("explain", EXAMPLES / "sm90_fp8_exp_d128.attn", "--json").out)
    assert all("transforms" not in row for row in plain)


def _massive_k_case(path, S=128, H=2, D=64):
    from fp4gen.numerics import activations

    c = activations.synthetic("massive_k", seqlen=S, heads=H, head_dim=D)
    activations.save(path, c.q, c.k, c.v, dtype=torch.float32)


def test_accuracy_inputs_runs_the_specs_transforms(cli, tmp_path):
    """The spec's `smooth` runs in `accuracy --inputs` (the same number as --transform smooth_k on
    the spec without it), and on massive K channels it is the better number."""
    f = tmp_path / "mk.pt"
    _massive_k_case(f)
    body = "  Q : fp8e4m3(block=128)\n  K : fp8e4m3(block=128){}\n  P : fp8e4m3 via exp\n  V : fp8e4m3"
    with_opt = _write(tmp_path, body.format(" smooth"), name="a.attn")
    without = _write(tmp_path, body.format(""), name="b.attn")
    a = json.loads(cli("accuracy", with_opt, "--inputs", f, "--json", "--quiet").out)
    b = json.loads(cli("accuracy", without, "--inputs", f, "--json", "--quiet").out)
    c = json.loads(cli("accuracy", without, "--inputs", f, "--transform", "smooth_k", "--json", "--quiet").out)
    assert a["transforms"] == ["smooth_k"] and "transforms" not in b
    assert a["overall_rel_l2"] == c["overall_rel_l2"]
    assert a["overall_rel_l2"] < b["overall_rel_l2"]


def test_accuracy_random_runs_the_specs_transforms(cli, tmp_path):
    body = "  Q : fp8e4m3(block=128)\n  K : fp8e4m3(block=128)\n  P : fp8e4m3 via exp\n  V : fp8e4m3 channel_scale"
    p = _write(tmp_path, body)
    r = cli("accuracy", p, "--seqlen", "64", "--heads", "2", "--json", "--quiet")
    assert r.rc == 0
    rep = json.loads(r.out)
    assert rep["transforms"] == ["channel_scale_v"] and 0 < rep["rel_l2"] < 0.2


def test_run_goes_through_the_transforms(cli, tmp_path, monkeypatch):
    """`fp4gen run` of a spec with transforms runs them (fp4gen.attention around the module), not
    the bare module: a Post that is not applied shows in its O error."""
    body = ("  mask causal\n  Q : fp8e4m3(block=128)\n  K : fp8e4m3(block=128) smooth\n  P : fp8e4m3 via exp\n"
            "  V : fp8e4m3 channel_scale\n  backward {\n    dO : bf16\n  }")
    p = _write(tmp_path, body)
    r = cli("run", p, "--seqlen", "64", "--heads", "2", "--backward")
    assert r.rc == 0 and "transforms smooth_k, channel_scale_v: torch steps" in r.out
    rel = float(r.out.split("o: cosine")[1].split("rel_l2")[1].split()[0])
    assert rel < 0.1
    from fp4gen.numerics import outliers

    monkeypatch.setattr(outliers.Post, "o", lambda self, x: x)  # planted: O's columns not scaled back
    bad = cli("run", p, "--seqlen", "64", "--heads", "2")
    assert float(bad.out.split("o: cosine")[1].split("rel_l2")[1].split()[0]) > 0.3
