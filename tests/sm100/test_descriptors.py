"""Descriptor checks (fp4gen/lowering/descriptors.py): tcgen05.mma instruction and SMEM
descriptors read back from the PTX and compared with the plan.

Fast tests: the bit tables on hand-built words (every field round-trips; the words the
compiled kernels use decode to what the plan says), the known-bits arithmetic the PTX tracer
rests on (checked against brute force), the scale-factor id/column rule, and the tracer on a
hand-written PTX fragment. Slow tests compile the paper's kernel (and the sm100a backward)
once per module and plant one fault at a time in the compiled PTX: each is reported as exactly
the field it changes.
"""
from __future__ import annotations

import dataclasses
import random
import re

import pytest

from fp4gen.lowering import descriptors as D

# ------------------------------------------------------------------ bit tables (fast)

KINDS = ["kind::f16", "kind::tf32", "kind::f8f6f4", "kind::i8", "kind::mxf8f6f4",
         "kind::mxf4.block_scale.block32", "kind::mxf4nvf4.block_scale.block16"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_descriptor_field_round_trips(kind):
    table, _ = D._TABLES[D.kind_family(kind)]
    for f in table:
        for v in {0, 1, (1 << f.width) - 1}:
            word = D.encode_instr_desc(kind, **{f.name: v})
            assert word == v << f.lo
            d = D.decode_instr_desc(kind, word)
            assert d[f.name] == v, (f.name, v, d)
            assert all(d[g.name] == 0 for g in table if g is not f)
            assert d["reserved"] == 0


def test_fields_do_not_overlap_and_reserved_bits_are_the_rest():
    for fam, (table, reserved) in D._TABLES.items():
        masks = [f.mask for f in table]
        assert sum(masks) == sum(set(masks)) and not any(a & b for i, a in enumerate(masks) for b in masks[i + 1:])
        assert sum(masks) & reserved == 0
        assert sum(masks) | reserved == 0xFFFFFFFF, fam


def test_the_compiled_kernels_words_decode_to_their_plans():
    # QK of the paper kernel: NVFP4 x NVFP4, block16 with UE4M3 scales, M=N=128, K-major
    qk = D.encode_instr_desc("kind::mxf4nvf4", a_format=1, b_format=1, n_dim=128 >> 3, m_dim=128 >> 7)
    assert qk == 0x08200480 == 136316032  # the selp constant in the compiled PTX
    d = D.decode_instr_desc("kind::mxf4nvf4.block_scale.block16", qk)
    assert (d["M"], d["N"], d["K"], d["a_type"], d["b_type"], d["scale"], d["a_major"], d["b_major"]) == \
        (128, 128, 64, "e2m1", "e2m1", "ue4m3", 0, 0)
    # PV: MXFP4, UE8M0 scales, second K step with sf ids 2 OR-ed in
    pv = 144704640 | (2 << 29) | (2 << 4)
    d = D.decode_instr_desc("kind::mxf4nvf4.block_scale.block32", pv)
    assert (d["scale"], d["a_sf_id"], d["b_sf_id"], d["N"], d["reserved"]) == ("ue8m0", 2, 2, 128, 0)
    # CUTLASS writes M >> 4 into bits 24-28 of the block-scaled word: the same bits for M=128
    assert (128 >> 4) << 24 == (128 >> 7) << 27
    # FP8 PV of fa4_nvfp8 (V MN-major) and the backward's bf16 MMAs
    d = D.decode_instr_desc("kind::f8f6f4", 136380432)
    assert (d["a_type"], d["b_type"], d["d_type"], d["a_major"], d["b_major"], d["K"]) == ("e4m3", "e4m3", "f32", 0, 1, 32)
    d = D.decode_instr_desc("kind::f16", 136316048)
    assert (d["a_type"], d["d_type"], d["M"], d["N"], d["K"]) == ("bf16", "f32", 128, 128, 16)
    # the negate bit is its own field (the compiled kernels select it at run time)
    assert D.decode_instr_desc("kind::f16", 136324240)["negate_a"] == 1


def test_unknown_bits_make_only_their_fields_dynamic():
    known = 0xFFFFFFFF & ~((1 << 13) | (1 << 14))
    d = D.decode_instr_desc("kind::mxf4nvf4", 0x08200480, known)
    assert d["negate_a"] == d["negate_b"] == D.DYN
    assert d["N"] == 128 and d["a_type"] == "e2m1"
    d = D.decode_instr_desc("kind::mxf4nvf4", 0x08200480, known & ~(1 << 29))
    assert d["a_sf_id"] == D.DYN and d["b_sf_id"] == 0


def test_reserved_bits_and_invalid_codes_are_visible():
    assert D.decode_instr_desc("kind::mxf4nvf4", 0x08200480 | (1 << 24))["reserved"] == 1 << 24
    assert D.decode_instr_desc("kind::mxf4nvf4", 0x08200480 | (1 << 12))["reserved"] == 1 << 12
    assert D.decode_instr_desc("kind::mxf4nvf4", D.encode_instr_desc("kind::mxf4nvf4", a_format=5))["a_type"] == "invalid(5)"
    assert D.decode_instr_desc("kind::mxf4nvf4", 1 << 31)["K"] == 96
    with pytest.raises(ValueError):
        D.encode_instr_desc("kind::f16", n_dim=64)
    with pytest.raises(KeyError):
        D.encode_instr_desc("kind::mxf4nvf4", d_format=1)  # not a field of Table 44


def test_every_smem_descriptor_field_round_trips():
    for f in D._SMEM:
        for v in {0, 1, (1 << f.width) - 1}:
            d = D.decode_smem_desc(D.encode_smem_desc(**{f.name: v}))
            assert d[f.name] == v and all(d[g.name] == 0 for g in D._SMEM if g is not f) and d["reserved"] == 0
    # the QK operands of the paper kernel: 64B swizzle, SBO 512 (8 rows of 64 B), version 1
    d = D.decode_smem_desc(0x8000402000010000 | (18816 >> 4))
    assert (d["swizzle_bytes"], d["sbo_bytes"], d["lbo_bytes"], d["version"], d["start_bytes"]) == (64, 512, 16, 1, 18816)
    assert D.decode_smem_desc(3 << 61)["swizzle_bytes"] == "invalid(3)"


# ------------------------------------------------------------------ known bits (fast)


def _sample(kb, rng):
    free = D._mask(kb.width) & ~kb.mask
    return kb.val | (rng.getrandbits(kb.width) & free)


def _random_kb(rng, w):
    mask = rng.getrandbits(w) | (D._mask(w) << rng.randrange(w) & D._mask(w) if rng.random() < 0.5 else 0)
    return D.KB(rng.getrandbits(w) & mask, mask, w)


@pytest.mark.parametrize("w", [32, 64])
def test_known_bits_arithmetic_is_sound(w):
    """Every concrete result of an operation lies in the known bits the analysis gives it."""
    rng = random.Random(w)
    m = D._mask(w)
    ops = {
        "add": (lambda a, b: a.add(b), lambda x, y: (x + y) & m),
        "sub": (lambda a, b: a.add(b.not_(), carry=1), lambda x, y: (x - y) & m),
        "or": (lambda a, b: a.or_(b), lambda x, y: x | y),
        "and": (lambda a, b: a.and_(b), lambda x, y: x & y),
        "xor": (lambda a, b: a.xor(b), lambda x, y: x ^ y),
        "join": (lambda a, b: a.join(b), None),
    }
    for _ in range(300):
        a, b = _random_kb(rng, w), _random_kb(rng, w)
        s = rng.randrange(w)
        for name, (abstract, concrete) in ops.items():
            r = abstract(a, b)
            for _ in range(8):
                x, y = _sample(a, rng), _sample(b, rng)
                vals = [x, y] if concrete is None else [concrete(x, y)]
                for v in vals:
                    assert v & r.mask == r.val, (name, a, b, x, y, r)
        for abstract, concrete in ((a.shl(s), lambda x: (x << s) & m), (a.shr(s), lambda x: x >> s)):
            for _ in range(8):
                x = _sample(a, rng)
                assert concrete(x) & abstract.mask == abstract.val
    # and it is exact where it should be: shifts bring in known zeros, and no carry can leave a
    # masked 14-bit start address
    assert D.KB(0, 0xFFFF0000, 32).shr(4).mask == 0xFFFFF000 and D.KB(0, 0xFFFF, 32).shl(4).mask == 0xFFFFF
    start = D.KB(0, m & ~0x3FD8, w)
    assert start.add(D.KB.const(2, w)).mask & ~0x3FFF == m & ~0x3FFF


# ------------------------------------------------------------------ the sf rule (fast)


def _op(kind, sf_block, k_total=128):
    return D._Op("X", kind, 128, 128, k_total, "e2m1", "e2m1", 0, 0, "smem", 0, True, sf_block=sf_block)


def test_scale_factor_ids_and_columns_per_k_step():
    # block32 with K=64 per instruction (scale_vec::2X): two scales per row per K step, SF_ID
    # is the half-word of the 32-bit TMEM word: 0 then 2 in the same columns, then the next atom
    op = _op("kind::mxf4nvf4.block_scale.block32", 32, 256)
    assert [D._expected_sf(op, i, 128) for i in range(op.k_steps)] == [(0, 0), (0, 2), (4, 0), (4, 2)]
    # block16 (scale_vec::4X): the whole word, SF_ID 0, a new 4-column atom every K step
    op = _op("kind::mxf4nvf4.block_scale.block16", 16)
    assert [D._expected_sf(op, i, 128) for i in range(op.k_steps)] == [(0, 0), (4, 0)]
    # mxf8f6f4 block32 (scale_vec::1X, K=32): one byte per K step
    op = _op("kind::mxf8f6f4.block_scale.block32", 32)
    assert [D._expected_sf(op, i, 128) for i in range(op.k_steps)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert D._expected_sf(op, 1, 256) == (0, 1) and D._expected_sf(_op("kind::mxf4", 32, 512), 2, 256) == (8, 0)


# ------------------------------------------------------------------ the tracer (fast)

MINI = """\
.version 9.4
.target sm_100a
.extern .shared .align 1024 .b8 __dynamic_shmem__0[];
.visible .entry k(
\t.param .align 4 .b8 k_param_0[12]
)
{
\tld.param.b8 \t%rs1, [k_param_0+1];
\tand.b16 \t%rs2, %rs1, 1;
\tsetp.ne.b16 \t%p1, %rs2, 0;
\tmov.b32 \t%r216, __dynamic_shmem__0;
\tshfl.sync.idx.b32 \t%r1, %r216, 0, 31, -1;
\tadd.s32 \t%r21, %r1, 2376;
\ttcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 \t[%r21], 512;
\tld.shared.b32 \t%r53, [%r1+2376];
\tadd.s32 \t%r55, %r53, 256;
\tadd.s32 \t%r57, %r53, 64;
\tadd.s32 \t%r69, %r53, 72;
\tadd.s32 \t%r61, %r53, 80;
\tadd.s32 \t%r59, %r53, 84;
\tadd.s32 \t%r67, %r53, -2147483568;
\tadd.s32 \t%r68, %r53, -2147483564;
\tselp.b32 \t%r10, 144712832, 144704640, %p1;
\tshr.u32 \t%r11, %r61, 1;
\tand.b32 \t%r12, %r11, 1610612736;
\tshr.u32 \t%r13, %r59, 26;
\tand.b32 \t%r14, %r13, 48;
\tor.b32 \t%r15, %r12, %r14;
\tor.b32 \t%r16, %r15, %r10;
\tshr.u32 \t%r17, %r67, 1;
\tand.b32 \t%r18, %r17, 1610612736;
\tshr.u32 \t%r19, %r68, 26;
\tand.b32 \t%r20, %r19, 48;
\tor.b32 \t%r22, %r18, %r20;
\tor.b32 \t%r23, %r22, %r10;
\tadd.s32 \t%r30, %r1, 51584;
\tshr.u32 \t%r31, %r30, 4;
\tand.b32 \t%r32, %r31, 16344;
\tcvt.u64.u32 \t%rd1, %r32;
\tor.b64 \t%rd2, %rd1, -9223301530671579136;
\tmov.b64 \t{%r33, %r34}, %rd2;
\tor.b32 \t%r35, %r33, 2;
\tmov.b64 \t%rd3, {%r35, %r34};
\tsetp.ne.b32 \t%p2, %r7, 1;
\tmov.pred \t%p3, -1;
\ttcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block32.collector::a::discard [%r55], [%r57], %rd2, %r16, [%r61], [%r59], %p2;
\ttcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block32.collector::a::discard [%r55], [%r69], %rd3, %r23, [%r67], [%r68], %p3;
\tret;
}
"""


def test_the_tracer_reads_a_hand_written_pv():
    m0, m1 = D.mma_instructions(MINI)
    for m, a_col, sf in ((m0, 64, 0), (m1, 72, 2)):
        assert m.kind == "kind::mxf4nvf4.block_scale.block32" and m.a_source == "tmem"
        assert (m.d.column, m.d.based, m.a.column, m.sf_a.column, m.sf_b.column) == (256, True, a_col, 80, 84)
        assert (m.idesc["a_sf_id"], m.idesc["b_sf_id"], m.sf_a.sf_id, m.sf_b.sf_id) == (sf, sf, sf, sf)
        assert (m.idesc["M"], m.idesc["N"], m.idesc["scale"]) == (128, 128, "ue8m0")
        assert m.dynamic_fields == ("negate_a",)  # selected by the kernel parameter's byte
        assert m.b.fields["swizzle_bytes"] == 64 and m.b.start_offset == 51584 + 32 * (sf // 2)
    assert (m0.enable_input_d, m1.enable_input_d) == (D.DYN, True)
    # without the alloc base assumption (TMEM base from an unrelated load) the sf ids are unknown
    unknown_base = MINI.replace("[%r1+2376];", "[%r1+2380];")
    m0, m1 = D.mma_instructions(unknown_base)
    assert m1.idesc["a_sf_id"] == D.DYN and not m1.d.based
    # an absolute TMEM address (not the alloc base + offset) is told apart
    m0, _ = D.mma_instructions(MINI.replace("add.s32 \t%r57, %r53, 64;", "mov.b32 \t%r57, 64;"))
    assert not m0.a.based and m0.a.absolute_column == 64


# ------------------------------------------------------------------ the compiled kernels (slow)


def _plan(name):
    from fp4gen.frontend import parse_file
    from fp4gen.ir.passes import plan_kernel

    from test_sm100_lowering import EXAMPLES

    return plan_kernel(parse_file(EXAMPLES / f"{name}.attn")[0])


@pytest.fixture(scope="module")
def paper_kernel(tmp_path_factory):
    from fp4gen.lowering import conformance as C
    from fp4gen.lowering import sm100

    plan = _plan("fa4_fp4_d128")
    return plan, C.compile_artifacts(sm100.render(plan), str(tmp_path_factory.mktemp("desc"))).ptx


@pytest.fixture(scope="module")
def backward_kernel(tmp_path_factory):
    from fp4gen.lowering import conformance as C
    from fp4gen.lowering import sm100

    plan = _plan("sm100_bwd_d128")
    art = C.compile_artifacts(sm100.render(plan), str(tmp_path_factory.mktemp("desc_bwd")), backward=True)
    return plan.backward, art.ptx


def checks(plan, ptx):
    return {m.check for m in D.check_descriptors(plan, ptx)}


def _groups(mmas, d_col):
    return [m for m in mmas if m.d.column == d_col]


@pytest.mark.slow
def test_the_paper_kernel_descriptors_match_its_plan(paper_kernel):
    plan, ptx = paper_kernel
    assert D.check_descriptors(plan, ptx) == [], "\n".join(map(str, D.check_descriptors(plan, ptx)))
    mmas = D.mma_instructions(ptx)
    regions = {r.name: r.first_col for r in plan.tmem.regions}
    for j in range(plan.pipeline.q_stages):
        pv = _groups(mmas, regions[f"O{j}"])
        qk = _groups(mmas, regions[f"S{j}"])
        assert pv and qk and len(pv) % 2 == 0 and len(qk) % 2 == 0
        # block32: sf_id 0 then 2 in the same SFP/SFV columns; P part 1 then part 2
        assert [(m.idesc["a_sf_id"], m.idesc["b_sf_id"]) for m in pv[:2]] == [(0, 0), (2, 2)]
        assert [(m.sf_a.column, m.sf_b.column) for m in pv[:2]] == [(regions[f"SFP{j}"], regions[f"SFV{j}"])] * 2
        assert [m.a.column for m in pv[:2]] == [regions[f"P{j}"], regions[f"P{j}"] + 8]
        # block16: sf_id 0, the next 4-column atom for the second K step
        assert [(m.idesc["a_sf_id"], m.sf_a.column - regions[f"SFQ{j}"], m.sf_b.column - regions[f"SFK{j}"])
                for m in qk[:2]] == [(0, 0, 0), (0, 4, 4)]
    # the only fields the PTX leaves to run time: the negate bits (TiledMMA run-time fields)
    assert {f for m in mmas for f in m.dynamic_fields} == {"negate_a", "negate_b"}


def _pv_qk_words(ptx):
    """The static instruction-descriptor words of QK and PV as the PTX spells them (negate and
    sf-id bits cleared: those are OR-ed in separately)."""
    out = {}
    for m in D.mma_instructions(ptx):
        name = "PV" if m.a_source == "tmem" else "QK"
        out.setdefault(name, m.idesc_known.val & ~((3 << 29) | (3 << 4) | (3 << 13)))
    return out


def _flip_literal(ptx, word, new):
    """Replace the descriptor constant ``word`` (and its negate-A variant) wherever it appears."""
    out = ptx
    for w in (word, word | (1 << 13)):
        out, n = re.subn(rf"(?<![\d-]){w}(?!\d)", str(new | (w & (1 << 13))), out)
        assert n > 0, f"{w} not found in the PTX"
    return out


def _redefine(ptx, reg, pattern, repl):
    """Rewrite the one line defining ``reg``."""
    rx = re.compile(rf"^(\s*[\w.]+\s+{re.escape(reg)},.*)$", re.M)
    lines = rx.findall(ptx)
    assert len(lines) == 1, (reg, lines)
    new = re.sub(pattern, repl, lines[0])
    assert new != lines[0]
    return ptx.replace(lines[0], new)


def _pv(ptx, k_step):
    return [m for m in D.mma_instructions(ptx) if m.a_source == "tmem"][k_step]


def _qk(ptx, k_step):
    return [m for m in D.mma_instructions(ptx) if m.a_source == "smem"][k_step]


def _reg(tok):
    return re.search(r"%\w+", tok).group(0)


IDESC_FAULTS = {
    # name: (product, bits to clear, bits to set, the one check that must fire)
    "M 256 in place of 128": ("QK", 3 << 27, 2 << 27, {"idesc.QK.M"}),
    "N 64 in place of 128": ("PV", 0x3F << 17, 8 << 17, {"idesc.PV.N"}),
    "A format E2M1 as mxf8f6f4 codes it (5)": ("QK", 7 << 7, 5 << 7, {"idesc.QK.a_type"}),
    "B format 0": ("PV", 3 << 10, 0, {"idesc.PV.b_type"}),
    "B MN-major": ("QK", 0, 1 << 16, {"idesc.QK.b_major"}),
    "A MN-major": ("PV", 0, 1 << 15, {"idesc.PV.a_major"}),
    "UE4M3 scales in place of UE8M0": ("PV", 1 << 23, 0, {"idesc.PV.scale"}),
    "UE8M0 scales in place of UE4M3": ("QK", 0, 1 << 23, {"idesc.QK.scale"}),
    "K 96": ("PV", 0, 1 << 31, {"idesc.PV.K"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(IDESC_FAULTS))
def test_each_planted_instruction_descriptor_fault_is_caught(paper_kernel, fault):
    plan, ptx = paper_kernel
    product, clear, set_, expected = IDESC_FAULTS[fault]
    word = _pv_qk_words(ptx)[product]
    bad = _flip_literal(ptx, word, (word & ~clear) | set_)
    assert checks(plan, bad) == expected


@pytest.mark.slow
def test_a_wrong_sf_id_is_caught(paper_kernel):
    """PV's second K step reads scale bytes 0-1 again (sf_id 0): the TMEM address's byte bits and
    the descriptor field it feeds; then only the descriptor field (the OR of the id dropped)."""
    plan, ptx = paper_kernel
    m = _pv(ptx, 1)
    assert m.idesc["a_sf_id"] == 2
    bad = _redefine(ptx, _reg(m.sf_a.token), r"-2147483\d+;", lambda x: str(int(x.group(0)[:-1]) & 0x3FFFFFFF) + ";")
    assert checks(plan, bad) == {"idesc.PV.a_sf_id", "tmem.PV.SFA.sf_id"}
    bad = re.sub(r"(and\.b32\s+%r\d+,\s*%r\d+,\s*)1610612736;", r"\g<1>0;", ptx)
    assert bad != ptx and checks(plan, bad) == {"idesc.PV.a_sf_id"}


@pytest.mark.slow
def test_p_part_2_read_in_place_of_part_1_is_caught(paper_kernel):
    plan, ptx = paper_kernel
    m = _pv(ptx, 1)
    bad = _redefine(ptx, _reg(m.a.token), r"\b72;", "64;")
    assert checks(plan, bad) == {"tmem.PV.A.column"}


@pytest.mark.slow
def test_a_scale_factor_column_fault_is_caught(paper_kernel):
    plan, ptx = paper_kernel
    m = _qk(ptx, 1)  # second K step: SFK at the next 4-column atom
    bad = _redefine(ptx, _reg(m.sf_b.token), r"\b140;", "136;")
    assert checks(plan, bad) == {"tmem.QK.SFB.column"}


@pytest.mark.slow
def test_smem_descriptor_faults_are_caught(paper_kernel):
    plan, ptx = paper_kernel
    m = _qk(ptx, 0)
    tok = m.a.token
    # Q's descriptor with 128B swizzle (2) in place of 64B (4)
    bad = _redefine(ptx, tok, r"-9223301530671579136", str(0x4000402000010000))
    assert checks(plan, bad) == {"smem.QK.A.swizzle"}
    # SBO 1024 in place of 512
    bad = _redefine(ptx, tok, r"-9223301530671579136", str(0x8000402000010000 + (32 << 32) - (1 << 64)))
    assert checks(plan, bad) == {"smem.QK.A.sbo"}
    # the second K step reads K 0..63 again (start address not advanced by 32 bytes)
    m1 = _qk(ptx, 1)
    bad = _redefine(ptx, m1.a.token, r"-9223301530671579134", "-9223301530671579136")
    assert checks(plan, bad) == {"smem.QK.A.k_advance"}


@pytest.mark.slow
def test_the_backward_descriptors_match_its_plan(backward_kernel):
    bp, ptx = backward_kernel
    assert D.check_backward_descriptors(bp, ptx) == [], "\n".join(map(str, D.check_backward_descriptors(bp, ptx)))
    mmas = D.mma_instructions(ptx)
    dv = [m for m in mmas if m.a_source == "tmem"]
    # P^T is read at absolute TMEM columns (not the alloc base + offset): right only because the
    # kernel allocates all 512 columns, which the check requires for it
    assert bp.tmem.alloc_columns == 512 and dv and not dv[0].a.based
    assert [m.a.absolute_column for m in dv[:8]] == list(range(0, 64, 8))
    smaller = dataclasses.replace(bp, tmem=dataclasses.replace(bp.tmem, alloc_columns=256))
    assert {m.check for m in D.check_backward_descriptors(smaller, ptx)} == {"tmem.A.absolute_address"}
    # dQ = dS K is the only MN/MN product: flip its A major
    words = {m.idesc_known.val & ~(3 << 13) for m in mmas if (m.idesc["a_major"], m.idesc["b_major"]) == (1, 1)}
    (word,) = words
    bad = _flip_literal(ptx, word, word & ~(1 << 15))
    assert {m.check for m in D.check_backward_descriptors(bp, bad)} == {"idesc.dQ.a_major"}
    # dQ's B (K, MN-major bf16: two 128-byte MN chunks) with its chunk stride halved
    dq0 = next(m for m in mmas if (m.idesc["a_major"], m.idesc["b_major"]) == (1, 1))
    assert dq0.b.fields["lbo_bytes"] == 128 * 128
    lit = re.search(r"(-?\d+);$", next(ln for ln in ptx.splitlines()
                                       if re.match(rf"\s*or\.b64\s+{re.escape(dq0.b.token)},", ln))).group(1)
    bad = _redefine(ptx, dq0.b.token, lit, str(int(lit) - (512 << 16)))
    assert {m.check for m in D.check_backward_descriptors(bp, bad)} == {"smem.dQ.B.lbo"}
    # dV's second K step reads P^T's first 8 columns again
    bad = _redefine(ptx, _reg(dv[1].a.token), r"\b8;", "0;")
    assert {m.check for m in D.check_backward_descriptors(bp, bad)} == {"tmem.dV.A.column"}
