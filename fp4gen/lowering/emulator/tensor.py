"""Shared memory, tensor memory and the tcgen05 operations of one sm100a CTA, in numpy.

Every rule below names the PTX ISA section it implements (PTX ISA 9.x, read from a copy of its
sections: github jIab-b/nvfp4_gemv-kernel ``kernel_thing/ptx_llm/sections/9-7-16-*.md`` at
7487307). The instruction descriptor and the SMEM matrix descriptor are decoded with
``fp4gen.lowering.descriptors`` (its bit tables, ISA 9.7.16.4.1 / 9.7.16.4.2).

Only the forms the five generated sm100a kernels use are implemented; any other raises
``NotImplementedError`` naming the form. A use the ISA forbids or leaves undefined (an access
to lanes another warp owns, an address outside the allocation, a reserved descriptor bit) raises
``TensorOpError``: on hardware that is a wrong result or a fault, so the emulator stops.

Implemented:

* ``tcgen05.ld`` / ``tcgen05.st`` ``.32x32b.xN`` (N = 1..128), no ``.pack::16b``/``.unpack::16b``;
* ``tcgen05.cp.cta_group::1.32x128b.warpx4`` from a no-swizzle SMEM descriptor;
* ``tcgen05.mma.cta_group::1`` ``kind::f16`` (bf16, f16), ``kind::f8f6f4`` (e4m3, e5m2),
  ``kind::mxf4nvf4.block_scale.block16`` (E2M1 x UE4M3 per 16 K) and ``.block32`` (E2M1 x
  UE8M0 per 32 K), M = 128, dense, K per instruction 16 / 32 / 64, A from SMEM or TMEM, B from
  SMEM, D fp32 in TMEM, SMEM operands K-major or MN-major with no swizzle or 32B/64B/128B
  swizzle (16-byte atomicity), ``collector::a::discard`` only, with or without a
  ``{disable-output-lane}`` mask (no ``scale-input-d``).

Arithmetic: each MMA forms its products (exact in float64 for every kind here) and their sum
in numpy float64 (exact unless the products of one row and column span more than ~40 binades;
otherwise rounded far below fp32 resolution), adds D in float64 and rounds once to fp32 when it
writes D. The hardware's internal accumulation width and rounding are not documented; only
hardware can tell how far this is from it.

Swizzles are computed from absolute SMEM address bits, for the TMA that writes a tile and the
MMA that reads it alike, so a tile whose pattern does not start at its 256/512/1024-byte
boundary reads back correctly here; the ISA asks for a base offset then (9.7.16.4.1 Table 41),
and such uses are recorded in ``SharedMemory.findings`` rather than modelled.

What the ISA text does not state (its figures are images this copy does not have; where a
transcription of a figure exists it is cited) and what is assumed here, to be confirmed on
hardware:

* packed E2M1 in SMEM (9.7.16.10.4.6: "two 4-bit elements in a 8-bit container, with no
  padding") and in TMEM (9.7.16.10.4.5, Figure 204): which nibble holds the lower K index is
  in the figures only. Assumed: element 2i in bits 0-3, 2i+1 in bits 4-7 (CUTLASS's sub-byte
  order, ``formats.pack_fp4``). ``NIBBLE_LOW_FIRST_SMEM`` / ``NIBBLE_LOW_FIRST_TMEM`` switch it
  (two facts: flipping both for Q and K leaves Q·K^T unchanged, since the sum over K is the
  same when both operands are permuted alike; only P (TMEM, packed by the kernel) against V
  (SMEM, packed by the host) can expose a wrong order).
* sub-word elements of A in a 32-bit TMEM word (9.7.16.10.4.3: "contiguously packed in a 32-bit
  Tensor Memory word"): assumed lower K index in lower bits (bf16: bits 0-15 then 16-31; e4m3:
  byte 0 first; e2m1: nibble 0 first).
* ``tcgen05.ld/st .32x32b`` (9.7.16.2.3.1.1): the text says a warp accesses 32 lanes, 32·num
  bits each; that thread t gets lane base+t and register j column base+j is in Figure 183 only.
  Assumed as CUTLASS's ``SM100_TMEM_LOAD_32dp32b<N>x`` does it.
* ``tcgen05.cp``: SMEM byte j of a 128-bit row goes to byte j % 4 (bits 8(j%4)..) of column
  j // 4 (little-endian words; consistent with Figures 233/242 as transcribed in the same
  repository, ``kernel_thing/ptx_llm/f233.txt``/``f242.txt``: SF0 in bits [0:7]).
* scale factors (9.7.16.10.7, Figures 233/242 transcribed in ``f233.txt``/``f242.txt``): the
  scale of row m (of A, or column n of B) for K block j sits in lane 32p + m % 32 of every
  32-lane partition p ("duplicated to all 32 lane partitions"), column base + m // 32, byte
  (sf_id + j) of the word. The data-path partition p that computes D rows 32p..32p+31 is
  assumed to read its own partition's copy (so copies that differ between partitions give
  different rows; the emulator reproduces that instead of picking one).
* TMEM address bits 30-31 of a scale-factor address (CuTe ORs the sf id into them) are not part
  of the ISA's address format (9.7.16.1.1: lane 31-16, column 15-0); they are ignored here
  and the instruction descriptor's sf ids are used, as 9.7.16.10.7.2/3 define.
"""
from __future__ import annotations

