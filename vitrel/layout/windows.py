"""Swin's windows as a token layout: partition, shift, the regions a shifted window holds, and their masks.

Shifted windows and the mask. The windows of a shifted block are those of the image partitioned
with an offset ``s``: along each axis, row ``r`` lies in window ``floor((r - s) / M)``. They are
computed as plain windows of the map rolled by ``-s``, which puts the first ``s`` rows (columns)
after the last ones; the last window then straddles the wrap-around seam. Along each axis a
position of the rolled map gets a label: 1 if it wrapped around, 2 if it is padding, 0 otherwise;
two tokens of a window may attend to each other only when their labels agree on both axes
(``-inf`` otherwise, so attention across the seam is exactly 0).

The windows are a :class:`~vitrel.layout.tokens.TokenLayout` (:meth:`~vitrel.layout.tokens.TokenLayout.windows`), the
layout type of the ViT's packed images: each window a row, its regions (the label pairs) images of the window's grid
with the other regions' tokens dropped. Attention takes it as its mask (``attn(windows, mask=layout, ...)``): the
fused kernel reads the regions per window and masks in the kernel; the other kernels read the float mask it lowers
to (:func:`shifted_window_mask`). The block's window attention is :func:`vitrel.models.swin_blocks.window_attention`.

Window size per stage is set from the grid the stage actually sees at forward time: a stage whose
grid is no larger than the window uses a window the size of the grid and no shift (timm's rule).
A grid that is not a multiple of the window is padded at the bottom/right *before* the roll, so the
windows stay exactly ``floor((r - s) / M)``, and padded positions are masked out of attention.
(timm rolls before padding and lets tokens attend to the zero padding.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from vitrel.layout.geometry import Grid
from vitrel.layout.tokens import TokenLayout, segment_mask

__all__ = [
    "NUM_REGIONS",
    "floor_mod",
    "mixed_states",
    "shifted_window_mask",
    "stage_window",
    "symbolic_map",
    "unwindow",
    "window_and_shift",
    "window_groups",
    "window_layout",
    "window_partition",
    "window_positions",
    "window_regions",
    "window_reverse",
]

T = TypeVar("T")


def window_and_shift(grid: Grid, window: tuple[int, int], shifted: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """Window and shift for a stage grid: the window shrinks to the grid, no shift when it covers it."""
    win = (min(window[0], grid.h), min(window[1], grid.w))
    if not shifted:
        return win, (0, 0)
    shift = (0 if grid.h <= win[0] else win[0] // 2, 0 if grid.w <= win[1] else win[1] // 2)
    return win, shift


def window_partition(x: Tensor, window: tuple[int, int]) -> Tensor:
    """``[B, H, W, C]`` (H, W multiples of the window) -> ``[B * nW, wh * ww, C]``, windows in raster order."""
    b, h, w, c = x.shape
    wh, ww = window
    x = x.view(b, h // wh, wh, w // ww, ww, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, wh * ww, c)


def window_reverse(windows: Tensor, window: tuple[int, int], h: int, w: int) -> Tensor:
    """Inverse of :func:`window_partition`: ``[B * nW, wh * ww, C]`` -> ``[B, H, W, C]``."""
    wh, ww = window
    c = windows.shape[-1]
    x = windows.view(-1, h // wh, w // ww, wh, ww, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, h, w, c)


def window_positions(h: int, w: int, window: tuple[int, int], shift: tuple[int, int]) -> Tensor:
    """Image position (``r * w + c``, -1 for padding) of every slot of every window ``[nW, wh * ww]`` of the
    ``h x w`` map padded to multiples of ``window`` and rolled by ``-shift`` (:func:`window_partition` order)."""
    hp, wp = h + (-h) % window[0], w + (-w) % window[1]
    src_r = (torch.arange(hp) + shift[0]) % hp
    src_c = (torch.arange(wp) + shift[1]) % wp
    src_r = torch.where(src_r < h, src_r, -1)
    src_c = torch.where(src_c < w, src_c, -1)
    pos = torch.where((src_r[:, None] >= 0) & (src_c[None, :] >= 0), src_r[:, None] * w + src_c[None, :], -1)
    return window_partition(pos.view(1, hp, wp, 1), window)[..., 0]


def _axis_labels(n: int, n_pad: int, shift: int | Tensor, device: torch.device | None = None) -> Tensor:
    """Label of each position ``r'`` of a padded (to ``n_pad``) then rolled (by ``-shift``) axis:
    2 for padding (image position ``(r' + shift) mod n_pad >= n``), 1 for the positions that wrapped
    around (``r' >= n_pad - shift``), 0 otherwise. ``shift`` may be a 0-d tensor (sizes unknown at trace time)."""
    r = torch.arange(n_pad, device=device)
    lab = (r >= n_pad - shift).long()
    return torch.where(floor_mod(r + shift, n_pad) >= n, 2, lab)


def floor_mod(x: Tensor, n: int) -> Tensor:
    """``x mod n`` (Python's sign rule) as ``x - floor(x / n) n``: exports (ONNX too) with a symbolic ``n``."""
    return x - (x // n) * n


#: region ids of a window slot: 3 row labels x 3 column labels (:func:`_axis_labels`)
NUM_REGIONS = 9


def window_regions(
    grid: Grid, window: tuple[int, int], shift: tuple[int, int], device: torch.device | None = None
) -> Tensor | None:
    """Region id ``[nW, n]`` (row label ``* 3 +`` column label, :func:`_axis_labels`) of every slot of the windows
    of a map padded to multiples of ``window`` and then rolled by ``-shift`` (:func:`window_partition` order): two
    slots of a window may attend to each other when their ids agree. None when nothing needs masking (no shift,
    no padding)."""
    wh, ww = window
    hp, wp = -(-grid.h // wh) * wh, -(-grid.w // ww) * ww
    if not any(shift) and (hp, wp) == tuple(grid):
        return None
    lh, lw = _axis_labels(grid.h, hp, shift[0], device), _axis_labels(grid.w, wp, shift[1], device)
    return window_partition((lh[:, None] * 3 + lw[None, :])[None, :, :, None], window)[..., 0]


def window_layout(regions: Tensor | None, window: tuple[int, int]) -> TokenLayout | None:
    """The :class:`~vitrel.layout.tokens.TokenLayout` of the windows whose slots have the ``regions`` ids
    (:func:`window_regions`), which attention reads as its mask; None for None."""
    return None if regions is None else TokenLayout.windows(regions, Grid(*window), NUM_REGIONS)


def window_groups(grid: Grid, window: tuple[int, int], shifted: bool) -> Tensor:
    """``[H, W]`` long: the group of each position of the map, the tokens it attends to and is attended by in a
    (shifted) block (``window`` shrunk to the grid, the shift as :func:`window_and_shift`), numbered ``0, 1, ...`` in
    raster order of their first position: a window's region read back onto the map from the windows' layout
    (:func:`window_positions`, :func:`window_regions`). What :func:`vitrel.viz.plot_swin_windows` draws."""
    win, shift = window_and_shift(grid, window, shifted)
    pos = window_positions(grid.h, grid.w, win, shift)  # [nW, n]: image position, -1 for padding
    regions = window_regions(grid, win, shift)
    ids = torch.arange(pos.shape[0])[:, None] * NUM_REGIONS + (0 if regions is None else regions)
    group = torch.empty(grid.h * grid.w, dtype=torch.long)
    group[pos[pos >= 0]] = ids.expand_as(pos)[pos >= 0]
    first = torch.full((int(group.max()) + 1,), grid.h * grid.w, dtype=torch.long).scatter_reduce(
        0, group, torch.arange(grid.h * grid.w), "amin"
    )
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(len(first))
    return rank[group].view(grid.h, grid.w)


def shifted_window_mask(
    grid: Grid, window: tuple[int, int], shift: tuple[int, int], device: torch.device | None = None
) -> Tensor | None:
    """Additive mask ``[nW, n, n]`` (0 / ``-inf``) of the windows of a map padded to multiples of
    ``window`` and then rolled by ``-shift``; None when nothing needs masking (no shift, no padding): the float
    mask the windows' layout lowers to (:func:`~vitrel.layout.tokens.segment_mask` of :func:`window_layout`).

    Windows are in :func:`window_partition` order. A block keeps the regions of the grid it is built for
    as a buffer (``SwinBlock.window_regions``); other grids compute them in the forward pass.
    """
    layout = window_layout(window_regions(grid, window, shift, device), window)
    return None if layout is None else segment_mask(layout, torch.get_default_dtype())[:, 0]


def symbolic_map(x: Tensor) -> bool:
    """The map's height or width is symbolic (``torch.export`` / ``torch.compile`` with dynamic sizes)."""
    return not isinstance(x.shape[1], int) or not isinstance(x.shape[2], int)


def unwindow(windows: Tensor, grid: Grid, win: tuple[int, int], shift: tuple[int, int]) -> Tensor:
    """Inverse of ``SwinBlock.windows``: windows ``[B nW, n, C]`` of the ``grid`` map (padded to multiples of
    ``win``, rolled by ``-shift``) -> the map ``[B, h, w, C]`` (rolled back, the padding cut)."""
    h, w = grid
    out = window_reverse(windows, win, h + (-h) % win[0], w + (-w) % win[1])
    if any(shift):
        out = torch.roll(out, shifts=shift, dims=(1, 2))
    if out.shape[1] != h or out.shape[2] != w:
        out = out[:, :h, :w]
    return out


def stage_window(x: Tensor, window: tuple[int, int]) -> Grid:
    """The window grid of the map ``x [B, H, W, C]``: the window, shrunk to a smaller map; the full window
    when the sizes are symbolic (see :func:`~vitrel.models.swin_blocks.window_attention` of symbolic sizes)."""
    if symbolic_map(x):
        return Grid(*window)
    return Grid(*window_and_shift(Grid(x.shape[1], x.shape[2]), window, False)[0])


def mixed_states(prepare: Callable[[Tensor], T], maps: Sequence[Tensor], window: tuple[int, int]) -> dict[Grid, T]:
    """``prepare`` (a function of one image's map, e.g. a stage's ``position_states``) once per distinct window grid
    of the maps ``[1, h_i, w_i, C]`` (an image's window: ``window`` shrunk to its grid, as alone), keyed by that
    window grid."""
    out: dict[Grid, T] = {}
    for m in maps:
        win = stage_window(m, window)
        if win not in out:
            out[win] = prepare(m)
    return out
