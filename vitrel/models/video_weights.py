"""Reading released video networks' checkpoints, for their importers (:func:`vitrel.from_vjepa2`,
:func:`vitrel.from_videomae`): the file as a dict (:func:`read_checkpoint`), and a video ViT's sizes from its weights
(:func:`video_vit_sizes`; their state dicts name the patch embedding, the blocks and the MLPs as timm's ViT does)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor, nn

from vitrel.models.ckpt_files import CheckpointError
from vitrel.models.data_config import set_data_config

__all__ = ["read_checkpoint", "set_clip_preprocessing", "video_vit_sizes", "weights_under"]


def read_checkpoint(src: str | os.PathLike | dict[str, Any], kind: str, what: str) -> dict[str, Any]:
    """``src``, a path (loaded on the CPU, tensors only) or the loaded dict, as a dict; else a
    :class:`CheckpointError` naming the ``kind`` of checkpoint and ``what`` file was expected."""
    if isinstance(src, (str, os.PathLike)):
        p = Path(src)
        if not p.is_file():
            raise CheckpointError(f"no such file: {p} ({what})")
        src = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(src, dict):
        raise CheckpointError(f"a {kind} checkpoint is a dict, got {type(src).__name__}")
    return src


def weights_under(src: dict[str, Any], key: str | None, keys: tuple[str, ...]) -> dict[str, Any]:
    """The weights of checkpoint ``src``: ``src[key]``, or without ``key`` those under the first of ``keys`` it has
    (``src`` itself when it has none); a ``key`` it lacks is a :class:`CheckpointError` naming what it holds."""
    if key is None:
        key = next((k for k in keys if k in src), None)
    if key is None:
        return src
    if key not in src:
        raise CheckpointError(f"the checkpoint has no {key!r} (it holds {sorted(src)[:6]})")
    return src[key]


def video_vit_sizes(sd: dict[str, Tensor], heads: dict[int, int], num_heads: int | None, what: str) -> dict[str, Any]:
    """``embed_dim``, ``in_chans``, ``tubelet_size``, ``patch_size``, ``depth``, ``num_heads`` and ``mlp_ratio`` of the
    network in ``sd`` (``patch_embed.proj.weight`` a 3-D convolution's, ``blocks.<i>.mlp.fc1``): ``num_heads``, or
    the heads of its width in ``heads``; else a :class:`CheckpointError` naming ``what`` was read."""
    w = sd["patch_embed.proj.weight"]
    if w.dim() != 5:
        raise CheckpointError(f"{what} has a 3-D patch embedding, got weight {tuple(w.shape)}")
    embed_dim = w.shape[0]
    if num_heads is None:
        if embed_dim not in heads:
            raise CheckpointError(f"width {embed_dim} is none of {what}'s ({sorted(heads)}): give num_heads=")
        num_heads = heads[embed_dim]
    return dict(
        embed_dim=embed_dim,
        in_chans=w.shape[1],
        tubelet_size=w.shape[2],
        patch_size=w.shape[3],
        depth=1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks.")),
        num_heads=num_heads,
        mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
    )


def set_clip_preprocessing(model: nn.Module, size: int, num_frames: int, crop_pct: float, **more: Any) -> None:
    """The model's preprocessing (its data config): clips of ``num_frames`` frames of ``size`` x ``size``, ImageNet's
    mean and std, bilinear resizing, ``crop_pct`` (as both importers' sources evaluate), and ``more``."""
    c = model.vitrel_cfg["in_chans"]
    config = dict(mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, input_size=(c, size, size))
    set_data_config(model, config | dict(interpolation="bilinear", crop_pct=crop_pct, num_frames=num_frames) | more)
