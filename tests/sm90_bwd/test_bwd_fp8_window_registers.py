"""The register gate for the sm90a FP8 window backward without a softcap, which no example uses
(so ``fp4gen verify`` on the examples never sees it).

CPU (slow, one compile each, ~15 s): the backward of the FP8 recipe (S, dP, dV in FP8) and of
the all-FP8 one with ``mask window(l, r)`` and no softcap assembles under the plan's setmaxnreg
budgets with 0 spill bytes (ptxas of the pinned nvcc wheel, ``fp4gen.lowering.ptxas``). It
spilled 8 B (all-FP8: 12 B) while the window was masked per element
(``mask.apply_keys_by_queries``); ``Backward.window_mask_rows`` masks it by per-row bounds. The
planted fault compiles the per-element form again and the gate must report its spill.

GPU (``-m gpu``, an sm_90 GPU): the per-row mask's sides (left 0, right 0, one side unbounded,
Sq != Sk both ways) against the oracle, as test_bwd_window_softcap_gpu checks them with a
softcap.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bwd_modules as bm  # noqa: E402

# the planted fault: the backward class with the window masked per element again
PER_ELEMENT = """
class PerElement(mod._BWD_HOST.kernel):
    window_by_rows = False
mod._BWD_HOST.kernel = PerElement
"""


def _backward_ptx(tmp_path, recipe, window, *, det=False, gqa=False, fault=""):
    """(PTX of the compiled backward, the plan's producer / consumer budgets); compiled in a
    subprocess (CuTe DSL keeps the PTX there; the arch stays out of this process)."""
    dump = tmp_path / "dump"
    dump.mkdir()
    code = textwrap.dedent(f"""
        import glob, json, os, sys
        sys.path.insert(0, {HERE!r})
        import bwd_modules as bm
        from fp4gen.ir.passes import plan_kernel
        plan = plan_kernel(bm.make_masked_spec({recipe!r}, window={window!r}, deterministic={det!r}))
        mod = bm.load_module(plan, {str(tmp_path)!r})
    """) + fault + textwrap.dedent(f"""
        mod._bwd_compile("sm_90a", False, {gqa!r})
        (path,) = glob.glob(os.path.join({str(dump)!r}, "*.ptx"))
        print(json.dumps(dict(ptx=path, producer=plan.backward.producer_registers,
                              consumer=plan.backward.consumer_registers)))
    """)
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(dump),
               FP4GEN_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    with open(out["ptx"]) as f:
        return f.read(), {"producer": out["producer"], "consumer": out["consumer"]}


def _gate(ptx, budgets):
    """ptxas's reports and the register gate's mismatches (``fp4gen verify``'s check)."""
    from fp4gen.lowering import ptxas

    try:
        reports = ptxas.assemble(ptx)
    except ptxas.PtxasUnavailable as e:
        pytest.skip(str(e))
    return reports, ptxas.check_registers(ptx, reports, budgets=budgets)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, window, det, gqa", [
    ("fp8", (255, 0), False, False),  # spilled 8 B
    ("fp8", (100, 37), True, True),  # both sides off the tile grid, deterministic dQ, fp32 dK/dV
    ("ds8", (255, 0), False, False),  # spilled 12 B
])
def test_fp8_window_backward_does_not_spill(recipe, window, det, gqa, tmp_path):
    ptx, budgets = _backward_ptx(tmp_path, recipe, window, det=det, gqa=gqa)
    assert "setmaxnreg" in ptx  # the warp-specialised backward, not a helper kernel
    reports, mismatches = _gate(ptx, budgets)
    assert mismatches == [], mismatches
    assert [(r.spill_store_bytes, r.spill_load_bytes) for r in reports] == [(0, 0)], reports


@pytest.mark.slow
def test_gate_sees_the_per_element_mask_spill(tmp_path):
    """Planted fault: the same FP8 window backward masked per element spills, and the gate
    above reports it (else the test above could not fail)."""
    ptx, budgets = _backward_ptx(tmp_path, "fp8", (255, 0), fault=PER_ELEMENT)
    reports, mismatches = _gate(ptx, budgets)
    assert sum(r.spills for r in reports) > 0, reports
    assert [m.check for m in mismatches] == ["ptxas.spills"], mismatches


# ------------------------------------------------------------------ GPU

def _hopper():
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


_MODS = {}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("recipe", ["fp8", "ds8"])
@pytest.mark.parametrize("window", [(0, 0), (-1, 64), (64, -1), (0, 200)])
@pytest.mark.parametrize("shape", [(1, 300, 100, 2, 2), (1, 100, 300, 2, 1)])
def test_fp8_window_rows_edges(recipe, window, shape, tmp_path_factory):
    """The per-row window mask without a softcap (-inf fill) at each side of its rule."""
    from fp4gen.ir.passes import plan_kernel

    key = (recipe, window)
    if key not in _MODS:
        spec = bm.make_masked_spec(recipe, window=window)
        _MODS[key] = (spec, bm.load_module(plan_kernel(spec), str(tmp_path_factory.mktemp("fp8wrows"))))
    spec, mod = _MODS[key]
    row = bm.check_masked(mod, spec, shape)
    assert row["pass"], bm.describe(row)
