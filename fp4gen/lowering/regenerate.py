"""Regenerate ``generated/`` from ``examples/*.attn``, byte for byte.

Every kernel of every example is planned and rendered for its own target into
``generated/<module_name(kernel, target)>.py``. Targets whose backend is not
written yet are skipped (and listed). ``check`` mode writes nothing and reports
files that differ from what would be generated, are missing, or are left over.

Paths inside the generated files are relative to the repository root
(``examples/x.attn``), so the output does not depend on where the checkout is.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from . import BACKENDS, module_name

GENERATED_DIR = "generated"
EXAMPLES_DIR = "examples"


def repo_root() -> Path:
    """The checkout this package runs from (``fp4gen/`` sits at its top)."""
    return Path(__file__).resolve().parents[2]


def backend_available(target: str) -> bool:
    backend = BACKENDS.get(target)
    return backend is not None and importlib.util.find_spec(f"{__package__}.{backend}") is not None


@dataclass
class Result:
    expected: dict[str, str] = field(default_factory=dict)  # file name -> source
    written: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # differ from the examples
    missing: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # generated for a kernel that no longer exists
    skipped: dict[str, list[str]] = field(default_factory=dict)  # target -> kernels
    unsupported: dict[str, str] = field(default_factory=dict)  # "kernel (target)" -> reason

    @property
    def up_to_date(self) -> bool:
        return not (self.stale or self.missing or self.orphans)


def expected_sources(root: Path):
    """({file name: source}, {target: skipped kernels}, {kernel (target): why not lowered}).

    Kernels whose target has no backend are skipped; kernels the backend
    refuses with a ``LoweringError`` are listed with the reason.

    Raises ``SpecError`` (examples must be valid) and lowering errors as they come.
    """
    from fp4gen.frontend import parse_text
    from fp4gen.ir.passes import PlanError, plan_kernel

    from . import LoweringError, render

    out: dict[str, str] = {}
    skipped: dict[str, list[str]] = {}
    unsupported: dict[str, str] = {}
    for path in sorted((root / EXAMPLES_DIR).glob("*.attn")):
        rel = path.relative_to(root).as_posix()
        # the repository-relative name is what the generated files record
        specs = parse_text(path.read_text(encoding="utf-8"), filename=rel)
        for spec in specs:
            target = spec.target.value
            if not backend_available(target):
                skipped.setdefault(target, []).append(spec.name)
                continue
            try:
                plan = plan_kernel(spec)
            except PlanError as e:
                from fp4gen.frontend.diagnostics import plan_error_to_spec_error

                raise plan_error_to_spec_error(e, spec) from None
            name = f"{module_name(spec.name, target)}.py"
            if name in out:
                raise ValueError(f"two example kernels generate {GENERATED_DIR}/{name}; rename one")
            try:
                out[name] = render(plan)
            except LoweringError as e:
                # the backend exists but does not cover this recipe yet: list it, do not fail
                unsupported[f"{spec.name} ({target})"] = str(e)
    return out, skipped, unsupported


def _generated_by_us(name: str) -> bool:
    """Files regenerate owns: ``<kernel>_<target>.py`` for a target with a backend."""
    return name.endswith(".py") and any(
        name[: -len(".py")].endswith(f"_{t}") for t in BACKENDS if backend_available(t))


def regenerate(root: Optional[Path] = None, *, check: bool = False) -> Result:
    root = Path(root) if root is not None else repo_root()
    gen = root / GENERATED_DIR
    expected, skipped, unsupported = expected_sources(root)
    res = Result(expected=expected, skipped=skipped, unsupported=unsupported)
    for name, src in sorted(expected.items()):
        p = gen / name
        if not p.exists():
            res.missing.append(name)
        elif p.read_bytes() != src.encode():
            res.stale.append(name)
    if gen.is_dir():
        res.orphans = sorted(p.name for p in gen.iterdir()
                             if p.is_file() and _generated_by_us(p.name) and p.name not in expected)
    if check:
        return res
    from fp4gen.runtime.fileio import atomic_write

    gen.mkdir(exist_ok=True)
    for name in res.missing + res.stale:
        atomic_write(gen / name, expected[name])
        res.written.append(name)
    for name in res.orphans:
        (gen / name).unlink()
    return res


def report(res: Result, *, check: bool) -> str:
    lines = []
    for target, kernels in sorted(res.skipped.items()):
        lines.append(f"skipped (no {target} backend yet): {', '.join(kernels)}")
    for kernel, why in sorted(res.unsupported.items()):
        lines.append(f"skipped {kernel}: the backend does not lower it yet: {why}")
    if check:
        for what, names in (("stale", res.stale), ("missing", res.missing), ("left over", res.orphans)):
            lines += [f"{what}: {GENERATED_DIR}/{n}" for n in names]
        if res.up_to_date:
            lines.append(f"ok: {GENERATED_DIR}/ is up to date ({len(res.expected)} modules)")
        else:
            lines.append("run 'fp4gen regenerate' to update it")
    else:
        lines += [f"wrote {GENERATED_DIR}/{n}" for n in res.written]
        lines += [f"removed {GENERATED_DIR}/{n}" for n in res.orphans]
        lines.append(f"ok: {len(res.expected)} modules, {len(res.written)} written")
    return "\n".join(lines)
