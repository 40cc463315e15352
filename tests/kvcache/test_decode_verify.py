"""``fp4gen verify`` on the sm90a decode modules: the split-KV kernel has no warp
specialisation and no setmaxnreg, so its row is gated like the helper kernels (no setmaxnreg,
no C7508, no spill), not against the forward's producer/consumer budgets, which it never sets
(that gate failed every decode module). Planted fault: a complaint from the helper gate fails
the row."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sm90_decode_bf16_d128.attn"

pytestmark = pytest.mark.slow


def _plan():
    from fp4gen import parse_file
    from fp4gen.ir.passes import plan_kernel

    spec = parse_file(str(EXAMPLE))[0]
    return plan_kernel(spec)


def test_decode_module_passes_the_helper_gate():
    from fp4gen.lowering import verify as V

    rows = V.verify_sm90(_plan())
    regs = [r for r in rows if r.check == "registers"]
    assert len(regs) == 1 and regs[0].part == "forward"
    assert all(r.ok for r in rows), V.table(rows)
    assert "no setmaxnreg" in regs[0].detail and "spills 0 B" in regs[0].detail


def test_a_helper_gate_complaint_fails_the_decode_row(monkeypatch):
    from fp4gen.lowering import ptxas
    from fp4gen.lowering import verify as V

    monkeypatch.setattr(ptxas, "check_helper", lambda ptx, reports, **kw: ["planted: 8 bytes spill stores"])
    regs = [r for r in V.verify_sm90(_plan()) if r.check == "registers"]
    assert not regs[0].ok and "planted" in regs[0].detail
