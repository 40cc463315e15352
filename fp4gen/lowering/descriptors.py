"""Descriptor checks: every ``tcgen05.mma`` of a compiled sm100a kernel, decoded from its PTX
and compared with the plan.

``conformance.py`` checks MMA kind strings and (from the MLIR) which TMEM columns the MMAs
use; it does not look inside the 32-bit instruction descriptor (M, N, K, operand formats,
majors, scale type, scale-factor ids) or the 64-bit SMEM matrix descriptors (swizzle,
strides, the start address each K step reads). A kernel whose descriptor says N=64 where
the plan says 128, or whose second block32 K step reads scale bytes 0-1 again, passes
conformance and computes garbage. This module reads those words back from the PTX:

* ``mma_instructions(ptx)``: each ``tcgen05.mma`` with its operands. Every operand register
  is traced back through the ``mov/or/and/add/shl/shr/selp/cvt`` chain that defines it, with
  a known-bits analysis (which bits are constants whatever the run-time values are). Fields
  whose bits are all known are decoded; the others are reported as ``"dynamic"`` (e.g. the
  negate bits, which CuTe DSL takes from the TiledMMA's run-time fields, a kernel parameter).
  TMEM addresses are also evaluated relative to the ``tcgen05.alloc`` base (column offsets),
  SMEM start addresses relative to the dynamic-SMEM base.
* ``decode_instr_desc(kind, word)`` / ``decode_smem_desc(word)``: the bit tables, below.
* ``check_descriptors(plan, ptx)``: the forward (QK^T, PV) against ``plan.mma_choice``,
  ``plan.pipeline``, ``plan.tmem``. ``check_backward_descriptors(bp, ptx)``: the sm100a
  backward's five MMAs against ``BackwardPlanSm100.mmas``.

Assumptions (stated where they are used): the TMEM address ``tcgen05.alloc`` returns has lane 0
and a column below 512 (PTX ISA 9.7.16.1.1 "Tensor Memory Addressing", 9.7.16.7.1: an allocation
spans all 128 lanes of 32..512 columns), so its bits 9..31 are 0; ``__dynamic_shmem__0`` is
``.align 1024`` (its declaration), so its bits 0..9 are 0.

Sources. PTX ISA 9.x (read from a copy of the ISA's sections, github jIab-b/nvfp4_gemv-kernel
``kernel_thing/ptx_llm/sections/9-7-16-*.md`` at 7487307); NVIDIA/cutlass
``include/cute/arch/mma_sm100_desc.hpp`` (``UMMA::InstrDescriptor``,
``InstrDescriptorBlockScaled``, ``SmemDescriptor``, ``make_runtime_instr_desc_block_scaled``);
CuTe DSL in this environment, ``nvidia_cutlass_dsl/.../cutlass/experimental/primitives/
descriptors.py`` (``Tcgen05InstrDesc``, ``Tcgen05MxInstrDesc``, ``Tcgen05MxOmmaInstrDesc``,
``Tcgen05SmemDesc``) and ``cutlass/utils/blackwell_helpers.py`` (``get_smem_layout_atom_ab``).
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Optional

from .conformance import Mismatch

DYN = "dynamic"

# ============================================================================ bit tables


@dataclass(frozen=True)
class Field:
    name: str
    lo: int
    width: int

    @property
    def mask(self) -> int:
        return ((1 << self.width) - 1) << self.lo


# PTX ISA 9.7.16.4.2 "Instruction descriptor", Table 42: .kind::tf32, .kind::f16, .kind::f8f6f4,
# .kind::i8. (= cutlass UMMA::InstrDescriptor, = CuTe DSL Tcgen05InstrDesc; the ISA's
# "Transpose A/B" is CUTLASS's a_major/b_major: 0 = K-major, 1 = MN-major.)
_T42 = (
    Field("sparsity_selector", 0, 2),  # if sparse
    Field("sparse", 2, 1),             # dense 0, sparse 1
    Field("saturate", 3, 1),           # integer kinds only
    Field("d_format", 4, 2),           # F16 0, F32 1, S32 2
    Field("a_format", 7, 3),           # f16: F16 0 BF16 1; tf32: 2; f8f6f4: E4M3 0 E5M2 1 E2M3 3 E3M2 4 E2M1 5
    Field("b_format", 10, 3),
    Field("negate_a", 13, 1),
    Field("negate_b", 14, 1),
    Field("a_major", 15, 1),           # "Transpose A"
    Field("b_major", 16, 1),           # "Transpose B"
    Field("n_dim", 17, 6),             # N >> 3
    Field("m_dim", 24, 5),             # M >> 4
    Field("max_shift", 30, 2),         # .ws B reuse
)
_R42 = (1 << 6) | (1 << 23) | (1 << 29)  # reserved bits of Table 42

# Table 43: .kind::mxf8f6f4. Bits 24-26 reserved, M is M >> 7 in bits 27-28. (CUTLASS's
# InstrDescriptorBlockScaled writes M >> 4 into [24,29): the same bits for M = 128 and 256.)
_T43 = (
    Field("sparse", 2, 1),
    Field("b_sf_id", 4, 2),            # Matrix B scale factor data id, 0-3
    Field("a_format", 7, 3),           # E4M3 0 E5M2 1 E2M3 3 E3M2 4 E2M1 5
    Field("b_format", 10, 3),
    Field("negate_a", 13, 1),
    Field("negate_b", 14, 1),
    Field("a_major", 15, 1),
    Field("b_major", 16, 1),
    Field("n_dim", 17, 6),             # N >> 3
    Field("scale_type", 23, 1),        # UE8M0 1
    Field("m_dim", 27, 2),             # M >> 7
    Field("a_sf_id", 29, 2),           # Matrix A scale factor data id, 0-3
)
_R43 = 0b11 | (1 << 3) | (1 << 6) | (0b111 << 24) | (1 << 31)

# Table 44: .kind::mxf4 and .kind::mxf4nvf4. B format is 2 bits (10-11), bit 12 reserved;
# E2M1 is 1 here (not 5 as in Table 43); transpose must be 0 (K-major only); scale type UE8M0 1,
# UE4M3 0 (mxf4nvf4 only); bit 31 is the K size: 0 = dense K 64, 1 = dense K 96.
# (CuTe DSL Tcgen05MxOmmaInstrDesc: b_format [10:12), k_dim_lower [31:32).)
_T44 = (
    Field("sparse", 2, 1),
    Field("b_sf_id", 4, 2),            # "0 or 2"
    Field("a_format", 7, 3),           # E2M1 1
    Field("b_format", 10, 2),
    Field("negate_a", 13, 1),
    Field("negate_b", 14, 1),
    Field("a_major", 15, 1),
    Field("b_major", 16, 1),
    Field("n_dim", 17, 6),
    Field("scale_type", 23, 1),
    Field("m_dim", 27, 2),             # M >> 7
    Field("a_sf_id", 29, 2),           # "0 or 2"
    Field("k_size", 31, 1),
)
_R44 = 0b11 | (1 << 3) | (1 << 6) | (1 << 12) | (0b111 << 24)

_TABLES = {"f16": (_T42, _R42), "tf32": (_T42, _R42), "f8f6f4": (_T42, _R42), "i8": (_T42, _R42),
           "mxf8f6f4": (_T43, _R43), "mxf4": (_T44, _R44), "mxf4nvf4": (_T44, _R44)}

_FORMATS = {
    "f16": {0: "f16", 1: "bf16"},
    "tf32": {2: "tf32"},
    "f8f6f4": {0: "e4m3", 1: "e5m2", 3: "e2m3", 4: "e3m2", 5: "e2m1"},
    "mxf8f6f4": {0: "e4m3", 1: "e5m2", 3: "e2m3", 4: "e3m2", 5: "e2m1"},
    "i8": {0: "u8", 1: "s8"},
    "mxf4": {1: "e2m1"},
    "mxf4nvf4": {1: "e2m1"},
}
_D_FORMATS = {0: "f16", 1: "f32", 2: "s32"}
_SCALE_TYPES = {0: "ue4m3", 1: "ue8m0"}
# dense K per instruction (PTX ISA 9.7.16.2.1 "Matrix Shape", Table 39; sparse doubles it;
# mxf4/mxf4nvf4: K 64, or 96 with Table 44's bit 31)
_K_DENSE = {"f16": 16, "tf32": 8, "f8f6f4": 32, "i8": 32, "mxf8f6f4": 32}


def kind_family(kind: str) -> str:
    """``kind::mxf4nvf4.block_scale.block16`` -> ``mxf4nvf4`` (the key of the bit tables)."""
    m = re.search(r"kind::(\w+)", kind)
    fam = m.group(1) if m else kind
    if fam not in _TABLES:
        raise ValueError(f"no instruction-descriptor table for {kind!r}")
    return fam


def _get(word: int, known: int, f: Field):
    if known & f.mask != f.mask:
        return DYN
    return (word & f.mask) >> f.lo


def decode_instr_desc(kind: str, word: int, known: int = 0xFFFFFFFF) -> dict:
    """The fields of a 32-bit ``tcgen05.mma`` instruction descriptor of ``kind``.

    Raw fields under the names of the bit tables above (values, or ``"dynamic"`` where a bit
    of the field is not in ``known``), ``reserved`` (the reserved bits that are set), and the
    derived ``M``, ``N``, ``K``, ``a_type``, ``b_type``, ``d_type`` / ``scale``."""
    fam = kind_family(kind)
    table, reserved = _TABLES[fam]
    word &= 0xFFFFFFFF
    out = {f.name: _get(word, known, f) for f in table}
    out["reserved"] = (word & reserved) if known & reserved == reserved else DYN
    m_shift = 4 if table is _T42 else 7
    out["M"] = out["m_dim"] << m_shift if out["m_dim"] != DYN else DYN
    out["N"] = out["n_dim"] << 3 if out["n_dim"] != DYN else DYN
    sparse = out["sparse"]
    if fam in ("mxf4", "mxf4nvf4"):
        ks = out["k_size"]
        out["K"] = DYN if DYN in (ks, sparse) else (96 if ks else 64) * (2 if sparse else 1)
    else:
        out["K"] = DYN if sparse == DYN else _K_DENSE[fam] * (2 if sparse else 1)
    names = _FORMATS[fam]
    for op in ("a", "b"):
        v = out[f"{op}_format"]
        out[f"{op}_type"] = v if v == DYN else names.get(v, f"invalid({v})")
    if "d_format" in out:
        v = out["d_format"]
        out["d_type"] = v if v == DYN else _D_FORMATS.get(v, f"invalid({v})")
    if "scale_type" in out:
        v = out["scale_type"]
        out["scale"] = v if v == DYN else _SCALE_TYPES[v]
    return out


def encode_instr_desc(kind: str, **fields) -> int:
    """The word with the given raw fields (names of the tables above; missing fields 0)."""
    table, _ = _TABLES[kind_family(kind)]
    by_name = {f.name: f for f in table}
    word = 0
    for k, v in fields.items():
        f = by_name[k]  # KeyError: not a field of this kind
        if not 0 <= v < (1 << f.width):
            raise ValueError(f"{k}={v} does not fit {f.width} bits")
        word |= v << f.lo
    return word


# PTX ISA 9.7.16.4.1 "Shared memory descriptor", Table 40 (64 bits). matrix-descriptor-encode(x)
# = (x & 0x3FFFF) >> 4 for the start address and both byte offsets. Bits 46-48 are the fixed
# constant 0b001 (the sm100 descriptor version: CuTe DSL Tcgen05SmemDesc "version", CUTLASS
# SmemDescriptor version_ = 1 at bit 46); bit 52 (leading-dimension absolute-address mode)
# exists on sm_103a only (9.7.16.4.1.1), so it must be 0 on sm_100a; bits 53-60 are 0.
# Swizzle (61-63): 0 none, 1 128B with 32B atoms, 2 128B, 4 64B, 6 32B; 3, 5, 7 invalid.
# LBO/SBO meaning per major-ness: 9.7.16.3.1 / 9.7.16.3.2; canonical layouts 9.7.16.3.3.
_SMEM = (
    Field("start_address", 0, 14),  # (addr & 0x3FFFF) >> 4
    Field("lbo", 16, 14),           # leading dimension byte offset >> 4 (K-major swizzled: unused, 1)
    Field("sbo", 32, 14),           # stride dimension byte offset >> 4
    Field("version", 46, 3),        # fixed 0b001
    Field("base_offset", 49, 3),    # 0 when the swizzle pattern starts at its boundary
    Field("lbo_mode", 52, 1),       # 0 relative offset, 1 absolute (sm_103a only)
    Field("fixed_53_60", 53, 8),    # 0
    Field("swizzle", 61, 3),
)
_SMEM_RESERVED = (0b11 << 14) | (0b11 << 30)
SWIZZLE_BYTES = {0: 0, 1: 128, 2: 128, 4: 64, 6: 32}  # 0: none/interleave


def decode_smem_desc(word: int, known: int = (1 << 64) - 1) -> dict:
    """The fields of a 64-bit SMEM matrix descriptor (Table 40), plus byte values
    ``start_bytes``/``lbo_bytes``/``sbo_bytes`` and ``swizzle_bytes``."""
    word &= (1 << 64) - 1
    out = {f.name: _get(word, known, f) for f in _SMEM}
    out["reserved"] = (word & _SMEM_RESERVED) if known & _SMEM_RESERVED == _SMEM_RESERVED else DYN
    for k in ("start_address", "lbo", "sbo"):
        out[k.replace("_address", "") + "_bytes"] = out[k] if out[k] == DYN else out[k] << 4
    sw = out["swizzle"]
    out["swizzle_bytes"] = sw if sw == DYN else SWIZZLE_BYTES.get(sw, f"invalid({sw})")
    return out


def encode_smem_desc(**fields) -> int:
    by_name = {f.name: f for f in _SMEM}
    word = 0
    for k, v in fields.items():
        f = by_name[k]
        if not 0 <= v < (1 << f.width):
            raise ValueError(f"{k}={v} does not fit {f.width} bits")
        word |= v << f.lo
    return word


# ============================================================================ PTX reading

_FUNC = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(?:entry|func)\b")
_GUARD = re.compile(r"^(@!?[%\w]+)\s+")
_INSTR = re.compile(r"^([a-z][\w.:]*)\s*(.*?)\s*;\s*(?://.*)?$")
_REG = re.compile(r"^%[a-z]+\d+$")
_NO_DEF = ("st.", "tcgen05.mma", "tcgen05.cp", "tcgen05.st", "tcgen05.commit", "tcgen05.alloc",
           "tcgen05.dealloc", "tcgen05.fence", "tcgen05.wait", "tcgen05.relinquish", "bra", "red.",
           "cp.", "prefetch", "fence", "bar.", "barrier", "mbarrier.init", "setmaxnreg", "ret", "exit",
           "trap", "membar", "griddepcontrol", "discard", "applypriority", "cvta.to")
_TMEM_BITS = 0xFFFFFE00  # known 0 in the tcgen05.alloc result (lane 0, column < 512)
_SMEM_ALIGN_BITS = 0x3FF  # __dynamic_shmem__0 is .align 1024


def _split(ops: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in ops:
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _width(reg: str, op: str = "") -> int:
    m = re.match(r"%([a-z]+)\d+$", reg)
    p = m.group(1) if m else ""
    if p == "p":
        return 1
    if p in ("rd", "fd"):
        return 64
    if p == "rs":
        return 16
    if p in ("r", "f"):
        return 32
    m = re.search(r"\.[bsuf](16|32|64)\b", op)
    return int(m.group(1)) if m else 32


@dataclass
class _Ins:
    line: int  # 1-based line in the PTX text
    op: str
    args: list
    guard: Optional[str]
    text: str


def _imm(tok: str) -> Optional[int]:
    t = tok.strip()
    try:
        if re.fullmatch(r"-?0[xX][0-9a-fA-F]+", t):
            return int(t, 16)
        if re.fullmatch(r"-?\d+", t):
            return int(t)
    except ValueError:
        pass
    return None


class _Function:
    """One PTX function body: instructions, definitions of every register, value analyses."""

    def __init__(self, lines: list, first_line: int):
        self.ins: list[_Ins] = []
        self.defs: dict = {}
        for k, raw in enumerate(lines):
            st = raw.strip()
            if not st or st.startswith(("//", ".", "{", "}", "$")) or st.endswith(":"):
                continue
            g = _GUARD.match(st)
            guard = None
            if g:
                guard, st = g.group(1), st[g.end():]
            m = _INSTR.match(st)
            if not m:
                continue
            ins = _Ins(first_line + k, m.group(1), _split(m.group(2)), guard, raw.strip())
            self.ins.append(ins)
            if not ins.args or ins.op.startswith(_NO_DEF):
                continue
            dest = ins.args[0]
            regs = [r.strip() for r in re.split(r"[{},|]", dest) if r.strip()]
            if regs and all(_REG.match(r) or r == "_" for r in regs):  # "_": a discarded part
                for i, r in enumerate(regs):
                    if r != "_":
                        self.defs.setdefault(r, []).append((ins, i, len(regs)))
        self._kb_memo: dict = {}
        self._c_memo: dict = {}
        # the SMEM words tcgen05.alloc writes the TMEM address to
        self._slots = set()
        for ins in self.ins:
            if ins.op.startswith("tcgen05.alloc"):
                a = self._addr_concrete(ins.args[0])
                if a is not None:
                    self._slots.add(a)
        self._kb_memo.clear()
        self._c_memo.clear()

    # ---------------------------------------------------------------- leaves
    def _addr_concrete(self, tok: str):
        """A ``[reg+imm]`` address under two SMEM-base assumptions (equal bases give equal pairs)."""
        m = re.fullmatch(r"\[\s*(%\w+)?\s*(?:\+\s*(-?\w+))?\s*\]", tok.strip())
        if not m:
            return None
        reg, off = m.group(1), _imm(m.group(2) or "0")
        if off is None:
            return None
        if reg is None:
            return (off, off)
        a = self.concrete(reg, _ENV_A)
        b = self.concrete(reg, _ENV_C)
        return (a + off, b + off)

    def _leaf_kind(self, ins: _Ins) -> Optional[str]:
        if ins.op.startswith("ld.shared") and len(ins.args) >= 2 and self._slots:
            if self._addr_concrete(ins.args[1]) in self._slots:
                return "tmem_base"
        if ins.op.startswith("mov") and len(ins.args) == 2 and ins.args[1].startswith("__dynamic_shmem"):
            return "smem_base"
        return None

    # ---------------------------------------------------------------- known bits
    def known(self, tok: str, width: Optional[int] = None) -> "KB":
        """Known bits of an operand token (register or immediate) whatever the run time does."""
        v = _imm(tok)
        if v is not None:
            w = width or 64
            return KB.const(v, w)
        tok = tok.strip()
        if tok in self._kb_memo:
            kb = self._kb_memo[tok]
            return KB.unknown(_width(tok)) if kb is None else kb
        self._kb_memo[tok] = None  # cycle guard: a loop-carried value is unknown
        defs = self.defs.get(tok, [])
        w = _width(tok)
        if not defs:
            kb = KB.unknown(w)
        else:
            kb = None
            for d in defs:
                v = self._kb_def(*d, w)
                kb = v if kb is None else kb.join(v)
        self._kb_memo[tok] = kb
        return kb

    def _kb_def(self, ins: _Ins, idx: int, n: int, w: int) -> "KB":
        op, a = ins.op, ins.args
        leaf = self._leaf_kind(ins)
        if leaf == "tmem_base":
            return KB(0, _TMEM_BITS, 32)
        if leaf == "smem_base":
            return KB(0, _SMEM_ALIGN_BITS, w)
        base = op.split(".")[0]
        try:
            if base == "mov":
                if n > 1:  # mov.b64 {lo, hi}, src: unpack
                    sw = _op_bits(op)
                    part = sw // n
                    return self.known(a[1], sw).trunc(sw).shr(idx * part).trunc(part)
                src = a[1].strip()
                if src.startswith("{"):
                    parts = [p.strip() for p in src.strip("{}").split(",")]
                    pw = w // len(parts)
                    out = KB.const(0, w)
                    for i, p in enumerate(parts):
                        out = out.or_(self.known(p, pw).trunc(pw).zext(w).shl(i * pw))
                    return out
                if op == "mov.pred":
                    v = _imm(src)
                    return KB.const(1 if v else 0, 1) if v is not None else self.known(src, 1)
                return self.known(src, w).trunc(w)
            if base == "shfl" and ".idx" in op and n == 1:
                return self.known(a[1], w)  # warp broadcast of lane 0: known bits hold in every lane
            if base in ("add", "sub", "or", "and", "xor", "shl", "shr", "mul", "selp", "not", "cvt") and n == 1:
                if base == "cvt":
                    m = re.search(r"cvt\.([su])(\d+)\.([su])(\d+)$", op)
                    if not m:
                        return KB.unknown(w)
                    sw = int(m.group(4))
                    src = self.known(a[1], sw).trunc(sw)
                    return src.sext(w) if m.group(3) == "s" else src.zext(w)
                if base == "not":
                    return self.known(a[1], w).not_()
                if base == "selp":
                    return self.known(a[1], w).trunc(w).join(self.known(a[2], w).trunc(w))
                x, y = self.known(a[1], w).trunc(w), self.known(a[2], w)
                if base == "add":
                    return x.add(y.trunc(w))
                if base == "sub":
                    return x.add(y.trunc(w).not_(), carry=1)
                if base == "or":
                    return x.or_(y.trunc(w))
                if base == "and":
                    return x.and_(y.trunc(w))
                if base == "xor":
                    return x.xor(y.trunc(w))
                if base == "mul" and ".lo" in op and x.full and y.full:
                    return KB.const(x.val * y.val, w)
                if base in ("shl", "shr") and y.full:
                    s = y.val & 0xFF
                    if base == "shl":
                        return x.shl(s)
                    return x.sar(s) if ".s" in op else x.shr(s)
        except (IndexError, ValueError):
            pass
        return KB.unknown(w)

    # ---------------------------------------------------------------- concrete values
    def concrete(self, tok: str, env: dict) -> int:
        """The operand's value when every unknown leaf takes its value from ``env``:
        ``env['tmem_base']``, ``env['smem_base']``, ``env['leaf'](register)`` for the rest
        (loop-carried registers, parameters, loads, special registers)."""
        v = _imm(tok)
        if v is not None:
            return v
        tok = tok.strip()
        key = (tok, env["name"])
        if key in self._c_memo:
            r = self._c_memo[key]
            return env["leaf"](tok) & _mask(_width(tok)) if r is None else r
        self._c_memo[key] = None
        defs = self.defs.get(tok, [])
        w = _width(tok)
        if len(defs) != 1:
            r = env["leaf"](tok) & _mask(w)
        else:
            r = self._c_def(*defs[0], w, env, tok)
        r &= _mask(w)
        self._c_memo[key] = r
        return r

    def _c_def(self, ins: _Ins, idx: int, n: int, w: int, env: dict, tok: str) -> int:
        op, a = ins.op, ins.args
        leaf = self._leaf_kind(ins)
        if leaf:
            return env[leaf]
        base = op.split(".")[0]
        c = lambda t, ww=w: self.concrete(t, env) & _mask(ww)  # noqa: E731
        try:
            if base == "mov":
                if n > 1:
                    sw = _op_bits(op)
                    part = sw // n
                    return (c(a[1], sw) >> (idx * part)) & _mask(part)
                src = a[1].strip()
                if src.startswith("{"):
                    parts = [p.strip() for p in src.strip("{}").split(",")]
                    pw = w // len(parts)
                    return sum(c(p, pw) << (i * pw) for i, p in enumerate(parts))
                return c(src)
            if base == "shfl" and ".idx" in op and n == 1:
                return c(a[1])
            if n == 1:
                if base == "cvt":
                    m = re.search(r"cvt\.([su])(\d+)\.([su])(\d+)$", op)
                    if m:
                        sw = int(m.group(4))
                        v = c(a[1], sw)
                        if m.group(3) == "s" and v >> (sw - 1):
                            v -= 1 << sw
                        return v
                elif base == "not":
                    return ~c(a[1])
                elif base == "selp":
                    p = self.concrete(a[3], env) & 1
                    return c(a[1]) if p else c(a[2])
                elif base in ("add", "sub", "or", "and", "xor", "shl", "shr", "mul"):
                    x, y = c(a[1]), c(a[2])
                    if base == "add":
                        return x + y
                    if base == "sub":
                        return x - y
                    if base == "or":
                        return x | y
                    if base == "and":
                        return x & y
                    if base == "xor":
                        return x ^ y
                    if base == "mul" and ".lo" in op:
                        return x * y
                    if base == "shl":
                        return x << (y & 0xFF)
                    if base == "shr":
                        if ".s" in op and x >> (w - 1):
                            x -= 1 << w
                        return x >> (y & 0xFF)
        except (IndexError, ValueError):
            pass
        return env["leaf"](tok)


def _op_bits(op: str) -> int:
    m = re.search(r"\.[bsu](16|32|64)\b", op)
    return int(m.group(1)) if m else 64


def _mask(w: int) -> int:
    return (1 << w) - 1


def _hash_leaf(tok: str) -> int:
    return zlib.crc32(tok.encode()) * 2654435761 & 0xFFFFFFFFFFFFFFFF


# envA: every base and unknown 0 -> base-relative values; envB: unknowns take other values
# (a value that changes is not static); envC: a different TMEM/SMEM base (a TMEM address that
# does not move with it is not based on the allocation).
_ENV_A = {"name": "A", "tmem_base": 0, "smem_base": 0, "leaf": lambda t: 0}
_ENV_B = {"name": "B", "tmem_base": 0, "smem_base": 0, "leaf": _hash_leaf}
# small values (a stage or K-block index): descriptor arithmetic stays inside its fields
_ENV_S = {"name": "S", "tmem_base": 0, "smem_base": 0, "leaf": lambda t: 1 + zlib.crc32(t.encode()) % 3}
_ENV_C = {"name": "C", "tmem_base": 64, "smem_base": 4096, "leaf": lambda t: 0}


@dataclass(frozen=True)
class KB:
    """Known bits of a ``width``-bit value: bits in ``mask`` are known and equal to ``val``."""

    val: int
    mask: int
    width: int

    @staticmethod
    def const(v: int, w: int) -> "KB":
        m = _mask(w)
        return KB(v & m, m, w)

    @staticmethod
    def unknown(w: int) -> "KB":
        return KB(0, 0, w)

    @property
    def full(self) -> bool:
        return self.mask == _mask(self.width)

    @property
    def zero(self) -> int:
        return self.mask & ~self.val

    def _mk(self, one: int, zero: int, w: Optional[int] = None) -> "KB":
        w = w or self.width
        m = _mask(w)
        return KB(one & m, (one | zero) & m, w)

    def join(self, o: "KB") -> "KB":
        w = max(self.width, o.width)
        agree = self.mask & o.mask & ~(self.val ^ o.val)
        return KB(self.val & agree, agree & _mask(w), w)

    def trunc(self, w: int) -> "KB":
        return KB(self.val & _mask(w), self.mask & _mask(w), w)

    def zext(self, w: int) -> "KB":
        return KB(self.val, self.mask | (_mask(w) & ~_mask(self.width)), w)

    def sext(self, w: int) -> "KB":
        top = 1 << (self.width - 1)
        hi = _mask(w) & ~_mask(self.width)
        if self.mask & top:
            return KB(self.val | (hi if self.val & top else 0), self.mask | hi, w)
        return KB(self.val, self.mask, w)

    def or_(self, o: "KB") -> "KB":
        return self._mk(self.val | o.val, self.zero & o.zero)

    def and_(self, o: "KB") -> "KB":
        return self._mk(self.val & o.val, self.zero | o.zero)

    def xor(self, o: "KB") -> "KB":
        m = self.mask & o.mask
        return KB((self.val ^ o.val) & m, m, self.width)

    def not_(self) -> "KB":
        return KB(~self.val & self.mask, self.mask, self.width)

    def shl(self, s: int) -> "KB":
        return self._mk(self.val << s, (self.zero << s) | _mask(s))

    def shr(self, s: int) -> "KB":
        hi = _mask(self.width) & ~(_mask(self.width) >> s)
        return self._mk(self.val >> s, (self.zero >> s) | hi)

    def sar(self, s: int) -> "KB":
        top = 1 << (self.width - 1)
        hi = _mask(self.width) & ~(_mask(self.width) >> s)
        if self.mask & top:
            return self._mk((self.val >> s) | (hi if self.val & top else 0),
                            (self.zero >> s) | (0 if self.val & top else hi))
        return self._mk(self.val >> s, self.zero >> s)

    def add(self, o: "KB", carry: int = 0) -> "KB":
        """Known bits of a sum (LLVM KnownBits::computeForAddCarry)."""
        m = _mask(self.width)
        lmax, lmin = (self.val | ~self.zero) & m, self.val
        rmax, rmin = (o.val | ~o.zero) & m, o.val
        sum_zero = (lmax + rmax + carry) & m  # every unknown bit 1: where a 0 survives it is known
        sum_one = (lmin + rmin + carry) & m
        carry_known_zero = ~(sum_zero ^ self.zero ^ o.zero) & m
        carry_known_one = (sum_one ^ self.val ^ o.val) & m
        known = self.mask & o.mask & (carry_known_zero | carry_known_one)
        return KB(sum_one & known, known, self.width)

    def field(self, lo: int, width: int):
        fm = _mask(width) << lo
        return DYN if self.mask & fm != fm else (self.val & fm) >> lo


# ============================================================================ MMA records


@dataclass
class TmemOperand:
    """A TMEM address operand (PTX ISA 9.7.16.1.1: lane in bits 16-31, column in 0-15; CuTe
    carries a scale factor's byte/half-word id in bits 30-31, see ``sf_id``)."""

    token: str
    column: object  # offset from the tcgen05.alloc base (int), or "dynamic"
    lane: object
    sf_id: object  # bits 30-31 of the static address (the byte id CuTe ORs into the idesc)
    based: bool  # moves with the tcgen05.alloc base (False: an absolute address)
    absolute_column: object  # bits 0-15 of the address when not based, else None


@dataclass
class SmemOperand:
    token: str
    fields: dict  # decode_smem_desc of the static bits
    start_offset: object  # byte offset of the start address from the dynamic SMEM base, or "dynamic"
    word_rel: object  # the whole descriptor with both bases 0 (int), or "dynamic"
    samples: tuple = ()  # the descriptor under the evaluation environments A, B, S (K-step differences)


@dataclass
class MmaInstr:
    """One ``tcgen05.mma`` as compiled."""

    line: int
    text: str
    kind: str  # e.g. kind::mxf4nvf4.block_scale.block16
    d: TmemOperand
    a: object  # TmemOperand (A in TMEM) or SmemOperand
    b: SmemOperand
    idesc_token: str
    idesc_known: KB
    idesc: dict  # decode_instr_desc of the known bits
    sf_a: Optional[TmemOperand] = None
    sf_b: Optional[TmemOperand] = None
    enable_input_d: object = DYN  # True / False / "dynamic"
    dynamic_fields: tuple = ()

    @property
    def a_source(self) -> str:
        return "tmem" if isinstance(self.a, TmemOperand) else "smem"


_MMA = re.compile(r"^tcgen05\.mma\.cta_group::(\d)\.(kind::\w+(?:\.block_scale(?:\.(?:block\d+|scale_vec::\dX))?)?)")


def _functions(ptx: str) -> list:
    lines = ptx.splitlines()
    starts = [i for i, ln in enumerate(lines) if _FUNC.match(ln)]
    if not starts:
        return [_Function(lines, 1)]
    starts.append(len(lines))
    return [_Function(lines[a:b], a + 1) for a, b in zip(starts, starts[1:])]


def _tmem_operand(fn: _Function, tok: str) -> TmemOperand:
    m = re.fullmatch(r"\[\s*([^\]+]+?)\s*(?:\+\s*(-?\w+))?\s*\]", tok.strip())
    reg, off = (m.group(1), _imm(m.group(2) or "0") or 0) if m else (tok, 0)
    kb = fn.known(reg, 32).add(KB.const(off, 32))
    a = (fn.concrete(reg, _ENV_A) + off) & 0xFFFFFFFF
    b = (fn.concrete(reg, _ENV_B) + off) & 0xFFFFFFFF
    c = (fn.concrete(reg, _ENV_C) + off) & 0xFFFFFFFF
    based = (c - a) & 0xFFFFFFFF == _ENV_C["tmem_base"]
    col = (a & 0xFFFF) if a == b else DYN
    lane = ((a >> 16) & 0x3FFF) if a == b else DYN
    return TmemOperand(tok, col, lane, kb.field(30, 2), based,
                       None if based else kb.field(0, 16))


def _smem_operand(fn: _Function, tok: str) -> SmemOperand:
    """The descriptor's static fields. The start address is computed at run time and added to
    the constant upper part; known bits alone cannot rule out a carry out of bits 0-13 into the
    strides and mode bits (that would need an SMEM address of 256 KB or more, beyond the CTA's
    shared window). So a field above the start address that known bits leave open is taken from
    the descriptor evaluated with small run-time values, when two such evaluations agree
    (``fields['carry_assumed']`` lists those fields)."""
    kb = fn.known(tok, 64)
    fields = decode_smem_desc(kb.val, kb.mask)
    a, b, s = fn.concrete(tok, _ENV_A), fn.concrete(tok, _ENV_B), fn.concrete(tok, _ENV_S)
    upper = ~0x3FFF & ((1 << 64) - 1)
    assumed = []
    if (a & upper) == (s & upper):
        full = decode_smem_desc(a)
        for k in list(fields):
            if fields[k] == DYN and k not in ("start_address", "start_bytes") and full[k] != DYN:
                fields[k] = full[k]
                assumed.append(k)
    fields["carry_assumed"] = tuple(assumed)
    rel = a if a == b == s else DYN
    start = ((a & 0x3FFF) << 4) if rel != DYN else DYN
    return SmemOperand(tok, fields, start, rel, (a, b, s))


def _pred(fn: _Function, tok: str):
    t = tok.strip()
    if _imm(t) is not None:
        return bool(_imm(t))
    kb = fn.known(t, 1)
    return bool(kb.val & 1) if kb.mask & 1 else DYN


def mma_instructions(ptx: str) -> list:
    """Every ``tcgen05.mma`` of the PTX, in text order, with its descriptors decoded."""
    out = []
    for fn in _functions(ptx):
        for ins in fn.ins:
            m = _MMA.match(ins.op)
            if not m:
                continue
            kind = m.group(2)
            a = ins.args
            d = _tmem_operand(fn, a[0])
            aop = _tmem_operand(fn, a[1]) if a[1].startswith("[") else _smem_operand(fn, a[1])
            bop = _smem_operand(fn, a[2])
            ikb = fn.known(a[3], 32).trunc(32)
            idesc = decode_instr_desc(kind, ikb.val, ikb.mask)
            rec = MmaInstr(ins.line, ins.text, kind, d, aop, bop, a[3], ikb, idesc)
            rest = a[4:]
            if ".block_scale" in kind:
                rec.sf_a, rec.sf_b = _tmem_operand(fn, rest[0]), _tmem_operand(fn, rest[1])
                rest = rest[2:]
            rest = [x for x in rest if not x.startswith("{")]  # disable-output-lane
            rec.enable_input_d = _pred(fn, rest[0]) if rest else DYN
            raw = [f.name for f in _TABLES[kind_family(kind)][0]] + ["reserved"]
            rec.dynamic_fields = tuple(k for k in raw if idesc[k] == DYN)
            out.append(rec)
    return out


# ============================================================================ the checks

_TYPE_OF_FORMAT = {"nvfp4": "e2m1", "mxfp4": "e2m1", "fp8e4m3": "e4m3", "fp8e5m2": "e5m2",
                   "bf16": "bf16", "fp16": "f16", "fp32": "tf32"}
_BITS = {"e2m1": 4, "e4m3": 8, "e5m2": 8, "bf16": 16, "f16": 16, "tf32": 32}


def _elem_type(fmt: str) -> str:
    return _TYPE_OF_FORMAT.get(fmt.split("(")[0].strip(), fmt)


def _major(s: str) -> int:
    return 1 if s.upper().startswith("MN") else 0


@dataclass
class _Op:
    """What the plan says one MMA (one accumulator, one stage) must be."""

    name: str
    kind: str
    m: int
    n: int
    k_total: int
    a_type: str
    b_type: str
    a_major: int
    b_major: int
    a_source: str
    d_col: int
    zero_init: bool  # K step 0 overwrites D
    a_col: Optional[int] = None  # first TMEM column of A (a_source tmem)
    sf_block: Optional[int] = None
    scale: Optional[str] = None
    sf_a_col: Optional[int] = None
    sf_b_col: Optional[int] = None
    order: int = 0
    stage: Optional[int] = None

    @property
    def k_inst(self) -> int:
        fam = kind_family(self.kind)
        return 64 if fam in ("mxf4", "mxf4nvf4") else _K_DENSE[fam]

    @property
    def k_steps(self) -> int:
        return -(-self.k_total // self.k_inst)


def _expected_sf(op: _Op, i: int, rows: int) -> tuple:
    """(column offset from the SF region's first column, sf_id) of K step ``i``.

    PTX ISA 9.7.16.10.7.2/3 (Scale Factor A/B ID): one TMEM word holds 4 one-byte scales of a
    row; block16 (= scale_vec::4X for mxf4nvf4, K=64) uses all 4, SF_ID must be 0; block32
    (= scale_vec::2X for mxf4/mxf4nvf4, K=64) uses 2, SF_ID 0 or 2 is the half-word; block32
    with mxf8f6f4 (= 1X, K=32) uses 1, SF_ID 0-3 is the byte (aliases: 9.7.16.10.9.1,
    ".block16 is aliased with .scale_vec::4X", ".block32 ... .scale_vec::2X"). Where the scales
    sit: the SF atom CuTe lays out in SMEM and ``tcgen05.cp .32x128b.warpx4`` copies, shape
    ((32,4),(vec,4)) stride ((16,4),(0,1)) (CuTe DSL utils/blockscaled_layout.py), puts row
    32·c + l in lane l (all 4 lane quarters: 9.7.16.10.7 "duplicated to all 32 lane partitions")
    of column c, and K block b in byte b: ``rows // 32`` columns hold 4 K blocks of every row."""
    per_step = op.k_inst // op.sf_block  # scales per row per instruction
    first = i * per_step
    return (rows // 32) * (first // 4), first % 4


def _smem_expect(major: int, elem_bits: int, rows: int, k_total: int, k_inst: int):
    """(swizzle code, SBO bytes, LBO bytes or None, start advance of K step i in bytes).

    Swizzle: CuTe DSL's choice (blackwell_helpers.get_smem_layout_atom_ab): the widest of
    128/64/32 B dividing the contiguous extent (K for K-major, MN for MN-major), else none;
    128 B with 32 B atoms (code 1) for 32-bit MN-major operands. The atoms are tiled over the
    operand's (MN, K) tile MN first for K-major, K first for MN-major (make_smem_layout_a/b:
    ``order = (1, 2, 3)`` / ``(2, 1, 3)``). With W the swizzle bytes, the canonical layouts
    (ISA 9.7.16.3.3) then give:
    K-major ((8,m),(T,2k)):((W/16·T,SBO),(1,T)): SBO = 8 rows of W bytes; LBO unused. A K step
    moves k_inst elements along the row, past a W-byte atom to the next atom column (rows·W on).
    MN-major ((T,W/16,m),(8,k)):((1,T,LBO),(W/16·T,SBO)): SBO = 8 K rows of W bytes; LBO = the
    next W-byte MN chunk, K_total rows of W bytes on (used when MN spans more than W bytes).
    A K step is k_inst/8 groups of 8 K rows."""
    contig = (k_total if major == 0 else rows) * elem_bits
    sw = 128 if contig % 1024 == 0 else 64 if contig % 512 == 0 else 32 if contig % 256 == 0 else 0
    code = {128: 2, 64: 4, 32: 6, 0: 0}[sw]
    if major == 1 and elem_bits == 32 and sw == 128:
        code = 1
    if not sw:  # interleaved layouts: strides not derived here
        return code, None, None, lambda i: None
    if major == 0:
        step_bytes = k_inst * elem_bits // 8

        def advance(i):
            kb = i * step_bytes
            return (kb // sw) * rows * sw + kb % sw
        return code, 8 * sw, None, advance
    lbo = k_total * sw if contig > sw * 8 else None
    return code, 8 * sw, lbo, lambda i: i * (k_inst // 8) * 8 * sw


class _Report:
    def __init__(self):
        self.items: dict = {}

    def add(self, check: str, expected, found, mma: MmaInstr, detail: str = ""):
        key = (check, repr(expected), repr(found))
        if key not in self.items:
            self.items[key] = [check, expected, found, [], detail]
        self.items[key][3].append(mma)

    def mismatches(self) -> list:
        out = []
        for check, exp, found, mmas, detail in self.items.values():
            first = mmas[0]
            d = f"{len(mmas)} MMA(s), first at PTX line {first.line}: {first.text[:140]}"
            out.append(Mismatch(check, exp, found, "ptx", (detail + "; " if detail else "") + d))
        return out


def _check_op(rep: _Report, op: _Op, mma: MmaInstr, i: int):
    n = op.name
    if mma.kind != op.kind:
        rep.add(f"mma.{n}.kind", op.kind, mma.kind, mma)
        return
    d = mma.idesc
    want = {"M": op.m, "N": op.n, "K": op.k_inst, "a_type": op.a_type, "b_type": op.b_type,
            "a_major": op.a_major, "b_major": op.b_major, "sparse": 0, "reserved": 0}
    if "d_type" in d:
        want["d_type"] = "f32"
        want.update(saturate=0, max_shift=0, sparsity_selector=0)
    if op.scale is not None:
        want["scale"] = op.scale
        rows_a, rows_b = op.m, op.n
        (ca, ia), (cb, ib) = _expected_sf(op, i, rows_a), _expected_sf(op, i, rows_b)
        want["a_sf_id"], want["b_sf_id"] = ia, ib
    for k, v in want.items():
        got = d.get(k, DYN)
        if got != v:
            rep.add(f"idesc.{n}.{k}", v, got, mma, f"K step {i}")
    # TMEM operands (columns relative to the tcgen05.alloc base)
    _check_tmem(rep, f"tmem.{n}.D", op.d_col, 0, mma.d, mma, i)
    if op.a_source != mma.a_source:
        rep.add(f"mma.{n}.a_source", op.a_source, mma.a_source, mma)
    elif op.a_source == "tmem":
        cols = op.k_inst * _BITS[op.a_type] // 32  # 32-bit columns one K step of a row spans
        _check_tmem(rep, f"tmem.{n}.A", op.a_col + i * cols, 0, mma.a, mma, i)
    if op.scale is not None:
        _check_tmem(rep, f"tmem.{n}.SFA", op.sf_a_col + ca, ia, mma.sf_a, mma, i)
        _check_tmem(rep, f"tmem.{n}.SFB", op.sf_b_col + cb, ib, mma.sf_b, mma, i)
    # accumulate flag (enable-input-d)
    if i == 0 and op.zero_init and mma.enable_input_d is not False:
        rep.add(f"mma.{n}.enable_input_d", False, mma.enable_input_d, mma, "K step 0 overwrites the accumulator")
    if i > 0 and mma.enable_input_d is not True:
        rep.add(f"mma.{n}.enable_input_d", True, mma.enable_input_d, mma, f"K step {i} accumulates")


def _check_tmem(rep, check, col, sf_id, t: TmemOperand, mma, i):
    if t.based:
        found = t.column
    else:
        found = t.absolute_column
    if found != col:
        rep.add(f"{check}.column", col, found, mma, f"K step {i}" + ("" if t.based else
                "; absolute address, not based on the tcgen05.alloc result"))
    if t.sf_id != sf_id:
        rep.add(f"{check}.sf_id", sf_id, t.sf_id, mma, f"K step {i}: TMEM address bits 30-31")
    if t.based and t.lane not in (0,):
        rep.add(f"{check}.lane", 0, t.lane, mma, f"K step {i}")


def _check_smem(rep, name: str, which: str, s: SmemOperand, major: int, elem: str, rows: int,
                k_total: int, k_inst: int, mma, i: int, start0):
    f = s.fields
    pre = f"smem.{name}.{which}"
    for k, v in (("version", 1), ("lbo_mode", 0), ("fixed_53_60", 0), ("reserved", 0), ("base_offset", 0)):
        if f[k] != v:
            rep.add(f"{pre}.{k}", v, f[k], mma)
    code, sbo, lbo, advance = _smem_expect(major, _BITS[elem], rows, k_total, k_inst)
    if f["swizzle"] != code:
        name_of = {0: "none", 1: "128B/32B atoms", 2: "128B", 4: "64B", 6: "32B"}
        rep.add(f"{pre}.swizzle", name_of[code], name_of.get(f["swizzle"], f["swizzle"]), mma,
                f"CuTe's atom for a {'K' if major == 0 else 'MN'}-major {elem} tile, {rows}x{k_total}")
    if sbo is not None and f["sbo_bytes"] != sbo:
        rep.add(f"{pre}.sbo", sbo, f["sbo_bytes"], mma, "8 rows of one swizzle atom (canonical layout)")
    if lbo is not None and f["lbo_bytes"] != lbo:
        rep.add(f"{pre}.lbo", lbo, f["lbo_bytes"], mma, "the next swizzle-wide MN chunk (MN-major canonical layout)")
    if advance(i) is not None and i > 0 and start0:
        # the start address K step i adds to K step 0's (both computed from the same run-time
        # values; the difference must not depend on them)
        diffs = {((w - w0) & 0x3FFF) << 4 for w, w0 in zip(s.samples, start0)}
        got = diffs.pop() if len(diffs) == 1 else DYN
        if got != advance(i):
            rep.add(f"{pre}.k_advance", advance(i), got, mma, f"K step {i}: start address minus K step 0's, bytes")


def _assign(mmas: list, ops: list, rep: _Report) -> list:
    """(mma, op, K step) for each MMA. The op is found by the accumulator's column; where
    several ops share it (the backward's dP^T and dQ), by A's source, then the one next in the
    plan's issue order. Consecutive MMAs of one op are cut into groups of ``op.k_steps``."""
    by_col: dict = {}
    for op in ops:
        by_col.setdefault(op.d_col, []).append(op)
    out, run = [], []
    prev = -1

    def flush():
        if not run:
            return
        op = run[0][1]
        if len(run) % op.k_steps:
            rep.add(f"mma.{op.name}.k_steps", op.k_steps, len(run), run[0][0],
                    f"{op.k_total} / {op.k_inst} per instruction; a run of {len(run)} MMAs on D column {op.d_col}")
        for j, (mma, _) in enumerate(run):
            out.append((mma, op, j % op.k_steps))
        run.clear()

    for mma in mmas:
        col = mma.d.column if mma.d.based else mma.d.absolute_column
        cands = by_col.get(col, [])
        if not cands:
            flush()
            rep.add("tmem.mma.D.column", sorted(by_col), col, mma, "an MMA whose accumulator is no planned region")
            continue
        cur = run[0][1] if run else None
        if cur in cands and len(run) % cur.k_steps:
            op = cur  # inside a K loop
        elif len(cands) == 1:
            op = cands[0]
        else:
            same = [c for c in cands if c.a_source == mma.a_source] or cands
            later = [c for c in same if c.order > prev]
            op = min(later or same, key=lambda c: c.order)
        if op is not cur:
            flush()
        run.append((mma, op))
        prev = op.order
    flush()
    return out


_ANY_MMA = re.compile(r"^\s*(?:@!?%\w+\s+)?tcgen05\.mma\b", re.M)


def _run_checks(mmas: list, ops: list, smem_geom, ptx: str, alloc_columns: int) -> list:
    rep = _Report()
    assigned = _assign(mmas, ops, rep)
    start0 = {}
    for mma, op, i in assigned:
        _check_op(rep, op, mma, i)
        if mma.kind != op.kind:
            continue
        for which, s in (("A", mma.a), ("B", mma.b)):
            if not isinstance(s, SmemOperand):
                continue
            major, elem, rows = smem_geom(op, which)
            if i == 0:
                start0[(id(op), which)] = s.samples
            _check_smem(rep, op.name, which, s, major, elem, rows, op.k_total, op.k_inst, mma, i,
                        start0.get((id(op), which)))
    out = rep.mismatches()
    if not mmas:
        out.append(Mismatch("mma.count", ">0", 0, "ptx", "no tcgen05.mma in the PTX"))
    n_any = len(_ANY_MMA.findall(ptx))
    if n_any != len(mmas):
        out.append(Mismatch("mma.form", n_any, len(mmas), "ptx",
                            "tcgen05.mma forms this module does not decode (.ws, .sp, ...)"))
    # an absolute TMEM address (not tcgen05.alloc's result + offset) is right only when the
    # allocation can start nowhere but column 0: all 512 columns allocated
    if alloc_columns != 512:
        for mma in mmas:
            for role, t in (("D", mma.d), ("A", mma.a), ("SFA", mma.sf_a), ("SFB", mma.sf_b)):
                if isinstance(t, TmemOperand) and not t.based:
                    out.append(Mismatch(f"tmem.{role}.absolute_address", "tcgen05.alloc base + offset",
                                        f"absolute column {t.absolute_column}", "ptx",
                                        f"PTX line {mma.line}; the plan allocates {alloc_columns} columns"))
    used = {id(op) for _, op, _ in assigned}
    for op in ops:
        if id(op) not in used:
            out.append(Mismatch(f"mma.{op.name}.missing", f"MMAs into column {op.d_col}", "none", "ptx",
                                f"{op.name}" + (f" of query stage {op.stage}" if op.stage is not None else "")))
    return out


def _geom(op: _Op, which: str):
    if which == "A":
        return op.a_major, op.a_type, op.m
    return op.b_major, op.b_type, op.n


def forward_ops(plan) -> list:
    """The plan's MMAs of the forward, one per (product, query stage)."""
    regions = {r.name: r for r in plan.tmem.regions}
    pipe, spec = plan.pipeline, plan.spec
    ops = []
    for j in range(pipe.q_stages):
        for name, d, n, k, sfa, sfb, a_reg in (
                ("QK", f"S{j}", pipe.tile_n, spec.head_dim, f"SFQ{j}", f"SFK{j}", None),
                ("PV", f"O{j}", spec.head_dim, pipe.tile_n, f"SFP{j}", f"SFV{j}", f"P{j}")):
            ch = plan.mma_choice(name)
            op = _Op(name, ch.kind, pipe.tile_m, n, k, _elem_type(ch.a), _elem_type(ch.b), _major(ch.a_major),
                     _major(ch.b_major), ch.a_source, regions[d].first_col, zero_init=(name == "QK"),
                     order=len(ops), stage=j)
            if ch.a_source == "tmem":
                op.a_col = regions[a_reg].first_col
            if ch.block_scaled:
                op.sf_block, op.scale = ch.sf_block, _SCALE_TYPES[1 if ch.sf_dtype == "e8m0" else 0]
                op.sf_a_col, op.sf_b_col = regions[sfa].first_col, regions[sfb].first_col
            ops.append(op)
    return ops


def check_descriptors(plan, ptx: str) -> list:
    """Mismatches between the forward's compiled MMAs and ``plan`` (empty: they agree).

    Per MMA: kind; idesc M, N, K, A/B types, majors, D type, scale type, sf ids, reserved bits;
    where A comes from (PV: TMEM, or SMEM with p_source smem, whose descriptor is then checked
    as Q's is); the TMEM columns of D, of A (P, K step i at P + i·8) and of the scale factors (K step i at
    the column and sf_id ``_expected_sf`` gives); enable-input-d (QK's first K step
    overwrites S); the SMEM descriptors' version, swizzle, SBO and the start address each K step
    adds. Runs of MMAs on one accumulator must be whole K loops (head_dim / K per
    instruction for QK, tile_n / K for PV)."""
    return _run_checks(mma_instructions(ptx), forward_ops(plan), _geom, ptx, plan.tmem.alloc_columns)


def backward_ops(bp) -> list:
    regions = {r.name: r for r in bp.tmem.regions}
    ops = []
    for m in bp.mmas:
        a_t, b_t = (_elem_type(f) for f in m.formats())
        op = _Op(m.name, m.kind, m.m, m.n, m.k, a_t, b_t, _major(m.a_major), _major(m.b_major), m.a_source,
                 regions[m.accumulator].first_col, zero_init=(m.accumulate == "zero_init"), order=len(ops))
        if m.a_source == "tmem":
            op.a_col = regions["P"].first_col
        ops.append(op)
    return ops


def check_backward_descriptors(bp, ptx: str) -> list:
    """The sm100a backward's MMAs (S^T, dP^T, dV, dK, dQ) against ``BackwardPlanSm100.mmas``,
    the same checks as ``check_descriptors``. (Its dV MMA reads P^T at absolute TMEM columns,
    which is accepted because the plan allocates all 512 columns.)"""
    return _run_checks(mma_instructions(ptx), backward_ops(bp), _geom, ptx, bp.tmem.alloc_columns)


# ============================================================================ report


def describe(mmas: list) -> list:
    """One compact row per distinct compiled MMA form (the PTX repeats each per peeled loop copy)."""
    rows, seen = [], {}
    for m in mmas:
        d = m.idesc
        a = (f"tmem+{m.a.column}" if m.a.based else f"tmem@{m.a.absolute_column}") if isinstance(m.a, TmemOperand) \
            else f"smem+{m.a.start_offset} sw{m.a.fields['swizzle_bytes']} sbo{m.a.fields['sbo_bytes']}"
        b = f"smem+{m.b.start_offset} sw{m.b.fields['swizzle_bytes']} sbo{m.b.fields['sbo_bytes']}"
        sf = ""
        if m.sf_a is not None:
            sf = f"sfa col {m.sf_a.column} id {d['a_sf_id']}, sfb col {m.sf_b.column} id {d['b_sf_id']}"
        row = (m.kind.replace("kind::", "").replace(".block_scale", ""), f"D col {m.d.column if m.d.based else m.d.absolute_column}",
               d["M"], d["N"], d["K"], f"{d['a_type']}/{d['b_type']}",
               f"{'K' if d['a_major'] == 0 else 'MN'}/{'K' if d['b_major'] == 0 else 'MN'}",
               d.get("scale", d.get("d_type")), sf, a, b, ",".join(m.dynamic_fields), m.enable_input_d)
        if row not in seen:
            seen[row] = m.line
            rows.append((m.line,) + row)
    return rows
