"""The backward model (fp4gen/lowering/perf_backward.py) on the generated sm100a backwards: its
roles are found from the SASS, the serial rule adds them up, and the FP8-dO kernel's tensor time
is the one its plan implies. (FA4's backward is compiled only by ``fp4gen perf --backward``,
which needs flash-attn-4: not here.)"""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each backward compiles once (~10 s, cached on disk)


@pytest.fixture(scope="module")
def kernels():
    from fp4gen.lowering import perf_backward as pb

    return {n: pb.fp4gen_backward(str(ROOT / "generated" / f"{n}_sm100a.py"))
            for n in ("sm100_bwd_causal_d128", "sm100_bwd_fp8do_causal_d128")}


def test_roles_and_the_serial_chain(kernels):
    from fp4gen.lowering import perf_backward as pb
    from fp4gen.lowering.perf import GPUS

    for name, k in kernels.items():
        roles = pb._roles(k)
        assert {"mma", "compute", "dq"} <= set(roles), (name, set(roles))
        assert roles["compute"]["main"]["pipes"]["mufu"] == 128  # one exp2 per (key, query) of the row
        step = pb.step_cycles(k, GPUS["b200"], roles=roles)
        r = step["roles"]
        assert step["schedule"] == "serial"
        assert step["cycles"] == pytest.approx(step["tensor_cycles"] + r["compute"]["cycles"] + r["dq"]["cycles"])


def test_fp8_do_halves_the_tensor_time_of_dp_and_dv(kernels):
    from fp4gen.lowering import perf_backward as pb
    from fp4gen.lowering.perf import GPUS

    g = GPUS["b200"]
    bf, f8 = (pb.step_cycles(kernels[n], g) for n in ("sm100_bwd_causal_d128", "sm100_bwd_fp8do_causal_d128"))
    one = 2.0 * 128 ** 3 / g.tensor_flops_per_clk["bf16"]  # one 128^3 bf16 product
    assert bf["tensor_cycles"] == pytest.approx(5 * one)
    assert f8["tensor_cycles"] == pytest.approx(3 * one + one)  # dP^T and dV at twice the rate
    assert kernels["sm100_bwd_fp8do_causal_d128"].formats == {"S": "bf16", "dP": "fp8", "dV": "fp8",
                                                              "dK": "bf16", "dQ": "bf16"}


def test_prediction_counts_the_causal_tiles(kernels):
    from fp4gen.lowering import perf_backward as pb

    k = kernels["sm100_bwd_causal_d128"]
    full = pb.predict(k, "b200", {"B": 1, "H": 148, "S": 4096, "causal": False})
    causal = pb.predict(k, "b200", {"B": 1, "H": 148, "S": 4096, "causal": True})
    # half the FLOPs, and (one CTA row per SM) about half the tile steps: similar TFLOP/s
    assert causal["predicted_ms"] < 0.6 * full["predicted_ms"]
    assert 0.8 < causal["predicted_tflops"] / full["predicted_tflops"] < 1.1


def test_cli_says_when_no_spec_has_an_sm100a_backward(capsys):
    """``fp4gen perf --backward`` on an sm90a spec: no FA4 needed, a clear message, exit 1."""
    from fp4gen.lowering import perf, perf_backward

    a = perf.parse_args(["--backward", str(ROOT / "examples" / "sm90_bf16_d128.attn"), "--seqlens", "4096"])
    assert perf_backward.main(a) == 1
    assert "none of the specs has an sm100a backward" in capsys.readouterr().err
