"""A static performance model: predicted speed of an attention forward from its compiled SASS.

What it does, per kernel:

1. compile the kernel on the CPU (fp4gen's generated modules; FA4's BF16 forwards through
   ``flash_attn.cute.interface`` with fake tensors), assemble the PTX with the pinned ptxas and
   disassemble it (``fp4gen/lowering/sass.py``);
2. split the SASS into warp roles (one per ``USETMAXREG``), find each role's KV-tile loops and
   count one iteration's instructions by pipe: the steady-state path, without the cold regions
   that moderate logits never enter (the guard's headroom rebase: ``cold_regions``, found from
   the branch structure and the rebase test, not from names), which are counted apart and
   charged ``rebase_rate`` times per tile (0 in the steady state, 1 in the worst case: both
   are reported);
3. price one CTA step (one KV tile of N keys against all the CTA's query rows) on a GPU from
   the table ``GPUS``:

   * tensor: the step's MMA FLOPs / the tensor core's dense rate for the operand format;
   * each role: per SM sub-partition (SMSP), max over pipes of instructions x cost, where a
     pipe's cost is 32 lanes / its lanes per clock per SMSP; the role's warps are spread evenly
     over the 4 SMSPs (warp w runs on SMSP w % 4);
   * issue: every role's instructions on an SMSP share its one dispatch per clock;
   * overlap: consumer/softmax warpgroups alternate on the tensor core (FA3/FA4 "ping-pong";
     fp4gen's sm90a and sm100a forwards do the same), so a step takes at least
     ``T_mma / groups + T_softmax(one group)``: while one group computes its softmax the
     other's MMAs run, and a group's own MMA cannot overlap its own softmax;
   * step = max(tensor, overlap bound, issue, every role's pipes);

4. a shape (B, H, S, D, causal): steps per CTA (causal: the diagonal tiles run the masked loop,
   the rest the unmasked loop), CTAs over SMs in waves (non-persistent) or spread evenly
   (persistent), a fixed per-CTA cost by how O is stored (TMA store or STG: calibrated on an
   earlier H200 run, ``CTA_FIXED_CYCLES``) and the HBM bound (Q, K, V, O once); predicted
   TFLOP/s = FLOPs / time.

``predict(kernel_artifacts, gpu, shape) -> dict`` (with ``worst_case``). ``main(argv)``:
``fp4gen perf SPEC...``.

What it is not: a cycle simulator. It has no latency model, no bank conflicts, no L2, and one
clock per GPU. Its estimates are labelled in ``GPUS``; two rules are calibrated on earlier H200
runs (``Gpu.serial_mma`` for Hopper, ``CTA_FIXED_CYCLES``); the same-run H200 check
(bench/perf_model_h200.py) says how far that carries.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fp4gen.device import markers as _markers

from . import sass as _sass

# ============================================================================ GPUs
#
# Per-SM rates. Sources:
#   [PG]   CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table (results per
#          clock per SM) for compute capability 9.0 and 10.0: FP32 add/mul/fma 128, special
#          functions (MUFU: exp2, rcp, lg2, rsqrt) 16, 32-bit integer add/logic/shift 64,
#          integer multiply-add (IMAD) 64, compare/min/max 64, conversions 16, warp shuffle 32.
#   [HWP]  NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs (SXM5), 4 SMSPs per SM
#          each dispatching one warp instruction per clock, dense FP16/BF16 989.4 TFLOP/s and
#          FP8 1978.9 TFLOP/s at the boost clock (=> 4096 and 8192 FLOP/clk/SM at 1.83 GHz),
#          shared memory 128 B/clk/SM.
#   [H200] NVIDIA H200 datasheet: the same GH100 compute (BF16 989 / FP8 1979 TFLOP/s dense),
#          HBM3e 4.8 TB/s.
#   [BWP]  NVIDIA Blackwell architecture technical brief / B200 and GB200 NVL72 datasheets:
#          B200 dense BF16 2.25 PFLOP/s, FP8 4.5, FP4 9 (HGX B200, 1000 W); GB200 2.5 / 5 / 10
#          per GPU; HBM3e 8 TB/s. 148 SMs (both).
#   [I18]  issue 18: MUFU ex2 16/clk/SM on B200 and GB200; FA4 BF16 forward ~1,613 TFLOP/s on B200.
# Estimates (labelled "estimate"): the sustained clock under a tensor-core load, the per-CTA
# fixed cost, FFMA2's rate (one packed instruction = 2 FP32 lanes of work on the FMA pipe:
# the same 128 results/clk/SM, half the issue slots).


@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    clock_ghz: float  # the clock the tensor-core peaks are quoted at
    smsp_per_sm: int
    issue_per_smsp: float  # warp instructions dispatched per clock per SMSP
    lanes: dict  # pipe -> thread results per clock per SM
    tensor_flops_per_clk: dict  # format -> dense FLOP per clock per SM
    hbm_gbs: float
    sources: dict = field(default_factory=dict)
    serial_mma: bool = False  # step = tensor + busiest SMSP (True) or the max of the bounds


_LANES_COMMON = {
    "fma": 128,  # [PG] FP32 add/mul/fma, min/max, FSEL/FSETP on the FMA pipe
    "mufu": 16,  # [PG] special functions; [I18] for B200/GB200
    "alu": 64,  # [PG] 32-bit integer add/logic/shift/compare, IMAD on cc 9.0/10.0
    "conv": 16,  # [PG] type conversions (F2F, F2I, I2F); F2FP packs take the same pipe (estimate)
    "lds_sts": 32,  # [HWP] 128 B/clk/SM: one 4-byte word per lane per clock (estimate for wider ld)
    "ldg_stg": 32,  # LSU issue, same unit as LDS (estimate)
    "tmem": 32,  # tcgen05.ld/st: one warp-wide 32-lane access per clock per SMSP (estimate)
    "sync": 32,
    "uniform": 128,  # one uniform-datapath op per warp: costs the issue slot only
    "control": 128,
    "tensor": 128,  # the MMA issue itself: the tensor time is counted from FLOPs
    "other": 32,
}

GPUS = {
    "h200": Gpu("h200", 132, 1.83, 4, 1.0, dict(_LANES_COMMON),
                {"bf16": 4096, "fp8": 8192, "fp4": 8192},  # [HWP]/[H200]; no FP4 on Hopper (runs as FP8)
                4800.0,
                {"sms": "[HWP] 132 SMs (H200 = GH100 SXM)", "clock": "1.83 GHz: 989.4 TFLOP/s / (132 x 4096)",
                 "tensor": "[HWP]/[H200] 989 BF16, 1979 FP8 TFLOP/s dense", "hbm": "[H200] 4.8 TB/s"},
                serial_mma=True),
    "b200": Gpu("b200", 148, 1.855, 4, 1.0, dict(_LANES_COMMON),
                # 2.25e15 / (148 x 1.855e9) = 8192 FLOP/clk/SM BF16 (clock: derived so that the
                # datasheet's dense BF16 is 8192/clk/SM, twice Hopper's per SM, estimate)
                {"bf16": 8192, "fp8": 16384, "fp4": 32768},
                8000.0,
                {"sms": "[BWP] 148 SMs", "clock": "estimate: 2.25 PFLOP/s / (148 x 8192) = 1.855 GHz",
                 "tensor": "[BWP] dense 2.25 / 4.5 / 9 PFLOP/s BF16 / FP8 / FP4", "mufu": "[I18] 16/clk/SM",
                 "hbm": "[BWP] 8 TB/s"}),
    "gb200": Gpu("gb200", 148, 2.06, 4, 1.0, dict(_LANES_COMMON),
                 {"bf16": 8192, "fp8": 16384, "fp4": 32768},
                 8000.0,
                 {"sms": "[BWP] 148 SMs", "clock": "estimate: 2.5 PFLOP/s / (148 x 8192) = 2.06 GHz",
                  "tensor": "[BWP] dense 2.5 / 5 / 10 PFLOP/s per GPU (GB200 NVL72)", "mufu": "[I18] 16/clk/SM",
                  "hbm": "[BWP] 8 TB/s"}),
}

# Gpu.serial_mma. Hopper: the step is the tensor time plus the busiest SMSP's instruction time, not their max.
# Estimate, from the earlier H200 rounds (bench/results/attention-sm90-fwd-d128-*-h200.json):
# FA4's BF16 forward runs a 128 x 128 step in ~3,000 cycles at 1.83 GHz where its wgmma needs
# 2,048 and its consumers issue ~920 instructions per SMSP; the max of the two would say
# 2,048. The likely cause: wgmma's A fragment (P, RS form) and its accumulators live in the
# consumers' register file, so tensor work and the softmax contend for it. Blackwell's
# tcgen05 MMAs read SMEM/TMEM and are issued by one MMA warp: there the max (with the
# ping-pong bound) is used; ``predict(..., serial=True)`` gives the Hopper rule there too, as a
# pessimistic bound (FA4's published ~1,613 TFLOP/s on B200 [I18] lies between the two).

# Per-CTA fixed cost in cycles, by how the kernel stores O. Calibrated, not derived: the
# fused-quant H200 run (bench/results/attention-sm90-fwd-d128-fusedquant-h200.json, S = 1k, 4k,
# 8k, 16k, B*S = 32k, non-causal) fits time per CTA wave = tiles x t + c with residuals under
# 1 us for every kernel: FA4 (O staged in SMEM, TMA store: UTMASTG) c = -0.1 us; fp4gen's
# sm90a forwards (O stored from registers with STG) c = 4.4 us (FP8 exp), 4.6 (Direct-P), 7.8
# (BF16, whose peeled first tile and masked last tile are larger: the model prices those
# separately). Their per-tile t agree with the model within 7% (FA4 3,084 cycles at 1.83 GHz
# against 3,104 predicted; BF16 3,074 / 3,104; FP8 exp 2,228 / 2,080; Direct-P 1,893 / 1,906).
# Why an STG epilogue costs ~8,000 cycles a CTA is not known (the CTA's 32 KB of O leaves as
# 4-byte stores from 256 threads while the whole wave ends and starts together); the term is
# what the run shows. Blackwell uses the same two values (an estimate: nothing has run there).
CTA_FIXED_CYCLES = {"tma_store": 0, "stg": 8000}


def cta_fixed_cycles(sass_text: str) -> tuple:
    """("tma_store" | "stg", cycles): a kernel with a TMA store (UTMASTG) writes O through it."""
    kind = "tma_store" if "UTMASTG" in sass_text else "stg"
    return kind, CTA_FIXED_CYCLES[kind]

# ============================================================================ compile + cache


def cache_dir() -> Path:
    d = Path(os.environ.get("FP4GEN_PERF_CACHE") or Path(tempfile.gettempdir()) / "fp4gen-perf-cache")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


_SM90_RUNNER = textwrap.dedent("""
    import importlib.util, sys
    from fp4gen.runtime.loader import exec_file
    m = exec_file("fp4gen_generated_under_test", sys.argv[1])
    c = m._compile("sm_90a", tvm_ffi=False)
    open(sys.argv[2], "w").write(c.artifacts.PTX)
