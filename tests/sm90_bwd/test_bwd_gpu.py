"""The sm90a backward on a Hopper GPU: dq, dk, dv against the numerics oracle
(``fp4gen.numerics.reference.backward``) and float64 autograd, on random and
adversarial inputs (ragged lengths, S=1, Sq != Sk, GQA, large logits), plus
determinism of the deterministic variant. Skipped without CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bwd_modules as bm  # noqa: E402

pytestmark = pytest.mark.gpu

_MODS = {}


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _module(d, causal, det, tmp_path_factory, fp8=False):
    key = (d, causal, det, fp8)
    if key not in _MODS:
        plan = bm.make_plan(d, causal, det, fp8)
        _MODS[key] = (plan.spec, bm.load_module(plan, str(tmp_path_factory.mktemp("sm90bwd"))))
    return _MODS[key]


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", list(bm.CASES))
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_oracle_and_f64(case, d, causal, tmp_path_factory):
    spec, mod = _module(d, causal, False, tmp_path_factory)
    row = bm.check_case(mod, spec, case)
    assert row["pass"], row


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", ["basic", "ragged_200", "gqa_6_2"])
def test_deterministic_variant(case, tmp_path_factory):
    spec, mod = _module(128, True, True, tmp_path_factory)
    row = bm.check_case(mod, spec, case)
    assert row["pass"], row
    q, k, v, do = bm.make_inputs(case, 128, seed=1)
    o, lse = bm.torch_forward(q, k, v, True, spec.scale)
    a = mod.backward(q, k, v, o, lse, do)
    b = mod.backward(q, k, v, o, lse, do)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "deterministic backward gave two different results"


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_softmax_scale_argument(tmp_path_factory):
    spec, mod = _module(128, True, False, tmp_path_factory)
    q, k, v, do = bm.make_inputs("basic", 128, seed=2)
    scale = 0.05
    o, lse = bm.torch_forward(q, k, v, True, scale)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do, softmax_scale=scale)
    fq, fk, fv = bm.autograd_f64(q, k, v, do, True, scale)
    for x, f in ((dq, fq), (dk, fk), (dv, fv)):
        assert bm.rel_l2(x, f) < 2e-2


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_bad_input_is_a_clear_error(tmp_path_factory):
    spec, mod = _module(128, True, False, tmp_path_factory)
    q, k, v, do = bm.make_inputs("basic", 128)
    o, lse = bm.torch_forward(q, k, v, True, spec.scale)
    with pytest.raises((TypeError, ValueError), match="lse"):
        mod.backward(q, k, v, o, lse[:, :1], do)
    with pytest.raises(TypeError, match="dtype"):
        mod.backward(q.float(), k, v, o, lse, do)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [256, 128, 64])
@pytest.mark.parametrize("sq", [1, 64, 200])
def test_postprocess_undoes_the_fragment_order(d, sq):
    """The post-processing kernel reads the dQ accumulator in the kernel's fragment order
    (bwd_prep.dq_fragment_index) and writes bf16(scale * dQ) in (B, Sq, H, D): bit-exact
    against the same arithmetic in torch on a row-major tensor."""
    from fp4gen.device import bwd_prep

    torch.manual_seed(sq + d)
    B, H = 2, 3
    sqp = -(-sq // 64) * 64
    rows = torch.randn(B, H, sqp, d, device="cuda", dtype=torch.float32)
    got = bwd_prep.postprocess(bwd_prep.dq_rows_to_fragments(rows), sq, 0.125)
    want = (rows[:, :, :sq] * 0.125).to(torch.bfloat16).permute(0, 2, 1, 3)
    assert got.shape == (B, sq, H, d)
    assert torch.equal(got, want)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", ["basic", "gqa_6_2", "ragged_200"])
def test_fp8_backward_reuses_the_forward_state_exactly(case, tmp_path_factory):
    """FP8 S/dP/dV: handing the backward the forward's quantize_inputs (Q/K payloads and
    scales, V's per-head scale) gives bit-identical gradients to letting it quantize again."""
    spec, mod = _module(128, True, False, tmp_path_factory, fp8=True)
    q, k, v, do = bm.make_inputs(case, 128, seed=3)
    o, lse = bm.torch_forward(q, k, v, True, spec.scale)
    again = mod.backward(q, k, v, o, lse, do)
    reused = mod.backward(q, k, v, o, lse, do, prepared=mod.quantize_inputs(q, k, v))
    # ... and with V's natural payload written by the forward's quantizer (for_backward=True)
    with_v8 = mod.backward(q, k, v, o, lse, do, prepared=mod.quantize_inputs(q, k, v, for_backward=True))
    for x, y, z in zip(again, reused, with_v8):
        assert torch.equal(x, y) and torch.equal(x, z)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", list(bm.CASES))
