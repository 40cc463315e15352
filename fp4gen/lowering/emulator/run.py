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
"""
from __future__ import annotations

import hashlib
import importlib.util
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


def prime(source: str, ptx: str, mlir: str, cache: Path = CACHE) -> None:
    """Record a compile made elsewhere (``fp4gen verify`` has the artifacts already)."""
    d = _cache_dir(source, cache)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"tmp{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    (tmp / "kernel.ptx").write_text(ptx)
    (tmp / "kernel.mlir").write_text(mlir)
    for n in ("kernel.ptx", "kernel.mlir"):  # atomic: a concurrent reader sees all or nothing
        os.replace(tmp / n, d / n)
    tmp.rmdir()


def compiled(source: str, cache: Path = CACHE):
    """(ptx, mlir) of a generated sm100a module, compiled once per source text."""
    d = _cache_dir(source, cache)
    if (d / "kernel.ptx").exists() and (d / "kernel.mlir").exists():
        return (d / "kernel.ptx").read_text(), (d / "kernel.mlir").read_text()
    from fp4gen.lowering import conformance

    a = conformance.compile_artifacts(source)
    prime(source, a.ptx, a.mlir, cache)
    return a.ptx, a.mlir


def _load_module(source: str):
    with tempfile.TemporaryDirectory(prefix="fp4gen_emu_") as d:
        path = Path(d) / "module.py"
        path.write_text(source)
        key = hashlib.sha256(source.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(f"fp4gen_emulated_{key}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
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


def dynamic_values(typ: str, shape, stride) -> list:
    """The values at the ``?`` positions of ``typ``'s layout (shape ones first, then strides),
    taken from a static layout of the same structure."""
    text = _layout_text(typ)
    sh_t, st_t = _split_layout(re.sub(r"\{div=\d+\}", "", text))
    vals = []
    for toks, real in ((_leaves(sh_t), _flat(shape)), (_leaves(st_t), _flat(stride))):
        if "?" not in toks:
            continue
        if len(toks) != len(real):
            raise ValueError(f"layout {text} does not match the static layout {shape}:{stride}")
        for t, v in zip(toks, real):
            if t == "?":
                vals.append(int(v))
            elif "@" not in t and "/" not in t and int(t) != int(v):
                raise ValueError(f"layout {text}: static {t} but the host layout has {v}")
    return vals


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
    """Names of the template's ``kernel(self, ...)`` arguments in order; the V-scale arguments
    are None (and absent from the compiled signature) without PV block scales."""
    m = re.search(r"def kernel\(\s*self,(.*?)\):", source, re.S)
    if not m:
        raise ValueError("no kernel(self, ...) in the module")
    names = [a.split(":")[0].strip() for a in m.group(1).split(",") if a.strip()]
    if not pv_block_scaled:
        names = [n for n in names if n not in ("tma_sfv", "gSFV_nkl", "sSFV_l", "sSFP_l")]
    return names


# which host operand each kernel argument views
_TMA = {"tma_q": "q", "tma_k": "k", "tma_v": "v", "tma_sfq": "sfq", "tma_sfk": "sfk", "tma_sfv": "sfv"}
_COORD = {"gQ_mkl": "q", "gK_nkl": "k", "gV_nkl": "v", "gSFQ_mkl": "sfq", "gSFK_nkl": "sfk",
          "gSFV_nkl": "sfv"}
_MEMREF = {"mO": "o", "mLSE": "lse", "mVS": "vs", "mSFQb": "sfq", "mSFKb": "sfk"}


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
    names = kernel_arg_names(source, cfg.pv_block_scaled)
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
    from fp4gen.frontend import parse_file

    path = REPO / mod.SPEC_FILE
    return parse_file(path)[0]


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