""")

# FA4's own compile path on a CPU-only host: fake tensors through
# flash_attn.cute.interface._flash_attn_fwd with FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH set. Two
# things need no driver to be stubbed: quack's autotuner imports triton at module load (the
# forward never autotunes), and the sm100 persistent scheduler asks the device for its SM count.
# FA4 imported with stubs and a fixed SM count, cute.compile captured: the runners of its
# forward (here) and backward (perf_backward) add only their calls
_FA4_RUNNER_SETUP = textwrap.dedent("""
    import os, sys, types
    sys.path.insert(0, sys.argv[1])
    stub = types.ModuleType("quack.autotuner")
    class AutotuneConfig:
        def __init__(self, *a, **k): pass
    class Autotuner:
        def __init__(self, *a, **k): pass
    stub.AutotuneConfig, stub.Autotuner = AutotuneConfig, Autotuner
    stub.autotune = lambda *a, **k: (lambda fn: fn)
    sys.modules["quack.autotuner"] = stub
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    import cutlass.utils
    import cutlass.cute as cute
    from flash_attn.cute import interface as I
    import flash_attn.cute.tile_scheduler as ts
    class HW:
        def __init__(self, *a, **k): pass
        def get_device_multiprocessor_count(self): return int(os.environ["FLASH_ATTENTION_NUM_SMS"])
    cutlass.utils.HardwareInfo = HW
    ts.HardwareInfo = HW
    import warnings
    warnings.filterwarnings("ignore")
    compiled = []
    orig = cute.compile
    def capture(*a, **k):
        r = orig(*a, **k)
        compiled.append(r)
        return r
    cute.compile = capture
    causal = sys.argv[2] == "1"
    B, S, H, D = 2, 4096, 16, 128
""")
_FA4_RUNNER = _FA4_RUNNER_SETUP + textwrap.dedent("""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        I._flash_attn_fwd(q, k, v, causal=causal)
    open(sys.argv[3], "w").write(compiled[-1].artifacts.PTX)
