#!/usr/bin/env python3
"""Model-level speed: a transformer's training step and prefill with SDPA or fp4gen attention.

The attention kernels are only part of a step; this script times the whole step (QKV and output
projections, norms, MLP, the vocabulary head, the optimizer) so that the work fp4gen adds around
its kernels (quantization launches, layout copies, host code) is counted against what the kernels
save. Each row is one (model, S, mode, recipe, graphs) point:

- model: ``gpt-d768`` (H 6, D 128, MHA, LayerNorm, GELU MLP: bench/train_gpt.py's shape),
  ``llama-d2048`` (H 16, Hkv 2: GQA 8:1, RMSNorm, SwiGLU), ``llama-d4096`` (H 32, Hkv 4);
  byte-level vocabulary (256), ``--layers`` blocks (default 4), B = ``--tokens`` / S;
- mode: ``train`` (forward, cross-entropy, backward, fused AdamW step) or ``prefill``
  (forward only, inference mode);
- recipe: ``sdpa`` (BF16 SDPA, causal, GQA by ``enable_gqa``), or an fp4gen spec through
  ``fp4gen.attention`` (``--backend generated``: a missing kernel is an error, never the
  reference): see RECIPES;
- graphs: ``eager``, or ``graph`` (the step captured once with ``torch.cuda.graph`` and
  replayed). A capture that fails is a row with ``error`` (it runs in its own process, because a
  failed capture can leave the CUDA context unusable).

Times are CUDA-event medians over ``--iters`` steps after ``--warmup``, in ``--rounds`` rounds
interleaved over the recipes (eager); ``ratio_vs_sdpa`` divides by the SDPA row of the same
(model, S, mode, graphs). ``--profile`` adds, for each (model, S, mode, recipe), one eager step
under torch.profiler: GPU time per kernel class (attention, quantize/prep, GEMM, norm/elementwise,
other) and the top kernels, so that every millisecond of difference has a name.

    python3 bench/model_step.py --name model-step-h200                     # the H200 run
    python3 bench/model_step.py --models gpt-d768 --seqs 128 --recipes sdpa --device cpu --iters 1 --warmup 0
    python3 bench/model_step.py --plot bench/results/model-step-h200.json   # PNG beside it

Output: ``$OUT/<name>.json`` on the device tool (else ``bench/results/<name>.json``) with the
command, environment and rows.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name -> (d_model, heads, kv heads, head_dim, block style)
MODELS = {
    "gpt-d768": (768, 6, 6, 128, "gpt"),
    "llama-d2048": (2048, 16, 2, 128, "llama"),
    "llama-d4096": (4096, 32, 4, 128, "llama"),
}

# recipe -> (spec::kernel or None for SDPA, modes it serves)
RECIPES = {
    "sdpa": (None, ("train", "prefill")),
    "bf16": ("examples/sm90_bf16_d128.attn::sm90_bf16_causal_d128", ("train", "prefill")),
    "fp8": ("examples/sm90_fp8_train_d128.attn::sm90_fp8_train_causal_d128", ("train", "prefill")),
    "fp8-ds8": ("examples/sm90_fp8_train_d128.attn::sm90_fp8_train_ds8_causal_d128", ("train",)),
    "fp8-exp": ("examples/sm90_fp8_exp_d128.attn::sm90_fp8_exp_causal_d128", ("prefill",)),
    "fp8-directp": ("examples/sm90_fp8_directp_d128.attn::sm90_fp8_directp_causal_d128", ("prefill",)),
}

# kernel-name patterns -> class, first match wins (CuTe DSL kernels carry their class names)
KERNEL_CLASSES = (
    ("quantize/prep", re.compile(r"quantize|bwd_prep|Quant|VTranspose|amax", re.I)),
    ("attention", re.compile(r"ForwardKernel|Backward|Attention|flash|fmha|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|sm90_|cublas", re.I)),
    ("norm/elementwise", re.compile(r"elementwise|vectorized|norm|reduce|softmax|gelu|silu|copy|fill|"
                                    r"cat|index|adam|mul|add", re.I)),
)


def ensure_fp4gen_importable():
    sys.path.insert(0, str(HERE))
    from checkout import ensure_fp4gen_importable as ensure

    ensure()


# ---------------------------------------------------------------------------
# model


def build_model(name: str, layers: int, seq: int, attn_core, device, dtype):
    """A decoder of ``layers`` blocks of model ``name`` whose attention core is ``attn_core``."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d_model, n_head, n_kv, head_dim, style = MODELS[name]

    class RMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d_model, (n_head + 2 * n_kv) * head_dim, bias=False)
            self.proj = nn.Linear(n_head * head_dim, d_model, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim], -1)
            o = attn_core(q.view(b, s, n_head, head_dim), k.view(b, s, n_kv, head_dim),
                          v.view(b, s, n_kv, head_dim))
            return self.proj(o.reshape(b, s, n_head * head_dim))

    class SwiGLU(nn.Module):
        def __init__(self):
            super().__init__()
            hidden = 256 * ((8 * d_model // 3 + 255) // 256)
            self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
            self.down = nn.Linear(hidden, d_model, bias=False)

        def forward(self, x):
            g, u = self.gate_up(x).chunk(2, -1)
            return self.down(F.silu(g) * u)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            norm = (lambda: nn.LayerNorm(d_model)) if style == "gpt" else (lambda: RMSNorm(d_model))
            self.ln1, self.ln2 = norm(), norm()
            self.attn = Attention()
            self.mlp = (nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
                        if style == "gpt" else SwiGLU())

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(256, d_model)
            self.pos = nn.Embedding(seq, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, 256, bias=False)

        def forward(self, idx, targets=None):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            if targets is None:
                return logits
            return F.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))

    torch.manual_seed(0)
    return Decoder().to(device=device, dtype=dtype)


