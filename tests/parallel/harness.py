"""Workers for the context-parallel tests: W processes over gloo (torch.multiprocessing spawn,
a FileStore rendezvous in a temporary directory, so no port can be taken by another job).

Every rank builds the same full-sequence inputs from a seed, shards them (``shard_for_cp``), runs
``context_parallel_attention`` forward and backward, and gathers O, LSE and the gradients
(``unshard``); rank 0 also runs the single-process ``fp4gen.attention`` on the full tensors and
the float64 oracle (``numerics.exact``) and saves everything to ``out/<case>.pt``. The tests
compare in the parent process, so a planted fault shows up as a failed comparison there.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
if importlib.util.find_spec("fp4gen") is None or importlib.util.find_spec("fp4gen.ir") is None:
    from fp4gen.runtime.srctree import use_source_tree

    use_source_tree(_ROOT)

import torch  # noqa: E402

SPECS = {
    # every operand and gradient in fp32: the ring's only difference from one process is the
    # order of the fp32 sums (the LSE merge, dQ/dK/dV summed per block)
    "fp32": """
attention cp_fp32 {
  target reference
  head_dim 32
  mask causal
  Q : fp32
  K : fp32
  P : fp32
  V : fp32
  O : fp32
  backward {
    reuse q k lse
    dO : fp32
    dP : fp32
    dS : fp32
    dQ : fp32
    dK : fp32
    dV : fp32
  }
}
""",
    # the BF16 recipe as the kernels run it (bf16 P, O and gradients)
    "bf16": """
attention cp_bf16 {
  target reference
  head_dim 32
  mask causal
  Q : bf16
  K : bf16
  P : bf16
  V : bf16
  O : bf16
  backward {
    reuse q k lse
  }
}
""",
    # the FP8 training recipe (examples/sm90_fp8_train_d128.attn's, at head_dim 32), dS in FP8 too,
    # so K and V travel in FP8 in the backward as well
    "fp8": """
attention cp_fp8 {
  target reference
  head_dim 32
  mask causal
  Q : fp8e4m3(block=128)
  K : fp8e4m3(block=128)
  P : fp8e4m3 via exp
  V : fp8e4m3(block=128)
  O : bf16
  backward {
    reuse q k lse
    dO : fp8e4m3
    dS : fp8e4m3
  }
}
""",
}


def spec_of(name: str):
    from fp4gen import parse_text

    return parse_text(SPECS[name], filename=f"<cp test spec {name}>")[0]


def _faults(fault: str):
    """Plant a fault in this process's fp4gen.parallel (the tests prove the checks catch it)."""
    from fp4gen import parallel

    if fault == "merge":  # forget the running part's weight: the last block wins too much
        def bad_merge(o_acc, lse_acc, o_b, lse_b):
            lse = torch.logaddexp(lse_acc, lse_b)
            wb = torch.exp(lse_b - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse))
            return o_acc + o_b.float() * wb.transpose(1, 2)[..., None], lse
        parallel._merge = bad_merge
    elif fault == "skip":  # drop the block one step before the last
        good = parallel._blocks

        def bad_blocks(rank, src, world, n, cfg):
            return [] if (rank - src) % world == max(1, world - 2) else good(rank, src, world, n, cfg)
        parallel._blocks = bad_blocks
    elif fault == "sync_ring":  # a blocking ring: each transfer is waited before the step's kernels
        class SyncRing(parallel._Ring):
            def start(self, send, tag, step):
                done = super().start(send, tag, step)
                done.recv = super().finish(done)
                return done

            def finish(self, p):
                return p.recv
        parallel._Ring = SyncRing
    elif fault == "late_wait":  # finish hands the buffers out at once and waits only at the next call
        base = parallel._Ring

        class LateWaitRing(base):
            def start(self, send, tag, step):
                LateWaitRing.flush()
                return super().start(send, tag, step)

            def finish(self, p):
                LateWaitRing.flush()
                LateWaitRing.late.append((self, p))
                return p.recv

            @staticmethod
            def flush():
                while LateWaitRing.late:
                    ring, p = LateWaitRing.late.pop(0)
                    base.finish(ring, p)
        LateWaitRing.late = []
        parallel._Ring = LateWaitRing
    elif fault == "inplace_decode":  # decode K/V by writing into the buffer that is still being sent
        good = parallel._Wire.decode

        def bad_decode(self, bufs):
            if self.fp8 is None:
                bufs[0].add_(1.0)
                return bufs[0] - 1.0
            return good(self, bufs)
        parallel._Wire.decode = bad_decode
    elif fault:
        raise ValueError(fault)


