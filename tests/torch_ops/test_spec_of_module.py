"""torch_ops._spec_of_module reads the spec from the module's PLAN_JSON, wherever it runs from."""
from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

from fp4gen import torch_ops
from fp4gen.runtime.checks import AttentionInputError

ROOT = Path(__file__).resolve().parents[2]
frontend = pytest.importorskip("fp4gen.frontend")


def module_from_file(path: Path) -> types.ModuleType:
    """The contract constants of a generated module (no CuTe DSL import), and a forward."""
    mod = types.ModuleType(path.stem)
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id in ("KERNEL_NAME", "TARGET", "SPEC_FILE", "PLAN_JSON"):
                    setattr(mod, t.id, node.value.value)
    mod.forward = lambda *a, **k: None
    return mod


@pytest.mark.parametrize("name", ["sm90_fp8_train_causal_d128_sm90a", "fa4_fp4_d128_sm100a"])
def test_spec_from_plan_json_not_from_the_cwd(name, tmp_path, monkeypatch):
    mod = module_from_file(ROOT / "generated" / f"{name}.py")
    text = (ROOT / mod.SPEC_FILE).read_text()
    (want,) = [s for s in frontend.parse_text(text, filename=mod.SPEC_FILE) if s.name == mod.KERNEL_NAME]
    monkeypatch.chdir(tmp_path)  # SPEC_FILE is relative to the repository: not readable from here
    assert not Path(mod.SPEC_FILE).exists()
    assert torch_ops._spec_of_module(mod) == want
    key = torch_ops.spec_key(mod)
    assert torch_ops.spec_for_key(key) == want and key.endswith(torch_ops._fingerprint(want))


def test_no_plan_json_is_none_and_a_bad_one_an_error():
    mod = module_from_file(ROOT / "generated" / "sm90_bf16_d128_sm90a.py")
    del mod.PLAN_JSON
    assert torch_ops._spec_of_module(mod) is None
    mod.PLAN_JSON = '{"spec": {"mask": "none"}}'  # an older schema, without kernel_spec
    with pytest.raises(AttentionInputError, match="PLAN_JSON holds no spec.*plan schema None.*regenerate"):
        torch_ops._spec_of_module(mod)
    mod.PLAN_JSON = "not json"
    with pytest.raises(AttentionInputError, match="not JSON"):
        torch_ops.spec_key(mod)
