"""Host side of the generated sm100a attention forward: operand layouts and packing,
argument checks, compile and launch (docs/sm100.md, "Host side"; docs/design/host-code.md).

One copy for every sm100a module. A generated module builds one ``ForwardHost`` from its
plan-decided constants (a frozen ``ForwardConfig``) and its kernel-class builder
(``_build``), and binds its host names to it (``forward``, ``prepare_operands``,
``operand_layouts``, ``compile_only``, ``_gmem_layouts``, ...). Nothing here is looked up
in the generated module by name.

The kernel's global tensors are described once: ``ForwardHost.gmem_layouts`` gives the CuTe
layouts the kernel's ``__call__`` builds its tensors and TMA atoms from, ``operand_layouts``
the host tensors (contiguous, in ``__call__``'s argument order) that hold them.
``prepare_operands`` fills tensors of exactly those shapes; ``kernel_args`` (launch) and
``fake_args`` (compile_only) take pointer types and alignments from the same table, so the
compiled kernel and the prepared operands cannot disagree on a dtype or an alignment.
tests/sm100/test_sm100_host.py reads the prepared tensors back through ``gmem_layouts``.

Importing this module imports only the standard library: torch, CuTe DSL and
fp4gen.numerics are imported inside the functions that use them, and no compiler stage
(front end, IR passes, lowering, lark, jinja2) ever is.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

from fp4gen.runtime import cache

ARCH = "sm_100a"
NVFP4_BLOCK = 16  # Q, K: 16 elements along D share one E4M3 scale (kind::mxf4nvf4 ... block16)
MXFP4_BLOCK = 32  # V (and P): 32 keys share one E8M0 scale (block32)
# K-major V^T rows are padded to a multiple of V_KEY_PAD keys: TMA needs 16-byte row
# strides (32 FP4 keys) and the kernel assumes the row stride divides by 128.
V_KEY_PAD = 128
SF_ATOM_ROWS, SF_ATOM_COLS, SF_ATOM_BYTES = 128, 4, 512  # one tcgen05 scale-factor atom
INT32_LIMIT = 2 ** 31  # the kernel indexes global memory with 32-bit element offsets
MAX_GRID_Y = 65535  # grid.y = batch * heads

_REFUSAL = (
    "{kernel} is an sm_100a (Blackwell B200/GB200) kernel: {why}. "
    "Use the sm90a or reference module of the same spec on other machines; "
    "compile_only('sm_100a') builds it without a GPU."
)


@dataclass(frozen=True)
class ForwardConfig:
    """What the host side needs of one generated sm100a forward (its rendered constants)."""

    kernel_name: str  # KERNEL_NAME: the prefix of every message
    head_dim: int  # HEAD_DIM
    softmax_scale: float  # SOFTMAX_SCALE: forward's default scale
    pv_fp8: bool  # PV_FP8: P/V in FP8 E4M3 (V with one fp32 scale per (batch, kv head))
    pv_block_scaled: bool  # PV_BLOCK_SCALED: the PV MMA reads V block scales (sfv)
    pv_sf_vec: int  # PV_SF_VEC: keys per V block scale, 32 (MXFP4, E8M0) or 16 (NVFP4, E4M3)
    v_k_major: bool  # V_K_MAJOR: V stored transposed (D x padded keys) for a K-major PV B operand

    def __post_init__(self):
        if self.pv_sf_vec not in (NVFP4_BLOCK, MXFP4_BLOCK):
            raise ValueError(f"{self.kernel_name}: pv_sf_vec must be {NVFP4_BLOCK} or {MXFP4_BLOCK}, "
                             f"got {self.pv_sf_vec}")
        if not self.pv_fp8 and not self.v_k_major:
            raise ValueError(f"{self.kernel_name}: an FP4 V must be stored K-major (v_k_major)")

    @property
    def v_block(self) -> int:
        """Keys per V block scale: MXFP4 32 (E8M0) or, with two-level P, NVFP4 16 (E4M3)."""
        return self.pv_sf_vec


class OperandLayout:
    """One global tensor of the kernel as the host allocates it (always contiguous)."""

    __slots__ = ("name", "shape", "torch_dtype", "cute_dtype", "align")

    def __init__(self, name, shape, torch_dtype, cute_dtype, align):
        self.name = name
        self.shape = tuple(shape)  # torch shape of the host tensor
        self.torch_dtype = torch_dtype  # torch dtype name of the storage ("uint8" for FP4/FP8/scales)
        self.cute_dtype = cute_dtype  # element type of the kernel's pointer (cutlass.<name>)
        self.align = align  # bytes the kernel assumes of the base address

    def __repr__(self):
        return (f"OperandLayout({self.name!r}, {self.shape}, {self.torch_dtype}, "
                f"{self.cute_dtype}, align={self.align})")


class Operands:
    """The kernel's global operands for one call: ``tensors`` (name -> torch tensor, in
    operand_layouts' shapes) and the problem sizes. Each ``ForwardHost`` has its own
    subclass (``host.Operands``) whose ``layouts()`` are that host's."""

    host: "ForwardHost" = None

    def __init__(self, tensors, batch, seqlen_q, seqlen_k, heads, heads_kv):
        self.tensors = tensors
        self.batch, self.seqlen_q, self.seqlen_k = batch, seqlen_q, seqlen_k
        self.heads, self.heads_kv = heads, heads_kv

    @property
    def dims(self):
        return (self.batch, self.seqlen_q, self.seqlen_k, self.heads, self.heads_kv)

    def layouts(self):
        return self.host.operand_layouts(*self.dims)


