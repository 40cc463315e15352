"""`fp4gen regenerate [--check]` on a scratch copy of the repository layout."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def scratch(tmp_path):
    """examples/ with two specs (one sm90a file, one sm100a file) and an empty generated/."""
    (tmp_path / "examples").mkdir()
    for name in ("sm90_bf16_d128.attn", "fa4_fp4_d128.attn"):
        shutil.copy(ROOT / "examples" / name, tmp_path / "examples" / name)
    (tmp_path / "generated").mkdir()
    (tmp_path / "generated" / "__init__.py").write_text("")
    return tmp_path


def test_regenerate_then_check_round_trip(cli, scratch):
    from fp4gen.lowering.regenerate import backend_available

    r = cli("regenerate", "--check", "--root", scratch)
    expected = [n for n, t in (("sm90_bf16_d128_sm90a.py", "sm90a"), ("sm90_bf16_causal_d128_sm90a.py", "sm90a"),
                               ("fa4_fp4_d128_sm100a.py", "sm100a")) if backend_available(t)]
    if not expected:
        pytest.skip("no CuTe DSL backend is written yet")
    assert r.rc == 1
    for n in expected:
        assert f"missing: generated/{n}" in r.err

    r = cli("regenerate", "--root", scratch)
    assert r.rc == 0, r.err
    written = sorted(p.name for p in (scratch / "generated").iterdir() if p.name != "__init__.py")
    assert written == sorted(expected)
    first = {n: (scratch / "generated" / n).read_bytes() for n in written}

    r = cli("regenerate", "--check", "--root", scratch)
    assert r.rc == 0, r.err
    assert "ok: generated/ is up to date" in r.out

    # byte-for-byte: a second regeneration writes nothing and changes nothing
    r = cli("regenerate", "--root", scratch)
    assert r.rc == 0 and "wrote" not in r.out
    assert {n: (scratch / "generated" / n).read_bytes() for n in written} == first

    # the generated files do not depend on where the checkout lives
    for src in first.values():
        assert str(scratch).encode() not in src

    # a hand edit is stale, a kernel that no longer exists is left over
    victim = scratch / "generated" / written[0]
    victim.write_bytes(victim.read_bytes() + b"# edited\n")
    orphan_target = "sm90a" if backend_available("sm90a") else "sm100a"
    (scratch / "generated" / f"gone_{orphan_target}.py").write_text("x = 1\n")
    (scratch / "generated" / "notes.py").write_text("# not ours\n")
    r = cli("regenerate", "--check", "--root", scratch)
    assert r.rc == 1
    assert f"stale: generated/{written[0]}" in r.err
    assert f"left over: generated/gone_{orphan_target}.py" in r.err
    assert "notes.py" not in r.err

    r = cli("regenerate", "--root", scratch)
    assert r.rc == 0
    assert victim.read_bytes() == first[written[0]]
    assert not (scratch / "generated" / f"gone_{orphan_target}.py").exists()
    assert (scratch / "generated" / "notes.py").exists()


def test_regenerate_reports_a_bad_example(cli, scratch):
    (scratch / "examples" / "broken.attn").write_text("attention b {\n  target sm90a\n  head_dim 12\n  mask causl\n}\n")
    r = cli("regenerate", "--check", "--root", scratch)
    assert r.rc == 1
    assert "examples/broken.attn:4:8: error: unknown mask 'causl'" in r.err
