"""The PTX interpreter (fp4gen.lowering.emulator.ptx / machine) on hand-written snippets:
opcodes against independent computations, divergence and reconvergence, named barriers,
mbarriers, async-op ordering under both schedules, deadlock detection. No CuTe compile."""
from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np
import pytest

from fp4gen.lowering.emulator import machine as M
from fp4gen.lowering.emulator import ptx as P
from fp4gen.lowering.emulator import trace as T


class _Smem:
    """Stand-in for emu-tensor's SharedMemory (only .data/read/write are used)."""

    def __init__(self, n=4096):
        self.data = bytearray(n)

    def read(self, addr, n):
        return bytes(self.data[addr:addr + n])

    def write(self, addr, data):
        self.data[addr:addr + len(data)] = data


HEAD = """
.version 9.4
.target sm_100a
.address_size 64
.extern .shared .align 16 .b8 smem[];

.visible .entry k(
\t.param .u64 k_param_0,
\t.param .u32 k_param_1,
\t.param .f32 k_param_2
)
.reqntid {ntid}, 1, 1
{{
\t.reg .pred %p<40>;
\t.reg .b16 %rs<40>;
\t.reg .b32 %r<200>;
\t.reg .b64 %rd<60>;
\tld.param.u64 %rd1, [k_param_0];
\tmov.u32 %r1, %tid.x;
\tmul.wide.u32 %rd2, %r1, {stride};
\tadd.s64 %rd3, %rd1, %rd2;
{body}
{stores}
\tret;
}}
"""


def run(body, *, ntid=32, nout=1, p1=0, p2=0.0, schedule="eager", ops=None, smem=None, trace=False):
    """Run ``body`` (PTX) in a CTA of ``ntid`` threads; thread t's %r100..%r100+nout-1 land in
    row t of the result (uint32)."""
    stores = "\n".join(f"\tst.global.b32 [%rd3+{4 * j}], %r{100 + j};" for j in range(nout))
    text = HEAD.format(ntid=ntid, stride=4 * nout, body=body, stores=stores)
    mod = P.parse(text)
    gm = M.GlobalMemory()
    out = gm.alloc(bytes(4 * nout * ntid))
    params = struct.pack("<QIf", out, p1 & 0xFFFFFFFF, p2)
    mach = M.Machine(mod, smem=smem or _Smem(), gmem=gm, params=params, schedule=schedule, ops=ops)
    mach.run()
    res = np.frombuffer(gm.read(out, 4 * nout * ntid), dtype=np.uint32).reshape(ntid, nout)
    return (res, mach) if trace else res


def f32(x):
    return np.array(x, dtype=np.float32).view(np.uint32)


def as_f32(u):
    return np.asarray(u, dtype=np.uint32).view(np.float32)


# ----------------------------------------------------------------------------- parser

def test_parser_scopes_labels_and_operands():
    text = HEAD.format(ntid=32, stride=4, stores="", body="""
\t{
\t.reg .pred P1;
\tLAB_WAIT:
\tsetp.eq.s32 P1, %r1, 0;
\t@P1 bra.uni DONE;
\tbra.uni LAB_WAIT;
\tDONE:
\t}
\t{
\t.reg .pred P1;
\tLAB_WAIT:
\t@!P1 bra.uni LAB_WAIT;
\t}
\tmov.b64 %rd5, {%r1, %r2};
\tld.param.v2.b8 {%rs3, %rs4}, [k_param_1+2];
\tmov.b32 %r7, 0f3F800000;
\telect.sync %r8|%p9, -1;
""")
    mod = P.parse(text)
    assert [p.name for p in mod.params] == ["k_param_0", "k_param_1", "k_param_2"]
    assert mod.shared[0].name == "smem" and mod.shared[0].size is None
    br = [i for i in mod.instrs if i.opcode == "bra.uni"]
    # each block's LAB_WAIT / DONE resolves inside its own block
    assert br[0].target == br[0].index + 2 and br[1].target == br[0].index - 1
    assert br[2].target == br[2].index and br[2].guard == ("P1#2", True)
    assert br[0].guard == ("P1#1", False)
    mov = next(i for i in mod.instrs if i.opcode == "mov.b64" and isinstance(i.operands[1], P.Vec))
    assert mov.operands[1] == P.Vec((P.Reg("%r1"), P.Reg("%r2")))
    ld = next(i for i in mod.instrs if i.opcode.startswith("ld.param.v2"))
    assert ld.operands[1] == P.Addr(P.Sym("k_param_1"), 2)
    imm = next(i for i in mod.instrs if i.opcode == "mov.b32" and isinstance(i.operands[1], P.Imm))
    assert imm.operands[1] == P.Imm(0x3F800000, 32)
    el = next(i for i in mod.instrs if i.opcode == "elect.sync")
    assert el.operands[0] == P.Pair(P.Reg("%r8"), P.Reg("%p9"))


# ----------------------------------------------------------------------------- integer

