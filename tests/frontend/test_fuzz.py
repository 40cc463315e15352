"""No input makes fp4gen crash: mutated example specs through ``fp4gen check``,
arbitrary text through the parser, and generated valid specs through the planner."""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4gen.frontend import SpecError, parse_text
from fp4gen.ir.plan import TMEM_COLUMNS
from fp4gen.ir.spec import (
    DIRECT_P_FORMATS, KV_STAGES_RANGE, Q_STAGES_RANGE, Backward, DirectPPolicy, Format, Guard, GuardKind, Mask,
    OperandFormat, PKind, PProduction, PPublish, ScaleGranularity, Schedule, Target, TmemRegionRequest, default_operand_format,
)
from fp4gen.runtime.specjson import spec_from_json, spec_to_json

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.attn"))

TOKEN = re.compile(r"\n|[A-Za-z_][A-Za-z0-9_]*|[0-9]+(?:\.[0-9]+)?|\.\.|#[^\n]*|[^\sA-Za-z0-9_]|[ \t]+")
EXTRA = ["{", "}", "(", ")", ":", ";", ",", "=", "..", "x", "\n", "via", "attention", "tmem", "-1", "0", "1e9",
         "@", "\"", ".", "\t", "nvfp4", "#", "\u00e9", "999999999999999999999", "schedule {", "backward {"]


def mutate(text: str, rng: random.Random) -> str:
    toks = TOKEN.findall(text)
    assert "".join(toks) == text  # the tokenizer covers every character
    vocab = sorted(set(t for t in toks if t.strip())) + EXTRA
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(toks))
        op = rng.choice(("delete", "insert", "swap", "replace", "dup_line"))
        if op == "delete":
            del toks[i]
        elif op == "insert":
            toks.insert(i, rng.choice(vocab) + rng.choice(("", " ")))
        elif op == "swap" and i + 1 < len(toks):
            toks[i], toks[i + 1] = toks[i + 1], toks[i]
        elif op == "replace":
            toks[i] = rng.choice(vocab)
        elif op == "dup_line":
            lines = "".join(toks).split("\n")
            j = rng.randrange(len(lines))
            lines.insert(j, lines[j])
            toks = TOKEN.findall("\n".join(lines))
        if not toks:
            toks = [""]
    return "".join(toks)


DIAG_LINE = re.compile(r"^(?:\S+:\d+:\d+: )?error: .+$", re.M)


def test_mutated_examples_never_crash_check(tmp_path, capsys):
    from fp4gen.cli.main import main

    rng = random.Random(20261129)
    sources = [p.read_text() for p in EXAMPLES]
    outcomes = {0: 0, 1: 0}
    for n in range(300):
        text = mutate(rng.choice(sources), rng)
        path = tmp_path / f"m{n}.attn"
        path.write_text(text)
        capsys.readouterr()
        rc = main(["check", str(path)])
        out, err = capsys.readouterr()
        assert rc in (0, 1), f"rc={rc} for\n{text}\n---\n{err}"
        assert "Traceback" not in err
        if rc == 1:
            assert DIAG_LINE.search(err), f"no diagnostic for\n{text}\n---\n{err}"
            assert str(path) in err or "error: " in err
        else:
            assert out.startswith(f"ok: {path}")
        outcomes[rc] += 1
    # the mutations hit both sides (a fuzzer that only ever breaks or never breaks proves little)
    assert outcomes[0] > 10 and outcomes[1] > 100, outcomes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("attention{}():;,=.x_ \n#Qnvfp4mx0123456789-+eé@\t\r")), max_size=120))
def test_arbitrary_text_raises_only_spec_errors(text):
    try:
        parse_text(text, "fuzz.attn")
    except SpecError as e:
        assert e.diagnostics
        for d in e.diagnostics:
            d.render(e.source_lines)  # rendering never fails either


# ------------------------------------------------------------------ generated valid specs

ELEMENT = [f for f in Format if f not in (Format.E8M0, Format.E4M3)]


