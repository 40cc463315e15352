"""SASS reader: parsing, CFG, natural loops, warp roles, tile loops, pipe classes.

The listings are hand-written in nvdisasm's format, so every expected count below is known
from the text itself. The real-kernel end-to-end check is in test_perf.py.
"""
from __future__ import annotations

import pytest

from fp4gen.lowering import sass


def two_role_kernel(n_ex2=4, n_ffma=6, masked_branch=True):
    """A softmax role (setmaxnreg 192) whose KV loop waits on an mbarrier (out-of-line retry),
    reads S from TMEM, does ``n_ex2`` MUFU.EX2 and ``n_ffma`` FFMA, optionally a masking branch
    of 3 FSEL; and an MMA role (setmaxnreg 48) whose loop issues 2 UTCHMMA."""
    soft = ["MUFU.EX2 R4, R4 ;"] * n_ex2 + ["FFMA R5, R4, R6, R5 ;"] * n_ffma
    mask = ["@!P3 BRA `(.L_x_5) ;", "FSEL R4, R4, -INF, P4 ;", "FSEL R5, R5, -INF, P4 ;",
            "FSEL R6, R6, -INF, P4 ;", ".L_x_5:"] if masked_branch else []
    return [
        "S2R R0, SR_TID.X ;",
        "ISETP.GT.AND P0, PT, R0, 0x7f, PT ;",
        "@P0 BRA `(.L_x_1) ;",
        "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;",
        ".L_x_2:",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;",
        "@!P1 BRA `(.L_x_9) ;",
        ".L_x_3:",
        "LDTM.x32 R4, tmem[UR5] ;",
        *mask,
        *soft,
        "F2FP.BF16.F32.PACK_AB R7, R5, R4 ;",
        "STTM.x16 tmem[UR6], R4 ;",
        "IADD3 R3, R3, -0x1, RZ ;",
        "ISETP.NE.AND P2, PT, R3, RZ, PT ;",
        "@P2 BRA `(.L_x_2) ;",
        "EXIT ;",
        ".L_x_1:",
        "USETMAXREG.DEALLOC.CTAPOOL 0x30 ;",
        ".L_x_4:",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P5, [UR7], R2 ;",
        "UTCHMMA gdesc[UR8], gdesc[UR10], tmem[UR12], tmem[UR14], idesc[UR15], UPT ;",
        "UTCHMMA gdesc[UR8], gdesc[UR10], tmem[UR12], tmem[UR14], idesc[UR15], UPT ;",
        "UIADD3 UR4, UR4, 0x1, URZ ;",
        "@P6 BRA `(.L_x_4) ;",
        "EXIT ;",
        ".L_x_9:",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;",
        "@!P1 NANOSLEEP.SYNCS 0x989680 ;",
        "@!P1 BRA `(.L_x_9) ;",
        "BRA `(.L_x_3) ;",
    ]


def fn_of(lines):
    return sass.parse_instr_lines(lines)


def test_parse_instruction_fields():
    f = fn_of(["@!P1 FFMA.FTZ R5, R4, R6, R5 ;", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;",
               "EXIT ;"])
    a, b, c = f.instrs
    assert (a.pred, a.opcode, a.base, a.mods) == ("!P1", "FFMA.FTZ", "FFMA", ("FTZ",))
    assert a.operands == "R5, R4, R6, R5"
    assert (b.base, b.mods[0]) == ("HGMMA", "64x128x16")
    assert [i.addr for i in f.instrs] == [0, 16, 32]


def test_cfg_edges_conditional_unconditional_exit():
    f = fn_of(["ISETP.NE.AND P0, PT, R0, RZ, PT ;", "@P0 BRA `(.L_x_1) ;",  # block 0: cond -> 1, 2
               "MOV R1, R2 ;", "BRA `(.L_x_2) ;",  # block 1: -> 3 only
               ".L_x_1:", "@P1 EXIT ;",  # block 2: predicated exit falls through to 3
               ".L_x_2:", "EXIT ;"])  # block 3: no successor
    succ = [b.succs for b in f.blocks]
    assert succ == [[1, 2], [3], [3], []]
    assert sorted(f.blocks[3].preds) == [1, 2]


def test_uniform_predicate_branch_is_conditional():
    f = fn_of(["BRA.U !UP0, `(.L_x_1) ;", "MOV R1, R2 ;", ".L_x_1:", "EXIT ;"])
    assert f.blocks[0].succs == [1, 2]