""")

# a folder holding flash_attn (flash-attn-4 4.0.0b36), quack (quack-kernels 0.6.5), tvm_ffi and
# einops, installed there with `pip install --target DIR --no-deps ...` (not into the venv);
# without it, a flash_attn importable in this environment
FA4_PATH_ENV = "FP4GEN_FA4_PATH"


def _run(args, env, cwd, timeout):
    r = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"compile failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def fp4gen_ptx(path: str, timeout: int = 1800) -> str:
    """The PTX of a generated fp4gen module (its forward), cached by the sha256 of its source and
    the fingerprint of the kernel library it builds (``runtime.cache.kernel_deps_version``): a
    module renders only a config, so a kernel change leaves the module's text as it was."""
    from fp4gen.runtime.cache import kernel_deps_version

    source = Path(path).read_text()
    target = "sm_100a" if "sm100a" in Path(path).name or 'TARGET = "sm100a"' in source else "sm_90a"
    key = cache_dir() / f"fp4gen-{_sha(source + kernel_deps_version())[:24]}-{target}.ptx"
    if key.is_file():
        return key.read_text()
    if target == "sm_100a":
        from .conformance import compile_artifacts

        ptx = compile_artifacts(source, timeout=timeout).ptx
    else:
        with tempfile.TemporaryDirectory(prefix="fp4gen_perf_") as d:
            mod = Path(d) / "module.py"
            mod.write_text(source)
            env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=d)
            _run([sys.executable, "-c", _SM90_RUNNER, str(mod), str(Path(d) / "k.ptx")], env, d, timeout)
            ptx = (Path(d) / "k.ptx").read_text()
    tmp = key.with_suffix(".tmp")
    tmp.write_text(ptx)
    tmp.replace(key)
    return ptx


def _installed_fa4() -> str:
    """The folder holding an importable flash_attn (flash-attn-4 in this environment), or ""."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return ""
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


def fa4_ptx(arch: str, causal: bool, fa4_path: Optional[str] = None, timeout: int = 1800) -> str:
    """The PTX of FA4's BF16 forward (D128) for ``arch`` ("sm_90a" | "sm_100a"), cached."""
    fa4_path = fa4_path or os.environ.get(FA4_PATH_ENV) or _installed_fa4()
    if not (Path(fa4_path) / "flash_attn" / "cute" / "interface.py").is_file():
        raise FileNotFoundError(f"no flash-attn-4 {'under ' + fa4_path if fa4_path else 'importable'}: "
                                f"`pip install --target DIR --no-deps "
                                f"flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi einops`, "
                                f"then set ${FA4_PATH_ENV}=DIR")
    ver = next(Path(fa4_path).glob("flash_attn_4-*.dist-info"), None)
    key = cache_dir() / f"fa4-{_sha(str(ver) + _FA4_RUNNER)[:16]}-{arch}-{'causal' if causal else 'full'}.ptx"
    if key.is_file():
        return key.read_text()
    with tempfile.TemporaryDirectory(prefix="fp4gen_perf_fa4_") as d:
        env = dict(os.environ, FLASH_ATTENTION_ARCH=arch, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx",
                   CUTE_DSL_DUMP_DIR=d, FLASH_ATTENTION_NUM_SMS="132" if arch == "sm_90a" else "148")
        _run([sys.executable, "-c", _FA4_RUNNER, fa4_path, "1" if causal else "0", str(Path(d) / "k.ptx")],
             env, d, timeout)
        ptx = (Path(d) / "k.ptx").read_text()
    tmp = key.with_suffix(".tmp")
    tmp.write_text(ptx)
    tmp.replace(key)
    return ptx


def sass_cached(ptx: str) -> str:
    key = cache_dir() / f"sass-{_sha(ptx)[:24]}.sass"
    if key.is_file():
        return key.read_text()
    text = _sass.sass_of_ptx(ptx)
    tmp = key.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(key)
    return text


# ============================================================================ kernels


@dataclass
class KernelInfo:
    """What the model needs beyond the SASS: tile shape, roles' warps, formats, scheduling."""

    name: str
    arch: str  # "sm_90a" | "sm_100a"
    causal: bool
    tile_m: int  # query rows per CTA per step (all Q stages / consumer warpgroups together)
    tile_n: int  # keys per KV tile
    head_dim: int
    warps_by_registers: dict  # setmaxnreg count -> warps of the CTA that set it
    groups: int = 2  # consumer/softmax warpgroups that alternate on the tensor core
    persistent: bool = False
    # masked tiles per CTA: max(diagonal tiles, 1) (the sequence end or the diagonal) + masked_extra
    masked_extra: int = 0
    qk_format: Optional[str] = None  # sm100a: from the PTX's tcgen05.mma kinds
    pv_format: Optional[str] = None
    source: str = ""


# the kernel config a generated module renders (sm100a FWD_CONFIG = ForwardKernelConfig(...),
# sm90a CONFIG = ForwardConfig(...)): its literal keywords are the module's constants
_CONFIG_NAMES = ("FWD_CONFIG", "CONFIG")


def _module_constants(source: str) -> dict:
    """Literal top-level assignments of a generated module, and the literal keywords of its
    rendered kernel config upper-cased (tile_m -> TILE_M): since the kernels moved into
    fp4gen/device, a module's tile, stages and mask live only in that config."""
    import ast

    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in _CONFIG_NAMES and isinstance(node.value, ast.Call):
                for kw in node.value.keywords:
                    try:
                        out.setdefault(kw.arg.upper(), ast.literal_eval(kw.value))
                    except Exception:
                        pass
                continue
            try:
                out[name] = ast.literal_eval(node.value)
            except Exception:
                pass
    return out


def _warps_from_plan(plan: dict, arch: str) -> dict:
    """setmaxnreg count -> active warps. A Hopper producer warpgroup issues TMA from one warp."""
    out = {}
    roles = plan.get("pipeline", plan).get("roles") or _find_key(plan, "roles") or []
    for r in roles:
        w = int(r.get("warps", 1))
        if arch == "sm_90a" and "idle" in str(r.get("does", "")):
            w = 1
        out[int(r["registers"])] = out.get(int(r["registers"]), 0) + w
    return out


def _find_key(obj, key):
    if isinstance(obj, dict):
        if key in obj and isinstance(obj[key], list) and obj[key] and isinstance(obj[key][0], dict) \
                and "registers" in obj[key][0]:
            return obj[key]
        for v in obj.values():
            r = _find_key(v, key)
            if r:
                return r
    elif isinstance(obj, list):
        for v in obj:
            r = _find_key(v, key)
            if r:
                return r
    return None


