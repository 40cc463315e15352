"""fp4gen.runtime.dlpack: the one torch -> CuTe conversion of the CuTe-ABI launch paths."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass")


def test_float8_goes_through_its_bytes_and_keeps_its_type():
    from fp4gen.runtime.dlpack import cute_tensor

    c = cute_tensor(torch.zeros(4, 8, dtype=torch.float8_e4m3fn))
    assert str(c.element_type) == "Float8E4M3FN" and "(?,?)" in str(c)


def test_other_dtypes_keep_theirs_and_none_stays_none():
    from fp4gen.runtime.dlpack import cute_tensor

    assert cute_tensor(None) is None
    for dtype, name in ((torch.float32, "Float32"), (torch.int32, "Int32"), (torch.bfloat16, "BFloat16")):
        c = cute_tensor(torch.zeros(4, 8, dtype=dtype), align4=(torch.float32, torch.int32))
        assert str(c.element_type) == name
