"""Run one CTA of a generated sm100a forward in the emulator and compare with the reference.

``emulate_forward(module_source, seqlen_q=256, seqlen_k=448, ...)``:

1. compiles the module for sm_100a (``conformance.compile_artifacts``; cached on disk by the
   source's sha256) and parses its PTX (optionally mutated by ``ptx_mutation``, the planted
   faults of the tests);
2. prepares q, k, v (batch 1, one head, seeded) with the module's own host side
   (``ForwardHost.prepare_operands``) and lays each operand out in an emulated global memory;
3. builds the kernel's ``.param`` bytes in the PTX's parameter order from the MLIR kernel
   signature (``cuda.kernel @kernel_...(%arg0: ..., ...)``) and the names of the template's
   ``kernel(...)`` arguments: TiledMMA structs (no run-time field is set: zeros), TMA atoms
   (128 bytes, opaque: the machine resolves a TMA's descriptor address to its parameter and
   asks ``tma.tensor_maps`` for the map), coordinate tensors and gmem memrefs (the dynamic
   ``?`` entries of their MLIR layout, in order, as i32, after the 8-byte pointer for a
   memref), scalars; static layouts have no parameter;
4. runs CTA (0, 0) of the grid (query rows 0..255 = the two 128-row tiles) and reads O and LSE
   back;
5. compares with ``fp4gen.numerics.reference.forward`` of the module's spec.

``globals_by_arg`` (the argument of ``tma.tensor_maps``, emu-tensor's form): index of each
pointer argument of the module's ``__call__`` (``operand_layouts`` order: q, sfq, k, sfk, v,
sfv, o, lse, vs) -> ``(address, shape, strides, dtype)``: its address in the emulated global
memory, the CuTe layout ``__call__`` builds its tensor with (``ForwardHost.gmem_layouts`` for
these sizes, nested tuples in elements) and the MLIR element type name (``"f4E2M1FN"``, ...).

``emulate_backward(module_source, seqlen_q=256, seqlen_k=256, ...)``: the module's sm100a
backward kernel (compiled with ``backward=True``, cached apart from the forward) on every CTA of
its grid, driven by the module's own host code; see the section "the backward" below.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from fp4gen.runtime.loader import exec_file

from . import machine as M
from . import ptx as P
from . import trace as T

CACHE = Path(os.environ.get("FP4GEN_EMULATOR_CACHE", Path(tempfile.gettempdir()) / "fp4gen_emulator_cache"))
REPO = Path(__file__).resolve().parents[3]


@dataclass
class EmulationResult:
    kernel: str
    out: "object"  # torch (B, Sq, H, D) float32 (the kernel's bf16 O)
    lse: "object"  # torch (B, H, Sq)
    reference_out: "object"
    reference_lse: "object"
    max_abs_err: float
    max_lse_err: float
    trace: T.Trace
    seconds: float
    instructions: int = 0  # warp instructions executed
    emulation_seconds: float = 0.0  # the machine alone (seconds: also compile lookup, host prep, reference)
    schedule: str = "eager"
    seqlen_q: int = 256
    seqlen_k: int = 448
    machine: Optional[M.Machine] = None
    notes: list = field(default_factory=list)


LSE_TOLERANCE = 1e-3  # nats: LSE is fp32 m + log2 l on both sides


def o_tolerance(res: "EmulationResult") -> float:
    """fp32 summation order plus the bf16 rounding of O: a few bf16 ulps of the output's scale."""
    scale = float(res.reference_out.abs().max())
    return 4 * 2.0 ** -8 * max(scale, 1e-3)


# ----------------------------------------------------------------------------- compile cache

def _cache_dir(source: str, cache: Path) -> Path:
    return cache / hashlib.sha256(source.encode()).hexdigest()[:20]


def _cache_key(source: str, backward: bool) -> str:
    """The module's source and the fingerprint of the fp4gen code its kernel traces (the
    kernel classes live in fp4gen/device/sm100/, not in the module); the backward kernel has
    its own entry."""
    from fp4gen.runtime.cache import kernel_deps_version

    key = source + "\0" + kernel_deps_version()
    return key + "\0backward" if backward else key


def library_source(backward: bool = False) -> str:
    """The source of the kernel class the generated modules bind (fp4gen/device/sm100/forward.py
    or backward.py): where its ``kernel(self, ...)`` arguments are named."""
    name = "backward" if backward else "forward"
    return (REPO / "fp4gen" / "device" / "sm100" / f"{name}.py").read_text(encoding="utf-8")


def prime(source: str, ptx: str, mlir: str, cache: Path = CACHE, backward: bool = False) -> None:
    """Record a compile made elsewhere (``fp4gen verify`` has the artifacts already);
    ``backward``: the artifacts are the module's backward kernel's."""
    d = _cache_dir(_cache_key(source, backward), cache)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"tmp{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    (tmp / "kernel.ptx").write_text(ptx)
    (tmp / "kernel.mlir").write_text(mlir)
    for n in ("kernel.ptx", "kernel.mlir"):  # atomic: a concurrent reader sees all or nothing
        os.replace(tmp / n, d / n)
    tmp.rmdir()


