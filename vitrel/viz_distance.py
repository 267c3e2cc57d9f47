"""How far each head looks: the mean attention distance of a ViT, a Swin or a video model (:func:`attention_distance`,
also ``vitrel.viz.attention_distance``) and its picture, one dot per head against depth
(:func:`plot_attention_distance`), the analysis of Dosovitskiy et al. 2021 (Fig. 7) and Raghu et al. 2021.

For block ``l`` and head ``h``, with ``a_ij`` the attention probability of query token ``i`` for key token ``j`` and
``c_i`` the centre of token ``i`` in input pixels (rows, columns; time left out)::

    D[l, h] = mean over images, windows and query tokens i of  sum over key tokens j of  a_ij * ||c_i - c_j||

* A global ViT: one window, all patches. Prefix tokens (class, registers) are left out as queries and as keys, and
  the weights are not renormalised over the patches (the Keras example "Investigating Vision Transformer
  representations", ``compute_mean_attention_dist``): a head that attends to the class token contributes that mass at
  distance 0.
* A Swin: ``j`` runs over the query's window; a stage's token stride is the patch size times ``2^merges`` so far.
  Pairs the shifted-window mask forbids (and padding keys) have probability 0; padding queries are left out. The
  distance is between the tokens' places in the image (the window slots un-rolled), which for the pairs the mask
  allows equals the distance inside the rolled window. Blocks count across stages (``model.layers[s].blocks[i]`` in
  order); a block with fewer heads than the widest has NaN in the others.
* A video model (clips ``[B, C, T, H, W]``: the video ViT, the Video Swin): the same distance in pixels within the
  frame plane, and with ``frames=True`` also the mean temporal distance ``sum_j a_ij * tubelet_size * |t_i - t_j|``
  in frames.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from vitrel.figures import new_figure
from vitrel.layout.geometry import Grid, Grid3
from vitrel.models.swin_blocks import SwinStage

__all__ = ["attention_distance", "check_distance_model", "plot_attention_distance"]


def _is_global_vit(model: nn.Module) -> bool:
    """vitrel's image or video VisionTransformer: its blocks, embedding and position states."""
    return all(hasattr(model, k) for k in ("blocks", "embed", "position_states", "num_prefix_tokens", "patch_embed"))


def _is_swin(model: nn.Module) -> bool:
    """vitrel's Swin or Video Swin: stages ``layers`` of window blocks (``SwinStage``)."""
    layers = getattr(model, "layers", None)
    return (
        isinstance(layers, nn.Sequential)
        and hasattr(model, "patch_embed")
        and all(isinstance(s, SwinStage) for s in layers)
    )


def check_distance_model(model: nn.Module) -> None:
    """A TypeError unless :func:`attention_distance` can read ``model``: a global ViT (vitrel's image or video
    VisionTransformer) or a Swin (vitrel's image or Video Swin)."""
    if not (_is_swin(model) or _is_global_vit(model)):
        raise TypeError(
            f"attention_distance takes vitrel's ViT, video ViT, Swin or Video Swin, got {type(model).__name__}"
        )


def coord_map(grid: Grid | Grid3, stride: tuple[int, int], tubelet: int = 1) -> Tensor:
    """``[1, (T,) H, W, 4]`` float64: each token's (frame, row pixel, column pixel, 1) on the map of ``grid``
    (``stride``: the token's size in pixels; ``tubelet``: in frames). Windowed as the tokens are, the last channel
    tells real tokens (1) from padding (0)."""
    g = grid if isinstance(grid, Grid3) else Grid3(1, *grid)
    axes = [torch.arange(n, dtype=torch.float64) * s for n, s in zip(g, (tubelet, *stride))]
    t, r, c = torch.meshgrid(*axes, indexing="ij")
    out = torch.stack([t, r, c, torch.ones_like(t)], -1)
    return out[None] if isinstance(grid, Grid3) else out[0][None]


