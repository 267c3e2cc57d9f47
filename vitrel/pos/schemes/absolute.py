"""Absolute position embeddings added to the patch tokens at the input of the network.

``x_i <- x_i + e(r_i, c_i)`` for every patch token ``i`` (row ``r``, column ``c``); prefix tokens are
left untouched. Inside attention these schemes do nothing (``kind == "absolute"``).

* ``ape``: learned table ``pos_embed [1, H*W, C]`` (ViT, Dosovitskiy et al. 2021), trunc-normal
  init with std 0.02, on the model's grid or on ``table_grid``. On another grid the table is resampled, by default
  as timm's ``resample_abs_pos_embed`` (bicubic, ``align_corners=False``, antialiased); ``interp_mode``
  (``"bilinear"``), ``antialias``, ``align_corners`` and ``ar_preserving`` (resample to the square of the longer side,
  keep the top-left ``H x W``) are timm NaFlexVit's ``pos_embed_*`` options of those names. A checkpoint of another
  grid is resampled to the module's grid when it loads.
* ``sincos2d``: fixed 2-D sin-cos embedding (MAE / MoCo v3), rows first, ``C % 4 == 0``::

      omega_t = T^(-t / (C/4)),  t < C/4,   T = temperature (10000)
      e(r, c) = [sin(r omega), cos(r omega), sin(c omega), cos(c omega)]

  (per-axis ``[sin, cos]`` blocks as in MAE/MoCo v3; timm's ``build_sincos2d_pos_embed`` with
  ``interleave_sin_cos=True``), computed for any grid at call time.
* ``sincos1d``: fixed 1-D sinusoid of the original Transformer (Vaswani et al. 2017) over the patches' raster index
  ``p = r * W + c`` (``(t * H + h) * W + w`` on a video grid), as VideoMAE's ``get_sinusoid_encoding_table``
  (MCG-NJU/VideoMAE, ``modeling_finetune.py``), ``C`` even, sin and cos interleaved::

      e(p)[2i] = sin(p T^(-2i/C)),  e(p)[2i+1] = cos(p T^(-2i/C)),   T = temperature (10000)

  Any grid is its own raster, image or video (on another grid, the table of its token count, as VideoMAE's
  fine-tuning builds it); a token's index depends on the grid's width (and height), ``depends_on_extent``.

Video grids ``(T, H, W)`` (tokens t-major, ``index = (t * H + h) * W + w``):

* ``ape`` built on a video grid is separable, as MAE-ST's ``sep_pos_embed`` (Feichtenhofer et al. 2022) and
  TimeSformer's ``time_embed``: ``e(t, h, w) = pos_embed[h, w] + pos_embed_temporal[t]``, a spatial table
  ``[1, H*W, C]`` (the image table's name and shape: an image checkpoint's table loads into it) and a temporal one
  ``[1, T, C]``, both trunc-normal (std 0.02). Another video grid resamples the spatial table bicubically (as for
  images) and the temporal one linearly (``align_corners=False``, no antialias), the separable resample of the
  whole ``T x H x W`` table; an image grid is one frame. ``ape`` built on an image grid is the image table above and
  refuses a video grid (it has no time).
* ``sincos3d``: fixed 3-D sin-cos embedding, the channels split as in the video MAE of torchmultimodal
  (facebookresearch/multimodal, ``models/masked_auto_encoder/position_embeddings.py``,
  ``get_3d_sin_cos_embeddings``): time first on ``C/4`` channels, then columns and rows on ``3C/8`` each, each block
  ``[sin(x omega), cos(x omega)]`` with ``omega_k = T^(-k/(n/2))`` over its ``n`` channels. That is its split for
  ``C % 16 == 0`` (what its code runs); for other even ``C`` columns and rows get ``2 floor(3C/16)`` channels each and
  time the rest (``C = 24``: 8, 8, 8). Unlike that code, the class token gets nothing added (vitrel's prefix tokens
  are untouched).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, Grid3, as_grid, as_grid3, check_tokens, grid_str, patch_coords, patch_coords3
from vitrel.pos.base import PositionScheme
from vitrel.pos.cache import GridBuffers, concrete_grid
from vitrel.pos.registry import register_pos
from vitrel.pos.tables import check_init_std, warn_once

__all__ = [
    "Ape",
    "Sincos1d",
    "Sincos2d",
    "Sincos3d",
    "add_patch_embed",
    "INTERP_MODES",
    "RESAMPLE_DEFAULTS",
    "resample_pos_embed",
    "resample_time_embed",
    "sincos1d_embed",
    "sincos2d_embed",
    "sincos3d_embed",
    "sincos3d_space_channels",
    "infer_grid",
]


# ---------------------------------------------------------------------------- functional core
def add_patch_embed(x: Tensor, pe: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
    """``x [B, P + H*W, C]`` plus ``pe [1 or B, H*W, C]`` on the patch tokens (``T*H*W`` on a video grid); prefix
    tokens unchanged."""
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


#: the modes the learned tables resample with (``F.interpolate``'s), timm's ``pos_embed_interp_mode``
INTERP_MODES = ("bicubic", "bilinear")
#: ``ape``'s resampling options as timm's ``resample_abs_pos_embed`` resamples (its defaults)
RESAMPLE_DEFAULTS = {"interp_mode": "bicubic", "antialias": True, "align_corners": False, "ar_preserving": False}


def resample_pos_embed(
    pe: Tensor,
    old_grid: Grid,
    new_grid: Grid,
    *,
    mode: str = "bicubic",
    antialias: bool = True,
    align_corners: bool = False,
    ar_preserving: bool = False,
) -> Tensor:
    """Resample ``[1, h*w, C]`` (raster order) to ``[1, H*W, C]``: timm's ``resample_abs_pos_embed`` by default
    (bicubic, ``align_corners=False``, antialiased: matters when shrinking).

    ``mode``, ``antialias``, ``align_corners``: ``F.interpolate``'s. ``ar_preserving``: resample to the square
    ``L x L``, ``L = max(H, W)``, and keep its top-left ``H x W`` (timm NaFlexVit's ``pos_embed_ar_preserving``: rows
    and columns on one scale whatever the aspect ratio). Computed in float32 (float64 for float64 input) and returned in
    ``pe``'s dtype; the table itself on its own grid. Differentiable.
    """
    old_grid, new_grid = as_grid(old_grid), as_grid(new_grid)
    if pe.dim() != 3 or pe.shape[1] != old_grid.n:
        raise ValueError(f"pos_embed {tuple(pe.shape)} does not match grid {tuple(old_grid)} ([1, {old_grid.n}, C])")
    if mode not in INTERP_MODES:
        raise ValueError(f"resample mode {mode!r} is not one of {INTERP_MODES}")
    if isinstance(new_grid.h, int) and isinstance(new_grid.w, int) and old_grid == new_grid:
        return pe  # (with symbolic sizes the resampling runs: the identity there, but for ar_preserving off a square)
    c = pe.shape[-1]
    work = torch.float64 if pe.dtype == torch.float64 else torch.float32
    img = pe.to(work).reshape(pe.shape[0], old_grid.h, old_grid.w, c).permute(0, 3, 1, 2)
    side = torch.sym_max(new_grid.h, new_grid.w)
    size = (side, side) if ar_preserving else tuple(new_grid)
    img = F.interpolate(img, size=size, mode=mode, align_corners=align_corners, antialias=antialias)
    if ar_preserving:  # (a copy: a traced reshape of the cut would guard on whether it is a view, side == W)
        img = img[:, :, : new_grid.h, : new_grid.w].clone(memory_format=torch.contiguous_format)
    return img.permute(0, 2, 3, 1).reshape(pe.shape[0], new_grid.n, c).to(pe.dtype)


def resample_time_embed(pe: Tensor, frames: int) -> Tensor:
    """Linear resample of a 1-D table ``[1, T, C]`` (a temporal table, ``ape_factored``'s rows or columns) to
    ``[1, frames, C]`` (``align_corners=False``, no antialias), computed in float32 (float64 for float64 input),
    returned in ``pe``'s dtype; the table itself at its own length. Differentiable."""
    if isinstance(frames, int) and pe.shape[1] == frames:
        return pe
    work = torch.float64 if pe.dtype == torch.float64 else torch.float32
    out = F.interpolate(pe.to(work).transpose(1, 2), size=frames, mode="linear", align_corners=False)
    return out.transpose(1, 2).to(pe.dtype)


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


def sincos1d_embed(
    grid: Grid | Grid3, embed_dim: int, temperature: float = 10000.0, dtype: torch.dtype = torch.float64
) -> Tensor:
    """``[1, N, C]`` over the raster index ``p`` of the grid's ``N`` patches (``p = r * W + c``; t-major on a video
    grid): ``e(p)[2i] = sin(p w_i)``, ``e(p)[2i+1] = cos(p w_i)``, ``w_i = T^(-2i/C)`` (VideoMAE's table)."""
    if embed_dim % 2 or embed_dim < 2:
        raise ValueError(f"sincos1d needs an even embed_dim, got embed_dim={embed_dim}")
    p = torch.arange(as_grid(grid).n, dtype=dtype)  # tokens are in raster order: token k is at index k
    omega = temperature ** (-torch.arange(0, embed_dim, 2, dtype=dtype) / embed_dim)
    a = p[:, None] * omega
    return torch.stack((a.sin(), a.cos()), dim=-1).flatten(1)[None]


def _sincos1d(x: Tensor, dim: int, temperature: float) -> Tensor:
    """``[sin(x omega), cos(x omega)]``, ``omega_k = T^(-k/(dim/2))``: ``[len(x), dim]``."""
    omega = temperature ** (-torch.arange(dim // 2, dtype=x.dtype) / (dim / 2))
    a = x[:, None] * omega
    return torch.cat((a.sin(), a.cos()), dim=-1)


def sincos3d_space_channels(embed_dim: int) -> int:
    """The channels of the column block and of the row block of :func:`sincos3d_embed`: ``2 floor(3C/16)``."""
    space = 2 * (3 * embed_dim // 16)
    if embed_dim % 2 or space == 0:
        raise ValueError(f"sincos3d needs an even embed_dim of at least 6, got embed_dim={embed_dim}")
    return space


def sincos3d_embed(
    grid: Grid3, embed_dim: int, temperature: float = 10000.0, dtype: torch.dtype = torch.float64
) -> Tensor:
    """``[1, T*H*W, C]`` with ``e(t, h, w) = [s(t; C - 2n), s(w; n), s(h; n)]``, ``n = 2 floor(3C/16)`` (``3C/8`` for
    ``C % 16 == 0``), ``s(x; m)`` the ``m``-channel ``[sin, cos]`` block (see the module docstring)."""
    space = sincos3d_space_channels(embed_dim)
    grid = as_grid3(grid)
    t, r, c = (a.to(dtype) for a in patch_coords3(grid))
    time = _sincos1d(t, embed_dim - 2 * space, temperature)
    parts = (time, _sincos1d(c, space, temperature), _sincos1d(r, space, temperature))
    return torch.cat(parts, dim=-1)[None]


# ---------------------------------------------------------------------------- modules
@register_pos("ape")
class Ape(PositionScheme):
    """Learned absolute embedding ``pos_embed [1, H*W, C]`` for the grid it is built for; on a video grid
    ``(T, H, W)`` plus ``pos_embed_temporal [1, T, C]`` (separable, see the module docstring).

    On another grid at call time the tables are resampled (bicubic in space, linear in time); a checkpoint of
    another grid is resampled to this module's grid when loaded (with a warning): from the grid it was saved at where
    the loader knows it (:meth:`state_from`: ``vitrel.load_model``, ``set_input_size``), else inferred from its
    length (see :func:`infer_grid`).
    """

    kind = "absolute"
    family = "absolute"
    #: image grids (the image table) or video grids (a separable table)
    grid_dims = None
    no_weight_decay_keys = ("pos_embed",)

    def __init__(
        self,
        *,
        init_std: float = 0.02,
        table_grid: Any = None,
        interp_mode: str = "bicubic",
        antialias: bool = True,
        align_corners: bool = False,
        ar_preserving: bool = False,
        **kw,
    ) -> None:
        super().__init__(**kw)
        self.init_std = check_init_std(self.name, init_std)
        if interp_mode not in INTERP_MODES:
            raise ValueError(f"{self.name}: interp_mode={interp_mode!r} is not one of {INTERP_MODES}")
        self.interp_mode, self.antialias, self.align_corners = interp_mode, antialias, align_corners
        self.ar_preserving = ar_preserving
        if table_grid is not None and self.video:
            raise ValueError(f"{self.name}: table_grid is for image grids; a video table is built on the model's grid")
        self.table_grid = None if table_grid is None else as_grid(table_grid)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.space.n, self.embed_dim))
        if self.video:
            self.pos_embed_temporal = nn.Parameter(torch.zeros(1, self.grid.t, self.embed_dim))
        self.reset_parameters()

    @property
    def video(self) -> bool:
        """Built on a video grid: the temporal table ``pos_embed_temporal`` exists."""
        return isinstance(self.grid, Grid3)

    @property
    def resample(self) -> dict[str, Any]:
        """The table's resampling options, :func:`resample_pos_embed`'s keywords."""
        return {
            "mode": self.interp_mode,
            "antialias": self.antialias,
            "align_corners": self.align_corners,
            "ar_preserving": self.ar_preserving,
        }

    @property
    def size_branches(self) -> bool:  # type: ignore[override]
        """``ar_preserving`` on a non-square table: the table is used as stored on its own grid (timm's NaFlexVit), a
        traced program resamples it there."""
        return self.ar_preserving and self.space.h != self.space.w

    @property
    def space(self) -> Grid:
        """The spatial table's grid: ``table_grid``, else the built grid's (its space on a video grid)."""
        if self.table_grid is not None:
            return self.table_grid
        return self.grid.space if self.video else self.grid

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=self.init_std)
        if self.video:
            nn.init.trunc_normal_(self.pos_embed_temporal, std=self.init_std)

    def _call_grid(self, grid: Grid | Grid3) -> Grid | Grid3:
        g = as_grid(grid)
        if self.video:
            return as_grid3(g)
        if isinstance(g, Grid3):
            raise ValueError(
                f"ape built on the image grid {grid_str(self.grid)} has no time: build it on a video grid (T, H, W) "
                f"for the tokens of {grid_str(g)}"
            )
        return g

    def embed(self, grid: Grid | Grid3) -> Tensor:
        """The table for ``grid`` ``[1, H*W, C]`` or ``[1, T*H*W, C]`` (the parameter itself on a built image grid)."""
        g = self._call_grid(grid)
        if not self.video:
            return resample_pos_embed(self.pos_embed, self.space, g, **self.resample)
        space = resample_pos_embed(self.pos_embed, self.space, g.space, **self.resample)
        time = resample_time_embed(self.pos_embed_temporal, g.t)
        return (time[:, :, None, :] + space[:, None, :, :]).flatten(1, 2)

    def add_to_tokens(self, x: Tensor, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> Tensor:
        return add_patch_embed(x, self.embed(grid), self._call_grid(grid), num_prefix_tokens)

    def state_from(self, state: dict[str, Tensor], stored: PositionScheme) -> dict[str, Tensor]:
        """The stored spatial table resampled from ``stored``'s grid (timm's ``resample_abs_pos_embed`` with
        ``old_size``): its length alone does not tell ``8 x 12`` from ``12 x 8`` (nor ``4 x 16`` from ``8 x 8``)."""
        pe, old = state.get("pos_embed"), getattr(stored, "space", None)
        if pe is None or old is None or tuple(old) == tuple(self.space) or pe.shape[1] != old.n:
            return state
        warn_once(
            f"resampled absolute position embedding from grid {grid_str(old)} to {grid_str(self.space)} "
            f"({self.resample['mode']})"
        )
        return {**state, "pos_embed": resample_pos_embed(pe, old, self.space, **self.resample)}

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
            old = infer_grid(src.shape[1], self.space)
            state_dict[key] = resample_pos_embed(src, old, self.space, **self.resample)
            warn_once(
                f"resampled absolute position embedding {key} from grid {old.h}x{old.w} to "
                f"{self.space.h}x{self.space.w} ({self.resample['mode']})"
            )
        key = prefix + "pos_embed_temporal"
        src = state_dict.get(key)
        if self.video and src is not None and src.dim() == 3 and src.shape[1] != self.grid.t:
            state_dict[key] = resample_time_embed(src, self.grid.t)
            warn_once(f"resampled {key} from {src.shape[1]} to {self.grid.t} frames (linear)")
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        table = "" if self.table_grid is None else f", table_grid={grid_str(self.table_grid)}"
        changed = "".join(f", {k}={getattr(self, k)!r}" for k, v in RESAMPLE_DEFAULTS.items() if getattr(self, k) != v)
        return f"{super().extra_repr()}, embed_dim={self.embed_dim}{table}{changed}"


class _SincosEmbed(GridBuffers, PositionScheme):
    """A fixed sin-cos embedding: the built grid's as a non-persistent buffer, any other computed at call time."""

    kind = "absolute"
    family = "absolute"
    #: ``embed_dim`` must be a multiple of it
    _divisor = 4

    def __init__(self, *, temperature: float = 10000.0, **kw) -> None:
        super().__init__(**kw)
        if self.embed_dim % self._divisor:
            raise ValueError(
                f"{self.name} needs embed_dim divisible by {self._divisor}, got embed_dim={self.embed_dim}"
            )
        if not temperature > 0:
            raise ValueError(f"{self.name} needs temperature > 0, got {temperature}")
        self.temperature = float(temperature)
        self.init_non_persistent_buffers()

    def _table(self, grid: Grid | Grid3) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def _init_buffers(self) -> None:
        """``built_embed``: the embedding of the built grid (float32 unless the module was converted)."""
        like = self._like("built_embed") or {"dtype": torch.float32}
        self.register_buffer("built_embed", self._table(self.grid).to(**like), persistent=False)

    def embed(self, grid: Grid, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[1, N, C]`` for ``grid``, computed in float64 then cast."""
        return self._table(as_grid(grid)).to(device=device, dtype=dtype)

    def add_to_tokens(self, x: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        pe = self.built_embed
        if not (
            concrete_grid(grid) and tuple(grid) == tuple(self.grid) and pe.dtype == x.dtype and pe.device == x.device
        ):
            pe = self._table(grid).to(device=x.device, dtype=x.dtype)
        return add_patch_embed(x, pe, grid, num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, embed_dim={self.embed_dim}, temperature={self.temperature}"


@register_pos("sincos2d")
class Sincos2d(_SincosEmbed):
    """Fixed 2-D sin-cos embedding (rows in the first half of the channels, columns in the second)."""

    def _table(self, grid: Grid) -> Tensor:
        return sincos2d_embed(grid, self.embed_dim, self.temperature)


@register_pos("sincos3d")
class Sincos3d(_SincosEmbed):
    """Fixed 3-D sin-cos embedding on video grids: time on the first quarter of the channels, then columns, then rows
    (see the module docstring); an image grid is one frame. ``embed_dim`` even, at least 6."""

    grid_dims = 3
    _divisor = 2

    def _table(self, grid: Grid3) -> Tensor:
        return sincos3d_embed(grid, self.embed_dim, self.temperature)

    def add_to_tokens(self, x: Tensor, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> Tensor:
        return super().add_to_tokens(x, self.check_grid(grid), num_prefix_tokens)


@register_pos("sincos1d")
class Sincos1d(_SincosEmbed):
    """Fixed 1-D sinusoid over the raster index of the patches (VideoMAE's ``get_sinusoid_encoding_table``), sin and
    cos interleaved; image grids ``(H, W)`` and video grids ``(T, H, W)`` alike, each its own raster. ``embed_dim``
    even."""

    #: image or video grids, as given: either is a raster of ``N`` tokens
    grid_dims = None
    #: a token's raster index ``r * W + c`` depends on the grid's width
    depends_on_extent = True
    _divisor = 2

    def _table(self, grid: Grid | Grid3) -> Tensor:
        return sincos1d_embed(grid, self.embed_dim, self.temperature)

    def add_to_tokens(self, x: Tensor, grid: Grid | Grid3, num_prefix_tokens: int = 0) -> Tensor:
        return super().add_to_tokens(x, self.check_grid(grid), num_prefix_tokens)