def fp4gen_info(path: str) -> KernelInfo:
    source = Path(path).read_text()
    c = _module_constants(source)
    arch = "sm_100a" if c.get("TARGET") == "sm100a" else "sm_90a"
    plan = json.loads(c["PLAN_JSON"]) if isinstance(c.get("PLAN_JSON"), str) else {}
    warps = _warps_from_plan(plan, arch)
    tile_m = int(c.get("TILE_M", 128)) * (int(c.get("Q_STAGES", 1)) if arch == "sm_100a" else 1)
    causal = bool(c.get("CAUSAL", False))
    return KernelInfo(name=f"fp4gen-{c.get('KERNEL_NAME', Path(path).stem)}", arch=arch, causal=causal,
                      tile_m=tile_m, tile_n=int(c.get("TILE_N", 128)), head_dim=int(c.get("HEAD_DIM", 128)),
                      warps_by_registers=warps, groups=2, persistent=False,
                      # sm90a: the first key tile is peeled with the mask applied, and the last tile
                      # (sequence end / diagonal) runs the masked step (generated/sm90_*: n_mask_start)
                      masked_extra=1 if arch == "sm_90a" else 0, source=path)


def fa4_info(arch: str, causal: bool) -> KernelInfo:
    """FA4 4.0.0b36's BF16 D128 forward configuration (flash_attn/cute/interface.py,
    flash_fwd_sm90.py, flash_fwd_sm100.py): sm90 tile 128 x 128 (``_tile_size_fwd_sm90``),
    one producer warpgroup (one warp issues TMA, setmaxnreg 24) and two consumer warpgroups
    (240); sm100 m_block 128 x q_stage 2, n_block 128, softmax warps 0-7, correction 8-11, MMA 12,
    epilogue 13, load 14, empty 15; the static persistent scheduler when not causal."""
    if arch == "sm_90a":
        return KernelInfo(name="fa4-cute-bf16", arch=arch, causal=causal, tile_m=128, tile_n=128, head_dim=128,
                          warps_by_registers={24: 1, 240: 8}, groups=2, persistent=False, source="flash-attn-4")
    # interface.py: is_static_persistent for non-causal (causal: one work tile per CTA, longest first)
    return KernelInfo(name="fa4-cute-bf16", arch=arch, causal=causal, tile_m=256, tile_n=128, head_dim=128,
                      warps_by_registers={}, groups=2, persistent=not causal, source="flash-attn-4")


@dataclass
class KernelArtifacts:
    info: KernelInfo
    ptx: str
    sass: str


def fp4gen_artifacts(path: str) -> KernelArtifacts:
    ptx = fp4gen_ptx(path)
    return KernelArtifacts(fp4gen_info(path), ptx, sass_cached(ptx))


def fa4_artifacts(arch: str, causal: bool, fa4_path: Optional[str] = None) -> KernelArtifacts:
    ptx = fa4_ptx(arch, causal, fa4_path)
    return KernelArtifacts(fa4_info(arch, causal), ptx, sass_cached(ptx))


# ============================================================================ the model

# cycles of one SMSP pipe per warp instruction: 32 lanes / (lanes per clock per SM / 4 SMSPs)


def pipe_cost(gpu: Gpu, pipe: str) -> float:
    return 32.0 / (gpu.lanes[pipe] / gpu.smsp_per_sm)


_PACKED = ("FFMA2", "FMUL2", "FADD2", "FMNMX2", "HFMA2", "HADD2", "HMUL2")


def _pipe_cycles(gpu: Gpu, counts: dict) -> dict:
    """Cycles on one SMSP for one warp's counted instructions, per pipe, plus "issue".
    A packed f32x2 instruction (FFMA2...) does two lanes' work on the FMA pipe."""
    out = {p: n * pipe_cost(gpu, p) for p, n in counts["pipes"].items() if n}
    packed = sum(counts["opcodes"].get(op, 0) for op in _PACKED[:4])
    if packed:
        out["fma"] = out.get("fma", 0.0) + packed * pipe_cost(gpu, "fma")
    out["issue"] = counts["instructions"] / gpu.issue_per_smsp
    return out


_KIND_FORMAT = (("kind::f16", "bf16"), ("kind::tf32", "bf16"), ("kind::mxf4nvf4", "fp4"), ("kind::mxf4", "fp4"),
                ("kind::mxf8f6f4", "fp8"), ("kind::f8f6f4", "fp8"), ("kind::i8", "fp8"))


def _mma_formats(ptx: str) -> tuple:
    """(QK^T format, PV format) from the PTX's tcgen05.mma kinds (PTX ISA 9.7.16.10.9
    "tcgen05.mma"): kind::f16 runs at the BF16 rate, kind::f8f6f4 and kind::mxf8f6f4 at the
    8-bit rate whatever their operands (E2M1 included), kind::mxf4(nvf4) at the FP4 rate. QK^T
    reads A (Q) from SMEM, PV reads A (P) from TMEM."""
    from .descriptors import mma_instructions

    qk = pv = None
    for m in mma_instructions(ptx):
        fmt = next((f for k, f in _KIND_FORMAT if m.kind.startswith(k)), "bf16")
        if m.a_source == "tmem":
            pv = pv or fmt
        else:
            qk = qk or fmt
    return qk or "bf16", pv or qk or "bf16"


def _hgmma_format(instrs: list) -> str:
    for i in instrs:
        if i.base in ("HGMMA", "QGMMA"):
            return "fp8" if any(m.startswith(("E4M3", "E5M2")) for m in i.mods) else "bf16"
    return "bf16"


def _role_warps(info: KernelInfo, role: "_sass.Role", n_same: int, has_mma: bool) -> float:
    if info.arch == "sm_100a" and not info.warps_by_registers:  # FA4 sm100: by function
        if role.kind == "alloc":
            return 8.0  # softmax warps 0-7
        return 4.0 if role.registers and role.registers >= 72 else 1.0  # correction 8-11; MMA/load/epilogue
    w = info.warps_by_registers.get(role.registers)
    if w is None:
        return 1.0
    return w / max(n_same, 1)


