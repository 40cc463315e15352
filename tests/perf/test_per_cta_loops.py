"""A loop the kernel marks with ``pmevent markers.PER_CTA_LOOP`` (the sm100a epilogue over query
stages) is not a KV-tile loop: the model must not charge it per tile. Hand-written SASS; the
expected counts are written here, never read back from the model."""
from __future__ import annotations

from fp4gen.device import markers
from fp4gen.lowering import perf

from test_cold_weighting import _art, _lines

N_EPI = 200  # instructions of one epilogue iteration (per query stage, per CTA)


def _with_epilogue(marked: bool) -> list:
    lines = _lines()
    at = lines.index(".L_x_1:")
    epilogue = [
        ".L_x_8:",
        "USETMAXREG.DEALLOC.CTAPOOL 0x50 ;",
        ".L_x_9:",
        *([f"PMTRIG {1 << markers.PER_CTA_LOOP:#x} ;"] if marked else []),
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR20], R2 ;",
        *["FMUL R40, R40, R12 ;"] * N_EPI,
        "IADD3 R3, R3, -0x1, RZ ;",
        "ISETP.NE.AND P2, PT, R3, RZ, PT ;",
        "@P2 BRA `(.L_x_9) ;",
        "EXIT ;",
    ]
    # the MMA warp's branch now leads to the epilogue role first
    head = ["S2R R1, SR_TID.X ;", "ISETP.GT.AND P0, PT, R1, 0x17f, PT ;", "@P0 BRA `(.L_x_8) ;"]
    return lines[:at + 1] + head + lines[at + 1:] + epilogue


def _epilogue_roles(an) -> list:
    return [r for r in an["roles"] if r["registers"] == 80]


def test_a_marked_per_cta_loop_is_no_tile_loop():
    an = perf.analyse(_art(_with_epilogue(marked=True)))
    assert _epilogue_roles(an) == []
    assert any(r["registers"] == 192 for r in an["roles"])  # the softmax loop is still found


def test_planted_fault_without_the_marker_the_loop_is_charged_per_tile():
    an = perf.analyse(_art(_with_epilogue(marked=False)))
    (epi,) = _epilogue_roles(an)
    assert epi["main"]["opcodes"]["FMUL"] == N_EPI


def test_pmtrig_events():
    assert markers.pmtrig_events("0x40 ;") == {markers.PER_CTA_LOOP}
    assert markers.pmtrig_events("0xc0") == {markers.PER_CTA_LOOP, markers.REBASE}
    assert markers.pmtrig_events("R3") == set()
