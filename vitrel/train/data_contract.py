"""What ``train.py`` and ``eval.py`` read from a data module, checked where a data module of the user's own (any
``LightningDataModule`` named by ``data._target_``) could lack it: the attributes the model is sized by
(:func:`check_data_module`), the preprocessing the checkpoints store for ``predict.py`` and ``vitrel.load_model``
(:func:`warn_no_preprocessing`), the images of the first batch of each stage (:class:`CheckOwnBatches`: of the
channels and size those attributes say, which the model is built at and the checkpoints tell ``predict.py`` to resize
files to), and the targets of every batch (:func:`check_targets`: class indices ``0..num_classes-1``, where
``F.cross_entropy`` would stop with an index error deep in torch). docs/data.md, "Your own data". And what any data
module must fit in the model: its images cut into patches (:func:`check_data_fits_model`), clips for a video model
and images for an image one (:func:`check_video_pairing`), the channels a ``model.in_chans`` gives
(:func:`check_channels_fit`); a fit that gets no training batch (:class:`EveryEpochTrains`)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from omegaconf import DictConfig, OmegaConf, open_dict
from timm.layers import to_2tuple
from torch import Tensor

from vitrel.config import ConfigError
from vitrel.models.input_size import InputSizeError

__all__ = [
    "SIZED_BY",
    "build_data",
    "check_channels_fit",
    "check_data_fits_model",
    "check_video_pairing",
    "is_video_architecture",
    "is_video_data",
    "CheckOwnBatches",
    "EveryEpochTrains",
    "NoTrainingBatchError",
    "TargetError",
    "check_data_module",
    "check_flip_keeps_labels",
    "check_targets",
    "mirrored_classes",
    "is_vitrels",
    "planned_steps",
    "warn_no_preprocessing",
]

#: the attributes of a data module the model is built from (``train.py``) or checked against (``eval.py``)
SIZED_BY = ("num_classes", "in_chans", "img_size")
#: the guide's section on a data module of one's own
GUIDE = 'docs/data.md, "Your own data"'


class TargetError(ValueError):
    """A batch whose targets are not class indices of the model (``train.py`` and ``eval.py`` print it as one
    line)."""


def is_vitrels(dm: Any) -> bool:
    """``dm`` is one of vitrel's data modules (checked by vitrel's tests), not one of the user's own (a subclass of
    one of vitrel's included)."""
    return type(dm).__module__.split(".")[0] == "vitrel"


def check_data_module(dm: Any) -> None:
    """``dm`` has an ``num_classes``, ``in_chans`` and ``img_size`` (:data:`SIZED_BY`), not None, and (one of the
    user's own) as many ``class_names`` as classes, if any: else a :class:`~vitrel.config.ConfigError` naming what
    is wrong, before anything is built."""
    missing = [k for k in SIZED_BY if getattr(dm, k, None) is None]
    names = None if missing or is_vitrels(dm) else getattr(dm, "class_names", None)
    if names is not None and len(names) != int(dm.num_classes):  # (predict.py would label classes past them by index)
        raise ConfigError(
            f"{type(dm).__name__} has {len(names)} class_names for its {dm.num_classes} classes (num_classes): give "
            f"one name per class index 0..{int(dm.num_classes) - 1} ({GUIDE})"
        )
    if not missing:
        return
    raise ConfigError(
        f"{type(dm).__name__} has no {', '.join(missing)}: the model is built from the data module's num_classes "
        "(an int), in_chans (1 for grey images) and img_size (the side of its square images, or [H, W]); set them "
        f"as attributes in its __init__ ({GUIDE})"
    )


#: "left" / "right" as a word: between non-letters (``swipe_left``, "turn left") or a CamelCase part (``TurnLeft``)
_SIDES = re.compile(r"(?:(?<![A-Za-z])|(?<=[a-z])(?=[LR]))(left|right|Left|Right|LEFT|RIGHT)(?![a-z])")
#: a class folder's leading number (``10_left_arrow``, ``03 - Swipe Right``), which sorts the folders, not the class
_NUMBERED = re.compile(r"^\d+[\s_.\-]*")


def _name_key(name: str) -> str:
    return _NUMBERED.sub("", name).lower()


