"""torch tensors as CuTe tensors, for launches through CuTe DSL's own ABI (no TVM-FFI).

One conversion for every runtime host: float8 goes through its bytes (DLPack has no E4M3),
the layout is dynamic along the leading dimension, and the assumed alignment is 16 bytes
except for the dtypes a host names as 4-byte aligned (small per-row vectors: the forward's
fp32 LSE, the backward's int32 turn counters)."""
from __future__ import annotations

from typing import Any


def cute_tensor(t: Any, align4=()):
    """``t`` as a CuTe tensor; None stays None. ``align4``: torch dtypes assumed 4-byte aligned."""
    if t is None:
        return None
    import cutlass
    import torch
    from cutlass.cute.runtime import from_dlpack

    if t.dtype == torch.float8_e4m3fn:
        ct = from_dlpack(t.view(torch.uint8), assumed_align=16)
        ct.element_type = cutlass.Float8E4M3FN
    else:
        ct = from_dlpack(t, assumed_align=4 if t.dtype in align4 else 16)
    return ct.mark_layout_dynamic(leading_dim=t.dim() - 1)
