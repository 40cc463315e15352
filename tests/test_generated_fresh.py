"""generated/ must be exactly what `fp4gen regenerate` makes from examples/*.attn."""
from __future__ import annotations

from fp4gen.lowering.regenerate import regenerate, report, repo_root


def test_generated_is_up_to_date():
    res = regenerate(repo_root(), check=True)
    assert res.up_to_date, "generated/ is stale; run `fp4gen regenerate`:\n" + report(res, check=True)
