"""Host side of the generated sm90a attention forward: argument checks, FP8 operand packing,
compile and launch (docs/design/host-code.md).

One copy for every sm90a module. A generated module builds one ``ForwardHost`` from its
config (``fp4gen.device.sm90.forward.ForwardConfig``: the host reads ``kernel_name``,
``head_dim``, ``in_fp8``, ``quant_block``, ``sinks``, ``varlen`` and ``extended``), its kernel builder (``_build() -> kernel
object``, defined in the module so that the compile cache is keyed by the module's source)
and, for FP8 inputs, the fused input quantizer (``fp4gen.device.quantize``), and binds its
host names to it (``forward``, ``run_prepared``, ``quantize_inputs``, ``compile_only``, ...).

Importing this module imports only the standard library: torch, CuTe DSL and fp4gen.numerics
are imported inside the functions that use them, and no compiler stage ever is.
"""
from __future__ import annotations

import math
import os
from typing import Callable


ARCH = "sm_90a"


def _reads_offsets(cu_q, cu_k) -> bool:
    """Whether check_varlen reads the offsets' values to the host: when they are there already,
    or in the FP4GEN_CHECK_OFFSETS=1 debug mode (a sync per call on the GPU)."""
    import os

    return (cu_q.device.type == "cpu" and cu_k.device.type == "cpu") or os.environ.get("FP4GEN_CHECK_OFFSETS") == "1"


