"""The static performance model: its arithmetic on hand-written SASS with known counts, a
planted fault (more MUFU makes MUFU the bottleneck), and one real sm90a kernel end to end.

Expected cycles are computed here from the table's rates (lanes per clock per SM) and the
counts written into the SASS, never read back from the model's output.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from fp4gen.lowering import perf, sass

ROOT = Path(__file__).resolve().parents[2]


def sm100_like(n_ex2: int, n_ffma: int = 6):
    """Softmax role (setmaxnreg 192) and MMA role (48); per softmax iteration: 1 try-wait,
    LDTM, n_ex2 MUFU.EX2, n_ffma FFMA, F2FP, STTM, IADD3, ISETP, BRA."""
    return "\n".join(["\t.type\t\tk,@function"] + [
        f"        /*{16 * i:04x}*/  {ln}" if not ln.endswith(":") else ln
        for i, ln in enumerate([
            "S2R R0, SR_TID.X ;",
            "ISETP.GT.AND P0, PT, R0, 0xff, PT ;",
            "@P0 BRA `(.L_x_1) ;",
            "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0 ;",
            ".L_x_2:",
            "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2 ;",
            "LDTM.x32 R4, tmem[UR5] ;",
            *["MUFU.EX2 R4, R4 ;"] * n_ex2,
            *["FFMA R5, R4, R6, R5 ;"] * n_ffma,
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
            "UTCQMMA gdesc[UR8], gdesc[UR10], tmem[UR12], tmem[UR14], idesc[UR15], UPT ;",
            "@P6 BRA `(.L_x_4) ;",
            "EXIT ;",
        ])])


def sm100_art(n_ex2, causal=False):
    info = perf.KernelInfo(name="toy", arch="sm_100a", causal=causal, tile_m=256, tile_n=128, head_dim=128,
                           warps_by_registers={192: 8, 48: 1}, groups=2, qk_format="fp4", pv_format="fp4")
    return perf.KernelArtifacts(info, ptx="", sass=sm100_like(n_ex2))


def per_warp_instr_cycles(gpu, pipe):
    """Cycles one warp instruction holds an SMSP's pipe: 32 lanes at lanes/4 per clock."""
    return 32 / (gpu.lanes[pipe] / gpu.smsp_per_sm)


def test_tensor_cycles_of_a_step():
    g = perf.GPUS["b200"]
    st = perf.step_cycles(sm100_art(4), g)
    # QK^T and PV of 256 rows x 128 keys x D 128, FP4 rate
    assert st["tensor_cycles"] == pytest.approx(2 * (2 * 256 * 128 * 128) / g.tensor_flops_per_clk["fp4"])
    assert st["bottleneck"] == "tensor"


def test_role_pipe_cycles_known_counts():
    g = perf.GPUS["b200"]
    n_ex2 = 10
    st = perf.step_cycles(sm100_art(n_ex2), g)
    soft = next(r for r in st["roles"] if r["warps"] == 8)
    # 8 softmax warps: 2 per SMSP
    assert soft["pipes"]["mufu"] == pytest.approx(2 * n_ex2 * per_warp_instr_cycles(g, "mufu"))
    assert soft["pipes"]["fma"] == pytest.approx(2 * 6 * per_warp_instr_cycles(g, "fma"))
    n_instr = 1 + 1 + n_ex2 + 6 + 1 + 1 + 2 + 1
    assert soft["instructions"] == n_instr
    assert soft["pipes"]["issue"] == pytest.approx(2 * n_instr)
    # one group alone: one warp per SMSP; the ping-pong bound adds half the tensor time
    assert st["bounds"]["overlap"] == pytest.approx(st["tensor_cycles"] / 2 + n_ex2 * per_warp_instr_cycles(g, "mufu"))


def test_planted_fault_doubled_mufu_becomes_the_bottleneck():
    g = perf.GPUS["b200"]
    tensor = 2 * (2 * 256 * 128 * 128) / g.tensor_flops_per_clk["fp4"]  # 512
    n = 20  # 2 warps x 20 x 8 = 320 MUFU cycles per SMSP: below the tensor time
    assert 2 * n * per_warp_instr_cycles(g, "mufu") < tensor < 2 * 2 * n * per_warp_instr_cycles(g, "mufu")
    ok = perf.step_cycles(sm100_art(n), g)
    bad = perf.step_cycles(sm100_art(2 * n), g)
    assert ok["bottleneck"] == "tensor" and ok["cycles"] == pytest.approx(tensor)
    assert bad["bottleneck"] == "smsp_mufu"
    assert bad["cycles"] == pytest.approx(2 * 2 * n * per_warp_instr_cycles(g, "mufu"))


