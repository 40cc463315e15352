"""End to end: the generated sm100a backward (templates/sm100/bwd.py.j2) executed from its
compiled PTX on every CTA of its grid (fp4gen.lowering.emulator.run.emulate_backward), through
the module's own host code, against autograd's float64 gradient; and planted faults (PTX text
mutations of the compiled kernel) that must each make dq, dk or dv disagree. The example's
kernel is the non-deterministic one; its ``deterministic true`` variant (dQ turns through
ld.acquire / red.release) is rendered and compiled here too.

One key tile of one (batch, head) is one CTA (~21k warp instructions, 2-4 s of CPU); each
backward compiles once per source text (~6-12 s, cached on disk by its sha256); the module takes
~2.5 minutes and is marked slow.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
KERNEL = "sm100_bwd_causal_d128"


def _source():
    return (ROOT / "generated" / f"{KERNEL}_sm100a.py").read_text()


_RESULTS = {}


def _emulate(sq, sk, mutation=None, **kw):
    """One emulation per (sizes, fault, options) and test session."""
    from fp4gen.lowering.emulator.run import emulate_backward

    key = (sq, sk, mutation, tuple(sorted(kw.items())))
    if key not in _RESULTS:
        _RESULTS[key] = emulate_backward(_source(), seqlen_q=sq, seqlen_k=sk, seed=0, ptx_mutation=mutation, **kw)
    return _RESULTS[key]


def _tol():
    from fp4gen.lowering.emulator.run import BWD_TOLERANCE

    return BWD_TOLERANCE


# (Sq, Sk): square causal grids of 2 and 3 key tiles; Sk > Sq (offset 128: every query sees the
# first key tile); Sq > Sk (offset -128: the first 128 queries see no key, LSE2 = +inf there);
# a ragged 200 (TMA zero-fills keys past Sk, dQ rows past Sq land in the host's padding);
# two heads x two batches (the grid's y and z, each (batch, head) its own inputs)
CASES = [(256, 256, 1, 1), (384, 384, 1, 1), (128, 256, 1, 1), (256, 128, 1, 1), (200, 200, 1, 1),
         (128, 256, 2, 2)]


@pytest.mark.parametrize("sq,sk,heads,batch", CASES)
def test_gradients_match_the_exact_gradient(sq, sk, heads, batch):
    kw = dict(heads=heads, batch=batch) if heads * batch > 1 else {}
    res = _emulate(sq, sk, **kw)
    assert max(res.errors.values()) < _tol(), res.errors
    assert res.ctas == -(-sk // 128) * heads * batch
    assert not res.notes, res.notes[:3]
    # the MMA warp really ran the pipeline: five products of 8 K-slices per visited query tile
    mma = sum(1 for tr in res.traces for evs in tr.warps.values() for e in evs if getattr(e, "kind", "") == "mma")
    assert mma >= 5 * 8 * res.ctas, mma


# ----------------------------------------------------------------------------- planted faults

def _ld_address_defs(ptx: str):
    """(line index, register, base, column) of each ``add.s32 %rX, %rB, C;`` whose %rX is the
    address of a tcgen05.ld."""
    lines = ptx.split("\n")
    ld_addr = set(re.findall(r"tcgen05\.ld\.[^\n]*\[(%r\d+)\]", ptx))
    out = []
    for i, ln in enumerate(lines):
        m = re.match(r"\s*add\.s32\s+(%r\d+), (%r\d+), (\d+);", ln)
        if m and m.group(1) in ld_addr:
            out.append((i, m.group(1), m.group(2), int(m.group(3))))
    return lines, out


def _dp_column_off_by_one(ptx: str) -> str:
    """Planted fault: the compute warps' first dP^T chunk (TMEM column 128, the plan's dP) read
    from column 129."""
    from fp4gen.lowering.emulator.run import _load_module

    dp0 = _load_module(_source()).BWD_CONFIG.first_col("dP")
    lines, defs = _ld_address_defs(ptx)
    # the compute warps' chunk addresses come first (S^T + 32 c, dP^T + 32 c from one base);
    # the epilogue's dV/dK chunks add the same constants to other bases
    table = min(d for d in defs if d[3] == 32)[2]
    hits = [d for d in defs if d[3] == dp0 and d[2] == table]
    assert len(hits) == 1, hits
    i, reg, base, col = hits[0]
    lines[i] = lines[i].replace(f", {col};", f", {col + 1};")
    return "\n".join(lines)


def _drop_first_red(ptx: str) -> str:
    """Planted fault: the first red.global.add.v4.f32 of the dQ warps (4 of 128 dQ columns) removed."""
    lines = ptx.split("\n")
    i = next(i for i, ln in enumerate(lines) if "red.global.add" in ln)
    del lines[i]
    return "\n".join(lines)


def _causal_offset_plus_one(ptx: str) -> str:
    """Planted fault: the kernel reads causal_offset + 1 (the diagonal one key late)."""
    last = max(int(p) for p in re.findall(r"\.param \.\w+ \w+_param_(\d+)", ptx))  # the last argument
    hits = list(re.finditer(r"ld\.param\.b32\s+(%r\d+), \[\w+_param_" + str(last) + r"\];\n", ptx))
    assert len(hits) == 1, len(hits)
    m, reg = hits[0], hits[0].group(1)
    return ptx[:m.end()] + f"\tadd.s32 \t{reg}, {reg}, 1;\n" + ptx[m.end():]


def test_wrong_dp_column_is_caught():
    res = _emulate(256, 256, _dp_column_off_by_one)
    # dS^T = P^T (dP^T - D) feeds dK and dQ; dV = P^T dO does not read dP^T
    assert res.errors["dk"] > 10 * _tol() and res.errors["dq"] > 10 * _tol(), res.errors
    assert res.errors["dv"] < _tol(), res.errors


def test_dropped_red_add_is_caught():
    res = _emulate(256, 256, _drop_first_red)
    assert res.errors["dq"] > _tol(), res.errors
    assert res.errors["dk"] < _tol() and res.errors["dv"] < _tol(), res.errors


def test_wrong_causal_offset_is_caught():
    res = _emulate(256, 256, _causal_offset_plus_one)
    assert max(res.errors.values()) > _tol(), res.errors


def test_wrong_host_causal_offset_is_caught():
    """The host's offset one key tile off (the kernel unchanged): every gradient is wrong."""
    res = _emulate(256, 256, causal_offset_error=128)
    assert min(res.errors.values()) > 10 * _tol(), res.errors


