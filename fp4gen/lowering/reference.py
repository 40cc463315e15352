"""The reference backend: a module that runs the spec through ``fp4gen.numerics.reference``.

The generated module embeds its ``KernelSpec`` as JSON and rebuilds it with
``fp4gen.runtime.specjson`` (no lark, no jinja2), and its plan as ``PLAN_JSON`` like every
backend (``fp4gen.lowering.plan_json``). Its ``forward``/``backward``
take any device and the floating dtypes torch has, and compute exactly the
numerics the spec asks for (quantized Q/K/V, P's production, guard, mask, softcap,
sinks), so it is the oracle for the CuTe DSL kernels and lets anyone run a spec on a CPU.
Beyond the contract of ``fp4gen.lowering``, they take ``sinks=`` (the sink logits of a
``sinks learned`` spec) and, for a ``layout varlen`` spec, packed ``(total, H, D)`` tensors
with ``cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k`` by name.
"""
from __future__ import annotations

from fp4gen.ir.dump.text import mask_text
from fp4gen.ir.serialize import spec_to_json
from fp4gen.ir.spec import Target

from . import Comment, LoweringError, plan_json, template_env

TEMPLATE = "reference.py.j2"  # in templates/common/


def _spec_excerpt(spec) -> list[str]:
    """The kernel's own lines of the spec file, for the module docstring."""
    loc = spec.locs.get("name")
    if loc is None or not spec.source_lines:
        return []
    lines = spec.source_lines
    start = loc.line - 1
    depth, end = 0, len(lines) - 1
    for i in range(start, len(lines)):
        code = lines[i].split("#", 1)[0]
        depth += code.count("{") - code.count("}")
        if depth <= 0 and "{" in "".join(x.split("#", 1)[0] for x in lines[start:i + 1]):
            end = i
            break
    return list(lines[start:end + 1])


def context(plan) -> dict:
    spec = plan.spec
    if spec.target is not Target.REFERENCE:
        raise LoweringError(f"the reference backend renders target 'reference', not {spec.target.value!r}")
    g = spec.guard
    return dict(
        kernel_name=Comment(spec.name),
        spec_file=Comment(spec.source_file),
        excerpt=[Comment(line) for line in _spec_excerpt(spec)],
        operands=f"Q {spec.q}, K {spec.k}, P {spec.p} via {spec.p_production.kind.value}, V {spec.v}, O {spec.o}",
        head_dim=spec.head_dim,
        mask=Comment(mask_text(spec)),  # "mask causal"; window sizes, softcap, sinks, layout where set
        guard=g.kind.value + (f"({g.m}, {g.l})" if g.kind.value == "sample" else ""),
        has_backward=spec.backward is not None,
        plan_json=plan_json(plan),
        has_transforms=bool(spec.transforms),  # the module applies the spec's outlier transforms
        spec_json=spec_to_json(spec),
    )


def render(plan) -> str:
    """Source text of the reference module for ``plan`` (``templates/common/reference.py.j2``)."""
    return template_env("common").get_template(TEMPLATE).render(**context(plan))
