"""Video grids ``(T, H, W)``: the geometry (t-major tokens, offsets query minus key) and the schemes' grid check."""

import pytest
import torch

import vitrel
from vitrel.layout.geometry import Grid, Grid3, as_grid, as_grid3, patch_coords3, rel_offsets3


def test_as_grid_takes_triples_and_refuses_other_lengths():
    assert as_grid((2, 3, 4)) == Grid3(2, 3, 4) and as_grid((2, 3, 4)).n == 24
    assert as_grid((3, 4)) == Grid(3, 4)
    assert as_grid3((3, 4)) == Grid3(1, 3, 4) and as_grid3((2, 3, 4)).space == Grid(3, 4)
    for bad in [(1, 2, 3, 4), (2,), (0, 3, 4), "abc"]:
        with pytest.raises(ValueError, match="grid"):
            as_grid(bad)


def test_tokens_are_t_major_and_offsets_are_query_minus_key():
    g = Grid3(2, 3, 4)
    t, h, w = patch_coords3(g)
    for i in range(g.n):  # index = (t * H + h) * W + w, from the definition
        assert (int(t[i]) * g.h + int(h[i])) * g.w + int(w[i]) == i
    dt, dh, dw = rel_offsets3(g)
    for i in range(g.n):
        for j in range(g.n):
            assert (dt[i, j], dh[i, j], dw[i, j]) == (t[i] - t[j], h[i] - h[j], w[i] - w[j])


def test_image_scheme_refuses_a_video_grid_naming_the_video_schemes():
    attn = vitrel.Attention(32, 2, pos="rel2d_full", grid=(3, 3))
    x = torch.randn(1, 2 * 9, 32)
    with pytest.raises(ValueError, match=r"rel2d_full.*video grid 2x3x3.*none"):
        attn(x, grid=(2, 3, 3))
    with pytest.raises(ValueError, match="video grid"):
        vitrel.Attention(32, 2, pos="rope2d_axial", grid=(2, 3, 3))


def test_no_position_takes_a_video_grid():
    attn = vitrel.Attention(32, 2, pos="none", grid=(2, 3, 3))
    x = torch.randn(2, 18, 32)
    assert attn(x, grid=(2, 3, 3)).shape == x.shape
    with pytest.raises(ValueError, match="2x3x3"):
        attn(x[:, :-1], grid=(2, 3, 3))
