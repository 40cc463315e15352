"""The static performance model for the sm100a attention backward (issue 18, item 4): fp4gen's
generated backward and FA4's sm100 BF16 backward, priced by the same rules from their SASS.

It reuses the forward model (``perf``): the GPU table, the SASS roles and their loop counts
(``perf.analyse``) and the per-pipe cost of a warp's instructions (``perf._pipe_cycles``). What
differs is the step: one query tile of ``tile_m`` queries against the CTA's ``tile_n`` keys,
five products (S^T, dP^T, dV, dK, dQ), and how the roles overlap:

* ``serial`` (fp4gen's backward, fp4gen/device/sm100/backward.py): the MMA warp issues S^T and
  dP^T, waits for the compute warps' P^T / dS^T, issues dV, dK and dQ, and waits for the dQ
  warps to drain dQ (whose columns alias dP^T) before the next S^T: one tile's time is the
  tensor time of the five products plus the compute role's and the dQ role's time, in a chain;
* ``overlapped`` (FA4's flash_bwd_sm100: two compute warpgroups, a dQ reduce warpgroup and
  double-buffered accumulators): the step is the largest of the tensor time, each role's
  busiest pipe and the issue slots of each SMSP.

The roles are told apart by what their loop issues, not by name: the role whose loop issues
tcgen05.mma is the MMA warp; the one issuing MUFU (exp2) is the compute role; of the rest, the
one with the most instructions per tile is the dQ role (fp4gen: red.global.add; FA4: its
reduce warps); the load warp is what remains. Warps per role come from each kernel's source
(``KERNELS``). FLOPs: 2.5 x the forward's (4 B H S^2 D, half when causal).

Not modelled: latencies (a serial chain pays its MMA and TMEM latencies on every tile), L2
atomics bandwidth for dQ, the pre- and post-processing launches. FA4's published B200 backward
(~1,237 TFLOP/s, BRIEF) against what this model predicts for it says how optimistic the
overlapped rule is.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import perf

# FA4 4.0.0b36's flash_bwd_sm100 (D128, 1 CTA): reduce warps 0-3, compute 4-11, MMA 12,
# load 13, relay 14, empty 15; tile_m 128 queries x tile_n 128 keys (interface.py defaults)
KERNELS = {
    "fp4gen": {"compute": 4, "dq": 4, "schedule": "serial"},
    "fa4": {"compute": 8, "dq": 4, "schedule": "overlapped"},
}
FA4_BWD_PUBLISHED_B200 = 1237.0  # TFLOP/s, D128 (BRIEF: FA4 BF16 on B200 ~1,237 backward)


@dataclass
class BackwardKernel:
    name: str
    family: str  # "fp4gen" | "fa4"
    causal: bool
    tile_m: int
    tile_n: int
    head_dim: int
    formats: dict  # product -> "bf16" | "fp8"
    ptx: str
    sass: str


_FA4_BWD_RUNNER = perf._FA4_RUNNER_SETUP + textwrap.dedent("""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v, o, do = (torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(5))
        lse = torch.empty(B, H, S, dtype=torch.float32, device="cuda")
        I._flash_attn_bwd(q, k, v, o, do, lse, causal=causal)
    main = [c.artifacts.PTX for c in compiled if "FlashAttentionBackwardSm100" in c.artifacts.PTX]
    open(sys.argv[3], "w").write(main[-1])
""")


def fa4_backward(causal: bool, fa4_path: Optional[str] = None, timeout: int = 1800) -> BackwardKernel:
    """FA4's sm100 BF16 backward (D128), compiled on the CPU through its interface with fake
    tensors (its pre/post-processing kernels are left out), cached like the forward's."""
    fa4_path = fa4_path or os.environ.get(perf.FA4_PATH_ENV) or perf._installed_fa4()
    if not (Path(fa4_path) / "flash_attn" / "cute" / "interface.py").is_file():
        raise FileNotFoundError(f"no flash-attn-4 {'under ' + fa4_path if fa4_path else 'importable'}: "
                                f"set ${perf.FA4_PATH_ENV} (see fp4gen perf --help)")
    ver = next(Path(fa4_path).glob("flash_attn_4-*.dist-info"), None)
    key = perf.cache_dir() / f"fa4bwd-{perf._sha(str(ver) + _FA4_BWD_RUNNER)[:16]}-{'causal' if causal else 'full'}.ptx"
    if not key.is_file():
        with tempfile.TemporaryDirectory(prefix="fp4gen_perf_fa4bwd_") as d:
            env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_100a", CUTE_DSL_ARCH="sm_100a", CUTE_DSL_KEEP="ptx",
                       CUTE_DSL_DUMP_DIR=d, FLASH_ATTENTION_NUM_SMS="148")
            perf._run([sys.executable, "-c", _FA4_BWD_RUNNER, fa4_path, "1" if causal else "0",
                       str(Path(d) / "k.ptx")], env, d, timeout)
            tmp = key.with_suffix(".tmp")
            tmp.write_text((Path(d) / "k.ptx").read_text())
            tmp.replace(key)
    ptx = key.read_text()
    return BackwardKernel("fa4-cute-bf16-bwd", "fa4", causal, 128, 128, 128,
                          dict.fromkeys(("S", "dP", "dV", "dK", "dQ"), "bf16"), ptx, perf.sass_cached(ptx))


