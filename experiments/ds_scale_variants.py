#!/usr/bin/env python3
"""Where does FP8 dS's scale bookkeeping cost its ~5 %? Variants of the all-FP8 backward for an A/B.

The all-FP8 sm90a backward (``sm90_fp8_train_ds8_causal_d128``) keeps one power-of-two dS scale
per 64 x 128 tile, guessed from the previous tile: every thread takes the max of its f |dS|
(a tree of 32 ``absmax2``), the dS barrier ORs the overflows (``bar.red.or``), a second barrier
ANDs the "below 448/16" flags (``bar.red.and``), an overflowing tile (and each walk's first)
takes its exact max and is stored again, and dK's accumulator is rescaled when c changes. With
a static scale the kernel was 1.15x over the bf16-dS kernel, with the guess 1.08x-1.11x
(docs/backward.md, "FP8 dS"); cutting the redo path's share did not move its time. This script
writes copies of the generated module with one piece taken out each, for the bench to time
side by side (kernel-only rows), so that the next change goes where the time is:

- ``base``: unchanged (renamed, so that it times in the same process as the others);
- ``one_barrier``: no ``bar.red.and`` (the guess is never halved; numerics still correct);
- ``no_rescale``: dK's accumulator is never rescaled (wrong when c changes; timing only);
- ``short_max``: each thread's max over one pair of its 64 dS values instead of all of them
  (wrong when a tile overflows unseen; timing only);
- ``static``: c taken on the walk's first tile and kept (one barrier, no rescale, no redo after
  the first tile; wrong where a later tile overflows; timing only).

    python3 experiments/ds_scale_variants.py --out /tmp/dsv [--compile]   # --compile: sm_90a, CPU
    # then on the H200 (rows "-kernel-only"; the gate is off: some variants are wrong on purpose)
    source .dev/activate && python3 bench/attention_bwd.py /tmp/dsv/*.py \\
        generated/sm90_fp8_train_causal_d128_sm90a.py --anchors fa4 --gate 1 --rounds 5 \\
        --name ds-scale-variants-h200
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "generated" / "sm90_fp8_train_ds8_causal_d128_sm90a.py"
NAME = "sm90_fp8_train_ds8_causal_d128"

_MAX_TREE = ("ds_loc = _bwd_tree_max([_bwd_ptx.absmax2(acc_dP[2 * i], acc_dP[2 * i + 1])\n"
             "                                        for i in range(cute.size(acc_dP) // 2)])")
_SMALL = "ds_small = ds_loc < _BWD_DS_SMALL"
_AND_BARRIER = "                ds_small = _bwd_barrier_red(_BWD_BAR_DS, _BWD_MMA_THREADS, ds_small, \"and\")\n"
_REDO = "ds_redo = (ds_loc > 448.0) | (m_block == m_block_min)"
_RESCALE = "if ds_c != dk_c:"

VARIANTS = {
    "base": [],
    "one_barrier": [(_SMALL, "ds_small = ds_loc < -1.0  # A/B: never halve"), (_AND_BARRIER, "")],
    "no_rescale": [(_RESCALE, "if ds_c != ds_c:  # A/B: never rescale dK")],
    "short_max": [(_MAX_TREE, "ds_loc = _bwd_ptx.absmax2(acc_dP[0], acc_dP[1])  # A/B: one pair")],
    "static": [(_SMALL, "ds_small = ds_loc < -1.0  # A/B: never halve"), (_AND_BARRIER, ""),
               (_REDO, "ds_redo = m_block == m_block_min  # A/B: c from the first tile only"),
               (_RESCALE, "if ds_c != ds_c:  # A/B: c never changes after the first tile")],
}


def variant_source(text: str, name: str) -> str:
    for old, new in VARIANTS[name]:
        if text.count(old) != 1:
            raise SystemExit(f"{name}: expected one {old.strip()[:60]!r} in {SOURCE.name}, found "
                             f"{text.count(old)} (the template changed: update this script)")
        text = text.replace(old, new)
    old_name = f"KERNEL_NAME = {NAME!r}"
    if text.count(old_name) != 1:
        raise SystemExit(f"{SOURCE.name} does not define {old_name}")
    return text.replace(old_name, f"KERNEL_NAME = {NAME + '_ab_' + name!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the variant modules")
    ap.add_argument("--compile", action="store_true", help="also compile each variant's backward for sm_90a")
    args = ap.parse_args(argv)
    if args.compile:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = SOURCE.read_text()
    for name in VARIANTS:
        path = out / f"ds8_ab_{name}.py"
        path.write_text(variant_source(text, name))
        print(f"wrote {path}")
        if args.compile:
            spec = importlib.util.spec_from_file_location(f"_ds8_ab_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mod._bwd_compile("sm_90a", tvm_ffi=False, gqa=False)
            print("  compiled for sm_90a")
    return 0


if __name__ == "__main__":
    sys.exit(main())