def test_integer_ops_against_python():
    body = """
\tmov.u32 %r2, %tid.x;
\tsub.s32 %r3, %r2, 16;
\tmul.lo.s32 %r100, %r3, -7;
\tdiv.s32 %r101, %r3, 3;
\trem.s32 %r102, %r3, 3;
\tshr.s32 %r103, %r3, %r2;
\tshr.u32 %r104, %r3, %r2;
\tshl.b32 %r105, %r3, %r2;
\tmad.lo.s32 %r106, %r3, %r3, 5;
\tmul.hi.s32 %r107, %r3, 0x7fffffff;
\tmax.s32 %r108, %r3, -3;
\tmin.u32 %r109, %r3, 10;
\tbfi.b32 %r110, %r2, 0xffffffff, 4, 3;
\tbfe.s32 %r111, %r3, 2, 4;
\tbfe.u32 %r112, %r3, 28, 8;
\tsetp.lt.s32 %p1, %r3, 0;
\tselp.b32 %r113, 11, 22, %p1;
\tsetp.hi.u32 %p2, %r3, 5;
\tselp.b32 %r114, 1, 0, %p2;
\tprmt.b32 %r115, %r3, 0x33221100, 0x8a41;
\tmul.wide.s32 %rd10, %r3, 100000;
\tmov.b64 {%r116, %r117}, %rd10;
\tcvt.u16.u32 %rs1, %r3;
\tcvt.s32.s16 %r118, %rs1;
\tshl.b32 %r119, %r2, 5;
\tcvt.s8.s32 %rs2, %r119;
\tcvt.s32.s16 %r120, %rs2;
\txor.b32 %r121, %r3, 0x55;
\tnot.b32 %r122, %r3;
\tneg.s32 %r123, %r3;
\tdp4a.u32.u32 %r124, %r3, 0x01010101, 7;
\tdp4a.s32.s32 %r125, %r3, 0x02ff0180, %r2;
"""
    out = run(body, nout=26)
    for t in range(32):
        x = t - 16
        u = x & 0xFFFFFFFF
        row = [int(v) for v in out[t]]
        s = lambda v: v & 0xFFFFFFFF  # noqa: E731
        assert row[0] == s(x * -7)
        assert row[1] == s(int(x / 3))  # truncation toward zero
        assert row[2] == s(x - 3 * int(x / 3))
        assert row[3] == s(x >> min(t, 31))
        assert row[4] == (0 if t >= 32 else u >> t)
        assert row[5] == s(u << t)
        assert row[6] == s(x * x + 5)
        assert row[7] == s((x * 0x7FFFFFFF) >> 32)
        assert row[8] == s(max(x, -3))
        assert row[9] == min(u, 10)
        assert row[10] == (0xFFFFFFFF & ~(0b111 << 4)) | ((t & 0b111) << 4)
        f = (u >> 2) & 0xF
        assert row[11] == s(f - 16 if f & 8 else f)
        assert row[12] == (u >> 28) & 0xF  # len past bit 31: zero-filled (unsigned)
        assert row[13] == (11 if x < 0 else 22)
        assert row[14] == int(u > 5)
        # prmt: selectors 1, 4, 0xa (byte 2 of b, sign-replicated), 8 (byte 0 of a, replicated)
        a_bytes = u.to_bytes(4, "little") + (0x33221100).to_bytes(4, "little")
        sel = [0x1, 0x4, 0xA, 0x8]
        exp = 0
        for i, c in enumerate(sel):
            b = a_bytes[c & 7]
            if c & 8:
                b = 0xFF if b & 0x80 else 0
            exp |= b << (8 * i)
        assert row[15] == exp
        wide = (x * 100000) & (2 ** 64 - 1)
        assert row[16] == wide & 0xFFFFFFFF and row[17] == wide >> 32
        assert row[18] == s(x)  # 16-bit round trip of a small signed value
        b8 = ((t << 5) & 0xFF)
        assert row[20] == s(b8 - 256 if b8 & 0x80 else b8)  # cvt.s8 sign-extends into 16 bits
        assert row[21] == u ^ 0x55 and row[22] == (~u) & 0xFFFFFFFF and row[23] == s(-x)
        ub = list(u.to_bytes(4, "little"))
        assert row[24] == sum(ub) + 7  # dp4a unsigned: the byte sum byte_sum() relies on
        sb = [b - 256 if b & 0x80 else b for b in ub]
        assert row[25] == s(t + sb[0] * -128 + sb[1] * 1 + sb[2] * -1 + sb[3] * 2)  # signed bytes of both


# ----------------------------------------------------------------------------- float

def _round_f32(fr: Fraction) -> np.float32:
    """Correctly rounded (nearest even) float32 of an exact rational."""
    c = np.float32(float(fr))
    best = None
    for cand in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        d = abs(Fraction(float(cand)) - fr)
        key = (d, int(np.array(cand).view(np.uint32)) & 1)
        if best is None or key < best[0]:
            best = (key, cand)
    return best[1]


def test_fma_is_fused_and_correctly_rounded():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(32).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    c = (-(a.astype(np.float64) * b)).astype(np.float32)  # heavy cancellation: the residue shows
    c[:8] = rng.standard_normal(8).astype(np.float32) * np.float32(1e-3)
    # near-ties: c chosen so a*b + c sits next to a float32 midpoint
    got = M._fma_f32(a, b, c)
    for i in range(32):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert got[i] == _round_f32(exact), i
    naive = (a * b + c).astype(np.float32)
    assert (naive != got).any()  # the unfused computation differs: the test can fail