def sm90_like(n_ex2=66, n_fma=100):
    """A Hopper consumer role (setmaxnreg 240) whose loop issues 16 HGMMA 64x128x16."""
    lines = ["USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;", ".L_x_1:", "WARPGROUP.ARRIVE ;",
             *["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24 ;"] * 16,
             *["MUFU.EX2 R4, R4 ;"] * n_ex2, *["FFMA R5, R4, R6, R5 ;"] * n_fma,
             "@P0 BRA `(.L_x_1) ;", "EXIT ;"]
    return "\n".join(["\t.type\t\tk,@function"] + [
        f"        /*{16 * i:04x}*/  {ln}" if not ln.endswith(":") else ln for i, ln in enumerate(lines)])


def test_hopper_step_is_tensor_plus_busiest_smsp():
    g = perf.GPUS["h200"]
    info = perf.KernelInfo(name="toy90", arch="sm_90a", causal=False, tile_m=128, tile_n=128, head_dim=128,
                           warps_by_registers={240: 8})
    art = perf.KernelArtifacts(info, "", sm90_like())
    st = perf.step_cycles(art, g)
    tensor = 2 * 16 * (2 * 64 * 128 * 16) / g.tensor_flops_per_clk["bf16"]  # two warpgroups
    assert st["tensor_cycles"] == pytest.approx(tensor)
    n_instr = 1 + 16 + 66 + 100 + 1
    busiest = max(2 * 66 * per_warp_instr_cycles(g, "mufu"), 2 * n_instr)
    assert st["cycles"] == pytest.approx(tensor + busiest)
    # the same counts with the max rule (Blackwell's) would hide the softmax entirely
    assert perf.step_cycles(art, g, serial=False)["cycles"] == pytest.approx(tensor)


def test_predict_shape_arithmetic():
    g = perf.GPUS["b200"]
    art = sm100_art(4)
    shape = {"B": 2, "H": 16, "S": 4096, "D": 128, "causal": False}
    p = perf.predict(art, "b200", shape)
    step = perf.step_cycles(art, g)["cycles"]
    ctas = 2 * 16 * math.ceil(4096 / 256)
    tiles = 4096 // 128
    cycles = math.ceil(ctas / g.sms) * (tiles * step + perf.CTA_FIXED_CYCLES["stg"])  # no UTMASTG in the toy
    secs = cycles / (g.clock_ghz * 1e9)
    assert p["ctas"] == ctas
    assert p["predicted_tflops"] == pytest.approx(4 * 2 * 16 * 4096 * 4096 * 128 / secs / 1e12, rel=1e-3)
    # causal: half the FLOPs, the diagonal tiles on the masked path, the rest unmasked
    pc = perf.predict(sm100_art(4, causal=True), "b200", dict(shape, causal=True))
    assert pc["kv_tiles_per_cta"] == [math.ceil(256 / 128), tiles]


def test_ratio_vs_fa4():
    a = {"predicted_tflops": 1500.0}
    f = {"predicted_tflops": 1000.0}
    assert perf.with_fa4_ratio(a, f)["ratio_vs_fa4_bf16"] == 1.5


def test_every_gpu_rate_has_a_source():
    for g in perf.GPUS.values():
        for key in ("sms", "clock", "tensor", "hbm"):
            assert g.sources.get(key), (g.name, key)
        assert set(g.tensor_flops_per_clk) >= {"bf16", "fp8", "fp4"}
        assert set(g.lanes) >= set(sass.PIPES)
    assert perf.GPUS["b200"].lanes["mufu"] == 16 and perf.GPUS["gb200"].lanes["mufu"] == 16  # issue 18


def _tools_present():
    try:
        from fp4gen.lowering import ptxas

        ptxas.find_ptxas()
        sass.find_nvdisasm()
        return True
    except Exception:
        return False


@pytest.fixture(scope="module")
def bf16_sm90():
    """One compile per session: perf's on-disk cache is keyed by the module's sha256."""
    if not _tools_present():
        pytest.skip("needs the pinned ptxas and nvdisasm (test extras)")
    return perf.fp4gen_artifacts(str(ROOT / "generated" / "sm90_bf16_d128_sm90a.py"))


