"""timm's input-size arguments on vitrel's models: ``dynamic_img_size`` / ``strict_img_size`` and
``set_input_size``.

vitrel's models read the patch grid from the input, so they run at any multiple of the patch size:
``img_size`` only sizes learned tables and absolute embeddings. timm's arguments keep their meaning:

* ``dynamic_img_size=True`` or ``strict_img_size=False``: any input size (vitrel's default);
* ``strict_img_size=True``, or ``dynamic_img_size=False`` alone (timm's ViT default): the input must be
  ``img_size`` (a ``ValueError`` otherwise, as timm's ``PatchEmbed`` asserts).

``set_input_size`` changes the size a model is built for in place: every position scheme is rebuilt for
the new grid (window) and takes the old scheme's weights through its own load hook (the same resize
as loading a checkpoint with ``img_size=`` another size, ``vitrel.load_model``); ``vitrel_cfg`` follows,
so a saved model reloads at the new size, and so does ``pretrained_cfg``'s ``input_size`` (:func:`follow_input_size`:
what ``timm.data.resolve_data_config`` feeds it and timm's ``save_for_hf`` stores).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from timm.layers import register_notrace_function, to_2tuple
from timm.models._input import update_model_input_size
from torch import Tensor, nn

from vitrel.layout.geometry import Grid
from vitrel.pos.base import PositionScheme

__all__ = [
    "InputSizeError",
    "resolve_strict_img_size",
    "check_img_size",
    "check_grid_sizes",
    "check_patches_fit",
    "rebuild_position_schemes",
    "set_clip_input_size",
    "follow_input_size",
]


class InputSizeError(ValueError):
    """Images of a size that a model cannot cut into its patches, refused before the model is built
    (:func:`check_patches_fit`; ``train.py`` and ``eval.py`` print it as one line)."""


def resolve_strict_img_size(dynamic_img_size: bool | None, strict_img_size: bool | None) -> bool:
    """Whether inputs must be ``img_size``, from timm's two arguments (None: not given).

    ``dynamic_img_size=True`` wins (timm's Swin: "same as strict_img_size=False"); else an explicit
    ``strict_img_size``; else ``dynamic_img_size=False`` means strict (timm's ViT); neither given: any size.
    """
    if dynamic_img_size:
        return False
    if strict_img_size is not None:
        return bool(strict_img_size)
    return dynamic_img_size is not None


@register_notrace_function
def check_img_size(x: Tensor, img_size: tuple[int, int]) -> None:
    """Raise unless images ``x [B, C, H, W]`` are ``img_size`` (models built with a strict input size)."""
    if tuple(x.shape[-2:]) != tuple(img_size):
        raise ValueError(
            f"input size {tuple(x.shape[-2:])} does not match the model's img_size {tuple(img_size)} "
            "(strict_img_size=True); build with dynamic_img_size=True for any size, or call set_input_size"
        )


def check_grid_sizes(grids: Sequence[Grid], patch_size: int, img_size: tuple[int, int], pad: bool = False) -> None:
    """:func:`check_img_size` for images given as patches (a NaFlex dict, a list of images): each image's ``grids``
    (patches of ``patch_size``) must span ``img_size`` (with ``pad``, timm's ``dynamic_img_pad``: that size padded to
    whole patches)."""
    if pad:
        img_size = tuple(-(-s // patch_size) * patch_size for s in img_size)
    for g in grids:
        check_img_size(torch.empty(g.h * patch_size, g.w * patch_size, device="meta"), img_size)


def check_patches_fit(
    img_size: int, patch_size: int, data: str, whose: str, made_for: int, why: str, pad: str = ""
) -> None:
    """Refuse images of side ``img_size`` (``data.img_size``; ``data``: the data module's name) that ``whose`` (its
    patches of side ``patch_size``) cannot cut into patches: an :class:`InputSizeError` saying what to set,
    ``data.img_size=<made_for>`` (``why``: what that size is, e.g. ``the size vitrel_vit_small_patch16_224 is made
    for``) or the nearest larger multiple of the patch; ``pad``: the setting that pads such images instead (a ViT's
    ``dynamic_img_pad``), named last. Square sizes, as ``data.img_size``."""
    if img_size >= patch_size and img_size % patch_size == 0:
        return
    above = max(-(-img_size // patch_size), 1) * patch_size
    near = f", or the nearest larger multiple of {patch_size}, data.img_size={above}" if above != made_for else ""
    padded = f"; or keep the size and pad the images to whole patches with {pad} (timm's)" if pad else ""
    raise InputSizeError(
        f"{data}'s images, {img_size}x{img_size} (data.img_size), are not a whole number of the "
        f"{patch_size}x{patch_size} patches of {whose}: set data.img_size={made_for} ({why}){near} (the images are "
        f"resized to it){padded}"
    )


def rebuild_position_schemes(model: nn.Module, **changes: Any) -> nn.Module:
    """Swap every position scheme of ``model`` for one built with the constructor arguments ``changes``
    (``img_size``, ``window_size``) and loaded with the old scheme's weights (the scheme's load hook
    resizes learned tables / absolute embeddings, as ``load_weights`` does for a checkpoint).

    Returns the model built with the new arguments (its other size-dependent attributes are the caller's
    to adopt); ``model.vitrel_cfg`` and timm's recorded input size (``get_model_input_config``) follow.
    """
    params = inspect.signature(type(model).__init__).parameters
    cfg = {k: v for k, v in model.vitrel_cfg.items() if k in params}
    cfg.update(changes)
    ref = next(model.parameters(), None)
    placement = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
    fresh = type(model)(**cfg, **placement)
    done: list[str] = []
    for name, old in list(model.named_modules()):
        if not isinstance(old, PositionScheme) or any(name.startswith(d + ".") for d in done):
            continue
        new = fresh.get_submodule(name)
        new.load_state_dict(new.state_from(old.state_dict(), old))  # strict; the scheme's load hook resizes
        for pname, p in new.named_parameters():
            p.requires_grad_(old.get_parameter(pname).requires_grad)
        new.train(old.training)
        model.set_submodule(name, new)
        done.append(name)
    before = {key: model.vitrel_cfg.get(key) for key in changes}
    for key in changes:
        model.vitrel_cfg[key] = fresh.vitrel_cfg[key]
    follow_input_size(model, fresh, changed={k for k in changes if to_2tuple(before[k]) != to_2tuple(cfg[k])})
    img = fresh.vitrel_cfg["img_size"]
    update_model_input_size(model, img, **{k: v for k, v in changes.items() if k != "img_size"})
    return fresh


def follow_input_size(model: nn.Module, fresh: nn.Module, changed: set[str]) -> None:
    """``model.pretrained_cfg`` (what ``timm.data.resolve_data_config(model=m)`` and ``save_for_hf`` read) at the size
    ``model`` is now built for, ``fresh``'s: ``input_size`` (its channels kept) when ``img_size`` is in ``changed``,
    a video model's ``num_frames`` when that is, and timm's ``pool_size`` (the final map) with them; as a model built
    (or loaded, ``img_size=``) at that size has it. A model left at its size keeps its own (the images it was fed)."""
    pcfg = getattr(model, "pretrained_cfg", None)
    if not isinstance(pcfg, dict) or not changed & {"img_size", "num_frames"}:
        return
    pcfg = dict(pcfg)
    if "img_size" in changed:
        chans = pcfg.get("input_size", (model.vitrel_cfg.get("in_chans", 3),))[0]
        pcfg["input_size"] = (chans, *to_2tuple(fresh.vitrel_cfg["img_size"]))
    if "num_frames" in changed and "num_frames" in pcfg:
        pcfg["num_frames"] = int(fresh.vitrel_cfg["num_frames"])
    if "pool_size" in pcfg:
        pcfg["pool_size"] = type(model).feature_defaults(fresh.vitrel_cfg)["pool_size"]
    model.pretrained_cfg = model.default_cfg = pcfg  # (timm keeps both names)


def check_same_patch(model: nn.Module, patch_size: Any) -> None:
    """``set_input_size(patch_size=...)``: the model's own patch size, or none, is taken; another is a ``ValueError``
    (the patch embedding's weights are learned for its size)."""
    if patch_size is not None and to_2tuple(patch_size) != to_2tuple(model.patch_embed.patch_size):
        raise ValueError(f"set_input_size cannot change the patch size ({model.patch_embed.patch_size})")


def set_clip_input_size(
    model: nn.Module, img_size: Any = None, num_frames: int | None = None, patch_size: Any = None
) -> None:
    """A video model's ``set_input_size``: built from now on for frames of ``img_size`` and clips of ``num_frames``
    (learned tables and absolute embeddings resized as :func:`vitrel.load_model` with ``img_size=`` /
    ``num_frames=`` does; ``vitrel_cfg``, and so the model's data config, follow). The patch size stays (another is
    a ``ValueError``)."""
    check_same_patch(model, patch_size)
    changes: dict[str, Any] = {}
    if img_size is not None:
        changes["img_size"] = to_2tuple(img_size)
    if num_frames is not None:
        changes["num_frames"] = int(num_frames)
    if changes:
        fresh = rebuild_position_schemes(model, **changes)
        model.img_size, model.num_frames, model.grid = fresh.img_size, fresh.num_frames, fresh.grid