import numpy as np

from ..descriptors import decode_instr_desc, decode_smem_desc
from .trace import SmemSpan, TmemSpan

SMEM_BYTES = 232448  # the CTA's shared window on sm_100 (227 KB)
TMEM_LANES = 128
TMEM_COLS = 512

# Assumption switches (see the module docstring): E2M1 element 2i in the low nibble.
NIBBLE_LOW_FIRST_SMEM = True
NIBBLE_LOW_FIRST_TMEM = True


class TensorOpError(ValueError):
    """A tcgen05 / shared-memory use the ISA forbids or leaves undefined."""


# ============================================================================ shared memory


class SharedMemory:
    """The CTA's shared window: byte addresses 0 .. SMEM_BYTES-1 (``.data``: a bytearray).

    ``fill``: the initial byte (SMEM is uninitialised at launch; a poison such as 0xFF makes a
    read of never-written bytes visible as NaN scales / fp32 NaN).

    ``findings``: uses of swizzled SMEM that the ISA's text calls for differently but whose
    effect only hardware can show (a swizzle pattern that does not start at its boundary while
    the descriptor's base offset is 0, ISA 9.7.16.4.1 Table 41; a swizzled TMA box that does not,
    5.5.7). The emulator computes every swizzle from absolute address bits, which is consistent
    for the TMA that writes and the MMA that reads whatever the alignment, so such a kernel
    computes the right result here; on hardware it may not. ``strict``: raise instead."""

    def __init__(self, size: int = SMEM_BYTES, fill: int = 0, strict: bool = False):
        self.data = bytearray([fill]) * size
        self.findings: list[str] = []
        self.strict = strict

    def finding(self, msg: str):
        if self.strict:
            raise TensorOpError(msg)
        if msg not in self.findings:
            self.findings.append(msg)

    def _check(self, addr: int, n: int):
        if addr < 0 or n < 0 or addr + n > len(self.data):
            raise TensorOpError(f"shared-memory access [{addr:#x}, {addr + n:#x}) outside the CTA's "
                                f"{len(self.data)}-byte window")

    def read(self, addr: int, n: int) -> bytes:
        self._check(addr, n)
        return bytes(self.data[addr:addr + n])

    def write(self, addr: int, data: bytes):
        self._check(addr, len(data))
        self.data[addr:addr + len(data)] = data

    def view(self) -> np.ndarray:
        """A uint8 numpy view of the whole window (no copy)."""
        return np.frombuffer(self.data, dtype=np.uint8)

    def gather(self, addrs: np.ndarray) -> np.ndarray:
        """Bytes at an array of byte addresses (bounds-checked)."""
        if addrs.size and (int(addrs.min()) < 0 or int(addrs.max()) >= len(self.data)):
            raise TensorOpError(f"shared-memory read at {int(addrs.min()):#x}..{int(addrs.max()):#x} "
                                f"outside the CTA's {len(self.data)}-byte window")
        return self.view()[addrs]


def smem_spans(addrs) -> tuple:
    """Half-open SmemSpans covering a set of byte addresses (merged runs)."""
    a = np.unique(np.asarray(addrs, dtype=np.int64).ravel())
    if a.size == 0:
        return ()
    breaks = np.nonzero(np.diff(a) != 1)[0]
    lo = np.concatenate(([a[0]], a[breaks + 1]))
    hi = np.concatenate((a[breaks], [a[-1]])) + 1
    return tuple(SmemSpan(int(x), int(y)) for x, y in zip(lo, hi))


# ============================================================================ tensor memory


def split_taddr(taddr: int) -> tuple[int, int]:
    """(lane, column) of a TMEM address: lane in bits 31-16, column in 15-0 (ISA 9.7.16.1.1)."""
    taddr &= 0xFFFFFFFF
    return taddr >> 16, taddr & 0xFFFF