# ============================================================================ cold code
#
# Static counts charge every instruction of a tile's path once per tile. Some code sits in the
# loop but runs only on rare tiles: the guard's headroom rebase (numerics.directp.rebase: a
# tile more than REBASE_E binades above the row reference) rescales O in TMEM behind a
# warp-uniform branch that moderate logits never take. Such a *cold region* is found by
# structure, never by labels or names:
#
# * a conditional branch inside the tile loop whose one successor is entered only from it
#   (an if-then: the other successor is the merge point); the region is the blocks of the loop
#   that this successor dominates; and
# * the branch's predicate comes from the rebase test: its backward slice (register and
#   predicate def-use, within the loop body, in address order) reaches an FSETP against the
#   float immediate REBASE_E; or the region holds the kernel library's marker ``pmevent N``
#   (SASS ``PMTRIG 1 << N``, COLD_EVENTS: a marker a kernel may emit at the head of a cold
#   branch; the sm100a forward emits it where the rebase rescales O).
#
# Each cold region is charged ``rebase_rate`` times per tile: 0 in the steady state (moderate
# logits never rebase: the assumption the model states), 1 in the worst case (every tile
# rebases). Instructions predicated off under the rebase predicate (if-converted code) are
# counted in full: a predicated-off instruction still takes its issue slot. Masked code is
# weighed by its own frequency already: the diagonal and sequence-end tiles run the masked path
# (``predict``: masked tiles per CTA), the others the unmasked one.

COLD_EVENTS = {_markers.REBASE: "rebase"}  # pmevent N -> kind of cold region
REBASE_RATE_STEADY = 0.0  # rebases per tile with moderate logits: none (docs/sm100.md)

_REG_TOKEN = re.compile(r"(?<![\w.])!?(U?R\d+|U?P\d)\b")
_PAIR_SRC = re.compile(r"(?<![\w.])(U?R)(\d+)\.F32x2")
_SETP = ("FSETP", "ISETP", "DSETP", "HSETP2", "PSETP", "PLOP3", "FCHK")


def _rebase_e() -> float:
    from fp4gen.numerics.directp import REBASE_E

    return float(REBASE_E)


def _defs_uses(ins: "_sass.Instr") -> tuple:
    """(registers and predicates written, those read) of one SASS instruction, by position:
    the first operand is the destination when it is a register (two leading predicates for
    compares and PLOP3); a store's first operand is an address, so it writes none. Packed
    f32x2 operands name the low register of a pair."""
    ops = [o.strip() for o in ins.operands.split(",")]
    n_def = 2 if ins.base in _SETP else 1
    defs, uses = set(), set()
    for k, op in enumerate(ops):
        regs = [m[1] for m in _REG_TOKEN.finditer(op)]
        pair = [f"{m[1]}{int(m[2]) + 1}" for m in _PAIR_SRC.finditer(op)]
        if k < n_def and len(regs) == 1 and re.fullmatch(r"!?(U?R\d+|U?P\d)(\.\w+)*", op):
            defs.add(regs[0])
            if ins.base in _PACKED[:4] and "R" in regs[0]:  # f32x2: FADD2 R2 writes R2 and R3
                head = regs[0].rstrip("0123456789")
                defs.add(f"{head}{int(regs[0][len(head):]) + 1}")
        else:
            uses.update(regs + pair)
    if ins.pred and ins.pred.lstrip("!") not in ("PT", "UPT"):
        uses.add(ins.pred.lstrip("!"))
    return defs, uses


def _is_rebase_test(ins: "_sass.Instr", rebase_e: float) -> bool:
    if ins.base != "FSETP":
        return False
    for op in ins.operands.split(","):
        try:
            if float(op.strip()) == rebase_e:
                return True
        except ValueError:
            pass
    return False


def _slice_reaches(seq: list, pred: str, test) -> bool:
    """Does the backward slice of ``pred`` over ``seq`` (the instructions before its use, in
    order) hold an instruction ``test`` accepts? A predicated def may not happen, so it
    does not end the search for an earlier one."""
    want = {pred}
    for ins in reversed(seq):
        if _sass._never(ins.pred):
            continue
        defs, uses = _defs_uses(ins)
        if want & defs:
            if test(ins):
                return True
            if _sass._always(ins.pred):
                want -= defs
            want |= uses
    return False


def _marker_kind(instrs: list) -> Optional[str]:
    for i in instrs:
        if i.base == "PMTRIG":
            events = _markers.pmtrig_events(i.operands)
            for bit, kind in COLD_EVENTS.items():
                if bit in events:
                    return kind
    return None


def cold_regions(f: "_sass.Function", loop: "_sass.Loop", spin: frozenset, dom: dict) -> dict:
    """block index -> cold kind ("rebase") for the tile loop's cold regions (see above)."""
    body = loop.blocks - spin
    order = sorted(body)
    rebase_e = _rebase_e()
    out = {}
    for bb in order:
        last = f.blocks[bb].instrs[-1]
        succ = [x for x in f.blocks[bb].succs if x in body and x != loop.header]
        if last.base != "BRA" or len(succ) != 2:
            continue
        only = [x for x in succ if f.blocks[x].preds == [bb]]
        if len(only) != 1:  # not an if-then (an if-else, or a merge on both sides)
            continue
        then = only[0]
        region = {n for n in body if then in dom.get(n, ()) and n != loop.header}
        if not region or any(t in region for t in loop.tails):
            continue
        kind = _marker_kind([i for n in region for i in f.blocks[n].instrs])
        pred = last.pred.lstrip("!")
        if kind is None and pred and pred not in ("PT", "UPT"):
            seq = [i for n in order if n <= bb for i in f.blocks[n].instrs][:-1]
            if _slice_reaches(seq, pred, lambda i: _is_rebase_test(i, rebase_e)):
                kind = "rebase"
        if kind:
            for n in region:
                out.setdefault(n, kind)
    # a marker in a block no if-then region covered: that block and those it dominates
    for n in order:
        kind = _marker_kind(f.blocks[n].instrs)
        if kind and n not in out and n != loop.header:
            for x in body:
                if n in dom.get(x, ()) and x != loop.header:
                    out.setdefault(x, kind)
    return out


def weighted_path(f: "_sass.Function", loop: "_sass.Loop", spin: frozenset, dom: dict, longest: bool,
                  cold: frozenset = frozenset()) -> list:
    """Blocks of one iteration along the cheapest (or costliest) path from the header to a back
    edge, each block costing its instructions, a cold block nothing (so the steady-state path
    is found as if cold regions were empty; their instructions are charged separately)."""
    body = loop.blocks - spin
    best, order, seen = {}, [], set()

    def visit(n):  # post-order over forward edges (an edge to a dominator is a back edge)
        if n in seen:
            return
        seen.add(n)
        for x in f.blocks[n].succs:
            if x in body and x not in dom.get(n, ()):
                visit(x)
        order.append(n)

    visit(loop.header)
    pick = max if longest else min
    for n in order:
        opts = [best[x] for x in f.blocks[n].succs if x in body and x not in dom.get(n, ()) and x in best]
        if any(x == loop.header for x in f.blocks[n].succs) or n in loop.tails:
            opts.append((0, ()))
        if not opts:
            best[n] = (-math.inf if longest else math.inf, ())
            continue
        c, path = pick(opts, key=lambda o: o[0])
        best[n] = (c + (0 if n in cold else len(f.blocks[n].instrs)), (n,) + path)
    c, path = best.get(loop.header, (0, ()))
    if not path or not math.isfinite(c):
        return sorted(body)
    return list(path)


