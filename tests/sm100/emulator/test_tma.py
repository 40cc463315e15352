"""Tensor maps and cp.async.bulk.tensor tile loads of the sm100a CTA emulator.

``tma_load`` is checked against numpy slicing of the global tensor and against the ISA's
swizzle tables (PTX ISA 5.5.7, copied below as data); ``tensor_maps`` is checked end to end on
compiled kernels: the maps it derives from the kept MLIR, applied to operands prepared by the
generated module's own host code, must put each tile in SMEM exactly where CuTe DSL's SMEM
layout atom (evaluated on the host) says the MMA reads it, and scale-factor tiles byte for
byte as ``quant.to_tcgen05_sf_layout`` packs them.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4gen.lowering.emulator import tma
from fp4gen.lowering.emulator.tensor import SharedMemory, TensorOpError
from fp4gen.numerics.formats import unpack_fp4

# PTX ISA 5.5.7 "Swizzling Modes": 16-byte cell order of each 128-byte row, per swizzle span
ISA_TABLES = {
    32: [[0, 1, 2, 3, 4, 5, 6, 7], [1, 0, 3, 2, 5, 4, 7, 6]],
    64: [[0, 1, 2, 3, 4, 5, 6, 7], [1, 0, 3, 2, 5, 4, 7, 6], [2, 3, 0, 1, 6, 7, 4, 5], [3, 2, 1, 0, 7, 6, 5, 4]],
    128: [[0, 1, 2, 3, 4, 5, 6, 7], [1, 0, 3, 2, 5, 4, 7, 6], [2, 3, 0, 1, 6, 7, 4, 5], [3, 2, 1, 0, 7, 6, 5, 4],
          [4, 5, 6, 7, 0, 1, 2, 3], [5, 4, 7, 6, 1, 0, 3, 2], [6, 7, 4, 5, 2, 3, 0, 1], [7, 6, 5, 4, 3, 2, 1, 0]],
}


class Gmem:
    def __init__(self):
        self.chunks = {}

    def put(self, addr, arr):
        self.chunks[addr] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        return addr

    def read(self, addr, n):
        for base, buf in self.chunks.items():
            if base <= addr and addr + n <= base + buf.size:
                return buf[addr - base: addr - base + n].tobytes()
        raise AssertionError(f"read of {n} bytes at {addr:#x} outside every tensor")


# ------------------------------------------------------------------ tma_store ----

@pytest.mark.parametrize("span", [0, 128])
def test_tile_store_is_the_inverse_of_the_load_and_clips_out_of_bounds(span):
    """A box loaded to SMEM and stored back lands where it came from; rows and columns outside
    the tensor are not written (ISA 5.5.3.3)."""
    rng = np.random.default_rng(2)
    rows, planes = 40, 2
    g = Gmem()
    data = rng.integers(1, 256, (planes, rows, 256), dtype=np.uint8)
    base = g.put(0x50000, data)
    out = np.zeros_like(data)
    obase = 0x90000

    def write(addr, b):
        off = addr - obase
        assert 0 <= off and off + len(b) <= out.size, (hex(addr), len(b))
        out.reshape(-1)[off:off + len(b)] = np.frombuffer(b, np.uint8)

    box = (128, 32, 1)
    tm_in = tma.TensorMap(8, base, (256, rows, planes), (256, 256 * rows), box, (1, 1, 1), span)
    tm_out = tma.TensorMap(8, obase, (256, rows, planes), (256, 256 * rows), box, (1, 1, 1), span)
    sm = SharedMemory()
    for coords in ((0, 0, 0), (128, 32, 1), (128, 0, 1)):  # (128, 32, 1): rows 32..39 only
        tma.tma_load(sm, g.read, tm_in, coords, 8192)
        n, _ = tma.tma_store(sm, write, tm_out, coords, 8192)
        assert n == 128 * 32
    want = np.zeros_like(data)
    want[0, 0:32, 0:128] = data[0, 0:32, 0:128]
    want[1, 32:40, 128:256] = data[1, 32:40, 128:256]
    want[1, 0:32, 128:256] = data[1, 0:32, 128:256]
    assert np.array_equal(out, want)


def test_tile_store_reads_smem_through_the_swizzle():
    """The store reads 16-byte cell table[r % 8][j] of 128-byte SMEM row r as cell j of global
    row r (the ISA table); a planted unswizzled SMEM image comes out permuted."""
    rows = 8
    sm = SharedMemory()
    plain = (np.arange(rows * 128) // 16).astype(np.uint8)  # cell ids in global order
    swz = np.zeros_like(plain)
    for r in range(rows):
        for j in range(8):
            c = ISA_TABLES[128][r][j]
            swz[128 * r + 16 * c:128 * r + 16 * c + 16] = plain[128 * r + 16 * j:128 * r + 16 * j + 16]
    out = {}
    tm = tma.TensorMap(8, 0x1000, (128, rows), (128,), (128, rows), (1, 1), 128)
    sm.write(4096, swz.tobytes())
    tma.tma_store(sm, lambda a, b: out.__setitem__(a, b), tm, (0, 0), 4096)
    got = np.frombuffer(b"".join(out[k] for k in sorted(out)), np.uint8)
    assert np.array_equal(got, plain)
    sm.write(4096, plain.tobytes())
    tma.tma_store(sm, lambda a, b: out.__setitem__(a, b), tm, (0, 0), 4096)
    got = np.frombuffer(b"".join(out[k] for k in sorted(out)), np.uint8)
    assert not np.array_equal(got, plain)


# ------------------------------------------------------------------ tma_load -----

def test_tile_load_with_out_of_bounds_rows_and_columns():
    rng = np.random.default_rng(0)
    pitch, rows, planes = 96, 50, 3  # row pitch 96 bytes, 64 of them in the tensor
    g = Gmem()
    data = rng.integers(1, 256, (planes, rows, pitch), dtype=np.uint8)
    base = g.put(0x10000, data)
    tm = tma.TensorMap(8, base, (64, rows, planes), (pitch, pitch * rows), (32, 32, 1), (1, 1, 1), 0)
    sm = SharedMemory()
    for coords in ((0, 40, 1), (48, 0, 2), (-16, -8, 0), (32, 18, 0)):
        n, spans = tma.tma_load(sm, g.read, tm, coords, 1024)
        assert n == 32 * 32
        got = np.frombuffer(sm.read(1024, 1024), np.uint8).reshape(32, 32)
        want = np.zeros((32, 32), np.uint8)
        c0, c1, c2 = coords
        for r in range(32):
            for c in range(32):
                x, y = c0 + c, c1 + r
                if 0 <= x < 64 and 0 <= y < rows:
                    want[r, c] = data[c2, y, x]
        assert np.array_equal(got, want), coords
        assert spans[0].lo == 1024 and spans[-1].hi == 2048
    with pytest.raises(TensorOpError, match="128-byte aligned"):
        tma.tma_load(sm, g.read, tm, (0, 0, 0), 1040)


@pytest.mark.parametrize("span", [32, 64, 128])
def test_swizzle_follows_the_isa_tables(span):
    rows = 16
    g = Gmem()
    data = (np.arange(rows * span) // 16).astype(np.uint8)  # each 16-byte chunk holds its chunk number
    base = g.put(0x20000, data)
    tm = tma.TensorMap(8, base, (span, rows), (span,), (span, rows), (1, 1), span)
    sm = SharedMemory()
    tma.tma_load(sm, g.read, tm, (0, 0), 4096)
    got = np.frombuffer(sm.read(4096, rows * span), np.uint8).reshape(-1, 128)[:, ::16]  # chunk ids per 128-B row
    table = ISA_TABLES[span]
    for r in range(got.shape[0]):
        # cell j of 128-byte row r holds source chunk table[r % len(table)][j] (of that row)
        want = [8 * r + table[r % len(table)][j] for j in range(8)]
        assert list(got[r]) == want, (span, r)


def test_four_bit_rows_ending_inside_a_byte():
    """A U4 tensor with an odd extent: the last tile's run ends mid-byte, the rest is zero."""
    rng = np.random.default_rng(1)
    g = Gmem()
    n, rows = 333, 8
    codes = rng.integers(1, 16, (rows, 384)).astype(np.uint8)  # stored padded to 384
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    base = g.put(0x30000, packed)
    tm = tma.TensorMap(4, base, (n, rows), (192,), (128, rows), (1, 1), 64)
    sm = SharedMemory()
    nbytes, _ = tma.tma_load(sm, g.read, tm, (256, 0), 2048)
    assert nbytes == 128 * rows // 2
    raw = np.frombuffer(sm.read(2048, nbytes), np.uint8)
    # undo the 64-byte swizzle with the ISA table to get rows back
    rows_back = np.zeros((rows, 64), np.uint8)
    for r in range(rows):
        for j in range(4):
            a = 64 * r + 16 * j
            row128, cell = a // 128, (a % 128) // 16
            phys = 128 * row128 + 16 * ISA_TABLES[64][row128 % 4].index(cell)
            rows_back[r, 16 * j:16 * j + 16] = raw[phys:phys + 16]
    got = unpack_fp4(torch.from_numpy(rows_back)).numpy()
    want = codes[:, 256:384].copy()
    want[:, n - 256:] = 0
    assert np.array_equal(got, want)


