"""What a training run is built from, before the trainer: the network (:func:`build_model`, sized by the datamodule
and checked against its images and clips; a resumed fine-tune's from the checkpoint it resumes), the normalisation of
pretrained weights (:func:`adopt_preprocessing`), the trainer's plugins, and the names the run reports for the model and
its position scheme (those of a ``model=from_checkpoint`` file, whatever the ``pos`` group says)."""

from __future__ import annotations

import hashlib
import inspect
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig, OmegaConf
from timm.layers import to_2tuple

from vitrel.config import ConfigError
from vitrel.data.normalisation import Normalisation
from vitrel.models.checkpoint import CheckpointError
from vitrel.models.ckpt_files import stored_config
from vitrel.models.data_config import NoDataConfigWarning, data_fields, stored_data_config
from vitrel.models.factory import TRANSFERABLE
from vitrel.models.input_size import InputSizeError, check_patches_fit
from vitrel.models.registry import MODEL_ARGS, build_from_cfg
from vitrel.train.data_contract import check_channels_fit, check_data_module, check_video_pairing, is_video_data
from vitrel.train.utils import (
    override_key,
    plain,
    task_overrides,
)

__all__ = [
    "build_model",
    "adopt_preprocessing",
    "check_from_checkpoint",
    "trainer_plugins",
    "loads_checkpoint",
    "weights_source",
    "WEIGHT_FILES",
    "stored_cfg",
    "model_name",
    "pos_name",
]


def build_model(model_cfg: DictConfig, dm: L.LightningDataModule, resume: str | None = None) -> torch.nn.Module:
    """``instantiate(cfg.model)``; ``num_classes``, ``in_chans`` and ``img_size`` (and a video data module's
    ``num_frames``) come from the datamodule unless the node sets them. Video data with an image model (or the
    reverse) is refused before anything is built (:func:`~vitrel.train.data_contract.check_video_pairing`).

    ``resume``: the checkpoint the run resumes. A model of pretrained weights (``model.init_from``,
    ``model=from_checkpoint``) is then built from the configuration stored in it (:func:`_resumed_model`), without
    reading the pretrained weights (``model.init_file``, a download, ``model.path``), which its weights replace.

    A data module without ``num_classes``, ``in_chans`` or ``img_size`` (one of the user's own) is refused first,
    naming them (:func:`~vitrel.train.data_contract.check_data_module`)."""
    check_data_module(dm)
    if resume is not None and (model_cfg.get("init_from") or loads_checkpoint(model_cfg)):
        stored = stored_config(resume)
        if stored:  # (a checkpoint of vitrel.train always has one)
            return _resumed_model(model_cfg, dm, resume, stored)
    arch = model_cfg.get("name") or model_cfg.get("architecture")
    if arch is None and model_cfg.get("path") is not None:  # model=from_checkpoint: the stored architecture
        arch = (stored_config(str(model_cfg.path)) or {}).get("architecture")
    if arch is not None:
        check_video_pairing(str(arch), dm)
        _check_patches_fit(model_cfg, str(arch), dm)
        _check_frames_fit(model_cfg, str(arch), dm)
        _check_schemes_take_clips(model_cfg, str(arch), dm)
    check_channels_fit(model_cfg, dm)
    sized = {"num_classes": dm.num_classes, "in_chans": dm.in_chans, "img_size": dm.img_size}
    if is_video_data(dm):
        sized["num_frames"] = dm.num_frames
        sized.update(_segments(model_cfg, arch, dm))
    try:
        with warnings.catch_warnings():  # (the data's own statistics normalise: the checkpoint's defaults do not)
            warnings.simplefilter("ignore", NoDataConfigWarning)
            return instantiate(model_cfg, **{k: v for k, v in sized.items() if model_cfg.get(k) is None})
    except InstantiationException as e:  # weights that cannot be read or fetched: the error itself (one line)
        if isinstance(e.__cause__, CheckpointError):
            raise e.__cause__ from None
        raise


def _resumed_model(model_cfg: DictConfig, dm: L.LightningDataModule, resume: str, stored: dict) -> torch.nn.Module:
    """The model of ``stored`` (the ``vitrel_cfg`` of the checkpoint ``resume``) with what the node sets that the route
    of its weights would apply over the architecture (``init_from``: the position scheme and the transferable
    settings, as :func:`vitrel.from_timm` takes them; ``model=from_checkpoint``: ``vitrel.load_model``'s overrides) and
    the sizes of the data, so that :func:`~vitrel.train.resume.check_same_model` still refuses a changed setting.
    Logged in one line."""
    arch = str(stored.get("architecture"))
    check_video_pairing(arch, dm)
    check_channels_fit(model_cfg, dm)
    node = plain(model_cfg)
    if model_cfg.get("init_from"):
        over = {k: node[k] for k in TRANSFERABLE if node.get(k) is not None}
        if node.get("pos") is not None:
            over["pos"] = node["pos"]
        source = f"model.init_from={model_cfg.init_from}" + (
            f" (model.init_file={model_cfg.init_file})" if model_cfg.get("init_file") else ""
        )
    else:
        over = {k: v for k, v in node.items() if k not in ("_target_", "_convert_", "path", "architecture", "use_ema")}
        source = f"model.path={model_cfg.path}"
    sized = {"num_classes": dm.num_classes, "in_chans": dm.in_chans, "img_size": dm.img_size}
    if is_video_data(dm):
        sized["num_frames"] = dm.num_frames
        sized.update(_segments(model_cfg, arch, dm))
    over.update({k: v for k, v in sized.items() if over.get(k) is None})
    rank_zero_info(
        f"resuming {resume}: the model ({arch}) is built from the configuration stored in it; the weights of "
        f"{source} are not read (the checkpoint's replace them)"
    )
    return build_from_cfg(stored, **over)


