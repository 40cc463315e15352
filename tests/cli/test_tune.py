"""``fp4gen tune`` on the CPU: the candidate set, the decision, the correctness gate, the
write-back, and the user errors. Fake compilers and timers stand in for the GPU (the timer, the
checker and the compiler are ``tune_kernel``'s arguments); one slow test compiles two real
candidates."""
from __future__ import annotations

import difflib
import json
import math
import os

import pytest

from conftest import EXAMPLES, planner_available

pytestmark = pytest.mark.skipif(not planner_available(), reason="the planner is not available")

BF16 = EXAMPLES / "sm90_bf16_d128.attn"
FP8 = EXAMPLES / "sm90_fp8_directp_d128.attn"

SMALL = """# a small BF16 forward to tune
attention small_d64 {
  target   sm90a
  head_dim 64
  mask     causal   # bottom-right
  Q : bf16
  K : bf16
  P : bf16
  V : bf16
  O : bf16
}

attention other {   # not tuned: its bytes must not move
  target reference
  head_dim 64
  schedule { tile 128 x 64 }
}
"""


def _tune():
    from fp4gen.cli import tune

    return tune


def _smem_fits(n: int, kv: int, d: int = 128) -> bool:
    """The sm90a forward's SMEM items written out here from docs/plan.md's budget: bf16 Q
    (128 x d), kv stages of bf16 K and V (n x d each), 4 kv + 2 mbarriers of 8 B."""
    from fp4gen.ir.plan import SMEM_LIMIT_BYTES

    return 128 * d * 2 + kv * 2 * n * d * 2 + (4 * kv + 2) * 8 <= SMEM_LIMIT_BYTES


# --------------------------------------------------------------------------- enumeration


def test_bf16_candidates_are_the_legal_schedules():
    tune = _tune()
    text = BF16.read_text()
    cands, skipped = tune.enumerate_candidates(text, str(BF16), "sm90_bf16_d128")
    got = {(c.tile_m, c.tile_n, c.kv_stages) for c in cands}
    # what LANGUAGE.md / lowering/sm90.py state: 128-row tiles (two consumer warpgroups), 64..128
    # keys in steps of 16, at least 2 K/V stages, within the SMEM limit
    want = {(128, n, kv) for n in range(64, 129, 16) for kv in range(2, 9) if _smem_fits(n, kv)}
    assert got == want
    assert len(got) == len(cands)  # no duplicates
    # every point of the raw space is a candidate or refused with a reason
    refused_any = {(s.tile_m, s.tile_n) for s in skipped if s.kv_stages is None}
    refused_kv = {(s.tile_m, s.tile_n, s.kv_stages) for s in skipped if s.kv_stages is not None}
    for m in tune.TILE_M_CHOICES:
        for n in range(16, 257, 16):
            if (m, n) in refused_any:
                continue
            for kv in tune.KV_STAGE_CHOICES:
                assert ((m, n, kv) in got) != ((m, n, kv) in refused_kv), (m, n, kv)
    assert all(s.reason for s in skipped)
    reasons = {(s.tile_m, s.tile_n, s.kv_stages): s.reason for s in skipped}
    assert "128-row" in reasons[(64, 128, None)]
    assert "at least 2 K/V stages" in reasons[(128, 128, 1)]
    assert "SMEM" in reasons[(128, 128, 4)]
    # the planner's own choice (schedule all auto) is flagged and tried first
    auto = [c for c in cands if c.auto]
    assert len(auto) == 1 and cands[0] is auto[0]
    assert (auto[0].tile_m, auto[0].tile_n, auto[0].kv_stages) == (128, 128, 2)


def test_each_candidate_text_plans_to_itself():
    from fp4gen.ir.passes import plan_kernel

    import fp4gen

    tune = _tune()
    cands, _ = tune.enumerate_candidates(BF16.read_text(), str(BF16), "sm90_bf16_d128")
    for c in cands[:4]:
        spec = {s.name: s for s in fp4gen.parse_text(c.text, filename="x.attn")}["sm90_bf16_d128"]
        sm = plan_kernel(spec).sm90
        assert (sm.tile_m, sm.tile_n, sm.kv_stages) == (c.tile_m, c.tile_n, c.kv_stages)


