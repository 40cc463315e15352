"""Probe kernel: the two-level softmax's call-free divisions, compiled for sm_90a.

``fp4gen.device.sm100.two_level.div_rn`` / ``div_rn_const`` are fp64 PTX (cvt, rcp.approx.ftz.f64,
fma.rn.f64, mul.rn.f64) that Hopper runs too; one thread per element writes
div_rn(x, y), div_rn_const(x, 6) and div_rn_const(x, 2688) so that
tests/sm100/test_two_level_division.py can compare them with fp32 division bit for bit.
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:  # plain checkout (device machine)
    sys.path.insert(0, _ROOT)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402

from fp4gen.device.sm100 import two_level as tl  # noqa: E402

THREADS = 256
ARCH = "sm_90a"


@cute.kernel
def _kernel(mX: cute.Tensor, mY: cute.Tensor, mQ: cute.Tensor, mQ6: cute.Tensor, mQ2688: cute.Tensor,
            n: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    if i < n:
        x = mX[i]
        mQ[i] = tl.div_rn(x, mY[i])
        mQ6[i] = tl.div_rn_const(x, 6.0)
        mQ2688[i] = tl.div_rn_const(x, tl.P2_RANGE)


class _Probe:
    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, y_ptr: cute.Pointer, q_ptr: cute.Pointer,
                 q6_ptr: cute.Pointer, q2688_ptr: cute.Pointer, n: Int32, stream):
        def vec(p):
            return cute.make_tensor(p, cute.make_layout(n))

        _kernel(vec(x_ptr), vec(y_ptr), vec(q_ptr), vec(q6_ptr), vec(q2688_ptr), n).launch(
            grid=((n + THREADS - 1) // THREADS, 1, 1), block=[THREADS, 1, 1], stream=stream)


_COMPILED = {}


def _ptrs(addrs):
    from cutlass.cute.runtime import make_ptr

    return [make_ptr(cutlass.Float32, a, cute.AddressSpace.gmem, assumed_align=4) for a in addrs]


def compile_probe():
    import cuda.bindings.driver as cuda

    if "p" not in _COMPILED:
        _COMPILED["p"] = cute.compile(_Probe(), *_ptrs([0] * 5), Int32(1), cuda.CUstream(0),
                                      options=f"--gpu-arch {ARCH}")
    return _COMPILED["p"]


def run(x, y):
    """x, y: CUDA float32 vectors of one length; returns (div_rn(x, y), x / 6, x / 2688) as the
    helpers compute them."""
    import cuda.bindings.driver as cuda
    import torch

    x, y = x.contiguous(), y.contiguous()
    outs = [torch.full_like(x, float("nan")) for _ in range(3)]
    with torch.cuda.device(x.device):
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        compile_probe()(*_ptrs([t.data_ptr() for t in (x, y, *outs)]), Int32(x.numel()), stream)
        torch.cuda.synchronize()
    return tuple(outs)
