"""Absolute schemes on video grids: sincos3d and the separable learned ``ape``, references from the equations and,
for sincos3d, torchmultimodal's ``get_3d_sin_cos_embeddings`` re-written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from vitrel.layers.attention import Attention
from vitrel.layout.geometry import Grid, Grid3
from vitrel.pos import build_pos, get_pos_class, list_pos
from vitrel.pos import tables as pos_tables
from vitrel.pos.schemes.absolute import Ape, Sincos3d, resample_pos_embed, resample_time_embed

CONF = Path(__file__).resolve().parents[2] / "conf" / "pos"
C = 16


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(pos_tables, "_WARNED", set())


def make(name: str, grid, embed_dim: int = C, **kw):
    return build_pos(name, num_heads=2, head_dim=embed_dim // 2, grid=grid, embed_dim=embed_dim, **kw).double()


def txy(i: int, g: Grid3) -> tuple[int, int, int]:
    t, rem = divmod(i, g.h * g.w)
    return (t, *divmod(rem, g.w))


def ref_add(x: torch.Tensor, pe: torch.Tensor, prefix: int) -> torch.Tensor:
    rows = [x[:, i] if i < prefix else x[:, i] + pe[i - prefix] for i in range(x.shape[1])]
    return torch.stack(rows, dim=1)


# ------------------------------------------------------------------------------ sincos3d
def ref_sincos3d(g: Grid3, c: int, temperature: float = 10000.0, blocks=None) -> torch.Tensor:
    """``[T*H*W, C]`` from the equation, one token and one channel at a time: blocks of ``(t, w, h)`` of ``blocks``
    channels (default ``(C/4, 3C/8, 3C/8)``), each ``[sin(x omega_k), cos(x omega_k)]``, ``omega_k = T^(-k/(n/2))``."""
    blocks = blocks or (c // 4, 3 * c // 8, 3 * c // 8)
    out = torch.zeros(g.n, c, dtype=torch.float64)
    for i in range(g.n):
        t, r, col = txy(i, g)
        start = 0
        for x, n in zip((t, col, r), blocks):
            for k in range(n // 2):
                om = temperature ** (-k / (n / 2))
                out[i, start + k] = math.sin(x * om)
                out[i, start + n // 2 + k] = math.cos(x * om)
            start += n
    return out


def torchmultimodal_3d(embed_dim: int, temporal_size: int, spatial_size) -> torch.Tensor:
    """torchmultimodal's ``get_3d_sin_cos_embeddings`` (models/masked_auto_encoder/position_embeddings.py), re-written,
    in float64, without its class-token row."""

    def one_d(dim, positions):
        omega = 1 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
        out = torch.einsum("i,j->ij", positions.double(), omega)
        return torch.cat([out.sin(), out.cos()], dim=1)

    spatial, temporal = embed_dim // 4 * 3, embed_dim // 4
    h, w = spatial_size
    grid = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy"), dim=0).reshape(2, 1, h, w)
    emb_spatial = torch.cat([one_d(spatial // 2, grid[0].flatten()), one_d(spatial // 2, grid[1].flatten())], dim=1)
    emb_temporal = one_d(temporal, torch.arange(temporal_size))
    emb_temporal = emb_temporal[:, None, :].repeat_interleave(h * w, dim=1)
    emb_spatial = emb_spatial[None].repeat_interleave(temporal_size, dim=0)
    return torch.cat([emb_temporal, emb_spatial], dim=-1).reshape(-1, embed_dim)


@pytest.mark.parametrize("grid", [Grid3(2, 3, 4), Grid3(3, 2, 2)])
@pytest.mark.parametrize("prefix", [0, 1])
def test_sincos3d_matches_equations_and_torchmultimodal(grid, prefix):
    s = make("sincos3d", grid=(2, 3, 4))
    assert isinstance(s, Sincos3d) and list(s.parameters()) == [] and s.state_dict() == {}
    ref = ref_sincos3d(grid, C)
    torch.testing.assert_close(ref, torchmultimodal_3d(C, grid.t, (grid.h, grid.w)), rtol=1e-12, atol=1e-12)
    x = torch.randn(2, prefix + grid.n, C, dtype=torch.float64)
    torch.testing.assert_close(s.add_to_tokens(x, grid, prefix), ref_add(x, ref, prefix), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.embed(grid, dtype=torch.float64)[0], ref, rtol=1e-12, atol=1e-12)


def test_sincos3d_image_grid_is_one_frame_and_errors():
    s = make("sincos3d", grid=(3, 4))
    assert s.grid == Grid3(1, 3, 4)
    x = torch.randn(1, 13, C, dtype=torch.float64)
    torch.testing.assert_close(s.add_to_tokens(x, (3, 4), 1), s.add_to_tokens(x, (1, 3, 4), 1), rtol=0, atol=0)
    torch.testing.assert_close(s.add_to_tokens(x, (3, 4), 1), ref_add(x, ref_sincos3d(Grid3(1, 3, 4), C), 1))
    with pytest.raises(ValueError, match="sincos3d needs embed_dim divisible by 2"):
        make("sincos3d", grid=(2, 2, 2), embed_dim=7)
    with pytest.raises(ValueError, match="sincos3d needs an even embed_dim of at least 6"):
        make("sincos3d", grid=(2, 2, 2), embed_dim=4)
    with pytest.raises(ValueError, match="temperature"):
        make("sincos3d", grid=(2, 2, 2), temperature=0.0)
    with pytest.raises(ValueError, match="tokens"):
        s.add_to_tokens(x, (2, 3, 4), 1)


@pytest.mark.parametrize(("c", "blocks"), [(24, (8, 8, 8)), (8, (4, 2, 2)), (6, (2, 2, 2)), (48, (12, 18, 18))])
def test_sincos3d_split_when_channels_are_not_a_multiple_of_16(c, blocks):
    """torchmultimodal's split needs C % 16 == 0; otherwise rows and columns get 2 floor(3C/16) channels, time the
    rest."""
    g = Grid3(2, 2, 3)
    s = make("sincos3d", grid=g, embed_dim=c)
    torch.testing.assert_close(s.embed(g, dtype=torch.float64)[0], ref_sincos3d(g, c, blocks=blocks))


# ------------------------------------------------------------------------------ ape on video grids
def test_ape_video_tables_and_image_ape_unchanged():
    torch.manual_seed(0)
    v = make("ape", grid=(2, 3, 4))
    assert isinstance(v, Ape) and v.video and v.grid == Grid3(2, 3, 4)
    assert {n: tuple(p.shape) for n, p in v.named_parameters()} == {
        "pos_embed": (1, 12, C),
        "pos_embed_temporal": (1, 2, C),
    }
    for p in v.parameters():  # trunc-normal, std 0.02
        assert 0.01 < p.std() < 0.03
    img = make("ape", grid=(3, 4))
    assert not img.video and img.grid == Grid(3, 4) and [n for n, _ in img.named_parameters()] == ["pos_embed"]
    with pytest.raises(ValueError, match="ape built on the image grid 3x4 has no time"):
        img.add_to_tokens(torch.zeros(1, 24, C, dtype=torch.float64), (2, 3, 4))


@pytest.mark.parametrize("prefix", [0, 1])
def test_ape_video_adds_separable_table_and_grads(prefix):
    """On its grid: token (t, h, w) gets ``pos_embed[h W + w] + pos_embed_temporal[t]``; both tables get the
    gradient of the tokens that read them."""
    torch.manual_seed(1)
    g = Grid3(2, 3, 4)
    v = make("ape", grid=g)
    x = torch.randn(2, prefix + g.n, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn_like(x)
    out = v.add_to_tokens(x, g, prefix)
    pe = torch.stack(
        [v.pos_embed[0, r * g.w + c] + v.pos_embed_temporal[0, t] for t, r, c in map(lambda i: txy(i, g), range(g.n))]
    )
    ref = ref_add(x, pe, prefix)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    params = [x, v.pos_embed, v.pos_embed_temporal]
    for a, b in zip(torch.autograd.grad((out * w).sum(), params), torch.autograd.grad((ref * w).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[:, :prefix], x[:, :prefix])


def ref_linear(pe: torch.Tensor, frames: int) -> torch.Tensor:
    """Linear resampling, ``align_corners=False``, from its definition: output frame ``i`` reads source position
    ``(i + 0.5) T / T' - 0.5`` clamped to ``[0, T - 1]``, between its two neighbours."""
    t = pe.shape[1]
    rows = []
    for i in range(frames):
        src = min(max((i + 0.5) * t / frames - 0.5, 0.0), t - 1)
        lo = int(math.floor(src))
        hi = min(lo + 1, t - 1)
        lam = src - lo
        rows.append((1 - lam) * pe[0, lo] + lam * pe[0, hi])
    return torch.stack(rows)[None]


