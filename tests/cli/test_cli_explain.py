"""fp4gen explain: one line per kernel, what runs it here, on an H200 (sm90a), on a B200 (sm100a)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_explain_an_sm90a_example(cli):
    r = cli("explain", EXAMPLES / "sm90_bf16_d128.attn")
    assert r.rc == 0, r
    lines = r.out.splitlines()
    assert lines[0].startswith("sm90_bf16_d128: here (")  # the CPU here, or the GPU it runs on
    assert "H200 (sm90a): fwd generated, bwd none: the spec has no backward block" in lines[0]
    assert "B200 (sm100a): fwd+bwd none: the spec targets sm90a" in lines[0]
    assert "H200 (sm90a): fwd+bwd generated" in lines[1]
    assert "NoKernelError" in lines[2]


def test_explain_names_the_refusal_at_its_line(cli, tmp_path):
    spec = tmp_path / "w.attn"
    # sinks: the sm90a forward has them, its backward does not (a window is no refusal any more)
    spec.write_text((EXAMPLES / "sm90_bf16_d128.attn").read_text().replace("mask     causal",
                                                                           "mask     causal\n  sinks    learned"))
    r = cli("explain", spec, "--kernel", "sm90_bf16_causal_d128")
    assert r.rc == 0, r
    (line, _) = r.out.splitlines()
    assert f"H200 (sm90a): fwd+bwd none: {spec}:22:12: " in line and "sinks learned" in line
    assert "its backward does not" in line
    r = cli("explain", spec, "--kernel", "sm90_bf16_causal_d128", "--target", "reference")
    assert "H200 (sm90a): fwd+bwd none: the spec targets reference" in r.out


def test_explain_json_and_the_sm100a_backward(cli):
    r = cli("explain", EXAMPLES / "fa4_fp4_d128.attn", "--json")
    assert r.rc == 0, r
    (row,) = json.loads(r.out)
    assert row["kernel"] == "fa4_fp4_d128" and row["target"] == "sm100a"
    assert row["B200"]["forward"] == "generated"
    assert row["H200"] == {"target": "sm90a", "forward": "none: the spec targets sm100a",
                           "backward": "none: the spec targets sm100a"}
    assert set(row["here"]) == {"machine", "forward", "backward"}


def test_explain_a_bad_spec(cli, tmp_path):
    bad = tmp_path / "bad.attn"
    bad.write_text("attention a {\n  target sm90a\n  head_dim 64\n  mask windw(1, 0)\n}\n")
    r = cli("explain", bad)
    assert r.rc == 1 and f"{bad}:4:8: error: unknown mask 'windw'" in r.err


@pytest.mark.parametrize("argv", [["explain"], ["explain", "x.attn", "--target", "sm80"]])
def test_explain_usage(cli, argv):
    assert cli(*argv).rc == 2


def test_explain_here_on_a_gpu(cli, monkeypatch):
    """On a GPU, 'here' is what that GPU's target gets (a GPU of no fp4gen target gets none)."""
    import torch

    from fp4gen import torch_ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a")
    r = cli("explain", EXAMPLES / "sm90_bf16_d128.attn", "--kernel", "sm90_bf16_causal_d128")
    assert r.out.startswith("sm90_bf16_causal_d128: here (NVIDIA H200, sm90a): fwd+bwd generated | "), r
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: None)
    r = cli("explain", EXAMPLES / "sm90_bf16_d128.attn", "--kernel", "sm90_bf16_causal_d128")
    assert "here (NVIDIA H200, no fp4gen target): fwd+bwd none: fp4gen generates for sm90a" in r.out


def test_explain_a_decode_spec(cli):
    """A kv_cache spec: the H200 line names the decode kernel and its entry point and says that
    fp4gen.attention refuses the spec (not "fwd generated"); a dense spec's line is unchanged."""
    r = cli("explain", EXAMPLES / "sm90_decode_bf16_d128.attn", "--kernel", "sm90_decode_bf16_d128")
    assert r.rc == 0, r
    line = r.out.splitlines()[0]
    assert "H200 (sm90a): decode generated (the sm90a decode kernel) via fp4gen.attention_with_kvcache; " \
           "fp4gen.attention refuses it" in line
    assert "fwd generated" not in line and "fwd+bwd" not in line
    assert "B200 (sm100a): decode none: the spec targets sm90a" in line
    assert "fp4gen.attention with backend='auto' raises" not in r.out  # that footer is for attention's none
    assert "attention_with_kvcache with backend='auto' raises NoKernelError" in r.out
    r = cli("explain", EXAMPLES / "sm90_decode_bf16_d128.attn", "--kernel", "sm90_decode_bf16_d128", "--json")
    (row,) = json.loads(r.out)
    assert row["H200"]["decode"] == "generated" and row["H200"]["forward"].startswith("refused: a kv_cache spec")
    assert row["H200"]["backward"] == row["H200"]["forward"]


def test_explain_a_decode_spec_on_an_sm100a(cli):
    """Retargeted to sm100a: no decode kernel there, said at the kv_cache line."""
    spec = EXAMPLES / "sm90_decode_bf16_d128.attn"
    r = cli("explain", spec, "--kernel", "sm90_decode_bf16_d128", "--target", "sm100a")
    assert r.rc == 0, r
    assert f"B200 (sm100a): decode none: {spec}:9:3: " in r.out and "no decode kernel" in r.out


def test_explain_a_decode_spec_here_on_a_gpu(cli, monkeypatch):
    import torch

    from fp4gen import torch_ops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a")
    r = cli("explain", EXAMPLES / "sm90_decode_bf16_d128.attn", "--kernel", "sm90_decode_bf16_d128")
    assert r.out.startswith("sm90_decode_bf16_d128: here (NVIDIA H200, sm90a): decode generated (the decode kernel) "
                            "via fp4gen.attention_with_kvcache; fp4gen.attention refuses it | "), r