def _disable_dv_lanes(ptx: str) -> str:
    """Planted fault: the first dV MMA of each query tile (A = P^T from TMEM) with D's lanes
    0-31 disabled (element 0 of its {disable-output-lane} vector all ones, ISA 9.7.16.10.9.1)."""
    m = re.search(r"\n(\s*)tcgen05\.mma\.[^\n]*\[%r\d+\], \[%r\d+\], [^\n]*\{(%r\d+),", ptx)
    assert m, "no tcgen05.mma with A in TMEM and a disable-output-lane vector"
    return ptx[:m.start()] + f"\n{m.group(1)}mov.b32 \t{m.group(2)}, -1;" + ptx[m.start():]


def test_disabled_output_lanes_reach_the_mma():
    """The kernel's masks are all zero (the matching runs above); a nonzero one is honoured:
    keys 0-31 of each CTA lose a K slice of dV, the other keys and dK/dQ are untouched."""
    res = _emulate(256, 256, _disable_dv_lanes)
    assert res.errors["dv"] > _tol() and res.errors["dk"] < _tol() and res.errors["dq"] < _tol(), res.errors
    from fp4gen.lowering.emulator.run import rel_l2_error

    rest = [slice(32, 128), slice(160, 256)]
    assert all(rel_l2_error(res.dv[:, s], res.reference[2][:, s]) < _tol() for s in rest)


# ----------------------------------------------------------------------------- deterministic dQ

_VARIANTS = {}


def _variant(old, new):
    """The example's module rendered with one line of its spec changed (compiled once per
    session through the emulator's on-disk cache)."""
    from fp4gen.frontend import parse_text
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.lowering import sm100

    if (old, new) not in _VARIANTS:
        text = (ROOT / "examples" / "sm100_bwd_d128.attn").read_text()
        starts = [m.start() for m in re.finditer(r"^attention ", text, re.M)]
        text = text[:starts[1]] if len(starts) > 1 else text  # the first kernel (the bf16 one)
        assert text.count(old) == 1, old
        plan = plan_kernel(parse_text(text.replace(old, new), "sm100_bwd_variant_d128.attn")[0])
        _VARIANTS[(old, new)] = sm100.render(plan)
    return _VARIANTS[(old, new)]


@pytest.fixture(scope="module")
def deterministic_source():
    """The example's backward with ``deterministic true``: key tiles take turns per query tile
    through an int32 counter (ld.acquire.gpu / red.release.gpu.global.add.s32)."""
    return _variant("deterministic false", "deterministic true")


