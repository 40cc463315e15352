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


@pytest.mark.parametrize("s", [1, 32, 100, 128])
def test_dot_tiles_puts_each_query_tile_in_one_block(s):
    """dO^T for the FP8 backward: (B, H, D, S padded to 32) -> (B, H, tiles, D, 64), query
    tile t's D x 64 block contiguous, zeros past the payload; dot_untiles inverts it."""
    B, H, D = 2, 3, 16
    s32 = -(-s // 32) * 32
    sqp = -(-s // 64) * 64
    xt = torch.randint(1, 255, (B, H, D, s32), dtype=torch.uint8)
    t = bwd_prep.dot_tiles(xt, sqp)
    assert t.shape == (B, H, sqp // 64, D, 64) and t.is_contiguous()
    for tile in range(sqp // 64):
        for dd in (0, D - 1):
            n = max(0, min(s32 - 64 * tile, 64))
            assert torch.equal(t[1, 2, tile, dd, :n], xt[1, 2, dd, 64 * tile:64 * tile + n])
            assert not t[1, 2, tile, dd, n:].any()
    back = bwd_prep.dot_untiles(t)
    assert torch.equal(back[..., :s32], xt) and not back[..., s32:].any()
    f8 = bwd_prep.dot_tiles(xt.view(torch.float8_e4m3fn), sqp)
    assert f8.dtype == torch.float8_e4m3fn and torch.equal(f8.view(torch.uint8), t)
