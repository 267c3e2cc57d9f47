"""ALiBi (Press et al., 2022): a fixed linear distance penalty with geometric per-head slopes.

No parameters; extends to any distance by definition. Slopes ``m_h = 2^(-8 (h+1) / heads)``::

    alibi1d:  A_ij = q_i . k_j / sqrt(d) - m_h * |d_ij|,                   d_ij = p_i - p_j, p = row * W + col
    alibi2d:  A_ij = q_i . k_j / sqrt(d) - m_h * sqrt(dh_ij^2 + dw_ij^2)   (Euclidean grid distance)

The bias depends on the grid alone, so eager forwards reuse it (:class:`~vitrel.pos.cache.TensorCache`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitrel.pos.base import Grid, PositionScheme, geometric_slopes, pad_prefix, register_pos, rel_offsets
from vitrel.pos.cache import TensorCache

__all__ = ["Alibi1d", "Alibi2d"]


class _AlibiBase(PositionScheme):
    family = "fixed bias"
    has_bias = True

    def __init__(self, *, max_exponent: float = 8.0, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("slopes", geometric_slopes(self.num_heads, max_exponent), persistent=False)
        self._bias_cache = TensorCache()

    def distance(self, grid: Grid) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        key = (tuple(grid), num_prefix_tokens, self.slopes.device, self.slopes.dtype)
        return self._bias_cache.get(key, lambda: self._bias(grid, num_prefix_tokens), self.slopes)

    def _bias(self, grid: Grid, num_prefix_tokens: int) -> Tensor:
        return pad_prefix(-self.slopes[:, None, None] * self.distance(grid)[None], num_prefix_tokens)


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
