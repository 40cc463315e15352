"""FP8 varlen (packed sequences) without a GPU: the per-sequence scale layout the sm90a FP8
varlen forward reads (docs/runtime.md, "FP8 varlen"), checked against each sequence quantized
alone, and ``fp4gen.attention_varlen`` on the reference backend against each sequence run alone.

Lengths are ragged around the 128-token scale block (1, 127, 128, 129 tokens) with an empty
sequence between them, so a block that straddled two sequences, or blocks counted from the
packed tensor's start instead of each sequence's, would change some sequence's scales. The
planted faults below show each comparison fails for exactly that mistake.
The kernel against the reference on an H200: tests/sm90/test_fp8_varlen_gpu.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.numerics import quant

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sm90_fp8_varlen_d128.attn"
LENGTHS = [1, 127, 0, 128, 129, 300]


def _cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def _packed(lengths, H, D, seed, mult=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(lengths), H, D, generator=g) * mult).to(dtype)


def _spans(cu):
    c = cu.tolist()
    return [(a, b) for a, b in zip(c, c[1:])]


# ---- the quantizer: per-sequence blocks, bit-equal to the dense quantizer on each sequence ----

@pytest.mark.parametrize("granularity", ["block", "tensor"])
def test_varlen_quantizer_equals_each_sequence_alone(granularity):
    cu = _cu(LENGTHS)
    x = _packed(LENGTHS, 3, 64, seed=1, mult=4.0)
    t = quant.quantize_fp8_varlen(x, cu, granularity)
    scale = t.token_scale(cu)
    for b, (a, e) in enumerate(_spans(cu)):
        if a == e:
            continue
        alone = quant.quantize_fp8(x[None, a:e], granularity, 128)
        assert torch.equal(t.codes[a:e], alone.codes[0]), f"sequence {b}: payload"
        assert torch.equal(scale[a:e], alone.expand_scale().expand(1, e - a, 3, 1)[0, :, :, 0]), f"sequence {b}"
        if granularity == "tensor":
            assert torch.equal(t.scale[b], alone.scale[0])
    if granularity == "tensor":
        assert torch.equal(t.scale[2], torch.ones(3))  # the empty sequence: scale 1


def test_planted_fault_blocks_from_the_packed_start_are_caught():
    """Blocks counted over the packed tensor (the dense quantizer on (1, total, H, D)) straddle
    sequences: the comparison above must see it."""
    cu = _cu(LENGTHS)
    x = _packed(LENGTHS, 3, 64, seed=1, mult=4.0)
    ok = quant.quantize_fp8_varlen(x, cu, "block")
    wrong = quant.quantize_fp8(x[None], "block", 128)
    assert not torch.equal(ok.token_scale(cu), wrong.expand_scale()[0, :, :, 0])


def test_a_block_of_one_sequence_ignores_its_neighbour():
    """A huge value in one sequence leaves the next sequence's scales alone."""
    lengths = [129, 5]
    cu = _cu(lengths)
    x = _packed(lengths, 1, 64, seed=2)
    x2 = x.clone()
    x2[128] = 1e4  # last token of sequence 0, in its second (1-token) block
    s1 = quant.quantize_fp8_varlen(x, cu, "block").scale
    s2 = quant.quantize_fp8_varlen(x2, cu, "block").scale
    assert torch.equal(s1[129:], s2[129:]) and torch.equal(s1[:128], s2[:128]) and not torch.equal(s1[128], s2[128])


def test_nan_poisons_only_its_block():
    lengths = [130]
    cu = _cu(lengths)
    x = _packed(lengths, 1, 16, seed=3)
    x[129, 0, 3] = float("nan")
    s = quant.quantize_fp8_varlen(x, cu, "block").scale
    assert torch.isnan(s[128:]).all() and not torch.isnan(s[:128]).any()
    dense = quant.quantize_fp8(x[None], "block", 128).scale  # the dense quantizer does the same
    assert torch.isnan(dense[0, 1]).all() and not torch.isnan(dense[0, 0]).any()


# ---- the host's operands (what the kernel reads) ----------------------------------------------

@pytest.fixture(scope="module")
def host():
    mod = fp4gen.load(str(EXAMPLE), kernel="sm90_fp8_directp_varlen_causal_d128")
    return mod._HOST


