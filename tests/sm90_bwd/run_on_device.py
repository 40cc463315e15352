#!/usr/bin/env python3
"""sm90a backward on the H200: correctness table (vs the numerics oracle and float64
autograd) for every variant and adversarial case, then timing against FA4's BF16
backward (flash_attn.cute) in the same process.

From the repo root of a plain checkout on the device machine:

    source .dev/activate && python3 tests/sm90_bwd/run_on_device.py --out $OUT

Writes ``$OUT/sm90_bwd_results.json`` and prints a PASS/FAIL table and a timing table.
``--no-bench`` skips timing; ``--quick`` runs d128 causal only. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--watchdog", type=int, default=560)
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog, exit=True)  # a hung kernel must not eat the call
    import bwd_modules as bm
    import torch

    results = []
    out_path = os.path.join(a.out, "sm90_bwd_results.json")

    def log(row):
        print(json.dumps(row), flush=True)
        results.append(row)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)

    log({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
         "command": " ".join(sys.argv)})
    gen = tempfile.mkdtemp(prefix="fp4gen_bwd_")
    # (head_dim, causal, deterministic, fp8): fp8 True = FP8 S, dP, dV; "s" = FP8 S only
    variants = [(128, True, False, False), (128, True, False, True)] if a.quick else [
        (128, True, False, False), (64, True, False, False), (128, False, False, False), (128, True, True, False),
        (128, True, False, True), (64, True, False, True), (128, False, False, True), (128, True, False, "s")]
    mods = {}
    for d, causal, det, fp8 in variants:
        t = time.time()
        try:
            plan = bm.make_plan(d, causal, det, fp8)
            mod = bm.load_module(plan, gen)
            mod._bwd_compile(None)
            mods[(d, causal, det, fp8)] = (plan.spec, mod)
            log({"compiled": f"d{d} causal={causal} det={det} fp8={fp8}", "s": round(time.time() - t, 1)})
        except Exception:  # noqa: BLE001 (recorded, the run goes on)
            log({"compile_error": f"d{d} causal={causal} det={det} fp8={fp8}", "error": traceback.format_exc()[-1500:]})

    table = []
    for (d, causal, det, fp8), (spec, mod) in mods.items():
        cases = list(bm.CASES) if not det else ["basic", "ragged_200", "gqa_6_2"]
        for case in cases:
            try:
                row = bm.check_case(mod, spec, case)
            except Exception:  # noqa: BLE001
                row = {"case": case, "d": d, "causal": causal, "deterministic": det, "pass": False,
                       "error": traceback.format_exc()[-1200:]}
            log(row)
            table.append(row)
        if det:  # bitwise repeatability
            q, k, v, do = bm.make_inputs("basic", d, seed=3)
            o, lse = bm.torch_forward(q, k, v, causal, spec.scale)
            r1 = mod.backward(q, k, v, o, lse, do)
            r2 = mod.backward(q, k, v, o, lse, do)
            same = all(torch.equal(x, y) for x, y in zip(r1, r2))
            row = {"case": "repeatable", "d": d, "causal": causal, "deterministic": det, "pass": same}
            log(row)
            table.append(row)

    print("\n== correctness (rel-L2 vs oracle | vs f64 | oracle vs f64) ==")
    for r in table:
        errs = " ".join(
            f"{n}={r[n]['vs_oracle']:.2e}|{r[n]['vs_f64']:.2e}|{r[n]['oracle_vs_f64']:.2e}"
            for n in ("dq", "dk", "dv") if n in r)
        tag = (f"d{r['d']} {'causal' if r['causal'] else 'full  '} {'det' if r['deterministic'] else '   '} "
               f"{'fp8' if r.get('fp8') else 'bf16'}")
        print(f"{'PASS' if r['pass'] else 'FAIL'}  {tag}  {r['case']:<14} {errs} {r.get('error', '')[-300:]}")
        if "diag" in r:
            print("      per-tile rel-L2 vs oracle:", json.dumps(r["diag"])[:600])
    n_pass = sum(r["pass"] for r in table)
    print(f"{n_pass}/{len(table)} passed")

    if a.no_bench:
        return
    timed = [(name, mods[key][1]) for name, key in (("bf16", (128, True, False, False)),
                                                    ("fp8", (128, True, False, True)),
                                                    ("fp8_s_only", (128, True, False, "s"))) if key in mods]
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001
        log({"fa4": "unavailable", "error": str(e)[:300]})
        return
    from triton.testing import do_bench

    from attention_bwd import kernel_only_call  # bench/: relaunches the kernel alone (turn counters reset)

    print("\n== timing, causal d128 backward, H16, B*S = 32k (median ms; TFLOP/s = 2.5 * 2*B*H*S*S*D / t;"
          " 'all' = the whole backward() call incl. quantization and pre/post-processing, 'kernel' = the"
          " launch alone) ==")
    for S in (4096, 8192, 16384):
        B, H, D = 32768 // S, 16, 128
        row = {"B": B, "S": S, "H": H, "D": D, "causal": True, "pass": "bwd"}
        try:
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            flops = 2.5 * 4 * B * H * S * S * D / 2
            qf, kf, vf = (x.detach().requires_grad_(True) for x in (q, k, v))
            out, lse = flash_attn_func(qf, kf, vf, causal=True, return_lse=True)[:2]
            o, lse = out.detach(), lse.float().contiguous()
            g = torch.autograd.grad(out, (qf, kf, vf), do, retain_graph=True)
            ms = do_bench(lambda: torch.autograd.grad(out, (qf, kf, vf), do, retain_graph=True), return_mode="median")
            row["fa4_ms"], row["fa4_tflops"] = ms, flops / ms / 1e9
            line = f"S{S:5d} B{B}: FA4 {row['fa4_tflops']:.0f}"
            for name, mod in timed:
                try:
                    res = mod.backward(q, k, v, o, lse, do)
                    row[f"{name}_rel_l2_vs_fa4"] = [bm.rel_l2(x, y) for x, y in zip(res, g)]
                    t_all = do_bench(lambda: mod.backward(q, k, v, o, lse, do), return_mode="median")
                    kern, why = kernel_only_call(mod, q, k, v, o, lse, do)
                    if kern is None:
                        raise RuntimeError(why)
                    t_k = do_bench(kern, return_mode="median")
                    row[f"{name}_ms"], row[f"{name}_kernel_ms"] = t_all, t_k
                    row[f"{name}_tflops"], row[f"{name}_kernel_tflops"] = flops / t_all / 1e9, flops / t_k / 1e9
                    line += (f" | {name} all {flops / t_all / 1e9:.0f} ({ms / t_all:.2f}x) kernel {flops / t_k / 1e9:.0f}"
                             f" ({ms / t_k:.2f}x) err {max(row[f'{name}_rel_l2_vs_fa4']):.1e}")
                except Exception:  # noqa: BLE001
                    row[f"{name}_error"] = traceback.format_exc()[-1500:]
                    line += f" | {name} ERROR"
            log(row)
            print(line, flush=True)
        except Exception:  # noqa: BLE001
            log(dict(row, bench_error=traceback.format_exc()[-1500:]))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
