"""Data configs stored with weights: the preprocessing a model was trained with (timm's ``input_size``, ``mean``,
``std``, ``interpolation``, ``crop_pct``, ``crop_mode``, a video model's ``num_frames`` and evaluation clip sampling
(:data:`CLIP_FIELDS`), and the class names), read from a training checkpoint's ``hyper_parameters["data_config"]``
(written by :func:`data_config_of` from the data module) or an export's metadata / ``pretrained_cfg``, and put into a
model's ``pretrained_cfg``, where ``timm.data.resolve_data_config(model=model)`` finds it."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from timm.models import PretrainedCfg
from torch import nn

from vitrel.caller import caller_stacklevel
from vitrel.models.ckpt_files import (
    CONFIG_NAME,
    TIMM_BIN_NAME,
    _parse_meta,
    _read_json,
    _resolve,
    _safetensors_metadata,
    stored_config,
)
from vitrel.models.run_record import resize_of_run

log = logging.getLogger(__name__)

__all__ = [
    "example_input",
    "CANVAS_FIELDS",
    "NoDataConfigWarning",
    "CLIP_FIELDS",
    "clip_field",
    "DATA_FIELDS",
    "RESIZE_FIELDS",
    "TRAIN_FIELDS",
    "TIMM_CFG_FIELDS",
    "data_config_for",
    "data_config_of",
    "data_fields",
    "fit_data_config",
    "model_data_config",
    "pretrained_cfg_fields",
    "checkpoint_data_config",
    "set_data_config",
    "stored_data_config",
    "warn_no_data_config",
]

#: the fields of timm's ``PretrainedCfg``: what a timm ``pretrained_cfg`` overlay or an export's ``config.json``
#: may hold (``num_frames`` and :data:`CLIP_FIELDS` are not among them: they stay in vitrel's own data config)
TIMM_CFG_FIELDS = frozenset(f.name for f in dataclasses.fields(PretrainedCfg))
#: timm's ``pretrained_cfg`` fields of the preprocessing (a data config also holds ``class_names``)
DATA_FIELDS = ("input_size", "mean", "std", "interpolation", "crop_pct", "crop_mode", "num_frames")
#: a video model's evaluation clips beside ``num_frames``: ``frame_stride`` (frames between a clip's frames),
#: ``clips_per_video`` (evenly spaced clips per video), ``spatial_crops`` (crops of each clip, along its longer side)
#: and ``num_segments`` (clips joined into one input, one from each part of the video; the last two absent from
#: checkpoints before them: 1), ``frame_sampling`` (``"stride"``, or ``"spread"``: a clip's frames one from each part
#: of the video; absent before it: ``"stride"``); not timm fields, so never in a timm ``pretrained_cfg`` overlay
CLIP_FIELDS = ("frame_stride", "clips_per_video", "spatial_crops", "num_segments", "frame_sampling")
#: the sides training batches were drawn at (``data.size_choices``): ``eval.py`` runs the stored model as trained at
#: one of them; not a timm field either
TRAIN_FIELDS = ("size_choices",)
#: a model trained on images pasted into a black canvas (``data.canvas_size``, the translation study): the canvas side
#: and the side of the images pasted into it, so that ``predict.py`` pastes an image as the data module did (not
#: timm's fields either)
CANVAS_FIELDS = ("canvas_size", "canvas_image_size")
#: how evaluation images were resized: ``resize="tensor"`` for a run of the memory loader (``data.loader=memory``: the
#: image normalised, then resized as a float tensor by torchvision, :func:`vitrel.data.memory.eval_images`), absent for
#: PIL's resize (timm's eval transform); ``predict.py`` and the exports resize an image the same way (not timm's field)
RESIZE_FIELDS = ("resize",)


def data_fields(src: Mapping[str, Any]) -> dict[str, Any]:
    """The data-config fields of ``src`` (a stored data config or a ``pretrained_cfg``: ``label_names`` are the class
    names; ``img_size``, the side or ``[H, W]``, as written by hand before ``input_size``)."""
    keys = (*DATA_FIELDS, *CLIP_FIELDS, *TRAIN_FIELDS, *CANVAS_FIELDS, *RESIZE_FIELDS, "img_size")
    out = {k: src[k] for k in keys if src.get(k) is not None}
    names = src.get("class_names") or src.get("label_names")
    if names:
        out["class_names"] = [str(n) for n in names]
    return out


def _pretrained_cfg_beside(p: Path) -> dict[str, Any] | None:
    """The data fields of the ``pretrained_cfg`` in the ``config.json`` beside the weights ``p`` (timm's layout)."""
    cj = p.parent / CONFIG_NAME
    if not cj.is_file():
        return None
    pcfg = _read_json(cj).get("pretrained_cfg")
    return (data_fields(pcfg) or None) if isinstance(pcfg, Mapping) and "mean" in pcfg else None


def stored_data_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The data config stored with the weights at ``path``, None when there is none.

    A training checkpoint: ``hyper_parameters["data_config"]`` (what ``vitrel.train`` writes), or Lightning's
    ``datamodule_hyper_parameters`` when they hold the statistics. An export: its safetensors metadata
    ``"data_config"``, else the ``pretrained_cfg`` of the ``config.json`` beside it (timm's fields, ``label_names``
    as the class names).
    """
    p = _resolve(path)
    if p.suffix == ".safetensors":
        meta = _safetensors_metadata(p)
        if "data_config" in meta:
            return data_fields(_parse_meta(meta["data_config"], p, "data_config")) or None
        return _pretrained_cfg_beside(p)
    if p.name == TIMM_BIN_NAME:  # timm's save_for_hf layout without safetensors
        return _pretrained_cfg_beside(p)
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)  # tensors stay on disk
    except Exception:  # noqa: BLE001 - an unreadable file is reported by the weights' reader, with its reason
        return None
    return checkpoint_data_config(ckpt, p)


def checkpoint_data_config(ckpt: Any, p: Path) -> dict[str, Any] | None:
    """:func:`stored_data_config` of a training checkpoint already loaded (``ckpt``, read from ``p``)."""
    if not isinstance(ckpt, Mapping):
        return None
    hp = ckpt.get("hyper_parameters")
    hp = hp if isinstance(hp, Mapping) else {}
    for cand in (hp.get("data_config"), hp.get("data"), ckpt.get("datamodule_hyper_parameters")):
        if isinstance(cand, Mapping) and any(k in cand for k in ("mean", "std", "input_size", "img_size")):
            return {**data_fields(cand), **({} if "resize" in cand else _resize_of_run(p))}
    return None


def _resize_of_run(p: Path) -> dict[str, str]:
    """``{"resize": "tensor"}`` for a checkpoint written before checkpoints stored how its run resized images
    (2026-12-03) by a run of the memory loader, as its run record says
    (:func:`~vitrel.models.run_record.resize_of_run`): ``predict.py`` and the exports then resize an image as its
    test did; else empty."""
    resize, record = resize_of_run(p)
    if resize is None:
        return {}
    _say_resized(p.name, record)
    return {"resize": resize}


@functools.cache
def _say_resized(name: str, record: str) -> None:
    """Said once a checkpoint (loading it reads its data config more than once)."""
    log.info(
        f"{name} does not store how its run resized images (written before 2026-12-03); its run record {record} "
        "says data.loader=memory: images are resized as its test resized them (normalised tensors, torchvision)"
    )


def model_data_config(
    model: nn.Module, stored: Mapping[str, Any] | None = None, built_at: Any = None
) -> dict[str, Any]:
    """The preprocessing of ``model``: ``input_size``, ``mean``, ``std``, ``interpolation``, ``crop_pct``,
    ``crop_mode`` (and ``num_frames`` for a video model, with :data:`CLIP_FIELDS` when stored; ``class_names`` when
    known), as timm's data config.

    ``stored`` (a data config stored with the weights) wins over the model's ``pretrained_cfg`` (where
    :func:`load_model` put the stored one already); the input size and channels are the model's (``vitrel_cfg``),
    but for a model at ``built_at``, the ``img_size`` stored with the weights, fed images of another size in training
    (``train.py +model.img_size=[32,48]`` on 28-px data): the stored ``input_size``, the size it was trained on.
    Means and standard deviations of another channel count are averaged to the model's channels (a grey model
    with the RGB statistics of its architecture's defaults).
    """
    src = {**data_fields(getattr(model, "pretrained_cfg", None) or {}), **data_fields(stored or {})}
    cfg = getattr(model, "vitrel_cfg", None) or {}
    in_chans = int(cfg.get("in_chans", src.get("input_size", (3,))[0]))
    size = cfg.get("img_size", src.get("input_size", (3, 224, 224))[1:])
    fed = list((stored or {}).get("input_size") or [])[-2:]
    if built_at is not None and len(fed) == 2 and _hw(size) == _hw(built_at):  # (not rebuilt at another size)
        size = fed
    h, w = _hw(size)
    out = {
        "input_size": [in_chans, int(h), int(w)],
        "mean": [float(v) for v in src.get("mean", (0.5,) * in_chans)],
        "std": [float(v) for v in src.get("std", (0.5,) * in_chans)],
        "interpolation": str(src.get("interpolation", "bicubic")),
        "crop_pct": float(src.get("crop_pct", 1.0)),
        "crop_mode": str(src.get("crop_mode", "center")),
    }
    for key in ("mean", "std"):
        if len(out[key]) != in_chans:
            out[key] = [sum(out[key]) / len(out[key])] * in_chans
    frames = cfg.get("num_frames", src.get("num_frames"))
    if frames is not None:  # a video model: frames per clip (``input_size`` stays timm's ``[C, H, W]``)
        out["num_frames"] = int(frames)
        out.update({k: clip_field(k, src[k]) for k in CLIP_FIELDS if k in src})
        if "num_segments" in cfg:  # (the model's own: an input holds that many clips)
            out["num_segments"] = int(cfg["num_segments"])
    if src.get("size_choices"):
        out["size_choices"] = [int(v) for v in src["size_choices"]]
    out.update({k: int(src[k]) for k in CANVAS_FIELDS if k in src})
    out.update({k: str(src[k]) for k in RESIZE_FIELDS if k in src})
    if src.get("class_names"):
        out["class_names"] = list(src["class_names"])
    return out


def clip_field(key: str, value: Any) -> int | str:
    """A :data:`CLIP_FIELDS` value as stored: ``frame_sampling`` a string, the others integers."""
    return str(value) if key == "frame_sampling" else int(value)


def _hw(size: Any) -> tuple[int, int]:
    """An ``img_size`` (a side, or ``(H, W)``) as ``(H, W)``."""
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


class NoDataConfigWarning(UserWarning):
    """Weights with a stored model configuration but no data config: the model's preprocessing is the architecture's
    defaults (:func:`warn_no_data_config`)."""


def warn_no_data_config(path: str | os.PathLike, model: nn.Module) -> None:
    """One :class:`NoDataConfigWarning` for ``model``, loaded from ``path``, which stores no data config (a
    checkpoint written before vitrel stored one, or by hand), naming the statistics the model's ``pretrained_cfg``
    then holds: the architecture's defaults, which need not be the training data's."""
    out = model_data_config(model)
    stats = ", ".join(f"{k} {out[k]}" for k in ("mean", "std", "interpolation", "crop_pct"))
    warnings.warn(
        f"{path} stores no data config (the preprocessing of its training data; checkpoints of vitrel.train store it "
        f"in hyper_parameters['data_config']): images are normalised with {stats}, the architecture's defaults (as "
        "in the model's pretrained_cfg, which timm.data.resolve_data_config reads; predict.py and the exports use "
        "them), which need not be the statistics the model was trained with",
        NoDataConfigWarning,
        stacklevel=caller_stacklevel(),  # (the caller of load_model or load_predictor: a script, predict.py)
    )


def data_config_for(path: str | os.PathLike, model: nn.Module) -> dict[str, Any]:
    """:func:`model_data_config` of ``model`` loaded from ``path`` (by :func:`~vitrel.models.checkpoint.load_model`,
    which warned when ``path`` stores no data config)."""
    return model_data_config(model, stored_data_config(path), (stored_config(path) or {}).get("img_size"))


def pretrained_cfg_fields(data_config: Mapping[str, Any]) -> dict[str, Any]:
    """A data config as timm's ``pretrained_cfg`` fields (tuples; the class names as ``label_names``)."""
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in data_config.items() if k in DATA_FIELDS}
    if data_config.get("class_names"):
        out["label_names"] = tuple(data_config["class_names"])
    return out


