"""CuTe DSL's checker warnings on the sm100a kernels: each is triaged beside its code, and a
warning without its triage comment fails (fp4gen/lowering/cute_warnings.py)."""
from __future__ import annotations

from pathlib import Path

from fp4gen.lowering import cute_warnings as cw

ROOT = Path(__file__).resolve().parents[2]
BWD = ROOT / "generated" / "sm100_bwd_causal_d128_sm100a.py"
BWD_LIBRARY = ROOT / "fp4gen" / "device" / "sm100" / "backward.py"
PIPELINES = ROOT / "fp4gen" / "device" / "pipelines.py"  # where the backward's pipelines are created

LOG = """\x1b[93mwarning[nvvm-diag:C3]:\x1b[0m mbarrier arrive count may not match the mbarrier.init count
  --> /tmp/x/module.py:12:5
      in function `kernel(...)`:
   |
\x1b[93mwarning[W0015]:\x1b[0m tcgen05.dealloc is not ordered after prior TMEM loads by a synchronization

  --> /tmp/x/module.py:30:16
"""


def test_parse_reads_code_and_location_through_ansi_colours():
    ws = cw.parse(LOG)
    assert [(w.code, w.line, w.col) for w in ws] == [("C3", 12, 5), ("W0015", 30, 16)]
    assert ws[0].file == "/tmp/x/module.py"
    assert ws[1].message.startswith("tcgen05.dealloc is not ordered")


def test_a_triage_comment_must_name_the_code_say_triaged_and_be_in_the_function():
    w = cw.CuteWarning("C3", "m", line=6, col=1)
    src = ["def kernel():", "    # C3 false positive: four warps arrive. Triaged 2026-12-01.", "    a = 1",
           "    b = 2", "    c = 3", "    bar = make()"]
    assert cw.triaged(w, src)
    assert not cw.triaged(cw.CuteWarning("W0014", "m", 6, 1), src)  # another code
    assert not cw.triaged(w, [ln.replace("Triaged", "Seen") for ln in src])
    # a comment in the function before does not cover this one
    other = ["def f():", "    # C3 ... Triaged", "    pass", "def kernel():", "    x = 1", "    bar = make()"]
    assert not cw.triaged(w, other)
    far = ["def kernel():", "    # C3 Triaged"] + ["    x = 1"] * (cw.WINDOW + 1) + ["    bar = make()"]
    assert not cw.triaged(cw.CuteWarning("C3", "m", len(far), 1), far)


def test_a_warning_in_a_library_file_is_read_against_that_file(tmp_path):
    lib = tmp_path / "kernel.py"
    lib.write_text("def kernel():\n    # C3: four warps arrive. Triaged.\n    bar = make()\n")
    w = cw.CuteWarning("C3", "m", line=3, col=5, file=str(lib))
    module = "def kernel():\n    x = 1\n    bar = make()\n"  # the module has no triage note
    assert cw.untriaged([w], module) == []
    assert cw.untriaged([w], module, {str(lib): lib.read_text().replace("Triaged", "Seen")}) == [w]
    assert cw.untriaged([cw.CuteWarning("C3", "m", 3, 5)], module) != []  # file None: the module


def test_backward_warnings_are_all_triaged_and_a_removed_comment_is_caught():
    src = BWD.read_text()
    found = cw.collect(src, backward=True)
    assert {w.code for w in found} >= {"C3"}, found  # the checker ran and reported something
    # the kernel code is the library's: its warnings name those files
    assert {Path(w.file).resolve() for w in found} <= {BWD_LIBRARY, PIPELINES}, found
    assert cw.untriaged(found, src) == []
    # planted fault: the library without its triage notes (same line numbers)
    planted = {w.file: Path(w.file).read_text().replace("Triaged", "Noted") for w in found}
    assert cw.untriaged(found, src, planted) == found
