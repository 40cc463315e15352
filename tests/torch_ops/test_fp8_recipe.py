"""The FP8 P/V training recipe (examples/sm90_fp8_train_d128.attn) through fp4gen.torch_ops.

On the CPU: the spec plans a BF16 backward that recomputes S from the caller's bf16 q, k;
autograd through the custom ops (reference backend) gives gradients close to float64
attention; opcheck and torch.compile(fullgraph=True) with this spec's key; and the
dispatch on a (pretend) Hopper GPU sends the forward to the generated FP8 module and the
backward to that module's generated bf16 ``backward`` (its host code for real, the kernel
launch replaced by the tile emulator of tests/sm90_bwd/test_bwd_host.py).
On a Hopper GPU (``-m gpu``): the real generated kernels, forward and backward.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.torch_ops import attention

from .conftest import STANDIN, plain_attention64

ROOT = Path(__file__).resolve().parents[2]
SPEC_FILE = ROOT / "examples" / "sm90_fp8_train_d128.attn"
KERNEL = "sm90_fp8_train_bf16grad_causal_d128"  # the BF16-gradient backward (the CPU tile emulator models it)
SPEC = f"{SPEC_FILE}::{KERNEL}"

pytestmark = pytest.mark.skipif(not SPEC_FILE.is_file(), reason=f"{SPEC_FILE} is missing")


def _spec():
    import fp4gen

    return [s for s in fp4gen.parse_file(str(SPEC_FILE)) if s.name == KERNEL][0]


def _qkv(b=1, s=200, h=2, hkv=2, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, 128, generator=g)
    k = torch.randn(b, s, hkv, 128, generator=g)
    v = torch.randn(b, s, hkv, 128, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _f64_grads(q, k, v, w, scale):
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    o = plain_attention64(*leaves, scale=scale, causal=True)
    (o * w.double().cpu()).sum().backward()
    return o.detach(), [t.grad for t in leaves]


def _real_reference(reference_backend):
    if reference_backend is STANDIN:
        pytest.skip("needs the real reference backend (fp4gen.numerics.reference)")
    return reference_backend


# ---------------------------------------------------------------------------
# the spec


def test_recipe_spec_and_backward_plan():
    import fp4gen
    from fp4gen.ir.spec import Format, Mask, Target

    spec = _spec()
    assert spec.target is Target.SM90A and spec.mask is Mask.CAUSAL and spec.head_dim == 128
    assert (spec.q.format, spec.k.format, spec.p.format, spec.v.format, spec.o.format) == (
        Format.FP8E4M3, Format.FP8E4M3, Format.FP8E4M3, Format.FP8E4M3, Format.BF16)
    assert spec.q.block == spec.k.block == 128
    # the backward recomputes S from bf16 q, k: the forward's FP8 Q/K are not reused
    assert set(spec.backward.reuse) == {"lse"} and not spec.backward.deterministic
    bw = fp4gen.plan(spec).backward
    assert bw is not None, "the planner recorded no backward plan for the FP8 recipe"
    assert bw.mma_format == "bf16" and bw.causal and bw.reuse == ("lse",)
    assert all(f == "bf16" for _, f in bw.grad_formats)


def test_recipe_renders_forward_and_backward(tmp_path):
    import fp4gen

    (path,) = fp4gen.compile_spec(str(SPEC_FILE), tmp_path, kernel=KERNEL)
    text = Path(path).read_text()
    for needle in ("def forward(", "quantize_inputs = ", "def backward(", "compile_only_backward = ",
                   'TARGET = "sm90a"', "reuse: lse"):
        assert needle in text, needle


@pytest.mark.slow
def test_recipe_module_compiles_for_sm90a(tmp_path):
    """Forward (FP8), fused quantizer and bf16 backward compile for sm_90a without a GPU.
    Once generated/ holds this kernel, tests/test_generated_compile.py covers it."""
    if (ROOT / "generated" / f"{KERNEL}_sm90a.py").is_file():
        pytest.skip("generated/ has this module: tests/test_generated_compile.py compiles it")
    import fp4gen

    (path,) = fp4gen.compile_spec(str(SPEC_FILE), tmp_path, kernel=KERNEL)
    child = (
        "import importlib.util, json, sys\n"
        "s = importlib.util.spec_from_file_location('m', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
        "print('RESULT ' + json.dumps(m.compile_only('sm_90a')))\n")
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    for name in (KERNEL, f"{KERNEL}.backward", f"{KERNEL}.backward_gqa"):
        assert f'"{name}"' in names, names


# ---------------------------------------------------------------------------
# autograd on the reference backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recipe_gradients_vs_float64(reference_backend, dtype):
    _real_reference(reference_backend)
    q, k, v = _qkv(s=200, dtype=dtype, seed=1)  # 200: a partial second 128-token scale block
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch_ops.reset_dispatch_counts()
    o = attention(*leaves, spec=SPEC, causal=True)
    (o.float() * w).sum().backward()
    assert torch_ops.dispatch_counts() == {"bwd/reference": 1, "fwd/reference": 1}
    assert o.dtype == dtype and all(t.grad.dtype == dtype for t in leaves)
    o64, g64 = _f64_grads(q, k, v, w, _spec().scale)
    # FP8 Q/K/P/V: a few percent from exact attention, but clearly not exact
    err_o = _rel_l2(o, o64)
    assert 1e-3 < err_o < 0.08, err_o
    for name, t, ref in zip("qkv", leaves, g64):
        err = _rel_l2(t.grad, ref)
        assert 1e-3 < err < 0.08, f"d{name}: rel-L2 {err}"


def test_recipe_autograd_is_the_reference_backward(reference_backend):
    """The op's gradients are exactly fp4gen.numerics.reference.backward on the saved state."""
    ref = _real_reference(reference_backend)
    spec = _spec()
    q, k, v = _qkv(s=150, h=4, hkv=2, seed=3)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    attention(*leaves, spec=SPEC, causal=True).backward(do)
    o, lse = ref.forward(q, k, v, spec)
    want = ref.backward(q, k, v, o.to(q.dtype), lse, do, spec)
    for name, t, w in zip("qkv", leaves, want):
        torch.testing.assert_close(t.grad, w.to(t.dtype), rtol=0, atol=0, msg=lambda m: f"d{name}: {m}")