def _counts(instrs: list) -> dict:
    out = _sass.count_pipes(instrs)
    out["hgmma_flops"] = _sass.hgmma_flops(instrs)
    return out


def weighted_counts(steady: dict, cold: dict, rate: float) -> dict:
    """``steady`` + ``rate`` x ``cold`` (per-tile counts; rate = cold regions run per tile)."""
    if not rate or not cold.get("instructions"):
        return steady
    out = dict(steady)
    out["pipes"] = {p: steady["pipes"].get(p, 0) + rate * cold["pipes"].get(p, 0) for p in steady["pipes"]}
    ops = dict(steady["opcodes"])
    for k, v in cold["opcodes"].items():
        ops[k] = ops.get(k, 0) + rate * v
    out["opcodes"] = ops
    for k in ("instructions", "mufu_ex2", "ffma2", "hgmma_flops"):
        out[k] = steady.get(k, 0) + rate * cold.get(k, 0)
    return out


def _loop_paths(f, lp, spin, dom) -> dict:
    cold = cold_regions(f, lp, spin, dom)
    cset = frozenset(cold)
    short = weighted_path(f, lp, spin, dom, False, cset)
    long_ = weighted_path(f, lp, spin, dom, True, cset)
    ins = lambda blocks: [i for b in blocks for i in f.blocks[b].instrs]  # noqa: E731
    cold_ins = ins(sorted(cset))
    return {"loop": lp, "cold": cold, "short": ins([b for b in short if b not in cset]),
            "long": ins([b for b in long_ if b not in cset]), "cold_instrs": cold_ins}


def analyse(art: KernelArtifacts) -> dict:
    """Roles, their tile loops and one iteration's counts: ``main`` the steady-state unmasked
    tile (the cheapest path of the cheapest sibling loop, cold regions left out), ``masked`` the
    costliest path of the costliest sibling loop (a masked tile; cold regions left out), and
    ``main_cold`` / ``masked_cold`` the cold regions of those loops (charged per tile at the
    rebase rate: ``weighted_counts``)."""
    k = _sass.KernelSass.from_text(art.sass)
    f = k.function
    spin = _sass.spin_blocks(f, k.loops)
    same = {}
    for r in k.roles:
        same[r.registers] = same.get(r.registers, 0) + 1
    roles = []
    for r in k.roles:
        loops = _sass.tile_loops(f, r, k.loops)
        if not loops:
            continue
        paths = [_loop_paths(f, lp, spin, k.dom) for lp in loops]
        main = min(paths, key=lambda p: (len(p["short"]), p["loop"].header))
        # the masked copy: the costliest in the worst case (cold regions in), as before
        masked = max(paths, key=lambda p: (len(p["long"]) + len(p["cold_instrs"]), -p["loop"].header))
        c_main, c_mask = _counts(main["short"]), _counts(masked["long"])
        has_mma = c_main["pipes"]["tensor"] > 0
        cold = [{"loop_header": p["loop"].header, "block": b, "kind": kind,
                 "instructions": len(f.blocks[b].instrs)} for p in paths for b, kind in sorted(p["cold"].items())]
        roles.append({"role": r.name, "registers": r.registers, "kind": r.kind,
                      "warps": _role_warps(art.info, r, same[r.registers], has_mma),
                      "loop_header": main["loop"].header, "masked_loop_header": masked["loop"].header,
                      "loops": len(loops), "main": c_main, "masked": c_mask,
                      "main_cold": _counts(main["cold_instrs"]), "masked_cold": _counts(masked["cold_instrs"]),
                      "cold_blocks": cold, "hgmma_format": _hgmma_format(main["loop"].instrs(f, spin))})
    return {"function": f.name, "instructions": len(f.instrs), "roles": roles}


def _role_counts(r: dict, key: str, rate: float) -> dict:
    return weighted_counts(r[key], r.get(key + "_cold") or {}, rate)


def step_cycles(art: KernelArtifacts, gpu: Gpu, counts_key: str = "main", analysis: Optional[dict] = None,
                serial: Optional[bool] = None, rebase_rate: float = REBASE_RATE_STEADY) -> dict:
    """Cycles of one CTA step (one KV tile against all the CTA's query rows) and what bounds it.
    ``rebase_rate``: cold regions charged per tile (0 steady state, 1 worst case)."""
    info = art.info
    an = analysis or analyse(art)
    roles = [dict(r, main=_role_counts(r, "main", rebase_rate), masked=_role_counts(r, "masked", rebase_rate))
             for r in an["roles"]]
    # tensor time of the step
    rows, n, d = info.tile_m, info.tile_n, info.head_dim
    if info.arch == "sm_90a":
        cons = max((r for r in roles if r["main"]["hgmma_flops"]), key=lambda r: r["warps"], default=None)
        if cons is None:
            raise ValueError(f"{info.name}: no role issues HGMMA")
        groups = cons["warps"] / 4  # warpgroups running the consumer loop
        flops = cons[counts_key]["hgmma_flops"] * groups
        fmt = cons["hgmma_format"]
        t_mma = flops / gpu.tensor_flops_per_clk[fmt]
        qk_fmt = pv_fmt = fmt
    else:
        qk_fmt, pv_fmt = (info.qk_format, info.pv_format) if info.qk_format else _mma_formats(art.ptx)
        flops = 2.0 * rows * n * d * 2
        t_mma = (2.0 * rows * n * d) / gpu.tensor_flops_per_clk[qk_fmt] + \
                (2.0 * rows * n * d) / gpu.tensor_flops_per_clk[pv_fmt]
        cons = max((r for r in roles if r["main"]["pipes"]["tensor"] == 0),
                   key=lambda r: (r["warps"], r["main"]["instructions"]), default=None)
    per_role, issue_total, pipe_total = [], 0.0, {}
    for r in roles:
        cyc = _pipe_cycles(gpu, r[counts_key] if r is cons else r["main"])
        per_smsp = r["warps"] / gpu.smsp_per_sm  # warps of the role on one SMSP (average)
        busiest = math.ceil(per_smsp)
        role_t = {p: c * busiest for p, c in cyc.items()}
        for p, c in cyc.items():
            pipe_total[p] = pipe_total.get(p, 0.0) + c * per_smsp
        per_role.append({"role": r["role"], "warps": r["warps"], "instructions": r[counts_key if r is cons else "main"]["instructions"],
                         "cycles": round(max(role_t.values()), 1),
                         "bound": max(role_t, key=role_t.get), "pipes": {p: round(c, 1) for p, c in role_t.items()}})
    # a softmax group alone: one warp per SMSP (a warpgroup spans the 4 SMSPs)
    t_group = max(_pipe_cycles(gpu, cons[counts_key]).values()) if cons else 0.0
    smsp = {p: c for p, c in pipe_total.items()}
    busiest = max(smsp, key=smsp.get)
    bounds = {"tensor": t_mma, "overlap": t_mma / max(info.groups, 1) + t_group}
    for p, c in smsp.items():
        bounds["smsp_" + p] = c
    serial = gpu.serial_mma if serial is None else serial
    if serial:
        # the consumers' instructions are taken as not overlapping the tensor time (Gpu.serial_mma)
        cycles = t_mma + smsp[busiest]
        name = f"tensor+smsp_{busiest}"
        bounds["serial"] = cycles
    else:
        name = max(bounds, key=bounds.get)
        cycles = bounds[name]
    return {"cycles": cycles, "bottleneck": name, "bounds": {k: round(v, 1) for k, v in bounds.items()},
            "tensor_cycles": round(t_mma, 1), "softmax_group_cycles": round(t_group, 1), "mma_flops": flops,
            "formats": {"qk": qk_fmt, "pv": pv_fmt}, "roles": per_role,
            "consumer_role": cons["role"] if cons else None}