def set_data_config(model: nn.Module, data_config: Mapping[str, Any], built_at: Any = None) -> None:
    """Put a data config into ``model.pretrained_cfg`` (:func:`pretrained_cfg_fields`; ``built_at``: as
    :func:`model_data_config`), and timm's ``pool_size`` of the model as built (its final map; None for tokens)."""
    dc = model_data_config(model, data_config, built_at)
    pcfg = {**dict(getattr(model, "pretrained_cfg", None) or {}), **pretrained_cfg_fields(dc)}
    ours = (*CLIP_FIELDS, *TRAIN_FIELDS, *CANVAS_FIELDS, *RESIZE_FIELDS)  # (vitrel's fields, not timm's)
    pcfg.update({k: dc[k] for k in ours if k in dc})
    pcfg["pool_size"] = type(model).feature_defaults(model.vitrel_cfg)["pool_size"]  # (timm's: the final map)
    model.pretrained_cfg = model.default_cfg = pcfg  # (timm keeps both names)


def fit_data_config(
    model: nn.Module,
    data_config: Mapping[str, Any],
    stored_num_classes: int | None,
    overlay: Mapping[str, Any] | None = None,
    built_at: Any = None,
) -> None:
    """Put the data config stored with loaded weights into ``model.pretrained_cfg`` as every loading route does
    (``load_model``, timm's ``pretrained_cfg_overlay=dict(file=...)`` and ``local-dir:``): the input size and channels
    the model's (:func:`model_data_config`), no class names beside a head of another size than the stored one
    (``stored_num_classes``), then the caller's ``pretrained_cfg_overlay`` entries over it all. ``built_at``: the
    ``img_size`` stored with the weights (:func:`model_data_config`).

    ``model`` may be timm's feature wrapper around the network (its ``pretrained_cfg`` then follows the network's,
    without the classifier's fields, as timm's builder writes it); one that rebuilt the network from its parts
    (``fx`` / ``list`` / ``dict``: no ``vitrel_cfg``) keeps what timm gave it."""
    net = next((m for m in model.modules() if isinstance(getattr(m, "vitrel_cfg", None), dict)), None)
    if net is None:
        return
    data_config = dict(data_config)
    if getattr(net, "num_classes", None) != stored_num_classes:  # a new head: the stored names are another head's
        data_config.pop("class_names", None)
        net.pretrained_cfg = {k: v for k, v in (net.pretrained_cfg or {}).items() if k != "label_names"}
    set_data_config(net, data_config, built_at)
    net.pretrained_cfg = net.default_cfg = {**net.pretrained_cfg, **(overlay or {})}
    if model is not net:
        from timm.models._builder import pretrained_cfg_for_features

        model.pretrained_cfg = model.default_cfg = pretrained_cfg_for_features(net.pretrained_cfg)


