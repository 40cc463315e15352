"""The per-call host path of fp4gen.attention (issue 24): what depends only on the spec key, the
tensors' shapes, strides, dtypes and devices and the call's flags is computed once. With a stub
generated module on a pretend sm90a GPU (bench/host_overhead.py's), the checks, the kernel choice
and the forward-state options run on the first call and not on an identical second one; any change
in shape, stride, dtype, sinks or max_seqlen runs the checks again, and bad input keeps its error.
A planted fault (a key without strides) is caught."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fp4gen import torch_ops
from fp4gen.runtime import checks
from fp4gen.torch_ops import AttentionInputError, attention, attention_varlen

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fp4gen_host_overhead_bench", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def stubbed(bench, monkeypatch):
    """-> make(case): the case's spec resolving to a stub module on a pretend sm90a, and the
    call counts of the uncached helpers and the stubs."""
    counts: dict = {}
    monkeypatch.setattr(torch_ops, "_arch_of", lambda device: "sm90a")
    ref = bench.stub_reference(counts)
    monkeypatch.setattr(torch_ops, "_reference", lambda: ref)
    for name, owner in (("check_qkv", checks), ("_check_layout", torch_ops), ("_check_sinks_shape", torch_ops),
                        ("_check_varlen_inputs", torch_ops), ("_choose", torch_ops),
                        ("forward_state_options", torch_ops)):
        orig = getattr(owner, name)

        def counted(*a, _orig=orig, _name=name, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _orig(*a, **kw)
        monkeypatch.setattr(owner, name, counted)
    monkeypatch.setattr(torch_ops, "_CHECKED", set())

    def make(case, spec_name=None):
        spec = bench.case_spec(case)
        if spec_name:  # a fresh key per test: the plans of other tests' keys stay out
            import dataclasses
            spec = dataclasses.replace(spec, name=spec_name)
        mod = bench.stub_module(spec, counts)
        from fp4gen.lowering import module_name
        name = f"fp4gen.generated.{module_name(spec.name, 'sm90a')}"
        mod.__name__ = name
        monkeypatch.setitem(sys.modules, name, mod)
        return spec, counts
    return make


def _qkv(shape=(2, 64, 4, 4, 128), grad=True):
    b, s, h, hkv, d = shape
    q = torch.randn(b, s, h, d, dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, requires_grad=grad)
    return q, k, v


def _step(q, k, v, spec, **kw):
    o = attention(q, k, v, spec=spec, **kw)
    torch.autograd.grad(o, (q, k, v), torch.ones_like(o))


def test_second_identical_call_reruns_nothing(stubbed):
    spec, counts = stubbed("dense", "hostpath_dense")
    q, k, v = _qkv()
    _step(q, k, v, spec)
    first = dict(counts)
    # the first call ran every check, chose once per pass, and the stubs ran
    assert first["check_qkv"] == first["_check_layout"] == first["_check_sinks_shape"] == 1
    assert first["_choose"] == 2 and first["forward_state_options"] >= 1
    assert first["quantize_inputs"] == first["forward"] == first["backward"] == 1
    _step(q, k, v, spec)
    _step(*_qkv(), spec)  # new tensors, same shapes, strides, dtype and device
    helpers = ("check_qkv", "_check_layout", "_check_sinks_shape", "_choose", "forward_state_options")
    assert {h: counts[h] for h in helpers} == {h: first[h] for h in helpers}
    assert counts["quantize_inputs"] == counts["forward"] == counts["backward"] == 3  # the kernels still run


@pytest.mark.parametrize("change", ["strides", "shape", "dtype", "gqa"])
def test_a_new_signature_runs_the_checks_again(stubbed, change):
    spec, counts = stubbed("dense", f"hostpath_sig_{change}")
    q, k, v = _qkv()
    _step(q, k, v, spec)
    n = counts["check_qkv"]
    if change == "strides":  # the same shape as a view of (B, H, S, D) storage
        q2 = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
        assert q2.shape == q.shape and q2.stride() != q.stride()
        args = (q2, k, v)
    elif change == "shape":
        args = _qkv((2, 32, 4, 4, 128))
    elif change == "dtype":
        args = tuple(t.detach().half().requires_grad_(True) for t in (q, k, v))
    else:
        args = _qkv((2, 64, 8, 2, 128))
    _step(*args, spec)
    assert counts["check_qkv"] == n + 1


def test_bad_input_after_a_good_call_keeps_its_error(stubbed):
    spec, _ = stubbed("dense", "hostpath_bad")
    q, k, v = _qkv()
    _step(q, k, v, spec)
    with pytest.raises(AttentionInputError, match="head dim"):
        attention(q[..., :64], k, v, spec=spec)
    with pytest.raises(AttentionInputError, match="batch size"):
        attention(q[:1], k, v, spec=spec)
    with pytest.raises(AttentionInputError, match="multiple of the number of key/value heads"):
        attention(q[:, :, :3], k, v, spec=spec)
    with pytest.raises(TypeError, match="one dtype"):
        attention(q, k.detach().half(), v, spec=spec)
    with pytest.raises(TypeError, match="q must be a tensor"):
        attention([1.0], k, v, spec=spec)
    with pytest.raises(AttentionInputError, match="non-empty"):
        attention(q[:, :0], k, v, spec=spec)
    with pytest.raises(AttentionInputError, match="sinks must have one logit per query head"):
        attention(q, k, v, spec=spec, sinks=torch.zeros(3))
    _step(q, k, v, spec)  # the good call still runs


def test_varlen_max_seqlen_is_part_of_the_key(stubbed):
    spec, counts = stubbed("varlen", "hostpath_varlen")
    t = torch.randn(128, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32)
    attention_varlen(t, t, t, cu, cu, 64, 64, spec=spec)
    attention_varlen(t, t, t, cu, cu, 64, 64, spec=spec)
    assert counts["_check_varlen_inputs"] == 1
    with pytest.raises(AttentionInputError, match="max_seqlen_q must be an int"):
        attention_varlen(t, t, t, cu, cu, -1, 64, spec=spec)
    with pytest.raises(AttentionInputError, match="max_seqlen_k must be an int"):
        attention_varlen(t, t, t, cu, cu, 64, True, spec=spec)  # True == 1 as a dict key: typed
    with pytest.raises(AttentionInputError, match="cu_seqlens_q must be a 1-D int32"):
        attention_varlen(t, t, t, cu.float(), cu, 64, 64, spec=spec)
    with pytest.raises(AttentionInputError, match="max_seqlen_q must be an int"):
        attention_varlen(t, t, t, cu, cu, [64], 64, spec=spec)  # unhashable: not a key, still its error
    assert counts["_check_varlen_inputs"] == 5


def test_a_cleared_lookup_drops_the_plans(stubbed):
    """entry.found.clear() (as tests do between dispatch set-ups) must not leave a stale plan."""
    spec, counts = stubbed("dense", "hostpath_clear")
    q, k, v = _qkv()
    _step(q, k, v, spec)
    n = counts["_choose"]
    torch_ops._entry(torch_ops.spec_key(spec)).found.clear()
    _step(q, k, v, spec)
    assert counts["_choose"] == n + 2


def test_planted_fault_key_without_strides_is_caught(stubbed, monkeypatch):
    """A cache key that forgets the strides lets a differently-strided call skip its checks:
    the stride test above must then fail."""
    monkeypatch.setattr(torch_ops, "_signature", lambda t: None if t is None else (t.shape, t.dtype, t.device))
    with pytest.raises(AssertionError):
        test_a_new_signature_runs_the_checks_again(stubbed, "strides")


def test_under_torch_compile_the_checks_are_traced_not_cached(stubbed):
    spec, counts = stubbed("dense", "hostpath_compile")
    assert torch_ops._checked_key("dense", "k", 128, (torch.zeros(1),)) is not None
    fn = torch.compile(lambda q, k, v: torch_ops._checked_key("dense", "k", 128, (q, k, v)) is None,
                       fullgraph=True, backend="eager")
    assert fn(*_qkv(grad=False))


def test_no_host_sync_calls_in_the_op_path():
    """No .item(), .tolist(), .cpu() or numpy() in torch_ops or the backward host steps it calls:
    each would wait for the GPU in the middle of a step (the GPU variant checks the whole path)."""
    import re

    root = Path(torch_ops.__file__).resolve().parent
    for f in (root / "torch_ops.py", root / "runtime" / "bwd_common.py"):
        text = f.read_text()
        hits = [m.group(0) for m in re.finditer(r"\.(item|tolist|cpu|numpy)\(\)", text)]
        assert not hits, f"{f.name}: {hits}"


@pytest.mark.parametrize("sinks", [False, True])
def test_eager_fast_path_equals_the_custom_op(sinks, monkeypatch):
    """Eager calls run the op's implementation through an autograd.Function (no torch.library
    dispatch): the same outputs and gradients, sinks' included, as through the op."""
    from tests.torch_ops.conftest import fp32_spec

    spec = fp32_spec(head_dim=16, causal=True, name="hostpath_eager")
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 24, h, 16, generator=g) for h in (4, 2, 2)]
    s0 = torch.randn(4, generator=g) if sinks else None

    def run():
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        s = s0.clone().requires_grad_(True) if sinks else None
        o, lse = attention(q, k, v, spec=spec, sinks=s, return_lse=True)
        (o.square().sum() + 0 * lse.sum()).backward()
        return [o, lse, q.grad, k.grad, v.grad] + ([s.grad] if sinks else [])

    calls = []
    orig = torch_ops._EagerAttention.apply
    monkeypatch.setattr(torch_ops._EagerAttention, "apply", lambda *a: calls.append(1) or orig(*a))
    fast = run()
    assert calls, "the eager call did not take the fast path"
    monkeypatch.setattr(torch_ops, "_eager_fast_path", lambda *t: False)
    slow = run()
    assert len(calls) == 1
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fake_tensors_take_the_op_and_are_not_cached(stubbed):
    """Fake tensors (as non-strict export and shape propagation pass them) go through the custom
    op's fake implementation, and their checks run every time (symbolic shapes may not hash)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec, counts = stubbed("dense", "hostpath_fake")
    with FakeTensorMode():
        q, k, v = _qkv(grad=False)
        for _ in range(2):
            o = attention(q, k, v, spec=spec)
            assert o.shape == q.shape
    assert counts["check_qkv"] == 2
    assert "forward" not in counts  # the fake implementation ran, not the module
