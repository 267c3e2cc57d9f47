"""timm's Swin Transformers read as vitrel's Swin, for :func:`~vitrel.models.timm_import.from_timm`: V1
(``swin_*``: ``rel2d_full``) and the authors' V2 (``swinv2_*``: ``rel2d_cpb`` with ``post_norm`` and
``cosine_attn``, its continuous position bias normalised by each block's ``pretrained_window_size``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid
from vitrel.layout.windows import window_and_shift
from vitrel.models.timm_qkv import qkv_bias_of

__all__ = ["swin_args", "swin_table", "swinv2_reference", "warn_swin_padding"]

SWIN_WINDOWS = (
    "its blocks' windows and shifts are not one window for all stages shrunk to a smaller stage grid (a window per "
    "stage, as swin_s3_*, or always_partition=True)"
)


def _swin_windows(t: nn.Module, window: tuple[int, int] | None = None) -> list[tuple[tuple[int, ...], ...]]:
    """Each block's ``(window, shift)`` in a timm Swin; with ``window``: those vitrel's Swin gives its grids with that
    one window for all stages (:func:`~vitrel.layout.windows.window_and_shift`)."""
    out = []
    for stage in t.layers:
        for j, blk in enumerate(stage.blocks):
            if window is None:
                out.append((tuple(blk.window_size), tuple(blk.shift_size)))
            else:
                win, shift = window_and_shift(Grid(*blk.input_resolution), window, j % 2 == 1)
                out.append((tuple(win), tuple(shift)))
    return out


def swin_args(t: nn.Module, v2: bool, refuse: Callable[[bool, str], None]) -> tuple[dict[str, Any], Any]:
    """vitrel's Swin arguments for the timm Swin ``t`` (``v2``: a ``SwinTransformerV2``) and the scheme that computes
    its function; ``refuse(condition, what)`` raises for what vitrel has no equivalent of."""
    blk = t.layers[0].blocks[0]
    ws = blk.window_size
    refuse(not v2 and not hasattr(blk.attn, "relative_position_bias_table"), "a position bias other than Swin V1's")
    refuse(_swin_windows(t) != _swin_windows(t, (int(ws[0]), int(ws[1]))), SWIN_WINDOWS)
    gp = t.head.global_pool.pool_type if hasattr(t.head, "global_pool") else "avg"
    refuse(gp not in ("avg", "max", "avgmax", ""), f"global_pool={gp!r}")
    args = dict(
        img_size=list(t.patch_embed.img_size),
        patch_size=int(t.patch_embed.patch_size[0]),
        in_chans=int(t.patch_embed.proj.in_channels),
        num_classes=int(t.num_classes),
        global_pool=gp,
        embed_dim=int(t.embed_dim),
        depths=[len(s.blocks) for s in t.layers],
        num_heads=[int(s.blocks[0].attn.num_heads) for s in t.layers],
        window_size=[int(ws[0]), int(ws[1])],
        mlp_ratio=blk.mlp.fc1.out_features / blk.mlp.fc1.in_features,
        qkv_bias=qkv_bias_of(blk.attn),
        norm_eps=float(blk.norm1.eps),
        **({"post_norm": True, "cosine_attn": True} if v2 else {}),
    )
    return args, ({"name": "rel2d_cpb", "hidden_dim": blk.attn.cpb_mlp[0].out_features} if v2 else "rel2d_full")


def swin_table(t: nn.Module, key: str, table: Tensor, own: Tensor | None) -> Tensor | None:
    """timm's flat ``[(2H-1)(2W-1), heads]`` bias table ``key`` of the Swin ``t`` as ``rel2d_full``'s ``[2H-1, 2W-1,
    heads]`` at the source block's window ``H x W``, for the target's table ``own``; None where ``own`` is no such
    table (another scheme). A target of another window (``from_timm(..., window_size=8)``) resizes it as it loads, by
    its scheme's ``extend`` rule, with a warning naming the rule: the trained values are carried, not dropped."""
    if own is None or own.dim() != 3 or own.shape[-1] != table.shape[-1]:
        return None
    wh, ww = (int(w) for w in t.get_submodule(key.rpartition(".")[0]).window_size)
    return table.reshape(2 * wh - 1, 2 * ww - 1, table.shape[-1])


def swinv2_reference(t: nn.Module, own: dict[str, Tensor], out: dict[str, Tensor]) -> dict[str, str]:
    """Each ``rel2d_cpb`` block's ``ref_grid`` (the window its offsets are normalised by) into ``out``: Swin V2's
    ``pretrained_window_size``, or the block's window where that is 0; returns what each came from."""
    said = {}
    for i, stage in enumerate(t.layers):
        for j, b in enumerate(stage.blocks):
            key, pw = f"layers.{i}.blocks.{j}.attn.pos.ref_grid", tuple(b.attn.pretrained_window_size)
            if key in own:
                out[key] = torch.tensor([int(w) for w in (pw if any(pw) else b.attn.window_size)])
                said[key] = f"layers.{i}.blocks.{j}.attn.pretrained_window_size"
    return said


def warn_swin_padding(t: nn.Module, name: str) -> None:
    """Warn when a timm Swin pads a stage grid to its window at its own size: timm lets tokens attend to the zero
    padding there, vitrel masks it, so the two give other logits (equal where every grid is a window multiple)."""
    pads = {(tuple(b.input_resolution), tuple(b.window_size)) for s in t.layers for b in s.blocks
            if any(int(r) % int(w) for r, w in zip(b.input_resolution, b.window_size))}  # fmt: skip
    if pads:
        grids = ", ".join(f"{g[0]}x{g[1]} (window {w[0]}x{w[1]})" for g, w in sorted(pads))
        warnings.warn(
            f"from_timm({name}): timm's Swin pads the stage grids {grids} of its img_size "
            f"{tuple(t.patch_embed.img_size)} to whole windows and attends to the zero padding; vitrel masks the "
            "padding, so the logits differ (they are equal at sizes whose stage grids are multiples of the window)",
            stacklevel=3,
        )
