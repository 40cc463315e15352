"""``KernelSpec`` <-> plain dict / JSON for generated modules: the runtime's name for the
spec half of ``fp4gen.ir.serialize`` (the one serializer of spec and plan JSON).

The reference backend's modules embed their spec as ``SPEC_JSON`` and rebuild it with
``spec_from_json`` at import time, so they need neither lark nor jinja2; generated modules
import ``fp4gen.runtime`` only, hence this name. Nothing is defined here.
"""
from __future__ import annotations

from fp4gen.ir.serialize import (  # noqa: F401 -- re-exported
    SOURCE_FIELDS, SPEC_SCHEMA as SCHEMA, computed_fields, spec_from_dict, spec_from_json,
    spec_from_plan_dict, spec_from_plan_json, spec_to_dict, spec_to_json,
)

__all__ = ["SCHEMA", "SOURCE_FIELDS", "computed_fields", "spec_from_dict", "spec_from_json",
           "spec_from_plan_dict", "spec_from_plan_json", "spec_to_dict", "spec_to_json"]
