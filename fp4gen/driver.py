"""The compile driver: spec -> plan -> generated module files; shared by ``fp4gen compile``,
``fp4gen regenerate`` and ``fp4gen.compile_spec``.

Errors a user can cause come out as ``UserError`` (one line, exit 1) or as
``SpecError`` with diagnostics (exit 1); anything else is an internal error.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

from fp4gen.frontend.diagnostics import kernel_error, plan_error_to_spec_error  # the latter re-exported
from fp4gen.ir.spec import KernelSpec, Target


class UserError(Exception):
    """A mistake on the command line or in the environment: printed as one line, exit 1."""


def parse_target(name: Optional[str]) -> Optional[Target]:
    if name is None:
        return None
    norm = name.strip().lower().replace("_", "")  # accept sm_90a
    try:
        return Target(norm)
    except ValueError:
        known = ", ".join(t.value for t in Target)
        raise UserError(f"unknown target '{name}'; known targets: {known}") from None


def select_specs(specs: Sequence[KernelSpec], kernel: Optional[str]) -> list[KernelSpec]:
    if kernel is None:
        return list(specs)
    found = [s for s in specs if s.name == kernel]
    if not found:
        from fp4gen.frontend import did_you_mean

        names = ", ".join(s.name for s in specs)
        hint = did_you_mean(kernel, [s.name for s in specs])
        raise UserError(f"no kernel '{kernel}' in the spec (it defines: {names})" + (f"; {hint}" if hint else ""))
    return found


def plan_spec(spec: KernelSpec):
    """``fp4gen.ir.passes.plan_kernel`` with PlanError turned into a SpecError."""
    try:
        from fp4gen.ir.passes import PlanError, plan_kernel
    except ImportError as e:
        raise RuntimeError(f"the planner (fp4gen.ir.passes.plan_kernel) is not available: {e}") from e
    try:
        plan = plan_kernel(spec)
    except PlanError as e:
        raise plan_error_to_spec_error(e, spec) from None
    return plan


def verify_plan(plan) -> None:
    """Run the planner's verifier when it exists (its failures are internal errors)."""
    try:
        from fp4gen.ir.passes import verify
    except ImportError:
        return
    verify(plan)


def retarget(spec: KernelSpec, target: Optional[Target]) -> KernelSpec:
    return spec if target is None or target is spec.target else spec.with_target(target)


def lowering_error_to_spec_error(err, spec: KernelSpec):
    """A backend's refusal as a spec diagnostic, at the field it names (``LoweringError.path``)."""
    loc = spec.loc(err.path) if getattr(err, "path", None) else None
    return kernel_error(spec, f"cannot compile for {spec.target.value}: {err}", loc)


def check_lowering(plan) -> None:
    """Raise a SpecError for what the backend would refuse (``fp4gen check`` == ``compile``)."""
    from fp4gen.lowering import refusal

    err = refusal(plan)
    if err is not None:
        raise lowering_error_to_spec_error(err, plan.spec)


def render_module(plan) -> str:
    from fp4gen.lowering import render

    return render(plan)


def compile_specs(specs: Iterable[KernelSpec], out_dir, *, target=None, parents: bool = False,
                  written: Optional[list] = None) -> list[Path]:
    """Plan and render every spec (for ``target`` or its own) into ``out_dir``; returns the files.

    ``out_dir`` is created when missing, a missing parent of it only with ``parents``.
    Every module is rendered and every destination checked (``fileio.check_output_path``)
    before the first file is written, so a refused kernel or destination writes nothing.
    Each path is appended to ``written`` (when given) as soon as it is written, so a
    caller can say how far a write that stopped part-way (disk full, Ctrl-C) got.
    """
    from fp4gen.lowering import LoweringError, module_name
    from fp4gen.runtime.fileio import atomic_write, check_output_path

    tgt = parse_target(target) if isinstance(target, str) else target
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output path '{out}' exists and is not a directory")
    if not out.is_dir():
        check_output_path(out, parents=parents)  # a dangling symlink, a missing parent
    rendered = []
    for spec in specs:
        spec = retarget(spec, tgt)
        plan = plan_spec(spec)
        try:
            source = render_module(plan)
        except LoweringError as e:
            raise lowering_error_to_spec_error(e, spec) from None
        rendered.append((out / f"{module_name(spec.name, spec.target.value)}.py", source))
    written = [] if written is None else written
    try:
        out.mkdir(parents=parents, exist_ok=True)
        for p, _ in rendered:
            check_output_path(p)
        for p, src in rendered:
            written.append(atomic_write(p, src))
    except OSError as e:
        raise UserError(f"cannot write to '{out}': {e.strerror or e}") from None
    return [p for p, _ in rendered]


_ARCH = {"sm90a": "sm_90a", "sm100a": "sm_100a"}


def emit_artifacts(module_path: Path, target: str, kinds: Sequence[str], timeout: float = 1800.0) -> Path:
    """Compile a generated CuTe DSL module without a GPU and keep its PTX/cubin.

    Runs the module's ``compile_only`` in a child process with CuTe DSL's
    ``CUTE_DSL_KEEP``/``CUTE_DSL_DUMP_DIR`` set, so the artifacts land in
    ``<module>.artifacts/`` beside the module.
    """
    arch = _ARCH.get(target)
    if arch is None:
        raise UserError(f"target {target} produces no {'/'.join(kinds)} (only sm90a and sm100a are compiled)")
    dump = module_path.with_suffix(".artifacts")
    dump.mkdir(parents=True, exist_ok=True)
    # CuTe DSL names artifacts per compiled object; drop the previous run's so they do not pile up
    for old in dump.iterdir():
        if old.is_file() and old.suffix.lstrip(".") in ("ptx", "cubin"):
            old.unlink(missing_ok=True)
    env = dict(os.environ, CUTE_DSL_KEEP=",".join(kinds), CUTE_DSL_DUMP_DIR=str(dump.resolve()),
               CUTE_DSL_ARCH=arch)
    code = ("import sys\n"
            "from fp4gen.runtime.loader import exec_file\n"
            "mod = exec_file('fp4gen_emit_module', sys.argv[1])\n"
            "if not hasattr(mod, 'compile_only'): sys.exit('the module has no compile_only()')\n"
            "print('\\n'.join(mod.compile_only(sys.argv[2])))\n")
    try:
        res = subprocess.run([sys.executable, "-c", code, str(module_path), arch], env=env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"compiling {module_path.name} for {arch} took longer than {timeout:.0f} s") from None
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        raise UserError(f"compiling {module_path.name} for {arch} failed:\n{tail}")
    return dump


def backward_gaps(specs: Iterable[KernelSpec], *, target=None) -> list[str]:
    """One line per spec whose ``backward`` block is not generated (the sm100a backward planner
    refuses it; the forward is still generated): 'file:line:col: kernel: reason'. sm90a specs
    never appear here: their backward refusals are errors."""
    from fp4gen.ir.passes.backward_sm100 import plan_backward_sm100
    from fp4gen.ir.plan import PlanError
    from fp4gen.ir.spec import Target

    out = []
    for spec in specs:
        spec = retarget(spec, parse_target(target)) if target else spec
        if spec.backward is None or spec.target is not Target.SM100A:
            continue
        try:
            plan_backward_sm100(plan_spec(spec))
        except PlanError as e:
            where = f"{e.loc}: " if e.loc else ""
            out.append(f"{where}{spec.name}: backward not generated: {e.message}")
    return out