def _ceil_div(a, b):
    return (a + b - 1) // b


def _sf_bytes(mn, k, vec):
    """Bytes of one (batch, head)'s scale factors in the tcgen05 atom layout: (mn x k)
    elements, one scale per ``vec`` along k, padded to whole 128 x 4-scale atoms."""
    return _ceil_div(mn, SF_ATOM_ROWS) * _ceil_div(_ceil_div(k, vec), SF_ATOM_COLS) * SF_ATOM_BYTES


def _heads_major(x):
    """(B, S, Hx, C) -> contiguous (B*Hx, S, C): one run per (batch, head), as the kernel indexes."""
    B, S, Hx = x.shape[:3]
    return x.transpose(1, 2).reshape(B * Hx, S, *x.shape[3:]).contiguous()


def pin_compile_arch(arch: str, caller: str) -> None:
    """Make ``arch`` the process's CuTe DSL target (``CUTE_DSL_ARCH``, which the sm100a
    kernels' compile reads) for a CPU-only compile; refuses (RuntimeError) when the process
    already targets another architecture."""
    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    if os.environ["CUTE_DSL_ARCH"] != arch:
        raise RuntimeError(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']} but {caller}({arch!r}) was asked")


class ForwardHost:
    """The host side of one generated sm100a forward: ``config`` its constants, ``build()``
    -> ``(Kernel, cutlass, cute)`` its kernel class (CuTe DSL imported lazily by the module).
    Holds the module's compiled kernels (one per process and GPU)."""

    def __init__(self, config: ForwardConfig, build: Callable):
        self.config = config
        self.build = build
        self.last_compiled = None  # the object of the last compile_only
        self._compiled = {}  # device index -> compiled kernel
        self.Operands = type("Operands", (Operands,), {"host": self, "__module__": __name__})

    # ------------------------------------------------------------------ refusal

    def require_sm100(self):
        """``UnsupportedDeviceError`` (a RuntimeError) without a GPU or on a GPU other than sm_100."""
        import torch

        from fp4gen.runtime.checks import UnsupportedDeviceError  # a RuntimeError

        kernel = self.config.kernel_name
        if not torch.cuda.is_available():
            raise UnsupportedDeviceError(_REFUSAL.format(kernel=kernel, why="no CUDA GPU is visible"))
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) != (10, 0):
            name = torch.cuda.get_device_name()
            raise UnsupportedDeviceError(_REFUSAL.format(kernel=kernel,
                                                         why=f"this GPU is {name} (sm_{major}{minor})"))

    # ------------------------------------------------------------------ layouts

    def gmem_layouts(self, cute, bsl, seqlen_q, seqlen_k, num_bh, num_bh_kv):
        """CuTe layouts of the kernel's global tensors, in elements of each operand's type.

        Called by the kernel's __call__ (dynamic Int32 sizes) and by the host tests (Python
        ints, where every ``assume`` is also checked). Q, K, O: (S, D, batch*heads), D
        contiguous; V: (D, Sk, batch*kv_heads), K-major (V^T rows of a padded key stride) when
        the PV B operand is K-major (required for FP4), else as stored (keys x D); LSE:
        (Sq, batch*heads); scale factors: the tcgen05 atom layout over Q's, K's and V's shape.
        """
        cfg = self.config
        D = cfg.head_dim
        sk_pad = (seqlen_k + (V_KEY_PAD - 1)) // V_KEY_PAD * V_KEY_PAD
        q = cute.make_layout((seqlen_q, D, num_bh), stride=(D, 1, cute.assume(seqlen_q * D, 128)))
        k = cute.make_layout((seqlen_k, D, num_bh_kv), stride=(D, 1, cute.assume(seqlen_k * D, 128)))
        if cfg.v_k_major:
            v = cute.make_layout((D, seqlen_k, num_bh_kv),
                                 stride=(cute.assume(sk_pad, V_KEY_PAD), 1, cute.assume(sk_pad * D, V_KEY_PAD)))
        else:
            v = cute.make_layout((D, seqlen_k, num_bh_kv), stride=(1, D, cute.assume(seqlen_k * D, 128)))
        return {
            "q": q, "k": k, "v": v,
            "o": cute.make_layout((seqlen_q, D, num_bh), stride=(D, 1, cute.assume(seqlen_q * D, 128))),
            "lse": cute.make_layout((seqlen_q, num_bh), stride=(1, seqlen_q)),
            "vs": cute.make_layout(num_bh_kv),
            "sfq": bsl.tile_atom_to_shape_SF(q.shape, NVFP4_BLOCK),
            "sfk": bsl.tile_atom_to_shape_SF(k.shape, NVFP4_BLOCK),
            "sfv": bsl.tile_atom_to_shape_SF(v.shape, cfg.v_block) if cfg.pv_block_scaled else None,
        }

    def operand_layouts(self, batch, seqlen_q, seqlen_k, heads, heads_kv):
        """name -> OperandLayout for every pointer argument of the kernel, in argument order."""
        cfg = self.config
        L, Lkv, D = batch * heads, batch * heads_kv, cfg.head_dim
        per_byte = 1 if cfg.pv_fp8 else 2  # elements per byte of V's payload
        if cfg.v_k_major:
            v_shape = (Lkv, D, _ceil_div(seqlen_k, V_KEY_PAD) * V_KEY_PAD // per_byte)
        else:
            v_shape = (Lkv, seqlen_k, D // per_byte)
        rows = [
            ("q", (L, seqlen_q, D // 2), "uint8", "Float4E2M1FN", 128),
            ("sfq", (L, _sf_bytes(seqlen_q, D, NVFP4_BLOCK)), "uint8", "Float8E4M3FN", 128),
            ("k", (Lkv, seqlen_k, D // 2), "uint8", "Float4E2M1FN", 128),
            ("sfk", (Lkv, _sf_bytes(seqlen_k, D, NVFP4_BLOCK)), "uint8", "Float8E4M3FN", 128),
            ("v", v_shape, "uint8", "Float8E4M3FN" if cfg.pv_fp8 else "Float4E2M1FN", 128),
            # without V block scales the kernel never reads sfv; it still takes a pointer
            ("sfv", (Lkv, _sf_bytes(D, seqlen_k, cfg.v_block)) if cfg.pv_block_scaled else (SF_ATOM_BYTES,),
             "uint8", "Float8E4M3FN" if cfg.v_block == NVFP4_BLOCK else "Float8E8M0FNU", 128),
            ("o", (L, seqlen_q, D), "bfloat16", "BFloat16", 128),
            ("lse", (L, seqlen_q), "float32", "Float32", 128),
            ("vs", (Lkv,), "float32", "Float32", 16),
        ]
        return {r[0]: OperandLayout(*r) for r in rows}

    # ------------------------------------------------------------------ operands

    def check_args(self, q, k, v, softmax_scale, device_type):
        """User-facing argument checks (clear messages, fp4gen.runtime.checks); returns the sizes."""
        import torch

        from fp4gen.runtime import checks

        kernel, D = self.config.kernel_name, self.config.head_dim
        sizes = checks.check_qkv(kernel, q, k, v, dtypes=(torch.bfloat16,), head_dim=D,
                                 device_type=device_type, tma=False)  # repacked before any TMA
        checks.check_softmax_scale(kernel, softmax_scale)
        if sizes.batch * sizes.heads > MAX_GRID_Y:
            raise ValueError(f"{kernel}: batch * heads must be at most {MAX_GRID_Y} (one grid row per "
                             f"(batch, head)); got {sizes.batch} * {sizes.heads}")
        sk_pad = _ceil_div(sizes.seqlen_k, V_KEY_PAD) * V_KEY_PAD
        biggest = max(sizes.batch * sizes.heads * sizes.seqlen_q, sizes.batch * sizes.heads_kv * sk_pad) * D
        if biggest >= INT32_LIMIT:
            raise ValueError(f"{kernel}: q/k/v are too large for the kernel's 32-bit element offsets "
                             f"(B*H*S*D = {biggest} >= 2**31); split the batch")
        return sizes

    def prepare_operands(self, q, k, v):
        """bf16 ``q (B, Sq, H, D)``, ``k, v (B, Sk, Hkv, D)`` -> ``Operands`` for one launch,
        computed with torch ops on the inputs' device.

        Quantization is fp4gen.numerics' (bit for bit what fp4gen.numerics.reference does for
        this spec): Q, K NVFP4 along D (blocks of 16, E4M3 scales, no tensor scale); V MXFP4
        along the keys (blocks of 32, E8M0 scales, 'ceil' rule), NVFP4 along the keys (blocks
        of 16, E4M3 scales; two-level P) or, for FP8 PV, E4M3 with one fp32 scale per (batch,
        kv head).
        Layouts (see operand_layouts): payloads per (batch, head), E2M1 codes two per byte
        (element 2i in the low nibble); V transposed to (B*Hkv, D, Sk padded to 128) when the
        PV B operand is K-major; scale codes in the tcgen05 scale-factor atom layout
        (fp4gen.numerics.quant.to_tcgen05_sf_layout), padding 0; ``vs`` V's tensor scales
        (1.0 for MXFP4 V); ``o``, ``lse`` allocated for the kernel to write.
        """
        import torch

        from fp4gen.numerics import quant
        from fp4gen.numerics.formats import E4M3, pack_fp4

        cfg = self.config
        sizes = self.check_args(q, k, v, None, device_type=None)
        B, Sq, Sk, H, Hkv = sizes.batch, sizes.seqlen_q, sizes.seqlen_k, sizes.heads, sizes.heads_kv
        lay = self.operand_layouts(B, Sq, Sk, H, Hkv)
        dev = q.device
        t = {}
        for name, x in (("q", q), ("k", k)):
            qt = quant.quantize_nvfp4(x, dim=3, block=NVFP4_BLOCK)
            t[name] = pack_fp4(_heads_major(qt.codes)).contiguous()
            t["sf" + name] = quant.to_tcgen05_sf_layout(_heads_major(qt.scale_codes)).contiguous()
        if cfg.pv_fp8:
            vq = quant.quantize_fp8(v, "tensor", fmt=E4M3)
            v_codes = vq.codes  # (B, Sk, Hkv, D) E4M3 codes; one fp32 scale per (batch, kv head)
            t["vs"] = vq.scale.reshape(B * Hkv).to(torch.float32).contiguous()
            t["sfv"] = torch.zeros(lay["sfv"].shape, dtype=torch.uint8, device=dev)  # not read
        else:
            if cfg.v_block == NVFP4_BLOCK:
                vq = quant.quantize_nvfp4(v, dim=1, block=NVFP4_BLOCK)
            else:
                vq = quant.quantize_mxfp4(v, dim=1, block=MXFP4_BLOCK)
            v_codes = vq.codes
            # scale codes come as (B, Hkv, D, Sk/32): rows = D, scale columns along the keys
            t["sfv"] = quant.to_tcgen05_sf_layout(vq.scale_codes.reshape(B * Hkv, cfg.head_dim, -1)).contiguous()
            t["vs"] = torch.ones(B * Hkv, dtype=torch.float32, device=dev)
        if cfg.v_k_major:
            vt = v_codes.permute(0, 2, 3, 1).reshape(B * Hkv, cfg.head_dim, Sk)  # V^T per (batch, kv head)
            pad = _ceil_div(Sk, V_KEY_PAD) * V_KEY_PAD - Sk
            vt = torch.nn.functional.pad(vt, (0, pad)) if pad else vt  # zero codes past the last key
        else:
            vt = _heads_major(v_codes)
        t["v"] = (vt if cfg.pv_fp8 else pack_fp4(vt)).to(torch.uint8).contiguous()
        t["o"] = torch.empty(lay["o"].shape, dtype=torch.bfloat16, device=dev)
        t["lse"] = torch.empty(lay["lse"].shape, dtype=torch.float32, device=dev)
        ops = self.Operands({name: t[name] for name in lay}, B, Sq, Sk, H, Hkv)
        self.check_operands(ops)
        return ops

    def check_operands(self, ops, *, check_align=True):
        """Internal consistency: every tensor has its operand_layouts shape, dtype, contiguity
        (and, for real pointers, alignment). A failure here is an fp4gen bug, not a user error."""
        kernel = self.config.kernel_name
        for name, spec in ops.layouts().items():
            x = ops.tensors.get(name)
            if x is None:
                raise RuntimeError(f"{kernel} internal error: operand {name} is missing")
            dt = str(x.dtype).replace("torch.", "")
            if tuple(x.shape) != spec.shape or dt != spec.torch_dtype or not x.is_contiguous():
                raise RuntimeError(f"{kernel} internal error: operand {name} is {dt} {tuple(x.shape)} "
                                   f"(contiguous={x.is_contiguous()}), the kernel expects {spec}")
            # (CPU tensors are checked for shape only: they are never handed to the kernel)
            if check_align and x.device.type == "cuda" and x.data_ptr() % spec.align:
                raise RuntimeError(f"{kernel} internal error: operand {name} at 0x{x.data_ptr():x} "
                                   f"is not {spec.align}-byte aligned")

    def fake_operands(self, batch, seqlen_q, seqlen_k, heads, heads_kv):
        """Operands of the given sizes on torch's meta device (shapes/dtypes only, no memory)."""
        import torch

        lay = self.operand_layouts(batch, seqlen_q, seqlen_k, heads, heads_kv)
        return self.Operands({n: torch.empty(s.shape, dtype=getattr(torch, s.torch_dtype), device="meta")
                              for n, s in lay.items()}, batch, seqlen_q, seqlen_k, heads, heads_kv)

    def outputs(self, ops, return_lse):
        """The kernel's (B*H, Sq, D) O and (B*H, Sq) LSE as the contract's (B, Sq, H, D), (B, H, Sq)."""
        B, Sq, H = ops.batch, ops.seqlen_q, ops.heads
        o = ops.tensors["o"].view(B, H, Sq, self.config.head_dim).transpose(1, 2).contiguous()
        if not return_lse:
            return o
        return o, ops.tensors["lse"].view(B, H, Sq)

    # ------------------------------------------------------------------ compile, launch

    def kernel_args(self, ops, softmax_scale, stream, *, fake=False):
        """The kernel's __call__ arguments for ``ops``: typed global pointers (address 0 when
        ``fake``, for compilation), the sizes, scale * log2(e) in fp32, the stream."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        self.check_operands(ops, check_align=not fake)
        ptrs = []
        for name, spec in ops.layouts().items():
            addr = 0 if fake else ops.tensors[name].data_ptr()
            ptrs.append(make_ptr(getattr(cutlass, spec.cute_dtype), addr, cute.AddressSpace.gmem,
                                 assumed_align=spec.align))
        scale = self.config.softmax_scale if softmax_scale is None else float(softmax_scale)
        return (
            *ptrs,
            cutlass.Int32(ops.seqlen_q), cutlass.Int32(ops.seqlen_k),
            cutlass.Int32(ops.batch * ops.heads), cutlass.Int32(ops.heads // ops.heads_kv),
            cutlass.Float32(scale * math.log2(math.e)),
            stream,
        )

    def fake_args(self, cutlass, cute, seqlen_q=1024, seqlen_k=1024, num_bh=16):
        """Arguments for compilation without a GPU: the pointer types and alignments of
        operand_layouts at address 0 (sizes are run-time Int32s: they do not change the code)."""
        import cuda.bindings.driver as cuda

        ops = self.fake_operands(1, seqlen_q, seqlen_k, num_bh, num_bh)
        return self.kernel_args(ops, None, cuda.CUstream(0), fake=True)

    def compile_only(self, arch: str = ARCH):
        """Compile the forward for ``arch`` without a GPU, keeping its PTX; returns
        ``(names compiled, compiled object)`` (the module keeps the object as ``LAST_COMPILED``)."""
        kernel = self.config.kernel_name
        if arch != ARCH:
            raise ValueError(f"{kernel} targets sm_100a only, not {arch!r}")
        pin_compile_arch(arch, "compile_only")
        Kernel, cutlass, cute = self.build()
        self.last_compiled = cute.compile[cute.KeepPTX](Kernel(), *self.fake_args(cutlass, cute))
        return [kernel + ".forward"], self.last_compiled

    def compiled_kernel(self, device_index):
        """The compiled forward, through the compile cache every target uses
        (``fp4gen.runtime.cache.compiled_kernel``: in memory, then a verified disk entry keyed
        by the module's source, then a compile). Pointer types and alignments are fixed; sizes
        and addresses are run-time."""
        if device_index not in self._compiled:
            def build():
                Kernel, cutlass, cute = self.build()
                return cute.compile(Kernel(), *self.fake_args(cutlass, cute))

            self._compiled[device_index] = cache.module_kernel(
                "forward", f"arch={ARCH}", build, cache.module_source(self.build))
        return self._compiled[device_index]

    def forward(self, q, k, v, *, softmax_scale=None, return_lse=False):
        """Attention forward on an sm_100 GPU; refuses (RuntimeError) anywhere else (the
        generated module's ``forward``, whose docstring states the contract)."""
        self.require_sm100()  # before looking at the arguments: the refusal is the useful message
        import torch

        from fp4gen.runtime import checks

        self.check_args(q, k, v, softmax_scale, device_type="cuda")
        checks.require_arch(ARCH, kernel=self.config.kernel_name, device=q.device)
        import cuda.bindings.driver as cuda

        with torch.cuda.device(q.device):
            ops = self.prepare_operands(q, k, v)
            index = q.device.index if q.device.index is not None else torch.cuda.current_device()
            kernel = self.compiled_kernel(index)
            stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            kernel(*self.kernel_args(ops, softmax_scale, stream))
        return self.outputs(ops, return_lse)
