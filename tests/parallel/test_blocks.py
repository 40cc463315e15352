"""The pieces of context-parallel attention that need no process group: which blocks a ring
step computes, the sharding order, the LSE merge and the FP8 wire format."""
from __future__ import annotations

import pytest
import torch

from fp4gen import parallel
from fp4gen.numerics import exact, quant
from fp4gen.numerics.formats import E4M3, E5M2


def _covered(world, S, causal, balanced, blocks=parallel.step_blocks):
    """How often each (query, key) pair of the whole sequence is computed, and under which mask."""
    n = S // world
    count = torch.zeros(S, S, dtype=torch.int64)
    for rank in range(world):
        rows = parallel.shard_indices(S, world, rank, balanced=balanced)
        for src in range(world):
            cols = parallel.shard_indices(S, world, src, balanced=balanced)
            for q0, q1, k0, k1, diag in blocks(rank, src, world, n, causal, balanced):
                r, c = rows[q0:q1], cols[k0:k1]
                ok = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
                if diag:  # a square block's causal mask in local order
                    assert q1 - q0 == k1 - k0
                    ok = torch.ones_like(ok).tril()
                count[r[:, None].expand_as(ok)[ok], c[None, :].expand_as(ok)[ok]] += 1
    return count


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_steps_tile_the_mask_once(world, balanced, causal):
    S = 2 * world * 8
    want = torch.ones(S, S, dtype=torch.int64)
    if causal:
        want = want.tril()
    assert torch.equal(_covered(world, S, causal, balanced), want)


def test_a_skipped_block_shows_in_the_tiling():
    def bad(rank, src, world, n, causal, balanced):
        return [] if (rank, src) == (2, 0) else parallel.step_blocks(rank, src, world, n, causal, balanced)
    assert not torch.equal(_covered(4, 64, True, True, bad), torch.ones(64, 64, dtype=torch.int64).tril())


def test_balanced_ranks_see_equal_work():
    world, S = 4, 64
    work = _covered(world, S, True, True)
    per_rank = [int(work[parallel.shard_indices(S, world, r)].sum()) for r in range(world)]
    assert len(set(per_rank)) == 1, per_rank


def test_shards_are_a_permutation():
    for world in (1, 2, 4):
        for balanced in (True, False):
            idx = torch.cat([parallel.shard_indices(48, world, r, balanced=balanced) for r in range(world)])
            assert torch.equal(idx.sort().values, torch.arange(48))
    assert parallel.shard_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="does not split"):
        parallel.shard_indices(18, 2, 0)


def test_merge_of_two_key_halves_is_attention_over_all_keys():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 24, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    o, lse = exact.attention(q, k, v, scale=0.25)
    o1, l1 = exact.attention(q, k[:, :10], v[:, :10], scale=0.25)
    o2, l2 = exact.attention(q, k[:, 10:], v[:, 10:], scale=0.25)
    om, lm = parallel.merge_partial(torch.zeros_like(o), torch.full_like(lse, float("-inf")), o1, l1)
    om, lm = parallel.merge_partial(om, lm, o2, l2)
    torch.testing.assert_close(om.double(), o, rtol=1e-6, atol=1e-6)  # the merge's arithmetic is fp32
    torch.testing.assert_close(lm.double(), lse, rtol=1e-6, atol=1e-6)
    # a row that saw no key in either part stays o = 0, lse = -inf
    ninf = torch.full_like(l1, float("-inf"))
    oz, lz = parallel.merge_partial(torch.zeros_like(o), ninf, torch.zeros_like(o), ninf)
    assert torch.equal(oz, torch.zeros_like(oz)) and torch.isneginf(lz).all()


def _roundtrip_exact(wire, x):
    fmt, gran, block = wire.fp8
    y = wire.decode(wire.encode(x))
    a, b = quant.quantize_fp8(x, gran, block, fmt), quant.quantize_fp8(y, gran, block, fmt)
    return torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("gran", ["tensor", "block", "token"])
def test_fp8_wire_requantizes_to_the_senders_codes_and_scales(fmt, gran):
    g = torch.Generator().manual_seed(2)
    wire = parallel._Wire((fmt, gran, 128), torch.float32)
    for mag in (1e-3, 1.0, 1e3):
        x = torch.randn(2, 300, 3, 32, generator=g) * mag
        x[1, :, 2] = 0  # an all-zero group (scale 1)
        assert _roundtrip_exact(wire, x)
        codes, amax = wire.encode(x)
        assert codes.dtype == torch.uint8 and codes.shape == x.shape
        assert amax.dtype == torch.float32 and amax.shape == quant.quantize_fp8(x, gran, 128, fmt).scale.shape


def test_plain_dequantize_on_the_wire_would_not_be_exact():
    """The planted fault for the test above: payload x scale alone requantizes to other scales."""
    class Plain(parallel._Wire):
        def encode(self, x):
            t = quant.quantize_fp8(x, self.fp8[1], self.fp8[2], self.fp8[0])
            return [t.codes, t.scale]

        def decode(self, bufs):
            return quant.FP8Tensor(bufs[0], bufs[1], *self.fp8).dequantize()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 512, 4, 32, generator=g)
    assert not _roundtrip_exact(Plain((E4M3, "block", 128), torch.float32), x)


def test_window_sinks_and_varlen_specs_are_refused():
    import dataclasses

    from fp4gen.ir.spec import Layout, Mask, Sinks
    from fp4gen.torch_ops import AttentionInputError

    from .harness import spec_of

    spec = spec_of("bf16")
    assert parallel._spec_causal(spec, None) is True and parallel._spec_causal(spec, False) is False
    for bad, msg in ((dataclasses.replace(spec, mask=Mask.WINDOW, window=(64, 0)), "window"),
                     (dataclasses.replace(spec, sinks=Sinks.LEARNED), "sinks"),
                     (dataclasses.replace(spec, layout=Layout.VARLEN), "dense")):
        with pytest.raises(AttentionInputError, match=msg):
            parallel._spec_causal(bad, None)
