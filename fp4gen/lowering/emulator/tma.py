"""Tensor maps and ``cp.async.bulk.tensor`` tile loads of the sm100a CTA emulator.

``TensorMap`` holds what ``cuTensorMapEncodeTiled`` receives (data type, rank, global
dimensions and byte strides, box dimensions, element strides, swizzle, OOB fill = zeros);
``tma_load`` performs one ``cp.async.bulk.tensor.<N>d.shared::{cta,cluster}.global.tile
.mbarrier::complete_tx::bytes`` (PTX ISA 9.7.9.25.5.2) with such a map; ``tensor_maps``
builds each TMA atom's map **from the compiled kernel's MLIR**, not from the plan.

Where the maps come from. CuTe DSL's lowered host code does not call ``cuTensorMapEncodeTiled``:
after its pipeline the host function packs the 128-byte ``CUtensorMap`` itself, as bit fields
of an ``array<16 x i64>`` whose format is not public (checked on fa4_fp4_d128 by dumping the
module after ``Compiler.compile``). So box and swizzle are derived from the kept MLIR (the
``CUTE_DSL_KEEP=ir`` module) instead:

* ``cute_nvgpu.atom.make_non_exec_tiled_tma_load(%view, %smem_layout, %cta_tiler)`` in the host
  function: its result type carries ``tma_gbasis`` (the TMA box as modes of the global tensor:
  each top mode is one TMA dimension, dimension 0 innermost; a mode may combine several
  contiguous global sub-modes) and ``tma_format`` (the TMA element type: U4, U8, U16,
  BF16_RN...); the SMEM layout operand carries the swizzle ``S<B,4,3>`` (B = 1/2/3: 32/64/128
  bytes, 0 or absent: none); the view operand's memref type is the global layout (static
  entries; the dynamic ones come from the caller).
* the kernel signature / ``cuda.launch_ex`` operands: which kernel argument each atom is.

Assumed, not stated by the ISA text: 4-bit elements (U4, ``.b4x16`` "copied as is", ISA
5.5.1.1) are numbered low nibble first within a byte, so a box row that ends inside a byte keeps
the low nibble and zero-fills the high one (only V^T with an odd key count does this).

A basis ``k@a@b@c`` in ``tma_gbasis`` is read as scale k on the global mode path [c][b][a]
(CuTe prints the innermost index first; checked against the shapes it selects, e.g. the
scale-factor box ``(2,4,32)`` = 2 x 16-bit scale pairs, 4 row groups, 32 rows).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .tensor import SharedMemory, TensorOpError, smem_spans, swizzle_address

# tma_format -> bits of one TMA element
_FORMAT_BITS = {"U4": 4, "U8": 8, "U16": 16, "U32": 32, "U64": 64, "BF16_RN": 16, "F16_RN": 16,
                "F32_RN": 32, "TF32_RN": 32, "S32": 32, "F64_RN": 64}
_ELEM_BITS = {"f4E2M1FN": 4, "f8E4M3FN": 8, "f8E5M2": 8, "f8E8M0FNU": 8, "i8": 8, "u8": 8, "bf16": 16,
              "f16": 16, "f32": 32, "i32": 32}


@dataclass(frozen=True)
class TensorMap:
    """A tiled tensor map (the ``cuTensorMapEncodeTiled`` arguments; dimension 0 innermost).

    elem_bits: bits of one TMA element (4 for the packed sub-byte type, ISA 5.5.1.1 ``.b4x16``:
    copied as is); global_dims: elements per dimension; global_strides: bytes between
    consecutive indices of dimensions 1 .. rank-1 (rank-1 entries, as ``cuTensorMapEncodeTiled``
    takes them: dimension 0 is dense by definition); box_dims: elements per dimension of the box;
    element_strides: all 1 here (traversal stride, 9.7.9.25.5.2 / 5.5.3.1); swizzle: 0, 32, 64,
    128 (bytes, ISA 5.5.7); oob_fill: "zero" (ISA 5.5.3.3, zero fill mode)."""

    elem_bits: int
    global_address: int
    global_dims: tuple
    global_strides: tuple
    box_dims: tuple
    element_strides: tuple = ()
    swizzle: int = 0
    oob_fill: str = "zero"
    name: str = ""
    dtype: str = ""  # the atom's tma_format (U4, U8, U16, BF16_RN, ...), for messages

    @property
    def rank(self) -> int:
        return len(self.global_dims)

    @property
    def box_bytes(self) -> int:
        return int(np.prod(self.box_dims)) * self.elem_bits // 8

    def check(self):
        r = self.rank
        if not 1 <= r <= 5 or len(self.global_strides) != r - 1 or len(self.box_dims) != r:
            raise TensorOpError(f"tensor map {self.name}: rank {r} with {len(self.global_strides)} strides, "
                                f"{len(self.box_dims)} box dims")
        if self.element_strides and any(e != 1 for e in self.element_strides):
            raise NotImplementedError(f"tensor map {self.name}: element strides {self.element_strides}")
        if self.oob_fill != "zero":
            raise NotImplementedError(f"tensor map {self.name}: OOB fill {self.oob_fill!r}")
        inner = self.box_dims[0] * self.elem_bits
        if inner % 128:
            raise TensorOpError(f"tensor map {self.name}: box inner dimension of {inner} bits is not a "
                                "multiple of 16 bytes")
        if self.swizzle not in (0, 32, 64, 128):
            raise NotImplementedError(f"tensor map {self.name}: swizzle {self.swizzle}")
        if self.swizzle and inner // 8 != self.swizzle:
            # the driver allows an inner box <= the swizzle span; the generated kernels always
            # fill it, and a shorter row's placement is not modelled
            raise NotImplementedError(f"tensor map {self.name}: box inner dimension of {inner // 8} bytes "
                                      f"under a {self.swizzle}-byte swizzle")
        if any(s % 16 for s in self.global_strides):
            raise TensorOpError(f"tensor map {self.name}: global strides {self.global_strides} must be "
                                "multiples of 16 bytes")


def tma_load(smem: SharedMemory, gmem_read: Callable[[int, int], bytes], tmap: TensorMap, coords,
             smem_addr: int) -> tuple[int, tuple]:
    """One tile-mode ``cp.async.bulk.tensor`` global -> shared (PTX ISA 9.7.9.25.5.2).

    The box at ``coords`` (one per dimension, innermost first; signed) is written densely to
    SMEM from ``smem_addr``, dimension 0 fastest, with the map's swizzle applied to the SMEM
    byte addresses (ISA 5.5.7: 16-byte chunks of each 128-byte row XORed with the row index
    modulo 2/4/8, the pattern anchored at 256/512/1024-byte boundaries -- the same function
    as the MMA's Swizzle<B,4,3>). Box elements outside the tensor are zeros (5.5.3.3).
    Returns (bytes delivered = the whole box, what complete_tx counts; SMEM spans written)."""
    tmap.check()
    coords = tuple(int(c) for c in coords)
    if len(coords) != tmap.rank:
        raise TensorOpError(f"tensor map {tmap.name}: {len(coords)} coordinates for rank {tmap.rank}")
    if smem_addr % 128:
        raise TensorOpError(f"cp.async.bulk.tensor to SMEM {smem_addr:#x}: must be 128-byte aligned "
                            "(ISA 9.7.9.25.5.2)")
    if tmap.swizzle and smem_addr % (8 * tmap.swizzle) and hasattr(smem, "finding"):
        smem.finding(f"cp.async.bulk.tensor: {tmap.swizzle}B-swizzled box {tmap.name} at SMEM {smem_addr:#x}, "
                     f"not at a {8 * tmap.swizzle}-byte boundary (ISA 5.5.7 states the pattern for aligned "
                     "starts; the emulator swizzles by absolute address bits)")
    eb = tmap.elem_bits
    box = tmap.box_dims
    n0 = box[0]
    sub = eb < 8  # 4-bit elements: placed element by element (a run may end inside a byte)
    per = 8 // eb if sub else 1
    out = np.zeros(int(np.prod(box)) if sub else tmap.box_bytes, dtype=np.uint8)
    ebytes = eb // 8
    # every box row (all dimensions but 0): one contiguous run of dimension 0
    for idx in np.ndindex(*reversed(box[1:])):
        outer = tuple(reversed(idx))  # (b1, b2, ...)
        g = [c + b for c, b in zip(coords[1:], outer)]
        if any(not 0 <= x < d for x, d in zip(g, tmap.global_dims[1:])):
            continue  # the whole row is out of bounds: zeros (ISA 5.5.3.3)
        lo = max(0, coords[0])
        hi = min(tmap.global_dims[0], coords[0] + n0)
        if lo >= hi:
            continue
        row_off = tmap.global_address + sum(x * st for x, st in zip(g, tmap.global_strides))
        lin = 0
        for b, n in zip(reversed(outer), reversed(box[1:])):
            lin = lin * n + b
        first = lin * n0 + (lo - coords[0])  # box element index of global element lo
        if sub:
            b0, b1 = lo // per, (hi + per - 1) // per
            raw = np.frombuffer(gmem_read(row_off + b0, b1 - b0), dtype=np.uint8)
            # ISA 5.5.1.1 (.b4x16 "copied as is"): element 2i taken as the low nibble, as in SMEM
            nib = np.stack([(raw >> (eb * j)) & ((1 << eb) - 1) for j in range(per)], axis=1).ravel()
            out[first:first + hi - lo] = nib[lo - b0 * per: hi - b0 * per]
        else:
            data = np.frombuffer(gmem_read(row_off + lo * ebytes, (hi - lo) * ebytes), dtype=np.uint8)
            out[first * ebytes: first * ebytes + data.size] = data
    if sub:
        out = np.bitwise_or.reduce(np.stack([out[j::per] << (eb * j) for j in range(per)]), axis=0).astype(np.uint8)
    addrs = swizzle_address(smem_addr + np.arange(out.size, dtype=np.int64), tmap.swizzle)
    if int(addrs.max()) >= len(smem.data):
        raise TensorOpError(f"cp.async.bulk.tensor: box of {out.size} bytes at {smem_addr:#x} overruns SMEM")
    smem.view()[addrs] = out
    return out.size, smem_spans(addrs)


def tma_store(smem: SharedMemory, gmem_write: Callable[[int, bytes], None], tmap: TensorMap, coords,
              smem_addr: int) -> tuple[int, tuple]:
    """One tile-mode ``cp.async.bulk.tensor`` shared -> global (PTX ISA 9.7.9.25.5.2, the
    ``.global.shared::cta.bulk_group`` form): ``tma_load``'s box read back from SMEM (the same
    swizzle) and written to the tensor, box elements outside the tensor dropped (5.5.3.3: a store
    never writes out of bounds). Byte-sized elements only. Returns (bytes read from SMEM, the
    SMEM spans read)."""
    tmap.check()
    coords = tuple(int(c) for c in coords)
    if len(coords) != tmap.rank:
        raise TensorOpError(f"tensor map {tmap.name}: {len(coords)} coordinates for rank {tmap.rank}")
    if smem_addr % 128:
        raise TensorOpError(f"cp.async.bulk.tensor from SMEM {smem_addr:#x}: must be 128-byte aligned")
    if tmap.elem_bits < 8:
        raise NotImplementedError(f"tensor map {tmap.name}: a TMA store of {tmap.elem_bits}-bit elements")
    box = tmap.box_dims
    n0, ebytes = box[0], tmap.elem_bits // 8
    addrs = swizzle_address(smem_addr + np.arange(tmap.box_bytes, dtype=np.int64), tmap.swizzle)
    if int(addrs.max()) >= len(smem.data):
        raise TensorOpError(f"cp.async.bulk.tensor: box of {tmap.box_bytes} bytes at {smem_addr:#x} overruns SMEM")
    data = smem.view()[addrs]
    for idx in np.ndindex(*reversed(box[1:])):
        outer = tuple(reversed(idx))
        g = [c + b for c, b in zip(coords[1:], outer)]
        if any(not 0 <= x < d for x, d in zip(g, tmap.global_dims[1:])):
            continue
        lo = max(0, coords[0])
        hi = min(tmap.global_dims[0], coords[0] + n0)
        if lo >= hi:
            continue
        lin = 0
        for b, n in zip(reversed(outer), reversed(box[1:])):
            lin = lin * n + b
        first = (lin * n0 + (lo - coords[0])) * ebytes
        row_off = tmap.global_address + sum(x * st for x, st in zip(g, tmap.global_strides))
        gmem_write(row_off + lo * ebytes, data[first:first + (hi - lo) * ebytes].tobytes())
    return tmap.box_bytes, smem_spans(addrs)


# ============================================================================ maps from the MLIR

_ATOM = re.compile(r"%(\w+), %(\w+) = cute_nvgpu\.atom\.make_non_exec_tiled_tma_(?:load|store)\((%\w+), (%\w+), (%\w+)\)"
                   r".*?: \((.*)\) -> \(!cute_nvgpu\.atom\.non_exec_tiled_tma_(?:load|store)<(.*?)>, !cute\.coord_tensor")


def _parse_tuple(s: str):
    """'(a,(b,c),d)' -> nested tuples of strings/ints."""
    s = s.strip()
    pos = 0

    def item():
        nonlocal pos
        if s[pos] == "(":
            pos += 1
            out = []
            while s[pos] != ")":
                out.append(item())
                if s[pos] == ",":
                    pos += 1
            pos += 1
            return tuple(out)
        m = re.match(r"[^,()]+", s[pos:])
        pos += m.end()
        tok = m.group(0).strip()
        return int(tok) if re.fullmatch(r"-?\d+", tok) else tok

    return item()


def _layout(s: str):
    """'shape:stride' -> (shape, stride) nested tuples (a bare int for rank 0)."""
    depth = 0
    for i, ch in enumerate(s):
        depth += ch == "("
        depth -= ch == ")"
        if ch == ":" and depth == 0:
            return _parse_tuple(s[:i]), _parse_tuple(s[i + 1:])
    raise ValueError(f"not a layout: {s!r}")


def _at(tree, path):
    for p in path:
        if not isinstance(tree, tuple):
            raise TensorOpError(f"mode path {path} goes below a leaf")
        tree = tree[p]
    return tree


def _split_types(sig: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in sig:
        depth += ch in "<(["
        depth -= ch in ">)]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


@dataclass(frozen=True)
class TmaAtom:
    """One TMA atom of the kernel, as the MLIR states it."""

    kernel_arg: int  # index among the kernel's (MLIR) arguments
    host_arg: int | None  # the host function's pointer argument its global view is built from
    elem_type: str  # global element type, e.g. f4E2M1FN
    gmem_layout: tuple  # (shape, stride) of the memref type; '?' entries are dynamic
    gbasis: tuple  # (shape, basis) of tma_gbasis
    tma_format: str
    swizzle: int  # bytes
    copy_bits: int


def tma_atoms(mlir: str) -> list[TmaAtom]:
    """Every ``make_non_exec_tiled_tma_load`` / ``_store`` of the host function, with its kernel
    argument."""
    aliases = dict(re.findall(r"^(!\w+) = (.*)$", mlir, re.M))
    host = re.search(r"^\s*func\.func @cutlass___call__", mlir, re.M)
    if not host:
        raise TensorOpError("no host function (func.func @cutlass___call__...) in the MLIR")
    mlir = mlir[host.start():]  # SSA names are reused inside the kernel: read the host only
    iters = dict(re.findall(r"%(\w+) = cute\.get_iter\(%arg(\d+)\)", mlir))
    views = {}
    for v, src in re.findall(r"%(\w+) = cute\.make_view\(%(\w+),", mlir):
        if src.startswith("arg") and src[3:].isdigit():
            views[v] = src[3:]
        elif src in iters:
            views[v] = iters[src]
    launch = re.search(r"cuda\.launch_ex @\S+<%\w+> \(([^)]*)\)", mlir)
    if not launch:
        raise TensorOpError("no cuda.launch_ex in the MLIR (not a kept host module?)")
    largs = [a.strip().lstrip("%") for a in launch.group(1).split(",")]
    out = []
    for m in _ATOM.finditer(mlir):
        atom, _tensor, view, smem_l, _tiler, sig, attrs = m.groups()
        types = _split_types(sig)
        mem = aliases.get(types[0], types[0])
        mm = re.search(r'!cute\.memref<(\w+), gmem, [^"]*"([^"]*)">', mem)
        if not mm:
            raise TensorOpError(f"TMA atom %{atom}: global operand type {mem!r} is not a gmem memref")
        sw = re.search(r"S<(\d+),(\d+),(\d+)>", types[1])
        if sw and (sw.group(2), sw.group(3)) != ("4", "3"):
            raise NotImplementedError(f"TMA atom %{atom}: SMEM swizzle {sw.group(0)}")
        swz = 0 if not sw or sw.group(1) == "0" else 16 << int(sw.group(1))
        gb = re.search(r'tma_gbasis = <"([^"]*)">', attrs)
        fm = re.search(r"tma_format = (\w+)", attrs)
        cb = re.search(r"copy_bits = (\d+)", attrs)
        if atom not in largs:
            raise TensorOpError(f"TMA atom %{atom} is not a kernel argument of the launch")
        hv = views.get(view.lstrip("%"))
        out.append(TmaAtom(largs.index(atom), int(hv) if hv is not None else None, mm.group(1),
                           _layout(mm.group(2)), _layout(gb.group(1)), fm.group(1), swz, int(cb.group(1))))
    return out


def _basis_path(b: str) -> tuple:
    parts = b.split("@")
    if parts[0] != "1":
        raise NotImplementedError(f"tma_gbasis basis {b!r} with a scale other than 1")
    return tuple(int(p) for p in reversed(parts[1:]))


def _leaves(shape, basis):
    if isinstance(shape, tuple):
        out = []
        for s, b in zip(shape, basis):
            out += _leaves(s, b)
        return out
    return [(shape, basis)]


def _fill(layout_static, given, what):
    """The caller's concrete (shape, stride) checked against the memref's static entries (the
    stride of an extent-1 mode is not checked: CuTe makes it 0 when the size is 1)."""
    def walk(sh, st, gsh, gst):
        if isinstance(sh, tuple):
            if not (isinstance(gsh, tuple) and isinstance(gst, tuple) and len(gsh) == len(sh) == len(gst)):
                raise TensorOpError(f"{what}: layout {given} does not match the kernel's {layout_static}")
            parts = [walk(*x) for x in zip(sh, st, gsh, gst)]
            return tuple(p[0] for p in parts), tuple(p[1] for p in parts)
        if isinstance(gsh, tuple) or isinstance(gst, tuple):
            raise TensorOpError(f"{what}: layout {given} does not match the kernel's {layout_static}")
        if isinstance(sh, int) and sh != int(gsh):
            raise TensorOpError(f"{what}: extent {gsh} where the kernel's layout has the static {sh}")
        if isinstance(st, int) and st != int(gst) and int(gsh) != 1:
            raise TensorOpError(f"{what}: stride {gst} where the kernel's layout has the static {st}")
        return int(gsh), int(gst)
    return walk(layout_static[0], layout_static[1], given[0], given[1])


def tensor_map_of(atom: TmaAtom, address: int, shape, stride, name: str = "") -> TensorMap:
    """The tensor map of ``atom`` over a global tensor at ``address`` with the CuTe layout
    (shape, stride) in elements (nested like the atom's memref; the memref's static entries
    must agree).

    Each top mode of ``tma_gbasis`` is one TMA dimension; its components (box extent, global
    mode path) are converted to TMA elements (``tma_format``: a global mode of stride 1 element
    narrower than the TMA element is merged, e.g. 4 bytes of E4M3 scales = 2 U16); the
    components of one dimension must be contiguous in memory (each full but the last). Global
    extent = product of the inner components x the last component's global extent; stride =
    the first component's stride."""
    shape, stride = _fill(atom.gmem_layout, (shape, stride), f"TMA atom {name or atom.kernel_arg}")
    fb = _FORMAT_BITS.get(atom.tma_format)
    eb = _ELEM_BITS.get(atom.elem_type)
    if fb is None or eb is None:
        raise NotImplementedError(f"TMA format {atom.tma_format} / element type {atom.elem_type}")
    gshape, gbasis = atom.gbasis
    if not isinstance(gshape, tuple):
        gshape, gbasis = (gshape,), (gbasis,)
    dims, strides, boxes = [], [], []
    for d, (ms, mb) in enumerate(zip(gshape, gbasis)):
        comps = _leaves(ms, mb)
        ext_t, str_t = [], []
        for box_e, b in comps:
            path = _basis_path(b)
            s_, d_ = _at(shape, path), _at(stride, path)
            if isinstance(s_, tuple) or isinstance(d_, tuple):
                raise TensorOpError(f"tma_gbasis path {path} is not a leaf of the global layout")
            bits = d_ * eb
            if bits % fb:
                if d_ != 1 or fb % eb:
                    raise TensorOpError(f"global mode {path} (stride {d_}) is not addressable in {atom.tma_format}")
                ext_t.append(s_ * eb // fb)
                str_t.append(1)
            else:
                ext_t.append(s_)
                str_t.append(bits // fb)
        box_ext = [int(e) for e, _ in comps]
        for j in range(len(comps) - 1):
            if box_ext[j] != ext_t[j] or str_t[j + 1] != str_t[j] * box_ext[j]:
                raise TensorOpError(f"TMA dimension {d} of atom {atom.kernel_arg}: components {comps} are "
                                    "not contiguous in the global tensor")
        if d == 0 and str_t[0] != 1:
            raise TensorOpError(f"TMA dimension 0 of atom {atom.kernel_arg} has stride {str_t[0]} (must be 1)")
        dims.append(int(np.prod(box_ext[:-1])) * ext_t[-1])
        if d:
            strides.append(str_t[0] * fb // 8)
        boxes.append(int(np.prod(box_ext)))
    tm = TensorMap(fb, int(address), tuple(dims), tuple(strides), tuple(boxes), (1,) * len(dims),
                   atom.swizzle, "zero", name, atom.tma_format)
    tm.check()
    if atom.copy_bits % (tm.box_bytes * 8):
        raise TensorOpError(f"TMA atom {atom.kernel_arg}: copy of {atom.copy_bits} bits is not a whole "
                            f"number of {tm.box_bytes}-byte boxes")
    return tm


def _ptx_tensormap_params(ptx: str) -> list[int]:
    """Indices of the PTX kernel parameters that are 128-byte, 64-aligned byte arrays (the
    CUtensorMap parameters), in order."""
    return [int(m.group(1)) for m in re.finditer(r"\.param \.align 64 \.b8 \w+_param_(\d+)\[128\]", ptx)]


def tensor_maps(mlir: str, globals_by_arg: dict, ptx: str | None = None) -> dict[int, TensorMap]:
    """Each TMA atom's ``TensorMap``, keyed by kernel parameter index.

    ``globals_by_arg``: host pointer argument index (the ``%argN`` of the host function that the
    atom's global view is built from = the position in the generated module's ``__call__`` /
    ``operand_layouts`` order) -> ``(address, shape, strides, dtype)``: the device address of
    the global tensor, its CuTe layout in elements as nested tuples (what ``_gmem_layouts``
    gives for the run's sizes; static entries are checked against the kernel's memref type),
    and its element type name (CuTe's, e.g. ``"f4E2M1FN"``, or ``None`` to skip the check).

    Keys of the result: with ``ptx``, the PTX parameter index of each atom (the k-th atom is the
    k-th ``.param .align 64 .b8 ..[128]``, checked by count); without it, the atom's index among
    the MLIR kernel's arguments (equal to the PTX index when no argument before it is dropped,
    true of the generated kernels, whose atoms precede every static-layout argument)."""
    atoms = tma_atoms(mlir)
    keys = [a.kernel_arg for a in atoms]
    if ptx is not None:
        pidx = _ptx_tensormap_params(ptx)
        if len(pidx) != len(atoms):
            raise TensorOpError(f"{len(atoms)} TMA atoms in the MLIR, {len(pidx)} tensor-map parameters in the PTX")
        keys = pidx
    out = {}
    for key, a in zip(keys, atoms):
        if a.host_arg is None or a.host_arg not in globals_by_arg:
            raise TensorOpError(f"TMA atom (kernel argument {a.kernel_arg}) is built on host argument "
                                f"{a.host_arg}, not in globals_by_arg {sorted(globals_by_arg)}")
        addr, shape, strides, dtype = globals_by_arg[a.host_arg]
        if dtype is not None and str(dtype) != a.elem_type:
            raise TensorOpError(f"TMA atom on host argument {a.host_arg}: element type {dtype}, the kernel's is "
                                f"{a.elem_type}")
        out[key] = tensor_map_of(a, addr, shape, strides, name=f"arg{a.host_arg}")
    return out


__all__ = ["TensorMap", "TmaAtom", "tma_load", "tma_store", "tma_atoms", "tensor_map_of", "tensor_maps"]
