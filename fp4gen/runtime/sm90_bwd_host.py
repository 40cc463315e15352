"""Host side of the generated sm90a attention backward: compile-time arguments, the compile
path, the FP8 operands and preprocessing, launch, dQ post-processing and the GQA sums
(docs/backward.md; docs/design/host-code.md).

One copy for every sm90a module with a backward. The module builds one ``BackwardHost``
from its kernel name, its kernel config (``fp4gen.device.sm90.backward.BackwardConfig``,
rendered from the plan), the kernel class and the device helper modules it calls
(``fp4gen.device.bwd_prep``: pre/post-processing kernels; ``fp4gen.device.quantize``: the
forward's FP8 quantizer), and binds ``compile_only_backward``, ``backward``, ``_bwd_launch``
and ``_bwd_compile`` to it. The runtime sits below the device layer, so those come in as
arguments; the host calls them through the module objects, so a test that replaces one of
their functions (or the generated module's ``_bwd_launch``) is seen. Importing this module
imports only the standard library; torch and CuTe DSL are imported where they are used.

Compiles go through ``fp4gen.runtime.cache.compiled_kernel`` (in memory, then a verified disk
entry keyed by the generated module's source, then a compile) with the calling convention of
``cache.tvm_ffi_available()``; the architecture is a compile option, never the process's
``CUTE_DSL_ARCH``. ``compile_only`` (CPU, no GPU) compiles in memory.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

from fp4gen.runtime import bwd_common, cache, dlpack

ARCH = "sm_90a"

# The kernel's tensor arguments in ``__call__`` order, with the config flag that makes each one
# present (None: always). Absent ones are passed as None (a compile-time constant).
KERNEL_TENSORS = (
    ("q", None), ("k", None), ("v", None), ("do", None),
    ("q8", "s_fp8"), ("k8", "s_fp8"), ("scale_q", "s_fp8"), ("scale_k", "s_fp8"),
    ("dot8", "do_fp8"), ("scale_v", "do_fp8"), ("scale_do", "do_fp8"),
    ("qt8", "ds_fp8"), ("kt8", "ds_fp8"),
    ("lse2", None), ("dsum", None), ("dq_acc", None), ("dq_turn", "deterministic"),
    ("dk", None), ("dv", None),
)


class BackwardHost:
    """Compile (once per process and variant), prepare, launch and finish one backward.

    ``kernel_name``: the module's KERNEL_NAME; ``config``: its kernel config (read here:
    head_dim, tile_m, tile_n, s_fp8, do_fp8, ds_fp8, deterministic); ``kernel``: the kernel
    class (``kernel(config)`` is the ``cute.compile`` target); ``prep``, ``quantize``: the
    device modules ``bwd_prep`` and ``quantize``; ``module_file``: the generated module's
    path, whose text keys the compile cache ('' or unreadable: compile in memory only, so
    two modules never share an entry)."""

    def __init__(self, kernel_name: str, config, kernel: Callable, *, prep, quantize, module_file: str = ""):
        self.kernel_name = kernel_name
        self.config = config
        self.kernel = kernel
        self.prep = prep
        self.quantize = quantize
        self.module_file = module_file
        self._compiled = {}  # (arch, tvm_ffi, gqa) -> compiled kernel

    # ------------------------------------------------------------------ compile

    def present(self, name: str) -> bool:
        """Whether the kernel reads tensor ``name`` (a ``KERNEL_TENSORS`` entry) in this variant."""
        flag = dict(KERNEL_TENSORS)[name]
        return flag is None or bool(getattr(self.config, flag))

    def kernel_args(self, tensors) -> list:
        """The kernel's tensor arguments from the ones this variant reads (``tensors``, in
        ``KERNEL_TENSORS`` order, as ``backward`` passes them to ``launch``): None for the rest."""
        it = iter(tensors)
        out = [next(it) if self.present(name) else None for name, _ in KERNEL_TENSORS]
        if next(it, None) is not None:
            raise ValueError(f"{self.kernel_name} backward: more kernel arguments than this variant reads")
        return out

    def fake_args(self, dkv_fp32: bool):
        """Compile-time arguments: compact tensors with symbolic sizes (no GPU), in the kernel's
        ``__call__`` order."""
        import cutlass
        import cutlass.cute as cute
        from cutlass import Float32, Int32
        from cutlass.cute.runtime import make_fake_compact_tensor as fake

        cfg = self.config
        BF16, FP8 = cutlass.BFloat16, cutlass.Float8E4M3FN
        sym = cute.sym_int
        b, sq, sk, h, hkv, sqp = sym(), sym(), sym(), sym(), sym(), sym()
        d = cfg.head_dim
        bshd = dict(stride_order=(3, 2, 1, 0), assumed_align=16)
        tiles = dict(stride_order=(4, 3, 2, 1, 0), assumed_align=16)
        t = dict(q=fake(BF16, (b, sq, h, d), **bshd), k=fake(BF16, (b, sk, hkv, d), **bshd),
                 v=fake(FP8 if cfg.do_fp8 else BF16, (b, sk, hkv, d), **bshd),
                 do=fake(FP8 if cfg.do_fp8 else BF16, (b, sq, h, d), **bshd))
        if cfg.s_fp8:
            nbq, nbk = sym(), sym()
            t.update(q8=fake(FP8, (b, sq, h, d), **bshd), k8=fake(FP8, (b, sk, hkv, d), **bshd),
                     scale_q=fake(Float32, (b, h, nbq), stride_order=(2, 1, 0), assumed_align=4),
                     scale_k=fake(Float32, (b, hkv, nbk), stride_order=(2, 1, 0), assumed_align=4))
        if cfg.do_fp8:
            t.update(dot8=fake(FP8, (b, h, sym(), d, cfg.tile_m), **tiles),
                     scale_v=fake(Float32, (b, hkv), stride_order=(1, 0), assumed_align=4),
                     scale_do=fake(Float32, (b, h), stride_order=(1, 0), assumed_align=4))
        if cfg.ds_fp8:
            t.update(qt8=fake(FP8, (b, h, sym(), d, cfg.tile_m), **tiles),
                     kt8=fake(FP8, (b, hkv, sym(), d, cfg.tile_n), **tiles))
        t.update(lse2=fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=16),
                 dsum=fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=16),
                 dq_acc=fake(Float32, (b, h, sqp, d), **bshd))
        if cfg.deterministic:
            nqb = sym()
            t["dq_turn"] = fake(Int32, (b, h, nqb), stride_order=(2, 1, 0), assumed_align=4)
        dkv = Float32 if dkv_fp32 else BF16
        t.update(dk=fake(dkv, (b, sk, h, d), **bshd), dv=fake(dkv, (b, sk, h, d), **bshd))
        return (*[t.get(name) for name, _ in KERNEL_TENSORS], Float32(1.0), Float32(1.0), Int32(0))

    def compile(self, arch: Optional[str] = None, tvm_ffi: Optional[bool] = None, gqa: bool = False):
        """The compiled backward of one variant (``gqa``: dK/dV written as fp32 per query head,
        summed on the host; else bf16); sizes and addresses are run-time. ``arch`` given
        (compile_only; only "sm_90a"): compiled here, in memory; None: through the compile
        cache."""
        if arch not in (None, ARCH):
            raise ValueError(f"{self.kernel_name} backward is a Hopper kernel: arch must be {ARCH!r}, got {arch!r}")
        tvm_ffi = cache.tvm_ffi_available() if tvm_ffi is None else tvm_ffi
        return cache.host_kernel(self._compiled, (arch, tvm_ffi, gqa),
                                 lambda: (self.kernel(self.config), self.fake_args(gqa)), gpu_arch=ARCH,
                                 tvm_ffi=tvm_ffi, here=arch is not None, name="backward",
                                 variant=f"arch={ARCH},tvm_ffi={tvm_ffi},gqa={gqa}", source_of=self.module_file)

    def compile_only(self, arch: str = ARCH) -> list:
        """Compile the backward kernel (both dK/dV variants) and its pre/post-processing kernels
        for ``arch`` without a GPU; returns the names compiled."""
        if arch != ARCH:
            raise ValueError(f"{self.kernel_name} backward is a Hopper kernel: arch must be {ARCH!r}, got {arch!r}")
        self.compile(arch, tvm_ffi=False, gqa=False)
        self.compile(arch, tvm_ffi=False, gqa=True)
        names = [self.kernel_name + ".backward", self.kernel_name + ".backward_gqa"]
        return names + self.prep.compile_only(arch, self.config.head_dim)

    # ------------------------------------------------------------------ run

    def backward(self, q, k, v, o, lse, do, *, softmax_scale=None, prepared=None, launch: Callable):
        """The generated module's ``backward`` (its docstring states the contract).
        ``launch(args, softmax_scale, causal_offset, gqa)`` runs the kernel on the tensors it
        reads (``KERNEL_TENSORS`` order): the module passes its ``_bwd_launch`` so that tests
        can stand in for the kernel."""
        import torch

        from fp4gen.runtime import checks

        cfg, kernel, prep = self.config, self.kernel_name, self.prep
        checks.check_softmax_scale(kernel, softmax_scale)
        checks.check_backward(kernel, q, k, v, o, lse, do, dtypes=(torch.bfloat16,), head_dim=cfg.head_dim)
        checks.require_arch(ARCH, kernel=kernel, device=q.device)
        q, k, v, do, o = self.operands(q, k, v, do, o, prepared)
        B, Sq, H, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        scale = float(softmax_scale) if softmax_scale is not None else D ** -0.5
        dev = q.device
        sqp = -(-Sq // cfg.tile_m) * cfg.tile_m
        # preprocessing: LSE in log2 units (+inf where the forward saw nothing, so P = 0),
        # D_i = rowsum(dO * O), a zeroed fp32 dQ accumulator; padded to whole query tiles.
        # On CUDA one fused kernel (fp4gen.device.bwd_prep); the torch path is the same
        # arithmetic for CPU tensors (the host tests emulate the kernel there).
        fp8 = {}  # the FP8 operands and their scales, by KERNEL_TENSORS name
        if cfg.s_fp8:
            fp8.update(self._fp8_qk(q, k, prepared))
        if cfg.do_fp8:
            # dO in FP8, one scale per (batch, head), in both layouts: natural (for dP) and dO^T
            # (queries contiguous, permuted per 32 like the FP8 forward's V^T, for dV); D_i from the
            # dequantized dO, which is what dP sees. Two passes over dO: its amax, then everything else.
            lse2, dsum, dq_acc, do_in, fp8["dot8"], scale_do = prep.preprocess_fp8(o, do, lse, sqp)
            if cfg.s_fp8:
                # V's per-head scale is the forward's (quantize_inputs computes it by the same contract),
                # and so is its natural payload when the forward wrote one (for_backward=True)
                scale_v = prepared[5] if prepared is not None else prep.scale_per_head(v)
                v_in = prepared[6] if prepared is not None and len(prepared) > 6 else prep.quantize_per_head(v, scale_v)
            else:
                scale_v = prep.scale_per_head(v)
                v_in = prep.quantize_per_head(v, scale_v)
            fp8["scale_v"], fp8["scale_do"] = scale_v.contiguous(), scale_do.contiguous()
        else:
            if q.is_cuda:
                lse2, dsum, dq_acc = prep.preprocess(o, do, lse, sqp)
            else:
                lse2, dsum, dq_acc = bwd_common.preprocess_torch(o, do, lse, sqp)
            do_in, v_in = do, v
        if cfg.deterministic:
            fp8["dq_turn"] = torch.zeros((B, H, sqp // cfg.tile_m), dtype=torch.int32, device=dev)
        # GQA: fp32 dK/dV per query head, summed over each group below; else bf16 directly
        dk_h, dv_h = bwd_common.dkv_per_query_head(k, H)
        named = dict(q=q, k=k, v=v_in, do=do_in, lse2=lse2, dsum=dsum, dq_acc=dq_acc, dk=dk_h, dv=dv_h, **fp8)
        args = tuple(named[name] for name, _ in KERNEL_TENSORS if self.present(name))
        launch(args, scale, Sk - Sq, H > Hkv)
        if q.is_cuda:
            dq = prep.postprocess(dq_acc, Sq, scale)
        else:
            dq = (prep.dq_fragments_to_rows(dq_acc)[:, :, :Sq] * scale).permute(0, 2, 1, 3).to(q.dtype)
        dk, dv = bwd_common.gqa_sum(dk_h, dv_h, k, v)
        return dq.contiguous(), dk, dv

    def operands(self, q, k, v, do, o, prepared):
        """q, k, v, do, o as this variant's kernels take them, copied (``.contiguous()``) only where
        one reads compact rows: the backward kernel's bf16 TMA loads, compiled for compact tensors
        (Q and K unless dS is FP8, which reads the forward's transposed copies instead; V unless dP
        is FP8), and ``bwd_prep``'s kernels (dO and O; V when they quantize it because ``prepared``
        has no V payload). An operand no kernel reads (only its shape) goes as it lies, e.g. a
        fused QKV projection's view, when the compiled kernel's argument accepts its strides
        (``_fits_compiled``); the fused FP8 quantizer (no ``prepared``) reads Q and K in place."""
        cfg = self.config
        v_payload = cfg.s_fp8 and prepared is not None and len(prepared) > 6
        reads = dict(q=not cfg.ds_fp8, k=not cfg.ds_fp8, v=not (cfg.do_fp8 and v_payload))
        q, k, v = (x.contiguous() if reads[n] or not _fits_compiled(x, cfg.head_dim) else x
                   for n, x in (("q", q), ("k", k), ("v", v)))
        return q, k, v, do.contiguous(), o.contiguous()

    def _fp8_qk(self, q, k, prepared) -> dict:
        """reuse q k: the forward's FP8 Q/K payloads and block scales (and with ``ds_fp8`` their
        transposed copies), from ``prepared`` or quantized again by the same deterministic
        quantizer (bit-identical payloads and scales)."""
        import torch

        quant = self.quantize
        if prepared is not None:
            out = dict(q8=prepared[0], k8=prepared[1], scale_q=prepared[3], scale_k=prepared[4])
            if self.config.ds_fp8:
                # dS : fp8e4m3 reads Q and K through transposed copies of the same payloads
                # (quantize_inputs(..., for_backward=True, transposed_qk=True) writes them)
                if len(prepared) < 9:
                    raise ValueError(f"{self.kernel_name}.backward: prepared= needs the forward's transposed Q/K "
                                     f"payloads (quantize_inputs(q, k, v, for_backward=True, transposed_qk=True): "
                                     f"9 tensors), got {len(prepared)}")
                out.update(qt8=prepared[7], kt8=prepared[8])
                for name, x, op in (("qt8", q, "q"), ("kt8", k, "k")):
                    t, want = out[name], quant.transposed_shape(x.shape, op)
                    if tuple(t.shape) != want or t.dtype != torch.float8_e4m3fn:
                        raise ValueError(f"{self.kernel_name}.backward: prepared's {name} must be float8_e4m3fn of "
                                         f"shape {want} for these q, k; got {t.dtype} {tuple(t.shape)}")
        elif self.config.ds_fp8:
            q8, scale_q, qt8 = quant.quantize_blockwise(q, transposed="q")
            k8, scale_k, kt8 = quant.quantize_blockwise(k, transposed="k")
            out = dict(q8=q8, k8=k8, scale_q=scale_q, scale_k=scale_k, qt8=qt8, kt8=kt8)
        else:
            q8, scale_q = quant.quantize_blockwise(q)
            k8, scale_k = quant.quantize_blockwise(k)
            out = dict(q8=q8, k8=k8, scale_q=scale_q, scale_k=scale_k)
        out["scale_q"], out["scale_k"] = out["scale_q"].contiguous(), out["scale_k"].contiguous()
        return out

    def launch(self, args, softmax_scale, causal_offset, gqa):
        """Launch the compiled kernel on ``args`` (torch CUDA tensors this variant reads, in
        ``KERNEL_TENSORS`` order) on the current stream."""
        import torch

        with torch.cuda.device(args[0].device):
            tvm_ffi = cache.tvm_ffi_available()
            kern = self.compile(None, tvm_ffi, gqa)
            full = self.kernel_args(args)
            scalars = (float(softmax_scale) * math.log2(math.e), float(softmax_scale), int(causal_offset))
            if tvm_ffi:
                try:
                    kern(*full, *scalars)
                except ValueError:  # torch < 2.11 cannot export float8 through DLPack: pass the bytes
                    kern(*[_fp8_bytes(t) for t in full], *scalars)
                return
            import cuda.bindings.driver as cuda
            from cutlass import Float32, Int32

            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            kern(*[_cute_tensor(t) for t in full], Float32(scalars[0]), Float32(scalars[1]), Int32(scalars[2]),
                 stream)


def _fits_compiled(t: Any, head_dim: int) -> bool:
    """Whether the kernel compiled from ``fake_args``' compact (B, S, H, D) stand-ins accepts ``t``
    as it lies: their head stride is the static head dim, the token and batch strides symbolic
    multiples of it (CuTe DSL derives them so; TVM-FFI checks them at the call), rows contiguous,
    a 16-byte aligned base. A fused QKV projection's q/k/v views fit."""
    st = t.stride()
    return (st[3] == 1 and not t.data_ptr() & 15 and (st[2] == head_dim or t.shape[2] == 1)
            and st[1] % head_dim == 0 and st[0] % head_dim == 0)


def _fp8_bytes(t: Any):
    """A float8 tensor as its bytes (uint8 view); anything else as it is."""
    import torch

    return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e4m3fn else t


def _cute_tensor(t: Any):
    """The backward's arguments for the CuTe-ABI launch: its int32 turn counters are 4-byte aligned."""
    import torch

    return dlpack.cute_tensor(t, align4=(torch.int32,))
