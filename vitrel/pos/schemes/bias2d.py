"""Learned 2-D relative bias tables: full (Swin) and factored.

``rel2d_full`` (Liu et al., Swin, 2021), one table ``B in R^{(2H-1) x (2W-1)}`` per head::

    A_ij = q_i . k_j / sqrt(d) + B_h[dh_ij + H - 1, dw_ij + W - 1],   dh_ij = row_i - row_j

``rel2d_factored`` (b_h[dh] + b_w[dw], as in the decomposed biases of MViTv2/SAM)::

    A_ij = q_i . k_j / sqrt(d) + b^(h)_h[dh_ij] + b^(w)_h[dw_ij]

Option ``extend`` (``grow`` | ``clip`` | ``interpolate``, see ``tables.py``): how a table meets a
grid it was not built for. ``grow`` (default) and ``clip`` clamp the offsets of a larger call grid to
the table's edge; ``interpolate`` resizes the table bicubically to the call grid's extent (Swin V1);
loading a checkpoint at a new size applies the same rule (``grow`` / ``clip``: the offsets it had keep their
values, new ones take the edge value).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, axis_factors, pad_prefix
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos
from vitrel.pos.tables import ResizeOnLoad, check_init_std, cover_grid, offset_index, take_offsets

__all__ = ["FullTable", "Rel2dFull", "Rel2dFactored", "full_bias", "full_bias_flat", "factored_bias"]


def full_bias(table: Tensor, grid: Grid) -> Tensor:
    """``[2Ht-1, 2Wt-1, heads]`` table -> ``[heads, HW, HW]`` bias for ``grid`` (offsets clamped)."""
    th, tw, heads = table.shape
    return full_bias_flat(table.permute(2, 0, 1).reshape(heads, th * tw), th, tw, grid)


def full_bias_flat(t: Tensor, th: int, tw: int, grid: Grid) -> Tensor:
    """:func:`full_bias` of a table given flat, ``[heads, th * tw]`` (row-major ``[th, tw]``)."""
    ih = offset_index(grid.h, (th - 1) // 2, t.device)  # [H, H]
    iw = offset_index(grid.w, (tw - 1) // 2, t.device)  # [W, W]
    flat = (ih[:, None, :, None] * tw + iw[None, :, None, :]).reshape(-1)  # [(H W) (H W)]
    return t.index_select(1, flat).view(t.shape[0], grid.n, grid.n)


def factored_bias(table_h: Tensor, table_w: Tensor, grid: Grid) -> Tensor:
    """``[2Ht-1, heads]`` and ``[2Wt-1, heads]`` tables -> ``b_h[dh] + b_w[dw]``, ``[heads, HW, HW]``."""
    heads = table_h.shape[1]
    ih = offset_index(grid.h, (table_h.shape[0] - 1) // 2, table_h.device)
    iw = offset_index(grid.w, (table_w.shape[0] - 1) // 2, table_w.device)
    bh = table_h.t()[:, ih]  # [heads, H, H]
    bw = table_w.t()[:, iw]  # [heads, W, W]
    b = bh[:, :, None, :, None] + bw[:, None, :, None, :]  # [heads, H, W, H, W]
    return b.reshape(heads, grid.n, grid.n)


class FullTable(ResizeOnLoad, PositionScheme):
    """A learned ``(2H-1) x (2W-1)`` bias table per head, ``table [2H-1, 2W-1, heads]``, read at a call's grid by the
    option ``extend``: what ``rel2d_full`` and ``rel2d_beit`` share."""

    family = "learned bias"
    has_bias = True
    _covers_grid = True
    _rel_tables = {"table": "2d"}
    no_weight_decay_keys = ("table",)

    def __init__(self, *, init_std: float = 0.02, **kw) -> None:
        super().__init__(**kw)
        self.init_std = check_init_std(self.name, init_std)
        g = self.grid
        self.table = nn.Parameter(torch.zeros(2 * g.h - 1, 2 * g.w - 1, self.num_heads))
        nn.init.trunc_normal_(self.table, std=init_std)

    def table_for(self, grid: Grid) -> Tensor:
        """The table a call on ``grid`` reads (resized by ``extend: interpolate`` when the grid outgrows it)."""
        return cover_grid(self.table, grid, self.extend)


@register_pos("rel2d_full")
class Rel2dFull(FullTable):
    """Swin's learned ``(2H-1) x (2W-1)`` bias table per head."""

    has_offset_table = True

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        return pad_prefix(full_bias(self.table_for(grid), grid), num_prefix_tokens)

    def offset_table(self, grid: Grid) -> Tensor:
        table = self.table_for(grid)
        kh, kw = (table.shape[0] - 1) // 2, (table.shape[1] - 1) // 2
        return take_offsets(take_offsets(table.permute(2, 0, 1), 1, grid.h, kh), 2, grid.w, kw)


@register_pos("rel2d_factored")
class Rel2dFactored(ResizeOnLoad, PositionScheme):
    """Factored 2-D bias ``b_h[dh] + b_w[dw]`` per head: ``(2H-1) + (2W-1)`` parameters a head."""

    family = "learned bias"
    has_bias = True
    _covers_grid = True
    has_bias_factors = True
    _rel_tables = {"table_h": "1d", "table_w": "1d"}
    no_weight_decay_keys = ("table_h", "table_w")

    def __init__(self, *, init_std: float = 0.02, **kw) -> None:
        super().__init__(**kw)
        check_init_std(self.name, init_std)
        g = self.grid
        self.table_h = nn.Parameter(torch.zeros(2 * g.h - 1, self.num_heads))
        self.table_w = nn.Parameter(torch.zeros(2 * g.w - 1, self.num_heads))
        nn.init.trunc_normal_(self.table_h, std=init_std)
        nn.init.trunc_normal_(self.table_w, std=init_std)

    has_offset_table = True

    def tables_for(self, grid: Grid) -> tuple[Tensor, Tensor]:
        """``(table_h, table_w)`` a call on ``grid`` reads (resized by ``extend: interpolate`` when the grid
        outgrows them)."""
        th = cover_grid(self.table_h[:, None, :], (grid.h, 1), self.extend)[:, 0, :]
        tw = cover_grid(self.table_w[:, None, :], (grid.w, 1), self.extend)[:, 0, :]
        return th, tw

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        return pad_prefix(factored_bias(*self.tables_for(grid), grid), num_prefix_tokens)

    def offset_table(self, grid: Grid) -> Tensor:
        table_h, table_w = self.tables_for(grid)
        kh, kw = (table_h.shape[0] - 1) // 2, (table_w.shape[0] - 1) // 2
        bh = take_offsets(table_h.t(), 1, grid.h, kh)  # [heads, 2H-1]
        bw = take_offsets(table_w.t(), 1, grid.w, kw)
        return bh[:, :, None] + bw[:, None, :]

    def bias_factors(self, grid: Grid, num_prefix_tokens: int = 0) -> tuple[Tensor, Tensor]:
        """``b_h[row_i - row_j] + b_w[col_i - col_j]`` as ``u_i . w_j`` (rank ``H + W``, see ``axis_factors``)."""
        table_h, table_w = self.tables_for(grid)
        ih = offset_index(grid.h, (table_h.shape[0] - 1) // 2, table_h.device)
        iw = offset_index(grid.w, (table_w.shape[0] - 1) // 2, table_w.device)
        return axis_factors(table_h.t()[:, ih], table_w.t()[:, iw], grid, num_prefix_tokens, self.head_dim)
