"""Child process for the CuTe DSL persistence tests (run as a script, not collected).

    python aot_child.py CACHE_ROOT [--run] [--tvm-ffi]

Gets a tiny 'add one' kernel through fp4gen.runtime.cache.compiled_kernel and
prints one JSON line: whether build() ran, whether a kernel.o exists, and (with
--run, on a GPU) the values the kernel produced.
"""
import json
import sys
import warnings
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda

from fp4gen.runtime import cache

# Other people edit fp4gen/device while tests run; pin the part of the key that
# fingerprints those sources so that two children of one test agree.
cache.kernel_deps_version = lambda: "aot-test"


@cute.kernel
def _inc(a: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    a[tidx] = a[tidx] + 1.0


@cute.jit
def _launch(a: cute.Tensor, stream: cuda.CUstream):
    _inc(a).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)


def main():
    root = Path(sys.argv[1])
    run = "--run" in sys.argv
    tvm = "--tvm-ffi" in sys.argv
    built = []

    def build():
        built.append(1)
        fake = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (32,))
        if tvm:
            stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
            return cute.compile(_launch, fake, stream, options="--gpu-arch sm_90a --enable-tvm-ffi")
        return cute.compile(_launch, fake, cuda.CUstream(0), options="--gpu-arch sm_90a")

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn = cache.compiled_kernel("inc", f"f32x32,sm_90a,tvm={tvm}", build, module_source="aot-test", root=root,
                                   enable_tvm_ffi=tvm)
    out = {"built": bool(built), "objects": len(list(root.rglob("kernel.o"))),
           "warnings": [str(x.message)[:300] for x in w]}
    if run:
        import torch
        from cutlass.cute.runtime import from_dlpack

        t = torch.arange(32, dtype=torch.float32, device="cuda")
        if tvm:
            fn(t)  # TVM-FFI takes torch tensors and the current stream
        else:
            fn(from_dlpack(t), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        out["values"] = t.cpu().tolist()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