class TensorMemory:
    """128 lanes x 512 columns of 32-bit cells (ISA 9.7.16.1 "Tensor Memory").

    ``alloc``/``dealloc`` follow 9.7.16.7.1: a power-of-two number of columns, 32 <= n <= 512,
    all 128 lanes; the address returned has lane 0 and the first allocated column. Accesses
    must stay inside an allocation. Spans are reported with columns relative to the first
    allocation's base column (``trace`` module convention)."""

    def __init__(self, fill: int = 0):
        self.data = np.full((TMEM_LANES, TMEM_COLS), fill & 0xFFFFFFFF, dtype=np.uint32)
        self.allocs: dict[int, int] = {}  # first column -> ncols
        self.base: int | None = None  # the first allocation's column (span origin)

    def alloc(self, ncols: int) -> int:
        if ncols < 32 or ncols > TMEM_COLS or ncols & (ncols - 1):
            raise TensorOpError(f"tcgen05.alloc of {ncols} columns: must be a power of 2 in 32..512 "
                                "(ISA 9.7.16.7.1)")
        used = np.zeros(TMEM_COLS, bool)
        for c, n in self.allocs.items():
            used[c:c + n] = True
        for c in range(0, TMEM_COLS - ncols + 1, ncols):  # aligned first fit
            if not used[c:c + ncols].any():
                self.allocs[c] = ncols
                if self.base is None:
                    self.base = c
                return c  # lane 0
        raise TensorOpError(f"tcgen05.alloc of {ncols} columns: not enough free tensor memory")

    def dealloc(self, taddr: int, ncols: int):
        lane, col = split_taddr(taddr)
        if lane != 0 or self.allocs.get(col) != ncols:
            raise TensorOpError(f"tcgen05.dealloc({taddr:#x}, {ncols}) does not match an allocation "
                                f"{self.allocs} (ISA 9.7.16.7.1)")
        del self.allocs[col]

    def check(self, lanes: tuple[int, int], cols: tuple[int, int], what: str):
        (l0, l1), (c0, c1) = lanes, cols
        if not (0 <= l0 < l1 <= TMEM_LANES):
            raise TensorOpError(f"{what}: lanes {l0}..{l1 - 1} outside 0..127")
        for c, n in self.allocs.items():
            if c <= c0 and c1 <= c + n:
                return
        raise TensorOpError(f"{what}: columns {c0}..{c1 - 1} are not inside one allocation "
                            f"(allocated: {sorted(self.allocs.items())})")

    def span(self, l0: int, l1: int, c0: int, c1: int) -> TmemSpan:
        b = self.base or 0
        return TmemSpan(l0, l1, c0 - b, c1 - b)


# ============================================================================ tcgen05.ld / st


def _num(num) -> int:
    if isinstance(num, str):
        num = int(num.lstrip(".x"))
    if num not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise NotImplementedError(f"tcgen05.ld/st .x{num}: not a .num of ISA Table 47")
    return num


def _ld_st_region(tmem: TensorMemory, shape: str, num, taddr: int, warp: int, op: str):
    shape = shape.lstrip(".")
    if shape != "32x32b":
        # 16x64b, 16x128b, 16x256b, 16x32bx2 and .pack::16b / .unpack::16b are not used by the
        # generated kernels
        raise NotImplementedError(f"tcgen05.{op}.{shape}: only .32x32b is implemented")
    n = _num(num)
    lane, col = split_taddr(taddr)
    # ISA 9.7.16.8.1 "Access restrictions": warp w of a warpgroup may access lanes
    # 32*(w%4) .. 32*(w%4)+31 only; a 32x32b access covers 32 lanes from taddr's lane.
    first = 32 * (warp % 4)
    if lane != first:
        raise TensorOpError(f"tcgen05.{op}.32x32b by warp {warp} at lane {lane}: warp {warp} may "
                            f"access lanes {first}..{first + 31} only (ISA 9.7.16.8.1)")
    # 9.7.16.2.3.1.1 (Figure 183, see the module docstring): thread t <-> lane lane+t,
    # register j <-> column col+j
    tmem.check((lane, lane + 32), (col, col + n), f"tcgen05.{op}.32x32b.x{n}")
    return lane, col, n


def tmem_load(tmem: TensorMemory, shape: str, num, taddr: int, warp: int) -> tuple[np.ndarray, tuple]:
    """``tcgen05.ld.sync.aligned.<shape>.x<num>.b32``: (32 threads, num registers) uint32 and
    the span read. Thread t's register j is TMEM (lane + t, column + j) (ISA 9.7.16.8.3,
    fragment 9.7.16.2.3.1.1)."""
    lane, col, n = _ld_st_region(tmem, shape, num, taddr, warp, "ld")
    regs = tmem.data[lane:lane + 32, col:col + n].copy()
    return regs, (tmem.span(lane, lane + 32, col, col + n),)


