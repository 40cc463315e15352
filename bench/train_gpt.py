#!/usr/bin/env python3
"""Train a small GPT with fp4gen attention or BF16 SDPA, same seed, same data.

The model is a byte-level GPT (pre-LayerNorm, learned positions, GELU MLP,
tied embeddings); only the attention core differs between runs:

- ``--attn sdpa``: ``torch.nn.functional.scaled_dot_product_attention``,
  causal, in bf16 under autocast on CUDA (fp32 on the CPU);
- ``--attn fp4gen --spec FILE.attn[::KERNEL]``: ``fp4gen.torch_ops.attention``
  with that spec's numerics (default: the FP8 P/V training recipe for Hopper,
  examples/sm90_fp8_train_d128.attn). It runs a generated kernel where one
  exists for this GPU and spec, else the reference backend; the JSON records
  which one ran (``backend`` and ``dispatch_counts``).

``--recipe`` names the runs the comparison is made of (explicit
``--attn/--spec/--backend`` flags still win):

- ``sdpa``: BF16 SDPA, the baseline;
- ``bf16``: fp4gen's generated BF16 causal forward + backward (sm90a);
- ``fp8``:  the FP8 P/V recipe, generated FP8 forward (Q, K per-block E4M3,
  P from exp in E4M3, V E4M3) + generated FP8 backward (S from the forward's
  FP8 Q/K, dP and dV in FP8 with dO E4M3, dK and dQ in BF16) (sm90a);
- ``fp8-bf16grad``: the same FP8 forward with an all-BF16 backward;
- ``fp8-ds8``: the FP8 recipe with dK and dQ in FP8 too (``dS : fp8e4m3``: every
  backward MMA in FP8, dS with one power-of-two scale per 64 x 128 tile).

The corpus is the Python standard library's source, byte-level (see
bench/train_data.py): nothing is downloaded. Parameters and batches come from
``--seed``, so every run starts from the same weights and sees the same data.

    python3 bench/train_gpt.py --recipe sdpa                        # on the H200
    python3 bench/train_gpt.py --recipe fp8
    python3 bench/plot_train.py train_sdpa.json train_fp8.json -o train_loss.png
    python3 bench/train_gpt.py --recipe fp8 --backend reference --steps 3 --tiny   # CPU smoke test

Output: ``--out``, else ``$OUT/train_<recipe or attn>.json`` when $OUT is set
(device runs), else ``./train_<recipe or attn>.json``. Loss is logged every
``--log-every`` steps (the mean over that window) with the median step time;
held-out loss every ``--eval-every`` steps and at the end. Every step's time is
kept (``step_ms``); ``step_time`` summarises them after ``--timing-warmup``
steps (kernel compilation, allocator warm-up). A run whose loss turns NaN/Inf
stops there and says so (``diverged_at_step``): divergence is a result.
``--time-budget-s`` stops a run early (``stopped_early_at_step``) so that one
slow run cannot use up a device call.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_SPEC = "examples/sm90_fp8_train_d128.attn::sm90_fp8_train_causal_d128"

# --recipe: (attn, spec, backend) of each run of the comparison
RECIPES = {
    "sdpa": ("sdpa", None, None),
    "bf16": ("fp4gen", "examples/sm90_bf16_d128.attn::sm90_bf16_causal_d128", "generated"),
    "fp8": ("fp4gen", "examples/sm90_fp8_train_d128.attn::sm90_fp8_train_causal_d128", "generated"),
    "fp8-bf16grad": ("fp4gen", "examples/sm90_fp8_train_d128.attn::sm90_fp8_train_bf16grad_causal_d128",
                     "generated"),
    "fp8-ds8": ("fp4gen", "examples/sm90_fp8_train_d128.attn::sm90_fp8_train_ds8_causal_d128", "generated"),
}
RECIPE_LABELS = {"sdpa": "SDPA BF16", "bf16": "fp4gen BF16", "fp8": "fp4gen FP8 P/V, FP8 dO/dV",
                 "fp8-bf16grad": "fp4gen FP8 P/V, BF16 backward", "fp8-ds8": "fp4gen FP8 P/V, FP8 dO/dV/dS"}

sys.path.insert(0, str(HERE))
from train_data import Batches, load_corpus  # noqa: E402


def ensure_fp4gen_importable():
    sys.path.insert(0, str(HERE))
    from checkout import ensure_fp4gen_importable as ensure

    ensure()


# ---------------------------------------------------------------------------
# model


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, head_dim: int, attn_core):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        self.qkv = nn.Linear(d_model, 3 * n_head * head_dim, bias=False)
        self.proj = nn.Linear(n_head * head_dim, d_model, bias=False)
        self.attn_core = attn_core  # (q, k, v) in (B, S, H, D) -> (B, S, H, D), causal

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).unbind(2)
        o = self.attn_core(q, k, v)
        return self.proj(o.reshape(b, s, self.n_head * self.head_dim))


class Block(nn.Module):
    def __init__(self, d_model, n_head, head_dim, attn_core):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, head_dim, attn_core)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, d_model, n_head, head_dim, seq, attn_core, vocab=256):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, head_dim, attn_core) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        # GPT-2: scale the residual projections by depth
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def sdpa_core(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


def fp4gen_core(spec, backend):
    from fp4gen.torch_ops import attention

    def core(q, k, v):
        return attention(q, k, v, spec=spec, causal=True, backend=backend)

    return core


# ---------------------------------------------------------------------------
# run


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=sorted(RECIPES),
                    help="one run of the comparison: sdpa (BF16 SDPA), bf16 (fp4gen generated BF16), "
                         "fp8 (fp4gen FP8 P/V recipe with FP8 dO/dV, generated), fp8-bf16grad (same forward, "
                         "BF16 backward), fp8-ds8 (FP8 recipe with FP8 dS: dK, dQ in FP8 too); sets --attn, --spec, "
                         "--backend")
    ap.add_argument("--attn", choices=("fp4gen", "sdpa"), help="required unless --recipe is given")
    ap.add_argument("--spec",
                    help="fp4gen spec: FILE.attn, or FILE.attn::KERNEL when the file has several "
                         f"(default {DEFAULT_SPEC}); its head_dim sets the model's")
    ap.add_argument("--backend", choices=("auto", "reference", "generated"),
                    help="fp4gen backend (default auto: a generated kernel where one applies; "
                         "generated for the fp4gen recipes)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--tiny", action="store_true",
                    help="a CPU-sized model and data (smoke test); explicit size flags still win")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--head-dim", type=int, help="sdpa runs only; fp4gen takes the spec's")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--corpus-mb", type=float, help="stdlib source to read (default 32, tiny 0.5)")
    ap.add_argument("--log-every", type=int)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--eval-batches", type=int)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--amp", choices=("bf16", "none"),
                    help="autocast dtype (default bf16 on CUDA, none on the CPU)")
    ap.add_argument("--threads", type=int,
                    help="CPU threads for torch (default: torch's; 1 with --tiny, which is faster on a busy CPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--compile-mode", choices=("default", "reduce-overhead"), default="default",
                    help="with --compile: torch.compile's mode (reduce-overhead replays the step's "
                         "kernels as CUDA graphs, which takes the host's launch cost out of the step)")
    ap.add_argument("--timing-warmup", type=int, default=20,
                    help="steps left out of the step-time summary (default 20; at most half the steps)")
    ap.add_argument("--time-budget-s", type=float,
                    help="stop training after this many seconds (the run is then marked stopped early)")
    ap.add_argument("--out", help="JSON path (default $OUT/train_<recipe or attn>.json, else ./)")
    args = ap.parse_args(argv)

    if args.recipe:
        attn, spec, backend = RECIPES[args.recipe]
        if args.attn is not None and args.attn != attn:
            ap.error(f"--recipe {args.recipe} is --attn {attn}, not --attn {args.attn}")
        args.attn = attn
        if attn == "fp4gen":
            args.spec = args.spec or spec
            args.backend = args.backend or backend
    if args.attn is None:
        ap.error("give --recipe or --attn")
    if args.attn == "sdpa" and (args.spec or args.backend):
        ap.error("--spec and --backend are for --attn fp4gen")
    args.spec = args.spec or DEFAULT_SPEC
    args.backend = args.backend or "auto"

    big = dict(layers=6, d_model=768, head_dim=128, seq=1024, batch=16, corpus_mb=32.0,
               log_every=10, eval_every=250, eval_batches=8)
    tiny = dict(layers=2, d_model=256, head_dim=128, seq=128, batch=2, corpus_mb=0.5,
                log_every=1, eval_every=1000, eval_batches=1)
    for name, value in (tiny if args.tiny else big).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.threads is None and args.tiny and not args.device.startswith("cuda"):
        args.threads = 1
    if args.amp is None:
        args.amp = "bf16" if args.device.startswith("cuda") else "none"
    for name in ("steps", "layers", "d_model", "seq", "batch", "log_every", "eval_every", "eval_batches"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.timing_warmup < 0:
        ap.error("--timing-warmup must be >= 0")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        ap.error("--time-budget-s must be positive")
    return ap, args


def step_time_summary(step_ms, warmup: int) -> dict:
    """Median (and spread) of the per-step times, leaving out the first ``warmup`` steps
    (at most half of them, so a short run still has a number)."""
    skip = min(warmup, len(step_ms) // 2)
    kept = sorted(step_ms[skip:])
    if not kept:
        return {"median_ms": None, "mean_ms": None, "p10_ms": None, "p90_ms": None,
                "steps_counted": 0, "steps_skipped": skip}

    def pct(p):
        return kept[min(len(kept) - 1, int(p * (len(kept) - 1) + 0.5))]

    return {"median_ms": statistics.median(kept), "mean_ms": sum(kept) / len(kept),
            "p10_ms": pct(0.10), "p90_ms": pct(0.90), "steps_counted": len(kept), "steps_skipped": skip}


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10% of --lr."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def main(argv=None) -> dict:
    ap, args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return run(ap, args, argv)
    finally:
        torch.set_num_threads(threads)  # main() is also called in-process by the tests


def run(ap, args, argv) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")

    spec_info, backend_info = None, None
    if args.attn == "fp4gen":
        ensure_fp4gen_importable()
        from fp4gen import torch_ops
        from fp4gen.frontend import SpecError

        file_part = args.spec.split("::")[0]
        if not Path(file_part).exists() and (ROOT / file_part).exists():
            args.spec = str(ROOT / args.spec)  # a path relative to the checkout
        try:
            key = torch_ops.spec_key(args.spec, causal=True)
        except SpecError as e:
            ap.exit(2, e.render() if hasattr(e, "render") else f"{e}\n")
        except (torch_ops.AttentionInputError, OSError) as e:
            ap.error(str(e))
        spec = torch_ops.spec_for_key(key)
        head_dim = spec.head_dim
        core = fp4gen_core(args.spec, args.backend)
        spec_info = {"path": args.spec, "kernel": spec.name, "target": spec.target.value,
                     "head_dim": spec.head_dim, "spec_mask": spec.mask.value,
                     "formats": {n: str(spec.operand(n)) for n in ("Q", "K", "P", "V", "O")},
                     "backward_block": spec.backward is not None}
        try:
            backend_info = torch_ops.explain(args.spec, device, causal=True, backend=args.backend)
        except RuntimeError as e:  # backend="generated" with none available
            ap.error(str(e))
        torch_ops.reset_dispatch_counts()
    else:
        head_dim = args.head_dim
        core = sdpa_core
    if args.d_model % head_dim:
        ap.error(f"--d-model {args.d_model} is not a multiple of the head dim {head_dim}")
    n_head = args.d_model // head_dim

    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_corpus(int(args.corpus_mb * 2**20))
    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.d_model, n_head, head_dim, args.seq, core).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    run_model = torch.compile(model, mode=args.compile_mode) if args.compile else model
    train = Batches(corpus.train, args.batch, args.seq, seed=args.seed)
    val_windows = [Batches(corpus.val, args.batch, args.seq, seed=args.seed + 1).next("cpu")
                   for _ in range(args.eval_batches)]

    def autocast():
        if args.amp == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = []
        for x, y in val_windows:
            with autocast():
                losses.append(run_model(x.to(device), y.to(device)).item())
        model.train()
        return sum(losses) / len(losses)

    print(f"[train_gpt] attn={args.attn} params={n_params / 1e6:.1f}M layers={args.layers} "
          f"d_model={args.d_model} heads={n_head}x{head_dim} seq={args.seq} batch={args.batch} "
          f"device={device} amp={args.amp} corpus={corpus.train.numel() / 1e6:.1f}MB", flush=True)
    if backend_info:
        print(f"[train_gpt] fp4gen spec {spec_info['kernel']} ({spec_info['target']}): "
              f"forward={backend_info['forward']} backward={backend_info['backward']}"
              + (f" ({backend_info['reason']})" if backend_info.get("reason") else ""), flush=True)

    log, evals, window_loss, window_ms, step_ms = [], [], [], [], []
    diverged_at, stopped_at = None, None
    tokens_per_step = args.batch * args.seq
    t_start = time.perf_counter()
    for step in range(args.steps):
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = train.next(device)
        sync()
        t0 = time.perf_counter()
        with autocast():
            loss = run_model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        window_ms.append((time.perf_counter() - t0) * 1e3)
        step_ms.append(window_ms[-1])
        lv = loss.item()
        window_loss.append(lv)
        if not math.isfinite(lv):
            diverged_at = step + 1
            print(f"[train_gpt] loss is {lv} at step {step + 1}: stopping (diverged)", flush=True)
        elif (args.time_budget_s is not None and step + 1 < args.steps
              and time.perf_counter() - t_start > args.time_budget_s):
            stopped_at = step + 1
            print(f"[train_gpt] --time-budget-s {args.time_budget_s:g} used up at step {step + 1}: "
                  "stopping early", flush=True)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps or diverged_at or stopped_at:
            ms = statistics.median(window_ms)
            row = {"step": step + 1, "loss": sum(window_loss) / len(window_loss), "lr": lr,
                   "grad_norm": float(grad_norm), "ms_per_step": ms,
                   "tokens_per_s": tokens_per_step / (ms / 1e3)}
            log.append(row)
            print(f"step {step + 1:6d}  loss {row['loss']:.4f}  lr {lr:.2e}  "
                  f"{ms:8.1f} ms/step  {row['tokens_per_s'] / 1e3:8.1f} ktok/s", flush=True)
            window_loss, window_ms = [], []
        if diverged_at or stopped_at:
            break
        if (step + 1) % args.eval_every == 0 and step + 1 != args.steps:
            evals.append({"step": step + 1, "val_loss": evaluate()})
            print(f"step {step + 1:6d}  val_loss {evals[-1]['val_loss']:.4f}", flush=True)
    total_s = time.perf_counter() - t_start
    last_step = len(step_ms)
    final_val = None if diverged_at else evaluate()
    if final_val is not None:
        evals.append({"step": last_step, "val_loss": final_val})
        print(f"final val_loss {final_val:.4f}  ({total_s:.1f} s)", flush=True)
    timing = step_time_summary(step_ms, args.timing_warmup)
    if timing["median_ms"] is not None:
        print(f"[train_gpt] step time: median {timing['median_ms']:.2f} ms over {timing['steps_counted']} "
              f"steps (first {timing['steps_skipped']} left out), "
              f"{tokens_per_step / (timing['median_ms'] / 1e3) / 1e3:.1f} ktok/s", flush=True)

    label = args.recipe or args.attn
    result = {
        "label": label,
        "recipe": args.recipe,
        "display": RECIPE_LABELS.get(args.recipe) if args.recipe else None,
        "attn": args.attn,
        "spec": spec_info,
        "backend": backend_info,
        "dispatch_counts": None,
        "model": {"params": n_params, "layers": args.layers, "d_model": args.d_model,
                  "heads": n_head, "head_dim": head_dim, "seq": args.seq, "vocab": 256},
        "config": vars(args),
        "corpus": corpus.describe(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "log": log,
        "eval": evals,
        "final_val_loss": final_val,
        "diverged_at_step": diverged_at,
        "stopped_early_at_step": stopped_at,
        "steps_run": last_step,
        "ms_per_step": timing["median_ms"],
        "step_time": dict(timing, tokens_per_step=tokens_per_step,
                          note="wall time of forward + backward + clip + optimizer step, CUDA-synchronised; "
                               "median over the steps after the first steps_skipped"),
        "step_ms": [round(x, 3) for x in step_ms],
        "total_s": total_s,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python3 bench/train_gpt.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
    }
    if args.attn == "fp4gen":
        from fp4gen import torch_ops

        result["dispatch_counts"] = torch_ops.dispatch_counts()
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or ".") / f"train_{label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"[train_gpt] wrote {out}", flush=True)
    return result


if __name__ == "__main__":
    main()
