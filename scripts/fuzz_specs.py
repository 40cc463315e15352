#!/usr/bin/env python3
"""Mutate examples/*.attn and run each mutant through the ``fp4gen`` command; report crashes.

    .venv/bin/python scripts/fuzz_specs.py N [--seed S] [--out DIR]

Each of the N mutants (byte flips, token swaps, huge integers, odd unicode,
truncation, duplication) goes through ``fp4gen check``, ``fp4gen compile --target
reference`` and ``fp4gen run --target reference --seqlen 64``, in this process
through ``cli.main.main(argv)`` (no interpreter start-up per case). Exit 0, 1 and
2 are fine: a mutant is usually a bad spec. Exit 3 (an internal error), a
traceback on stderr, an exception out of ``main`` or a case that runs past the
time limit is a finding: the mutant is saved to DIR (default ``fuzz-findings/``)
with the command and its stderr beside it. The script exits 1 if there was any.

The process's address space is capped (--max-memory-gib), so a mutant that asks
for a huge tensor fails inside fp4gen (a finding) instead of waking the OOM killer.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import re
import resource
import signal
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the tokens a swap or a duplication moves: words, numbers, punctuation, line ends
TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+(?:\.[0-9]+)?|\s+|.", re.S)
NUMBER = re.compile(r"(?<![A-Za-z_])[0-9]+(?:\.[0-9]+)?")
HUGE = ["0", "-1", "4294967296", str(2**63), str(2**64 + 1), "9" * 39, "9" * 5000, "1e308", "1e-400",
        "0.0000001", "inf", "nan", "1" + "0" * 30 + ".5"]
ODD = ["\u00e9", "\u202e", "\u00a0", "\ufeff", "\u200b", "\x00", "\u0301", "\U0001f600", "\uff11\uff12\uff18",
       "\u0661\u0662", "\r", "\t", "\\", '"', "\ud7ff", "\u2028", "\x0c"]


def _tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One to three random edits of a spec's bytes."""
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(("flip", "swap", "huge", "unicode", "truncate", "duplicate"))
        if op == "flip" and data:
            i = rng.randrange(len(data))
            data = data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
            continue
        if op == "truncate":
            data = data[:rng.randrange(len(data) + 1)]
            continue
        text = data.decode("utf-8", errors="surrogateescape")
        toks = _tokens(text)
        if op == "swap" and len(toks) > 1:
            i, j = rng.randrange(len(toks)), rng.randrange(len(toks))
            toks[i], toks[j] = toks[j], toks[i]
            text = "".join(toks)
        elif op == "huge":
            nums = list(NUMBER.finditer(text))
            if nums:
                m = rng.choice(nums)
                text = text[:m.start()] + rng.choice(HUGE) + text[m.end():]
        elif op == "unicode":
            i = rng.randrange(len(text) + 1)
            text = text[:i] + rng.choice(ODD) + text[i:]
        elif op == "duplicate":
            lines = text.split("\n")
            if rng.random() < 0.2:  # the whole file: every kernel defined twice
                lines = lines + lines
            else:
                i = rng.randrange(len(lines))
                j = rng.randrange(i, min(len(lines), i + 4)) + 1
                lines[j:j] = lines[i:j]
            text = "\n".join(lines)
        data = text.encode("utf-8", errors="surrogateescape")
    return data


class CaseTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so the CLI's `except Exception` does not swallow it."""


def _on_alarm(signum, frame):
    raise CaseTimeout()


def run_cli(argv: list[str], timeout: int) -> tuple[int, str, str]:
    """(exit status or a description of what escaped main, stdout, stderr) of ``fp4gen ARGV``."""
    from fp4gen.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except CaseTimeout:
        rc = f"timeout after {timeout} s"
    except BaseException as e:  # anything that escapes main is a finding
        rc = f"{type(e).__name__} escaped main"
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
    return rc, out.getvalue(), err.getvalue()


def first_kernel(path: Path):
    """The first kernel's name when the mutant parses, for `run --kernel` (files may define several)."""
    import fp4gen

    try:
        return fp4gen.parse_text(path.read_text(encoding="utf-8"), filename=str(path))[0].name
    except Exception:  # a mutant that does not parse: `check` and `compile` report on it
        return None


def fuzz(n: int, seed: int, out_dir: Path, timeout: int) -> list[str]:
    import torch

    torch.set_num_threads(1)  # many tiny cases: threads cost more than they save
    sources = [p.read_bytes() for p in sorted((ROOT / "examples").glob("*.attn"))]
    rng = random.Random(seed)
    findings: list[str] = []
    counts: dict = {}
    with tempfile.TemporaryDirectory(prefix="fp4gen-fuzz-") as tmp:
        tmp = Path(tmp)
        os.environ["FP4GEN_CACHE_DIR"] = str(tmp / "cache")  # `run` compiles through the cache
        for i in range(n):
            spec = tmp / f"case{i}.attn"
            spec.write_bytes(mutate(rng.choice(sources), rng))
            cmds = [["check", str(spec)],
                    ["compile", str(spec), "--target", "reference", "-o", str(tmp / "out")]]
            kernel = first_kernel(spec)
            if kernel is not None:
                cmds.append(["run", str(spec), "--kernel", kernel, "--target", "reference", "--seqlen", "64",
                             "--heads", "1"])
            for argv in cmds:
                rc, out, err = run_cli(argv, timeout)
                counts[(argv[0], rc)] = counts.get((argv[0], rc), 0) + 1
                if rc in (0, 1, 2) and "Traceback" not in err:
                    continue
                out_dir.mkdir(parents=True, exist_ok=True)
                saved = out_dir / f"seed{seed}-case{i}-{argv[0]}.attn"
                saved.write_bytes(spec.read_bytes())
                cmd = " ".join(["fp4gen"] + [str(saved) if a == str(spec) else a for a in argv])
                saved.with_suffix(".txt").write_text(f"{cmd}\nexit: {rc}\n--- stderr\n{err}")
                findings.append(f"{saved}: {cmd}: exit {rc}: {err.strip().splitlines()[0] if err.strip() else ''}")
    print("outcomes:", ", ".join(f"{c} rc={rc}: {k}" for (c, rc), k in sorted(counts.items(), key=str)))
    return findings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", type=int, help="number of mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("fuzz-findings"), help="where findings are saved")
    ap.add_argument("--timeout", type=int, default=60, help="seconds per command")
    ap.add_argument("--max-memory-gib", type=float, default=8.0, help="address-space cap of this process")
    a = ap.parse_args(argv)
    cap = int(a.max_memory_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _on_alarm)
    findings = fuzz(a.n, a.seed, a.out, a.timeout)
    for f in findings:
        print(f)
    print(f"{len(findings)} finding{'s' * (len(findings) != 1)} in {a.n} mutants (seed {a.seed})")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
