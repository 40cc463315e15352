"""The performance model's weighting of cold code (fp4gen/lowering/perf.py, "cold code"):
hand-written SASS with a known cold region (the guard's headroom rebase: a branch whose
predicate comes from the FSETP against REBASE_E), checked by structure, not by instruction
numbers of the real kernels (those move while the sm100a forward changes).

Expected counts are written into the SASS here and never read back from the model's output.
"""
from __future__ import annotations

import pytest

from fp4gen.lowering import perf, sass
from fp4gen.numerics.directp import REBASE_E

N_HOT = 300  # FFMAs every tile runs
N_COLD = 120  # FMULs of the O rescale a rebase runs


def _lines(threshold=REBASE_E, cold_marker=False, predicated_cold=0, label="3", wait_pred=False):
    cond = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [UR9], R2 ;"] if wait_pred else [
        "FADD R9, R8, -R10 ;",  # u = t_max - m
        f"FSETP.GT.AND P3, PT, R9, {threshold:g}, PT ;",  # the rebase test
        "FRND.FLOOR R11, R9 ;",
        "FSEL R12, R11, RZ, P3 ;",  # d
        "FSETP.GT.AND P4, PT, R12, RZ, PT ;"]
    return [
        "S2R R0, SR_TID.X ;",
        "ISETP.GT.AND P0, PT, R0, 0xff, PT ;",
        "@P0 BRA `(.L_x_1) ;",
        "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;",
        ".L_x_2:",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;",
        "LDTM.x32 R4, tmem[UR5] ;",
        "FMNMX R8, R4, R5, !PT ;",
        *cond,
        "VOTE.ANY P5, PT, P4 ;",
        *["@P3 FMUL R30, R30, R12 ;"] * predicated_cold,  # if-converted: issued on every tile
        f"@!P5 BRA `(.L_x_{label}) ;",
        *(["PMTRIG 0x80 ;"] if cold_marker else []),
        "LDTM.x16 R40, tmem[UR6] ;",
        *["FMUL R40, R40, R12 ;"] * N_COLD,
        "STTM.x16 tmem[UR6], R40 ;",
        f".L_x_{label}:",
        *["FFMA R5, R4, R6, R5 ;"] * N_HOT,
        "STTM.x16 tmem[UR7], R4 ;",
        "IADD3 R3, R3, -0x1, RZ ;",
        "ISETP.NE.AND P2, PT, R3, RZ, PT ;",
        "@P2 BRA `(.L_x_2) ;",
        "EXIT ;",
        ".L_x_1:",
        "USETMAXREG.DEALLOC.CTAPOOL 0x30 ;",
        ".L_x_4:",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P6, [UR7], R2 ;",
        "UTCQMMA gdesc[UR8], gdesc[UR10], tmem[UR12], tmem[UR14], idesc[UR15], UPT ;",
        "@P6 BRA `(.L_x_4) ;",
        "EXIT ;",
    ]


def _hot_count(lines):
    """Instructions of one steady-state iteration, counted from the listing: header to the back
    edge, without the cold region (from after the BRA to its label)."""
    body = lines[lines.index(".L_x_2:") + 1: lines.index("@P2 BRA `(.L_x_2) ;") + 1]
    bra = next(i for i, ln in enumerate(body) if ln.startswith("@!P5 BRA"))
    label = next(i for i, ln in enumerate(body) if ln.startswith(".L_x_") and i > bra)
    return len(body[:bra + 1]) + len(body[label + 1:])


def _sass_text(lines, start=0):
    out, addr = ["\t.type\t\tk,@function"], start
    for ln in lines:
        if ln.endswith(":"):
            out.append(ln)
        else:
            out.append(f"        /*{addr:04x}*/  {ln}")
            addr += 16
    return "\n".join(out)


def _art(lines, causal=False, start=0):
    info = perf.KernelInfo(name="toy", arch="sm_100a", causal=causal, tile_m=256, tile_n=128, head_dim=128,
                           warps_by_registers={192: 8, 48: 1}, groups=2, qk_format="fp4", pv_format="fp4")
    return perf.KernelArtifacts(info, ptx="", sass=_sass_text(lines, start))


def _softmax(an):
    return next(r for r in an["roles"] if r["registers"] == 192)


def steady_problems(an, lines) -> list:
    """What is wrong with the model's steady-state counts of the toy (empty: nothing)."""
    r = _softmax(an)
    hot, out = _hot_count(lines), []
    for key in ("main", "masked"):
        if r[key]["instructions"] != hot:
            out.append(f"{key}: {r[key]['instructions']} instructions, the steady path has {hot}")
        if r[key + "_cold"]["instructions"] != N_COLD + 2:
            out.append(f"{key}_cold: {r[key + '_cold']['instructions']}, the cold region has {N_COLD + 2}")
    return out