def test_noncausal_variant_matches():
    """``mask none``: every key tile visits every query tile (no diagonal, no skipped tiles)."""
    from fp4gen.lowering.emulator.run import emulate_backward

    src = _variant("mask     causal", "mask     none")
    assert "    causal=False,\n" in src.split("BWD_CONFIG = ")[1]
    res = emulate_backward(src, seqlen_q=256, seqlen_k=256, seed=0)
    assert max(res.errors.values()) < _tol(), res.errors
    # and the causal kernel's gradients are not these (the masks differ)
    from fp4gen.lowering.emulator.run import rel_l2_error

    assert rel_l2_error(_emulate(256, 256).dk, res.reference[1]) > 0.1


def test_deterministic_dq_matches(deterministic_source):
    from fp4gen.lowering.emulator.run import emulate_backward

    assert "ld.acquire" in _ptx(deterministic_source) and "red.release" in _ptx(deterministic_source)
    res = emulate_backward(deterministic_source, seqlen_q=128, seqlen_k=384, seed=0)
    assert max(res.errors.values()) < _tol(), res.errors


def test_a_dq_turn_never_passed_stops_the_next_key_tile(deterministic_source):
    """Planted fault: the turn's red.release removed; key tile 1 waits for query tile 0's turn
    forever (the emulator stops it at its instruction limit)."""
    from fp4gen.lowering.emulator.machine import EmulationError
    from fp4gen.lowering.emulator.run import emulate_backward

    def drop_release(ptx):
        return "\n".join(ln for ln in ptx.split("\n") if "red.release" not in ln)

    with pytest.raises(EmulationError, match="livelock"):
        emulate_backward(deterministic_source, seqlen_q=128, seqlen_k=256, seed=0, ptx_mutation=drop_release,
                         max_instructions=300_000)


def _ptx(source):
    from fp4gen.lowering.emulator.run import compiled

    return compiled(source, backward=True)[0]


# ----------------------------------------------------------------------------- red, by hand

_RED_PTX = """
.version 9.4
.target sm_100a
.address_size 64

.visible .entry k(
\t.param .u64 k_param_0
)
.reqntid 32, 1, 1
{
\t.reg .b32 %r<10>;
\t.reg .f32 %f<10>;
\t.reg .b64 %rd<4>;
\tld.param.u64 %rd1, [k_param_0];
\tmov.u32 %r1, %tid.x;
\tcvt.rn.f32.u32 %f1, %r1;
\tmov.f32 %f2, 0f3F800000;
\tmov.f32 %f3, 0f00000001;
\tneg.f32 %f4, %f1;
\tred.global.add.v4.f32 [%rd1], {%f1, %f2, %f3, %f4};
\tred.release.gpu.global.add.s32 [%rd1+16], %r1;
\tret;
}
"""


def test_red_add_every_lane_counts_and_f32_flushes_subnormals():
    """32 lanes on the same 16 bytes (ISA 9.7.13.6 red: atomic per element): lane t adds
    (t, 1, the smallest subnormal, -t) and t to an s32; the subnormal is flushed to zero."""
    import struct

    import numpy as np

    from fp4gen.lowering.emulator import machine as M
    from fp4gen.lowering.emulator import ptx as P

    gm = M.GlobalMemory()
    buf = gm.alloc(np.array([0.5, 0.0, 0.0, 0.0], np.float32).tobytes() + struct.pack("<i", -7) + bytes(12))
    M.Machine(P.parse(_RED_PTX), smem=None, gmem=gm, params=struct.pack("<Q", buf)).run()
    f = struct.unpack("<4f", gm.read(buf, 16))
    assert f == (0.5 + sum(range(32)), 32.0, 0.0, -float(sum(range(32)))), f
    assert struct.unpack("<i", gm.read(buf + 16, 4))[0] == -7 + sum(range(32))


def _p_store_column_off_by_one(ptx: str) -> str:
    """Planted fault: the second P^T chunk (bf16 pairs, TMEM columns 16-31) stored from column 17."""
    st_addr = set(re.findall(r"tcgen05\.st\.[^\n]*\[(%r\d+)\]", ptx))
    lines = ptx.split("\n")
    # (an add, or an or where the lane bits and the column cannot overlap: uniform slices)
    hits = [i for i, ln in enumerate(lines)
            if (m := re.match(r"\s*(?:add\.s32|or\.b32)\s+(%r\d+), %r\d+, 16;", ln)) and m.group(1) in st_addr]
    assert len(hits) == 1, hits
    lines[hits[0]] = lines[hits[0]].replace(", 16;", ", 17;")
    return "\n".join(lines)


def test_wrong_p_column_is_caught():
    res = _emulate(256, 256, _p_store_column_off_by_one)
    # dV += P^T dO reads P^T from TMEM; dK and dQ take dS^T from SMEM
    assert res.errors["dv"] > 10 * _tol(), res.errors
    assert res.errors["dk"] < _tol() and res.errors["dq"] < _tol(), res.errors
