"""The fast Direct-P softmax's issue count per KV tile, read from the compiled SASS by the
performance model (fp4gen/lowering/perf.py): it bounds the predicted speed (issue-bound on the
softmax warps), so a change that adds instructions to the steady-state tile fails here.

Measured when the bounds were set (fa4_fp4_d128): 982 instructions per row per unmasked tile
of an unguarded stage (m = 0: no subtraction of m) for both softmax warpgroups, 1048 for a
guarded one, 1353 / 1386 for a masked guarded tile (before the f32x2 chain, the multiply-add
word and the split tile loops: 2134 / 2139, masked alike).

The guard's headroom rebase (4d1e8c5) made these static counts 1070 / 1071 (main) and 1664 /
1684 (masked), measured against its parent on the same SASS: +64 FADD2 in the main loop (the
m = 0 copy's in-place subtraction of a rebased m) and +129 FMUL, 8 LDTM/STTM, 8 FENCE in the
masked one (the O rescale in TMEM) sit behind a warp-uniform branch that only a row whose tile
maximum is > 64 binades above its reference takes; ~20 instructions (the tile maximum's
compare, FSEL, VOTE, BRA, FRND/F2I) run on every tile. The bounds below count the cold branch
too.

Since the m = 0 copies were dropped for compile time (issue 16: +85 % of fa4_fp4's compile),
every stage runs the subtracting copies: 1070 / 1072 (main; the same static count as the m = 0
copy with its cold in-place subtraction, 64 FADD2 more in the steady state of an unguarded
stage) and 1365 / 1391 (masked), two loops per warpgroup.

The saturating classifier (2026-12-07: one FFMA.SAT per key, one FFMA2 per two, the scale
folded in; numerics.directp.sat_codes) made them 636 (main) and 1082 (masked); the masked
tile's per-key select on the FMA pipe (FSEL, ptx.keep_or_neg_inf) 1033; two codes per byte by
three f32x2 instructions per four keys and three PRMTs per word (direct_p.sat_block) 590 / 983;
the masked tile's select without a run-time branch around it (R2P, no merge moves) 757;
e_B by one saturating cvt.rmi and l's halving folded into the block scale 581 / 749; the
lookups on the word's two halves before they are joined (no shift) 567 / 731; the l table's
first word in a register (no MOV before each lookup), the block's byte sum by one dp4a, the
rebase's arithmetic and its O rescale inside the cold branch, e_B, its E8M0 byte and l's
2^(e_B+1) from one float (l summed as 4 l), the scale bytes' row address carried, one proxy
fence per tile 483 / 655; the classifier's A/7 and the byte-pair multiplier 112 in registers of
their own, no clamp of e_B at 127 where the rebase bounds it 477 / 649; the tile's TMEM
address in a uniform register (no R2UR before each tcgen05.ld/st) 472 / 644.
"""
from __future__ import annotations

import pytest

MAIN_BOUND = 475  # instructions per row per unmasked tile, each softmax warpgroup
MASKED_BOUND = 650
MASK_COMPARES = 16  # ISETP on the unmasked path: none per key (the masked copy has ~128)


def _softmax_roles(example: str, tmp):
    from fp4gen.frontend import parse_file
    from fp4gen.ir.passes import plan_kernel
    from fp4gen.lowering import conformance as C
    from fp4gen.lowering import perf, sm100

    from test_sm100_lowering import EXAMPLES

    plan = plan_kernel(parse_file(EXAMPLES / f"{example}.attn")[0])
    art = C.compile_artifacts(sm100.render(plan), str(tmp))
    info = perf.KernelInfo(name=example, arch="sm_100a", causal=True, tile_m=256, tile_n=128,
                           head_dim=128, warps_by_registers={}, groups=2, persistent=False)
    an = perf.analyse(perf.KernelArtifacts(info, art.ptx, perf.sass_cached(art.ptx)))
    softmax = next(r.registers for r in plan.pipeline.roles if r.name.startswith("softmax"))
    return [r for r in an["roles"] if r["registers"] == softmax]


@pytest.fixture(scope="module")
def softmax_roles(tmp_path_factory):
    return _softmax_roles("fa4_fp4_d128", tmp_path_factory.mktemp("count"))


@pytest.mark.slow
def test_the_fast_direct_p_tile_stays_under_its_instruction_bound(softmax_roles):
    assert len(softmax_roles) == 1  # one traced body serves both query stages (stage_view)
    for r in softmax_roles:
        assert r["loops"] == 2, "unmasked and masked"
        assert r["main"]["instructions"] <= MAIN_BOUND, r["main"]["opcodes"]
        assert r["masked"]["instructions"] <= MASKED_BOUND, r["masked"]["opcodes"]
        assert r["main"]["opcodes"].get("ISETP", 0) <= MASK_COMPARES, r["main"]["opcodes"]
        ops = r["main"]["opcodes"]
        assert ops.get("FFMA", 0) >= 128  # y = sat(A7s * s + c_B), one per key
        assert ops.get("FFMA2", 0) == 64 and ops.get("FADD2", 0) == 32  # two code bytes per 3 f32x2
        assert not ops.get("FMUL2")  # the scale is folded into the classifier


# The FP8 exp path (fa4_nvfp8_d128), one loop masking every tile: 959 instructions and 129 MUFU
# per row per tile (MUFU-bound: 129 x 8 cycles at 16 lanes/clk/SM); with the exponent as one
# FFMA2 per two scores, P's factor 256 in it, l summed by FADD2 and 2 pairs in 8 of the
# exponentials on the FMA pipe (exp2_fma): 782 and 97 MUFU, the two pipes balanced.
FP8_BOUND = 790
FP8_MUFU = 97


@pytest.mark.slow
def test_the_fp8_exp_tile_balances_issue_and_mufu(tmp_path_factory):
    (r,) = _softmax_roles("fa4_nvfp8_d128", tmp_path_factory.mktemp("fp8"))
    ops = r["main"]["opcodes"]
    assert r["main"]["instructions"] <= FP8_BOUND, ops
    assert ops.get("MUFU", 0) <= FP8_MUFU, ops
    assert ops.get("FMUL", 0) <= 1, ops  # the row max's scale only: each score's is in the FFMA2
