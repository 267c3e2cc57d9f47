"""Absolute position embeddings added to the patch tokens at the input of the network.

``x_i <- x_i + e(r_i, c_i)`` for every patch token ``i`` (row ``r``, column ``c``); prefix tokens are
left untouched. Inside attention these schemes do nothing (``kind == "absolute"``).

* ``ape``: learned table ``pos_embed [1, H*W, C]`` (ViT, Dosovitskiy et al. 2021), trunc-normal
  init with std 0.02. On another grid the table is bicubic-resampled (as timm's
  ``resample_abs_pos_embed``: ``align_corners=False``, antialiased); a checkpoint of another grid
  is resampled to the module's grid when it loads.
* ``sincos2d``: fixed 2-D sin-cos embedding (MAE / MoCo v3), rows first, ``C % 4 == 0``::

      omega_t = T^(-t / (C/4)),  t < C/4,   T = temperature (10000)
      e(r, c) = [sin(r omega), cos(r omega), sin(c omega), cos(c omega)]

  (per-axis ``[sin, cos]`` blocks as in MAE/MoCo v3; timm's ``build_sincos2d_pos_embed`` with
  ``interleave_sin_cos=True``), computed for any grid at call time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, as_grid, check_tokens, patch_coords
from vitrel.pos.base import PositionScheme
from vitrel.pos.cache import GridBuffers, concrete_grid
from vitrel.pos.registry import register_pos
from vitrel.pos.tables import warn_once

__all__ = ["Ape", "Sincos2d", "add_patch_embed", "resample_pos_embed", "sincos2d_embed", "infer_grid"]


# ---------------------------------------------------------------------------- functional core
def add_patch_embed(x: Tensor, pe: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
    """``x [B, P + H*W, C]`` plus ``pe [1 or B, H*W, C]`` on the patch tokens; prefix tokens unchanged."""
    grid = as_grid(grid)
    if x.dim() != 3:
        raise ValueError(f"expected tokens of shape [B, N, C], got {tuple(x.shape)}")
    check_tokens(x.shape[1], grid, num_prefix_tokens)
    if pe.shape[-1] != x.shape[-1]:
        raise ValueError(f"position embedding has {pe.shape[-1]} channels, the tokens have {x.shape[-1]}")
    pe = pe.to(x.dtype)
    if num_prefix_tokens == 0:
        return x + pe
    return torch.cat((x[:, :num_prefix_tokens], x[:, num_prefix_tokens:] + pe), dim=1)


def resample_pos_embed(pe: Tensor, old_grid: Grid, new_grid: Grid) -> Tensor:
    """Bicubic resample ``[1, h*w, C]`` (raster order) to ``[1, H*W, C]`` (timm's resample_abs_pos_embed).

    ``align_corners=False``, antialiased (matters when shrinking); computed in float32 (float64 for
    float64 input) and returned in ``pe``'s dtype. Differentiable.
    """
    old_grid, new_grid = as_grid(old_grid), as_grid(new_grid)
    if pe.dim() != 3 or pe.shape[1] != old_grid.n:
        raise ValueError(f"pos_embed {tuple(pe.shape)} does not match grid {tuple(old_grid)} ([1, {old_grid.n}, C])")
    if isinstance(new_grid.h, int) and isinstance(new_grid.w, int) and old_grid == new_grid:
        return pe  # (with symbolic sizes the resampling always runs: at the same size it is the identity)
    c = pe.shape[-1]
    work = torch.float64 if pe.dtype == torch.float64 else torch.float32
    img = pe.to(work).reshape(pe.shape[0], old_grid.h, old_grid.w, c).permute(0, 3, 1, 2)
    img = F.interpolate(img, size=tuple(new_grid), mode="bicubic", align_corners=False, antialias=True)
    return img.permute(0, 2, 3, 1).reshape(pe.shape[0], new_grid.n, c).to(pe.dtype)


def infer_grid(n: int, like: Grid) -> Grid:
    """The grid of a stored ``[1, n, C]`` table: ``like``'s aspect ratio if ``n`` fits it, else square.

    A table carries only ``n = h * w``; a grid with ``like``'s exact aspect ratio is preferred
    (``h / w == H / W``), then a square one. Anything else is ambiguous and raises.
    """
    g = math.gcd(like.h, like.w)
    a, b = like.h // g, like.w // g
    if n % (a * b) == 0:
        s = math.isqrt(n // (a * b))
        if s * s * a * b == n:
            return Grid(a * s, b * s)
    s = math.isqrt(n)
    if s * s == n:
        return Grid(s, s)
    raise ValueError(
        f"cannot tell the grid of a stored position embedding with {n} positions: it is neither square "
        f"nor of aspect ratio {like.h}:{like.w}; resample it with resample_pos_embed(pe, old_grid, new_grid) first"
    )


def sincos2d_embed(
    grid: Grid, embed_dim: int, temperature: float = 10000.0, dtype: torch.dtype = torch.float64
) -> Tensor:
    """``[1, H*W, C]`` with ``e(r, c) = [sin(r w), cos(r w), sin(c w), cos(c w)]``, ``w_t = T^(-t/(C/4))``."""
    if embed_dim % 4:
        raise ValueError(f"sincos2d needs embed_dim divisible by 4, got embed_dim={embed_dim}")
    q = embed_dim // 4
    omega = temperature ** (-torch.arange(q, dtype=dtype) / q)
    rows, cols = patch_coords(grid)
    r = rows.to(dtype)[:, None] * omega
    c = cols.to(dtype)[:, None] * omega
    return torch.cat((r.sin(), r.cos(), c.sin(), c.cos()), dim=-1)[None]


# ---------------------------------------------------------------------------- modules
@register_pos("ape")
class Ape(PositionScheme):
    """Learned absolute embedding ``pos_embed [1, H*W, C]`` for the grid it is built for.

    On another grid at call time the table is bicubic-resampled; a checkpoint of another grid is
    resampled to this module's grid when loaded (with a warning). A stored table's grid is inferred
    from its length (see :func:`infer_grid`).
    """

    kind = "absolute"
    family = "absolute"
    no_weight_decay_keys = ("pos_embed",)

    def __init__(self, *, init_std: float = 0.02, **kw) -> None:
        super().__init__(**kw)
        self.init_std = init_std
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid.n, self.embed_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=self.init_std)

    def embed(self, grid: Grid) -> Tensor:
        """The table for ``grid`` ``[1, H*W, C]`` (the parameter itself on the built grid)."""
        return resample_pos_embed(self.pos_embed, self.grid, as_grid(grid))

    def add_to_tokens(self, x: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        return add_patch_embed(x, self.embed(grid), grid, num_prefix_tokens)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        key = prefix + "pos_embed"
        src = state_dict.get(key)
        dst = self.pos_embed
        if (
            src is not None
            and src.shape != dst.shape
            and src.dim() == 3
            and src.shape[0] == 1
            and src.shape[-1] == dst.shape[-1]
        ):
            old = infer_grid(src.shape[1], self.grid)
            state_dict[key] = resample_pos_embed(src, old, self.grid)
            warn_once(
                f"resampled absolute position embedding {key} from grid {old.h}x{old.w} to "
                f"{self.grid.h}x{self.grid.w} (bicubic)"
            )
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, embed_dim={self.embed_dim}"


@register_pos("sincos2d")
class Sincos2d(GridBuffers, PositionScheme):
    """Fixed 2-D sin-cos embedding (rows in the first half of the channels, columns in the second)."""

    kind = "absolute"
    family = "absolute"

    def __init__(self, *, temperature: float = 10000.0, **kw) -> None:
        super().__init__(**kw)
        if self.embed_dim % 4:
            raise ValueError(f"sincos2d needs embed_dim divisible by 4, got embed_dim={self.embed_dim}")
        if not temperature > 0:
            raise ValueError(f"sincos2d needs temperature > 0, got {temperature}")
        self.temperature = float(temperature)
        self.init_non_persistent_buffers()

    def _init_buffers(self) -> None:
        """``built_embed``: the embedding of the built grid (float32 unless the module was converted)."""
        like = self._like("built_embed") or {"dtype": torch.float32}
        pe = sincos2d_embed(self.grid, self.embed_dim, self.temperature).to(**like)
        self.register_buffer("built_embed", pe, persistent=False)

    def embed(self, grid: Grid, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[1, H*W, C]`` for ``grid``, computed in float64 then cast."""
        return sincos2d_embed(as_grid(grid), self.embed_dim, self.temperature).to(device=device, dtype=dtype)

    def add_to_tokens(self, x: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        pe = self.built_embed
        if not (
            concrete_grid(grid) and tuple(grid) == tuple(self.grid) and pe.dtype == x.dtype and pe.device == x.device
        ):
            pe = sincos2d_embed(grid, self.embed_dim, self.temperature).to(device=x.device, dtype=x.dtype)
        return add_patch_embed(x, pe, grid, num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, embed_dim={self.embed_dim}, temperature={self.temperature}"
