"""CuTe DSL's own checker on a generated kernel, and which of its warnings are triaged.

``cute.compile(..., options="warnings")`` runs CuTe DSL's synchronisation and TMEM checks
(mbarrier arrive counts, TMEM loads outstanding at a release or a dealloc, ...) and prints each
finding with a file:line: the kernel classes' files (fp4gen/device/sm100/*.py,
fp4gen/device/sm90/*.py, the helper kernels' fp4gen/device/quantize.py and bwd_prep.py), where
the kernel code lives, or the generated module. ``collect`` compiles an sm100a module's forward
or backward; ``collect_module`` every kernel an (sm90a) module's ``compile_only`` compiles. Issue 16 asks that every
one be fixed, or be suppressed with a reason next to the code it names. A warning counts as triaged
when a comment above the line it names, in the same function and within ``WINDOW`` lines (one
comment may cover a block of similar statements, e.g. eight barrier creations), mentions its
code (``C3``, ``W0014``, ...) and the word "Triaged"; anything else fails ``fp4gen verify``, so
a new warning cannot slip in unread.

The compile runs in a child process (CuTe DSL state and ``CUTE_DSL_ARCH`` stay out of the
caller) and keeps nothing: with ``options`` CuTe DSL does not keep PTX, so this is one extra
compile per kernel (~15 s), paid by ``fp4gen verify`` only. ``collect_module`` turns the checker
on through ``CUTE_DSL_COMPILER_OPT=warnings``, which CuTe DSL adds to the options every host
passes, so the module's own compile path runs unchanged.
"""
from __future__ import annotations

import dataclasses
import json
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
    from fp4gen.runtime.loader import exec_file
    m = exec_file("fp4gen_generated_under_test", sys.argv[1])
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

# Every compile of ``compile_only(arch)``, its checker output (CuTe DSL prints it to
# sys.stderr) captured apart, so that each warning belongs to the kernel compiled.
_MODULE_RUNNER = textwrap.dedent("""
    import contextlib, importlib.util, io, json, sys
    import cutlass.cute as cute
    _compile, logs = cute.compile, []
    def _logged(*args, **kwargs):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stderr(buf):
                return _compile(*args, **kwargs)
        finally:
            logs.append(buf.getvalue())
            sys.stderr.write(buf.getvalue())  # a failing compile's diagnostics stay visible
    cute.compile = _logged
    from fp4gen.runtime.loader import exec_file
    m = exec_file("fp4gen_generated_under_test", sys.argv[1])
    names = m.compile_only(sys.argv[2])
    print(json.dumps({"names": names, "logs": logs}))
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
    return [_named_in(w, mod) for w in parse(r.stdout + "\n" + r.stderr)]


def _named_in(w: CuteWarning, mod: Path) -> CuteWarning:
    """The warning, with ``file`` None when it names the compiled copy of the module (that copy
    is gone with its temporary directory: the caller reads the module's source instead)."""
    return dataclasses.replace(w, file=None) if w.file in (str(mod), mod.name) else w


def collect_module(source: str, arch: str = "sm_90a", *, timeout: int = 1800) -> list:
    """Compile every kernel a generated module's ``compile_only(arch)`` compiles, each with
    CuTe's checker on; return ``(name, warnings)`` per compile, in compile order, the names
    ``compile_only``'s. Raises RuntimeError when a compile fails or the names and compiles
    disagree in number."""
    with tempfile.TemporaryDirectory(prefix="fp4gen_cute_warnings_") as tmp:
        mod = Path(tmp) / "module.py"
        mod.write_text(source)
        env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_COMPILER_OPT="warnings",
                   FP4GEN_CACHE_DIR=str(Path(tmp) / "cache"))  # compile, never a cache hit
        r = subprocess.run([sys.executable, "-c", _MODULE_RUNNER, str(mod), arch],
                           env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{arch} compilation with CuTe warnings failed (exit {r.returncode}):\n"
                           f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    names, logs = out["names"], out["logs"]
    if len(names) != len(logs):
        raise RuntimeError(f"compile_only named {len(names)} kernels ({', '.join(names)}) but ran "
                           f"{len(logs)} compiles")
    return [(name, [_named_in(w, mod) for w in parse(log)]) for name, log in zip(names, logs)]


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