def test_float_ops_cvt_and_packing():
    import torch

    body = """
\tcvt.rn.f32.s32 %r2, %r1;
\tsub.f32 %r3, %r2, 0f41800000;
\tmul.f32 %r4, %r3, 0f3F400000;
\tcvt.rzi.s32.f32 %r100, %r4;
\tcvt.rmi.f32.f32 %r101, %r4;
\tcvt.rn.bf16x2.f32 %r102, %r4, %r3;
\tcvt.rn.satfinite.e2m1x2.f32 %rs1, %r4, %r3;
\tcvt.u32.u16 %r103, %rs1;
\tcvt.rn.satfinite.e4m3x2.f32 %rs2, %r4, %r3;
\tcvt.u32.u16 %r104, %rs2;
\tex2.approx.ftz.f32 %r105, %r4;
\tabs.f32 %r106, %r3;
\tneg.f32 %r107, %r3;
\tmax.f32 %r108, %r3, 0f40000000;
\tsetp.geu.f32 %p1, %r3, 0f00000000;
\tselp.f32 %r109, 0f3F800000, 0fBF800000, %p1;
\tdiv.rn.f32 %r110, %r3, 0f40400000;
\tmov.b64 %rd10, {%r3, %r4};
\tmov.b64 %rd11, {%r4, %r4};
\tmul.f32x2 %rd12, %rd10, %rd11;
\tmov.b64 {%r111, %r112}, %rd12;
"""
    out = run(body, nout=13)
    x3 = (np.arange(32) - 16).astype(np.float32)
    x4 = (x3 * np.float32(0.75)).astype(np.float32)
    assert (out[:, 0].view(np.int32) == np.trunc(x4).astype(np.int32)).all()
    assert (as_f32(out[:, 1]) == np.floor(x4)).all()
    bf = lambda v: torch.tensor(v).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)  # noqa: E731
    assert (out[:, 2] >> 16 == bf(x4)).all() and (out[:, 2] & 0xFFFF == bf(x3)).all()
    # E2M1: RNE on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6 (hand table)
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def e2m1(v):
        a = min(abs(v), 6.0)
        best = min(range(8), key=lambda k: (abs(grid[k] - a), k & 1))
        return best | (8 if v < 0 or (v == 0 and np.signbit(v)) else 0)
    for t in range(32):
        assert out[t, 3] == (e2m1(x4[t]) << 4) | e2m1(x3[t]), t
    # E4M3 (bias 7): integers up to 16 and their 0.75 multiples are exact except 0.75*odd>8
    for t in range(32):
        for half, v in ((1, x4[t]), (0, x3[t])):
            code = (int(out[t, 4]) >> (8 * half)) & 0xFF
            mag = code & 0x7F
            e, mnt = mag >> 3, mag & 7
            val = (mnt / 8) * 2 ** -6 if e == 0 else (1 + mnt / 8) * 2 ** (e - 7)
            val = -val if code & 0x80 else val
            assert abs(val - v) <= abs(v) * 2 ** -4 + 1e-9, (t, v, val)
    assert np.allclose(as_f32(out[:, 5]), np.exp2(x4.astype(np.float64)), rtol=2 ** -22)
    assert (as_f32(out[:, 6]) == np.abs(x3)).all() and (as_f32(out[:, 7]) == -x3).all()
    assert (as_f32(out[:, 8]) == np.maximum(x3, 2)).all()
    assert (as_f32(out[:, 9]) == np.where(x3 >= 0, 1, -1)).all()
    assert (as_f32(out[:, 10]) == (x3 / np.float32(3)).astype(np.float32)).all()
    assert (as_f32(out[:, 11]) == x3 * x4).all() and (as_f32(out[:, 12]) == x4 * x4).all()


# ----------------------------------------------------------------------------- memory

def test_param_shared_global_loads_and_stores():
    body = """
\tld.param.b32 %r100, [k_param_1];
\tld.param.f32 %r101, [k_param_2];
\tmov.b32 %r2, smem;
\tshl.b32 %r3, %r1, 2;
\tadd.s32 %r4, %r2, %r3;
\tmul.lo.s32 %r5, %r1, 3;
\tst.shared.b32 [%r4+128], %r5;
\tbar.sync 0;
\txor.b32 %r6, %r3, 4;
\tadd.s32 %r7, %r2, %r6;
\tld.shared.b32 %r102, [%r7+128];
\tadd.s32 %r8, %r2, %r1;\n\tst.shared.b8 [%r8], %r1;
\tbar.sync 0;
\tld.shared.v2.b32 {%r103, %r104}, [%r2+128];
\tld.global.b32 %r105, [%rd3];
"""
    out, mach = run(body, ntid=64, nout=6, p1=1234, p2=2.5, trace=True)
    assert (out[:, 0] == 1234).all() and (as_f32(out[:, 1]) == 2.5).all()
    t = np.arange(64)
    assert (out[:, 2] == (t ^ 1) * 3).all()
    assert (out[:, 3] == 0).all() and (out[:, 4] == 3).all()
    assert (out[:, 5] == 0).all()  # the output buffer before this thread's stores
    ev = mach.trace.warps[0]
    st = [e for e in ev if isinstance(e, T.Access) and e.write]
    assert st[0].spans == (T.SmemSpan(128, 128 + 4 * 32),)
    assert sum(isinstance(e, T.NamedBarrier) for e in ev) == 2


