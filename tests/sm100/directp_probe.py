"""Probe kernel: the sm100a Direct-P device helpers, compiled for sm_90a.

``fp4gen.device.sm100.direct_p``'s fast-policy helpers are FP32/integer code
(FADD/FMUL/FMNMX, PRMT, IMAD) that also runs on Hopper. This module wraps them in a
tiny kernel that mirrors the per-row softmax loop of ``fp4gen/device/sm100/forward.py``
(one thread owns one row; 32-key blocks; per block: fmax of the scores, block
exponent of ``bmax - m``, the offset ``sat_offset``, then ``sat_block``'s four nibble words
and block sum, beside each key's code from the scalar chain ``fma_sat`` then ``fma_rn``; then
``l += twice * half_pow2_e8m0(e_B)``, and as the kernels with the guard's rebase keep it,
``4 l += twice * quad_pow2(e_B)``), so that a Hopper GPU can check them bit for bit
against ``fp4gen.numerics.directp.sat_codes`` (the scores are in log2 units: scale 1).

The accurate policy is not probed: ``cvt.rn.satfinite.e2m1x2.f32`` is sm_100-only.

Kernel arguments (pointers, so nothing depends on DLPack/tvm-ffi; ``rows`` at run time):
  t      (rows, N_KEYS) fp32, scores in log2 units (masked = -inf), row-major
  m      (rows,) fp32 row reference
  raw    (rows, N_KEYS) int32: bits(r) - bits(1.5*2^23) for each key's scalar-chain
         result r (== the code when r holds it the way the helpers assume)
  words  (rows, N_KEYS // 8) int32: the packed nibble words exactly as the kernel puts
         them in ``p_words`` (key 8w+c in nibble c of word w)
  e8m0   (rows, N_KEYS // 32) uint8: e_B + 127 per block (the byte written to sSFP)
  twice  (rows, N_KEYS // 32) int32: 2 * sum of the block's E2M1 magnitudes (PRMT table)
  l      (rows,) fp32: the row's l, accumulated block by block as a kernel without the guard
  l4     (rows,) fp32: 4 l accumulated as a kernel with the guard (quad_pow2; exact in the
         rebase's range e_B <= 64, overflowing for e_B >= 125)
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # plain checkout (device machine): fp4gen/ is a plain package
    sys.path.insert(0, _ROOT)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402

from fp4gen.device.sm100 import direct_p as dp  # noqa: E402
from fp4gen.numerics.directp import FAST_A, FAST_B, sat_constants  # noqa: E402

N_KEYS = 128  # one TILE_N of the sm100 template: 4 blocks of 32 keys
N_BLOCKS = N_KEYS // 32
N_WORDS = N_KEYS // 8
THREADS = 128  # one warpgroup; one thread per row
MAGIC_BITS = 0x4B400000  # bits of 1.5 * 2^23 (dp.MAGIC)
ARCH = "sm_90a"


@cute.kernel
def _probe_kernel(mT: cute.Tensor, mM: cute.Tensor, mRaw: cute.Tensor, mWords: cute.Tensor,
                  mE8: cute.Tensor, mTwice: cute.Tensor, mL: cute.Tensor, mL4: cute.Tensor, rows: Int32,
                  a: cutlass.Constexpr, b: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    row = bidx * THREADS + tidx
    if row < rows:
        # the row's scores in registers, as tS_rc[block][key] in the template
        s = cute.make_rmem_tensor((N_KEYS,), Float32)
        for c in cutlass.range_constexpr(N_KEYS):
            s[c] = mT[row, c]
        m_ref = mM[row]
        a7, k7 = sat_constants(a, b)
        l_run = Float32(0.0)
        l4_run = Float32(0.0)
        for blk in cutlass.range_constexpr(N_BLOCKS):
            bmax = -Float32.inf
            for c in cutlass.range_constexpr(32):
                bmax = cute.arch.fmax(bmax, s[blk * 32 + c])
            e_bf, e_word = dp.block_exponent(bmax - m_ref)
            c_b = dp.sat_offset(m_ref, e_bf, a7, k7)
            # each key's code by the scalar chain (y = sat(A7 t + c_B), then 7 y + 1.5 * 2^23),
            # and the words and block sum of the block helper the kernel runs (its scalar
            # form: f32x2 is sm_100a only); scale 1: the scores are already in log2 units
            for c in cutlass.range_constexpr(32):
                y = dp.fma_sat(s[blk * 32 + c], Float32(a7), c_b)
                r = dp.fma_rn(y, Float32(7.0), Float32(dp.MAGIC))
                mRaw[row, blk * 32 + c] = dp.f32_as_i32(r) - Int32(MAGIC_BITS)
            sb = cute.make_rmem_tensor((32,), Float32)
            for c in cutlass.range_constexpr(32):
                sb[c] = s[blk * 32 + c]
            wv = cute.make_rmem_tensor((4,), Int32)
            twice = dp.sat_block(sb, Float32(a7), c_b, wv, 0, False)
            for w in cutlass.range_constexpr(4):
                mWords[row, blk * 4 + w] = wv[w]
            l_run = l_run + Float32(twice) * dp.half_pow2_e8m0(e_word)
            l4_run = l4_run + Float32(twice) * dp.quad_pow2(e_word)
            mE8[row, blk] = cutlass.Uint8(e_word)
            mTwice[row, blk] = twice
        mL[row] = l_run
        mL4[row] = l4_run


class _Probe:
    def __init__(self, a: float, b: float):
        self.a, self.b = a, b

    @cute.jit
    def __call__(self, t_ptr: cute.Pointer, m_ptr: cute.Pointer, raw_ptr: cute.Pointer,
                 words_ptr: cute.Pointer, e8_ptr: cute.Pointer, twice_ptr: cute.Pointer,
                 l_ptr: cute.Pointer, l4_ptr: cute.Pointer, rows: Int32, stream):
        def mat(ptr, cols):
            return cute.make_tensor(ptr, cute.make_layout((rows, cols), stride=(cols, 1)))

        _probe_kernel(
            mat(t_ptr, N_KEYS), cute.make_tensor(m_ptr, cute.make_layout(rows)),
            mat(raw_ptr, N_KEYS), mat(words_ptr, N_WORDS), mat(e8_ptr, N_BLOCKS),
            mat(twice_ptr, N_BLOCKS), cute.make_tensor(l_ptr, cute.make_layout(rows)),
            cute.make_tensor(l4_ptr, cute.make_layout(rows)),
            rows, self.a, self.b,
        ).launch(grid=((rows + THREADS - 1) // THREADS, 1, 1), block=[THREADS, 1, 1], stream=stream)


class _ProbeT:
    """The same launch taking CuTe tensors (DLPack path): a fallback if pointer arguments
    are not accepted by the runtime in use."""

    def __init__(self, a: float, b: float):
        self.a, self.b = a, b

    @cute.jit
    def __call__(self, mT: cute.Tensor, mM: cute.Tensor, mRaw: cute.Tensor, mWords: cute.Tensor,
                 mE8: cute.Tensor, mTwice: cute.Tensor, mL: cute.Tensor, mL4: cute.Tensor, stream):
        rows = mT.shape[0]
        _probe_kernel(mT, mM, mRaw, mWords, mE8, mTwice, mL, mL4, rows, self.a, self.b).launch(
            grid=((rows + THREADS - 1) // THREADS, 1, 1), block=[THREADS, 1, 1], stream=stream)


_DTYPES = (cutlass.Float32, cutlass.Float32, cutlass.Int32, cutlass.Int32, cutlass.Uint8,
           cutlass.Int32, cutlass.Float32, cutlass.Float32)
_COMPILED = {}


def _ptrs(addrs):
    from cutlass.cute.runtime import make_ptr

    return [make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=4 if dt is not cutlass.Uint8 else 1)
            for dt, addr in zip(_DTYPES, addrs)]


def compile_probe(a: float = FAST_A, b: float = FAST_B, keep_ptx: bool = False):
    """Compile for sm_90a (no GPU needed). Cached per (a, b, keep_ptx)."""
    import cuda.bindings.driver as cuda

    key = (a, b, keep_ptx)
    if key not in _COMPILED:
        # the target comes from the option, whatever CUTE_DSL_ARCH says (another test in the
        # same process may have set it for sm_100a); no GPU is needed to compile
        args = (*_ptrs([0] * len(_DTYPES)), Int32(1), cuda.CUstream(0))
        compile_ = cute.compile[cute.KeepPTX] if keep_ptx else cute.compile
        _COMPILED[key] = compile_(_Probe(a, b), *args, options=f"--gpu-arch {ARCH}")
    return _COMPILED[key]


def compile_probe_tensors(a: float = FAST_A, b: float = FAST_B):
    """The fallback (DLPack tensors, symbolic row count), compiled for sm_90a."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    key = ("tensors", a, b)
    if key not in _COMPILED:
        rows = cute.sym_int()
        cols = (N_KEYS, None, N_KEYS, N_WORDS, N_BLOCKS, N_BLOCKS, None, None)
        args = [fake(dt, (rows, c) if c else (rows,), stride_order=(1, 0) if c else (0,), assumed_align=1)
                for dt, c in zip(_DTYPES, cols)]
        _COMPILED[key] = cute.compile(_ProbeT(a, b), *args, cuda.CUstream(0), options=f"--gpu-arch {ARCH}")
    return _COMPILED[key]


