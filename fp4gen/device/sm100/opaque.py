"""A value the compiler above ptxas cannot see through (CuTe DSL device helper)."""
from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def opaque_i32(x, *, loc=None, ip=None) -> Int32:
    """``x`` through one ``mov.b32`` in inline PTX: LLVM cannot fold it into the addresses that
    use it (ptxas sees a plain move and still may). The sm100a forward passes the TMEM-address
    word's SMEM address through it, so that tcgen05.alloc and the roles' ld.shared of that word
    take a register address ([%r]), the form fp4gen.lowering.descriptors follows, instead of the
    [__dynamic_shmem__0+imm] LLVM folds SMEM addresses into without the uniform-base hint."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
