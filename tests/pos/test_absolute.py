"""Absolute schemes (ape, sincos2d): embeddings added to the patch tokens, references from the equations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from timm.layers import resample_abs_pos_embed
from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed

from vitrel.layers.attention import Attention
from vitrel.pos import Grid, build_pos, get_pos_class, list_pos
from vitrel.pos import tables as pos_tables
from vitrel.pos.schemes.absolute import Ape, Sincos2d, infer_grid, resample_pos_embed

CONF = Path(__file__).resolve().parents[2] / "conf" / "pos"
GRIDS = [Grid(3, 5), Grid(4, 4)]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """warn_once keeps a global set of messages; give every test a fresh one."""
    monkeypatch.setattr(pos_tables, "_WARNED", set())


def make(name: str, grid=(4, 4), embed_dim: int = 16, **kw):
    return build_pos(name, num_heads=2, head_dim=embed_dim // 2, grid=grid, embed_dim=embed_dim, **kw).double()


# ------------------------------------------------------------------------------ references
def ref_sincos2d(grid: Grid, c: int, temperature: float = 10000.0) -> torch.Tensor:
    """[H*W, C]: e(r, col)[t] per the equation, with explicit loops."""
    q = c // 4
    out = torch.zeros(grid.n, c, dtype=torch.float64)
    for i in range(grid.n):
        r, col = divmod(i, grid.w)
        for t in range(q):
            w = temperature ** (-t / q)
            out[i, t] = math.sin(r * w)
            out[i, q + t] = math.cos(r * w)
            out[i, 2 * q + t] = math.sin(col * w)
            out[i, 3 * q + t] = math.cos(col * w)
    return out


def ref_add(x: torch.Tensor, pe: torch.Tensor, prefix: int) -> torch.Tensor:
    """Loop reference: patch token i gets pe[i], prefix tokens unchanged."""
    rows = []
    for i in range(x.shape[1]):
        rows.append(x[:, i] if i < prefix else x[:, i] + pe[i - prefix])
    return torch.stack(rows, dim=1)


def offset_spread(logits: torch.Tensor, grid: Grid) -> float:
    """Largest spread of logits[i, j] within a group of equal 2-D offsets (dh, dw)."""
    groups: dict = {}
    for i in range(grid.n):
        for j in range(grid.n):
            (ri, ci), (rj, cj) = divmod(i, grid.w), divmod(j, grid.w)
            groups.setdefault((rj - ri, cj - ci), []).append(logits[..., i, j])
    return max((torch.stack(v, -1).amax(-1) - torch.stack(v, -1).amin(-1)).abs().max().item() for v in groups.values())


# ------------------------------------------------------------------------------ sincos2d
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("prefix", [0, 1])
def test_sincos2d_matches_loop_reference(grid, prefix):
    torch.manual_seed(0)
    s = make("sincos2d", grid=(2, 2))  # fixed embedding: any grid at call time
    assert isinstance(s, Sincos2d) and s.kind == "absolute"
    ref = ref_sincos2d(grid, 16)
    torch.testing.assert_close(s.embed(grid, dtype=torch.float64)[0], ref, rtol=1e-12, atol=1e-12)
    # the same layout as timm's build_sincos2d_pos_embed with per-axis [sin, cos] (rows first)
    timm_pe = build_sincos2d_pos_embed(
        list(grid), dim=16, temperature=10000.0, interleave_sin_cos=True, dtype=torch.float64
    )
    torch.testing.assert_close(s.embed(grid, dtype=torch.float64)[0], timm_pe.double(), rtol=1e-6, atol=1e-6)

    x = torch.randn(2, prefix + grid.n, 16, dtype=torch.float64, requires_grad=True)
    y = s.add_to_tokens(x, grid, prefix)
    torch.testing.assert_close(y, ref_add(x, ref, prefix), rtol=1e-12, atol=1e-12)
    assert torch.equal(y[:, :prefix], x[:, :prefix])
    (gx,) = torch.autograd.grad((y * y).sum(), x)
    torch.testing.assert_close(gx, 2 * y)  # d(x + e)^2 / dx = 2 (x + e)


def test_sincos2d_errors_and_inference_mode():
    with pytest.raises(ValueError, match="embed_dim"):
        build_pos("sincos2d", num_heads=2, head_dim=3, grid=4)  # embed_dim 6
    s = build_pos("sincos2d", num_heads=2, head_dim=8, grid=4)
    assert list(s.parameters()) == [] and s.state_dict() == {}
    a = s.embed(Grid(3, 5))
    assert a.shape == (1, 15, 16) and a.dtype == torch.float32
    x = torch.randn(1, 15, 16)
    with torch.inference_mode():
        s.add_to_tokens(x, Grid(3, 5))
    xg = x.clone().requires_grad_(True)
    s.add_to_tokens(xg, Grid(3, 5)).sum().backward()  # no inference tensor saved for backward
    with pytest.raises(ValueError, match="tokens"):
        s.add_to_tokens(torch.randn(1, 16, 16), Grid(3, 5), 0)


# ------------------------------------------------------------------------------ ape
def test_ape_parameter_and_init():
    torch.manual_seed(1)
    s = build_pos("ape", num_heads=4, head_dim=16, grid=(8, 12))
    assert isinstance(s, Ape) and s.kind == "absolute"
    assert s.pos_embed.shape == (1, 96, 64)
    assert [n for n, _ in s.named_parameters()] == ["pos_embed"]
    assert s.no_weight_decay_keys == ("pos_embed",)
    std = s.pos_embed.detach().std().item()
    assert 0.017 < std < 0.023, std


@pytest.mark.parametrize("prefix", [0, 1])
def test_ape_adds_on_its_grid_and_grads(prefix):
    torch.manual_seed(2)
    grid = Grid(3, 5)
    s = make("ape", grid=grid)
    x = torch.randn(2, prefix + grid.n, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x)
    y = s.add_to_tokens(x, grid, prefix)
    torch.testing.assert_close(y, ref_add(x, s.pos_embed[0], prefix), rtol=0, atol=0)
    gx, gp = torch.autograd.grad((y * g).sum(), (x, s.pos_embed))
    torch.testing.assert_close(gx, g)
    torch.testing.assert_close(gp, g[:, prefix:].sum(0, keepdim=True))


@pytest.mark.parametrize("new", [Grid(6, 7), Grid(2, 3), Grid(4, 4)])
def test_ape_resamples_to_another_grid(new):
    torch.manual_seed(3)
    s = make("ape", grid=(4, 4))
    pe = s.embed(new)
    assert pe.shape == (1, new.n, 16)
    ref = resample_abs_pos_embed(s.pos_embed.detach(), list(new), old_size=[4, 4], num_prefix_tokens=0)
    torch.testing.assert_close(pe.detach(), ref, rtol=1e-6, atol=1e-6)
    if new == Grid(4, 4):
        assert pe is s.pos_embed
    x = torch.randn(2, 1 + new.n, 16, dtype=torch.float64)
    y = s.add_to_tokens(x, new, 1)
    assert y.shape == x.shape and torch.equal(y[:, :1], x[:, :1])
    torch.testing.assert_close(y[:, 1:], x[:, 1:] + pe)
    (gp,) = torch.autograd.grad(y.sum(), s.pos_embed)
    assert gp.abs().sum() > 0


def test_ape_resample_non_square_and_constant():
    """Bicubic resampling of a constant (per channel) table is that constant on any grid."""
    pe = torch.ones(1, 12, 3, dtype=torch.float64) * torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    out = resample_pos_embed(pe, Grid(3, 4), Grid(5, 7))
    torch.testing.assert_close(out, torch.ones(1, 35, 3, dtype=torch.float64) * pe[:, :1])
    with pytest.raises(ValueError, match="grid"):
        resample_pos_embed(pe, Grid(4, 4), Grid(5, 7))


NAFLEX_OPTIONS = [  # timm NaFlexVit's pretrained settings: the default, par_gap, siglip, C-RADIO v3 base, C-RADIO v4
    {},
    {"ar_preserving": True},
    {"interp_mode": "bilinear"},
    {"interp_mode": "bilinear", "ar_preserving": True, "antialias": False, "align_corners": True},
    {"interp_mode": "bilinear", "ar_preserving": True, "antialias": False},
]


@pytest.mark.parametrize("opts", NAFLEX_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_ape_options_equal_timm_naflexvit(opts):
    """The resampling options against timm's own code (NaFlexEmbeds' learned embedding, pos_embed_* of the same
    names): on image grids larger, smaller, of other aspect ratios and its own, and on a NaFlex batch."""
    from timm.models.naflexvit import NaFlexEmbeds

    torch.manual_seed(7)
    s = make("ape", grid=(9, 9), table_grid=(6, 6), **opts).float()
    theirs = {f"pos_embed_{k}": v for k, v in opts.items()}
    t = NaFlexEmbeds(patch_size=2, embed_dim=16, class_token=False, pos_embed_grid_size=(6, 6), proj_type="linear",
                     **theirs)  # fmt: skip
    with torch.no_grad():
        t.pos_embed.copy_(s.pos_embed.view(1, 6, 6, 16))
        t.proj.weight.zero_()
        t.proj.bias.zero_()
    for grid in (Grid(6, 6), Grid(9, 9), Grid(3, 8), Grid(10, 4), Grid(2, 2), Grid(6, 11)):
        out, _ = t(torch.zeros(1, 3, 2 * grid.h, 2 * grid.w))
        torch.testing.assert_close(s.embed(grid), out, rtol=0, atol=1e-6, msg=str(grid))
    rc = torch.tensor([(r, c) for r in range(3) for c in range(8)])
    out, _ = t(torch.zeros(1, 24, 12), patch_coord=rc[None])
    torch.testing.assert_close(s.embed(Grid(3, 8)), out, rtol=0, atol=1e-6)


def test_ape_ar_preserving_is_the_square_cut():
    """With ar_preserving the table on an H x W grid is the top-left of its resample to the square of the longer side
    (each row and column on one scale): equal to the plain resample to that square, cut; not to the plain H x W one."""
    torch.manual_seed(8)
    s = make("ape", grid=(4, 4), ar_preserving=True)
    square = resample_pos_embed(s.pos_embed.detach(), Grid(4, 4), Grid(7, 7)).view(7, 7, -1)
    torch.testing.assert_close(s.embed(Grid(3, 7)).detach().view(3, 7, -1), square[:3], rtol=0, atol=0)
    torch.testing.assert_close(s.embed(Grid(7, 2)).detach().view(7, 2, -1), square[:, :2], rtol=0, atol=0)
    plain = resample_pos_embed(s.pos_embed.detach(), Grid(4, 4), Grid(3, 7))
    assert (s.embed(Grid(3, 7)) - plain).abs().max() > 1e-3


def test_ape_table_grid_options_and_errors():
    s = build_pos("ape", num_heads=2, head_dim=8, grid=(24, 24), table_grid=(16, 16), interp_mode="bilinear")
    assert s.pos_embed.shape == (1, 256, 16) and s.embed(Grid(24, 24)).shape == (1, 576, 16)
    assert "table_grid=16x16" in repr(s) and "interp_mode='bilinear'" in repr(s) and "antialias" not in repr(s)
    assert not s.size_branches
    assert build_pos("ape", num_heads=2, head_dim=8, grid=(4, 6), ar_preserving=True).size_branches
    with pytest.raises(ValueError, match="interp_mode='nearest' is not one of"):
        build_pos("ape", num_heads=2, head_dim=8, grid=(4, 4), interp_mode="nearest")
    with pytest.raises(ValueError, match="table_grid is for image grids"):
        build_pos("ape", num_heads=2, head_dim=8, grid=(2, 4, 4), table_grid=(4, 4))


def test_ape_state_dict_load_at_another_grid_resizes_and_warns():
    torch.manual_seed(4)
    src = make("ape", grid=(4, 4))
    dst = make("ape", grid=(6, 6))
    with pytest.warns(UserWarning, match="resampled absolute position embedding"):
        dst.load_state_dict(src.state_dict())
    ref = resample_abs_pos_embed(src.pos_embed.detach(), [6, 6], old_size=[4, 4], num_prefix_tokens=0)
    torch.testing.assert_close(dst.pos_embed.detach(), ref, rtol=1e-6, atol=1e-6)
    # warned once: the same load again is silent
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dst.load_state_dict(src.state_dict())
    # same grid: exact copy, no resampling
    same = make("ape", grid=(4, 4))
    same.load_state_dict(src.state_dict())
    assert torch.equal(same.pos_embed, src.pos_embed)


def test_ape_state_dict_load_non_square_and_nested():
    torch.manual_seed(5)
    src = make("ape", grid=(3, 5))
    # inside a model (prefix in the key); target has the same 3:5 aspect ratio
    model = torch.nn.Module()
    model.pos = make("ape", grid=(6, 10))
    with pytest.warns(UserWarning, match="3x5 to 6x10"):
        model.load_state_dict({"pos.pos_embed": src.pos_embed.detach().clone()})
    ref = resample_pos_embed(src.pos_embed.detach(), Grid(3, 5), Grid(6, 10))
    torch.testing.assert_close(model.pos.pos_embed.detach(), ref)
    # an ambiguous stored length (15 positions into a 4x4 module: not square, not 1:1) is refused
    with pytest.raises(ValueError, match="cannot tell the grid"):
        make("ape", grid=(4, 4)).load_state_dict(src.state_dict())


def test_infer_grid():
    assert infer_grid(16, Grid(8, 8)) == Grid(4, 4)
    assert infer_grid(60, Grid(3, 5)) == Grid(6, 10)
    assert infer_grid(16, Grid(3, 5)) == Grid(4, 4)
    assert infer_grid(12, Grid(6, 8)) == Grid(3, 4)
    with pytest.raises(ValueError):
        infer_grid(15, Grid(4, 4))


# ------------------------------------------------------------------------------ absolute != relative
@pytest.mark.parametrize("name", ["ape", "sincos2d"])
@pytest.mark.parametrize("grid", GRIDS)
def test_absolute_schemes_are_not_translation_invariant(name, grid):
    """The same token at every position: after the embedding, logits depend on absolute position."""
    torch.manual_seed(6)
    s = make(name, grid=grid)
    x = torch.randn(1, 1, 16, dtype=torch.float64).expand(1, grid.n, 16)
    wq, wk = torch.randn(16, 16, dtype=torch.float64), torch.randn(16, 16, dtype=torch.float64)
    with torch.no_grad():
        y = s.add_to_tokens(x, grid, 0)
    logits = (y[0] @ wq) @ (y[0] @ wk).T
    assert offset_spread(logits, grid) > 1e-3
    # control: without the embedding the logits are constant, hence trivially offset-only
    plain = (x[0] @ wq) @ (x[0] @ wk).T
    assert offset_spread(plain, grid) < 1e-12


@pytest.mark.parametrize("name", ["ape", "sincos2d"])
def test_absolute_schemes_are_refused_inside_attention(name):
    with pytest.raises(ValueError, match=f"absolute position scheme.*abs_pos='{name}'"):
        Attention(16, num_heads=2, pos=name, grid=(3, 3), num_prefix_tokens=1)
    assert name in list_pos("absolute") and name not in list_pos("relative")


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("name", ["ape", "sincos2d"])
def test_config_builds(name):
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert cfg["name"] == name
    s = build_pos(cfg, num_heads=2, head_dim=8, grid=(3, 5))
    assert type(s) is get_pos_class(name)
    for k, v in cfg.items():
        if k != "name":
            assert getattr(s, k) == v
