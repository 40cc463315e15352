"""The planner's scale-factor column counts agree with CuTe DSL's own TMEM layouts.

Compiles (CPU only, no GPU) a tiny @cute.jit probe that builds the tcgen05 block-scaled
MMA's SFA/SFB TMEM layouts and measures their width in columns.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fp4gen.ir.passes import plan_kernel

import specs

PROBE = textwrap.dedent('''
    import os
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
    import cutlass, cutlass.cute as cute
    from cutlass.cute.nvgpu import tcgen05
    import cutlass.utils.blockscaled_layout as bs

    CASES = [("SFQ", cutlass.Float8E4M3FN, 16, 128, 128, 128),   # QK: M=128 queries, K=head_dim 128
             ("SFP", cutlass.Float8E8M0FNU, 32, 128, 128, 128)]  # PV: M=128 queries, N=head_dim, K=128 keys

    @cute.jit
    def probe():
        for name, sfd, vec, M, N, K in CASES:
            op = tcgen05.MmaMXF4NVF4Op(sfd, (M, N, 64), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM)
            tm = cute.make_tiled_mma(op)
            sa = bs.make_smem_layout_sfa(tm, (M, N, K), vec, 1)
            sb = bs.make_smem_layout_sfb(tm, (M, N, K), vec, 1)
            la = bs.make_tmem_layout_sfa(tm, (M, N, K), vec, cute.slice_(sa, (None, None, None, 0)))
            lb = bs.make_tmem_layout_sfb(tm, (M, N, K), vec, cute.slice_(sb, (None, None, None, 0)))
            p = cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem)
            a = cute.make_tensor(cute.recast_ptr(p, dtype=sfd), la)
            b = cute.make_tensor(cute.recast_ptr(p, dtype=sfd), lb)
            print("COLS", name, tcgen05.find_tmem_tensor_col_offset(a), tcgen05.find_tmem_tensor_col_offset(b))

    cute.compile(probe)
''')


@pytest.mark.slow
def test_scale_factor_columns_match_cute_dsl(tmp_path):
    pytest.importorskip("cutlass.cute")
    probe = tmp_path / "sf_probe.py"  # the DSL reads the jit function's source from a file
    probe.write_text(PROBE)
    out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUTE_DSL_ARCH": "sm_100a"})
    assert out.returncode == 0, out.stderr[-2000:]
    cols = {}
    for line in out.stdout.splitlines():
        if line.startswith("COLS"):
            _, name, a, b = line.split()
            cols[name] = (int(a), int(b))
    p = plan_kernel(specs.paper_fp4())
    width = {r.name: r.columns for r in p.tmem.regions}
    assert cols["SFQ"] == (width["SFQ0"], width["SFK0"])  # (8, 8)
    assert cols["SFP"] == (width["SFP0"], width["SFV0"])  # (4, 4)
