"""Tiny single-CTA sm100a unit kernels for the forward's risky tcgen05 forms (``fp4gen selftest``).

The sm100a forward (``fp4gen/device/sm100/forward.py``, docs/sm100.md) has never run. Its P.V product
is ``tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block32`` with A (P, E2M1) read from
TMEM, a form CUTLASS ships no atom test for. Each check here isolates one assumption of that
path on one 128-row tile, with the expected result computed on the host from
``fp4gen.numerics`` codecs (never from the kernel):

=========================  =====================================================================
check                      what it proves when it passes on an sm_100 GPU
=========================  =====================================================================
pv_mxfp4_tmem_a            the whole P.V form: A codes ``tcgen05.st``-ed into TMEM from registers,
                           A's E8M0 scales SMEM -> TMEM by ``tcgen05.cp``, B (N x K, K-major)
                           and its scales by TMA into SMEM, two K=64 MMA steps, D read back by
                           ``tcgen05.ld``: D = deq(A) deq(B)^T
e2m1_nibble_order_tmem     one K=64 step with B = identity: D is A exactly as the hardware read
                           it from TMEM, so D tells which nibble of a byte is the even K index
block32_sf_id              the K=64 step pair again, with a different power of two per 32-key
                           block for A and B: the second step reads the scale bytes selected by
                           sf_id 2 (PTX ISA 9.7.16.10.7), a wrong id gives other bits of D
accumulator_column_reuse   a second MMA, issued right after the first by the same thread,
                           writes D over the TMEM columns the first read as A and as scale
                           factors (the forward's next QK^T over P and its scales): the first
                           product must be unaffected (tcgen05.mma from one thread execute in
                           issue order, PTX ISA 9.7.16.6.4 "pipelined instruction pairs")
=========================  =====================================================================

(PTX ISA 9.7.16.10.4.5: for ``.kind::mxf4``/``mxf4nvf4`` two E2M1 elements share an 8-bit
container in TMEM; which nibble holds the even element is only in the ISA's Figure 204, an image.)

Three kernels are compiled (``_CONFIGS``): ``pv_mxfp4_tmem_a`` and ``block32_sf_id`` are the same
code (two K steps) run on different operands; the nibble check issues one K step; the reuse
check issues two products. Each also has a ``fenced`` variant (``KernelConfig.fenced``) with the
PTX ISA's tcgen05 fences the forward lacks, which ``fp4gen selftest`` runs after a failure. Every kernel mirrors the forward's calls: ``tcgen05.st.32x32b`` of
fp32-typed words (8 E2M1 codes per 32-bit column, key 8w + c in nibble c, as the forward packs
P), scale bytes written by threads into SMEM in the tcgen05 scale-factor atom layout then
``tcgen05.cp .32x128b.warpx4``, the PV TiledMMA built with
``make_blockscaled_trivial_tiled_mma(..., OperandSource.TMEM)``, TMEM columns as the forward's
stage 0 (A at 64-79 inside the first accumulator's columns, scales at 80-87, D at 256-383).

``compile_only(name)`` compiles for sm_100a on the CPU (no GPU, no driver) and returns the PTX;
``run(name, device)`` launches on an sm_100 GPU and returns ``(got, expected)`` fp32 tensors;
``run`` raises ``RuntimeError`` without a GPU or on any other architecture.
"""
# no `from __future__ import annotations`: CuTe DSL evaluates the kernels' annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4gen.numerics import formats, quant
from fp4gen.numerics.formats import E2M1

M = 128  # rows (TMEM lanes), one per thread of the single warpgroup
N = 128  # columns of D (the forward's head dim)
K = 128  # reduction length (the forward's KV tile); two K=64 MMA steps
SF_VEC = 32  # MXFP4: one E8M0 scale per 32 K elements (block32)
ARCH = "sm_100a"

# TMEM columns (a 512-column allocation), as the forward's stage 0 of fa4_fp4_d128
# (docs/sm100.md, TMEM map): A = P0, its scales = SFP0, B's = SFV0, D = O0. The reuse check's
# second MMA writes D2 over columns 0-127 (= S0: A, SFA and SFB of the first lie inside) and
# reads its own A and scales from stage 1's columns.
TMEM_COLS = 512
COL = {"A": 64, "SFA": 80, "SFB": 84, "D": 256, "A2": 192, "SFA2": 208, "SFB2": 212, "D2": 0}


