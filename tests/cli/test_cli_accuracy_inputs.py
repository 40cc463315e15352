"""``fp4gen accuracy SPEC --inputs FILE|DIR``: saved q/k/v, per head and overall (issue 21)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import EXAMPLES

FP8 = EXAMPLES / "sm90_fp8_exp_d128.attn"
KERNEL = "sm90_fp8_exp_d128"  # non-causal


def _case(seed=0, S=64, H=4, Hkv=2, D=64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, S, H, D, generator=g) * scale
    k = torch.randn(1, S, Hkv, D, generator=g) * scale
    v = torch.randn(1, S, Hkv, D, generator=g)
    return q, k, v


def _oracle(q, k, v):
    """float64 softmax attention written out here (GQA by repeating k/v heads)."""
    H, hk = q.shape[2], k.shape[2]
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(H // hk, dim=1) for x in (k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    return (p @ v).transpose(1, 2)


def _rel(x, r):
    return float((x.double() - r).norm() / r.norm())


def test_inputs_file_per_head_and_overall(cli, tmp_path):
    from fp4gen.numerics import reference
    from fp4gen.numerics.accuracy import for_head_dim
    from fp4gen.frontend import parse_file

    q, k, v = _case()
    torch.save({"q": q.half(), "k": k.half(), "v": v.half()}, tmp_path / "a.pt")
    r = cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", tmp_path / "a.pt", "--json")
    assert r.rc == 0, r
    rep = json.loads(r.out)
    case = rep["cases"][0]
    assert case["shape"] == {"q": [1, 64, 4, 64], "k": [1, 64, 2, 64]}
    assert len(case["per_head"]) == 4
    # the numbers from a computation written here: the spec's reference numerics on the file's
    # (fp16) tensors against this file's own float64 softmax
    spec = for_head_dim(next(s for s in parse_file(str(FP8)) if s.name == KERNEL), 64)
    qh, kh, vh = (x.half().float() for x in (q, k, v))
    o, _ = reference.forward(qh, kh, vh, spec)
    ref = _oracle(qh, kh, vh)
    assert case["rel_l2"] == pytest.approx(_rel(o, ref), rel=1e-6)
    assert rep["overall_rel_l2"] == pytest.approx(_rel(o, ref), rel=1e-6)
    for h in range(4):
        assert case["per_head"][h]["rel_l2"] == pytest.approx(_rel(o[:, :, h], ref[:, :, h]), rel=1e-6)
    assert 0.01 < case["rel_l2"] < 0.2  # FP8 error, not bf16's and not a broken recipe's
    text = cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", tmp_path / "a.pt")
    assert text.rc == 0 and "| | 3 |" in text.out and "overall cosine" in text.out


def test_inputs_folder_reads_every_file_and_pools_them(cli, tmp_path):
    for i in range(2):
        q, k, v = _case(seed=i, scale=1 + 2 * i)  # the second one peaked: a larger error
        torch.save({"q": q, "k": k, "v": v, "meta": {"layer": i}}, tmp_path / f"layer{i}.pt")
    (tmp_path / "notes.txt").write_text("ignored: not *.pt")
    rep = json.loads(cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", tmp_path, "--json").out)
    names = [c["inputs"] for c in rep["cases"]]
    assert [n.rsplit("/", 1)[-1] for n in names] == ["layer0.pt", "layer1.pt"]
    assert [c["meta"]["layer"] for c in rep["cases"]] == [0, 1]
    rels = [c["rel_l2"] for c in rep["cases"]]
    assert rels[1] > rels[0] and min(rels) < rep["overall_rel_l2"] < max(rels)


def test_capture_metadata_mismatch_is_noted(cli, tmp_path):
    q, k, v = _case()
    torch.save({"q": q, "k": k, "v": v, "meta": {"causal": True, "scale": 0.5}}, tmp_path / "c.pt")
    r = cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", tmp_path / "c.pt")
    assert r.rc == 0
    assert "captured with causal=True" in r.err and "softmax scale 0.5" in r.err


@pytest.mark.parametrize("content,message", [
    ({"q": 1, "k": 2}, "missing v"),
    ({"q": "x", "k": "x", "v": "x"}, "q must be a floating-point tensor"),
    ({"q": torch.zeros(2, 3), "k": torch.zeros(2, 3), "v": torch.zeros(2, 3)}, "q must be (B, S, H, D)"),
    ({"q": torch.zeros(1, 4, 3, 8), "k": torch.zeros(1, 4, 2, 8), "v": torch.zeros(1, 4, 2, 8)},
     "multiple of the key/value heads"),
    ({"q": torch.zeros(1, 4, 2, 8), "k": torch.zeros(1, 4, 2, 8), "v": torch.zeros(1, 5, 2, 8)},
     "must have the same shape"),
    ({"q": torch.zeros(1, 4, 2, 8), "k": torch.zeros(1, 4, 2, 8), "v": torch.zeros(1, 4, 2, 8), "Q": 1},
     "unknown key(s) Q"),
    ({"q": torch.full((1, 4, 2, 8), float("nan")), "k": torch.zeros(1, 4, 2, 8), "v": torch.zeros(1, 4, 2, 8)},
     "q has 64 non-finite values"),
    ([1, 2, 3], "expected a dict"),
])
def test_bad_inputs_exit_1_with_the_file_name(cli, tmp_path, content, message):
    f = tmp_path / "bad.pt"
    torch.save(content, f)
    r = cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", f)
    assert r.rc == 1, r
    assert str(f) in r.err and message in r.err and "Traceback" not in r.err


def test_unreadable_missing_and_empty_inputs(cli, tmp_path):
    (tmp_path / "junk.pt").write_text("not a torch file")
    (tmp_path / "empty").mkdir()
    for path, message in ((tmp_path / "junk.pt", "not a torch.save file"),
                          (tmp_path / "nope.pt", "no such file or folder"),
                          (tmp_path / "empty", "no *.pt files")):
        r = cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", path)
        assert r.rc == 1 and message in r.err and str(path) in r.err, r


def test_transform_smooth_k_fixes_massive_k_channels(cli, tmp_path):
    from fp4gen.numerics import activations

    c = activations.synthetic("massive_k", seqlen=128, heads=2, head_dim=64)
    activations.save(tmp_path / "mk.pt", c.q, c.k, c.v, meta=c.meta, dtype=torch.float32)
    plain = json.loads(cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", tmp_path / "mk.pt", "--json").out)
    smooth = json.loads(cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", tmp_path / "mk.pt", "--json",
                            "--transform", "smooth_k").out)
    assert smooth["cases"][0]["transforms"] == ["smooth_k"]
    assert smooth["overall_rel_l2"] < plain["overall_rel_l2"] / 2


def test_transform_errors(cli, tmp_path):
    q, k, v = _case()
    torch.save({"q": q, "k": k, "v": v}, tmp_path / "a.pt")
    r = cli("accuracy", FP8, "--kernel", KERNEL, "--inputs", tmp_path / "a.pt", "--transform", "smooth_q")
    assert r.rc == 2 and "unknown smooth_q" in r.err
    r = cli("accuracy", FP8, "--kernel", KERNEL, "--transform", "smooth_k")
    assert r.rc == 2 and "--transform needs --inputs" in r.err
    soft = EXAMPLES / "sm90_bf16_softcap_d128.attn"
    r = cli("accuracy", soft, "--inputs", tmp_path / "a.pt", "--transform", "smooth_k")
    assert r.rc == 1 and "softcap" in r.err, r
