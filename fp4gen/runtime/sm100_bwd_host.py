"""Host side of the generated sm100a attention backward: compile-time arguments, the compile
memo, the preprocessing (LSE in log2 units, D = rowsum(dO * O)), launch and the GQA sums
(docs/backward.md; docs/design/host-code.md).

One copy for every sm100a module with a backward. The module builds one ``BackwardHost``
from its plan-decided constants (a frozen ``BackwardConfig``) and its backward kernel-class
builder (``_bwd_build``) and binds ``compile_only_backward``, ``backward`` and
``_bwd_launch`` to it. Like ``sm100_host``, importing this module imports only the standard
library; torch and CuTe DSL are imported inside the functions that use them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from fp4gen.runtime import bwd_common, cache
from fp4gen.runtime.sm100_host import pin_compile_arch

ARCH = "sm_100a"
VARIANTS = ("bf16", "gqa")  # dK/dV written as bf16, or as fp32 per query head (GQA sums them)


@dataclass(frozen=True)
class BackwardConfig:
    """What the backward's host side needs of one generated module (its rendered constants)."""

    kernel_name: str  # KERNEL_NAME
    head_dim: int  # BWD_HEAD_DIM
    tile_m: int  # BWD_TILE_M: queries per step; dQ, LSE2 and D are padded to whole tiles
    softmax_scale: float  # SOFTMAX_SCALE: the spec's default scale
    # BWD_CONFIG.do_format: "bf16", or FP8 dO ("e4m3" / "e5m2", one scale per (batch, head)),
    # with V quantized as the forward does (E4M3, one scale per (batch, kv head))
    do_format: str = "bf16"

    @property
    def do_fp8(self) -> bool:
        return self.do_format != "bf16"