def attn_core_for(recipe: str, backend: str):
    """(q, k, v) in (B, S, H|Hkv, D) -> (B, S, H, D), causal."""
    import torch.nn.functional as F

    spec = RECIPES[recipe][0]
    if spec is None:
        def sdpa(q, k, v):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=k.shape[2] != q.shape[2])
            return o.transpose(1, 2)
        return sdpa

    import fp4gen

    def fp4(q, k, v):
        return fp4gen.attention(q, k, v, spec=str(ROOT / spec), causal=True, backend=backend)
    return fp4


# ---------------------------------------------------------------------------
# one point


class Step:
    """A model, its inputs and its step function for one (model, S, mode, recipe)."""

    def __init__(self, args, model_name, seq, mode, recipe, device):
        import torch

        self.mode = mode
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.batch = max(1, args.tokens // seq)
        self.model = build_model(model_name, args.layers, seq, attn_core_for(recipe, args.backend), device, dtype)
        g = torch.Generator(device="cpu").manual_seed(1)
        self.idx = torch.randint(0, 256, (self.batch, seq), generator=g).to(device)
        self.tgt = torch.randint(0, 256, (self.batch, seq), generator=g).to(device)
        self.opt = None
        if mode == "train":
            fused = device.type == "cuda"
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused,
                                         capturable=fused)
        self.loss = None

    def __call__(self):
        import torch

        if self.mode == "prefill":
            with torch.inference_mode():
                return self.model(self.idx)
        self.opt.zero_grad(set_to_none=False)
        self.loss = self.model(self.idx, self.tgt)
        self.loss.backward()
        self.opt.step()
        return self.loss

    def capture(self, warmup: int):
        """Warm up on a side stream, capture one step into a CUDA graph; return its replay."""
        import torch

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(max(warmup, 3)):
                self()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        if self.mode == "prefill":
            with torch.inference_mode(), torch.cuda.graph(graph):
                self.model(self.idx)
        else:
            self.opt.zero_grad(set_to_none=False)
            with torch.cuda.graph(graph):
                self.loss = self.model(self.idx, self.tgt)
                self.loss.backward()
                self.opt.step()
        return graph.replay


def time_ms(fn, warmup: int, iters: int, device) -> list:
    import time

    import torch

    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def kernel_class(name: str) -> str:
    for cls, pat in KERNEL_CLASSES:
        if pat.search(name):
            return cls
    return "other"


