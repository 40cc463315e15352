"""The ``fp4gen`` command.

    fp4gen check SPEC...                       parse + plan; diagnostics on stderr
    fp4gen explain SPEC [--kernel K] [--target T] [--json]  what would run each kernel: here, on an H200, a B200
    fp4gen schedule SPEC [--kernel K] [--format text|json|svg|html] [-o FILE [--parents]]
    fp4gen compile SPEC -o DIR [--parents] [--target T] [--kernel K] [--emit py,ptx,cubin]
    fp4gen accuracy SPEC [--kernel K] [--seqlen N] [--heads H] [--batch B] [--seed S] [--json]
                    [--inputs FILE|DIR [--transform T,...]]   saved q/k/v instead of random ones
    fp4gen run SPEC [--kernel K] [--target T] [--device D] [--seqlen N] [--backward]   run once, compare with float64
    fp4gen verify SPEC... [--kernel K] [--json]  compile sm100a kernels on the CPU, check them against the plan
    fp4gen regenerate [--check] [--root DIR]   generated/ from examples/*.attn
    fp4gen selftest [--json]                   Blackwell smoke kit: unit kernels + sm100a examples (sm_100 only)
    fp4gen perf SPEC... [--gpu G] [--backward] [--json]
                                               predicted TFLOP/s and ratio to FA4 BF16 from the SASS (a model)
    fp4gen tune SPEC [--kernel K] [--shapes B,S,H[,D] ...] [--budget-s N] [--limit N] [--write] [--dry-run] [--json]
                                               time the sm90a schedule choices on the GPU; --write keeps the fastest
    fp4gen demo                                compile + schedule + accuracy of the paper's recipe

Exit status: 0 success; 1 a spec error or another user error (one-line
message or diagnostics, never a traceback); 2 bad command-line usage;
3 an internal error (a bug: the message says how to see the traceback).

Outputs are written atomically through ``fp4gen.runtime.fileio.atomic_write``:
only regular files are replaced (never a symlink, a device node or a FIFO), modes
follow the umask, and a missing parent directory is an error unless ``--parents``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

EXIT_OK, EXIT_USER, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class UsageError(Exception):
    """Bad command-line usage discovered after argparse (exit 2)."""


# ---------------------------------------------------------------------------
# helpers


def _err(msg: str) -> None:
    print(f"fp4gen: error: {msg}", file=sys.stderr)


class Progress:
    """One stderr line per slow stage: a stage still running after ``DELAY_S`` seconds prints
    ``fp4gen: <stage> ...`` and, when it ends, the elapsed time on the same line. Quicker stages
    print nothing; so does everything when stderr is not a terminal or with ``--quiet`` (the
    output of scripts and of the tests stays as it was)."""

    DELAY_S = 2.0

    def __init__(self, quiet: bool = False, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = not quiet and callable(isatty) and isatty()

    @contextlib.contextmanager
    def stage(self, what: str):
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        lock = threading.Lock()
        state = {"shown": False, "done": False}

        def show():
            with lock:
                if not state["done"]:
                    print(f"fp4gen: {what} ...", end="", file=self.stream, flush=True)
                    state["shown"] = True

        timer = threading.Timer(self.DELAY_S, show)
        timer.daemon = True
        timer.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            timer.cancel()
            with lock:
                state["done"] = True
                if state["shown"]:
                    dt = time.perf_counter() - t0
                    print(f" {dt:.1f} s" if ok else f" stopped after {dt:.1f} s", file=self.stream, flush=True)


def _load(path: str):
    import fp4gen
    from fp4gen.runtime.fileio import read_text_file

    return fp4gen.parse_text(read_text_file(path), filename=str(path))


def _one_kernel(specs, kernel: Optional[str], what: str):
    from fp4gen.driver import select_specs

    chosen = select_specs(specs, kernel)
    if len(chosen) > 1:
        names = ", ".join(s.name for s in chosen)
        raise UsageError(f"the spec defines several kernels ({names}); choose one with --kernel for {what}")
    return chosen[0]


def _write_output(text: str, path: Optional[str], parents: bool) -> None:
    if path is None or path == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    from fp4gen.runtime.fileio import atomic_write

    atomic_write(path, text, parents=parents)
    print(f"wrote {path}")


def _dump_module():
    try:
        from fp4gen.ir import dump
    except ImportError as e:  # pragma: no cover - the planner's package is part of fp4gen
        raise RuntimeError(f"fp4gen.ir.dump is not available: {e}") from e
    return dump


def _render_plan(plan, fmt: str) -> str:
    dump = _dump_module()
    fn = {"text": "to_text", "json": "to_json", "svg": "to_svg", "html": "to_html"}[fmt]
    if not hasattr(dump, fn):
        raise RuntimeError(f"fp4gen.ir.dump.{fn} is not implemented yet")
    out = getattr(dump, fn)(plan)
    if fmt == "json":
        return json.dumps(out, indent=2, sort_keys=True)
    return out


# ---------------------------------------------------------------------------
# commands


def cmd_check(args) -> int:
    from fp4gen.frontend import SpecError
    from fp4gen.runtime.fileio import InputFileError

    from fp4gen.driver import check_lowering, parse_target, plan_spec, retarget, verify_plan

    target = parse_target(args.target)
    bad_files, n_errors, n_kernels = 0, 0, 0
    for path in args.specs:
        try:
            specs = _load(path)
            errors = []
            if not args.parse_only:
                for spec in specs:
                    try:
                        plan = plan_spec(retarget(spec, target))
                        verify_plan(plan)
                        check_lowering(plan)  # what compile would refuse, refused here
                    except SpecError as e:  # keep checking the other kernels
                        errors.append(e)
        except SpecError as e:
            specs, errors = [], [e]
        except InputFileError as e:
            _err(str(e))
            bad_files += 1
            n_errors += 1
            continue
        if errors:
            bad_files += 1
            for e in errors:
                n_errors += len(e.diagnostics)
                print("\n".join(d.render(e.source_lines) for d in e.diagnostics), file=sys.stderr)
            continue
        n_kernels += len(specs)
        names = ", ".join(s.name for s in specs)
        print(f"ok: {path}: {len(specs)} kernel{'s' * (len(specs) != 1)} ({names})")
    if bad_files:
        print(f"fp4gen: {n_errors} error{'s' * (n_errors != 1)} in {bad_files} of {len(args.specs)} "
              f"file{'s' * (len(args.specs) != 1)}", file=sys.stderr)
        return EXIT_USER
    if len(args.specs) > 1:
        print(f"ok: {n_kernels} kernels in {len(args.specs)} files")
    return EXIT_OK


# The GPUs explain reports on, by the generated target that runs on them.
EXPLAIN_GPUS = (("H200", "sm90a"), ("B200", "sm100a"))


def _explain_target(spec, target: str) -> dict:
    """What ``fp4gen.attention(..., backend="auto")`` would run for ``spec`` on a GPU of ``target``:
    {"forward", "backward"}, each "generated" or "none: <why>" (the refusal at its spec line;
    under backend="auto" a "none" raises NoKernelError, backend="reference" runs the reference).
    A kv_cache spec adds "decode", what ``fp4gen.attention_with_kvcache`` runs ("generated": the
    target's decode kernel, or "none: <why>"); ``fp4gen.attention`` refuses such a spec there
    (its module's forward raises): forward and backward are KV_REFUSED."""
    from fp4gen.frontend import SpecError

    from fp4gen.driver import backward_gaps, check_lowering, plan_spec

    kv = spec.kv_cache is not None
    if spec.target.value != target:
        why = f"none: the spec targets {spec.target.value}"
        return {"forward": why, "backward": why, **({"decode": why} if kv else {})}
    try:
        check_lowering(plan_spec(spec))  # what compile would refuse (fp4gen check says the same)
    except SpecError as e:
        why = "none: " + "; ".join(f"{d.loc}: {d.message}" if d.loc else d.message for d in e.diagnostics)
        return {"forward": why, "backward": why, **({"decode": why} if kv else {})}
    if kv:
        return {"forward": KV_REFUSED, "backward": KV_REFUSED, "decode": "generated"}
    if spec.backward is None:
        bwd = "none: the spec has no backward block"
    else:
        gaps = backward_gaps([spec])  # sm100a's backward planner; sm90a refusals failed the plan above
        bwd = f"none: {gaps[0]}" if gaps else "generated"
    return {"forward": "generated", "backward": bwd}


# fp4gen.attention on a kv_cache spec's generated module: its forward raises, naming the decode entry
KV_REFUSED = "refused: a kv_cache spec (fp4gen.attention_with_kvcache decodes it)"


def _explain_here(spec) -> tuple[str, dict]:
    """(this machine's name, what would run on it)."""
    import torch

    if not torch.cuda.is_available():
        res = {"forward": "reference", "backward": "reference"}
        return "here (cpu)", ({**res, "decode": "reference"} if spec.kv_cache is not None else res)
    from fp4gen.torch_ops import _arch_of

    dev = torch.device("cuda")
    arch = _arch_of(dev)
    name = f"here ({torch.cuda.get_device_name(dev)}, {arch or 'no fp4gen target'})"
    if arch is None:
        why = "none: fp4gen generates for sm90a (H100/H200) and sm100a (B200/GB200) only"
        return name, {"forward": why, "backward": why, **({"decode": why} if spec.kv_cache is not None else {})}
    return name, _explain_target(spec, arch)


def _explain_text(where: str, res: dict) -> str:
    f, b = res["forward"], res["backward"]
    if "decode" in res:  # a kv_cache spec: what decodes it, and whether fp4gen.attention refuses it
        d = res["decode"]
        if d.startswith("none"):
            return f"{where}: decode {d}"
        tgt = f"{res['target']} " if "target" in res else ""
        kernel = f" (the {tgt}decode kernel)" if d == "generated" else ""
        refused = "; fp4gen.attention refuses it" if f == KV_REFUSED else ""
        return f"{where}: decode {d}{kernel} via fp4gen.attention_with_kvcache{refused}"
    if f == b:
        return f"{where}: fwd+bwd {f}"
    return f"{where}: fwd {f}, bwd {b}"


def cmd_explain(args) -> int:
    """One line per kernel: what runs its forward and backward here, on an H200 and on a B200."""
    from fp4gen.driver import parse_target, retarget, select_specs

    specs = [retarget(s, parse_target(args.target)) for s in select_specs(_load(args.spec), args.kernel)]
    rows = []
    for spec in specs:
        here_name, here = _explain_here(spec)
        row = {"kernel": spec.name, "target": spec.target.value, "here": {"machine": here_name, **here}}
        for gpu, tgt in EXPLAIN_GPUS:
            row[gpu] = {"target": tgt, **_explain_target(spec, tgt)}
        if spec.transforms:
            row["transforms"] = _explain_transforms(spec)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for row in rows:
        parts = [_explain_text(row["here"]["machine"], row["here"])]
        parts += [_explain_text(f"{gpu} ({tgt})", row[gpu]) for gpu, tgt in EXPLAIN_GPUS]
        print(f"{row['kernel']}: " + " | ".join(parts))
        if "transforms" in row:
            t = row["transforms"]
            b, h, n = t["example"]
            print(f"  transforms {', '.join(t['names'])}: torch passes before and after the attention on every "
                  f"backend (not fused into the kernel): {t['example_bytes'] / 1e6:.1f} MB of HBM traffic at "
                  f"B={b}, H={h}, S={n} bf16, predicted {t['example_us']:g} us (fp4gen schedule lists the passes)")
    if any("none" in r[g][p] for r in rows for g, _ in EXPLAIN_GPUS for p in ("forward", "backward")
           if "decode" not in r[g]):
        print("(none: fp4gen.attention with backend='auto' raises NoKernelError there; "
              "backend='reference' runs the exact, slow reference)")
    if any(r[g].get("decode", "").startswith("none") for r in rows for g, _ in EXPLAIN_GPUS):
        print("(decode none: fp4gen.attention_with_kvcache with backend='auto' raises NoKernelError there; "
              "backend='reference' runs the reference decode)")
    return EXIT_OK


def _explain_transforms(spec) -> dict:
    """The spec's outlier transforms and their cost as the plan records it (ir.plan.transforms_plan)."""
    from fp4gen.ir.plan import transforms_plan

    t = transforms_plan(spec)
    return {"names": list(t.transforms), "runs": "torch passes around the attention (every backend), not fused",
            "example": list(t.example), "example_bytes": t.example_bytes, "example_us": t.example_us,
            "hadamard_seed": spec.transforms.hadamard_seed,
            **({"sink_tokens": spec.transforms.sink_tokens} if spec.transforms.sink_tokens else {})}


def cmd_schedule(args) -> int:
    from fp4gen.driver import parse_target, plan_spec, retarget, select_specs

    specs = select_specs(_load(args.spec), args.kernel)
    target = parse_target(args.target)
    if args.format != "text" and len(specs) > 1:
        _one_kernel(specs, None, f"--format {args.format}")
    parts = [_render_plan(plan_spec(retarget(s, target)), args.format) for s in specs]
    _write_output("\n\n".join(p.rstrip("\n") for p in parts), args.output, args.parents)
    return EXIT_OK


def cmd_compile(args) -> int:
    from fp4gen.driver import backward_gaps, compile_specs, emit_artifacts, parse_target, select_specs

    emit = [e.strip() for e in args.emit.split(",") if e.strip()]
    bad = [e for e in emit if e not in ("py", "ptx", "cubin")]
    if bad or not emit:
        raise UsageError(f"--emit takes a comma-separated list of py, ptx, cubin; got '{args.emit}'")
    specs = select_specs(_load(args.spec), args.kernel)
    progress = Progress(getattr(args, "quiet", False))
    written: list[Path] = []
    try:
        with progress.stage(f"planning and rendering {len(specs)} kernel{'s' * (len(specs) != 1)}"):
            paths = compile_specs(specs, args.output, target=args.target, parents=args.parents, written=written)
    except BaseException:  # an error or Ctrl-C: say which modules are new and which are not
        if len(specs) > 1:
            names = ", ".join(p.name for p in written) or "none"
            print(f"fp4gen: compile stopped: wrote {len(written)} of {len(specs)} modules to {args.output} "
                  f"({names})", file=sys.stderr)
        raise
    for p in paths:
        print(f"wrote {p}")
    for line in backward_gaps(specs, target=args.target):  # the forward was written; say what was not
        print(f"warning: {line}", file=sys.stderr)
    extra = [e for e in emit if e != "py"]
    if extra:
        for i, (spec, p) in enumerate(zip(specs, paths), 1):
            tgt = (parse_target(args.target) or spec.target).value
            with progress.stage(f"[{i}/{len(specs)}] compiling {spec.name} ({tgt}) to {','.join(extra)}"):
                dump = emit_artifacts(p, tgt, extra)
            for f in sorted(dump.rglob("*")):
                if f.is_file() and f.suffix.lstrip(".") in extra:
                    print(f"wrote {f}")
    return EXIT_OK


def _accuracy_report(spec, args) -> dict:
    from fp4gen.numerics.accuracy import report

    if spec.transforms:
        return _accuracy_report_transformed(spec, args)
    return report(spec, seqlen=args.seqlen, heads=args.heads, batch=args.batch, seed=args.seed)


def _accuracy_report_transformed(spec, args) -> dict:
    """The random-input report of a spec with outlier transforms: the inputs ``report`` draws
    (q, k, v from one seeded generator), through the transforms, the reference and back
    (``accuracy.report_case``), against float64 attention of the untransformed inputs. Forward
    only: the report's backward has no transform steps (fp4gen.attention differentiates them)."""
    import torch

    from fp4gen.driver import UserError
    from fp4gen.ir.spec import Layout
    from fp4gen.numerics import accuracy, activations

    if spec.layout is Layout.VARLEN:
        raise UserError(f"{spec.name}: the accuracy report of a varlen spec with outlier transforms is not "
                        "implemented; drop the transforms or use a dense spec")
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.seqlen, args.heads, spec.head_dim)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    case = activations.Case(f"randn(seed={args.seed})", q, k, v)
    t = spec.transforms
    try:
        rep = accuracy.report_case(spec, case, t.names, hadamard_seed=t.hadamard_seed,
                                   sink_tokens=t.sink_tokens or 1)
    except ValueError as e:
        raise UserError(f"{spec.name}: {e}") from None
    for key in ("_o", "_o_ref", "per_head"):
        rep.pop(key, None)
    if spec.backward is not None:
        rep.setdefault("notes", []).append("forward only: the transforms' backward runs in fp4gen.attention")
    return rep


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # torch / numpy scalars
        try:
            return x.item()
        except (ValueError, RuntimeError):
            return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "value"):  # enums
        return x.value
    return str(x)


