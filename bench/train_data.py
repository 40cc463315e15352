"""Training data for bench/train_gpt.py, with nothing downloaded.

The corpus is the Python standard library's own source files (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, site-packages excluded), read in sorted
path order and tokenized at byte level (vocabulary 256). It is real, learnable
text (code, comments, docstrings) that every Python installation ships. Its
exact bytes depend on the Python version, so ``Corpus.sha256`` is recorded
with every run: compare runs only when it matches (two runs on one machine do).

Batches are drawn with a seeded ``torch.Generator``, so two runs with the same
seed see the same token windows in the same order whatever their model does.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

import torch


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 tokens
    val: torch.Tensor
    source: str
    files: int
    sha256: str

    def describe(self) -> dict:
        return {"source": self.source, "files": self.files, "train_bytes": int(self.train.numel()),
                "val_bytes": int(self.val.numel()), "sha256": self.sha256}


def stdlib_sources():
    """Paths of the standard library's .py files in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(d, f)


def load_corpus(max_bytes: int, val_fraction: float = 0.05) -> Corpus:
    """Up to ``max_bytes`` of stdlib source; the last ``val_fraction`` is held out."""
    chunks, total, files = [], 0, 0
    for path in stdlib_sources():
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue  # unreadable file: skip, the hash records what was used
        data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        files += 1
        if total >= max_bytes:
            break
    blob = b"".join(chunks)
    if len(blob) < 4096:
        raise RuntimeError(f"found only {len(blob)} bytes of stdlib source under "
                           f"{sysconfig.get_paths()['stdlib']}; cannot build the corpus")
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    n_val = max(1, int(len(tokens) * val_fraction))
    return Corpus(train=tokens[:-n_val], val=tokens[-n_val:],
                  source="python stdlib *.py, byte-level", files=files,
                  sha256=hashlib.sha256(blob).hexdigest())


class Batches:
    """Random windows of ``seq + 1`` tokens: inputs and next-token targets."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, seed: int):
        if len(tokens) <= seq + 1:
            raise ValueError(f"corpus split of {len(tokens)} tokens is too short for seq {seq}")
        self.tokens, self.batch, self.seq = tokens, batch, seq
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq - 1, (self.batch,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq + 1)[None, :]
        w = self.tokens[idx].long()
        return w[:, :-1].to(device, non_blocking=True), w[:, 1:].to(device, non_blocking=True)
