"""Parse a PTX module (one ``.entry``) into instructions the emulator executes.

Only what the generated sm100a kernels contain is parsed, but in its general form: the
``.entry`` and its ``.param`` list, ``.reg`` declarations (``%r<N>`` ranges and named
registers), ``.shared`` variables, labels, instructions with guard predicates (``@%p`` /
``@!%p``), vector operands ``{%r1, %r2}``, immediates (integers, ``0fXXXXXXXX`` / ``0dX...``
floats), address operands ``[%rd1+16]``, ``[name+8]``, ``[%rd1, {%r1, %r2}]`` (tensor
coordinates) and ``%r|%p`` destination pairs.

Inline-asm blocks (``{ .reg .pred P1; LAB_WAIT: ... }``) open a scope (PTX ISA 4.1 "Source
Format", 11.x: ``{}`` blocks scope their declarations): registers declared and labels defined
inside a block are renamed ``name#<block>`` so the 48 copies of CuTe's ``LAB_WAIT`` loop do
not collide; a branch resolves to the innermost enclosing block that defines its label.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union


class PtxParseError(ValueError):
    pass


# ----------------------------------------------------------------------------- operands

@dataclass(frozen=True)
class Reg:
    name: str  # '%r5', '%p3', or a block-local 'lo#12'


@dataclass(frozen=True)
class Imm:
    value: int  # integers as written; float immediates as their bit pattern
    float_bits: int = 0  # 32 for 0f..., 64 for 0d..., 0 for an integer


@dataclass(frozen=True)
class Sym:
    name: str  # a variable (param, shared) or special register ('%tid.x') or label


@dataclass(frozen=True)
class Vec:
    items: tuple


@dataclass(frozen=True)
class Addr:
    base: Union[Reg, Sym, None]
    offset: int = 0
    coords: Optional[Vec] = None  # [tmap, {c0, c1, ...}] of cp.async.bulk.tensor


@dataclass(frozen=True)
class Not:
    """``!%p``: a negated predicate source (setp's combining operand, vote)."""
    reg: Reg


@dataclass(frozen=True)
class Pair:
    """``d|p``: a value destination and a predicate destination (elect.sync, shfl.sync)."""
    value: Union[Reg, Sym]
    pred: Reg


Operand = Union[Reg, Imm, Sym, Vec, Addr, Pair, Not]

SPECIAL_REGS = re.compile(r"^%(tid|ntid|ctaid|nctaid|laneid|warpid|nwarpid|smid|clock|clock64|"
                          r"globaltimer|dynamic_smem_size|total_smem_size|lanemask_\w+|"
                          r"cluster_\w+|clusterid|nclusterid|gridid)(\.[xyz])?$")


# ----------------------------------------------------------------------------- module

@dataclass
class Param:
    name: str
    index: int
    size: int  # bytes
    align: int
    type: str  # '.b8' (byte arrays), '.u32', '.f32', ...


@dataclass
class SharedVar:
    name: str
    align: int
    size: Optional[int]  # None: extern (dynamic shared memory)


@dataclass
class Instr:
    index: int
    line: int  # 1-based line in the PTX text
    opcode: str  # the full opcode, e.g. 'setp.lt.s32', 'tcgen05.mma.cta_group::1.kind::f16'
    operands: tuple
    guard: Optional[tuple] = None  # (register name, negated)
    target: Optional[int] = None  # branch target (instruction index)
    text: str = ""
    aligned: bool = False  # a '.aligned' warp-collective: the whole warp must execute it

    def __post_init__(self):
        parts = self.opcode.split(".")
        # bar{.cta}.sync/arrive/red are barrier.*.aligned (PTX ISA 9.7.13.1)
        self.aligned = "aligned" in parts or (parts[0] == "bar" and len(parts) > 1 and parts[1] != "warp")

    @property
    def parts(self) -> list:
        return self.opcode.split(".")

    def __str__(self):
        return f"line {self.line}: {self.text}"


@dataclass
class Module:
    entry: str
    params: list
    shared: list
    instrs: list
    reg_types: dict  # register name or '%r<' prefix -> PTX type ('.b32', '.pred', ...)
    labels: dict = field(default_factory=dict)  # outer-scope label -> index
    reqntid: Optional[tuple] = None
    local: list = field(default_factory=list)  # .local variables (per-thread memory), SharedVar form

    def reg_type(self, name: str) -> str:
        t = self.reg_types.get(name)
        if t is not None:
            return t
        m = re.match(r"^(%[a-zA-Z_]+)\d+$", name)
        if m and m.group(1) in self.reg_types:
            return self.reg_types[m.group(1)]
        raise PtxParseError(f"register {name} is not declared")

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


# ----------------------------------------------------------------------------- lexing

_INT = re.compile(r"^-?(0[xX][0-9a-fA-F]+|\d+)U?$")
_FLT = re.compile(r"^0([fFdD])([0-9a-fA-F]+)$")
_LABEL = re.compile(r"^([$\w]+)\s*:(?!:)\s*(.*)$")
_GUARD = re.compile(r"^@(!?)([%\w#$.]+)\s+(.*)$")


def _split_top(s: str, sep: str = ",") -> list:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        out.append(tail)
    return out


def _int(tok: str) -> int:
    t = tok.rstrip("U")
    neg = t.startswith("-")
    t = t[1:] if neg else t
    v = int(t, 16) if t.lower().startswith("0x") else int(t)
    return -v if neg else v


class _Scopes:
    """Block scopes of registers and labels (see the module docstring)."""

    def __init__(self):
        self.stack = [0]  # block ids; 0 is the function body
        self.next = 1
        self.regs = [dict()]  # per open block: local name -> renamed

    def push(self):
        self.stack.append(self.next)
        self.regs.append({})
        self.next += 1

    def pop(self):
        if len(self.stack) == 1:
            raise PtxParseError("unbalanced '}'")
        self.stack.pop()
        self.regs.pop()

    def declare(self, name: str) -> str:
        if len(self.stack) == 1:
            return name
        new = f"{name}#{self.stack[-1]}"
        self.regs[-1][name] = new
        return new

    def resolve(self, name: str) -> str:
        for d in reversed(self.regs):
            if name in d:
                return d[name]
        return name


def _operand(tok: str, sc: _Scopes) -> Operand:
    tok = tok.strip()
    if tok.startswith("{"):
        if not tok.endswith("}"):
            raise PtxParseError(f"bad vector operand {tok!r}")
        return Vec(tuple(_operand(t, sc) for t in _split_top(tok[1:-1])))
    if tok.startswith("["):
        if not tok.endswith("]"):
            raise PtxParseError(f"bad address operand {tok!r}")
        inner = _split_top(tok[1:-1])
        coords = _operand(inner[1], sc) if len(inner) > 1 else None
        a = inner[0].replace(" ", "")
        m = re.match(r"^([^+\-]+)?(?:([+\-])(.+))?$", a)
        base_s, sign, off_s = m.group(1), m.group(2), m.group(3)
        if base_s is not None and _INT.match(base_s):  # [0x10] absolute
            return Addr(None, _int(base_s), coords)
        base = _operand(base_s, sc) if base_s else None
        off = 0
        if off_s:
            off = _int(off_s) * (-1 if sign == "-" else 1)
        return Addr(base, off, coords)
    if tok.startswith("!"):
        return Not(_operand(tok[1:], sc))
    if "|" in tok:
        a, b = tok.split("|")
        return Pair(_operand(a, sc), _operand(b, sc))
    m = _FLT.match(tok)
    if m:
        return Imm(int(m.group(2), 16), 32 if m.group(1) in "fF" else 64)
    if _INT.match(tok):
        return Imm(_int(tok))
    if SPECIAL_REGS.match(tok):
        return Sym(tok)
    if tok.startswith("%") or tok == "_":
        return Reg(sc.resolve(tok)) if tok != "_" else Sym("_")
    r = sc.resolve(tok)
    if r != tok:
        return Reg(r)
    return Sym(tok)


def _statements(text: str):
    """(line number, statement text) with comments removed; '{' and '}' as their own statements."""
    in_block_comment = False
    for ln, raw in enumerate(text.splitlines(), start=1):
        s = raw
        if in_block_comment:
            if "*/" not in s:
                continue
            s = s.split("*/", 1)[1]
            in_block_comment = False
        while "/*" in s:
            a, b = s.split("/*", 1)
            if "*/" in b:
                s = a + b.split("*/", 1)[1]
            else:
                s, in_block_comment = a, True
        s = s.split("//", 1)[0].strip()
        if not s:
            continue
        buf = ""
        depth = 0  # braces inside an operand list ({%r1, %r2}) are not blocks
        for ch in s:
            if ch == ";" and depth == 0:
                if buf.strip():
                    yield ln, buf.strip()
                buf = ""
                continue
            if ch == "{":
                if depth == 0 and not buf.strip():  # a block: '{' starts a statement
                    yield ln, "{"
                    buf = ""
                    continue
                depth += 1
            elif ch == "}":
                if depth == 0:
                    if buf.strip():
                        yield ln, buf.strip()
                    yield ln, "}"
                    buf = ""
                    continue
                depth -= 1
            buf += ch
        if buf.strip():
            yield ln, buf.strip()


_DECL_REG = re.compile(r"^\.reg\s+(\.\w+)\s+(.*)$")
_DECL_SHARED = re.compile(r"^(?:\.extern\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.\w+\s+([$\w]+)\s*\[(\d*)\]$")
_DECL_LOCAL = re.compile(r"^\.local\s+(?:\.align\s+(\d+)\s+)?\.\w+\s+([$\w]+)\s*\[(\d+)\]$")
_PARAM = re.compile(r"^\.param\s+(?:\.align\s+(\d+)\s+)?(\.\w+)\s+([$\w]+)(?:\[(\d+)\])?$")
_TYPE_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
               "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def parse(text: str) -> Module:
    """Parse the first ``.entry`` of a PTX module."""
    m = re.search(r"\.entry\s+([$\w]+)\s*\(", text)
    if not m:
        raise PtxParseError("no .entry in the PTX")
    entry = m.group(1)
    # the parameter list: between '(' and the matching ')'
    start = m.end()
    end = text.index(")", start)
    params = []
    for i, p in enumerate(t.strip() for t in text[start:end].split(",") if t.strip()):
        pm = _PARAM.match(re.sub(r"\s+", " ", p))
        if not pm:
            raise PtxParseError(f"cannot parse parameter {p!r}")
        align, typ, name, count = pm.groups()
        esize = _TYPE_BYTES[typ[1:]]
        size = esize * int(count) if count else esize
        params.append(Param(name, i, size, int(align) if align else esize, typ))
    param_end_line = text.count("\n", 0, end) + 1
    reqntid = None
    rm = re.search(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", text)
    if rm:
        reqntid = tuple(int(x) for x in rm.groups() if x)

    shared, local, reg_types, instrs = [], [], {}, []
    sc = _Scopes()
    pending_labels = []  # (scope chain, name) waiting for the next instruction
    label_defs = {}  # (block id, name) -> instruction index
    branches = []  # (instr, scope chain, label)
    depth = None  # None before the function body's '{'
    for ln, st in _statements(text):
        if ln <= param_end_line:
            sm = _DECL_SHARED.match(re.sub(r"\s+", " ", st))
            if sm:
                shared.append(SharedVar(sm.group(2), int(sm.group(1) or 1),
                                        int(sm.group(3)) if sm.group(3) else None))
            continue
        if st == "{":
            if depth is None:
                depth = 0
            else:
                sc.push()
                depth += 1
            continue
        if st == "}":
            if depth is None:
                raise PtxParseError(f"line {ln}: '}}' outside the function body")
            if depth == 0:
                break  # end of the entry
            sc.pop()
            depth -= 1
            continue
        if depth is None:
            continue  # .reqntid, .minnctapersm, ...
        while True:
            lm = _LABEL.match(st)
            if lm and not st.startswith("@"):
                pending_labels.append((tuple(sc.stack), lm.group(1)))
                st = lm.group(2).strip()
                if not st:
                    break
                continue
            break
        if not st:
            continue
        if st.startswith("."):
            dm = _DECL_REG.match(st)
            if dm:
                typ = dm.group(1)
                for r in _split_top(dm.group(2)):
                    rr = re.match(r"^(%?[\w$]+)<(\d+)>$", r.strip())
                    if rr:
                        reg_types[rr.group(1)] = typ
                    else:
                        reg_types[sc.declare(r.strip())] = typ
                continue
            sm = _DECL_SHARED.match(re.sub(r"\s+", " ", st))
            if sm:
                shared.append(SharedVar(sm.group(2), int(sm.group(1) or 1),
                                        int(sm.group(3)) if sm.group(3) else None))
                continue
            lm2 = _DECL_LOCAL.match(re.sub(r"\s+", " ", st))
            if lm2:
                local.append(SharedVar(lm2.group(2), int(lm2.group(1) or 1), int(lm2.group(3))))
                continue
            if st.startswith((".pragma", ".loc", ".file", ".maxnreg")):
                continue
            raise PtxParseError(f"line {ln}: unsupported directive {st!r}")
        guard = None
        gm = _GUARD.match(st)
        if gm:
            guard = (sc.resolve(gm.group(2)), gm.group(1) == "!")
            st = gm.group(3).strip()
        parts = st.split(None, 1)
        opcode = parts[0]
        ops = tuple(_operand(t, sc) for t in _split_top(parts[1])) if len(parts) > 1 else ()
        ins = Instr(len(instrs), ln, opcode, ops, guard, None, st)
        for chain, name in pending_labels:
            label_defs[(chain[-1], name)] = ins.index
        pending_labels = []
        if opcode.split(".")[0] == "bra":
            if len(ops) != 1 or not isinstance(ops[0], Sym):
                raise PtxParseError(f"line {ln}: indirect branches are not supported: {st}")
            branches.append((ins, tuple(sc.stack), ops[0].name))
        instrs.append(ins)
    # labels at the very end (before '}') point past the last instruction
    for chain, name in pending_labels:
        label_defs[(chain[-1], name)] = len(instrs)
    for ins, chain, name in branches:
        for blk in reversed(chain):
            if (blk, name) in label_defs:
                ins.target = label_defs[(blk, name)]
                break
        else:
            raise PtxParseError(f"line {ins.line}: branch to undefined label {name}")
    labels = {name: i for (blk, name), i in label_defs.items() if blk == 0}
    return Module(entry, params, shared, instrs, reg_types, labels, reqntid, local)
