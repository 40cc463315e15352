"""The schedule text names the mask fields of issue 19 (window sizes, softcap, sinks, layout)
where a spec sets them, and prints nothing new where it does not (the goldens keep their bytes)."""
from __future__ import annotations

from fp4gen.ir.dump import to_text
from fp4gen.ir.passes import plan_kernel
from fp4gen.ir.spec import Layout, Mask, Sinks

import specs


def _header(spec) -> str:
    return to_text(plan_kernel(spec)).splitlines()[1]


def test_window_softcap_sinks_layout_are_printed():
    spec = specs.reference(mask=Mask.WINDOW, window=(128, 0), softcap=30.0, sinks=Sinks.LEARNED,
                           layout=Layout.VARLEN)
    assert "head_dim 128, mask window(128, 0), softcap 30, sinks learned, layout varlen, tile" in _header(spec)


def test_each_field_alone():
    assert ", mask window(-1, 64), tile" in _header(specs.reference(mask=Mask.WINDOW, window=(-1, 64)))
    assert ", mask none, softcap 0.5, tile" in _header(specs.reference(softcap=0.5))
    assert ", mask causal, sinks learned, tile" in _header(specs.reference(mask=Mask.CAUSAL, sinks=Sinks.LEARNED))


def test_a_spec_without_them_prints_the_mask_alone():
    for spec in (specs.reference(), specs.reference(mask=Mask.CAUSAL), specs.paper_fp4()):
        header = _header(spec)
        assert f", mask {spec.mask.value}, tile" in header
        assert not any(w in header for w in ("softcap", "sinks", "layout", "window"))