def attn_flops(B, S, H, D, causal) -> float:
    """4 B H S^2 D, half when causal (bench/attention.py's convention)."""
    return 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)


def _cta_schedule(info: KernelInfo, S: int, causal: bool) -> list:
    """Per query tile of a (b, h): (KV tiles, of which masked): causal, the diagonal tiles run
    the masked path; every CTA's last tile (the sequence end) too."""
    m, n = info.tile_m, info.tile_n
    out = []
    for qi in range(math.ceil(S / m)):
        hi = min(S, (qi + 1) * m) if causal else S
        tiles = math.ceil(hi / n)
        diag = (math.ceil(hi / n) - (qi * m) // n) if causal else 0
        out.append((tiles, min(tiles, max(diag, 1) + info.masked_extra)))
    return out


def _predict_one(art: KernelArtifacts, g: Gpu, shape: dict, an: dict, serial, rate: float) -> dict:
    info = art.info
    B, H, S = int(shape["B"]), int(shape["H"]), int(shape["S"])
    D = int(shape.get("D", info.head_dim))
    causal = bool(shape.get("causal", info.causal))
    main = step_cycles(art, g, "main", an, serial, rate)
    masked = step_cycles(art, g, "masked", an, serial, rate)
    m, n = info.tile_m, info.tile_n
    n_q = math.ceil(S / m)
    sched = _cta_schedule(info, S, causal)
    cta_cycles = [(tiles - n_mask) * main["cycles"] + n_mask * masked["cycles"] for tiles, n_mask in sched]
    ctas = B * H * n_q
    total = sum(cta_cycles) * B * H
    epilogue, fixed = cta_fixed_cycles(art.sass)
    if info.persistent:  # work tiles spread evenly; the fixed cost once per SM (later tiles overlap it)
        compute = total / g.sms + fixed
    elif not causal:
        compute = math.ceil(ctas / g.sms) * (cta_cycles[0] + fixed)
    else:  # longest-first blocks over SMs: the average, at least the longest CTA
        compute = max((total + ctas * fixed) / g.sms, max(cta_cycles) + fixed)
    seconds = compute / (g.clock_ghz * 1e9)
    in_bytes = {"bf16": 2, "fp8": 1, "fp4": 0.5}
    qkv = in_bytes.get(main["formats"]["qk"], 2)
    mem_bytes = B * H * S * D * (2 * qkv + in_bytes.get(main["formats"]["pv"], 2) + 2)
    mem_s = mem_bytes / (g.hbm_gbs * 1e9)
    bottleneck = main["bottleneck"]
    if mem_s > seconds:
        seconds, bottleneck = mem_s, "hbm"
    flops = attn_flops(B, S, H, D, causal)
    return {"kernel": info.name, "gpu": g.name, "shape": {"B": B, "H": H, "S": S, "D": D, "causal": causal},
            "predicted_tflops": round(flops / seconds / 1e12, 1), "predicted_ms": round(seconds * 1e3, 4),
            "bottleneck": bottleneck, "cycles_per_tile": round(main["cycles"], 1),
            "cycles_per_masked_tile": round(masked["cycles"], 1), "tile": {"m": m, "n": n},
            "ctas": ctas, "kv_tiles_per_cta": [sched[0][0], sched[-1][0]],
            "masked_tile_fraction": round(sum(k for _, k in sched) / sum(t for t, _ in sched), 4),
            "memory_ms": round(mem_s * 1e3, 4), "epilogue": epilogue, "cta_fixed_cycles": fixed, "step": main,
            "masked_step": {k: masked[k] for k in ("cycles", "bottleneck", "bounds")},
            "sass_instructions": an["instructions"]}


def predict(art: KernelArtifacts, gpu, shape: dict, serial: Optional[bool] = None,
            rebase_rate: float = REBASE_RATE_STEADY, analysis: Optional[dict] = None) -> dict:
    """Predicted forward time and TFLOP/s of ``art`` on ``gpu`` for ``shape`` = {B, H, S, D, causal}.

    The steady state charges the cold regions (``cold_regions``) ``rebase_rate`` times per tile
    (default 0: moderate logits never rebase); ``worst_case`` charges them on every tile."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    if not 0.0 <= rebase_rate <= 1.0:
        raise ValueError(f"rebase_rate is rebases per KV tile, in [0, 1]: got {rebase_rate}")
    an = analysis or analyse(art)
    out = _predict_one(art, g, shape, an, serial, rebase_rate)
    worst = _predict_one(art, g, shape, an, serial, 1.0)
    cold_roles = [r for r in an["roles"] if r["cold_blocks"]]
    out["rebase_rate"] = rebase_rate
    out["cold"] = {"blocks": sum(len(r["cold_blocks"]) for r in an["roles"]),
                   "instructions_per_tile": max((r["main_cold"]["instructions"] for r in cold_roles), default=0),
                   "instructions_per_masked_tile": max((r["masked_cold"]["instructions"] for r in cold_roles), default=0),
                   "assumption": "steady state: moderate logits never rebase (0 per tile); worst case: every tile"}
    out["worst_case"] = {"rebase_rate": 1.0, **{k: worst[k] for k in ("predicted_tflops", "predicted_ms", "bottleneck",
                                                                       "cycles_per_tile", "cycles_per_masked_tile")}}
    return out


# ============================================================================ FA4 ratio, CLI


def with_fa4_ratio(pred: dict, fa4_pred: dict) -> dict:
    """``pred`` with ``ratio_vs_fa4_bf16``: its predicted TFLOP/s over FA4 BF16's (same pass,
    mask, shape and model)."""
    out = dict(pred)
    out["fa4_bf16_predicted_tflops"] = fa4_pred["predicted_tflops"]
    out["ratio_vs_fa4_bf16"] = round(pred["predicted_tflops"] / fa4_pred["predicted_tflops"], 3)
    if "worst_case" in pred:  # FA4's worst case against ours (FA4 has no rebase: its steady state)
        fa4_worst = fa4_pred.get("worst_case", fa4_pred)["predicted_tflops"]
        out["worst_case"] = dict(pred["worst_case"],
                                 ratio_vs_fa4_bf16=round(pred["worst_case"]["predicted_tflops"] / fa4_worst, 3))
    return out


def _spec_sources(path: str) -> list:
    """Generated-module paths for one command-line SPEC: a generated module (.py, or its name
    under generated/), or an .attn spec rendered kernel by kernel into the cache."""
    p = Path(path)
    if p.suffix == ".py" or not p.suffix:
        if not p.is_file():
            root = Path(__file__).resolve().parents[2] / "generated"
            p = root / (p.name if p.suffix else p.name + ".py")
        if not p.is_file():
            raise FileNotFoundError(f"no generated module {path}")
        return [str(p)]
    import fp4gen
    from fp4gen.ir.passes import plan_kernel

    from . import render

    out = []
    for spec in fp4gen.parse_text(p.read_text(), filename=str(p)):
        source = render(plan_kernel(spec))
        dst = cache_dir() / f"spec-{spec.name}-{_sha(source)[:16]}.py"
        if not dst.is_file():
            dst.write_text(source)
        out.append(str(dst))
    return out


def parse_args(argv=None):
    """The arguments of ``fp4gen perf`` (forward, and ``--backward``, which the CLI hands to
    ``perf_backward.main``: that module builds on this one, not the other way)."""
    ap = argparse.ArgumentParser(
        prog="fp4gen perf",
        description="Predicted forward TFLOP/s of each kernel and its ratio to FA4's BF16 forward of "
                    "the same mask, by a static model of the compiled SASS (a prediction, not a timing).")
    ap.add_argument("specs", nargs="+", help=".attn specs or generated modules (path or name)")
    ap.add_argument("--gpu", default=None, choices=sorted(GPUS), help="default: h200 for sm90a, b200 for sm100a")
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=32768, help="B = tokens // S")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--serial", action="store_true", help="the Hopper rule (tensor + busiest SMSP) on every GPU")
    ap.add_argument("--rebase-rate", type=float, default=REBASE_RATE_STEADY, metavar="R",
                    help="headroom rebases per KV tile charged in the main prediction (default 0: moderate "
                         "logits never rebase; the worst case, 1, is always reported beside it)")
    ap.add_argument("--backward", action="store_true",
                    help="the sm100a backwards of the specs instead, beside FA4's sm100 BF16 backward "
                         "(fp4gen/lowering/perf_backward.py)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not 0.0 <= a.rebase_rate <= 1.0:
        ap.error(f"--rebase-rate is rebases per KV tile, in [0, 1]: got {a.rebase_rate}")
    return a


def main(argv=None) -> int:
    """``fp4gen perf SPEC... [--gpu h200|b200|gb200] [--json]``: predicted forward TFLOP/s of
    each kernel and its ratio to FA4's BF16 forward of the same mask, by the same model."""
    a = parse_args(argv)
    if a.backward:
        print("fp4gen perf: --backward runs through the CLI (`fp4gen perf --backward`, "
              "fp4gen/lowering/perf_backward.py: main)", file=sys.stderr)
        return 2
    return run(a)


