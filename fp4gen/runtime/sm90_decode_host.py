"""Host side of the generated sm90a split-KV decode (issue 22): argument checks, compile
(``cache.module_kernel``, the one compile memo) and launch, then the split combine.

A generated decode module builds one ``DecodeHost`` from its config
(``fp4gen.device.sm90.decode_config.DecodeConfig``) and its kernel builder (``_build``, defined
in the module so that the compile cache keys on the module's source), and binds ``decode``,
``forward`` (a clear refusal: a decode module attends to a cache) and ``compile_only``.

The kernel reads the cache as it is; appending new tokens is ``fp4gen.attention_with_kvcache``'s
(``numerics.kvcache.append``, the reference quantizer, before the launch). The partials are
combined by ``numerics.kvcache.combine`` on the device (torch); one split is o_s itself, with
no combine launched.

Importing this module imports only the standard library.
"""
from __future__ import annotations

import math
from typing import Callable

ARCH = "sm_90a"


class DecodeHost:
    """The host side of one generated sm90a decode kernel (one compile per calling convention;
    symbolic shapes serve every batch, cache size, head count and split count)."""

    def __init__(self, config, build: Callable):
        self.config = config
        self.build = build
        self._compiled = {}  # tvm_ffi -> compiled kernel

    # ------------------------------------------------------------------ compile

    def fake_args(self):
        """Symbolic-shape stand-ins for every kernel argument (no GPU needed)."""
        import cutlass
        import cutlass.cute as cute
        from cutlass import Float32, Int32
        from cutlass.cute.runtime import make_fake_compact_tensor as fake

        cfg = self.config
        sym = cute.sym_int
        b, sq, h, slots, page, hkv, splits = (sym() for _ in range(7))
        d = cfg.head_dim
        cache_t = cutlass.Uint8 if cfg.fp8 or cfg.nvfp4 else cutlass.BFloat16  # E4M3 / packed E2M1 codes as bytes
        row = d // 2 if cfg.nvfp4 else d
        q = fake(cutlass.BFloat16, (b, sq, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
        k = fake(cache_t, (slots, page, hkv, row), stride_order=(3, 2, 1, 0), assumed_align=16)
        v = fake(cache_t, (slots, page, hkv, row), stride_order=(3, 2, 1, 0), assumed_align=16)
        gk = gv = None
        if cfg.nvfp4:
            sk, sv = (fake(cutlass.Uint8, (slots, page, hkv, d // 16), stride_order=(3, 2, 1, 0), assumed_align=16)
                      for _ in range(2))
            if cfg.tensor_scale:
                gk, gv = (fake(Float32, (hkv,), assumed_align=4) for _ in range(2))
        elif cfg.token_scale:
            sk, sv = (fake(Float32, (slots, page, hkv), stride_order=(2, 1, 0), assumed_align=4) for _ in range(2))
        elif cfg.fp8:
            sk, sv = (fake(Float32, (hkv,), assumed_align=4) for _ in range(2))
        else:
            sk = sv = None
        pt = fake(Int32, (b, sym()), stride_order=(1, 0), assumed_align=4) if cfg.paged else None
        lens = fake(Int32, (b,), assumed_align=4)
        o = fake(Float32, (splits, b, h, sq, d), stride_order=(4, 3, 2, 1, 0), assumed_align=16)
        lse = fake(Float32, (splits, b, h, sq), stride_order=(3, 2, 1, 0), assumed_align=4)
        return q, k, v, sk, sv, gk, gv, pt, lens, o, lse, Int32(1), Float32(1.0)

    def compile(self, arch=None, tvm_ffi=None):
        """The compiled decode kernel: at run time (``arch`` None) through
        ``cache.module_kernel`` keyed by the generated module's source; with ``arch``
        (``compile_only``) a plain compile in memory."""
        from fp4gen.runtime import cache

        tvm_ffi = cache.tvm_ffi_available() if tvm_ffi is None else tvm_ffi
        return cache.host_kernel(self._compiled, tvm_ffi, lambda: (self.build(), self.fake_args()), gpu_arch=ARCH,
                                 tvm_ffi=tvm_ffi, here=arch is not None, name="decode",
                                 variant=f"arch={ARCH},tvm_ffi={tvm_ffi}", source_of=self.build)

    def compile_only(self, arch: str = ARCH) -> list:
        """Compile the decode kernel for ``arch`` without a GPU; returns the names compiled."""
        cfg = self.config
        if arch != ARCH:
            raise ValueError(f"{cfg.kernel_name} is a Hopper kernel: arch must be {ARCH!r}, got {arch!r}")
        self.compile(arch, tvm_ffi=False)
        return [cfg.kernel_name]

    # ------------------------------------------------------------------ checks

    def check(self, q, k_cache, v_cache, seqlens_k, page_table, num_splits, softmax_scale, k_scale=None,
              v_scale=None, k_tensor_scale=None, v_tensor_scale=None):
        """The kernel's own argument checks (``fp4gen.attention_with_kvcache`` checked the
        cache's layout against the spec already; a direct caller gets the same errors for what
        the kernel needs): q (B, Sq, H, D) bf16, Sq <= q_tokens, H = gqa x Hkv; the caches
        (slots, page, Hkv, D) contiguous, bf16 or (fp8) uint8 E4M3 codes; fp8: k_scale, v_scale
        fp32 (slots, page, Hkv) per token or (Hkv,) per tensor (made contiguous for the launch); seqlens_k int (B,) keys per
        sequence; page_table int (B, pages) exactly when the cache is paged; nvfp4: the caches
        uint8 (slots, page, Hkv, D / 2) (two E2M1 codes a byte), k_scale / v_scale their uint8
        E4M3 block scales (slots, page, Hkv, D / 16), and with tensor_scale=fp32 k_tensor_scale /
        v_tensor_scale fp32 (Hkv,). Returns (B, Sq, H)."""
        import torch

        from fp4gen.runtime import checks
        from fp4gen.runtime.checks import AttentionInputError

        cfg = self.config
        who = cfg.kernel_name
        checks.check_softmax_scale(who, softmax_scale)
        if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 4 or q.shape[3] != cfg.head_dim:
            raise AttentionInputError(f"{who}: q must be a bf16 (B, Sq, H, D={cfg.head_dim}) tensor, got "
                                      f"{checks.describe(q)}")
        B, Sq, H, _ = q.shape
        if not 1 <= Sq <= cfg.q_tokens:
            raise AttentionInputError(f"{who}: q holds {Sq} tokens per sequence; this kernel takes 1 to "
                                      f"q_tokens {cfg.q_tokens}")
        want = torch.uint8 if cfg.fp8 or cfg.nvfp4 else torch.bfloat16
        what = "uint8 (E4M3 codes)" if cfg.fp8 else "uint8 (two E2M1 codes a byte)" if cfg.nvfp4 else "bf16"
        row = cfg.head_dim // 2 if cfg.nvfp4 else cfg.head_dim
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor) or t.dtype != want or t.dim() != 4 or t.shape[3] != row:
                raise AttentionInputError(f"{who}: {name} must be a {what} (slots, page, Hkv, {row}) tensor (the "
                                          f"kernel reads a {cfg.cache_format} cache, D={cfg.head_dim}), got "
                                          f"{checks.describe(t)}")
            if not t.is_contiguous():
                raise AttentionInputError(f"{who}: {name} must be contiguous (slots, page, Hkv, D), got strides "
                                          f"{tuple(t.stride())}")
        if k_cache.shape != v_cache.shape:
            raise AttentionInputError(f"{who}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
        Hkv = k_cache.shape[2]
        if cfg.nvfp4:
            scale_shape, scale_t = tuple(k_cache.shape[:3]) + (cfg.head_dim // 16,), torch.uint8
        else:
            scale_shape, scale_t = (tuple(k_cache.shape[:3]) if cfg.token_scale else (Hkv,)), torch.float32
        scale_name = str(scale_t).removeprefix("torch.")
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (cfg.fp8 or cfg.nvfp4):
                if t is not None:
                    raise AttentionInputError(f"{who}: a bf16 cache has no scales; drop {name}")
            elif not isinstance(t, torch.Tensor) or t.dtype != scale_t or tuple(t.shape) != scale_shape:
                raise AttentionInputError(f"{who}: {name} must be a {scale_name} tensor {scale_shape} "
                                          f"(the {cfg.cache_format} cache's scales), got {checks.describe(t)}")
        for name, t in (("k_tensor_scale", k_tensor_scale), ("v_tensor_scale", v_tensor_scale)):
            if not cfg.tensor_scale:
                if t is not None:
                    raise AttentionInputError(f"{who}: a {cfg.cache_format} cache has no per-KV-head tensor scale; "
                                              f"drop {name}")
            elif not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (Hkv,):
                raise AttentionInputError(f"{who}: {name} must be a float32 tensor ({Hkv},) (the two-level nvfp4 "
                                          f"cache's g), got {checks.describe(t)}")
        if H != cfg.gqa * Hkv:
            raise AttentionInputError(f"{who}: q has {H} heads, the cache {Hkv} KV heads; this kernel packs gqa "
                                      f"{cfg.gqa} query heads per KV head")
        if cfg.paged:
            if k_cache.shape[1] != cfg.page_size:
                raise AttentionInputError(f"{who}: the cache's pages hold {k_cache.shape[1]} tokens, the kernel's "
                                          f"page_size is {cfg.page_size}")
            if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or page_table.shape[0] != B or \
                    page_table.dtype not in (torch.int32, torch.int64):
                raise AttentionInputError(f"{who}: a paged cache needs page_table, an int32 (B={B}, pages) tensor, got "
                                          f"{checks.describe(page_table)}")
        elif page_table is not None:
            raise AttentionInputError(f"{who}: a contiguous cache takes no page_table")
        elif k_cache.shape[0] < B:
            raise AttentionInputError(f"{who}: a contiguous cache of {k_cache.shape[0]} sequences cannot hold a "
                                      f"batch of {B}")
        if not isinstance(seqlens_k, torch.Tensor) or seqlens_k.shape != (B,) or \
                seqlens_k.dtype not in (torch.int32, torch.int64):
            raise AttentionInputError(f"{who}: seqlens_k must be an int32 tensor (B={B},) of keys per sequence, got "
                                      f"{checks.describe(seqlens_k)}")
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise AttentionInputError(f"{who}: num_splits must be an int >= 1, got {num_splits!r}")
        checks.check_same_device(who, q=q, k_cache=k_cache, v_cache=v_cache, seqlens_k=seqlens_k,
                                 page_table=page_table, k_scale=k_scale, v_scale=v_scale,
                                 k_tensor_scale=k_tensor_scale, v_tensor_scale=v_tensor_scale)
        if q.device.type != "cuda":
            raise AttentionInputError(f"{who}: the sm90a decode kernel runs on a CUDA device; q is on {q.device} "
                                      "(fp4gen.attention_with_kvcache runs the reference there)")
        checks.require_arch(ARCH, kernel=who, device=q.device)
        return B, Sq, H

    # ------------------------------------------------------------------ launch

    def forward(self, q, k, v, **kw):
        from fp4gen.runtime.checks import AttentionInputError

        raise AttentionInputError(f"{self.config.kernel_name} is a decode kernel (its spec has a kv_cache block): "
                                  "call fp4gen.attention_with_kvcache(q, k_cache, v_cache, ...) or this module's "
                                  "decode(q, k_cache, v_cache, seqlens_k, ...)")

    def decode(self, q, k_cache, v_cache, seqlens_k, *, k_scale=None, v_scale=None, k_tensor_scale=None,
               v_tensor_scale=None, page_table=None, num_splits: int = 1, softmax_scale=None, return_lse: bool = False,
               partials: bool = False):
        """Attend q (B, Sq, H, D) bf16 to the first seqlens_k[b] keys of each sequence of a
        cache (slots, page, Hkv, D) (contiguous: slot b; paged: through page_table) in the
        config's format (bf16, or uint8 codes with ``k_scale``/``v_scale`` and, two-level nvfp4,
        ``k_tensor_scale``/``v_tensor_scale``, as ``numerics.kvcache.CacheTensor`` holds them:
        ``scale`` and ``tensor_scale``; see ``check``), masks bottom-right aligned, split into
        ``num_splits`` runs of key tiles and combined.
        Returns o (B, Sq, H, D) bf16, with return_lse (o, lse (B, H, Sq) fp32 natural log);
        ``partials``: the uncombined (o_s (splits, B, H, Sq, D), lse_s (splits, B, H, Sq) log2)."""
        import torch

        from fp4gen.numerics import kvcache as kv

        cfg = self.config
        B, Sq, H = self.check(q, k_cache, v_cache, seqlens_k, page_table, num_splits, softmax_scale, k_scale, v_scale,
                              k_tensor_scale, v_tensor_scale)
        scale = float(softmax_scale) if softmax_scale is not None else cfg.head_dim ** -0.5
        # the kernel writes every element of both (a split without keys: o 0, lse -inf), so no fill
        o_s = torch.empty((num_splits, B, H, Sq, cfg.head_dim), dtype=torch.float32, device=q.device)
        lse_s = torch.empty((num_splits, B, H, Sq), dtype=torch.float32, device=q.device)
        if B:
            k_scale, v_scale, k_tensor_scale, v_tensor_scale = (
                None if t is None else t.contiguous() for t in (k_scale, v_scale, k_tensor_scale, v_tensor_scale))
            tensors = (q.contiguous(), k_cache, v_cache, k_scale, v_scale, k_tensor_scale, v_tensor_scale,
                       None if page_table is None else page_table.to(torch.int32).contiguous(),
                       seqlens_k.to(torch.int32).contiguous(), o_s, lse_s)
            self.launch(tensors, (int(num_splits), scale * math.log2(math.e)))
        if partials:
            return o_s, lse_s
        if num_splits == 1:  # combine of one split is the split itself, bit for bit (w = 2^0 = 1)
            o, lse2 = o_s[0], lse_s[0]
        else:
            o, lse2 = kv.combine(o_s, lse_s)  # (B, H, Sq, D), (B, H, Sq)
        o = o.permute(0, 2, 1, 3).to(torch.bfloat16).contiguous()
        return (o, lse2 * kv.LN2) if return_lse else o

    def launch(self, tensors, scalars):
        import torch

        from fp4gen.runtime import cache

        with torch.cuda.device(tensors[0].device):
            tvm_ffi = cache.tvm_ffi_available()
            kern = self.compile(None, tvm_ffi)
            if tvm_ffi:
                kern(*tensors, *scalars)
                return
            import cuda.bindings.driver as cuda
            from cutlass import Float32, Int32

            from fp4gen.runtime.dlpack import cute_tensor

            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            conv = [cute_tensor(t, align4=(torch.float32, torch.int32)) for t in tensors]
            # q and the caches are 16-byte aligned; o_s is fp32 with D contiguous: 16 bytes too
            conv[9] = cute_tensor(tensors[9])
            kern(*conv, Int32(scalars[0]), Float32(scalars[1]), stream)
