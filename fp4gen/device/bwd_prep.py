"""Pre- and post-processing kernels of the Hopper attention backward (CuTe DSL).

They replace chains of torch ops (each a full pass over (B, S, H, D) tensors, with fp32
temporaries) that cost about as much as a fifth of the backward kernel at S = 4k:

- ``_Pre``: per query row, D_i = rowsum(dO_i * O_i) in fp32, LSE in log2 units (+inf for
  rows past Sq and for rows the forward saw nothing of, so that P = 0 there), and a zeroed
  fp32 dQ accumulator row. With ``fp8``: dO is quantized with its per-(batch, head) scale
  into an e4m3 payload (natural layout, the B operand of dP^T = V dO^T) and D_i is summed
  from the dequantized dO, which is the dO that dP sees. The generated FP8 backward uses
  ``_PreFp8`` instead; ``_Pre(fp8=True)`` after ``quantize_v_operand(dO)`` stays as the
  independent implementation the GPU test holds ``_PreFp8`` to, bit for bit.
- ``_PreFp8``: the FP8 backward's whole preprocessing in one pass over O and dO after dO's
  block-amax pass: dO's scale, its payload in both layouts, D_i, LSE2, the zeroed dQ rows
  (215 us against 71 + 163 us for ``quantize_v_operand(dO)`` + ``_Pre`` at 32k tokens, H200).
- ``_Post``: dQ = softmax_scale * dQ_acc rounded to bf16, (B, H, Sqp, D) -> (B, Sq, H, D). The
  accumulator holds each 64-query tile in the backward kernel's *fragment order*
  (``dq_fragment_index``), which ``_Post`` undoes.
- ``_ScaleQuant``: x / scale[b, h] -> e4m3 payload (natural layout), e.g. V for dP.

Layout of the work (``_Pre``; the others say their own): a CTA of 256 threads covers
256 / (D/8) token rows of one (batch, head); a thread owns 8 consecutive elements of one row
(16-byte loads of bf16). ``_PreFp8`` and ``_ScaleQuant`` make one CTA cover 64 rows, the same
map repeated, with every load issued before the first store. Row sums reduce over the D/8 threads of a row with
butterfly shuffles.

Arithmetic contract (what the tests compare against): D_i in fp32 (summation order is the
kernel's: 8 products per thread, then the butterfly), lse2 = fl32(lse * fl32(log2 e)),
dQ = bf16_rne(fl32(acc * scale)), FP8 payload = e4m3_rne_satfinite(x / scale) (IEEE
division, as ``fp4gen.device.quantize``).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T
from cutlass.memory import SmemAllocator

from fp4gen.runtime import cache

from . import quantize as _quantize
from .layout import FP8_P_KEY_PERM
from .ptx import bf16x2_to_f32, e4m3x4_to_f32, f32x2_to_bf16x2, ld_v4_f32, st_v4_pred
from .quantize import (BLOCK, _block_max, chunk_of_thread, keep_if, launch, ld_v4_pred, load_rows, quant8,
                       scale_from_amax_bits, st_v2_pred, store_transposed_tile, transpose_tile_setup, umax)

THREADS = 256
DQ_TILE_M = 64  # query rows per tile of the dQ accumulator (the backward kernel's tile_m)
LOG2E = math.log2(math.e)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
ARCH = "sm_90a"
_COMPILED: dict = {}  # (kind, head dim, tvm_ffi, persist) -> compiled kernel


def _as_f32(w) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Uint32(w).ir_value()))


def _dot_fp8(q, o0, o1, o2, o3, scale) -> Float32:
    """This thread's part of D_i: sum over its 8 elements of (e4m3 dO * scale) * O, in the order
    the arithmetic contract fixes (``q``: two words of four e4m3; ``o0``..``o3``: four words of
    two bf16)."""
    o = (o0, o1, o2, o3)
    acc = Float32(0.0)
    for h in range(2):
        dq4 = e4m3x4_to_f32(q[h])
        for j in range(2):
            of = bf16x2_to_f32(o[2 * h + j])
            acc = acc + (dq4[2 * j] * scale) * of[0]
            acc = acc + (dq4[2 * j + 1] * scale) * of[1]
    return acc


@cute.jit
def _finish_row(acc: Float32, vpr: cutlass.Constexpr, d: cutlass.Constexpr, s, valid, col, batch, head, H,
                mLSE: cute.Tensor, mLSE2: cute.Tensor, mDsum: cute.Tensor, mdQacc: cute.Tensor):
    """The end of query row ``s``'s preprocessing, for the ``vpr`` threads that hold it (8
    elements each; ``col`` = this thread's): D_i summed over them (butterfly), LSE2 and D_i
    written by the first, and this thread's 8 fp32 of the dQ accumulator row zeroed. Rows
    past Sq (``valid`` false) get LSE2 = +inf and D_i = 0 up to the padded length Sqp."""
    for off in [vpr >> (i + 1) for i in range(int(math.log2(vpr)))]:
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off)
    Sqp = mLSE2.shape[2]
    if s < Sqp:
        if col == 0:
            lse2 = Float32.inf
            if valid:
                lse = mLSE[batch, head, s]
                if lse != -Float32.inf:
                    lse2 = lse * Float32(LOG2E)
            mLSE2[batch, head, s] = lse2
            mDsum[batch, head, s] = acc  # 0 past Sq: the loads gave zeros
        base = mdQacc.iterator.toint() + ((Int64(batch) * H + head) * Sqp + s) * (d * 4) + col * 32
        z = Uint32(0)
        st_v4_pred(base, z, z, z, z, Int32(1))
        st_v4_pred(base + 16, z, z, z, z, Int32(1))


class _Rows:
    """Shared thread -> (row, 8-element chunk) mapping."""

    def __init__(self, head_dim: int):
        self.d = head_dim
        self.vpr = head_dim // 8  # threads per row (16 bytes of bf16 each)
        self.rpc = THREADS // self.vpr  # rows per CTA


class _Pre(_Rows):
    def __init__(self, head_dim: int, fp8: bool):
        super().__init__(head_dim)
        self.fp8 = fp8

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mScale: cute.Tensor,
                 mLSE2: cute.Tensor, mDsum: cute.Tensor, mdQacc: cute.Tensor, mdO8: cute.Tensor, stream):
        # mO, mdO (B, Sq, H, D) bf16; mLSE (B, H, Sq) fp32; mScale (B, H) fp32 (dO's FP8 scale,
        # unused without fp8); mLSE2, mDsum (B, H, Sqp); mdQacc (B, H, Sqp, D) fp32;
        # mdO8 (B, Sq, H, D) uint8 (unused without fp8)
        grid = (cute.ceil_div(cute.size(mLSE2.shape[2]), self.rpc), cute.size(mO.shape[2]),
                cute.size(mO.shape[0]))
        self.kernel(mO, mdO, mLSE, mScale, mLSE2, mDsum, mdQacc, mdO8).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mScale: cute.Tensor,
               mLSE2: cute.Tensor, mDsum: cute.Tensor, mdQacc: cute.Tensor, mdO8: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        Sq = mO.shape[1]
        H = mO.shape[2]
        row, col = chunk_of_thread(tidx, self.d)
        s = blk * self.rpc + row
        valid = s < Sq
        tok = (Int64(batch) * Sq + s) * H + head  # token row in (B, S, H)
        wo = ld_v4_pred(mO.iterator.toint() + tok * (self.d * 2) + col * 16, valid)
        wd = ld_v4_pred(mdO.iterator.toint() + tok * (self.d * 2) + col * 16, valid)
        acc = Float32(0.0)
        if cutlass.const_expr(self.fp8):
            scale = mScale[batch, head]
            q = quant8(wd[0], wd[1], wd[2], wd[3], scale)
            st_v2_pred(mdO8.iterator.toint() + tok * self.d + col * 8, q[0], q[1], valid)
            acc = _dot_fp8(q, wo[0], wo[1], wo[2], wo[3], scale)
        else:
            for j in cutlass.range_constexpr(4):
                o2 = bf16x2_to_f32(wo[j])
                d2 = bf16x2_to_f32(wd[j])
                acc = acc + d2[0] * o2[0]
                acc = acc + d2[1] * o2[1]
        _finish_row(acc, self.vpr, self.d, s, valid, col, batch, head, H, mLSE, mLSE2, mDsum, mdQacc)


class _RowTiles(_Rows):
    """``_Rows``'s mapping repeated so that a CTA covers ``ROWS`` token rows: ``iters`` passes
    of ``rpc`` rows."""

    ROWS = 64

    def __init__(self, head_dim: int):
        super().__init__(head_dim)
        self.iters = self.ROWS // self.rpc


class _PreFp8(_RowTiles):  # ROWS == DQ_TILE_M: a CTA writes one dO^T tile
    """The FP8 backward's preprocessing in one pass over O and dO, after dO's block-amax pass
    (``quantize``'s "amax" kernel): dO's scale per (batch, head) from the block amaxes, dO's
    e4m3 payload in both layouts (natural, the B operand of dP^T = V dO^T; transposed with the
    queries permuted per 32 like the FP8 forward's V^T, one D x 64 block per query tile, the B
    operand of dV), D_i from the
    dequantized dO, LSE2 and the zeroed dQ accumulator rows. Replaces ``quantize_v_operand(dO)``
    (two more reads of dO) followed by ``_Pre``, with bit-identical outputs (same quantizer,
    same thread -> (row, 8 elements) map, same summation order). A CTA covers ``ROWS`` query
    rows of one (batch, head): 64 keeps enough CTAs per SM to have the loads in flight (a
    128-row version ran at 2.8 TB/s, slower than the two kernels it replaced)."""

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mA: cute.Tensor,
                 mLSE2: cute.Tensor, mDsum: cute.Tensor, mdQacc: cute.Tensor, mdO8: cute.Tensor,
                 mdOt: cute.Tensor, mScale: cute.Tensor, stream):
        # mO, mdO (B, Sq, H, D) bf16; mLSE (B, H, Sq) fp32; mA (B, H, nb) int32 dO block amax bits;
        # mLSE2, mDsum (B, H, Sqp); mdQacc (B, H, Sqp, D) fp32; mdO8 (B, Sq, H, D) uint8;
        # mdOt (B, H, Sqp / 64, D, 64) uint8 (dO^T in 64-query tiles); mScale (B, H) fp32
        grid = (cute.ceil_div(cute.size(mLSE2.shape[2]), self.ROWS), cute.size(mO.shape[2]),
                cute.size(mO.shape[0]))
        self.kernel(mO, mdO, mLSE, mA, mLSE2, mDsum, mdQacc, mdO8, mdOt, mScale).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mA: cute.Tensor,
               mLSE2: cute.Tensor, mDsum: cute.Tensor, mdQacc: cute.Tensor, mdO8: cute.Tensor,
               mdOt: cute.Tensor, mScale: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, batch, red, s_words, s_bytes = transpose_tile_setup(self.ROWS, self.d)
        d = self.d
        Sq = mO.shape[1]
        H = mO.shape[2]
        nb = mA.shape[2]
        row, col = chunk_of_thread(tidx, d)

        # the tile's loads first; the scale reduction runs while they are in flight
        vdo, vo = load_rows([mdO.iterator.toint(), mO.iterator.toint()], d, Sq, H, batch, head, tile * self.ROWS,
                            self.rpc, self.iters, row, col)
        m = Uint32(0)
        for i in cutlass.range(tidx, nb, THREADS, unroll=1):
            m = umax(m, Uint32(mA[batch, head, i]))
        scale = scale_from_amax_bits(_block_max(m, red, tidx))
        if tile == 0 and tidx == 0:
            mScale[batch, head] = scale

        for it in cutlass.range_constexpr(self.iters):
            r = it * self.rpc + row
            s = tile * self.ROWS + r
            valid = s < Sq
            tok = (Int64(batch) * Sq + s) * H + head
            q = quant8(vdo[it * 4], vdo[it * 4 + 1], vdo[it * 4 + 2], vdo[it * 4 + 3], scale)
            st_v2_pred(mdO8.iterator.toint() + tok * d + col * 8, q[0], q[1], valid)
            # queries past Sq are padding of the transposed payload: byte 0 whatever the scale
            s_words[r * (d // 4) + col * 2] = keep_if(q[0], valid)
            s_words[r * (d // 4) + col * 2 + 1] = keep_if(q[1], valid)
            # D_i from the dequantized dO (what dP sees), in _Pre's order
            acc = _dot_fp8(q, vo[it * 4], vo[it * 4 + 1], vo[it * 4 + 2], vo[it * 4 + 3], scale)
            _finish_row(acc, self.vpr, d, s, valid, col, batch, head, H, mLSE, mLSE2, mDsum, mdQacc)
        cute.arch.sync_threads()

        # dO^T in the FP8 PV operand's layout (as _VTranspose writes V^T), one D x 64 block per
        # query tile: the backward kernel loads exactly that block per tile
        store_transposed_tile(s_bytes, mdOt, tile, d, batch, head, H, tidx, DQ_TILE_M, FP8_P_KEY_PERM)


class _Post:
    """One CTA per 64-row tile of one (batch, head). The tile is read in fragment order (thread
    t takes 16-byte chunks t, t + 256, ...: fully coalesced), scaled, rounded to bf16 and put in
    row order in SMEM; then each row goes out as d/8 contiguous 16-byte stores (coalesced).
    Reading and writing in one pass each without the SMEM hop would leave either side with 32
    half-used sectors per warp instruction (2.7x slower, measured)."""

    def __init__(self, head_dim: int):
        self.d = head_dim
        self.row_words = head_dim // 2 + 4  # bf16 words per SMEM row: +4 makes the scatter conflict-free

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, scale: Float32, stream):
        # mdQacc (B, H, Sqp, D) fp32 in fragment order -> mdQ (B, Sq, H, D) bf16
        grid = (cute.ceil_div(cute.size(mdQ.shape[1]), DQ_TILE_M), cute.size(mdQ.shape[2]), cute.size(mdQ.shape[0]))
        self.kernel(mdQacc, mdQ, scale).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, batch = cute.arch.block_idx()
        d = self.d
        Sq = mdQ.shape[1]
        H = mdQ.shape[2]
        Sqp = mdQacc.shape[2]
        smem = SmemAllocator()
        s_words = smem.allocate_tensor(Uint32, cute.make_layout(DQ_TILE_M * self.row_words), byte_alignment=16)
        src = mdQacc.iterator.toint() + ((Int64(batch) * H + head) * Sqp + tile * DQ_TILE_M) * (d * 4)
        # chunk j holds fragment floats 4j..4j+3 (``dq_fragment_index``): warpgroup wg, column
        # block c, thread tt = 32 w4 + lane; rows 16 w4 + lane/4 (+8), columns 2 (lane%4) (+1)
        for i in cutlass.range_constexpr(d // 16):
            j = tidx + THREADS * i
            w = ld_v4_f32(src + j * 16)
            wg = j // (8 * d)
            c = (j // 128) % (d // 16)
            w4 = (j // 32) % 4
            lane = j % 32
            row = 16 * w4 + lane // 4
            word = wg * (d // 4) + 4 * c + lane % 4  # column / 2
            for r in cutlass.range_constexpr(2):
                s_words[(row + 8 * r) * self.row_words + word] = f32x2_to_bf16x2(
                    _as_f32(w[2 * r]) * scale, _as_f32(w[2 * r + 1]) * scale)
        cute.arch.sync_threads()
        per_row = d // 8  # 16-byte chunks of a bf16 row
        for i in cutlass.range_constexpr(d // 32):
            k = tidx + THREADS * i
            row = k // per_row
            cc = k % per_row
            s = tile * DQ_TILE_M + row
            base = row * self.row_words + cc * 4
            tok = (Int64(batch) * Sq + s) * H + head
            st_v4_pred(mdQ.iterator.toint() + tok * (d * 2) + cc * 16, s_words[base], s_words[base + 1],
                       s_words[base + 2], s_words[base + 3], Int32(s < Sq))


class _ScaleQuant(_RowTiles):
    """x / scale[b, h] -> e4m3 payload (natural layout). A CTA covers ``ROWS`` token rows of
    one (batch, head), every load issued before the first store: with 16 rows per CTA (one
    16-byte load per thread) the pass ran at 1.7 TB/s."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mScale: cute.Tensor, mY: cute.Tensor, stream):
        # mX (B, S, H, D) bf16, mScale (B, H) fp32 -> mY (B, S, H, D) uint8 (e4m3 bits)
        grid = (cute.ceil_div(cute.size(mX.shape[1]), self.ROWS), cute.size(mX.shape[2]),
                cute.size(mX.shape[0]))
        self.kernel(mX, mScale, mY).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mScale: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        S = mX.shape[1]
        H = mX.shape[2]
        row, col = chunk_of_thread(tidx, self.d)
        (w,) = load_rows([mX.iterator.toint()], self.d, S, H, batch, head, blk * self.ROWS, self.rpc, self.iters,
                         row, col)
        scale = mScale[batch, head]
        for it in cutlass.range_constexpr(self.iters):
            s = blk * self.ROWS + it * self.rpc + row
            tok = (Int64(batch) * S + s) * H + head
            q = quant8(w[it * 4], w[it * 4 + 1], w[it * 4 + 2], w[it * 4 + 3], scale)
            st_v2_pred(mY.iterator.toint() + tok * self.d + col * 8, q[0], q[1], s < S)


# ------------------------------------------------------------------ host side


def _fake_args(kind: str, d: int):
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    sym = cute.sym_int
    b, s, h, sqp = sym(), sym(), sym(), sym()
    x = fake(cutlass.BFloat16, (b, s, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
    y8 = fake(cutlass.Uint8, (b, s, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
    sc = fake(Float32, (b, h), stride_order=(1, 0), assumed_align=4)
    acc = fake(Float32, (b, h, sqp, d), stride_order=(3, 2, 1, 0), assumed_align=16)
    if kind in ("pre", "pre_fp8"):
        lse = fake(Float32, (b, h, s), stride_order=(2, 1, 0), assumed_align=4)
        lse2 = fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=4)
        dsum = fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=4)
        # dO's payload has its own extents: without fp8 a 1-row placeholder is passed
        do8 = fake(cutlass.Uint8, (sym(), sym(), sym(), d), stride_order=(3, 2, 1, 0), assumed_align=16)
        return (x, x, lse, sc, lse2, dsum, acc, do8)
    if kind == "pre_fp8t":
        lse = fake(Float32, (b, h, s), stride_order=(2, 1, 0), assumed_align=4)
        lse2 = fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=4)
        dsum = fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=4)
        amax = fake(Int32, (b, h, sym()), stride_order=(2, 1, 0), assumed_align=4)
        dot = fake(cutlass.Uint8, (b, h, sym(), d, DQ_TILE_M), stride_order=(4, 3, 2, 1, 0), assumed_align=16)
        return (x, x, lse, amax, lse2, dsum, acc, y8, dot, sc)
    if kind == "post":
        return (acc, x, Float32(1.0))
    return (x, sc, y8)  # "quant"


_OPS = {"pre": lambda d: _Pre(d, False), "pre_fp8": lambda d: _Pre(d, True), "pre_fp8t": _PreFp8,
        "post": _Post, "quant": _ScaleQuant}


def _compile(kind: str, d: int, tvm_ffi=None, persist: bool = True):
    """One kernel, compiled for sm_90a (no GPU needed) through the compile cache every target
    uses (``fp4gen.runtime.cache.compiled_kernel``: in memory, a verified disk entry, else a
    compile); ``persist=False`` (compile_only) keeps it in memory. This module's source is in
    the cache key through ``cache.KERNEL_DEPENDENCIES``."""
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"backward pre/post-processing: head dim must be one of {SUPPORTED_HEAD_DIMS}; got {d}")
    tvm_ffi = cache.tvm_ffi_available() if tvm_ffi is None else tvm_ffi
    key = (kind, d, tvm_ffi, persist)
    if key not in _COMPILED:
        def build():
            stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
            opts = f"--gpu-arch {ARCH}" + (" --enable-tvm-ffi" if tvm_ffi else "")
            return cute.compile(_OPS[kind](d), *_fake_args(kind, d), stream, options=opts)

        _COMPILED[key] = cache.compiled_kernel(
            f"bwd_{kind}_d{d}", f"arch={ARCH},tvm_ffi={tvm_ffi}", build, module_source=__name__, persist=persist,
            enable_tvm_ffi=tvm_ffi)
    return _COMPILED[key]