def run(a) -> int:
    """The forward predictions for parsed ``parse_args`` arguments."""
    try:
        rows = _rows(a)
    except (FileNotFoundError, _sass.NvdisasmUnavailable, RuntimeError) as e:
        # no FA4 folder, no nvdisasm/ptxas, a compile that failed: say so, exit 1
        print(f"fp4gen perf: {e}", file=sys.stderr)
        return 1
    if a.json:
        def brief(r):
            return {k: v for k, v in r.items() if k != "step"} | {"roles": r["step"]["roles"]}

        print(json.dumps([brief(r) for r in rows], indent=1))
    else:
        print(f"{'kernel':36s} {'gpu':6s} {'S':>6s} {'causal':6s} {'TFLOP/s':>8s} {'xFA4':>6s} "
              f"{'cyc/tile':>8s} {'worst xFA4':>10s}  bottleneck   (predicted; worst case: a rebase on every tile)")
        for r in rows:
            print(f"{r['kernel']:36s} {r['gpu']:6s} {r['shape']['S']:6d} {str(r['shape']['causal']):6s} "
                  f"{r['predicted_tflops']:8.1f} {r['ratio_vs_fa4_bf16']:6.2f} {r['cycles_per_tile']:8.0f} "
                  f"{r['worst_case']['ratio_vs_fa4_bf16']:10.2f}  {r['bottleneck']}")
        print(f"steady state: {rows[0]['rebase_rate'] if rows else 0:g} rebases per KV tile (moderate logits never "
              f"rebase); causal: the diagonal tiles run the masked path")
    return 0


def _rows(a) -> list:
    rows = []
    fa4_cache = {}
    for spec in a.specs:
        for src in _spec_sources(spec):
            art = fp4gen_artifacts(src)
            gpu = a.gpu or ("h200" if art.info.arch == "sm_90a" else "b200")
            key = (art.info.arch, art.info.causal)
            if key not in fa4_cache:
                fa4 = fa4_artifacts(*key)
                fa4_cache[key] = (fa4, analyse(fa4))
            an = analyse(art)
            for s in (int(x) for x in a.seqlens.split(",") if x):
                shape = {"B": max(1, a.tokens // s), "H": a.heads, "S": s, "D": art.info.head_dim,
                         "causal": art.info.causal}
                serial = True if a.serial else None
                p = predict(art, gpu, shape, serial, a.rebase_rate, analysis=an)
                f = predict(fa4_cache[key][0], gpu, shape, serial, analysis=fa4_cache[key][1])
                rows.append(with_fa4_ratio(p, f))
    return rows


if __name__ == "__main__":
    sys.exit(main())