def mirrored_classes(names: Sequence[str]) -> list[tuple[str, str]]:
    """The pairs of class names each of which is the other with the words "left" and "right" swapped
    (Something-Something v2's "Pushing something from left to right" and "... from right to left", a traffic sign's
    "turn left" and "turn right", a folder's ``swipe_left`` and ``swipe_right`` or ``TurnLeft`` and ``TurnRight``): a
    left-right flip of a sample of one shows the other. Case and a leading number (``10_left_arrow`` and
    ``11_right_arrow``) are ignored; each pair is listed once."""
    index = {_name_key(n): n for n in names}
    pairs = []
    for n in names:
        other = index.get(_name_key(_SIDES.sub(lambda m: "right" if m.group(0).lower() == "left" else "left", n)))
        if other is not None and _name_key(other) != _name_key(n) and (other, n) not in pairs:
            pairs.append((n, other))
    return pairs


def check_flip_keeps_labels(dm: Any) -> None:
    """Refuse training with left-right flips (one of vitrel's data modules: its ``train_flip``) over classes that tell
    left from right (:func:`mirrored_classes` of its ``class_names``): a flipped sample shows the other class of its
    pair under its own label, and vitrel's flips swap no labels. A :class:`~vitrel.config.ConfigError` naming the
    key to set to 0."""
    if not is_vitrels(dm) or not hasattr(dm, "train_flip"):
        return
    key, p = dm.train_flip
    pairs = mirrored_classes(getattr(dm, "class_names", None) or []) if p > 0 else []
    if pairs:
        shown = "; ".join(f"{a!r} / {b!r}" for a, b in pairs[:2])
        shown += f"; ... ({len(pairs)} pairs)" if len(pairs) > 2 else ""
        raise ConfigError(
            f"{key}={p:g} flips training samples left to right, but classes tell left from right ({shown}): a flipped "
            f"sample shows the other class of its pair under its own label. Set {key}=0 (as V-JEPA 2 and VideoMAE "
            "train Something-Something v2)"
        )


def warn_no_preprocessing(dm: Any) -> None:
    """A warning when ``dm`` has no ``mean`` / ``std``: the checkpoints then store no preprocessing, and
    ``predict.py`` and ``vitrel.load_model`` would normalise images with the architecture's defaults."""
    missing = [k for k in ("mean", "std") if getattr(dm, k, None) is None]
    if missing:
        rank_zero_warn(
            f"{type(dm).__name__} has no {' and '.join(missing)}: the checkpoints store no preprocessing, so "
            "predict.py and vitrel.load_model will normalise images with the architecture's defaults, not as this "
            "data module's loaders do; set mean and std (per channel, of images scaled to 0-1) to what they apply, "
            f"and class_names for predict.py's labels ({GUIDE})"
        )


def check_targets(y: Any, num_classes: int, values: bool = True) -> None:
    """The targets of a batch are integer class indices in ``0..num_classes-1``: else a :class:`TargetError` naming
    what was found. ``values``: their range too (one read of the device: their smallest and largest value); else
    only their type and dtype (no read: the fast step's)."""
    if not isinstance(y, Tensor):  # (class names as labels: the default collate gives a list of str)
        raise TargetError(
            f"the batch's targets are a {type(y).__name__} of {type(y[0]).__name__ if len(y) else 'nothing'}, not a "
            f"tensor of class indices 0..{num_classes - 1}: map each label to its index in the data set (and give "
            f"the data module class_names) ({GUIDE})"
        )
    if y.dtype not in (torch.int64, torch.uint8):
        kind = "float" if y.is_floating_point() else str(y.dtype).removeprefix("torch.")
        raise TargetError(
            f"the batch's targets are {kind} ({y.dtype}): a classifier takes class indices 0..{num_classes - 1} as "
            "torch.long (int64); return them so from the data set"
        )
    if not values or y.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(y))
    if lo >= 0 and hi < num_classes:
        return
    hint = f"; labels 1..{num_classes}? subtract 1" if lo >= 1 and hi == num_classes else ""
    raise TargetError(
        f"the batch holds targets {lo}..{hi}, but the model has {num_classes} classes (the data module's "
        f"num_classes): targets must be class indices 0..{num_classes - 1}{hint} ({GUIDE})"
    )


