"""Inline-PTX wrappers: the one module for them. Each cites its PTX ISA section by title
(docs.nvidia.com/cuda/parallel-thread-execution).

Arithmetic is side-effect-free: CuTe DSL's own ``cute.arch.exp2`` / ``cute.arch.prmt`` are
emitted with ``has_side_effects=True``, which pins them in program order; ours are pure so
LLVM/ptxas may schedule them freely. Memory operations, barriers and warp-collective ops
(the ones below "ordered") keep their side effects: their order is the program's.
"""
from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass._mlir.dialects import llvm


def _asm(ret_type, ptx: str, constraints: str, args, *, side_effects: bool = False, loc=None, ip=None):
    return llvm.inline_asm(
        ret_type,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        ptx,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _i32_struct(n: int):
    """The LLVM struct of ``n`` i32: the result type of a multi-output asm."""
    return llvm.StructType.get_literal([T.i32()] * n)


def _words(res, n: int, loc=None, ip=None):
    """The ``n`` i32 outputs of a multi-output asm as Uint32."""
    return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def ex2(x, *, loc=None, ip=None) -> Float32:
    """2**x on the MUFU (``ex2.approx.ftz.f32``). PTX ISA: Floating-Point Instructions, ``ex2``."""
    return Float32(_asm(T.f32(), "ex2.approx.ftz.f32 $0, $1;", "=f,f", [Float32(x)], loc=loc, ip=ip))


@dsl_user_op
def prmt(a, b, sel: int, *, loc=None, ip=None) -> Uint32:
    """Byte permute of {b, a} (bytes a0..a3 = 0..3, b0..b3 = 4..7). PTX ISA: Integer Arithmetic
    Instructions, ``prmt``."""
    return Uint32(
        _asm(T.i32(), f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r", [Uint32(a), Uint32(b)], loc=loc, ip=ip)
    )


def _four_to_word(half: str, body: str, kind: str, args, loc, ip) -> Uint32:
    """One 32-bit word from four inputs ($1..$4, asm constraint ``kind``) built as two halves
    ``lo``, ``hi`` (registers of PTX type ``half``) that ``body`` computes and joins into $0."""
    return Uint32(_asm(T.i32(), "{\n.reg ." + half + " lo, hi;\n" + body + "\n}", "=r" + ("," + kind) * 4,
                       args, loc=loc, ip=ip))


@dsl_user_op
def pack_low_bytes4(y0, y1, y2, y3, *, loc=None, ip=None) -> Uint32:
    """Pack the low byte of four 32-bit words into one word (byte i = y_i & 0xff).

    Three PRMTs: two gather pairs, one joins the halves (``prmt``, as above).
    """
    return _four_to_word("b32", "prmt.b32 lo, $1, $2, 0x0040;\nprmt.b32 hi, $3, $4, 0x0040;\n"
                         "prmt.b32 $0, lo, hi, 0x5410;", "r", [Uint32(y0), Uint32(y1), Uint32(y2), Uint32(y3)],
                         loc, ip)


@dsl_user_op
def cvt_e4m3x4(p0, p1, p2, p3, *, loc=None, ip=None) -> Uint32:
    """Four fp32 -> four E4M3 (round to nearest even, saturating), byte i = p_i. PTX ISA: Data
    Movement and Conversion Instructions, ``cvt`` (``.e4m3x2.f32``)."""
    return _four_to_word("b16", "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\ncvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
                         "mov.b32 $0, {lo, hi};", "f", [Float32(p0), Float32(p1), Float32(p2), Float32(p3)],
                         loc, ip)


@dsl_user_op
def f32_as_u32(x, *, loc=None, ip=None) -> Uint32:
    """The bits of a float (PTX ISA: Data Movement and Conversion Instructions, ``mov``)."""
    return Uint32(_asm(T.i32(), "mov.b32 $0, $1;", "=r,f", [Float32(x)], loc=loc, ip=ip))


@dsl_user_op
def u32_as_f32(x, *, loc=None, ip=None) -> Float32:
    """A float from its bits (``mov``, as ``f32_as_u32``)."""
    return Float32(_asm(T.f32(), "mov.b32 $0, $1;", "=f,r", [Uint32(x)], loc=loc, ip=ip))


@dsl_user_op
def keep_below(n, *, loc=None, ip=None) -> Uint32:
    """The low ``n`` bits set, for any n: 0 for n <= 0, all 32 for n >= 32 (``shr.u32`` of all
    ones by 32 - n, clamped at 0; PTX ISA: Logic and Shift Instructions, ``shr``: shift
    amounts above 32 act as 32). A key mask whose bit tests ptxas turns into R2P."""
    k = cutlass.max(Int32(32) - Int32(n), Int32(0))
    return Uint32(_asm(T.i32(), "shr.u32 $0, $1, $2;", "=r,r,r", [Uint32(0xFFFFFFFF), Uint32(k)], loc=loc, ip=ip))


@dsl_user_op
def keep_or_neg_inf(x, mask, bit: int, *, loc=None, ip=None) -> Float32:
    """``x`` where bit ``bit`` of ``mask`` is set, else -inf (``and``, ``setp``, ``selp.f32``:
    ptxas makes one R2P per seven keys of a mask and one FSEL per key)."""
    return Float32(_asm(T.f32(), "{\n.reg .pred p;\n.reg .b32 t;\n"
                        f"and.b32 t, $2, {1 << bit};\nsetp.ne.b32 p, t, 0;\n"
                        "selp.f32 $0, $1, 0fFF800000, p;\n}", "=f,f,r", [Float32(x), Uint32(mask)],
                        loc=loc, ip=ip))


@dsl_user_op
def absmax2(x, y, *, loc=None, ip=None) -> Float32:
    """max(|x|, |y|) (ptxas folds the abs into the FMNMX). PTX ISA: Floating-Point Instructions,
    ``abs``, ``max``."""
    return Float32(_asm(T.f32(), "{\n.reg .f32 a, b;\nabs.f32 a, $1;\nabs.f32 b, $2;\nmax.f32 $0, a, b;\n}",
                        "=f,f,f", [Float32(x), Float32(y)], loc=loc, ip=ip))


@dsl_user_op
def pow2_reciprocal(c, *, loc=None, ip=None) -> Float32:
    """1 / c, exactly, for c a normal power of two (from its exponent bits; NaN stays NaN).
    PTX ISA: Integer Arithmetic Instructions (``bfe``, ``sub``, ``shl``)."""
    return Float32(_asm(
        T.f32(),
        "{\n.reg .b32 e, r;\n.reg .pred special;\nmov.b32 r, $1;\nbfe.u32 e, r, 23, 8;\n"
        "setp.eq.u32 special, e, 255;\nsub.u32 e, 254, e;\nshl.b32 e, e, 23;\n@!special mov.b32 r, e;\n"
        "mov.b32 $0, r;\n}",
        "=f,f", [Float32(c)], loc=loc, ip=ip))


@dsl_user_op
def fp8_scale_cover(x, *, loc=None, ip=None) -> Float32:
    """The smallest power of two s with 448 s >= x (x >= 0): x = m 2^e, m in [1, 2), gives
    2^(e-8) if m <= 1.75 else 2^(e-7) (448 = 1.75 2^8); 1 for x < 2^-117 (0 included), NaN
    for inf/NaN. Exact and without a division; the numerics oracle's
    ``reference.fp8_ds_scale_cover`` does the same bit arithmetic. PTX ISA: Integer Arithmetic
    Instructions (``bfe``, ``and``, ``setp``)."""
    return Float32(_asm(
        T.f32(),
        "{\n.reg .b32 e, m, r;\n.reg .pred big, tiny, special;\n"
        "mov.b32 r, $1;\n"
        "bfe.u32 e, r, 23, 8;\n"
        "and.b32 m, r, 0x7fffff;\n"
        "setp.gt.u32 big, m, 0x600000;\n"
        "sub.u32 r, e, 8;\n"
        "@big add.u32 r, r, 1;\n"
        "shl.b32 r, r, 23;\n"
        "setp.lt.u32 tiny, e, 10;\n"
        "@tiny mov.b32 r, 0x3f800000;\n"
        "setp.eq.u32 special, e, 255;\n"
        "@special mov.b32 r, 0x7fc00000;\n"
        "mov.b32 $0, r;\n}",
        "=f,f", [Float32(x)], loc=loc, ip=ip))


@dsl_user_op
def bf16x2_to_f32(w, *, loc=None, ip=None):
    """One word of two bf16 (element 0 low) -> two fp32 (exact: a shift and a mask)."""
    res = _asm(llvm.StructType.get_literal([T.f32(), T.f32()]),
               "{\n.reg .b32 a, b;\nshl.b32 a, $2, 16;\nand.b32 b, $2, 0xffff0000;\n"
               "mov.b32 $0, a;\nmov.b32 $1, b;\n}",
               "=f,=f,r", [Uint32(w)], loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(2)]


@dsl_user_op
def e4m3x4_to_f32(w, *, loc=None, ip=None):
    """One word of four e4m3 (element 0 in the low byte) -> four fp32 (exact, via f16).
    PTX ISA: Data Movement and Conversion Instructions, ``cvt`` (``.f16x2.e4m3x2``)."""
    res = _asm(llvm.StructType.get_literal([T.f32()] * 4),
               "{\n.reg .b16 lo, hi;\n.reg .b32 h0, h1;\n.reg .f16 a, b, c, d;\n"
               "mov.b32 {lo, hi}, $4;\ncvt.rn.f16x2.e4m3x2 h0, lo;\ncvt.rn.f16x2.e4m3x2 h1, hi;\n"
               "mov.b32 {a, b}, h0;\nmov.b32 {c, d}, h1;\n"
               "cvt.f32.f16 $0, a;\ncvt.f32.f16 $1, b;\ncvt.f32.f16 $2, c;\ncvt.f32.f16 $3, d;\n}",
               "=f,=f,=f,=f,r", [Uint32(w)], loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def f32x2_to_bf16x2(a, b, *, loc=None, ip=None) -> Uint32:
    """Two fp32 -> one word of two bf16 (round to nearest even; ``a`` in the low half).
    PTX ISA: Data Movement and Conversion Instructions, ``cvt`` (``.bf16x2.f32``)."""
    return Uint32(_asm(T.i32(), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [Float32(a), Float32(b)],
                       loc=loc, ip=ip))


# ---------------------------------------------------------------------------- ordered
# (memory, barriers, warp collectives: emitted with side effects, kept in program order)


@dsl_user_op
def bulk_load(gmem_ptr, smem_ptr, mbar_ptr, num_bytes: int, *, loc=None, ip=None):
    """``num_bytes`` (a multiple of 16) global -> SMEM by the TMA unit, completing on ``mbar_ptr``
    (whose transaction count must include these bytes). PTX ISA: Data Movement and Conversion
    Instructions, ``cp.async.bulk``."""
    _asm(None, "cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [$1], [$0], $3, [$2];",
         "l,r,r,r", [gmem_ptr.toint(loc=loc, ip=ip), smem_ptr.toint(loc=loc, ip=ip),
                     mbar_ptr.toint(loc=loc, ip=ip), Int32(num_bytes)], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def bulk_add_f32(gmem_ptr, smem_ptr, num_bytes: int, *, loc=None, ip=None):
    """``num_bytes`` of fp32 in SMEM added element-wise into global memory by the TMA unit (one
    bulk reduce: the L2 sees whole lines, not one atomic per element); completes with the
    thread's bulk async-group. PTX ISA: Data Movement and Conversion Instructions,
    ``cp.reduce.async.bulk``."""
    _asm(None, "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
         "l,r,r", [gmem_ptr.toint(loc=loc, ip=ip), smem_ptr.toint(loc=loc, ip=ip), Int32(num_bytes)],
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def stmatrix_x4_trans(smem_addr, r0, r1, r2, r3, *, loc=None, ip=None):
    """Four 8x8 matrices of 16-bit units, stored transposed: lane l gives the address of row
    l % 8 of matrix l // 8, which receives column l % 8. PTX ISA: Warp-level Matrix
    Instructions, ``stmatrix`` (``.x4.trans.b16``)."""
    _asm(None, "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
         [Int32(smem_addr)] + [Uint32(r) for r in (r0, r1, r2, r3)], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def barrier_red(barrier_id: int, number_of_threads: int, pred, op: str, *, loc=None, ip=None):
    """Named barrier that also reduces ``pred`` over its threads (``op``: "or" / "and"); every
    thread gets the same answer. PTX ISA: Parallel Synchronization and
    Communication Instructions, ``bar.red``."""
    return cutlass.Boolean(_asm(
        T.i32(),
        "{\n.reg .pred p, q;\nsetp.ne.b32 p, $1, 0;\nbar.red." + op + ".pred q, " + str(barrier_id) + ", "
        + str(number_of_threads) + ", p;\nselp.u32 $0, 1, 0, q;\n}", "=r,r", [Int32(pred)],
        side_effects=True, loc=loc, ip=ip)) != 0


@dsl_user_op
def warp_max_nonneg(x, *, loc=None, ip=None) -> Float32:
    """Max over the warp of a non-negative float: one ``redux.sync`` on its bits (non-negative
    floats order as their unsigned bit patterns). PTX ISA: Parallel Synchronization and
    Communication Instructions, ``redux.sync``."""
    return Float32(_asm(
        T.f32(), "{\n.reg .b32 a, r;\nmov.b32 a, $1;\nredux.sync.max.u32 r, a, 0xffffffff;\nmov.b32 $0, r;\n}",
        "=f,f", [Float32(x)], side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def red_add_f32x4(ptr, v0, v1, v2, v3, *, loc=None, ip=None):
    """Atomic add of four consecutive fp32 at ``ptr`` (16-byte aligned) in global memory, no
    return value (sm_90+). PTX ISA: Parallel Synchronization and Communication Instructions,
    ``red`` (``.global.add.v4.f32``)."""
    _asm(None, "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f",
         [ptr.toint(loc=loc, ip=ip)] + [Float32(v) for v in (v0, v1, v2, v3)], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_acquire_s32(ptr, *, loc=None, ip=None) -> Int32:
    """Load with acquire semantics at GPU scope (a dQ turn counter). PTX ISA: Data Movement
    and Conversion Instructions, ``ld`` (``.acquire``); Memory Consistency Model.."""
    return Int32(_asm(T.i32(), "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr.toint(loc=loc, ip=ip)],
                      side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def red_release_add_s32(ptr, val, *, loc=None, ip=None):
    """Add with release semantics at GPU scope (hands a dQ turn on). PTX ISA:
    Parallel Synchronization and Communication Instructions, ``red`` (``.release``)."""
    _asm(None, "red.release.gpu.global.add.s32 [$0], $1;", "l,r", [ptr.toint(loc=loc, ip=ip), Int32(val)],
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def ld_v4_f32(addr, *, loc=None, ip=None):
    """16 bytes from global memory through the read-only path, not kept in L1, as four words.
    PTX ISA: Data Movement and Conversion Instructions, ``ld`` (``.global.nc``)."""
    res = _asm(_i32_struct(4), "ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,l", [Int64(addr)], side_effects=True, loc=loc, ip=ip)
    return _words(res, 4, loc, ip)


@dsl_user_op
def st_v4_pred(addr, a, b, c, d, pred, *, loc=None, ip=None):
    """16 bytes to global memory if ``pred`` != 0. PTX ISA: Data Movement and Conversion
    Instructions, ``st``."""
    _asm(None, "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n@p st.global.v4.b32 [$0], {$1, $2, $3, $4};\n}",
         "l,r,r,r,r,r", [Int64(addr), Uint32(a), Uint32(b), Uint32(c), Uint32(d), Int32(pred)],
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def perf_marker(event: int, *, loc=None, ip=None) -> None:
    """``pmevent event;`` (PTX ISA: Miscellaneous Instructions, pmevent): a marker for the
    static performance model (``fp4gen.device.markers``). Ordered: it stays where it is."""
    llvm.inline_asm(None, [], f"pmevent {int(event)};", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
