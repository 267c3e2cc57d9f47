"""What a training run is built from, before the trainer: the network (:func:`build_model`, sized by the datamodule
and checked against its images and clips), the trainer's plugins, and the names the run reports for the model and its
position scheme (those of a ``model=from_checkpoint`` file, whatever the ``pos`` group says)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from timm.layers import to_2tuple

from vitrel.config import ConfigError
from vitrel.models.checkpoint import CheckpointError
from vitrel.models.ckpt_files import stored_config
from vitrel.models.input_size import InputSizeError, check_patches_fit
from vitrel.models.registry import MODEL_ARGS
from vitrel.train.utils import (
    check_channels_fit,
    check_video_pairing,
    is_video_data,
    override_key,
    task_overrides,
)

__all__ = [
    "build_model",
    "check_pos_override",
    "trainer_plugins",
    "loads_checkpoint",
    "stored_cfg",
    "model_name",
    "pos_name",
]


def build_model(model_cfg: DictConfig, dm: L.LightningDataModule) -> torch.nn.Module:
    """``instantiate(cfg.model)``; ``num_classes``, ``in_chans`` and ``img_size`` (and a video data module's
    ``num_frames``) come from the datamodule unless the node sets them. Video data with an image model (or the
    reverse) is refused before anything is built (:func:`~vitrel.train.utils.check_video_pairing`)."""
    arch = model_cfg.get("name") or model_cfg.get("architecture")
    if arch is None and model_cfg.get("path") is not None:  # model=from_checkpoint: the stored architecture
        arch = (stored_config(str(model_cfg.path)) or {}).get("architecture")
    if arch is not None:
        check_video_pairing(str(arch), dm)
        _check_patches_fit(model_cfg, str(arch), dm)
        _check_frames_fit(model_cfg, str(arch), dm)
    check_channels_fit(model_cfg, dm)
    sized = {"num_classes": dm.num_classes, "in_chans": dm.in_chans, "img_size": dm.img_size}
    if is_video_data(dm):
        sized["num_frames"] = dm.num_frames
    try:
        return instantiate(model_cfg, **{k: v for k, v in sized.items() if model_cfg.get(k) is None})
    except InstantiationException as e:  # weights that cannot be read or fetched: the error itself (one line)
        if isinstance(e.__cause__, CheckpointError):
            raise e.__cause__ from None
        raise


def _check_patches_fit(model_cfg: DictConfig, arch: str, dm: L.LightningDataModule) -> None:
    """The data's images are a whole number of the model's patches (a 224-px ViT-S/16 on Fashion-MNIST's 28 px is
    not): else an :class:`~vitrel.models.input_size.InputSizeError` naming the ``data.img_size`` to set, before the
    model is built. Not checked: NaFlex batches (patches cut by the data), timm architectures (``init_from``)."""
    size = getattr(dm, "img_size", None)
    if size is None or getattr(dm, "packing", None) or model_cfg.get("init_from"):
        return
    patch, made_for = _model_args(model_cfg, arch, "patch_size", "img_size")
    if loads_checkpoint(model_cfg):  # model=from_checkpoint: the file's patches, and the size it was trained at
        why = f"the size {arch} was trained at"
    else:
        why = "model.img_size" if model_cfg.get("img_size") else f"the size {arch} is made for"
    if patch is None or made_for is None:
        return
    (ph, pw), (mh, mw) = to_2tuple(patch), to_2tuple(made_for)
    if ph == pw and mh == mw:  # (square patches and size, as data.img_size)
        check_patches_fit(int(size), int(ph), type(dm).__name__, arch, int(mh), why)


def _check_frames_fit(model_cfg: DictConfig, arch: str, dm: L.LightningDataModule) -> None:
    """A video's clips are a whole number of the model's tubelets (7 frames are not of tubelets of 2): else an
    :class:`~vitrel.models.input_size.InputSizeError` naming the ``data.num_frames`` to set, before the model is
    built (the model's own error names no config key)."""
    frames = getattr(dm, "num_frames", None)
    if not is_video_data(dm) or frames is None:
        return
    (tubelet,) = _model_args(model_cfg, arch, "tubelet_size")
    if tubelet is None or (frames >= tubelet and frames % tubelet == 0):
        return
    above, below = max(-(-frames // tubelet), 1) * tubelet, frames // tubelet * tubelet
    sizes = f"data.num_frames={above}" + (f" or {below}" if below else "")
    raise InputSizeError(
        f"{type(dm).__name__}'s clips, {frames} frames (data.num_frames), are not a whole number of the "
        f"{tubelet}-frame tubelets of {arch} (model.tubelet_size): set {sizes}"
    )


def _model_args(model_cfg: DictConfig, arch: str, *names: str) -> tuple[Any, ...]:
    """The constructor arguments ``names`` the model will be built with: the stored model's (``model=from_checkpoint``,
    the file read once), else the node's, else the architecture's registered value or its class default; None for
    one it has none of."""
    if loads_checkpoint(model_cfg):
        stored = stored_config(str(model_cfg.path)) or {}
        return tuple(stored.get(n) for n in names)
    cls, args = MODEL_ARGS[arch]
    params = inspect.signature(cls.__init__).parameters
    return tuple(model_cfg.get(n) or args.get(n, params[n].default if n in params else None) for n in names)


def check_pos_override(cfg: DictConfig) -> None:
    """``model=from_checkpoint`` builds the position scheme stored in ``model.path``: a ``pos=`` / ``pos.<key>=``
    override on the command line would have no effect, so it is refused (ConfigError), before anything is built."""
    if not loads_checkpoint(cfg.model):
        return
    given = [o for o in task_overrides() if override_key(o).split(".")[0] == "pos"]
    if given:
        stored = (stored_config(str(cfg.model.path)) or {}).get("pos")
        name = stored.get("name") if isinstance(stored, Mapping) else stored
        raise ConfigError(
            f"{' '.join(given)} has no effect with model=from_checkpoint: the model is {cfg.model.path}'s, with its "
            f"position scheme ({name}). Drop {'it' if len(given) == 1 else 'them'} to fine-tune that model, or train "
            "a new one with model=<architecture> pos=<scheme>."
        )


def trainer_plugins(trainer_cfg: DictConfig) -> list[Any]:
    """The plugins ``cfg.trainer.plugins`` asks for (``train()`` adds its checkpoint IO to them)."""
    node = trainer_cfg.get("plugins")
    if node is None:
        return []
    built = instantiate(node)
    return list(built) if isinstance(built, (list, tuple)) or OmegaConf.is_list(built) else [built]


def stored_cfg(model: torch.nn.Module) -> dict[str, Any]:
    return getattr(model, "vitrel_cfg", None) or {}


def loads_checkpoint(model_cfg: DictConfig) -> bool:
    """``model=from_checkpoint``: the network is ``vitrel.load_model(model.path)``, its scheme the file's."""
    return model_cfg.get("path") is not None and "load_model" in str(model_cfg.get("_target_", ""))


def model_name(cfg: DictConfig, model: torch.nn.Module | None = None) -> str:
    """The architecture the model has (its ``vitrel_cfg``), else ``model.name`` / ``model.architecture``."""
    stored = stored_cfg(model) if model is not None else {}
    return str(stored.get("architecture") or cfg.model.get("name") or cfg.model.get("architecture"))


def pos_name(cfg: DictConfig, model: torch.nn.Module) -> str | None:
    """The position scheme the model has: ``model=from_checkpoint`` builds the file's, whatever the pos group says."""
    pos = stored_cfg(model).get("pos") if loads_checkpoint(cfg.model) else None
    if isinstance(pos, Mapping):
        return pos.get("name")
    return pos if isinstance(pos, str) else cfg.pos.get("name")
