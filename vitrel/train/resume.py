"""Which checkpoint a training run resumes, and whether it may: :func:`resolve_ckpt_path` (``ckpt_path`` /
``resume=auto``), the checkpoint's model and the weights it started from against the configured ones
(:func:`check_same_model`, :func:`check_same_start`), a sweep job's folder against the job (:func:`sweep_job`), its
validation split and its position mid-epoch against the data and processes (:func:`world_size`). The position
itself, and the training order it continues, are :mod:`vitrel.train.exact_resume`'s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig

from vitrel.config import ConfigError, check_resume
from vitrel.models.checkpoint import CheckpointError, check_checkpoint, extract_model_state
from vitrel.models.ckpt_files import run_checkpoint
from vitrel.models.data_config import checkpoint_data_config, data_config_of
from vitrel.models.registry import upgraded_cfg
from vitrel.train.build import WEIGHT_FILES, weights_source
from vitrel.train.callbacks import ExactResume, check_resume_position
from vitrel.train.last_checkpoint import last_checkpoint_file
from vitrel.train.progress import CountValidations
from vitrel.train.requeue import drop_requeue_checkpoints, drop_requeue_files, newest_checkpoint, requeue_checkpoints
from vitrel.train.requeue import load_keys as _load
from vitrel.train.requeue import same_file as _same_file
from vitrel.train.run_times import RunTimes
from vitrel.train.sweep_files import MAY_DIFFER, SWEEP_JOB, sweep_folder, sweep_plan
from vitrel.train.sweepers import BASIC_SWEEPER
from vitrel.train.utils import hydra_config, is_multirun, override_key, task_overrides

__all__ = [
    "resume_path",
    "resolve_ckpt_path",
    "check_same_model",
    "check_same_preprocessing",
    "check_same_start",
    "check_same_sweep_job",
    "run_job",
    "drop_requeue_checkpoints",
    "newest_checkpoint",
    "requeue_checkpoints",
    "sweep_job",
    "StartRecord",
    "SweepJobRecord",
    "world_size",
]
_UNRESOLVED: Any = object()


def resume_path(cfg: DictConfig, callbacks: Sequence[Callback], run_dir: Path) -> str | None:
    """The checkpoint the run resumes (``ckpt_path`` / ``resume=auto``, see :func:`resolve_ckpt_path`), checked to be
    a readable checkpoint; None for a new run. Known before the model is built: a resumed fine-tune is built from it
    (:func:`~vitrel.train.build.build_model`). A run that starts over (``resume=false``) removes the SLURM requeue
    checkpoints of its folder first, which Lightning would load into it. Given ``ckpt_path=<file>`` with
    ``resume=auto``, the folder's newer checkpoints of a run that started from that file (a requeued job: same command,
    same folder) are continued instead (:func:`_continued`)."""
    root = cfg.trainer.get("default_root_dir") or run_dir
    path = _ckpt_path(cfg, last_checkpoint_file(callbacks, root), run_dir, Path(root))
    if path is not None:
        check_checkpoint(path)
    return path


def resolve_ckpt_path(
    cfg: DictConfig,
    callbacks: Sequence[Callback],
    run_dir: Path,
    model: torch.nn.Module,
    dm: L.LightningDataModule | None = None,
    path: str | None = _UNRESOLVED,
    started_from: Mapping[str, str] | None = None,
) -> tuple[str | None, int | None]:
    """``(checkpoint to resume, its global step)``, or ``(None, None)`` for a new run. ``started_from``: the
    configured weights' :func:`~vitrel.train.build.weights_source`, when the caller has it (files hashed once).

    ``ckpt_path``: a file, or ``last`` (= the ``last.ckpt`` that ``callbacks`` write, by default
    ``<run dir>/checkpoints/last.ckpt``, or a newer SLURM requeue checkpoint: :func:`newest_checkpoint`; must exist);
    with ``resume=auto`` and no ``ckpt_path``, that checkpoint is resumed when there is one. The file is checked first
    (``vitrel.models.checkpoint.check_checkpoint``: a truncated or foreign file is a clear
    ``CheckpointError``), then the weights it started from against ``cfg.model``'s (:func:`check_same_start`), its
    model configuration against ``model``'s (:func:`check_same_model`), then its
    validation split against ``dm``'s (``VisionDataModule.check_split``: a resume with another ``data.seed`` or
    ``data.val_fraction`` would validate on images it trained on) and its preprocessing
    (:func:`check_same_preprocessing`), and a position mid-epoch against ``dm``'s batch
    size and the trainer's processes (:func:`~vitrel.train.callbacks.check_resume_position`: another would train on
    some of the epoch's images twice and skip others). ``path``: :func:`resume_path`'s answer, when it was asked first.
    The figures the checkpoint carries for the record go to the run's callbacks that keep them (:func:`_take_carried`).
    """
    if path is _UNRESOLVED:
        path = resume_path(cfg, callbacks, run_dir)
    if path is None:
        return None, None
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors stay on disk
    check_same_start(ckpt, started_from if started_from is not None else weights_source(cfg.model), path)
    given = cfg.get("ckpt_path")
    own = given in (None, "", "last") or not _same_file(path, given_checkpoint(str(given)))  # (a requeue: _continued)
    if own:  # the folder's own: Hydra chose a sweep job's folder (or a single run's, given again)
        check_same_sweep_job(ckpt, run_job(), path)
    check_same_model(ckpt, model, path)
    if hasattr(dm, "check_split"):  # vitrel's data modules (a _target_ of one's own may have no split record)
        dm.check_split(ckpt.get(type(dm).__qualname__), path)
    check_same_preprocessing(ckpt, path, dm)
    position = (ckpt.get("callbacks") or {}).get(ExactResume.__qualname__)
    seed = next((cb.seed for cb in callbacks if isinstance(cb, ExactResume)), None)  # the epoch order's
    per_batch, key = _train_batch(dm)
    check_resume_position(position, per_batch, world_size(cfg.trainer), path, seed, batch_key=key)
    if "global_step" not in ckpt:
        raise CheckpointError(
            f"{path} is not a training checkpoint (no training state to resume, only weights): to start a new run "
            f"from its weights use model=from_checkpoint model.path={path} (or vitrel.load_model)"
        )
    _take_carried(ckpt, callbacks, path)
    for cb in callbacks:
        if isinstance(cb, StartRecord):  # the start the folder's checkpoint carries, or the file given
            cb.start = ckpt.get(START_CKPT, _UNRESOLVED) if own else str(Path(path).resolve())
    return path, int(ckpt["global_step"])


#: data-config fields absent from checkpoints written before them, and what their absence meant
_BEFORE_FIELDS = {"crop_mode": "center", "spatial_crops": 1, "num_segments": 1, "frame_sampling": "stride"}


def check_same_preprocessing(ckpt: Mapping[str, Any], path: str | Path, dm: Any) -> None:
    """The checkpoint ``ckpt`` (loaded from ``path``) was trained on images (clips) preprocessed as ``dm``
    preprocesses them (its stored data config against :func:`~vitrel.models.data_config.data_config_of` ``dm``, the
    class names aside): else a :class:`~vitrel.config.ConfigError` naming the fields. A run resumed with another
    ``data.std`` trained on under it and a finished one was tested again under it, its ``metrics.json`` (and a
    sweep's table) recording a test of the run's weights on other inputs than the run's, where ``eval.py`` of the
    same checkpoint scores its own."""
    stored, now = checkpoint_data_config(ckpt, Path(path)), data_config_of(dm)
    if not stored or now is None:  # (a checkpoint without one, a data module of one's own)
        return

    def value(dc: Mapping[str, Any], k: str) -> Any:
        v = dc.get(k, _BEFORE_FIELDS.get(k))
        return list(v) if isinstance(v, tuple) else v

    differ = [k for k in sorted((set(stored) | set(now)) - {"class_names"}) if value(stored, k) != value(now, k)]
    if differ:
        what = "; ".join(f"{k}: checkpoint {value(stored, k)}, now {value(now, k)}" for k in differ)
        raise ConfigError(
            f"{path} was trained on data preprocessed otherwise than this run's ({what}): resumed, it would train on "
            "and be tested under preprocessing its weights did not learn, recorded as the run's. Give the data "
            "settings of its run (its folder's .hydra/config.yaml); resume=false starts over in this folder; "
            f"model=from_checkpoint model.path={path} trains on from its weights; eval.py ckpt_path={path} with the "
            "data settings given scores it under them."
        )


#: the callbacks that carry figures of the run's record in its checkpoints, and what one without them leaves unknown
CARRIED: dict[type[Callback], str] = {
    RunTimes: "the time the run took before it (fit_s and wall_s)",
    CountValidations: "the validations run before it (val_runs)",
}


def _train_batch(dm: Any) -> tuple[int | None, str]:
    """The samples a training batch of ``dm`` is collated from (what the loader's position counts: videos, where
    each is read in ``clip_repeats`` views) and the data keys that set them."""
    repeats = int(getattr(dm, "clip_repeats", 1))
    key = "data.batch_size" if repeats == 1 else "data.batch_size / data.clip_repeats"
    return getattr(dm, "train_batch_size", getattr(dm, "batch_size", None)), key


def _take_carried(ckpt: Mapping[str, Any], callbacks: Sequence[Callback], where: str | Path) -> None:
    """The figures of the processes before the checkpoint, to the run's callbacks that carry them in the checkpoints
    (:class:`~vitrel.train.run_times.RunTimes`: the times; :class:`~vitrel.train.progress.CountValidations`: the
    validations), loaded here, before the fit: under ``ddp_spawn`` Lightning loads callback states in the spawned
    processes only (which get these callbacks as loaded here), and only those the checkpoint has. A checkpoint
    written before vitrel kept a figure leaves it unknown (null in ``metrics.json``): one warning names them all."""
    states = ckpt.get("callbacks") or {}
    unknown = []
    for cb in callbacks:
        if type(cb) in CARRIED:
            cb.load_state_dict(states.get(cb.state_key) or {})
            if None in cb.state_dict().values():  # (their state's None: unknown)
                unknown.append(CARRIED[type(cb)])
    if unknown:
        rank_zero_warn(
            f"{where} holds no record of {' nor of '.join(unknown)}, written before vitrel kept it: those figures in "
            "metrics.json are unknown (null)"
        )


def sweep_job() -> dict[str, list[str]] | None:
    """This ``-m`` job's ``overrides`` and the keys its sweep varies (``swept``): for Hydra's basic sweeper those with
    several values among the jobs it planned; for another (Optuna, Ax, Nevergrad: values drawn as the sweep goes, from
    a search space that a function of one's own may extend) every key the job sets except :data:`MAY_DIFFER`. None
    outside a sweep."""
    if not is_multirun():
        return None
    hc = hydra_config()
    overrides = task_overrides()
    if hc.sweeper.get("_target_") != BASIC_SWEEPER:
        return {"overrides": overrides, "swept": sorted({override_key(o) for o in overrides} - MAY_DIFFER)}
    values: dict[str, set[str]] = {}
    for job in sweep_plan(sweep_folder(hc)) or []:
        for o in job:
            values.setdefault(override_key(o), set()).add(o)
    return {"overrides": overrides, "swept": sorted(k for k, v in values.items() if len(v) > 1)}


def run_job() -> dict[str, list[str]] | None:
    """What the run's checkpoints record of its command line (:class:`SweepJobRecord`): a ``-m`` job's
    :func:`sweep_job`, a single run's overrides (nothing swept); None outside Hydra (``train(cfg)`` in Python)."""
    job = sweep_job()
    if job is None and hydra_config() is not None:
        job = {"overrides": task_overrides(), "swept": []}
    return job


def check_same_sweep_job(ckpt: Mapping[str, Any], job: Mapping[str, Any] | None, where: str | Path) -> None:
    """The checkpoint ``ckpt`` (loaded from ``where``, the job folder's own) was written by the sweep job ``job``
    (:func:`sweep_job`): the same value of every key that its sweep or this one varies. Hydra names a sweep's job
    folders by job number, so a sweep run again in its folder with other lists gives a folder to another job, which
    resumed would report the folder's run as its own: a :class:`~vitrel.config.ConfigError` naming both. Not checked
    outside a sweep (a single run may resume with other settings) or for checkpoints that record no sweep job. Another
    value of a key neither sweep varies (the sweep run again with another ``module.optimizer.lr``) is a warning naming
    it, unless the key is one of :data:`MAY_DIFFER`."""
    theirs = ckpt.get(SWEEP_JOB)
    if job is None or not isinstance(theirs, Mapping):
        return
    keys = set(theirs.get("swept") or ()) | set(job["swept"])
    a = {override_key(o): o for o in theirs.get("overrides") or ()}
    b = {override_key(o): o for o in job["overrides"]}
    none = "(not on the command line)"
    differ = sorted(k for k in keys if a.get(k) != b.get(k))
    others = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in keys and k not in MAY_DIFFER)
    if others and not differ and job["swept"]:  # (a sweep run again with another setting than its lists: an lr)
        what = "; ".join(f"{k}: checkpoint {a.get(k, none)}, this job {b.get(k, none)}" for k in others)
        rank_zero_warn(
            f"resuming {where}, which this job's folder holds from a sweep run with other settings ({what}): the "
            "resumed run keeps the checkpoint's weights, optimizer and rates, and a finished one is only tested "
            "again. resume=false starts this job over in this folder; a new sweep folder (the default) starts all."
        )
    elif others and not differ:  # a single run resumed with other settings than it was started with
        what = "; ".join(f"{k}: checkpoint {a.get(k, none)}, now {b.get(k, none)}" for k in others)
        rank_zero_warn(
            f"resuming {where}, trained with other settings ({what}): the resumed run keeps the checkpoint's "
            "weights, optimizer state and rates (Lightning's resume), so a rate or decay given now does not apply (a "
            "warmup's length does: the schedule is rebuilt with it), while the run folder's .hydra/config.yaml "
            "records it; the run's length does (max_epochs, and the steps an epoch: the schedule goes on from where "
            "the epochs done put it). resume=false starts over in this folder; model=from_checkpoint "
            "model.path=<it> starts a new run from its weights."
        )
    if not differ:
        return
    what = "; ".join(f"{k}: checkpoint {a.get(k, none)}, this job {b.get(k, none)}" for k in differ)
    raise ConfigError(
        f"{where} was written by another job of a sweep ({what}; its job: {' '.join(theirs.get('overrides') or ())}):"
        " Hydra gives a sweep's jobs their folders by job number, so a sweep run again in its folder with other lists"
        " would resume another job's run under this job's name. Run the sweep again with the lists it was run with "
        "(an Optuna study: its sampler seed and search space, so that its trials draw the same values; a job's failed"
        " ones are retried, its finished ones only tested again), or in a new sweep folder (the default); "
        "resume=false starts this job over in this folder."
    )


class SweepJobRecord(Callback):
    """Writes the sweep job (:func:`sweep_job`) into every checkpoint of the run, for :func:`check_same_sweep_job`."""

    def __init__(self, job: Mapping[str, list[str]]) -> None:
        self.job = {k: list(v) for k, v in job.items()}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[SWEEP_JOB] = {k: list(v) for k, v in self.job.items()}


#: the checkpoint key of the file the folder's run started from (``ckpt_path=<file>``; None: no ``ckpt_path``)
START_CKPT = "vitrel_start_ckpt"


class StartRecord(Callback):
    """Writes into every checkpoint of the run the file it started from (``start``: the ``ckpt_path=<file>`` it was
    given, or the one the folder's checkpoint it resumed records; None without; none written when that checkpoint
    records none), set by :func:`resolve_ckpt_path`: a requeued job given the same ``ckpt_path`` continues the
    folder's newer checkpoints of that start (:func:`_continued`)."""

    def __init__(self) -> None:
        self.start: Any = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.start is not _UNRESOLVED:  # (resumed from a checkpoint written before vitrel recorded it: unknown)
            checkpoint[START_CKPT] = self.start


def world_size(trainer_cfg: DictConfig) -> int | None:
    """The processes (devices x nodes) the trainer of ``trainer_cfg`` will train with, as Lightning counts them, known
    before it is built; None where the cluster decides (SLURM, torchrun) or for accelerators other than the CPU and
    CUDA (the trainer's own ``world_size`` is checked again when training starts: :class:`ExactResume`)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    if SLURMEnvironment.detect() or TorchElasticEnvironment.detect():
        return None
    accelerator = str(trainer_cfg.get("accelerator", "auto")).lower()
    if accelerator in ("auto", "gpu") and CUDAAccelerator.is_available():
        accelerator = "cuda"
    elif accelerator == "auto":
        accelerator = "cpu"  # (Lightning's choice without CUDA, unless another accelerator is there: MPS, TPU)
    kind = {"cpu": CPUAccelerator, "cuda": CUDAAccelerator}.get(accelerator)
    devices, nodes = trainer_cfg.get("devices", "auto"), int(trainer_cfg.get("num_nodes", 1) or 1)
    if kind is None:
        return None
    try:
        parsed = kind.auto_device_count() if devices == "auto" else kind.parse_devices(devices)
    except (MisconfigurationException, TypeError, ValueError):  # devices the trainer refuses itself, with its message
        return None
    return nodes * (len(parsed) if isinstance(parsed, (list, tuple)) else int(parsed))


# settings that change training, not the parameters: a resume may change them
_TRAINING_ONLY = ("drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate", "attn_impl")


def check_same_model(ckpt: Mapping[str, Any], model: torch.nn.Module, where: str | Path) -> None:
    """The checkpoint ``ckpt`` (loaded from ``where``) holds ``model``'s architecture: its stored
    ``vitrel_cfg`` equals ``model.vitrel_cfg`` except for training-only settings (dropout rates, the
    attention implementation). Otherwise a :class:`~vitrel.models.checkpoint.CheckpointError` naming the
    differing keys with both values. Models without a ``vitrel_cfg`` are not checked (Lightning's strict
    loading is)."""
    mine = getattr(model, "vitrel_cfg", None)
    if mine is None:
        return
    stored = extract_model_state(ckpt)[0]
    theirs = upgraded_cfg(stored)  # (written by an older vitrel: its specs as meant now)
    a, b, raw = _flat(theirs), _flat(mine), _flat(stored)
    diff = sorted(k for k in a.keys() | b.keys() if k.split(".")[0] not in _TRAINING_ONLY and a.get(k) != b.get(k))
    if diff:
        absent = "(absent)"
        lines = "\n".join(f"  {k}: checkpoint {a.get(k, absent)!r}, configured {b.get(k, absent)!r}" for k in diff)
        # an option the checkpoint's format meant without storing it (a default changed since): name the override
        meant = [k for k in diff if k in a and raw.get(k, absent) != a[k]]
        if meant:
            written = stored.get("vitrel_format") or 1
            sets = " ".join(f"{k}={str(a[k]).lower() if isinstance(a[k], bool) else a[k]}" for k in meant)
            lines += (
                f"\n  (the checkpoint's vitrel_format {written} meant {', '.join(meant)} without storing it: {sets})"
            )
        raise CheckpointError(
            f"{where} holds another model than the one configured ({', '.join(diff)} differ):\n{lines}\n"
            "Resume with the configuration it was trained with (its run folder's .hydra/config.yaml), or start a "
            f"new run from its weights instead of resuming it: model=from_checkpoint model.path={where} (its "
            "architecture and scheme) in a new run folder."
        )


def check_same_start(ckpt: Mapping[str, Any], configured: Mapping[str, str], where: str | Path) -> None:
    """The checkpoint ``ckpt`` (loaded from ``where``) started from the weights the configuration names
    (``configured``: :func:`~vitrel.train.build.weights_source`), as it records them: otherwise a
    :class:`~vitrel.config.ConfigError` naming both. The resumed run does not read those weights (the checkpoint's
    replace them), so another source would go on training the checkpoint's run under the other one's name. A weights
    file at another path with the same content (moved) is the same; one that is not there cannot be compared: a
    warning. Not checked: a checkpoint that records none (written before vitrel recorded it, or by a module of one's
    own)."""
    hp = ckpt.get("hyper_parameters")
    theirs = hp.get("started_from") if isinstance(hp, Mapping) else None
    if theirs is None:
        return
    names = [k for k in (*theirs, *configured) if not k.endswith(" sha256")]
    differ = list(dict.fromkeys(k for k in names if theirs.get(k) != configured.get(k)))
    unchecked = [k for k in differ if k in WEIGHT_FILES and k in theirs and k in configured]
    moved = [k for k in unchecked if theirs.get(f"{k} sha256") == configured.get(f"{k} sha256") is not None]
    unchecked = [k for k in unchecked if k not in moved and configured.get(f"{k} sha256") is None]
    differ = [k for k in differ if k not in moved and k not in unchecked]
    for k in unchecked:
        rank_zero_warn(
            f"{where} was trained from {k}={theirs[k]}; the configured {configured[k]} is not there to compare "
            "(not read: the checkpoint's weights continue)"
        )
    if not differ:
        return
    none = "(none)"
    what = ", ".join(f"{k}: checkpoint {theirs.get(k, none)}, configured {configured.get(k, none)}" for k in differ)
    run = " ".join(f"{k}={v}" for k, v in theirs.items() if not k.endswith(" sha256"))
    raise ConfigError(
        f"{where} was trained from other weights than the configured ones ({what}): resumed, it would go on "
        "training its own run, which does not read them. Resume with the weights it started from "
        f"({run or 'none: its run started from scratch'}; not read again: the checkpoint's weights replace them; a "
        "file moved since is known by its content), or start a new run from the configured weights in a new folder "
        "(resume=false starts over in this one)."
    )


def _flat(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b": value}``, values as plain lists (a stored config may hold tuples)."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = _plain(v)
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def missing_checkpoint(ck: str) -> str:
    """The error of a ``ckpt_path`` that names nothing; Lightning's words ``best`` / ``hpc`` / ``registry`` (made a
    path in the launch folder: only ``last`` is a word here) said to be none of vitrel's."""
    said = f"ckpt_path={ck}: no such file or folder"
    word = Path(ck).name
    if word in ("best", "hpc", "registry") and not Path(ck).parent.joinpath(word).exists():
        said += (
            f" (Lightning's ckpt_path='{word}' is not taken: give a file, e.g. <run>/checkpoints/best-*.ckpt, a run "
            "folder, or last)"
        )
    return said


