"""The emulator compares a generated module with the reference of its own spec, as the module's
PLAN_JSON records it. It used to parse the module's SPEC_FILE and take the file's first kernel:
a module whose file holds another kernel first (an example file with several kernels) was
compared with that kernel's reference (fa4_fp4_full_d128, in fa4_fp4_d128.attn beside the
causal forward, failed at O max error 0.91 while the kernel was right)."""
from __future__ import annotations

from pathlib import Path

from fp4gen.ir.spec import Mask
from fp4gen.lowering.emulator import run

GENERATED = Path(__file__).resolve().parents[3] / "generated"


def test_the_spec_comes_from_the_module_not_its_file():
    src = (GENERATED / "fa4_fp4_full_d128_sm100a.py").read_text()
    own = run._spec_of(run._load_module(src))
    assert (own.name, own.mask) == ("fa4_fp4_full_d128", Mask.NONE)
    # the module pointed at a file whose first kernel is the causal forward: still its own spec
    moved = src.replace("SPEC_FILE = 'examples/fa4_fp4_full_d128.attn'", "SPEC_FILE = 'examples/fa4_fp4_d128.attn'")
    assert moved != src
    spec = run._spec_of(run._load_module(moved))
    assert (spec.name, spec.mask) == ("fa4_fp4_full_d128", Mask.NONE)
