"""`p_source smem` (issue 16 item 5): the sm100a PV MMA reads P from an SMEM tile.

Language (the statement, its default, its diagnostics), plan (PV's A source, no P regions in
TMEM, P's SMEM tiles in the budget, sm90a refuses it), serializer (the field round-trips and a
tmem spec's dict keeps its bytes), lowering (the SS MMA, swizzled st.shared of P, the proxy
fence) and the compiled kernel's static checks, each with a planted fault it must catch.
The emulator run of the kernel is `fp4gen verify examples/fa4_fp4_psmem_d128.attn`.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from fp4gen.frontend import parse_file, parse_text
from fp4gen.frontend import SpecError
from fp4gen.ir.passes import plan_kernel, simulate
from fp4gen.ir.plan import PlanError
from fp4gen.ir.serialize import spec_from_dict, spec_to_dict
from fp4gen.ir.spec import PSource, Target

ROOT = Path(__file__).resolve().parents[2]
PSMEM = ROOT / "examples" / "fa4_fp4_psmem_d128.attn"
PAPER = ROOT / "examples" / "fa4_fp4_d128.attn"


def _with_line(text: str, after: str, line: str) -> str:
    assert after in text
    return text.replace(after, after + "\n" + line, 1)


def _paper_text() -> str:
    return PAPER.read_text()


# ------------------------------------------------------------------ language


def test_p_source_parses_with_its_location():
    (spec,) = parse_file(PSMEM)
    assert spec.schedule.p_source is PSource.SMEM
    loc = spec.loc("schedule.p_source")
    line = PSMEM.read_text().splitlines()[loc.line - 1]
    assert line[loc.col - 1:].startswith("smem")


def test_p_source_defaults_to_tmem():
    (spec,) = parse_file(PAPER)
    assert spec.schedule.p_source is PSource.TMEM
    assert spec.loc("schedule.p_source") is None


@pytest.mark.parametrize("word", ["gmem", "SMEM", "regs"])
def test_a_bad_p_source_is_reported_at_its_word_with_the_allowed_values(word):
    text = _with_line(_paper_text(), "    p_publish halves", f"    p_source  {word}")
    with pytest.raises(SpecError) as ei:
        parse_text(text, "bad.attn")
    (d,) = ei.value.diagnostics
    line_no = next(i for i, ln in enumerate(text.splitlines(), 1) if f"p_source  {word}" in ln)
    col = text.splitlines()[line_no - 1].index(word) + 1
    assert (d.loc.line, d.loc.col) == (line_no, col)
    assert f"'{word}'" in d.message and "'tmem'" in d.message and "'smem'" in d.message


def test_p_source_twice_is_an_error():
    text = _with_line(_paper_text(), "    p_publish halves", "    p_source smem\n    p_source tmem")
    with pytest.raises(SpecError) as ei:
        parse_text(text, "twice.attn")
    assert any("p_source is set twice" in d.message for d in ei.value.diagnostics)


def test_fp4gen_check_prints_file_line_col(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.attn"
    text = _with_line(_paper_text(), "    p_publish halves", "    p_source  gmem")
    bad.write_text(text)
    exe = Path(sys.executable).parent / "fp4gen"
    r = subprocess.run([str(exe), "check", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0
    line_no = next(i for i, ln in enumerate(text.splitlines(), 1) if "p_source  gmem" in ln)
    assert f"{bad}:{line_no}:15: error: unknown p_source value 'gmem'; expected 'tmem' or 'smem'" in r.stdout + r.stderr


# ------------------------------------------------------------------ plan


@pytest.fixture(scope="module")
def plans():
    (smem,) = parse_file(PSMEM)
    (tmem,) = parse_file(PAPER)
    return plan_kernel(smem, debug=True), plan_kernel(tmem, debug=True)


def test_pv_reads_a_from_smem_and_no_p_region_exists(plans):
    ps, pt = plans
    assert ps.mma_choice("PV").a_source == "smem" and pt.mma_choice("PV").a_source == "tmem"
    assert ps.mma_choice("QK") == pt.mma_choice("QK")
    names_s, names_t = set(ps.tmem.names()), set(pt.tmem.names())
    assert {"P0", "P1"} <= names_t and not {"P0", "P1"} & names_s
    # everything else of the TMEM map (S, O and every scale region) is planned as before
    assert names_s == names_t - {"P0", "P1"}
    assert ps.contract("P").storage.startswith("smem")
    assert all(p.p_columns is None for p in ps.publish.parts)


def test_the_smem_plan_grows_by_one_p_tile_per_query_stage(plans):
    ps, pt = plans
    s = ps.spec
    tile = s.schedule.tile_m * s.schedule.tile_n * s.p.format.bits // 8
    items_s = {i.name: i.bytes for i in ps.pipeline.smem}
    items_t = {i.name: i.bytes for i in pt.pipeline.smem}
    assert items_s.pop("P") == s.schedule.q_stages * tile
    assert items_s == items_t  # the same KV stages and O staging fit (227 KiB)
    assert ps.pipeline.smem_bytes == pt.pipeline.smem_bytes + s.schedule.q_stages * tile


def test_the_events_have_no_tmem_access_to_p_and_simulate(plans):
    ps, _ = plans
    for e in ps.events:
        assert not any(a.region.startswith("P") for a in e.reads + e.writes), e
    simulate(ps, 3)


def test_sm90a_refuses_p_source_smem_at_its_line():
    text = (ROOT / "examples" / "sm90_fp8_directp_d128.attn").read_text()
    text = re.sub(r"(\n\s*schedule\s*\{)", r"\1\n    p_source smem", text, count=1)
    spec = parse_text(text, "sm90.attn")[0]  # the first kernel took the statement
    assert spec.schedule.p_source is PSource.SMEM
    with pytest.raises(PlanError) as ei:
        plan_kernel(spec)
    assert ei.value.loc == spec.loc("schedule.p_source")
    assert "p_source smem" in ei.value.message


def test_an_explicit_p_region_is_unknown_with_p_source_smem():
    text = PSMEM.read_text().replace("tmem      auto", "tmem { P0 cols 64..79 }")
    (spec,) = parse_text(text, "x.attn")
    with pytest.raises(PlanError) as ei:
        plan_kernel(spec)
    assert "unknown TMEM region 'P0'" in ei.value.message


# ------------------------------------------------------------------ serializer


def test_spec_dict_round_trips_p_source_and_omits_the_default():
    (smem,) = parse_file(PSMEM)
    (tmem,) = parse_file(PAPER)
    d = spec_to_dict(smem)
    assert d["schedule"]["p_source"] == "smem"
    assert spec_from_dict(d) == smem
    assert "p_source" not in spec_to_dict(tmem)["schedule"]  # existing dumps keep their bytes
    assert spec_from_dict(spec_to_dict(tmem)).schedule.p_source is PSource.TMEM
    # planted fault: a dict that lost the field reads back as tmem, not as the spec
    d2 = spec_to_dict(smem)
    del d2["schedule"]["p_source"]
    assert spec_from_dict(d2) != smem


# ------------------------------------------------------------------ lowering and the compiled kernel


def _render(spec):
    from fp4gen.lowering import sm100

    return sm100.render(plan_kernel(spec))


def test_the_tmem_rendering_configures_p_in_tmem():
    src = _render(parse_file(PAPER)[0])
    assert "    p_smem=False,\n" in src and "('P0', " in src  # the kernel reads P's plan region


def test_the_smem_rendering_configures_p_in_smem_and_no_p_region():
    src = _render(parse_file(PSMEM)[0])
    assert "    p_smem=True,\n" in src and "    p_row_bytes=64,\n" in src
    assert "('P0', " not in src and "('P1', " not in src


def test_the_lowering_refuses_smem_p_it_does_not_implement():
    from fp4gen.lowering import LoweringError, sm100

    text = (ROOT / "examples" / "fa4_nvfp8_d128.attn").read_text()
    text = re.sub(r"(\n\s*schedule\s*\{)", r"\1\n    p_source smem", text, count=1)
    (spec,) = parse_text(text, "nvfp8.attn")
    with pytest.raises(LoweringError) as ei:
        sm100.render(plan_kernel(spec))
    assert ei.value.path == "schedule.p_source"


@pytest.mark.parametrize("example,what", [("fa4_nvfp8_d128", "P : fp8e4m3 via exp"),
                                          ("sage3_fp4_d128", "P : nvfp4 via two_level")])
def test_every_other_recipe_refuses_smem_p_at_its_line(tmp_path, example, what):
    """`fp4gen check` on each sm100a recipe without an SMEM-P kernel: the refusal names the
    p_source statement's file:line:col and the implemented form, exit 1."""
    import subprocess
    import sys

    text = (ROOT / "examples" / f"{example}.attn").read_text()
    text = re.sub(r"(\n\s*schedule\s*\{)", r"\1\n    p_source smem", text, count=1)
    bad = tmp_path / f"{example}.attn"
    bad.write_text(text)
    exe = Path(sys.executable).parent / "fp4gen"
    r = subprocess.run([str(exe), "check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1
    line_no = next(i for i, ln in enumerate(text.splitlines(), 1) if "p_source smem" in ln)
    assert (f"{bad}:{line_no}:14: error: kernel '{example}' (sm100a): cannot compile for sm100a: sm100a "
            f"lowering implements p_source smem for P : mxfp4 via direct_p only (this plan: {what})") in r.stdout + r.stderr


CACHE = Path(os.environ.get("FP4GEN_PSMEM_CACHE", "/tmp/fp4gen_psmem_cache"))


@pytest.fixture(scope="module")
def compiled():
    """(plan, Artifacts) of the psmem kernel; one compile per source text (cached on disk)."""
    from fp4gen.lowering import conformance as C

    (spec,) = parse_file(PSMEM)
    plan = plan_kernel(spec)
    src = _render(spec)
    from fp4gen.runtime.cache import kernel_deps_version

    # the module's source and the fp4gen code its kernel traces (the kernel library)
    key = CACHE / hashlib.sha256((src + kernel_deps_version()).encode()).hexdigest()
    if not (key / "kernel.ptx").exists() or not (key / "kernel.mlir").exists():
        art = C.compile_artifacts(src, str(key / "build"))
        key.mkdir(parents=True, exist_ok=True)
        (key / "kernel.mlir").write_text(art.mlir)
        (key / "kernel.ptx").write_text(art.ptx)  # written last: its presence marks a whole entry
    return plan, C.Artifacts(ptx=(key / "kernel.ptx").read_text(), mlir=(key / "kernel.mlir").read_text())


def test_the_compiled_kernel_conforms_to_its_plan(compiled):
    from fp4gen.lowering import conformance as C

    plan, art = compiled
    assert C.check_conformance(plan, art) == []


def test_the_compiled_kernels_descriptors_match_its_plan(compiled):
    from fp4gen.lowering import descriptors as D

    plan, art = compiled
    assert D.check_descriptors(plan, art.ptx) == []
    pv = [m for m in D.mma_instructions(art.ptx) if m.kind.endswith("block32")]
    assert pv and all(m.a_source == "smem" for m in pv)


def test_planted_missing_proxy_fence_is_caught(compiled):
    from fp4gen.lowering import conformance as C

    plan, art = compiled
    ptx = re.sub(r"(?m)^\s*fence\.proxy\.async[^\n]*\n", "", art.ptx)
    checks = {m.check for m in C.check_conformance(plan, replace(art, ptx=ptx))}
    assert "ptx.fence.p_smem" in checks


def test_planted_missing_p_stores_are_caught(compiled):
    from fp4gen.lowering import conformance as C

    plan, art = compiled
    ptx = re.sub(r"(?m)^\s*st\.shared\.(v4\.)?b32\s+\[[^\]]+\],\s*[{%][^\n]*\n", "", art.ptx)
    checks = {m.check for m in C.check_conformance(plan, replace(art, ptx=ptx))}
    assert "ptx.p_smem.stores" in checks


def test_the_tmem_plan_does_not_accept_the_smem_kernel(compiled, plans):
    """Planted fault in the other direction: the same PTX/MLIR judged against the TMEM-A plan."""
    from fp4gen.lowering import conformance as C
    from fp4gen.lowering import descriptors as D

    _, art = compiled
    _, pt = plans
    assert "mma.PV.a_source" in {m.check for m in D.check_descriptors(pt, art.ptx)}
    assert C.check_conformance(pt, art) != []


# ------------------------------------------------------------------ the emulator (slow: ~25 s each)

SWIZZLE_LINE = "p_sw = ((t * cfg.p_row_bytes) >> Int32(7)) & Int32(cfg.p_row_bytes // 16 - 1)"
LIBRARY = ROOT / "fp4gen" / "device" / "sm100" / "forward.py"
LIBRARY_IMPORT = "from fp4gen.device.sm100.forward import AttentionFwdSm100"


def _with_planted_library(src, tmp_path, old, new):
    """``src`` bound to a copy of the kernel library with ``old`` replaced by ``new`` (the
    kernel code lives in fp4gen/device/sm100/forward.py, not in the module)."""
    lib = LIBRARY.read_text()
    assert old in lib and LIBRARY_IMPORT in src
    (tmp_path / "fp4gen_planted_forward.py").write_text(lib.replace(old, new))
    return src.replace(LIBRARY_IMPORT, f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
                                       "from fp4gen_planted_forward import AttentionFwdSm100")


def _emulate(src):
    from fp4gen.lowering.emulator import run

    res = run.emulate_forward(src, seed=0, seqlen_q=256, seqlen_k=448)  # one CTA, 3.5 KV tiles
    return res, run.o_tolerance(res), run.LSE_TOLERANCE


def test_the_emulated_kernel_matches_the_reference():
    src = _render(parse_file(PSMEM)[0])
    res, tol, lse_tol = _emulate(src)
    assert res.max_abs_err <= tol and res.max_lse_err <= lse_tol


def test_planted_unswizzled_p_stores_are_caught_by_the_emulator(tmp_path):
    """The SS MMA reads P through its descriptor's 64-byte swizzle: stores that ignore it put
    the chunks of odd row pairs in the wrong K positions, and O is wrong (LSE is not: it comes
    from the scores)."""
    src = _render(parse_file(PSMEM)[0])
    res, tol, _ = _emulate(_with_planted_library(src, tmp_path, SWIZZLE_LINE, "p_sw = t & Int32(0)  # planted: no swizzle"))
    assert res.max_abs_err > tol