def _ckpt_path(cfg: DictConfig, last: Path | None, run_dir: Path, root: Path) -> str | None:
    last = last or run_dir / "checkpoints" / "last.ckpt"
    ck = cfg.get("ckpt_path")
    if ck == "last":
        newest = newest_checkpoint(last, root)
        if newest is None:
            raise CheckpointError(
                f"ckpt_path=last: there is no {last}. `last` is the last checkpoint of this run's folder ({run_dir}); "
                "to resume an earlier run, run in its folder (hydra.run.dir=<that folder>) or give ckpt_path=<file>."
            )
        return str(newest)
    if ck:
        p = Path(str(ck)).expanduser()
        if not p.exists():
            raise CheckpointError(missing_checkpoint(str(ck)))
        p = given_checkpoint(str(ck), say=True)
        if check_resume(cfg) == "auto":
            return str(_continued(p, last, run_dir, root))
        drop_requeue_files(root, f"this run starts from ckpt_path={ck} (resume=false)", keep=p)
        return str(p)
    resume = check_resume(cfg)
    newest = newest_checkpoint(last, root) if resume == "auto" else None
    if newest is not None:
        rank_zero_info(f"resume=auto: resuming from {newest} (set resume=false to start over in this folder)")
        return str(newest)
    drop_requeue_files(root, "this run starts over (resume=false)")
    return None


