"""The sm90a backward with ``mask window(l, r)`` and ``softcap c``, no GPU: what legalize and the
planner accept and refuse, the config the lowering renders, the query-tile ranges a CTA walks
(checked against the oracle's masking rules), the GPU check's harness (it passes the oracle and
fails planted faults), and the CPU compile of every recipe.

The kernels on the GPU: test_bwd_window_softcap_gpu.py."""
from __future__ import annotations

import dataclasses
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bwd_modules as bm  # noqa: E402

from fp4gen.frontend import parse_text  # noqa: E402
from fp4gen.ir.passes import PlanError, plan_kernel  # noqa: E402
from fp4gen.lowering.sm90_bwd import render_backward  # noqa: E402

RECIPES = ("bf16", "fp8", "ds8")


# ------------------------------------------------------------------ legalize and plan

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("window, softcap, causal", [
    ((255, 0), 0.0, False), ((100, 37), 30.0, False), (None, 30.0, True), ((-1, 64), 0.0, False),
])
def test_every_recipe_plans_window_and_softcap(recipe, window, softcap, causal):
    spec = bm.make_masked_spec(recipe, window=window, softcap=softcap, causal=causal)
    bp = plan_kernel(spec).backward
    assert bp is not None and bp.causal == causal
    notes = " ".join(bp.notes)
    if window is not None:
        assert f"window({window[0]}, {window[1]})" in notes and "query tiles that see one of its keys" in notes
    assert ("softcap" in notes) == bool(softcap)


@pytest.mark.parametrize("line, field, col", [
    ("  sinks learned", "sinks", 9),  # the column of the value
    ("  layout varlen", "layout", 10),
])
def test_what_the_backward_lacks_is_refused_at_its_line(line, field, col):
    text = bm.MASKED_SPEC.format(name="k", d=128, mask="window(255, 0)", softcap="\n" + line, det="false",
                                 **bm.RECIPES["bf16"])
    (spec,) = parse_text(text, "k.attn")
    with pytest.raises(PlanError) as exc:
        plan_kernel(spec)
    loc = exc.value.loc
    assert loc == spec.loc(field) and loc.file == "k.attn" and loc.line == 6 and loc.col == col
    assert "backward does not" in exc.value.message


# ------------------------------------------------------------------ render

def test_render_adds_window_and_softcap_only_when_set():
    src = render_backward(plan_kernel(bm.make_masked_spec("fp8", window=(255, 0), softcap=30.0)))
    assert "    window=(255, 0),\n" in src and "    softcap=30.0,\n" in src
    assert "# window: sm90_bwd_fp8_d128_w255_0_cap30.attn:5: mask window(255, 0)" in src
    plain = render_backward(plan_kernel(bm.make_masked_spec("fp8", causal=True)))
    assert "window=" not in plain and "softcap=" not in plain


def test_config_refuses_a_bad_window():
    from fp4gen.lowering.sm90_bwd import context

    cfg = context(plan_kernel(bm.make_masked_spec("bf16", window=(255, 0))))["config"]
    from fp4gen.device.sm90.backward import BackwardConfig

    base = dict(cfg, mma_majors=(("K", "K"),) * 5)
    BackwardConfig(**base)
    for bad in (dict(window=(-1, 0)), dict(window=(-1, -1)), dict(window=(3, -2)), dict(window=(2 ** 31, 0)),
                dict(window=(3, 0), causal=True), dict(softcap=-1.0)):
        with pytest.raises(ValueError):
            BackwardConfig(**dict(base, **bad))


# ------------------------------------------------------------------ the query tiles a CTA walks

def _kernel(window, bm_=64, bn=128):
    from fp4gen.device.sm90.backward import Backward

    cfg = context_config(window)
    return Backward(cfg)


def context_config(window):
    from fp4gen.device.sm90.backward import BackwardConfig
    from fp4gen.lowering.sm90_bwd import context

    cfg = context(plan_kernel(bm.make_masked_spec("bf16", window=window)))["config"]
    return BackwardConfig(**dict(cfg, mma_majors=(("K", "K"),) * 5))