def test_the_rebase_branch_is_cold_and_left_out_of_the_steady_state():
    lines = _lines()
    an = perf.analyse(_art(lines))
    assert steady_problems(an, lines) == []
    r = _softmax(an)
    assert [c["kind"] for c in r["cold_blocks"]] == ["rebase"]
    assert r["main_cold"]["pipes"]["tmem"] == 2 and r["main_cold"]["opcodes"]["FMUL"] == N_COLD


def test_planted_fault_counting_the_cold_region_in_the_steady_state_is_caught(monkeypatch):
    """Without the cold-region finder the masked (costliest) path runs through the O rescale:
    the check above must then fail."""
    lines = _lines()
    monkeypatch.setattr(perf, "cold_regions", lambda *a, **k: {})
    problems = steady_problems(perf.analyse(_art(lines)), lines)
    assert any(p.startswith("masked:") for p in problems), problems


def test_steady_state_charges_nothing_and_the_worst_case_everything():
    g = perf.GPUS["b200"]
    art = _art(_lines())
    an = perf.analyse(art)
    hot = _hot_count(_lines())
    # 8 softmax warps: 2 per SMSP, one issue per clock each instruction
    for rate, n in ((0.0, hot), (1.0, hot + N_COLD + 2), (0.25, hot + 0.25 * (N_COLD + 2))):
        st = perf.step_cycles(art, g, "masked", an, rebase_rate=rate)
        soft = next(x for x in st["roles"] if x["warps"] == 8)
        assert soft["pipes"]["issue"] == pytest.approx(2 * n), rate
    shape = {"B": 4, "H": 16, "S": 4096, "D": 128, "causal": True}
    p = perf.predict(art, "b200", shape, analysis=an)
    assert p["worst_case"]["predicted_tflops"] < p["predicted_tflops"]
    assert p["worst_case"]["cycles_per_masked_tile"] > p["cycles_per_masked_tile"]
    assert p["cold"]["instructions_per_tile"] == N_COLD + 2
    p_mid = perf.predict(art, "b200", shape, rebase_rate=0.5, analysis=an)
    assert p["worst_case"]["predicted_tflops"] < p_mid["predicted_tflops"] < p["predicted_tflops"]
    with pytest.raises(ValueError, match="rebase_rate"):
        perf.predict(art, "b200", shape, rebase_rate=2.0, analysis=an)


def test_labels_and_addresses_do_not_matter():
    base = perf.analyse(_art(_lines()))
    moved = perf.analyse(_art(_lines(label="917"), start=0x4000))
    for key in ("main", "masked", "main_cold", "masked_cold"):
        assert _softmax(moved)[key]["instructions"] == _softmax(base)[key]["instructions"]


def test_a_branch_not_from_the_rebase_test_is_not_cold():
    # the same shape under a compare against another constant, or a barrier's try-wait: no cold
    # region (the cheapest path still skips the branch: that is the model's old rule)
    for lines in (_lines(threshold=32.0), _lines(wait_pred=True)):
        r = _softmax(perf.analyse(_art(lines)))
        assert r["cold_blocks"] == [] and r["main_cold"]["instructions"] == 0
        # the costliest path takes the branch: counted in full on a masked tile
        assert r["masked"]["instructions"] == _hot_count(lines) + N_COLD + 2


def test_the_kernel_marker_makes_a_region_cold():
    """pmevent 7 (SASS PMTRIG 0x80) at the head of a branch marks it cold whatever its predicate."""
    lines = _lines(wait_pred=True, cold_marker=True)
    r = _softmax(perf.analyse(_art(lines)))
    assert [c["kind"] for c in r["cold_blocks"]] == ["rebase"]
    assert r["masked"]["instructions"] == _hot_count(lines)
    assert r["masked_cold"]["instructions"] == N_COLD + 3  # the marker runs with it


def test_predicated_cold_code_still_takes_issue_slots():
    lines = _lines(predicated_cold=10)
    r = _softmax(perf.analyse(_art(lines)))
    assert r["main"]["instructions"] == _hot_count(lines)  # the 10 @P3 FMULs included
    assert r["main"]["opcodes"]["FMUL"] == 10


def test_defs_and_uses():
    f = sass.parse_instr_lines(["FSETP.GT.AND P1, PT, R39.reuse, 64, PT ;", "FADD2 R2, R4.F32x2.HI_LO, -R6.F32 ;",
                                "STTM.x16 tmem[UR6], R40 ;", "@!P2 FSEL R12, R11, RZ, P3 ;"])
    d = [perf._defs_uses(i) for i in f.instrs]
    assert d[0] == ({"P1"}, {"R39"})
    assert d[1][0] == {"R2", "R3"} and {"R4", "R5", "R6"} <= d[1][1]
    assert d[2][0] == set() and "R40" in d[2][1]
    assert d[3] == ({"R12"}, {"R11", "P3", "P2"})
