"""fp4gen.runtime.sm100_host on its own (the generated modules' use of it: tests/sm100)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fp4gen.runtime import sm100_host as host

FP4 = dict(kernel_name="k4", head_dim=128, softmax_scale=0.1, pv_fp8=False, pv_block_scaled=True,
           pv_sf_vec=32, v_k_major=True)
FP8 = dict(FP4, kernel_name="k8", pv_fp8=True, pv_block_scaled=False, v_k_major=False)


def test_import_needs_only_the_standard_library():
    code = ("import sys, fp4gen.runtime.sm100_host; "
            "print([m for m in ('torch', 'cutlass', 'jinja2', 'lark', 'fp4gen.numerics', 'fp4gen.lowering') "
            "if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_config_is_frozen_and_refuses_what_no_kernel_is():
    cfg = host.ForwardConfig(**FP4)
    with pytest.raises(AttributeError):
        cfg.head_dim = 64
    with pytest.raises(ValueError, match="pv_sf_vec must be 16 or 32"):
        host.ForwardConfig(**dict(FP4, pv_sf_vec=64))
    with pytest.raises(ValueError, match="FP4 V must be stored K-major"):
        host.ForwardConfig(**dict(FP4, v_k_major=False))


def test_each_host_reads_its_own_config():
    def build():
        raise AssertionError("nothing here compiles")

    h4, h8 = host.ForwardHost(host.ForwardConfig(**FP4), build), host.ForwardHost(host.ForwardConfig(**FP8), build)
    ops4, ops8 = h4.fake_operands(1, 200, 333, 2, 1), h8.fake_operands(1, 200, 333, 2, 1)
    assert isinstance(ops4, host.Operands) and not isinstance(ops4, h8.Operands)
    assert ops4.layouts()["v"].shape == (1, 128, 384 // 2) and ops4.layouts()["v"].cute_dtype == "Float4E2M1FN"
    assert ops8.layouts()["v"].shape == (1, 333, 128) and ops8.layouts()["sfv"].shape == (512,)
    with pytest.raises(ValueError, match="k8 targets sm_100a only"):
        h8.compile_only("sm_90a")
