"""What a generated module may hold (issue 17): its spec excerpt, PLAN_JSON, the config the
plan decides, and a thin binding to the kernel library and the runtime; nothing else.

* At most half the lines the module had when issue 17 was filed (commit 3dfd8ce, when every
  module carried its kernel class and host code), not counting PLAN_JSON (one line then,
  several now).
* No host code: no class, no function besides the thin entry points below.
* No retyped constant: every number in the code stands in a ``...Config(...)`` literal, where
  the lowering rendered it from the plan, or is the spec's softmax scale as PLAN_JSON records it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = sorted(p for p in (ROOT / "generated").glob("*.py") if p.stem.endswith(("_sm90a", "_sm100a")))

# `git show 3dfd8ce:generated/<name>.py | wc -l`, minus its one PLAN_JSON line
LINES_AT_3DFD8CE = {
    "fa4_fp4_d128_sm100a": 1032, "fa4_nvfp8_d128_sm100a": 1005, "fa4_nvmx_accurate_d128_sm100a": 1035,
    "sage3_fp4_d128_sm100a": 1042, "sm100_bwd_causal_d128_sm100a": 1608,
    "sm90_bf16_causal_d128_sm90a": 1242, "sm90_bf16_d128_sm90a": 532, "sm90_bf16_d64_sm90a": 527,
    "sm90_fp8_directp_causal_d128_sm90a": 673, "sm90_fp8_directp_d128_sm90a": 665,
    "sm90_fp8_directp_d64_sm90a": 660, "sm90_fp8_exp_causal_d128_sm90a": 637,
    "sm90_fp8_exp_d128_sm90a": 629, "sm90_fp8_exp_d64_sm90a": 624,
    "sm90_fp8_train_bf16grad_causal_d128_sm90a": 1339, "sm90_fp8_train_causal_d128_sm90a": 1414,
    "sm90_fp8_train_ds8_causal_d128_sm90a": 1569,
}
ENTRY_POINTS = {"_build", "_bwd_build", "forward", "forward_varlen", "backward", "compile_only", "compile_only_backward"}


# the 3dfd8ce modules that carried a backward section too
WITH_BACKWARD = {"sm100_bwd_causal_d128_sm100a", "sm90_bf16_causal_d128_sm90a",
                 "sm90_fp8_train_bf16grad_causal_d128_sm90a", "sm90_fp8_train_causal_d128_sm90a",
                 "sm90_fp8_train_ds8_causal_d128_sm90a"}


def _budget(stem: str, tree) -> int:
    """Half the 3dfd8ce lines; a module added since gets the smallest budget among the modules
    of its target with the same passes (forward only, or forward and backward)."""
    if stem in LINES_AT_3DFD8CE:
        return LINES_AT_3DFD8CE[stem] // 2
    target = stem.rsplit("_", 1)[1]
    with_bwd = any(isinstance(n, ast.FunctionDef) and n.name == "backward" for n in tree.body)
    peers = [lines for n, lines in LINES_AT_3DFD8CE.items()
             if n.endswith(target) and (n in WITH_BACKWARD) == with_bwd]
    assert peers, f"no 3dfd8ce peer for {stem}"
    return min(peers) // 2


def _plan_json_span(tree):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PLAN_JSON" for t in node.targets):
            return node.lineno, node.end_lineno
    raise AssertionError("no PLAN_JSON")


def _config_spans(tree):
    spans = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            name = getattr(n.func, "id", getattr(n.func, "attr", ""))
            if name.endswith("Config"):
                spans.append((n.lineno, n.end_lineno))
    return spans


@pytest.fixture(params=GENERATED, ids=lambda p: p.stem)
def module(request):
    src = request.param.read_text()
    return request.param.stem, src, ast.parse(src)


def test_at_most_half_the_lines_of_issue_17s_modules(module):
    stem, src, tree = module
    a, b = _plan_json_span(tree)
    lines = len(src.splitlines()) - (b - a + 1)
    assert lines <= _budget(stem, tree), f"{stem}: {lines} lines besides PLAN_JSON"


def test_no_host_code(module):
    stem, _src, tree = module
    for node in tree.body:
        assert not isinstance(node, ast.ClassDef), f"{stem}:{node.lineno}: class {node.name}"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.name in ENTRY_POINTS, f"{stem}:{node.lineno}: def {node.name} is host code"
            assert len(node.body) <= 12, f"{stem}:{node.lineno}: {node.name} is not a thin binding"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{stem}: imports torch"


def _spec_scale(tree) -> float:
    import json

    (node,) = [n for n in tree.body if isinstance(n, ast.Assign)
               and any(getattr(t, "id", "") == "PLAN_JSON" for t in n.targets)]
    spec = json.loads(ast.literal_eval(node.value))["spec"]
    return spec["softmax_scale"] if spec["softmax_scale"] is not None else spec["head_dim"] ** -0.5


def test_every_number_comes_from_a_config(module):
    stem, _src, tree = module
    allowed = [_plan_json_span(tree)] + _config_spans(tree)
    scale = _spec_scale(tree)
    stray = [(n.lineno, n.value) for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and type(n.value) in (int, float)
             and not any(a <= n.lineno <= b for a, b in allowed) and n.value != scale]
    assert not stray, f"{stem}: numbers outside a rendered config: {stray}"


def test_the_checks_can_fail(tmp_path):
    """Planted faults: a retyped constant, a host function, a class."""
    base = (ROOT / "generated" / "sm90_bf16_d128_sm90a.py").read_text()
    for extra, check in (("\n_BWD_P_SCALE = 256.0\n", test_every_number_comes_from_a_config),
                         ("\nSOFTMAX_SCALE = 0.125\n", test_every_number_comes_from_a_config),  # not D**-0.5
                         ("\ndef _launch(x):\n    return x\n", test_no_host_code),
                         ("\nclass Kernel:\n    pass\n", test_no_host_code)):
        src = base + extra
        with pytest.raises(AssertionError):
            check(("sm90_bf16_d128_sm90a", src, ast.parse(src)))
    bloated = base + "\n".join(f"X{i} = CONFIG" for i in range(300)) + "\n"
    with pytest.raises(AssertionError):
        test_at_most_half_the_lines_of_issue_17s_modules(("sm90_bf16_d128_sm90a", bloated, ast.parse(bloated)))


# `git grep -o "{%" 3dfd8ce -- templates | wc -l`: the jinja control tags of the four templates
# then (sm90 fwd 107, bwd 185; sm100 fwd 28, bwd 12)
CONTROL_TAGS_AT_3DFD8CE = 332


def test_templates_carry_at_most_a_third_of_the_control_tags():
    """Issue 17: templates render structure, the lowering writes the prose and values; every
    template counts, those added since (decode, the reference module) included."""
    counts = {p.relative_to(ROOT).as_posix(): p.read_text().count("{%")
              for p in sorted((ROOT / "templates").rglob("*.j2"))}
    assert sum(counts.values()) <= CONTROL_TAGS_AT_3DFD8CE // 3, counts