def profile_step(step, device) -> dict:
    """GPU time of one eager step by kernel class and the top kernels (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3
    by_class = {}
    for name, ms in kernels.items():
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"gpu_ms_total": round(sum(kernels.values()), 4),
            "gpu_ms_by_class": {k: round(v, 4) for k, v in sorted(by_class.items())},
            "top_kernels": [{"name": n[:160], "ms": round(ms, 4)} for n, ms in top]}


# ---------------------------------------------------------------------------
# runs


def points(args):
    for model in args.models:
        for seq in args.seqs:
            for mode in args.modes:
                yield model, seq, mode, [r for r in args.recipes if mode in RECIPES[r][1]]


def run_eager(args, device) -> list:
    """Every point eager; recipes interleaved round by round, medians over rounds x iters."""
    import torch

    rows = []
    for model, seq, mode, recipes in points(args):
        samples = {r: [] for r in recipes}
        steps, errors, prof = {}, {}, {}
        for r in recipes:
            try:
                steps[r] = Step(args, model, seq, mode, r, device)
                samples[r] += time_ms(steps[r], args.warmup, 1, device)  # compile + first call
                samples[r].clear()
            except Exception as e:  # a row says what failed; the others still run
                errors[r] = f"{type(e).__name__}: {e}"[:500]
        for _ in range(args.rounds):
            for r in list(steps):
                samples[r] += time_ms(steps[r], 1, args.iters, device)
        for r in recipes:
            row = {"model": model, "seq": seq, "batch": max(1, args.tokens // seq), "mode": mode,
                   "recipe": r, "graphs": "eager"}
            if r in errors:
                row["error"] = errors[r]
            else:
                row.update(ms_median=round(statistics.median(samples[r]), 4),
                           ms_min=round(min(samples[r]), 4), ms_max=round(max(samples[r]), 4),
                           n=len(samples[r]))
                if mode == "train" and steps[r].loss is not None:
                    row["loss"] = float(steps[r].loss)
                if args.profile and device.type == "cuda":
                    prof[r] = profile_step(steps[r], device)
                    row["profile"] = prof[r]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run_graph_child(args, device, recipe) -> list:
    """Inside a child process: every point of one recipe captured and replayed."""
    rows = []
    for model, seq, mode, recipes in points(args):
        if recipe not in recipes:
            continue
        row = {"model": model, "seq": seq, "batch": max(1, args.tokens // seq), "mode": mode,
               "recipe": recipe, "graphs": "graph"}
        try:
            step = Step(args, model, seq, mode, recipe, device)
            replay = step.capture(args.warmup)
            ms = time_ms(replay, args.warmup, args.iters * args.rounds, device)
            row.update(ms_median=round(statistics.median(ms), 4), ms_min=round(min(ms), 4),
                       ms_max=round(max(ms), 4), n=len(ms))
            if mode == "train":
                row["loss"] = float(step.loss)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)
            break  # the context may be unusable now: the remaining points say so below
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_graphs(args, argv) -> list:
    rows = []
    for recipe in args.recipes:
        cmd = [sys.executable, __file__, *argv, "--graph-child", recipe]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout_s)
            got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 and not any("error" in r for r in got):
                got.append({"recipe": recipe, "graphs": "graph",
                            "error": f"child exited {out.returncode}: {out.stderr[-400:]}"})
        except subprocess.TimeoutExpired:
            got = [{"recipe": recipe, "graphs": "graph", "error": f"timeout after {args.child_timeout_s} s"}]
        rows += got
        for r in got:
            print(json.dumps(r), flush=True)
    return rows


def add_ratios(rows) -> None:
    base = {(r["model"], r["seq"], r["mode"], r["graphs"]): r["ms_median"] for r in rows
            if r.get("recipe") == "sdpa" and "ms_median" in r}
    for r in rows:
        b = base.get((r.get("model"), r.get("seq"), r.get("mode"), r.get("graphs")))
        if b and "ms_median" in r:
            r["ratio_vs_sdpa"] = round(r["ms_median"] / b, 4)


def plot(json_path: str, png_path: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    rows = [r for r in data["rows"] if "ratio_vs_sdpa" in r and r["recipe"] != "sdpa"]
    panels = sorted({(r["model"], r["mode"], r["graphs"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.5 * max(1, len(panels)), 3.8), squeeze=False)
    for ax, (model, mode, graphs) in zip(axes[0], panels):
        for recipe in sorted({r["recipe"] for r in rows}):
            pts = sorted((r["seq"], r["ratio_vs_sdpa"]) for r in rows
                         if (r["model"], r["mode"], r["graphs"], r["recipe"]) == (model, mode, graphs, recipe))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=recipe)
        ax.axhline(1.0, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} {mode} {graphs}", fontsize=9)
        ax.set_xlabel("S")
        ax.set_ylabel("step time / SDPA's")
        ax.legend(fontsize=7)
    fig.tight_layout()
    png_path = png_path or str(Path(json_path).with_suffix(".png"))
    fig.savefig(png_path, dpi=110)
    return png_path


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=lambda s: s.split(","), default=["gpt-d768", "llama-d2048"])
    ap.add_argument("--seqs", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192, 16384])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["train", "prefill"])
    ap.add_argument("--recipes", type=lambda s: s.split(","), default=list(RECIPES))
    ap.add_argument("--graphs", type=lambda s: s.split(","), default=["eager", "graph"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (B = tokens / S)")
    ap.add_argument("--backend", default="generated", help="fp4gen backend (generated: no fallback)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="one profiled eager step per row")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--name", default="model-step")
    ap.add_argument("--child-timeout-s", type=int, default=240)
    ap.add_argument("--graph-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plot", default=None, metavar="JSON", help="only write the PNG of a result file")
    args = ap.parse_args(argv)
    for name, known, what in ((args.models, MODELS, "model"), (args.recipes, RECIPES, "recipe"),
                              (args.modes, ("train", "prefill"), "mode"), (args.graphs, ("eager", "graph"), "graphs")):
        bad = [x for x in name if x not in known]
        if bad:
            ap.error(f"unknown {what} {', '.join(bad)}; known: {', '.join(known)}")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    ensure_fp4gen_importable()
    import torch

    device = torch.device(args.device)
    if args.graph_child:
        run_graph_child(args, device, args.graph_child)
        return 0
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out = out_dir / f"{args.name}.json"

    def save(rows):  # after each phase, so that a run cut short keeps what it measured
        add_ratios(rows)
        doc = {"command": "python3 bench/model_step.py " + shlex.join(argv),
               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
               "torch": torch.__version__, "rows": rows}
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, out)

    rows = run_eager(args, device) if "eager" in args.graphs else []
    save(rows)
    if "graph" in args.graphs and device.type == "cuda":
        rows += run_graphs(args, argv)
        save(rows)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
