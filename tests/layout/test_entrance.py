"""One layout type and one entrance: the input's form is read once (``read_input``), the Swin's packed maps are a
``TokenLayout`` (``TokenLayout.packed``), and ``SwinBlock`` keeps ``Block``'s contract (its forward signature, its
layer scale)."""

from __future__ import annotations

import inspect

import pytest
import torch

from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout
from vitrel.models.blocks import Block
from vitrel.models.naflex import images_batch, input_form, read_input
from vitrel.models.swin_blocks import SwinBlock, image_maps, pack_maps


@pytest.mark.parametrize("prefix", [0, 2])
def test_packed_layout_matches_its_definition(prefix: int) -> None:
    """Each image after the other in one row, prefix tokens then patches in raster order, written out token by
    token."""
    grids = [Grid(2, 3), Grid(1, 4), Grid(3, 1)]
    lay = TokenLayout.packed(grids, prefix)
    distinct = list(dict.fromkeys(grids))
    tokens = []  # (segment, (row, col), index, image, group) of each token
    for i, g in enumerate(grids):
        tokens += [(i, (-1, -1), k, i, distinct.index(g)) for k in range(prefix)]
        tokens += [(i, (r, c), prefix + r * g.w + c, i, distinct.index(g)) for r in range(g.h) for c in range(g.w)]
    seg, coords, index, image, group = (list(t) for t in zip(*tokens))
    assert lay.segment.tolist() == [seg] and lay.image.tolist() == [image] and lay.index.tolist() == [index]
    assert lay.coords.tolist() == [[list(c) for c in coords]] and lay.group.tolist() == [group]
    assert lay.image_grids == tuple(grids) and lay.grids == tuple(distinct) and lay.num_prefix_tokens == prefix
    assert lay.image_sizes == [prefix + g.n for g in grids] and sum(lay.image_sizes) == lay.num_tokens


def test_pack_and_split_maps_round_trip() -> None:
    maps = [torch.randn(1, h, w, 5) for h, w in [(2, 3), (4, 1), (1, 1)]]
    x, lay = pack_maps(maps)
    assert x.shape == (1, 6 + 4 + 1, 5) and lay.image_grids == (Grid(2, 3), Grid(4, 1), Grid(1, 1))
    for got, want in zip(image_maps(x, lay), maps):
        assert torch.equal(got, want)


def test_read_input_decides_the_form_once() -> None:
    conv = torch.nn.Conv2d(3, 8, 4, 4)
    imgs = [torch.randn(3, 8, 12), torch.randn(3, 4, 4)]
    assert [input_form(v) for v in (torch.randn(1, 3, 8, 8), imgs, tuple(imgs), images_batch(imgs, 4))] == [
        "images",
        "list",
        "list",
        "naflex",
    ]
    x = torch.randn(2, 3, 8, 8)
    got = read_input(x, conv)
    assert got.images is x and got.batch is None
    from_list, from_dict = read_input(imgs, conv), read_input(images_batch(imgs, 4), conv)
    assert from_list.images is None and from_list.batch.image_grids == (Grid(2, 3), Grid(1, 1))
    assert torch.equal(from_list.batch.patches, from_dict.batch.patches)
    with pytest.raises(ValueError, match="image 1 of the list: 4x6 is not a positive multiple of the patch size 4"):
        read_input([imgs[0], torch.randn(3, 4, 6)], conv)


def test_swin_block_keeps_block_forward_signature() -> None:
    assert list(inspect.signature(SwinBlock.forward).parameters) == list(inspect.signature(Block.forward).parameters)
    blk = SwinBlock(8, 2, (2, 2), shifted=True, pos="rel2d_full", build_grid=(4, 4))
    x = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="makes its windows' masks"):
        blk(x, None, torch.zeros(4, 4, 4))
    with pytest.raises(ValueError, match="not on the grid"):
        blk(x, Grid(2, 8))
    torch.testing.assert_close(blk(x, Grid(4, 4)), blk(x))