def compiled(source: str, cache: Path = CACHE, backward: bool = False):
    """(ptx, mlir) of a generated sm100a module (its forward, or with ``backward`` its bf16
    backward kernel), compiled once per source text."""
    d = _cache_dir(_cache_key(source, backward), cache)
    if (d / "kernel.ptx").exists() and (d / "kernel.mlir").exists():
        return (d / "kernel.ptx").read_text(), (d / "kernel.mlir").read_text()
    from fp4gen.lowering import conformance

    a = conformance.compile_artifacts(source, backward=backward)
    prime(source, a.ptx, a.mlir, cache, backward)
    return a.ptx, a.mlir


def _load_module(source: str):
    with tempfile.TemporaryDirectory(prefix="fp4gen_emu_") as d:
        path = Path(d) / "module.py"
        path.write_text(source)
        key = hashlib.sha256(source.encode()).hexdigest()[:12]
        mod = exec_file(f"fp4gen_emulated_{key}", path)
    return mod


# ----------------------------------------------------------------------------- MLIR signature

def _split_args(s: str) -> list:
    """Split ``%arg0: T0, %arg1: T1`` at top-level commas (types nest <>, (), "", {})."""
    out, depth, cur, q = [], 0, [], False
    for ch in s:
        if ch == '"':
            q = not q
        elif not q:
            if ch in "<({[":
                depth += 1
            elif ch in ">)}]":
                depth -= 1
            elif ch == "," and depth == 0:
                out.append("".join(cur).strip())
                cur = []
                continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def kernel_signature(mlir: str) -> list:
    """[(arg index, type text)] of the ``cuda.kernel``; type aliases (``!memref_gmem_bf16``)
    resolved to their definitions."""
    aliases = dict(re.findall(r"^(![\w.]+) = (.*)$", mlir, re.M))
    m = re.search(r"cuda\.kernel @[\w$]+\(", mlir)
    if not m:
        raise ValueError("no cuda.kernel in the MLIR")
    i, depth = m.end(), 1
    j = i
    q = False
    while depth:
        ch = mlir[j]
        if ch == '"':
            q = not q
        elif not q:
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
        j += 1
    out = []
    for a in _split_args(mlir[i:j - 1]):
        name, typ = a.split(":", 1)
        typ = typ.strip()
        typ = re.sub(r"\s*\{cute_nvgpu\.grid_constant\}$", "", typ)
        out.append((int(name.strip()[4:]), aliases.get(typ, typ)))
    return out


def _layout_text(typ: str) -> Optional[str]:
    """The "shape:stride" string of a memref / coord tensor / layout type."""
    ms = re.findall(r'"([^"]*)"', typ)
    if not ms:
        return None
    if typ.startswith("!cute.coord_tensor"):
        return ms[1]
    return ms[-1]


def _leaves(text: str) -> list:
    return [t.strip() for t in re.split(r"[(),]", text) if t.strip()]


def _split_layout(text: str):
    depth = 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == ":" and depth == 0:
            return text[:i], text[i + 1:]
    raise ValueError(f"no ':' in layout {text!r}")


def _flat(x) -> list:
    if isinstance(x, (tuple, list)):
        out = []
        for y in x:
            out += _flat(y)
        return out
    return [x]


def dynamic_fields(typ: str, shape, stride) -> list:
    """``(value, bits)`` at the ``?`` positions of ``typ``'s layout (shape ones first, then
    strides), taken from a static layout of the same structure; bits is 64 for a ``?{i64}``
    entry (the backward's memref strides), else 32."""
    text = _layout_text(typ)
    sh_t, st_t = _split_layout(re.sub(r"\{div=\d+\}", "", text))
    vals = []
    extents = _flat(shape)
    for toks, real, is_stride in ((_leaves(sh_t), extents, False), (_leaves(st_t), _flat(stride), True)):
        if not any(t.startswith("?") for t in toks):
            continue
        if len(toks) != len(real):
            raise ValueError(f"layout {text} does not match the static layout {shape}:{stride}")
        for i, (t, v) in enumerate(zip(toks, real)):
            if t.startswith("?"):
                vals.append((int(v), 64 if "i64" in t else 32))
            elif "@" not in t and "/" not in t and int(t) != int(v):
                # the stride of an extent-1 mode never moves an address: CuTe's host layout
                # makes it 0 (Sk = 128, one KV tile) where the kernel's type has a static one
                if is_stride and len(extents) == len(toks) and int(extents[i]) == 1:
                    continue
                raise ValueError(f"layout {text}: static {t} but the host layout has {v}")
    return vals


def dynamic_values(typ: str, shape, stride) -> list:
    """The values at the ``?`` positions of ``typ``'s layout (shape ones first, then strides)."""
    return [v for v, _ in dynamic_fields(typ, shape, stride)]


