"""LookHere (Fuller et al., NeurIPS 2024): heads look in fixed directions, with a distance penalty.

Every head ``h`` sees only the keys inside its field of view (a direction-dependent 2-D mask) and
pays a linear penalty for Euclidean distance; prefix (class/register) tokens are unrestricted. With
``d_ij = (dh, dw) = (row_i - row_j, col_i - col_j)`` (query minus key)::

    A_ij = q_i . k_j / sqrt(d) - g * s_l * m_h * sqrt(dh^2 + dw^2)   if j is in head h's view of i
    A_ij = -inf                                                       otherwise

``m_h = 2^-(floor(h / 4) + 1)`` (the authors' ``get_slopes``: groups of four heads, one per
direction, halving slopes), ``s_l`` the per-layer slope, linear over depth from
``layer_slopes[0]`` (first block) to ``layer_slopes[1]`` (last block) as in the authors'
``create_lh_bias_tensor``, and ``g`` the ``global_slope``. Head ``h`` looks in direction
``h mod 4`` of the direction set (the authors' construction for head counts that are multiples of
four; other head counts continue the same pattern). Views, all inclusive of their borders and of the
query itself:

* ``halves`` (180 degrees): up ``dh >= 0``, down ``dh <= 0``, left ``dw >= 0``, right ``dw <= 0``;
* ``quadrants`` (90 degrees, the authors' ``corners``): up-left, up-right, down-left, down-right
  (the intersections of two halves);
* ``triangles`` (90-degree wedges around an axis): up ``dh >= |dw|``, down ``-dh >= |dw|``, left
  ``dw >= |dh|``, right ``-dw >= |dh|``;
* ``eighths`` (45 degrees, the authors' ``eighths1``): up-wedge & left half, down-wedge & left
  half, left-wedge & up half, right-wedge & up half.

``fov=180 | 90 | 45`` picks ``halves``, ``quadrants``, ``eighths``; ``directions=`` names a set
directly (e.g. ``triangles``, the other 90-degree construction). Views and penalty depend on the
offset only, so the scheme is relative (translation-equivariant) and runs on any grid, in windows
too. The masked directions are ``-inf`` in the bias; a kernel with block masks can skip them
(:meth:`LookHere.view_mask` gives the boolean view).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from vitrel.pos.base import (
    Grid,
    PositionScheme,
    PosState,
    as_grid,
    expand_offset_table,
    offset_block_mask,
    offset_grid,
    register_pos,
    rel_offsets,
)
from vitrel.pos.cache import GridBuffers

__all__ = ["LookHere", "DIRECTION_SETS", "FOV_SETS", "lookhere_views", "offset_views"]

#: per set, the four directions as lists of elementary views (a view is the intersection of its parts)
DIRECTION_SETS: dict[str, list[list[str]]] = {
    "halves": [["up"], ["down"], ["left"], ["right"]],
    "quadrants": [["up", "left"], ["up", "right"], ["down", "left"], ["down", "right"]],
    "triangles": [["tri_up"], ["tri_down"], ["tri_left"], ["tri_right"]],
    "eighths": [["tri_up", "left"], ["tri_down", "left"], ["tri_left", "up"], ["tri_right", "up"]],
}
FOV_SETS = {180: "halves", 90: "quadrants", 45: "eighths"}


def _elementary(dh: Tensor, dw: Tensor) -> dict[str, Tensor]:
    return {
        "up": dh >= 0,
        "down": dh <= 0,
        "left": dw >= 0,
        "right": dw <= 0,
        "tri_up": dh >= dw.abs(),
        "tri_down": -dh >= dw.abs(),
        "tri_left": dw >= dh.abs(),
        "tri_right": -dw >= dh.abs(),
    }


def lookhere_views(grid: Grid, directions: str, num_heads: int, device: torch.device | None = None) -> Tensor:
    """Boolean ``[heads, HW, HW]``: key ``j`` is in head ``h``'s view of query ``i``."""
    return offset_views(*rel_offsets(grid, device), directions, num_heads)


def offset_views(dh: Tensor, dw: Tensor, directions: str, num_heads: int) -> Tensor:
    """Boolean ``[heads, *dh.shape]``: offset ``(dh, dw)`` (query minus key) is in head ``h``'s view."""
    parts = _elementary(dh, dw)
    views = []
    for h in range(num_heads):
        v = torch.ones_like(dh, dtype=torch.bool)
        for p in DIRECTION_SETS[directions][h % 4]:
            v = v & parts[p]
        views.append(v)
    return torch.stack(views)


