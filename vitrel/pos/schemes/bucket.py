"""T5-style bucketed relative bias (Raffel et al., 2020), on raster order (1-D) and per axis (2-D).

With the offset ``d_ij = p_i - p_j`` (query minus key, the convention of every vitrel scheme), T5's
bucket function takes the key-minus-query offset ``r = -d_ij`` (T5's ``memory_position -
context_position``): half the buckets for each sign (bidirectional), and within a sign, exact
buckets for ``|r| < n/2`` and log-spaced buckets up to ``max_distance`` (T5's name: the distance
where the log-spaced buckets end; beyond it, the last bucket)::

    rel1d_bucket:  A_ij = q_i . k_j / sqrt(d) + b_h[bucket(-d_ij)],                    p = row * W + col
    rel2d_bucket:  A_ij = q_i . k_j / sqrt(d) + b^(h)_h[bucket(-dh_ij)] + b^(w)_h[bucket(-dw_ij)]

Under causal attention (``Attention(..., causal=True)``, or ``causal=True`` on the scheme)
``rel1d_bucket`` uses T5's one-directional decoder buckets: every bucket for the past offsets
``d_ij >= 0`` (``bidirectional=False``), as T5's decoder does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vitrel.device_cache import per_device
from vitrel.layout.geometry import Grid, axis_factors, axis_offsets, pad_prefix
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos
from vitrel.pos.tables import check_init_std

__all__ = ["t5_bucket", "Rel1dBucket", "Rel2dBucket"]


def t5_bucket(rel: Tensor, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True) -> Tensor:
    """T5's bucket of each signed key-minus-query offset ``rel = p_j - p_i = -d_ij`` (long tensor, same shape)."""
    ret = torch.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        ret = ret + (rel > 0).long() * n
        r = rel.abs()
    else:
        r = (-rel).clamp(min=0)
    max_exact = n // 2
    is_small = r < max_exact
    r_log = (
        max_exact
        + (torch.log(r.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (n - max_exact)).long()
    )
    r_log = r_log.clamp(max=n - 1)
    return ret + torch.where(is_small, r, r_log)


@per_device(maxsize=32)
def axis_buckets(n: int, num_buckets: int, max_distance: int, bidirectional: bool, device) -> Tensor:
    """``[2n-1]``: the bucket of ``-d`` for each offset ``d = -(n-1) .. n-1`` along an axis of ``n`` patches (an offset
    table's index; made once per arguments, :func:`~vitrel.device_cache.per_device`)."""
    return t5_bucket(-axis_offsets(n, device), num_buckets, max_distance, bidirectional)


@per_device(maxsize=32)
def raster_buckets(h: int, w: int, num_buckets: int, max_distance: int, bidirectional: bool, device) -> Tensor:
    """``[2H-1, 2W-1]``: the bucket of ``-d`` for the raster-order offset ``d = dh W + dw`` of each 2-D offset of an
    ``H x W`` grid (made once per arguments)."""
    d = axis_offsets(h, device)[:, None] * w + axis_offsets(w, device)[None, :]  # p_i - p_j
    return t5_bucket(-d, num_buckets, max_distance, bidirectional)


class _BucketBase(PositionScheme):
    family = "learned bias"
    has_bias = True
    no_weight_decay_keys = ("table",)

    def __init__(self, *, num_buckets: int, max_distance: int, init_std: float = 0.02, **kw) -> None:
        super().__init__(**kw)
        if num_buckets < 4 or num_buckets % 2:
            raise ValueError(f"num_buckets must be even and >= 4, got {num_buckets}")
        if max_distance <= num_buckets // 4:
            raise ValueError(f"max_distance must exceed num_buckets/4 = {num_buckets // 4}, got {max_distance}")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self._init_std = check_init_std(self.name, init_std)

    def _bucket(self, rel: Tensor) -> Tensor:
        return t5_bucket(rel, self.num_buckets, self.max_distance, bidirectional=True)


@register_pos("rel1d_bucket")
class Rel1dBucket(_BucketBase):
    """T5 buckets of the raster-order offset ``d_ij = p_i - p_j``; one learned scalar per bucket and head.

    ``causal=True``: T5's one-directional (decoder) buckets (set by a causal ``Attention``).
    """

    causal_aware = True
    depends_on_extent = True

    def __init__(self, *, num_buckets: int = 32, max_distance: int = 128, causal: bool = False, **kw) -> None:
        super().__init__(num_buckets=num_buckets, max_distance=max_distance, **kw)
        self.causal = bool(causal)
        self.table = nn.Parameter(torch.zeros(num_buckets, self.num_heads))
        nn.init.trunc_normal_(self.table, std=self._init_std)

    has_offset_table = True

    def offset_table(self, grid: Grid) -> Tensor:
        idx = raster_buckets(grid.h, grid.w, self.num_buckets, self.max_distance, not self.causal, self.table.device)
        return self.table.t()[:, idx]  # [heads, 2H-1, 2W-1]

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        p = torch.arange(grid.n, device=self.table.device)
        rel = -(p[:, None] - p[None, :])  # bucket(-d_ij)
        idx = t5_bucket(rel, self.num_buckets, self.max_distance, bidirectional=not self.causal)
        b = self.table.t().index_select(1, idx.reshape(-1)).view(self.num_heads, grid.n, grid.n)
        return pad_prefix(b, num_prefix_tokens)


@register_pos("rel2d_bucket")
class Rel2dBucket(_BucketBase):
    """T5 buckets per axis: ``b_h[bucket(-dh)] + b_w[bucket(-dw)]``, one table per axis and head."""

    def __init__(self, *, num_buckets: int = 16, max_distance: int = 32, **kw) -> None:
        super().__init__(num_buckets=num_buckets, max_distance=max_distance, **kw)
        self.table_h = nn.Parameter(torch.zeros(num_buckets, self.num_heads))
        self.table_w = nn.Parameter(torch.zeros(num_buckets, self.num_heads))
        nn.init.trunc_normal_(self.table_h, std=self._init_std)
        nn.init.trunc_normal_(self.table_w, std=self._init_std)

    no_weight_decay_keys = ("table_h", "table_w")
    has_bias_factors = True

    def _axis_biases(self, grid: Grid) -> tuple[Tensor, Tensor]:
        """``[heads, H, H]`` and ``[heads, W, W]``: ``b_h[bucket(-dh_ij)]``, ``b_w[bucket(-dw_ij)]``."""
        dev = self.table_h.device
        rh = torch.arange(grid.h, device=dev)
        rw = torch.arange(grid.w, device=dev)
        ih = self._bucket(-(rh[:, None] - rh[None, :]))  # [H, H], bucket(-dh_ij)
        iw = self._bucket(-(rw[:, None] - rw[None, :]))
        return self.table_h.t()[:, ih], self.table_w.t()[:, iw]

    has_offset_table = True

    def offset_table(self, grid: Grid) -> Tensor:
        nb, md, dev = self.num_buckets, self.max_distance, self.table_h.device
        bh = self.table_h.t()[:, axis_buckets(grid.h, nb, md, True, dev)]  # [heads, 2H-1]: b_h[bucket(-dh)]
        bw = self.table_w.t()[:, axis_buckets(grid.w, nb, md, True, dev)]
        return bh[:, :, None] + bw[:, None, :]

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        bh, bw = self._axis_biases(grid)
        b = (bh[:, :, None, :, None] + bw[:, None, :, None, :]).reshape(self.num_heads, grid.n, grid.n)
        return pad_prefix(b, num_prefix_tokens)

    def bias_factors(self, grid: Grid, num_prefix_tokens: int = 0) -> tuple[Tensor, Tensor]:
        """The per-axis buckets as ``u_i . w_j`` (rank ``H + W``, see ``axis_factors``)."""
        return axis_factors(*self._axis_biases(grid), grid, num_prefix_tokens, self.head_dim)
