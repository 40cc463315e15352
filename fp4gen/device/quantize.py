"""Fused FP8 input quantizer for the Hopper FP8 forward (CuTe DSL).

Produces bit-for-bit what the generated module's torch path ``quantize_inputs(q, k, v)``
produces on CUDA (the Hopper FP8 contract, docs/numerics.md section 4):

- Q, K (B, S, H, D) bf16 -> e4m3 payload (B, S, H, D) + fp32 scale (B, H, ceil(S/128)),
  one scale per (batch, head, 128-token block).
- V (B, S, Hkv, D) bf16 -> V^T (B, Hkv, D, Skp) e4m3, Skp = S rounded up to 32, keys
  permuted inside every 32-key group by ``layout.FP8_P_KEY_PERM`` (padded keys are byte 0)
  + fp32 scale (B, Hkv), one per (batch, head).
- For the FP8 backward, optionally, Q's or K's payload also transposed (``TRANSPOSED_TILES``):
  (B, H, tiles, D, tokens), one contiguous D x tokens block per tile, tokens permuted per 32
  (Q^T: 64-token tiles, ``FP8_P_KEY_PERM``; K^T: 128-token tiles, ``FP8_DS_KEY_PERM``).

Arithmetic (the same fp32 operations, in the same order, as the torch code on CUDA):

- amax = max |x| over the group. Computed on the bf16 bit patterns with the sign cleared
  (unsigned order of |bf16| bits = order of the values), so a NaN (bits > +Inf's) wins,
  as torch's ``amax`` propagates NaN.
- scale = 1 if amax == 0 else fl32(amax * fl32(1/448)). NOT amax / 448: torch on CUDA
  evaluates ``tensor / python_float`` as a multiplication by the fp32 reciprocal
  (``div_true_kernel_cuda``, CPU-scalar divisor); for about half of all bf16 amax values
  that is one ulp away from the true quotient. ``SCALE_BY_RECIPROCAL`` documents the
  choice; the torch CPU path divides and can differ by that ulp.
- payload = e4m3_rne_satfinite(fl32(x / scale)) with an IEEE division (div.rn.f32, no
  flush to zero), as torch divides two CUDA tensors. NaN -> 0x7F (sign cleared, as the
  oracle's ``encode``), +-Inf -> +-448 (never reached: Inf in a group makes the scale Inf).

Special inputs, consequently: a group holding a NaN gets scale NaN and an all-0x7F
payload; a group holding +-Inf gets scale Inf, finite elements become +-0 (0x00 / 0x80)
and the Infs NaN (0x7F); an all-zero group gets scale 1 and zero payload (-0.0 -> 0x80);
bf16 subnormals are kept (scales may be fp32 subnormals).

Inputs are read where they lie: any (batch, token, head) strides that are multiples of 16 bytes,
rows contiguous (``strided_view``; the q, k, v views of a fused QKV projection), so a caller never
copies them first; the outputs are compact. Other layouts are copied once (``_prep``).

Kernels (all memory bound; one CTA of 256 threads per 128 tokens of one (batch, head)):

1. ``_BlockQuant``: Q or K. Loads its 128 x D tile once into registers (16-byte loads),
   reduces amax (warp shuffles + shared memory), writes the scale and the payload; with a
   transposed copy (``with_transposed``), also stages the quantized tile in shared memory and
   writes it transposed (``store_transposed_tile``, shared with ``bwd_prep._PreFp8``).
2. ``_BlockQuant(amax_only)``: the same pass over V, writing only the 128-token amax
   bit patterns (B, Hkv, nb) int32: no atomics, no zero-fill, deterministic.
3. ``_VTranspose``: each CTA reduces V's nb partial amaxes of its (batch, head) into the
   per-head scale, quantizes 128 keys x D in registers, transposes through shared memory
   (gathering the permuted key order) and writes 32-byte runs of V^T.
"""
from __future__ import annotations

import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from fp4gen.runtime.cache import tvm_ffi_available

from . import ptx
from .ptx import _asm, _i32_struct, _words
from .layout import FP8_DS_KEY_PERM, FP8_P_KEY_PERM

BLOCK = 128  # tokens per Q/K scale and keys per V^T tile (numerics contract)
THREADS = 256
E4M3_MAX = 448.0
SCALE_BY_RECIPROCAL = True  # see the module docstring: torch-on-CUDA semantics of amax / 448.0
_R448_BITS = struct.unpack("<I", struct.pack("<f", 1.0 / E4M3_MAX))[0]  # fl32(1/448) = 0x3B124925
_448_BITS = struct.unpack("<I", struct.pack("<f", E4M3_MAX))[0]
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
# The transposed copies of Q and K that the FP8 backward reads (K-major B operands of its FP8
# wgmma), by operand: (tokens per tile, order of the tokens inside every 32, ``layout``). Each
# tile is one contiguous (D, tokens) block of a (B, H, tiles, D, tokens) tensor, tokens past S
# are byte 0. "q": Q^T for dK = dS^T Q, in 64-query tiles and P's FP8 order, the layout of the
# backward's dO^T (``bwd_prep.dot_tiles``); "k": K^T for dQ = dS K, one tile per 128-key
# block, in the key order of FP8 dS's transposed stmatrix stores.
TRANSPOSED_TILES = {"q": (64, FP8_P_KEY_PERM), "k": (BLOCK, FP8_DS_KEY_PERM)}


