"""The sm90a varlen forward's host path reads no offset to the host (issue 24), on the CPU: the
tensors are a subclass that raises on every read of their values (.tolist(), .item(), int(),
bool(), .cpu(), .numpy()), the GPU is pretended (``_reads_offsets`` False, the arch check and the
launch stubbed), and ``forward_varlen`` must still hand the launch its offsets and outputs.
Invalid offsets never reach the kernel: it gets all-zero ones and o, lse come back NaN.
``offsets_valid`` (the device-side check) agrees with ``segments`` (the host one) case by case.
Planted: with the host read switched back on, the same call trips the subclass."""
from __future__ import annotations

import types

import pytest
import torch

from fp4gen.numerics import masking
from fp4gen.runtime import checks, sm90_host

_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy"}


class NoRead(torch.Tensor):
    """A tensor whose values may be computed on but never read to the host."""

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _READS:
            raise RuntimeError(f"host read: Tensor.{func.__name__}")
        return super().__torch_function__(func, types_, args, kwargs or {})


def _cfg(sinks=False):
    return types.SimpleNamespace(kernel_name="fake_varlen_d128", head_dim=128, in_fp8=False, quant_block=128,
                                 sinks=sinks, varlen=True, extended=True)


@pytest.fixture
def host(monkeypatch):
    """A ForwardHost on a pretend GPU: the launch records its arguments instead."""
    real_check_tensor = checks.check_tensor
    monkeypatch.setattr(checks, "check_tensor", lambda *a, **kw: real_check_tensor(*a, **{**kw, "device_type": None}))
    monkeypatch.setattr(checks, "require_arch", lambda *a, **kw: None)
    monkeypatch.setattr(sm90_host, "_reads_offsets", lambda cu_q, cu_k: False)

    def make(sinks=False):
        h = sm90_host.ForwardHost(_cfg(sinks), build=lambda: None)
        h.launches = []
        h.run_prepared = lambda ins, o, lse, *a, **kw: h.launches.append((o, lse, kw))
        return h
    return make


def _packed(lens_q, lens_k, H=2, Hkv=1, D=128):
    q = torch.randn(sum(lens_q), H, D).to(torch.bfloat16)
    k = torch.randn(sum(lens_k), Hkv, D).to(torch.bfloat16)
    v = torch.randn(sum(lens_k), Hkv, D).to(torch.bfloat16)
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cq, ck


def _no_read(*ts):
    return [t.as_subclass(NoRead) for t in ts]


# (cq, ck, max_q, max_k) for totals 8 (q) and 8 (k); each invalid one as the host check sees it
GOOD = ([0, 3, 5, 8], [0, 2, 2, 8], 3, 6)
BAD = {
    "decreasing": ([0, 5, 3, 8], [0, 2, 2, 8], None, None),
    "not from 0": ([1, 3, 5, 8], [0, 2, 2, 8], None, None),
    "short end": ([0, 3, 5, 8], [0, 2, 2, 7], None, None),
    "past the end": ([0, 3, 5, 9], [0, 2, 2, 8], None, None),
    "huge offset": ([0, 3, 1 << 30, 8], [0, 2, 2, 8], None, None),
    "longer than max_q": ([0, 3, 5, 8], [0, 2, 2, 8], 2, None),
    "longer than max_k": ([0, 3, 5, 8], [0, 2, 2, 8], None, 5),
    "negative": ([0, -3, 5, 8], [0, 2, 2, 8], None, None),
}


@pytest.mark.parametrize("case, valid", [(GOOD, True), ((*GOOD[:2], None, None), True),
                                         *((c, False) for c in BAD.values())], ids=["good", "good no max", *BAD])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_offsets_valid_agrees_with_segments(case, valid, dtype):
    cq, ck, mq, mk = (torch.tensor(case[0], dtype=dtype), torch.tensor(case[1], dtype=dtype), *case[2:])
    try:
        masking.segments(cq, ck, 8, 8, max_seqlen_q=mq, max_seqlen_k=mk)
        host_ok = True
    except ValueError:
        host_ok = False
    dev = masking.offsets_valid(cq, ck, 8, 8, max_seqlen_q=mq, max_seqlen_k=mk)
    assert dev.shape == () and dev.dtype == torch.bool
    assert host_ok == valid and bool(dev) == valid


def test_random_offsets_agree_with_segments():
    """Valid offsets, half of them with one entry moved: the two checks agree on each."""
    g = torch.Generator().manual_seed(0)
    kinds = set()
    for i in range(400):
        n = int(torch.randint(1, 5, (1,), generator=g))
        cu = [torch.cat((torch.zeros(1, dtype=torch.int64), torch.randint(0, 5, (n,), generator=g).cumsum(0)))
              for _ in range(2)]
        totals = [int(c[-1]) for c in cu]
        if i % 2:
            c = cu[int(torch.randint(0, 2, (1,), generator=g))]
            c[int(torch.randint(0, n + 1, (1,), generator=g))] += int(torch.randint(-3, 4, (1,), generator=g))
        mq = int(torch.randint(0, 6, (1,), generator=g))
        try:
            masking.segments(*cu, *totals, max_seqlen_q=mq)
            host_ok = True
        except ValueError:
            host_ok = False
        kinds.add(host_ok)
        assert bool(masking.offsets_valid(*cu, *totals, max_seqlen_q=mq)) == host_ok, (cu, totals, mq)
    assert kinds == {True, False}