@st.composite
def operand_formats(draw):
    fmt = draw(st.sampled_from(ELEMENT))
    if fmt.is_high_precision or fmt.is_fp4:
        return fmt.value, default_operand_format(fmt)
    kind = draw(st.sampled_from(["bare", "tensor", "token", "none", "block"]))
    if kind == "bare":
        return fmt.value, default_operand_format(fmt)
    if kind == "block":  # fp32 scales: one per 16..256 tokens; e8m0 scales are OCP MX, blocks of 32
        scale = draw(st.sampled_from(["fp32", "e8m0"]))
        block = draw(st.sampled_from([16, 32, 64, 128, 256])) if scale == "fp32" else 32
        return f"{fmt.value}(block={block}, scale={scale})", OperandFormat(fmt, ScaleGranularity.BLOCK, block,
                                                                           Format(scale))
    if kind == "none":
        return f"{fmt.value}(scale=none)", OperandFormat(fmt, ScaleGranularity.NONE, None, None)
    return f"{fmt.value}(scale={kind})", OperandFormat(fmt, ScaleGranularity(kind), None, Format.FP32)


@st.composite
def specs(draw):
    """(spec text, expected field values) for a spec the language accepts."""
    target = draw(st.sampled_from(list(Target)))
    head_dim = draw(st.sampled_from([32, 64, 96, 128, 192, 256, 80, 16]))  # 80, 16: the GPU planners refuse
    mask = draw(st.sampled_from(list(Mask)))
    mask_text = mask.value
    want = {"target": target, "head_dim": head_dim, "mask": mask}
    if mask is Mask.WINDOW:  # sizes other than (-1, -1) and (-1, 0), which spell none and causal
        window = draw(st.tuples(st.integers(-1, 300), st.integers(-1, 300)).filter(lambda w: w[0] >= 0 or w[1] > 0))
        mask_text = f"window({window[0]}, {window[1]})"
        want["window"] = window
    lines = [f"attention gen {{", f"  target {target.value}", f"  head_dim {head_dim}", f"  mask {mask_text}"]
    if draw(st.booleans()):
        scale = draw(st.sampled_from([0.088, 0.125, 1.0]))
        lines.append(f"  scale {scale}")
        want["softmax_scale"] = scale
    for name in ("Q", "K", "P", "V", "O"):
        if draw(st.booleans()):
            text, fmt = draw(operand_formats())
            via = ""
            if name == "P":
                kinds = ["exp"] + (["direct_p"] if fmt.format in DIRECT_P_FORMATS else []) + \
                    (["two_level"] if fmt.format.is_fp4 else [])
                kind = draw(st.sampled_from(kinds))
                if kind == "direct_p":
                    policy = draw(st.sampled_from(list(DirectPPolicy)))
                    a, b = draw(st.sampled_from([(1.5, 1.2), (1.6, 0.95)]))
                    via = f" via direct_p(policy={policy.value}, a={a}, b={b})"
                    want["p_production"] = PProduction(PKind.DIRECT_P, policy, a, b)
                else:
                    via = f" via {kind}"
                    want["p_production"] = PProduction(PKind(kind))
            lines.append(f"  {name} : {text}{via}")
            want[name.lower()] = fmt
    if draw(st.booleans()):
        m, l = draw(st.sampled_from([(110, 16), (112, 14)]))
        lines.append(f"  guard sample(m={m}, l={l})")
        want["guard"] = Guard(GuardKind.SAMPLE, m, l)
    if draw(st.booleans()):
        # in the language's bounds (ir/spec.py *_RANGE), not all of them in a planner's
        tm, tn = draw(st.sampled_from([(128, 128), (64, 128), (128, 64), (192, 128), (128, 256), (16, 48),
                                       (112, 112)]))
        qs = draw(st.integers(Q_STAGES_RANGE.start, Q_STAGES_RANGE[-1]))
        pub = draw(st.sampled_from(list(PPublish)))
        kv = draw(st.sampled_from([None, 1, 2, 3, KV_STAGES_RANGE[-1]]))
        regions = None
        tmem = ["    tmem auto"]
        if draw(st.booleans()):
            names = draw(st.lists(st.sampled_from(["S0", "S1", "O0", "O1", "P0", "P1", "SFP0", "X"]),
                                  min_size=1, max_size=5, unique=True))
            regions = []
            for nm in names:
                lo = draw(st.integers(0, TMEM_COLUMNS - 1))
                hi = min(lo + draw(st.integers(0, 200)), TMEM_COLUMNS - 1)
                regions.append(TmemRegionRequest(nm, lo, hi))
            tmem = ["    tmem {"] + [f"      {r.name} cols {r.first_col}..{r.last_col}" for r in regions] + ["    }"]
            regions = tuple(regions)
        lines += ["  schedule {", f"    tile {tm} x {tn}", f"    q_stages {qs}", f"    p_publish {pub.value}"] \
            + tmem + ([f"    kv_stages {kv}"] if kv else []) + ["  }"]
        want["schedule"] = Schedule(tile_m=tm, tile_n=tn, q_stages=qs, p_publish=pub, kv_stages=kv,
                                    tmem_regions=regions)
    if draw(st.booleans()):
        reuse = draw(st.sets(st.sampled_from(["q", "k", "lse", "scales"]), min_size=1))
        grads = draw(st.dictionaries(st.sampled_from(["dO", "dS", "dP", "dQ", "dK", "dV"]),
                                     operand_formats().filter(lambda f: not f[1].format.is_fp4),  # no FP4 gradients
                                     max_size=3))
        det = draw(st.booleans())
        lines += ["  backward {", "    reuse " + " ".join(sorted(reuse))]
        lines += [f"    {g} : {t}" for g, (t, _) in grads.items()]
        lines += [f"    deterministic {str(det).lower()}", "  }"]
        want["backward"] = Backward(reuse=frozenset(reuse), formats={g: f for g, (_, f) in grads.items()},
                                    deterministic=det)
    lines.append("}")
    return "\n".join(lines) + "\n", want


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_generated_specs_parse_exactly_and_plan_or_diagnose(case):
    text, want = case
    (spec,) = parse_text(text, "gen.attn")
    for field, value in want.items():
        got = getattr(spec, field)
        if field == "backward":
            assert (got.reuse, dict(got.formats), got.deterministic) == \
                (value.reuse, dict(value.formats), value.deterministic)
        else:
            assert got == value, field
    assert spec_from_json(spec_to_json(spec)) == spec

    from fp4gen.driver import plan_spec

    try:
        plan = plan_spec(spec)  # runs the planner's verify as its last step
    except SpecError as e:
        (d,) = e.diagnostics
        assert d.message
        assert d.loc is None or (d.loc.file == "gen.attn" and 0 < d.loc.line <= len(spec.source_lines))
        return
    try:
        from fp4gen.ir.passes import verify
    except ImportError:
        return
    verify(plan)