class _Sums:
    """Per block (in forward order, counted afresh for each batch): the sums over images, windows and real queries
    of ``sum_j a_ij d_ij`` (pixels, frames), and how many queries."""

    def __init__(self) -> None:
        self.px: list[Tensor] = []
        self.frames: list[Tensor] = []
        self.queries: list[Tensor] = []
        self.block = 0

    def add(self, probs: Tensor, coords: Tensor) -> None:
        """The next block's ``probs [B nW, heads, n, n]`` of windows whose tokens are at ``coords [nW, n, 4]``
        (:func:`coord_map`, windowed)."""
        nw, n = coords.shape[:2]
        coords = coords.to(probs.device)
        a = probs.double().view(-1, nw, probs.shape[1], n, n)
        real = coords[..., 3] > 0  # [nW, n]
        pair = (real[:, :, None] & real[:, None, :]).double()
        d = coords[:, :, None, :3] - coords[:, None, :, :3]  # [nW, n, n, 3]
        space = torch.hypot(d[..., 1], d[..., 2]) * pair
        time = d[..., 0].abs() * pair
        sums = [torch.einsum("bwhij,wij->h", a, t).cpu() for t in (space, time)] + [a.shape[0] * real.sum().cpu()]
        if self.block == len(self.px):
            for store, v in zip((self.px, self.frames, self.queries), sums):
                store.append(torch.zeros_like(v))
        for store, v in zip((self.px, self.frames, self.queries), sums):
            store[self.block] += v
        self.block += 1

    def result(self) -> tuple[Tensor, Tensor]:
        """``(pixels, frames)``, each ``[blocks, heads]``, NaN where a block has fewer heads than the widest."""
        heads = max(len(v) for v in self.px)
        nan = float("nan")
        px, fr = (
            torch.stack([torch.cat([v / q, v.new_full((heads - len(v),), nan)]) for v, q in zip(vs, self.queries)])
            for vs in (self.px, self.frames)
        )
        return px, fr


def _global_vit(model: nn.Module, x: Tensor, sums: _Sums) -> None:
    if hasattr(model, "split_segments"):  # (a video ViT's input of K clips: each is encoded, and attends, alone)
        x = model.split_segments(x)
    x, grid = model.embed(x)
    if not isinstance(grid, Grid | Grid3):
        raise ValueError(f"attention_distance takes a batch of images or clips of one size, got the layout {grid}")
    pe = model.patch_embed
    coords = coord_map(grid, _pair(pe.patch_size), getattr(pe, "tubelet_size", 1)).flatten(0, -2)  # [N, 4]
    states = model.position_states(grid, x)
    outs = [x, *model.run_blocks(x, grid, states)]  # (the model's loop: CPE's convolution, a late prefix)
    for i, (blk, state) in enumerate(zip(model.blocks, states)):
        x = model.block_input(outs[i], i)
        at = torch.cat([coords.new_zeros(model.prefix_in(i), 4), coords])[None]  # prefix tokens: not real
        sums.add(blk.attn.attention_map(blk.attn_input(x), pos_state=state), at)


def _swin(model: nn.Module, x: Tensor, sums: _Sums) -> None:
    pe = model.patch_embed
    stride, tubelet = _pair(pe.patch_size), getattr(pe, "tubelet_size", 1)
    x = model.embed(x)
    for stage in model.layers:
        if stage.merges:
            x = stage.downsample(x)
            stride = (2 * stride[0], 2 * stride[1])
        video = x.dim() == 5
        cmap = coord_map(Grid3(*x.shape[1:4]) if video else Grid(*x.shape[1:3]), stride, tubelet)
        for blk, state in zip(stage.blocks, stage.position_states(x)):
            windows, *_, mask = blk.windows(blk.attn_input(x))  # (SwinBlock's and Swin3DBlock's)
            coords = blk.windows(cmap.to(x.device))[0]
            sums.add(blk.attn.attention_map(windows, mask=mask, pos_state=state), coords)
            x = blk(x, pos_state=state)


def _one_size_batches(model: nn.Module, images: Any) -> list[Tensor]:
    """``images`` as batches of one size each: a batch ``[B, C, H, W]`` or ``[B, C, T, H, W]`` as it is; a list of
    images ``[C, H_i, W_i]`` or a NaFlex dict (read by the model's own entrance, its checks and errors) as its images,
    put back together from their patches and grouped by size in order of first appearance."""
    if isinstance(images, Tensor) and images.dim() in (4, 5):
        return [images]
    if not isinstance(images, Mapping | list | tuple) or not hasattr(model, "read_input"):
        what = f"a tensor of shape {tuple(images.shape)}" if isinstance(images, Tensor) else type(images).__name__
        more = ", a list of images [C, H, W] or a NaFlex dict" if hasattr(model, "read_input") else ""
        raise ValueError(f"attention_distance takes images [B, C, H, W] or clips [B, C, T, H, W]{more}, got {what}")
    inp = model.read_input(images)
    found = [inp.images] if inp.batch is None else inp.batch.images(_pair(model.patch_embed.patch_size)[0])
    sizes: dict[tuple[int, ...], list[Tensor]] = {}
    for img in found:
        sizes.setdefault(tuple(img.shape[-2:]), []).append(img)
    return [torch.cat(v) if v[0].dim() == 4 else torch.stack(v) for v in sizes.values()]