def tmem_store(tmem: TensorMemory, shape: str, num, taddr: int, warp: int, regs: np.ndarray) -> tuple:
    """``tcgen05.st.sync.aligned.<shape>.x<num>.b32``: thread t's register j -> TMEM
    (lane + t, column + j) (ISA 9.7.16.8.4). Returns the span written."""
    lane, col, n = _ld_st_region(tmem, shape, num, taddr, warp, "st")
    regs = np.asarray(regs)
    if regs.shape != (32, n):
        raise ValueError(f"tcgen05.st.32x32b.x{n}: registers must be (32, {n}), got {regs.shape}")
    tmem.data[lane:lane + 32, col:col + n] = regs.astype(np.uint32)
    return (tmem.span(lane, lane + 32, col, col + n),)


# ============================================================================ SMEM matrix addressing

# swizzle code (Table 40) -> (swizzle span in bytes, address-bit mask applied to bits 4..)
_SWIZZLES = {0: 0, 2: 128, 4: 64, 6: 32}


def swizzle_address(addr, span: int):
    """The swizzled byte address: the 16-byte chunk (bits 4..) XORed with the 128-byte row index
    (bits 7..), over log2(span/16) bits -- Swizzle<1|2|3, 4, 3> on byte addresses (ISA 9.7.16.3.3
    "Canonical Layouts", last column; 9.7.16.4.1 Table 41: the pattern repeats at 256/512/1024-byte
    boundaries, hence a base offset of 0 means it is anchored at address bits)."""
    if span == 0:
        return addr
    bits = {32: 1, 64: 2, 128: 3}[span]
    mask = (1 << bits) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def _desc(desc: int, what: str) -> dict:
    f = decode_smem_desc(desc)
    bad = []
    if f["version"] != 1:
        bad.append(f"version {f['version']} (fixed 0b001)")
    if f["fixed_53_60"] != 0 or f["reserved"] != 0:
        bad.append("reserved/fixed bits set")
    if f["lbo_mode"] != 0:
        bad.append("leading-dimension absolute-address mode (sm_103a only, ISA 9.7.16.4.1.1)")
    if f["swizzle"] in (3, 5, 7):
        bad.append(f"swizzle code {f['swizzle']} (invalid)")
    if bad:
        raise TensorOpError(f"{what}: SMEM descriptor {desc:#018x}: " + "; ".join(bad) + " (ISA 9.7.16.4.1)")
    if f["swizzle"] == 1:
        raise NotImplementedError(f"{what}: 128B swizzle with 32B atomicity is not implemented")
    if f["base_offset"] != 0:
        raise NotImplementedError(f"{what}: a non-zero matrix base offset ({f['base_offset']}) is not implemented")
    return f