@dataclass(frozen=True)
class KernelConfig:
    name: str
    k_steps: int  # K=64 MMA steps issued per product (1: keys 0-63 only)
    products: int  # 1, or 2 for the column-reuse check (second D over the first's A)
    # the PTX ISA's canonical cross-thread patterns (9.7.16.6.4.3/.4): tcgen05.fence::
    # before_thread_sync before each arrive that publishes tcgen05 work, after_thread_sync after
    # each wait that precedes tcgen05 work, and (reuse check) tcgen05.commit + mbarrier wait +
    # after_thread_sync between the two products, the non-pipelined same-thread pattern of
    # 9.7.16.6.4.2. False: the forward's synchronisation, which has none of these.
    fenced: bool = False


_CONFIGS = {
    "pv_mxfp4_tmem_a": KernelConfig("pv_mxfp4_tmem_a", 2, 1),
    "e2m1_nibble_order_tmem": KernelConfig("e2m1_nibble_order_tmem", 1, 1),
    "block32_sf_id": KernelConfig("pv_mxfp4_tmem_a", 2, 1),  # same code, other operands
    "accumulator_column_reuse": KernelConfig("accumulator_column_reuse", 2, 2),
}
CHECKS = tuple(_CONFIGS)

WHAT = {
    "pv_mxfp4_tmem_a": "kind::mxf4nvf4.block_scale.block32, A (E2M1) from TMEM via tcgen05.st, "
                       "scales via tcgen05.cp: D = deq(A) deq(B)^T",
    "e2m1_nibble_order_tmem": "one K=64 step, B = identity: which nibble of a TMEM byte is the even K index",
    "block32_sf_id": "K=64 step pair, distinct scale per 32-block: step 2 reads the bytes of sf_id 2",
    "accumulator_column_reuse": "second MMA writes D over the first's A/scale columns: first D unaffected",
}


def kernel_config(name: str, fenced: bool = False) -> KernelConfig:
    """The kernel of check ``name``; ``fenced``: its variant with the ISA's tcgen05 fences (the
    follow-up ``fp4gen selftest`` runs when a check fails, to tell a missing fence from a wrong
    form)."""
    try:
        cfg = _CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown selftest kernel {name!r}; known: {', '.join(CHECKS)}") from None
    return dataclasses.replace(cfg, fenced=True) if fenced else cfg


# ============================================================================ device code