def fp4gen_backward(path: str) -> Optional[BackwardKernel]:
    """The backward of a generated sm100a module (None if it has none), its formats from the
    module's plan (PLAN_JSON's backward MMAs)."""
    from .emulator import run

    source = Path(path).read_text()
    if "def _bwd_build(" not in source:
        return None
    c = perf._module_constants(source)
    bp = json.loads(c["PLAN_JSON"])["backward"]
    ptx, _ = run.compiled(source, backward=True)
    formats = {m["name"]: "fp8" if str(m["operand_format"]).startswith("fp8") else "bf16" for m in bp["mmas"]}
    return BackwardKernel(f"fp4gen-{c.get('KERNEL_NAME', Path(path).stem)}-bwd", "fp4gen",
                          bool(bp["causal"]), int(bp["tile_m"]), int(bp["tile_n"]), int(bp["head_dim"]),
                          formats, ptx, perf.sass_cached(ptx))


def _roles(k: BackwardKernel) -> dict:
    """Role name -> the analysed role (perf.analyse's dict), by what each loop issues."""
    info = perf.KernelInfo(name=k.name, arch="sm_100a", causal=k.causal, tile_m=k.tile_m, tile_n=k.tile_n,
                           head_dim=k.head_dim, warps_by_registers={}, groups=1, persistent=False, source=k.name)
    an = perf.analyse(perf.KernelArtifacts(info, k.ptx, k.sass))
    roles = {}
    rest = []
    for r in an["roles"]:
        pipes = r["main"]["pipes"]
        if pipes.get("tensor"):
            roles["mma"] = r
        elif pipes.get("mufu"):
            roles["compute"] = r
        else:
            rest.append(r)
    rest.sort(key=lambda r: -r["main"]["instructions"])
    if rest:
        roles["dq"] = rest[0]
    for i, r in enumerate(rest[1:]):
        roles[f"other{i}"] = r
    missing = {"mma", "compute", "dq"} - set(roles)
    if missing:
        raise ValueError(f"{k.name}: no {', '.join(sorted(missing))} role found in the SASS")
    return roles


def step_cycles(k: BackwardKernel, gpu: perf.Gpu, key: str = "main", roles: Optional[dict] = None) -> dict:
    """Cycles of one backward step (one query tile against the CTA's keys) and what bounds it."""
    roles = roles or _roles(k)
    fam = KERNELS[k.family]
    m, n, d = k.tile_m, k.tile_n, k.head_dim
    t_mma = sum(2.0 * m * n * d / gpu.tensor_flops_per_clk[k.formats[p]] for p in ("S", "dP", "dV", "dK", "dQ"))
    per_role, smsp = {}, {}
    for name, r in roles.items():
        warps = fam.get(name, 1)
        per = warps / gpu.smsp_per_sm
        cyc = perf._pipe_cycles(gpu, r[key] if name == "compute" else r["main"])
        per_role[name] = {"warps": warps, "instructions": (r[key] if name == "compute" else r["main"])["instructions"],
                          "cycles": round(max(cyc.values()) * math.ceil(per), 1),
                          "bound": max(cyc, key=cyc.get)}
        for p, c in cyc.items():
            smsp[p] = smsp.get(p, 0.0) + c * per
    if fam["schedule"] == "serial":
        cycles = t_mma + per_role["compute"]["cycles"] + per_role["dq"]["cycles"]
        bottleneck = "serial: tensor + compute + dq"
    else:
        bounds = {"tensor": t_mma, **{"smsp_" + p: c for p, c in smsp.items()},
                  **{r: v["cycles"] for r, v in per_role.items()}}
        bottleneck = max(bounds, key=bounds.get)
        cycles = bounds[bottleneck]
    return {"cycles": round(cycles, 1), "bottleneck": bottleneck, "tensor_cycles": round(t_mma, 1),
            "schedule": fam["schedule"], "roles": per_role}