# ----------------------------------------------------------------------------- control flow

def test_divergence_reconverges_before_a_collective():
    # odd lanes take the else branch; every lane loops (lane % 5) times; then a shfl reads
    # lane 0 and a vote counts -- both need the whole warp back together
    body = """
\tand.b32 %r2, %r1, 1;
\tsetp.eq.s32 %p1, %r2, 0;
\t@%p1 bra $EVEN;
\tmov.b32 %r100, 111;
\tbra.uni $JOIN;
$EVEN:
\tmov.b32 %r100, 222;
$JOIN:
\trem.u32 %r3, %r1, 5;
\tmov.b32 %r101, 0;
\tsetp.eq.s32 %p2, %r3, 0;
\t@%p2 bra $DONE;
$LOOP:
\tadd.s32 %r101, %r101, 10;
\tsub.s32 %r3, %r3, 1;
\tsetp.ne.s32 %p3, %r3, 0;
\t@%p3 bra $LOOP;
$DONE:
\tadd.s32 %r4, %r1, 1000;
\tshfl.sync.idx.b32 %r102, %r4, 3, 31, -1;
\tsetp.gt.u32 %p4, %r101, 25;
\tvote.sync.ballot.b32 %r103, %p4, -1;
\telect.sync %r104|%p5, -1;
\tselp.b32 %r105, 1, 0, %p5;
"""
    out = run(body, nout=6)
    t = np.arange(32)
    assert (out[:, 0] == np.where(t % 2 == 0, 222, 111)).all()
    assert (out[:, 1] == 10 * (t % 5)).all()
    assert (out[:, 2] == 1003).all()
    assert out[0, 3] == sum(1 << i for i in range(32) if 10 * (i % 5) > 25)
    assert (out[:, 4] == 0).all() and out[:, 5].tolist() == [1] + [0] * 31


def test_elect_in_a_partial_warp_and_guarded_exit():
    body = """
\tsetp.lt.u32 %p1, %r1, 6;
\tmov.b32 %r100, 7;
\t@%p1 bra $SKIP;
\telect.sync %r100|%p2, -1;
$SKIP:
"""
    out = run(body, nout=1)
    assert (out[:6, 0] == 7).all() and (out[6:, 0] == 6).all()  # lowest lane among 6..31


# ----------------------------------------------------------------------------- synchronisation

PRODUCER_CONSUMER = """
\tmov.b32 %r2, smem;
\tshr.u32 %r3, %r1, 5;
\tsetp.ne.s32 %p1, %r1, 0;
\t@%p1 bra $NOINIT;
\tmov.b32 %r4, 1;
\tmbarrier.init.shared.b64 [%r2], %r4;
$NOINIT:
\tbar.sync 0;
\tsetp.eq.s32 %p2, %r3, 1;
\t@%p2 bra $PRODUCER;
\t{
\t.reg .pred P1;
\tLAB_WAIT:
\tmbarrier.try_wait.parity.shared.b64 P1, [%r2], 0, 10000000;
\t@P1 bra.uni DONE;
\tbra.uni LAB_WAIT;
\tDONE:
\t}
\tld.shared.b32 %r100, [%r2+64];
\tbra.uni $END;
$PRODUCER:
\tmov.b32 %r5, 4242;
\tst.shared.b32 [%r2+64], %r5;
\tsetp.ne.s32 %p3, %r1, 32;
\t@%p3 bra $END;
\tmbarrier.arrive.shared.b64 %rd20, [%r2];
$END:
"""


@pytest.mark.parametrize("schedule", ["eager", "lazy"])
def test_mbarrier_orders_a_producer_and_a_consumer(schedule):
    out, mach = run(PRODUCER_CONSUMER, ntid=64, schedule=schedule, trace=True)
    assert (out[:32, 0] == 4242).all()
    ev0 = mach.trace.warps[0]
    waits = [e for e in ev0 if isinstance(e, T.Wait)]
    assert waits == [T.Wait(waits[0].line, 0, 0)]
    arr = [e for e in mach.trace.warps[1] if isinstance(e, T.Arrive)]
    assert len(arr) == 1 and arr[0].count == 1
    # warp 0 ran into the wait before warp 1 ran at all (round-robin): it really blocked
    assert mach.warps[0].count < 200