def _build(cfg: KernelConfig):
    """The kernel class of ``cfg`` (CuTe DSL imported lazily: importing this module needs none)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.memory as cmem
    import cutlass.utils.blackwell_helpers as sm100_utils
    import cutlass.utils.blockscaled_layout as bsl
    from cutlass import Float32, Int32, const_expr
    from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05

    F4 = cutlass.Float4E2M1FN
    E8M0 = cutlass.Float8E8M0FNU
    K_STEPS = cfg.k_steps
    PRODUCTS = cfg.products
    FENCED = cfg.fenced
    from fp4gen.device.pipelines import coop, participants
    from fp4gen.device.sm100 import copies  # the forward's TMA and scale-factor copies
    from fp4gen.device.sm100.bwd import tcgen05_fence_after_thread_sync, tcgen05_fence_before_thread_sync
    WORDS = K // 8  # 32-bit TMEM columns of one A row (8 E2M1 codes each)

    def slice0(layout):
        return cute.slice_(layout, (None, None, None, 0))

    class SelftestPV:
        def __init__(self):
            self.tiler = (M, N, K)

        @cute.jit
        def __call__(self, a_ptr: cute.Pointer, sfa_ptr: cute.Pointer, b_ptr: cute.Pointer,
                     sfb_ptr: cute.Pointer, d_ptr: cute.Pointer, stream):
            # A: PRODUCTS x M rows of WORDS packed 32-bit words (the registers tcgen05.st writes);
            # SFA: M x K/32 E8M0 bytes, row-major (threads place them in the SF atom layout);
            # B: N x K E2M1 K-major; SFB: the tcgen05 scale-factor atom layout over (N, K);
            # D: PRODUCTS x M x N fp32.
            mA = cute.make_tensor(a_ptr, cute.make_layout((M, WORDS, PRODUCTS), stride=(WORDS, 1, M * WORDS)))
            mSFA = cute.make_tensor(sfa_ptr, cute.make_layout((M, K // SF_VEC), stride=(K // SF_VEC, 1)))
            b_l = cute.make_layout((N, K, 1), stride=(K, 1, N * K))
            mB = cute.make_tensor(b_ptr, b_l)
            mSFB = cute.make_tensor(sfb_ptr, bsl.tile_atom_to_shape_SF(b_l.shape, SF_VEC))
            mD = cute.make_tensor(d_ptr, cute.make_layout((M, N, PRODUCTS), stride=(N, 1, M * N)))

            # the forward's PV TiledMMA (forward.py: pv_mma), A from TMEM
            mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
                F4, F4, OperandMajorMode.K, OperandMajorMode.K, E8M0, SF_VEC,
                tcgen05.CtaGroup.ONE, self.tiler[:2], tcgen05.OperandSource.TMEM)
            cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma.thr_id.shape,))
            sB_l = sm100_utils.make_smem_layout_b(mma, self.tiler, F4, 1)
            sSFA_l = bsl.make_smem_layout_sfa(mma, self.tiler, SF_VEC, 1)
            sSFB_l = bsl.make_smem_layout_sfb(mma, self.tiler, SF_VEC, 1)
            tA_l = sm100_utils.make_smem_layout_a(mma, self.tiler, F4, 1)  # A's layout, placed in TMEM
            g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
            tma_b, gB = cute.nvgpu.make_tiled_tma_atom_B(g2s, mB, slice0(sB_l), self.tiler, mma, cluster.shape)
            tma_sfb, gSFB = cute.nvgpu.make_tiled_tma_atom_B(g2s, mSFB, slice0(sSFB_l), self.tiler, mma,
                                                             cluster.shape, internal_type=cutlass.Int16)
            self.b_bytes = cute.size_in_bytes(F4, slice0(sB_l)) + cute.size_in_bytes(E8M0, slice0(sSFB_l))
            self.kernel(mma, tma_b, gB, tma_sfb, gSFB, mA, mSFA, mD, sB_l, sSFA_l, sSFB_l, tA_l).launch(
                grid=(1, 1, 1), block=[M, 1, 1], cluster=(1, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mma: cute.TiledMma, tma_b: cute.CopyAtom, gB_nkl: cute.Tensor,
                   tma_sfb: cute.CopyAtom, gSFB_nkl: cute.Tensor, mA: cute.Tensor, mSFA: cute.Tensor,
                   mD: cute.Tensor, sB_l: cute.ComposedLayout, sSFA_l: cute.Layout, sSFB_l: cute.Layout,
                   tA_l: cute.ComposedLayout):
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            tidx, _, _ = cute.arch.thread_idx()
            if warp == 0:
                cpasync.prefetch_descriptor(tma_b)
                cpasync.prefetch_descriptor(tma_sfb)

            @cute.struct
            class Storage:
                b_bar: cute.struct.MemRange[cutlass.Int64, 2]
                a_bar: cute.struct.MemRange[cutlass.Int64, 2]
                d_bar: cute.struct.MemRange[cutlass.Int64, 2]
                mid_bar: cute.struct.MemRange[cutlass.Int64, 2]  # fenced reuse: first product done
                tmem_holding_buf: Int32

            smem = cmem.SmemAllocator()
            st = smem.allocate(Storage)
            sB = smem.allocate_tensor(F4, sB_l.outer, 128, sB_l.inner)
            sSFA = smem.allocate_tensor(E8M0, sSFA_l, 128)
            sSFB = smem.allocate_tensor(E8M0, sSFB_l, 128)

            one = coop(1)
            wg = coop(M)
            # CuTe's checker (compile option "warnings") reports C3 "arrive count may not match the
            # mbarrier.init count (effective count: 1)" on the a and d pipelines and C8 "constant
            # parity=1 on a single-use barrier" at the two producers' first acquire. Triaged
            # 2026-12-01: the a-full barrier is initialised to 128 and all 128 threads arrive once,
            # the d-empty one likewise (PTX: mbarrier.init ..., 128); parity 1 on a fresh barrier
            # tests the phase before the first, which counts as complete (PTX ISA 9.7.13.15.16),
            # the start state of every CuTe producer. The kernels also ran to completion in
            # fp4gen's PTX emulator under both its schedules.
            # TMA of B + SFB -> MMA thread
            b_prod, b_cons = participants(pipeline.PipelineTmaUmma, st.b_bar, one, one, tx_count=self.b_bytes)
            # all threads: A stored in TMEM + SFA bytes in SMEM -> MMA thread (the forward's P pipe)
            a_prod, a_cons = participants(pipeline.PipelineAsyncUmma, st.a_bar, wg, one)
            # MMA commit -> all threads read D
            d_prod, d_cons = participants(pipeline.PipelineUmmaAsync, st.d_bar, one, wg)
            m_prod, m_cons = None, None
            if const_expr(FENCED and PRODUCTS == 2):
                m_prod, m_cons = participants(pipeline.PipelineUmmaAsync, st.mid_bar, one, one)

            tmem = cmem.TmemAllocator(
                st.tmem_holding_buf.ptr,
                barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=M),
                allocator_warp_id=0)
            tmem.allocate(TMEM_COLS)
            thr = mma.get_slice(0)
            tBrB = mma.make_fragment_B(sB)
            d_fake = mma.make_fragment_C(mma.partition_shape_C(self.tiler[:2]))
            tmem.wait_for_alloc()
            base = tmem.retrieve_ptr(Float32)

            # ---- TMA: B and its scales (warp 0) ----
            if warp == 0:
                gB = cute.local_tile(gB_nkl, cute.slice_(self.tiler, (0, None, None)), (None, None, None))
                gSFB = cute.local_tile(gSFB_nkl, cute.slice_(self.tiler, (0, None, None)), (None, None, None))
                tBs, tBg = copies.tma_part(tma_b, sB, thr.partition_B(gB), False)
                tSFBs, tSFBg = copies.tma_part(tma_sfb, sSFB, thr.partition_B(gSFB), True)
                hb_p = b_prod.acquire_and_advance()
                cute.copy(tma_b, tBg[None, 0, 0, 0], tBs[None, 0], tma_bar_ptr=hb_p.barrier)
                cute.copy(tma_sfb, tSFBg[None, 0, 0, 0], tSFBs[None, 0], tma_bar_ptr=hb_p.barrier)

            # ---- every thread: its A row(s) into TMEM (tcgen05.st, as the forward's P) ----
            t = tidx % M
            a_cols = ("A", "A2")
            # two tcgen05.st.32x32b.x8, keys 0-63 then 64-127 (the forward's P halves)
            half = WORDS // 2
            a_half_l = cute.composition(d_fake.layout, cute.make_layout((M, half)))
            st_atom = cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(half)), Float32)
            ha = a_prod.acquire_and_advance()
            for p in cutlass.range_constexpr(PRODUCTS):
                for h in cutlass.range_constexpr(2):
                    slab = cute.make_tensor(base + COL[a_cols[p]] + h * half, a_half_l)
                    thr_st = tcgen05.make_tmem_copy(st_atom, slab).get_slice(t)
                    src = cute.make_rmem_tensor(
                        thr_st.partition_S(cute.make_identity_tensor((M, half))).shape, Float32)
                    src_i = cute.recast_tensor(src, Int32)
                    for w in cutlass.range_constexpr(half):
                        src_i[w] = mA[t, h * half + w, p]
                    cute.copy(thr_st, src, thr_st.partition_D(slab))
            # SFA bytes at the forward's atom coordinate (forward.py softmax: sfp_bytes[...])
            sfa_bytes = cute.make_tensor(cute.recast_ptr(sSFA.iterator, dtype=cutlass.Uint8), sSFA.layout)
            for b in cutlass.range_constexpr(K // SF_VEC):
                sfa_bytes[(((t % 32, t // 32), 0), (0, b % 2)), 0, b // 2, 0] = mSFA[t, b]
            cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st before the arrive
            cute.arch.fence_proxy("async.shared", space="cta")  # SFA bytes visible to tcgen05.cp
            if const_expr(FENCED):
                tcgen05_fence_before_thread_sync()
            ha.commit()

            # ---- MMA thread (warp 0) ----
            if warp == 0:
                s2t = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), E8M0)
                tSFA_l = bsl.make_tmem_layout_sfa(mma, self.tiler, SF_VEC, slice0(sSFA_l))
                tSFB_l = bsl.make_tmem_layout_sfb(mma, self.tiler, SF_VEC, slice0(sSFB_l))
                tA_fake = mma.make_fragment_A(cute.make_tensor(base, tA_l.outer))[None, None, None, 0]
                hb_c = b_cons.wait_and_advance()
                ha_c = a_cons.wait_and_advance()
                if const_expr(FENCED):
                    tcgen05_fence_after_thread_sync()
                names = (("A", "SFA", "SFB", "D"), ("A2", "SFA2", "SFB2", "D2"))
                for p in cutlass.range_constexpr(PRODUCTS):
                    ca, csa, csb, cd = names[p]
                    tA = cute.make_tensor(cute.recast_ptr(base + COL[ca], dtype=F4), tA_fake.layout)
                    tSFA = cute.make_tensor(cute.recast_ptr(base + COL[csa], dtype=E8M0), tSFA_l)
                    tSFB = cute.make_tensor(cute.recast_ptr(base + COL[csb], dtype=E8M0), tSFB_l)
                    tD = cute.make_tensor(base + COL[cd], d_fake.layout)
                    copies.s2t(copies.s2t_part(s2t, sSFA, tSFA), 0)  # SMEM has one stage
                    copies.s2t(copies.s2t_part(s2t, sSFB, tSFB), 0)
                    for kb in cutlass.range_constexpr(K_STEPS):
                        mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                        mma.set(tcgen05.Field.SFA, tSFA[None, None, kb].iterator)
                        mma.set(tcgen05.Field.SFB, tSFB[None, None, kb].iterator)
                        cute.gemm(mma, tD, tA[None, None, kb], tBrB[None, None, kb, 0], tD)
                    if const_expr(FENCED and PRODUCTS == 2 and p == 0):
                        hm_p = m_prod.acquire_and_advance()
                        hm_p.commit()  # first product complete ...
                        hm_c = m_cons.wait_and_advance()
                        tcgen05_fence_after_thread_sync()  # ... before the second's MMAs
                        hm_c.release()
                hd_p = d_prod.acquire_and_advance()
                hd_p.commit()  # tcgen05.commit: D final once every tcgen05 op above completed
                ha_c.release()
                hb_c.release()

            # ---- every thread: its D row(s) -> global (tcgen05.ld.32x32b.x32) ----
            hd = d_cons.wait_and_advance()
            if const_expr(FENCED):
                tcgen05_fence_after_thread_sync()
            ld = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), Float32)
            d_cols = ("D", "D2")
            for p in cutlass.range_constexpr(PRODUCTS):
                tD = cute.make_tensor(base + COL[d_cols[p]], cute.logical_divide(
                    cute.composition(d_fake.layout, cute.make_layout((M, N))), (None, 32)))
                thr_ld = tcgen05.make_tmem_copy(ld, tD[None, (None, 0)]).get_slice(t)
                for c in cutlass.range_constexpr(N // 32):
                    reg = cute.make_rmem_tensor(thr_ld.partition_D(tD[None, (None, c)]).shape, Float32)
                    cute.copy(thr_ld, thr_ld.partition_S(tD[None, (None, c)]), reg)
                    for e in cutlass.range_constexpr(32):
                        mD[t, c * 32 + e, p] = reg[e]
            cute.arch.fence_view_async_tmem_load()
            if const_expr(FENCED):
                tcgen05_fence_before_thread_sync()
            hd.release()
            cute.arch.barrier(barrier_id=2, number_of_threads=M)
            if warp == 0:
                if const_expr(FENCED):
                    tcgen05_fence_after_thread_sync()
                tmem.relinquish_alloc_permit()
                tmem.free(base)

    return SelftestPV, cutlass, cute


# ============================================================================ host side

# (name, torch dtype, cute dtype, alignment) of the kernel's arguments, in order
_ARGS = (("a", "int32", "Int32", 16), ("sfa", "uint8", "Uint8", 16), ("b", "uint8", "Float4E2M1FN", 16),
         ("sfb", "uint8", "Float8E8M0FNU", 16), ("d", "float32", "Float32", 16))


def _pointers(tensors, fake):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return [make_ptr(getattr(cutlass, cdt), 0 if fake else tensors[n].data_ptr(), cute.AddressSpace.gmem,
                     assumed_align=al) for n, _, cdt, al in _ARGS]


# the kernel library files the kernels trace besides this one (their edits must recompile)
_TRACED = ("../pipelines.py", "copies.py", "bwd.py")


def _source_key(cfg: KernelConfig) -> str:
    """sha256 of this file and the ones it traces, the config and the CuTe DSL version: what
    the PTX depends on."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        dsl = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:  # pragma: no cover - CuTe DSL is needed to compile at all
        dsl = "?"
    here = Path(__file__)
    h = hashlib.sha256(here.read_bytes())
    for rel in _TRACED:
        h.update((here.parent / rel).read_bytes())
    h.update(f"{cfg!r} {dsl}".encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("FP4GEN_SELFTEST_CACHE", "/tmp/selftest"))


