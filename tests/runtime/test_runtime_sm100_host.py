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


# ------------------------------------------------------------------ the backward's host side
from fp4gen.runtime import sm100_bwd_host as bwd_host  # noqa: E402

BWD = dict(kernel_name="kb", head_dim=128, tile_m=128, softmax_scale=0.125)


def test_backward_host_import_needs_only_the_standard_library():
    code = ("import sys, fp4gen.runtime.sm100_bwd_host; "
            "print([m for m in ('torch', 'cutlass', 'jinja2', 'lark', 'fp4gen.numerics', 'fp4gen.lowering') "
            "if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_backward_compile_only_refuses_other_arches_and_variants():
    def build():
        raise AssertionError("nothing here compiles")

    h = bwd_host.BackwardHost(bwd_host.BackwardConfig(**BWD), build)
    with pytest.raises(ValueError, match="kb backward is a Blackwell kernel"):
        h.compile_only("sm_90a")
    with pytest.raises(ValueError, match="unknown backward variant 'fp8'"):
        h.compile_only("sm_100a", variants=("fp8",))


@pytest.mark.parametrize("heads,heads_kv,sq,sk", [(2, 2, 200, 333), (6, 2, 130, 190)])
def test_backward_prepares_padded_operands_and_sums_gqa(cpu_backward_checks, heads, heads_kv, sq, sk):
    """What the launch receives (padding, LSE in log2 units with +inf for empty rows, D, the
    causal offset, the dK/dV dtype per variant) and how the host finishes the results."""
    import math

    import torch

    seen = {}

    def launch(args, scale, offset, gqa):
        q, k, v, do, lse2, dsum, dq_acc, turn, dk_h, dv_h, scales = args
        assert scales.shape == (1, heads, 2) and (scales == 1).all()  # bf16 dO: no FP8 factors
        seen.update(scale=scale, offset=offset, gqa=gqa, lse2=lse2.clone(), dsum=dsum.clone(),
                    shapes=[tuple(t.shape) for t in args], dk_dtype=dk_h.dtype)
        dq_acc.fill_(1.0)
        dk_h.fill_(1.0)
        dv_h.fill_(2.0)

    h = bwd_host.BackwardHost(bwd_host.BackwardConfig(**BWD), build=None)
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    q, o, do = (torch.randn(1, sq, heads, 128, generator=g).to(bf) for _ in range(3))
    k, v = (torch.randn(1, sk, heads_kv, 128, generator=g).to(bf) for _ in range(2))
    lse = torch.randn(1, heads, sq, generator=g)
    lse[0, 0, 3] = float("-inf")  # a row that saw no key
    dq, dk, dv = h.backward(q, k, v, o, lse, do, softmax_scale=None, launch=launch)
    sqp = 256
    assert seen["scale"] == 0.125 and seen["offset"] == sk - sq and seen["gqa"] == (heads > heads_kv)
    assert seen["shapes"][4] == (1, heads, sqp) and seen["shapes"][6] == (1, heads, sqp, 128)
    assert seen["dk_dtype"] == (torch.float32 if heads > heads_kv else bf)
    l2 = seen["lse2"]
    assert math.isinf(l2[0, 0, 3]) and l2[0, 0, 3] > 0 and torch.isinf(l2[:, :, sq:]).all()
    torch.testing.assert_close(l2[0, 1, :sq], lse[0, 1] * math.log2(math.e))
    torch.testing.assert_close(seen["dsum"][:, :, :sq], (do.float() * o.float()).sum(-1).permute(0, 2, 1))
    assert (seen["dsum"][:, :, sq:] == 0).all()
    assert dq.shape == q.shape and torch.all(dq.float() == 0.125)
    group = heads // heads_kv
    assert dk.shape == k.shape and torch.all(dk.float() == group) and torch.all(dv.float() == 2 * group)


def test_both_hosts_compile_through_the_shared_cache_keyed_by_their_module(monkeypatch, tmp_path):
    """One compile/cache path: the sm100a hosts call cache.compiled_kernel with the generated
    module's own source (two modules never share an entry); without a readable source they
    compile in memory only."""
    from fp4gen.runtime import cache

    calls = []
    monkeypatch.setattr(cache, "compiled_kernel",
                        lambda name, variant, build, **kw: calls.append((name, variant, kw)) or "K")
    mod = tmp_path / "gen_mod.py"
    mod.write_text("def _build():\n    raise AssertionError('not compiled here')\n")
    ns = {}
    exec(compile(mod.read_text(), str(mod), "exec"), ns)
    fwd = host.ForwardHost(host.ForwardConfig(**FP4), ns["_build"])
    bwd = bwd_host.BackwardHost(bwd_host.BackwardConfig(**BWD), ns["_build"])
    assert fwd.compiled_kernel(0) == "K" and bwd.compiled(gqa=True) == "K"
    (n1, v1, kw1), (n2, v2, kw2) = calls
    assert (n1, v1) == ("forward", "arch=sm_100a") and (n2, v2) == ("backward", "arch=sm_100a,gqa=True")
    assert kw1["module_source"] == mod.read_text() == kw2["module_source"] and kw1["persist"]
    calls.clear()
    ns2 = {}
    exec(compile("def _build():\n    pass\n", "<no file>", "exec"), ns2)
    host.ForwardHost(host.ForwardConfig(**FP4), ns2["_build"]).compiled_kernel(0)
    assert calls[0][2] == {"module_source": "", "persist": False, "enable_tvm_ffi": False}