def _oracle_visits(sq, sk, window, tm=64, tn=128):
    """{(key tile, query tile)} with some visible (query, key) pair, by the oracle's rule."""
    import torch

    from fp4gen.numerics import masking

    ok = masking.allowed(torch.arange(sq), torch.arange(sk), sq, sk, window)
    pairs = ok.nonzero().tolist()
    return {(j // tn, i // tm) for i, j in pairs}


def _kernel_visits(kern, sq, sk, tm=64, tn=128):
    out = set()
    for n in range(-(-sk // tn)):
        lo, hi = kern.window_query_tiles(n, sk - sq, -(-sq // tm))
        out |= {(n, m) for m in range(lo, hi)}
    return out


WINDOW_SHAPES = [(w, sq, sk) for w in ((255, 0), (0, 0), (100, 37), (-1, 64), (64, -1), (5000, 5000), (0, 200), (3, 5))
                 for sq, sk in ((1000, 1000), (200, 200), (300, 100), (100, 300), (1, 1), (64, 700), (700, 64))]


@pytest.mark.parametrize("window, sq, sk", WINDOW_SHAPES)
def test_query_tile_ranges_are_the_visible_tiles(window, sq, sk):
    """A CTA walks exactly the query tiles that hold a (query, key) pair the window lets through
    (none skipped: a skipped one loses gradient; none extra: the deterministic turns count on
    it), and ``first_key_tile`` names the first key tile that walks a query tile."""
    kern = _kernel(window)
    want = _oracle_visits(sq, sk, window)
    assert _kernel_visits(kern, sq, sk) == want
    if window[0] >= 0:
        for m in range(-(-sq // 64)):
            firsts = [n for n, mm in want if mm == m]
            if firsts:
                assert kern.first_key_tile(m, sk - sq) == min(firsts)


def test_query_tile_check_catches_an_off_by_one():
    """Planted fault: the first query tile taken one query early at the window's right bound
    (a key tile then walks a query tile none of its keys reaches); the check above sees it."""
    kern = _kernel((0, 0))

    class Fault(type(kern)):
        def window_query_tiles(self, n_block, causal_offset, m_block_max):
            lo, hi = super().window_query_tiles(n_block, causal_offset, m_block_max)
            return max(n_block * 128 - causal_offset - 1, 0) // 64, hi

    bad = Fault(kern.config)
    assert _kernel_visits(bad, 1000, 1000) != _oracle_visits(1000, 1000, (0, 0))


# ------------------------------------------------------------------ the GPU check's harness

class _OracleModule:
    """A stand-in for a generated module whose backward is the oracle of ``spec`` (CPU)."""

    def __init__(self, spec):
        self.spec = spec

    def backward(self, q, k, v, o, lse, do):
        from fp4gen.ir.spec import Format, OperandFormat
        from fp4gen.numerics import reference

        bw = self.spec.backward
        fmts = dict(bw.formats, dP=OperandFormat(Format.FP32))
        spec = dataclasses.replace(self.spec, backward=dataclasses.replace(bw, formats=fmts))
        return tuple(x.to("cpu").to(q.dtype) for x in reference.backward(q, k, v, o, lse, do, spec))


@pytest.mark.parametrize("window, softcap, shape", [
    ((100, 37), 30.0, (1, 200, 300, 2, 1)),
    ((0, 0), 0.0, (1, 300, 100, 2, 2)),  # the first 200 rows see no key
])
def test_check_masked_passes_the_oracle(window, softcap, shape):
    spec = bm.make_masked_spec("bf16", window=window, softcap=softcap)
    row = bm.check_masked(_OracleModule(spec), spec, shape, mult=1.0, device="cpu")
    assert row["pass"], row


@pytest.mark.parametrize("fault, shape", [
    (dict(softcap=0.0), (1, 200, 200, 2, 2)),  # dS without the tanh derivative (and P uncapped)
    (dict(window=(200, 37)), (1, 300, 300, 2, 2)),  # a window wider on the left
    (dict(window=(100, 36)), (1, 300, 300, 2, 2)),  # one key short on the right
])
def test_check_masked_fails_planted_faults(fault, shape):
    """The check fails a backward computed with the wrong window or without the softcap."""
    spec = bm.make_masked_spec("bf16", window=(100, 37), softcap=30.0)
    kw = dict(window=(100, 37), softcap=30.0)
    kw.update(fault)
    wrong = bm.make_masked_spec("bf16", **kw)
    row = bm.check_masked(_OracleModule(wrong), spec, shape, mult=4.0, device="cpu")
    assert not row["pass"], row


# ------------------------------------------------------------------ CPU compile

@pytest.mark.parametrize("recipe, window, softcap, det", [
    ("bf16", (100, 37), 30.0, True),
    ("fp8", (255, 0), 30.0, False),
    ("ds8", (255, 0), 30.0, False),
])
def test_compile_sm90a(recipe, window, softcap, det, tmp_path):
    """Every recipe compiles for sm_90a with a window and a softcap (no GPU; a subprocess, as
    test_bwd_cpu's compiles, for the PTX dump): one MUFU tanh and one exp per score a thread
    holds (64 keys x 64 queries / 128 threads), and the deterministic turns."""
    import json
    import subprocess
    import textwrap

    dump = tmp_path / "dump"
    dump.mkdir()
    code = textwrap.dedent(f"""
        import glob, json, os, sys
        sys.path.insert(0, {HERE!r})
        import bwd_modules as bm
        from fp4gen.ir.passes import plan_kernel
        plan = plan_kernel(bm.make_masked_spec({recipe!r}, window={window!r}, softcap={softcap!r},
                                               deterministic={det!r}))
        mod = bm.load_module(plan, {str(tmp_path)!r})
        mod._bwd_compile("sm_90a", False, False)
        ptx = open(max(glob.glob(os.path.join({str(dump)!r}, "*.ptx")), key=os.path.getmtime)).read()
        names = mod.compile_only_backward("sm_90a")
        print(json.dumps(dict(names=names, tanh=ptx.count("tanh.approx.f32"), ex2=ptx.count("ex2.approx"),
                              acquire=ptx.count("ld.acquire.gpu"), release=ptx.count("red.release.gpu"))))
    """)
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_ARCH="sm_90a", CUTE_DSL_DUMP_DIR=str(dump))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    f = json.loads(res.stdout.strip().splitlines()[-1])
    name = bm.make_masked_spec(recipe, window=window, softcap=softcap, deterministic=det).name
    assert f["names"][:2] == [name + ".backward", name + ".backward_gqa"], f
    assert f["tanh"] == 32 and f["ex2"] == 32, f
    assert (f["acquire"] > 0 and f["release"] == 1) if det else (f["acquire"] == f["release"] == 0), f
