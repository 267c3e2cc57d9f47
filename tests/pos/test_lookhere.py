"""LookHere against a float64 loop written from the definitions of its views and penalty (the single-set
form: every head looks in one direction set).

The authors' construction (GreenCUBIC/lookhere ``create_lh_bias_tensor``) and their released head groups
(``fov`` 180 / 90 / 45) are re-derived in ``tests/pos/test_lookhere_presets.py``."""

from __future__ import annotations

import math

import pytest
import torch

import vitrel
from tests.reference import reference_attention
from vitrel import Attention
from vitrel.pos import Grid, build_pos

INF = float("-inf")


# each set's four views, as (half, wedge) conditions that must all hold
SETS = {
    "halves": [("up",), ("down",), ("left",), ("right",)],
    "quadrants": [("up", "left"), ("up", "right"), ("down", "left"), ("down", "right")],
    "triangles": [("w_up",), ("w_down",), ("w_left",), ("w_right",)],
    "eighths": [("w_up", "left"), ("w_down", "left"), ("w_left", "up"), ("w_right", "up")],
}


def _in_view(view: str, dh: int, dw: int) -> bool:
    """The definitions, one by one (query minus key offsets): ``view`` is ``(set, head % 4)``."""
    cond = {
        "up": dh >= 0,
        "down": dh <= 0,
        "left": dw >= 0,
        "right": dw <= 0,
        "w_up": dh >= abs(dw),
        "w_down": -dh >= abs(dw),
        "w_left": dw >= abs(dh),
        "w_right": -dw >= abs(dh),
    }
    name, direction = view
    return all(cond[c] for c in SETS[name][direction])


def naive_bias(directions, heads, grid, prefix, g=1.0, ls=(1.5, 0.5), layer=None):
    h_, w_ = grid
    n = prefix + h_ * w_
    s_l = ls[0] if layer is None else ls[0] + (ls[1] - ls[0]) * layer[0] / (layer[1] - 1)
    out = torch.zeros(heads, n, n, dtype=torch.float64)
    for h in range(heads):
        m_h = 2.0 ** -(h // 4 + 1)
        for i in range(h_ * w_):
            for j in range(h_ * w_):
                dh, dw = i // w_ - j // w_, i % w_ - j % w_
                ok = _in_view((directions, h % 4), dh, dw)
                out[h, prefix + i, prefix + j] = -g * s_l * m_h * math.hypot(dh, dw) if ok else INF
    return out


@pytest.mark.parametrize("directions", ["halves", "quadrants", "triangles", "eighths"])
@pytest.mark.parametrize("grid,prefix,heads", [((3, 4), 0, 4), ((4, 4), 1, 8), ((5, 2), 2, 6)])
def test_bias_and_attention_match_the_definition(directions, grid, prefix, heads):
    torch.manual_seed(0)
    a = Attention(
        8 * heads,
        heads,
        pos={"name": "lookhere", "directions": directions, "global_slope": 0.7},
        grid=grid,
        num_prefix_tokens=prefix,
    ).double()
    want = naive_bias(directions, heads, grid, prefix, g=0.7)
    got = a.bias(grid)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(want)], want[~torch.isinf(want)])
    x = torch.randn(2, prefix + grid[0] * grid[1], 8 * heads, dtype=torch.float64, requires_grad=True)
    logits, ref = reference_attention(a, x, want)
    out = a(x, grid)
    torch.testing.assert_close(out, ref)
    (g1,) = torch.autograd.grad(out.square().sum(), x)
    (g2,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(g1, g2)
    assert torch.isfinite(out).all()


def test_fov_picks_the_head_groups_and_prefix_tokens_are_unrestricted():
    presets = {180: "halves-diagonals-none", 90: "quadrants-triangles-none", 45: "eighths-eighths2-none"}
    for fov, groups in presets.items():
        s = build_pos({"name": "lookhere", "fov": fov}, num_heads=12, head_dim=8, grid=(3, 3), num_prefix_tokens=1)
        assert s.directions == tuple(groups.split("-")) and s.global_slope == 2.0
        single = build_pos(
            {"name": "lookhere", "directions": groups.split("-")[0]}, num_heads=4, head_dim=8, grid=(3, 3)
        )
        assert single.directions == (groups.split("-")[0],)
        b = s.bias(Grid(3, 3), 1)
        assert torch.equal(b[:, 0], torch.zeros_like(b[:, 0])) and torch.equal(b[:, :, 0], torch.zeros_like(b[:, 0]))
    with pytest.raises(ValueError, match="fov must be one of"):
        build_pos({"name": "lookhere", "fov": 120}, num_heads=4, head_dim=8, grid=(3, 3))


@pytest.mark.parametrize("fov", [90, 45])
def test_fov_with_directions_is_refused(fov):
    # directions set the head groups themselves: fov was ignored, so a pos.fov sweep trained one model
    with pytest.raises(ValueError, match=rf"lookhere: fov={fov} .* and directions=.*give one of the two"):
        build_pos({"name": "lookhere", "fov": fov, "directions": "halves"}, num_heads=4, head_dim=8, grid=(3, 3))
    s = build_pos({"name": "lookhere", "fov": 180, "directions": "quadrants"}, num_heads=4, head_dim=8, grid=(3, 3))
    assert s.groups == [("quadrants", 4)]  # fov 180 (the config file's) with directions: the directions
    with pytest.raises(ValueError, match="directions must be one of"):
        build_pos({"name": "lookhere", "directions": "spiral"}, num_heads=4, head_dim=8, grid=(3, 3))


def test_per_layer_slopes_in_a_model():
    """The blocks of a model get the linear schedule; a scheme shared by all blocks takes the first slope."""
    pos = {"name": "lookhere", "directions": "halves", "global_slope": 1.0, "layer_slopes": [2.0, 0.5]}
    kw = dict(pos=pos, embed_dim=32, depth=4, num_heads=4)
    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", **kw)
    assert [b.attn.pos.slope for b in m.blocks] == [2.0, 1.5, 1.0, 0.5]
    for i, blk in enumerate(m.blocks):
        want = naive_bias("halves", 4, (8, 8), 1, ls=(2.0, 0.5), layer=(i, 4))
        got = blk.attn.pos.bias(Grid(8, 8), 1)
        torch.testing.assert_close(got[~torch.isinf(want)], want[~torch.isinf(want)])
    shared = vitrel.create_model("vitrel_vit_tiny_patch4_32", pos_share=True, **kw)
    assert shared.rel_pos.slope == 2.0
    x = torch.randn(2, 3, 32, 32)
    assert torch.isfinite(m(x)).all() and torch.isfinite(shared(x)).all()
    swin = vitrel.create_model(
        "vitrel_swin_tiny_patch2_window4_32",
        pos={"name": "lookhere", "fov": 45},
        embed_dim=16,
        depths=(2, 2),
        num_heads=(4, 4),
    )
    slopes = [b.attn.pos.slope for st in swin.layers for b in st.blocks]
    assert slopes == pytest.approx([2 * v for v in (1.5, 1.5 - 1 / 3, 0.5 + 1 / 3, 0.5)])  # global_slope 2
    assert torch.isfinite(swin(torch.randn(2, 3, 40, 40))).all()  # padded windows: every query sees itself