def test_fp8_searches_only_128_key_tiles():
    tune = _tune()
    cands, skipped = tune.enumerate_candidates(FP8.read_text(), str(FP8), "sm90_fp8_directp_d128")
    assert cands and {c.tile_n for c in cands} == {128}
    assert any("128-key tiles" in s.reason for s in skipped if s.tile_n == 112)


# --------------------------------------------------------------------------- the decision


class FakeModule:
    def __init__(self, cand):
        self.cand = cand


def _fake_run(text, filename, kernel, times, shapes, wrong=(), checker=None, **kw):
    """tune_kernel with a fake compiler, a checker failing the candidates in ``wrong``, and a
    timer reading ``times[(tile_n, kv)]`` (ms, scaled per shape)."""
    tune = _tune()
    compiled = []

    def compiler(c):
        compiled.append((c.tile_n, c.kv_stages))
        return FakeModule(c)

    def fake_checker(mod, c):
        return ((c.tile_n, c.kv_stages) not in wrong), "fake check"

    def timer(mod, c, shape):
        assert (c.tile_n, c.kv_stages) not in wrong, "a wrong candidate was timed"
        return times[(c.tile_n, c.kv_stages)] * shape[1] / 1024.0 * (1.0 if shape[0] == 1 else shape[2])

    res = tune.tune_kernel(text, filename, kernel, shapes, compiler=compiler, checker=checker or fake_checker,
                           timer=timer, **kw)
    return res, compiled


def _times(cands, fast=None, ms=1.0):
    t = {(c.tile_n, c.kv_stages): ms + 0.01 * i for i, c in enumerate(cands)}
    if fast is not None:
        t[fast] = 0.5 * ms
    return t


def test_winner_is_the_fastest_correct_candidate():
    tune = _tune()
    text = BF16.read_text()
    cands, _ = tune.enumerate_candidates(text, str(BF16), "sm90_bf16_d128")
    times = _times(cands, fast=(96, 3))
    res, compiled = _fake_run(text, str(BF16), "sm90_bf16_d128", times, [(1, 1024, 4, 128)])
    assert len(compiled) == len(cands)
    assert (res.winner.tile_n, res.winner.kv_stages) == (96, 3)
    assert all(c.status == "timed" for c in res.candidates)


def test_winner_over_several_shapes_is_the_geometric_mean_best():
    tune = _tune()
    text = BF16.read_text()
    shapes = [(1, 1024, 4, 128), (2, 8192, 16, 128)]
    cands, _ = tune.enumerate_candidates(text, str(BF16), "sm90_bf16_d128")
    res, _ = _fake_run(text, str(BF16), "sm90_bf16_d128", _times(cands), shapes)
    keys = [",".join(map(str, s)) for s in shapes]
    best = {k: min(c.medians_ms[k] for c in res.candidates) for k in keys}
    gm = {id(c): math.prod(c.medians_ms[k] / best[k] for k in keys) ** 0.5 for c in res.candidates}
    assert gm[id(res.winner)] == min(gm.values())


def test_planted_wrong_candidate_is_never_chosen():
    tune = _tune()
    text = BF16.read_text()
    cands, _ = tune.enumerate_candidates(text, str(BF16), "sm90_bf16_d128")
    times = _times(cands, fast=(64, 2))  # the wrong one would win on time
    res, _ = _fake_run(text, str(BF16), "sm90_bf16_d128", times, [(1, 1024, 4, 128)], wrong={(64, 2)})
    bad = next(c for c in res.candidates if (c.tile_n, c.kv_stages) == (64, 2))
    assert bad.status == "wrong" and not bad.medians_ms
    assert res.winner is not bad and res.winner.status == "timed"


