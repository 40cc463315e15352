"""Issue 24: a fused QKV projection's q, k, v views reach the FP8 recipes' kernels without a copy.

The model hands ``fp4gen.attention`` views of one (B, S, (H + 2 Hkv) D) projection (bench/model_step.py);
the FP8 training recipe's step used to copy q, k and v in the forward and again in the backward
(``.contiguous()``, 0.76 ms of ``direct_copy_kernel_cuda`` per H200 step at S 4096). Here the real
generated sm90a modules' host code (torch_ops, ``ForwardHost``, ``BackwardHost``) runs on CPU tensors
that pretend to sit on an sm90a GPU, with the GPU-only pieces replaced by stubs that record what they
receive and compute nothing (the quantizer, the kernel launches, dO's preprocessing): the tests assert
that what reaches them shares the projection's storage, and, under a dispatch mode, that no aten copy
(copy_, clone, _to_copy) reads the projection's storage anywhere on the path. The planted-fault tests
put a copy back and check that both checks see it.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp4gen import torch_ops
from fp4gen.device import bwd_prep, quantize
from fp4gen.runtime import checks, sm90_bwd_host

ROOT = Path(__file__).resolve().parents[2]
DS8 = str(ROOT / "examples/sm90_fp8_train_d128.attn") + "::sm90_fp8_train_ds8_causal_d128"
DIRECTP = str(ROOT / "examples/sm90_fp8_directp_d128.attn") + "::sm90_fp8_directp_causal_d128"
B, S, H, HKV, D = 2, 96, 4, 2, 128

_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default}


class CopyCounter(TorchDispatchMode):
    """Counts the aten copies whose source shares ``storage``'s memory."""

    def __init__(self, storage):
        super().__init__()
        self.ptr = storage.data_ptr()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _COPIES:
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if isinstance(src, torch.Tensor) and src.untyped_storage().data_ptr() == self.ptr:
                self.copies.append((str(func), tuple(src.shape)))
        return func(*args, **kwargs)


def _fused_qkv(requires_grad=True):
    """q, k, v as a fused projection gives them: views of one tensor, token stride (H + 2 Hkv) D."""
    x = torch.randn(B, S, (H + 2 * HKV) * D, dtype=torch.bfloat16, requires_grad=requires_grad)
    q, k, v = x.split([H * D, HKV * D, HKV * D], -1)
    return x, q.view(B, S, H, D), k.view(B, S, HKV, D), v.view(B, S, HKV, D)


