"""Run CTAs of the sm90a decode kernel's PTX on the CPU (tests/kvcache/test_decode_sm90.py).

fp4gen's CTA emulator (``fp4gen.lowering.emulator``, written for sm100a) executes the PTX CuTe
DSL emits; this subclass adds the three instruction families the decode kernel uses and sm100a
kernels do not, each by its PTX ISA definition:

- ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` (9.7.14.5.8, the m16n8k16 fragment
  layouts: with g = lane / 4, t = lane % 4, A's a0..a3 hold rows g, g+8 x columns 2t.., 2t+8..;
  B's b0, b1 rows 2t.., 2t+8.. of column g; C/D rows g, g+8 x columns 2t, 2t+1), in float64
  then rounded to fp32 (the hardware's accumulation order is not specified);
- ``cp.async.{ca,cg}.shared.global [d], [s], n{, src-size}`` (9.7.9.25.3): the bytes land when
  issued (so ordering bugs between copies and readers are not seen here), the ones past
  src-size are zeros; ``commit_group`` / ``wait_group`` do nothing;
- ``cvt.rn.f16x2.e4m3x2`` (9.7.9.21): both E4M3 bytes decoded exactly (numerics.formats).

The multi-line ``mma.sync`` statements are joined first (the emulator's parser reads one
statement a line). Kernel parameters are packed from the compiled MLIR signature as
``emulator.run`` does for sm100a.
"""
from __future__ import annotations

import glob
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

from fp4gen.lowering.emulator import machine as M
from fp4gen.lowering.emulator import ptx as P
from fp4gen.lowering.emulator import run as R
from fp4gen.lowering.emulator import tensor as TN

W = 32
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


class DecodeMachine(M.Machine):
    def _compile(self, ins):
        op = ins.opcode
        if op == MMA:
            return ("op", self._mma_sync(ins))
        if op.startswith(("cp.async.cg.shared.global", "cp.async.ca.shared.global")):
            return ("op", self._cp_async(ins))
        if op.startswith(("cp.async.commit_group", "cp.async.wait_group")):
            return ("op", lambda w, m, full: None)
        if op == "cvt.rn.f16x2.e4m3x2":
            return ("op", self._cvt_e4m3x2(ins))
        return super()._compile(ins)

    def _mma_sync(self, ins):
        d, a, b, c = ins.operands
        dw = [self._writer(x) for x in d.items]
        ar = [self._reader(x, np.uint32) for x in a.items]
        br = [self._reader(x, np.uint32) for x in b.items]
        cr = [self._reader(x, np.float32) for x in c.items]
        lane = np.arange(W)
        g, t = lane >> 2, lane & 3

        def lo(x):  # the low bf16 of each word, as fp32
            return ((x & 0xFFFF).astype(np.uint32) << np.uint32(16)).view(np.float32)

        def hi(x):
            return (x & 0xFFFF0000).astype(np.uint32).view(np.float32)

        def h(w, m, full):
            if not m.all():
                raise M.EmulationError(f"PTX line {ins.line}: mma.sync with inactive lanes")
            av, bv, cv = [r(w) for r in ar], [r(w) for r in br], [r(w) for r in cr]
            A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
            for k, (r0, c0) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                A[g + r0, 2 * t + c0], A[g + r0, 2 * t + c0 + 1] = lo(av[k]), hi(av[k])
            for k in range(2):
                B[2 * t + 8 * k, g], B[2 * t + 8 * k + 1, g] = lo(bv[k]), hi(bv[k])
            for k, (r0, c1) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                C[g + r0, 2 * t + c1] = cv[k]
            D = (A @ B + C).astype(np.float32)
            for k, (r0, c1) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                dw[k](w, D[g + r0, 2 * t + c1], m, full)
        return h

    def _cp_async(self, ins):
        ops = ins.operands
        dst, src = self._addr(ops[0], "shared"), self._addr(ops[1], "global")
        n = ops[2].value
        size = self._reader(ops[3], np.uint32) if len(ops) > 3 else None

        def h(w, m, full):
            idx = np.nonzero(m)[0]
            if idx.size == 0:
                return
            raw = self._mem_read("global", src(w)[idx], n, w, idx).copy()
            if size is not None:
                for i, s in enumerate(size(w)[idx]):
                    raw[i, int(s):] = 0
            self._mem_write("shared", dst(w)[idx], raw, w, idx)
        return h

    def _cvt_e4m3x2(self, ins):
        from fp4gen.numerics.formats import E4M3, decode

        table = decode(torch.arange(256, dtype=torch.uint8), E4M3).numpy().astype(np.float16).view(np.uint16)
        rd, wr = self._reader(ins.operands[1], np.uint16), self._writer(ins.operands[0])

        def h(w, m, full):
            a = rd(w).astype(np.uint32)
            wr(w, (table[(a >> 8) & 0xFF].astype(np.uint32) << np.uint32(16)) | table[a & 0xFF].astype(np.uint32),
               m, full)
        return h