def compile_only(arch: str = ARCH, head_dim: int = 128) -> list:
    """Compile the five kernels for ``head_dim`` without a GPU; return their names."""
    if arch != ARCH:
        raise ValueError(f"the backward pre/post-processing kernels are Hopper kernels: arch must be {ARCH!r}, got {arch!r}")
    names = []
    for kind in ("pre", "pre_fp8", "pre_fp8t", "post", "quant"):
        _compile(kind, head_dim, tvm_ffi=False, persist=False)
        names.append(f"bwd_{kind}_d{head_dim}")
    return names


def _launch(kind: str, d: int, *args):
    launch(lambda tvm_ffi: _compile(kind, d, tvm_ffi), *args)


def preprocess(o, do, lse, sqp: int, scale_do=None):
    """(lse2, dsum, dq_acc[, do8]) for the backward kernel: see the module docstring.
    o, do (B, Sq, H, D) bf16 compact; lse (B, H, Sq) fp32; ``scale_do`` (B, H) fp32 quantizes
    dO to e4m3 (returned as a fourth tensor)."""
    import torch

    B, Sq, H, D = do.shape
    dev = do.device
    lse2 = torch.empty((B, H, sqp), dtype=torch.float32, device=dev)
    dsum = torch.empty((B, H, sqp), dtype=torch.float32, device=dev)
    dq_acc = torch.empty((B, H, sqp, D), dtype=torch.float32, device=dev)
    fp8 = scale_do is not None
    do8 = torch.empty((B, Sq, H, D), dtype=torch.uint8, device=dev) if fp8 else \
        torch.empty((1, 1, 1, D), dtype=torch.uint8, device=dev)
    sc = scale_do.contiguous() if fp8 else torch.ones((B, H), dtype=torch.float32, device=dev)
    _launch("pre_fp8" if fp8 else "pre", D, o, do, lse.contiguous(), sc, lse2, dsum, dq_acc, do8)
    out = (lse2, dsum, dq_acc)
    return out + (do8.view(torch.float8_e4m3fn),) if fp8 else out