# ------------------------------------------------------------------ PTX wrappers


@dsl_user_op
def ld_v4_pred(addr, pred, *, loc=None, ip=None):
    """16 bytes from global memory (read-only path) if ``pred`` != 0, else four zero words."""
    res = _asm(
        _i32_struct(4),
        "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n"
        "mov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
        "@p ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];\n}",
        "=r,=r,=r,=r,l,r", [Int64(addr), Int32(pred)], side_effects=True, loc=loc, ip=ip)
    return _words(res, 4, loc, ip)


@dsl_user_op
def st_v2_pred(addr, a, b, pred, *, loc=None, ip=None):
    """8 bytes to global memory if ``pred`` != 0."""
    _asm(None, "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.v2.b32 [$0], {$1, $2};\n}",
         "l,r,r,r", [Int64(addr), Uint32(a), Uint32(b), Int32(pred)], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_v4(addr, a, b, c, d, *, loc=None, ip=None):
    """16 bytes to global memory."""
    _asm(None, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
         [Int64(addr), Uint32(a), Uint32(b), Uint32(c), Uint32(d)], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def absmax_bf16x2(acc, w, *, loc=None, ip=None) -> Uint32:
    """Per 16-bit lane: max(acc, |w| bits) (sign cleared; unsigned compare keeps NaN on top)."""
    return Uint32(_asm(
        T.i32(), "{\n.reg .b32 t;\nand.b32 t, $2, 0x7fff7fff;\nmax.u16x2 $0, $1, t;\n}",
        "=r,r,r", [Uint32(acc), Uint32(w)], loc=loc, ip=ip))


@dsl_user_op
def umax(a, b, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), "max.u32 $0, $1, $2;", "=r,r,r", [Uint32(a), Uint32(b)], loc=loc, ip=ip))


def chunk_of_thread(tidx, d: int):
    """(token row in the pass, 16-byte chunk of the row) of thread ``tidx`` when a row of ``d``
    bf16 is split over d / 8 threads: the map of every row-wise kernel here and in ``bwd_prep``."""
    vpr = d // 8
    return tidx // vpr, tidx % vpr


def load_rows(bases, d: int, S, H, batch, head, first, rows_per_pass: int, iters: int, row, col,
              absmax: bool = False, strides=None):
    """This thread's chunk of ``iters`` token rows (``first`` + it * ``rows_per_pass`` + ``row``)
    of one (batch, head) of (B, S, H, d) bf16 tensors at base addresses ``bases``: one
    (iters * 4,) Uint32 register tensor per base, zeros past S, every load issued before any
    use. ``absmax``: also returns max |x| over the first tensor's words as two 16-bit lanes
    (``absmax_bf16x2``), folded in as the words arrive. ``strides``: the (batch, token, head)
    strides in elements of every tensor at ``bases`` (each a multiple of 8: 16-byte loads), for
    views such as a fused QKV projection's; None: compact tensors. A trace-time helper (it inlines)."""
    vals = [cute.make_rmem_tensor((iters * 4,), Uint32) for _ in bases]
    m = Uint32(0)
    if strides is not None:
        sb, ss, sh = strides
        head_off = (Int64(batch) * sb + Int64(head) * sh) * 2 + col * 16  # bytes to this (batch, head) chunk
    for it in range(iters):
        s = first + it * rows_per_pass + row
        if strides is None:
            tok = (Int64(batch) * S + s) * H + head  # token row index in (B, S, H)
            ws = [ld_v4_pred(b + tok * (d * 2) + col * 16, s < S) for b in bases]
        else:
            ws = [ld_v4_pred(b + head_off + Int64(s) * ss * 2, s < S) for b in bases]
        for j in range(4):
            for v, w in zip(vals, ws):
                v[it * 4 + j] = w[j]
            if absmax:
                m = absmax_bf16x2(m, ws[0][j])
    return (vals, m) if absmax else vals


def input_strides(mX):
    """The (batch, token, head) strides in elements of a (B, S, H, D) input tensor: the quantizer
    reads its input where it lies (``strided_view``), only its outputs are compact."""
    return mX.stride[0], mX.stride[1], mX.stride[2]


@dsl_user_op
def scale_from_amax_bits(bits, *, loc=None, ip=None) -> Float32:
    """bf16 |amax| bit pattern (low 16 bits) -> scale: 1 if 0, else fl32(amax * fl32(1/448))
    (or the IEEE quotient amax / 448 without SCALE_BY_RECIPROCAL). No flush to zero."""
    if SCALE_BY_RECIPROCAL:
        op = f"mul.rn.f32 s, a, 0f{_R448_BITS:08X};"
    else:
        op = f"div.rn.f32 s, a, 0f{_448_BITS:08X};"
    return Float32(_asm(
        T.f32(),
        "{\n.reg .b32 ab;\n.reg .f32 a, s;\n.reg .pred z;\nshl.b32 ab, $1, 16;\nmov.b32 a, ab;\n"
        + op + "\nsetp.eq.b32 z, ab, 0;\nselp.f32 $0, 0f3F800000, s, z;\n}",
        "=f,r", [Uint32(bits)], loc=loc, ip=ip))