@pytest.mark.parametrize("packed", [False, True])
def test_swin_block_applies_its_layer_scale(packed: bool) -> None:
    """``init_values`` builds ``ls1`` / ``ls2``, and the forward applies them: the residual branches are scaled by
    exactly the gammas (float64: the attention branch read off with ``gamma_1 = 1, gamma_2 = 0``, the MLP applied by
    hand)."""
    torch.manual_seed(0)
    blk = SwinBlock(8, 2, (2, 2), shifted=True, pos="rel2d_full", build_grid=(4, 4), init_values=1.0).double()
    maps = [torch.randn(1, 4, 4, 8, dtype=torch.float64), torch.randn(1, 3, 5, 8, dtype=torch.float64)]
    x, lay = pack_maps(maps) if packed else (maps[0], None)
    with torch.no_grad():
        g1, g2 = torch.rand(8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
        blk.ls2.gamma.zero_()
        a = blk(x, lay) - x  # the attention branch alone, gamma 1
        blk.ls1.gamma.copy_(g1)
        blk.ls2.gamma.copy_(g2)
        y = blk(x, lay)
        mid = x + g1 * a
        want = mid + g2 * blk.mlp(blk.norm2(mid))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pos", ["rel2d_full", "rope2d_mixed", "rel2d_bucket"])
def test_swin_windows_are_a_token_layout(pos: str) -> None:
    """The Swin's windows are a ``TokenLayout`` (``TokenLayout.windows``): read by the general token-layout path (each
    region an image of the window's grid with the other regions' tokens dropped: its terms gathered per token or pair,
    the images' block-diagonal mask) they give what the windows' path gives (the window grid's terms for every
    window, the regions masked), float64. A 7 x 9 map in 4 x 5 windows shifted by (2, 2): the seam and the padding."""
    from vitrel import Attention
    from vitrel.layout.windows import NUM_REGIONS, shifted_window_mask, window_layout, window_regions

    regions = window_regions(Grid(7, 9), (4, 5), (2, 2))
    lay = window_layout(regions, (4, 5))
    t = torch.arange(20)
    assert lay.segment.equal(regions) and lay.grids == (Grid(4, 5),) and lay.num_prefix_tokens == 0
    assert lay.coords.tolist() == [torch.stack([t // 5, t % 5], -1).tolist()] * 4 and lay.index.equal(t.expand(4, 20))
    assert lay.image.equal(torch.arange(4)[:, None] * NUM_REGIONS + regions) and lay.num_images == 4 * NUM_REGIONS
    torch.manual_seed(0)
    attn = Attention(16, 2, pos=pos, grid=(4, 5)).double()
    x = torch.randn(8, 20, 16, dtype=torch.float64)  # two maps' windows: row b reads the layout's row b % 4
    y = attn(x, grid=(4, 5), mask=lay)
    torch.testing.assert_close(y, attn(x, grid=(4, 5), mask=shifted_window_mask(Grid(7, 9), (4, 5), (2, 2))))
    for half in (x[:4], x[4:]):
        torch.testing.assert_close(attn(half, grid=lay), attn(half, grid=(4, 5), mask=lay))


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_a_windows_layout_that_does_not_fit_is_refused(impl: str) -> None:
    """The windows' layout as a mask must fit the batch (a multiple of its windows) and the windows' tokens, named,
    whether the kernel lowers it (sdpa) or reads it (flex)."""
    from vitrel import Attention
    from vitrel.layout.windows import window_layout, window_regions

    lay = window_layout(window_regions(Grid(7, 9), (4, 5), (2, 2)), (4, 5))  # 4 windows of 20 tokens
    attn = Attention(16, 2, pos="rel2d_full", grid=(4, 5), attn_impl=impl).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="not a multiple of the layout's 4 windows"):
        attn(torch.randn(6, 20, 16), grid=(4, 5), mask=lay)
    with torch.no_grad(), pytest.raises(ValueError, match="a layout of windows"):
        attn(torch.randn(4, 12, 16), grid=(3, 4), mask=lay)


@pytest.mark.parametrize(("grid", "window"), [((8, 8), (4, 4)), ((7, 9), (4, 5)), ((14, 14), (4, 4)), ((3, 5), (7, 7))])
@pytest.mark.parametrize("shifted", [False, True])
def test_window_groups_are_swins_shifted_windows(grid, window, shifted) -> None:
    """The windows' layout read back onto the map (``window_groups``) is Swin's definition: with the shift ``s`` and
    window ``M`` of ``window_and_shift``, two positions attend to each other iff ``floor((r - s) / M)`` agree on both
    axes (the padding, the roll and the regions of the seam undone). And the figure draws it."""
    from vitrel.layout.windows import window_and_shift, window_groups
    from vitrel.viz import plot_swin_windows

    g = Grid(*grid)
    (mh, mw), (sh, sw) = window_and_shift(g, window, shifted)
    groups = window_groups(g, window, shifted)
    r, c = torch.arange(g.h)[:, None].expand(g.h, g.w), torch.arange(g.w)[None, :].expand(g.h, g.w)
    key = ((r - sh).div(mh, rounding_mode="floor") * 1000 + (c - sw).div(mw, rounding_mode="floor")).flatten()
    flat = groups.flatten()
    assert torch.equal(flat[:, None] == flat[None, :], key[:, None] == key[None, :])
    assert sorted(flat.unique().tolist()) == list(range(len(key.unique())))
    assert len(plot_swin_windows(g, window).axes) == 2
