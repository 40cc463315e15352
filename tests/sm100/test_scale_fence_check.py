"""The conformance rule for P's block scales in SMEM (conformance.scale_fence_mismatches): in a
publish window (arrive to arrive, holding a tcgen05.st of P) that stores to SMEM, a
fence.proxy.async must follow the last store. Synthetic PTX lines (the passing shapes and
planted faults), then the compiled fa4_fp4 forward with its fences deleted."""
from __future__ import annotations

import pytest

from fp4gen.lowering.conformance import scale_fence_mismatches

SCALES = "st.shared.b32 [%r82+125952], %r1663;"
STATS = "st.shared.b32 [%r3003+320], %r2999;"
FENCE = "fence.proxy.async.shared::cta;"
WAIT = "tcgen05.wait::st.sync.aligned;"
ARRIVE = "mbarrier.arrive.release.cta.shared::cta.b64 _, [%r20];"
TRY_WAIT = "mbarrier.try_wait.parity.shared::cta.b64 P1, [%r21], %r5;"
P_STORE = "tcgen05.st.sync.aligned.32x32b.x8.b32 [%r30], {%r1, %r2, %r3, %r4, %r5, %r6, %r7, %r8};"


def test_halves_with_one_fence_after_the_scales_pass():
    # S drained, scales stored, part 1 acquired (a wait) and published with the fence, part 2
    # published without one (no SMEM store in its window), the row statistics (no tcgen05.st)
    lines = [ARRIVE, SCALES, TRY_WAIT, P_STORE, WAIT, FENCE, ARRIVE, TRY_WAIT, P_STORE, WAIT, ARRIVE,
             TRY_WAIT, STATS, ARRIVE]
    assert scale_fence_mismatches(lines) == []


def test_a_missing_fence_fails():
    lines = [ARRIVE, SCALES, TRY_WAIT, P_STORE, WAIT, ARRIVE, TRY_WAIT, P_STORE, WAIT, FENCE, ARRIVE]
    (m,) = scale_fence_mismatches(lines)
    assert m.check == "ptx.fence.scales"


def test_a_fence_before_the_store_does_not_count():
    lines = [ARRIVE, FENCE, SCALES, TRY_WAIT, P_STORE, WAIT, ARRIVE]
    assert len(scale_fence_mismatches(lines)) == 1


def test_a_store_after_the_fence_fails():
    lines = [ARRIVE, SCALES, FENCE, P_STORE, WAIT, SCALES, ARRIVE]
    assert len(scale_fence_mismatches(lines)) == 1


@pytest.mark.slow
def test_the_compiled_forward_passes_and_fails_without_its_fences():
    """fa4_fp4_d128's PTX (compiled on the CPU, ~20 s): clean, and with every
    fence.proxy.async deleted the rule fires (it sees the kernel's scale stores)."""
    from fp4gen.lowering import perf

    (src,) = perf._spec_sources("examples/fa4_fp4_d128.attn")
    lines = [ln.strip() for ln in perf.fp4gen_ptx(src).splitlines()]
    assert scale_fence_mismatches(lines) == []
    assert len(scale_fence_mismatches([ln for ln in lines if not ln.startswith("fence.proxy.async")])) == 1