LAST_PATH = None  # which launch path run_probe used: "pointers" or "tensors"


def run_probe(t, m, a: float = FAST_A, b: float = FAST_B):
    """Run on CUDA tensors t (rows, N_KEYS) fp32 and m (rows,) fp32.
    Returns dict raw, codes (from the packed words), words, e8m0, twice, l, l4 (CPU tensors)."""
    import cuda.bindings.driver as cuda
    import torch

    if t.dim() != 2 or t.shape[1] != N_KEYS or t.dtype != torch.float32:
        raise ValueError(f"t must be float32 (rows, {N_KEYS}), got {tuple(t.shape)} {t.dtype}")
    rows = t.shape[0]
    if rows == 0:
        raise ValueError("t has no rows")
    if m.shape != (rows,) or m.dtype != torch.float32:
        raise ValueError(f"m must be float32 ({rows},), got {tuple(m.shape)} {m.dtype}")
    dev = t.device
    t = t.contiguous()
    m = m.contiguous()
    raw = torch.full((rows, N_KEYS), -1, dtype=torch.int32, device=dev)
    words = torch.full((rows, N_WORDS), -1, dtype=torch.int32, device=dev)
    e8 = torch.full((rows, N_BLOCKS), 0xEE, dtype=torch.uint8, device=dev)
    twice = torch.full((rows, N_BLOCKS), -1, dtype=torch.int32, device=dev)
    l = torch.full((rows,), float("nan"), dtype=torch.float32, device=dev)
    l4 = torch.full((rows,), float("nan"), dtype=torch.float32, device=dev)
    global LAST_PATH
    bufs = (t, m, raw, words, e8, twice, l, l4)
    with torch.cuda.device(dev):
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        try:
            compile_probe(a, b)(*_ptrs([x.data_ptr() for x in bufs]), Int32(rows), stream)
            LAST_PATH = "pointers"
        except Exception as err_ptr:  # noqa: BLE001 - retried below, both errors reported
            from cutlass.cute.runtime import from_dlpack

            try:
                conv = [from_dlpack(x, assumed_align=1).mark_layout_dynamic(leading_dim=x.dim() - 1)
                        for x in bufs]
                compile_probe_tensors(a, b)(*conv, stream)
                LAST_PATH = "tensors"
            except Exception as err_t:
                raise RuntimeError(f"probe launch failed both ways: pointers: {err_ptr!r}; "
                                   f"tensors: {err_t!r}") from err_t
        torch.cuda.synchronize()
    words_c = words.cpu()
    shifts = torch.arange(8, dtype=torch.int32) * 4
    codes = ((words_c[:, :, None] >> shifts) & 0xF).reshape(rows, N_KEYS).to(torch.uint8)
    return {"raw": raw.cpu(), "codes": codes, "words": words_c, "e8m0": e8.cpu(),
            "twice": twice.cpu(), "l": l.cpu(), "l4": l4.cpu()}


def pack_words(codes):
    """Reference packing (key 8w+c in nibble c of word w) of (rows, N_KEYS) uint8 codes -> int32."""
    import torch

    c = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)
    w = (c << (torch.arange(8, dtype=torch.int64) * 4)).sum(-1)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