def test_real_checker_rejects_a_planted_wrong_output():
    """check_candidate (the GPU path's check) on the CPU: a module whose O is the oracle's passes,
    one whose O is 5 % off fails, and the tuner then skips it though its time is the fastest."""
    import torch

    from fp4gen.numerics import reference

    tune = _tune()
    text = BF16.read_text()

    class Oracle:
        def __init__(self, cand, scale):
            self.cand, self.scale = cand, scale

        def forward(self, q, k, v, return_lse=False, **kw):
            o, lse = reference.forward(q, k, v, self.cand.spec)
            o = (o * self.scale).to(torch.bfloat16)
            return (o, lse) if return_lse else o

    planted = (128, 3)  # the second candidate tried (the first is the planner's own)

    def compiler(c):
        return Oracle(c, 1.05 if (c.tile_n, c.kv_stages) == planted else 1.0)

    def checker(mod, c):
        return tune.check_candidate(mod, c.spec, "cpu")

    cands, _ = tune.enumerate_candidates(text, str(BF16), "sm90_bf16_d128")
    times = _times(cands, fast=planted)
    res = tune.tune_kernel(text, str(BF16), "sm90_bf16_d128", [(1, 1024, 4, 128)], compiler=compiler,
                           checker=checker, timer=lambda m, c, s: times[(c.tile_n, c.kv_stages)], limit=3)
    st = {(c.tile_n, c.kv_stages): c for c in res.candidates}
    assert st[planted].status == "wrong" and "rel-L2" in st[planted].detail
    assert st[(128, 2)].status == "timed"
    assert res.winner is not st[planted]


def test_timing_without_a_checker_is_refused():
    tune = _tune()
    with pytest.raises(ValueError):
        tune.tune_kernel(BF16.read_text(), str(BF16), "sm90_bf16_d128", [(1, 1024, 4, 128)],
                         compiler=FakeModule, timer=lambda m, c, s: 1.0)


def test_compile_failure_and_budget_are_reported_not_chosen():
    tune = _tune()
    text = BF16.read_text()
    clock = iter(range(0, 10_000, 10))

    def compiler(c):
        if c.tile_n == 112:
            raise RuntimeError("ptxas: planted failure")
        return FakeModule(c)

    res = tune.tune_kernel(text, str(BF16), "sm90_bf16_d128", [(1, 1024, 4, 128)], compiler=compiler,
                           checker=lambda m, c: (True, ""), timer=lambda m, c, s: 0.1 if c.tile_n == 112 else 1.0,
                           budget_s=45, clock=lambda: next(clock))
    by = {c.status for c in res.candidates}
    assert "compile-failed" in by and "budget" in by
    assert res.winner.tile_n != 112 and res.winner.status == "timed"


def test_no_timer_compiles_and_chooses_nothing():
    tune = _tune()
    res = tune.tune_kernel(BF16.read_text(), str(BF16), "sm90_bf16_d128", [(1, 1024, 4, 128)],
                           compiler=FakeModule, limit=2)
    assert [c.status for c in res.candidates[:2]] == ["not-timed"] * 2
    assert res.winner is None and "GPU" in res.note


# --------------------------------------------------------------------------- write-back


def _result(text, filename, kernel, n, kv):
    """A KernelResult whose winner is (128, n, kv), timed by a fake."""
    tune = _tune()
    cands, skipped = tune.enumerate_candidates(text, filename, kernel)
    res, _ = _fake_run(text, filename, kernel, _times(cands, fast=(n, kv)), [(1, 1024, 4, cands[0].spec.head_dim)])
    assert (res.winner.tile_n, res.winner.kv_stages) == (n, kv)
    return res


