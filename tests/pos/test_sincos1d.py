"""sincos1d: VideoMAE's fixed 1-D sinusoid over the patches' raster order, against the authors' table function
(MCG-NJU/VideoMAE, ``modeling_finetune.py``, ``get_sinusoid_encoding_table``) written out below, alone and in the
image and video ViTs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import vitrel
from vitrel.layout.geometry import Grid, Grid3
from vitrel.pos import build_pos, get_pos_class, list_pos
from vitrel.pos.schemes.absolute import Sincos1d, sincos1d_embed

CONF = Path(__file__).resolve().parents[2] / "conf" / "pos"


def get_sinusoid_encoding_table(n_position, d_hid):
    """VideoMAE's function, verbatim but for the last line (numpy float64 here, not a float32 tensor)."""

    def get_position_angle_vec(position):
        return [position / np.power(10000, 2 * (hid_j // 2) / d_hid) for hid_j in range(d_hid)]

    sinusoid_table = np.array([get_position_angle_vec(pos_i) for pos_i in range(n_position)])
    sinusoid_table[:, 0::2] = np.sin(sinusoid_table[:, 0::2])  # dim 2i
    sinusoid_table[:, 1::2] = np.cos(sinusoid_table[:, 1::2])  # dim 2i+1
    return torch.from_numpy(sinusoid_table)[None]  # [1, n_position, d_hid], float64


def raster(grid) -> list[tuple[int, ...]]:
    """The grid's patches in the order of VideoMAE's ``Conv3d(...)(x).flatten(2).transpose(1, 2)``: t-major, then
    rows, then columns (image grids: rows, then columns)."""
    return [tuple(int(i) for i in c) for c in np.ndindex(*tuple(grid))]


def their_table(grid, c: int) -> torch.Tensor:
    """Their table for the grid's tokens: token ``k`` of the raster is position ``k``, ``p = (t * H + h) * W + w``."""
    shape = tuple(grid)
    index = [int(np.ravel_multi_index(ix, shape)) for ix in raster(grid)]
    assert index == list(range(len(index)))  # (the raster index of the k-th token is k)
    return get_sinusoid_encoding_table(len(index), c)


GRIDS = [Grid(1, 1), Grid(3, 4), Grid(5, 2), Grid(7, 7), Grid3(1, 3, 4), Grid3(2, 3, 4), Grid3(4, 2, 5), Grid3(8, 4, 4)]


@pytest.mark.parametrize("c", [16, 64])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_table_is_videomaes(grid, c):
    want = their_table(grid, c)
    torch.testing.assert_close(sincos1d_embed(grid, c), want, rtol=0, atol=1e-12)
    s = build_pos("sincos1d", num_heads=2, head_dim=c // 2, grid=(2, 3))  # fixed: any grid at call time
    torch.testing.assert_close(s.embed(grid, dtype=torch.float64), want, rtol=0, atol=1e-12)
    # built on that grid, the buffer is the table too (float32 unless converted)
    b = build_pos("sincos1d", num_heads=2, head_dim=c // 2, grid=grid).double()
    assert tuple(b.grid) == tuple(grid)
    torch.testing.assert_close(b.built_embed, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("prefix", [0, 1, 3])
def test_add_to_tokens_leaves_the_prefix(prefix):
    g = Grid3(2, 3, 4)
    s = build_pos("sincos1d", num_heads=2, head_dim=8, grid=g).double()
    x = torch.randn(2, prefix + g.n, 16, dtype=torch.float64)
    out = s.add_to_tokens(x, g, prefix)
    assert torch.equal(out[:, :prefix], x[:, :prefix])
    torch.testing.assert_close(out[:, prefix:], x[:, prefix:] + their_table(g, 16), rtol=0, atol=1e-12)
    # an image grid is its own H*W raster, the same numbers as one frame
    img = s.add_to_tokens(x[:, : prefix + 12], (3, 4), prefix)
    torch.testing.assert_close(img[:, prefix:], x[:, prefix : prefix + 12] + their_table(Grid(3, 4), 16))


def test_the_scheme_declares_what_it_is():
    cls = get_pos_class("sincos1d")
    assert cls is Sincos1d and "sincos1d" in list_pos("absolute")
    assert cls.kind == "absolute" and cls.family == "absolute"
    assert cls.grid_dims is None  # image and video grids, each as given
    assert cls.depends_on_extent  # the raster index r * W + c moves with the grid's width
    s = build_pos("sincos1d", num_heads=2, head_dim=8, grid=(3, 4))
    assert list(s.parameters()) == [] and s.state_dict() == {}  # fixed: nothing learned, nothing saved
    # the same patch (row 1, column 1) gets another embedding on a grid of another width
    assert not torch.equal(s.embed((3, 4))[0, 1 * 4 + 1], s.embed((3, 5))[0, 1 * 5 + 1])


@pytest.mark.parametrize("c", [7, 33])
def test_odd_embed_dim_is_refused(c):
    with pytest.raises(ValueError, match=f"sincos1d needs embed_dim divisible by 2, got embed_dim={c}"):
        build_pos("sincos1d", num_heads=1, head_dim=c, grid=(3, 4))
    with pytest.raises(ValueError, match=f"sincos1d needs an even embed_dim, got embed_dim={c}"):
        sincos1d_embed(Grid(3, 4), c)
    with pytest.raises(ValueError, match="sincos1d needs embed_dim divisible by 2, got embed_dim=33"):
        vitrel.create_model("vitrel_vit_tiny_patch4_32", pos="sincos1d", depth=1, embed_dim=33, num_heads=3)
    with pytest.raises(ValueError, match="temperature > 0"):
        build_pos("sincos1d", num_heads=2, head_dim=8, grid=(3, 4), temperature=0.0)


def test_config_builds():
    cfg = yaml.safe_load((CONF / "sincos1d.yaml").read_text())
    assert cfg == {"name": "sincos1d", "temperature": 10000.0}
    s = build_pos(cfg, num_heads=2, head_dim=8, grid=(2, 3, 5))
    assert type(s) is Sincos1d and s.temperature == 10000.0


# ------------------------------------------------------------------------------ in the models
def expected_tokens(model, x: torch.Tensor, prefix: torch.Tensor | None) -> tuple[torch.Tensor, tuple]:
    """The model's patch tokens plus their table, the prefix tokens as they are."""
    patches, grid = model.patch_embed(x)
    patches = patches + their_table(grid, patches.shape[-1]).to(patches.dtype)
    if prefix is None:
        return patches, grid
    return torch.cat([prefix.expand(x.shape[0], -1, -1), patches], dim=1), grid


@pytest.mark.parametrize(
    ("built", "other"),
    [((4, 16, 16), (6, 12, 20)), ((2, 8, 12), (5, 8, 12))],
    ids=["longer-and-another-size", "another-clip-length"],
)
def test_video_vit_adds_their_table(built, other):
    """VideoMAE's layout: the tubelets in raster order, their table for the token count; at another clip length or
    frame size the table of that grid (their fine-tuning builds it anew the same way)."""
    torch.manual_seed(0)
    t, h, w = built
    m = vitrel.create_model(
        "vitrel_vit_video_tiny_patch4_32", pos="sincos1d", depth=1, embed_dim=32, num_heads=2, class_token=True,
        num_frames=t, img_size=(h, w),
    ).eval().double()  # fmt: skip
    with torch.no_grad():
        m.cls_token.normal_()
    assert isinstance(m.abs_pos, Sincos1d) and m.num_prefix_tokens == 1
    for size in (built, other):
        x = torch.randn(2, 1, *size, dtype=torch.float64)
        with torch.no_grad():
            got, grid = m.embed(x)
            want, g = expected_tokens(m, x, m.cls_token)
        assert tuple(grid) == tuple(g) == (size[0], size[1] // 4, size[2] // 4)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert torch.equal(got[:, 0], m.cls_token[0].expand(2, -1))


@pytest.mark.parametrize("reg_tokens", [0, 2])
def test_image_vit_adds_their_table(reg_tokens):
    torch.manual_seed(0)
    m = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="sincos1d", depth=1, embed_dim=32, num_heads=2, reg_tokens=reg_tokens
    ).eval().double()  # fmt: skip
    assert isinstance(m.abs_pos, Sincos1d) and m.num_prefix_tokens == 1 + reg_tokens
    with torch.no_grad():
        m.cls_token.normal_()
        prefix = m.cls_token if m.reg_token is None else torch.cat([m.cls_token, m.reg_token.normal_()], dim=1)
    for size in ((32, 32), (24, 40)):  # the built size, and another (grid 6 x 10: another width)
        x = torch.randn(2, 3, *size, dtype=torch.float64)
        with torch.no_grad():
            got, grid = m.embed(x)
            want, g = expected_tokens(m, x, prefix)
            logits = m(x)
        assert tuple(grid) == tuple(g) == (size[0] // 4, size[1] // 4)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert torch.equal(got[:, : 1 + reg_tokens], prefix.expand(2, -1, -1))
        assert logits.shape == (2, m.num_classes) and torch.isfinite(logits).all()