def test_deadlock_is_reported_with_line_and_barrier():
    # the producer arrives on the wrong barrier: the consumer waits forever
    body = PRODUCER_CONSUMER.replace("mbarrier.arrive.shared.b64 %rd20, [%r2];",
                                     "mbarrier.init.shared.b64 [%r2+8], %r5;\n\tmbarrier.arrive.shared.b64 %rd20, [%r2+8];")
    with pytest.raises(M.EmulationError) as e:
        run(body, ntid=64)
    msg = str(e.value)
    line = next(i + 1 for i, s in enumerate(HEAD.format(ntid=64, stride=4, body=body, stores="\tst.global.b32 [%rd3+0], %r100;").splitlines())
                if "try_wait" in s)
    assert "deadlock" in msg and f"warp 0: PTX line {line}" in msg
    assert "mbarrier.try_wait.parity 0 on mbarrier 0x0 (phase 0, 1 of 1 arrivals pending" in msg


def test_named_barrier_with_a_thread_count():
    # warps 0 and 1 meet at barrier 3 (64 threads); warp 2 never does and is not waited for
    body = """
\tmov.b32 %r2, smem;
\tshr.u32 %r3, %r1, 5;
\tsetp.eq.s32 %p1, %r3, 2;
\t@%p1 bra $OUT;
\tsetp.ne.s32 %p2, %r3, 1;
\t@%p2 bra $WAIT;
\tmov.b32 %r4, 99;
\tst.shared.b32 [%r2], %r4;
$WAIT:
\tbar.sync 3, 64;
\tld.shared.b32 %r100, [%r2];
$OUT:
"""
    out = run(body, ntid=96)
    assert (out[:64, 0] == 99).all() and (out[64:, 0] == 0).all()
    body_bad = body.replace("bar.sync 3, 64;", "bar.sync 3, 96;")
    with pytest.raises(M.EmulationError, match=r"bar.sync 3 \(64 of 96 threads arrived\)"):
        run(body_bad, ntid=96)


def test_test_wait_loop_does_not_spin_forever():
    body = PRODUCER_CONSUMER.replace(
        "mbarrier.try_wait.parity.shared.b64 P1, [%r2], 0, 10000000;",
        "mbarrier.test_wait.parity.shared.b64 P1, [%r2], 0;")
    out, mach = run(body, ntid=64, trace=True)
    assert (out[:32, 0] == 4242).all()
    assert mach.warps[0].count < 200  # parked, not spinning through its quantum


# ----------------------------------------------------------------------------- async ops

class _Ops:
    """Records the order tcgen05 ops execute in; the values show what each read."""

    def __init__(self, smem):
        self.smem, self.log = smem, []

    def mma(self, tmem, smem, **kw):
        # "reads" the 4 bytes at the A descriptor's address, "writes" D's id into the log
        val = int.from_bytes(smem.data[kw["a"]:kw["a"] + 4], "little")
        self.log.append(("mma", kw["d_taddr"], val, kw["enable_input_d"], kw["kind"]))
        return (T.SmemSpan(kw["a"], kw["a"] + 4),), (T.TmemSpan(0, 128, kw["d_taddr"], kw["d_taddr"] + 1),)

    def tmem_copy(self, tmem, smem, shape, mc, taddr, sdesc):
        self.log.append(("cp", taddr, sdesc, shape, mc))
        return (), ()


MMA_BODY = """
\tmov.b32 %r2, smem;
\tsetp.ne.s32 %p1, %r1, 0;
\t@%p1 bra $NOINIT;
\tmov.b32 %r4, 1;
\tmbarrier.init.shared.b64 [%r2], %r4;
$NOINIT:
\tbar.sync 0;
\tshr.u32 %r3, %r1, 5;
\tsetp.ne.s32 %p2, %r3, 0;
\t@%p2 bra $WAITER;
\telect.sync %r5|%p3, -1;
\t@!%p3 bra $WAITER;
\tmov.b32 %r6, 7;
\tst.shared.b32 [%r2+256], %r6;
\tcvt.u64.u32 %rd10, %r2;
\tadd.s64 %rd11, %rd10, 256;
\tmov.b32 %r7, 1234;
\tmov.pred %p4, 0;
\ttcgen05.cp.cta_group::1.32x128b.warpx4 [%r7+4], %rd11;
\ttcgen05.mma.cta_group::1.kind::f16 [%r7], %rd11, %rd11, 99, %p4;
\tmov.b32 %r6, 8;
\tst.shared.b32 [%r2+256], %r6;
\ttcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%r2];
$WAITER:
\t{
\t.reg .pred P1;
\tLAB_WAIT:
\tmbarrier.try_wait.parity.shared.b64 P1, [%r2], 0, 10000000;
\t@P1 bra.uni DONE;
\tbra.uni LAB_WAIT;
\tDONE:
\t}
"""


