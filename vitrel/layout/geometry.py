"""Grid and offset geometry shared by the position schemes and the attention kernels.

Token layout everywhere: ``num_prefix_tokens`` class/register tokens first, then the ``H x W`` patch
tokens in raster order (a video's ``T x H x W`` tubelets t-major: ``index = (t * H + h) * W + w``,
:class:`Grid3`). One sign convention: the offset of query ``i`` to key ``j`` is ``d_ij = p_i - p_j``
(``dh_ij = row_i - row_j``, ``dw_ij = col_i - col_j``), as in Swin's relative index; index ``d + n - 1``
of an offset table's axis holds offset ``d``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Grid",
    "Grid3",
    "as_grid",
    "as_grid3",
    "grid_str",
    "patch_coords3",
    "rel_offsets3",
    "check_tokens",
    "patch_coords",
    "rel_offsets",
    "pad_prefix",
    "axis_offsets",
    "offset_grid",
    "offset_grid3",
    "expand_offset_table",
    "axis_factors",
    "axis_factors3",
]


class Grid(NamedTuple):
    """Height and width of a patch grid, in patches."""

    h: int
    w: int

    @property
    def n(self) -> int:
        return self.h * self.w


class Grid3(NamedTuple):
    """Frames, height and width of a video's grid of tubelets (``T x H x W``), t-major."""

    t: int
    h: int
    w: int

    @property
    def n(self) -> int:
        return self.t * self.h * self.w

    @property
    def space(self) -> Grid:
        """The grid of one frame."""
        return Grid(self.h, self.w)


def as_grid(grid: Any) -> Grid | Grid3:
    """``int`` (square), ``(h, w)``, ``(t, h, w)``, ``Grid`` or ``Grid3`` -> ``Grid`` / ``Grid3``, with a clear error
    otherwise."""
    if isinstance(grid, (Grid, Grid3)):
        return grid
    if isinstance(grid, int):
        g: Grid | Grid3 = Grid(grid, grid)
    else:
        try:
            sides = tuple(int(s) for s in grid)
        except (TypeError, ValueError):
            raise ValueError(f"grid must be an int, a pair (H, W) or a triple (T, H, W), got {grid!r}") from None
        if len(sides) not in (2, 3):
            raise ValueError(f"grid must be an int, a pair (H, W) or a triple (T, H, W), got {grid!r}")
        g = Grid(*sides) if len(sides) == 2 else Grid3(*sides)
    if min(g) < 1:
        raise ValueError(f"grid must have positive sides, got {tuple(g)}")
    return g


def as_grid3(grid: Any) -> Grid3:
    """:func:`as_grid`, an image grid ``(H, W)`` taken as one frame ``(1, H, W)``."""
    g = as_grid(grid)
    return g if isinstance(g, Grid3) else Grid3(1, g.h, g.w)


def grid_str(grid: Grid | Grid3) -> str:
    """``"14x14"``, ``"8x14x14"``."""
    return "x".join(str(s) for s in grid)


def check_tokens(n_tokens: int, grid: Grid | Grid3, num_prefix_tokens: int) -> None:
    """Raise if ``n_tokens`` is not ``num_prefix_tokens + grid.n``."""
    if n_tokens != num_prefix_tokens + grid.n:
        raise ValueError(
            f"grid {grid_str(grid)} with {num_prefix_tokens} prefix token(s) needs "
            f"{num_prefix_tokens + grid.n} tokens, but the input has {n_tokens}"
        )


