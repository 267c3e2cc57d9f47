"""ALiBi (Press et al., 2022): a fixed linear distance penalty with per-head slopes.

No parameters; extends to any distance by definition. Slopes (``slopes=``):

* ``"reference"`` (default): the ALiBi reference code's ``get_slopes`` and BLOOM's
  ``build_alibi_tensor``: for a power of two ``n`` heads ``m_h = 2^(-8 (h+1) / n)``; otherwise the
  slopes of the nearest lower power of two ``c`` followed by every other slope of ``2c`` heads;
* ``"geometric"``: ``m_h = 2^(-8 (h+1) / heads)`` for every head count (vitrel 0.1's rule; configs
  written by 0.1 keep it, see ``legacy_options``). Both rules agree for a power of two.

``max_exponent`` replaces the 8. The bias::

    alibi1d:  A_ij = q_i . k_j / sqrt(d) - m_h * |d_ij|,                   d_ij = p_i - p_j, p = row * W + col
    alibi2d:  A_ij = q_i . k_j / sqrt(d) - m_h * sqrt(dh_ij^2 + dw_ij^2)   (Euclidean grid distance)
    alibi3d:  A_ij = q_i . k_j / sqrt(d) - m_h * sqrt(dt_ij^2 + dh_ij^2 + dw_ij^2)

``alibi3d`` takes video grids ``(T, H, W)`` (tokens t-major, ``dt_ij = t_i - t_j``): alibi2d's Euclidean distance
over the three axes, one frame apart weighing as one patch apart; on an image grid (one frame) it is ``alibi2d``.

The bias depends on the grid alone: the built grid's is a non-persistent buffer
(:class:`~vitrel.pos.cache.GridBuffers`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from vitrel.layout.geometry import Grid, Grid3, offset_grid, offset_grid3, pad_prefix, rel_offsets, rel_offsets3
from vitrel.pos.base import PositionScheme
from vitrel.pos.cache import GridBuffers
from vitrel.pos.registry import register_pos

__all__ = ["Alibi1d", "Alibi2d", "Alibi3d", "reference_slopes"]


def geometric_slopes(num_heads: int, max_exponent: float = 8.0) -> Tensor:
    """ALiBi slopes ``m_h = 2^(-max_exponent * (h + 1) / num_heads)`` for h = 0..heads-1."""
    return torch.tensor([2.0 ** (-max_exponent * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float64)


def reference_slopes(num_heads: int, max_exponent: float = 8.0) -> Tensor:
    """The ALiBi reference slopes (``get_slopes`` of the authors' code, BLOOM's ``build_alibi_tensor``), float64."""

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-max_exponent / n)
        return [start ** (i + 1) for i in range(n)]

    def slopes(n: int) -> list[float]:
        if math.log2(n).is_integer():
            return power_of_2(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_2(closest) + slopes(2 * closest)[0::2][: n - closest]

    return torch.tensor(slopes(num_heads), dtype=torch.float64)


class _AlibiBase(GridBuffers, PositionScheme):
    family = "fixed bias"
    has_bias = True

    def __init__(self, *, max_exponent: float = 8.0, slopes: str = "reference", **kw) -> None:
        super().__init__(**kw)
        rules = {"reference": reference_slopes, "geometric": geometric_slopes}
        if slopes not in rules:
            raise ValueError(f"{self.name}: slopes must be 'reference' or 'geometric', got {slopes!r}")
        if not max_exponent > 0:  # (0 or less: slopes of 1 or more, growing with the head, the bias no longer ALiBi's)
            raise ValueError(
                f"{self.name}: max_exponent must be > 0 (slopes 2^-(max_exponent (h+1) / heads), h = 0 .. heads-1), "
                f"got {max_exponent}"
            )
        self.slope_rule, self.max_exponent = slopes, float(max_exponent)
        self.init_non_persistent_buffers()

    def _init_buffers(self) -> None:
        """``slopes`` and ``built_bias`` (the bias of the built grid), as non-persistent buffers."""
        rule = {"reference": reference_slopes, "geometric": geometric_slopes}[self.slope_rule]
        slopes = rule(self.num_heads, self.max_exponent).to(**self._like("slopes"))
        self.register_buffer("slopes", slopes, persistent=False)
        self.register_buffer("built_bias", self._bias(self.grid, self.num_prefix_tokens), persistent=False)

    @classmethod
    def legacy_options(cls, options: dict[str, Any], written_format: int = 1) -> dict[str, Any]:
        """vitrel 0.1 (format 1) used the geometric rule for every head count."""
        return options if written_format >= 2 else {"slopes": "geometric", **options}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, slopes={self.slope_rule}"

    has_offset_table = True

    def offset_distance(self, *offsets: Tensor, grid: Grid) -> Tensor:  # pragma: no cover - overridden
        """The distance of patch offsets (``(dh, dw)``; ``(dt, dh, dw)`` on a video grid) on ``grid``, in the slopes'
        dtype."""
        raise NotImplementedError

    def distance(self, grid: Grid | Grid3) -> Tensor:
        """``[N, N]``: the distance between every two patches."""
        rel = rel_offsets3 if isinstance(grid, Grid3) else rel_offsets
        return self.offset_distance(*rel(grid, self.slopes.device), grid=grid)

    def offset_table(self, grid: Grid | Grid3) -> Tensor:
        grid = self.check_grid(grid)
        offsets = (offset_grid3 if isinstance(grid, Grid3) else offset_grid)(grid, self.slopes.device)
        d = self.offset_distance(*offsets, grid=grid)
        return -self.slopes.view(-1, *(1,) * d.dim()) * d[None]

    def bias(self, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> Tensor:
        grid = self.check_grid(grid)
        if self.at_built_grid(grid, num_prefix_tokens):
            return self.built_bias
        return self._bias(grid, num_prefix_tokens)

    def _bias(self, grid: Grid, num_prefix_tokens: int) -> Tensor:
        return pad_prefix(-self.slopes[:, None, None] * self.distance(grid)[None], num_prefix_tokens)


@register_pos("alibi1d")
class Alibi1d(_AlibiBase):
    """ALiBi on the raster-order index of the patches."""

    depends_on_extent = True

    def offset_distance(self, dh: Tensor, dw: Tensor, grid: Grid) -> Tensor:
        return (dh * grid.w + dw).abs().to(self.slopes.dtype)  # |p_i - p_j|, raster order


@register_pos("alibi2d")
class Alibi2d(_AlibiBase):
    """2-D ALiBi: the penalty grows with the Euclidean distance between patches."""

    def offset_distance(self, dh: Tensor, dw: Tensor, grid: Grid) -> Tensor:
        return torch.sqrt((dh * dh + dw * dw).to(self.slopes.dtype))


@register_pos("alibi3d")
class Alibi3d(_AlibiBase):
    """3-D ALiBi for video grids: the penalty grows with the Euclidean distance over ``(dt, dh, dw)``."""

    grid_dims = 3

    def offset_distance(self, dt: Tensor, dh: Tensor, dw: Tensor, grid: Grid3) -> Tensor:
        return torch.sqrt((dt * dt + dh * dh + dw * dw).to(self.slopes.dtype))
