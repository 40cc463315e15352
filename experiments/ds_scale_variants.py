#!/usr/bin/env python3
"""Where does FP8 dS's scale bookkeeping cost its ~5 %? Variants of the all-FP8 backward for an A/B.

The all-FP8 sm90a backward (``sm90_fp8_train_ds8_causal_d128``) keeps one power-of-two dS scale
per 64 x 128 tile, guessed from the previous tile: every thread takes the max of its f |dS|
(a tree of 32 ``absmax2``), the dS barrier ORs the overflows (``bar.red.or``), a second barrier
ANDs the "below 448/16" flags (``bar.red.and``), an overflowing tile (and each walk's first)
takes its exact max and is stored again, and dK's accumulator is rescaled when c changes. With
a static scale the kernel was 1.15x over the bf16-dS kernel, with the guess 1.08x-1.11x
(docs/backward.md, "FP8 dS"); cutting the redo path's share did not move its time. This script
writes copies of the sm90a backward kernel class (fp4gen/device/sm90/backward.py) with one piece
taken out each, each beside a copy of the generated module that builds it, for the bench to time
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
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "generated" / "sm90_fp8_train_ds8_causal_d128_sm90a.py"
KERNEL_SOURCE = ROOT / "fp4gen" / "device" / "sm90" / "backward.py"  # the kernel class the variants patch
NAME = "sm90_fp8_train_ds8_causal_d128"
KERNEL_IMPORT = "from fp4gen.device.sm90 import backward as _bwd_kernel"

_MAX_TREE = ("ds_loc = tree_max([ptx.absmax2(acc_dP[2 * i], acc_dP[2 * i + 1])\n"
             "                                       for i in range(cute.size(acc_dP) // 2)])")
_SMALL = "ds_small = ds_loc < DS_SMALL"
_AND_BARRIER = "                    ds_small = ptx.barrier_red(BAR_DS, self.mma_threads, ds_small, \"and\")\n"
_REDO = "ds_redo = (ds_loc > E4M3_MAX) | (m_block == m_block_min)"
_RESCALE = "if ds_c != dk_c:"

VARIANTS = {
    "base": [],
    "one_barrier": [(_SMALL, "ds_small = ds_loc < -1.0  # A/B: never halve"), (_AND_BARRIER, "")],
    "no_rescale": [(_RESCALE, "if ds_c != ds_c:  # A/B: never rescale dK")],
    "short_max": [(_MAX_TREE, "ds_loc = ptx.absmax2(acc_dP[0], acc_dP[1])  # A/B: one pair")],
    "static": [(_SMALL, "ds_small = ds_loc < -1.0  # A/B: never halve"), (_AND_BARRIER, ""),
               (_REDO, "ds_redo = m_block == m_block_min"),  # A/B: c from the first tile only
               (_RESCALE, "if ds_c != ds_c:  # A/B: c never changes after the first tile")],
}


def _replace_once(text: str, old: str, new: str, what: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"expected one {old.strip()[:60]!r} in {what}, found {text.count(old)} "
                         f"(the kernel or the module changed: update this script)")
    return text.replace(old, new)


def kernel_variant(text: str, name: str) -> str:
    """The sm90a backward kernel class's source with variant ``name``'s pieces taken out."""
    for old, new in VARIANTS[name]:
        text = _replace_once(text, old, new, KERNEL_SOURCE.name)
    return text


def module_variant(text: str, name: str, kernel_text: str) -> str:
    """The generated module, renamed, building its backward from the variant kernel file beside
    it (``ds8_ab_<name>_kernel.py``, loaded as a sibling of fp4gen.device.sm90.backward so that
    its relative imports resolve). The kernel text's hash is in the module text: the compile
    cache keys on the module's source, so an edited variant is never served an old kernel."""
    digest = hashlib.sha256(kernel_text.encode()).hexdigest()[:16]
    loader = (f"import importlib.util as _ab_util, sys as _ab_sys  # noqa: E402  (A/B variant {name!r}, "
              f"kernel sha256 {digest})\n"
              f"_ab_spec = _ab_util.spec_from_file_location(\n"
              f"    'fp4gen.device.sm90.ds8_ab_{name}', __import__('pathlib').Path(__file__).with_name("
              f"'ds8_ab_{name}_kernel.py'))\n"
              f"_bwd_kernel = _ab_util.module_from_spec(_ab_spec)\n"
              f"_ab_sys.modules[_ab_spec.name] = _bwd_kernel  # dataclasses look their module up\n"
              f"_ab_spec.loader.exec_module(_bwd_kernel)")
    text = _replace_once(text, KERNEL_IMPORT, loader, SOURCE.name)
    return _replace_once(text, f"KERNEL_NAME = {NAME!r}", f"KERNEL_NAME = {NAME + '_ab_' + name!r}", SOURCE.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the variant modules")
    ap.add_argument("--compile", action="store_true", help="also compile each variant's backward for sm_90a")
    args = ap.parse_args(argv)
    if args.compile:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text, kernel = SOURCE.read_text(), KERNEL_SOURCE.read_text()
    for name in VARIANTS:
        path = out / f"ds8_ab_{name}.py"
        kernel_text = kernel_variant(kernel, name)
        path.with_name(f"ds8_ab_{name}_kernel.py").write_text(kernel_text)
        path.write_text(module_variant(text, name, kernel_text))
        print(f"wrote {path} and its kernel")
        if args.compile:
            spec = importlib.util.spec_from_file_location(f"_ds8_ab_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mod._bwd_compile("sm_90a", tvm_ffi=False, gqa=False)
            print("  compiled for sm_90a")
    return 0


if __name__ == "__main__":
    sys.exit(main())