def test_natural_loops_nested_and_spin():
    f = fn_of([
        "MOV R0, RZ ;",
        ".L_x_1:",  # outer header
        "IADD3 R1, R1, 0x1, RZ ;",
        ".L_x_2:",  # inner header
        "FFMA R2, R2, R2, R2 ;",
        "@P0 BRA `(.L_x_2) ;",  # inner back edge
        "@P1 BRA `(.L_x_1) ;",  # outer back edge
        "EXIT ;",
    ])
    loops = sass.natural_loops(f)
    assert len(loops) == 2
    inner, outer = loops  # innermost first
    assert inner.blocks < outer.blocks
    assert f.blocks[inner.header].label == ".L_x_2" and f.blocks[outer.header].label == ".L_x_1"
    assert not any(sass.is_spin_loop(f, lp) for lp in loops)


def test_self_loop_body_stops_at_header():
    # a TRY_ALLOC retry: the loop is the one block, not everything that reaches it
    f = fn_of(["MOV R0, RZ ;", "MOV R1, RZ ;", ".L_x_4:", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;",
               "PLOP3.LUT P0, PT, PT, PT, UP0, 0x80, 0x0 ;", "@!P0 BRA `(.L_x_4) ;", "EXIT ;"])
    (lp,) = sass.natural_loops(f)
    assert len(lp.blocks) == 1 and sass.is_spin_loop(f, lp)


def test_roles_and_tile_loops():
    f = fn_of(two_role_kernel())
    dom = sass.dominators(f)
    roles = sass.roles(f, dom)
    assert sorted((r.kind, r.registers) for r in roles) == [("alloc", 192), ("dealloc", 48)]
    loops = sass.natural_loops(f, dom)
    spin = [lp for lp in loops if sass.is_spin_loop(f, lp)]
    assert len(spin) == 1  # the out-of-line mbarrier retry
    soft = next(r for r in roles if r.registers == 192)
    mma = next(r for r in roles if r.registers == 48)
    ls, lm = sass.tile_loop(f, soft, loops), sass.tile_loop(f, mma, loops)
    assert ls is not None and lm is not None and ls.header != lm.header
    c = sass.loop_counts(f, lm, loops)
    assert c["pipes"]["tensor"] == 2
    c = sass.loop_counts(f, ls, loops)
    # the retry loop is not part of an iteration: one try-wait only
    assert c["opcodes"]["SYNCS"] == 1 and c["opcodes"].get("NANOSLEEP", 0) == 0


def test_pipe_counts_of_one_iteration():
    f = fn_of(two_role_kernel(n_ex2=5, n_ffma=7, masked_branch=False))
    k = sass.KernelSass(text="", function=f, dom=sass.dominators(f), loops=[], roles=[])
    k.loops = sass.natural_loops(f, k.dom)
    k.roles = sass.roles(f, k.dom)
    soft = next(r for r in k.roles if r.registers == 192)
    c = sass.loop_counts(f, sass.tile_loop(f, soft, k.loops), k.loops)
    p = c["pipes"]
    assert p["mufu"] == 5 and c["mufu_ex2"] == 5
    assert p["fma"] == 7
    assert p["tmem"] == 2  # LDTM + STTM
    assert p["conv"] == 1  # F2FP
    assert p["alu"] == 2  # IADD3 + ISETP
    assert p["sync"] == 1 and p["control"] == 2  # try-wait; the two branches
    assert c["instructions"] == 5 + 7 + 2 + 1 + 2 + 1 + 2


def test_masked_branch_cheap_and_costly_paths():
    f = fn_of(two_role_kernel(masked_branch=True))
    loops = sass.natural_loops(f)
    soft = next(r for r in sass.roles(f) if r.registers == 192)
    lp = sass.tile_loop(f, soft, loops)
    allb = sass.loop_counts(f, lp, loops, "all")
    short = sass.loop_counts(f, lp, loops, "short")
    long_ = sass.loop_counts(f, lp, loops, "long")
    assert allb["opcodes"]["FSEL"] == 3 and long_["opcodes"]["FSEL"] == 3
    assert short["opcodes"].get("FSEL", 0) == 0
    assert long_["instructions"] - short["instructions"] == 3