@register_pos("lookhere")
class LookHere(GridBuffers, PositionScheme):
    """LookHere's directional views and distance penalties (see the module docstring).

    Args:
        fov: 180, 90 or 45 degrees (``halves``, ``quadrants``, ``eighths``), used when ``directions``
            is None.
        directions: a direction set by name (``halves``, ``quadrants``, ``triangles``, ``eighths``).
        global_slope: ``g``.
        layer_slopes: ``(first, last)``: the per-layer slope ``s_l`` goes linearly from ``first`` to
            ``last`` over the model's blocks (``first`` alone for a scheme shared by all blocks).
    """

    family = "fixed bias"
    has_bias = True

    def __init__(
        self,
        *,
        fov: int = 180,
        directions: str | None = None,
        global_slope: float = 1.0,
        layer_slopes: tuple[float, float] | list[float] = (1.5, 0.5),
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if directions is None:
            if fov not in FOV_SETS:
                raise ValueError(f"lookhere: fov must be one of {sorted(FOV_SETS)}, got {fov!r}")
            directions = FOV_SETS[fov]
        if directions not in DIRECTION_SETS:
            raise ValueError(f"lookhere: directions must be one of {sorted(DIRECTION_SETS)}, got {directions!r}")
        ls = [float(v) for v in layer_slopes]
        if len(ls) != 2 or min(ls) < 0 or global_slope < 0:
            raise ValueError(
                f"lookhere: layer_slopes is (first, last) >= 0 and global_slope >= 0, got {ls}, {global_slope}"
            )
        self.fov, self.directions = fov, directions
        self.global_slope, self.layer_slopes = float(global_slope), tuple(ls)
        self.slope = self.global_slope * self.layer_slope()
        self.init_non_persistent_buffers()

    def _init_buffers(self) -> None:
        """``head_slopes`` and ``built_bias`` (the bias of the built grid), as non-persistent buffers."""
        head = torch.tensor([2.0 ** -(h // 4 + 1) for h in range(self.num_heads)], dtype=torch.float64)
        self.register_buffer("head_slopes", head.to(**self._like("head_slopes")), persistent=False)
        self.register_buffer("built_bias", self._bias(self.grid, self.num_prefix_tokens), persistent=False)

    def layer_slope(self) -> float:
        """``s_l``: linear from ``layer_slopes[0]`` to ``[1]`` over the blocks (``torch.linspace``'s points)."""
        first, last = self.layer_slopes
        if self.layer is None or self.layer[1] <= 1:
            return first
        i, n = self.layer
        return first + (last - first) * i / (n - 1)

    def view_mask(self, grid: Grid) -> Tensor:
        """``[heads, HW, HW]`` booleans: the keys each head may attend to (for block-sparse kernels)."""
        return lookhere_views(grid, self.directions, self.num_heads, self.head_slopes.device)

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        if self.at_built_grid(grid, num_prefix_tokens):
            return self.built_bias
        return self._bias(grid, num_prefix_tokens)

    has_offset_table = True
    has_masked_offsets = True

    def offset_table(self, grid: Grid) -> Tensor:
        dh, dw = offset_grid(grid, self.head_slopes.device)
        dist = torch.sqrt((dh * dh + dw * dw).to(self.head_slopes.dtype))
        t = -(self.slope * self.head_slopes[:, None, None]) * dist[None]
        return t.masked_fill(~offset_views(dh, dw, self.directions, self.num_heads), float("-inf"))

    @classmethod
    def prepare_many(
        cls,
        schemes: Sequence[PositionScheme],
        grid: Any,
        num_prefix_tokens: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        impl: str = "auto",
    ) -> list[PosState]:
        """With ``impl="flex"``, one BlockMask for every block that looks in the same directions (the views do
        not depend on the layer's slope); otherwise each scheme's ``prepare``."""
        if impl != "flex" or len(schemes) < 2 or any(type(s) is not cls for s in schemes):
            return super().prepare_many(schemes, grid, num_prefix_tokens, device, dtype, impl)
        grid, masks, states = as_grid(grid), {}, []
        for s in schemes:
            table = s.offset_table(grid)
            key = (s.directions, s.num_heads)
            if key not in masks:
                masks[key] = offset_block_mask(table, grid, num_prefix_tokens)
            states.append(PosState(s, grid, num_prefix_tokens, table=table, block_mask=masks[key], impl=impl))
        return states

    def _bias(self, grid: Grid, num_prefix_tokens: int) -> Tensor:
        return expand_offset_table(self.offset_table(grid), grid, num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, directions={self.directions}, slope={self.slope:g}"