def build_data(data_cfg: Any) -> Any:
    """``instantiate(data_cfg)``; its ``name:`` (the data's label, by which ``eval.py`` knows a run's data) is passed
    only to a class that takes it: a data module of one's own with ``__init__(self, batch_size)`` failed on it."""
    from hydra.utils import get_class, instantiate

    try:
        params = inspect.signature(get_class(str(data_cfg.get("_target_")))).parameters.values()
    except Exception:  # noqa: BLE001 - (a target that does not import: instantiate's own error says so)
        return instantiate(data_cfg)
    takes = any(p.name == "name" or p.kind is p.VAR_KEYWORD for p in params)
    if takes or "name" not in data_cfg:
        return instantiate(data_cfg)
    with open_dict(data_cfg):
        name = data_cfg.pop("name")
    try:
        return instantiate(data_cfg)
    finally:
        with open_dict(data_cfg):
            data_cfg.name = name


class CheckOwnBatches(Callback):
    """The first image batch of each stage from a data module of the user's own (not one of vitrel's: a subclass of
    a ``VisionDataModule`` outside vitrel is the user's) has its
    ``in_chans`` channels and ``img_size`` side (or ``[H, W]``): else an
    :class:`~vitrel.models.input_size.InputSizeError` naming both. A model of vitrel runs on any grid, so images of
    32 px from a data module that says 16 trained, silently, a model whose checkpoints say 16: ``predict.py`` resized
    files to 16 and ``eval.py`` reported 16. Not checked: training batches with ``size_choices``, NaFlex dicts,
    clips."""

    def __init__(self, dm: Any) -> None:
        self.dm, self.seen = dm, set()
        if is_vitrels(dm):  # (nothing to check, at any batch)
            self.seen = {"train", "val", "test"}

    def _check(self, batch: Any, stage: str) -> None:
        if stage in self.seen:
            return
        self.seen.add(stage)
        x = batch[0] if isinstance(batch, (tuple, list)) and batch else None
        if not isinstance(x, Tensor) or x.dim() != 4 or (stage == "train" and getattr(self.dm, "size_choices", None)):
            return
        want = (int(self.dm.in_chans), *(int(v) for v in to_2tuple(self.dm.img_size)))
        if tuple(x.shape[1:]) != want:
            raise InputSizeError(
                f"{type(self.dm).__name__}'s {stage} images are {'x'.join(map(str, x.shape[1:]))} (channels x height "
                f"x width), but its in_chans and img_size say {'x'.join(map(str, want))}: the model is built at those, "
                "and its checkpoints tell predict.py to resize files to them; set them to what its loaders give "
                f"({GUIDE})"
            )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._check(batch, "train")

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, *args: Any) -> None:
        self._check(batch, "val")

    def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, *args: Any) -> None:
        self._check(batch, "test")


class NoTrainingBatchError(ConfigError):
    """The training data gives no batch: the run would end "finished" having trained nothing."""


def _epoch_contents(trainer: Any) -> str:
    """What one process's training epoch is made of: its images, the batch size and ``drop_last``, where known."""
    dl = trainer.train_dataloader
    sampler, bs = getattr(dl, "sampler", None), getattr(dl, "batch_size", None)
    try:
        n = len(sampler) if sampler is not None else len(dl.dataset)
    except TypeError:  # (an iterable without a length)
        n = None
    parts = [f"{n:,} training images a process" if n is not None else "a training loader of unknown length"]
    if bs is not None:
        parts.append(f"data.batch_size={bs}" + (" with drop_last (whole batches only)" if dl.drop_last else ""))
    hint = "lower data.batch_size or set data.drop_last=false" if bs is not None and dl.drop_last else "add images"
    return f"{', '.join(parts)}: {hint}"


def planned_steps(trainer: Any) -> int:
    """``trainer.estimated_stepping_batches``, the optimizer steps a schedule is planned over: a finite run's, of at
    least one step; else a ``ValueError`` (no ``max_epochs`` nor ``max_steps``) or :class:`NoTrainingBatchError`
    naming ``trainer.max_steps=0`` or ``trainer.limit_train_batches=0``, else the epoch's contents (36 images and
    ``data.batch_size=128`` with ``drop_last``: no batch)."""
    total = trainer.estimated_stepping_batches
    if not float(total).is_integer():
        raise ValueError("the schedule needs a finite run: set trainer.max_epochs or trainer.max_steps")
    for key in ("max_steps", "limit_train_batches") if total < 1 else ():  # (Lightning's ways to train nothing)
        if float(getattr(trainer, key)) == 0:
            raise NoTrainingBatchError(
                f"trainer.{key}=0 trains nothing: trainer.max_epochs=0 tests the model as built or loaded, and "
                "eval.py ckpt_path=<checkpoint> scores a trained one"
            )
    if total < 1:
        raise NoTrainingBatchError(f"the training epoch has no batch: {_epoch_contents(trainer)}")
    return int(total)