EXAMPLE_KERNELS = [(p, k.name) for p in EXAMPLES for k in __import__("fp4gen").parse_file(str(p))]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EXAMPLE_KERNELS), st.sampled_from(["none", "causal"]), st.sampled_from([64, 128, 192, 256]),
       st.sampled_from(["", "  guard sample(m=112, l=14)", "  guard none"]),
       st.sampled_from(["", "    p_publish whole", "    q_stages 1", "    kv_stages 4", "    tile 64 x 128"]))
def test_variations_of_the_examples_plan_or_diagnose(example, mask, head_dim, guard, sched):
    """Examples with one field changed: closer to what users write, so most of them plan."""
    from fp4gen.driver import plan_spec

    path, name = example
    text = path.read_text()
    start = text.index(f"attention {name} ")
    end = text.index("\nattention ", start + 1) if "\nattention " in text[start + 1:] else len(text)
    src = text[start:end]
    src = re.sub(r"\bmask\s+\w+(\([^)]*\))?", f"mask {mask}", src) if "mask" in src else src
    src = re.sub(r"\bhead_dim\s+\d+", f"head_dim {head_dim}", src)
    if guard:
        src = re.sub(r"\bguard [^\n;}]*", "", src)
        src = src.replace("\n  head_dim", f"\n{guard}\n  head_dim", 1)
    if sched and "schedule {" in src:
        key = sched.split()[0]
        src = re.sub(rf"\b{key} [^\n;}}]*", "", src)
        src = src.replace("schedule {", "schedule {\n" + sched + "\n", 1)
    (spec,) = parse_text(src, "var.attn")
    try:
        plan = plan_spec(spec)
    except SpecError as e:
        (d,) = e.diagnostics
        assert d.message
        return
    from fp4gen.ir.passes import verify

    verify(plan)