def data_config_of(dm: Any) -> dict[str, Any] | None:
    """The preprocessing a vitrel data module applies to evaluation images, in timm's data-config fields:
    ``input_size`` ``[C, H, W]``, ``mean``, ``std``, ``interpolation``, ``crop_pct``, ``crop_mode``; ``num_frames``
    and :data:`CLIP_FIELDS` (its evaluation clips) of a video data module, ``size_choices`` (the sides it trained
    batches at, read by ``eval.py``) when set, ``canvas_size`` and ``canvas_image_size`` with a translation canvas,
    ``resize="tensor"`` for the memory loader's (a normalised tensor resized by torchvision, not a PIL image),
    ``class_names`` when it has them; plain types (``weights_only=True`` reads them). None for an object without
    ``img_size``, ``in_chans``, ``mean`` and ``std``."""
    if dm is None or not all(hasattr(dm, k) for k in ("img_size", "in_chans", "mean", "std")):
        return None
    size = dm.img_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    out: dict[str, Any] = {
        "input_size": [int(dm.in_chans), int(h), int(w)],
        "mean": [float(v) for v in dm.mean],
        "std": [float(v) for v in dm.std],
        "interpolation": str(getattr(dm, "interpolation", "bilinear")),
        "crop_pct": float(getattr(dm, "crop_pct", 1.0)),
        "crop_mode": "center",
        **({"resize": "tensor"} if getattr(dm, "loader", None) == "memory" else {}),  # (predict.py resizes alike)
    }
    if getattr(dm, "num_frames", None) is not None:  # clips: the frames per clip (T), the evaluation clips
        out["num_frames"] = int(dm.num_frames)  # (frames consecutive, one clip, where the module has no such option)
        out["frame_stride"] = int(getattr(dm, "stride", 1))
        out["clips_per_video"] = int(getattr(dm, "clips_per_video", 1))
        out["spatial_crops"] = int(getattr(dm, "spatial_crops", 1))
        out["num_segments"] = int(getattr(dm, "num_segments", 1))
        out["frame_sampling"] = str(getattr(dm, "frame_sampling", "stride"))
    if getattr(dm, "size_choices", None):  # (eval.py runs the model as trained at one of these sides)
        out["size_choices"] = [int(v) for v in dm.size_choices]
    if getattr(dm, "canvas_size", None) is not None:  # (images pasted into a black canvas: predict.py does the same)
        out["canvas_size"], out["canvas_image_size"] = int(dm.canvas_size), int(dm.native_size)
    if names := getattr(dm, "class_names", None):
        out["class_names"] = [str(n) for n in names]
    return out


def example_input(data_config: Mapping[str, Any] | None) -> torch.Tensor | None:
    """One sample, zeros, of the shape of the data ``data_config`` describes (a checkpoint's
    ``hyper_parameters["data_config"]``): an image ``[1, C, H, W]`` at its ``input_size`` (with NaFlex batches,
    ``data.packing``, too: one image at the evaluation size), or a clip ``[1, C, T, H, W]`` of ``num_frames`` (``K T``
    frames: ``num_segments`` clips joined). None without a data config. Lightning's model summary runs it
    (``ClassifierModule.example_input_array``)."""
    if not data_config:
        return None
    c, h, w = (int(v) for v in data_config["input_size"])
    t = data_config.get("num_frames")
    if t is None:
        return torch.zeros(1, c, h, w)
    return torch.zeros(1, c, int(t) * int(data_config.get("num_segments", 1)), h, w)