def test_recipe_opcheck(reference_backend):
    _real_reference(reference_backend)
    key = torch_ops.spec_key(SPEC, causal=True)
    assert key.startswith(KERNEL + "@")
    q, k, v = _qkv(s=130, h=4, hkv=2, seed=5)
    for t in (q, k, v):
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.fp4gen.attention_fwd.default, (q, k, v, key, None, "auto"))
    o, lse, state = torch.ops.fp4gen.attention_fwd(q.detach(), k.detach(), v.detach(), key, None, "auto")
    assert lse.shape == (1, 4, 130) and lse.dtype == torch.float32
    do = torch.randn_like(o)
    torch.library.opcheck(torch.ops.fp4gen.attention_bwd.default,
                          (q.detach(), k.detach(), v.detach(), o, lse, do, state, key, None, "auto"))


def test_recipe_torch_compile_fullgraph(reference_backend):
    _real_reference(reference_backend)
    torch._dynamo.reset()

    def f(q, k, v):
        return attention(q, k, v, spec=SPEC, causal=True).float().square().sum()

    q, k, v = _qkv(s=140, seed=6)
    eager = [t.clone().requires_grad_(True) for t in (q, k, v)]
    comp = [t.clone().requires_grad_(True) for t in (q, k, v)]
    loss_e = f(*eager)
    loss_e.backward()
    loss_c = torch.compile(f, backend="aot_eager", fullgraph=True)(*comp)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# dispatch to the generated module (a pretend Hopper GPU; the kernels emulated)


def _bwd_emulator():
    path = ROOT / "tests" / "sm90_bwd" / "test_bwd_host.py"
    try:
        s = importlib.util.spec_from_file_location("_fp8_recipe_bwd_host", path)
        m = importlib.util.module_from_spec(s)
        s.loader.exec_module(m)
        return m.emulate_kernel
    except Exception as e:  # the emulator lives in another area's tests
        pytest.skip(f"cannot import the backward tile emulator from {path}: {type(e).__name__}: {e}")


@pytest.fixture
def hopper_dispatch(monkeypatch, tmp_path):
    """Make torch_ops believe CPU tensors sit on an sm90a GPU, find the recipe's generated
    module as it would on the H200 (fp4gen.generated, else rendered from the .attn file),
    and let it run on the CPU: the FP8 forward kernel is replaced by the reference
    forward (its numerics contract), the backward's host code runs for real with the
    kernel launch replaced by the tile emulator."""
    from fp4gen.runtime import checks

    ref = torch_ops._reference()
    if ref is STANDIN or not hasattr(ref, "forward"):
        pytest.skip("needs the real reference backend")
    emulate = _bwd_emulator()
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a")
    key = torch_ops.spec_key(SPEC, causal=True)
    entry = torch_ops._entry(key)
    entry.found.clear()
    mod, reason = torch_ops._find_generated(entry, "sm90a")
    assert mod is not None, f"no generated sm90a module for the recipe: {reason}"
    calls = []

    def forward(q, k, v, *, softmax_scale=None, return_lse=False):
        calls.append("fwd")
        o, lse = ref.forward(q, k, v, torch_ops._ref_spec(entry, softmax_scale))
        o = o.to(q.dtype)
        return (o, lse) if return_lse else o

    def launch(args, scale, offset, gqa):
        calls.append("bwd-kernel")
        emulate(mod, args, scale, offset, gqa)

    orig_check = checks.check_backward
    monkeypatch.setattr(checks, "check_backward",
                        lambda *a, **kw: orig_check(*a, **dict(kw, device_type=None, tma=False)))
    monkeypatch.setattr(checks, "require_arch", lambda *a, **kw: None)
    monkeypatch.setattr(mod, "forward", forward)
    monkeypatch.setattr(mod, "_bwd_launch", launch)
    yield mod, calls
    entry.found.clear()  # the next lookup (a real GPU) must not see this test's module