class ForwardHost:
    """The host side of one generated sm90a forward. Holds its compiled kernels (one per
    calling convention: TVM-FFI or CuTe's own; one compile serves every B, S, H)."""

    def __init__(self, config, build: Callable, quantizer=None):
        if config.in_fp8 and quantizer is None:
            raise ValueError(f"{config.kernel_name}: an FP8 forward needs its input quantizer")
        self.config = config
        self.build = build
        self.quantizer = quantizer  # fp4gen.device.quantize for FP8 inputs, else None
        self._compiled = {}  # tvm_ffi -> compiled kernel
        self._fp8_as_uint8 = None  # TVM-FFI: whether float8 tensors go as uint8 views (torch < 2.11)

    # ------------------------------------------------------------------ compile

    def fake_args(self):
        """Symbolic-shape stand-ins for every kernel argument (no GPU needed)."""
        import cutlass
        import cutlass.cute as cute
        from cutlass import Float32, Int32
        from cutlass.cute.runtime import make_fake_compact_tensor as fake

        cfg = self.config
        dtype = cutlass.Float8E4M3FN if cfg.in_fp8 else cutlass.BFloat16
        sym = cute.sym_int
        b, sq, sk, h, hkv = sym(), sym(), sym(), sym(), sym()
        d = cfg.head_dim
        q = fake(dtype, (b, sq, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
        k = fake(dtype, (b, sk, hkv, d), stride_order=(3, 2, 1, 0), assumed_align=16)
        if cfg.in_fp8:
            skp = sym(divisibility=32)
            v = fake(dtype, (b, hkv, d, skp), stride_order=(3, 2, 1, 0), assumed_align=16)
            nqb, nkb = sym(), sym()
            sq_scale = fake(Float32, (b, h, nqb), stride_order=(2, 1, 0), assumed_align=4)
            sk_scale = fake(Float32, (b, hkv, nkb), stride_order=(2, 1, 0), assumed_align=4)
            sv_scale = fake(Float32, (b, hkv), stride_order=(1, 0), assumed_align=4)
            ins = (q, k, v, sq_scale, sk_scale, sv_scale)
        else:
            v = fake(dtype, (b, sk, hkv, d), stride_order=(3, 2, 1, 0), assumed_align=16)
            ins = (q, k, v)
        o = fake(cutlass.BFloat16, (b, sq, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
        lse = fake(Float32, (b, h, sq), stride_order=(2, 1, 0), assumed_align=4)
        if not cfg.extended:
            return (*ins, o, lse, Int32(1), Float32(1.0), Int32(0))
        # ExtForwardKernel: every operand, None where the config reads none
        scales = ins[3:] if cfg.in_fp8 else (None, None, None)
        sinks = fake(Float32, (h,), assumed_align=4) if cfg.sinks else None
        cu_q = cu_k = None
        if cfg.varlen:
            tq, tk, nb1 = sym(), sym(), sym()
            q = fake(dtype, (tq, h, d), stride_order=(2, 1, 0), assumed_align=16)
            k = fake(dtype, (tk, hkv, d), stride_order=(2, 1, 0), assumed_align=16)
            if cfg.in_fp8:
                # quantize_inputs_varlen's operands: V^T (Hkv, D, Tkp), per-token Q/K scales,
                # one V scale per (sequence, kv head)
                v = fake(dtype, (hkv, d, sym(divisibility=32)), stride_order=(2, 1, 0), assumed_align=16)
                scales = (fake(Float32, (sym(), h), stride_order=(1, 0), assumed_align=4),
                          fake(Float32, (sym(), hkv), stride_order=(1, 0), assumed_align=4),
                          fake(Float32, (sym(), hkv), stride_order=(1, 0), assumed_align=4))
            else:
                v = fake(dtype, (tk, hkv, d), stride_order=(2, 1, 0), assumed_align=16)
            ins = (q, k, v)
            o = fake(cutlass.BFloat16, (tq, h, d), stride_order=(2, 1, 0), assumed_align=16)
            lse = fake(Float32, (h, tq), stride_order=(1, 0), assumed_align=4)
            cu_q = fake(Int32, (nb1,), assumed_align=4)
            cu_k = fake(Int32, (nb1,), assumed_align=4)
        return (*ins[:3], *scales, o, lse, sinks, cu_q, cu_k, Int32(1), Int32(1), Float32(1.0), Int32(0))

    def compile(self, arch=None, tvm_ffi=None):
        """The compiled forward; symbolic shapes let one compile serve every B, S, H.

        At run time (``arch`` None) through ``fp4gen.runtime.cache.compiled_kernel``: in
        memory, then a verified disk entry keyed by the generated module's source (read from
        the file that defines ``build``; a module whose source cannot be read compiles in
        memory only), the calling convention and the CuTe DSL version. With ``arch``
        (``compile_only``) a plain compile in memory.
        """
        from fp4gen.runtime import cache

        tvm_ffi = cache.tvm_ffi_available() if tvm_ffi is None else tvm_ffi
        return cache.host_kernel(self._compiled, tvm_ffi, lambda: (self.build(), self.fake_args()), gpu_arch=ARCH,
                                 tvm_ffi=tvm_ffi, here=arch is not None, name="forward",
                                 variant=f"arch={ARCH},tvm_ffi={tvm_ffi}", source_of=self.build)

    def compile_only(self, arch: str = ARCH) -> list:
        """Compile the forward (and the FP8 input quantizer) for ``arch`` without a GPU;
        returns the names compiled."""
        cfg = self.config
        if arch != ARCH:
            raise ValueError(f"{cfg.kernel_name} is a Hopper kernel: arch must be {ARCH!r}, got {arch!r}")
        self.compile(arch, tvm_ffi=False)
        names = [cfg.kernel_name]
        if cfg.in_fp8 and not cfg.varlen and cfg.head_dim in self.quantizer.SUPPORTED_HEAD_DIMS:
            # the fused input quantizer; other head dims (96, 192) and varlen quantize on the torch path
            names += self.quantizer.compile_only(arch, cfg.head_dim)
        return names

    # ------------------------------------------------------------------ operands

    def check(self, q, k, v, softmax_scale):
        """User-facing argument checks (fp4gen.runtime.checks); returns the sizes."""
        import torch

        from fp4gen.runtime import checks

        kernel = self.config.kernel_name
        checks.check_softmax_scale(kernel, softmax_scale)
        sizes = checks.check_qkv(kernel, q, k, v, dtypes=(torch.bfloat16,), head_dim=self.config.head_dim)
        checks.require_arch(ARCH, kernel=kernel, device=q.device)
        return sizes

    def check_sinks(self, sinks, q, heads: int):
        """The (H,) fp32 sink logits the kernel reads: required with ``sinks learned``, refused
        without; any float dtype on q's device (converted to fp32)."""
        import torch

        from fp4gen.runtime.checks import AttentionInputError

        cfg = self.config
        if not cfg.sinks:
            if sinks is not None:
                raise AttentionInputError(f"{cfg.kernel_name}: this kernel has no sinks (its spec has no "
                                          "'sinks learned' line); got sinks=")
            return None
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or not torch.is_floating_point(sinks):
            got = f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise AttentionInputError(f"{cfg.kernel_name}: sinks learned: pass sinks=, a 1-D float tensor (H,) = "
                                      f"({heads},) of sink logits; got {got}")
        if sinks.shape != (heads,):
            raise AttentionInputError(f"{cfg.kernel_name}: sinks must have one logit per query head, shape "
                                      f"({heads},); got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise AttentionInputError(f"{cfg.kernel_name}: sinks are on {sinks.device}, q on {q.device}")
        return sinks.to(torch.float32).contiguous()

    def check_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
        """The packed layout's checks: q (total_q, H, D), k, v (total_k, Hkv, D) bf16 on an sm90a
        GPU, laid out for TMA; cu_seqlens int32 (int64 is converted) of B + 1 offsets from 0 to
        the totals, never decreasing; max_seqlen bounds. Returns (cu_q, cu_k int32, the grid's
        query rows, ok): ``ok`` None when the offsets were checked here, else a 0-d bool tensor
        on the GPU (``numerics.masking.offsets_valid``) for ``forward_varlen`` to act on.

        The offsets' values are read to the host (``numerics.masking.segments``, clear errors)
        only when they are already there (CPU tensors) or with FP4GEN_CHECK_OFFSETS=1 (a debug
        mode): on the GPU that read is a sync on every call (issue 24), so by default only
        their shapes are checked here and their values on the device."""
        import torch

        from fp4gen.numerics import masking
        from fp4gen.runtime import checks

        cfg = self.config
        kernel = cfg.kernel_name
        checks.check_softmax_scale(kernel, softmax_scale)
        named = (("q", q, ("total_q", "H", "D")), ("k", k, ("total_k", "Hkv", "D")), ("v", v, ("total_k", "Hkv", "D")))
        # shapes and offsets first, the device last: the CPU tests reach every check but the GPU's
        for name, t, dims in named:
            checks.check_tensor(kernel, name, t, dtypes=(torch.bfloat16,), dims=dims, head_dim=cfg.head_dim,
                                device_type=None)
        if k.shape != v.shape:
            raise checks.AttentionInputError(f"{kernel}: k and v must have one shape (total_k, Hkv, D); got "
                                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        H, Hkv = q.shape[1], k.shape[1]
        if H == 0 or Hkv == 0 or H % Hkv:
            raise checks.AttentionInputError(f"{kernel}: the number of query heads ({H}) must be a positive multiple "
                                             f"of the number of key/value heads ({Hkv})")
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
                raise checks.AttentionInputError(f"{kernel}: {name} must be an int >= 0 (the longest sequence), "
                                                 f"got {m!r}")
        total_q, total_k = q.shape[0], k.shape[0]
        ok = None
        try:
            masking.check_offset_tensors(cu_seqlens_q, cu_seqlens_k, who=kernel)
            if _reads_offsets(cu_seqlens_q, cu_seqlens_k):
                segs = masking.segments(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q=max_seqlen_q,
                                        max_seqlen_k=max_seqlen_k, who=kernel)
                rows_q = max(q1 - q0 for q0, q1, _, _ in segs)
            else:
                ok = masking.offsets_valid(cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
                # no sequence of valid offsets is longer than max_seqlen_q (ok checks it) or total_q
                rows_q = total_q if max_seqlen_q is None else min(max_seqlen_q, total_q)
        except ValueError as e:
            raise checks.AttentionInputError(str(e)) from None
        checks.check_tensor(kernel, "q", q, dtypes=(torch.bfloat16,), dims=named[0][2], head_dim=cfg.head_dim)
        checks.check_same_device(kernel, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        checks.require_arch(ARCH, kernel=kernel, device=q.device)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.numel():
                checks.check_tma_layout(kernel, name, t)
        cu_q, cu_k = (c.to(torch.int32).contiguous() for c in (cu_seqlens_q, cu_seqlens_k))
        return cu_q, cu_k, rows_q, ok

    def quantize(self, x, per_block: bool, fast: bool = True):
        """(B, S, H, D) bf16 -> e4m3 payload (B, S, H, D) and fp32 scales (B, H, nblk) or (B, H).

        Contract (numerics oracle): scale = amax / 448 (1 where amax == 0), payload =
        e4m3_rne(x / scale), saturating; one scale per ``quant_block`` tokens (``per_block``)
        or per (batch, head). ``fast``: the same arithmetic with torch's own
        round-to-nearest-even float8 cast (tests check it bit-equal to the oracle's quantizers);
        otherwise the oracle's quantizers themselves.
        """
        import torch

        from fp4gen.numerics.formats import E4M3

        blk = self.config.quant_block
        if not fast:
            from fp4gen.numerics.quant import quantize_fp8_blockwise, quantize_fp8_tensor

            if per_block:
                t = quantize_fp8_blockwise(x, block=blk, dim=1)
                return t.payload, t.scale.permute(0, 2, 1).contiguous()  # (B, nb, H) -> (B, H, nb)
            t = quantize_fp8_tensor(x)
            return t.payload, t.scale.contiguous()
        fmax = E4M3.max_value
        B, S, H, D = x.shape
        xf = x.float()
        if per_block:
            nb = (S + blk - 1) // blk
            pad = nb * blk - S
            xp = torch.nn.functional.pad(xf, (0, 0, 0, 0, 0, pad)) if pad else xf
            amax = xp.view(B, nb, blk, H, D).abs().amax(dim=(2, 4))  # (B, nb, H)
            scale = torch.where(amax == 0, torch.ones_like(amax), amax / fmax)
            full = scale.repeat_interleave(blk, dim=1)[:, :S, :, None]
            payload = (xf / full).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
            return payload, scale.permute(0, 2, 1).contiguous()
        amax = xf.abs().amax(dim=(1, 3))  # (B, H)
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / fmax)
        payload = (xf / scale[:, None, :, None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        return payload, scale.contiguous()

    def v_operand(self, v8):
        """(B, Sk, Hkv, D) e4m3 -> V^T (B, Hkv, D, Skp): keys contiguous, padded to 32, keys
        permuted inside each 32-block to match P's register order (the quantizer's
        ``FP8_P_KEY_PERM``, from fp4gen.device.layout)."""
        import torch

        B, S, H, D = v8.shape
        skp = (S + 31) // 32 * 32
        vt = torch.zeros((B, H, D, skp), dtype=torch.uint8, device=v8.device)
        vt[..., :S] = v8.view(torch.uint8).permute(0, 2, 3, 1)
        perm = torch.tensor(self.quantizer.FP8_P_KEY_PERM, device=v8.device)
        idx = (torch.arange(skp // 32, device=v8.device)[:, None] * 32 + perm[None, :]).reshape(-1)
        return vt.index_select(3, idx).contiguous().view(torch.float8_e4m3fn)

    def quantize_inputs(self, q, k, v, fast: bool = True, for_backward: bool = False,
                        transposed_qk: bool = False):
        """bf16 q, k, v -> the kernel's FP8 operands (q8, k8, vt8, scale_q, scale_k, scale_v).

        ``fast``: on CUDA, the fused CuTe DSL quantizer (fp4gen.device.quantize: 4 launches,
        memory bound, bit-identical to the torch path); ``fast=False``, or tensors it does not
        take (not on CUDA, other head dims), use the torch path (``quantize``, ``v_operand``).
        ``for_backward``: a seventh tensor, v8, V's payload in its own (B, Sk, Hkv, D) layout,
        written by the same pass; an FP8 backward given these ``prepared`` reads it instead of
        quantizing V again. ``transposed_qk`` (with ``for_backward``): two more, the transposed
        copies of Q's and K's payloads that a backward with FP8 dS reads
        (``fp4gen.device.quantize.TRANSPOSED_TILES``), written by the same Q and K passes.
        """
        dq = self.quantizer
        if transposed_qk and not for_backward:
            raise ValueError("quantize_inputs: transposed_qk=True needs for_backward=True")
        if fast and q.is_cuda and self.config.head_dim in dq.SUPPORTED_HEAD_DIMS:
            return dq.quantize_inputs(q, k, v, for_backward=for_backward, transposed_qk=transposed_qk)
        q8, sq = self.quantize(q, True)
        k8, sk = self.quantize(k, True)
        v8, sv = self.quantize(v, False)
        out = (q8, k8, self.v_operand(v8), sq, sk, sv) + ((v8,) if for_backward else ())
        if transposed_qk:
            out += (dq.transposed_operand(q8, "q"), dq.transposed_operand(k8, "k"))
        return out

    def quantize_inputs_varlen(self, q, k, v, cu_q, cu_k, fast: bool = True):
        """Packed bf16 q (total_q, H, D), k, v (total_k, Hkv, D) and int32 offsets -> the FP8
        varlen kernel's operands (q8, k8, vt8, scale_q, scale_k, scale_v), on the torch path
        (a fused varlen quantizer in fp4gen.device.quantize is later work).

        Scale layout (docs/runtime.md, "FP8 varlen"): blocks of ``quant_block`` tokens restart
        at every sequence start, so no block straddles two sequences and each sequence gets the
        scales it would get alone (the reference's per-sequence quantization, bit-equal).
        scale_q (total_q, H) and scale_k (total_k, Hkv) hold each token's block scale; the
        kernel reads the one of a tile's first token, cu_seqlens[b] + tile * 128 (a tile is a
        block). scale_v (B, Hkv): one per (sequence, kv head). vt8: ``v_operand_varlen``.
        ``fast``: torch's own RNE float8 cast (bit-equal to the oracle's ``encode``, tested);
        otherwise ``numerics.quant.quantize_fp8_varlen`` itself. No host read of the offsets."""
        import torch

        from fp4gen.numerics import quant
        from fp4gen.numerics.formats import E4M3

        blk = self.config.quant_block
        if not fast:
            tq, tk = quant.quantize_fp8_varlen(q, cu_q, "block", blk), quant.quantize_fp8_varlen(k, cu_k, "block", blk)
            tv = quant.quantize_fp8_varlen(v, cu_k, "tensor")
            return (tq.payload.contiguous(), tk.payload.contiguous(), self.v_operand_varlen(tv.payload, cu_k),
                    tq.scale.contiguous(), tk.scale.contiguous(), tv.scale.contiguous())
        fmax = E4M3.max_value

        def cast(x, s):  # s (total, Hx): each token's scale
            return (x.float() / s[..., None]).clamp(-fmax, fmax).to(torch.float8_e4m3fn).contiguous()

        recip = torch.tensor(1.0 / fmax, dtype=torch.float32, device=q.device)  # as quant._fp8_scale

        def scale_of(amax):
            s = amax * recip
            return torch.where(s == 0, torch.ones_like(s), s)

        out = []
        for x, cu in ((q, cu_q), (k, cu_k)):
            ids, n = quant.varlen_block_ids(cu, x.shape[0], blk)
            s = scale_of(quant.group_amax(x.float(), ids, n))[ids].contiguous()  # (total, Hx)
            out.append((cast(x, s), s))
        seq, _ = quant.varlen_token_positions(cu_k, v.shape[0])
        sv = scale_of(quant.group_amax(v.float(), seq, max(cu_k.numel() - 1, 1))).contiguous()  # (B, Hkv)
        v8 = cast(v, sv[seq])
        return (out[0][0], out[1][0], self.v_operand_varlen(v8, cu_k), out[0][1], out[1][1], sv)

    def v_operand_varlen(self, v8, cu_k):
        """Packed (total_k, Hkv, D) e4m3 -> V^T (Hkv, D, Tkp), keys contiguous: sequence b's
        keys start at column ``config.varlen_v_start(cu_k[b], b)`` (cu_k[b] rounded up to 16
        bytes, TMA's alignment for a box of this byte-wide tensor, plus 48 b), permuted inside
        each 32-key block counted from that start (``FP8_P_KEY_PERM``, as ``v_operand`` per
        sequence), the rest zero. The spacing leaves room for each sequence's last partial
        block, so no two sequences share a 32-key block and the kernel finds the start without
        another offsets tensor; Tkp is the start after the last sequence rounded up to 32
        (TMA's 16-byte strides). No host read of the offsets."""
        import torch

        from fp4gen.numerics import quant

        total, H, D = v8.shape
        cu = cu_k.to(torch.int64)
        nseq = cu.numel() - 1
        tkp = (self.config.varlen_v_start(total, nseq) + 31) // 32 * 32
        dev = v8.device
        start = self.config.varlen_v_start(cu, torch.arange(nseq + 1, device=dev))  # each sequence's first column
        b, j = quant.varlen_token_positions(start, tkp)  # each column's sequence and place in it
        perm = torch.tensor(self.quantizer.FP8_P_KEY_PERM, device=dev)
        src = cu[b] + j // 32 * 32 + perm[j % 32]
        valid = (j >= 0) & (src < cu[b + 1])
        gathered = v8.view(torch.uint8)[src.clamp(0, max(total - 1, 0))]  # (Tkp, Hkv, D)
        gathered = torch.where(valid[:, None, None], gathered, torch.zeros_like(gathered))
        return gathered.permute(1, 2, 0).contiguous().view(torch.float8_e4m3fn)

    def bench_inputs(self, q, k, v):
        """For bench/attention.py: time the kernel alone, with the quantization done beforehand."""
        return (q, k, v), {"prepared": self.quantize_inputs(q, k, v)}

    # ------------------------------------------------------------------ launch

    def forward(self, q, k, v, *, softmax_scale=None, return_lse=False, prepared=None, sinks=None):
        """The generated module's ``forward`` (its docstring states the contract)."""
        import torch

        from fp4gen.runtime.checks import AttentionInputError

        if self.config.varlen:
            raise AttentionInputError(f"{self.config.kernel_name} is a varlen kernel (layout varlen): call "
                                      "forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)")
        sizes = self.check(q, k, v, softmax_scale)
        sinks = self.check_sinks(sinks, q, q.shape[2])
        B, Sq, H, D = q.shape
        Sk = sizes.seqlen_k
        causal_offset = Sk - Sq
        scale = float(softmax_scale) if softmax_scale is not None else D ** -0.5
        o = torch.empty_like(q)
        lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
        if self.config.in_fp8:
            ins = prepared[:6] if prepared is not None else self.quantize_inputs(q, k, v)
        else:
            ins = (q, k, v)
        self.run_prepared(ins, o, lse, Sk, scale, causal_offset, sinks=sinks)
        return (o, lse) if return_lse else o

    def forward_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                       softmax_scale=None, return_lse=False, sinks=None):
        """The generated module's ``forward_varlen`` (its docstring states the contract)."""
        import torch

        from fp4gen.runtime.checks import AttentionInputError

        cfg = self.config
        if not cfg.varlen:
            raise AttentionInputError(f"{cfg.kernel_name} takes dense (B, S, H, D) batches: call forward(q, k, v) "
                                      "(a varlen kernel needs 'layout varlen' in its spec)")
        cu_q, cu_k, rows_q, ok = self.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                   softmax_scale)
        sinks = self.check_sinks(sinks, q, q.shape[1])
        total_q, H, D = q.shape
        scale = float(softmax_scale) if softmax_scale is not None else D ** -0.5
        if ok is None:  # offsets checked on the host
            o = torch.zeros_like(q)
            lse = torch.full((H, total_q), float("-inf"), dtype=torch.float32, device=q.device)
        else:
            # Offsets on the GPU, not read here (no sync). The kernel indexes q, o and lse by them
            # with no bound of its own (its O/LSE stores would land past the tensors), so invalid
            # ones never reach it: it gets all-zero offsets instead (every sequence empty: no tile
            # loads keys or stores a row), and o and lse come back NaN, not plausible zeros.
            # FP4GEN_CHECK_OFFSETS=1 raises the clear error instead (check_varlen).
            zero = torch.zeros_like(cu_q)
            cu_q, cu_k = torch.where(ok, cu_q, zero), torch.where(ok, cu_k, zero)
            o = torch.empty_like(q)
            o.copy_(torch.where(ok, 0.0, float("nan")).expand(o.shape))
            lse = torch.where(ok, float("-inf"), float("nan")).to(torch.float32).expand(H, total_q).contiguous()
        if total_q and k.shape[0]:  # no TMA descriptor of an empty tensor: no keys, no launch
            ins = self.quantize_inputs_varlen(q, k, v, cu_q, cu_k) if cfg.in_fp8 else (q, k, v)
            self.run_prepared(ins, o, lse, 0, scale, 0, sinks=sinks, cu_seqlens=(cu_q, cu_k),
                              max_seqlen_q=rows_q)
        elif sinks is not None:
            lse.copy_(sinks[:, None].expand(H, total_q))  # a row that sees no key: O = 0, LSE = the sink
            if ok is not None:
                lse.masked_fill_(~ok, float("nan"))
        return (o, lse) if return_lse else o

    def run_prepared(self, ins, o, lse, seqlen_k, softmax_scale, causal_offset=0, *, sinks=None, cu_seqlens=None,
                     max_seqlen_q=0):
        """Launch on already prepared operands (``ins`` as ``forward`` builds them; ``sinks``,
        ``cu_seqlens`` = (cu_q, cu_k) and ``max_seqlen_q`` for the extended kernel)."""
        import torch

        from fp4gen.runtime import cache

        cfg = self.config
        if cfg.extended:
            # ExtForwardKernel's order: q, k, v, three FP8 scales, o, lse, sinks, cu_q, cu_k
            cu_q, cu_k = cu_seqlens if cu_seqlens is not None else (None, None)
            tensors = (*ins[:3], *(ins[3:6] if cfg.in_fp8 else (None,) * 3), o, lse, sinks, cu_q, cu_k)
            scalars = (int(seqlen_k), int(max_seqlen_q), float(softmax_scale) * math.log2(math.e),
                       int(causal_offset))
        else:
            tensors = (*ins, o, lse)
            scalars = (int(seqlen_k), float(softmax_scale) * math.log2(math.e), int(causal_offset))
        with torch.cuda.device(o.device):
            tvm_ffi = cache.tvm_ffi_available()
            kern = self.compile(None, tvm_ffi)
            if tvm_ffi:
                if self._fp8_as_uint8 is None:
                    # torch >= 2.11 exports float8 through DLPack; older torch needs a uint8 view
                    try:
                        kern(*tensors, *scalars)
                        self._fp8_as_uint8 = False
                        return
                    except ValueError:
                        if not self.config.in_fp8:
                            raise
                        self._fp8_as_uint8 = True
                args = [t.view(torch.uint8) if (self._fp8_as_uint8 and t is not None and t.dtype == torch.float8_e4m3fn)
                        else t for t in tensors]
                kern(*args, *scalars)
            else:
                import cuda.bindings.driver as cuda
                from cutlass import Float32, Int32

                from fp4gen.runtime.dlpack import cute_tensor

                def conv(t):  # the fp32 LSE, scale and sink vectors and the int32 offsets are 4-byte aligned
                    return None if t is None else cute_tensor(t, align4=(torch.float32, torch.int32))

                kinds = (Int32, Int32, Float32, Int32) if cfg.extended else (Int32, Float32, Int32)
                stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
                kern(*[conv(t) for t in tensors], *[kind(x) for kind, x in zip(kinds, scalars)], stream)