class EveryEpochTrains(Callback):
    """A fit whose epochs hold no batch (:func:`planned_steps`), or a training epoch that ran none (a loader of
    shards whose every sample failed to decode under ``data.on_bad_sample=skip``, an iterable data set that yields
    nothing), stops the run with a :class:`NoTrainingBatchError`: else it ended "finished", having trained nothing."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        planned_steps(trainer)  # (no batch at all: Lightning's fit returns at once, "No training batches")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.current.completed == 0:  # (the epoch's, a resumed part too)
            raise NoTrainingBatchError(
                f"training epoch {trainer.current_epoch + 1} ran no batch: its loader gave nothing (the data's "
                "warnings above say why: every sample skipped under data.on_bad_sample=skip?)"
            )


def check_data_fits_model(dm: Any, model: torch.nn.Module, whose: str = "the model", training: bool = True) -> None:
    """Refuse, before any batch is made, data settings that the model ``model`` cannot take, naming the key and its
    value: ``data.patch_size`` (NaFlex batches, ``data.packing``) other than the model's patch size, and a side of
    ``data.size_choices`` that is not a positive multiple of it (or, for a model built with a strict input size, not
    its ``img_size``), as an :class:`~vitrel.models.input_size.InputSizeError` (one line from ``train.py``).
    ``whose`` names the model in the message (``evaluate``: the checkpoint). Models without a ``vitrel_cfg`` patch
    size are not checked. A video scheme fed token layouts (NaFlex batches; ``model.token_drop`` when ``training``) is
    a :class:`~vitrel.config.ConfigError`, and so are clips joined into inputs (``data.num_segments``) other than the
    model's ``num_segments``."""

    _check_schemes_take_layouts(dm, model, training)
    _check_segments(dm, model, whose)
    patch = (getattr(model, "vitrel_cfg", None) or {}).get("patch_size")
    if patch is None:
        return
    ph, pw = (int(v) for v in to_2tuple(patch))
    shown = ph if ph == pw else f"{ph}x{pw}"
    if getattr(dm, "packing", None) is not None and dm.patch_size is not None and (dm.patch_size,) * 2 != (ph, pw):
        raise InputSizeError(
            f"data.patch_size={dm.patch_size} but {whose} has patches of {shown}: NaFlex batches (data.packing="
            f"{dm.packing}) are cut into the model's patches; set data.patch_size={shown}"
        )
    choices = getattr(dm, "size_choices", None)
    if choices:
        pads = bool(model.vitrel_cfg.get("dynamic_img_pad"))  # (images of any size padded to whole patches)
        bad = [s for s in choices if s < 1 or (not pads and (s < max(ph, pw) or s % ph or s % pw))]
        if bad:
            raise InputSizeError(
                f"data.size_choices={list(choices)}: {', '.join(map(str, bad))} "
                f"{'is' if len(bad) == 1 else 'are'} not a positive multiple of the patch size {shown} of {whose}"
            )
        img = tuple(getattr(model, "img_size", ()) or ())
        fixed = [s for s in choices if (s, s) != img] if getattr(model, "strict_img_size", False) else []
        if fixed:
            raise InputSizeError(
                f"data.size_choices={list(choices)}: {whose} takes only its img_size {img} (strict_img_size); "
                "build it with dynamic_img_size=True (model.dynamic_img_size=true) for batches of other sizes"
            )


def _check_segments(dm: Any, model: torch.nn.Module, whose: str) -> None:
    """The data joins as many clips into an input as the model splits it into (else each clip would be cut in
    two, or two encoded as one, without an error)."""
    k = int((getattr(model, "vitrel_cfg", None) or {}).get("num_segments", 1))
    got = int(getattr(dm, "num_segments", 1))
    if is_video_data(dm) and k != got:
        raise ConfigError(
            f"data.num_segments={got} but {whose} encodes {k} clip(s) per input (its num_segments): set "
            f"data.num_segments={k} (eval.py: +model_overrides.num_segments=<n> with data.num_segments=<n> scores it "
            "with another count)"
        )