def test_recipe_dispatches_to_generated_fwd_and_bwd(hopper_dispatch):
    mod, calls = hopper_dispatch
    info = torch_ops.explain(SPEC, "cpu", causal=True)
    assert info["forward"] == info["backward"] == f"generated:{mod.__name__}", info
    q, k, v = _qkv(b=2, s=200, h=4, hkv=2, dtype=torch.bfloat16, seed=7)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch_ops.reset_dispatch_counts()
    o = attention(*leaves, spec=SPEC, causal=True, backend="generated")
    (o.float() * w).sum().backward()
    assert calls == ["fwd", "bwd-kernel"]
    assert torch_ops.dispatch_counts() == {"bwd/generated": 1, "fwd/generated": 1}
    assert all(t.grad.dtype == torch.bfloat16 and t.grad.shape == t.shape for t in leaves)
    # bf16 backward from the caller's q, k, v on the FP8 forward's o and lse: as close to
    # float64 attention as the FP8 forward allows
    _, g64 = _f64_grads(q, k, v, w, _spec().scale)
    for name, t, ref in zip("qkv", leaves, g64):
        err = _rel_l2(t.grad, ref)
        assert err < 0.08, f"d{name}: rel-L2 {err}"


def test_recipe_generated_backward_reads_bf16_v(hopper_dispatch):
    """dV and dP come from the caller's bf16 v, not from FP8 V: with the exact forward's o
    and lse, the generated backward matches float64 autograd to bf16 accuracy."""
    mod, _ = hopper_dispatch
    spec = _spec()
    q, k, v = _qkv(b=1, s=190, h=2, hkv=2, dtype=torch.bfloat16, seed=9)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    s = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1]) * spec.scale
    s = s.masked_fill(torch.ones(190, 190, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1).float().detach()
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), leaves[2])
    o.backward(do.double())
    dq, dk, dv = mod.backward(q, k, v, o.detach().to(torch.bfloat16), lse, do)
    for name, got, ref in zip("qkv", (dq, dk, dv), leaves):
        err = _rel_l2(got, ref.grad)
        assert err < 1.5e-2, f"d{name}: rel-L2 {err}"


def test_recipe_generated_backward_agrees_with_the_reference(hopper_dispatch):
    """The oracle's backward for this spec (bf16 dO, so bf16 V and a bf16 P in dP and dV,
    bf16 Q/K for dQ and dK) and the generated backward compute the same thing from the
    same forward state, up to accumulation order."""
    mod, _ = hopper_dispatch
    ref = torch_ops._reference()
    spec = _spec()
    q, k, v = _qkv(b=1, s=260, h=4, hkv=2, dtype=torch.bfloat16, seed=13)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    o, lse = ref.forward(q, k, v, spec)  # the FP8 forward's o and LSE
    o = o.to(torch.bfloat16)
    got = mod.backward(q, k, v, o, lse, do)
    want = ref.backward(q, k, v, o, lse, do, spec)
    for name, g, w in zip("qkv", got, want):
        err = _rel_l2(g, w)
        assert err < 1e-2, f"d{name}: rel-L2 {err} between the generated and the reference backward"


# ---------------------------------------------------------------------------
# the real kernels (H200)


@pytest.mark.gpu
def test_recipe_on_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    info = torch_ops.explain(SPEC, "cuda", causal=True)
    assert info["forward"].startswith("generated") and info["backward"].startswith("generated"), info
    q, k, v = _qkv(b=2, s=1000, h=4, hkv=4, dtype=torch.bfloat16, seed=11, device="cuda")
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).cuda()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch_ops.reset_dispatch_counts()
    o = attention(*leaves, spec=SPEC, causal=True, backend="generated")
    (o.float() * w).sum().backward()
    assert torch_ops.dispatch_counts() == {"bwd/generated": 1, "fwd/generated": 1}
    o64, g64 = _f64_grads(q, k, v, w, _spec().scale)
    assert _rel_l2(o.cpu(), o64) < 0.08
    for name, t, ref in zip("qkv", leaves, g64):
        err = _rel_l2(t.grad.cpu(), ref)
        assert torch.isfinite(t.grad).all() and err < 0.08, f"d{name}: rel-L2 {err}"
