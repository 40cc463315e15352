"""Progress lines: a stage still running after DELAY_S prints one stderr line with its elapsed
time; quick stages, a stderr that is not a terminal and --quiet print nothing."""
from __future__ import annotations

import io
import time

import pytest

from fp4gen.cli.main import Progress


class Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(Progress, "DELAY_S", 0.05)


def test_a_slow_stage_prints_one_line_with_its_time(fast):
    out = Tty()
    with Progress(stream=out).stage("compiling k (sm90a) to ptx"):
        time.sleep(0.3)
    line = out.getvalue()
    assert line.startswith("fp4gen: compiling k (sm90a) to ptx ... ") and line.endswith(" s\n")
    assert line.count("\n") == 1 and 0.2 <= float(line.split("... ")[1][:-3]) < 5


def test_a_quick_stage_prints_nothing(fast):
    out = Tty()
    with Progress(stream=out).stage("quick"):
        pass
    time.sleep(0.15)  # the timer was cancelled: nothing comes later either
    assert out.getvalue() == ""


def test_a_failed_stage_says_so(fast):
    out = Tty()
    with pytest.raises(RuntimeError):
        with Progress(stream=out).stage("emit"):
            time.sleep(0.2)
            raise RuntimeError("boom")
    assert "emit ... stopped after" in out.getvalue()


@pytest.mark.parametrize("stream, quiet", [(io.StringIO(), False), (Tty(), True)])
def test_quiet_off_a_terminal_or_when_asked(fast, stream, quiet):
    with Progress(quiet, stream=stream).stage("slow"):
        time.sleep(0.2)
    assert stream.getvalue() == ""


def test_the_commands_take_quiet(cli, tmp_path):
    from pathlib import Path

    spec = Path(__file__).resolve().parents[2] / "examples" / "fa4_fp4_d128.attn"
    r = cli("compile", spec, "-o", tmp_path, "--target", "reference", "--quiet")
    assert r.rc == 0 and r.err == "", r
    r = cli("accuracy", spec, "--seqlen", "128", "--heads", "1", "--target", "reference", "--quiet")
    assert r.rc == 0 and "cosine" in r.out and r.err == "", r
