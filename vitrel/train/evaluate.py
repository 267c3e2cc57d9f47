"""Score a checkpoint on a data set at any image size: ``python eval.py ckpt_path=... data.img_size=48``.

A video checkpoint takes video data and any clip length: ``python eval.py ckpt_path=... data=moving_fmnist
data.num_frames=16`` (the model rebuilt for 16 frames, as for another image size); without ``data.num_frames``, the
clip length it was trained at, and without ``data.stride`` / ``data.clips_per_video`` the clips its run was tested on.

It scores the samples the checkpoint's run was scored on: the data settings that say which samples and how they are
preprocessed (the val split's ``data.seed`` and ``data.val_fraction``, the clips' motions, ``data.crop_pct``, ...
:data:`~vitrel.train.eval_data.RUN_DATA_KEYS`) are the run's, read from its folder's ``.hydra/config.yaml`` when its
data is the data scored, unless given on the command line; another ``data=`` keeps its group's defaults. A checkpoint
without its run folder (moved, an export) gives its stored ``interpolation`` and ``crop_pct``, as timm's ``validate.py``
takes them from the model's ``pretrained_cfg``. What is taken is logged in one line and recorded in
``eval_metrics.json`` (``data_from_run``). Which settings are taken, and how, is :mod:`vitrel.train.eval_data`'s.

With NaFlex data (``data.packing``, e.g. ``data=fashion_mnist_naflex``) every image is scored at its own size and
aspect ratio (within ``data.max_tokens`` patches, never enlarged with ``data.eval_max_ratio=1``), packed into rows
as in training.

The network is rebuilt from the configuration stored with the weights (``vitrel.load_model``), at
``data.img_size``, by default (null) the size the model was trained at (timm's ``validate.py`` takes the model's
input size too): learned relative tables and absolute embeddings are resized on load, the
parameter-free and continuous schemes extend by themselves. Results go to stdout and to
``<run dir>/eval_metrics.json``, with the number of images scored (fewer than the split's with
``trainer.limit_test_batches``).
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig
from timm.layers import to_2tuple

from vitrel.config import (
    ConfigError,
    EvalConfig,
    check_moved_keys,
    check_top_keys,
    data_val_fraction,
)
from vitrel.data.unreadable import ReportUnreadable
from vitrel.models.checkpoint import CheckpointError, weights_ema
from vitrel.models.ckpt_files import run_checkpoint, stored_config
from vitrel.models.data_config import NoDataConfigWarning, stored_data_config
from vitrel.models.input_size import check_patches_fit
from vitrel.models.run_record import nominal_size_warning, run_record
from vitrel.train.data_contract import (
    CheckOwnBatches,
    build_data,
    check_data_fits_model,
    check_data_module,
    check_video_pairing,
    is_video_data,
)
from vitrel.train.eval_data import (
    CLIP_KEYS,
    VAL_SPLIT_KEYS,
    check_naflex_img_size,
    check_run_data,
    is_given,
    run_settings,
    stored_split_record,
    take_run_data,
    trained_channels,
    trained_clips,
    trained_data,
    trained_frames,
    trained_preprocessing,
    trained_size,
)
from vitrel.train.flops import eval_gflops
from vitrel.train.launch_paths import EVAL_PATHS, launch_paths
from vitrel.train.module import ClassifierModule
from vitrel.train.progress import CountTestImages, progress_bar_kind, progress_callbacks
from vitrel.train.resume import missing_checkpoint
from vitrel.train.run_figures import RunFigures
from vitrel.train.sweep_rerun import swept_settings
from vitrel.train.target_keys import check_keys_taken, check_seed
from vitrel.train.utils import (
    apply_matmul_precision,
    check_accelerator,
    plain,
    route_lightning_logs,
    run_dir_of,
    scalars,
    task_overrides,
)

__all__ = ["evaluate"]
log = logging.getLogger(__name__)


class _SplitData(L.LightningDataModule):
    """``split`` of ``dm`` as the test loader, made once the test has started, so that under several processes
    (``trainer.devices=2``) each rank scores its part of the split and every image is scored once: made before, every
    rank would score all of it (the ranks unknown). The data module gives each rank its part
    (:class:`~vitrel.data.sampling.EvalSampler`: not Lightning's ``DistributedSampler``, which repeats images)."""

    def __init__(self, dm: L.LightningDataModule, split: str) -> None:
        super().__init__()
        self.dm, self.split = dm, split

    def test_dataloader(self) -> Any:
        self.dm.trainer = self.trainer  # (a vitrel data module reads the ranks and the device from its trainer)
        return self.dm.test_dataloader() if self.split == "test" else self.dm.val_dataloader()

    @property
    def class_names(self) -> list[str] | None:
        """The data module's (the per-class report names the classes by them)."""
        return getattr(self.dm, "class_names", None)

    @property
    def scored_data(self) -> L.LightningDataModule:
        """The data module whose split is scored (what :func:`~vitrel.train.data_contract.is_video_data` asks of)."""
        return self.dm


def _built_apart(saved: dict, stored_data: dict) -> bool:
    """Whether the stored model was built at a non-square ``img_size`` (``(H, W)``, H != W; the data's images are
    square), or at another size than the images it was trained on (``+model.img_size``)."""
    if saved.get("img_size") is None:
        return False
    built, fed = tuple(to_2tuple(saved["img_size"])), tuple(list(stored_data.get("input_size") or [])[-2:])
    return len(set(built)) > 1 or (len(fed) == 2 and fed != built)


def _nominal_size(
    ckpt: Path, saved: dict, trained: dict[str, int], record: tuple[Path, DictConfig | None]
) -> str | None:
    """The warning when the fixed size ``trained`` taken from the checkpoint is only the size a NaFlex run built its
    model at (:func:`~vitrel.models.run_record.nominal_size_warning`; ``record``: the run record, read once); None
    otherwise."""
    if "img_size" not in trained or saved.get("patch_size") is None or ckpt.suffix != ".ckpt":
        return None
    fix = "leave data.packing as the run's to score its images as it did"
    patch = int(to_2tuple(saved["patch_size"])[0])
    return nominal_size_warning(ckpt, trained["img_size"], patch, fix, "data.img_size", record)


def _size_choices(stored_data: dict, run: DictConfig | None) -> list[int]:
    """The ``data.size_choices`` the stored model was trained at: those stored with it (its data config), else (a
    checkpoint written before vitrel stored them) its run folder's record ``run``."""
    choices = stored_data.get("size_choices") or ((run.get("data") or {}).get("size_choices") if run else None)
    return [int(s) for s in choices or []]


def _size_choice_of_the_run(saved: dict, choices: list[int], dm: Any) -> bool:
    """Whether the data's ``img_size`` is one of the ``choices`` (:func:`_size_choices`): the run trained the stored
    model on batches of that size as built, its learned tables read at their edge past their offsets. Rebuilding
    the model at that size would interpolate those offsets instead, so it is loaded as stored and called at that
    size."""
    size = getattr(dm, "img_size", None)
    if size is None or saved.get("img_size") is None or getattr(dm, "packing", None):
        return False
    h, w = to_2tuple(size)  # (a data module of the user's own may give [H, W]; choices are square sides)
    return h == w and int(h) in choices


def _warn_other_val_split(ckpt: Path, data_cfg: DictConfig, given: dict[str, Any]) -> None:
    """``split=val`` with ``data.seed`` / ``data.val_fraction`` given unlike the run's (``given``: the run's values
    of the keys on the command line that differ): that hold-out is not the run's and may hold images the run trained
    on (with the run's ``val_fraction=0``, all of them): a warning."""
    other = [f"data.{k}={plain(data_cfg[k])} (the run's: {given[k]})" for k in VAL_SPLIT_KEYS if k in given]
    if other and rank_zero_only.rank == 0:
        log.warning(
            f"split=val with {', '.join(other)}: not the val split {ckpt.name}'s run held out of train; it may hold "
            "images the run trained on (drop the override to score the run's)"
        )


def _warn_unknown_val_split(ckpt: Path, data_cfg: DictConfig, split: dict[str, Any], run: DictConfig | None) -> None:
    """``split=val`` of weights that record no val split (an export folder, a weights file, an old checkpoint out of
    its run folder), on data whose val is a seeded hold-out of train: the group's hold-out is scored, which holds
    images the run trained on unless its ``data.seed`` / ``data.val_fraction`` were the run's: a warning naming them,
    unless both are on the command line. ``split``: the split stored in ``ckpt``; ``run``: its run's record."""
    if not data_val_fraction(data_cfg) or all(is_given(f"data.{k}") for k in VAL_SPLIT_KEYS):
        return
    if split or run is not None or rank_zero_only.rank != 0:
        return
    held = " ".join(f"data.{k}={plain(data_cfg.get(k))}" for k in VAL_SPLIT_KEYS)
    log.warning(
        f"split=val: {ckpt.name} records no val split (a .ckpt does): scored the hold-out of {held}, which holds "
        "images the run trained on unless those were its values; give the run's data.seed and data.val_fraction, "
        "or score split=test"
    )


def _check_val_split_is_the_runs(ckpt: Path, dm: L.LightningDataModule, theirs: dict[str, Any], fix: str) -> None:
    """``split=val`` of the run's data: the hold-out scored is the one the run held out of train, as ``ckpt`` records
    it (``theirs``: :func:`~vitrel.train.eval_data.stored_split_record`), unless ``data.seed`` / ``data.val_fraction``
    are given (warned by :func:`_warn_other_val_split`). Else a :class:`ConfigError`: the hold-out of other data (a
    ``fashion_mnist_full`` checkpoint out of its run folder scored on the default ``fashion_mnist``, whose hold-out
    is mostly images that run trained on)."""
    if "pool" not in theirs or not hasattr(dm, "split_record") or any(is_given(f"data.{k}") for k in VAL_SPLIT_KEYS):
        return
    mine = dm.split_record()
    if mine == theirs:
        return
    then, now = (f"{r.get('val_fraction')} of {r.get('pool')} training samples" for r in (theirs, mine))
    raise ConfigError(
        f"split=val: {ckpt.name}'s run held out {then} (seed {theirs.get('seed')}), this data {now} (seed "
        f"{mine.get('seed')}): another hold-out than the run's, which may hold images it trained on; {fix}, or score "
        "split=test"
    )


def _check_data_matches(ckpt: Path, stored: dict, dm: L.LightningDataModule, data_cfg: DictConfig, fix: str) -> None:
    """The data gives the model's classes and channels; else a :class:`ConfigError` naming the data to give instead
    (``fix``: :func:`~vitrel.train.eval_data.trained_data`), or, for data that makes either channel count
    (``data.in_chans`` given otherwise), the ``data.in_chans`` to give."""
    samples = "clips" if is_video_data(dm) else "images"
    chans = stored.get("in_chans")
    if stored.get("num_classes") != dm.num_classes:
        what = f"classifies {stored.get('num_classes')} classes but {type(dm).__name__} has {dm.num_classes}"
    elif chans != dm.in_chans:
        what = f"takes {chans}-channel {samples} but {type(dm).__name__} gives {dm.in_chans}"
        if "in_chans" in data_cfg and is_given("data"):  # (data chosen: only its channels differ)
            fix = f"give data.in_chans={chans} (or leave it out: eval.py takes the model's)"
    else:
        return
    raise ConfigError(f"{ckpt} {what} (data={data_cfg.get('name')}): {fix}")


def _warn_other_class_names(ckpt: Path, stored_data: dict, dm: L.LightningDataModule) -> None:
    """The data's class names where they differ from those stored with the weights: labels are compared with the
    model's outputs by index, so a class folder renamed (or sorting elsewhere) scores against another class."""
    stored = stored_data.get("class_names")
    names = getattr(dm, "class_names", None)
    if not stored or not names or len(stored) != len(names):
        return
    diff = [(i, str(a), str(b)) for i, (a, b) in enumerate(zip(stored, names)) if str(a) != str(b)]
    if diff and rank_zero_only.rank == 0:  # (a log warning, as eval.py's others: on the console and in eval.log)
        shown = "; ".join(f"class {i} is {b!r} here but {a!r} in {ckpt.name}" for i, a, b in diff[:3])
        more = f" ({len(diff)} classes differ)" if len(diff) > 3 else ""
        log.warning(
            f"{shown}{more}: eval.py scores the model's output i against the data's class i (by index), so these "
            "classes are scored against others; give the data the checkpoint was trained on"
        )


def _check_patches_fit(ckpt: Path, stored: dict, dm: L.LightningDataModule) -> None:
    """The data's images are a whole number of the stored model's patches (NaFlex batches are cut by the data): else
    an :class:`~vitrel.models.input_size.InputSizeError` naming the ``data.img_size`` to set."""
    patch, trained = stored.get("patch_size"), stored.get("img_size")
    if patch is None or trained is None or getattr(dm, "packing", None) or getattr(dm, "img_size", None) is None:
        return
    if stored.get("dynamic_img_pad"):  # (the model pads images of any size to whole patches)
        return
    (ph, pw), (th, tw), (sh, sw) = to_2tuple(patch), to_2tuple(trained), to_2tuple(dm.img_size)
    if ph == pw and th == tw and sh == sw:  # (square patches and size, as data.img_size; [H, W] of one's own data)
        whose = f"{ckpt} ({stored.get('architecture')})"
        why = "the size it was trained at, what eval.py takes without data.img_size"
        check_patches_fit(int(sh), int(ph), type(dm).__name__, whose, int(th), why)


def _naflex_size(dm: Any, patch: Any) -> list[int] | None:
    """``[H, W]`` every image of a NaFlex evaluation is scored at, for data whose images share one size (timm's
    ``ResizeToSequence`` rule, as the data module's eval transform applies it); None for images of many sizes."""
    from timm.data.naflex_transforms import get_image_size_for_seq

    native = getattr(dm, "native_size", 0)
    if not getattr(dm, "fixed_size", False) or not native or patch is None:
        return None
    _, hw = get_image_size_for_seq((native, native), to_2tuple(patch), int(dm.max_tokens), max_ratio=dm.eval_max_ratio)
    return [int(hw[0]), int(hw[1])]


def _naflex_where(dm: Any, size: list[int] | None, patch: Any) -> str:
    """What a NaFlex evaluation ran at, for the closing line (its ``)`` left to the caller): the size images of one
    size were scored at (native or resized), else the rule of ``data.eval_max_ratio``."""
    rows = f"NaFlex {dm.packing}, at most {dm.max_tokens} patches an image, rows of {dm.seq_len}"
    if size is not None:
        grid = "x".join(str(s // p) for s, p in zip(size, to_2tuple(patch)))
        native = size == [dm.native_size] * 2
        return f"at {'the images' + chr(39) + ' native ' if native else ''}{size[0]}x{size[1]} (grid {grid}, {rows}"
    ratio = dm.eval_max_ratio
    if ratio is None:
        how = "each image resized to fill the patch budget (data.eval_max_ratio=null)"
    elif ratio == 1:
        how = "each image at its native size (rounded up to whole patches; larger ones scaled down)"
    else:
        how = f"each image enlarged up to {ratio:g}x its native size (data.eval_max_ratio)"
    return f"with {how} ({rows}"


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Load ``cfg.ckpt_path``, score it on ``cfg.split`` of ``cfg.data``; return the metrics."""
    import vitrel

    check_moved_keys(cfg)
    check_top_keys(cfg, EvalConfig, "eval.py")  # +split_name=val: composed and ignored
    launch_paths(cfg, EVAL_PATHS)  # ckpt_path=runs/a: the launch folder's, also under hydra.job.chdir=true
    check_keys_taken(cfg)  # +trainer.max_epoch=1, +data.batchsize=32: a TypeError once the run has begun
    check_accelerator(cfg.trainer, "evaluate")  # trainer=gpu on a machine without one: what to run instead
    t0 = time.time()
    route_lightning_logs()
    check_seed(cfg.seed)  # (seed=-1: Lightning's traceback)
    for key, instead in (("img_size", "data.img_size=<n>"), ("use_ema", "ema=true or ema=false")):
        if key in (cfg.get("model_overrides") or {}):  # (a TypeError in vitrel.load_model's call otherwise)
            raise ConfigError(f"model_overrides.{key}: eval.py sets it itself, from {instead}: give that instead")
    split = str(cfg.get("split", "test"))
    if split not in ("test", "val"):
        raise ConfigError(f"split={split}: eval.py scores split=test (the default) or split=val")
    L.seed_everything(int(cfg.seed), workers=True)
    apply_matmul_precision(cfg)
    ckpt = Path(str(cfg.ckpt_path)).expanduser()
    if not ckpt.exists():
        raise CheckpointError(missing_checkpoint(str(cfg.ckpt_path)))
    ckpt = run_checkpoint(ckpt)  # a train.py run folder: the checkpoint its test scored (logged)
    if ckpt.is_file() and ckpt.suffix.lower() == ".pt2":  # (torch.load would call it a damaged checkpoint)
        weights = ckpt.parent if (ckpt.parent / "config.json").is_file() else "<the .ckpt it came from>"
        raise CheckpointError(
            f"{ckpt} is a torch.export program: eval.py rebuilds the model from its weights and does not read "
            f"programs (predict.py does): give ckpt_path={weights}"
        )
    # the weights scored: an export's own (recorded; None where it records none), a .ckpt's as ema= says
    use_ema = weights_ema(ckpt, cfg.get("ema", "auto"), strict=True)

    saved = stored_config(ckpt) or {}
    # what the checkpoint and its run folder tell, read once: the run's record, the data config and split stored
    record, stored_data = run_record(ckpt), stored_data_config(ckpt) or {}
    held_record = stored_split_record(ckpt, cfg.data)
    held = {k: held_record[k] for k in VAL_SPLIT_KEYS if k in held_record}
    fix = trained_data(record)
    other_data = check_run_data(ckpt, record[1], cfg.data, fix)  # (another data set than the run's: given, or refused)
    if other_data and rank_zero_only.rank == 0:
        log.warning(other_data)
    # what the command line leaves to the data group's defaults, taken from the checkpoint's run instead (logged):
    # first which samples and how preprocessed (a canvas or NaFlex batches decide the size below)
    settings, given, where = run_settings(ckpt, record, stored_data, held, cfg.data)
    if split == "val":
        _warn_other_val_split(ckpt, cfg.data, given)
        _warn_unknown_val_split(ckpt, cfg.data, held, record[1])
    what = f"the data settings of {ckpt.name}'s run ({where}; data.<key>=<v> for others)"
    taken = take_run_data(cfg, settings, what)
    check_naflex_img_size(cfg.data, saved)  # (NaFlex batches keep their images' sizes: data.img_size refused)
    # a model built at a non-square (H, W), or at another size than its images, stays so unless data.img_size is given
    keep_shape = _built_apart(saved, stored_data) and cfg.data.get("img_size") is None and not cfg.data.get("packing")
    what = f"the size {ckpt.name} was trained at (data.img_size=<n> for another)"  # as timm's validate.py
    if keep_shape:
        shape = "x".join(map(str, to_2tuple(saved["img_size"])))
        what = f"the size of the images {ckpt.name} was trained on, its model kept at {shape} (data.img_size=<n>)"
    trained = trained_size(saved, stored_data, cfg.data)
    nominal = _nominal_size(ckpt, saved, trained, record)
    if nominal:  # a NaFlex run's model size, which its training never fed it
        what = f"the size {ckpt.name}'s model was built at (data.img_size=<n> for another)"
    taken |= take_run_data(cfg, trained, what)
    if nominal:
        log.warning(nominal)
    what = f"the clip length {ckpt.name} was trained at (data.num_frames=<n> for another)"
    taken |= take_run_data(cfg, trained_frames(saved, cfg.data), what)
    what = f"the clips {ckpt.name}'s model joins into an input (its num_segments)"
    taken |= take_run_data(cfg, trained_frames(saved, cfg.data, "num_segments"), what)
    what = f"the evaluation clips of {ckpt.name}'s run (data.<key>=<v> for others)"
    taken |= take_run_data(cfg, trained_clips(stored_data, cfg.data), what)
    what = f"the channels {ckpt.name}'s model takes (data.in_chans=<n> for others)"
    taken |= take_run_data(cfg, trained_channels(saved, cfg.data), what)
    dm = build_data(cfg.data)  # (its name: passed to a class that takes it)
    check_data_module(dm)  # (one of the user's own without num_classes, in_chans, img_size: named)
    taken |= trained_preprocessing(ckpt, stored_data, record[1], cfg, dm)
    overrides = dict(plain(cfg.get("model_overrides")) or {})
    given = dict(overrides)  # (recorded with the result: the model scored is not the stored one)
    arch = saved.get("architecture")
    if arch is not None:  # clips for a video model, images for an image model: before the weights are read
        check_video_pairing(str(arch), dm, str(ckpt), fix=fix)
    if is_video_data(dm):  # the clips' length, as the images' size: learned tables resized on load
        overrides.setdefault("num_frames", dm.num_frames)
    if saved:  # classes and channels, and images the model can cut into patches: before the weights are read
        built = {**saved, **overrides}
        _check_data_matches(ckpt, built, dm, cfg.data, fix)
        _check_patches_fit(ckpt, built, dm)
    as_trained = _size_choice_of_the_run(saved, _size_choices(stored_data, record[1]), dm)
    if as_trained:
        log.info("data.img_size=%s is one of the run's data.size_choices: the model runs as trained", dm.img_size)
    size = saved["img_size"] if as_trained or keep_shape else dm.img_size
    with warnings.catch_warnings():  # (the data config of the run normalises here, not the checkpoint's defaults)
        warnings.simplefilter("ignore", NoDataConfigWarning)
        model = vitrel.load_model(ckpt, use_ema="auto" if use_ema is None else use_ema, img_size=size, **overrides)
    stored = getattr(model, "vitrel_cfg", {})
    _check_data_matches(ckpt, stored, dm, cfg.data, fix)
    check_data_fits_model(dm, model, str(ckpt), training=False)  # data.patch_size of NaFlex batches: before scoring

    module = ClassifierModule(model, num_classes=dm.num_classes)
    bar = progress_bar_kind(str(cfg.get("progress_bar", "auto")))
    counted, unreadable = CountTestImages(), ReportUnreadable(test_split=split)  # (unreadable: on_bad_sample=skip)
    figures = RunFigures(counted, unreadable)  # (read where the test ran: ddp_spawn's processes too)
    reports = [instantiate(cfg[k]) for k in ("per_class", "attention_distance") if cfg.get(k) is not None]  # null: none
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        logger=False,
        callbacks=[*progress_callbacks(bar), counted, unreadable, figures, CheckOwnBatches(dm), *reports],
        enable_progress_bar=bar in ("rich", "tqdm"),
        enable_checkpointing=False,
    )
    dm.setup("test" if split == "test" else "validate")
    _warn_other_class_names(ckpt, stored_data, dm)  # (after setup: a data module reads its names from its files)
    if split == "val" and not other_data:
        _check_val_split_is_the_runs(ckpt, dm, held_record, fix)
    scored = _SplitData(dm, split)
    res = trainer.test(module, datamodule=scored, verbose=False)
    tested = figures.take(trainer, "test")
    left_out = tested["unreadable"]
    metrics = {k.replace("test/", f"{split}/"): v for k, v in scalars(res[0]).items()}
    up = bool(stored.get("dynamic_img_pad"))  # (a model that pads images to whole patches: the grid rounds up)
    grid = [
        -(-s // p) if up else s // p for s, p in zip(to_2tuple(dm.img_size), to_2tuple(stored.get("patch_size", 1)))
    ]
    if is_video_data(dm):  # (T, H, W) of the tubelets
        grid.insert(0, dm.num_frames // stored.get("tubelet_size", 1))
    packing = getattr(dm, "packing", None)
    naflex = _naflex_size(dm, stored.get("patch_size")) if packing is not None else None
    if packing is not None:  # NaFlex: the grid of the size scored (images of one size), none for many sizes
        grid = None if naflex is None else [s // p for s, p in zip(naflex, to_2tuple(stored["patch_size"]))]
    result = {
        "ckpt_path": str(ckpt),
        "trained": swept_settings(ckpt),  # a sweep job's checkpoint: the settings its sweep varied (pos=, seed=)
        "data": cfg.data.get("name", cfg.data.get("_target_")),
        "split": split,
        # split=val of data whose val is its test split (data.val_fraction=0: the run validated on test): the test split
        "val_is_test": split == "val" and not data_val_fraction(cfg.data),
        "img_size": dm.img_size,
        "img_size_from": "checkpoint" if "img_size" in taken else "data",  # data.img_size null: the trained size
        "data_from_run": taken,  # the data settings taken from the checkpoint or its run (not on the command line)
        "grid": grid,
        "model_img_size": list(to_2tuple(stored["img_size"])) if stored.get("img_size") is not None else None,
        "naflex_size": naflex,  # NaFlex of images of one size: the size each was scored at
        "ema": use_ema,  # the weights scored: the EMA copy, the trained ones, null: an export that does not say
        "precision": str(trainer.precision),  # Lightning's: bf16-mixed (trainer=ddp) scores other figures than 32-true
        "model_overrides": given,  # model_overrides given on the command line ({}: the model as stored)
        "packing": packing,
        "metrics": metrics,
        **({k: getattr(dm, k) for k in ("num_frames", *CLIP_KEYS, "num_segments") if hasattr(dm, k)}),  # its clips
        "num_images": tested["test_images"],  # scored: fewer than the split's with trainer.limit_test_batches
        "split_images": tested["test_split_images"],  # the readable ones
        "unreadable": left_out,  # left out (data.on_bad_sample=skip), each named in the test's log line
        "gflops": eval_gflops(model, dm, naflex) if trainer.is_global_zero else None,  # one sample at the size scored
        "wall_s": round(time.time() - t0, 2),
        "status": "finished",  # (as metrics.json's: the sweep summary's row, eval.py -m)
        "overrides": task_overrides(),  # the command line's, as metrics.json's (tells an earlier sweep's record)
    }
    if trainer.is_global_zero:
        out = run_dir_of(cfg)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval_metrics.json").write_text(json.dumps(result, indent=2))
        shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        ema_note = ", EMA weights" if use_ema else ""
        if packing is None:
            frames = f"{dm.num_frames} frames of " if is_video_data(dm) else ""
            shape = "x".join(map(str, grid))
            model_hw = result["model_img_size"]
            built = f", model built at {'x'.join(map(str, model_hw))}" if model_hw and len(set(model_hw)) > 1 else ""
            where = f"at {frames}img_size {dm.img_size} (grid {shape}{built}{ema_note})"
        else:
            where = _naflex_where(dm, naflex, stored.get("patch_size")) + f"{ema_note})"
        n, total = result["num_images"], result["split_images"]
        noun = "videos" if is_video_data(dm) else "images"
        part = f"{n} of its {total} {noun}{tested['classes_note']}: trainer.limit_test_batches"
        images = f"{n} {noun}" if total is None or n == total else part
        if result["val_is_test"]:  # (val/* here are test scores: say so, as train.py's data line does)
            whose = "the run's" if "val_fraction" in taken else "its"
            images = f"the test split: {whose} data.val_fraction=0; {images}"
        images += f", {len(left_out)} unreadable files left out" if left_out else ""
        over = f", model_overrides {json.dumps(given)}" if given else ""
        print(f"{ckpt.name} on {result['data']} {split} ({images}) {where}{over}: {shown}", flush=True)
        print(f"wrote {out / 'eval_metrics.json'}", flush=True)  # (as predict.py names its CSV)
    return metrics
