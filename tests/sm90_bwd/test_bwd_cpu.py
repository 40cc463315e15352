"""The sm90a backward on the CPU: the backward plan, rendering, refusals, and
compiling every template variant for sm_90a without a GPU (checking the PTX for
the MMAs, exps and dQ reductions the plan asks for)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bwd_modules as bm  # noqa: E402

from fp4gen.ir.passes.backward import BackwardPlan, plan_backward  # noqa: E402
from fp4gen.ir.plan import KernelPlan, PlanError, SMEM_LIMIT_BYTES  # noqa: E402
from fp4gen.ir.spec import Backward, Format, OperandFormat, ScaleGranularity, Target  # noqa: E402
from fp4gen.lowering.sm90_bwd import render_backward  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")


# ------------------------------------------------------------------ plan

def test_plan_of_the_example_spec():
    from fp4gen.frontend import parse_file
    from fp4gen.ir.passes import plan_kernel

    spec = [s for s in parse_file(os.path.join(EXAMPLES, "sm90_bf16_d128.attn")) if s.backward][0]
    bp = plan_backward(plan_kernel(spec))
    assert isinstance(bp, BackwardPlan)
    assert (bp.tile_m, bp.tile_n, bp.mma_warpgroups, bp.head_dim, bp.causal) == (64, 128, 2, 128, True)
    assert bp.reuse == ("k", "lse", "q")
    assert bp.grad_format("dO") == "bf16" and bp.mma_format == "bf16"
    assert not bp.deterministic and bp.dq_reduction == "bulk_reduce_fp32"
    # K, V (128 x 128 bf16 each), 2 x Q, 2 x dO (64 x 128), 2 x dS (64 x 128),
    # the fp32 dQ staging tile (64 rows of 128 + 4 padding words), barriers
    assert bp.smem_bytes == 2 * 32768 + 2 * 16384 + 2 * 16384 + 2 * 16384 + 64 * 132 * 4 + 48
    assert bp.smem_bytes <= SMEM_LIMIT_BYTES
    assert bp.registers_total <= 65536
    assert [m.name for m in bp.mmas] == ["S", "dP", "dV", "dK", "dQ"]
    dataclasses.replace(bp)  # frozen dataclass, hashable
    hash(bp)


def test_deterministic_plan_uses_a_buffer():
    bp = plan_backward(bm.make_plan(64, True, True))
    assert bp.deterministic and bp.dq_reduction == "ordered_bulk_reduce_fp32" and bp.head_dim == 64


def _plan(**kw):
    return KernelPlan(spec=dataclasses.replace(bm.make_spec(), **kw))


@pytest.mark.parametrize("kw,match", [
    (dict(backward=None), "no backward block"),
    (dict(target=Target.SM100A), "sm90a"),
    (dict(head_dim=256), "head_dim 64 and 128"),
    (dict(backward=Backward(formats={"dO": OperandFormat(Format.FP8E5M2)})), "fp8e5m2 is not implemented"),
    # FP8 dO needs the forward's P and V in FP8 (one wgmma cannot mix FP8 and bf16)
    (dict(backward=Backward(formats={"dO": OperandFormat(Format.FP8E4M3)})), "needs the forward's V in fp8e4m3"),
    (dict(backward=Backward(formats={"dS": OperandFormat(Format.FP8E4M3)})), "FP8 dS needs `reuse q k`"),
    (dict(backward=Backward(formats={"dQ": OperandFormat(Format.FP16)})), "dQ : fp16 is not supported"),
    # reused FP8 Q/K must carry the forward's 128-token block scales (one per key tile)
    (dict(q=OperandFormat(Format.FP8E4M3), k=OperandFormat(Format.FP8E4M3)), r"must be fp8e4m3\(block=128\)"),
    (dict(q=OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 128),
          k=OperandFormat(Format.FP8E4M3, ScaleGranularity.BLOCK, 128),
          backward=Backward(reuse=frozenset({"q", "lse"}))), "reuse both q and k or neither"),
    (dict(q=OperandFormat(Format.NVFP4, ScaleGranularity.BLOCK, 16, Format.E4M3),
          k=OperandFormat(Format.NVFP4, ScaleGranularity.BLOCK, 16, Format.E4M3)), "can reuse fp8e4m3 or bf16 Q/K"),
])
def test_plan_refusals(kw, match):
    with pytest.raises(PlanError, match=match):
        plan_backward(_plan(**kw))


def test_plan_accepts_a_forward_that_quantizes_v():
    # the FP8 P/V training recipe: the backward reads the caller's bf16 V, not the forward's FP8 one
    spec = dataclasses.replace(bm.make_spec(128, True, False), p=OperandFormat(Format.FP8E4M3),
                               v=OperandFormat(Format.FP8E4M3))
    from fp4gen.ir.passes.backward import plan_backward
    from fp4gen.ir.passes import plan_kernel

    bp = plan_backward(plan_kernel(spec))
    assert bp.mma_format == "bf16" and "v" not in bp.reuse


def test_fp8_qk_without_reuse_is_planned_as_bf16():
    fp8 = OperandFormat(Format.FP8E4M3)
    bp = plan_backward(_plan(q=fp8, k=fp8, backward=Backward(reuse=frozenset({"lse"}))))
    assert bp.mma_format == "bf16"


# ------------------------------------------------------------------ rendering

@pytest.mark.parametrize("d,causal,det", bm.VARIANTS)
def test_render_contract(d, causal, det, tmp_path):
    """The section binds the kernel library's class to the plan's decisions (a config literal)
    and the runtime's host code: no kernel code, host code or compiler import of its own."""
    import ast

    from fp4gen.device.sm90.backward import MMA_NAMES, BackwardConfig

    plan = bm.make_plan(d, causal, det)
    sec = render_backward(plan)
    for banned in ("fp4gen.ir", "fp4gen.frontend", "jinja2", "lark", "fp4gen.lowering", "import torch",
                   "@cute.", "cute.compile", "inline_asm", "CUTE_DSL_ARCH"):
        assert banned not in sec, banned
    funcs = [n.name for n in ast.parse(sec).body if isinstance(n, ast.FunctionDef)]
    assert funcs == ["backward"]  # the loader's contract check looks for the def
    full = bm.render_module(plan)
    compile(full, plan.spec.name, "exec")
    mod = bm.load_module(plan, str(tmp_path))
    bp = plan.backward
    majors = {m.name: (m.a_major, m.b_major) for m in bp.mmas}
    assert mod.BWD_CONFIG == BackwardConfig(
        head_dim=d, causal=causal, tile_m=bp.tile_m, tile_n=bp.tile_n, mma_warpgroups=bp.mma_warpgroups,
        q_stages=bp.q_stages, ds_stages=bp.ds_stages, deterministic=det, s_fp8=False, do_fp8=False,
        ds_fp8=False, producer_registers=bp.producer_registers, consumer_registers=bp.consumer_registers,
        mma_majors=tuple(majors[n] for n in MMA_NAMES))
    # bf16 dQ = dS K reads dS^T and K through transposed views: MN-major, as the plan records
    assert mod.BWD_CONFIG.mn_major("dQ", 0) and mod.BWD_CONFIG.mn_major("dQ", 1)
    assert (mod.BWD_HEAD_DIM, mod.BWD_CAUSAL, mod.BWD_DETERMINISTIC) == (d, causal, det)
    assert callable(mod.compile_only_backward) and mod._bwd_launch == mod._BWD_HOST.launch


