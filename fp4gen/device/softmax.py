"""Online-softmax pieces shared by the generated forward kernels.

State per query row (registers): ``row_max`` m in log2 units (x = s * c),
``row_sum`` l (a per-thread partial: each row's columns are spread over the 4
threads of a quad; the quad sums once, in ``finalize``).

``tile`` processes one score tile in place: raw scores s (fp32 MMA output) ->
the values the PV product consumes, and returns nothing; ``row_scale`` gets
exp2(m_old - m_new) for rescaling O. The per-tile multiplier ``c`` folds the
operand scales of FP8 inputs, softmax_scale and log2(e), so FP8 and BF16 share
one code path. Modes (compile-time):

- "bf16":     p = 2^(x - m)                 (MUFU), l += p, P = bf16(p)
- "fp8_exp":  p256 = 2^(x - m + 8)          (MUFU), l += p256, P = e4m3_rne(p256)
- "fp8_directp": codes from ``directp`` (no MUFU), l += decode(code)
- "fp8_directp_l_mma": the same codes; l is left to the caller (computed on the tensor
  cores as P @ ones, from the very registers PV consumes)

For the FP8 modes l is kept at the 2^8 scale of P, so O = O_acc * scale_v / l.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from . import directp, ptx
from .layout import acc_mn
from .ptx import _asm
from cutlass.cutlass_dsl import T, dsl_user_op

LN2 = math.log(2.0)


def _quad_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


def _quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def _tree(vals, op):
    vals = list(vals)
    while len(vals) > 1:
        nxt = []
        for i in range(0, len(vals) - 1, 2):
            nxt.append(op(vals[i], vals[i + 1]))
        if len(vals) % 2 == 1:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


def _row_max_raw(s_mn, r, n_cols):
    return _tree([s_mn[r, j] for j in range(n_cols)], cute.arch.fmax)


@cute.jit
def tile(
    acc_s: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    row_scale: cute.Tensor,
    c: Float32,
    is_first: cutlass.Constexpr[bool],
    mode: cutlass.Constexpr[str],
):
    s_mn = acc_mn(acc_s)
    n_rows = cute.size(s_mn, mode=[0])
    n_cols = cute.size(s_mn, mode=[1])
    for r in cutlass.range_constexpr(n_rows):
        # row max of the raw scores (c > 0, so max(s) * c == max(s * c) exactly)
        smax = _row_max_raw(s_mn, r, n_cols)
        smax = _quad_max(smax)
        if cutlass.const_expr(mode.startswith("fp8_directp")):
            m_new = directp.row_ref(smax, c)  # rounded up: see directp
        else:
            m_new = smax * c
        m_old = row_max[r]
        if cutlass.const_expr(not is_first):
            m_new = cute.arch.fmax(m_old, m_new)
        row_max[r] = m_new
        # a row with nothing unmasked yet keeps m = -inf; subtract 0 instead (p = 0)
        m_use = m_new
        if m_new == -Float32.inf:
            m_use = Float32(0.0)
        scale = Float32(1.0)
        if cutlass.const_expr(not is_first):
            scale = ptx.ex2(m_old - m_use)
        row_scale[r] = scale
        parts = [Float32(0.0)] * 4
        if cutlass.const_expr(mode.startswith("fp8_directp")):
            c16 = c * 0.0625
            b128 = directp.offset(m_use)
            for j in cutlass.range_constexpr(n_cols):
                y = directp.code(s_mn[r, j], c16, b128)
                s_mn[r, j] = y
                if cutlass.const_expr(mode == "fp8_directp"):
                    parts[j % 4] = directp.decode_acc(y, parts[j % 4])
        else:
            neg = -m_use
            if cutlass.const_expr(mode == "fp8_exp"):
                neg = neg + float(directp.P_SCALE_LOG2)
            for j in cutlass.range_constexpr(n_cols):
                p = ptx.ex2(cute.math.fma(s_mn[r, j], c, neg))
                s_mn[r, j] = p
                parts[j % 4] = parts[j % 4] + p
        tot = (parts[0] + parts[1]) + (parts[2] + parts[3])
        if cutlass.const_expr(is_first):
            row_sum[r] = tot
        else:
            row_sum[r] = row_sum[r] * scale + tot


@dsl_user_op
def tanh_approx(x, *, loc=None, ip=None) -> Float32:
    """tanh on the MUFU (``tanh.approx.f32``, PTX ISA 9.7.3.22), as FlashAttention-3 uses it.
    Its maximum relative error is 2^-10.987 (PTX ISA), ~5e-4: with a softcap of c2 (log2
    units) a saturated score moves by up to c2 * 5e-4 (0.02 for softcap 30), i.e. P by up to
    ~1.5 %; the GPU tests' softcap tolerance accounts for that."""
    return Float32(_asm(T.f32(), "tanh.approx.f32 $0, $1;", "=f,f", [Float32(x)], loc=loc, ip=ip))


@cute.jit
def softcap(acc_s: cute.Tensor, c: Float32, cap2: cutlass.Constexpr[float]):
    """s -> x = cap2 * tanh(s * c / cap2) in place: the log2-unit score x = s * c, capped
    (fp4gen.numerics.reference: t = cap2 tanh(t / cap2), cap2 = softcap * log2 e). Applied
    before the mask (-inf stays -inf only if masked afterwards); ``tile`` then takes c = 1."""
    s_mn = acc_mn(acc_s)
    c_in = c * (1.0 / cap2)  # s * c / cap2 in one multiply (1 ulp from the reference's division)
    for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
        for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            s_mn[r, j] = tanh_approx(s_mn[r, j] * c_in) * cap2


@cute.jit
def rescale_o(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """O *= exp2(m_old - m_new) per row; skipped (exactly: x * 1.0 == x) when no row
    of the warp changed its max, which is most tiles once the max has settled."""
    o_mn = acc_mn(acc_o)
    n_rows = cute.size(o_mn, mode=[0])
    unchanged = row_scale[0] == 1.0
    for r in cutlass.range_constexpr(1, n_rows):
        unchanged = unchanged & (row_scale[r] == 1.0)
    if not cute.arch.vote_all_sync(unchanged):
        for r in cutlass.range_constexpr(n_rows):
            for j in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[r, j] = o_mn[r, j] * row_scale[r]


@cute.jit
def finalize(
    acc_o: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    lse: cute.Tensor,
    out_mult: Float32,
    l_scale_log2: cutlass.Constexpr[int],
    quad_reduce: cutlass.Constexpr[bool] = True,
):
    """O *= out_mult / l; lse = ln(2) * (m + log2(l) - l_scale_log2).

    Rows with l == 0 (nothing unmasked) get O = 0 and lse = -inf.
    """
    o_mn = acc_mn(acc_o)
    for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
        l = row_sum[r]
        if cutlass.const_expr(quad_reduce):
            l = _quad_sum(l)
        inv = Float32(0.0)
        row_lse = -Float32.inf
        if l > 0.0:
            inv = out_mult / l
            row_lse = (row_max[r] + cute.math.log2(l, fastmath=True) - float(l_scale_log2)) * LN2
        lse[r] = row_lse
        for j in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
            o_mn[r, j] = o_mn[r, j] * inv
