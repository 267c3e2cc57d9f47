"""``vitrel.Attention`` in a model of the user's own: as a drop-in for the ``attn`` of timm's ViT blocks.

timm's ``Block`` calls ``self.attn(x, attn_mask=..., is_causal=...)`` and no grid: the layer then attends on the grid
it was built for, takes timm's mask, and refuses what it cannot honour in one line naming the fix.
"""

from __future__ import annotations

import pytest
import timm
import torch

from vitrel import Attention
from vitrel.layout.tokens import TokenLayout
from vitrel.pos import Grid, build_pos

GRID = (4, 6)  # H != W: a grid inferred from the token count alone would be wrong


def timm_pair(pos: str = "none", **kw):
    """A timm ViT (float64, eval) and a copy of it whose blocks' ``attn`` are vitrel layers with ``pos``."""
    torch.manual_seed(0)
    args = dict(pretrained=False, depth=2, img_size=(GRID[0] * 16, GRID[1] * 16), **kw)
    ref = timm.create_model("vit_tiny_patch16_224", **args).double().eval()
    m = timm.create_model("vit_tiny_patch16_224", **args).double().eval()
    for blk in m.blocks:
        blk.attn = Attention(192, 3, pos=pos, grid=GRID, num_prefix_tokens=m.num_prefix_tokens).double()
    missing, unexpected = m.load_state_dict(ref.state_dict(), strict=False)  # timm's names: qkv, proj
    assert not unexpected
    return ref, m, missing


def test_no_position_reproduces_timm_vit():
    ref, m, missing = timm_pair("none")
    assert not missing
    x = torch.randn(2, 3, GRID[0] * 16, GRID[1] * 16, dtype=torch.float64)
    torch.testing.assert_close(m(x), ref(x), rtol=1e-12, atol=1e-12)


def test_registers_and_timm_weights_with_a_learned_table():
    ref, m, missing = timm_pair("rel2d_full", reg_tokens=2)
    assert sorted(missing) == ["blocks.0.attn.pos.table", "blocks.1.attn.pos.table"]
    x = torch.randn(2, 3, GRID[0] * 16, GRID[1] * 16, dtype=torch.float64)
    with torch.no_grad():
        m.blocks[0].attn.pos.table.normal_()
    assert (m(x) - ref(x)).abs().max() > 1e-3  # the scheme acts
    with torch.no_grad():
        for blk in m.blocks:
            blk.attn.pos.table.zero_()
    torch.testing.assert_close(m(x), ref(x), rtol=1e-12, atol=1e-12)  # a zero table: timm's function


def test_without_a_grid_the_layer_attends_on_its_built_grid():
    torch.manual_seed(0)
    a = Attention(24, 3, pos="rel2d_full", grid=GRID, num_prefix_tokens=1).double()
    with torch.no_grad():
        a.pos.table.normal_()
    x = torch.randn(2, 1 + GRID[0] * GRID[1], 24, dtype=torch.float64)
    torch.testing.assert_close(a(x), a(x, grid=GRID), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"built for .*4x6.* 25 tokens.*has 31.*grid=\(H, W\)"):
        a(torch.randn(2, 31, 24, dtype=torch.float64))
    # a scheme built elsewhere for another grid: the layer's grid is the forward's, the scheme's sizes its table
    b = Attention(24, 3, pos=build_pos("rel2d_full", num_heads=3, head_dim=8, grid=(2, 2)), grid=GRID).double()
    x = torch.randn(2, GRID[0] * GRID[1], 24, dtype=torch.float64)
    torch.testing.assert_close(b(x), b(x, grid=GRID), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_timm_attn_mask_is_the_mask(kind):
    torch.manual_seed(0)
    a = Attention(24, 3, pos="alibi2d", grid=GRID, num_prefix_tokens=1).double()
    n = 1 + GRID[0] * GRID[1]
    x = torch.randn(2, n, 24, dtype=torch.float64)
    keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
    keep[1, ..., 20:] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape, dtype=x.dtype).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(a(x, attn_mask=mask), a(x, GRID, mask), rtol=0, atol=0)
    with pytest.raises(ValueError, match="mask or attn_mask"):
        a(x, mask=mask, attn_mask=mask)


