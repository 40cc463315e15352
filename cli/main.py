"""The ``fp4gen`` command.

    fp4gen check SPEC...                       parse + plan; diagnostics on stderr
    fp4gen schedule SPEC [--kernel K] [--format text|json|svg|html] [-o FILE]
    fp4gen compile SPEC -o DIR [--target T] [--kernel K] [--emit py,ptx,cubin]
    fp4gen accuracy SPEC [--kernel K] [--seqlen N] [--heads H] [--seed S] [--json]
    fp4gen run SPEC [--kernel K] [--target T] [--seqlen N] [--backward]   run once, compare with float64
    fp4gen regenerate [--check]                generated/ from examples/*.attn
    fp4gen demo                                compile + schedule + accuracy of the paper's recipe

Exit status: 0 success; 1 a spec error or another user error (one-line
message or diagnostics, never a traceback); 2 bad command-line usage;
3 an internal error (a bug: the message says how to see the traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
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


def _load(path: str):
    from fp4gen.frontend import parse_file

    return parse_file(path)


def _one_kernel(specs, kernel: Optional[str], what: str):
    from fp4gen.driver import select_specs

    chosen = select_specs(specs, kernel)
    if len(chosen) > 1:
        names = ", ".join(s.name for s in chosen)
        raise UsageError(f"the spec defines several kernels ({names}); choose one with --kernel for {what}")
    return chosen[0]


def _write_output(text: str, path: Optional[str]) -> None:
    if path is None or path == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    from fp4gen.driver import UserError, atomic_write

    try:
        atomic_write(Path(path), text)
    except OSError as e:
        raise UserError(f"cannot write '{path}': {e.strerror or e}") from None
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

    from fp4gen.driver import parse_target, plan_spec, retarget, verify_plan

    target = parse_target(args.target)
    bad_files, n_errors, n_kernels = 0, 0, 0
    for path in args.specs:
        try:
            specs = _load(path)
            errors = []
            if not args.parse_only:
                for spec in specs:
                    try:
                        verify_plan(plan_spec(retarget(spec, target)))
                    except SpecError as e:  # keep checking the other kernels
                        errors.append(e)
        except SpecError as e:
            specs, errors = [], [e]
        except (OSError, UnicodeDecodeError) as e:
            _err(_read_error(path, e))
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


def _read_error(path: str, e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return f"cannot read '{path}': not UTF-8 text"
    if isinstance(e, IsADirectoryError):
        return f"cannot read '{path}': it is a directory"
    return f"cannot read '{path}': {getattr(e, 'strerror', None) or e}"


def cmd_schedule(args) -> int:
    from fp4gen.driver import parse_target, plan_spec, retarget, select_specs

    specs = select_specs(_load(args.spec), args.kernel)
    target = parse_target(args.target)
    if args.format != "text" and len(specs) > 1:
        _one_kernel(specs, None, f"--format {args.format}")
    parts = [_render_plan(plan_spec(retarget(s, target)), args.format) for s in specs]
    _write_output("\n\n".join(p.rstrip("\n") for p in parts), args.output)
    return EXIT_OK


def cmd_compile(args) -> int:
    from fp4gen.driver import compile_specs, emit_artifacts, select_specs

    emit = [e.strip() for e in args.emit.split(",") if e.strip()]
    bad = [e for e in emit if e not in ("py", "ptx", "cubin")]
    if bad or not emit:
        raise UsageError(f"--emit takes a comma-separated list of py, ptx, cubin; got '{args.emit}'")
    specs = select_specs(_load(args.spec), args.kernel)
    paths = compile_specs(specs, args.output, target=args.target)
    for p in paths:
        print(f"wrote {p}")
    from fp4gen.driver import backward_gaps

    for line in backward_gaps(specs, target=args.target):  # the forward was written; say what was not
        print(f"warning: {line}", file=sys.stderr)
    extra = [e for e in emit if e != "py"]
    if extra:
        from fp4gen.driver import parse_target

        for spec, p in zip(specs, paths):
            tgt = (parse_target(args.target) or spec.target).value
            dump = emit_artifacts(p, tgt, extra)
            for f in sorted(dump.rglob("*")):
                if f.is_file() and f.suffix.lstrip(".") in extra:
                    print(f"wrote {f}")
    return EXIT_OK


def _accuracy_report(spec, args) -> dict:
    import inspect

    try:
        from fp4gen.numerics.accuracy import report
    except ImportError as e:
        raise RuntimeError(f"fp4gen.numerics.accuracy.report is not available: {e}") from e
    wanted = {"seqlen": args.seqlen, "heads": args.heads, "seed": args.seed, "batch": args.batch}
    params = inspect.signature(report).parameters
    takes_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = {k: v for k, v in wanted.items() if v is not None and (takes_kw or k in params)}
    return report(spec, **kw)


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
    reports = []
    for spec in specs:
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


def cmd_run(args) -> int:
    """Load (compile if needed) one kernel, run it on random inputs, compare with float64."""
    import time

    from fp4gen.driver import UserError, parse_target

    specs = _load(args.spec)
    spec = _one_kernel(specs, args.kernel, "run")
    target = (parse_target(args.target) or spec.target).value
    import torch

    from fp4gen.numerics.accuracy import compare, exact_attention
    from fp4gen.runtime import LoadError, load

    device = args.device or ("cpu" if target == "reference" else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"target {target} runs on a CUDA GPU and none is available here "
                        "(try --target reference)")
    try:
        mod = load(args.spec, kernel=spec.name, target=target)
    except LoadError as e:
        raise UserError(str(e)) from None
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.seqlen, args.heads, spec.head_dim)
    q, k, v, do = (torch.randn(shape, generator=gen) for _ in range(4))
    dt = torch.bfloat16
    qd, kd, vd, dod = (x.to(device=device, dtype=dt) for x in (q, k, v, do))
    bwd = args.backward and hasattr(mod, "backward")
    if args.backward and not bwd:
        raise UsageError(f"kernel {spec.name} has no backward block")
    t0 = time.perf_counter()
    o, lse = mod.forward(qd, kd, vd, return_lse=True)
    grads = mod.backward(qd, kd, vd, o, lse, dod) if bwd else None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    # the float64 oracle sees the same (bf16-rounded) inputs the kernel saw
    ref_o, _, ref_g = exact_attention(qd.cpu().float(), kd.cpu().float(), vd.cpu().float(), spec.scale,
                                      spec.mask.value == "causal", dod.cpu().float() if bwd else None)
    print(f"{spec.name} ({target}, {device}): B={args.batch} S={args.seqlen} H={args.heads} D={spec.head_dim}, "
          f"{'forward+backward' if bwd else 'forward'} in {elapsed * 1e3:.1f} ms (first call, includes compilation)")
    rows = [("o", o, ref_o)] + ([(n, g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_g)] if bwd else [])
    for name, x, ref in rows:
        c = compare(x.float().cpu(), ref)
        print(f"  {name}: cosine {c['cosine']:.6f}  rel_l2 {c['rel_l2']:.6f}  max_abs {c['max_abs']:.4g}")
    return EXIT_OK


def cmd_regenerate(args) -> int:
    from fp4gen.lowering.regenerate import regenerate, report

    res = regenerate(Path(args.root) if args.root else None, check=args.check)
    text = report(res, check=args.check)
    print(text, file=sys.stdout if res.up_to_date or not args.check else sys.stderr)
    return EXIT_OK if (res.up_to_date or not args.check) else EXIT_USER


def cmd_demo(args) -> int:
    from fp4gen.lowering.regenerate import repo_root

    from fp4gen.driver import UserError

    spec = Path(args.spec) if args.spec else repo_root() / "examples" / "fa4_fp4_d128.attn"
    if not spec.is_file():
        raise UserError(f"demo spec '{spec}' not found (pass --spec PATH)")
    out = args.output
    print(f"== fp4gen compile {spec} -o {out} --target reference")
    rc = cmd_compile(argparse.Namespace(spec=str(spec), output=out, target="reference", kernel=None, emit="py"))
    if rc:
        return rc
    print(f"\n== fp4gen schedule {spec}")
    cmd_schedule(argparse.Namespace(spec=str(spec), kernel=None, target=None, format="text", output=None))
    print(f"\n== fp4gen accuracy {spec} --seqlen {args.seqlen} (reference backend vs float64)")
    return cmd_accuracy(argparse.Namespace(spec=str(spec), kernel=None, target="reference", seqlen=args.seqlen,
                                           heads=args.heads, seed=args.seed, batch=None, json=False))


# ---------------------------------------------------------------------------
# argument parsing


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fp4gen", description="FP4/FP8 FlashAttention kernel compiler.",
        epilog="exit status: 0 success, 1 spec or input error, 2 bad command line, 3 internal error. "
               "Start with: fp4gen demo")
    from fp4gen import __version__

    p.add_argument("--version", action="version", version=f"fp4gen {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("check", help="parse and plan specs; report every error")
    c.add_argument("specs", nargs="+", metavar="SPEC")
    c.add_argument("--target", help="check for this target instead of each kernel's own")
    c.add_argument("--parse-only", action="store_true", help="skip planning")
    c.set_defaults(func=cmd_check)

    s = sub.add_parser("schedule", help="print a kernel's plan (TMEM map, events, costs)")
    s.add_argument("spec", metavar="SPEC")
    s.add_argument("--kernel", help="kernel name (needed for json/svg/html when the file has several)")
    s.add_argument("--target", help="plan for this target instead of the kernel's own")
    s.add_argument("--format", choices=("text", "json", "svg", "html"), default="text")
    s.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    s.set_defaults(func=cmd_schedule)

    k = sub.add_parser("compile", help="write one Python module per kernel")
    k.add_argument("spec", metavar="SPEC")
    k.add_argument("-o", "--output", metavar="DIR", required=True)
    k.add_argument("--target", help="sm100a, sm90a or reference (default: each kernel's own)")
    k.add_argument("--kernel", help="compile only this kernel")
    k.add_argument("--emit", default="py", help="comma-separated: py (always), ptx, cubin")
    k.set_defaults(func=cmd_compile)

    a = sub.add_parser("accuracy", help="cosine / rel-L2 of the spec's numerics vs float64")
    a.add_argument("spec", metavar="SPEC")
    a.add_argument("--kernel")
    a.add_argument("--target", help="evaluate as this target (default: the kernel's own)")
    a.add_argument("--seqlen", type=_positive_int, default=None)
    a.add_argument("--heads", type=_positive_int, default=None)
    a.add_argument("--batch", type=_positive_int, default=None)
    a.add_argument("--seed", type=int, default=None)
    a.add_argument("--json", action="store_true", help="print the report as JSON")
    a.set_defaults(func=cmd_accuracy)

    u = sub.add_parser("run", help="run one kernel on random inputs and compare with float64")
    u.add_argument("spec", metavar="SPEC")
    u.add_argument("--kernel")
    u.add_argument("--target", help="default: the kernel's own (reference runs on the CPU)")
    u.add_argument("--device", help="default: cpu for reference, cuda otherwise")
    u.add_argument("--seqlen", type=_positive_int, default=256)
    u.add_argument("--heads", type=_positive_int, default=2)
    u.add_argument("--batch", type=_positive_int, default=1)
    u.add_argument("--seed", type=int, default=0)
    u.add_argument("--backward", action="store_true", help="also run the backward (specs with a backward block)")
    u.set_defaults(func=cmd_run)

    r = sub.add_parser("regenerate", help="rebuild generated/ from examples/*.attn")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if generated/ is stale")
    r.add_argument("--root", help="repository root (default: this checkout)")
    r.set_defaults(func=cmd_regenerate)

    d = sub.add_parser("demo", help="compile, schedule and check accuracy of the paper's recipe")
    d.add_argument("--spec", help="default: examples/fa4_fp4_d128.attn")
    d.add_argument("-o", "--output", default="fp4gen-demo", metavar="DIR")
    d.add_argument("--seqlen", type=_positive_int, default=256)
    d.add_argument("--heads", type=_positive_int, default=2)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_demo)
    return p


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def main(argv: Optional[Sequence[str]] = None) -> int:
    from fp4gen.frontend import SpecError

    from fp4gen.driver import UserError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return args.func(args)
    except SpecError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_USER
    except UsageError as e:
        print(f"fp4gen {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except UserError as e:
        _err(str(e))
        return EXIT_USER
    except (OSError, UnicodeDecodeError) as e:
        path = getattr(e, "filename", None) or getattr(args, "spec", None) or "?"
        _err(_read_error(str(path), e))
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug in fp4gen, not in the user's input
        print(f"fp4gen: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        if os.environ.get("FP4GEN_TRACEBACK"):
            traceback.print_exc()
        else:
            print("(this is a bug in fp4gen; set FP4GEN_TRACEBACK=1 to see the traceback and please report it)",
                  file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
