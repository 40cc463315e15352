#!/usr/bin/env python3
"""Fingerprint the PTX every generated module compiles to, for refactors that must not change it.

    scripts/ptx_fingerprint.py [MODULE.py ...] > after.json
    scripts/ptx_fingerprint.py --diff before.json after.json

Each module (default: every ``generated/*_sm90a.py`` and ``*_sm100a.py``) is compiled on the
CPU in its own process (``compile_only`` for its target, and ``compile_only_backward`` where the
module has one). Every kernel's PTX is normalised (comments, ``.file``/``.loc`` debug lines and
the mangled entry and parameter names removed: they carry class and module names a refactor may
change) and hashed. ``--diff`` lists the modules of the second file whose multiset of kernel hashes differs and
exits 1 if any does: a refactor that prints nothing compiled to the same instructions.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import importlib.util, itertools, json, sys
from cutlass.base_dsl import compiler as C
_n = itertools.count()
_orig = C.CompileOptions._set_artifact_dump_paths if hasattr(C, "CompileOptions") else None
def _unique(opt, dump_dir, function_name, arch, ext, attr):  # a staticmethod in CuTe DSL 4.8
    return _orig(opt, dump_dir, f"k{next(_n):03d}", arch, ext, attr)
if _orig is not None:
    C.CompileOptions._set_artifact_dump_paths = staticmethod(_unique)
from fp4gen.runtime.loader import exec_file
m = exec_file("fp4gen_fingerprinted", sys.argv[1])
arch = "sm_100a" if m.TARGET == "sm100a" else "sm_90a"
m.compile_only(arch)
if m.TARGET == "sm100a" and hasattr(m, "compile_only_backward"):
    m.compile_only_backward(arch)
"""


def normalise(ptx: str) -> str:
    lines = []
    for line in ptx.splitlines():
        s = line.split("//", 1)[0].rstrip()
        if not s or re.match(r"\s*\.(file|loc)\b", s):
            continue
        lines.append(s)
    text = "\n".join(lines)
    # mangled symbols (entry, params, globals) carry class/module names: number them by first use
    names: dict = {}

    def rename(mo):
        return names.setdefault(mo.group(0), f"SYM{len(names)}")

    return re.sub(r"\b_?[A-Za-z_][A-Za-z0-9_$]*(?:cutlass|kernel|Kernel|object_at|Fake)[A-Za-z0-9_$]*", rename, text)


def fingerprint(module: Path) -> list:
    with tempfile.TemporaryDirectory(prefix="fp4gen_fp_") as d:
        arch = "sm_100a" if module.stem.endswith("_sm100a") else "sm_90a"  # what the GPU would say
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=d, CUTE_DSL_ARCH=arch,
                   FP4GEN_CACHE_DIR=str(Path(d) / "cache"))
        r = subprocess.run([sys.executable, "-c", _CHILD, str(module)], env=env, capture_output=True,
                           text=True, cwd=str(ROOT))
        if r.returncode != 0:
            raise SystemExit(f"{module}: compile failed\n{r.stderr[-3000:]}")
        return sorted(hashlib.sha256(normalise(p.read_text()).encode()).hexdigest()[:16]
                      for p in Path(d).glob("*.ptx"))


def main(argv) -> int:
    if argv[:1] == ["--diff"]:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:3])
        bad = [k for k in sorted(b) if a.get(k) != b[k]]  # the modules fingerprinted after
        for k in bad:
            print(f"{k}: {a.get(k)} -> {b.get(k)}")
        return 1 if bad else 0
    mods = [Path(p) for p in argv] or sorted(
        p for p in (ROOT / "generated").glob("*.py") if p.stem.endswith(("_sm90a", "_sm100a")))
    out = {}
    for p in mods:
        out[p.name] = fingerprint(p)
        print(f"{p.name}: {len(out[p.name])} kernels", file=sys.stderr)
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