def _changed_lines(old: str, new: str):
    """(old line ranges replaced or deleted, new lines inserted) of a line diff."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    return [(i1, i2) for _, i1, i2, _, _ in ops], ["".join(b[j1:j2]) for _, _, _, j1, j2 in ops]


def test_write_back_replaces_only_the_schedule_block(tmp_path):
    import fp4gen

    tune = _tune()
    text = BF16.read_text().replace("# with).", "# with).  (a comment tune must keep)")
    path = tmp_path / "spec.attn"
    path.write_bytes(text.encode())
    _, digest = tune.read_spec(path)
    res = _result(text, str(path), "sm90_bf16_causal_d128", 96, 3)
    comments = {"sm90_bf16_causal_d128": tune.tune_comment(res, "Fake GPU", [(1, 1024, 4, 128)])}
    tune.write_back(path, text, digest, [res], comments)
    new = path.read_text()
    lines = text.splitlines()
    k0 = next(i for i, ln in enumerate(lines) if ln.startswith("attention sm90_bf16_causal_d128"))
    s0 = next(i for i in range(k0, len(lines)) if lines[i].strip() == "schedule {")
    s1 = next(i for i in range(s0, len(lines)) if lines[i].strip() == "}")
    spans, inserted = _changed_lines(text, new)
    assert spans and all(s0 <= i1 and i2 <= s1 + 1 for i1, i2 in spans), spans
    block = "".join(inserted)
    assert "tile      128 x 96" in block and "kv_stages 3" in block and "# tune: fp4gen tune on Fake GPU" in block
    specs = {s.name: s for s in fp4gen.parse_text(new, filename=str(path))}
    old = {s.name: s for s in fp4gen.parse_text(text, filename=str(path))}
    sch = specs["sm90_bf16_causal_d128"].schedule
    assert (sch.tile_m, sch.tile_n, sch.kv_stages) == (128, 96, 3)
    assert specs["sm90_bf16_d128"] == old["sm90_bf16_d128"]
    # tuning again replaces the old tune comment instead of adding a second one
    _, digest = tune.read_spec(path)
    res2 = _result(new, str(path), "sm90_bf16_causal_d128", 64, 2)
    tune.write_back(path, new, digest, [res2], {"sm90_bf16_causal_d128": ["again"]})
    again = path.read_text()
    assert again.count("# tune:") == 1 and "# tune: again" in again and "kv_stages 2" in again


def test_write_back_inserts_a_block_and_keeps_other_kernels(tmp_path):
    import fp4gen

    tune = _tune()
    path = tmp_path / "small.attn"
    path.write_text(SMALL)
    text, digest = tune.read_spec(path)
    res = _result(text, str(path), "small_d64", 64, 4)
    tune.write_back(path, text, digest, [res], {"small_d64": ["measured"]})
    new = path.read_text()
    a, b = SMALL.splitlines(keepends=True), new.splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    assert [op[0] for op in ops] == ["insert"]  # nothing of the old text changed
    close = next(i for i, ln in enumerate(a) if ln == "}\n")  # small_d64's closing brace
    assert ops[0][1] == close
    specs = {s.name: s for s in fp4gen.parse_text(new, filename="x.attn")}
    sch = specs["small_d64"].schedule
    assert (sch.tile_m, sch.tile_n, sch.kv_stages) == (128, 64, 4)
    assert specs["other"] == {s.name: s for s in fp4gen.parse_text(SMALL, filename="x.attn")}["other"]


def test_write_back_refuses_a_file_changed_since_read(tmp_path):
    tune = _tune()
    path = tmp_path / "small.attn"
    path.write_text(SMALL)
    text, digest = tune.read_spec(path)
    res = _result(text, str(path), "small_d64", 64, 3)
    edited = SMALL.replace("# a small", "# someone else's edit: a small")
    path.write_text(edited)
    with pytest.raises(tune.TuneError, match="changed since"):
        tune.write_back(path, text, digest, [res], {})
    assert path.read_text() == edited


def test_schedule_block_keeps_other_statements():
    tune = _tune()
    text = ("attention a {\n  target sm90a\n  head_dim 128\n  schedule {\n    p_publish whole  # mine\n"
            "    tile 128 x 128; q_stages 2\n  }\n}\n")
    new = tune.schedule_block(text, "a", 128, 80, 2, ["c"])
    assert "p_publish whole  # mine" in new and "q_stages" not in new and "tile      128 x 80" in new
    assert new.startswith("attention a {\n  target sm90a\n  head_dim 128\n  schedule {\n")


# --------------------------------------------------------------------------- the command


def test_cli_no_sm90a_kernel_exits_1(cli):
    r = cli("tune", EXAMPLES / "fa4_fp4_d128.attn", "--dry-run")
    assert r.rc == 1 and "no sm90a kernel to tune" in r.err and "sm100a" in r.err


def test_cli_bad_shapes_exit_1(cli, tmp_path):
    path = tmp_path / "small.attn"
    path.write_text(SMALL)
    r = cli("tune", path, "--kernel", "small_d64", "--shapes", "1,1024,4,128", "--dry-run")
    assert r.rc == 1 and "head_dim 64" in r.err
    r = cli("tune", path, "--kernel", "small_d64", "--shapes", "1,x,4", "--dry-run")
    assert r.rc == 1 and "B,S,H" in r.err
    r = cli("tune", path, "--kernel", "small_d64", "--shapes", "1,0,4", "--dry-run")
    assert r.rc == 1
    r = cli("tune", path, "--kernel", "nope", "--dry-run")
    assert r.rc == 1 and "no kernel 'nope'" in r.err
    assert path.read_text() == SMALL


def test_cli_write_without_gpu_exits_1(cli, tmp_path):
    path = tmp_path / "small.attn"
    path.write_text(SMALL)
    r = cli("tune", path, "--write", "--dry-run")
    assert r.rc == 1 and "--write needs measured times" in r.err
    assert path.read_text() == SMALL


@pytest.mark.slow
def test_cli_dry_run_compiles_two_candidates(cli, tmp_path, monkeypatch):
    """Two real compiles (CuTe DSL, sm_90a, no GPU): the planner's choice and the next one."""
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "small.attn"
    path.write_text(SMALL)
    r = cli("tune", path, "--dry-run", "--limit", "2", "--json")
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert out["timed"] is False and any("other" in n for n in out["not_tuned"])
    (k,) = out["kernels"]
    tried = [c for c in k["candidates"] if c["status"] != "budget"]
    assert [c["status"] for c in tried] == ["not-timed", "not-timed"], tried
    assert tried[0]["auto"] and k["winner"] is None
    # both modules are in the shared module cache, under different keys
    mods = list((tmp_path / "cache" / "modules").rglob("small_d64_sm90a_*.py"))
    assert len(mods) == 2
    assert path.read_text() == SMALL


