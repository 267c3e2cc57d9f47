"""Video Swin's 3-D windows: partition of a ``T x H x W`` map into ``Wt x Wh x Ww`` windows, the shift, and the mask.

The 2-D rules of :mod:`vitrel.layout.windows`, on three axes (Liu et al., "Video Swin Transformer", 2022; the
authors' ``mmaction/models/backbones/swin_transformer.py``: ``get_window_size``, ``window_partition``,
``compute_mask``):

* per axis, a window no smaller than the map's side shrinks to it and that axis is not shifted
  (:func:`window_and_shift3`, the authors' ``get_window_size``);
* the map is padded at the end of each axis to a multiple of the window, then rolled by ``-shift``
  (shift ``W // 2`` per axis in every second block), then cut into windows, frames-major
  (:func:`window_partition3`; tokens of a window t-major, ``(t Wh + h) Ww + w``);
* two tokens of a window attend to each other only when their labels agree on all three axes: per axis 1 for the
  positions that wrapped around, 2 for padding, 0 otherwise (:func:`window_regions3`: ``27`` regions). The authors'
  ``compute_mask`` labels the wrapped slices alike; it lets tokens attend to the zero padding, which vitrel masks out
  (as its 2-D windows do), so a clip gives the same output at any padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrel.device_cache import per_device
from vitrel.layout.geometry import Grid3
from vitrel.layout.windows import _axis_labels

__all__ = [
    "NUM_REGIONS3",
    "window_and_shift3",
    "window_partition3",
    "window_reverse3",
    "window_regions3",
    "window_mask3",
    "windows3",
    "unwindow3",
]

Window3 = tuple[int, int, int]

#: region ids of a window slot: 3 labels per axis, 3 axes
NUM_REGIONS3 = 27


def window_and_shift3(grid: Grid3, window: Window3, shifted: bool) -> tuple[Window3, Window3]:
    """Window and shift for a stage grid, per axis: the window shrinks to a side no larger than it, and that axis is
    not shifted; otherwise the shift is ``window // 2`` in a shifted block (the authors' ``get_window_size``)."""
    win = tuple(min(w, g) for w, g in zip(window, grid))
    if not shifted:
        return win, (0, 0, 0)  # type: ignore[return-value]
    return win, tuple(0 if g <= w else w // 2 for w, g in zip(win, grid))  # type: ignore[return-value]


def window_partition3(x: Tensor, window: Window3) -> Tensor:
    """``[B, T, H, W, C]`` (sides multiples of the window) -> ``[B nW, Wt Wh Ww, C]``, windows t-major, tokens of a
    window t-major."""
    b, t, h, w, c = x.shape
    wt, wh, ww = window
    x = x.view(b, t // wt, wt, h // wh, wh, w // ww, ww, c).permute(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(-1, wt * wh * ww, c)


def window_reverse3(windows: Tensor, window: Window3, t: int, h: int, w: int) -> Tensor:
    """Inverse of :func:`window_partition3`: ``[B nW, Wt Wh Ww, C]`` -> ``[B, T, H, W, C]``."""
    wt, wh, ww = window
    c = windows.shape[-1]
    x = windows.view(-1, t // wt, h // wh, w // ww, wt, wh, ww, c).permute(0, 1, 4, 2, 5, 3, 6, 7)
    return x.reshape(-1, t, h, w, c)


def _padded(grid: Grid3, window: Window3) -> Window3:
    return tuple(-(-g // w) * w for g, w in zip(grid, window))  # type: ignore[return-value]


def window_regions3(grid: Grid3, window: Window3, shift: Window3, device: torch.device | None = None) -> Tensor | None:
    """Region id ``[nW, n]`` (``(label_t * 3 + label_h) * 3 + label_w``) of every slot of the windows of the map padded
    to multiples of ``window`` and rolled by ``-shift`` (:func:`window_partition3` order); None when nothing needs
    masking (no shift, no padding)."""
    padded = _padded(grid, window)
    if not any(shift) and padded == tuple(grid):
        return None
    lt, lh, lw = (_axis_labels(g, p, s, device) for g, p, s in zip(grid, padded, shift))
    ids = (lt[:, None, None] * 3 + lh[None, :, None]) * 3 + lw[None, None, :]
    return window_partition3(ids[None, ..., None], window)[..., 0]


@per_device(maxsize=32)
def window_mask3(
    t: int, h: int, w: int, window: Window3, shift: Window3, device: torch.device | None = None
) -> Tensor | None:
    """Additive mask ``[nW, n, n]`` (float32, 0 / ``-inf``) of the windows of the ``t x h x w`` map (padded to
    multiples of ``window``, rolled by ``-shift``): ``-inf`` between slots whose regions differ
    (:func:`window_regions3`); None when nothing needs masking. Cached per arguments."""
    regions = window_regions3(Grid3(t, h, w), window, shift, device)
    if regions is None:
        return None
    differ = regions[:, :, None] != regions[:, None, :]
    return torch.zeros(differ.shape, device=device).masked_fill(differ, float("-inf"))


def windows3(x: Tensor, window: Window3, shifted: bool) -> tuple[Tensor, Grid3, Window3, Window3, Tensor | None]:
    """The windows of a map ``x [B, T, H, W, C]``: (windows ``[B nW, n, C]`` of the map padded to multiples of the
    window and rolled by ``-shift``, the map's grid, the window, the shift, the windows' mask ``[nW, n, n]`` or None);
    :func:`unwindow3` puts them back."""
    _, t, h, w, _ = x.shape
    grid = Grid3(t, h, w)
    win, shift = window_and_shift3(grid, window, shifted)
    pt, ph, pw = (p - g for p, g in zip(_padded(grid, win), grid))
    if pt or ph or pw:
        x = F.pad(x, (0, 0, 0, pw, 0, ph, 0, pt))
    if any(shift):
        x = torch.roll(x, shifts=tuple(-s for s in shift), dims=(1, 2, 3))
    return window_partition3(x, win), grid, win, shift, window_mask3(t, h, w, win, shift, x.device)


def unwindow3(windows: Tensor, grid: Grid3, win: Window3, shift: Window3) -> Tensor:
    """Inverse of :func:`windows3`: windows ``[B nW, n, C]`` -> the map ``[B, T, H, W, C]`` (rolled back, the padding
    cut)."""
    out = window_reverse3(windows, win, *_padded(grid, win))
    if any(shift):
        out = torch.roll(out, shifts=shift, dims=(1, 2, 3))
    if tuple(out.shape[1:4]) != tuple(grid):
        out = out[:, : grid.t, : grid.h, : grid.w]
    return out