@pytest.mark.parametrize("d, causal", [(128, True), (64, True), (128, False)])
def test_fp8_ds_matches_oracle_and_f64(case, d, causal, tmp_path_factory):
    """Every MMA in FP8 (dS : fp8e4m3: dQ = dS K and dK = dS^T Q from the forward's Q/K payloads
    through their transposed copies, dS with one power-of-two scale per 64 x 128 tile, handed
    from query tile to query tile and recomputed when it would overflow), against the oracle,
    which picks the scales by the same rule."""
    spec, mod = _module(d, causal, False, tmp_path_factory, fp8="ds")
    row = bm.check_case(mod, spec, case)
    assert row["pass"], row


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", ["basic", "gqa_6_2", "ragged_200"])
def test_fp8_ds_backward_reuses_the_forward_state_exactly(case, tmp_path_factory):
    """FP8 dS: the forward's quantize_inputs(..., for_backward=True, transposed_qk=True) handed
    over gives bit-identical gradients to the backward quantizing (and transposing) again; a
    prepared tuple without the transposed copies is refused."""
    spec, mod = _module(128, True, False, tmp_path_factory, fp8="ds")
    q, k, v, do = bm.make_inputs(case, 128, seed=3)
    o, lse = bm.torch_forward(q, k, v, True, spec.scale)
    again = mod.backward(q, k, v, o, lse, do)
    reused = mod.backward(q, k, v, o, lse, do,
                          prepared=mod.quantize_inputs(q, k, v, for_backward=True, transposed_qk=True))
    for x, y in zip(again, reused):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="transposed"):
        mod.backward(q, k, v, o, lse, do, prepared=mod.quantize_inputs(q, k, v, for_backward=True))


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [256, 128, 64])
@pytest.mark.parametrize("sq", [1, 100, 200, 300])
def test_fused_fp8_preprocessing_equals_the_separate_passes(d, sq):
    """preprocess_fp8 (dO's amax, then one pass for both payloads, D, LSE2 and the zeroed dQ
    accumulator) is bit-identical to quantize_v_operand(dO) followed by preprocess(..., scale_do),
    including a row the forward saw nothing of (LSE -inf) and a head of large values."""
    from fp4gen.device import bwd_prep, quantize

    torch.manual_seed(sq + d)
    B, H = 2, 3
    sqp = -(-sq // 64) * 64
    o = torch.randn(B, sq, H, d, device="cuda").to(torch.bfloat16)
    do = (torch.randn(B, sq, H, d, device="cuda") * 3).to(torch.bfloat16)
    do[0, :, 1] *= 1000.0
    lse = torch.randn(B, H, sq, device="cuda")
    lse[1, 2, sq // 2] = -float("inf")
    got = bwd_prep.preprocess_fp8(o, do, lse, sqp)
    dot8, scale_do = quantize.quantize_v_operand(do)
    want = bwd_prep.preprocess(o, do, lse, sqp, scale_do) + (bwd_prep.dot_tiles(dot8, sqp), scale_do)
    for name, x, y in zip(("lse2", "dsum", "dq_acc", "do8", "dot8", "scale_do"), got, want):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if x.element_size() == 1:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), name


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [256, 128, 64])
@pytest.mark.parametrize("s", [1, 100, 200, 300])
def test_per_head_fp8_quantizer_matches_the_oracle(d, s):
    """V's FP8 operand for dP (scale_per_head, then quantize_per_head): scales and e4m3 codes
    bit-identical to the numerics oracle's per-(batch, head) quantizer, with a head of large
    values, an all-zero head (scale 1) and sequence lengths that end inside a CTA's rows."""
    from fp4gen.device import bwd_prep
    from fp4gen.numerics.quant import quantize_fp8_tensor

    torch.manual_seed(s + d)
    B, H = 2, 3
    x = torch.randn(B, s, H, d, device="cuda").to(torch.bfloat16)
    x[0, :, 1] *= 1000.0
    x[1, :, 2] = 0.0
    want = quantize_fp8_tensor(x)
    scale = bwd_prep.scale_per_head(x)
    got = bwd_prep.quantize_per_head(x, scale)
    assert torch.equal(scale, want.scale)
    assert torch.equal(got.view(torch.uint8), want.codes)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("d", [256, 128, 64])
@pytest.mark.parametrize("s", [1, 100, 200, 300])
def test_forward_quantizer_writes_the_backward_v_operand(d, s):
    """quantize_v_operand(v, natural=True): V^T and the scale as without ``natural``, and V's
    codes in its own layout identical to the backward's own V pass (quantize_per_head)."""
    from fp4gen.device import bwd_prep, quantize

    torch.manual_seed(s + d)
    B, H = 2, 3
    v = torch.randn(B, s, H, d, device="cuda").to(torch.bfloat16)
    v[0, :, 1] *= 1000.0
    v[1, :, 2] = 0.0
    vt8, sv = quantize.quantize_v_operand(v)
    vt8n, svn, v8 = quantize.quantize_v_operand(v, natural=True)
    assert torch.equal(vt8.view(torch.uint8), vt8n.view(torch.uint8)) and torch.equal(sv, svn)
    assert v8.shape == v.shape and v8.dtype == torch.float8_e4m3fn
    assert torch.equal(v8.view(torch.uint8), bwd_prep.quantize_per_head(v, sv).view(torch.uint8))
