"""The picture of a packed NaFlex batch (:func:`plot_packed_batch`, also ``vitrel.viz.plot_packed_batch``): its rows'
tokens by image, the images put back together and the attention mask or a scheme's bias inside it."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from vitrel.figures import as_image, hide_ticks, new_figure
from vitrel.pos.base import PositionScheme

__all__ = ["plot_packed_batch"]


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
