"""ape_factored: row and column tables, against a loop reference from the equation and timm NaFlexVit's factorized
embedding (timm.models.naflexvit.NaFlexEmbeds, pos_embed="factorized")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from timm.models.naflexvit import NaFlexEmbeds

from vitrel.pos import Grid, build_pos, get_pos_class, list_pos
from vitrel.pos import tables as pos_tables
from vitrel.pos.schemes.ape_factored import ApeFactored

CONF = Path(__file__).resolve().parents[2] / "conf" / "pos"


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(pos_tables, "_WARNED", set())


def make(grid=(4, 4), embed_dim: int = 8, **kw) -> ApeFactored:
    s = build_pos("ape_factored", num_heads=2, head_dim=embed_dim // 2, grid=grid, embed_dim=embed_dim, **kw)
    return s.double()


def ref_linear(table: torch.Tensor, n: int) -> torch.Tensor:
    """``table [L, C]`` resampled to ``n`` rows, loops: output ``i`` reads the input at ``(i + 1/2) L / n - 1/2``
    (align_corners=False), clamped to ``[0, L - 1]``, between its two neighbours."""
    length = table.shape[0]
    if n == length:
        return table
    rows = []
    for i in range(n):
        s = min(max((i + 0.5) * length / n - 0.5, 0.0), length - 1)
        lo = math.floor(s)
        hi = min(lo + 1, length - 1)
        rows.append(table[lo] * (1 - (s - lo)) + table[hi] * (s - lo))
    return torch.stack(rows)


def ref_embed(y: torch.Tensor, x: torch.Tensor, grid: Grid, ar: bool, built: Grid) -> torch.Tensor:
    """``[H*W, C]``: ``e(r, c) = y'[r] + x'[c]``, the tables resampled to H and W (to max(H, W) with ``ar``, then cut;
    the tables as stored on their own grid)."""
    side = max(grid)
    ar = ar and tuple(grid) != tuple(built)
    ys, xs = ref_linear(y, side if ar else grid.h)[: grid.h], ref_linear(x, side if ar else grid.w)[: grid.w]
    return torch.stack([ys[r] + xs[c] for r in range(grid.h) for c in range(grid.w)])


GRIDS = [Grid(4, 4), Grid(6, 9), Grid(2, 3), Grid(5, 2), Grid(7, 4)]


@pytest.mark.parametrize("ar", [False, True])
@pytest.mark.parametrize("grid", GRIDS)
def test_matches_loop_reference_forward_and_grads(grid, ar):
    torch.manual_seed(0)
    s = make(grid=(4, 4), ar_preserving=ar)
    x = torch.randn(2, 1 + grid.n, 8, dtype=torch.float64)
    g = torch.randn_like(x)
    y = s.add_to_tokens(x, grid, 1)
    assert torch.equal(y[:, :1], x[:, :1])
    ty, tx = (s.pos_embed_y[0].detach().requires_grad_(True), s.pos_embed_x[0].detach().requires_grad_(True))
    ref = ref_embed(ty, tx, grid, ar, Grid(4, 4))
    torch.testing.assert_close(y[:, 1:], x[:, 1:] + ref, rtol=0, atol=1e-12)
    got = torch.autograd.grad((y * g).sum(), (s.pos_embed_y, s.pos_embed_x))
    want = torch.autograd.grad((ref * g[:, 1:]).sum(), (ty, tx))
    for a, b in zip(got, want):
        torch.testing.assert_close(a[0], b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("ar", [False, True])
def test_equals_timm_naflexvit_factorized(ar):
    """timm's own code, on image grids and on a NaFlex batch of two grids (its per-image path)."""
    torch.manual_seed(1)
    s = make(grid=(4, 4), embed_dim=16, ar_preserving=ar).float()
    t = NaFlexEmbeds(patch_size=2, embed_dim=16, class_token=False, pos_embed="factorized", pos_embed_grid_size=(4, 4),
                     pos_embed_ar_preserving=ar, proj_type="linear")  # fmt: skip
    with torch.no_grad():
        t.pos_embed_y.copy_(s.pos_embed_y)
        t.pos_embed_x.copy_(s.pos_embed_x)
        t.proj.weight.zero_()
        t.proj.bias.zero_()
    for grid in GRIDS:
        out, _ = t(torch.zeros(1, 3, 2 * grid.h, 2 * grid.w))
        torch.testing.assert_close(s.embed(grid), out, rtol=0, atol=1e-6)
    grids = [Grid(3, 5), Grid(6, 2)]
    coord = torch.full((2, 15, 2), 0)
    for b, g in enumerate(grids):
        rc = torch.tensor([(r, c) for r in range(g.h) for c in range(g.w)])
        coord[b, : g.n] = rc
        coord[b, g.n :] = rc[-1]  # (timm reads each image's extent off its largest coordinate)
    out, _ = t(torch.zeros(2, 15, 12), patch_coord=coord)
    for b, g in enumerate(grids):
        torch.testing.assert_close(s.embed(g)[0], out[b, : g.n], rtol=0, atol=1e-6)


def test_parameters_init_table_grid_and_repr():
    torch.manual_seed(2)
    s = build_pos("ape_factored", num_heads=4, head_dim=16, grid=(8, 12))
    assert isinstance(s, ApeFactored) and s.kind == "absolute"
    assert [n for n, _ in s.named_parameters()] == ["pos_embed_y", "pos_embed_x"]
    assert s.pos_embed_y.shape == (1, 8, 64) and s.pos_embed_x.shape == (1, 12, 64)
    assert 0.015 < torch.cat((s.pos_embed_y, s.pos_embed_x), 1).std().item() < 0.025
    assert s.no_weight_decay_keys == ("pos_embed_y", "pos_embed_x")
    t = build_pos("ape_factored", num_heads=2, head_dim=4, grid=(8, 12), table_grid=(5, 6), ar_preserving=True)
    assert t.pos_embed_y.shape == (1, 5, 8) and t.pos_embed_x.shape == (1, 6, 8)
    assert t.embed(Grid(8, 12)).shape == (1, 96, 8)
    assert "table_grid=5x6" in repr(t) and "ar_preserving=True" in repr(t) and t.size_branches
    assert not make(grid=(4, 4), ar_preserving=True).size_branches and not make(grid=(3, 5)).size_branches
    with pytest.raises(ValueError, match="ar_preserving must be true or false"):
        make(ar_preserving="yes")
    with pytest.raises(ValueError, match="video"):
        build_pos("ape_factored", num_heads=2, head_dim=4, grid=(2, 4, 4))


def test_load_of_other_lengths_resamples_and_warns():
    torch.manual_seed(3)
    src, dst = make(grid=(3, 5)), make(grid=(6, 4))
    with pytest.warns(UserWarning, match="pos_embed_y from 3 to 6"):
        dst.load_state_dict(src.state_dict())
    torch.testing.assert_close(dst.pos_embed_y[0], ref_linear(src.pos_embed_y[0].detach(), 6))
    torch.testing.assert_close(dst.pos_embed_x[0], ref_linear(src.pos_embed_x[0].detach(), 4))


def test_is_absolute_and_config_builds():
    assert "ape_factored" in list_pos("absolute") and "ape_factored" not in list_pos("relative")
    cfg = yaml.safe_load((CONF / "ape_factored.yaml").read_text())
    s = build_pos(cfg, num_heads=2, head_dim=8, grid=(3, 5))
    assert type(s) is get_pos_class("ape_factored")
    for k, v in cfg.items():
        if k != "name":
            assert getattr(s, k) == v