@pytest.mark.parametrize("schedule", ["eager", "lazy"])
def test_tcgen05_ops_in_order_and_commit_after_them(schedule):
    smem = _Smem()
    ops = _Ops(smem)
    out, mach = run(MMA_BODY, ntid=64, schedule=schedule, ops=ops, smem=smem, trace=True)
    assert [x[0] for x in ops.log] == ["cp", "mma"]
    assert ops.log[0][1:] == (1238, 256, "32x128b", "warpx4")
    # eager: the MMA reads the value stored before it; lazy: as late as the commit allows,
    # so it sees the store the kernel (wrongly) made after issuing it -- the race shows
    assert ops.log[1][:4] == ("mma", 1234, 7 if schedule == "eager" else 8, False)
    assert ops.log[1][4] == "f16"
    ev = mach.trace.warps[0]
    kinds = [type(e).__name__ for e in ev if isinstance(e, (T.AsyncOp, T.Commit))]
    assert kinds == ["AsyncOp", "AsyncOp", "Commit"]
    mma_ev = next(e for e in ev if isinstance(e, T.AsyncOp) and e.kind == "mma")
    assert mma_ev.reads == (T.SmemSpan(256, 260),) and mma_ev.op == 1
    assert any(isinstance(e, T.Wait) for e in mach.trace.warps[1])  # the commit released warp 1


def test_aligned_collective_in_divergent_code_is_caught():
    # a per-thread condition around a .sync.aligned instruction (undefined on the hardware:
    # the whole warp must execute it, PTX ISA 9.7.16.8.4 tcgen05.st)
    body = """
\tsetp.lt.u32 %p1, %r1, 5;
\t@%p1 bra $SKIP;
\tsetmaxnreg.dec.sync.aligned.u32 48;
$SKIP:
\tmov.b32 %r100, 1;
"""
    with pytest.raises(M.EmulationError, match=r"executed by 27 of the warp's 32 threads"):
        run(body)
    text = HEAD.format(ntid=32, stride=4, body=body, stores="")
    gm = M.GlobalMemory()
    out = gm.alloc(bytes(128))
    mach = M.Machine(P.parse(text), smem=_Smem(), gmem=gm, params=struct.pack("<QIf", out, 0, 0.0),
                     strict_aligned=False).run()
    assert len(mach.divergent_aligned) == 1
    # the converged form is fine
    run(body.replace("\t@%p1 bra $SKIP;\n", ""))


def test_fma_f64_is_fused():
    a = np.full(32, 1 + 2.0 ** -30)
    b = np.full(32, 1 - 2.0 ** -30)
    c = np.full(32, -1.0)
    got = M._fma_f64(a, b, c)
    assert (got == -(2.0 ** -60)).all()  # a*b rounds to 1 in float64: unfused gives 0
    assert ((a * b + c) == 0).all()


class _TmemOps(_Ops):
    """tcgen05.ld/st on a dict of 32-bit cells: (lane, column) -> value."""

    def __init__(self, smem):
        super().__init__(smem)
        self.cells = {}

    def tmem_store(self, tmem, shape, num, taddr, warp, regs):
        lane0 = 32 * (warp % 4)
        for l in range(32):
            for j in range(regs.shape[1]):
                self.cells[(lane0 + l, (taddr & 0xFFFF) + j)] = int(regs[l, j])
        return (T.TmemSpan(lane0, lane0 + 32, taddr & 0xFFFF, (taddr & 0xFFFF) + regs.shape[1]),)

    def tmem_load(self, tmem, shape, num, taddr, warp):
        lane0 = 32 * (warp % 4)
        vals = np.array([[self.cells.get((lane0 + l, (taddr & 0xFFFF) + j), 0) for j in range(num)]
                         for l in range(32)], dtype=np.uint32)
        return vals, (T.TmemSpan(lane0, lane0 + 32, taddr & 0xFFFF, (taddr & 0xFFFF) + num),)


TMEM_BODY = """
\tmov.b32 %r2, 0;
\tadd.s32 %r3, %r1, 500;
\ttcgen05.st.sync.aligned.32x32b.x1.b32 [%r2], {%r3};
\t{WAIT}
\ttcgen05.ld.sync.aligned.32x32b.x1.b32 {%r100}, [%r2];
\ttcgen05.wait::ld.sync.aligned;
"""


@pytest.mark.parametrize("schedule", ["eager", "lazy"])
def test_tcgen05_st_completes_by_its_wait(schedule):
    smem = _Smem()
    ops = _TmemOps(smem)
    out = run(TMEM_BODY.replace("{WAIT}", "tcgen05.wait::st.sync.aligned;"), schedule=schedule, ops=ops, smem=smem)
    assert (out[:, 0] == np.arange(32) + 500).all()
    # without the wait, the lazy schedule lets the load overtake the store (the race shows)
    ops = _TmemOps(smem)
    out = run(TMEM_BODY.replace("{WAIT}", ""), schedule=schedule, ops=ops, smem=smem)
    assert (out[:, 0] == (np.arange(32) + 500 if schedule == "eager" else 0)).all()