def given_checkpoint(ck: str, say: bool = False) -> Path:
    """The file ``ckpt_path=<ck>`` names: ``ck`` itself, or for a ``train.py`` run folder (or its ``checkpoints/``) the
    checkpoint its run would resume from (:func:`newest_checkpoint`: its ``last.ckpt``, or a newer requeue file),
    else the one ``eval.py`` takes there (:func:`~vitrel.models.ckpt_files.run_checkpoint`: its one best-epoch file;
    a folder without checkpoints refused, naming what it is). ``say``: log which file and why."""
    p = Path(ck).expanduser()
    if not p.is_dir():
        return p
    run = p.parent if p.name == "checkpoints" and not (p / "checkpoints").is_dir() else p
    chosen = newest_checkpoint(run / "checkpoints" / "last.ckpt", run) or run_checkpoint(p, say=False)
    if chosen.is_dir():
        raise CheckpointError(
            f"ckpt_path={ck} is a folder but not a train.py run folder (no checkpoints/ in it): give the checkpoint "
            f"file to resume (the weights of an export folder start a new run: model=from_checkpoint model.path={ck})"
        )
    if say:
        rank_zero_info(f"ckpt_path={ck} is a train.py run folder: resuming from {chosen.relative_to(run)}")
    return chosen


def _continued(given: Path, last: Path, run_dir: Path, root: Path) -> Path:
    """The checkpoint a run given ``ckpt_path=<given>`` resumes under ``resume=auto``: the folder's newest
    (:func:`newest_checkpoint`) when its run started from ``given`` (:class:`StartRecord`: a job requeued, by SLURM or
    submitit, with the same command in the same folder), else ``given``. A folder whose newest checkpoint is of
    another start (none, another file, not recorded) is a :class:`~vitrel.config.ConfigError`, unless ``given`` is
    one of the folder's own files: starting from ``given`` there would mix two runs' checkpoints in one folder."""
    newest = newest_checkpoint(last, root)
    if newest is None or _same_file(newest, given):
        return given
    theirs = _load(newest).get(START_CKPT, _UNRESOLVED)
    if theirs is not _UNRESOLVED and theirs is not None and _same_file(theirs, given):
        rank_zero_info(
            f"resume=auto: continuing from {newest}, which this folder's run wrote after starting from "
            f"ckpt_path={given} (resume=false starts from {given} again)"
        )
        return newest
    if any(given.resolve().is_relative_to(d.resolve()) for d in (run_dir, root, last.parent)):
        return given  # (one of the folder's own checkpoints, named: it goes on from there)
    what = (
        "that records no start: written before vitrel recorded it" if theirs is _UNRESOLVED
        else "of a run started without ckpt_path" if theirs is None
        else f"of a run started from ckpt_path={theirs}"
    )  # fmt: skip
    raise ConfigError(
        f"ckpt_path={given}: this run folder holds another run's checkpoints ({newest}, {what}), which a run "
        f"started from {given} here would mix with its own. resume=false starts from {given} in this folder (its "
        "requeue checkpoints removed, its others replaced as the run saves); ckpt_path=last continues the folder's "
        "run; or give a new run folder."
    )