def test_host_torch_path_is_bit_equal_to_the_oracle(host):
    cu_q, cu_k = _cu(LENGTHS), _cu([3, 0, 128, 129, 1, 256])
    q = _packed(LENGTHS, 4, 128, seed=4, mult=8.0)
    k = _packed([3, 0, 128, 129, 1, 256], 2, 128, seed=5, mult=8.0)
    v = _packed([3, 0, 128, 129, 1, 256], 2, 128, seed=6)
    fast = host.quantize_inputs_varlen(q, k, v, cu_q, cu_k)
    oracle = host.quantize_inputs_varlen(q, k, v, cu_q, cu_k, fast=False)
    for name, a, b in zip(("q8", "k8", "vt8", "sq", "sk", "sv"), fast, oracle):
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn \
            else torch.equal(a, b)
        assert same, name


def _alone(host, q, k, v):
    """The dense host operands of one (1, S, H, D) sequence with the oracle's quantizers
    (``quantize(fast=False)``: the dense torch path's ``amax / 448`` division differs from
    the oracle's reciprocal multiply by an ulp on the CPU; on CUDA torch multiplies too)."""
    q8, sq = host.quantize(q, True, fast=False)
    k8, sk = host.quantize(k, True, fast=False)
    v8, sv = host.quantize(v, False, fast=False)
    return q8, k8, host.v_operand(v8), sq, sk, sv