@pytest.fixture
def on_pretend_sm90a(monkeypatch):
    """CPU tensors pass for an sm90a GPU: the dispatcher's architecture, the modules' device and
    arch checks (their layout checks stay), and the GPU-only pieces as recording stubs. Returns
    (seen, install): ``install(spec)`` stubs the spec's generated module and returns it; ``seen``
    maps a stub's name to the tensors it got."""
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a")
    for name in ("check_qkv", "check_backward"):
        orig = getattr(checks, name)
        monkeypatch.setattr(checks, name, lambda *a, _orig=orig, **kw: _orig(*a, **{**kw, "device_type": None}))
    monkeypatch.setattr(checks, "require_arch", lambda *a, **kw: None)
    seen: dict = {}

    def quantize_inputs(q, k, v, fast=True, for_backward=False, transposed_qk=False):
        seen["quantize_inputs"] = (q, k, v)
        f8, f32 = torch.float8_e4m3fn, torch.float32
        nq, nk = -(-q.shape[1] // 128), -(-k.shape[1] // 128)
        out = (torch.empty(q.shape, dtype=f8), torch.empty(k.shape, dtype=f8),
               torch.empty((B, HKV, D, -(-k.shape[1] // 32) * 32), dtype=f8),
               torch.ones((B, H, nq)), torch.ones((B, HKV, nk)), torch.ones((B, HKV), dtype=f32))
        if for_backward:
            out += (torch.empty(v.shape, dtype=f8),)
        if transposed_qk:
            out += tuple(torch.empty(quantize.transposed_shape(x.shape, op), dtype=f8) for x, op in ((q, "q"), (k, "k")))
        return out

    def run_prepared(ins, o, lse, *a, **kw):
        seen["run_prepared"] = ins
        o.zero_()
        lse.zero_()

    def preprocess_fp8(o, do, lse, sqp):
        seen["preprocess_fp8"] = (o, do)
        f8 = torch.float8_e4m3fn
        return (torch.zeros((B, H, sqp)), torch.zeros((B, H, sqp)), torch.zeros((B, H, sqp, D)),
                torch.empty(do.shape, dtype=f8), torch.empty((B, H, sqp // 64, D, 64), dtype=f8), torch.ones((B, H)))

    def bwd_launch(args, softmax_scale, causal_offset, gqa):
        seen["bwd_launch"] = args

    monkeypatch.setattr(bwd_prep, "preprocess_fp8", preprocess_fp8)

    def install(spec):
        key = torch_ops.spec_key(spec, causal=True)
        mod = torch_ops._plan(torch_ops._entry(key), torch.device("cpu"), "generated", False, False, False).mod
        assert mod is not None and mod.TARGET == "sm90a", mod
        monkeypatch.setattr(mod, "quantize_inputs", quantize_inputs)
        monkeypatch.setattr(mod._HOST, "quantize_inputs", quantize_inputs)
        monkeypatch.setattr(mod._HOST, "run_prepared", run_prepared)
        if hasattr(mod, "_bwd_launch"):
            monkeypatch.setattr(mod, "_bwd_launch", bwd_launch)
        return mod

    return seen, install


def _shares(t, x) -> bool:
    return t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def _train_step(spec, eager: bool, monkeypatch, count: bool = True):
    """One forward + backward of ``spec`` on fused-QKV views; returns (x, copies of x's memory)."""
    monkeypatch.setattr(torch_ops, "_eager_fast_path", lambda *t: eager)  # else the op path (as under compile)
    x, q, k, v = _fused_qkv()
    counter = CopyCounter(x.untyped_storage())
    if count:
        with counter:
            o = torch_ops.attention(q, k, v, spec=spec, causal=True, backend="generated")
            o.float().sum().backward()
    else:
        o = torch_ops.attention(q, k, v, spec=spec, causal=True, backend="generated")
        o.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    return x, counter.copies


def test_the_counter_sees_copies_in_autograds_backward():
    """The dispatch mode is active in the backward pass as well (the checks below rely on it)."""
    x, q, _, _ = _fused_qkv()
    counter = CopyCounter(x.untyped_storage())
    with counter:
        y = q.sum()

        class Copying(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                q.contiguous()  # a copy of the projection's memory, in the backward
                return g
        Copying.apply(y).backward()
    assert counter.copies == [("aten.clone.default", (B, S, H, D))]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "custom_op"])
def test_ds8_train_step_passes_views_to_quantizer_and_kernels(on_pretend_sm90a, monkeypatch, eager):
    seen, install = on_pretend_sm90a
    mod = install(DS8)
    assert mod.BWD_DS_FP8 and mod.BWD_DO_FP8 and mod.BWD_S_FP8
    x, copies = _train_step(DS8, eager, monkeypatch, count=eager)
    assert copies == []
    for name, t in zip("qkv", seen["quantize_inputs"]):
        assert _shares(t, x) and not t.is_contiguous(), f"the quantizer got a copy of {name}"
    # the ds8 backward reads Q and K through the forward's transposed copies: their bf16 views go
    # in as they lie (the kernel reads only their shapes); V's FP8 payload is the forward's
    args = dict(zip([n for n, _ in sm90_bwd_host.KERNEL_TENSORS if mod._BWD_HOST.present(n)], seen["bwd_launch"]))
    assert _shares(args["q"], x) and _shares(args["k"], x)
    assert args["v"].dtype == torch.float8_e4m3fn


def test_fp8_directp_prefill_passes_views_to_the_quantizer(on_pretend_sm90a, monkeypatch):
    seen, install = on_pretend_sm90a
    install(DIRECTP)
    x, q, k, v = _fused_qkv(requires_grad=False)
    counter = CopyCounter(x.untyped_storage())
    with torch.inference_mode(), counter:
        o = torch_ops.attention(q, k, v, spec=DIRECTP, causal=True, backend="generated")
    assert o.shape == q.shape and o.is_contiguous()
    assert counter.copies == []
    assert all(_shares(t, x) for t in seen["quantize_inputs"])


def test_planted_forward_copy_is_caught(on_pretend_sm90a, monkeypatch):
    """The fault this file guards against: the forward's .contiguous() put back."""
    seen, install = on_pretend_sm90a
    install(DS8)
    monkeypatch.setattr(torch_ops, "_forward_operands", lambda plan, q, k, v: (q.contiguous(), k.contiguous(),
                                                                               v.contiguous()))
    x, copies = _train_step(DS8, True, monkeypatch)
    assert [s for _, s in copies] == [(B, S, H, D), (B, S, HKV, D), (B, S, HKV, D)]
    assert not any(_shares(t, x) for t in seen["quantize_inputs"])


def test_planted_backward_copy_is_caught(on_pretend_sm90a, monkeypatch):
    """The backward host's .contiguous() of q, k, v put back."""
    seen, install = on_pretend_sm90a
    install(DS8)
    orig = sm90_bwd_host.BackwardHost.operands
    monkeypatch.setattr(sm90_bwd_host.BackwardHost, "operands", lambda self, q, k, v, do, o, prepared: orig(
        self, q.contiguous(), k.contiguous(), v.contiguous(), do, o, prepared))
    _, copies = _train_step(DS8, True, monkeypatch)
    assert len(copies) == 3


def test_layouts_that_still_copy(on_pretend_sm90a, monkeypatch):
    """A permuted q (SDPA's (B, H, S, D) transposed) would give the module a permuted O
    (``torch.empty_like``): copied, as before. An unaligned view is copied too (TMA-layout check)."""
    seen, install = on_pretend_sm90a
    install(DS8)
    monkeypatch.setattr(torch_ops, "_eager_fast_path", lambda *t: True)
    qt = torch.randn(B, H, S, D, dtype=torch.bfloat16).transpose(1, 2)
    _, _, k, v = _fused_qkv(requires_grad=False)
    torch_ops.attention(qt, k, v, spec=DS8, causal=True, backend="generated")
    q_in, k_in, v_in = seen["quantize_inputs"]
    assert q_in.is_contiguous() and not _shares(q_in, qt)
    assert _shares(k_in, k) and _shares(v_in, v)


def test_strided_view_rules():
    """What the quantizer reads in place (16-byte strides, contiguous rows, aligned base)."""
    x, q, k, v = _fused_qkv(requires_grad=False)
    for t in (q, k, v):
        assert quantize.strided_view(t) is t
    assert quantize.strided_view(q[:, :, :, :64]) is not None  # a narrower head is still 16-byte strided
    odd = torch.randn(B, S, H * D + 1, dtype=torch.bfloat16)[..., 1:].view(B, S, H, D)  # 2-byte offset
    assert quantize.strided_view(odd) is None
    assert quantize.strided_view(q.transpose(2, 3)) is None  # rows not contiguous
    one = q[:1, :, :1]  # size-1 dims: stride 0, a view of the same memory
    view = quantize.strided_view(one)
    assert view.stride()[0] == view.stride()[2] == 0 and view.data_ptr() == one.data_ptr()
    assert torch.equal(view, one)


def test_fits_compiled_is_the_compiled_argument_layout():
    _, q, k, _ = _fused_qkv(requires_grad=False)
    assert sm90_bwd_host._fits_compiled(q, D) and sm90_bwd_host._fits_compiled(k, D)
    assert sm90_bwd_host._fits_compiled(q.contiguous(), D)
    interleaved = torch.randn(B, S, H, 3, D, dtype=torch.bfloat16)[:, :, :, 0]  # head stride 3 D
    assert not sm90_bwd_host._fits_compiled(interleaved, D)
    assert not sm90_bwd_host._fits_compiled(q[:, :, :, :64], 64)  # head stride 128 != 64


def test_tma_loadable_agrees_with_the_modules_check():
    """checks.tma_loadable predicts checks.check_tma_layout (the generated forward's own check),
    and _empty_like_is_compact predicts torch.empty_like, on layouts that pass and fail."""
    x, q, k, _ = _fused_qkv(requires_grad=False)
    flat = torch.randn(B * S * H * D + 8, dtype=torch.bfloat16)
    cases = [q, k, q.contiguous(), q.transpose(1, 2), q.transpose(2, 3), q[:, :, :, :64], q[:1, :5],
             flat[1:1 + B * S * H * D].view(B, S, H, D),  # 2-byte offset base
             torch.randn(B, S, H, D + 4, dtype=torch.bfloat16)[..., :D],  # token stride 8 bytes off
             torch.randn(B, H, S, D, dtype=torch.bfloat16).transpose(1, 2)]
    for i, t in enumerate(cases):
        try:
            checks.check_tma_layout("k", "q", t)
            ok = True
        except checks.AttentionInputError:
            ok = False
        assert checks.tma_loadable(t) == ok, i
        assert torch_ops._empty_like_is_compact(t) == torch.empty_like(t).is_contiguous(), i
