"""Semantics of SMEM, TMEM and the tcgen05 operations of the sm100a CTA emulator.

Each form the generated kernels use is checked against a computation that does not go
through the code under test: operands are placed in SMEM through CuTe DSL's own SMEM layout
atoms (``tcgen05.make_smem_layout_atom`` + ``cute.tile_to_shape``, evaluated on the host) and
CuTe's swizzle functor, scale factors through ``quant.to_tcgen05_sf_layout``, and the expected
product is a numpy matmul of operands dequantised with ``fp4gen.numerics.formats``. Planted
faults (wrong swizzle, swapped nibble order, wrong sf_id, wrong warp) must change the result or
be refused.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4gen.lowering.descriptors import encode_instr_desc, encode_smem_desc
from fp4gen.lowering.emulator import tensor as T
from fp4gen.lowering.emulator.trace import SmemSpan, TmemSpan
from fp4gen.numerics import formats as F
from fp4gen.numerics.quant import to_tcgen05_sf_layout

SW_CODE = {0: 0, 32: 6, 64: 4, 128: 2}  # Table 40 swizzle field


# ------------------------------------------------------------------ CuTe on the host -----

def _flat(shape, stride):
    if isinstance(shape, tuple):
        out = []
        for s, d in zip(shape, stride):
            out += _flat(s, d)
        return out
    return [(shape, stride)]


def _eval(shape, stride, coords):
    """A CuTe layout (shape, stride) at logical coordinates (one array per top mode), each
    coordinate split colexicographically over its mode (CuTe's definition)."""
    total = 0
    for ms, md, c in zip(shape, stride, coords):
        idx = c
        for s, d in _flat(ms, md):
            total = total + (idx % s) * d
            idx = idx // s
    return total


CASES = {
    # name: (atom kind, CuTe dtype name, bits, rows (MN), K of the tile, tile order)
    "K_SW64_e2m1": ("K_SW64", "Float4E2M1FN", 4, 128, 128, (0, 1)),
    "K_SW128_bf16": ("K_SW128", "BFloat16", 16, 128, 128, (0, 1)),
    "K_SW32_e4m3": ("K_SW32", "Float8E4M3FN", 8, 128, 64, (0, 1)),
    "K_INTER_bf16": ("K_INTER", "BFloat16", 16, 64, 32, (0, 1)),
    "MN_SW128_bf16": ("MN_SW128", "BFloat16", 16, 128, 64, (1, 0)),
    "MN_SW128_e4m3": ("MN_SW128", "Float8E4M3FN", 8, 128, 128, (1, 0)),
    "MN_SW64_bf16": ("MN_SW64", "BFloat16", 16, 64, 32, (0, 1)),
    "MN_INTER_bf16": ("MN_INTER", "BFloat16", 16, 32, 32, (0, 1)),
}


@pytest.fixture(scope="module")
def cute_ref():
    """CuTe's tile layouts (shape, stride, swizzle bits), a sample of direct evaluations of
    each, and CuTe's swizzle functors on 0..1023 plus a few far addresses."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05
    import cutlass.utils.blackwell_helpers  # noqa: F401  (registers the helpers)

    out = {"layouts": {}, "direct": {}, "swizzle": {}, "far": {}}
    rng = np.random.default_rng(0)
    samples = {n: [(int(rng.integers(c[3])), int(rng.integers(c[4]))) for _ in range(64)] for n, c in CASES.items()}
    far = [int(x) for x in rng.integers(0, 1 << 17, 16)]

    @cute.jit
    def trace():
        for name, (kind, dt, bits, rows, k, order) in CASES.items():
            atom = tcgen05.make_smem_layout_atom(getattr(tcgen05.SmemLayoutAtomKind, kind), getattr(cutlass, dt))
            t = cute.tile_to_shape(atom, (rows, k), order)
            o = t.outer
            out["layouts"][name] = (o.shape, o.stride, str(t.inner))
            out["direct"][name] = [o(rc) for rc in samples[name]]
        for b in (1, 2, 3):
            sw = cute.make_composed_layout(cute.make_swizzle(b, 4, 3), 0, cute.make_layout(1 << 18))
            out["swizzle"][16 << b] = [sw(x) for x in range(1024)]
            out["far"][16 << b] = [(x, sw(x)) for x in far]

    cute.compile(trace)
    out["samples"] = samples
    return out


def _cute_swizzle(ref, span, addr):
    if span == 0:
        return addr
    tab = np.array(ref["swizzle"][span], dtype=np.int64)
    return addr - addr % 1024 + tab[addr % 1024]


def _cute_addresses(ref, name, base):
    """(byte address, bit offset) of every (row, k) of the CASES tile at SMEM ``base``, from
    CuTe's layout (in elements; CuTe's SMEM swizzles act on byte addresses)."""
    kind, _, bits, rows, k, _ = CASES[name]
    shape, stride, sw = ref["layouts"][name]
    r = np.arange(rows)[:, None]
    c = np.arange(k)[None, :]
    elem = _eval(shape, stride, (r, c)).astype(np.int64)
    bit = elem * bits
    span = {"S<0,4,3>": 0, "S<1,4,3>": 32, "S<2,4,3>": 64, "S<3,4,3>": 128}[sw]
    return _cute_swizzle(ref, span, base + (bit >> 3)), bit & 7, span


def _descriptor(name, base, k0, ref):
    """The descriptor a kernel builds for K step starting at k0 of the CASES tile: start, LBO,
    SBO as ISA 9.7.16.3.1/3.2 define them for this tile (read off the tile's geometry)."""
    kind, _, bits, rows, k, order = CASES[name]
    _, _, span = _cute_addresses(ref, name, base)
    t = 128 // bits
    if kind.startswith("K"):
        if span == 0:
            # core matrices 8 rows x 16 B; K_INTER atoms tiled along rows first (order (0,1))
            sbo, lbo = 128, (rows // 8) * 128
            start = base + (k0 // t) * lbo
        else:
            sbo, lbo = 8 * span, 16
            atom_k = span * 8 // bits  # K elements per swizzle row
            start = base + (k0 // atom_k) * rows * span + (k0 % atom_k) * bits // 8
    else:
        row_bytes = rows * bits // 8
        if span == 0:
            sbo, lbo = 128, (rows // t) * 128  # next 16 B of MN / next 8 K (order (0,1))
        elif order == (0, 1):
            lbo, sbo = 8 * span, row_bytes * 8
        else:
            lbo, sbo = k * span, 8 * span
        start = base + (k0 // 8) * (lbo if span == 0 else sbo)
    return encode_smem_desc(start_address=(start & 0x3FFFF) >> 4, lbo=lbo >> 4, sbo=sbo >> 4,
                            version=1, swizzle=SW_CODE[span])


# ------------------------------------------------------------------ swizzle / addresses -----

@pytest.mark.parametrize("span", [32, 64, 128])
def test_swizzle_is_cute_swizzle(cute_ref, span):
    x = np.arange(1024)
    assert np.array_equal(T.swizzle_address(x, span), np.array(cute_ref["swizzle"][span]))
    for a, want in cute_ref["far"][span]:
        assert T.swizzle_address(a, span) == want


def test_cute_layout_evaluation_matches_cute(cute_ref):
    """Guard for the test helper: colex evaluation of CuTe's (shape, stride) = CuTe's own."""
    for name in CASES:
        shape, stride, _ = cute_ref["layouts"][name]
        for (r, c), want in zip(cute_ref["samples"][name], cute_ref["direct"][name]):
            assert int(_eval(shape, stride, (r, c))) == want, name


@pytest.mark.parametrize("name", list(CASES))
def test_operand_addresses_match_cute_layouts(cute_ref, name):
    kind, _, bits, rows, k, _ = CASES[name]
    base = 8192
    addr, sub, _ = _cute_addresses(cute_ref, name, base)
    kstep = 256 // bits if kind.startswith("K") and "INTER" not in kind else 128 // bits * 2
    kstep = min(kstep, k)
    for k0 in range(0, k, kstep):
        desc = _descriptor(name, base, k0, cute_ref)
        major = 0 if kind.startswith("K") else 1
        got_a, got_s = T.operand_bit_addresses(desc, rows, kstep, bits, major)
        assert np.array_equal(got_a, addr[:, k0:k0 + kstep]), f"{name} K step at {k0}: byte addresses"
        assert np.array_equal(got_s, sub[:, k0:k0 + kstep]), f"{name} K step at {k0}: bit offsets"


def test_wrong_swizzle_in_descriptor_changes_addresses(cute_ref):
    name = "K_SW64_e2m1"
    addr, _, _ = _cute_addresses(cute_ref, name, 0)
    desc = _descriptor(name, 0, 0, cute_ref)
    wrong = (desc & ~(7 << 61)) | (2 << 61)  # 128B instead of 64B
    got, _ = T.operand_bit_addresses(wrong, 128, 64, 4, 0)
    assert not np.array_equal(got, addr[:, :64])


# ------------------------------------------------------------------ memories / ld / st -----

def test_alloc_dealloc_and_bounds():
    tm = T.TensorMemory()
    assert tm.alloc(256) == 0 and tm.alloc(128) == 256
    with pytest.raises(T.TensorOpError):
        tm.alloc(100)
    with pytest.raises(T.TensorOpError):
        tm.alloc(256)  # only 128 columns left
    with pytest.raises(T.TensorOpError):
        T.tmem_load(tm, "32x32b", 32, (0 << 16) | 400, 0)  # columns 400.. not allocated
    tm.dealloc(256, 128)
    with pytest.raises(T.TensorOpError):
        tm.dealloc(256, 128)
    sm = T.SharedMemory()
    assert len(sm.data) == 232448
    sm.write(10, b"\x01\x02")
    assert sm.read(9, 4) == b"\x00\x01\x02\x00"
    with pytest.raises(T.TensorOpError):
        sm.read(232440, 16)


def test_tmem_ld_st_32x32b_rules():
    tm = T.TensorMemory()
    tm.alloc(512)
    rng = np.random.default_rng(1)
    for warp in (0, 5, 10, 15):
        regs = rng.integers(0, 2 ** 32, (32, 8), dtype=np.uint64).astype(np.uint32)
        lane = 32 * (warp % 4)
        w = T.tmem_store(tm, "32x32b", 8, (lane << 16) | 64, warp, regs)
        assert w == (TmemSpan(lane, lane + 32, 64, 72),)
        # ISA 9.7.16.2.3.1.1: thread t, register j <-> lane lane+t, column 64+j
        assert np.array_equal(tm.data[lane:lane + 32, 64:72], regs)
        got, r = T.tmem_load(tm, ".32x32b", "x8", (lane << 16) | 64, warp)
        assert np.array_equal(got, regs) and r == w
    # ISA 9.7.16.8.1: warp 1 (of its warpgroup) owns lanes 32..63 only
    with pytest.raises(T.TensorOpError, match="9.7.16.8.1"):
        T.tmem_load(tm, "32x32b", 32, 0, 1)
    with pytest.raises(T.TensorOpError):
        T.tmem_store(tm, "32x32b", 32, 32 << 16, 4, np.zeros((32, 32), np.uint32))
    for shape in ("16x64b", "16x128b", "16x256b", "16x32bx2"):
        with pytest.raises(NotImplementedError, match=shape):
            T.tmem_load(tm, shape, 4, 0, 0)


def test_spans_are_relative_to_the_allocation():
    tm = T.TensorMemory()
    tm.alloc(256)
    tm.alloc(256)  # second allocation at column 256; spans stay relative to the first base
    assert T.tmem_load(tm, "32x32b", 4, 300, 0)[1] == (TmemSpan(0, 32, 300, 304),)
    assert T.smem_spans([5, 3, 4, 9, 10]) == (SmemSpan(3, 6), SmemSpan(9, 11))


# ------------------------------------------------------------------ tcgen05.cp -----

def test_tcgen05_cp_32x128b_warpx4():
    sm, tm = T.SharedMemory(), T.TensorMemory()
    tm.alloc(512)
    rng = np.random.default_rng(2)
    block = rng.integers(0, 256, 1024, dtype=np.uint8)
    sm.write(4096, block.tobytes())
    # the kernels' descriptor: no swizzle, LBO 16, SBO 128; K step 1 at +512 bytes
    for step in (0, 1):
        desc = encode_smem_desc(start_address=(4096 + 512 * step) >> 4, lbo=1, sbo=8, version=1)
        reads, writes = T.tmem_copy(tm, sm, "32x128b", "warpx4", 80 + 4 * step, desc)
        assert reads == (SmemSpan(4096 + 512 * step, 4608 + 512 * step),)
        assert writes == (TmemSpan(0, 128, 80 + 4 * step, 84 + 4 * step),)
        rows = block[512 * step:512 * (step + 1)].reshape(32, 16)
        want = rows.view("<u4")  # bytes 4c..4c+3 of a row -> column c, little-endian
        for w in range(4):
            assert np.array_equal(tm.data[32 * w:32 * w + 32, 80 + 4 * step:84 + 4 * step], want)
    with pytest.raises(NotImplementedError, match="128x256b"):
        T.tmem_copy(tm, sm, "128x256b", None, 0, desc)
    with pytest.raises(NotImplementedError, match="64x128b.warpx2::02_13"):
        T.tmem_copy(tm, sm, "64x128b", "warpx2::02_13", 0, desc)


# ------------------------------------------------------------------ MMA helpers -----

def _place(sm, ref, name, base, codes):
    """Write element codes (rows, K) into SMEM at CuTe's addresses for tile ``name``."""
    kind, _, bits, rows, k, _ = CASES[name]
    addr, sub, _ = _cute_addresses(ref, name, base)
    mem = sm.view()
    codes = np.asarray(codes, dtype=np.int64)
    if bits == 4:
        for a, s, c in zip(addr.ravel().tolist(), sub.ravel().tolist(), codes.ravel().tolist()):
            mem[a] = (int(mem[a]) & (0xFF ^ (0xF << s))) | (c << s)
    elif bits == 8:
        mem[addr.ravel()] = codes.ravel()
    else:
        mem[addr.ravel()] = codes.ravel() & 0xFF
        mem[addr.ravel() + 1] = codes.ravel() >> 8


def _dq(codes, fmt):
    c = torch.from_numpy(np.asarray(codes, dtype=np.int64)).to(torch.uint8)
    return F.decode(c, F.FORMATS[fmt]).double().numpy()


def _bf16(rng, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))).to(torch.bfloat16)
    return x.view(torch.int16).numpy().astype(np.int64) & 0xFFFF, x.double().numpy()


def _f32(tm, col, n=128):
    return tm.data[0:128, col:col + n].view(np.float32).astype(np.float64)


def _close(got, want):
    # D is rounded to fp32 after every K step (the reference is float64 throughout)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _mem():
    sm, tm = T.SharedMemory(), T.TensorMemory(fill=0xFFFFFFFF)  # poison: NaN if read unwritten
    tm.alloc(512)
    return sm, tm


def _tmem_pack(tm, col, codes, bits):
    """A (128, K) codes -> TMEM row m = lane m, K packed low bits first (module assumption)."""
    per = 32 // bits
    codes = np.asarray(codes, dtype=np.uint64)
    words = np.zeros((128, codes.shape[1] // per), np.uint64)
    for i in range(per):
        words |= codes[:, i::per] << np.uint64(bits * i)
    tm.data[0:128, col:col + words.shape[1]] = words.astype(np.uint32)


# ------------------------------------------------------------------ kind::f16 (bf16) -----

def test_mma_f16_bf16_kmajor_sw128_accumulates(cute_ref):
    """The backward's S^T = K·Q^T form: A and B K-major SW128 bf16, K = 128 in 8 steps."""
    rng = np.random.default_rng(3)
    sm, tm = _mem()
    a_codes, A = _bf16(rng, (128, 128))
    b_codes, B = _bf16(rng, (128, 128))
    _place(sm, cute_ref, "K_SW128_bf16", 1024, a_codes)
    _place(sm, cute_ref, "K_SW128_bf16", 1024 + 32768, b_codes)
    idesc = encode_instr_desc("kind::f16", d_format=1, a_format=1, b_format=1, n_dim=128 >> 3, m_dim=128 >> 4)
    for i, k0 in enumerate(range(0, 128, 16)):
        reads, writes = T.mma(tm, sm, kind="kind::f16", modifiers=("cta_group::1", "collector::a::discard"),
                              d_taddr=128, a=_descriptor("K_SW128_bf16", 1024, k0, cute_ref), a_in_tmem=False,
                              b_desc=_descriptor("K_SW128_bf16", 1024 + 32768, k0, cute_ref), idesc=idesc,
                              enable_input_d=i > 0)
        assert writes == (TmemSpan(0, 128, 128, 256),)
        assert (TmemSpan(0, 128, 128, 256) in reads) == (i > 0)
    want = A @ B.T
    np.testing.assert_allclose(_f32(tm, 128), want, rtol=1e-5, atol=1e-5)


def test_mma_f16_a_from_tmem_b_mn_major(cute_ref):
    """The backward's dV = P^T·dO form: A (bf16) in TMEM, B MN-major SW128 (LBO between the
    two 64-element MN atoms)."""
    rng = np.random.default_rng(4)
    sm, tm = _mem()
    a_codes, A = _bf16(rng, (128, 64))
    b_codes, B = _bf16(rng, (128, 64))  # (N, K)
    _tmem_pack(tm, 0, a_codes, 16)
    _place(sm, cute_ref, "MN_SW128_bf16", 2048, b_codes)
    idesc = encode_instr_desc("kind::f16", d_format=1, a_format=1, b_format=1, b_major=1,
                              n_dim=128 >> 3, m_dim=128 >> 4)
    for i, k0 in enumerate(range(0, 64, 16)):
        T.mma(tm, sm, kind="kind::f16", modifiers=("cta_group::1",), d_taddr=256, a=k0 // 2, a_in_tmem=True,
              b_desc=_descriptor("MN_SW128_bf16", 2048, k0, cute_ref), idesc=idesc, enable_input_d=i > 0)
    np.testing.assert_allclose(_f32(tm, 256), A @ B.T, rtol=1e-5, atol=1e-5)


def test_mma_disable_output_lane_keeps_masked_lanes(cute_ref):
    """ISA 9.7.16.10.9.1: bit i of the 128-bit {disable-output-lane} mask (element 0's LSB =
    lane 0) leaves TMEM lane i of D as it was; a zero mask is the plain MMA."""
    rng = np.random.default_rng(8)
    sm, tm = _mem()
    a_codes, A = _bf16(rng, (128, 16))
    b_codes, B = _bf16(rng, (128, 64))
    _tmem_pack(tm, 0, a_codes, 16)
    _place(sm, cute_ref, "MN_SW128_bf16", 2048, b_codes)
    idesc = encode_instr_desc("kind::f16", d_format=1, a_format=1, b_format=1, b_major=1,
                              n_dim=128 >> 3, m_dim=128 >> 4)
    kw = dict(kind="kind::f16", d_taddr=256, a=0, a_in_tmem=True, idesc=idesc, enable_input_d=False,
              b_desc=_descriptor("MN_SW128_bf16", 2048, 0, cute_ref))
    T.mma(tm, sm, disable_output_lane=(0, 0, 0, 0), **kw)
    want = A @ B[:, :16].T
    _close(_f32(tm, 256), want)
    tm.data[0:128, 256:384] = 0
    mask = (1 << 0) | (1 << 37) | (0xFFFFFFFF << 96)  # lanes 0, 37, 96..127
    _, writes = T.mma(tm, sm, disable_output_lane=tuple((mask >> (32 * i)) & 0xFFFFFFFF for i in range(4)), **kw)
    assert writes == (TmemSpan(1, 37, 256, 384), TmemSpan(38, 96, 256, 384))
    got = _f32(tm, 256)
    kept = np.zeros(128, bool)
    kept[[0, 37]] = True
    kept[96:] = True
    assert (got[kept] == 0).all()
    _close(got[~kept], want[~kept])


# ------------------------------------------------------------------ kind::f8f6f4 (e4m3) -----

def test_mma_f8f6f4_e4m3_a_tmem_b_mn_major(cute_ref):
    """The FP8 forward's PV form: P (e4m3) in TMEM, V MN-major SW128 e4m3, K = 128 in 4 steps."""
    rng = np.random.default_rng(5)
    sm, tm = _mem()
    a_codes = rng.integers(0, 0x7F, (128, 128)) | (rng.integers(0, 2, (128, 128)) << 7)
    a_codes[a_codes & 0x7F == 0x7F] = 0  # no NaN
    b_codes = rng.integers(0, 0x7E, (128, 128))
    _tmem_pack(tm, 64, a_codes, 8)
    _place(sm, cute_ref, "MN_SW128_e4m3", 4096, b_codes)
    idesc = encode_instr_desc("kind::f8f6f4", d_format=1, a_format=0, b_format=0, b_major=1,
                              n_dim=128 >> 3, m_dim=128 >> 4)
    for i, k0 in enumerate(range(0, 128, 32)):
        T.mma(tm, sm, kind="kind::f8f6f4", modifiers=("cta_group::1", "collector::a::discard"), d_taddr=256,
              a=64 + k0 // 4, a_in_tmem=True, b_desc=_descriptor("MN_SW128_e4m3", 4096, k0, cute_ref),
              idesc=idesc, enable_input_d=i > 0)
    want = _dq(a_codes, "e4m3") @ _dq(b_codes, "e4m3").T
    _close(_f32(tm, 256), want)


# ------------------------------------------------------------------ block-scaled FP4 -----

def _fp4_case(rng, rows, k):
    codes = rng.integers(0, 16, (rows, k))
    return codes, _dq(codes, "e2m1")


def _sf_to_tmem(sm, tm, codes, smem_base, col, k_steps):
    """Scale codes (rows, Kb) -> SF atoms in SMEM (quant.to_tcgen05_sf_layout) -> one
    tcgen05.cp.32x128b.warpx4 per 512-byte atom, 4 columns each (as the kernels do)."""
    buf = to_tcgen05_sf_layout(torch.from_numpy(np.asarray(codes, dtype=np.uint8))).numpy()
    sm.write(smem_base, buf.tobytes())
    for s in range(k_steps):
        desc = encode_smem_desc(start_address=(smem_base + 512 * s) >> 4, lbo=1, sbo=8, version=1)
        T.tmem_copy(tm, sm, "32x128b", "warpx4", col + 4 * s, desc)


def _e4m3_scales(rng, shape):
    c = rng.integers(0x30, 0x48, shape)  # ~2^-1 .. 2^2, positive
    return c, _dq(c, "e4m3")


def _nvfp4_qk(cute_ref, sm, tm, rng, sf_a_id=0, desc_swizzle=None):
    """QK^T as fa4_fp4_d128 issues it: Q, K NVFP4 (E2M1, UE4M3 per 16) K-major SW64, D = 128
    in two K = 64 steps, scales of step s at SF column + 4s, sf ids 0. Returns the reference."""
    qa, Q = _fp4_case(rng, 128, 128)
    ka, Kx = _fp4_case(rng, 128, 128)
    sq, SQ = _e4m3_scales(rng, (128, 8))
    sk, SK = _e4m3_scales(rng, (128, 8))
    _place(sm, cute_ref, "K_SW64_e2m1", 2048, qa)
    _place(sm, cute_ref, "K_SW64_e2m1", 2048 + 8192, ka)
    _sf_to_tmem(sm, tm, sq, 65536, 128, 2)
    _sf_to_tmem(sm, tm, sk, 65536 + 1024, 136, 2)
    idesc = encode_instr_desc("kind::mxf4nvf4", a_format=1, b_format=1, n_dim=128 >> 3, m_dim=128 >> 7,
                              scale_type=0, a_sf_id=sf_a_id)
    for s in range(2):
        da = _descriptor("K_SW64_e2m1", 2048, 64 * s, cute_ref)
        db = _descriptor("K_SW64_e2m1", 2048 + 8192, 64 * s, cute_ref)
        if desc_swizzle is not None:
            da = (da & ~(7 << 61)) | (desc_swizzle << 61)
        T.mma(tm, sm, kind="kind::mxf4nvf4.block_scale.block16", modifiers=("cta_group::1", "collector::a::discard"),
              d_taddr=0, a=da, a_in_tmem=False, b_desc=db, idesc=idesc, enable_input_d=s > 0,
              scale_a_taddr=128 + 4 * s, scale_b_taddr=136 + 4 * s)
    return (Q * np.repeat(SQ, 16, 1)) @ (Kx * np.repeat(SK, 16, 1)).T


def test_mma_mxf4nvf4_block16_nvfp4(cute_ref):
    rng = np.random.default_rng(6)
    sm, tm = _mem()
    want = _nvfp4_qk(cute_ref, sm, tm, rng)
    _close(_f32(tm, 0), want)


def _mxfp4_pv(sm, tm, cute_ref, rng, ids=(0, 2)):
    """PV as fa4_fp4_d128 issues it: P (E2M1) in TMEM at columns 64..79 (8 codes per column),
    V^T K-major SW64, UE8M0 per 32 keys, one SF column group for both K steps with sf id 0
    (keys 0-63) and 2 (keys 64-127)."""
    pa, P = _fp4_case(rng, 128, 128)
    va, V = _fp4_case(rng, 128, 128)  # (N = head dim, K = keys)
    sp = rng.integers(120, 134, (128, 4))
    sv = rng.integers(120, 134, (128, 4))
    _tmem_pack(tm, 64, pa, 4)
    _place(sm, cute_ref, "K_SW64_e2m1", 4096, va)
    _sf_to_tmem(sm, tm, sp, 65536, 80, 1)
    _sf_to_tmem(sm, tm, sv, 65536 + 512, 84, 1)
    for s in range(2):
        idesc = encode_instr_desc("kind::mxf4nvf4", a_format=1, b_format=1, n_dim=128 >> 3, m_dim=128 >> 7,
                                  scale_type=1, a_sf_id=ids[s], b_sf_id=ids[s])
        T.mma(tm, sm, kind="kind::mxf4nvf4", modifiers=("block_scale", "block32", "cta_group::1"), d_taddr=256,
              a=64 + 8 * s, a_in_tmem=True, b_desc=_descriptor("K_SW64_e2m1", 4096, 64 * s, cute_ref), idesc=idesc,
              enable_input_d=s > 0, scale_a_taddr=(ids[s] << 30) | 80, scale_b_taddr=84)
    e8 = lambda c: 2.0 ** (np.asarray(c, dtype=np.float64) - 127)  # noqa: E731
    return (P * np.repeat(e8(sp), 32, 1)) @ (V * np.repeat(e8(sv), 32, 1)).T


def test_mma_mxf4nvf4_block32_mxfp4_a_from_tmem(cute_ref):
    rng = np.random.default_rng(7)
    sm, tm = _mem()
    want = _mxfp4_pv(sm, tm, cute_ref, rng)
    _close(_f32(tm, 256), want)


# ------------------------------------------------------------------ planted faults -----

def test_fault_wrong_sf_id_changes_the_result(cute_ref):
    sm, tm = _mem()
    want = _mxfp4_pv(sm, tm, cute_ref, np.random.default_rng(7), ids=(0, 0))  # K step 1 reads bytes 0-1 again
    assert not np.allclose(_f32(tm, 256), want, rtol=1e-3)


def test_fault_wrong_swizzle_changes_the_result(cute_ref):
    sm, tm = _mem()
    want = _nvfp4_qk(cute_ref, sm, tm, np.random.default_rng(6), desc_swizzle=2)  # 128B, data is 64B
    assert not np.allclose(_f32(tm, 0), want, rtol=1e-3)


def test_fault_swapped_nibble_order_changes_the_result(cute_ref, monkeypatch):
    """A Q/K pair packed alike is blind to the nibble order (the K sum is permutation
    invariant), so the faults are one-sided: K packed high nibble first; P's order in TMEM
    flipped against V's in SMEM; V's in SMEM flipped against P's."""
    sm, tm = _mem()
    want = _nvfp4_qk(cute_ref, sm, tm, np.random.default_rng(6))
    good = _f32(tm, 0).copy()
    _close(good, want)
    mem = sm.view()
    k_bytes = np.arange(2048 + 8192, 2048 + 16384)
    mem[k_bytes] = (mem[k_bytes] >> 4) | ((mem[k_bytes] & 0xF) << 4)  # K packed the other way
    idesc = encode_instr_desc("kind::mxf4nvf4", a_format=1, b_format=1, n_dim=16, m_dim=1, scale_type=0)
    for s in range(2):
        T.mma(tm, sm, kind="kind::mxf4nvf4.block_scale.block16", d_taddr=0,
              a=_descriptor("K_SW64_e2m1", 2048, 64 * s, cute_ref), a_in_tmem=False,
              b_desc=_descriptor("K_SW64_e2m1", 2048 + 8192, 64 * s, cute_ref), idesc=idesc,
              enable_input_d=s > 0, scale_a_taddr=128 + 4 * s, scale_b_taddr=136 + 4 * s)
    assert not np.allclose(_f32(tm, 0), want, rtol=1e-3)
    for switch in ("NIBBLE_LOW_FIRST_TMEM", "NIBBLE_LOW_FIRST_SMEM"):
        with monkeypatch.context() as mp:
            mp.setattr(T, switch, False)
            sm, tm = _mem()
            want = _mxfp4_pv(sm, tm, cute_ref, np.random.default_rng(7))
            assert not np.allclose(_f32(tm, 256), want, rtol=1e-3), switch


def test_fault_scale_copies_differ_between_partitions(cute_ref):
    """A scale copy written to one 32-lane partition only changes that partition's rows."""
    rng = np.random.default_rng(6)
    sm, tm = _mem()
    want = _nvfp4_qk(cute_ref, sm, tm, rng)
    tm.data[32:64, 136] ^= 0x01010101  # partition 1's copy of SFK, K step 0
    sm2 = sm  # rerun with the corrupted copy
    idesc = encode_instr_desc("kind::mxf4nvf4", a_format=1, b_format=1, n_dim=16, m_dim=1, scale_type=0)
    for s in range(2):
        T.mma(tm, sm2, kind="kind::mxf4nvf4.block_scale.block16", d_taddr=0,
              a=_descriptor("K_SW64_e2m1", 2048, 64 * s, cute_ref), a_in_tmem=False,
              b_desc=_descriptor("K_SW64_e2m1", 2048 + 8192, 64 * s, cute_ref), idesc=idesc,
              enable_input_d=s > 0, scale_a_taddr=128 + 4 * s, scale_b_taddr=136 + 4 * s)
    got = _f32(tm, 0)
    ok = np.isclose(got, want, rtol=1e-6).all(axis=1)
    assert ok[:32].all() and ok[64:].all() and not ok[32:64].all()


def test_pattern_start_findings(cute_ref):
    """ISA 9.7.16.4.1 Table 41: a swizzled operand whose pattern does not start at its boundary
    needs a non-zero base offset. The generated forwards place Q/K/V 384 bytes past a 512/1024
    boundary with base offset 0; the emulator records that (it swizzles by absolute address
    bits, so TMA and MMA agree here) and, strict, refuses it."""
    sm = T.SharedMemory()
    for k0 in (0, 64):  # K steps inside the first row of the pattern: same pattern, no finding
        T.check_pattern_start(sm, _descriptor("K_SW64_e2m1", 2048, k0, cute_ref), "A")
    assert sm.findings == []
    T.check_pattern_start(sm, _descriptor("K_SW64_e2m1", 2432, 0, cute_ref), "A")
    assert len(sm.findings) == 1 and "base offset 3" in sm.findings[0]
    with pytest.raises(T.TensorOpError, match="Table 41"):
        T.check_pattern_start(T.SharedMemory(strict=True), _descriptor("K_SW128_bf16", 1024 + 512, 0, cute_ref), "B")


def test_refusals():
    sm, tm = _mem()
    base = dict(d_taddr=0, a=0, a_in_tmem=True, b_desc=encode_smem_desc(version=1, sbo=64, swizzle=2),
                enable_input_d=False)
    f16 = encode_instr_desc("kind::f16", d_format=1, a_format=1, b_format=1, n_dim=16, m_dim=8)
    with pytest.raises(NotImplementedError, match="tf32"):
        T.mma(tm, sm, kind="kind::tf32", idesc=f16, **base)
    with pytest.raises(NotImplementedError, match="cta_group::2"):
        T.mma(tm, sm, kind="kind::f16", modifiers=("cta_group::2",), idesc=f16, **base)
    with pytest.raises(NotImplementedError, match="collector::a::fill"):
        T.mma(tm, sm, kind="kind::f16", modifiers=("collector::a::fill",), idesc=f16, **base)
    with pytest.raises(NotImplementedError, match="M = 64"):
        T.mma(tm, sm, kind="kind::f16", idesc=f16 & ~(0x1F << 24) | (4 << 24), **base)
    with pytest.raises(T.TensorOpError, match="reserved"):
        T.mma(tm, sm, kind="kind::f16", idesc=f16 | (1 << 23), **base)
    with pytest.raises(T.TensorOpError, match="9.7.16.4.1"):
        T.mma(tm, sm, kind="kind::f16", idesc=f16, **dict(base, b_desc=encode_smem_desc(version=0, sbo=64)))
    with pytest.raises(T.TensorOpError, match="lane"):
        T.mma(tm, sm, kind="kind::f16", idesc=f16, **dict(base, d_taddr=32 << 16))
    nv = encode_instr_desc("kind::mxf4nvf4", a_format=1, b_format=1, n_dim=16, m_dim=1, scale_type=0, a_sf_id=2)
    with pytest.raises(T.TensorOpError, match="sf ids"):
        T.mma(tm, sm, kind="kind::mxf4nvf4.block_scale.block16", idesc=nv, scale_a_taddr=128, scale_b_taddr=136,
              **dict(base, a_in_tmem=False, a=encode_smem_desc(version=1, sbo=32, swizzle=4)))


# ------------------------------------------------------------------ coverage of the kernels' forms -----

KERNELS = ["fa4_fp4_d128", "fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128", "sm100_bwd_causal_d128"]


@pytest.mark.slow
@pytest.mark.parametrize("name", KERNELS)
def test_every_tcgen05_form_of_the_kernels_is_implemented(name):
    """Each distinct tcgen05.ld/st/cp/mma opcode (and operand shape) in the compiled PTX maps to
    an implemented form: a regenerated kernel with a new form fails here, not mid-emulation."""
    import re

    from tests.sm100.emulator.test_tma import _artifacts

    ptx, _ = _artifacts(name)
    forms = set(re.findall(r"^\s*(?:@!?%\w+\s+)?(tcgen05\.(?:ld|st|cp|mma)\S*)\s+(.*);", ptx, re.M))
    assert forms
    for op, args in forms:
        parts = op.split(".")
        if parts[1] in ("ld", "st"):
            assert not any(p.startswith(("pack", "unpack")) for p in parts), op
            shape = next(p for p in parts if p[0].isdigit())
            num = next(p for p in parts if re.fullmatch(r"x\d+", p))
            tm = T.TensorMemory()
            tm.alloc(512)
            if parts[1] == "ld":
                T.tmem_load(tm, shape, num, 0, 0)
            else:
                T.tmem_store(tm, shape, num, 0, 0, np.zeros((32, int(num[1:])), np.uint32))
        elif parts[1] == "cp":
            shape = next(p for p in parts if p[0].isdigit())
            mc = next((p for p in parts if p.startswith("warpx")), None)
            sm, tm = T.SharedMemory(), T.TensorMemory()
            tm.alloc(512)
            T.tmem_copy(tm, sm, shape, mc, 0, encode_smem_desc(version=1, lbo=1, sbo=8))
        else:
            kind = next(p for p in parts if p.startswith("kind::"))
            i = parts.index(kind)
            T._parse_mma_form(".".join([kind] + parts[i + 1:]), ())
            ops = [a.strip() for a in re.split(r",(?![^{]*})", args)]
            vec = [a for a in ops if a.startswith("{")]
            # operands: [d], a, b, idesc, ([sfa], [sfb],) ({disable-output-lane},) enable-input-d
            assert len(ops) == 5 + 2 * ("block_scale" in parts) + len(vec), (op, args)
            assert all(len(v.strip("{}").split(",")) == 4 for v in vec), args
