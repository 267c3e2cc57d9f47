"""The pictures of token layouts: a packed NaFlex batch (:func:`plot_packed_batch`, also
``vitrel.viz.plot_packed_batch``: its rows' tokens by image, the images put back together and the attention mask or a
scheme's bias inside it) and Swin's windows (:func:`plot_swin_windows`, also ``vitrel.viz.plot_swin_windows``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from vitrel.figures import as_image, hide_ticks, new_figure
from vitrel.layout.geometry import Grid3, as_grid
from vitrel.pos.base import PositionScheme

__all__ = ["plot_packed_batch", "plot_swin_windows"]


def plot_packed_batch(
    batch: Mapping[str, Tensor],
    scheme: PositionScheme | None = None,
    num_prefix_tokens: int = 1,
    row: int = 0,
    patch_size: int | None = None,
    title: str | None = None,
):
    """A packed NaFlex batch (timm's dict with ``segment_ids``) and its attention: each row's tokens coloured by
    image (prefix tokens darker, padding grey), the images of row ``row`` put back together from their patches (with
    ``patch_size``, else skipped), and row ``row``'s attention mask (a block per image; padding sees padding) or, with
    a ``scheme`` (built with ``num_prefix_tokens``), its bias inside the mask, head-mean."""
    from matplotlib.colors import ListedColormap

    from vitrel.layout.tokens import segment_mask
    from vitrel.models.naflex import parse_naflex, with_prefix

    nb = parse_naflex(batch)
    zeros = nb.patches.new_zeros(*nb.patches.shape[:2], 1)
    _, layout, _ = with_prefix(zeros, nb, zeros.new_zeros(num_prefix_tokens, 1) if num_prefix_tokens else None)
    img = layout.image.cpu().numpy()
    shown = np.where(img < 0, 0, 2 + img % 5)  # grey padding, a colour per image
    shown[~layout.is_patch.cpu().numpy() & (img >= 0)] = 1  # prefix tokens: black
    mask = segment_mask(layout, torch.float32)[row, 0]
    what = "mask (white: attends)"
    if scheme is not None and scheme.has_bias:  # (a scheme with no bias adds nothing to the mask)
        st = scheme.prepare(layout, num_prefix_tokens, None, torch.float32)
        mask = (st.bias[row].mean(0) if st.bias.shape[1] > 1 else st.bias[row, 0]).detach()
        what = f"{scheme.name} bias, head mean"
    in_row = [i for i in range(nb.num_images) if bool((nb.image[row] == i).any())]
    draw_images = patch_size is not None and in_row
    fig = new_figure(9.0, 3.2)
    axes = fig.subplots(1, 3 if draw_images else 2, width_ratios=[2, 1, 1.2] if draw_images else [2, 1.2])
    palette = ListedColormap(["#bbbbbb", "#111111", "#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"])
    axes[0].imshow(shown, cmap=palette, vmin=0, vmax=palette.N - 1, aspect="auto", interpolation="nearest")
    for r in range(1, shown.shape[0]):
        axes[0].axhline(r - 0.5, color="white", linewidth=2)
    axes[0].set_yticks(range(shown.shape[0]))
    axes[0].set_xlabel("token", fontsize=7)
    axes[0].set_ylabel("row", fontsize=7)
    axes[0].set_title(f"{nb.num_images} images in {shown.shape[0]} rows (black: prefix, grey: padding)", fontsize=8)
    if draw_images:
        ax = axes[1]
        pieces = []
        for i in in_row:
            g, sel = nb.image_grids[i], nb.image[row] == i
            c = nb.patches.shape[-1] // patch_size**2
            canvas = torch.zeros(g.h * patch_size, g.w * patch_size, c)
            for (r, col), p in zip(nb.coords[row, sel].tolist(), nb.patches[row, sel].float().cpu()):
                ps = patch_size
                canvas[r * ps : (r + 1) * ps, col * ps : (col + 1) * ps] = p.reshape(ps, ps, c)
            pieces.append(as_image(canvas.permute(2, 0, 1)))
        h = max(p.shape[0] for p in pieces)
        gap = np.ones((h, 2) + pieces[0].shape[2:])
        strip = np.concatenate(
            [x for p in pieces for x in (np.pad(p, [(0, h - p.shape[0])] + [(0, 0)] * (p.ndim - 1)), gap)], 1
        )
        ax.imshow(strip, cmap="gray" if strip.ndim == 2 else None)
        ax.set_title(f"row {row}: its images at their own sizes", fontsize=8)
        hide_ticks(ax)
    ax = axes[-1]
    m = mask.float().cpu().numpy()
    if scheme is None:
        ax.imshow(np.where(np.isinf(m), 0.0, 1.0), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    else:
        ax.imshow(np.where(np.isinf(m), np.nan, m), cmap="viridis", interpolation="nearest")
    ax.set_facecolor("black")
    ax.set_title(f"row {row}: {what}", fontsize=8)
    hide_ticks(ax)
    fig.suptitle(title or "a packed batch: tokens carry their image and coordinates", fontsize=9)
    return fig


def plot_swin_windows(grid: Any, window: Any = 7, title: str | None = None):
    """Swin's windows on an ``H x W`` map of patches, plain and shifted (Swin paper, figure 2): each patch coloured by
    its group, the patches it attends to in that block (:func:`~vitrel.layout.windows.window_groups`: the
    windows' regions, read back from their :class:`~vitrel.layout.tokens.TokenLayout`), the window edges drawn. With a
    shift, the windows at the map's edges hold parts of several windows of the rolled map, which do not see each
    other; a map that is not a multiple of the window is padded at the bottom and right."""
    from vitrel.layout.windows import window_and_shift, window_groups

    if isinstance(grid, nn.Module):  # (not its repr in as_grid's message)
        raise TypeError(f"plot_swin_windows takes a map size (H, W) and a window, got a {type(grid).__name__}")
    grid = as_grid(grid)
    window = (window, window) if isinstance(window, int) else tuple(window)
    if isinstance(grid, Grid3) or len(window) != 2:  # a Video Swin's (T, H, W) map or (Wt, Wh, Ww) window
        h, w = grid[-2:]
        wh, ww = window[-2:]
        raise ValueError(
            f"plot_swin_windows draws an image map (H, W) and window (Wh, Ww), got {tuple(grid)} and {window}: a Video "
            f"Swin's windows cut every frame alike in space: draw one frame's, plot_swin_windows(({h}, {w}), "
            f"({wh}, {ww}))"
        )
    fig = new_figure(7.0, 3.4 * grid.h / max(grid.w, 1) + 0.6)
    for ax, shifted in zip(fig.subplots(1, 2), (False, True)):
        groups = window_groups(grid, window, shifted)
        win, shift = window_and_shift(grid, window, shifted)
        ax.imshow(groups.numpy() % 20, cmap="tab20", vmin=0, vmax=19, interpolation="nearest")
        for r in range(shift[0] % win[0] or win[0], grid.h, win[0]):
            ax.axhline(r - 0.5, color="k", lw=1.5)
        for c in range(shift[1] % win[1] or win[1], grid.w, win[1]):
            ax.axvline(c - 0.5, color="k", lw=1.5)
        hide_ticks(ax)
        kind = f"shifted by {shift}" if shifted else "plain"
        ax.set_title(f"{kind}: {int(groups.max()) + 1} groups", fontsize=8)
    fig.suptitle(title or f"Swin windows {window[0]}x{window[1]} on a {grid.h}x{grid.w} map", fontsize=9)
    return fig