def adopt_preprocessing(
    data_cfg: DictConfig, model_cfg: DictConfig, dm: L.LightningDataModule, model: torch.nn.Module, resume: str | None
) -> dict[str, Any]:
    """Preprocess as the weights expect where the config leaves it null (a ``data.mean=...`` given wins;
    :meth:`~vitrel.data.normalisation.Normalisation.adopt` takes, sets and logs them): with ``resume``, as the
    checkpoint was trained (its stored data config); with ``model.init_from``, as the pretrained weights were (the
    built model's ``pretrained_cfg``: timm's convention, ``timm.data.resolve_data_config(model=model)``; logged even
    where they are the data set's own); with ``model=from_checkpoint``, as that file's run (its stored data config).
    Set on ``dm`` before its pipelines are built, so the checkpoints store them too. Returns the values taken (empty
    for none, or a data module that is not a :class:`~vitrel.data.normalisation.Normalisation`)."""
    if not isinstance(dm, Normalisation):
        return {}
    if resume is not None:
        source, whose = stored_data_config(resume), f"those {Path(resume).name} was trained with"
    elif model_cfg.get("init_from"):
        pcfg = dict(getattr(model, "pretrained_cfg", None) or {})
        source = data_fields(pcfg) if "mean" in pcfg and "std" in pcfg else None
        whose = f"the pretrained weights' (model.init_from={model_cfg.init_from}: their pretrained_cfg)"
    elif loads_checkpoint(model_cfg):
        source, whose = stored_data_config(str(model_cfg.path)), f"those {model_cfg.path} was trained with"
    else:
        return {}
    return dm.adopt(source or {}, whose, data_cfg, always=bool(model_cfg.get("init_from")))


def _check_patches_fit(model_cfg: DictConfig, arch: str, dm: L.LightningDataModule) -> None:
    """The data's images are a whole number of the model's patches (a 224-px ViT-S/16 on Fashion-MNIST's 28 px is
    not): else an :class:`~vitrel.models.input_size.InputSizeError` naming the ``data.img_size`` to set, before the
    model is built. Not checked: NaFlex batches (patches cut by the data), timm architectures (``init_from``), a model
    that pads images to whole patches (``dynamic_img_pad``)."""
    size = getattr(dm, "img_size", None)
    if size is None or getattr(dm, "packing", None) or model_cfg.get("init_from"):
        return
    patch, made_for, pads = _model_args(model_cfg, arch, "patch_size", "img_size", "dynamic_img_pad")
    if loads_checkpoint(model_cfg):  # model=from_checkpoint: the file's patches, and the size it was trained at
        why = f"the size {arch} was trained at"
    else:
        why = "model.img_size" if model_cfg.get("img_size") else f"the size {arch} is made for"
    if patch is None or made_for is None or pads:  # (dynamic_img_pad: images of any size padded to whole patches)
        return
    (ph, pw), (mh, mw), (sh, sw) = to_2tuple(patch), to_2tuple(made_for), to_2tuple(size)
    if ph == pw and mh == mw and sh == sw:  # (square patches and size, as data.img_size)
        takes = "dynamic_img_pad" in inspect.signature(MODEL_ARGS[arch][0].__init__).parameters
        pad = "+model.dynamic_img_pad=true" if takes and not loads_checkpoint(model_cfg) else ""
        check_patches_fit(int(sh), int(ph), type(dm).__name__, arch, int(mh), why, pad)
    elif sh % ph or sw % pw or sh < ph or sw < pw:  # (a data module's [H, W] images: no data.img_size to name)
        raise InputSizeError(
            f"{type(dm).__name__}'s images, {sh}x{sw} (its img_size), are not a whole number of the {ph}x{pw} patches "
            f"of {arch}: give it images whose sides are multiples of the patch"
        )


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