def _format_report(name: str, rep: dict) -> str:
    lines = [f"{name}:"]
    first = ("cosine", "rel_l2")
    keys = [k for k in first if k in rep] + sorted(k for k in rep if k not in first and k != "kernel")
    for k in keys:
        v = rep[k]
        if isinstance(v, dict):
            lines.append(f"  {k}:")
            lines += [f"    {kk}: {_fmt_value(vv)}" for kk, vv in v.items()]
        else:
            lines.append(f"  {k}: {_fmt_value(v)}")
    return "\n".join(lines)


def _fmt_value(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def cmd_accuracy(args) -> int:
    from fp4gen.driver import parse_target, retarget, select_specs

    specs = select_specs(_load(args.spec), args.kernel)
    target = parse_target(args.target)
    if getattr(args, "inputs", None) is not None:
        return _accuracy_inputs([retarget(s, target) for s in specs], args)
    if getattr(args, "transform", None):
        raise UsageError("--transform needs --inputs (the random-input report has no transforms)")
    progress = Progress(getattr(args, "quiet", False))
    reports = []
    for i, spec in enumerate(specs, 1):
        with progress.stage(f"[{i}/{len(specs)}] accuracy of {spec.name} at S={args.seqlen}"):
            rep = _jsonable(_accuracy_report(retarget(spec, target), args))
        if isinstance(rep, dict):
            rep.setdefault("kernel", spec.name)
        reports.append(rep)
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2, sort_keys=True))
    else:
        print("\n".join(_format_report(s.name, r if isinstance(r, dict) else {"result": r})
                        for s, r in zip(specs, reports)))
    return EXIT_OK


