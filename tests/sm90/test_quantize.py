"""The fused FP8 input quantizer (fp4gen.device.quantize).

CPU: it compiles for sm_90a without a GPU, its PTX has the arithmetic the contract needs
(IEEE division, reciprocal-multiply scale, no flush to zero), and the bit tricks it relies
on are checked exhaustively in torch. GPU (``gpu`` marker): bit-exact equality of payload
bytes and scales with the ``fp4gen.numerics`` quantizers and with the generated module's
torch path, on random, adversarial, ragged and GQA inputs; the transposed copies of Q and K
(``transposed=``) bit-exact with the torch reference ``transposed_operand``.

Scales are compared bit for bit, except that NaN scales only have to be NaN in both (the
NaN payload bits are not part of the contract: torch on CPU keeps 0x7FC00000, a GPU
produces 0x7FFFFFFF).
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plans import load_module, make_plan  # noqa: E402

from fp4gen.device import quantize as dq  # noqa: E402
from fp4gen.device.layout import FP8_DS_KEY_PERM, FP8_P_KEY_PERM  # noqa: E402

# ------------------------------------------------------------------ CPU


@pytest.mark.parametrize("d", [128, 64])
def test_compiles_for_sm90a_without_gpu(d):
    kinds = ("block", "amax", "vt", "vt_nat", "block_qt", "block_kt")
    assert dq.compile_only("sm_90a", d) == [f"fp8_quantize_{k}_d{d}" for k in kinds]


def test_user_errors():
    with pytest.raises(ValueError, match="sm_90a"):
        dq.compile_only("sm_100a")
    with pytest.raises(ValueError, match="head dim"):
        dq.compile_only("sm_90a", 96)
    with pytest.raises(ValueError, match="CUDA bfloat16"):
        dq.quantize_blockwise(torch.zeros(1, 4, 1, 64))
    with pytest.raises(ValueError, match="4-d"):
        dq.quantize_v_operand(torch.zeros(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="transposed"):
        dq.quantize_blockwise(torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16), transposed="v")
    x = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="for_backward=True"):
        dq.quantize_inputs(x, x, x, transposed_qk=True)
    with pytest.raises(ValueError, match="transposed"):
        dq._BlockQuant(64, True, transposed="q")


def test_ptx_arithmetic(tmp_path):
    """Compile in a fresh process (CuTe DSL reads CUTE_DSL_* at import) and read the PTX."""
    code = textwrap.dedent("""
        from fp4gen.device import quantize
        quantize.compile_only("sm_90a", 128)
    """)
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ptx = {f: (tmp_path / f).read_text() for f in os.listdir(tmp_path) if f.endswith(".ptx")}
    # one file per entry point and argument types, cut short: vt / vt_nat share one, and so do
    # the two transposed Q/K kernels
    assert len(ptx) == 4, list(ptx)
    text = "\n".join(ptx.values())
    assert ".ftz" not in text  # subnormal scales and quotients must survive
    assert "div.approx" not in text and "div.full" not in text
    quant = [t for f, t in ptx.items() if "cvt.rn.satfinite.e4m3x2.f32" in t]
    assert len(quant) == 3  # Q/K pass, with and without Q^T/K^T, and V^T pass; amax writes no payload
    for t in quant:
        assert t.count("div.rn.f32") == 64  # 8 vectors x 8 elements per thread, IEEE division
        assert f"mul.rn.f32 s, a, 0f{dq._R448_BITS:08X}" in t
    assert dq._R448_BITS == struct.unpack("<I", struct.pack("<f", 1.0 / 448.0))[0] == 0x3B124925


def test_reciprocal_scale_is_what_torch_cuda_computes():
    """The scale rule the kernel copies: torch on CUDA divides by a Python float as a
    multiplication by its fp32 reciprocal. The two rules differ on many bf16 amaxes, so the
    choice matters (torch on CPU divides; see the module docstring)."""
    a = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    recip = a * torch.tensor(1.0 / 448.0, dtype=torch.float32)
    quot = a / torch.full_like(a, 448.0)
    assert (recip != quot).any()
    assert ((recip.view(torch.int32) - quot.view(torch.int32)).abs() <= 1).all()


def test_absmax_on_bf16_bits_orders_like_values():
    """amax from max over (bits & 0x7FFF) as unsigned 16-bit integers: same order as |x|,
    NaN above +Inf (so NaN propagates like torch.amax)."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    x = bits.to(torch.int16).view(torch.bfloat16).float()
    key = bits & 0x7FFF
    finite = ~torch.isnan(x)
    order = torch.argsort(key[finite], stable=True)
    vals = x[finite].abs()[order]
    assert (vals[1:] >= vals[:-1]).all()
    assert key[~finite].min() > key[torch.isinf(x)].max()


