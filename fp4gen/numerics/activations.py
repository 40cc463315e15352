"""Attention inputs from files, and seeded synthetic LLM-like cases (issue 21).

The file format ``fp4gen accuracy --inputs`` reads and ``numerics.capture`` writes: one
``torch.save`` of a dict per case,

    {"q": (B, Sq, H, D), "k": (B, Sk, Hkv, D), "v": (B, Sk, Hkv, D),
     "do": (B, Sq, H, D) optional, "meta": {...} optional}

floating-point tensors (any float dtype; H a multiple of Hkv, as the reference's GQA), or a
folder of such ``*.pt`` files (read in name order). ``meta`` is free-form provenance (the
capture writes model, layer, text, ``causal`` and ``scale``); nothing else is accepted, so a
misspelt key is an error, not a silently missing tensor.

``synthetic(kind, ...)`` draws the LLM-like structures that break one-scale-per-head
quantization (massive channels in K, an attention-sink token, outlier rows or channels of V,
peaked logits) from a seeded ``torch.Generator``: the same arguments give the same bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

KEYS = ("q", "k", "v")
OPTIONAL_KEYS = ("do", "meta")


class InputsError(ValueError):
    """A user's inputs file is unreadable or not in the format above (the message names it)."""


@dataclass
class Case:
    """One set of attention inputs: (B, S, H, D) float tensors and where they came from."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: Optional[torch.Tensor] = None
    meta: dict = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]


def check_case(name: str, d) -> Case:
    """``d`` as a Case, or an InputsError that names ``name`` and what is wrong."""
    if not isinstance(d, dict):
        raise InputsError(f"{name}: expected a dict with keys q, k, v (and optionally do, meta), "
                          f"got {type(d).__name__}")
    missing = [k for k in KEYS if k not in d]
    unknown = sorted(str(k) for k in d if k not in KEYS + OPTIONAL_KEYS)
    if missing or unknown:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
        raise InputsError(f"{name}: {'; '.join(parts)} (expected q, k, v and optionally do, meta)")
    t = {}
    for key in KEYS + ("do",):
        x = d.get(key)
        if x is None and key == "do":
            continue
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
            what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputsError(f"{name}: {key} must be a floating-point tensor, got {what}")
        if x.dim() != 4:
            raise InputsError(f"{name}: {key} must be (B, S, H, D), got shape {tuple(x.shape)}")
        t[key] = x
    q, k, v = t["q"], t["k"], t["v"]
    B, Sq, H, D = q.shape
    if k.shape != v.shape:
        raise InputsError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise InputsError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head dim")
    if k.shape[2] == 0 or H % k.shape[2]:
        raise InputsError(f"{name}: q has {H} heads, k/v {k.shape[2]}: the query heads must be a "
                          "multiple of the key/value heads")
    if "do" in t and t["do"].shape != q.shape:
        raise InputsError(f"{name}: do {tuple(t['do'].shape)} must have q's shape {tuple(q.shape)}")
    for key, x in t.items():
        if not torch.isfinite(x).all():
            raise InputsError(f"{name}: {key} has {int((~torch.isfinite(x)).sum())} non-finite values")
    meta = d.get("meta") or {}
    if not isinstance(meta, dict):
        raise InputsError(f"{name}: meta must be a dict, got {type(meta).__name__}")
    return Case(name, q.float(), k.float(), v.float(), None if "do" not in t else t["do"].float(), dict(meta))


def load(path) -> list[Case]:
    """The cases in a ``torch.save`` file, or in every ``*.pt`` of a folder (name order)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.pt"))
        if not files:
            raise InputsError(f"{p}: no *.pt files in this folder")
    elif p.exists():
        files = [p]
    else:
        raise InputsError(f"{p}: no such file or folder")
    cases = []
    for f in files:
        try:
            d = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a file that is not its format
            raise InputsError(f"{f}: not a torch.save file of tensors ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
        cases.append(check_case(str(f), d))
    return cases


def save(path, q, k, v, do=None, meta: Optional[dict] = None, dtype=torch.float16) -> None:
    """Write one case in the format above (``dtype`` for the tensors: float16 keeps the files
    small; pass torch.float32 for values beyond float16's range)."""
    d = {"q": q.to(dtype).contiguous(), "k": k.to(dtype).contiguous(), "v": v.to(dtype).contiguous()}
    if do is not None:
        d["do"] = do.to(dtype).contiguous()
    if meta:
        d["meta"] = dict(meta)
    check_case(str(path), d)  # what we write must read back
    torch.save(d, path)


# ------------------------------------------------------------ synthetic cases -----

SYNTHETIC = {
    "randn": "q, k, v ~ N(0, 1)",
    "massive_k": "K with 4 channels offset by +-30 for every token (a per-channel bias, as in LLM keys)",
    "sink": "token 0's key aligned with a direction all queries share (an attention sink, ~half the "
            "softmax mass), its value small",
    "outlier_v_rows": "8 tokens' value rows x50",
    "outlier_v_channels": "4 value channels x50 for every token",
    "peaked": "q, k x3 (score std ~9 at softmax_scale 1/sqrt(D))",
    "llm_mix": "massive_k + sink + outlier_v_channels + q, k x1.5",
}


def synthetic(kind: str, seqlen: int = 1024, heads: int = 2, head_dim: int = 128, batch: int = 1,
              seed: int = 0, kv_heads: Optional[int] = None) -> Case:
    """A seeded synthetic case ``kind`` (one of SYNTHETIC) in float32."""
    if kind not in SYNTHETIC:
        raise ValueError(f"unknown synthetic case {kind!r}: use one of {', '.join(SYNTHETIC)}")
    hk = kv_heads or heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, head_dim, generator=g)
    k = torch.randn(batch, seqlen, hk, head_dim, generator=g)
    v = torch.randn(batch, seqlen, hk, head_dim, generator=g)
    mix = kind == "llm_mix"
    if kind == "peaked":
        q, k = q * 3, k * 3
    if mix:
        q, k = q * 1.5, k * 1.5
    if kind == "massive_k" or mix:
        ch = torch.randperm(head_dim, generator=g)[:4]
        sign = torch.where(torch.rand(batch, 1, hk, 4, generator=g) < 0.5, -1.0, 1.0)
        k[..., ch] += 30.0 * sign
    if kind == "sink" or mix:
        u = torch.randn(batch, 1, heads, head_dim, generator=g)
        u = u / u.norm(dim=-1, keepdim=True)
        q = q + 2.0 * u  # a shared direction in every query
        # the sink key: along the mean direction of its group's queries, scaled so that its logit
        # is about log(seqlen) above the others (so it holds about half of each row's mass)
        grp = heads // hk
        ug = u.reshape(batch, 1, hk, grp, head_dim).mean(3)
        ug = ug / ug.norm(dim=-1, keepdim=True)
        k[:, :1] = ug * (math.log(seqlen) * math.sqrt(head_dim) / 2.0)
        v[:, :1] *= 0.1
    if kind == "outlier_v_rows":
        rows = torch.randperm(seqlen, generator=g)[:min(8, seqlen)]
        v[:, rows] *= 50.0
    if kind == "outlier_v_channels" or mix:
        ch = torch.randperm(head_dim, generator=g)[:4]
        v[..., ch] *= 50.0
    return Case(kind, q, k, v, None, {"synthetic": kind, "seed": seed, "what": SYNTHETIC[kind]})