# 4 bf16 (2 words) -> 4 e4m3 (1 word): IEEE division by the scale, RNE saturating cvt, then
# any 0xFF byte (a NaN with the sign set) becomes 0x7F, the oracle's NaN code.
_Q4 = (
    ".reg .b32 b0, b1, b2, b3;\n.reg .f32 x0, x1, x2, x3;\n.reg .b16 h0, h1;\n.reg .b32 o, t, y;\n"
    "shl.b32 b0, {w0}, 16;\nand.b32 b1, {w0}, 0xffff0000;\n"
    "shl.b32 b2, {w1}, 16;\nand.b32 b3, {w1}, 0xffff0000;\n"
    "mov.b32 x0, b0;\nmov.b32 x1, b1;\nmov.b32 x2, b2;\nmov.b32 x3, b3;\n"
    "div.rn.f32 x0, x0, {s};\ndiv.rn.f32 x1, x1, {s};\n"
    "div.rn.f32 x2, x2, {s};\ndiv.rn.f32 x3, x3, {s};\n"
    "cvt.rn.satfinite.e4m3x2.f32 h0, x1, x0;\ncvt.rn.satfinite.e4m3x2.f32 h1, x3, x2;\n"
    "mov.b32 o, {{h0, h1}};\n"
    # zero-byte test on ~o: bit 7 of byte i of y is clear iff byte i of o is 0xFF
    "not.b32 t, o;\nand.b32 y, t, 0x7f7f7f7f;\nadd.u32 y, y, 0x7f7f7f7f;\n"
    "or.b32 y, y, t;\nor.b32 y, y, 0x7f7f7f7f;\nnot.b32 y, y;\nxor.b32 {out}, o, y;\n"
)


@dsl_user_op
def quant8(w0, w1, w2, w3, scale, *, loc=None, ip=None):
    """8 bf16 (4 words, element 0 in the low half of w0) -> 8 e4m3 bytes (2 words)."""
    body = ("{\n" + _Q4.format(w0="$2", w1="$3", s="$6", out="$0") + "}\n{\n"
            + _Q4.format(w0="$4", w1="$5", s="$6", out="$1") + "}")
    res = _asm(_i32_struct(2), body, "=r,=r,r,r,r,r,f",
               [Uint32(w0), Uint32(w1), Uint32(w2), Uint32(w3), Float32(scale)], loc=loc, ip=ip)
    return _words(res, 2, loc, ip)


@dsl_user_op
def keep_if(x, pred, *, loc=None, ip=None) -> Uint32:
    """x if ``pred`` != 0 else 0."""
    return Uint32(_asm(T.i32(), "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\nselp.b32 $0, $1, 0, p;\n}",
                       "=r,r,r", [Uint32(x), Int32(pred)], loc=loc, ip=ip))