def _check_schemes_take_layouts(dm: Any, model: torch.nn.Module, training: bool) -> None:
    """NaFlex batches (``data.packing``) and token dropping (``model.token_drop``) give the attention token layouts,
    which a video scheme inside it (``rel3d_full`` on an image model: one frame) does not take: a
    :class:`~vitrel.config.ConfigError` naming its image form, before any batch (it came from the first forward, a
    traceback through Lightning's sanity check)."""
    from vitrel.pos.base import PositionScheme
    from vitrel.pos.registry import image_scheme

    packing, drop = getattr(dm, "packing", None), getattr(model, "token_drop", 0) if training else 0
    if packing is None and not drop:
        return
    for m in model.modules():
        if isinstance(m, PositionScheme) and m.kind != "absolute" and m.grid_dims == 3:
            given = f"data.packing={packing} (NaFlex batches)" if packing is not None else f"model.token_drop={drop}"
            image = image_scheme(type(m))
            raise ConfigError(
                f"pos={m.name} takes full video grids (T, H, W), and {given} gives the attention packed or "
                "token-dropped images, which video schemes do not take"
                + (f": use pos={image}, the same scheme on images" if image else "")
            )


# ------------------------------------------------------------------------------------------ video
def is_video_data(dm: Any) -> bool:
    """Whether the data module gives clips ``[B, C, T, H, W]`` (a :class:`vitrel.data.video.VideoDataModule`, or
    ``eval.py``'s test split of one, its ``scored_data``)."""
    from vitrel.data.video.base import VideoDataModule

    return isinstance(getattr(dm, "scored_data", dm), VideoDataModule)


def is_video_architecture(name: str) -> bool:
    """Whether the vitrel architecture ``name`` takes clips: its class is built with ``num_frames``."""
    from vitrel.models.registry import MODEL_ARGS, check_architecture

    cls = MODEL_ARGS[check_architecture(name)][0]
    return "num_frames" in inspect.signature(cls.__init__).parameters


def _model_configs(video: bool) -> list[str]:
    """The ``conf/model`` options whose architecture takes clips (``video``) or images."""
    from vitrel.models.registry import MODEL_ARGS

    out = []
    for path in sorted((Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml")):
        name = OmegaConf.load(path).get("name")
        if name in MODEL_ARGS and is_video_architecture(name) == video:
            out.append(f"model={path.stem}")
    return out


def check_video_pairing(architecture: str, dm: Any, whose: str = "the model", fix: str | None = None) -> None:
    """Refuse, before anything is built, a video data module with an image architecture or image data with a video
    architecture (a :class:`~vitrel.config.ConfigError`), naming the ``conf/model`` options that fit the data
    (``fix``: the advice instead, e.g. eval.py's data to score a checkpoint on)."""
    video = is_video_data(dm)
    if video == is_video_architecture(architecture):
        return

    data = type(dm).__name__
    if video:
        fits = ", ".join(_model_configs(True)) or "a vitrel_vit_video_* or vitrel_swin3d_* architecture"
        raise ConfigError(
            f"{data} gives clips [B, C, T, H, W] but {whose} ({architecture}) is an image model "
            f"(images [B, C, H, W]): {fix or 'use a video model: ' + fits}"
        )
    models = ", ".join(_model_configs(False))
    raise ConfigError(
        f"{data} gives images [B, C, H, W] but {whose} ({architecture}) is a video model (clips [B, C, T, H, W]): "
        f"{fix or f'use an image model ({models}) or video data (data=moving_fmnist, video_folder, video_list)'}"
    )


def check_channels_fit(model_cfg: DictConfig, dm: Any) -> None:
    """A ``model.in_chans`` set on the command line that the data's images do not have (``+model.in_chans=1`` on
    RGB data) is refused before the model is built, naming the keys; the model's own error came at the first step,
    under a traceback. Not checked: ``model=from_checkpoint`` (its first layer is adapted to the data's channels)."""

    want, have = model_cfg.get("in_chans"), getattr(dm, "in_chans", None)
    if want is None or have is None or int(want) == int(have) or model_cfg.get("path") is not None:
        return
    # grey data that repeats its channel on request (Fashion-MNIST, Moving Fashion-MNIST: data.in_chans=3)
    takes = int(want) == 3 and "in_chans" in inspect.signature(type(dm).__init__).parameters
    data = "data.in_chans=3 or " if takes else ""
    raise InputSizeError(
        f"model.in_chans={want} but {type(dm).__name__} gives {have}-channel images: set {data}leave model.in_chans "
        "unset (the data sets it)"
    )
