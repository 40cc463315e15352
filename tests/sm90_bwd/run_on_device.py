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


def bench_ms(fn, reps=20, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


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
    variants = [(128, True, False)] if a.quick else [(128, True, False), (64, True, False),
                                                      (128, False, False), (128, True, True)]
    mods = {}
    for d, causal, det in variants:
        t = time.time()
        try:
            plan = bm.make_plan(d, causal, det)
            mod = bm.load_module(plan, gen)
            mod._bwd_compile(None)
            mods[(d, causal, det)] = (plan.spec, mod)
            log({"compiled": f"d{d} causal={causal} det={det}", "s": round(time.time() - t, 1)})
        except Exception as e:
            log({"compile_error": f"d{d} causal={causal} det={det}", "error": traceback.format_exc()[-1500:]})

    table = []
    for (d, causal, det), (spec, mod) in mods.items():
        cases = list(bm.CASES) if not det else ["basic", "ragged_200", "gqa_6_2"]
        for case in cases:
            try:
                row = bm.check_case(mod, spec, case)
            except Exception as e:
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
        tag = f"d{r['d']} {'causal' if r['causal'] else 'full  '} {'det' if r['deterministic'] else '   '}"
        print(f"{'PASS' if r['pass'] else 'FAIL'}  {tag}  {r['case']:<14} {errs} {r.get('error', '')[-300:]}")
        if "diag" in r:
            print("      per-tile rel-L2 vs oracle:", json.dumps(r["diag"])[:600])
    n_pass = sum(r["pass"] for r in table)
    print(f"{n_pass}/{len(table)} passed")

    if a.no_bench or (128, True, False) not in mods:
        return
    spec, mod = mods[(128, True, False)]
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:  # noqa: BLE001
        flash_attn_func = None
        log({"fa4": "unavailable", "error": str(e)[:300]})
    print("\n== timing, causal d128 backward (median ms, TFLOP/s = 2.5 * 2*B*H*S*S*D / t) ==")
    for B, S, H in ((2, 4096, 16), (2, 16384, 16)):
        try:
            D = 128
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = None, None
            row = {"B": B, "S": S, "H": H, "D": D, "causal": True, "pass": "bwd"}
            flops = 2.5 * 4 * B * H * S * S * D / 2
            if flash_attn_func is not None:
                qf, kf, vf = (x.detach().requires_grad_(True) for x in (q, k, v))
                try:
                    res = flash_attn_func(qf, kf, vf, causal=True, return_lse=True)
                    out, lse = res[0], res[1]
                except TypeError:
                    res = flash_attn_func(qf, kf, vf, causal=True)
                    out = res[0] if isinstance(res, tuple) else res
                o = out.detach()

                def fa4():
                    torch.autograd.grad(out, (qf, kf, vf), do, retain_graph=True)
                ms = bench_ms(fa4)
                row["fa4_ms"], row["fa4_tflops"] = ms, flops / ms / 1e9
            if lse is None:
                o, lse = bm.torch_forward(q, k, v, True, D ** -0.5) if S <= 4096 else (None, None)
            if o is None:
                log(dict(row, skipped="no forward available for the timing inputs"))
                continue
            lse = lse.float().contiguous()
            ms = bench_ms(lambda: mod.backward(q, k, v, o, lse, do))
            row["fp4gen_ms"], row["fp4gen_tflops"] = ms, flops / ms / 1e9
            if "fa4_ms" in row:
                row["ratio_vs_fa4"] = row["fa4_ms"] / ms
                # our backward on FA4's own forward state, against FA4's gradients
                dq, dk, dv = mod.backward(q, k, v, o, lse, do)
                g = torch.autograd.grad(out, (qf, kf, vf), do, retain_graph=True)
                row["rel_l2_vs_fa4"] = [bm.rel_l2(x, y) for x, y in zip((dq, dk, dv), g)]
            log(row)
            print(f"B{B} S{S} H{H}: fp4gen {row['fp4gen_ms']:.3f} ms {row['fp4gen_tflops']:.0f} TFLOP/s"
                  + (f" | FA4 {row['fa4_ms']:.3f} ms {row['fa4_tflops']:.0f} TFLOP/s | ratio {row['ratio_vs_fa4']:.2f}"
                     f" | rel-L2 vs FA4 grads {['%.1e' % e for e in row['rel_l2_vs_fa4']]}"
                     if "fa4_ms" in row else ""))
        except Exception:  # noqa: BLE001
            log({"B": B, "S": S, "H": H, "bench_error": traceback.format_exc()[-1500:]})
            continue
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
