"""Host (Python) cost per call of fp4gen.attention, forward and forward + backward, without kernels.

The generated module's forward / backward / quantize_inputs and the reference backend are replaced
by stubs that return correctly shaped tensors and compute nothing, and the dispatcher is told the
(CPU) tensors sit on an sm90a GPU; what is left is fp4gen's per-call path: argument checks, spec
resolution, kernel choice, the custom ops' dispatch, autograd's bookkeeping, the forward state and
(for ``transforms``) the outlier transforms' torch steps. Each case is timed in rounds of ``--calls``
calls; the JSON has the median (and min) over rounds of microseconds per call, and ``stub_us``, what
the stubs themselves cost per call (their tensor allocations), which the totals include. Times are
the thread's CPU time (``time.thread_time_ns``), so that a busy machine's preemptions do not count.

    python3 bench/host_overhead.py --json bench/results/host-overhead-cpu.json

Cases: ``dense`` (the FP8 ds8 training recipe's module: causal, forward state), ``gqa`` (the same
with H = 8, Hkv = 2), ``fused`` (``dense`` on q, k, v views of one fused QKV projection, the stub
module carrying the sm90a host objects, so that torch_ops takes the strided path of issue 24: no
copies; the stubs do not run the hosts' own code), ``varlen`` (a BF16 varlen forward module; the
backward is the reference's), ``transforms`` (FP8 exp forward with K smoothing and V channel
scales; reference backward).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _torch_ops_from(path):
    """``--torch-ops PATH``: time another version of fp4gen/torch_ops.py (e.g. ``git show
    HEAD~1:fp4gen/torch_ops.py > /tmp/old.py``) in place of the installed one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp4gen.torch_ops", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fp4gen.torch_ops"] = mod
    spec.loader.exec_module(mod)
    import fp4gen
    fp4gen.torch_ops = mod


if "--torch-ops" in sys.argv:  # before anything imports the installed one
    _torch_ops_from(sys.argv[sys.argv.index("--torch-ops") + 1])

from fp4gen import torch_ops  # noqa: E402
from fp4gen.frontend import parse_text  # noqa: E402

_FP8 = ("Q : fp8e4m3(block=128); K : fp8e4m3(block=128){smooth}; P : fp8e4m3 via exp; "
        "V : fp8e4m3(scale=tensor){chan}; O : bf16")
SPECS = {
    "dense": "mask causal; " + _FP8 + "; backward { reuse q k lse; dO : fp8e4m3; dS : fp8e4m3; deterministic false }",
    "gqa": "mask causal; " + _FP8 + "; backward { reuse q k lse; dO : fp8e4m3; dS : fp8e4m3; deterministic false }",
    "fused": "mask causal; " + _FP8 + "; backward { reuse q k lse; dO : fp8e4m3; dS : fp8e4m3; deterministic false }",
    "varlen": "mask causal; layout varlen; Q : bf16; K : bf16; P : bf16; V : bf16; O : bf16",
    "transforms": "mask none; " + _FP8,
}
SHAPES = {  # (B, S, H, Hkv, D); varlen: B sequences of S tokens packed
    "dense": (2, 64, 4, 4, 128), "gqa": (2, 64, 8, 2, 128), "fused": (2, 64, 4, 4, 128), "varlen": (2, 64, 4, 4, 128),
    "transforms": (2, 64, 4, 4, 128),
}


def case_spec(name: str):
    on = name == "transforms"
    body = SPECS[name].replace("{smooth}", " smooth" if on else "").replace("{chan}", " channel_scale" if on else "")
    (s,) = parse_text(f"attention hostbench_{name} {{ target sm90a; head_dim 128; {body} }}")
    return s


