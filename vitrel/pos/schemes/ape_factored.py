"""``ape_factored``: a learned absolute embedding factored into a row table and a column table.

``x_i <- x_i + y[r_i] + x[c_i]`` for every patch token ``i`` (row ``r``, column ``c``), ``pos_embed_y [1, H, C]`` and
``pos_embed_x [1, W, C]``: ``(H + W) C`` parameters where ``ape`` has ``H W C``. It is timm NaFlexVit's
``pos_embed="factorized"`` (``naflexvit_base_patch16_parfac_gap``). On another grid each table is resampled linearly
(``align_corners=False``, no antialias, as timm's) to the grid's height and width, or with ``ar_preserving`` both to the
longer side and cut to ``H`` and ``W`` (one scale for rows and columns whatever the aspect ratio). Prefix tokens get
nothing; image grids only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, as_grid, grid_str
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos
from vitrel.pos.schemes.absolute import add_patch_embed, resample_time_embed
from vitrel.pos.tables import check_init_std, warn_once

__all__ = ["ApeFactored", "factored_embed"]


def factored_embed(pe_y: Tensor, pe_x: Tensor, grid: Grid, ar_preserving: bool = False) -> Tensor:
    """``[1, H*W, C]`` with ``e(r, c) = y[r] + x[c]`` from the tables ``pe_y [1, h, C]`` and ``pe_x [1, w, C]``
    resampled to ``grid`` (linearly; with ``ar_preserving`` both to ``max(H, W)``, then cut)."""
    g = as_grid(grid)
    side = torch.sym_max(g.h, g.w)
    rows = resample_time_embed(pe_y, side if ar_preserving else g.h)[:, : g.h]
    cols = resample_time_embed(pe_x, side if ar_preserving else g.w)[:, : g.w]
    return (rows[:, :, None, :] + cols[:, None, :, :]).flatten(1, 2)


@register_pos("ape_factored")
class ApeFactored(PositionScheme):
    """Learned row and column tables ``pos_embed_y [1, H, C]``, ``pos_embed_x [1, W, C]`` for the model's grid (or
    ``table_grid``), added to the patch tokens; trunc-normal init with std ``init_std``."""

    kind = "absolute"
    family = "absolute"
    no_weight_decay_keys = ("pos_embed_y", "pos_embed_x")

    def __init__(self, *, init_std: float = 0.02, table_grid: Any = None, ar_preserving: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.init_std = check_init_std(self.name, init_std)
        self.ar_preserving = ar_preserving
        self.table_grid = None if table_grid is None else as_grid(table_grid)
        h, w = self.space
        self.pos_embed_y = nn.Parameter(torch.zeros(1, h, self.embed_dim))
        self.pos_embed_x = nn.Parameter(torch.zeros(1, w, self.embed_dim))
        self.reset_parameters()

    @property
    def space(self) -> Grid:
        """The tables' grid: ``table_grid``, else the built one."""
        return self.table_grid if self.table_grid is not None else self.grid

    @property
    def size_branches(self) -> bool:  # type: ignore[override]
        """``ar_preserving`` on a non-square table grid: the tables are used as stored on their own grid, a traced
        program resamples them there."""
        return self.ar_preserving and self.space.h != self.space.w

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed_y, std=self.init_std)
        nn.init.trunc_normal_(self.pos_embed_x, std=self.init_std)

    def embed(self, grid: Grid) -> Tensor:
        """The embedding ``[1, H*W, C]`` on ``grid``."""
        g = self.check_grid(grid)
        stored = all(isinstance(v, int) for v in g) and tuple(g) == tuple(self.space)  # (timm's: the tables as kept)
        return factored_embed(self.pos_embed_y, self.pos_embed_x, g, self.ar_preserving and not stored)

    def add_to_tokens(self, x: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        return add_patch_embed(x, self.embed(grid), self.check_grid(grid), num_prefix_tokens)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        for name, n in (("pos_embed_y", self.space.h), ("pos_embed_x", self.space.w)):
            key, src = prefix + name, state_dict.get(prefix + name)
            if src is not None and src.dim() == 3 and src.shape[1] != n and src.shape[-1] == self.embed_dim:
                state_dict[key] = resample_time_embed(src, n)
                warn_once(f"resampled {key} from {src.shape[1]} to {n} positions (linear)")
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        table = "" if self.table_grid is None else f", table_grid={grid_str(self.table_grid)}"
        ar = ", ar_preserving=True" if self.ar_preserving else ""
        return f"{super().extra_repr()}, embed_dim={self.embed_dim}{table}{ar}"