def _accuracy_inputs(specs, args) -> int:
    """``accuracy --inputs FILE|DIR``: each spec's numerics on saved q/k/v (numerics.activations'
    format), per case, per head and overall; a malformed file is a user error (exit 1)."""
    from fp4gen.driver import UserError
    from fp4gen.numerics import accuracy, activations

    from fp4gen.numerics.outliers import ALL_TRANSFORMS

    extra = [t.strip() for t in (args.transform or "").split(",") if t.strip()]
    bad = [t for t in extra if t not in ALL_TRANSFORMS]
    if bad:
        raise UsageError(f"--transform: unknown {', '.join(bad)}; use a comma-separated subset of "
                         f"{', '.join(ALL_TRANSFORMS)}")
    try:
        cases = activations.load(args.inputs)
    except activations.InputsError as e:
        raise UserError(str(e)) from None
    progress = Progress(getattr(args, "quiet", False))
    reports = []
    for i, spec in enumerate(specs, 1):
        # the spec's own transforms (its K/V options, rotate line), then --transform's
        transforms = list(dict.fromkeys(spec.transforms.names + tuple(extra)))
        with progress.stage(f"[{i}/{len(specs)}] accuracy of {spec.name} on {len(cases)} input file(s)"):
            try:
                rep = _report_inputs(accuracy, spec, cases, transforms)
            except ValueError as e:  # a varlen spec, an unknown or inapplicable transform
                raise UserError(f"{spec.name}: {e}") from None
            if transforms:
                rep["transforms"] = transforms
            reports.append(_jsonable(rep))
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2, sort_keys=True))
        return EXIT_OK
    for rep in reports:
        extra = f", transforms {','.join(rep['transforms'])}" if rep.get("transforms") else ""
        print(f"{rep['kernel']} ({rep['target']}{extra}): overall cosine {rep['overall_cosine']:.4f}, "
              f"rel-L2 {rep['overall_rel_l2']:.4f}, max abs {rep['overall_max_abs']:.4g}")
        print("| inputs | head | cosine | mean row cosine | rel-L2 | max abs |")
        print("|---|---|---|---|---|---|")
        for c in rep["cases"]:
            print(f"| {c['inputs']} | all | {c['cosine']:.4f} | {c['mean_row_cosine']:.4f} | {c['rel_l2']:.4f} "
                  f"| {c['max_abs']:.4g} |")
            for h in c["per_head"]:
                print(f"| | {h['head']} | {h['cosine']:.4f} | {h['mean_row_cosine']:.4f} | {h['rel_l2']:.4f} "
                      f"| {h['max_abs']:.4g} |")
        for c in rep["cases"]:
            for n in c.get("notes", []):
                print(f"note: {c['inputs']}: {n}", file=sys.stderr)
            if "dq_rel_l2" in c:
                print(f"{c['inputs']}: dq / dk / dv rel-L2 {c['dq_rel_l2']:.4f} / {c['dk_rel_l2']:.4f} / "
                      f"{c['dv_rel_l2']:.4f}")
    return EXIT_OK