def stub_module(spec, counter=None, with_hosts: bool = False):
    """A module honouring the generated-module contract whose functions only allocate outputs
    (``with_hosts``: also the sm90a host objects, which the stubs never call)."""
    from fp4gen.device.quantize import transposed_shape

    count = counter if counter is not None else {}
    mod = types.ModuleType("stub")
    mod.KERNEL_NAME, mod.TARGET, mod.SPEC_FILE, mod.PLAN_JSON, mod.SPEC = spec.name, "sm90a", "<stub>", "{}", spec
    b = spec.backward
    fp8_state = b is not None and "q" in getattr(b, "reuse", ()) and spec.q.format.value.startswith("fp8")

    def _bump(k):
        count[k] = count.get(k, 0) + 1

    def forward(q, k, v, *, softmax_scale=None, return_lse=False, prepared=None, sinks=None):
        _bump("forward")
        o, lse = q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        return (o, lse) if return_lse else o

    def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, return_lse=False, sinks=None):
        _bump("forward_varlen")
        o, lse = q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        return (o, lse) if return_lse else o

    def backward(q, k, v, o, lse, do, *, softmax_scale=None, prepared=None):
        _bump("backward")
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def quantize_inputs(q, k, v, for_backward=False, transposed_qk=False):
        _bump("quantize_inputs")
        bq, sq, h, _ = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        f8, f32 = torch.float8_e4m3fn, torch.float32
        out = (q.new_empty(q.shape, dtype=f8), k.new_empty(k.shape, dtype=f8), None,
               q.new_empty((bq, h, -(-sq // 128)), dtype=f32), q.new_empty((bq, hkv, -(-sk // 128)), dtype=f32),
               q.new_empty((bq, hkv), dtype=f32))
        if for_backward:
            out += (v.new_empty(v.shape, dtype=f8),)
        if transposed_qk:
            out += tuple(x.new_empty(transposed_shape(x.shape, op), dtype=f8) for x, op in ((q, "q"), (k, "k")))
        return out

    mod.forward = forward
    if spec.layout.value == "varlen":
        mod.forward_varlen = forward_varlen
    if b is not None:
        mod.backward = backward
    if fp8_state:
        mod.BWD_S_FP8, mod.BWD_DO_FP8, mod.BWD_DS_FP8, mod.QUANT_BLOCK = True, True, True, 128
        mod.quantize_inputs = quantize_inputs
    if with_hosts:  # what torch_ops looks for to pass strided views (_forward_takes_strides, ...)
        from fp4gen.runtime.sm90_bwd_host import BackwardHost
        from fp4gen.runtime.sm90_host import ForwardHost

        mod._HOST = ForwardHost(types.SimpleNamespace(in_fp8=True, varlen=False, kernel_name=spec.name), None,
                                quantizer=object())
        mod._BWD_HOST = BackwardHost(spec.name, None, None, prep=None, quantize=None)
    return mod


def stub_reference(counter=None):
    count = counter if counter is not None else {}

    def _bump(k):
        count[k] = count.get(k, 0) + 1

    def backward(q, k, v, o, lse, do, spec, sinks=None):
        _bump("ref_backward")
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, spec, sinks=None, max_seqlen_q=0, max_seqlen_k=0):
        _bump("ref_backward_varlen")
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    return types.SimpleNamespace(backward=backward, backward_varlen=backward_varlen, __name__="stub-reference")


def install(spec, mod):
    """Make ``spec`` resolve to ``mod`` as a committed generated module would, on a pretend sm90a."""
    from fp4gen.lowering import module_name

    name = f"fp4gen.generated.{module_name(spec.name, 'sm90a')}"
    mod.__name__ = name
    sys.modules[name] = mod
    torch_ops._arch_of = lambda device: "sm90a"


def case_inputs(name: str, requires_grad: bool):
    b, s, h, hkv, d = SHAPES[name]
    # bf16 as a model's activations; the transforms' torch steps compute, and CPU bf16 kernels are
    # slow enough to hide the path in them: float32 there
    dt = torch.float32 if name == "transforms" else torch.bfloat16
    if name == "varlen":
        q, k, v = torch.randn(b * s, h, d, dtype=dt), torch.randn(b * s, hkv, d, dtype=dt), \
            torch.randn(b * s, hkv, d, dtype=dt)
    elif name == "fused":  # views of one (B, S, (H + 2 Hkv) D) projection, as a model's QKV linear gives
        x = torch.randn(b, s, (h + 2 * hkv) * d, dtype=dt, requires_grad=requires_grad)
        q, k, v = (t.view(b, s, -1, d) for t in x.split([h * d, hkv * d, hkv * d], -1))
        return q, k, v
    else:
        q, k, v = torch.randn(b, s, h, d, dtype=dt), torch.randn(b, s, hkv, d, dtype=dt), \
            torch.randn(b, s, hkv, d, dtype=dt)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def call_fn(name: str, spec, backward: bool):
    """A closure running one call (forward, or forward + backward through autograd)."""
    b, s = SHAPES[name][:2]
    q, k, v = case_inputs(name, backward)
    if name == "varlen":
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)

        def fwd():
            return torch_ops.attention_varlen(q, k, v, cu, cu, s, s, spec=spec)
    else:
        def fwd():
            return torch_ops.attention(q, k, v, spec=spec)
    if not backward:
        return fwd
    go = torch.randn(q.shape, dtype=q.dtype)

    def fwd_bwd():
        o = fwd()
        torch.autograd.grad(o, (q, k, v), go)
    return fwd_bwd


def time_per_call(fn, calls: int, rounds: int) -> list[float]:
    for _ in range(min(calls, 100)):  # warm: registry, lookups, caches
        fn()
    out = []
    for _ in range(rounds):
        # this thread's CPU time: on a shared machine, time spent preempted is not the path's
        t0 = time.thread_time_ns()
        for _ in range(calls):
            fn()
        out.append((time.thread_time_ns() - t0) / calls / 1e3)
    return out


def stub_cost(name: str, spec, mod, ref, calls: int, rounds: int) -> float:
    """What the stubs cost per forward + backward when called directly (their allocations)."""
    q, k, v = case_inputs(name, False)
    b, s = SHAPES[name][:2]
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)

    def direct():
        if name == "varlen":
            o, lse = mod.forward_varlen(q, k, v, cu, cu, s, s, return_lse=True)
            ref.backward_varlen(q, k, v, o, lse, o, cu, cu, spec)
        elif getattr(mod, "quantize_inputs", None):
            p = mod.quantize_inputs(q, k, v, for_backward=True, transposed_qk=True)
            o, lse = mod.forward(q, k, v, return_lse=True, prepared=p)
            mod.backward(q, k, v, o, lse, o, prepared=p)
        else:
            o, lse = mod.forward(q, k, v, return_lse=True)
            ref.backward(q, k, v, o, lse, o, spec)
    return statistics.median(time_per_call(direct, calls, rounds))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per round (default 2000)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per case (default 7)")
    ap.add_argument("--cases", default=",".join(SPECS), help=f"comma-separated, of {', '.join(SPECS)}")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--label", default="", help="a note stored with the run (e.g. before/after)")
    ap.add_argument("--torch-ops", help="time this fp4gen/torch_ops.py instead of the installed one")
    ap.add_argument("--compare", metavar="OLD_TORCH_OPS",
                    help="same run, interleaved: this torch_ops.py (before) against the installed one (after), "
                         "--processes pairs of processes; the JSON has both and after/before")
    ap.add_argument("--processes", type=int, default=3, help="process pairs for --compare (default 3)")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(a, argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(1)
    ref = stub_reference()
    torch_ops._reference = lambda: ref
    rows = []
    for name in a.cases.split(","):
        if name not in SPECS:
            ap.error(f"unknown case {name!r}; cases: {', '.join(SPECS)}")
        spec = case_spec(name)
        mod = stub_module(spec, with_hosts=name == "fused")
        install(spec, mod)
        assert torch_ops.explain(spec, "cpu")["forward"].startswith("generated:"), torch_ops.explain(spec, "cpu")
        fwd = time_per_call(call_fn(name, spec, False), a.calls, a.rounds)
        both = time_per_call(call_fn(name, spec, True), a.calls, a.rounds)
        row = {"case": name, "shape_bshkvd": list(SHAPES[name]),
               "fwd_us_median": round(statistics.median(fwd), 2), "fwd_us_min": round(min(fwd), 2),
               "fwd_bwd_us_median": round(statistics.median(both), 2), "fwd_bwd_us_min": round(min(both), 2),
               "stub_us": round(stub_cost(name, spec, mod, ref, a.calls, a.rounds), 2)}
        rows.append(row)
        print(f"{name:11s} fwd {row['fwd_us_median']:8.1f} us  fwd+bwd {row['fwd_bwd_us_median']:8.1f} us  "
              f"(stubs {row['stub_us']:.1f} us)", flush=True)
    if a.json:
        out = {"command": "python3 bench/host_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "label": a.label,
               "device": f"CPU ({platform.processor() or platform.machine()}), 1 torch thread",
               "torch": torch.__version__, "python": platform.python_version(),
               "calls": a.calls, "rounds": a.rounds, "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def compare(a, argv) -> int:
    """Alternate before/after processes (one torch_ops each: the custom ops register once per
    process); per case the median over processes of each process's median."""
    import subprocess
    import tempfile

    runs: dict = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.processes):
            for which in ("before", "after"):
                out = Path(tmp) / f"{which}{i}.json"
                cmd = [sys.executable, __file__, "--calls", str(a.calls), "--rounds", str(a.rounds),
                       "--cases", a.cases, "--json", str(out)]
                if which == "before":
                    cmd += ["--torch-ops", a.compare]
                print(f"[{which} {i + 1}/{a.processes}]", flush=True)
                subprocess.run(cmd, check=True)
                runs[which].append(json.loads(out.read_text()))
    rows = []
    fields = ("fwd_us_median", "fwd_bwd_us_median", "stub_us")
    for j, name in enumerate(a.cases.split(",")):
        row = {"case": name, "shape_bshkvd": list(SHAPES[name])}
        for which in ("before", "after"):
            for f in fields:
                row[f"{which}_{f}"] = round(statistics.median(r["rows"][j][f] for r in runs[which]), 2)
        for f in ("fwd_us_median", "fwd_bwd_us_median"):
            row[f"after_over_before_{f}"] = round(row[f"after_{f}"] / row[f"before_{f}"], 3)
        rows.append(row)
        print(f"{name:11s} fwd {row['before_fwd_us_median']:7.1f} -> {row['after_fwd_us_median']:7.1f} us   "
              f"fwd+bwd {row['before_fwd_bwd_us_median']:7.1f} -> {row['after_fwd_bwd_us_median']:7.1f} us")
    if a.json:
        first = runs["after"][0]
        out = {"command": "python3 bench/host_overhead.py " + " ".join(argv), "date": first["date"],
               "label": a.label, "device": first["device"], "torch": first["torch"], "python": first["python"],
               "calls": a.calls, "rounds": a.rounds, "processes": a.processes,
               "note": "us per call of this thread's CPU time, stub kernels (bench/host_overhead.py's docstring); "
                       "before = --compare's torch_ops.py, after = the installed one; medians over processes",
               "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