def worker(rank: int, world: int, store_dir: str, cases: list, out_dir: str, fault: str = "",
           pg_backend: str = "gloo"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if pg_backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world)
    try:
        _faults(fault)
        for case in cases:
            _run_case(rank, world, case, out_dir)
        # Rank 0 still computes the single-process reference and the oracle after the last
        # collective; a rank that tore its gloo context down meanwhile was seen to abort in CI
        # ("terminate called without an active exception", SIGABRT). Leave together.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Success: the results are on disk. Skip interpreter teardown, where gloo's worker threads
    # can still drop tensors and abort (pytorch/pytorch#179291 describes that crash); an
    # exception above never gets here and reaches the parent with its traceback as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_case(rank, world, case, out_dir):
    import torch.distributed as dist

    import fp4gen
    from fp4gen import parallel, torch_ops
    from fp4gen.numerics import exact

    spec = spec_of(case["spec"]) if case["spec"] in SPECS else case["spec"]  # or "file.attn::name"
    spec_obj = torch_ops.spec_for_key(torch_ops.spec_key(spec))
    dev = torch.device(f"cuda:{rank}") if case.get("device") == "cuda" else torch.device("cpu")
    backend = case.get("backend", "auto")
    B, S, H, Hkv, D = case.get("B", 1), case["S"], case["H"], case.get("Hkv", case["H"]), spec_obj.head_dim
    causal, balanced, mode = case["causal"], case.get("balanced", True), case["mode"]
    dtype = getattr(torch, case.get("dtype", "float32"))
    g = torch.Generator().manual_seed(case.get("seed", 0))
    q = torch.randn(B, S, H, D, generator=g).to(dev, dtype)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dev, dtype)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dev, dtype)
    do = torch.randn(B, S, H, D, generator=g).to(dev, dtype)

    torch_ops.reset_dispatch_counts()
    parallel.set_debug(case.get("debug", False))
    ql, kl, vl = (parallel.shard_for_cp(x, None, balanced=balanced).requires_grad_() for x in (q, k, v))
    kernels = None
    if case.get("profile"):  # the GPU kernels of one ring forward, for the overlap test
        kernels = _profile_forward(lambda: parallel.context_parallel_attention(
            ql, kl, vl, group=None, spec=spec, causal=causal, mode=mode, balanced=balanced,
            full_spec=case.get("full_spec"), backend=backend), os.path.join(out_dir, f"trace-{rank}.json"))
    o_l, lse_l = parallel.context_parallel_attention(ql, kl, vl, group=None, spec=spec, causal=causal, mode=mode,
                                                     balanced=balanced, exchange=case.get("exchange", "auto"),
                                                     full_spec=case.get("full_spec"), backend=backend,
                                                     return_lse=True)
    o_l.backward(parallel.shard_for_cp(do, None, balanced=balanced))
    late = getattr(parallel._Ring, "flush", None)
    if late is not None:  # the late_wait fault's last transfer
        late()
    stats = parallel.last_comm_stats()
    stats["trace"] = parallel.debug_trace()
    stats["traces"] = [None] * world  # every rank's, in rank order
    dist.all_gather_object(stats["traces"], stats["trace"])
    parallel.set_debug(False)
    stats["dispatch"] = torch_ops.dispatch_counts()
    stats["kernels"] = kernels
    got = {name: parallel.unshard(t.detach(), None, balanced=balanced).cpu()
           for name, t in (("o", o_l), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
    got["lse"] = parallel.unshard(lse_l.detach(), None, seq_dim=2, balanced=balanced).cpu()
    if rank != 0:
        return
    if not case.get("compare", True):  # no single-process run or oracle (large profiled cases)
        torch.save({"case": case, "cp": got, "stats": stats}, os.path.join(out_dir, f"{case['name']}.pt"))
        return
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = fp4gen.attention(qf, kf, vf, spec=spec, causal=causal, return_lse=True, backend=backend)
    o.backward(do)
    ref = {"o": o.detach(), "lse": lse, "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}
    q6, k6, v6 = (x.double().requires_grad_() for x in (q, k, v))
    o6, lse6 = exact.attention(q6, k6, v6, scale=spec_obj.scale, window=(-1, 0) if causal else (-1, -1))
    o6.backward(do.double())
    oracle = {"o": o6.detach(), "lse": lse6.detach(), "dq": q6.grad, "dk": k6.grad, "dv": v6.grad}
    torch.save({"case": case, "cp": got, "ref": {n: t.cpu() for n, t in ref.items()},
                "oracle": {n: t.cpu() for n, t in oracle.items()}, "stats": stats},
               os.path.join(out_dir, f"{case['name']}.pt"))


def _profile_forward(call, trace_path: str) -> list:
    """[(name, start_us, end_us)] of the GPU kernels of one ``call()`` (after a warm-up call),
    read from the profiler's Chrome trace (its "kernel" events)."""
    import json
    import time

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from fp4gen import parallel

    # Rank 1 issues its first transfer 50 ms late, so rank 0's NCCL kernel waits for it that long
    # on the GPU: a ring that overlaps runs rank 0's block kernels meanwhile, a blocking one
    # cannot; without the delay a fast transfer could end before the host launches a kernel.
    ring = parallel._Ring
    start = ring.start

    def late_start(self, send, tag, step):
        if step == 0:
            time.sleep(0.05)
        return start(self, send, tag, step)

    with torch.no_grad():
        call()
        torch.cuda.synchronize()
        dist.barrier()
        if dist.get_rank() == 1:
            ring.start = late_start
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        finally:
            ring.start = start
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return [(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
            if e.get("cat") == "kernel" and e.get("ph") == "X"]


def run(world: int, cases: list, tmp_path, fault: str = "", pg_backend: str = "gloo") -> dict:
    """Spawn ``world`` workers (gloo, or nccl with one GPU each) over ``cases``; {case name: the
    saved results of rank 0}."""
    import torch.multiprocessing as mp

    out, store = Path(tmp_path) / "out", Path(tmp_path) / "store"
    out.mkdir(parents=True)
    store.mkdir(parents=True)
    mp.spawn(worker, args=(world, str(store), cases, str(out), fault, pg_backend), nprocs=world, join=True)
    return {c["name"]: torch.load(out / f"{c['name']}.pt") for c in cases}


def rel_max(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


OUTPUTS = ("o", "lse", "dq", "dk", "dv")