_CHILD = r"""
import sys
from fp4gen.device.sm90.decode_config import DecodeConfig
from fp4gen.device.sm90.decode import kernel_class
from fp4gen.runtime.sm90_decode_host import DecodeHost
cfg = eval(sys.argv[1], {"DecodeConfig": DecodeConfig})
DecodeHost(cfg, lambda: kernel_class(cfg)(cfg)).compile("sm_90a", tvm_ffi=False)
"""


def compile_ptx(cfg, timeout=900):
    """(PTX with its mma.sync statements on one line, MLIR) of ``cfg``'s kernel, compiled for
    sm_90a in a child process (CuTe DSL reads CUTE_DSL_ARCH once per process)."""
    with tempfile.TemporaryDirectory(prefix="fp4gen_decode_emu_") as dump:
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ir,ptx", CUTE_DSL_DUMP_DIR=dump)
        subprocess.run([sys.executable, "-c", _CHILD, repr(cfg)], env=env, check=True, timeout=timeout,
                       capture_output=True)
        ptx = open(glob.glob(f"{dump}/*.ptx")[0]).read()
        mlir = open(glob.glob(f"{dump}/*clean.mlir")[0]).read()
    out, cur = [], None
    for ln in ptx.splitlines():
        if cur is not None:
            cur += " " + ln.strip()
            out.append("")  # keep the line numbers
            if ln.rstrip().endswith(";"):
                out[cur_at] = cur
                cur = None
            continue
        if ln.strip().startswith("mma.sync") and not ln.rstrip().endswith(";"):
            cur, cur_at = ln, len(out)
        out.append(ln)
    return "\n".join(out), mlir


def emulate(ptx, mlir, tensors, scalars, grid):
    """Run every CTA of ``grid`` on ``tensors`` (the kernel's tensor arguments in order; None
    where the config takes none: not a kernel parameter) and ``scalars`` [(struct format,
    value)]; returns the tensors as the kernel left them."""
    module = P.parse(ptx)
    sig = [t for _, t in R.kernel_signature(mlir) if not t.startswith(("!mma_", "!cute.tiled_mma"))]
    live = [t.contiguous() for t in tensors if t is not None]
    if len(sig) != len(live) + len(scalars) or len(sig) != len(module.params):
        raise ValueError(f"{len(sig)} kernel parameters, {len(live)} tensors + {len(scalars)} scalars, "
                         f"{len(module.params)} PTX params")
    gmem = M.GlobalMemory()
    poff = M.param_offsets(module)
    params = bytearray(max(poff[p.name] + p.size for p in module.params))
    addrs = []
    for typ, t, p in zip(sig, live, module.params):
        a = gmem.alloc(t.view(-1).view(torch.uint8).numpy().copy(), align=1024)
        addrs.append(a)
        data = struct.pack("<Q", a) + R.pack_fields(R.dynamic_fields(typ, tuple(t.shape), tuple(t.stride())), start=8)
        params[poff[p.name]:poff[p.name] + len(data)] = data
    for (fmt, v), p in zip(scalars, module.params[len(live):]):
        params[poff[p.name]:poff[p.name] + struct.calcsize(fmt)] = struct.pack(fmt, v)
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                DecodeMachine(module, smem=TN.SharedMemory(fill=0xFF), gmem=gmem, params=bytes(params),
                              ctaid=(x, y, z), nctaid=grid, ntid=128, strict_aligned=False).run()
    return [torch.frombuffer(bytearray(gmem.read(a, t.numel() * t.element_size())), dtype=t.dtype).reshape(t.shape)
            for t, a in zip(live, addrs)]


def run_decode(cfg, ptx, mlir, q, kc, vc, lens, page_table, num_splits, softmax_scale=None):
    """The kernel's (o (B, Sq, H, D) bf16 as fp32, lse (B, H, Sq) natural log) for caches
    ``kc``/``vc`` (numerics.kvcache.CacheTensor), combined by numerics.kvcache.combine as the
    host does."""
    from fp4gen.numerics import kvcache as kv

    B, Sq, H, D = q.shape
    ks, vs = (kc.scale, vc.scale) if kc.scale is not None else (kc.tensor_scale, vc.tensor_scale)
    gk, gv = (kc.tensor_scale, vc.tensor_scale) if cfg.nvfp4 else (None, None)
    o_s = torch.zeros(num_splits, B, H, Sq, D)
    lse_s = torch.full((num_splits, B, H, Sq), float("-inf"))
    scale = softmax_scale if softmax_scale is not None else D ** -0.5
    out = emulate(ptx, mlir, [q, kc.data, vc.data, ks, vs, gk, gv, page_table,
                              torch.tensor(lens, dtype=torch.int32), o_s, lse_s],
                  [("<i", num_splits), ("<f", scale * math.log2(math.e))], (num_splits, kc.kv_heads, B))
    o, lse2 = kv.combine(out[-2], out[-1])
    return o.permute(0, 2, 1, 3).to(torch.bfloat16).float(), lse2 * kv.LN2