def _segments(model_cfg: DictConfig, arch: str | None, dm: L.LightningDataModule) -> dict[str, int]:
    """``num_segments`` of a video data module that joins several clips into an input (``data.num_segments``), for
    the model to split them: a :class:`~vitrel.config.ConfigError` for an architecture that takes one clip (the video
    Swin). Empty for one clip a sample."""
    k = int(getattr(dm, "num_segments", 1))
    if k == 1 or model_cfg.get("num_segments") is not None:
        return {}
    if arch is not None and arch in MODEL_ARGS:
        if "num_segments" not in inspect.signature(MODEL_ARGS[arch][0].__init__).parameters:
            raise ConfigError(
                f"data.num_segments={k} joins {k} clips into each input, which {arch} does not take (one clip): use "
                f"a video ViT (vitrel_vit_video_*) or data.num_segments=1"
            )
    return {"num_segments": k}


def _check_schemes_take_clips(model_cfg: DictConfig, arch: str, dm: L.LightningDataModule) -> None:
    """A video model's ``pos`` (and ``abs_pos``) take its clips' grid ``(T, H, W)``: an image scheme (train.yaml's
    default ``pos``, ``rel2d_factored``) is a :class:`~vitrel.config.ConfigError` naming the ``pos=`` that do, before
    the model is built (its own error came wrapped in Hydra's instantiation messages)."""
    from vitrel.pos.registry import get_pos_class, list_pos

    if not is_video_data(dm):
        return
    for key, spec in zip(("pos", "model.abs_pos"), _model_args(model_cfg, arch, "pos", "abs_pos")):
        name = spec.get("name") if isinstance(spec, Mapping) else spec
        if not isinstance(name, str) or name not in list_pos() or get_pos_class(name).grid_dims != 2:
            continue  # (an unknown name: the model's own error names the known ones)
        video = [n for n in list_pos() if get_pos_class(n).grid_dims in (3, None)]
        if key != "pos":  # (an absolute embedding beside the scheme)
            video = [n for n in video if get_pos_class(n).kind == "absolute"]
        raise ConfigError(
            f"{key}={name} takes image grids (H, W), but {arch} attends over a clip's (T, H, W): set {key}= one "
            f"that takes clips: {', '.join(video)}"
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


def check_from_checkpoint(cfg: DictConfig) -> None:
    """``model=from_checkpoint`` builds the model and position scheme stored in ``model.path``, before anything is
    built: timm's weights named beside it (``model.init_from``, set by ``experiment=finetune_cifar10``), and a
    ``pos=`` / ``pos.<key>=`` override on the command line (it would have no effect), are refused (ConfigError)."""
    if not loads_checkpoint(cfg.model):
        return
    timm_keys = [k for k in ("init_from", "init_file") if cfg.model.get(k)]
    if timm_keys:
        drop = " ".join(f"'~model.{k}'" for k in timm_keys)
        raise ConfigError(
            f"model.{timm_keys[0]}={cfg.model.get(timm_keys[0])} starts from timm's weights and model=from_checkpoint "
            f"from {cfg.model.path}'s: give one. To fine-tune the checkpoint add {drop} (an experiment= may set it)."
        )
    given = [o for o in task_overrides() if override_key(o).split(".")[0] == "pos"]
    if given:
        stored = (stored_config(str(cfg.model.path)) or {}).get("pos")
        name = stored.get("name") if isinstance(stored, Mapping) else stored
        raise ConfigError(
            f"{' '.join(given)} has no effect with model=from_checkpoint: the model is {cfg.model.path}'s, with its "
            f"position scheme ({name}). Drop {'it' if len(given) == 1 else 'them'} to fine-tune that model; change "
            "one option of its scheme, the others as trained, with +model.pos.<key>=<value> (+model.pos.extend="
            "interpolate); or train a new one with model=<architecture> pos=<scheme>."
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


def weights_source(model_cfg: DictConfig) -> dict[str, str]:
    """The pretrained weights a run of ``model_cfg`` starts from, as ``{config key: value}``: ``model.init_from`` and
    ``model.init_file`` (a timm name and the file of its weights), or ``model.path`` (``model=from_checkpoint``);
    files as absolute paths, each with its content's SHA-256 under ``"<key> sha256"`` where it exists (a moved file is
    known as the same). Empty for a run from scratch. Kept in the checkpoints (the module's ``started_from``)."""
    if model_cfg.get("init_from"):
        keys = ("init_from", "init_file")
    elif loads_checkpoint(model_cfg):
        keys = ("path",)
    else:
        return {}
    out = {f"model.{k}": str(model_cfg[k]) for k in keys if model_cfg.get(k)}
    for k in [k for k in out if k in WEIGHT_FILES]:
        path = Path(out[k]).expanduser().absolute()
        out[k] = str(path)
        if path.exists():
            out[f"{k} sha256"] = _sha256(path)
    return out


#: the keys of :func:`weights_source` that name files (the others name weights: ``model.init_from``)
WEIGHT_FILES = ("model.init_file", "model.path")


def _sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, or of a folder's files (their names relative to it, then their bytes)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        if path.is_dir():
            digest.update(str(f.relative_to(path)).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


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