def pack_fields(fields, start: int = 0) -> bytes:
    """The dynamic fields as a struct after ``start`` bytes (a memref's 8-byte pointer): each
    field at its natural alignment (a 64-bit stride after three 32-bit extents starts at byte
    24 of the 40-byte memref parameter)."""
    out = bytearray()
    for v, bits in fields:
        n = bits // 8
        pad = (-(start + len(out))) % n
        out += bytes(pad) + struct.pack("<q" if bits == 64 else "<i", v)
    return bytes(out)


def _has_dynamic(typ: str) -> bool:
    return "?" in typ


def static_gmem_layouts(mod, seqlen_q, seqlen_k, num_bh, num_bh_kv) -> dict:
    """The kernel's global layouts (``_gmem_layouts``) for these sizes as (shape, stride)
    Python tuples, traced by CuTe DSL on the host (as tests/sm100/test_sm100_host.py does)."""
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as bsl

    got = {}

    @cute.jit
    def trace():
        for name, lay in mod._gmem_layouts(cute, bsl, seqlen_q, seqlen_k, num_bh, num_bh_kv).items():
            got[name] = None if lay is None else (lay.shape, lay.stride)

    cute.compile(trace)
    return got


def kernel_arg_names(source: str, pv_block_scaled: bool) -> list:
    """Names of the ``kernel(self, ...)`` arguments in ``source`` (the kernel class's file,
    ``library_source``) in order; the V-scale arguments are None (and absent from the compiled
    signature) without PV block scales."""
    m = re.search(r"def kernel\(\s*self,(.*?)\):", source, re.S)
    if not m:
        raise ValueError("no kernel(self, ...) in the module")
    names = [a.split(":")[0].strip() for a in m.group(1).split(",") if a.strip()]
    if not pv_block_scaled:
        names = [n for n in names if n not in ("tma_sfv", "gSFV_nkl", "sSFV_l", "sSFP_l")]
    return names


# which host operand each kernel argument views
_TMA = {"tma_q": "q", "tma_k": "k", "tma_v": "v", "tma_sfq": "sfq", "tma_sfk": "sfk", "tma_sfv": "sfv",
        "tma_o": "o"}
_COORD = {"gQ_mkl": "q", "gK_nkl": "k", "gV_nkl": "v", "gSFQ_mkl": "sfq", "gSFK_nkl": "sfk",
          "gSFV_nkl": "sfv", "gO_mkl": "o"}
_MEMREF = {"mLSE": "lse", "mVS": "vs", "mSFQb": "sfq", "mSFKb": "sfk"}


@dataclass
class Launch:
    params: bytes
    tensor_maps: dict  # PTX param index -> tensor map
    addresses: dict  # operand name -> global address
    globals_by_arg: dict
    arg_params: dict  # MLIR arg index -> PTX param index


_MLIR_ELEM = {"Float4E2M1FN": "f4E2M1FN", "Float8E4M3FN": "f8E4M3FN", "Float8E8M0FNU": "f8E8M0FNU",
              "Float8E5M2": "f8E5M2", "BFloat16": "bf16", "Float32": "f32"}