def attention_distance(model: nn.Module, images: Any, frames: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """``[blocks, heads]`` mean attention distance in input pixels (module docstring), float64 on the CPU, of a ViT
    or Swin on ``images`` or of a video ViT or Video Swin on clips ``[B, C, T, H, W]``; with ``frames`` (clips only)
    the pair ``(pixels, frames)``, the second the mean temporal distance in frames. ``images``: a batch
    ``[B, C, H, W]``, or images of any sizes as the models take them (a list of ``[C, H_i, W_i]``, or timm's NaFlex
    dict, packed or not, with every patch of each image): the mean over all their query tokens, each image as it
    runs alone (the packed path's rule). A Swin's blocks count across stages, NaN padding the heads a block lacks.
    The model runs in eval mode (its mode restored after) with gradients off; pass more images for a steadier mean,
    in batches of your own: the per-batch results weighted by their query counts average to the whole set's."""
    check_distance_model(model)
    batches = _one_size_batches(model, images)
    if frames and batches[0].dim() != 5:
        raise ValueError("frames=True: a temporal distance needs clips [B, C, T, H, W]")
    was_training = model.training
    model.eval()
    sums = _Sums()
    try:
        with torch.no_grad():
            for x in batches:
                sums.block = 0
                (_swin if _is_swin(model) else _global_vit)(model, x, sums)
    finally:
        model.train(was_training)
    px, fr = sums.result()
    return (px, fr) if frames else px


def plot_attention_distance(
    distances: Tensor | Mapping[str, Tensor], title: str | None = None, frames: Tensor | None = None
):
    """Mean attention distance against depth, one dot per head: ``distances [depth, heads]``
    (:func:`attention_distance`; NaN, a Swin block's missing heads, not drawn), or a mapping of names to them (several
    models, e.g. one per position scheme, each its own colour, side by side at every block). ``frames`` (a video
    model's distances in frames, ``[depth, heads]``, with one model's ``distances``): a second panel beside the
    pixels'. Returns a Figure."""
    runs = {"": distances} if isinstance(distances, Tensor) else dict(distances)
    if not runs or any(not isinstance(d, Tensor) or d.dim() != 2 for d in runs.values()):
        raise ValueError("expected [depth, heads] tensors (attention_distance's), or a mapping of names to them")
    if frames is not None and (not isinstance(distances, Tensor) or frames.shape != distances.shape):
        raise ValueError("frames needs one model's distances [depth, heads] of the same shape")
    panels = [(runs, "pixels")] + ([({"": frames}, "frames")] if frames is not None else [])
    legend = 1.8 if len(runs) > 1 or next(iter(runs)) else 0.0  # (beside the axes, not over the dots)
    width = max(4.0, 0.5 * max(d.shape[0] for d in runs.values()) + 2.5)
    fig = new_figure(width * len(panels) + legend, 3.2)
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (drawn, unit) in zip(axes, panels):
        _distance_panel(ax, drawn, unit)
    title = title or "how far each head looks"
    if len(axes) == 1:
        axes[0].set_title(title, fontsize=9)
    else:
        fig.suptitle(title, fontsize=9)
    return fig


def _distance_panel(ax, runs: Mapping[str, Tensor], unit: str) -> None:
    """One axes of :func:`plot_attention_distance`: each run's heads at every block, in ``unit``."""
    width = 0.6 / len(runs)
    for k, (name, d) in enumerate(runs.items()):
        d = d.detach().double().cpu().numpy()
        depth, heads = d.shape
        x = np.arange(depth)[:, None] + (k - (len(runs) - 1) / 2) * width + np.zeros((1, heads))
        ax.scatter(x.ravel(), d.ravel(), s=10, color=f"C{k}", label=name or None, alpha=0.8)
    ax.set_xlabel("block (forward order; a Swin's across stages)")
    ax.set_ylabel(f"mean attention distance ({unit})")
    ax.set_xticks(np.arange(max(d.shape[0] for d in runs.values())))
    ax.set_ylim(bottom=0)
    if len(runs) > 1 or next(iter(runs)):
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