def test_kernel_indexing_recovers_each_sequence_alone(host):
    """Read the operands the way the kernel does (Q scale at token q0 + 128 m, K scale at
    k0 + 128 n, V^T of sequence b from column varlen_v_start(k0, b) with the 32-key permutation) and
    compare with each sequence quantized alone by the dense host path (``_alone``), whose
    dequantized operands are the reference's."""
    from fp4gen.device.sm90.config import ForwardConfig

    start = ForwardConfig.varlen_v_start

    lq, lk = [1, 127, 0, 128, 129, 300], [129, 1, 5, 0, 128, 131]
    cu_q, cu_k = _cu(lq), _cu(lk)
    q, k, v = _packed(lq, 2, 128, seed=7, mult=8.0), _packed(lk, 1, 128, seed=8), _packed(lk, 1, 128, seed=9)
    q8, k8, vt8, sq, sk, sv = host.quantize_inputs_varlen(q, k, v, cu_q, cu_k)
    assert vt8.shape[2] % 32 == 0 and vt8.shape[2] >= start(k.shape[0], len(lq))
    # every sequence starts on a 16-byte boundary (TMA: a misaligned box start is an illegal
    # instruction on the H100/H200)
    assert all(start(cu_k[b].item(), b) % 16 == 0 for b in range(len(lk)))
    perm = torch.tensor(host.quantizer.FP8_P_KEY_PERM)
    for b, ((qa, qe), (ka, ke)) in enumerate(zip(_spans(cu_q), _spans(cu_k))):
        if qa == qe or ka == ke:
            continue  # the dense path needs both; an empty side has nothing to compare
        dq8, dk8, dvt8, dsq, dsk, dsv = _alone(host, q[None, qa:qe], k[None, ka:ke], v[None, ka:ke])
        assert torch.equal(q8[qa:qe].view(torch.uint8), dq8[0].view(torch.uint8)), f"#{b} q8"
        assert torch.equal(k8[ka:ke].view(torch.uint8), dk8[0].view(torch.uint8)), f"#{b} k8"
        for m in range((qe - qa + 127) // 128):  # the kernel's q_mult read
            assert torch.equal(sq[qa + 128 * m], dsq[0, :, m]), f"#{b} q block {m}"
        for n in range((ke - ka + 127) // 128):  # the kernel's tile_mult read
            assert torch.equal(sk[ka + 128 * n], dsk[0, :, n]), f"#{b} k block {n}"
        assert torch.equal(sv[b], dsv[0]), f"#{b} v scale"
        c0, width = start(ka, b), dvt8.shape[3]  # dense V^T: padded to 32, permuted
        assert torch.equal(vt8[:, :, c0:c0 + width].view(torch.uint8), dvt8[0].view(torch.uint8)), f"#{b} V^T"
        assert not vt8[:, :, c0 + width:start(ke, b + 1)].view(torch.uint8).any(), \
            f"#{b}: the gap after the sequence must be zero"
    # inverse check of the permutation on one 32-block: column 32 i + p holds key 32 i + perm[p]
    b = 4  # 128 keys from k0 = 135
    ka = cu_k[b].item()
    raw = quant.quantize_fp8(v[None, ka:ka + 128], "tensor").codes[0]  # (128, 1, D)
    c0 = start(ka, b)
    assert torch.equal(vt8[0, :, c0 + 32 + 5].view(torch.uint8), raw[32 + perm[5], 0])


def test_planted_fault_a_sequence_start_off_by_the_gap_is_caught(host):
    """V^T read from column k0 (no gap, no rounding): sequence 1 is then someone else's bytes."""
    lk = [129, 64]
    cu_k = _cu(lk)
    k = v = _packed(lk, 1, 128, seed=10)
    q = _packed(lk, 1, 128, seed=11)
    _, _, vt8, *_ = host.quantize_inputs_varlen(q, k, v, cu_k, cu_k)
    d = _alone(host, q[None, 129:], k[None, 129:], v[None, 129:])
    c1 = 144 + 48  # 129 rounded up to 16, plus the gap
    assert torch.equal(vt8[:, :, c1:c1 + 64].view(torch.uint8), d[2][0].view(torch.uint8))
    assert not torch.equal(vt8[:, :, 129:129 + 64].view(torch.uint8), d[2][0].view(torch.uint8))


# ---- attention_varlen on the reference backend: a packed batch == each sequence alone ----------

@pytest.mark.parametrize("kernel", ["sm90_fp8_exp_varlen_d128", "sm90_fp8_directp_varlen_causal_d128",
                                    "sm90_fp8_exp_varlen_causal_d128", "sm90_fp8_directp_varlen_d128"])
def test_packed_batch_equals_each_sequence_alone(kernel):
    spec = f"{EXAMPLE}::{kernel}"
    lq = [1, 127, 0, 128, 129, 200]
    lk = [1, 127, 5, 128, 129, 140]  # Sq > Sk in the last one: causal rows with no key
    cu_q, cu_k = _cu(lq), _cu(lk)
    q = _packed(lq, 2, 128, seed=12, mult=8.0)
    k = _packed(lk, 1, 128, seed=13, mult=8.0)
    v = _packed(lk, 1, 128, seed=14)
    o, lse = fp4gen.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), spec=spec, return_lse=True,
                                     backend="reference")
    assert o.shape == q.shape and lse.shape == (2, sum(lq))
    for b, ((qa, qe), (ka, ke)) in enumerate(zip(_spans(cu_q), _spans(cu_k))):
        if qa == qe:
            continue
        ob, lb = fp4gen.attention(q[None, qa:qe], k[None, ka:ke], v[None, ka:ke], spec=spec, return_lse=True,
                                  backend="reference")
        assert torch.equal(o[qa:qe], ob[0]), f"{kernel} sequence {b}: o"
        assert torch.equal(lse[:, qa:qe], lb[0]), f"{kernel} sequence {b}: lse"
    if "causal" in kernel:  # rows 0..59 of the last sequence see no key: O = 0, LSE = -inf
        qa = cu_q[-2].item()
        assert torch.isneginf(lse[:, qa:qa + 60]).all() and (o[qa:qa + 60] == 0).all()
        assert torch.isfinite(lse[:, qa + 60:]).all()


def test_planted_fault_one_packed_sequence_differs():
    """The same batch run as one dense sequence (blocks and the V scale across sequences, no
    per-sequence mask) is not each sequence alone: the comparison above can fail."""
    spec = f"{EXAMPLE}::sm90_fp8_exp_varlen_d128"
    lq = [127, 129]
    cu = _cu(lq)
    q, k, v = (_packed(lq, 1, 128, seed=s, mult=4.0) for s in (15, 16, 17))
    o = fp4gen.attention_varlen(q, k, v, cu, cu, 129, 129, spec=spec, backend="reference")
    whole = fp4gen.attention(q[None], k[None], v[None], spec=spec, backend="reference")[0]
    assert not torch.equal(o[127:], whole[127:])