def build_launch(mod, source, mlir, ptx_text, module: P.Module, ops, gmem: M.GlobalMemory, softmax_scale,
                 tensor_maps_fn: Optional[Callable] = None) -> Launch:
    cfg = mod._HOST.config
    B, Sq, Sk, H, Hkv = ops.dims
    layouts = ops.layouts()
    addresses = {}
    for name in layouts:  # operand_layouts' order (argument order of __call__)
        t = ops.tensors[name].contiguous()
        addresses[name] = gmem.alloc(t.view(-1).view(__import__("torch").uint8).numpy(), align=1024)
    gl = static_gmem_layouts(mod, Sq, Sk, B * H, B * Hkv)
    D = cfg.head_dim
    gl["qb"] = ((Sq, D // 2, B * H), (D // 2, 1, Sq * (D // 2)))
    gl["kb"] = ((Sk, D // 2, B * Hkv), (D // 2, 1, Sk * (D // 2)))
    sig = kernel_signature(mlir)
    names = kernel_arg_names(library_source(), cfg.pv_block_scaled)
    if len(names) != len(sig):
        raise ValueError(f"{len(names)} kernel(...) arguments but {len(sig)} in the compiled signature")
    poff = M.param_offsets(module)
    params = bytearray(max(poff[p.name] + p.size for p in module.params))
    dyn_args = [(i, n, t) for (i, t), n in zip(sig, names)
                if not (t.startswith(("!cute.layout", "!cute.composed_layout")) and not _has_dynamic(t))]
    if len(dyn_args) != len(module.params):
        raise ValueError(f"{len(dyn_args)} run-time kernel arguments but {len(module.params)} PTX params")
    scale = cfg.softmax_scale if softmax_scale is None else softmax_scale
    scalars = {"seqlen_q": ("<i", Sq), "seqlen_k": ("<i", Sk), "kv_group": ("<i", H // Hkv),
               "num_bh": ("<i", B * H),
               "scale_log2": ("<f", float(np.float32(scale * math.log2(math.e))))}
    arg_params, tma_args, globals_by_arg = {}, {}, {}
    for (arg, name, typ), p in zip(dyn_args, module.params):
        off = poff[p.name]
        arg_params[arg] = p.index
        if typ.startswith("!cute.tiled_mma") or typ.startswith("!mma_"):
            continue  # TiledMMA: its run-time fields (negate bits, accumulate) start as zero
        if name in _TMA:
            op = _TMA[name]
            tma_args[arg] = p.index
            params[off:off + 8] = struct.pack("<Q", 0x7E3A_0000 + arg)  # an opaque handle
            continue
        if name in _COORD:
            vals = dynamic_values(typ, *gl[_COORD[name]])
            data = struct.pack(f"<{len(vals)}i", *vals)
        elif name in _MEMREF or name in ("mQb", "mKb"):
            op = _MEMREF.get(name) or {"mQb": "q", "mKb": "k"}[name]
            lay = gl[{"mQb": "qb", "mKb": "kb"}.get(name, op)]
            vals = dynamic_values(typ, *lay)
            data = struct.pack("<Q", addresses[op]) + struct.pack(f"<{len(vals)}i", *vals)
        elif name in scalars:
            fmt, v = scalars[name]
            data = struct.pack(fmt, v)
        else:
            raise ValueError(f"kernel argument {name} ({typ[:60]}) has no emulator value")
        if len(data) > p.size:
            raise ValueError(f"argument {name}: {len(data)} bytes for the {p.size}-byte {p.name}")
        params[off:off + len(data)] = data
    for i, name in enumerate(layouts):
        if gl.get(name) is not None:
            shape, stride = gl[name]
            globals_by_arg[i] = (addresses[name], shape, stride, _MLIR_ELEM.get(layouts[name].cute_dtype))
    if tensor_maps_fn is None:
        from . import tma
        tensor_maps_fn = tma.tensor_maps
    tmaps = tensor_maps_fn(mlir, globals_by_arg, ptx_text)  # keyed by PTX param index
    missing = set(tma_args.values()) - set(tmaps)
    if missing:
        raise ValueError(f"tensor_maps gave no map for PTX params {sorted(missing)}")
    return Launch(bytes(params), tmaps, addresses, globals_by_arg, arg_params)


# ----------------------------------------------------------------------------- inputs

def make_inputs(seqlen_q, seqlen_k, seed, heads=1, heads_kv=1, batch=1, head_dim=128):
    """bf16 q, k, v (B, S, H, D): normal, q scaled so the scores spread over several units."""
    import torch

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=g) * 1.5
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=g)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=g)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)


def warp_roles(mod) -> dict:
    """warp -> role name from the module's plan (``PLAN_JSON`` pipeline roles, in warp order)."""
    import json

    try:
        roles = json.loads(mod.PLAN_JSON)["pipeline"]["roles"]
    except (AttributeError, KeyError, TypeError, ValueError):
        return {}
    out, w = {}, 0
    for r in roles:
        for _ in range(int(r.get("warps", 0))):
            out[w] = r["name"]
            w += 1
    return out


def _spec_of(mod):
    """The spec a generated module was rendered from, as its PLAN_JSON records it (as the runtime
    reads it: torch_ops._spec_of_module). The spec file may hold several kernels and may have
    changed since; taking its first kernel compared fa4_fp4_full_d128 with fa4_fp4_d128's
    causal reference."""
    from fp4gen.ir.serialize import spec_from_plan_json

    return spec_from_plan_json(mod.PLAN_JSON)


# ----------------------------------------------------------------------------- run

def emulate_forward(module_source: str, *, seqlen_q: int = 256, seqlen_k: int = 448, seed: int = 0,
                    schedule: str = "eager", ptx_mutation: Optional[Callable[[str], str]] = None,
                    inputs=None, softmax_scale=None, ops=None, tensor_maps_fn=None,
                    smem_fill: int = 0, tmem_fill: int = 0, cache: Path = CACHE,
                    strict_aligned: bool = True, keep_machine: bool = False) -> EmulationResult:
    """Emulate CTA (0, 0) of a generated sm100a forward and compare with the reference.

    ``ptx_mutation``: text -> text applied to the compiled PTX before it runs (planted faults).
    ``smem_fill``/``tmem_fill``: the initial byte / 32-bit word of shared and tensor memory
    (uninitialised on the hardware; a NaN pattern makes reads of never-written data visible).
    ``keep_machine``: keep the ``Machine`` (registers, memories) on the result, for debugging.
    ``strict_aligned``: a ``.sync.aligned`` instruction executed by part of a warp raises
    ``EmulationError`` (undefined on the hardware); with False the lanes present act alone and
    the result's ``notes`` list each such execution.
    """
    import torch

    from fp4gen.numerics import reference

    t0 = time.time()
    mod = _load_module(module_source)
    ptx_text, mlir = compiled(module_source, cache)
    if ptx_mutation is not None:
        new = ptx_mutation(ptx_text)
        if new == ptx_text:
            raise ValueError("the PTX mutation changed nothing")
        ptx_text = new
    module = P.parse(ptx_text)
    if inputs is None:
        inputs = make_inputs(seqlen_q, seqlen_k, seed, head_dim=mod._HOST.config.head_dim)
    q, k, v = inputs
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    host_ops = mod._HOST.prepare_operands(q, k, v)
    gmem = M.GlobalMemory()
    launch = build_launch(mod, module_source, mlir, ptx_text, module, host_ops, gmem, softmax_scale,
                          tensor_maps_fn)
    from . import tensor

    smem = tensor.SharedMemory(fill=smem_fill)
    tmem = tensor.TensorMemory(fill=tmem_fill)
    spec = _spec_of(mod)
    tr = T.Trace(kernel=mod.KERNEL_NAME, kv_tiles=math.ceil(Sk / 128), roles=warp_roles(mod))
    mach = M.Machine(module, smem=smem, tmem=tmem, gmem=gmem, params=launch.params,
                     ctaid=(0, 0, 0), nctaid=(math.ceil(Sq / 256), B * H, 1), schedule=schedule,
                     tensor_maps=launch.tensor_maps, ops=ops, trace=tr, strict_aligned=strict_aligned)
    mach.run()
    lay = host_ops.layouts()
    o_bytes = gmem.read(launch.addresses["o"], int(np.prod(lay["o"].shape)) * 2)
    lse_bytes = gmem.read(launch.addresses["lse"], int(np.prod(lay["lse"].shape)) * 4)
    o = torch.frombuffer(bytearray(o_bytes), dtype=torch.bfloat16).view(lay["o"].shape).clone()
    lse = torch.frombuffer(bytearray(lse_bytes), dtype=torch.float32).view(lay["lse"].shape).clone()
    host_ops.tensors["o"], host_ops.tensors["lse"] = o, lse
    out, out_lse = mod._HOST.outputs(host_ops, True)
    ref_o, ref_lse = reference.forward(q, k, v, spec)
    rows = slice(0, min(256, Sq))  # the rows CTA 0 owns
    got = out[:, rows].float()
    want = ref_o[:, rows].float()
    d = (got - want).abs()
    # a NaN the reference does not have is the largest error, not an incomparable one
    d = torch.where(torch.isnan(d) & ~(torch.isnan(got) & torch.isnan(want)), torch.full_like(d, float("inf")),
                    torch.nan_to_num(d, nan=0.0))
    err = float(d.max())
    gl, rl = out_lse[:, :, rows], ref_lse[:, :, rows]
    both_inf = torch.isinf(gl) & torch.isinf(rl) & (torch.sign(gl) == torch.sign(rl))
    dl = torch.where(both_inf, torch.zeros_like(gl), (gl - rl).abs())
    lse_err = float(torch.nan_to_num(dl, nan=float("inf")).max())
    return EmulationResult(kernel=mod.KERNEL_NAME, out=got, lse=gl, reference_out=want,
                           reference_lse=rl, max_abs_err=err, max_lse_err=lse_err, trace=tr,
                           seconds=time.time() - t0, instructions=mach.instructions,
                           emulation_seconds=mach.seconds,
                           schedule=schedule, seqlen_q=Sq, seqlen_k=Sk,
                           machine=mach if keep_machine else None,
                           notes=list(dict.fromkeys(mach.divergent_aligned)))


# ----------------------------------------------------------------------------- the backward
#
# ``emulate_backward`` runs the generated sm100a backward (fp4gen/device/sm100/backward.py) through the
# module's own host code (``_BWD_HOST.backward``: LSE2 / D preprocessing, padding, dQ scaling,
# dtypes) with the kernel launch replaced by ``BackwardLauncher``: every CTA of the grid
# (ceil(Sk / 128) key tiles x H x B), one after another, into one emulated global memory, so
# that the dQ accumulator collects every key tile's red.global.add. The CTAs of the hardware
# run concurrently; the non-deterministic kernel's result depends on their order only through
# the fp32 addition order of dQ.

# kernel(...) argument name -> index of the host ``__call__`` argument it views (the order of
# ``launch``'s args: q, k, v, do, lse2, dsum, dq_acc, dq_turn, dk, dv)
_BWD_HOST_ARGS = {"q": 0, "k": 1, "v": 2, "do": 3, "lse2": 4, "dsum": 5, "dq": 6, "turn": 7, "dk": 8, "dv": 9,
                  "scale": 10}
_BWD_TMA = {"tma_q": "q", "tma_k": "k", "tma_v": "v", "tma_do": "do"}
_BWD_COORD = {"gQ_all": "q", "gK_all": "k", "gV_all": "v", "gdO_all": "do"}
_BWD_MEMREF = {"mLSE2": "lse2", "mDsum": "dsum", "mdQacc": "dq", "mdQturn": "turn", "mdK": "dk", "mdV": "dv",
               "mScale": "scale"}
_TORCH_ELEM = {"bfloat16": "bf16", "float32": "f32", "int32": "i32"}


def backward_kernel_arg_names(source: str) -> list:
    """Names of the backward ``kernel(self, ...)`` arguments of a module with an sm100a
    backward (they are named in fp4gen/device/sm100/backward.py)."""
    if "def _bwd_build(" not in source:
        raise ValueError("the module has no sm100a backward (_bwd_build)")
    return kernel_arg_names(library_source(backward=True), pv_block_scaled=True)


@dataclass
class BackwardEmulationResult:
    kernel: str
    dq: "object"  # torch (B, Sq, H, D) bf16, what the module's backward returned
    dk: "object"
    dv: "object"
    reference: tuple  # (dq, dk, dv) of the oracle: exact float64, or fp4gen's reference backend
    errors: dict  # "dq"/"dk"/"dv" -> relative L2 error against the oracle
    ctas: int
    traces: list  # one T.Trace per CTA, in launch order
    seconds: float
    instructions: int = 0
    emulation_seconds: float = 0.0
    schedule: str = "eager"
    seqlen_q: int = 256
    seqlen_k: int = 256
    causal_offset: int = 0
    notes: list = field(default_factory=list)
    # "exact" (float64 autograd) for bf16 MMAs; "reference" (fp4gen.numerics.reference.backward
    # with the module's spec) with an FP8 dO, whose rounding the exact gradient cannot gate
    oracle: str = "exact"
    exact_errors: dict = field(default_factory=dict)  # against the exact gradient, always


# bf16 P^T / dS^T (the MMA operands) and bf16 outputs: the host tests' tile model of the same
# algorithm reaches about 2.5e-3; a wrong diagonal or a lost key tile gives > 0.1
BWD_TOLERANCE = 1e-2
# against the reference backend of an FP8-dO module's own spec: the same roundings, so what is
# left is fp32 summation order (about 5e-5 on the verify case); a scale or format fault is > 0.1
BWD_REFERENCE_TOLERANCE = 1e-3


def backward_tolerance(res) -> float:
    """The gate of a BackwardEmulationResult: by its oracle."""
    return BWD_TOLERANCE if res.oracle == "exact" else BWD_REFERENCE_TOLERANCE


def rel_l2_error(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (a NaN is an infinite error)."""
    x, ref = x.double(), ref.double()
    d = float((x - ref).norm())
    if math.isnan(d):
        return math.inf
    return d / max(float(ref.norm()), 1e-4 * math.sqrt(ref.numel()))


def exact_backward(q, k, v, do, causal: bool, scale: float):
    """float64 forward (o in bf16, lse fp32 natural log) and autograd's (dq, dk, dv); causal is
    bottom-right aligned (key j visible to query i iff j <= i + Sk - Sq)."""
    import torch

    f = torch.float64
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    Q, K, V = (x.to(f).detach().requires_grad_() for x in (q, k, v))
    g = H // Hkv
    s = torch.einsum("bqhd,bkhd->bhqk", Q, K.repeat_interleave(g, dim=2)) * scale
    if causal:
        hidden = torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + (Sk - Sq)
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(lse)[..., None]
    p = torch.where(seen, torch.exp(s - torch.where(seen, lse[..., None], torch.zeros_like(s))),
                    torch.zeros_like(s))
    o = torch.einsum("bhqk,bkhd->bqhd", p, V.repeat_interleave(g, dim=2))
    (o * do.to(f)).sum().backward()
    return o.detach().to(torch.bfloat16), lse.detach().float(), (Q.grad, K.grad, V.grad)


class BackwardLauncher:
    """Stands in for ``BackwardHost.launch``: builds the backward's ``.param`` bytes and runs
    every CTA of its grid in the emulator, then writes dq_acc, dk and dv back into the host's
    tensors."""

    def __init__(self, source, module: P.Module, mlir: str, ptx_text: str, *, schedule="eager",
                 strict_aligned=True, smem_fill=0, tmem_fill=0, ops=None, roles=None, kernel="",
                 max_instructions=5_000_000, fp8_elems=None):
        self.source, self.module, self.mlir, self.ptx_text = source, module, mlir, ptx_text
        self.schedule, self.strict_aligned = schedule, strict_aligned
        self.smem_fill, self.tmem_fill, self.ops = smem_fill, tmem_fill, ops
        self.roles, self.kernel = roles or {}, kernel
        self.traces, self.instructions, self.seconds, self.notes = [], 0, 0.0, []
        self.causal_offset, self.ctas = None, 0
        self.max_instructions = max_instructions
        self.fp8_elems = fp8_elems or {}  # host argument -> CuTe element type of its uint8 codes

    def params(self, args, addresses, scale, causal_offset) -> tuple:
        """(param bytes, tensor maps) for these host tensors at these global addresses."""
        from . import tma

        q, k = args[0], args[1]
        B, Sq, H, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        # CuTe layouts (element strides) of the host tensors, compact as the host makes them
        lay = {n: (tuple(args[i].shape), tuple(args[i].stride())) for n, i in _BWD_HOST_ARGS.items()}
        # the kernel's (seq, d, head, batch) views of q, k, v, do (``__call__``'s mode [1, 3, 2, 0])
        kview = {}
        for n in ("q", "k", "v", "do"):
            sh, st = lay[n]
            kview[n] = ((sh[1], sh[3], sh[2], sh[0]), (st[1], st[3], st[2], st[0]))
        sig = kernel_signature(self.mlir)
        names = backward_kernel_arg_names(self.source)
        if len(names) != len(sig):
            raise ValueError(f"{len(names)} kernel(...) arguments but {len(sig)} in the compiled signature")
        poff = M.param_offsets(self.module)
        out = bytearray(max(poff[p.name] + p.size for p in self.module.params))
        dyn = [(i, n, t) for (i, t), n in zip(sig, names)
               if not (t.startswith(("!cute.layout", "!cute.composed_layout")) and not _has_dynamic(t))]
        if len(dyn) != len(self.module.params):
            raise ValueError(f"{len(dyn)} run-time kernel arguments but {len(self.module.params)} PTX params")
        scalars = {"seqlen_q": ("<i", Sq), "seqlen_k": ("<i", Sk), "kv_group": ("<i", H // Hkv),
                   "scale_log2": ("<f", float(np.float32(scale * math.log2(math.e)))),
                   "softmax_scale": ("<f", float(np.float32(scale))), "causal_offset": ("<i", int(causal_offset))}
        tma_params = set()
        for (arg, name, typ), p in zip(dyn, self.module.params):
            off = poff[p.name]
            if typ.startswith("!cute.tiled_mma") or typ.startswith("!mma_"):
                continue  # run-time fields (accumulate, negate) start as zero, as in the forward
            if name in _BWD_TMA:
                tma_params.add(p.index)
                data = struct.pack("<Q", 0x7E3A_0000 + arg)  # opaque: the machine maps it to its param
            elif name in _BWD_COORD:
                data = pack_fields(dynamic_fields(typ, *kview[_BWD_COORD[name]]))
            elif name in _BWD_MEMREF:
                op = _BWD_MEMREF[name]
                data = struct.pack("<Q", addresses[op]) + pack_fields(dynamic_fields(typ, *lay[op]), 8)
            elif name in scalars:
                data = struct.pack(*scalars[name])
            else:
                raise ValueError(f"backward kernel argument {name} ({typ[:60]}) has no emulator value")
            if len(data) > p.size:
                raise ValueError(f"argument {name}: {len(data)} bytes for the {p.size}-byte {p.name}")
            out[off:off + len(data)] = data
        def elem(n):  # CuTe's element type of a host tensor (FP8 codes travel as uint8)
            dt = str(args[_BWD_HOST_ARGS[n]].dtype)[6:]
            return self.fp8_elems[n] if dt == "uint8" else _TORCH_ELEM[dt]

        gba = {_BWD_HOST_ARGS[n]: (addresses[n], *kview[n], elem(n)) for n in ("q", "k", "v", "do")}
        tmaps = tma.tensor_maps(self.mlir, gba, self.ptx_text)
        if tma_params - set(tmaps):
            raise ValueError(f"tensor_maps gave no map for PTX params {sorted(tma_params - set(tmaps))}")
        return bytes(out), tmaps

    def __call__(self, args, softmax_scale, causal_offset, gqa):
        import torch

        from . import tensor

        if gqa:
            raise NotImplementedError("the emulated backward is the bf16 dK/dV variant (H == Hkv)")
        self.causal_offset = int(causal_offset)
        gmem = M.GlobalMemory()
        addresses = {}
        for n, i in _BWD_HOST_ARGS.items():
            t = args[i].contiguous()
            addresses[n] = gmem.alloc(t.view(-1).view(torch.uint8).numpy(), align=1024)
        params, tmaps = self.params(args, addresses, softmax_scale, causal_offset)
        B, Sq, H, D = args[0].shape
        Sk = args[1].shape[1]
        tile_n = 128  # BWD_CONFIG.tile_n: the grid's x is ceil(Sk / tile_n) (``__call__``)
        grid = (math.ceil(Sk / tile_n), H, B)
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    tr = T.Trace(kernel=self.kernel, kv_tiles=0, roles=self.roles)
                    mach = M.Machine(self.module, smem=tensor.SharedMemory(fill=self.smem_fill),
                                     tmem=tensor.TensorMemory(fill=self.tmem_fill), gmem=gmem, params=params,
                                     ctaid=(x, y, z), nctaid=grid, schedule=self.schedule, tensor_maps=tmaps,
                                     ops=self.ops, trace=tr, strict_aligned=self.strict_aligned,
                                     max_instructions=self.max_instructions)
                    mach.run()
                    self.traces.append(tr)
                    self.instructions += mach.instructions
                    self.seconds += mach.seconds
                    self.notes += [f"CTA {(x, y, z)}: {n}" for n in dict.fromkeys(mach.divergent_aligned)]
        for n in ("dq", "dk", "dv"):
            t = args[_BWD_HOST_ARGS[n]]
            raw = gmem.read(addresses[n], t.numel() * t.element_size())
            t.copy_(torch.frombuffer(bytearray(raw), dtype=t.dtype).view(t.shape))
        self.ctas = grid[0] * grid[1] * grid[2]


def make_backward_inputs(seqlen_q, seqlen_k, seed, heads=1, batch=1, head_dim=128):
    """bf16 q, k, v, do (B, S, H, D): normal, seeded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, s, heads, head_dim, generator=g).to(torch.bfloat16)
                 for s in (seqlen_q, seqlen_k, seqlen_k, seqlen_q))