@cute.jit
def transpose_tile_setup(rows: cutlass.Constexpr, d: cutlass.Constexpr):
    """The start of a kernel that quantizes a tile of ``rows`` tokens and writes it transposed
    (``_VTranspose``, ``bwd_prep._PreFp8``): its (tile, head, batch), walked in the reverse of
    the amax pass's launch order (the first CTAs read what that pass touched last, which may
    still be in L2), the SMEM words ``_block_max`` reduces through, and the quantized tile,
    (token, d) with d contiguous, as words and as bytes."""
    bx, by, bz = cute.arch.block_idx()
    gx, gy, gz = cute.arch.grid_dim()
    smem = SmemAllocator()
    red = smem.allocate_tensor(Uint32, cute.make_layout(THREADS // 32), byte_alignment=16)
    s_words = smem.allocate_tensor(Uint32, cute.make_layout(rows * d // 4), byte_alignment=16)
    return gx - 1 - bx, gy - 1 - by, gz - 1 - bz, red, s_words, cute.recast_tensor(s_words, cutlass.Uint8)


@cute.jit
def store_transposed_tile(s_bytes: cute.Tensor, mT: cute.Tensor, tile, d: cutlass.Constexpr, batch, head, H, tidx,
                          tokens: cutlass.Constexpr, perm: cutlass.Constexpr):
    """A CTA's quantized tile, ``tokens`` tokens x ``d`` bytes in SMEM (token-major, d contiguous,
    from ``s_bytes``' start), written to ``mT`` (B, H, tiles, d, tokens) as its transpose, one
    contiguous d x ``tokens`` block per tile, with the tokens permuted inside every 32 by
    ``perm`` (position p of a group holds its token perm[p]: the register order of the FP8 MMA
    that reads it, ``layout``). One block per tile because a consumer loads exactly that block
    per tile, and the CTA's writes then land in one run instead of d rows a sequence apart.
    One job = 32 consecutive output bytes of one d row: lanes take consecutive d, so the byte
    gathers of a warp hit 32 consecutive bytes of one token row (no bank conflicts)."""
    jobs = (tokens // 32) * d
    base = mT.iterator.toint() + ((Int64(batch) * H + head) * mT.shape[2] + tile) * (d * tokens)
    for i in cutlass.range_constexpr((jobs + THREADS - 1) // THREADS):
        j = tidx + i * THREADS
        dd = j % d
        g = j // d
        if j < jobs:
            out = []
            for p4 in cutlass.range_constexpr(8):
                b = [Uint32(s_bytes[(g * 32 + perm[4 * p4 + e]) * d + dd]) for e in range(4)]
                out.append(ptx.pack_low_bytes4(b[0], b[1], b[2], b[3]))
            addr = base + dd * tokens + g * 32
            st_v4(addr, out[0], out[1], out[2], out[3])
            st_v4(addr + 16, out[4], out[5], out[6], out[7])


@cute.jit
def _block_max(m: Uint32, red: cute.Tensor, tidx: Int32) -> Uint32:
    """Max of ``m`` over the CTA (THREADS threads); ``red`` holds THREADS // 32 words."""
    for off in cutlass.range_constexpr(5):
        m = umax(m, cute.arch.shuffle_sync_bfly(m, offset=16 >> off))
    if tidx % 32 == 0:
        red[tidx // 32] = m
    cute.arch.sync_threads()
    out = red[0]
    for w in cutlass.range_constexpr(1, THREADS // 32):
        out = umax(out, red[w])
    return out


# ------------------------------------------------------------------ kernels


class _BlockQuant:
    """Q/K: per (batch, head, 128-token block) scale + payload; or (``amax_only``) the
    block amax bit patterns only (V's first pass). With ``transposed`` ("q" or "k"), the
    ``with_transposed`` entry point also writes the block's payload transposed, in the FP8
    backward's layout of that operand (``TRANSPOSED_TILES``), from the same read of the input:
    the 128 quantized tokens are staged in SMEM, then written by ``store_transposed_tile``."""

    def __init__(self, head_dim: int, amax_only: bool, transposed: str | None = None):
        if transposed is not None and (amax_only or transposed not in TRANSPOSED_TILES):
            raise ValueError(f"_BlockQuant: transposed must be one of {sorted(TRANSPOSED_TILES)} "
                             f"(and needs a payload); got {transposed!r} with amax_only={amax_only}")
        self.d = head_dim
        self.amax_only = amax_only
        self.transposed = transposed
        self.vpr = head_dim // 8  # 16-byte vectors per token row
        self.rpi = THREADS // self.vpr  # token rows per pass of the CTA
        self.iters = BLOCK // self.rpi

    @staticmethod
    def _grid(mX: cute.Tensor, mS: cute.Tensor):
        return (cute.size(mS.shape[2]), cute.size(mX.shape[2]), cute.size(mX.shape[0]))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mS: cute.Tensor, stream):
        # mX (B, S, H, D) bf16; mY (B, S, H, D) uint8 (e4m3 bits; unused if amax_only);
        # mS (B, H, nb): fp32 scales, or int32 amax bits if amax_only
        # min_blocks_per_mp=1: as with_transposed's (below); with strided loads the payload kernel
        # spills 12 B at ptxas's unbounded choice of 64 registers (D 128), none with the bound (72)
        self.kernel(mX, mY, mS, None).launch(grid=self._grid(mX, mS), block=[THREADS, 1, 1], stream=stream,
                                             min_blocks_per_mp=1)

    @cute.jit
    def with_transposed(self, mX: cute.Tensor, mY: cute.Tensor, mS: cute.Tensor, mYt: cute.Tensor, stream):
        # as __call__, plus mYt (B, H, nb * 128 / tokens, D, tokens) uint8, tokens and their
        # order per 32 from TRANSPOSED_TILES[self.transposed].
        # min_blocks_per_mp=1 (.minnctapersm 1): without a launch bound ptxas 13.5 fits this
        # kernel (D 128) into 64 registers, 4 CTAs per SM, and spills 8 B (the register gate of
        # fp4gen verify allows none); with it, 80 registers and no spill: 3 CTAs per SM, whose
        # 3 x 32 KB of tile loads in flight still exceed the ~40 KB per SM that HBM's bandwidth
        # x latency asks. Same arithmetic.
        self.kernel(mX, mY, mS, mYt).launch(grid=self._grid(mX, mS), block=[THREADS, 1, 1], stream=stream,
                                            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, mS: cute.Tensor, mYt):
        tidx, _, _ = cute.arch.thread_idx()
        blk, head, batch = cute.arch.block_idx()
        smem = SmemAllocator()
        red = smem.allocate_tensor(Uint32, cute.make_layout(THREADS // 32), byte_alignment=16)
        staged = mYt is not None  # the block's quantized tokens go through SMEM for mYt
        if cutlass.const_expr(staged):
            s_words = smem.allocate_tensor(Uint32, cute.make_layout(BLOCK * self.d // 4), byte_alignment=16)

        S = mX.shape[1]
        H = mX.shape[2]
        row, col = chunk_of_thread(tidx, self.d)
        (vals,), m = load_rows([mX.iterator.toint()], self.d, S, H, batch, head, blk * BLOCK, self.rpi, self.iters,
                               row, col, absmax=True, strides=input_strides(mX))
        m = umax(m & Uint32(0xFFFF), m >> Uint32(16))
        amax = _block_max(m, red, tidx)

        if cutlass.const_expr(self.amax_only):
            if tidx == 0:
                mS[batch, head, blk] = Int32(amax)
        else:
            scale = scale_from_amax_bits(amax)
            if tidx == 0:
                mS[batch, head, blk] = scale
            y_base = mY.iterator.toint()
            for it in cutlass.range_constexpr(self.iters):
                s = blk * BLOCK + it * self.rpi + row
                tok = (Int64(batch) * S + s) * H + head
                q = quant8(vals[it * 4], vals[it * 4 + 1], vals[it * 4 + 2], vals[it * 4 + 3], scale)
                st_v2_pred(y_base + tok * self.d + col * 8, q[0], q[1], s < S)
                if cutlass.const_expr(staged):
                    # tokens past S are padding of the transposed copy: byte 0 whatever the scale
                    r = it * self.rpi + row
                    s_words[r * (self.d // 4) + col * 2] = keep_if(q[0], s < S)
                    s_words[r * (self.d // 4) + col * 2 + 1] = keep_if(q[1], s < S)
            if cutlass.const_expr(staged):
                cute.arch.sync_threads()
                s_bytes = cute.recast_tensor(s_words, cutlass.Uint8)
                tokens, perm = TRANSPOSED_TILES[self.transposed]
                per_block = BLOCK // tokens  # output tiles per 128-token block
                for t in cutlass.range_constexpr(per_block):
                    tile_bytes = cute.make_tensor(s_bytes.iterator + t * tokens * self.d,
                                                  cute.make_layout(tokens * self.d))
                    store_transposed_tile(tile_bytes, mYt, blk * per_block + t, self.d, batch, head, H, tidx,
                                          tokens, perm)


class _VTranspose:
    """V: per-(batch, head) scale from the block amaxes, e4m3 payload written as V^T with
    permuted keys (the FP8 PV operand). With ``natural``, the payload is also written in V's
    own layout (the FP8 operand of the backward's dP^T = V dO^T), so that a training step
    reads V once for both (a separate pass costs 54 us at 32k tokens x 16 heads, H200)."""

    def __init__(self, head_dim: int, natural: bool = False):
        self.d = head_dim
        self.natural = natural
        self.vpr = head_dim // 8
        self.rpi = THREADS // self.vpr
        self.iters = BLOCK // self.rpi
        self.jobs = (BLOCK // 32) * head_dim  # (d, 32-key group) output runs per tile

    @cute.jit
    def __call__(self, mX: cute.Tensor, mA: cute.Tensor, mVt: cute.Tensor, mS: cute.Tensor, mV8: cute.Tensor,
                 stream):
        # mX (B, S, H, D) bf16; mA (B, H, nb) int32 block amax bits; mVt (B, H, D, Skp) uint8;
        # mS (B, H) fp32; mV8 (B, S, H, D) uint8 with ``natural`` (else unused)
        grid = (cute.ceil_div(cute.size(mVt.shape[3]), BLOCK), cute.size(mX.shape[2]), cute.size(mX.shape[0]))
        self.kernel(mX, mA, mVt, mS, mV8).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mA: cute.Tensor, mVt: cute.Tensor, mS: cute.Tensor, mV8: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, batch, red, s_words, s_bytes = transpose_tile_setup(BLOCK, self.d)

        S = mX.shape[1]
        H = mX.shape[2]
        nb = mA.shape[2]
        skp = mVt.shape[3]

        # issue the tile's loads first; the scale reduction runs while they are in flight
        row, col = chunk_of_thread(tidx, self.d)
        (vals,) = load_rows([mX.iterator.toint()], self.d, S, H, batch, head, tile * BLOCK, self.rpi, self.iters,
                            row, col, strides=input_strides(mX))

        m = Uint32(0)
        for i in cutlass.range(tidx, nb, THREADS, unroll=1):
            m = umax(m, Uint32(mA[batch, head, i]))
        amax = _block_max(m, red, tidx)
        scale = scale_from_amax_bits(amax)
        if tile == 0 and tidx == 0:
            mS[batch, head] = scale

        for it in cutlass.range_constexpr(self.iters):
            r = it * self.rpi + row
            q = quant8(vals[it * 4], vals[it * 4 + 1], vals[it * 4 + 2], vals[it * 4 + 3], scale)
            # keys past S are padding: byte 0, whatever the scale (the torch path zero-fills)
            keep = tile * BLOCK + r < S
            if cutlass.const_expr(self.natural):
                tok = (Int64(batch) * S + tile * BLOCK + r) * H + head
                st_v2_pred(mV8.iterator.toint() + tok * self.d + col * 8, q[0], q[1], keep)
            s_words[r * (self.d // 4) + col * 2] = keep_if(q[0], keep)
            s_words[r * (self.d // 4) + col * 2 + 1] = keep_if(q[1], keep)
        cute.arch.sync_threads()

        # one job = 32 consecutive output bytes of one d row: lanes take consecutive d, so the
        # byte gathers of a warp hit 32 consecutive bytes of one key row (no bank conflicts)
        vt_base = mVt.iterator.toint()
        for i in cutlass.range_constexpr((self.jobs + THREADS - 1) // THREADS):
            j = tidx + i * THREADS
            d = j % self.d
            g = j // self.d
            key0 = tile * BLOCK + g * 32
            if j < self.jobs:
                if key0 < skp:
                    out = []
                    for p4 in cutlass.range_constexpr(8):
                        b = [Uint32(s_bytes[(g * 32 + FP8_P_KEY_PERM[4 * p4 + e]) * self.d + d])
                             for e in range(4)]
                        out.append(ptx.pack_low_bytes4(b[0], b[1], b[2], b[3]))
                    addr = vt_base + ((Int64(batch) * H + head) * self.d + d) * skp + key0
                    st_v4(addr, out[0], out[1], out[2], out[3])
                    st_v4(addr + 16, out[4], out[5], out[6], out[7])


# ------------------------------------------------------------------ host side

_COMPILED: dict = {}
# compile kinds of _BlockQuant with a transposed copy, by operand ("block_qt": Q^T, "block_kt": K^T)
_BLOCK_T_OPERAND = {f"block_{op}t": op for op in TRANSPOSED_TILES}
_BLOCK_T_KINDS = tuple(_BLOCK_T_OPERAND)
_KINDS = ("block", "amax", "vt", "vt_nat") + _BLOCK_T_KINDS


def _check_head_dim(d: int):
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"fused FP8 quantizer: head dim must be one of {SUPPORTED_HEAD_DIMS}; got {d}")


def _fake_args(kind: str, d: int):
    from cutlass.cute.runtime import make_fake_compact_tensor as fake
    from cutlass.cute.runtime import make_fake_tensor

    sym = cute.sym_int
    b, s, h, nb = sym(), sym(), sym(), sym()
    # the input as it lies (``strided_view``): any (batch, token, head) strides of 16 bytes' multiples
    x = make_fake_tensor(cutlass.BFloat16, (b, s, h, d), tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,),
                         assumed_align=16)
    if kind in ("block",) + _BLOCK_T_KINDS:
        y = fake(cutlass.Uint8, (b, s, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
        sc = fake(Float32, (b, h, nb), stride_order=(2, 1, 0), assumed_align=4)
        if kind == "block":
            return (x, y, sc)
        tokens = TRANSPOSED_TILES[_BLOCK_T_OPERAND[kind]][0]
        yt = fake(cutlass.Uint8, (b, h, sym(), d, tokens), stride_order=(4, 3, 2, 1, 0), assumed_align=16)
        return (x, y, sc, yt)
    amax = fake(Int32, (b, h, nb), stride_order=(2, 1, 0), assumed_align=4)
    if kind == "amax":
        return (x, x, amax)
    skp = sym(divisibility=32)
    vt = fake(cutlass.Uint8, (b, h, d, skp), stride_order=(3, 2, 1, 0), assumed_align=16)
    sv = fake(Float32, (b, h), stride_order=(1, 0), assumed_align=4)
    # V's natural payload: its own extents, as "vt" is passed a one-row placeholder
    v8 = fake(cutlass.Uint8, (sym(), sym(), sym(), d), stride_order=(3, 2, 1, 0), assumed_align=16)
    return (x, amax, vt, sv, v8)


def compile_once(cache: dict, key, make_op, fake_args, tvm_ffi):
    """``cache[key]``, compiled on first use from ``make_op()`` and ``fake_args()`` for sm_90a
    (no GPU needed) with the given calling convention. Shared by the helper kernels (this
    quantizer, ``bwd_prep``)."""
    if key not in cache:
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
        opts = "--gpu-arch sm_90a" + (" --enable-tvm-ffi" if tvm_ffi else "")
        cache[key] = cute.compile(make_op(), *fake_args(), stream, options=opts)
    return cache[key]


def _compile(kind: str, d: int, tvm_ffi=None):
    """Compile one kernel once per process (per head dim and calling convention)."""
    _check_head_dim(d)
    tvm_ffi = tvm_ffi_available() if tvm_ffi is None else tvm_ffi
    return compile_once(_COMPILED, (kind, d, tvm_ffi), lambda: _make_op(kind, d), lambda: _fake_args(kind, d),
                        tvm_ffi)


def _make_op(kind: str, d: int):
    """The kernel entry point of one compile kind (only built on a cache miss of ``_compile``)."""
    if kind in _BLOCK_T_OPERAND:
        return _BlockQuant(d, False, transposed=_BLOCK_T_OPERAND[kind]).with_transposed
    return {"block": lambda: _BlockQuant(d, False), "amax": lambda: _BlockQuant(d, True),
            "vt": lambda: _VTranspose(d), "vt_nat": lambda: _VTranspose(d, natural=True)}[kind]()


def compile_only(arch: str = "sm_90a", head_dim: int = 128) -> list:
    """Compile the quantizer kernels (``_KINDS``) for ``head_dim`` without a GPU; return their names."""
    if arch != "sm_90a":
        raise ValueError(f"the fused FP8 quantizer is a Hopper kernel: arch must be 'sm_90a', got {arch!r}")
    names = []
    for kind in _KINDS:
        _compile(kind, head_dim, tvm_ffi=False)
        names.append(f"fp8_quantize_{kind}_d{head_dim}")
    return names


def launch(compile_for, *args):
    """Run a kernel on torch tensors (and Python floats, passed as Float32) on the current
    stream. ``compile_for(tvm_ffi)`` returns the compiled kernel for that calling convention.
    Shared by the device-side helper kernels (this quantizer, ``bwd_prep``)."""
    import torch

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    with torch.cuda.device(tensors[0].device):
        tvm_ffi = tvm_ffi_available()
        kern = compile_for(tvm_ffi)
        if tvm_ffi:
            kern(*args)
            return
        import cuda.bindings.driver as cuda
        from cutlass.cute.runtime import from_dlpack

        def conv(a):
            if not isinstance(a, torch.Tensor):
                return Float32(a)
            ct = from_dlpack(a, assumed_align=4 if a.element_size() == 4 and a.dim() < 4 else 16)
            return ct.mark_layout_dynamic(leading_dim=a.dim() - 1)

        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        kern(*[conv(a) for a in args], stream)


def _launch(kind: str, d: int, *tensors):
    launch(lambda tvm_ffi: _compile(kind, d, tvm_ffi), *tensors)


def strided_view(x):
    """``x`` (B, S, H, D) as the quantizer kernels can read it in place, or None if they cannot:
    rows contiguous (stride 1 along D), a 16-byte aligned base and (batch, token, head) strides
    that are multiples of 8 elements (16-byte loads). The q, k, v views of a fused QKV projection
    qualify. Dims of size 1 get stride 0 (never used to form an address; the compiled kernel
    checks every stride's divisibility). A view of ``x``, never a copy."""
    if x.stride(3) != 1 or x.data_ptr() % 16:
        return None
    st = list(x.stride())
    for i in range(3):
        if x.shape[i] == 1:
            st[i] = 0
        elif st[i] % 8:
            return None
    return x if st == list(x.stride()) else x.as_strided(x.shape, st, x.storage_offset())


def _prep(x, what: str, strided: bool = False):
    """``x`` checked, as the kernels take it: compact (row-major, size-1 dims included) with a
    16-byte aligned base; ``strided``: in place where ``strided_view`` allows (the Q/K/V kernels
    read any 16-byte strides; ``bwd_prep``'s kernels, which call this too, read compact rows only).
    Anything else is copied once."""
    import torch

    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"fused FP8 quantizer: {what} must be a 4-d (B, S, H, D) tensor; got "
                         f"{type(x).__name__ if not isinstance(x, torch.Tensor) else tuple(x.shape)}")
    if x.dtype != torch.bfloat16 or not x.is_cuda:
        raise ValueError(f"fused FP8 quantizer: {what} must be a CUDA bfloat16 tensor; got {x.dtype} on {x.device}")
    _check_head_dim(x.shape[3])
    if x.numel() == 0:
        raise ValueError(f"fused FP8 quantizer: {what} must be non-empty; got shape {tuple(x.shape)}")
    B, S, H, D = x.shape
    if strided:
        view = strided_view(x)
        if view is not None:
            return view
    if tuple(x.stride()) != (S * H * D, H * D, D, 1) or x.data_ptr() % 16:
        x = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device).copy_(x)
    return x


def transposed_shape(shape, transposed: str) -> tuple:
    """The shape of the transposed copy of a (B, S, H, D) payload (``TRANSPOSED_TILES``):
    (B, H, tiles, D, tokens), the ceil(S/128) blocks of 128 tokens cut into tiles of tokens."""
    B, S, H, D = shape
    tokens = TRANSPOSED_TILES[transposed][0]
    return (B, H, (S + BLOCK - 1) // BLOCK * BLOCK // tokens, D, tokens)


def quantize_blockwise(x, transposed: str | None = None):
    """(B, S, H, D) bf16 CUDA -> (e4m3 payload (B, S, H, D), fp32 scale (B, H, ceil(S/128))).

    ``transposed`` ("q" or "k"): a third tensor, the same codes transposed for the FP8 backward,
    written by the same pass: (B, H, tiles, D, tokens) e4m3 with (tokens, order per 32) =
    ``TRANSPOSED_TILES[transposed]``, tiles = ceil(S/128) * 128 / tokens, tokens past S zero;
    ``transposed_operand(payload, transposed)`` is its torch reference."""
    import torch

    if transposed is not None and transposed not in TRANSPOSED_TILES:
        raise ValueError(f"quantize_blockwise: transposed must be None or one of {sorted(TRANSPOSED_TILES)}; "
                         f"got {transposed!r}")
    x = _prep(x, "x", strided=True)
    B, S, H, D = x.shape
    nb = (S + BLOCK - 1) // BLOCK
    y = torch.empty((B, S, H, D), dtype=torch.uint8, device=x.device)
    sc = torch.empty((B, H, nb), dtype=torch.float32, device=x.device)
    if transposed is None:
        _launch("block", D, x, y, sc)
        return y.view(torch.float8_e4m3fn), sc
    yt = torch.empty(transposed_shape(x.shape, transposed), dtype=torch.uint8, device=x.device)
    _launch(f"block_{transposed}t", D, x, y, sc, yt)
    return y.view(torch.float8_e4m3fn), sc, yt.view(torch.float8_e4m3fn)


def quantize_v_operand(v, natural: bool = False):
    """(B, S, Hkv, D) bf16 CUDA -> (V^T e4m3 (B, Hkv, D, Skp) with keys permuted per 32,
    fp32 scale (B, Hkv)); with ``natural``, a third tensor: the same codes in V's own
    (B, S, Hkv, D) layout, for the FP8 backward."""
    import torch

    v = _prep(v, "v", strided=True)
    B, S, H, D = v.shape
    nb = (S + BLOCK - 1) // BLOCK
    skp = (S + 31) // 32 * 32
    amax = torch.empty((B, H, nb), dtype=torch.int32, device=v.device)
    _launch("amax", D, v, v, amax)
    vt = torch.empty((B, H, D, skp), dtype=torch.uint8, device=v.device)
    sv = torch.empty((B, H), dtype=torch.float32, device=v.device)
    v8 = torch.empty((B, S, H, D) if natural else (1, 1, 1, D), dtype=torch.uint8, device=v.device)
    _launch("vt_nat" if natural else "vt", D, v, amax, vt, sv, v8)
    out = (vt.view(torch.float8_e4m3fn), sv)
    return out + (v8.view(torch.float8_e4m3fn),) if natural else out


def quantize_inputs(q, k, v, for_backward: bool = False, transposed_qk: bool = False):
    """bf16 q, k, v -> (q8, k8, vt8, scale_q, scale_k, scale_v), the Hopper FP8 operands;
    ``for_backward`` appends v8, V's payload in its own layout (the FP8 backward's dP operand);
    ``transposed_qk`` (with ``for_backward``) then appends qt8 and kt8, Q's and K's payloads
    transposed for the FP8 backward's dK = dS^T Q and dQ = dS K (``quantize_blockwise``'s
    ``transposed`` "q" and "k"), written by the passes that write q8 and k8."""
    if transposed_qk and not for_backward:
        raise ValueError("quantize_inputs: transposed_qk=True adds the FP8 backward's Q^T and K^T "
                         "and needs for_backward=True")
    qs = quantize_blockwise(q, "q" if transposed_qk else None)
    ks = quantize_blockwise(k, "k" if transposed_qk else None)
    vt = quantize_v_operand(v, natural=for_backward)
    return (qs[0], ks[0], vt[0], qs[1], ks[1], vt[1]) + tuple(vt[2:]) + tuple(qs[2:]) + tuple(ks[2:])


# ------------------------------------------------------------------ torch references (CPU or CUDA)


def _group_order(n: int, perm, device):
    """Index of the token at each of ``n`` positions: position 32g + p holds token 32g + perm[p]."""
    import torch

    perm = torch.tensor(perm, dtype=torch.long, device=device)
    return (torch.arange(n // 32, device=device)[:, None] * 32 + perm[None, :]).reshape(-1)


def tile_tokens(xt, tokens: int):
    """(B, H, D, n) -> (B, H, n / tokens, D, tokens): the token axis cut into tiles, each tile one
    contiguous (D, tokens) block (the layout of the backward's transposed operands)."""
    B, H, D, n = xt.shape
    return xt.reshape(B, H, D, n // tokens, tokens).permute(0, 1, 3, 2, 4).contiguous()


def untile_tokens(x):
    """Inverse of ``tile_tokens``: (B, H, tiles, D, tokens) -> (B, H, D, tiles * tokens)."""
    B, H, T, D, M = x.shape
    return x.permute(0, 1, 3, 2, 4).reshape(B, H, D, T * M)


def transposed_tiles(x8, tiles: int, tokens: int, perm):
    """A natural payload (B, S, H, D) (uint8 or e4m3) -> (B, H, tiles, D, tokens), same dtype:
    tile t holds tokens t * tokens ... transposed, one contiguous (D, tokens) block, position p
    of every 32-token group holding token ``perm[p]`` of the group, zero past S
    (``store_transposed_tile``'s layout)."""
    import torch

    fp8 = x8.dtype == torch.float8_e4m3fn
    x = x8.view(torch.uint8) if fp8 else x8
    B, S, H, D = x.shape
    n = tiles * tokens
    if tokens % 32 or n < S:
        raise ValueError(f"transposed_tiles: {tiles} tiles of {tokens} tokens (a multiple of 32) must hold S = {S}")
    xt = torch.zeros((B, H, D, n), dtype=torch.uint8, device=x.device)
    xt[..., :S] = x.permute(0, 2, 3, 1)
    out = tile_tokens(xt.index_select(3, _group_order(n, perm, x.device)), tokens)
    return out.view(torch.float8_e4m3fn) if fp8 else out


def untransposed_tiles(xt8, seq_len: int, perm):
    """Inverse of ``transposed_tiles``: (B, H, tiles, D, tokens) -> (B, seq_len, H, D)."""
    import torch

    fp8 = xt8.dtype == torch.float8_e4m3fn
    xt = xt8.view(torch.uint8) if fp8 else xt8
    flat = untile_tokens(xt)
    nat = torch.empty_like(flat)
    nat[..., _group_order(flat.shape[3], perm, xt.device)] = flat
    out = nat[..., :seq_len].permute(0, 3, 1, 2).contiguous()
    return out.view(torch.float8_e4m3fn) if fp8 else out


def transposed_operand(x8, transposed: str):
    """What ``quantize_blockwise(x, transposed)`` writes as its third tensor, from its payload
    (B, S, H, D): ``transposed_tiles`` with ``TRANSPOSED_TILES[transposed]``, ceil(S/128)
    blocks of 128 tokens. For CPU stand-ins of the fused kernel and for tests."""
    _, _, tiles, _, tokens = transposed_shape(x8.shape, transposed)
    return transposed_tiles(x8, tiles, tokens, TRANSPOSED_TILES[transposed][1])