@pytest.mark.parametrize("new", [Grid3(4, 3, 4), Grid3(3, 5, 6), Grid3(1, 2, 2)])
def test_ape_video_resamples_to_another_video_grid(new):
    """Space as the image ``ape`` (bicubic), time linearly: the separable resample of the whole table."""
    torch.manual_seed(2)
    v = make("ape", grid=(2, 3, 4))
    pe = v.embed(new)[0]
    space = resample_pos_embed(v.pos_embed, Grid(3, 4), new.space)[0]
    time = ref_linear(v.pos_embed_temporal, new.t)[0]
    for i in range(new.n):
        t, r, c = txy(i, new)
        torch.testing.assert_close(pe[i], space[r * new.w + c] + time[t], rtol=1e-12, atol=1e-12)
    # a table constant in time stays so; an image grid is one frame
    const = torch.ones(1, 2, C, dtype=torch.float64)
    torch.testing.assert_close(resample_time_embed(const, 5), torch.ones(1, 5, C, dtype=torch.float64))
    torch.testing.assert_close(v.embed((3, 4)), v.embed((1, 3, 4)), rtol=0, atol=0)


def test_ape_video_state_dict_loads_resampling_time_and_space():
    torch.manual_seed(3)
    src = make("ape", grid=(2, 3, 4))
    dst = make("ape", grid=(4, 6, 8))
    with pytest.warns(UserWarning, match="resampled"):
        dst.load_state_dict(src.state_dict())
    torch.testing.assert_close(dst.pos_embed_temporal.detach(), ref_linear(src.pos_embed_temporal.detach(), 4))
    ref = resample_pos_embed(src.pos_embed.detach(), Grid(3, 4), Grid(6, 8))
    torch.testing.assert_close(dst.pos_embed.detach(), ref)
    # an image checkpoint's table is the spatial table (the temporal one is then the caller's, e.g. zeros)
    img = make("ape", grid=(3, 4))
    video = make("ape", grid=(2, 3, 4))
    missing = video.load_state_dict(img.state_dict(), strict=False).missing_keys
    assert missing == ["pos_embed_temporal"] and torch.equal(video.pos_embed, img.pos_embed)


# ------------------------------------------------------------------------------ kinds, configs
@pytest.mark.parametrize("name", ["ape", "sincos3d"])
def test_video_absolute_schemes_are_refused_inside_attention(name):
    with pytest.raises(ValueError, match=f"absolute position scheme.*abs_pos='{name}'"):
        Attention(16, num_heads=2, pos=name, grid=(2, 3, 3), num_prefix_tokens=1)
    assert name in list_pos("absolute")


def test_image_schemes_name_the_video_absolute_schemes():
    with pytest.raises(ValueError, match=r"sincos2d.*video grid 2x3x3.*ape.*sincos3d"):
        make("sincos2d", grid=(2, 3, 3))


def test_config_builds():
    cfg = yaml.safe_load((CONF / "sincos3d.yaml").read_text())
    assert cfg["name"] == "sincos3d"
    s = build_pos(cfg, num_heads=2, head_dim=8, grid=(2, 3, 5))
    assert type(s) is get_pos_class("sincos3d") and s.temperature == cfg["temperature"]
