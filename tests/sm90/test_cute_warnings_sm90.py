"""CuTe DSL's checker on sm90a kernels (``fp4gen verify``'s ``cute-warnings`` rows for sm90a).

The sm90a kernels of the examples raise no checker warning (every row says "0 warnings";
tests/cli/test_cli_verify.py runs them), so a check that never sees a warning must be shown to
see one: a tiny sm_90a kernel with a real defect (an mbarrier initialised for 64 arrivals that
one warp of 32 threads arrives on) is compiled through ``collect_module``, the module path
``fp4gen verify`` uses, and its warning must fail until a triage comment names its code. The
row logic is checked with a planted warning that names fp4gen/device/sm90/forward.py.
"""
from __future__ import annotations

from pathlib import Path

from fp4gen.lowering import cute_warnings as cw
from fp4gen.lowering import verify as V

ROOT = Path(__file__).resolve().parents[2]
SM90_FORWARD = ROOT / "fp4gen" / "device" / "sm90" / "forward.py"

# a "generated module" in miniature: compile_only compiles one kernel and names it
PLANTED = '''\
import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator


class Planted:
    @cute.jit
    def __call__(self, stream):
        self.kernel().launch(grid=(1, 1, 1), block=(128, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self):
        tidx, _, _ = cute.arch.thread_idx()
        bar = SmemAllocator().allocate_array(cutlass.Int64, 1)
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 64)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx < 32:
            cute.arch.mbarrier_arrive(bar)
        cute.arch.mbarrier_wait(bar, 0)


def compile_only(arch="sm_90a"):
    cute.compile(Planted(), cute.runtime.make_fake_stream(), options="--gpu-arch sm_90a")
    return ["planted"]
'''


def test_a_planted_sm90_arrive_count_defect_is_reported_and_must_be_triaged():
    ((name, found),) = cw.collect_module(PLANTED, "sm_90a")
    assert name == "planted"
    init_line = PLANTED.splitlines().index("            cute.arch.mbarrier_init(bar, 64)") + 1
    assert [(w.code, w.line, w.file) for w in found] == [("C3", init_line, None)], found  # names the module
    assert cw.untriaged(found, PLANTED) == found
    lines = PLANTED.splitlines()
    lines.insert(init_line - 1, "            # Triaged C3: planted, 64 expected, one warp arrives")
    moved = [w.__class__(w.code, w.message, w.line + 1, w.col, w.file) for w in found]
    assert cw.untriaged(moved, "\n".join(lines)) == []


def _pipeline_line() -> int:
    """A line of the sm90 forward that creates its pipelines (device/pipelines.tma_pipelines)."""
    return next(i for i, ln in enumerate(SM90_FORWARD.read_text().splitlines(), 1)
                if "tma_pipelines(" in ln)


def test_an_untriaged_warning_in_the_sm90_forward_fails_its_row_only(monkeypatch):
    line = _pipeline_line()
    planted = cw.CuteWarning("C3", "mbarrier arrive count may not match", line, 9, str(SM90_FORWARD))
    monkeypatch.setattr(cw, "collect_module", lambda source, arch: [
        ("k", [planted]), ("fp8_quantize_block_d128", []), ("fp8_quantize_amax_d128", [])])
    rows = {c.part: c for c in V._sm90_cute_warnings("k", "module source")}
    assert set(rows) == {"forward", "quantizers"}
    assert not rows["forward"].ok and rows["forward"].detail.startswith("untriaged: ")
    assert f"forward.py:{line}:9: C3" in rows["forward"].detail
    assert rows["quantizers"].ok and rows["quantizers"].detail == "2 kernels, 0 warnings (none)"
    # the same warning with a triage comment above its line in the library file passes
    text = SM90_FORWARD.read_text().splitlines()
    text[line - 2] = "        # Triaged C3: planted for this test"
    assert cw.untriaged([planted], "module source", {str(SM90_FORWARD): "\n".join(text)}) == []