def test_sibling_loops_main_is_the_cheaper():
    # a masked copy of the loop (more FSEL) and an unmasked copy, both with MMAs
    body = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24 ;", "MUFU.EX2 R4, R4 ;"]
    f = fn_of(["USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;",
               ".L_x_1:", *body, *["FSEL R4, R4, -INF, P4 ;"] * 9, "@P0 BRA `(.L_x_1) ;",
               ".L_x_2:", *body, "@P1 BRA `(.L_x_2) ;", "EXIT ;"])
    loops = sass.natural_loops(f)
    (role,) = sass.roles(f)
    cands = sass.tile_loops(f, role, loops)
    assert len(cands) == 2
    main = sass.tile_loop(f, role, loops)
    assert f.blocks[main.header].label == ".L_x_2"


@pytest.mark.parametrize("opcode,pipe", [
    ("HGMMA.64x128x16.F32.BF16", "tensor"), ("QGMMA.64x128x32.F32.E4M3.E4M3", "tensor"),
    ("UTCQMMA", "tensor"), ("UTCHMMA", "tensor"),
    ("MUFU.EX2", "mufu"), ("MUFU.RCP", "mufu"), ("MUFU.LG2", "mufu"),
    ("FFMA", "fma"), ("FFMA2", "fma"), ("FMUL.FTZ", "fma"), ("FADD", "fma"), ("FMNMX", "fma"),
    ("IADD3", "alu"), ("LOP3.LUT", "alu"), ("SHF.R.U32.HI", "alu"), ("IMAD.WIDE", "alu"), ("PRMT", "alu"),
    ("BFI", "alu"), ("SEL", "alu"), ("ISETP.GT.AND", "alu"),
    ("F2F.F16.F32", "conv"), ("F2FP.BF16.F32.PACK_AB", "conv"), ("I2F", "conv"), ("F2I.FTZ", "conv"),
    ("LDS.128", "lds_sts"), ("STS", "lds_sts"), ("LDSM.16.M88.4", "lds_sts"),
    ("LDG.E.128", "ldg_stg"), ("STG.E", "ldg_stg"), ("UTMALDG.4D", "ldg_stg"),
    ("LDTM.x32", "tmem"), ("STTM.x16", "tmem"),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT", "sync"), ("BAR.SYNC.DEFER_BLOCKING", "sync"), ("WARPGROUP.ARRIVE", "sync"),
    ("UIADD3", "uniform"), ("ULOP3.LUT", "uniform"), ("BRA", "control"), ("EXIT", "control"),
])
def test_classify(opcode, pipe):
    assert sass.classify(opcode) == pipe


def test_unknown_opcodes_are_other_and_listed():
    f = fn_of(["FOOBAR R1, R2 ;", "FFMA R1, R2, R3, R4 ;", "FOOBAR R1, R2 ;", "@!PT FFMA R1, R1, R1, R1 ;"])
    c = sass.count_pipes(f.instrs)
    assert c["pipes"]["other"] == 2 and c["unknown"] == ["FOOBAR"]
    assert c["pipes"]["fma"] == 1  # the @!PT one never issues


def test_wgmma_flops_from_the_opcode_shape():
    f = fn_of(["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24 ;",
               "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24 ;", "EXIT ;"])
    assert sass.hgmma_flops(f.instrs) == 2 * 64 * 128 * 16 + 2 * 64 * 128 * 32


def test_nvdisasm_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(sass.NVDISASM_ENV, str(tmp_path / "missing"))
    with pytest.raises(sass.NvdisasmUnavailable):
        sass.find_nvdisasm()


def test_indirect_branch_targets_from_the_annotation():
    # nvdisasm prints a switch's targets in a comment; without them the role branches behind it
    # are unreachable
    f = sass.parse_sass("\n".join([
        "\t.type\t\tf,@function",
        "        /*0000*/  BRX R2 -0x10 (*\"BRANCH_TARGETS .L_x_1,.L_x_2\"*) ;",
        ".L_x_1:",
        "        /*0010*/  USETMAXREG.DEALLOC.CTAPOOL 0x38 ;",
        "        /*0020*/  EXIT ;",
        ".L_x_2:",
        "        /*0030*/  USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;",
        "        /*0040*/  EXIT ;",
    ]))[0]
    assert f.blocks[0].succs == [1, 2]
    assert sorted(r.registers for r in sass.roles(f)) == [56, 192]
