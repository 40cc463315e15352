from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


class Run:
    def __init__(self, rc, out, err):
        self.rc, self.out, self.err = rc, out, err

    def __repr__(self):
        return f"Run(rc={self.rc}, out={self.out!r}, err={self.err!r})"


@pytest.fixture
def cli(capsys):
    """Run ``fp4gen ARGS`` in-process; returns rc, stdout, stderr."""
    from fp4gen.cli.main import main

    def run(*argv):
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return Run(rc, out, err)

    return run


def planner_available() -> bool:
    try:
        from fp4gen.ir.passes import plan_kernel  # noqa: F401
    except ImportError:
        return False
    return True


PYTHON = sys.executable