def compile_only(name: str, *, cache: bool = True, fenced: bool = False) -> str:
    """Compile check ``name``'s kernel for sm_100a without a GPU; return its PTX.

    The PTX is cached under ``cache_dir()`` keyed by the sha256 of the source and the config
    (a compile costs seconds of CPU). CuTe DSL reads ``CUTE_DSL_ARCH`` when it compiles; it is
    set to sm_100a here unless already set to something else (then: RuntimeError)."""
    cfg = kernel_config(name, fenced)
    path = cache_dir() / f"{cfg.name}{'-fenced' if cfg.fenced else ''}-{_source_key(cfg)}.ptx"
    if cache and path.exists():
        return path.read_text()
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    if os.environ["CUTE_DSL_ARCH"] != ARCH:
        raise RuntimeError(f"CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']}, the selftest kernels target {ARCH}")
    import cuda.bindings.driver as cuda

    Kernel, cutlass, cute = _build(cfg)
    compiled = cute.compile[cute.KeepPTX](Kernel(), *_pointers(None, True), cuda.CUstream(0))
    ptx = compiled.artifacts.PTX
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(ptx)
        tmp.replace(path)
    return ptx


# ---------------------------------------------------------------- operands

@dataclass
class Operands:
    """Host operands of one check: E2M1 codes (unpacked, one per byte) and E8M0 scale codes."""

    a_codes: torch.Tensor  # (products, M, K) uint8
    sfa: torch.Tensor  # (M, K/32) uint8 E8M0
    b_codes: torch.Tensor  # (N, K) uint8
    sfb: torch.Tensor  # (N, K/32) uint8 E8M0
    k_used: int  # K elements the kernel's MMA steps reduce over (64 per step)


