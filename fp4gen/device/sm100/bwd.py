"""Global-memory reductions of the sm_100a attention backward (CuTe DSL device helpers).

Called from inside ``@cute.jit`` code of the generated backward (they trace into the
caller). The dQ warps add their fp32 dQ rows into a global accumulator with
``red.global.add.v4.f32`` (sm_90+: four consecutive, 16-byte aligned floats per
instruction, no return value). With ``deterministic true`` the key tiles of one
(batch, head) take turns per query tile through an int32 counter read with acquire
and advanced with release semantics at GPU scope.
"""
from __future__ import annotations

from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass._mlir.dialects import llvm


def _addr(ptr, loc, ip):
    return ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)


@dsl_user_op
def red_add_f32x4(ptr, v0, v1, v2, v3, *, loc=None, ip=None):
    """Atomic add of four consecutive fp32 at ``ptr`` (16-byte aligned) in global memory."""
    llvm.inline_asm(
        None,
        [_addr(ptr, loc, ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)],
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def ld_acquire_s32(ptr, *, loc=None, ip=None) -> Int32:
    """int32 load with acquire semantics at GPU scope (reads a dQ turn counter)."""
    return Int32(llvm.inline_asm(
        T.i32(),
        [_addr(ptr, loc, ip)],
        "ld.acquire.gpu.global.b32 $0, [$1];",
        "=r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@dsl_user_op
def red_release_add_s32(ptr, val, *, loc=None, ip=None):
    """int32 add with release semantics at GPU scope (passes the dQ turn on)."""
    llvm.inline_asm(
        None,
        [_addr(ptr, loc, ip), Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def tcgen05_fence_before_thread_sync(*, loc=None, ip=None):
    """``tcgen05.fence::before_thread_sync``: orders this thread's earlier tcgen05 operations
    (here: completed TMEM loads) before the thread synchronisation that follows (PTX ISA
    9.7.16.6, tcgen05 memory consistency: "pipelined" tcgen05 ops are ordered across threads
    only through these fences around an execution barrier)."""
    from cutlass._mlir.dialects import nvvm

    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_after_thread_sync(*, loc=None, ip=None):
    """``tcgen05.fence::after_thread_sync``: the counterpart after the barrier, before the
    tcgen05 operation (here: tcgen05.dealloc) that must follow the other threads' ones."""
    from cutlass._mlir.dialects import nvvm

    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)