def test_cli_timed_path_with_a_fake_gpu_writes_the_winner(cli, tmp_path, monkeypatch):
    """cmd_tune's GPU branch end to end, with the device, compiler, checker and timer faked."""
    import fp4gen

    tune = _tune()
    path = tmp_path / "small.attn"
    path.write_text(SMALL)
    fast = (80, 3)
    monkeypatch.setattr(tune, "cuda_device", lambda: ("cpu", "Fake GPU"))
    monkeypatch.setattr(tune, "compile_candidate", lambda c, filename: FakeModule(c))
    monkeypatch.setattr(tune, "gpu_checker", lambda dev: (lambda m, c: (True, "fake check")))
    monkeypatch.setattr(tune, "gpu_timer", lambda dev: (
        lambda m, c, s: 0.25 if (c.tile_n, c.kv_stages) == fast else 1.0 + c.tile_n / 1000))
    r = cli("tune", path, "--shapes", "1,1024,4", "2,4096,8,64", "--write")
    assert r.rc == 0, r.err
    assert "chosen: tile 128 x 80, kv_stages 3" in r.out and f"wrote {path}" in r.out
    new = path.read_text()
    assert "# tune: fp4gen tune on Fake GPU" in new and "1,1024,4,64: 0.2500" in new
    specs = {s.name: s for s in fp4gen.parse_text(new, filename=str(path))}
    sch = specs["small_d64"].schedule
    assert (sch.tile_n, sch.kv_stages) == fast
    # the JSON report of the same run
    r = cli("tune", path, "--json", "--shapes", "1,1024,4")
    out = json.loads(r.out)
    assert r.rc == 0 and out["timed"] and out["kernels"][0]["winner"]["tile_n"] == 80
    assert any(c["current"] and c["tile_n"] == 80 for c in out["kernels"][0]["candidates"])