def _report_inputs(accuracy, spec, cases, transforms) -> dict:
    """``accuracy.report_inputs`` with the spec's Hadamard seed (``rotate qk hadamard(seed=N)``) and
    sink token count (``sink_tokens N``; 1 for ``--transform sink_tokens`` on a spec without it)."""
    import torch

    t = spec.transforms
    reps = [accuracy.report_case(spec, c, transforms, hadamard_seed=t.hadamard_seed, sink_tokens=t.sink_tokens or 1)
            for c in cases]
    o = torch.cat([r.pop("_o").flatten() for r in reps])
    ref = torch.cat([r.pop("_o_ref").flatten() for r in reps])
    out = {"kernel": spec.name, "target": spec.target.value, "cases": reps}
    out.update({f"overall_{k}": v for k, v in accuracy.compare(o, ref).items()})
    return out


def _run_device(name: Optional[str], target: str):
    """The torch device ``run`` uses: ``--device`` (default cpu for reference, cuda otherwise),
    checked against the target and this machine before any tensor is made."""
    import torch

    from fp4gen.driver import UserError

    if name is None:
        name = "cpu" if target == "reference" else "cuda"
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's message lists every backend it was built with; ours says what works
        raise UsageError(f"--device: unknown device '{name}'; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: fp4gen runs on cpu or cuda[:N]")
    if device.type == "cpu" and target != "reference":
        raise UsageError(f"target {target} runs on a CUDA GPU, not on the CPU; use --target reference or a GPU")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            hint = "--device cpu" if target == "reference" else "--target reference"
            raise UserError(f"target {target} on {name} needs a CUDA GPU and none is available here (try {hint})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def cmd_run(args) -> int:
    """Load (compile if needed) one kernel, run it on random inputs, compare with float64."""
    import time

    from fp4gen.driver import UserError, parse_target, plan_spec, retarget

    specs = _load(args.spec)
    spec = _one_kernel(specs, args.kernel, "run")
    target = (parse_target(args.target) or spec.target).value
    plan_spec(retarget(spec, parse_target(target)))  # what the planner refuses: diagnostics, not a crash
    device = _run_device(args.device, target)
    import torch

    from fp4gen.numerics import accuracy
    from fp4gen.api import LoadError, load
    from fp4gen.ir.spec import Layout, Sinks
    from fp4gen.runtime.checks import AttentionInputError, UnsupportedDeviceError

    try:
        mod = load(args.spec, kernel=spec.name, target=target)
    except LoadError as e:
        raise UserError(str(e)) from None
    bwd = args.backward and hasattr(mod, "backward")
    if args.backward and not bwd:
        raise UsageError(f"kernel {spec.name} has no backward block")
    gen = torch.Generator().manual_seed(args.seed)
    # a varlen spec runs a seeded ragged batch (with an empty and a one-token sequence), as accuracy does
    lengths = accuracy.ragged_lengths(args.batch, args.seqlen, gen) if spec.layout is Layout.VARLEN else None
    shape = ((sum(lengths),) if lengths else (args.batch, args.seqlen)) + (args.heads, spec.head_dim)

    def draw():  # one bf16 input on the device, without keeping its float32 draw
        return torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    q, k, v = draw(), draw(), draw()
    sinks = accuracy.draw_sinks(args.heads, args.seqlen, gen) if spec.sinks is not Sinks.NONE else None
    do = draw() if bwd else None  # drawn last: q, k, v (and sinks) are the same with and without --backward
    extra = {}  # what only a sinks or varlen spec's (reference) module takes
    if sinks is not None:
        extra["sinks"] = sinks.to(device)
    cu = None
    if lengths:
        cu = accuracy.cu_seqlens(lengths)
        extra.update(cu_seqlens_q=cu.to(device), cu_seqlens_k=cu.to(device), max_seqlen_q=max(lengths),
                     max_seqlen_k=max(lengths))
    t0 = time.perf_counter()
    try:
        if spec.transforms:  # the module's forward knows nothing of them: fp4gen.attention runs them around it
            o, grads = _run_with_transforms(mod, q, k, v, do, extra, bwd)
        else:
            o, lse = mod.forward(q, k, v, return_lse=True, **extra)
            grads = mod.backward(q, k, v, o, lse, do, **extra) if bwd else None
    except UnsupportedDeviceError as e:  # a GPU of another architecture
        raise UserError(str(e)) from None
    except AttentionInputError as e:  # inputs the spec cannot take (sink_tokens N with --seqlen <= N)
        raise UserError(str(e)) from None
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    # the float64 oracle sees the same (bf16-rounded) inputs the kernel saw, with the spec's mask fields
    ref_o, _, ref_g = accuracy.spec_oracle(spec, q.cpu(), k.cpu(), v.cpu(), do.cpu() if bwd else None,
                                           sinks=sinks, cu_seqlens_q=cu, cu_seqlens_k=cu)
    batch = f"seqlens {lengths}" if lengths else f"B={args.batch} S={args.seqlen}"
    print(f"{spec.name} ({target}, {device}): {batch} H={args.heads} D={spec.head_dim}, "
          f"{'forward+backward' if bwd else 'forward'} in {elapsed * 1e3:.1f} ms (first call, includes compilation)")
    if sinks is not None:
        print(f"  sink logits: {[round(float(x), 4) for x in sinks]}")
    if spec.transforms:
        print(f"  transforms {', '.join(spec.transforms.names)}: torch steps around the kernel (fp4gen.attention)")
    rows = [("o", o, ref_o)] + ([(n, g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_g)] if bwd else [])
    for name, x, ref in rows:
        c = accuracy.compare(x.cpu(), ref)
        print(f"  {name}: cosine {c['cosine']:.6f}  rel_l2 {c['rel_l2']:.6f}  max_abs {c['max_abs']:.4g}")
    return EXIT_OK


def _run_with_transforms(mod, q, k, v, do, extra, bwd):
    """``run`` of a spec with outlier transforms: fp4gen.attention with the module (which applies
    them and runs the module in between), the gradients through autograd. -> (o, grads or None)."""
    import torch

    from fp4gen import torch_ops

    backend = "auto" if mod.TARGET == "reference" else "generated"
    xs = [x.detach().requires_grad_(bwd) for x in (q, k, v)]
    kw = {"sinks": extra["sinks"]} if "sinks" in extra else {}
    with torch.set_grad_enabled(bwd):
        if "cu_seqlens_q" in extra:
            o = torch_ops.attention_varlen(*xs, extra["cu_seqlens_q"], extra["cu_seqlens_k"], extra["max_seqlen_q"],
                                           extra["max_seqlen_k"], spec=mod, backend=backend, **kw)
        else:
            o = torch_ops.attention(*xs, spec=mod, backend=backend, **kw)
    grads = torch.autograd.grad(o, xs, do) if bwd else None
    return o.detach(), grads


def cmd_verify(args) -> int:
    """Static proofs of each compiled kernel (conformance, register gate); exit 1 if any fails."""
    from fp4gen.lowering import LoweringError
    from fp4gen.lowering.ptxas import PtxasUnavailable
    from fp4gen.lowering.verify import as_json, table, verify_spec

    from fp4gen.driver import UserError, check_lowering, plan_spec, select_specs

    specs = [s for path in args.specs for s in select_specs(_load(path), args.kernel)]
    plans = [plan_spec(spec) for spec in specs]
    for plan in plans:
        check_lowering(plan)  # what the planner or the backend refuses: diagnostics, before any compile
    checks = []
    for spec, plan in zip(specs, plans):
        if not args.json:
            print(f"verifying {spec.name} ({spec.target.value}) ...", file=sys.stderr, flush=True)
        try:
            checks += verify_spec(spec, plan)
        except PtxasUnavailable as e:
            raise UserError(str(e)) from None
        except LoweringError as e:  # as `compile` reports it (the planner should refuse these: issue 19)
            raise UserError(f"kernel '{spec.name}': cannot compile for {spec.target.value}: {e}") from None
    if args.json:
        print(json.dumps(as_json(checks), indent=2))
    else:
        print(table(checks))
    failed = [c for c in checks if not c.ok]
    if failed and not args.json:
        print(f"fp4gen: {len(failed)} of {len(checks)} checks failed", file=sys.stderr)
    return EXIT_USER if failed else EXIT_OK


def cmd_perf(args) -> int:
    """The model's own command line (fp4gen/lowering/perf.py: ``parse_args``, ``run``; the
    backward's: perf_backward.py ``main``)."""
    from fp4gen.lowering import perf, perf_backward

    try:
        a = perf.parse_args(args.perf_args)
        return perf_backward.main(a) if a.backward else perf.run(a)
    except SystemExit as e:  # its argparse: --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE


def _tune_shapes(texts, spec) -> list:
    """``--shapes`` for kernel ``spec``: B,S,H[,D] each; D, when given, must be its head dim."""
    from fp4gen.cli import tune
    from fp4gen.driver import UserError

    if not texts:
        return [tune.DEFAULT_SHAPE + (spec.head_dim,)]
    shapes = []
    for t in texts:
        parts = t.split(",")
        try:
            nums = [int(x) for x in parts]
        except ValueError:
            nums = []
        if len(nums) not in (3, 4) or min(nums) < 1:
            raise UserError(f"--shapes: '{t}' is not B,S,H or B,S,H,D (positive integers)")
        if len(nums) == 4 and nums[3] != spec.head_dim:
            raise UserError(f"--shapes {t}: D is {nums[3]} but kernel '{spec.name}' has head_dim {spec.head_dim}")
        b, s, h = nums[:3]
        if s > MAX_SEQLEN or h > MAX_HEADS or b > MAX_BATCH or b * s * h > MAX_ROWS:
            raise UserError(f"--shapes {t}: at most S {MAX_SEQLEN}, H {MAX_HEADS}, B {MAX_BATCH} and "
                            f"B x S x H {MAX_ROWS}")
        shapes.append((b, s, h, spec.head_dim))
    return shapes


def cmd_tune(args) -> int:
    """Enumerate, compile, check and time each sm90a kernel's schedule candidates (docs/tune.md);
    without an sm_90 GPU (or with --dry-run) list and compile them, exit 0."""
    import fp4gen
    from fp4gen.cli import tune
    from fp4gen.driver import UserError, select_specs

    if args.budget_s is not None and not args.budget_s > 0:
        raise UsageError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    text, digest = tune.read_spec(args.spec)
    specs = select_specs(fp4gen.parse_text(text, filename=str(args.spec)), args.kernel)
    kernels = [s for s in specs if tune.tunable(s) is None]
    passed = [f"{s.name}: {tune.tunable(s)}" for s in specs if tune.tunable(s) is not None]
    if not kernels:
        raise UserError(f"{args.spec}: no sm90a kernel to tune ({'; '.join(passed)})")
    shapes = {s.name: _tune_shapes(args.shapes, s) for s in kernels}
    device, name = (None, "--dry-run") if args.dry_run else tune.cuda_device()
    if args.write and device is None:
        raise UserError(f"--write needs measured times, and timing needs an sm_90 GPU ({name})")
    timer = checker = None
    if device is not None:
        timer, checker = tune.gpu_timer(device), tune.gpu_checker(device)
    progress = Progress(args.json or args.quiet)
    log = (lambda m: print(f"fp4gen tune: {m}", file=sys.stderr, flush=True)) if progress.enabled else (lambda m: None)
    results = []
    t0 = time.monotonic()
    for spec in kernels:
        left = None if args.budget_s is None else max(0.0, args.budget_s - (time.monotonic() - t0))
        try:
            results.append(tune.tune_kernel(text, str(args.spec), spec.name, shapes[spec.name], compiler=None,
                                            checker=checker, timer=timer, budget_s=left, limit=args.limit, log=log))
        except tune.TuneError as e:
            raise UserError(str(e)) from None
    if args.json:
        print(json.dumps({"spec": str(args.spec), "device": name if device is not None else None,
                          "timed": device is not None, "not_tuned": passed,
                          "kernels": [r.as_json() for r in results]}, indent=2))
    else:
        if device is None:
            print(f"timing needs an sm_90 GPU ({name}): candidates listed and compiled, nothing measured")
        for line in passed:
            print(f"not tuned: {line}")
        print("\n\n".join(tune.table(r, shapes[r.kernel]) for r in results))
    if device is None:
        return EXIT_OK
    missing = [r.kernel for r in results if r.winner is None]
    if args.write:
        comments = {r.kernel: tune.tune_comment(r, name, shapes[r.kernel]) for r in results if r.winner}
        try:
            tune.write_back(args.spec, text, digest, results, comments)
        except tune.TuneError as e:
            raise UserError(str(e)) from None
        if not args.json:
            chosen = ", ".join(f"{r.kernel} {r.winner.tile_m} x {r.winner.tile_n} kv_stages {r.winner.kv_stages}"
                               for r in results if r.winner)
            print(f"wrote {args.spec} ({chosen or 'nothing chosen'})")
    if missing:
        _err(f"no correct candidate was timed for {', '.join(missing)}: nothing chosen")
        return EXIT_USER
    return EXIT_OK


def cmd_selftest(args) -> int:
    """Unit kernels of the risky tcgen05 forms, then every sm100a example against its reference
    backend, on an sm_100 GPU; elsewhere the list of what it would run (exit 0)."""
    from fp4gen import selftest

    rows = selftest.run(json=args.json)
    failed = [r for r in rows if r.status in ("fail", "error")]
    if failed and not args.json:
        print(f"fp4gen: {len(failed)} of {len(rows)} selftest checks failed", file=sys.stderr)
    return EXIT_USER if failed else EXIT_OK


def cmd_regenerate(args) -> int:
    from fp4gen.lowering.regenerate import EXAMPLES_DIR, GENERATED_DIR, regenerate, report

    from fp4gen.driver import UserError

    root = Path(args.root) if args.root else None
    if root is not None and not all((root / d).is_dir() for d in (EXAMPLES_DIR, GENERATED_DIR)):
        # elsewhere "nothing to do" would read as "up to date"
        raise UserError(f"--root {root}: not an fp4gen checkout (it has no {EXAMPLES_DIR}/ and "
                        f"{GENERATED_DIR}/ directories)")
    res = regenerate(root, check=args.check)
    text = report(res, check=args.check)
    print(text, file=sys.stdout if res.up_to_date or not args.check else sys.stderr)
    return EXIT_OK if (res.up_to_date or not args.check) else EXIT_USER


def cmd_demo(args) -> int:
    from fp4gen.lowering.regenerate import repo_root

    spec = Path(args.spec) if args.spec else repo_root() / "examples" / "fa4_fp4_d128.attn"
    out = args.output
    print(f"== fp4gen compile {spec} -o {out} --target reference")
    rc = cmd_compile(argparse.Namespace(spec=str(spec), output=out, parents=args.parents, target="reference",
                                        kernel=None, emit="py"))
    if rc:
        return rc
    print(f"\n== fp4gen schedule {spec}")
    cmd_schedule(argparse.Namespace(spec=str(spec), kernel=None, target=None, format="text", output=None,
                                    parents=False))
    print(f"\n== fp4gen accuracy {spec} --seqlen {args.seqlen} (reference backend vs float64)")
    return cmd_accuracy(argparse.Namespace(spec=str(spec), kernel=None, target="reference", seqlen=args.seqlen,
                                           heads=args.heads, seed=args.seed, batch=args.batch, json=False))


# ---------------------------------------------------------------------------
# argument parsing

# Random inputs are (batch, seqlen, heads, head_dim): bound each size and their product,
# so a typo gives a usage error, not an allocation that fails inside torch or the OOM killer.
MAX_SEQLEN = 1 << 20
MAX_HEADS = 1024
MAX_BATCH = 1 << 16
MAX_ROWS = 1 << 22  # batch x seqlen x heads
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64 bits


def _int_between(lo: int, hi: int):
    """An argparse type: an integer in lo..hi, else a usage error that gives the range."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got '{text}'") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {v}")
        return v
    return parse


def _target(text: str) -> str:
    """An argparse type: a target name (sm_90a is sm90a), normalised."""
    from fp4gen.driver import UserError, parse_target

    try:
        return parse_target(text).value
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_shape_options(sub, seqlen: int, heads: int) -> None:
    sub.add_argument("--seqlen", type=_int_between(1, MAX_SEQLEN), default=seqlen,
                     help=f"sequence length (default {seqlen}, at most {MAX_SEQLEN})")
    sub.add_argument("--heads", type=_int_between(1, MAX_HEADS), default=heads,
                     help=f"heads (default {heads}, at most {MAX_HEADS})")
    sub.add_argument("--batch", type=_int_between(1, MAX_BATCH), default=1,
                     help=f"batch (default 1; batch x seqlen x heads at most {MAX_ROWS})")
    sub.add_argument("--seed", type=_int_between(0, MAX_SEED), default=0, help="random inputs' seed (default 0)")


def _add_output_options(sub, metavar: str, required: bool, help: str) -> None:
    sub.add_argument("-o", "--output", metavar=metavar, required=required, help=help)
    sub.add_argument("--parents", action="store_true",
                     help="create missing parent directories of the output (otherwise an error)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fp4gen", description="FP4/FP8 FlashAttention kernel compiler.",
        epilog="exit status: 0 success, 1 spec or input error, 2 bad command line, 3 internal error. "
               "Outputs replace only regular files (never a symlink or a device), atomically, with "
               "umask modes. Start with: fp4gen demo")
    from fp4gen import __version__

    p.add_argument("--version", action="version", version=f"fp4gen {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("check", help="parse and plan specs; report every error")
    c.add_argument("specs", nargs="+", metavar="SPEC")
    c.add_argument("--target", type=_target, help="check for this target instead of each kernel's own")
    c.add_argument("--parse-only", action="store_true", help="skip planning")
    c.set_defaults(func=cmd_check)

    e = sub.add_parser("explain", help="what would run each kernel (generated or reference, or why not): "
                       "here, on an H200 and on a B200")
    e.add_argument("spec", metavar="SPEC")
    e.add_argument("--kernel", help="explain only this kernel")
    e.add_argument("--target", type=_target, help="as if the kernels targeted this")
    e.add_argument("--json", action="store_true", help="print the answer as JSON")
    e.set_defaults(func=cmd_explain)

    s = sub.add_parser("schedule", help="print a kernel's plan (TMEM map, events, costs)")
    s.add_argument("spec", metavar="SPEC")
    s.add_argument("--kernel", help="kernel name (needed for json/svg/html when the file has several)")
    s.add_argument("--target", type=_target, help="plan for this target instead of the kernel's own")
    s.add_argument("--format", choices=("text", "json", "svg", "html"), default="text")
    _add_output_options(s, "FILE", False, "write here instead of stdout (its directory must exist)")
    s.set_defaults(func=cmd_schedule)

    k = sub.add_parser("compile", help="write one Python module per kernel")
    k.add_argument("spec", metavar="SPEC")
    _add_output_options(k, "DIR", True, "output directory (created if missing; its parent must exist)")
    k.add_argument("--target", type=_target, help="sm100a, sm90a or reference (default: each kernel's own)")
    k.add_argument("--kernel", help="compile only this kernel")
    k.add_argument("--emit", default="py", help="comma-separated: py (always), ptx, cubin")
    k.add_argument("--quiet", action="store_true", help="no progress lines on stderr (none off a terminal anyway)")
    k.set_defaults(func=cmd_compile)

    a = sub.add_parser("accuracy", help="cosine / rel-L2 of the spec's numerics vs float64")
    a.add_argument("spec", metavar="SPEC")
    a.add_argument("--kernel")
    a.add_argument("--target", type=_target, help="evaluate as this target (default: the kernel's own)")
    _add_shape_options(a, seqlen=1024, heads=4)
    a.add_argument("--inputs", metavar="FILE|DIR",
                   help="saved q/k/v (and dO): a torch.save dict {q, k, v[, do, meta]} of (B, S, H, D) "
                        "tensors, or a folder of *.pt such files (fp4gen.numerics.capture writes them); "
                        "reports per case, per head and overall instead of random inputs")
    a.add_argument("--transform", metavar="T[,T]",
                   help="with --inputs: outlier transforms before the spec's numerics, besides the spec's own "
                        "(smooth_k, channel_scale_v, hadamard, sink_tokens; fp4gen.numerics.outliers; "
                        "sink_tokens takes the spec's count, else the first key)")
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    a.add_argument("--quiet", action="store_true", help="no progress lines on stderr (none off a terminal anyway)")
    a.set_defaults(func=cmd_accuracy)

    u = sub.add_parser("run", help="run one kernel on random inputs and compare with float64")
    u.add_argument("spec", metavar="SPEC")
    u.add_argument("--kernel")
    u.add_argument("--target", type=_target, help="default: the kernel's own (reference runs on the CPU)")
    u.add_argument("--device", help="cpu or cuda[:N] (default: cpu for reference, cuda otherwise)")
    _add_shape_options(u, seqlen=256, heads=2)
    u.add_argument("--backward", action="store_true", help="also run the backward (specs with a backward block)")
    u.set_defaults(func=cmd_run)

    vf = sub.add_parser("verify", help="compile sm100a kernels on the CPU and prove them against their plans")
    vf.add_argument("specs", nargs="+", metavar="SPEC")
    vf.add_argument("--kernel", help="verify only this kernel")
    vf.add_argument("--json", action="store_true", help="print the checks as JSON")
    vf.set_defaults(func=cmd_verify)

    st = sub.add_parser("selftest", help="on an sm_100 GPU: unit kernels of the risky tcgen05 forms, then "
                        "every sm100a example vs its reference; elsewhere: what it would run")
    st.add_argument("--json", action="store_true", help="print the checks as JSON")
    st.set_defaults(func=cmd_selftest)

    pf = sub.add_parser("perf", add_help=False,
                        help="static performance model: predicted TFLOP/s and ratio to FA4's BF16 forward, "
                        "from each kernel's SASS (see 'fp4gen perf --help')")
    pf.add_argument("perf_args", nargs=argparse.REMAINDER)
    pf.set_defaults(func=cmd_perf)

    tu = sub.add_parser("tune", help="time each sm90a kernel's legal schedules (tile, kv_stages) on the GPU; "
                        "--write keeps the fastest correct one in the spec (docs/tune.md)")
    tu.add_argument("spec", metavar="SPEC")
    tu.add_argument("--kernel", help="tune only this kernel")
    tu.add_argument("--shapes", nargs="+", metavar="B,S,H[,D]",
                    help="shapes to time (default 2,4096,16 at the kernel's head dim); the winner is the "
                         "fastest over all of them (geometric mean of ratios to the fastest)")
    tu.add_argument("--budget-s", type=float, metavar="N", help="stop compiling/timing new candidates after N s")
    tu.add_argument("--limit", type=_int_between(1, 1000), metavar="N",
                    help="try only the first N candidates (the planner's own choice first)")
    tu.add_argument("--write", action="store_true",
                    help="write the winning schedule block into SPEC (atomic; refused if SPEC changed meanwhile)")
    tu.add_argument("--dry-run", action="store_true", help="list and compile the candidates, time nothing "
                    "(what happens anyway without an sm_90 GPU)")
    tu.add_argument("--device", action="store_true", help="time on the GPU (the default when there is one; "
                    "accepted for the command line of issue 20)")
    tu.add_argument("--json", action="store_true", help="print the results as JSON")
    tu.add_argument("--quiet", action="store_true", help="no progress lines on stderr (none off a terminal anyway)")
    tu.set_defaults(func=cmd_tune)

    r = sub.add_parser("regenerate", help="rebuild generated/ from examples/*.attn")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if generated/ is stale")
    r.add_argument("--root", help="repository root, with examples/ and generated/ (default: this checkout)")
    r.set_defaults(func=cmd_regenerate)

    d = sub.add_parser("demo", help="compile, schedule and check accuracy of the paper's recipe")
    d.add_argument("--spec", help="default: examples/fa4_fp4_d128.attn")
    _add_output_options(d, "DIR", False, "where the compiled module goes (default: fp4gen-demo)")
    d.set_defaults(output="fp4gen-demo")
    _add_shape_options(d, seqlen=256, heads=2)
    d.set_defaults(func=cmd_demo)
    return p


def _check_rows(args) -> None:
    rows = getattr(args, "batch", 1) * getattr(args, "seqlen", 1) * getattr(args, "heads", 1)
    if rows > MAX_ROWS:
        raise UsageError(f"--batch x --seqlen x --heads is {rows} rows of random inputs; the limit is {MAX_ROWS}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from fp4gen.frontend import SpecError
    from fp4gen.runtime.fileio import InputFileError, OutputFileError

    from fp4gen.driver import UserError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["perf"]:  # the model parses its own options (and --help)
            args = argparse.Namespace(command="perf", perf_args=argv[1:], func=cmd_perf)
        else:
            args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        _check_rows(args)
        return args.func(args)
    except SpecError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_USER
    except UsageError as e:
        print(f"fp4gen {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (UserError, InputFileError, OutputFileError) as e:
        _err(str(e))
        return EXIT_USER
    except (OSError, UnicodeDecodeError) as e:  # a file or directory fp4gen was pointed at
        _err(_os_error(e))
        return EXIT_USER
    except KeyboardInterrupt:
        print("fp4gen: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in fp4gen, not in the user's input
        print(f"fp4gen: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        if os.environ.get("FP4GEN_TRACEBACK"):
            traceback.print_exc()
        else:
            print("(this is a bug in fp4gen; set FP4GEN_TRACEBACK=1 to see the traceback and please report it)",
                  file=sys.stderr)
        return EXIT_INTERNAL


def _os_error(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start})"
    where = f"{e.filename}: " if getattr(e, "filename", None) else ""
    return where + (getattr(e, "strerror", None) or str(e))


if __name__ == "__main__":
    sys.exit(main())