class BackwardHost:
    """Compile (once per process and variant), prepare, launch and finish one backward."""

    def __init__(self, config: BackwardConfig, build: Callable):
        self.config = config
        self.build = build  # () -> (Kernel, cutlass, cute)
        self._compiled = {}
        self.last_compiled = None  # the last compiled object (PTX kept by compile_only)

    def fake_args(self, cutlass, cute, dkv_fp32):
        """Compile-time arguments: compact (B, S, H, D) tensors with symbolic sizes (no GPU)."""
        from cutlass.cute.runtime import make_fake_compact_tensor as fake

        Float32, Int32, BF16 = cutlass.Float32, cutlass.Int32, cutlass.BFloat16
        fp8 = {"e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}
        v_t, do_t = (fp8["e4m3"], fp8[self.config.do_format]) if self.config.do_fp8 else (BF16, BF16)
        sym = cute.sym_int
        b, sq, sk, h, hkv, sqp, nqb = sym(), sym(), sym(), sym(), sym(), sym(), sym()
        d = self.config.head_dim
        bshd = dict(stride_order=(3, 2, 1, 0), assumed_align=16)
        q = fake(BF16, (b, sq, h, d), **bshd)
        k = fake(BF16, (b, sk, hkv, d), **bshd)
        v = fake(v_t, (b, sk, hkv, d), **bshd)
        do = fake(do_t, (b, sq, h, d), **bshd)
        lse2 = fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=16)
        dsum = fake(Float32, (b, h, sqp), stride_order=(2, 1, 0), assumed_align=16)
        dq = fake(Float32, (b, h, sqp, d), **bshd)
        turn = fake(Int32, (b, h, nqb), stride_order=(2, 1, 0), assumed_align=4)  # read only when deterministic
        dkv = Float32 if dkv_fp32 else BF16
        dk = fake(dkv, (b, sk, h, d), **bshd)
        dv = fake(dkv, (b, sk, h, d), **bshd)
        scales = fake(Float32, (b, h, 2), stride_order=(2, 1, 0), assumed_align=4)
        return (q, k, v, do, lse2, dsum, dq, turn, dk, dv, scales, Float32(1.0), Float32(1.0), Int32(0))

    def compiled(self, gqa=False, keep=False):
        """The compiled backward of one variant (sizes and addresses are run-time). ``keep``
        (compile_only): compile here, keeping the PTX; else through the compile cache every
        target uses (``fp4gen.runtime.cache.compiled_kernel``)."""
        if (gqa, keep) not in self._compiled:
            def build():
                Kernel, cutlass, cute = self.build()
                stream = cute.runtime.make_fake_stream()
                compile_fn = cute.compile[cute.KeepPTX] if keep else cute.compile
                return compile_fn(Kernel(), *self.fake_args(cutlass, cute, gqa), stream)

            self._compiled[(gqa, keep)] = build() if keep else cache.module_kernel(
                "backward", f"arch={ARCH},gqa={gqa}", build, cache.module_source(self.build))
        self.last_compiled = self._compiled[(gqa, keep)]
        return self.last_compiled

    def compile_only(self, arch: str = ARCH, variants=VARIANTS) -> list:
        """Compile the backward variants for ``arch`` without a GPU; returns the names compiled
        (``last_compiled`` holds the last one, its PTX kept for the conformance check)."""
        kernel = self.config.kernel_name
        if arch != ARCH:
            raise ValueError(f"{kernel} backward is a Blackwell kernel: arch must be 'sm_100a', got {arch!r}")
        pin_compile_arch(arch, "compile_only_backward")
        names = []
        for variant in variants:
            if variant not in VARIANTS:
                raise ValueError(f"unknown backward variant {variant!r} ({', '.join(VARIANTS)})")
            self.compiled(gqa=variant == "gqa", keep=True)
            names.append(kernel + (".backward" if variant == "bf16" else ".backward_gqa"))
        return names

    def backward(self, q, k, v, o, lse, do, *, softmax_scale, launch):
        """The generated module's ``backward`` after its sm_100 refusal (its docstring states
        the contract). ``launch(args, softmax_scale, causal_offset, gqa)`` runs the kernel: the
        module passes its ``_bwd_launch`` so that tests can stand in for the kernel."""
        import torch

        from fp4gen.runtime import checks

        kernel = self.config.kernel_name
        checks.check_softmax_scale(kernel, softmax_scale)
        checks.check_backward(kernel, q, k, v, o, lse, do, dtypes=(torch.bfloat16,), head_dim=self.config.head_dim)
        checks.require_arch(ARCH, kernel=kernel, device=q.device)
        q, k, v, do = (x.contiguous() for x in (q, k, v, do))  # compiled for compact (B, S, H, D)
        B, Sq, H, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        scale = float(softmax_scale) if softmax_scale is not None else self.config.softmax_scale
        dev = q.device
        tm = self.config.tile_m
        sqp = -(-Sq // tm) * tm
        v_in, do_in, scales = v, do, torch.ones((B, H, 2), dtype=torch.float32, device=dev)
        if self.config.do_fp8:
            v_in, do_in, do, scales = self.quantize_fp8(v, do, H)
        # preprocessing: LSE in log2 units and D = rowsum(dO * O), padded to whole query tiles
        # (with an FP8 dO, D is the sum over the dequantized dO that dP^T is made of)
        lse2, dsum, dq_acc = bwd_common.preprocess_torch(o, do, lse, sqp)
        dq_turn = torch.zeros((B, H, sqp // tm), dtype=torch.int32, device=dev)
        dk_h, dv_h = bwd_common.dkv_per_query_head(k, H)
        launch((q, k, v_in, do_in, lse2, dsum, dq_acc, dq_turn, dk_h, dv_h, scales), scale, Sk - Sq, H > Hkv)
        dq = (dq_acc[:, :, :Sq] * scale).permute(0, 2, 1, 3).to(q.dtype)
        dk, dv = bwd_common.gqa_sum(dk_h, dv_h, k, v)
        return dq.contiguous(), dk, dv

    def quantize_fp8(self, v, do, heads):
        """FP8 dO's operands, bit for bit what fp4gen.numerics.reference does for the spec:
        (V codes (B, Sk, Hkv, D) E4M3, dO codes (B, Sq, H, D), dO dequantized (fp32),
        scales (B, H, 2) fp32: dP^T's factor s_do s_v and dV's s_do / 2^8), codes as uint8."""
        import torch

        from fp4gen.numerics import quant
        from fp4gen.numerics.backward_rules import P_FP8_SCALE_LOG2
        from fp4gen.numerics.formats import E4M3, E5M2

        vq = quant.quantize_fp8(v, "tensor", fmt=E4M3)  # as the forward: one scale per (batch, kv head)
        dq8 = quant.quantize_fp8(do, "tensor", fmt={"e4m3": E4M3, "e5m2": E5M2}[self.config.do_format])
        s_v = vq.scale.to(torch.float32).repeat_interleave(heads // v.shape[2], dim=1)  # (B, H)
        s_do = dq8.scale.to(torch.float32)
        scales = torch.stack((s_do * s_v, s_do * 2.0 ** -P_FP8_SCALE_LOG2), dim=-1).contiguous()
        return (vq.codes.to(torch.uint8).contiguous(), dq8.codes.to(torch.uint8).contiguous(),
                dq8.dequantize(), scales)

    def launch(self, args, softmax_scale, causal_offset, gqa):
        """Launch the compiled kernel on ``args`` (torch CUDA tensors, in the kernel's
        ``__call__`` order)."""
        import torch

        with torch.cuda.device(args[0].device):
            import cuda.bindings.driver as cuda
            from cutlass import Float32, Int32
            from cutlass.cute.runtime import from_dlpack

            kern = self.compiled(gqa=gqa)

            def conv(t, align, elem=None):
                ct = from_dlpack(t, assumed_align=align)
                ct = ct.mark_layout_dynamic(leading_dim=t.dim() - 1)
                if elem is not None:  # FP8 codes travel as uint8
                    ct.element_type = elem
                return ct

            elems = [None] * len(args)
            aligns = [16] * len(args)
            aligns[7] = aligns[10] = 4  # the dQ turns (int32), the FP8 scales (fp32 x 2)
            if self.config.do_fp8:
                import cutlass

                elems[2] = cutlass.Float8E4M3FN
                elems[3] = {"e4m3": cutlass.Float8E4M3FN, "e5m2": cutlass.Float8E5M2}[self.config.do_format]
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            kern(*[conv(t, a, e) for t, a, e in zip(args, aligns, elems)], Float32(float(softmax_scale) * math.log2(math.e)),
                 Float32(float(softmax_scale)), Int32(int(causal_offset)), stream)