@pytest.mark.slow
def test_real_sm90a_kernel_end_to_end(bf16_sm90):
    art = bf16_sm90
    info = art.info
    assert info.arch == "sm_90a" and info.tile_m == 128 and info.tile_n == 128 and info.head_dim == 128
    an = perf.analyse(art)
    cons = max(an["roles"], key=lambda r: r["warps"])
    assert cons["warps"] == 8  # two consumer warpgroups (the plan's roles)
    c = cons["main"]
    # QK^T (D/16 k-steps) and PV (N/16 k-steps) of m64n128k16 per warpgroup per tile
    assert c["opcodes"]["HGMMA"] == 128 // 16 + 128 // 16
    assert c["hgmma_flops"] == 2 * (2 * 64 * 128 * 128)
    # each consumer thread owns 64 x 128 / 128 = 64 scores of the tile: one ex2 each at least
    assert c["mufu_ex2"] >= 64
    p = perf.predict(art, "h200", {"B": 2, "H": 16, "S": 16384, "D": 128, "causal": False})
    assert p["bottleneck"].startswith("tensor")
    assert 0 < p["predicted_tflops"] < 989.4  # below the dense BF16 peak
    assert p["step"]["tensor_cycles"] == pytest.approx(2 * 2 * 128 * 128 * 128 / 4096)


@pytest.mark.slow
def test_fa4_sm90_forward_if_installed(bf16_sm90):
    path = os.environ.get(perf.FA4_PATH_ENV)
    if not path:
        pytest.skip(f"set ${perf.FA4_PATH_ENV} to a flash-attn-4 4.0.0b36 folder to model FA4")
    fa = perf.fa4_artifacts("sm_90a", False, path)
    cons = max(perf.analyse(fa)["roles"], key=lambda r: r["warps"])
    assert cons["main"]["hgmma_flops"] == 2 * (2 * 64 * 128 * 128)
    shape = {"B": 2, "H": 16, "S": 16384, "D": 128, "causal": False}
    r = perf.with_fa4_ratio(perf.predict(bf16_sm90, "h200", shape), perf.predict(fa, "h200", shape))
    assert 0.5 < r["ratio_vs_fa4_bf16"] < 1.5


def test_bench_join_prefers_kernel_only_rows():
    import importlib.util

    spec = importlib.util.spec_from_file_location("perf_model_h200", ROOT / "bench" / "perf_model_h200.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    pred = [{"kernel": "k", "S": 4096, "causal": False, "predicted_ratio": 1.2, "predicted_tflops": 1.0,
             "bottleneck": "tensor"}]
    meas = [{"kernel": "k", "S": 4096, "causal": False, "measured_ratio": 1.0},
            {"kernel": "k-kernel-only", "S": 4096, "causal": False, "measured_ratio": 1.25}]
    rows = {r["kernel"]: r for r in m.predicted_ratio(meas, pred)}
    assert rows["k-kernel-only"]["compared"] and not rows["k"]["compared"]
    assert rows["k-kernel-only"]["error"] == pytest.approx(1.2 / 1.25 - 1, abs=1e-3)
    # bench/attention.py's own rows are read as measurements too
    assert m.as_measured([{"kernel": "k", "pass": "fwd", "S": 4096, "D": 128, "causal": False,
                           "ratio_vs_fa4_bf16": 0.9}])[0]["measured_ratio"] == 0.9


def test_cta_fixed_cost_follows_the_epilogue():
    tma = "\n".join(["\t.type\t\tk,@function", "        /*0000*/  UTMASTG.4D [UR8], [UR4] ;",
                     "        /*0010*/  EXIT ;"])
    assert perf.cta_fixed_cycles(tma) == ("tma_store", perf.CTA_FIXED_CYCLES["tma_store"])
    assert perf.cta_fixed_cycles(sm100_like(4)) == ("stg", perf.CTA_FIXED_CYCLES["stg"])
    # the fixed cost reaches the prediction: a TMA-store copy of the same kernel is faster
    shape = {"B": 2, "H": 16, "S": 4096, "D": 128, "causal": False}
    a = sm100_art(4)
    b = perf.KernelArtifacts(a.info, "", a.sass.replace("EXIT ;", "UTMASTG.4D [UR8], [UR4] ;\n        /*ffff*/  EXIT ;", 1))
    if perf.CTA_FIXED_CYCLES["stg"] > perf.CTA_FIXED_CYCLES["tma_store"]:
        assert perf.predict(b, "b200", shape)["predicted_tflops"] > perf.predict(a, "b200", shape)["predicted_tflops"]
