"""fp4gen.runtime.sm90_bwd_host without a GPU and without compiling: which tensors a variant
hands the kernel, and how it compiles (the arch as an option, never the process's
CUTE_DSL_ARCH; the compile cache at run time, in memory for compile_only)."""
from __future__ import annotations

import os
import types
from dataclasses import dataclass

import pytest

from fp4gen.runtime import cache
from fp4gen.runtime import sm90_bwd_host as H


@dataclass(frozen=True)
class _Config:  # the fields of device.sm90.backward.BackwardConfig the host reads
    head_dim: int = 128
    tile_m: int = 64
    tile_n: int = 128
    s_fp8: bool = False
    do_fp8: bool = False
    ds_fp8: bool = False
    deterministic: bool = False


def _host(**flags):
    prep = types.SimpleNamespace(compile_only=lambda arch, d: [f"prep_{arch}_d{d}"])
    return H.BackwardHost("k", _Config(**flags), kernel=lambda cfg: ("kernel", cfg), prep=prep, quantize=None,
                          module_file=__file__)


@pytest.mark.parametrize("flags, present", [
    ({}, ()),
    (dict(deterministic=True), ("dq_turn",)),
    (dict(s_fp8=True), ("q8", "k8", "scale_q", "scale_k")),
    (dict(s_fp8=True, do_fp8=True, ds_fp8=True), ("q8", "k8", "scale_q", "scale_k", "dot8", "scale_v", "scale_do",
                                                  "qt8", "kt8")),
])
def test_kernel_args_put_none_where_a_variant_reads_nothing(flags, present):
    host = _host(**flags)
    always = ("q", "k", "v", "do", "lse2", "dsum", "dq_acc", "dk", "dv")
    names = [n for n, _ in H.KERNEL_TENSORS if n in always or n in present]
    full = host.kernel_args(names)  # stand-ins: each tensor is its name
    assert full == [n if n in names else None for n, _ in H.KERNEL_TENSORS]
    with pytest.raises(ValueError, match="more kernel arguments"):
        host.kernel_args(names + ["extra"])


def test_compile_passes_the_arch_and_leaves_cute_dsl_arch_alone(monkeypatch):
    import cutlass.cute as cute

    seen = []

    def fake_compile(kernel, *args, options=""):
        seen.append((kernel, len(args), options, os.environ.get("CUTE_DSL_ARCH")))
        return f"compiled {len(seen)}"

    monkeypatch.setattr(cute, "compile", fake_compile)
    monkeypatch.setattr(H.BackwardHost, "fake_args", lambda self, gqa: ("arg",) * 3)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    cached = []
    monkeypatch.setattr(cache, "compiled_kernel", lambda name, variant, build, **kw: cached.append(
        (name, variant, kw["persist"], kw["enable_tvm_ffi"])) or build())
    host = _host(deterministic=True)
    assert host.compile_only("sm_90a") == ["k.backward", "k.backward_gqa", "prep_sm_90a_d128"]
    assert [s[2] for s in seen] == ["--gpu-arch sm_90a"] * 2 and all(s[3] is None for s in seen)
    assert cached == []  # compile_only compiles in memory (its PTX is what the checks read)
    host.compile(None, tvm_ffi=True, gqa=True)  # run time: through the one cache path
    assert seen[-1][2] == "--gpu-arch sm_90a --enable-tvm-ffi"
    assert cached == [("backward", "arch=sm_90a,tvm_ffi=True,gqa=True", True, True)]
    host.compile(None, tvm_ffi=True, gqa=True)  # memoized: no second compile
    assert len(seen) == 3 and "CUTE_DSL_ARCH" not in os.environ
    with pytest.raises(ValueError, match="Hopper kernel"):
        host.compile_only("sm_100a")