def operand_bit_addresses(desc: int, rows: int, k: int, bits: int, major: int, what: str = "operand"):
    """Where element (row, k) of a rows x K operand lives: (byte address, bit offset in the
    byte), each an int64 array (rows, k). ``major`` 0 = K-major, 1 = MN-major.

    The canonical layouts of ISA 9.7.16.3.3 in bytes, T = 128 / bits elements per 16-byte unit,
    W = swizzle span (32/64/128), LBO/SBO from the descriptor (9.7.16.3.1 / 9.7.16.3.2):

    * K-major, no swizzle ((8,m),(T,2k)):((1T,SBO),(1,LBO)): 16 bytes per row of a core matrix,
      next 8 rows at SBO, next 16 bytes of K at LBO;
    * K-major, swizzled ((8,m),(T,2k)):((W/16·T,SBO),(1,T)): W bytes per row, K contiguous,
      next 8 rows at SBO;
    * MN-major, no swizzle ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)): MN contiguous in 16-byte units,
      next 16 bytes of MN at SBO, 8 K rows of 16 bytes, next 8 K at LBO;
    * MN-major, swizzled ((T,W/16,m),(8,k)):((1,T,LBO),(W/16·T,SBO)): W bytes of MN per K row,
      next W bytes of MN at LBO, 8 K rows of W bytes, next 8 K at SBO;

    then the swizzle on the byte address (``swizzle_address``)."""
    f = _desc(desc, what)
    start, lbo, sbo = f["start_bytes"], f["lbo_bytes"], f["sbo_bytes"]
    span = _SWIZZLES[f["swizzle"]]
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(k, dtype=np.int64)[None, :]
    t = 128 // bits
    if major == 0:
        if span == 0:
            bit = (r % 8) * 128 + (r // 8) * sbo * 8 + (c % t) * bits + (c // t) * lbo * 8
        else:
            bit = (r % 8) * span * 8 + (r // 8) * sbo * 8 + c * bits
    else:
        if span == 0:
            bit = (r % t) * bits + (r // t) * sbo * 8 + (c % 8) * 128 + (c // 8) * lbo * 8
        else:
            per = t * span // 16  # MN elements per swizzle row
            bit = (r % per) * bits + (r // per) * lbo * 8 + (c % 8) * span * 8 + (c // 8) * sbo * 8
    byte = start + (bit >> 3)
    return swizzle_address(byte, span), bit & 7


def check_pattern_start(smem: SharedMemory, desc: int, what: str):
    """ISA 9.7.16.4.1 Table 41: base offset 0 means the swizzle pattern starts at a 256/512/1024-
    byte boundary (32/64/128B swizzle); otherwise it must be (pattern start >> 7) & 7. The
    pattern a matrix starts in begins at its start address's 128-byte row (a K step inside the
    row, start + 32·i, is the same pattern)."""
    f = decode_smem_desc(desc)
    span = _SWIZZLES.get(f["swizzle"], 0)
    if not span or f["base_offset"]:
        return
    row = f["start_bytes"] & ~127  # one finding per pattern, not per K step
    if row % (8 * span):
        smem.finding(f"{what}: swizzled ({span}B) operand whose pattern starts at SMEM {row:#x}, "
                     f"{row % (8 * span)} bytes past a {8 * span}-byte boundary, with base offset 0 (ISA "
                     f"9.7.16.4.1 Table 41 asks for base offset {(row >> 7) & 7})")


def read_operand_codes(smem: SharedMemory, desc: int, rows: int, k: int, bits: int, major: int,
                       what: str = "operand"):
    """(codes (rows, k) uint32, byte addresses read) of a SMEM operand."""
    if hasattr(smem, "finding"):
        check_pattern_start(smem, desc, what)
    addr, sub = operand_bit_addresses(desc, rows, k, bits, major, what)
    raw = smem.gather(addr).astype(np.uint32)
    if bits == 4:
        if not NIBBLE_LOW_FIRST_SMEM:
            sub = 4 - sub
        codes = (raw >> sub.astype(np.uint32)) & 0xF
    elif bits == 8:
        codes = raw
    elif bits == 16:
        hi = smem.gather(addr + 1).astype(np.uint32)  # little-endian halves (2-byte aligned)
        codes = raw | (hi << 8)
        addr = np.concatenate([addr.ravel(), (addr + 1).ravel()])
    else:
        raise NotImplementedError(f"{what}: {bits}-bit SMEM elements")
    return codes, addr


# ============================================================================ tcgen05.cp


def tmem_copy(tmem: TensorMemory, smem: SharedMemory, shape: str, multicast, taddr: int, sdesc: int):
    """``tcgen05.cp.cta_group::1.<shape>{.<multicast>}`` (ISA 9.7.16.9.2): SMEM -> TMEM.
    Returns (reads, writes).

    Implemented: ``.32x128b.warpx4``: 32 rows of 128 bits, described by a no-swizzle SMEM
    descriptor as a K-major operand of 16-byte rows (row r at start + (r%8)·16 + (r/8)·SBO,
    9.7.16.3.3), multicast to the four 32-lane partitions ("data ... multicasted into all 4
    warps"): row r -> lanes 32w + r for w = 0..3, columns col..col+3, SMEM byte j of the row in
    column j/4, bits 8(j%4) (little-endian; an assumption, see the module docstring)."""
    shape = shape.lstrip(".")
    mc = (multicast or "").lstrip(".")
    if (shape, mc) != ("32x128b", "warpx4"):
        raise NotImplementedError(f"tcgen05.cp.{shape}{'.' + mc if mc else ''}: only .32x128b.warpx4 "
                                  "is implemented")
    f = _desc(sdesc, "tcgen05.cp")
    if f["swizzle"] != 0:
        raise NotImplementedError(f"tcgen05.cp.32x128b.warpx4 from a swizzled source (swizzle code "
                                  f"{f['swizzle']})")
    lane, col = split_taddr(taddr)
    if lane != 0:
        raise TensorOpError(f"tcgen05.cp.32x128b.warpx4 to lane {lane}: the multicast writes lanes "
                            "32w+r of all four partitions, so the address must be lane 0")
    tmem.check((0, 128), (col, col + 4), "tcgen05.cp.32x128b.warpx4")
    addr, _ = operand_bit_addresses(sdesc, 32, 16, 8, 0, "tcgen05.cp")  # (32 rows, 16 bytes)
    raw = smem.gather(addr).astype(np.uint32)  # (32, 16)
    words = raw[:, 0::4] | (raw[:, 1::4] << 8) | (raw[:, 2::4] << 16) | (raw[:, 3::4] << 24)
    for w in range(4):
        tmem.data[32 * w:32 * w + 32, col:col + 4] = words
    return smem_spans(addr), (tmem.span(0, 128, col, col + 4),)


# ============================================================================ tcgen05.mma

_BITS = {"bf16": 16, "f16": 16, "e4m3": 8, "e5m2": 8, "e2m1": 4}


def _tables() -> dict:
    from fp4gen.numerics import formats as F

    t = {name: np.array(F.code_table(fmt), dtype=np.float64) for name, fmt in
         (("e2m1", F.E2M1), ("e4m3", F.E4M3), ("e5m2", F.E5M2))}
    # UE4M3 (ISA 5.2.3 "ue4m3": 7-bit unsigned, MSB padded with zero): a code with the MSB set
    # is not a UE4M3 value; NaN here so that it shows in the result
    ue = t["e4m3"].copy()
    ue[0x80:] = np.nan
    t["ue4m3"] = ue
    # UE8M0: 2^(c-127), 0xFF NaN (ISA 5.2.3 "ue8m0")
    t["ue8m0"] = np.array([2.0 ** (c - 127) for c in range(255)] + [np.nan], dtype=np.float64)
    return t


_TAB: dict = {}


def _decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    if not _TAB:
        _TAB.update(_tables())
    if fmt in ("bf16", "f16"):
        c = codes.astype(np.uint32)
        if fmt == "bf16":
            return (c << 16).view(np.float32).astype(np.float64)
        return c.astype(np.uint16).view(np.float16).astype(np.float64)
    return _TAB[fmt][codes.astype(np.int64)]


def _parse_mma_form(kind: str, modifiers) -> tuple[str, str | None]:
    toks = [t for t in (kind.split(".") + [m.lstrip(".") for m in modifiers]) if t]
    fam, block, seen = None, None, []
    for t in toks:
        if t.startswith("kind::"):
            fam = t[len("kind::"):]
        elif t in ("f16", "tf32", "f8f6f4", "i8", "mxf8f6f4", "mxf4", "mxf4nvf4") and fam is None:
            fam = t
        elif t in ("cta_group::1", "block_scale", "collector::a::discard", "tcgen05", "mma"):
            pass
        elif t in ("block16", "block32"):
            block = t
        else:
            seen.append(t)
    form = f"tcgen05.mma.{kind}{''.join('.' + m.lstrip('.') for m in modifiers)}"
    if seen:
        # cta_group::2, .ws, .sp, .ashift, collector fill/use/lastuse, scale_vec::NX spelled out,
        # disable-output-lane: not used by the generated kernels
        raise NotImplementedError(f"{form}: qualifier(s) {seen} not implemented")
    if fam not in ("f16", "f8f6f4", "mxf4nvf4"):
        raise NotImplementedError(f"{form}: kind {fam!r} not implemented (f16, f8f6f4, mxf4nvf4 are)")
    if (fam == "mxf4nvf4") != (block is not None):
        raise NotImplementedError(f"{form}: mxf4nvf4 needs .block_scale.block16/.block32 (and only it)")
    return fam, block


def _tmem_operand(tmem: TensorMemory, taddr: int, ncols: int, what: str, sf: bool = False):
    lane, col = split_taddr(taddr)
    if sf:
        lane &= 0x3FFF  # bits 30-31: CuTe's copy of the sf id, not part of the address
    # Layout D (M = 128, cta_group::1): TMEM datapath lane alignment 0 (ISA 9.7.16.10.5 table)
    if lane != 0:
        raise TensorOpError(f"{what} at lane {lane}: M = 128 with cta_group::1 uses lanes 0..127 "
                            "(ISA 9.7.16.10.5, Layout D, lane alignment 0)")
    tmem.check((0, 128), (col, col + ncols), what)
    return col


def _scale_matrix(tmem, taddr, rows, nblk, sf_id, fmt, what):
    """(rows, nblk) decoded scales for each data-path partition p: array (4, rows, nblk).

    ISA 9.7.16.10.7.2/3 (Figures 231-233, 240-242; f233.txt/f242.txt transcriptions): row r's
    scales at lane 32p + r%32, column base + r//32, bytes sf_id .. sf_id + nblk - 1."""
    ncols = (rows + 31) // 32
    col = _tmem_operand(tmem, taddr, ncols, what, sf=True)
    if sf_id + nblk > 4:
        raise TensorOpError(f"{what}: sf_id {sf_id} with {nblk} scales per row overruns the 32-bit word")
    r = np.arange(rows)
    out = np.empty((4, rows, nblk))
    for p in range(4):
        words = tmem.data[32 * p + r % 32, col + r // 32]  # (rows,)
        for j in range(nblk):
            out[p, :, j] = _decode((words >> np.uint32(8 * (sf_id + j))) & 0xFF, fmt)
    return out, tmem.span(0, 128, col, col + ncols)


def mma(tmem: TensorMemory, smem: SharedMemory, *, kind: str, modifiers=(), d_taddr: int, a: int,
        a_in_tmem: bool, b_desc: int, idesc: int, enable_input_d: bool,
        scale_a_taddr: int | None = None, scale_b_taddr: int | None = None,
        disable_output_lane=None) -> tuple[tuple, tuple]:
    """One ``tcgen05.mma`` (ISA 9.7.16.10.9.1): D = A·B (+ D if ``enable_input_d``), A M x K,
    B K x N (stored as N rows of K, like A), D M x N fp32 at TMEM lanes 0..M-1, columns
    d..d+N-1 (Layout D, 9.7.16.10.5.4). Block-scaled kinds: (A·scale_A)·(B·scale_B) + D
    (9.7.16.10.7). Returns (reads, writes) spans.

    ``kind``: ``"kind::mxf4nvf4.block_scale.block16"`` (or just ``"kind::f16"``...),
    ``modifiers``: the other dotted qualifiers of the opcode (``cta_group::1``,
    ``collector::a::discard``, ``block_scale``, ``block16``...), in any split between the two.
    ``a``: a TMEM address when ``a_in_tmem``, else the 64-bit SMEM descriptor.
    ``disable_output_lane``: the ``{disable-output-lane}`` vector (4 x 32-bit for cta_group::1)
    or None: bit i (element 0's LSB = lane 0) set leaves TMEM lane i of D unchanged (ISA
    9.7.16.10.9.1). The fp8 forward's and the backward's MMAs carry one (CuTe DSL passes the
    TiledMMA's run-time mask words)."""
    fam, block = _parse_mma_form(kind, modifiers)
    form = f"tcgen05.mma.kind::{fam}" + (f".block_scale.{block}" if block else "")
    d = decode_instr_desc(f"kind::{fam}", idesc & 0xFFFFFFFF)
    if d["reserved"] or d.get("sparse"):
        raise TensorOpError(f"{form}: instruction descriptor {idesc:#010x} has reserved or sparse bits "
                            "set (ISA 9.7.16.4.2)")
    M, N, K = d["M"], d["N"], d["K"]
    if M != 128:
        raise NotImplementedError(f"{form}: M = {M} (only M = 128, cta_group::1, Layout D)")
    # ISA 9.7.16.2.1 Table 38: M = 128 -> N = 16..256 in steps of 16
    if N % 16 or not 16 <= N <= 256:
        raise TensorOpError(f"{form}: N = {N} is not a valid shape for M = 128 (ISA 9.7.16.2.1)")
    a_t, b_t = d["a_type"], d["b_type"]
    if fam == "f16":
        if d["d_type"] != "f32":
            raise NotImplementedError(f"{form}: D type {d['d_type']} (only f32)")
        if a_t != b_t:
            raise TensorOpError(f"{form}: A {a_t} and B {b_t} must be the same type for kind::f16")
    elif fam == "f8f6f4":
        if d["d_type"] != "f32":
            raise NotImplementedError(f"{form}: D type {d['d_type']} (only f32)")
        if a_t not in ("e4m3", "e5m2") or b_t not in ("e4m3", "e5m2"):
            # 6/4-bit elements of kind::f8f6f4 are stored in padded 8-bit containers (9.7.16.10.4.3/4)
            raise NotImplementedError(f"{form}: {a_t} x {b_t} (only 8-bit types)")
    else:
        if a_t != "e2m1" or b_t != "e2m1":
            raise TensorOpError(f"{form}: A/B must be E2M1 (Table 44), found {a_t}/{b_t}")
        if K != 64:
            raise NotImplementedError(f"{form}: K = {K} (only the dense K = 64)")
        if d["a_major"] or d["b_major"]:
            raise TensorOpError(f"{form}: transpose bits must be 0, K-major only (ISA 9.7.16.4.2 Table 44)")
        want = "ue4m3" if block == "block16" else "ue8m0"
        # ISA 9.7.16.10.7.1 Table 55: block32 (scale_vec::2X) takes UE8M0; block16 (4X) UE8M0 or UE4M3
        if d["scale"] != want and not (block == "block16" and d["scale"] == "ue8m0"):
            raise TensorOpError(f"{form}: scale type {d['scale']} (Table 55)")
    if d.get("saturate") or d.get("max_shift"):
        raise NotImplementedError(f"{form}: saturate / max_shift set")

    reads: list = []
    # A (M x K)
    abits = _BITS[a_t]
    if a_in_tmem:
        # A in TMEM: row m in lane m, K packed low-to-high into 32-bit columns (9.7.16.10.4.3/.5;
        # the order inside a word is an assumption, module docstring)
        per = 32 // abits
        ncols = K // per
        col = _tmem_operand(tmem, a, ncols, f"{form} A")
        words = tmem.data[0:M, col:col + ncols].astype(np.uint64)
        kk = np.arange(K)
        shift = (kk % per) * abits
        if abits == 4 and not NIBBLE_LOW_FIRST_TMEM:
            shift = shift ^ 4
        a_codes = (words[:, kk // per] >> shift.astype(np.uint64)) & ((1 << abits) - 1)
        reads.append(tmem.span(0, M, col, col + ncols))
    else:
        a_codes, addr = read_operand_codes(smem, a, M, K, abits, d["a_major"], f"{form} A")
        reads += smem_spans(addr)
    b_codes, addr = read_operand_codes(smem, b_desc, N, K, _BITS[b_t], d["b_major"], f"{form} B")
    reads += smem_spans(addr)

    A = _decode(a_codes, a_t)
    B = _decode(b_codes, b_t)
    if d["negate_a"]:  # ISA 9.7.16.10.1 "Transpose and Negate operations"
        A = -A
    if d["negate_b"]:
        B = -B

    if fam == "mxf4nvf4":
        if scale_a_taddr is None or scale_b_taddr is None:
            raise TensorOpError(f"{form}: block-scaled MMA without scale-factor addresses")
        bs = 16 if block == "block16" else 32
        nblk = K // bs  # 4 (scale_vec::4X) or 2 (2X), ISA Table 54
        sfa_id, sfb_id = d["a_sf_id"], d["b_sf_id"]
        # 9.7.16.10.7.2.3 / .3.3: block16 (4X) sf_id must be 0; 2X: half-word offset 0 or 2
        if (nblk == 4 and (sfa_id or sfb_id)) or (nblk == 2 and (sfa_id % 2 or sfb_id % 2)):
            raise TensorOpError(f"{form}: sf ids {sfa_id}/{sfb_id} are not allowed for {block}")
        sa, span_a = _scale_matrix(tmem, scale_a_taddr, M, nblk, sfa_id, d["scale"], f"{form} scale_A")
        sb, span_b = _scale_matrix(tmem, scale_b_taddr, N, nblk, sfb_id, d["scale"], f"{form} scale_B")
        reads += [span_a, span_b]
        acc = np.empty((M, N))
        for p in range(4):  # data-path partition p computes rows 32p..32p+31 with its copies
            rows = slice(32 * p, 32 * p + 32)
            As = A[rows] * np.repeat(sa[p, rows], bs, axis=1)
            Bs = B * np.repeat(sb[p], bs, axis=1)
            acc[rows] = As @ Bs.T
    else:
        acc = A @ B.T

    col = _tmem_operand(tmem, d_taddr, N, f"{form} D")
    keep = np.ones(M, bool)
    if disable_output_lane is not None:
        words = [int(x) & 0xFFFFFFFF for x in disable_output_lane]
        if len(words) != 4:  # ISA 9.7.16.10.9.1: 4 elements for cta_group::1
            raise TensorOpError(f"{form}: disable-output-lane has {len(words)} elements (4 for cta_group::1)")
        mask = sum(w << (32 * i) for i, w in enumerate(words))
        keep = np.array([not (mask >> lane) & 1 for lane in range(M)])
    if enable_input_d:
        old = tmem.data[0:M, col:col + N].view(np.float32).astype(np.float64)
        acc = acc + old
        reads.append(tmem.span(0, M, col, col + N))
    new = acc.astype(np.float32).view(np.uint32)
    tmem.data[0:M, col:col + N] = np.where(keep[:, None], new, tmem.data[0:M, col:col + N])
    writes = tuple(tmem.span(int(lo), int(hi), col, col + N) for lo, hi in _runs(keep))
    return tuple(reads), writes


def _runs(flags: np.ndarray):
    """[lo, hi) runs of True in a boolean vector."""
    out, lo = [], None
    for i, f in enumerate(list(flags) + [False]):
        if f and lo is None:
            lo = i
        elif not f and lo is not None:
            out.append((lo, i))
            lo = None
    return out


__all__ = ["SharedMemory", "TensorMemory", "TensorOpError", "tmem_load", "tmem_store", "tmem_copy", "mma",
           "operand_bit_addresses", "read_operand_codes", "check_pattern_start", "swizzle_address", "smem_spans", "split_taddr",
           "NIBBLE_LOW_FIRST_SMEM", "NIBBLE_LOW_FIRST_TMEM"]