def emulate_backward(module_source: str, *, seqlen_q: int = 256, seqlen_k: int = 256, seed: int = 0,
                     schedule: str = "eager", ptx_mutation: Optional[Callable[[str], str]] = None,
                     strict_aligned: bool = True, heads: int = 1, batch: int = 1, inputs=None,
                     softmax_scale=None, causal_offset_error: int = 0, smem_fill: int = 0,
                     tmem_fill: int = 0, ops=None, max_instructions: int = 5_000_000,
                     cache: Path = CACHE) -> BackwardEmulationResult:
    """Emulate the generated sm100a backward of ``module_source`` on every CTA of its grid and
    compare dq, dk, dv with the exact float64 gradient (``exact_backward``).

    The module's own ``backward`` runs on CPU tensors (its device and TMA-alignment checks
    skipped) with ``BackwardLauncher`` as the launch. ``ptx_mutation``: text -> text applied to
    the compiled backward PTX (planted faults); ``causal_offset_error`` is added to the causal
    offset the host passes (a planted host fault). ``inputs``: (q, k, v, do) bf16.
    ``max_instructions``: per CTA; past it the CTA stops with ``EmulationError`` (a
    deterministic kernel's dQ turn that never comes spins forever otherwise).

    Limitation: the CTAs run one at a time in launch order (x fastest), so only that order of
    the CTAs' dQ additions is seen; a deterministic kernel's turn wait is satisfied only because
    its turns go in key-tile order (a wait for a later CTA would stop as above).
    """
    import contextlib
    from unittest import mock

    from fp4gen.runtime import checks

    t0 = time.time()
    mod = _load_module(module_source)
    ptx_text, mlir = compiled(module_source, cache, backward=True)
    if ptx_mutation is not None:
        new = ptx_mutation(ptx_text)
        if new == ptx_text:
            raise ValueError("the PTX mutation changed nothing")
        ptx_text = new
    module = P.parse(ptx_text)
    if inputs is None:
        inputs = make_backward_inputs(seqlen_q, seqlen_k, seed, heads, batch, mod.BWD_CONFIG.head_dim)
    q, k, v, do = inputs
    scale = mod.SOFTMAX_SCALE if softmax_scale is None else softmax_scale
    o, lse, ref = exact_backward(q, k, v, do, mod.BWD_CONFIG.causal, scale)
    roles = {}
    try:
        import json

        w = 0
        for r in json.loads(mod.PLAN_JSON)["backward"]["roles"]:
            for _ in range(int(r["warps"])):
                roles[w], w = r["name"], w + 1
    except (AttributeError, KeyError, TypeError, ValueError):
        pass  # no plan in the module: the trace has no role names
    launcher = BackwardLauncher(module_source, module, mlir, ptx_text, schedule=schedule,
                                strict_aligned=strict_aligned, smem_fill=smem_fill, tmem_fill=tmem_fill,
                                ops=ops, roles=roles, kernel=mod.KERNEL_NAME + ".backward",
                                max_instructions=max_instructions,
                                fp8_elems={"v": "f8E4M3FN", "do": {"e4m3": "f8E4M3FN", "e5m2": "f8E5M2"}.get(
                                    mod.BWD_CONFIG.do_format)})

    def launch(args, s, off, gqa):
        return launcher(args, s, off + causal_offset_error, gqa)

    orig_check = checks.check_backward

    def check_backward_cpu(*a, **kw):  # CPU tensors: no device or TMA-alignment requirement
        kw.update(device_type=None, tma=False)
        return orig_check(*a, **kw)

    with contextlib.ExitStack() as es:
        es.enter_context(mock.patch.object(checks, "check_backward", check_backward_cpu))
        es.enter_context(mock.patch.object(checks, "require_arch", lambda *a, **kw: None))
        dq, dk, dv = mod._BWD_HOST.backward(q, k, v, o, lse, do, softmax_scale=softmax_scale,
                                            launch=launch)
    exact_errors = {n: rel_l2_error(x, r) for n, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref)}
    errors, oracle = exact_errors, "exact"
    if mod.BWD_CONFIG.do_fp8:
        # the module's own numerics (FP8 dO and V, E4M3 P^T): the reference backend of its spec
        import dataclasses

        from fp4gen.numerics import reference as refnum

        spec = dataclasses.replace(_spec_of(mod), softmax_scale=scale)
        ref = refnum.backward(q, k, v, o, lse, do, spec)
        errors, oracle = {n: rel_l2_error(x, r) for n, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref)}, "reference"
    return BackwardEmulationResult(kernel=mod.KERNEL_NAME, dq=dq, dk=dk, dv=dv, reference=ref, errors=errors,
                                   oracle=oracle, exact_errors=exact_errors,
                                   ctas=launcher.ctas, traces=launcher.traces, seconds=time.time() - t0,
                                   instructions=launcher.instructions, emulation_seconds=launcher.seconds,
                                   schedule=schedule, seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                                   causal_offset=launcher.causal_offset, notes=list(dict.fromkeys(launcher.notes)))
