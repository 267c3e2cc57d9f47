"""A timm model with the weights of a local file in timm's on-disk formats: :func:`load_timm_file` (what
:func:`~vitrel.models.timm_import.from_timm` and ``train.py``'s ``model.init_file`` read on machines with no
network)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import timm
from timm.models import PretrainedCfg
from torch import Tensor, nn

from vitrel.models.checkpoint import CheckpointError, holds_timm_ema, read_weights

__all__ = ["load_timm_file"]


def load_timm_file(name: str, path: str | os.PathLike, **timm_kwargs: Any) -> nn.Module:
    """timm model ``name`` (random init) with the weights of a local file in timm's on-disk formats:
    ``.safetensors``, ``.pth`` / ``.bin`` (a state dict, or timm's train checkpoint with ``state_dict``),
    or a timm / Hugging Face export folder (``config.json`` + ``model.safetensors`` or
    ``pytorch_model.bin``; its ``model_args`` are the default ``timm_kwargs``, its ``pretrained_cfg`` the model's:
    the preprocessing the weights expect, as timm's ``local-dir:`` reads it). Read safely
    (``weights_only``), passed through the model module's ``checkpoint_filter_fn`` (as timm does for
    pretrained weights) and loaded strictly: :class:`~vitrel.CheckpointError` when it does not fit."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"no such file or folder: {p} (the weights of timm's {name}: model.init_file= in train.py, "
            "checkpoint_path= in vitrel.from_timm)"
        )
    cfg_file = p / "config.json" if p.is_dir() else None
    own_cfg: dict[str, Any] = {}  # (a folder's: what its config.json says of the weights)
    if cfg_file is not None and cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        arch = cfg.get("architecture")
        if arch is not None and arch.split(".")[0] != name.split(".")[0]:
            raise CheckpointError(f"{p} holds a timm {arch} model, not {name}")
        timm_kwargs = {**dict(cfg.get("model_args") or {}), **timm_kwargs}
        own_cfg = _folder_pretrained_cfg(cfg)
    _, sd = read_weights(p, use_ema=holds_timm_ema(p))  # (timm's load_checkpoint: the EMA copy when there is one)
    t = timm.create_model(name, pretrained=False, **{"pretrained_cfg_overlay": own_cfg, **timm_kwargs})
    filt = getattr(sys.modules[type(t).__module__], "checkpoint_filter_fn", None)
    try:  # timm's filter fails on some misfits (an embedding of another token count) before load_state_dict does
        t.load_state_dict(filt(sd, t) if filt is not None else sd, strict=True)
    except RuntimeError as e:
        raise CheckpointError(_misfit(p, name, timm_kwargs, sd, t, e)) from None
    return t


def _folder_pretrained_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    """The preprocessing and metadata a timm / Hugging Face export folder's ``config.json`` stores with its weights
    (``pretrained_cfg``, or the older single dict), as timm's ``local-dir:`` reads them: the weights' own mean, std,
    interpolation, crop and tag, not those of the name's default tag (``vit_small_patch16_224`` is ``augreg``'s
    mean 0.5, a DINO folder's ImageNet mean)."""
    theirs = cfg.get("pretrained_cfg", cfg)
    fields = {f.name for f in dataclasses.fields(PretrainedCfg)} - {"architecture"}
    return {k: v for k, v in theirs.items() if k in fields}


def _misfit(p: Path, name: str, timm_kwargs: dict[str, Any], sd: dict[str, Tensor], t: nn.Module, e: Exception) -> str:
    """One short message for a file that does not fit timm's ``name``: weights of another architecture (few of the
    file's tensor names are the model's), or of another variant of it (the arguments to give, and the first
    differences; timm's full list of keys is hundreds of lines)."""
    own = t.state_dict()
    shared = [k for k in sd if k in own]
    kw = f" {timm_kwargs}" if timm_kwargs else ""
    if 2 * len(shared) < min(len(sd), len(own)):  # (a shallower or deeper variant shares most of the smaller)
        theirs = ", ".join(list(sd)[:3])
        mine = ", ".join(list(own)[:3])
        return (
            f"{p} holds the weights of another architecture than timm's {name}{kw}: {len(shared)} of its "
            f"{len(sd)} tensor names are the model's {len(own)} (the file's: {theirs}, ...; {name}'s: {mine}, ...). "
            "Give the timm name the file was saved from: model.init_from=timm:<name> (train.py), from_timm('<name>')"
        )
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} (model {tuple(own[k].shape)})" for k in shared if sd[k].shape != own[k].shape]
    diffs = [
        f"{what} {len(keys)}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
        for what, keys in (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes))
        if keys
    ] or [str(e).splitlines()[0][:300]]
    return (
        f"{p} does not fit timm's {name}{kw} ({'; '.join(diffs)}): give the file's architecture arguments "
        "(e.g. depth, img_size, patch_size, num_classes, class_token, global_pool) as +model.timm_kwargs={...} "
        "(train.py) or timm_kwargs= (vitrel.from_timm), or save the file with timm's save_for_hf (its config.json "
        "holds them)"
    )