def pack_a_words(a_codes: torch.Tensor, nibble_order: str = "low_first") -> torch.Tensor:
    """(..., K) E2M1 codes -> (..., K/8) int32 words as the forward packs P: key 8w + c in nibble c
    of word w (``formats.pack_fp4`` bytes read little-endian). ``high_first`` swaps the two
    nibbles of every byte (the alternative hypothesis of the nibble check)."""
    packed = formats.pack_fp4(a_codes)  # element 2i low nibble
    if nibble_order == "high_first":
        packed = ((packed & 0xF) << 4) | (packed >> 4)
    elif nibble_order != "low_first":
        raise ValueError(f"nibble_order must be low_first or high_first, not {nibble_order!r}")
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, 4)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def dequantize(codes: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (..., K) with E8M0 codes (..., K/32) -> float64 values."""
    vals = formats.decode(codes, E2M1).double()
    scale = formats.decode_e8m0(sf).double().repeat_interleave(SF_VEC, dim=-1)
    return vals * scale


def expected(ops: Operands, *, nibble_order: str = "low_first", sf_id_step2: int = 2) -> torch.Tensor:
    """D = deq(A) deq(B)^T over the K the kernel's steps cover, (products, M, N) float64.

    ``nibble_order``: how the hardware is assumed to read a byte of A in TMEM (``high_first``:
    element 2i from the high nibble). ``sf_id_step2``: which scale-byte pair the second K step
    uses (2: keys 64-127's own scales, ISA 9.7.16.10.7; 0: keys 0-63's again, the fault the
    block32 check looks for). Both alternatives exist to say which hypothesis D matches."""
    a = ops.a_codes
    if nibble_order == "high_first":
        a = a.reshape(*a.shape[:-1], -1, 2).flip(-1).reshape(a.shape)
    elif nibble_order != "low_first":
        raise ValueError(f"nibble_order must be low_first or high_first, not {nibble_order!r}")
    sfa, sfb = ops.sfa.clone(), ops.sfb.clone()
    if sf_id_step2 == 0:
        sfa[:, 2:4], sfb[:, 2:4] = ops.sfa[:, 0:2], ops.sfb[:, 0:2]
    elif sf_id_step2 != 2:
        raise ValueError("sf_id_step2 must be 0 or 2")
    da = dequantize(a, sfa)[..., : ops.k_used]
    db = dequantize(ops.b_codes, sfb)[..., : ops.k_used]
    return da @ db.T


def _codes(gen, shape, low=0, high=16):
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64).to(torch.uint8)


def operands(name: str, seed: int = 0) -> Operands:
    """The operands of check ``name`` (deterministic in ``seed``). Values are chosen so fp32
    accumulation is exact: every product and partial sum is a short binary number."""
    cfg = kernel_config(name)
    gen = torch.Generator().manual_seed(seed)
    nb = K // SF_VEC
    if name in ("pv_mxfp4_tmem_a", "accumulator_column_reuse"):
        a = _codes(gen, (cfg.products, M, K))  # every E2M1 code, both signs
        b = _codes(gen, (N, K))
        # scales 2^-1 .. 2^1: every partial sum is a multiple of 2^-4 below 2^15, exact in fp32
        sfa = _codes(gen, (M, nb), 126, 129)
        sfb = _codes(gen, (N, nb), 126, 129)
        return Operands(a, sfa, b, sfb, 64 * cfg.k_steps)
    if name == "e2m1_nibble_order_tmem":
        # A row i: one nonzero code at an odd K index k_i = 2 (i % 32) + 1 (keys 0-63, the one
        # step), value code 1 + i % 7 (0.5 .. 6, positive); B = identity on keys 0-63 (code 2 =
        # 1.0), so D[i, n] = A as read at key n: nonzero at n = k_i if the even key is the low
        # nibble, at k_i - 1 if it is the high nibble.
        a = torch.zeros(1, M, K, dtype=torch.uint8)
        i = torch.arange(M)
        a[0, i, 2 * (i % 32) + 1] = (1 + i % 7).to(torch.uint8)
        b = torch.zeros(N, K, dtype=torch.uint8)
        n = torch.arange(64)
        b[n, n] = 2
        ones = torch.full((M, nb), 127, dtype=torch.uint8)
        return Operands(a, ones, b, torch.full((N, nb), 127, dtype=torch.uint8), 64)
    if name == "block32_sf_id":
        # A = B = 1.0 everywhere; block b of row i scaled by 2^(3b + i % 3), of column n by
        # 2^(3b + n % 2 - 4): block b adds 32 * 2^(6b + i % 3 + n % 2 - 4) to D, four disjoint
        # bit fields (21 bits in all, exact in fp32), so a step that reads another block's scale
        # bytes changes a recognisable field.
        a = torch.full((1, M, K), 2, dtype=torch.uint8)
        b = torch.full((N, K), 2, dtype=torch.uint8)
        blk = torch.arange(nb)
        sfa = (127 + 3 * blk[None, :] + (torch.arange(M)[:, None] % 3)).to(torch.uint8)
        sfb = (127 - 4 + 3 * blk[None, :] + (torch.arange(N)[:, None] % 2)).to(torch.uint8)
        return Operands(a, sfa, b, sfb, 128)
    raise ValueError(name)


def device_tensors(ops: Operands, device) -> dict:
    """The kernel's argument tensors on ``device`` (layouts of ``SelftestPV.__call__``)."""
    products = ops.a_codes.shape[0]
    return {
        "a": pack_a_words(ops.a_codes).contiguous().to(device),
        "sfa": ops.sfa.contiguous().to(device),
        "b": formats.pack_fp4(ops.b_codes).contiguous().to(device),
        "sfb": quant.to_tcgen05_sf_layout(ops.sfb).contiguous().to(device),
        "d": torch.full((products, M, N), float("nan"), dtype=torch.float32, device=device),
    }


def require_sm100(device=None):
    """RuntimeError unless ``device`` (default: the current CUDA device) is an sm_100 GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("selftest kernels need an sm_100 (B200/GB200) GPU: no CUDA GPU is visible")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise RuntimeError(f"selftest kernels run on an sm_100 GPU, not on {dev}")
    cap = torch.cuda.get_device_capability(dev)
    if cap != (10, 0):
        raise RuntimeError(f"selftest kernels need an sm_100 GPU; {torch.cuda.get_device_name(dev)} "
                           f"is sm_{cap[0]}{cap[1]}")
    return dev


_COMPILED = {}


def run(name: str, device=None, seed: int = 0, *, fenced: bool = False):
    """Launch check ``name`` on an sm_100 GPU; return ``(got, expected)``, (products, M, N) float32
    / float64 on the CPU. RuntimeError on anything but an sm_100 GPU."""
    dev = require_sm100(device)
    cfg = kernel_config(name, fenced)
    import cuda.bindings.driver as cuda

    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    ops = operands(name, seed)
    ts = device_tensors(ops, dev)
    with torch.cuda.device(dev):
        if cfg not in _COMPILED:
            Kernel, cutlass, cute = _build(cfg)
            _COMPILED[cfg] = cute.compile(Kernel(), *_pointers(None, True), cuda.CUstream(0))
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        _COMPILED[cfg](*_pointers(ts, False), stream)
        torch.cuda.synchronize(dev)
    return ts["d"].cpu(), expected(ops)


# ---------------------------------------------------------------- reading the result

# The operands make every product and partial sum exact in fp32, but the tensor core's internal
# accumulation width is not documented (Hopper's FP8 wgmma keeps fewer than 24 bits), so a check
# passes within 2^-10 of the tile's largest |D|; every wrong hypothesis below misses by far more.
RTOL = 2.0 ** -10


def hypotheses(name: str, ops: Operands) -> dict:
    """label -> expected D under that reading of the hardware; the first is the assumed one."""
    if name == "e2m1_nibble_order_tmem":
        return {"low nibble = even K index (as formats.pack_fp4 and the forward's P packing)": expected(ops),
                "HIGH nibble = even K index, against B's order in SMEM (swap P's nibbles to match V's)":
                    expected(ops, nibble_order="high_first")}
    if name == "block32_sf_id":
        return {"step 2 read the scale bytes of sf_id 2 (keys 64-127)": expected(ops),
                "step 2 read the scale bytes of keys 0-63 (sf_id 2 not honoured)": expected(ops, sf_id_step2=0)}
    return {"D = deq(A) deq(B)^T": expected(ops)}


def max_error(got: torch.Tensor, exp: torch.Tensor) -> float:
    """Largest |got - exp| relative to the largest |exp| (NaN in got counts as infinite)."""
    err = (got.double() - exp).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    return float(err.max()) / max(float(exp.abs().max()), 1e-30)


def judge(name: str, got: torch.Tensor, seed: int = 0):
    """(passed, max relative error against the assumed result, what the result says)."""
    ops = operands(name, seed)
    hyp = hypotheses(name, ops)
    errs = {label: max_error(got, e) for label, e in hyp.items()}
    assumed = next(iter(hyp))
    if bool(torch.isnan(got).all()):
        return False, errs[assumed], "D is all NaN as filled before the launch: nothing was written back"
    if bool((got == 0).all()):  # also the public FP4 attempt's symptom of this MMA form
        return False, errs[assumed], "D is all zero (NaN-filled before the launch: the MMA wrote zeros)"
    best = min(errs, key=errs.get)
    passed = errs[assumed] <= RTOL
    if name == "accumulator_column_reuse":
        e = hyp[assumed]
        e1, e2 = max_error(got[0], e[0]), max_error(got[1], e[1])
        return passed, errs[assumed], (f"first product rel. error {e1:.3g} (its A/scale columns were "
                                       f"overwritten by the second's D), second {e2:.3g}")
    if passed or errs[best] <= RTOL:
        return passed, errs[assumed], best
    if name == "e2m1_nibble_order_tmem":
        # D row i is A row i as the MMA read it: where each row's one code landed is the map
        seen = {}
        g = torch.nan_to_num(got[0].double(), nan=0.0).abs()
        for i in range(32):  # rows 0-31 hold the 32 odd keys 1..63 once each
            k = 2 * (i % 32) + 1
            seen[k] = int(g[i].argmax()) if float(g[i].max()) > 0 else None
        return passed, errs[assumed], ("matches no nibble order; key written -> key the MMA read: "
                                       + ", ".join(f"{k}->{v}" for k, v in sorted(seen.items())))
    return passed, errs[assumed], "matches no hypothesis (" + "; ".join(
        f"{k}: rel. error {v:.3g}" for k, v in errs.items()) + ")"
