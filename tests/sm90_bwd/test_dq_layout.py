"""The dQ accumulator's fragment order (fp4gen.device.bwd_prep.dq_fragment_index): a
permutation of each 64-row tile, consistent with the m64 wgmma accumulator layout the
backward kernel stores it from, and inverted exactly by the host helpers."""
from __future__ import annotations

import pytest
import torch

from fp4gen.device import bwd_prep


@pytest.mark.parametrize("d", [64, 128])
def test_fragment_index_is_a_permutation_of_the_tile(d):
    idx = bwd_prep.dq_fragment_index(d)
    assert len(idx) == 64 * d
    assert sorted(r * d + c for r, c in idx) == list(range(64 * d))


def test_fragment_index_follows_the_wgmma_accumulator():
    # thread 0 of warpgroup 0 holds rows 0 and 8, columns 0, 1 of each 8-column chunk: its
    # registers 0..3 are (0,0) (0,1) (8,0) (8,1), floats 0..3; thread 5 (row 1, columns 2, 3)
    # is at float 20; warpgroup 1 starts at float 32 * d, column d/2
    idx = bwd_prep.dq_fragment_index(128)
    assert idx[0:4] == [(0, 0), (0, 1), (8, 0), (8, 1)]
    assert idx[20:24] == [(1, 2), (1, 3), (9, 2), (9, 3)]
    assert idx[512:514] == [(0, 8), (0, 9)]  # register 4: the next 8-column chunk, 512 floats on
    assert idx[32 * 128] == (0, 64)
    assert idx[128] == (16, 0)  # thread 32: warp 1, rows 16..


@pytest.mark.parametrize("d", [64, 128])
def test_rows_fragments_round_trip(d):
    x = torch.randn(2, 3, 128, d)
    f = bwd_prep.dq_rows_to_fragments(x)
    assert not torch.equal(f, x)
    assert torch.equal(bwd_prep.dq_fragments_to_rows(f), x)
    # each 64-row tile is permuted within itself
    assert torch.equal(bwd_prep.dq_fragments_to_rows(f[:, :, :64]), x[:, :, :64])
