"""experiments/ds_scale_variants.py still applies to the generated all-FP8 backward: every
variant's edits find their lines (a template change that moves them fails here, not on the GPU)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("_ds_scale_variants", ROOT / "experiments" / "ds_scale_variants.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_variant_applies_and_is_renamed(tmp_path):
    script = _script()
    text = script.SOURCE.read_text()
    sources = {name: script.variant_source(text, name) for name in script.VARIANTS}
    for name, src in sources.items():
        assert f"KERNEL_NAME = '{script.NAME}_ab_{name}'\n" in src  # rendered with repr, as the generated module
        assert src.count("KERNEL_NAME = ") == 1
    base = sources["base"].replace(f"{script.NAME}_ab_base", script.NAME)
    assert base == text  # the baseline is the generated module itself
    assert len(set(sources.values())) == len(sources)  # each variant changes something
    and_barrier = 'ds_small, "and")'
    assert text.count(and_barrier) == 1 and and_barrier not in sources["one_barrier"]
    assert script.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.py")) == sorted(f"ds8_ab_{n}.py" for n in script.VARIANTS)
