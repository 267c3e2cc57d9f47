"""Table extension rules (option ``extend``: grow = clip | interpolate) of the learned relative tables
(vitrel/pos/tables.py): at call time on a larger grid and when a checkpoint loads at another size."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from vitrel import Attention
from vitrel.layout.geometry import as_grid
from vitrel.pos.registry import build_pos
from vitrel.pos.tables import extend_table

HEADS, D = 3, 8


def scheme(name, grid, **opts):
    torch.manual_seed(0)
    return build_pos({"name": name, **opts}, num_heads=HEADS, head_dim=D, grid=grid).double()


def naive_full_bias(table, grid):
    """``B[h, i, j] = T[dh + Kh, dw + Kw, h]`` with loops (``T`` covering every offset of ``grid``)."""
    H, W = grid
    kh, kw = (table.shape[0] - 1) // 2, (table.shape[1] - 1) // 2
    out = torch.zeros(table.shape[2], H * W, H * W, dtype=table.dtype)
    for i in range(H * W):
        for j in range(H * W):
            dh, dw = i // W - j // W, i % W - j % W
            out[:, i, j] = table[min(max(dh, -kh), kh) + kh, min(max(dw, -kw), kw) + kw]
    return out


def swin_v1_interpolate(table, new_hw):
    """Swin V1's fine-tuning resize (its official code): bicubic over ``[1, heads, S, S]``."""
    chw = table.permute(2, 0, 1)[None]
    return F.interpolate(chw, size=new_hw, mode="bicubic", align_corners=False)[0].permute(1, 2, 0)