def test_f64_division_sequence():
    # the correctly rounded fp32 division of the two-level P path (rcp.approx.f64 + Newton)
    body = """
\tmov.b32 %r20, 0f3F400000;
\tcvt.rn.f32.u32 %r21, %r1;
\tadd.f32 %r21, %r21, 0f3F800000;
\t{
.reg .f64 xd, yd, r, e, q;
cvt.f64.f32 xd, %r20;
cvt.f64.f32 yd, %r21;
rcp.approx.ftz.f64 r, yd;
neg.f64 yd, yd;
fma.rn.f64 e, yd, r, 0d3FF0000000000000;
fma.rn.f64 r, r, e, r;
fma.rn.f64 e, yd, r, 0d3FF0000000000000;
fma.rn.f64 r, r, e, r;
mul.rn.f64 q, xd, r;
fma.rn.f64 e, yd, q, xd;
fma.rn.f64 q, e, r, q;
cvt.rn.f32.f64 %r100, q;
\t}
"""
    out = run(body)
    want = (np.float32(0.75) / (np.arange(32) + 1).astype(np.float32)).astype(np.float32)
    assert (as_f32(out[:, 0]) == want).all()


TMA_HEAD = """
.version 9.4
.target sm_100a
.address_size 64
.extern .shared .align 1024 .b8 smem[];

.visible .entry k(
\t.param .u64 k_param_0,
\t.param .align 64 .b8 k_param_1[128],
\t.param .align 64 .b8 k_param_2[128]
)
.reqntid 32, 1, 1
{
\t.reg .pred %p<10>;
\t.reg .b32 %r<200>;
\t.reg .b64 %rd<60>;
\tld.param.u64 %rd1, [k_param_0];
\tmov.u32 %r1, %tid.x;
\tmov.b64 %rd5, k_param_2;
\tcvta.param.u64 %rd6, %rd5;
\tprefetch.tensormap [%rd6];
\tmov.b32 %r2, smem;
\tadd.s32 %r8, %r2, 1024;
\telect.sync %r3|%p1, -1;
\t@!%p1 bra $W;
\tmov.b32 %r4, 1;
\tmbarrier.init.shared.b64 [%r2], %r4;
\tmov.b32 %r5, 96;
\tmbarrier.arrive.expect_tx.shared.b64 %rd7, [%r2], %r5;
\tmov.b32 %r6, 3;
\tmov.b32 %r7, -2;
\tcp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r8], [%rd6, {%r6, %r7}], [%r2];
$W:
\tbar.sync 0;
\t{
\t.reg .pred P1;
\tLAB_WAIT:
\tmbarrier.try_wait.parity.shared.b64 P1, [%r2], 0, 10000000;
\t@P1 bra.uni DONE;
\tbra.uni LAB_WAIT;
\tDONE:
\t}
\tshl.b32 %r9, %r1, 2;
\tadd.s32 %r10, %r8, %r9;
\tld.shared.b32 %r100, [%r10];
\tmul.wide.u32 %rd2, %r1, 4;
\tadd.s64 %rd3, %rd1, %rd2;
\tst.global.b32 [%rd3], %r100;
\tret;
}
"""


class _TmaOps:
    """tma_load stand-in: 96 bytes whose values say which map and coordinates were asked for."""

    def __init__(self):
        self.calls = []

    def tma_load(self, smem, gmem_read, tmap, coords, smem_addr):
        self.calls.append((tmap, coords, smem_addr))
        data = np.full(24, tmap * 1000 + coords[0] * 10 + coords[1], dtype=np.int32).tobytes()
        smem.write(smem_addr, data)
        return len(data), (T.SmemSpan(smem_addr, smem_addr + len(data)),)


@pytest.mark.parametrize("schedule", ["eager", "lazy"])
def test_tma_resolves_its_tensor_map_parameter_and_completes_tx(schedule):
    mod = P.parse(TMA_HEAD)
    gm = M.GlobalMemory()
    out = gm.alloc(bytes(128))
    ops = _TmaOps()
    smem = _Smem(4096)
    params = bytearray(M.param_offsets(mod)["k_param_2"] + 128)
    params[0:8] = struct.pack("<Q", out)
    mach = M.Machine(mod, smem=smem, gmem=gm, params=bytes(params), schedule=schedule,
                     tensor_maps={1: 11, 2: 22}, ops=ops).run()
    assert ops.calls == [(22, (3, -2), 1024)]  # the map of the parameter whose address it used
    res = np.frombuffer(gm.read(out, 128), dtype=np.int32)
    assert (res[:24] == 22000 + 30 - 2).all()
    ev = mach.trace.warps[0]
    tma = next(e for e in ev if isinstance(e, T.AsyncOp) and e.kind == "tma")
    assert tma.tx == 96 and tma.bar == 0 and tma.writes == (T.SmemSpan(1024, 1120),)
    assert [type(e).__name__ for e in ev[:4]] == ["BarrierInit", "Arrive", "AsyncOp", "NamedBarrier"]