def test_varlen_forward_reads_no_offsets(host):
    h = host()
    q, k, v, cq, ck = _no_read(*_packed([3, 2, 3], [2, 0, 6]))
    o, lse = h.forward_varlen(q, k, v, cq, ck, 3, 6, return_lse=True)
    (o_l, lse_l, kw), = h.launches
    assert o_l is o and lse_l is lse
    assert kw["max_seqlen_q"] == 3  # the grid from max_seqlen_q, not from the offsets
    cu_q, cu_k = kw["cu_seqlens"]
    assert torch.equal(cu_q.as_subclass(torch.Tensor), cq.as_subclass(torch.Tensor))
    assert torch.equal(cu_k.as_subclass(torch.Tensor), ck.as_subclass(torch.Tensor))
    assert cu_q.dtype == torch.int32 and o.shape == q.shape and lse.shape == (2, 8)
    assert not o.as_subclass(torch.Tensor).any()  # rows the kernel skips read 0 / -inf, as before
    assert torch.isneginf(lse.as_subclass(torch.Tensor)).all()


def test_grid_without_max_seqlen_is_bounded_by_the_tokens(host):
    h = host()
    q, k, v, cq, ck = _no_read(*_packed([3, 2, 3], [2, 0, 6]))
    h.forward_varlen(q, k, v, cq, ck)
    assert h.launches[0][2]["max_seqlen_q"] == 8
    h.forward_varlen(q, k, v, cq, ck, 1 << 20, None)
    assert h.launches[1][2]["max_seqlen_q"] == 8


def test_planted_host_read_is_caught(host, monkeypatch):
    """The check is able to fail: the old path (segments' .tolist()) trips the subclass."""
    monkeypatch.setattr(sm90_host, "_reads_offsets", lambda cu_q, cu_k: True)
    h = host()
    q, k, v, cq, ck = _no_read(*_packed([3, 2, 3], [2, 0, 6]))
    with pytest.raises(RuntimeError, match="host read: Tensor.tolist"):
        h.forward_varlen(q, k, v, cq, ck, 3, 6)


@pytest.mark.parametrize("name", list(BAD))
def test_invalid_offsets_never_reach_the_kernel(host, name):
    cq, ck, mq, mk = BAD[name]
    h = host()
    q, k, v, _, _ = _packed([3, 2, 3], [2, 0, 6])
    q, k, v, cq, ck = _no_read(q, k, v, torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32))
    o, lse = h.forward_varlen(q, k, v, cq, ck, mq, mk, return_lse=True)
    cu_q, cu_k = h.launches[0][2]["cu_seqlens"]
    assert not cu_q.as_subclass(torch.Tensor).any() and not cu_k.as_subclass(torch.Tensor).any()
    assert torch.isnan(o.as_subclass(torch.Tensor)).all() and torch.isnan(lse.as_subclass(torch.Tensor)).all()


def test_shape_errors_need_no_read(host):
    """What can be checked without the values still raises, with the subclass."""
    h = host()
    q, k, v, cq, ck = _no_read(*_packed([3, 2, 3], [2, 0, 6]))
    with pytest.raises(checks.AttentionInputError, match="cu_seqlens_q has 4 offsets and cu_seqlens_k 2"):
        h.forward_varlen(q, k, v, cq, ck[:2], 3, 6)
    with pytest.raises(checks.AttentionInputError, match="B \\+ 1 >= 2"):
        h.forward_varlen(q, k, v, cq[:1], ck[:1], 3, 6)
    with pytest.raises(checks.AttentionInputError, match="1-D int32 tensor"):
        h.forward_varlen(q, k, v, cq.float(), ck, 3, 6)


def test_no_keys_with_sinks(host):
    """No keys, no launch: lse = the sinks, NaN when the offsets are invalid."""
    h = host(sinks=True)
    q, k, v, cq, ck = _packed([3, 5], [0, 0])
    sinks = torch.tensor([0.5, -1.0])
    o, lse = h.forward_varlen(*_no_read(q, k, v, cq, ck), 5, 0, return_lse=True, sinks=sinks.as_subclass(NoRead))
    assert not h.launches
    assert torch.equal(lse.as_subclass(torch.Tensor), sinks[:, None].expand(2, 8))
    o, lse = h.forward_varlen(*_no_read(q, k, v, cq, ck), 4, 0, return_lse=True, sinks=sinks.as_subclass(NoRead))
    assert torch.isnan(lse.as_subclass(torch.Tensor)).all() and torch.isnan(o.as_subclass(torch.Tensor)).all()


def test_reads_offsets_only_on_the_host_or_in_debug_mode(monkeypatch):
    cpu = torch.zeros(2, dtype=torch.int32)
    meta = torch.zeros(2, dtype=torch.int32, device="meta")  # not on the host: like a GPU's
    monkeypatch.delenv("FP4GEN_CHECK_OFFSETS", raising=False)
    assert sm90_host._reads_offsets(cpu, cpu)
    assert not sm90_host._reads_offsets(meta, meta) and not sm90_host._reads_offsets(cpu, meta)
    monkeypatch.setenv("FP4GEN_CHECK_OFFSETS", "1")
    assert sm90_host._reads_offsets(meta, meta)
