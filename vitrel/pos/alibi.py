"""ALiBi (Press et al., 2022): a fixed linear distance penalty with geometric per-head slopes.

No parameters; extends to any distance by definition. Slopes ``m_h = 2^(-8 (h+1) / heads)``::

    alibi1d:  A_ij = q_i . k_j / sqrt(d) - m_h * |p_i - p_j|,              p = row * W + col
    alibi2d:  A_ij = q_i . k_j / sqrt(d) - m_h * sqrt(dh_ij^2 + dw_ij^2)   (Euclidean grid distance)
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrel.pos.base import Grid, PositionScheme, geometric_slopes, pad_prefix, register_pos, rel_offsets

__all__ = ["Alibi1d", "Alibi2d"]


class _AlibiBase(PositionScheme):
    def __init__(self, *, max_exponent: float = 8.0, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("slopes", geometric_slopes(self.num_heads, max_exponent), persistent=False)
        self._table_cache: dict[tuple, Tensor] = {}

    def distance(self, grid: Grid) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        # parameter-free: computed once per (grid, prefix, device) and reused
        key = (tuple(grid), num_prefix_tokens, self.slopes.device, self.slopes.dtype)
        b = self._table_cache.get(key)
        if b is None:
            d = self.distance(grid)
            b = pad_prefix(-self.slopes[:, None, None] * d[None], num_prefix_tokens)
            if len(self._table_cache) > 16:
                self._table_cache.clear()
            self._table_cache[key] = b
        return b


@register_pos("alibi1d")
class Alibi1d(_AlibiBase):
    """ALiBi on the raster-order index of the patches."""

    def distance(self, grid: Grid) -> Tensor:
        p = torch.arange(grid.n, device=self.slopes.device, dtype=self.slopes.dtype)
        return (p[:, None] - p[None, :]).abs()


@register_pos("alibi2d")
class Alibi2d(_AlibiBase):
    """2-D ALiBi: the penalty grows with the Euclidean distance between patches."""

    def distance(self, grid: Grid) -> Tensor:
        dh, dw = rel_offsets(grid, self.slopes.device)
        return torch.sqrt((dh * dh + dw * dw).to(self.slopes.dtype))
