"""The data settings ``python eval.py`` takes from the checkpoint it scores and from the run that wrote it, where the
command line does not give them: which samples and how they are preprocessed (:data:`RUN_DATA_KEYS`, read from the
run folder's record by :func:`run_settings`; the val split stored in the checkpoint, :func:`stored_split`; the
loader, :func:`loader_used`), the size, clip length and clips the model was trained at (:func:`trained_size`,
:func:`trained_frames`, :func:`trained_clips`), its preprocessing (:func:`trained_preprocessing`), and what to give
for data that does not fit it (:func:`trained_data`). :func:`take_run_data` sets them on the config and logs them.
:mod:`vitrel.train.evaluate` uses them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra.utils import get_class
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from timm.layers import to_2tuple

from vitrel.config import ConfigError
from vitrel.data.normalisation import Normalisation
from vitrel.models.data_config import clip_field
from vitrel.models.run_record import loader_used
from vitrel.train.launch_paths import launch_path, recorded_launch_folder
from vitrel.train.utils import hydra_config, override_key, plain

if TYPE_CHECKING:
    import lightning as L

__all__ = [
    "CLIP_KEYS",
    "RUN_DATA_KEYS",
    "STORED_PREPROCESSING",
    "VAL_SPLIT_KEYS",
    "check_run_data",
    "is_given",
    "loader_used",
    "run_settings",
    "stored_split",
    "stored_split_record",
    "take_run_data",
    "trained_clips",
    "trained_data",
    "trained_frames",
    "trained_preprocessing",
    "trained_size",
]

#: The data keys eval.py takes from the run that wrote the checkpoint, unless given: those that say which samples are
#: scored and how they are preprocessed, read from the run folder's record when the run's data is the data scored.
#: ``img_size``, ``num_frames``, ``stride`` and ``clips_per_video`` come from the checkpoint itself
#: (:func:`trained_size`, ...; exports and moved checkpoints have them too). ``root`` is taken: the data the run read
#: (its ``${paths.data_dir}`` default resolves to eval's own); a folder that is not there is an error naming it.
#: ``loader`` is taken too (by :func:`run_settings`: the memory loader resizes tensors with torch, the workers loader
#: images with PIL, so a run's test is reproduced by its own). Not taken: how the samples are loaded (batch_size,
#: eval_batch_size, num_workers, pin_memory, memory_budget_gb), training-only keys (augment, augment_kwargs,
#: batch_augment, size_scale, size_choices, drop_last, num_samples), and the data's checks (download, verify,
#: on_bad_sample: their errors name the key to set).
RUN_DATA_KEYS = (
    # which samples: where they are, the split (val: a seeded hold-out of train), how many
    "root", "path", "subset", "train_dir", "val_dir", "source", "train_split", "val_split", "dataset_kwargs",
    "extensions", "num_classes", "seed", "val_fraction", "train_images", "test_images",
    # video lists: the list files, the SSv2 labels file, where their relative video paths are
    "train_list", "val_list", "labels_file", "video_dir", "video_ext",
    # the classes' names where the data's config gives them (arrays: not in the file), per_class.csv's and predict's
    "class_names",
    # Moving Fashion-MNIST's clips (with seed, the motions; train_images, the normalisation too)
    "size", "object_size", "speeds", "orientations",
    # preprocessing: channels, resize and crop, the translation canvas, NaFlex batches
    "in_chans", "interpolation", "crop_pct", "canvas_size", "canvas_mode",
    "packing", "seq_len", "patch_size", "max_tokens", "eval_max_ratio",
)  # fmt: skip
#: what a checkpoint without a run folder (moved, or an export) tells of its preprocessing: its stored data config's
#: (timm's ``pretrained_cfg`` fields, which timm's ``validate.py`` takes unless given; and ``in_chans``, its
#: ``input_size``'s channels); null in a data config: the data set's default (``default_<key>`` of its module)
STORED_PREPROCESSING = ("interpolation", "crop_pct")
#: the keys that choose the val split of a data set whose val is a seeded hold-out of train
VAL_SPLIT_KEYS = ("seed", "val_fraction")
#: a video folder's evaluation clips: the data key -> its name in the data config train.py stores
CLIP_KEYS = {
    "stride": "frame_stride", "clips_per_video": "clips_per_video", "spatial_crops": "spatial_crops",
    "frame_sampling": "frame_sampling",
}  # fmt: skip


log = logging.getLogger(__name__)


def is_given(key: str) -> bool:
    """Whether ``key`` is on the command line (outside Hydra, what was given cannot be told from a default: True)."""
    hc = hydra_config()
    return hc is None or key in [override_key(o) for o in hc.overrides.task]


def check_naflex_img_size(data_cfg: DictConfig, saved: dict) -> None:
    """Refuse ``data.img_size`` on the command line for NaFlex data (``data.packing``), other than the size the stored
    model (``saved``: its configuration) was built at: NaFlex batches score each image at its own size within
    ``data.max_tokens`` patches, so the key would only rebuild the model (its tables resized) while the record and an
    ``eval.py -m`` table named the size, every row scored alike (an audit's). A
    :class:`~vitrel.config.ConfigError` giving the two ways to score at that size."""
    size, built, patch = data_cfg.get("img_size"), saved.get("img_size"), saved.get("patch_size")
    if not data_cfg.get("packing") or not is_given("data.img_size") or size is None:
        return
    if built is not None and to_2tuple(size) == to_2tuple(built):
        return
    side = size if isinstance(size, int) else "x".join(str(s) for s in size)
    h, w = to_2tuple(size)
    ph, pw = to_2tuple(patch if patch is not None else data_cfg.get("patch_size") or 16)
    tokens = (h // ph) * (w // pw)
    raise ConfigError(
        f"data.img_size={side}: NaFlex data (data.packing={data_cfg.packing}) scores each image at its own size within "
        f"data.max_tokens patches, not at data.img_size; to score images at {side}: data.max_tokens={tokens} "
        f"data.seq_len={max(tokens, int(data_cfg.get('seq_len') or 0))} data.eval_max_ratio=null (images of one "
        f"size, enlarged to fill the budget), or data.packing=false data.img_size={side} (image tensors)"
    )


def take_run_data(cfg: DictConfig, values: dict[str, Any], what: str) -> dict[str, Any]:
    """Set the data keys of ``values`` (taken from the checkpoint or its run) and log them, ``what`` saying what they
    are; return them."""
    if values:
        with open_dict(cfg):
            cfg.data.update(values)
        rank_zero_info(" ".join(f"data.{k}={_override_text(v)}" for k, v in values.items()) + f": {what}")
    return values


def _override_text(value: Any) -> str:
    """``value`` as a command-line override writes it (``null``, ``[1,2]``)."""
    if isinstance(value, list):
        return f"[{','.join(map(_override_text, value))}]"
    return "null" if value is None else str(value)


def stored_split(ckpt: Path, data_cfg: DictConfig) -> dict[str, Any]:
    """``seed`` / ``val_fraction`` of the split the weights were trained with, as the checkpoint holds it (the data
    module's state Lightning saves, ``VisionDataModule.state_dict``) when it was written by the data module of
    ``data_cfg``: they win over the run folder's record, which a later command in that folder rewrites. Empty for
    other files (exports, weights) and checkpoints written before vitrel kept the split."""
    record = stored_split_record(ckpt, data_cfg)
    return {k: record[k] for k in VAL_SPLIT_KEYS if k in record}


def stored_split_record(ckpt: Path, data_cfg: DictConfig) -> dict[str, Any]:
    """The whole split record :func:`stored_split` reads (:func:`~vitrel.data.datasets.split_record`: with the
    ``pool`` of training samples it was drawn from and the ``val_digest`` of the held-out indices); empty where
    there is none."""
    if ckpt.suffix != ".ckpt" or not ckpt.is_file() or not data_cfg.get("_target_"):
        return {}
    state = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    return dict((state.get(get_class(str(data_cfg._target_)).__qualname__) or {}).get("split") or {})


def run_settings(
    ckpt: Path, record: tuple[Path, DictConfig | None], stored_data: dict, split: dict[str, Any], data_cfg: DictConfig
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``(taken, given, where)``: the data settings of the run that wrote ``ckpt`` (:data:`RUN_DATA_KEYS`) where they
    differ from ``data_cfg``'s and are not on the command line; those on it whose run value differs (the run's value);
    and where they come from. The run folder's record when there is one, for the same data (``data.name``; other
    data keeps its group's defaults): its interpolations resolved against that record, here (``${paths.data_dir}`` is
    eval's own data folder, as by default), a relative ``root`` / ``path`` the run was given against the folder it
    was launched from (:func:`_literal_run_path`); a value that does not resolve is an error naming the key to give.
    Without
    a record, the preprocessing stored with the weights (``stored_data``). Either way the split the checkpoint holds
    (``split``, :func:`stored_split`) gives ``seed`` and ``val_fraction``. ``record``:
    :func:`~vitrel.models.run_record.run_record`."""
    path, run = record
    raw = {}
    if run is not None:
        if not _same_data(run, data_cfg):
            return {}, {}, ""
        keys, node, where = [k for k in RUN_DATA_KEYS if k in run.data], run.data, str(path)
        raw = OmegaConf.to_container(node, resolve=False)
    else:  # (its channels: those of its input_size, as timm's validate.py takes the model's)
        channels = {"in_chans": stored_data["input_size"][0]} if stored_data.get("input_size") else {}
        node = {**stored_data, **channels}
        keys, where = [k for k in (*STORED_PREPROCESSING, "in_chans") if k in node], "the data config stored with it"
    if split:
        keys = [*keys, *(k for k in split if k not in keys)]
        where += f"{' and ' if where else ''}the split stored in {ckpt.name}"
    taken, given = {}, {}
    for k in (k for k in keys if k in data_cfg):
        on_command_line = is_given(f"data.{k}")
        try:
            value = split[k] if k in split else plain(node[k])
            if k in ("root", "path"):  # (not ${paths.data_dir}: eval's own, resolved here)
                literal = _literal_run_path(raw.get(k), path)
                value = literal if literal is not None else launch_path(value)
        except OmegaConfBaseException as e:
            if on_command_line:
                continue
            why = str(e).splitlines()[0]
            raise ValueError(
                f"data.{k}={raw.get(k)} of {path} does not resolve here ({why}): give data.{k}=<the run's>"
            ) from e
        if _as_used(data_cfg, k, value) != _as_used(data_cfg, k, plain(data_cfg[k])):
            (given if on_command_line else taken)[k] = value
    if taken.get("packing") and "loader" in data_cfg and not is_given("data.loader"):
        taken["loader"] = "workers"  # (NaFlex batches are made per sample, by the workers loader only)
    elif run is not None and "loader" in data_cfg and not is_given("data.loader"):
        loader = loader_used(run.data.get("loader"), data_cfg)  # (its resize: torch's on tensors, or PIL's)
        if loader is not None and loader != loader_used(data_cfg.get("loader"), data_cfg):
            taken["loader"] = loader
    return taken, given, where


def _same_data(run: DictConfig, data_cfg: DictConfig) -> bool:
    """Whether the run's record ``run`` is of the data scored: the same ``data.name``. Configs of one's own without a
    name are not known as the same (two such files, of two data sets, would pass the run's ``root`` or ``seed`` to
    the other)."""
    name = run.data.get("name") if run.get("data") is not None else None
    return name is not None and name == data_cfg.get("name")


def check_run_data(ckpt: Path, run: DictConfig | None, data_cfg: DictConfig, fix: str) -> str:
    """Whether the data scored is the data of the run that wrote ``ckpt`` (``data.name`` of its record ``run``).
    Without ``data=`` on the command line, another data set is a :class:`~vitrel.config.ConfigError` naming the
    run's (``fix``: :func:`trained_data`): eval.py's default group would be scored in its place, silently when
    classes and channels agree (a ``fashion_mnist_full`` run scored on the shipped subset, whose val split holds
    images that run trained on). With ``data=`` given, the warning to log (none of the run's data settings are
    taken); empty when the data is the run's, or the run's record names none."""
    name = run.data.get("name") if run is not None and run.get("data") is not None else None
    if name is None or name == data_cfg.get("name"):
        return ""
    if not is_given("data"):
        raise ConfigError(
            f"{ckpt} was trained on data={name}, but eval.py scores data={data_cfg.get('name')} unless told: {fix}"
        )
    return (
        f"scoring data={data_cfg.get('name')}, not the data {ckpt.name}'s run trained on (data={name}): none of "
        "the run's data settings are taken, and a val split held out of train may hold images the run trained on"
    )


def _literal_run_path(raw: Any, record: Path) -> str | None:
    """A ``root`` / ``path`` of the run's record ``record`` (``<run>/.hydra/config.yaml``) as written there (``raw``,
    unresolved) when it is a literal path, not an interpolation (``${paths.data_dir}`` is eval's own, resolved here):
    a relative one made absolute against the folder the run was launched from
    (:func:`~vitrel.train.launch_paths.recorded_launch_folder`), or, where the record has no ``hydra.yaml`` beside it
    to say which, against eval's own launch folder; None for an interpolation or no string. One rule for the settings
    taken from the run (:func:`run_settings`) and the ``data.root`` the advice of :func:`trained_data` names."""
    if not isinstance(raw, str) or "${" in raw:
        return None
    return launch_path(raw, recorded_launch_folder(record))


def _as_used(data_cfg: DictConfig, key: str, value: Any) -> Any:
    """``value`` of ``data.<key>`` as the data module uses it (a null interpolation or crop_pct: its default)."""
    if value is None and key in STORED_PREPROCESSING and data_cfg.get("_target_"):
        return getattr(get_class(str(data_cfg._target_)), f"default_{key}", None)
    return value


def trained_size(saved: dict, stored_data: dict, data_cfg: DictConfig) -> dict[str, int]:
    """``img_size``, when ``data.img_size`` is not given (null) and the model takes image tensors (not NaFlex
    batches, whose images keep their own sizes): the side of the images the stored model was trained on (its stored
    data config's ``input_size``; a model built at another size, ``+model.img_size``, is kept as built), else the
    side it was built at when square; else empty, and for a data module without an ``img_size`` argument (one of
    the user's own, whose images are of its own size: the model is built at its ``img_size`` attribute)."""
    if (
        "img_size" not in data_cfg
        or data_cfg.get("img_size") is not None
        or data_cfg.get("packing")
        or saved.get("img_size") is None
    ):
        return {}
    h, w = to_2tuple(saved["img_size"])
    fed = list(stored_data.get("input_size") or [])[-2:]
    if len(fed) == 2 and fed[0] == fed[1]:
        return {"img_size": int(fed[0])}
    return {"img_size": int(h)} if h == w else {}


def trained_frames(saved: dict, data_cfg: DictConfig, key: str = "num_frames") -> dict[str, int]:
    """``num_frames``: the clip length a stored video model was trained at, when video data is scored without
    ``data.num_frames`` on the command line (the data group's default would otherwise rebuild the model for its own
    length); else empty. ``key="num_segments"``: the clips one of its inputs joins (the data must give as many)."""
    if saved.get(key) is None or key not in data_cfg or is_given(f"data.{key}"):
        return {}
    return {key: int(saved[key])}


def trained_channels(saved: dict, data_cfg: DictConfig) -> dict[str, int]:
    """``in_chans``: the channels the stored model takes, for data given on the command line (``data=``) that makes
    either (``data.in_chans``: grey Fashion-MNIST repeated to RGB, video files made grey) without ``data.in_chans``, as
    timm's ``validate.py`` takes the model's; else empty (the default data group, not chosen, scored with another
    model's channels: refused, naming the run's data)."""
    chans = saved.get("in_chans")
    chosen = is_given("data") and not is_given("data.in_chans")
    if chans is None or "in_chans" not in data_cfg or not chosen or data_cfg.in_chans == chans:
        return {}
    return {"in_chans": int(chans)}


def trained_clips(stored_data: dict, data_cfg: DictConfig) -> dict[str, int | str]:
    """The evaluation clips of the run that wrote ``ckpt`` (``data.stride``, ``data.clips_per_video``,
    ``data.spatial_crops``, ``data.frame_sampling``), for those of the data's keys not on the command line: the data
    group's defaults would score other clips than the run's own test did. Empty for data without them (images, Moving
    Fashion-MNIST) or a checkpoint that does not store them."""
    keys = [k for k in CLIP_KEYS if k in data_cfg and not is_given(f"data.{k}")]
    unknown = [k for k in keys if k in ("stride", "clips_per_video") and not stored_data.get(CLIP_KEYS[k])]
    if unknown:  # (spatial_crops, frame_sampling: stored later; absent, they were 1 crop and strided frames)
        log.warning(
            "the checkpoint stores no clip sampling (%s): clips are sampled with data=%s's %s, which need not be the "
            "model's evaluation clips; give them on the command line",
            ", ".join(CLIP_KEYS[k] for k in unknown), data_cfg.get("name", "?"),
            ", ".join(f"data.{k}={data_cfg[k]}" for k in unknown),
        )  # fmt: skip
    return {k: clip_field(CLIP_KEYS[k], stored_data[CLIP_KEYS[k]]) for k in keys if stored_data.get(CLIP_KEYS[k])}


def trained_preprocessing(
    ckpt: Path, stored_data: dict, run: DictConfig | None, cfg: DictConfig, dm: L.LightningDataModule
) -> dict[str, Any]:
    """The preprocessing ``ckpt`` was trained with (its stored data config, what train.py used: a fine-tune takes
    the pretrained weights', which its run record leaves null) where the config leaves it null and the data set's
    own differs (:meth:`~vitrel.data.normalisation.Normalisation.adopt`: set on ``dm``, logged), put into
    ``cfg.data``. Not for other data than the run's (which keeps its group's defaults, as :data:`RUN_DATA_KEYS`)."""
    if run is not None and not _same_data(run, cfg.data):
        return {}
    if not isinstance(dm, Normalisation):
        return {}
    taken = dm.adopt(stored_data, f"those {ckpt.name} was trained with (its stored data config)", cfg.data)
    with open_dict(cfg):
        cfg.data.update(taken)
    return taken


def trained_data(record: tuple[Path, DictConfig | None]) -> str:
    """What to do about data that does not fit the checkpoint: score it on the ``data=`` of the train.py run that wrote
    it (``record``, :func:`~vitrel.models.run_record.run_record`), as overrides: its ``data.root`` and, for a copy the
    run did not check against the official md5s, ``data.verify=false`` (not taken from the run:
    :data:`RUN_DATA_KEYS`)."""
    run_cfg, run = record
    data = run.get("data") if run is not None else None
    if not data or not data.get("name"):
        what = "data=<that data set>" + ("" if is_given("data") else " (eval.py reads data=fashion_mnist unless told)")
    else:
        root = _literal_run_path(OmegaConf.to_container(data, resolve=False).get("root"), run_cfg)
        given = f" data.root={root}" if root is not None else ""
        if data.get("verify") is False:  # a copy not checked against the official md5s: checked, it would stop here
            given += " data.verify=false"
        what = f"data={data.name}{given} (its run's {run_cfg})"
    return f"score it on the data it was trained on, {what}"
