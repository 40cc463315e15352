"""tcgen05 fences of the sm_100a attention backward (CuTe DSL device helpers).

Called from inside ``@cute.jit`` code of the backward (they trace into the caller). Its
global-memory reductions (``red.global.add.v4.f32`` for dQ, the acquire/release dQ turn
counter of ``deterministic true``) are inline PTX and live with the other wrappers in
fp4gen/device/ptx.py.
"""
from __future__ import annotations

from cutlass.cutlass_dsl import dsl_user_op


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