def test_is_causal_on_a_layer_built_without_it_is_refused():
    a = Attention(24, 3, pos="alibi2d", grid=GRID)
    x = torch.randn(2, GRID[0] * GRID[1], 24)
    with pytest.raises(ValueError, match=r"is_causal=True.*causal=True"):
        a(x, is_causal=True)
    c = Attention(24, 3, pos="alibi1d", grid=GRID, causal=True)
    torch.testing.assert_close(c(x, is_causal=True), c(x, grid=GRID))


def test_a_key_padding_mask_of_the_wrong_rank_is_one_line():
    a = Attention(24, 3, pos="alibi2d", grid=GRID, num_prefix_tokens=1)
    x = torch.randn(2, 1 + GRID[0] * GRID[1], 24)
    keep = torch.ones(2, x.shape[1], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"\[2, 25\].*\[B, heads, N, N\].*mask\[:, None, None, :\]"):
        a(x, GRID, keep)
    torch.testing.assert_close(a(x, GRID, keep[:, None, None, :]), a(x, GRID))


@pytest.mark.parametrize("pos", ["none", "rel2d_full", "built"])
def test_timm_only_keywords_are_refused_as_the_layers(pos):
    """timm's ``Attention(dim, num_heads, scale_norm=..., fused_attn=...)``: refused as the layer's unexpected keywords,
    not reported as options a scheme the user never named lacks (vitrel's names: ``attn_norm``, ``norm_eps``); timm's
    ``norm_layer=`` class is refused naming vitrel's names for it."""
    if pos == "built":
        pos = build_pos("rel2d_full", num_heads=3, head_dim=8, grid=GRID)
    with pytest.raises(
        TypeError, match=r"Attention\(\) got unexpected keyword argument\(s\) \['fused_attn', 'scale_norm'\]"
    ):
        Attention(24, 3, pos=pos, grid=GRID, scale_norm=False, fused_attn=True)
    with pytest.raises(ValueError, match=r"norm_layer must be one of \('layernorm', 'rmsnorm'\)"):
        Attention(24, 3, pos=pos, grid=GRID, norm_layer=torch.nn.LayerNorm)
    with pytest.raises(TypeError, match=r"'extnd'.*rel2d_full.*\['extend', 'init_std'\]"):  # a typo names the options
        Attention(24, 3, pos="rel2d_full", grid=GRID, extnd="clip")


def test_a_token_layout_with_another_prefix_count_is_refused():
    """Variable-size images packed in one row (``grid=TokenLayout.packed(...)``): each image equals itself alone; a
    layout whose prefix count is not the layer's is refused (it took the layout's silently)."""
    torch.manual_seed(0)
    a = Attention(24, 3, pos="rel2d_full", grid=(3, 4), num_prefix_tokens=1).double()
    with torch.no_grad():
        a.pos.table.normal_()
    layout = TokenLayout.packed([Grid(3, 4), Grid(2, 5)], num_prefix_tokens=1)
    x = torch.randn(1, layout.num_tokens, 24, dtype=torch.float64)
    alone = torch.cat([a(x[:, :13], grid=(3, 4)), a(x[:, 13:], grid=(2, 5))], 1)
    torch.testing.assert_close(a(x, grid=layout), alone, rtol=1e-12, atol=1e-12)
    layout = TokenLayout.packed([Grid(3, 4), Grid(2, 5)], num_prefix_tokens=0)
    with pytest.raises(ValueError, match="layout has 0 prefix token.*num_prefix_tokens=1"):
        a(torch.randn(1, layout.num_tokens, 24, dtype=torch.float64), grid=layout)


def test_layer_with_a_built_scheme_is_not_ignored():
    """``layer=`` sets a scheme's per-layer schedule (LookHere's slopes) when the layer builds it; with a scheme built
    elsewhere it was dropped without a word."""
    lh = build_pos("lookhere", num_heads=4, head_dim=8, grid=GRID)  # built for no layer
    with pytest.raises(ValueError, match=r"layer=\(3, 4\) with a built scheme \(lookhere, built for layer None\)"):
        Attention(32, 4, pos=lh, grid=GRID, layer=(3, 4))
    built = build_pos("lookhere", num_heads=4, head_dim=8, grid=GRID, layer=(3, 4))
    Attention(32, 4, pos=built, grid=GRID, layer=(3, 4))  # the same layer: fine
