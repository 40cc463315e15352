#!/usr/bin/env python3
"""sm90 forward kernels on the H200: correctness against the numerics oracle,
timing against FA4 (flash_attn.cute) in the same process, SASS facts.

Run on the device machine from the repo root (a plain checkout, not installed):

    source .dev/activate && python3 tests/sm90/device_bench.py --out $OUT

Writes ``$OUT/sm90_results.json`` (a list of rows, see DESIGN.md) and prints a table.
``--quick`` skips d64 and the slow cases. Not collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "sm90"))


def _shim_fp4gen():
    """Make fp4gen.ir / fp4gen.templates importable from a plain checkout (pyproject maps them)."""
    import fp4gen

    shim = tempfile.mkdtemp(prefix="fp4gen_shim_")
    for name in ("ir", "cli", "generated", "templates"):
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            os.symlink(src, os.path.join(shim, name))
    fp4gen.__path__.append(shim)


def load_variant(variant, d, causal, gen_dir, tag="", **plan_kw):
    from fp4gen.lowering.sm90 import render
    from plans import make_plan

    plan = make_plan(variant, d, causal, **plan_kw)
    path = os.path.join(gen_dir, f"{plan.spec.name}{tag}.py")
    with open(path, "w") as f:
        f.write(render(plan))
    spec = importlib.util.spec_from_file_location(plan.spec.name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return plan, mod


def err_stats(o, ref):
    o, ref = o.double(), ref.double()
    d = (o - ref)
    rel_l2 = (d.norm() / ref.norm().clamp_min(1e-30)).item()
    cos = torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item()
    return d.abs().max().item(), rel_l2, cos


def lse_stats(lse, ref):
    inf_k, inf_r = torch.isneginf(lse), torch.isneginf(ref)
    same_inf = bool((inf_k == inf_r).all())
    fin = ~inf_r & ~inf_k
    err = (lse[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    return err, same_inf


def correctness(mods, quick, log):
    from fp4gen.numerics import reference

    cases = [
        # (B, Sq, Sk, H, Hkv, logit_mult, label)
        (1, 1024, 1024, 4, 4, 1.0, "square"),
        (2, 300, 700, 4, 2, 1.0, "ragged+gqa"),
        (1, 700, 300, 4, 1, 1.0, "sq>sk (masked rows if causal)"),
        (1, 513, 513, 2, 2, 12.0, "large logits"),
    ]
    if quick:
        cases = cases[:3]
    rows = []
    for (variant, d, causal), (plan, mod) in mods.items():
        for (B, Sq, Sk, H, Hkv, mult, label) in cases:
            g = torch.Generator(device="cuda").manual_seed(1234 + Sq + Sk + d)
            q = (torch.randn(B, Sq, H, d, device="cuda", generator=g) * mult).bfloat16()
            k = torch.randn(B, Sk, Hkv, d, device="cuda", generator=g).bfloat16()
            v = torch.randn(B, Sk, Hkv, d, device="cuda", generator=g).bfloat16()
            row = dict(variant=variant, D=d, causal=causal, case=label, B=B, Sq=Sq, Sk=Sk, H=H, Hkv=Hkv)
            try:
                o, lse = mod.forward(q, k, v, return_lse=True)
                torch.cuda.synchronize()
                o_ref, lse_ref = reference.forward(q, k, v, plan.spec)
                row["o_maxabs"], row["o_rel_l2"], row["o_cos"] = err_stats(o.float(), o_ref.float())
                row["lse_maxabs"], row["lse_inf_match"] = lse_stats(lse, lse_ref)
                row["nan"] = bool(torch.isnan(o).any())
            except Exception as e:  # report and go on: one broken variant must not hide the rest
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            rows.append(row)
            log(row)
    return rows


def bench(mods, log, B=2, S=16384, H=16):
    import triton.testing as tt

    rows = []
    fa = None
    try:
        from flash_attn.cute import flash_attn_func as fa
    except Exception as e:
        log({"fa4_import_error": str(e)})
    for causal in (False, True):
        D = 128
        g = torch.Generator(device="cuda").manual_seed(7)
        q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
        v = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        fa_ms = None
        if fa is not None:
            try:
                fa(q, k, v, causal=causal)
                fa_ms = tt.do_bench(lambda: fa(q, k, v, causal=causal), warmup=50, rep=300, return_mode="median")
                rows.append(dict(kernel="fa4-cute-bf16", causal=causal, B=B, S=S, H=H, D=D, ms=fa_ms,
                                 tflops=flops / fa_ms / 1e9))
                log(rows[-1])
            except Exception as e:
                log({"fa4_error": str(e)[:300]})
        for key, (plan, mod) in mods.items():
            variant, d, c = key[:3]
            if d != D or c != causal:
                continue
            if len(key) > 3:
                variant = f"{variant}[{key[3]}]"
            try:
                o = torch.empty_like(q)
                lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
                ins = mod.quantize_inputs(q, k, v) if mod.IN_FP8 else (q, k, v)
                fn = lambda: mod.run_prepared(ins, o, lse, S, D ** -0.5, 0)
                fn()
                ms = tt.do_bench(fn, warmup=50, rep=300, return_mode="median")
                e2e = tt.do_bench(lambda: mod.forward(q, k, v), warmup=5, rep=100, return_mode="median")
                row = dict(kernel=f"fp4gen-sm90a-{variant}", causal=causal, B=B, S=S, H=H, D=D, ms=ms,
                           tflops=flops / ms / 1e9, e2e_ms=e2e,
                           ratio_vs_fa4_bf16=(fa_ms / ms) if fa_ms else None)
            except Exception as e:
                row = dict(kernel=f"fp4gen-sm90a-{variant}", causal=causal, error=str(e)[:400])
            rows.append(row)
            log(row)
    return rows


def sass_facts(dump_dir, log):
    facts = {}
    for f in sorted(os.listdir(dump_dir)):
        if not f.endswith(".cubin"):
            continue
        name = next((v for v in ("fp8_directp", "fp8_exp", "bf16") if v in f), f[:40])
        name += "_causal" if "causal" in f else ""
        name += "_d64" if "_d64" in f else ""
        try:
            sass = subprocess.run(["cuobjdump", "-sass", os.path.join(dump_dir, f)], capture_output=True,
                                  text=True, timeout=60).stdout
            res = subprocess.run(["cuobjdump", "-res-usage", os.path.join(dump_dir, f)], capture_output=True,
                                 text=True, timeout=60).stdout
        except Exception as e:
            facts[name] = str(e)
            continue
        facts[name] = dict(
            mufu_ex2=sass.count("MUFU.EX2"), gmma=sass.count("GMMA."), ldl=sass.count("LDL"),
            stl=sass.count("STL"), prmt=sass.count("PRMT"), f2fp=sass.count("F2FP"),
            res=" ".join(l.strip() for l in res.splitlines() if "REG" in l)[:300],
        )
    log({"sass": facts})
    return facts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--variants", default="bf16,fp8_exp,fp8_directp")
    ap.add_argument("--dims", default="128,64")
    ap.add_argument("--watchdog", type=int, default=540)
    ap.add_argument("--perf-extra", default="", help="variant:opt[+opt] (opts: s3 s4 nopp nooverlap lmma) timed only")
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog, exit=True)  # a hung kernel must not eat the call
    dump = tempfile.mkdtemp(prefix="cute_dump_")
    os.environ.setdefault("CUTE_DSL_KEEP", "cubin")
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", dump)
    _shim_fp4gen()
    global torch
    import torch

    out_path = os.path.join(a.out, "sm90_results.json")
    results = []

    def log(row):
        print(json.dumps(row), flush=True)
        results.append(row)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)

    log({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
         "command": " ".join(sys.argv)})
    gen_dir = tempfile.mkdtemp(prefix="fp4gen_gen_")
    mods = {}
    for variant in a.variants.split(","):
        for d in [int(x) for x in a.dims.split(",")]:
            for causal in (False, True):
                t = time.time()
                try:
                    mods[(variant, d, causal)] = load_variant(variant, d, causal, gen_dir)
                    mods[(variant, d, causal)][1]._compile(None)
                    log({"compiled": f"{variant} d{d} causal={causal}", "s": round(time.time() - t, 1)})
                except Exception as e:
                    log({"compile_error": f"{variant} d{d} causal={causal}", "error": str(e)[:600]})
                    mods.pop((variant, d, causal), None)
    corr = correctness(mods, a.quick, log)
    for item in filter(None, a.perf_extra.split(",")):
        variant, opts = item.split(":")
        kw = {}
        for o in opts.split("+"):
            if o.startswith("s"):
                kw["kv_stages"] = int(o[1:])
            elif o == "nopp":
                kw["pingpong"] = False
            elif o == "nooverlap":
                kw["overlap"] = False
            elif o == "lmma":
                kw["l_from_mma"] = True
        for causal in (False, True):
            try:
                key = (variant, 128, causal, opts)
                mods[key] = load_variant(variant, 128, causal, gen_dir, tag="_" + opts.replace("+", "_"), **kw)
                mods[key][1]._compile(None)
                from fp4gen.numerics import reference
                plan_x, mod_x = mods[key]
                g = torch.Generator(device="cuda").manual_seed(11)
                q = torch.randn(2, 300, 4, 128, device="cuda", generator=g).bfloat16()
                k = torch.randn(2, 700, 2, 128, device="cuda", generator=g).bfloat16()
                v = torch.randn(2, 700, 2, 128, device="cuda", generator=g).bfloat16()
                o, lse = mod_x.forward(q, k, v, return_lse=True)
                o_ref, lse_ref = reference.forward(q, k, v, plan_x.spec)
                mx, rel, cos = err_stats(o.float(), o_ref.float())
                log({"extra_check": f"{item} causal={causal}", "o_rel_l2": rel, "o_cos": cos,
                     "lse": lse_stats(lse, lse_ref)})
            except Exception as e:
                log({"compile_error": item, "error": str(e)[:600]})
                mods.pop(key, None)
    if not a.no_bench:
        perf = bench(mods, log)
    else:
        perf = []
    sass_facts(dump, log)
    # short table last
    print("\n== correctness (vs fp4gen.numerics.reference) ==")
    for r in corr:
        if "error" in r:
            print(f"{r['variant']:12s} d{r['D']:3d} {'C' if r['causal'] else 'N'} {r['case']:28s} ERROR {r['error'][:120]}")
        else:
            print(f"{r['variant']:12s} d{r['D']:3d} {'C' if r['causal'] else 'N'} {r['case']:28s} "
                  f"o_max {r['o_maxabs']:.2e} relL2 {r['o_rel_l2']:.2e} cos {r['o_cos']:.6f} "
                  f"lse {r['lse_maxabs']:.2e} inf_ok {r['lse_inf_match']} nan {r['nan']}")
    print("\n== performance (B=2 S=16384 H=16 D=128) ==")
    for r in perf:
        if "error" in r:
            print(f"{r['kernel']:28s} {'causal' if r['causal'] else 'full  '} ERROR {r['error'][:150]}")
        else:
            ratio = r.get("ratio_vs_fa4_bf16")
            print(f"{r['kernel']:28s} {'causal' if r['causal'] else 'full  '} {r['ms']:8.3f} ms "
                  f"{r['tflops']:7.1f} TFLOP/s" + (f"  x{ratio:.2f} FA4" if ratio else "")
                  + (f"  e2e {r['e2e_ms']:.3f} ms" if r.get("e2e_ms") else ""))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
