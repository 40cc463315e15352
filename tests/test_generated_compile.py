"""Every committed module in generated/ compiles for its own architecture on the CPU.

CuTe DSL reads CUTE_DSL_ARCH once per process, so each target compiles in a child
process of its own. This is the CI check that the kernels users import are not just
rendered but accepted by the compiler (sm_90a and sm_100a need no GPU to compile).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GENERATED = Path(__file__).resolve().parent.parent / "generated"
ARCH = {"sm90a": "sm_90a", "sm100a": "sm_100a"}

CHILD = r"""
import importlib, json, sys, time
out = []
for name in sys.argv[1:]:
    mod = importlib.import_module("fp4gen.generated." + name)
    t0 = time.time()
    compiled = mod.compile_only(sys.argv[0])
    out.append({"module": name, "compiled": compiled, "seconds": round(time.time() - t0, 1)})
print("RESULT " + json.dumps(out))
"""


def _modules(target: str) -> list[str]:
    names = []
    for path in sorted(GENERATED.glob("*.py")):
        if path.name == "__init__.py":
            continue
        text = path.read_text()
        if f'TARGET = "{target}"' in text:
            names.append(path.stem)
    return names


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(ARCH))
def test_generated_modules_compile(target, tmp_path):
    names = _modules(target)
    assert names, f"no generated {target} modules found in {GENERATED}"
    # artifacts some modules keep (PTX for the sm100 conformance check) go to tmp, not the cwd
    env = dict(os.environ, CUTE_DSL_ARCH=ARCH[target], CUTE_DSL_DUMP_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", CHILD.replace("sys.argv[0]", repr(ARCH[target])), *names],
                          capture_output=True, text=True, env=env, timeout=3000)
    assert proc.returncode == 0, f"compiling generated {target} modules failed:\n{proc.stderr[-4000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    results = json.loads(line[len("RESULT "):])
    assert [r["module"] for r in results] == names
    for r in results:
        # each module compiled its forward kernel, named after the kernel (module = KERNEL_TARGET)
        kernel = r["module"][: -len("_" + target)]
        assert any(c == kernel or c == kernel + ".forward" for c in r["compiled"]), r
    print("\n".join(f"{r['module']}: {r['compiled']} in {r['seconds']} s" for r in results))