def preprocess_fp8(o, do, lse, sqp: int):
    """(lse2, dsum, dq_acc, do8, dot8, scale_do) for the FP8 backward in two passes over dO (its
    block amaxes, then ``_PreFp8``); equal to ``quantize_v_operand(do)`` (with its dO^T in
    64-query tiles: ``dot_tiles``) followed by ``preprocess(o, do, lse, sqp, scale_do)``.
    o, do (B, Sq, H, D) bf16 compact; dot8 (B, H, sqp / 64, D, 64)."""
    import torch

    do = _quantize._prep(do, "do")
    B, Sq, H, D = do.shape
    dev = do.device
    nb = (Sq + BLOCK - 1) // BLOCK
    amax = torch.empty((B, H, nb), dtype=torch.int32, device=dev)
    _quantize._launch("amax", D, do, do, amax)
    lse2 = torch.empty((B, H, sqp), dtype=torch.float32, device=dev)
    dsum = torch.empty((B, H, sqp), dtype=torch.float32, device=dev)
    dq_acc = torch.empty((B, H, sqp, D), dtype=torch.float32, device=dev)
    do8 = torch.empty((B, Sq, H, D), dtype=torch.uint8, device=dev)
    dot8 = torch.empty((B, H, sqp // DQ_TILE_M, D, DQ_TILE_M), dtype=torch.uint8, device=dev)
    scale_do = torch.empty((B, H), dtype=torch.float32, device=dev)
    _launch("pre_fp8t", D, o, do, lse.contiguous(), amax, lse2, dsum, dq_acc, do8, dot8, scale_do)
    e4m3 = torch.float8_e4m3fn
    return lse2, dsum, dq_acc, do8.view(e4m3), dot8.view(e4m3), scale_do


def dot_tiles(xt, sqp: int):
    """A transposed FP8 payload (B, H, D, S padded to 32; ``quantize_v_operand``'s layout) ->
    the backward's dO^T layout (B, H, sqp / 64, D, 64): one contiguous D x 64 block per query
    tile, zero past the payload's end."""
    import torch

    fp8 = xt.dtype == torch.float8_e4m3fn
    x = xt.view(torch.uint8) if fp8 else xt
    B, H, D, s32 = x.shape
    out = torch.zeros((B, H, D, sqp), dtype=x.dtype, device=x.device)
    n = min(s32, sqp)
    out[..., :n] = x[..., :n]
    out = _quantize.tile_tokens(out, DQ_TILE_M)
    return out.view(torch.float8_e4m3fn) if fp8 else out


def dot_untiles(x):
    """Inverse of ``dot_tiles``: (B, H, T, D, 64) -> (B, H, D, 64 T)."""
    return _quantize.untile_tokens(x)


def dq_fragment_index(head_dim: int) -> list:
    """(row, col) of each float of a 64 x head_dim dQ tile in fragment order: the order in which
    the backward's two MMA warpgroups hold dQ = dS K in registers and store it, 16 bytes per
    thread per store. Float f = wg * 32 * head_dim + 512 * c + 4 * t + 2 * r + e belongs to
    warpgroup wg (columns wg * head_dim / 2 ...), thread t = 32 * w4 + lane of it, register
    4c + 2r + e of the m64 wgmma accumulator: row 16 * w4 + lane / 4 + 8r, column
    wg * head_dim / 2 + 8c + 2 (lane % 4) + e."""
    d = head_dim
    out = []
    for wg in range(2):
        for c in range(d // 16):
            for t in range(128):
                w4, lane = divmod(t, 32)
                for r in range(2):
                    for e in range(2):
                        out.append((16 * w4 + lane // 4 + 8 * r, wg * (d // 2) + 8 * c + 2 * (lane % 4) + e))
    return out


def _dq_perm(head_dim: int, device):
    import torch

    idx = dq_fragment_index(head_dim)
    return torch.tensor([r * head_dim + c for r, c in idx], dtype=torch.long, device=device)


def dq_rows_to_fragments(x):
    """(B, H, Sqp, D) row-major -> the same tensor shape in fragment order (per 64-row tile)."""
    B, H, S, D = x.shape
    t = x.reshape(B, H, S // DQ_TILE_M, DQ_TILE_M * D)
    return t[..., _dq_perm(D, x.device)].reshape(B, H, S, D)


def dq_fragments_to_rows(x):
    """Inverse of ``dq_rows_to_fragments``."""
    import torch

    B, H, S, D = x.shape
    t = x.reshape(B, H, S // DQ_TILE_M, DQ_TILE_M * D)
    out = torch.empty_like(t)
    out[..., _dq_perm(D, x.device)] = t
    return out.reshape(B, H, S, D)


def postprocess(dq_acc, sq: int, softmax_scale: float):
    """dQ (B, Sq, H, D) bf16 = bf16(softmax_scale * dq_acc[:, :, :Sq]) from (B, H, Sqp, D) fp32
    in fragment order (``dq_fragment_index``)."""
    import torch

    B, H, _, D = dq_acc.shape
    dq = torch.empty((B, sq, H, D), dtype=torch.bfloat16, device=dq_acc.device)
    _launch("post", D, dq_acc, dq, float(softmax_scale))
    return dq


def quantize_per_head(x, scale):
    """e4m3 payload of x / scale[b, h] (natural layout), x (B, S, H, D) bf16 compact."""
    import torch

    y = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _launch("quant", x.shape[3], x, scale.contiguous(), y)
    return y.view(torch.float8_e4m3fn)


def scale_per_head(x):
    """FP8 scale per (batch, head) of x (B, S, H, D) bf16: amax / 448 as fl32(amax * fl32(1/448)),
    1 where amax == 0 (the fused quantizer's contract, ``fp4gen.device.quantize``)."""
    import torch

    from . import quantize as dquant

    x = dquant._prep(x, "x")
    B, S, H, D = x.shape
    nb = (S + dquant.BLOCK - 1) // dquant.BLOCK
    amax_bits = torch.empty((B, H, nb), dtype=torch.int32, device=x.device)
    dquant._launch("amax", D, x, x, amax_bits)  # bf16 |amax| bit patterns per 128 tokens
    a = (amax_bits.amax(-1) << 16).view(torch.float32)
    return torch.where(a == 0, torch.ones_like(a), a * (1.0 / 448.0))