def _nan_fixup(o: torch.Tensor) -> torch.Tensor:
    """Torch transcription of the PTX in quantize._Q4 (32-bit unsigned arithmetic)."""
    m = 0xFFFFFFFF
    t = ~o & m
    y = ((t & 0x7F7F7F7F) + 0x7F7F7F7F) & m
    y = ~(y | t | 0x7F7F7F7F) & m
    return o ^ y


def test_nan_byte_fixup_only_rewrites_0xff():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 1 << 32, (200000,), generator=g, dtype=torch.int64)
    # make sure every byte value shows up in every position, 0xFF and 0x7F included
    allb = torch.arange(256, dtype=torch.int64)
    words = torch.cat([words] + [allb << (8 * i) | (0xFF << (8 * ((i + 1) % 4))) for i in range(4)])
    out = _nan_fixup(words)
    for i in range(4):
        bi, bo = (words >> (8 * i)) & 0xFF, (out >> (8 * i)) & 0xFF
        assert torch.equal(bo, torch.where(bi == 0xFF, torch.full_like(bi, 0x7F), bi))


def test_v_permutation_gather_matches_v_operand_layout():
    """The V^T pass writes output column 32g + p from key 32g + FP8_P_KEY_PERM[p]: the same
    map the torch path's _v_operand builds with index_select."""
    mod = load_module(make_plan("fp8_exp", 64, False), _tmp())
    S = 70
    v8 = torch.arange(S, dtype=torch.int64).repeat_interleave(64).reshape(1, S, 1, 64).to(torch.uint8)
    vt = mod._v_operand(v8.view(torch.float8_e4m3fn)).view(torch.uint8)[0, 0, 0]  # (Skp,)
    ours = [(32 * (c // 32) + FP8_P_KEY_PERM[c % 32]) for c in range(96)]
    ours = [k if k < S else 0 for k in ours]  # padding keys are byte 0 (key 0's value here is 0 too)
    assert vt.tolist() == ours


def test_ds_key_perm_puts_key_r_plus_8_after_key_r():
    """K^T for FP8 dQ = dS K: within every 16 keys, the pair (2i, 2i + 1) holds keys i and i + 8,
    the two accumulator rows one thread packs into a 16-bit unit of dS's transposed stmatrix."""
    from fp4gen.device.layout import FP8_DS_KEY_PERM, FP8_P_KEY_PERM

    assert len(FP8_P_KEY_PERM) == 32
    assert sorted(FP8_DS_KEY_PERM) == list(range(32))
    assert FP8_DS_KEY_PERM[:4] == (0, 8, 1, 9) and FP8_DS_KEY_PERM[14:18] == (7, 15, 16, 24)
    for p in range(0, 32, 2):
        key = FP8_DS_KEY_PERM[p]
        assert key // 16 == p // 16 and key % 16 == (p % 16) // 2 and FP8_DS_KEY_PERM[p + 1] == key + 8


def _transposed_by_loops(x, tiles, tokens, perm):
    """``transposed_tiles`` written out element by element (the definition, for small shapes)."""
    B, S, H, D = x.shape
    out = torch.zeros((B, H, tiles, D, tokens), dtype=x.dtype)
    for t in range(tiles):
        for p in range(tokens):
            s = t * tokens + 32 * (p // 32) + perm[p % 32]
            if s < S:
                out[:, :, t, :, p] = x[:, s]
    return out


@pytest.mark.parametrize("op", ["q", "k"])
@pytest.mark.parametrize("s", [1, 50, 64, 100, 128, 200, 300])
def test_transposed_operand_layout_and_round_trip(op, s):
    """The layouts of quantize_blockwise(transposed=...) from a natural payload: (B, H, tiles, D,
    tokens) with ceil(S/128) * 128 / tokens tiles, tokens permuted per 32, zero past S; the
    inverse gives the payload back."""
    B, H, D = 2, 3, 16
    tokens, perm = dq.TRANSPOSED_TILES[op]
    assert (tokens, perm) == {"q": (64, FP8_P_KEY_PERM), "k": (128, FP8_DS_KEY_PERM)}[op]
    x = torch.randint(1, 256, (B, s, H, D), dtype=torch.uint8)  # no zero byte: zeros are padding
    xt = dq.transposed_operand(x, op)
    tiles = -(-s // 128) * (128 // tokens)
    assert xt.shape == (B, H, tiles, D, tokens) and xt.is_contiguous() and xt.dtype == torch.uint8
    assert torch.equal(xt, _transposed_by_loops(x, tiles, tokens, perm))
    assert int((xt == 0).sum()) == B * H * D * (tiles * tokens - s)  # padding, and only padding
    assert torch.equal(dq.untransposed_tiles(xt, s, perm), x)
    f8 = dq.transposed_operand(x.view(torch.float8_e4m3fn), op)
    assert f8.dtype == torch.float8_e4m3fn and torch.equal(f8.view(torch.uint8), xt)
    assert torch.equal(dq.untransposed_tiles(f8, s, perm).view(torch.uint8), x)


def test_q_transposed_is_the_backward_dot_layout():
    """Q^T is in the layout the backward's dO^T has: bwd_prep.dot_tiles of a V^T-style payload
    (B, H, D, S padded to 32, queries permuted per 32 by FP8_P_KEY_PERM)."""
    from fp4gen.device import bwd_prep

    B, S, H, D = 1, 200, 2, 32
    x = torch.randint(1, 256, (B, S, H, D), dtype=torch.uint8)
    s32 = -(-S // 32) * 32
    vt = torch.zeros((B, H, D, s32), dtype=torch.uint8)
    vt[..., :S] = x.permute(0, 2, 3, 1)
    cols = [32 * (c // 32) + FP8_P_KEY_PERM[c % 32] for c in range(s32)]
    vt = vt[..., cols]
    sqp = -(-S // 128) * 128
    assert torch.equal(dq.transposed_operand(x, "q"), bwd_prep.dot_tiles(vt, sqp))


def _tmp():
    import tempfile

    return tempfile.mkdtemp(prefix="fp4gen_quant_")


# ------------------------------------------------------------------ GPU


def _same_scale(a, b):
    if a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    return torch.equal(na, nb) and torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32))


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _oracle(mod, q, k, v):
    from fp4gen.numerics.quant import quantize_fp8_blockwise, quantize_fp8_tensor

    tq, tk, tv = quantize_fp8_blockwise(q, 128, 1), quantize_fp8_blockwise(k, 128, 1), quantize_fp8_tensor(v)
    return (tq.payload, tk.payload, mod._v_operand(tv.payload),
            tq.scale.permute(0, 2, 1).contiguous(), tk.scale.permute(0, 2, 1).contiguous(), tv.scale)


def _compare(mod, q, k, v):
    """Fused vs torch path vs oracle; returns a list of mismatching operand names."""
    fused = mod.quantize_inputs(q, k, v)  # fast=True: the fused kernels on CUDA
    torch_path = mod.quantize_inputs(q, k, v, fast=False)
    oracle = _oracle(mod, q, k, v)
    names = ("q8", "k8", "vt8", "scale_q", "scale_k", "scale_v")
    bad = []
    for ref_name, ref in (("torch", torch_path), ("oracle", oracle)):
        for n, a, b in zip(names, fused, ref):
            ok = _same_scale(a, b) if n.startswith("scale") else (
                a.shape == b.shape and torch.equal(_bytes(a), _bytes(b)))
            if not ok:
                bad.append(f"{n} vs {ref_name}")
    return bad


_MODS = {}


def _mod(d):
    if d not in _MODS:
        _MODS[d] = load_module(make_plan("fp8_exp", d, False), _tmp())
    return _MODS[d]


def _rand(shape, g, scale=3.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()


SHAPES = [
    # (B, Sq, Sk, H, Hkv, D)
    (2, 256, 256, 4, 4, 128),  # block aligned
    (2, 300, 700, 4, 2, 128),  # ragged (not multiples of 128 or 32), GQA 2:1
    (1, 77, 45, 4, 1, 128),  # shorter than one block, GQA 4:1
    (1, 1000, 513, 2, 2, 64),  # D 64
    (3, 129, 161, 6, 3, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_random_bit_exact(shape):
    B, Sq, Sk, H, Hkv, D = shape
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    q, k, v = _rand((B, Sq, H, D), g), _rand((B, Sk, Hkv, D), g, 0.5), _rand((B, Sk, Hkv, D), g, 20.0)
    assert _compare(_mod(D), q, k, v) == []


def _adversarial(D=128):
    """q, k, v with special blocks: all zeros, -0.0, huge, bf16 subnormals, huge and tiny
    together, NaN, +-Inf, and values at E4M3 rounding ties."""
    g = torch.Generator(device="cuda").manual_seed(1)
    B, S, H = 2, 128 * 7 + 45, 3
    base = _rand((B, S, H, D), g)
    q, k, v = base.clone(), base.clone() * 0.25, base.clone() * 8
    bf = torch.bfloat16
    for t in (q, k):
        t[0, 0:128, 0] = 0.0  # all-zero block -> scale 1
        t[0, 128:256, 1] = -0.0  # negative zeros -> payload 0x80
        t[1, 0:128, 0] = _rand((128, D), g) * 1e37  # huge (|x| up to ~1.5e38)
        t[1, 128:256, 0] = (_rand((128, D), g) * 1e-39).to(bf)  # bf16 subnormals -> subnormal scale
        t[1, 256:384, 0] = (_rand((128, D), g) * 1e-3)
        t[1, 256, 0, 0] = 3.0e38  # huge with tiny in one block: tiny quotients underflow to +-0
        t[0, 300, 2, 5] = float("nan")  # NaN block -> NaN scale, all 0x7F
        t[1, 400, 2, 7] = float("inf")  # Inf block -> Inf scale
        t[1, 401, 2, 9] = float("-inf")
        t[0, S - 1, 1, 0] = 448.0 * 3  # amax in the short last block
    # E4M3 ties: amax 448 -> scale fl32(448 * fl32(1/448)); values at midpoints of the grid
    ties = torch.tensor([448.0, 1.0625, 3.25, -0.0029296875, 0.013671875, 240.0, 232.0], device="cuda").to(bf)
    q[0, 512:519, 2, :] = ties[:, None]
    v_nan, v_inf = v.clone(), v.clone()
    v_nan[1, 3, 1, 4] = float("nan")  # one head of V: NaN scale, NaN payload, zero padding
    v_inf[0, 5, 2, 0] = float("-inf")
    v_zero = v.clone()
    v_zero[:, :, 0] = 0.0  # an all-zero head
    v_sub = (v * 1e-40).to(bf)  # whole V in the bf16 subnormal range
    return q, k, (v, v_nan, v_inf, v_zero, v_sub)


@pytest.mark.gpu
def test_adversarial_bit_exact():
    q, k, vs = _adversarial()
    for i, v in enumerate(vs):
        assert _compare(_mod(128), q, k, v) == [], f"V variant {i}"


@pytest.mark.gpu
def test_special_values_follow_the_documented_contract():
    """What the docstring of fp4gen.device.quantize promises, checked directly."""
    q, k, _ = _adversarial()
    q8, _, _, sq, _, _ = _mod(128).quantize_inputs(q, k, q[:, :, :3])
    codes = q8.view(torch.uint8)
    assert sq[0, 0, 0] == 1.0 and (codes[0, 0:128, 0] == 0).all()  # all zeros
    assert (codes[0, 128:256, 1] == 0x80).all()  # -0.0
    assert torch.isnan(sq[0, 2, 2]) and (codes[0, 256:384, 2] == 0x7F).all()  # NaN block
    assert torch.isinf(sq[1, 2, 3])  # Inf block
    assert codes[1, 400, 2, 7] == 0x7F and codes[1, 401, 2, 9] == 0x7F
    assert 0 < sq[1, 0, 1] < 2.0 ** -126  # subnormal scale kept (no flush to zero)


@pytest.mark.gpu
def test_non_contiguous_and_offset_inputs():
    g = torch.Generator(device="cuda").manual_seed(3)
    qkv = _rand((2, 200, 3, 4, 64), g)
    q, k, v = qkv.unbind(2)  # strided views
    assert not q.is_contiguous()
    assert _compare(_mod(64), q, k, v) == []
    flat = _rand((1 + 2 * 200 * 4 * 64,), g)[1:].view(2, 200, 4, 64)  # 2-byte misaligned base
    assert _compare(_mod(64), flat, flat, flat) == []


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fused", "interleaved", "batch1"])
@pytest.mark.parametrize("S, H, Hkv, D", [(1000, 6, 6, 128), (300, 8, 2, 128), (77, 4, 1, 64)])
def test_strided_inputs_read_in_place_bit_exact(layout, S, H, Hkv, D):
    """Views of a fused QKV projection (token stride (H + 2 Hkv) D), of a per-head interleaved one
    (head stride 3 D) and of a one-sequence batch (size-1 dims) are read where they lie
    (``strided_view``: no copy) and give every output of ``quantize_inputs`` bit for bit as their
    compact copies do, the backward's V payload and transposed Q/K copies included."""
    g = torch.Generator(device="cuda").manual_seed(S + H + D)
    B = 1 if layout == "batch1" else 2
    if layout == "interleaved":
        if H != Hkv:
            pytest.skip("one (B, S, H, 3, D) projection holds H = Hkv heads")
        x = _rand((B, S, H, 3, D), g, 5.0)
        q, k, v = x.unbind(3)
    else:
        x = _rand((B, S, (H + 2 * Hkv) * D), g, 5.0)
        q, k, v = (t.view(B, S, -1, D) for t in x.split([H * D, Hkv * D, Hkv * D], -1))
    assert not q.is_contiguous()
    for t in (q, k, v):
        assert dq._prep(t, "x", strided=True).data_ptr() == t.data_ptr()  # in place, not a copy
    got = dq.quantize_inputs(q, k, v, for_backward=True, transposed_qk=True)
    ref = dq.quantize_inputs(q.contiguous(), k.contiguous(), v.contiguous(), for_backward=True, transposed_qk=True)
    names = ("q8", "k8", "vt8", "scale_q", "scale_k", "scale_v", "v8", "qt8", "kt8")
    for n, a, b in zip(names, got, ref):
        assert (_same_scale(a, b) if n.startswith("scale") else torch.equal(_bytes(a), _bytes(b))), n
    assert _compare(_mod(D), q, k, v) == []  # and the oracle's bits


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_fuzz_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 3, (1,), generator=g))
    Hkv = int(torch.randint(1, 4, (1,), generator=g))
    H = Hkv * int(torch.randint(1, 4, (1,), generator=g))
    Sq, Sk = (int(x) for x in torch.randint(1, 600, (2,), generator=g))
    D = (64, 128)[seed % 2]
    gc = torch.Generator(device="cuda").manual_seed(seed)
    scale = float(10.0 ** torch.randint(-30, 30, (1,), generator=g))
    q, k, v = (_rand(s, gc, scale) for s in ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D)))
    assert _compare(_mod(D), q, k, v) == []


@pytest.mark.gpu
def test_forward_uses_fused_quantizer_and_matches_torch_path():
    """forward() output is identical whichever quantizer prepared the operands."""
    mod = _mod(128)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = _rand((1, 300, 2, 128), g), _rand((1, 300, 2, 128), g), _rand((1, 300, 2, 128), g)
    o_fused = mod.forward(q, k, v)
    o_torch = mod.forward(q, k, v, prepared=mod.quantize_inputs(q, k, v, fast=False))
    assert torch.equal(o_fused, o_torch)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [128, 200, 1000, 4096])
def test_transposed_copies_bit_exact(S, D):
    """quantize_blockwise(x, transposed="q" / "k"): payload and scales bit-identical to the plain
    kernel's, the transposed copy bit-identical to transposed_operand(payload) (padding zero)."""
    g = torch.Generator(device="cuda").manual_seed(S + D)
    B, H = 2, 3
    x = _rand((B, S, H, D), g)
    x[0, S // 3, 1] *= 1000.0  # a few rows scaled large: their blocks' scales differ
    x[1, S - 1, 2] *= 300.0
    x[1, 0, 0, :8] *= 50.0
    x8, scale = dq.quantize_blockwise(x)
    for op in ("q", "k"):
        y8, sc, yt8 = dq.quantize_blockwise(x, transposed=op)
        assert torch.equal(_bytes(y8), _bytes(x8)) and _same_scale(sc, scale), op
        ref = dq.transposed_operand(x8, op)
        assert yt8.dtype == torch.float8_e4m3fn and yt8.shape == ref.shape, op
        assert torch.equal(_bytes(yt8), _bytes(ref)), op


@pytest.mark.gpu
def test_transposed_copies_of_adversarial_blocks():
    """NaN, Inf, zero, -0.0 and subnormal blocks and a ragged last block, transposed bit for bit."""
    q, _, _ = _adversarial()
    x8, scale = dq.quantize_blockwise(q)
    for op in ("q", "k"):
        y8, sc, yt8 = dq.quantize_blockwise(q, transposed=op)
        assert torch.equal(_bytes(y8), _bytes(x8)) and _same_scale(sc, scale), op
        assert torch.equal(_bytes(yt8), _bytes(dq.transposed_operand(x8, op))), op


@pytest.mark.gpu
def test_quantize_inputs_with_transposed_qk():
    """for_backward + transposed_qk: the 7 tensors of for_backward, then Q^T and K^T of q8, k8."""
    g = torch.Generator(device="cuda").manual_seed(11)
    B, Sq, Sk, H, Hkv, D = 2, 300, 700, 4, 2, 128
    q, k, v = _rand((B, Sq, H, D), g), _rand((B, Sk, Hkv, D), g, 0.5), _rand((B, Sk, Hkv, D), g, 20.0)
    out = dq.quantize_inputs(q, k, v, for_backward=True, transposed_qk=True)
    base = dq.quantize_inputs(q, k, v, for_backward=True)
    assert len(out) == 9 and len(base) == 7
    names = ("q8", "k8", "vt8", "scale_q", "scale_k", "scale_v", "v8")
    for n, a, b in zip(names, out, base):
        assert (_same_scale(a, b) if n.startswith("scale") else torch.equal(_bytes(a), _bytes(b))), n
    qt8, kt8 = out[7:]
    assert qt8.shape == (B, H, 2 * 3, D, 64) and kt8.shape == (B, Hkv, 6, D, 128)
    assert torch.equal(_bytes(qt8), _bytes(dq.transposed_operand(out[0], "q")))
    assert torch.equal(_bytes(kt8), _bytes(dq.transposed_operand(out[1], "k")))


def _emulate_kernel_blockwise(x: torch.Tensor):
    """The kernel's algorithm in torch (CPU): amax from the |bf16| bit patterns of each
    (batch, 128-token block, head), scale = 1 or fl32(amax * fl32(1/448)), payload =
    e4m3(fl32(x / scale)) with the oracle's encoder standing in for cvt.rn.satfinite plus
    the NaN fix-up."""
    from fp4gen.numerics.formats import E4M3, encode

    B, S, H, D = x.shape
    nb = -(-S // 128)
    bits = x.view(torch.int16).to(torch.int32) & 0x7FFF
    bits = torch.nn.functional.pad(bits, (0, 0, 0, 0, 0, nb * 128 - S))
    amax_bits = bits.view(B, nb, 128, H, D).amax(dim=(2, 4))  # (B, nb, H)
    amax = (amax_bits << 16).view(torch.float32)
    scale = torch.where(amax_bits == 0, torch.ones_like(amax), amax * torch.tensor(1.0 / 448.0))
    full = scale.repeat_interleave(128, dim=1)[:, :S, :, None]
    return encode(x.float() / full, E4M3), scale.permute(0, 2, 1).contiguous()


def test_kernel_algorithm_matches_oracle_with_cuda_scale_rule(monkeypatch):
    """On the CPU, with the oracle's amax / 448 evaluated as torch does on CUDA (reciprocal),
    the kernel's algorithm gives the oracle's bits on adversarial blocks: zeros, -0.0,
    NaN, +-Inf, bf16 subnormals, huge with tiny, ragged last block."""
    from fp4gen.numerics import quant

    monkeypatch.setattr(quant, "_fp8_scale", lambda amax, fmt: torch.where(
        amax == 0, torch.ones_like(amax), amax * torch.tensor(1.0 / fmt.max_value)))
    g = torch.Generator().manual_seed(0)
    S, H, D = 128 * 5 + 17, 3, 64
    x = (torch.randn(2, S, H, D, generator=g) * 3).bfloat16()
    x[0, 0:128, 0] = 0.0
    x[0, 128:256, 1] = -0.0
    x[1, 0:128, 0] = (torch.randn(128, D, generator=g) * 1e37).bfloat16()
    x[1, 128:256, 0] = (torch.randn(128, D, generator=g) * 1e-39).bfloat16()
    x[1, 256:384, 0] = (torch.randn(128, D, generator=g) * 1e-3).bfloat16()
    x[1, 256, 0, 0] = 3.0e38
    x[0, 300, 2, 5] = float("nan")
    x[1, 400, 2, 7] = float("inf")
    x[1, 401, 2, 9] = float("-inf")
    x[0, S - 1, 1, 0] = 1344.0
    codes, scale = _emulate_kernel_blockwise(x)
    ref = quant.quantize_fp8_blockwise(x, 128, 1)
    assert torch.equal(codes, ref.codes)
    assert _same_scale(scale, ref.scale.permute(0, 2, 1).contiguous())
    assert torch.isnan(scale[0, 2, 2]) and (codes[0, 256:384, 2] == 0x7F).all()
    assert codes[1, 400, 2, 7] == 0x7F and scale[1, 0, 1] < 2.0 ** -126
