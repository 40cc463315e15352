"""`fp4gen compile` says when a spec's backward block is not generated (sm100a refusals)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile(spec, tmp_path):
    return subprocess.run([sys.executable, "-m", "fp4gen.cli.main", "compile", spec, "-o", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_refused_sm100_backward_is_a_warning_with_its_spec_line(tmp_path):
    res = _compile(os.path.join(ROOT, "examples", "fa4_nvfp8_d128.attn"), tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "fa4_nvfp8_d128_sm100a.py").is_file()  # the forward is still written
    warn = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warn) == 1 and "fa4_nvfp8_d128.attn:22:5: fa4_nvfp8_d128: backward not generated" in warn[0], res.stderr


def test_generated_backwards_give_no_warning(tmp_path):
    for name in ("sm100_bwd_d128.attn", "sm90_bf16_d128.attn"):
        res = _compile(os.path.join(ROOT, "examples", name), tmp_path)
        assert res.returncode == 0 and "warning:" not in res.stderr, res.stderr