# ---------------------------------------------------------------- the rules on a table
def test_interpolate_is_swin_v1_and_timm():
    """In the table's own precision: a float64 table was resized in float32 (5e-8 off)."""
    t = torch.randn(7, 5, HEADS, dtype=torch.float64)
    got = extend_table(t, (11, 9), "interpolate")
    torch.testing.assert_close(got, swin_v1_interpolate(t, (11, 9)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("new_hw", [(11, 9), (3, 5)])
def test_interpolate_is_timms_simple_resize(new_hw):
    """2-D and 1-D tables, growing and shrinking: timm's ``resize_rel_pos_bias_table_simple``."""
    from timm.layers import resize_rel_pos_bias_table_simple

    t = torch.randn(7, 5, HEADS, dtype=torch.float64)
    window = ((new_hw[0] + 1) // 2, (new_hw[1] + 1) // 2)
    want = resize_rel_pos_bias_table_simple(t.permute(2, 0, 1), window, (HEADS, *new_hw)).permute(1, 2, 0)
    torch.testing.assert_close(extend_table(t, new_hw, "interpolate"), want, rtol=1e-12, atol=1e-12)
    want = resize_rel_pos_bias_table_simple(t[:, 0].T[:, :, None], (window[0], 1), (HEADS, new_hw[0], 1))[:, :, 0].T
    got = extend_table(t[:, 0, None], (new_hw[0], 1), "interpolate")[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule", ["grow", "clip"])
def test_grow_and_clip_keep_offsets_and_take_edge_values(rule):
    """Every offset the table had keeps its value, each new one takes the edge value (a loop over offsets). ``grow``
    filled new offsets from a stretch of the whole table: growing 13 -> 23, offset 7 took about offset 3.8's value."""
    t = torch.randn(5, 5, HEADS, dtype=torch.float64)
    big = extend_table(t, (9, 7), rule)
    for a in range(9):
        for b in range(7):
            dh, dw = a - 4, b - 3
            assert torch.equal(big[a, b], t[min(max(dh, -2), 2) + 2, min(max(dw, -2), 2) + 2])
    small = extend_table(t, (3, 3), rule)  # shrinking crops the centre
    assert torch.equal(small, t[1:4, 1:4])
    assert extend_table(t, (3, 3), "interpolate").shape == (3, 3, HEADS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_geometric_is_beits_resize_as_timm_and_clamps_at_call_time(dtype):
    """``geometric``: timm's ``resize_rel_pos_bias_table`` (BEiT's, per head in float32) on a table loaded at a larger
    or smaller grid, 2-D and 1-D; the offsets at the centre keep their values growing; a call on a larger grid than
    the table clamps to its edge as ``grow`` does."""
    from timm.layers import resize_rel_pos_bias_table

    t = torch.randn(7, 5, HEADS, dtype=dtype)
    for new_hw in [(11, 9), (5, 3)]:
        window = ((new_hw[0] + 1) // 2, (new_hw[1] + 1) // 2)
        want = resize_rel_pos_bias_table(t.permute(2, 0, 1).contiguous(), window, (HEADS, *new_hw)).permute(1, 2, 0)
        got = extend_table(t, new_hw, "geometric")
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(extend_table(t, (11, 9), "geometric")[5, 4], t[3, 2])  # (float32 in between)
    assert extend_table(t[:, :1], (13, 1), "geometric").shape == (13, 1, HEADS)
    small, big = loaded("rel2d_factored", (3, 4), (5, 6), "geometric")  # (the ends map to the ends, the rest spreads)
    grown = extend_table(small.table_h.detach()[:, None], (9, 1), "grow")[:, 0]
    torch.testing.assert_close(big.table_h[0], small.table_h[0])
    assert big.table_h.shape[0] == 9 and (big.table_h[2] - grown[2]).abs().max() > 1e-3
    s, g = scheme("rel2d_full", (3, 4), extend="geometric"), scheme("rel2d_full", (3, 4), extend="grow")
    torch.testing.assert_close(s.bias(as_grid((5, 6))), g.bias(as_grid((5, 6))), rtol=0, atol=0)


# ---------------------------------------------------------------- call time on a larger grid
@pytest.mark.parametrize("rule", ["grow", "clip", "interpolate"])
def test_rel2d_full_call_time(rule):
    s = scheme("rel2d_full", (3, 4), extend=rule)
    grid = (5, 6)
    want_table = swin_v1_interpolate(s.table.detach().float(), (9, 11)).double() if rule == "interpolate" else s.table
    torch.testing.assert_close(s.bias(as_grid(grid)), naive_full_bias(want_table.detach(), grid))
    # the offset table (flex path) says the same
    ot = s.offset_table(as_grid(grid))
    torch.testing.assert_close(ot.permute(1, 2, 0), naive_offset_table(want_table.detach(), grid))


def naive_offset_table(table, grid):
    H, W = grid
    kh, kw = (table.shape[0] - 1) // 2, (table.shape[1] - 1) // 2
    out = torch.zeros(2 * H - 1, 2 * W - 1, table.shape[2], dtype=table.dtype)
    for a in range(2 * H - 1):
        for b in range(2 * W - 1):
            dh, dw = a - (H - 1), b - (W - 1)
            out[a, b] = table[min(max(dh, -kh), kh) + kh, min(max(dw, -kw), kw) + kw]
    return out


@pytest.mark.parametrize("rule", ["clip", "interpolate"])
def test_rel2d_factored_call_time_all_paths(rule):
    s = scheme("rel2d_factored", (3, 4), extend=rule)
    grid = as_grid((6, 5))
    th, tw = s.table_h.detach(), s.table_w.detach()
    if rule == "interpolate":
        th = swin_v1_interpolate(th[:, None, :].float(), (11, 1))[:, 0].double()
        tw = swin_v1_interpolate(tw[:, None, :].float(), (9, 1))[:, 0].double()
    # b_h[dh] + b_w[dw] with loops
    want = torch.zeros(HEADS, grid.n, grid.n, dtype=torch.float64)
    kh, kw = (th.shape[0] - 1) // 2, (tw.shape[0] - 1) // 2
    for i in range(grid.n):
        for j in range(grid.n):
            dh, dw = i // grid.w - j // grid.w, i % grid.w - j % grid.w
            want[:, i, j] = th[min(max(dh, -kh), kh) + kh] + tw[min(max(dw, -kw), kw) + kw]
    torch.testing.assert_close(s.bias(grid), want)
    u, w = s.bias_factors(grid)  # fold path: bias = u w^T
    torch.testing.assert_close(u @ w.transpose(-1, -2), want)
    ot = s.offset_table(grid)
    assert ot.shape == (HEADS, 2 * grid.h - 1, 2 * grid.w - 1)


def test_interpolate_at_call_time_is_differentiable():
    attn = Attention(dim=HEADS * D, num_heads=HEADS, pos={"name": "rel2d_full", "extend": "interpolate"}, grid=(3, 3))
    x = torch.randn(2, 25, HEADS * D)
    attn(x, grid=(5, 5)).sum().backward()
    g = attn.pos.table.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


# ---------------------------------------------------------------- load at another size = call time
def loaded(name, small_grid, big_grid, rule):
    """A scheme built for ``small_grid`` and one built for ``big_grid`` that loaded its state dict."""
    small, big = scheme(name, small_grid, extend=rule), scheme(name, big_grid, extend=rule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the resize warning
        big.load_state_dict(small.state_dict())
    return small, big


@pytest.mark.parametrize("name", ["rel2d_full", "rel2d_factored"])
@pytest.mark.parametrize("rule", ["grow", "clip", "interpolate"])
def test_loading_at_a_larger_size_equals_the_call_time_rule(name, rule):
    """A model loaded at a larger size computes on that grid what the original computes there."""
    small, big = loaded(name, (3, 4), (5, 6), rule)
    grid = as_grid((5, 6))
    torch.testing.assert_close(big.bias(grid), small.bias(grid), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["shaw2d_factored", "shaw2d_full", "shaw1d"])
@pytest.mark.parametrize("rule", ["grow", "clip", "interpolate"])
def test_shaw_tables_load_by_the_rule(name, rule):
    small, big = loaded(name, (3, 3), (5, 5), rule)
    for key, kind in small._rel_tables.items():
        src, dst = getattr(small, key).detach(), getattr(big, key).detach()
        src3 = src[:, None, :] if kind == "1d" else src
        want = extend_table(src3, (dst.shape[0], 1 if kind == "1d" else dst.shape[1]), rule)
        torch.testing.assert_close(dst, want[:, 0, :] if kind == "1d" else want)
        if rule == "clip" and kind == "1d":  # the old offsets stay, the new ones repeat the edge
            k, kk = (src.shape[0] - 1) // 2, (dst.shape[0] - 1) // 2
            torch.testing.assert_close(dst[kk - k : kk + k + 1], src)
            torch.testing.assert_close(dst[0], src[0])


def test_bad_rule_names_the_option():
    with pytest.raises(ValueError, match="extend must be one of"):
        scheme("rel2d_full", (3, 3), extend="stretch")


def test_the_resize_warning_says_what_a_smaller_grid_does():
    """Loaded at a smaller grid, the warning said new offsets "take the edge values": none are new, the outer ones
    are dropped. It now says so; at a larger grid it says the edge rule."""
    small, big = scheme("rel2d_full", (3, 3)), scheme("rel2d_full", (5, 5))
    with pytest.warns(UserWarning, match=r"offsets the smaller grid has keep their values, the others are dropped"):
        small.load_state_dict(big.state_dict())
    with pytest.warns(UserWarning, match=r"new ones take the edge values"):
        big.load_state_dict(scheme("rel2d_full", (3, 3)).state_dict())