def predict(k: BackwardKernel, gpu, shape: dict, roles: Optional[dict] = None) -> dict:
    """Predicted backward time and TFLOP/s for shape = {B, H, S, D, causal}: one CTA per key tile
    of a (batch, head), visiting the query tiles that see it (causal: from the diagonal on; the
    diagonal tiles take the masked loop where the kernel has one), CTAs in longest-first waves."""
    g = perf.GPUS[gpu] if isinstance(gpu, str) else gpu
    roles = roles or _roles(k)
    B, H, S = int(shape["B"]), int(shape["H"]), int(shape["S"])
    D = int(shape.get("D", k.head_dim))
    causal = bool(shape.get("causal", k.causal))
    main, masked = step_cycles(k, g, "main", roles), step_cycles(k, g, "masked", roles)
    n_q, n_k = math.ceil(S / k.tile_m), math.ceil(S / k.tile_n)
    cta = []
    for j in range(n_k):
        first = (j * k.tile_n) // k.tile_m if causal else 0
        diag = (math.ceil((j + 1) * k.tile_n / k.tile_m) - first) if causal else 0
        tiles = n_q - first
        cta.append((tiles - diag) * main["cycles"] + diag * masked["cycles"])
    total = sum(cta) * B * H
    compute = max(total / g.sms, max(cta)) if causal else math.ceil(B * H * n_k / g.sms) * cta[0]
    seconds = compute / (g.clock_ghz * 1e9)
    flops = 2.5 * perf.attn_flops(B, S, H, D, causal)
    return {"kernel": k.name, "pass": "backward", "gpu": g.name,
            "shape": {"B": B, "H": H, "S": S, "D": D, "causal": causal},
            "predicted_tflops": round(flops / seconds / 1e12, 1), "predicted_ms": round(seconds * 1e3, 4),
            "bottleneck": main["bottleneck"], "cycles_per_tile": main["cycles"],
            "cycles_per_masked_tile": masked["cycles"], "formats": k.formats, "step": main}


def rows(specs, gpu: Optional[str], seqlens, tokens: int, heads: int) -> list:
    """``fp4gen perf --backward``: every sm100a backward among ``specs`` beside FA4's sm100 BF16
    backward of the same mask and shape (``ratio_vs_fa4_bf16``, same model)."""
    out, fa4 = [], {}
    for spec in specs:
        for src in perf._spec_sources(spec):
            k = fp4gen_backward(src)
            if k is None:
                continue
            if k.causal not in fa4:
                f = fa4_backward(k.causal)
                fa4[k.causal] = (f, _roles(f))
            roles = _roles(k)
            for s in seqlens:
                shape = {"B": max(1, tokens // s), "H": heads, "S": s, "D": k.head_dim, "causal": k.causal}
                p = predict(k, gpu or "b200", shape, roles)
                f = predict(fa4[k.causal][0], gpu or "b200", shape, fa4[k.causal][1])
                p["fa4_bf16_predicted_tflops"] = f["predicted_tflops"]
                p["fa4_bf16_published_tflops"] = FA4_BWD_PUBLISHED_B200 if (gpu or "b200") == "b200" else None
                p["ratio_vs_fa4_bf16"] = round(p["predicted_tflops"] / f["predicted_tflops"], 3)
                p["fa4_step"] = {x: f["step"][x] for x in ("cycles", "bottleneck", "tensor_cycles")}
                out.append(p)
    return out


def main(a) -> int:
    """``fp4gen perf --backward``: the rows of ``rows`` for parsed ``perf.parse_args`` arguments,
    as a table or JSON."""
    seqlens = [int(x) for x in a.seqlens.split(",") if x]
    try:
        found = rows(a.specs, a.gpu, seqlens, a.tokens, a.heads)
    except (FileNotFoundError, perf._sass.NvdisasmUnavailable, RuntimeError) as e:
        print(f"fp4gen perf: {e}", file=sys.stderr)
        return 1
    if not found:
        print("fp4gen perf: none of the specs has an sm100a backward", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(found, indent=1))
        return 0
    print(f"{'kernel':40s} {'gpu':6s} {'S':>6s} {'TFLOP/s':>8s} {'xFA4':>6s} {'cyc/tile':>8s}  bottleneck"
          "   (predicted backward; FA4 by the same model)")
    for r in found:
        print(f"{r['kernel']:40s} {r['gpu']:6s} {r['shape']['S']:6d} {r['predicted_tflops']:8.1f} "
              f"{r['ratio_vs_fa4_bf16']:6.2f} {r['cycles_per_tile']:8.0f}  {r['bottleneck']}")
    fa4 = found[-1]
    print(f"FA4's backward by this model: {fa4['fa4_bf16_predicted_tflops']:.0f} TFLOP/s (step "
          f"{fa4['fa4_step']['cycles']:.0f} cycles, {fa4['fa4_step']['bottleneck']}-bound)"
          + (f"; published on B200: ~{fa4['fa4_bf16_published_tflops']:.0f}" if fa4["fa4_bf16_published_tflops"] else ""))
    return 0