def test_unaligned_swizzled_box_is_recorded():
    g = Gmem()
    base = g.put(0x40000, np.zeros(64 * 8, np.uint8))
    tm = tma.TensorMap(8, base, (64, 8), (64,), (64, 8), (1, 1), 64, name="t")
    sm = SharedMemory()
    tma.tma_load(sm, g.read, tm, (0, 0), 2048)
    assert sm.findings == []
    tma.tma_load(sm, g.read, tm, (0, 0), 2432)
    assert len(sm.findings) == 1 and "512-byte boundary" in sm.findings[0]


def test_map_checks():
    with pytest.raises(NotImplementedError, match="under a 128-byte swizzle"):
        tma.TensorMap(8, 0, (64, 4), (64,), (64, 4), (1, 1), 128).check()
    with pytest.raises(TensorOpError, match="16 bytes"):
        tma.TensorMap(8, 0, (64, 4), (72,), (64, 4), (1, 1), 0).check()


# ------------------------------------------------------------------ maps from compiled kernels -----

ROOT = Path(__file__).resolve().parents[3]


def _artifacts(name):
    """(ptx, mlir) of a generated module, through the emulator's one compile cache."""
    from fp4gen.lowering.emulator.run import compiled

    src = (ROOT / "generated" / f"{name}_sm100a.py").read_text()
    return compiled(src, backward=name.startswith("sm100_bwd"))


