"""How far each head looks: the mean attention distance of a ViT (:func:`attention_distance`, also
``vitrel.viz.attention_distance``) and its picture, one dot per head against depth (:func:`plot_attention_distance`),
the analysis of Dosovitskiy et al. 2021 (Fig. 7) and Raghu et al. 2021.

For block ``l`` and head ``h``, with ``a_ij`` the attention probability of query patch ``i`` for key patch ``j`` and
``c_i`` the centre of patch ``i`` in input pixels::

    D[l, h] = mean over images and query patches i of  sum over key patches j of  a_ij * ||c_i - c_j||

Prefix tokens (class, registers) are left out as queries and as keys, and the weights are not renormalised over the
patches (the Keras example "Investigating Vision Transformer representations", ``compute_mean_attention_dist``): a
head that attends to the class token contributes that mass at distance 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from vitrel.figures import new_figure
from vitrel.layout.geometry import Grid

__all__ = ["attention_distance", "check_global_vit", "plot_attention_distance"]


def check_global_vit(model: nn.Module) -> None:
    """A TypeError unless ``model`` is a global ViT :func:`attention_distance` can read (its blocks, embedding and
    position states)."""
    needed = ("blocks", "embed", "position_states", "num_prefix_tokens", "patch_embed")
    if not all(hasattr(model, k) for k in needed):
        raise TypeError(
            f"attention_distance takes a global ViT (vitrel's VisionTransformer), got {type(model).__name__}: a Swin "
            "attends within windows, whose distances its window size bounds"
        )


def patch_distances(grid: Grid, patch_size: tuple[int, int]) -> Tensor:
    """``[N, N]`` distances in pixels between the centres of the patches of ``grid`` (raster order), float64."""
    rows = torch.arange(grid.h, dtype=torch.float64).repeat_interleave(grid.w) * patch_size[0]
    cols = torch.arange(grid.w, dtype=torch.float64).repeat(grid.h) * patch_size[1]
    return torch.hypot(rows[:, None] - rows[None, :], cols[:, None] - cols[None, :])


def attention_distance(model: nn.Module, images: Tensor) -> Tensor:
    """``[depth, heads]`` mean attention distance in input pixels of a ViT on ``images [B, C, H, W]`` (module
    docstring), float64 on the CPU. The model runs in eval mode (its mode restored after) with gradients off; pass more
    images for a steadier mean, in batches of your own: the per-batch results weighted by their image counts average
    to the whole set's."""
    check_global_vit(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            x, grid = model.embed(images)
            if not isinstance(grid, Grid):
                raise ValueError(f"attention_distance takes image grids, got {grid}: a video model's grid has time")
            dist = patch_distances(grid, _pair(model.patch_embed.patch_size)).to(x.device)
            p = model.num_prefix_tokens
            out = []
            for blk, state in zip(model.blocks, model.position_states(grid, x)):
                a = blk.attn.attention_map(blk.norm1(x), pos_state=state)[:, :, p:, p:]  # [B, heads, N, N]
                out.append((a.double() * dist).sum(-1).mean((0, 2)))
                x = blk(x, pos_state=state)
    finally:
        model.train(was_training)
    return torch.stack(out).cpu()


def plot_attention_distance(distances: Tensor | Mapping[str, Tensor], title: str | None = None):
    """Mean attention distance against depth, one dot per head: ``distances [depth, heads]``
    (:func:`attention_distance`), or a mapping of names to them (several models, e.g. one per position scheme, each
    its own colour, side by side at every block). Returns a Figure."""
    runs = {"": distances} if isinstance(distances, Tensor) else dict(distances)
    if not runs or any(not isinstance(d, Tensor) or d.dim() != 2 for d in runs.values()):
        raise ValueError("expected [depth, heads] tensors (attention_distance's), or a mapping of names to them")
    fig = new_figure(max(4.0, 0.5 * max(d.shape[0] for d in runs.values()) + 2.5), 3.2)
    ax = fig.subplots()
    width = 0.6 / len(runs)
    for k, (name, d) in enumerate(runs.items()):
        d = d.detach().double().cpu().numpy()
        depth, heads = d.shape
        x = np.arange(depth)[:, None] + (k - (len(runs) - 1) / 2) * width + np.zeros((1, heads))
        ax.scatter(x.ravel(), d.ravel(), s=10, color=f"C{k}", label=name or None, alpha=0.8)
    ax.set_xlabel("block (from 0, as model.blocks[i])")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(np.arange(max(d.shape[0] for d in runs.values())))
    ax.set_ylim(bottom=0)
    if len(runs) > 1 or next(iter(runs)):
        ax.legend(fontsize=7, frameon=False)
    ax.set_title(title or "how far each head looks", fontsize=9)
    return fig
