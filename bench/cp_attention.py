#!/usr/bin/env python3
"""Context-parallel attention benchmark (issue 23): fp4gen's ring and all-to-all CP against
PyTorch's context-parallel SDPA, and single-GPU fp4gen, in one run on N GPUs over NCCL.

Implementations (``--impls``, comma-separated):

- ``fp4gen-{bf16,fp8}-{ring,a2a}``: ``fp4gen.parallel.context_parallel_attention`` with the
  BF16 recipe or the FP8 training recipe (examples/sm90_fp8_train_d128.attn's: Q/K E4M3 per
  128-token block, P E4M3 via exp, V E4M3 per tensor, dO E4M3; K/V travel in FP8 on the ring).
  A causal ring's off-diagonal blocks run the same recipe's ``mask none`` kernel: the script
  writes one spec file with both masks (and their backwards) to a temporary directory.
- ``torch-cp-{cudnn,flash}``: ``torch.distributed.tensor.experimental.context_parallel`` around
  ``F.scaled_dot_product_attention(is_causal=True)`` under ``sdpa_kernel(CUDNN_ATTENTION |
  FLASH_ATTENTION)``, BF16, head-tail load balancing (the same shard layout as fp4gen's
  ``balanced=True``), K/V rotation ``--torch-rotate`` ("alltoall": the ring, one shard per step;
  "allgather": all shards at once).
- ``single-fp4gen-{bf16,fp8}``: rank 0 alone, ``fp4gen.attention`` on the whole sequence (the
  causal kernel), at each S in turn until one runs out of memory; the others wait.

Shapes: B = 1, S in --seqlens (the whole sequence; each of W ranks holds S / W), H in --heads,
D = --head-dim, causal. Timing: per iteration a barrier, then CUDA events on each rank around
the call (forward: no autograd; backward: ``o.backward(do)`` after an untimed forward); the
iteration's time is the slowest rank's (an all-reduce MAX), and the row reports the median of
--iters iterations after --warmup. TFLOP/s: causal FLOPs of the whole sequence, 2 B H S^2 D
forward and 2.5x that backward, over the group's time (``tflops``) and per GPU. Scaling:
``speedup_vs_single`` = single-GPU fp4gen time of the same recipe at the same S / CP time, and
``scaling_efficiency`` = speedup / W; where one GPU did not fit S, against the throughput at
the largest S that fit (``single_ref_S`` says which). ``ratio_vs_torch_cp_cudnn``: PyTorch's
CP cuDNN time / this row's time. ``cosine_vs_fp4gen_bf16_ring``: each
implementation's O shard against the BF16 ring's, fp32, on rank 0's shard.

Output: JSON (command, date, device, world, rows) written atomically to --out-dir (default
$OUT on a device run, else bench/results/) as <--name>.json.

    torchrun --nproc-per-node 2 bench/cp_attention.py --name cp-attention-h200x2
    python3 bench/cp_attention.py --nproc 2 --seqlens 65536 --heads 16   # mp.spawn, NCCL
    python3 bench/cp_attention.py --cpu-smoke --out-dir /tmp/x           # gloo, reference, tiny

``--cpu-smoke``: 2 gloo processes on the CPU, the reference backend, S = 256, H = 2, D = 32,
one iteration; checks that the script runs end to end (tests/bench/test_cp_attention.py), not a
measurement. docs/parallel.md says how to run it on two H200s.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

RECIPES = {
    "bf16": dict(qk="bf16", p="bf16", v="bf16", dO=""),
    "fp8": dict(qk="fp8e4m3(block=128)", p="fp8e4m3 via exp", v="fp8e4m3(scale=tensor)", dO="    dO : fp8e4m3\n"),
}
IMPLS = ("fp4gen-bf16-ring", "fp4gen-fp8-ring", "fp4gen-bf16-a2a", "fp4gen-fp8-a2a",
         "torch-cp-cudnn", "torch-cp-flash", "single-fp4gen-bf16", "single-fp4gen-fp8")
CHECK_REF = "fp4gen-bf16-ring"
# the other ranks wait while rank 0 times single-GPU fp4gen at 256k tokens (minutes at most)
_TIMEOUT = _dt.timedelta(minutes=30)
_MESH = {}

_BLOCK = """
attention cp_{recipe}_{mask}_d{D} {{
  target   {target}
  head_dim {D}
  mask     {mask}
  Q : {qk}
  K : {qk}
  P : {p}
  V : {v}
  O : bf16
  schedule {{
    tile 128 x 128
  }}
  backward {{
    reuse q k lse
{dO}    deterministic false
  }}
}}
"""


def spec_text(D: int, target: str) -> str:
    """Both recipes, each with its causal kernel (the diagonal block, the single GPU) and its
    mask none kernel (a causal ring's off-diagonal blocks), with backwards."""
    return "".join(_BLOCK.format(recipe=r, mask=m, D=D, target=target, **kw)
                   for r, kw in RECIPES.items() for m in ("causal", "none"))


def causal_flops(B, S, H, D, bwd=False) -> float:
    f = 4.0 * B * H * S * S * D * 0.5
    return 2.5 * f if bwd else f


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--seqlens", default="65536,131072,262144", help="comma-separated whole-sequence S")
    p.add_argument("--heads", default="16,32", help="comma-separated H")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--passes", default="fwd,bwd", help="fwd, bwd or both")
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: every GPU); ignored "
                   "under torchrun")
    p.add_argument("--torch-rotate", default="alltoall", choices=("alltoall", "allgather"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--name", default=None, help="output file stem (default cp-attention-<date>)")
    p.add_argument("--out-dir", default=None, help="default $OUT, else bench/results")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, reference backend, tiny shapes")
    a = p.parse_args(argv)
    a.impls = [s for s in a.impls.split(",") if s]
    bad = [s for s in a.impls if s not in IMPLS]
    if bad:
        p.error(f"unknown implementation {bad[0]} (choose from {', '.join(IMPLS)})")
    a.passes = [s for s in a.passes.split(",") if s]
    if not a.passes or any(s not in ("fwd", "bwd") for s in a.passes):
        p.error("--passes takes fwd, bwd or fwd,bwd")
    try:
        a.seqlens = [int(s) for s in a.seqlens.split(",") if s]
        a.heads = [int(s) for s in a.heads.split(",") if s]
    except ValueError as e:
        p.error(f"--seqlens / --heads take comma-separated integers ({e})")
    if a.cpu_smoke:
        a.seqlens, a.heads, a.head_dim, a.warmup, a.iters = [256], [2], 32, 0, 1
    a.name = a.name or "cp-attention-" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M")
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


class _Timer:
    """Milliseconds of one call on this rank: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn) -> float:
        import torch

        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)


def _slowest(ms: float, device) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return float(t.item())


def time_group(setup, call, args, device, timer) -> list:
    """[the slowest rank's ms] per timed iteration: ``state = setup()`` untimed, then ``call(state)``
    timed, every rank starting together (a barrier)."""
    import torch.distributed as dist

    out = []
    for it in range(args.warmup + args.iters):
        state = setup()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        dist.barrier()
        ms = _slowest(timer(lambda: call(state)), device)
        if it >= args.warmup:
            out.append(ms)
        del state
    return out


# ---------------------------------------------------------------------------
# The implementations
# ---------------------------------------------------------------------------


def _inputs(B, S, H, D, device, dtype):
    """The whole-sequence q, k, v, dO, the same on every rank (one seed)."""
    import torch

    g = torch.Generator(device=device).manual_seed(1234)
    return [torch.randn(B, S, H, D, generator=g, device=device, dtype=dtype) for _ in range(4)]


def run_fp4gen_cp(recipe, mode, full, shape, spec_path, args, device, timer, backend):
    import torch

    from fp4gen import parallel

    B, S, H, D = shape
    diag, none = f"{spec_path}::cp_{recipe}_causal_d{D}", f"{spec_path}::cp_{recipe}_none_d{D}"
    ql, kl, vl, dol = (parallel.shard_for_cp(x, None) for x in full)

    def fwd(grad):
        qs, ks, vs = (x.detach().requires_grad_(grad) for x in (ql, kl, vl))
        with torch.set_grad_enabled(grad):
            o = parallel.context_parallel_attention(qs, ks, vs, spec=diag, full_spec=none, causal=True, mode=mode,
                                                    backend=backend)
        return o

    res = {}
    if "fwd" in args.passes:
        res["fwd"] = time_group(lambda: None, lambda _: fwd(False), args, device, timer)
    if "bwd" in args.passes:
        res["bwd"] = time_group(lambda: fwd(True), lambda o: o.backward(dol), args, device, timer)
    o = fwd(False)
    return res, o.detach(), parallel.last_comm_stats()


def run_torch_cp(kind, full, shape, args, device, timer):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch.distributed as dist

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kind]
    if device.type not in _MESH:  # one mesh (over the default group) for every shape
        _MESH[device.type] = init_device_mesh(device.type, (dist.get_world_size(),))
    mesh = _MESH[device.type]
    set_rotate_method(args.torch_rotate)
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in full)  # SDPA's (B, H, S, D)
    with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers={q, k, v, do}), sdpa_kernel([backend]):
        # inside the context q, k, v, do are this rank's head-tail shards, SDPA is the ring

        def fwd(grad):
            qs, ks, vs = (x.detach().requires_grad_(grad) for x in (q, k, v))
            with torch.set_grad_enabled(grad):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

        res = {}
        if "fwd" in args.passes:
            res["fwd"] = time_group(lambda: None, lambda _: fwd(False), args, device, timer)
        if "bwd" in args.passes:
            res["bwd"] = time_group(lambda: fwd(True), lambda o: o.backward(do), args, device, timer)
        o = fwd(False).detach().transpose(1, 2).contiguous()
    return res, o, {"rotate": args.torch_rotate}


def run_single(recipe, full, shape, spec_path, args, device, timer, backend):
    """Rank 0 alone on the whole sequence, with no collective inside (rank 0 may run out of
    memory midway); the other ranks wait in the caller's all-reduce of ``ok``."""
    import torch
    import torch.distributed as dist

    import fp4gen

    B, S, H, D = shape
    spec = f"{spec_path}::cp_{recipe}_causal_d{D}"
    res, ok = {}, torch.ones(1, device=device)
    if dist.get_rank() != 0:
        return res, ok, None

    def fwd(grad):
        qs, ks, vs = (x.detach().requires_grad_(grad) for x in full[:3])
        with torch.set_grad_enabled(grad):
            return fp4gen.attention(qs, ks, vs, spec=spec, causal=True, backend=backend)

    def local(setup, call):
        out = []
        for it in range(args.warmup + args.iters):
            state = setup()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ms = timer(lambda: call(state))
            if it >= args.warmup:
                out.append(ms)
            del state
        return out

    try:
        if "fwd" in args.passes:
            res["fwd"] = local(lambda: None, lambda _: fwd(False))
        if "bwd" in args.passes:
            res["bwd"] = local(lambda: fwd(True), lambda o: o.backward(full[3]))
        with torch.no_grad():  # rank 0's shard of O, for the cosine against the CP rows
            from fp4gen import parallel

            o = parallel.shard_for_cp(fwd(False), None)
    except torch.cuda.OutOfMemoryError:
        res, ok, o = {}, ok.zero_(), None
        torch.cuda.empty_cache()
    return res, ok, o


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------


def _cosine(a, b) -> float:
    a, b = a.float().flatten(), b.float().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def ensure_fp4gen_importable():
    """fp4gen from this checkout where it is not pip-installed (the GPU machine's plain copy);
    every spawned rank calls it again."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from checkout import ensure_fp4gen_importable as ensure

    ensure()


def worker(rank: int, world: int, args, store_dir: str | None, out_path: str):
    import torch
    import torch.distributed as dist

    ensure_fp4gen_importable()

    if args.cpu_smoke:
        torch.set_num_threads(1)
        device, pg, backend = torch.device("cpu"), "gloo", "reference"
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, pg, backend = torch.device("cuda", local), "nccl", "auto"
    if store_dir is not None:
        store = dist.FileStore(os.path.join(store_dir, "store"), world)
        dist.init_process_group(pg, store=store, rank=rank, world_size=world, timeout=_TIMEOUT)
    else:  # torchrun's environment
        dist.init_process_group(pg, timeout=_TIMEOUT)
    timer = _Timer(device.type == "cuda")
    tmp = tempfile.mkdtemp(prefix=f"cp-bench-r{rank}-")
    spec_path = Path(tmp) / "cp_bench.attn"
    spec_path.write_text(spec_text(args.head_dim, "reference" if args.cpu_smoke else "sm90a"))
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    rows, single_fits = [], {"bf16": True, "fp8": True}
    try:
        for H in args.heads:
            for S in args.seqlens:
                shape = (1, S, H, args.head_dim)
                full = _inputs(*shape, device, dtype)
                ref_o = None
                for impl in args.impls:
                    base = dict(impl=impl, B=1, S=S, H=H, D=args.head_dim, causal=True, world=world)
                    if impl.startswith("single-") and not single_fits[impl.split("-")[-1]]:
                        rows.append(dict(base, error="skipped: a smaller S did not fit on one GPU"))
                        continue
                    try:
                        o, extra = None, {}
                        if impl.startswith("fp4gen-"):
                            _, recipe, mode = impl.split("-")
                            res, o, extra = run_fp4gen_cp(recipe, mode, full, shape, spec_path, args, device, timer,
                                                          backend)
                        elif impl.startswith("torch-cp-"):
                            res, o, extra = run_torch_cp(impl.split("-")[-1], full, shape, args, device, timer)
                        else:
                            recipe = impl.split("-")[-1]
                            res, ok, o = run_single(recipe, full, shape, spec_path, args, device, timer, backend)
                            dist.all_reduce(ok, dist.ReduceOp.MIN)
                            if not ok.item():
                                single_fits[recipe] = False
                                rows.append(dict(base, error="out of memory on one GPU"))
                                continue
                    except Exception as e:  # one implementation failing must not lose the others' rows
                        if rank == 0:
                            traceback.print_exc()
                        rows.append(dict(base, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
                        dist.barrier()
                        continue
                    cos = None
                    if o is not None:
                        if impl == CHECK_REF:
                            ref_o = o
                        elif ref_o is not None:
                            cos = _cosine(o, ref_o)
                    for pas, times in res.items():
                        med = statistics.median(times)
                        fl = causal_flops(1, S, H, args.head_dim, pas == "bwd")
                        rows.append(dict(base, **{"pass": pas, "ms": med, "ms_all": times,
                                                  "tflops": fl / (med * 1e-3) / 1e12,
                                                  "tflops_per_gpu": fl / (med * 1e-3) / 1e12 / (
                                                      1 if impl.startswith("single-") else world),
                                                  "cosine_vs_fp4gen_bf16_ring": cos,
                                                  "comm": {k: v for k, v in extra.items()
                                                           if k in ("exchange_fwd", "fwd_bytes_per_step",
                                                                    "bwd_bytes_per_step", "rotate")}}))
                    del o
                del full, ref_o
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if rank == 0:  # after every shape: a run cut short keeps what it measured
                    add_scaling(rows)
                    save(args, rows, out_path, device, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def add_scaling(rows):
    """speedup_vs_single and scaling_efficiency of every CP row (see the module docstring), and
    ratio_vs_torch_cp_cudnn (PyTorch CP cuDNN time / this time, same pass and shape)."""
    single = {(r["impl"].split("-")[-1], r["pass"], r["H"], r["S"]): r for r in rows
              if r["impl"].startswith("single-") and "ms" in r}
    torch_cp = {(r["pass"], r["H"], r["S"]): r for r in rows if r["impl"] == "torch-cp-cudnn" and "ms" in r}
    for r in rows:
        if "ms" not in r or r["impl"].startswith("single-"):
            continue
        anchor = torch_cp.get((r["pass"], r["H"], r["S"]))
        if anchor is not None:
            r["ratio_vs_torch_cp_cudnn"] = anchor["ms"] / r["ms"]
        recipe = "fp8" if "-fp8-" in r["impl"] else "bf16"  # torch CP is BF16
        same = single.get((recipe, r["pass"], r["H"], r["S"]))
        if same is not None:
            r["single_ref_S"] = r["S"]
            r["speedup_vs_single"] = same["ms"] / r["ms"]
        else:
            fits = [s for (rc, p, h, s) in single if (rc, p, h) == (recipe, r["pass"], r["H"])]
            if not fits:
                continue
            ref = single[(recipe, r["pass"], r["H"], max(fits))]
            r["single_ref_S"] = max(fits)
            r["speedup_vs_single"] = r["tflops"] / ref["tflops"]  # throughput ratio across S
        r["scaling_efficiency"] = r["speedup_vs_single"] / r["world"]


def save(args, rows, out_path, device, world):
    import torch

    doc = {"command": "python3 bench/cp_attention.py " + shlex.join(args.argv),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "world": world, "torch": torch.__version__, "torch_rotate": args.torch_rotate,
           "cpu_smoke": args.cpu_smoke, "rows": rows}
    out = Path(out_path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)  # a reader never sees half a file


def _spawned(rank, world, args, store_dir, out_path):
    worker(rank, world, args, store_dir, out_path)


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_fp4gen_importable()
    out_dir = Path(args.out_dir or os.environ.get("OUT") or HERE / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = str(out_dir / f"{args.name}.json")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, out_path)
    else:
        import torch
        import torch.multiprocessing as mp

        if args.cpu_smoke:
            world = args.nproc or 2
        else:
            if not torch.cuda.is_available():
                print("cp_attention: no CUDA GPU here; use --cpu-smoke for the CPU check", file=sys.stderr)
                return 1
            world = args.nproc or torch.cuda.device_count()
            if world > torch.cuda.device_count():
                print(f"cp_attention: --nproc {world} but {torch.cuda.device_count()} GPUs", file=sys.stderr)
                return 1
        with tempfile.TemporaryDirectory(prefix="cp-bench-store-") as store:
            mp.spawn(_spawned, args=(world, args, store, out_path), nprocs=world, join=True)
    if Path(out_path).exists():
        print(f"cp_attention: wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
