"""CuTe DSL's own checker on a generated sm100a kernel, and which of its warnings are triaged.

``cute.compile(..., options="warnings")`` runs CuTe DSL's synchronisation and TMEM checks
(mbarrier arrive counts, TMEM loads outstanding at a release or a dealloc, ...) and prints each
finding with a file:line: the kernel classes' files (fp4gen/device/sm100/forward.py,
backward.py), where the kernel code lives, or the generated module. Issue 16 asks that every
one be fixed, or be suppressed with a reason next to the code it names. A warning counts as triaged
when a comment above the line it names, in the same function and within ``WINDOW`` lines (one
comment may cover a block of similar statements, e.g. eight barrier creations), mentions its
code (``C3``, ``W0014``, ...) and the word "Triaged"; anything else fails ``fp4gen verify``, so
a new warning cannot slip in unread.

The compile runs in a child process (CuTe DSL state and ``CUTE_DSL_ARCH`` stay out of the
caller) and keeps nothing: with ``options`` CuTe DSL does not keep PTX, so this is one extra
compile per kernel (~15 s), paid by ``fp4gen verify`` only.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

WINDOW = 80  # lines above a warning's line searched for its triage comment

_RUNNER = textwrap.dedent("""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("fp4gen_generated_under_test", sys.argv[1])
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    if sys.argv[2] == "backward":
        host = m._BWD_HOST
        Kernel, cutlass, cute = host.build()
        args = host.fake_args(cutlass, cute, False) + (cute.runtime.make_fake_stream(),)
    else:
        host = m._HOST
        Kernel, cutlass, cute = host.build()
        args = host.fake_args(cutlass, cute)
    cute.compile(Kernel(), *args, options="warnings")
""")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HEAD = re.compile(r"^warning\[(?:[\w-]+:)?(?P<code>\w+)\]:\s*(?P<msg>.*)$")
_AT = re.compile(r"^\s*-->\s*(?P<file>.+?):(?P<line>\d+):(?P<col>\d+)\s*$")


@dataclass(frozen=True)
class CuteWarning:
    code: str  # e.g. "C3", "W0014"
    message: str
    line: int  # in ``file``
    col: int
    file: Optional[str] = None  # the source file it names; None: the generated module

    def __str__(self) -> str:
        where = f"{self.file}:" if self.file else ""
        return f"{where}{self.line}:{self.col}: {self.code} {self.message}"


def parse(log: str) -> list:
    """The warnings of one compile's output, in order (each header and its ``-->`` location)."""
    out, head = [], None
    for raw in log.splitlines():
        s = _ANSI.sub("", raw)
        m = _HEAD.match(s.strip())
        if m:
            head = m
            continue
        at = _AT.match(s)
        if at and head is not None:
            out.append(CuteWarning(head["code"], head["msg"].strip(), int(at["line"]), int(at["col"]), at["file"]))
            head = None
    return out


def collect(source: str, *, backward: bool = False, timeout: int = 900) -> list:
    """Compile a generated sm100a module's forward (or backward) with CuTe's checker on and
    return its warnings. Raises RuntimeError when the compile fails."""
    with tempfile.TemporaryDirectory(prefix="fp4gen_cute_warnings_") as tmp:
        mod = Path(tmp) / "module.py"
        mod.write_text(source)
        env = dict(os.environ, CUTE_DSL_ARCH="sm_100a")
        r = subprocess.run([sys.executable, "-c", _RUNNER, str(mod), "backward" if backward else "forward"],
                           env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"sm_100a compilation with CuTe warnings failed (exit {r.returncode}):\n"
                           f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    # the compiled copy of the module is gone with tmp: a warning there names the module itself
    return [dataclasses.replace(w, file=None) if w.file in (str(mod), "module.py") else w
            for w in parse(r.stdout + "\n" + r.stderr)]


def triaged(warning: CuteWarning, source_lines: list) -> bool:
    """A comment above the warning's line (same function, within WINDOW lines) names its code
    and says Triaged."""
    above = []
    for ln in reversed(source_lines[max(0, warning.line - 1 - WINDOW):warning.line]):
        s = ln.strip()
        if s.startswith("def ") or s.startswith("async def "):
            break
        above.append(s)
    comments = " ".join(ln for ln in above if ln.startswith("#"))
    return "Triaged" in comments and re.search(rf"\b{re.escape(warning.code)}\b", comments) is not None


def untriaged(warnings: list, source: str, texts: Optional[dict] = None) -> list:
    """The warnings without their triage comment. A warning that names the module is read
    against ``source``; one that names another file (the kernel library) against that file's
    text, from ``texts`` (path -> text; tests plant faults there) or read from disk."""
    texts = dict(texts or {})
    out = []
    for w in warnings:
        if w.file is None:
            text = source
        else:
            if w.file not in texts:
                texts[w.file] = Path(w.file).read_text(encoding="utf-8")
            text = texts[w.file]
        if not triaged(w, text.splitlines()):
            out.append(w)
    return out
