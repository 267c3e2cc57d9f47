"""Learned 3-D relative bias tables for video grids ``(T, H, W)``: full (Video Swin) and factored.

Tokens: the prefix tokens, then the ``T x H x W`` tubelets t-major (``index = (t * H + h) * W + w``); offsets query
minus key, ``dt_ij = t_i - t_j`` (and ``dh``, ``dw`` as in 2-D). Prefix tokens get no bias.

``rel3d_full`` (Liu et al., Video Swin Transformer, 2022: the relative position bias of ``WindowAttention3D`` in
SwinTransformer/Video-Swin-Transformer ``mmaction/models/backbones/swin_transformer.py``, whose flat table
``[(2T-1)(2H-1)(2W-1), heads]`` is this one reshaped, dt-major), one table ``B in R^{(2T-1) x (2H-1) x (2W-1)}`` per
head, stored as ``attn.pos.table`` of shape ``[2T-1, 2H-1, (2W-1) heads]`` (``table_4d()``: ``[2T-1, 2H-1, 2W-1,
heads]``; 3-D, so that ``model.to(memory_format=torch.channels_last_3d)`` leaves it; weights stored 4-D, the earlier
shape, load as they are)::

    A_ij = q_i . k_j / sqrt(d) + B_h[dt_ij + T - 1, dh_ij + H - 1, dw_ij + W - 1]

``rel3d_factored``: one table per axis, ``[2T-1, heads]``, ``[2H-1, heads]``, ``[2W-1, heads]``::

    A_ij = q_i . k_j / sqrt(d) + b^(t)_h[dt_ij] + b^(h)_h[dh_ij] + b^(w)_h[dw_ij]

Option ``extend`` (``grow`` | ``clip`` | ``interpolate``) as the 2-D tables' (``vitrel/pos/tables.py``): a larger call
grid clamps offsets to the table's edge under ``grow`` / ``clip``; ``interpolate`` resizes the table to the call grid
(bicubic per axis, tricubic for the full table); a checkpoint loaded at another size is resized by the same rule.
An image grid ``(H, W)`` is one frame, ``(1, H, W)``: then both are their 2-D counterparts read at ``dt = 0``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, Grid3, as_grid3, axis_factors3, pad_prefix
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos
from vitrel.pos.tables import ResizeOnLoad, check_init_std, cover_grid, cover_grid3, offset_index, take_offsets

__all__ = ["Rel3dFull", "Rel3dFactored", "full_bias3d", "factored_bias3d"]


def _axis_index(n: int, table_len: int, device: torch.device) -> Tensor:
    """``[n, n]`` index into a ``table_len`` offset axis (offsets clamped to its edge)."""
    return offset_index(n, (table_len - 1) // 2, device)


def full_bias3d(table: Tensor, grid: Grid3) -> Tensor:
    """``[2Tt-1, 2Ht-1, 2Wt-1, heads]`` table -> ``[heads, THW, THW]`` bias for ``grid`` (offsets clamped)."""
    tt, th, tw, heads = table.shape
    it, ih, iw = (_axis_index(n, s, table.device) for n, s in zip(grid, (tt, th, tw)))
    flat = (it[:, None, None, :, None, None] * th + ih[None, :, None, None, :, None]) * tw
    flat = (flat + iw[None, None, :, None, None, :]).reshape(-1)  # [(T H W) (T H W)]
    return table.permute(3, 0, 1, 2).reshape(heads, -1).index_select(1, flat).view(heads, grid.n, grid.n)


def _axis_biases(tables: tuple[Tensor, Tensor, Tensor], grid: Grid3) -> tuple[Tensor, ...]:
    """``b_t[:, t_i, t_j]``, ``b_h[:, row_i, row_j]``, ``b_w[:, col_i, col_j]``, each ``[heads, n, n]``."""
    return tuple(t.t()[:, _axis_index(n, t.shape[0], t.device)] for t, n in zip(tables, grid))


def factored_bias3d(table_t: Tensor, table_h: Tensor, table_w: Tensor, grid: Grid3) -> Tensor:
    """``[2Tt-1, heads]``, ``[2Ht-1, heads]``, ``[2Wt-1, heads]`` -> ``b_t[dt] + b_h[dh] + b_w[dw]``,
    ``[heads, THW, THW]``."""
    bt, bh, bw = _axis_biases((table_t, table_h, table_w), grid)
    b = (
        bt[:, :, None, None, :, None, None] + bh[:, None, :, None, None, :, None] + bw[:, None, None, :, None, None, :]
    )  # [heads, T, H, W, T, H, W]
    return b.reshape(table_t.shape[1], grid.n, grid.n)


class _Bias3d(ResizeOnLoad, PositionScheme):
    family = "learned bias"
    has_bias = True
    _covers_grid = True
    has_offset_table = True
    grid_dims = 3

    def _table(self, *shape: int, init_std: float, merge: bool = False) -> nn.Parameter:
        """``[*shape, heads]`` drawn from ``N(0, init_std)``, truncated; ``merge``: its last two axes as one."""
        t = nn.Parameter(
            torch.zeros(*shape[:-1], shape[-1] * self.num_heads) if merge else torch.zeros(*shape, self.num_heads)
        )
        nn.init.trunc_normal_(t, std=init_std)
        return t


@register_pos("rel3d_full")
class Rel3dFull(_Bias3d):
    """Video Swin's learned ``(2T-1) x (2H-1) x (2W-1)`` bias table per head."""

    _rel_tables = {"table": "3d"}
    no_weight_decay_keys = ("table",)

    def __init__(self, *, init_std: float = 0.02, **kw) -> None:
        super().__init__(**kw)
        check_init_std(self.name, init_std)
        g = self.grid
        self.table = self._table(2 * g.t - 1, 2 * g.h - 1, 2 * g.w - 1, init_std=init_std, merge=True)

    def table_4d(self) -> Tensor:
        """The stored table ``[2T-1, 2H-1, (2W-1) heads]`` as ``[2T-1, 2H-1, 2W-1, heads]``."""
        return self.table.reshape(*self.table.shape[:2], -1, self.num_heads)

    def table_for(self, grid: Grid | Grid3) -> Tensor:
        """The table ``[2T-1, 2H-1, 2W-1, heads]`` a call on ``grid`` reads (resized by ``extend: interpolate`` when
        the grid outgrows it)."""
        return cover_grid3(self.table_4d(), as_grid3(grid), self.extend)

    def bias(self, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> Tensor:
        g = as_grid3(grid)
        return pad_prefix(full_bias3d(self.table_for(g), g), num_prefix_tokens)

    def offset_table(self, grid: Grid | Grid3) -> Tensor:
        """``[heads, 2T-1, 2H-1, 2W-1]``: the bias by offset (flex)."""
        g = as_grid3(grid)
        t = self.table_for(g).permute(3, 0, 1, 2)
        for dim, (n, s) in enumerate(zip(g, t.shape[1:]), start=1):
            t = take_offsets(t, dim, n, (s - 1) // 2)
        return t


@register_pos("rel3d_factored")
class Rel3dFactored(_Bias3d):
    """Factored 3-D bias ``b_t[dt] + b_h[dh] + b_w[dw]`` per head: ``(2T-1) + (2H-1) + (2W-1)`` parameters a head."""

    has_bias_factors = True
    _rel_tables = {"table_t": "1d", "table_h": "1d", "table_w": "1d"}
    no_weight_decay_keys = ("table_t", "table_h", "table_w")

    def __init__(self, *, init_std: float = 0.02, **kw) -> None:
        super().__init__(**kw)
        check_init_std(self.name, init_std)
        g = self.grid
        self.table_t = self._table(2 * g.t - 1, init_std=init_std)
        self.table_h = self._table(2 * g.h - 1, init_std=init_std)
        self.table_w = self._table(2 * g.w - 1, init_std=init_std)

    def tables_for(self, grid: Grid3) -> tuple[Tensor, Tensor, Tensor]:
        """``(table_t, table_h, table_w)`` a call on ``grid`` reads (resized by ``extend: interpolate`` when the grid
        outgrows them)."""
        tables = (self.table_t, self.table_h, self.table_w)
        return tuple(cover_grid(t[:, None, :], (n, 1), self.extend)[:, 0, :] for t, n in zip(tables, grid))

    def bias(self, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> Tensor:
        g = as_grid3(grid)
        return pad_prefix(factored_bias3d(*self.tables_for(g), g), num_prefix_tokens)

    def offset_table(self, grid: Grid | Grid3) -> Tensor:
        """``[heads, 2T-1, 2H-1, 2W-1]``: ``b_t[dt] + b_h[dh] + b_w[dw]`` by offset (flex)."""
        g = as_grid3(grid)
        bt, bh, bw = (take_offsets(t.t(), 1, n, (t.shape[0] - 1) // 2) for t, n in zip(self.tables_for(g), g))
        return bt[:, :, None, None] + bh[:, None, :, None] + bw[:, None, None, :]

    def bias_factors(self, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> tuple[Tensor, Tensor]:
        """``b_t[dt] + b_h[dh] + b_w[dw]`` as ``u_i . w_j`` (rank ``T + H + W``, see ``axis_factors3``)."""
        g = as_grid3(grid)
        return axis_factors3(*_axis_biases(self.tables_for(g), g), g, num_prefix_tokens, self.head_dim)
