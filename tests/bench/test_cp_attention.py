"""bench/cp_attention.py on the CPU: the --cpu-smoke run (2 gloo processes, reference backend)
writes a complete JSON, the scaling columns follow their definition, bad names are refused."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("cp_attention", ROOT / "bench" / "cp_attention.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_cpu_smoke_writes_every_row(tmp_path):
    m = load()
    # as a script, as CI and a user run it (mp.spawn's children re-import the script as __main__)
    cmd = [sys.executable, str(ROOT / "bench" / "cp_attention.py"), "--cpu-smoke", "--out-dir", str(tmp_path),
           "--name", "smoke"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert doc["command"] == "python3 bench/cp_attention.py --cpu-smoke --out-dir " + str(tmp_path) + " --name smoke"
    assert doc["world"] == 2 and doc["cpu_smoke"] is True
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: the temporary file is gone
    rows = {(r["impl"], r.get("pass")): r for r in doc["rows"]}
    S, H, D = 256, 2, 32
    for impl in m.IMPLS:
        if impl.startswith("torch-cp-"):
            # PyTorch's CP SDPA has no CPU kernel to dispatch to: a row that says so, no timing
            assert any(r["impl"] == impl for r in doc["rows"]), impl
            continue
        for pas in ("fwd", "bwd"):
            r = rows[(impl, pas)]
            assert r["S"] == S and r["H"] == H and r["D"] == D and r["ms"] > 0, r
            flops = 2.0 * S * S * H * D * (2.5 if pas == "bwd" else 1.0)  # causal: half of 4 B H S^2 D
            assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
            if impl.startswith("fp4gen-"):
                assert r["single_ref_S"] == S
                single = rows[("single-fp4gen-" + impl.split("-")[1], pas)]
                assert r["speedup_vs_single"] == pytest.approx(single["ms"] / r["ms"])
                assert r["scaling_efficiency"] == pytest.approx(r["speedup_vs_single"] / 2)
    # every CP implementation computed the same attention as the BF16 ring (the shards line up)
    assert rows[("fp4gen-bf16-a2a", "fwd")]["cosine_vs_fp4gen_bf16_ring"] > 0.99999
    assert rows[("fp4gen-fp8-ring", "fwd")]["cosine_vs_fp4gen_bf16_ring"] > 0.99
    assert rows[("single-fp4gen-bf16", "fwd")]["cosine_vs_fp4gen_bf16_ring"] > 0.99999
    assert rows[("fp4gen-fp8-ring", "fwd")]["comm"]["exchange_fwd"]["k"].startswith("fp8")


def test_scaling_against_the_largest_single_gpu_s():
    m = load()
    rows = [dict(impl="single-fp4gen-fp8", **{"pass": "fwd"}, H=16, S=1024, ms=4.0, tflops=100.0),
            dict(impl="single-fp4gen-fp8", **{"pass": "fwd"}, H=16, S=2048, error="out of memory on one GPU"),
            dict(impl="fp4gen-fp8-ring", **{"pass": "fwd"}, H=16, S=1024, ms=2.5, tflops=160.0, world=2),
            dict(impl="fp4gen-fp8-ring", **{"pass": "fwd"}, H=16, S=2048, ms=8.0, tflops=180.0, world=2),
            dict(impl="torch-cp-cudnn", **{"pass": "fwd"}, H=16, S=1024, ms=3.0, tflops=130.0, world=2)]
    m.add_scaling(rows)
    same, larger, torch_row = rows[2], rows[3], rows[4]
    assert same["speedup_vs_single"] == 4.0 / 2.5 and same["scaling_efficiency"] == 0.8
    assert larger["single_ref_S"] == 1024 and larger["speedup_vs_single"] == 1.8  # 180 / 100 TFLOP/s
    assert "speedup_vs_single" not in torch_row  # no BF16 single-GPU row to compare with
    assert same["ratio_vs_torch_cp_cudnn"] == 3.0 / 2.5 and torch_row["ratio_vs_torch_cp_cudnn"] == 1.0
    assert "ratio_vs_torch_cp_cudnn" not in larger  # PyTorch CP did not run at S = 2048


def test_spec_file_has_both_masks_for_both_recipes():
    from fp4gen import parse_text

    m = load()
    specs = parse_text(m.spec_text(128, "sm90a"), filename="<cp bench>")
    assert sorted(s.name for s in specs) == ["cp_bf16_causal_d128", "cp_bf16_none_d128",
                                             "cp_fp8_causal_d128", "cp_fp8_none_d128"]
    assert all(s.backward is not None for s in specs)


def test_bad_arguments_are_refused(capsys):
    m = load()
    with pytest.raises(SystemExit) as e:
        m.parse_args(["--impls", "fp4gen-bf16-ring,fp4gen-fp4-ring"])
    assert e.value.code == 2 and "unknown implementation fp4gen-fp4-ring" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        m.parse_args(["--passes", "sideways"])


@pytest.mark.gpu
def test_two_gpu_run_small(tmp_path):
    """The real run at one small shape on 2 GPUs (NCCL): every implementation times, and each O
    shard matches the BF16 ring's. The lead runs this on nvidia-h200-x2."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (NCCL)")
    cmd = [sys.executable, str(ROOT / "bench" / "cp_attention.py"), "--nproc", "2", "--seqlens", "8192",
           "--heads", "16", "--warmup", "1", "--iters", "2", "--out-dir", str(tmp_path), "--name", "small"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "small.json").read_text())["rows"]
    failed = [r for r in rows if "error" in r]
    assert failed == [], failed
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0, r
        if r["impl"] != "fp4gen-bf16-ring":
            want = 0.99 if "fp8" in r["impl"] else 0.999
            assert r["cosine_vs_fp4gen_bf16_ring"] > want, r