def test_shuffle_modes_vote_and_negated_predicates():
    body = """
\tadd.s32 %r2, %r1, 100;
\tshfl.sync.down.b32 %r100|%p1, %r2, 3, 31, -1;
\tshfl.sync.up.b32 %r101, %r2, 2, 0, -1;
\tshfl.sync.bfly.b32 %r102, %r2, 5, 31, -1;
\tshfl.sync.idx.b32 %r103, %r2, 33, 0x1c1f, -1;
\tselp.b32 %r104, 1, 0, %p1;
\tsetp.lt.u32 %p2, %r1, 10;
\tsetp.gt.and.u32 %p3, %r1, 3, !%p2;
\tselp.b32 %r105, 1, 0, %p3;
\tvote.sync.any.pred %p4, %p3, -1;
\tvote.sync.all.pred %p5, %p3, -1;
\tselp.b32 %r106, 1, 0, %p4;
\tselp.b32 %r107, 1, 0, %p5;
"""
    out = run(body, nout=8)
    t = np.arange(32)
    # down: lanes past 31 keep their own value, pred false (PTX ISA shfl.sync pseudo-code)
    assert (out[:, 0] == np.where(t + 3 <= 31, t + 3, t) + 100).all()
    assert (out[:, 4] == (t + 3 <= 31)).all()
    assert (out[:, 1] == np.where(t - 2 >= 0, t - 2, t) + 100).all()
    assert (out[:, 2] == (t ^ 5) + 100).all()
    # idx with segmask 0x1c (groups of 4 lanes) and clamp 31: lane (t & ~3) | (33 & 3)
    assert (out[:, 3] == ((t & ~3) | 1) + 100).all()
    assert (out[:, 5] == (t >= 10)).all()  # t > 3 and not (t < 10)
    assert (out[:, 6] == 1).all() and (out[:, 7] == 0).all()


def test_packed_fp8_fp4_conversions_at_their_edges():
    """cvt.rn.satfinite.{e2m1x2,e4m3x2}.f32 at ties, saturation, NaN and infinities, against
    hand-derived codes (PTX ISA 9.7.9.21: RNE; .satfinite clamps to MAX_NORM; NaN -> NaN for
    e4m3, -> +MAX_NORM for e2m1)."""
    e2m1 = [(0.25, 0x0), (0.75, 0x2), (2.5, 0x4), (5.0, 0x6), (7.0, 0x7), (1e10, 0x7),
            (-0.25, 0x8), (float("nan"), 0x7), (float("-inf"), 0xF), (-3.0, 0xD), (1.25, 0x2),
            (1.75, 0x4), (0.2, 0x0), (0.3, 0x1), (-6.0, 0xF), (4.9, 0x6)]
    e4m3 = [(448.0, 0x7E), (464.0, 0x7E), (1e6, 0x7E), (float("nan"), 0x7F), (float("-inf"), 0xFE),
            (2.0 ** -9, 0x01), (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02), (1.0, 0x38),
            (1.0625, 0x38), (1.1875, 0x3A), (-0.0, 0x80), (240.0, 0x77), (-17.0, 0xD8),
            (0.015625, 0x08), (2.0 ** -7 * 1.125, 0x04)]
    vals = np.zeros(32, np.float32)
    vals[:16] = [v for v, _ in e2m1]
    vals[16:] = [v for v, _ in e4m3]
    body = """
\tmul.wide.u32 %rd20, %r1, 4;
\tadd.s64 %rd21, %rd1, %rd20;
\tld.global.b32 %r2, [%rd21];
\tmov.b32 %r3, 0f00000000;
\tcvt.rn.satfinite.e2m1x2.f32 %rs1, %r2, %r3;
\tcvt.u32.u16 %r100, %rs1;
\tcvt.rn.satfinite.e4m3x2.f32 %rs2, %r3, %r2;
\tcvt.u32.u16 %r101, %rs2;
"""
    text = HEAD.format(ntid=32, stride=8, body=body,
                       stores="\tst.global.b32 [%rd3+0], %r100;\n\tst.global.b32 [%rd3+4], %r101;")
    gm = M.GlobalMemory()
    buf = gm.alloc(vals.tobytes() + bytes(256 - 128))
    M.Machine(P.parse(text), smem=_Smem(), gmem=gm, params=struct.pack("<QIf", buf, 0, 0.0)).run()
    res = np.frombuffer(gm.read(buf, 256), dtype=np.uint32).reshape(32, 2)
    for i, (v, code) in enumerate(e2m1):
        assert res[i, 0] >> 4 == code and res[i, 0] & 0xF == 0, (v, hex(int(res[i, 0])), hex(code))
    for i, (v, code) in enumerate(e4m3):
        assert res[16 + i, 1] & 0xFF == code and res[16 + i, 1] >> 8 == 0, (v, hex(int(res[16 + i, 1])), hex(code))


def test_local_memory_is_per_thread():
    # the stack-frame pattern of spilled or indexed arrays: a .local depot reached through
    # its local address and through cvta.local's generic address
    body = """
\t.local .align 8 .b8 __local_depot0[64];
\tmov.u64 %rd10, __local_depot0;
\tcvta.local.u64 %rd11, %rd10;
\tmul.lo.s32 %r2, %r1, 7;
\tst.local.b32 [%rd10+8], %r2;
\tadd.s32 %r3, %r1, 1000;
\tst.b32 [%rd11+12], %r3;
\tbar.sync 0;
\tld.local.v2.b32 {%r100, %r101}, [%rd10+8];
\tld.b32 %r102, [%rd11+8];
"""
    out = run(body, ntid=64, nout=3)
    t = np.arange(64)
    assert (out[:, 0] == 7 * t).all() and (out[:, 1] == t + 1000).all() and (out[:, 2] == 7 * t).all()
