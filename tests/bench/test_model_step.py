"""bench/model_step.py on the CPU: a tiny SDPA row runs, bad names are refused, kernels classify."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("model_step", ROOT / "bench" / "model_step.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_tiny_cpu_rows(tmp_path, monkeypatch):
    m = load()
    monkeypatch.setenv("OUT", str(tmp_path))
    assert m.main(["--models", "gpt-d768", "--seqs", "32", "--recipes", "sdpa", "--device", "cpu",
                   "--layers", "1", "--tokens", "32", "--iters", "1", "--warmup", "0", "--rounds", "1",
                   "--name", "tiny"]) == 0
    doc = json.loads((tmp_path / "tiny.json").read_text())
    rows = doc["rows"]
    assert [(r["mode"], r["graphs"]) for r in rows] == [("train", "eager"), ("prefill", "eager")]
    assert all(r["ratio_vs_sdpa"] == 1.0 and r["ms_median"] > 0 for r in rows)
    assert 4.0 < rows[0]["loss"] < 7.0  # cross-entropy of a fresh model over 256 bytes ~ ln 256
    assert doc["command"].startswith("python3 bench/model_step.py --models gpt-d768")


def test_unknown_names_are_refused(capsys):
    m = load()
    with pytest.raises(SystemExit) as e:
        m.parse_args(["--recipes", "sdpa,fp9"])
    assert e.value.code == 2 and "unknown recipe fp9" in capsys.readouterr().err


def test_kernel_classes():
    m = load()
    assert m.kernel_class("kernel_cutlass_kernel_fp4gendevicesm90forwardForwardKernel_object_at_0") == "attention"
    assert m.kernel_class("kernel_cutlass_kernel_fp4gendevicebwd_prep_PreFp8_object_at_0") == "quantize/prep"
    assert m.kernel_class("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention"
    assert m.kernel_class("kernel_QuantizeFp8_1") == "quantize/prep"
    assert m.kernel_class("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert m.kernel_class("void at::native::vectorized_elementwise_kernel<4>") == "norm/elementwise"
    assert m.kernel_class("some_unknown_kernel") == "other"