def test_render_refuses_a_spec_without_backward():
    from fp4gen.lowering import LoweringError

    plan = bm.make_plan(128, True, False)
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, backward=None))
    with pytest.raises((LoweringError, PlanError), match="backward"):
        render_backward(plan)


# ------------------------------------------------------------------ compile for sm_90a

def _compile(variants, tmp_path):
    """Compile in a child (CUTE_DSL_ARCH is read once per process); PTX facts per variant."""
    code = textwrap.dedent(f"""
        import glob, json, os, sys, time
        sys.path.insert(0, {HERE!r})
        import bwd_modules as bm
        out = {{}}
        dump = os.environ["CUTE_DSL_DUMP_DIR"]  # read once per process by the DSL
        for d, causal, det, *fp8 in {variants!r}:
            tag = f"d{{d}}_{{int(causal)}}_{{int(det)}}" + ("_fp8" if fp8 and fp8[0] else "")
            dd = os.path.join({str(tmp_path)!r}, tag); os.makedirs(dd)
            mod = bm.load_module(bm.make_plan(d, causal, det, fp8[0] if fp8 else False), dd)
            t = time.time()
            ptxs = []
            for gqa in (False, True):  # bf16 dK/dV; fp32 per-head dK/dV (GQA)
                mod._bwd_compile("sm_90a", False, gqa)
                # the newest dump (two variants may share one truncated file name)
                ptxs.append(open(max(glob.glob(os.path.join(dump, "*.ptx")), key=os.path.getmtime)).read())
            ptx, gqa_ptx = ptxs
            names = mod.compile_only_backward("sm_90a")  # cached: the two above (+ pre/post kernels)
            out[tag] = dict(names=names, s=time.time() - t, wgmma=ptx.count("wgmma.mma_async.sync"),
                            red=ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"), ex2=ptx.count("ex2.approx"),
                            acquire=ptx.count("ld.acquire.gpu"), release=ptx.count("red.release.gpu"),
                            tma=ptx.count("cp.async.bulk.tensor"),
                            wgmma_e4m3=ptx.count("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3")
                            + ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3")
                            + ptx.count("wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3"),
                            st16=ptx.count("st.global.b16"), gqa_st16=gqa_ptx.count("st.global.b16"),
                            st32=ptx.count("st.global.b32"), gqa_st64=gqa_ptx.count("st.global.v2.b32"),
                            stmatrix=ptx.count("stmatrix.sync.aligned"), lds_v2=ptx.count("ld.shared.v2.b32"),
                            sts_v4=ptx.count("st.shared.v4.b32"), ldg=ptx.count("ld.global"),
                            bulk_g2s=ptx.count("cp.async.bulk.shared::cta.global"),
                            bar_red=ptx.count("bar.red."), redux=ptx.count("redux.sync"),
                            stmatrix_trans=ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16"))
        print(json.dumps(out))
    """)
    dump = tmp_path / "dump"
    dump.mkdir()
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(dump))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _check_ptx(facts, d, det):
    # per warpgroup: S^T, dP^T (K = d), dV, dK (K = 64 queries), dQ (K = 128 keys), k16 each
    assert facts["wgmma"] == 2 * (d // 16) + 2 * (64 // 16) + 128 // 16, facts
    # one exp per score a thread holds: 64 keys x 64 queries / 128 threads
    assert facts["ex2"] == 32, facts
    # dQ: the SMEM tile is in fragment order (one contiguous run): one bulk reduce per lane (8 lanes)
    assert facts["red"] == 1, facts
    # ... written by the MMA warps with 16-byte stores: d/2 x 64 fp32 per warpgroup, 4 per store
    assert facts["sts_v4"] == d // 16, facts
    # dS^T -> SMEM with stmatrix: 64 x 64 bf16 per warpgroup, 4 registers per thread per x4 store
    assert facts["stmatrix"] == 4, facts
    # LSE2 and D come with each Q/dO stage (two bulk copies) and are read from SMEM in column pairs:
    # no global loads in the kernel at all (bf16 variants)
    assert facts["bulk_g2s"] == 2 and facts["lds_v2"] == 16 and facts["ldg"] == 0, facts
    # deterministic: wait for this key tile's turn (acquire), pass it on (release)
    assert (facts["acquire"] > 0 and facts["release"] == 1) if det else (facts["acquire"] == facts["release"] == 0), facts
    assert facts["tma"] >= 4, facts  # K, V, Q, dO
    # dK, dV: 64 x d per warpgroup -> d/2 values each per thread, stored as column pairs:
    # 4-byte bf16 pairs; 8-byte fp32 pairs for GQA
    assert facts["st16"] == 0 and facts["st32"] == d // 2, facts
    assert facts["gqa_st16"] == 0 and facts["gqa_st64"] == d // 2, facts


FAST = [(128, True, False), (64, True, True)]


def test_compile_sm90a(tmp_path):
    facts = _compile(FAST, tmp_path)
    for d, causal, det in FAST:
        f = facts[f"d{d}_{int(causal)}_{int(det)}"]
        assert f["names"][0].endswith(".backward")
        assert f["names"][1].endswith(".backward_gqa")
        _check_ptx(f, d, det)


def test_compile_sm90a_fp8(tmp_path):
    """FP8 S (reused Q/K), dP and dV: k32 e4m3 wgmmas for those three, bf16 for dK and dQ."""
    d = 128
    f = _compile([(d, True, False, True)], tmp_path)[f"d{d}_1_0_fp8"]
    assert f["names"][:2] == ["sm90_bwd_fp8_d128_causal.backward", "sm90_bwd_fp8_d128_causal.backward_gqa"]
    # S^T, dP^T: K = d in k32 steps; dV: K = 64 queries in k32 steps
    assert f["wgmma_e4m3"] == 2 * (d // 32) + 64 // 32, f
    # dK (K = 64 queries) and dQ (K = 128 keys) stay bf16 k16
    assert f["wgmma"] - f["wgmma_e4m3"] == 64 // 16 + 128 // 16, f
    assert f["ex2"] == 32 and f["red"] == 1 and f["stmatrix"] == 4 and f["bulk_g2s"] == 2, f
    assert f["tma"] >= 7, f  # K, V8, K8, Q, dO8, Q8, dO^T


def test_compile_sm90a_fp8_ds(tmp_path):
    """All-FP8 (dS : fp8e4m3): every wgmma k32 e4m3; dS reaches dQ through stmatrix.trans (two
    x4 stores per thread, written twice in the source: the tile as guessed and, on overflow,
    again); the dS barrier ORs the overflows and ANDs the small tiles (two bar.red); one warp
    redux for the exact max; K^T and Q^T loaded in place of bf16 K and Q."""
    d = 128
    f = _compile([(d, True, False, "ds")], tmp_path)[f"d{d}_1_0_fp8"]
    assert f["names"][:2] == ["sm90_bwd_fp8ds_d128_causal.backward", "sm90_bwd_fp8ds_d128_causal.backward_gqa"]
    # S^T, dP^T: K = d; dV, dK: K = 64 queries; dQ: K = 128 keys; all in k32 steps
    assert f["wgmma"] == f["wgmma_e4m3"] == 2 * (d // 32) + 2 * (64 // 32) + 128 // 32, f
    assert f["stmatrix"] == f["stmatrix_trans"] == 4, f
    assert f["bar_red"] == 2 and f["redux"] == 1, f
    assert f["ex2"] == 32 and f["red"] == 1 and f["bulk_g2s"] == 2, f
    assert f["tma"] == 7, f  # K^T, V8, K8, Q^T, dO8, Q8, dO^T


@pytest.mark.slow
def test_compile_sm90a_all_variants(tmp_path):
    rest = [v for v in bm.VARIANTS if v not in FAST]
    facts = _compile(rest, tmp_path)
    for d, causal, det in rest:
        _check_ptx(facts[f"d{d}_{int(causal)}_{int(det)}"], d, det)