def patch_coords(grid: Grid, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Row and column index of each patch token in raster order, each ``[H*W]`` (long)."""
    p = torch.arange(grid.h * grid.w, device=device)  # (division, not repeat: exports at any symbolic size)
    r = p // grid.w
    return r, p - r * grid.w


def rel_offsets(grid: Grid, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Row and column offsets ``(dh, dw)`` with ``dh[i, j] = row_i - row_j``, each ``[HW, HW]``."""
    r, c = patch_coords(grid, device)
    return r[:, None] - r[None, :], c[:, None] - c[None, :]


def patch_coords3(grid: Grid3, device: torch.device | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Frame, row and column index of each tubelet token, t-major, each ``[T*H*W]`` (long)."""
    p = torch.arange(grid.n, device=device)
    hw = grid.h * grid.w
    t = p // hw
    r = (p - t * hw) // grid.w
    return t, r, p - t * hw - r * grid.w


def rel_offsets3(grid: Grid3, device: torch.device | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Offsets ``(dt, dh, dw)`` with ``dt[i, j] = t_i - t_j``, each ``[THW, THW]``."""
    return tuple(a[:, None] - a[None, :] for a in patch_coords3(grid, device))


def pad_prefix(bias: Tensor, num_prefix_tokens: int) -> Tensor:
    """Zero-pad a ``[..., HW, HW]`` term with ``num_prefix_tokens`` leading rows and columns."""
    if num_prefix_tokens == 0:
        return bias
    p = num_prefix_tokens
    return F.pad(bias, (p, 0, p, 0))


def axis_offsets(n: int, device: torch.device | None = None) -> Tensor:
    """The offsets ``-(n-1) .. n-1`` along an axis of ``n`` patches (``[2n-1]``, long): index ``d + n - 1``
    of an offset table holds offset ``d``."""
    return torch.arange(-(n - 1), n, device=device)


def offset_grid(grid: Grid, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """``(dh, dw)`` over an offset table, each ``[2H-1, 2W-1]`` (long): ``dh[a, b] = a - (H - 1)``,
    ``dw[a, b] = b - (W - 1)``."""
    dh = axis_offsets(grid.h, device)[:, None].expand(-1, 2 * grid.w - 1)
    dw = axis_offsets(grid.w, device)[None, :].expand(2 * grid.h - 1, -1)
    return dh, dw


def offset_grid3(grid: Grid3, device: torch.device | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dt, dh, dw)`` over a video's offset table, each ``[2T-1, 2H-1, 2W-1]`` (long)."""
    dt, dh, dw = (axis_offsets(n, device) for n in grid)
    shape = (2 * grid.t - 1, 2 * grid.h - 1, 2 * grid.w - 1)
    return dt[:, None, None].expand(shape), dh[None, :, None].expand(shape), dw[None, None, :].expand(shape)


def expand_offset_table(table: Tensor, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> Tensor:
    """``T [heads, 2H-1, 2W-1]`` -> the bias ``[heads, N, N]``, ``T[h, dh_ij + H - 1, dw_ij + W - 1]`` for
    patch pairs, 0 for pairs with a prefix token; on a video grid ``T [heads, 2T-1, 2H-1, 2W-1]`` read at
    ``(dt_ij + T - 1, dh_ij + H - 1, dw_ij + W - 1)``."""
    if isinstance(grid, Grid3):
        dt, dh, dw = rel_offsets3(grid, table.device)
        return pad_prefix(table[:, dt + grid.t - 1, dh + grid.h - 1, dw + grid.w - 1], num_prefix_tokens)
    dh, dw = rel_offsets(grid, table.device)
    return pad_prefix(table[:, dh + grid.h - 1, dw + grid.w - 1], num_prefix_tokens)


def _onehot_factors(
    blocks: tuple[Tensor, ...], coords: tuple[Tensor, ...], num_prefix_tokens: int, head_dim: int
) -> tuple[Tensor, Tensor]:
    """Factors of ``sum_a blocks[a][:, x_i, x_j]`` over axes ``a`` (``blocks[a] [heads, n_a, n_a]``, ``x = coords[a]``
    the tokens' coordinate on that axis): ``u_i = [blocks[a][x_i, :]]_a``, ``w_j = [onehot(x_j)]_a``."""
    heads, device = blocks[0].shape[0], blocks[0].device
    u = torch.cat([b[:, x, :] for b, x in zip(blocks, coords)], dim=-1)  # [heads, n, sum n_a]
    w = torch.cat([x[:, None] == torch.arange(b.shape[-1], device=device) for b, x in zip(blocks, coords)], dim=-1)
    pad = -(head_dim + u.shape[-1]) % 8
    u = F.pad(u, (0, pad, num_prefix_tokens, 0))
    w = F.pad(w.to(u.dtype), (0, pad, num_prefix_tokens, 0)).expand(heads, -1, -1)
    return u, w


def axis_factors(bh: Tensor, bw: Tensor, grid: Grid, num_prefix_tokens: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Factors of ``bh[:, row_i, row_j] + bw[:, col_i, col_j]`` (``bh [heads, H, H]``, ``bw [heads, W, W]``):
    ``u_i = [bh[row_i, :], bw[col_i, :]]``, ``w_j = [onehot(row_j), onehot(col_j)]``, rank ``H + W`` padded
    with zeros so that ``head_dim + r`` is a multiple of 8 (what fused kernels want); prefix tokens get zeros."""
    return _onehot_factors((bh, bw), patch_coords(grid, bh.device), num_prefix_tokens, head_dim)


def axis_factors3(
    bt: Tensor, bh: Tensor, bw: Tensor, grid: Grid3, num_prefix_tokens: int, head_dim: int
) -> tuple[Tensor, Tensor]:
    """:func:`axis_factors` on a video grid: ``bt[:, t_i, t_j] + bh[:, row_i, row_j] + bw[:, col_i, col_j]``, rank
    ``T + H + W`` padded the same way."""
    return _onehot_factors((bt, bh, bw), patch_coords3(grid, bh.device), num_prefix_tokens, head_dim)