def _module(name):
    spec = importlib.util.spec_from_file_location(f"fp4gen_tma_test_{name}", ROOT / "generated" / f"{name}_sm100a.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _host_layouts(mod, B, Sq, Sk, H, Hkv):
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as bsl

    got = {}

    @cute.jit
    def trace():
        for n, lay in mod._gmem_layouts(cute, bsl, Sq, Sk, B * H, B * Hkv).items():
            got[n] = None if lay is None else (lay.shape, lay.stride)

    cute.compile(trace)
    return got


def _eval(shape, stride, coords):
    """CuTe layout (shape, stride) at coordinates, each split colexicographically over its mode
    (test_tensor_semantics checks this evaluation against CuTe's own calls)."""
    def flat(sh, st):
        if isinstance(sh, tuple):
            return [x for a, b in zip(sh, st) for x in flat(a, b)]
        return [(sh, st)]

    total = 0
    for ms, md, c in zip(shape, stride, coords):
        idx = c
        for s_, d_ in flat(ms, md):
            total = total + (idx % s_) * d_
            idx = idx // s_
    return total


def _smem_tile(kind, dtype, rows, k, order):
    """Byte address (relative to the tile) of every (row, k) of a CuTe SMEM tile, and its bit."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05

    out = {}

    @cute.jit
    def trace():
        atom = tcgen05.make_smem_layout_atom(getattr(tcgen05.SmemLayoutAtomKind, kind), getattr(cutlass, dtype))
        t = cute.tile_to_shape(atom, (rows, k), order)
        out["l"] = (t.outer.shape, t.outer.stride, str(t.inner))
        b = {"S<1,4,3>": 1, "S<2,4,3>": 2, "S<3,4,3>": 3}[str(t.inner)]
        sw = cute.make_composed_layout(cute.make_swizzle(b, 4, 3), 0, cute.make_layout(1 << 18))
        out["sw"] = [sw(x) for x in range(1024)]

    cute.compile(trace)
    shape, stride, _ = out["l"]
    r = np.arange(rows)[:, None]
    c = np.arange(k)[None, :]
    bits = {"Float4E2M1FN": 4, "Float8E4M3FN": 8, "BFloat16": 16}[dtype]
    bit = _eval(shape, stride, (r, c)).astype(np.int64) * bits
    byte = bit >> 3
    tab = np.array(out["sw"])
    return byte - byte % 1024 + tab[byte % 1024], bit & 7


SHAPE = (1, 200, 333, 2, 1)  # B, Sq, Sk, H, Hkv: ragged Sq and Sk, GQA


def _setup(name):
    ptx, mlir = _artifacts(name)
    mod = _module(name)
    B, Sq, Sk, H, Hkv = SHAPE
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, Sq, H, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, 128, generator=g).to(torch.bfloat16)
    v = torch.randn(B, Sk, Hkv, 128, generator=g).to(torch.bfloat16)
    ops = mod.prepare_operands(q, k, v)
    lays = _host_layouts(mod, *SHAPE)
    gm = Gmem()
    by_arg = {}
    for i, (nm, spec) in enumerate(ops.layouts().items()):
        addr = gm.put(0x1_0000_0000 * (i + 1), ops.tensors[nm].contiguous().view(torch.uint8).numpy())
        if lays.get(nm) is not None:
            by_arg[i] = (addr, lays[nm][0], lays[nm][1], None)
    maps = tma.tensor_maps(mlir, by_arg, ptx)
    atoms = tma.tma_atoms(mlir)
    by_host = {a.host_arg: key for a, key in zip(atoms, sorted(maps))}
    names = list(ops.layouts())
    return ops, gm, {names[h]: maps[k] for h, k in by_host.items()}


def _fp4_rows(t: torch.Tensor) -> np.ndarray:
    return unpack_fp4(t.contiguous()).numpy()


@pytest.mark.slow
def test_fa4_fp4_maps_put_tiles_where_the_mma_reads_them():
    ops, gm, maps = _setup("fa4_fp4_d128")
    assert set(maps) == {"q", "k", "v", "sfq", "sfk", "sfv", "o"}
    # O (the epilogue's TMA store): bf16 rows of D = 128 in two 64-element boxes of 128 query
    # rows under the 128-byte swizzle, one plane per (batch, head)
    o = maps["o"]
    assert (o.elem_bits, o.box_dims, o.swizzle) == (16, (64, 128, 1), 128)
    assert o.global_dims[0] == 128 and o.global_dims[1] == 200
    addr, sub = _smem_tile("K_SW64", "Float4E2M1FN", 128, 128, (0, 1))
    sm = SharedMemory(fill=0xAB)

    def read_codes(base):
        raw = sm.view()[base + addr]
        return (raw >> sub.astype(np.uint8)) & 0xF

    # Q of head 1, query tile 1 (rows 128..255; rows >= Sq = 200 are outside: zeros)
    n, _ = tma.tma_load(sm, gm.read, maps["q"], (0, 128, 1), 8192)
    assert n == 8192
    want = np.zeros((128, 128), np.uint8)
    want[:200 - 128] = _fp4_rows(ops.tensors["q"][1, 128:200])
    assert np.array_equal(read_codes(8192), want)
    # V^T (K-major B operand: rows = head dim, K = keys) of key tile 2 (keys 256..383, Sk = 333)
    tma.tma_load(sm, gm.read, maps["v"], (256, 0, 0), 16384)
    want = _fp4_rows(ops.tensors["v"][0])[:, 256:384].copy()
    want[:, 333 - 256:] = 0
    assert np.array_equal(read_codes(16384), want)
    # scale factors: K tile 1's 1024-byte SF atoms (two K-64 steps), as the host packed them
    n, _ = tma.tma_load(sm, gm.read, maps["sfk"], (0, 0, 1, 0), 32768)
    assert n == 1024
    assert np.array_equal(sm.view()[32768:32768 + 1024], ops.tensors["sfk"][0, 1024:2048].numpy())
    n, _ = tma.tma_load(sm, gm.read, maps["sfv"], (0, 2, 0), 40960)
    assert n == 512
    assert np.array_equal(sm.view()[40960:40960 + 512], ops.tensors["sfv"][0, 1024:1536].numpy())


@pytest.mark.slow
def test_fa4_nvfp8_v_map_is_mn_major_sw128():
    ops, gm, maps = _setup("fa4_nvfp8_d128")
    addr, _ = _smem_tile("MN_SW128", "Float8E4M3FN", 128, 128, (1, 0))  # (head dim, keys)
    sm = SharedMemory()
    tma.tma_load(sm, gm.read, maps["v"], (0, 256, 0), 16384)
    got = sm.view()[16384 + addr]
    want = np.zeros((128, 128), np.uint8)
    want[:, :333 - 256] = ops.tensors["v"][0, 256:333].numpy().T  # stored (keys, D)
    assert np.array_equal(got, want)


@pytest.mark.slow
def test_planted_fault_wrong_swizzle_misplaces_the_tile():
    ops, gm, maps = _setup("fa4_fp4_d128")
    addr, sub = _smem_tile("K_SW64", "Float4E2M1FN", 128, 128, (0, 1))
    sm = SharedMemory()
    import dataclasses

    wrong = dataclasses.replace(maps["k"], swizzle=0)
    tma.tma_load(sm, gm.read, wrong, (0, 0, 0), 8192)
    raw = sm.view()[8192 + addr]
    assert not np.array_equal((raw >> sub.astype(np.uint8)) & 0xF, _fp4_rows(ops.tensors["k"][0, 0:128]))


@pytest.mark.slow
def test_backward_maps():
    """The backward's bf16 atoms: 64-element (128-byte) boxes under the 128B swizzle, 4 dims."""
    ptx, mlir = _artifacts("sm100_bwd_causal_d128")
    atoms = tma.tma_atoms(mlir)
    assert [a.tma_format for a in atoms] == ["BF16_RN"] * 4 and all(a.swizzle == 128 for a in atoms)
    S, H, B = 256, 2, 1
    shape, stride = (S, 128, H, B), (128 * H, 1, 128, S * 128 * H)
    maps = tma.tensor_maps(mlir, {a.host_arg: (0x1000 * (a.host_arg + 1) * 4096, shape, stride, "bf16")
                                  for a in atoms}, ptx)
    for m in maps.values():
        assert m.box_dims == (64, 128, 1, 1) and m.global_dims == (128, S, H, B)
        assert m.global_strides == (256 * H, 256, S * 256 * H)
    with pytest.raises(TensorOpError, match="static"):
        tma.tensor_maps(mlir, {a.host_arg: (0, (S, 64, H, B), stride, "bf16") for a in atoms}, ptx)
    # a mode of extent 1 may have any stride (CuTe gives 0); its static stride is not checked
    a = atoms[0]
    m = tma.tensor_map_of(a, 0, (S, 128, 1, 1), (128, 1, 0, 0))
    assert m.global_dims == (128, S, 1, 1)
    with pytest.raises(TensorOpError, match="stride 2"):
        tma.tensor_map_of(a, 0, (S, 128, 2, 1), (128, 2, 128, 0))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fa4_fp4_d128", "fa4_nvfp8_d128", "fa4_nvmx_accurate_d128", "sage3_fp4_d128"])
def test_every_forward_atom_gets_a_map(name):
    """Every TMA atom of each forward resolves to a map over the operand it is built on, and
    each cp.async.bulk.tensor of the PTX has the rank of some map."""
    import re

    ops, gm, maps = _setup(name)
    ptx, _ = _artifacts(name)
    want = {"q", "k", "v", "sfq", "sfk", "o"} | ({"sfv"} if "sfv" in maps else set())
    assert want <= set(maps)
    ranks = {int(r) for r in re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.", ptx)}
    assert ranks <= {m.rank for m in maps.values()}
    for nm, m in maps.items():
        assert m.global_address == gm_address(gm, ops, nm)


def gm_address(gm, ops, nm):
    return 0x1_0000_0000 * (list(ops.layouts()).index(nm) + 1)
