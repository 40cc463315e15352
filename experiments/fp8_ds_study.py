#!/usr/bin/env python3
"""How much accuracy would FP8 dS (dQ = dS K and dK = dS^T Q in FP8) cost on Hopper? (CPU)

The sm90a backward keeps dS in bf16 today; the paper's recipe has dS in FP8. On Hopper an FP8
MMA has no per-block scales, so dK (accumulated over every query tile in the CTA's registers)
needs one dS scale for the whole CTA, fixed before the loop. This script measures, against
float64 autograd, the error that rounding dS alone adds (everything else exact, float64), for
these scale choices:

- ``bound``: one scale per (batch, head) from a bound the preprocessing could compute:
  |dS_ij| = P_ij |dP_ij - D_i| <= 2 max_i |dO_i| max_j |V_j| (row 2-norms), scale = bound / fmax.
- ``amax``: one scale per (batch, head) from dS's true amax (not knowable before the kernel:
  the best a per-(batch, head) scale can do).
- ``tile``: one scale per 64-query x 128-key tile from its amax (only dQ could use it: dQ is
  computed fresh per tile; shown as the floor).

and, for comparison, the whole FP8 recipe of the oracle (``sm90_fp8_train_causal_d128``: FP8
Q/K/P/V forward, FP8 dO/dP/dV, bf16 dS) against the same float64 gradients.

    python3 experiments/fp8_ds_study.py            # prints a table (about a minute on 2 cores)

Written before FP8 dS existed; it measured at S = 1024, where the per-(batch, head) bound
looked as good as dS's amax. It is not at long sequences (P ~ 1/S puts most dS many binades
below a head-wide bound): the kernel built on it lost accuracy with S on the H200. The
``--recipes`` mode measures the two backwards that exist now, through the numerics oracle:
the FP8 recipe with bf16 dS and the all-FP8 one (``dS : fp8e4m3``, one scale per 64 x 128
tile), whole backward against float64 autograd, H = 1, at the given lengths:

    python3 experiments/fp8_ds_study.py --recipes 1024 4096   # about a minute on 2 cores

The ``--walk`` mode measures the scale rule itself (``reference.fp8_ds_tile_scale``), on the
exact dS (float64, causal, H = 1): how often a tile's guess overflows (and the tile pays for
its exact max a second time in the kernel), how often c changes, and what the rounding of dS
alone costs against every tile taking c from its own max; for the rule as it is and for the
rule it replaced (guess handed on as taken, halved below 448 / 4):

    python3 experiments/fp8_ds_study.py --walk 1024 4096       # about a minute on 2 cores
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4gen.numerics import formats  # noqa: E402

S, H, D = 1024, 4, 128
TILE_M, TILE_N = 64, 128


def inputs(kind: str, seed: int = 0, seq: int = S, heads: int = H):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, seq, heads, D, generator=g) for _ in range(4))
    if kind == "peaked":  # large logits (a peaky softmax) and heavy-tailed output gradients
        q, k = q * 2.5, k * 2.5
        do = do * torch.exp(torch.randn(1, seq, heads, 1, generator=g))
    return [x.to(torch.bfloat16) for x in (q, k, v, do)]


def exact(q, k, v, do, scale):
    """float64 P, dP, D and the autograd gradients (causal), (B, H, S, *) layouts."""
    q, k, v, do = (x.double().permute(0, 2, 1, 3) for x in (q, k, v, do))
    s = (q @ k.transpose(-1, -2)) * scale
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    o = p @ v
    dp = do @ v.transpose(-1, -2)
    drow = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - drow)
    return dict(q=q, k=k, v=v, do=do, ds=ds, dq=ds @ k * scale, dk=ds.transpose(-1, -2) @ q * scale)


def fake_quant(x, scale, fmt):
    return formats.round_to((x / scale).float(), fmt).double() * scale


def tile_scales(ds, fmax):
    B, Hh, M, N = ds.shape
    a = ds.abs().reshape(B, Hh, M // TILE_M, TILE_M, N // TILE_N, TILE_N).amax(dim=(3, 5))
    a = torch.where(a == 0, torch.ones_like(a), a) / fmax
    return a.repeat_interleave(TILE_M, 2).repeat_interleave(TILE_N, 3)


def rel_l2(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


def ds_variants(e, scale):
    out = {}
    for fmt in (formats.E4M3, formats.E5M2):
        fmax = fmt.max_value
        bound = 2 * e["do"].norm(dim=-1).amax(-1) * e["v"].norm(dim=-1).amax(-1)  # (B, H)
        amax = e["ds"].abs().amax(dim=(-1, -2))
        for name, s in (("bound", (bound / fmax)[..., None, None]), ("amax", (amax / fmax)[..., None, None]),
                        ("tile", tile_scales(e["ds"], fmax))):
            dsq = fake_quant(e["ds"], s, fmt)
            zero = ((dsq == 0) & (e["ds"] != 0)).double().mean().item()
            out[f"dS {fmt.name}, {name} scale"] = (rel_l2(dsq @ e["k"] * scale, e["dq"]),
                                                  rel_l2(dsq.transpose(-1, -2) @ e["q"] * scale, e["dk"]), zero)
    return out


def train_spec(name: str = "sm90_fp8_train_causal_d128"):
    from fp4gen.frontend import parse_file

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        "sm90_fp8_train_d128.attn")
    return next(sp for sp in parse_file(path) if sp.name == name)


def recipe(q, k, v, do, name: str = "sm90_fp8_train_causal_d128"):
    """dq, dk of the numerics oracle for the example training kernel ``name`` (its own forward's
    O and LSE, as a training step hands over)."""
    from fp4gen.numerics import reference

    spec = train_spec(name)
    o, lse = reference.forward(q, k, v, spec)
    dq, dk, _ = reference.backward(q, k, v, o.to(torch.bfloat16), lse, do, spec)
    return spec.scale, dq, dk


def recipes_table(lengths):
    """The FP8 recipe (bf16 dS) and the all-FP8 one (FP8 dS per tile) against float64 autograd."""
    print("causal, H=1, D=128; rel-L2 vs float64 autograd of the whole backward, dq / dk")
    print(f"{'S':>6s} {'inputs':7s} {'bf16 dS':>17s} {'FP8 dS (per tile)':>24s}")
    for n in lengths:
        for kind in ("randn", "peaked"):
            q, k, v, do = inputs(kind, seq=n, heads=1)
            scale, bq, bk = recipe(q, k, v, do)
            _, fq, fk = recipe(q, k, v, do, "sm90_fp8_train_ds8_causal_d128")
            e = exact(q, k, v, do, scale)
            r = [rel_l2(x.double().permute(0, 2, 1, 3), e[w]) for x, w in ((bq, "dq"), (bk, "dk"), (fq, "dq"), (fk, "dk"))]
            print(f"{n:6d} {kind:7s} {r[0]:8.3f} / {r[1]:.3f}   {r[2]:8.3f} / {r[3]:.3f} ({r[2] / r[0]:.2f}x)", flush=True)


def walk_stats(e, sq, rules):
    """Walk every key tile's query tiles (causal: from the diagonal) with the oracle's scale rule
    under each of ``rules`` (name -> (FP8_DS_SMALL, FP8_DS_HEADROOM)); ``sq`` (S,) Q's block
    scale per row. Returns name -> (overflow %, first-tile %, c-change %, dq, dk rel-L2 of dS
    rounding alone vs float64), plus "own max" (every tile's c from its own max)."""
    from fp4gen.numerics import reference as R

    ds = e["ds"][0, 0]
    n = ds.shape[0]
    saved = R.FP8_DS_SMALL, R.FP8_DS_HEADROOM
    out = {}
    try:
        for name, (small, headroom) in list(rules.items()) + [("own max", (None, None))]:
            if headroom is not None:
                R.FP8_DS_SMALL, R.FP8_DS_HEADROOM = small, headroom
            dsr = torch.zeros_like(ds)
            over = firsts = changes = tiles = 0
            for n0 in range(0, n, TILE_N):
                guess, prev = torch.ones(1), None
                for t0 in range(n0 // TILE_M * TILE_M, n, TILE_M):
                    tile = ds[t0:t0 + TILE_M, n0:n0 + TILE_N]
                    s_q = sq[t0].reshape(1)
                    a = (tile.abs().amax() * s_q).float().reshape(1)
                    first = headroom is None or prev is None
                    over += int(not first and float(a) / float(guess) > 448)
                    c, guess = R.fp8_ds_tile_scale(a, guess, first)
                    firsts += int(prev is None)
                    changes += int(prev is not None and float(c) != float(prev))
                    tiles += 1
                    prev = c
                    f = (s_q / c).double()
                    dsr[t0:t0 + TILE_M, n0:n0 + TILE_N] = formats.round_to((tile * f).float(), formats.E4M3).double() / f
            dq = rel_l2(dsr @ e["k"][0, 0], e["ds"][0, 0] @ e["k"][0, 0])
            dk = rel_l2(dsr.T @ e["q"][0, 0], e["ds"][0, 0].T @ e["q"][0, 0])
            out[name] = (100 * over / tiles, 100 * firsts / tiles, 100 * changes / tiles, dq, dk)
    finally:
        R.FP8_DS_SMALL, R.FP8_DS_HEADROOM = saved
    return out


def walk_table(lengths):
    from fp4gen.numerics.quant import quantize_fp8
    from fp4gen.numerics import reference as R

    rules = {"now (x%g on a redo, halve < %g)" % (R.FP8_DS_HEADROOM, R.FP8_DS_SMALL):
             (R.FP8_DS_SMALL, R.FP8_DS_HEADROOM),
             "before (x1, halve < 112)": (112.0, 1.0)}
    print("causal, H=1, D=128; per 64 x 128 dS tile: guess overflowed / walk's first tile / c changed "
          "(% of tiles), and rel-L2 of dq / dk from rounding dS alone")
    for n in lengths:
        for kind in ("randn", "peaked"):
            q, k, v, do = inputs(kind, seq=n, heads=1)
            e = exact(q, k, v, do, 1.0 / D ** 0.5)
            sq = quantize_fp8(q, "block", 128).expand_scale()[0, :, 0, 0].double()
            for name, (ov, fi, ch, dq, dk) in walk_stats(e, sq, rules).items():
                print(f"{n:6d} {kind:7s} {name:34s} {ov:5.2f} / {fi:5.2f} / {ch:5.2f}   "
                      f"{dq:.4e} / {dk:.4e}", flush=True)


def main():
    print(f"causal, S={S}, H={H}, D={D}; rel-L2 vs float64 autograd (dS rounding alone, everything "
          "else exact), and the fraction of nonzero dS that rounds to 0")
    for kind in ("randn", "peaked"):
        q, k, v, do = inputs(kind)
        scale, rdq, rdk = recipe(q, k, v, do)
        e = exact(q, k, v, do, scale)
        print(f"\n{kind}:")
        print(f"  {'the FP8 recipe today (bf16 dS), whole backward':44s} dq {rel_l2(rdq.double().permute(0, 2, 1, 3), e['dq']):.2e}"
              f"  dk {rel_l2(rdk.double().permute(0, 2, 1, 3), e['dk']):.2e}")
        dsb = e["ds"].to(torch.bfloat16).double()
        print(f"  {'dS bf16 alone':44s} dq {rel_l2(dsb @ e['k'] * scale, e['dq']):.2e}"
              f"  dk {rel_l2(dsb.transpose(-1, -2) @ e['q'] * scale, e['dk']):.2e}")
        for name, (a, b, z) in ds_variants(e, scale).items():
            print(f"  {name:44s} dq {a:.2e}  dk {b:.2e}  zeroed {z:.1%}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--walk":
        walk_table([int(a) for a in sys.argv[2:]] or [1024, 4096])
    elif len(sys.argv) > 1 and sys.argv[1] == "--recipes":
        recipes_table([int(a) for a in sys.argv[2:]] or [1024, 4096])
    else:
        main()
