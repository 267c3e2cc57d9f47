"""Build a training run from a Hydra config, fit, test, and write the run's metrics.

``train(cfg)`` is what ``python train.py`` calls. Every object comes from its config node's
``_target_``: the datamodule (``cfg.data``), the network (``cfg.model``: ``vitrel.create_model`` with
``pos: ${pos}``, sized by the datamodule), the :class:`~vitrel.train.module.ClassifierModule`
(``cfg.module``, with its ``_partial_`` optimizer and scheduler), the loggers (``cfg.logger``), the
callbacks (``cfg.callbacks``) and the trainer (``cfg.trainer``, with
:class:`~vitrel.train.ckpt_io.AtomicCheckpointIO` as its checkpoint IO). Then it fits (resuming per
``ckpt_path`` / ``resume``), tests, and writes ``<run dir>/metrics.json``, which the sweep summary reads.

Order matters for a resume: the run folder is locked first (:class:`~vitrel.train.rundir.RunLock`: a
second run in a folder whose run is still going stops before it touches anything), then the checkpoint
to resume is resolved and checked against the configured model, and only then are the loggers built,
from the checkpoint's step on (:mod:`vitrel.train.loggers`), so that a resumed run continues its logs.
"""

from __future__ import annotations

import csv
import inspect
import json
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from omegaconf import DictConfig, OmegaConf
from timm.layers import to_2tuple

from vitrel.config import ConfigError, check_moved_keys, check_resume
from vitrel.models.checkpoint import CheckpointError, check_checkpoint, extract_model_state
from vitrel.models.ckpt_files import stored_config
from vitrel.models.input_size import InputSizeError, check_patches_fit
from vitrel.models.registry import MODEL_ARGS
from vitrel.train.callbacks import ExactResume, check_resume_position, last_checkpoint_file, last_checkpoint_path
from vitrel.train.ckpt_io import AtomicCheckpointIO
from vitrel.train.hydra_callbacks import finished_record, write_held_back_record
from vitrel.train.progress import CountTestImages, CountValidations
from vitrel.train.rundir import RunLock, is_launching_process
from vitrel.train.utils import (
    check_accelerator,
    check_channels_fit,
    check_data_fits_model,
    check_video_pairing,
    hydra_config,
    instantiate_callbacks,
    instantiate_loggers,
    is_multirun,
    is_video_data,
    override_key,
    progress_bar_kind,
    progress_callbacks,
    route_lightning_logs,
    run_dir_of,
    scalars,
)

__all__ = [
    "train",
    "build_model",
    "check_launch",
    "check_pos_override",
    "resolve_ckpt_path",
    "check_same_model",
    "world_size",
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
    if _loads_checkpoint(model_cfg):  # model=from_checkpoint: the file's patches, and the size it was trained at
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
    if _loads_checkpoint(model_cfg):
        stored = stored_config(str(model_cfg.path)) or {}
        return tuple(stored.get(n) for n in names)
    cls, args = MODEL_ARGS[arch]
    params = inspect.signature(cls.__init__).parameters
    return tuple(model_cfg.get(n) or args.get(n, params[n].default if n in params else None) for n in names)


def check_launch(trainer_cfg: DictConfig | dict) -> None:
    """Lightning's plain ``ddp`` re-runs ``sys.argv`` for the extra processes: under ``-m`` with
    Hydra's in-process launcher every child would run the whole sweep. Refuse it with the fix."""
    if not is_multirun():
        return
    strategy = str(trainer_cfg.get("strategy", "auto"))
    devices = trainer_cfg.get("devices", 1)
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    multi = nodes > 1 or devices not in (1, "1", [0], "auto")
    launcher = str(hydra_config().launcher.get("_target_", ""))
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    managed = SLURMEnvironment.detect() or TorchElasticEnvironment.detect()
    if multi and strategy.startswith("ddp") and "spawn" not in strategy and not managed and "submitit" not in launcher:
        raise ValueError(
            f"trainer.strategy={strategy} with {devices} devices cannot run under -m with Hydra's local launcher: "
            "Lightning re-launches `python train.py <same arguments>` for each extra process, so every child would "
            "run the whole sweep. Under -m use trainer=ddp_spawn, or hydra/launcher=slurm (one SLURM job per sweep "
            "point, one task per device); or run the sweep points one by one without -m."
        )


def resolve_ckpt_path(
    cfg: DictConfig,
    callbacks: Sequence[Callback],
    run_dir: Path,
    model: torch.nn.Module,
    dm: L.LightningDataModule | None = None,
) -> tuple[str | None, int | None]:
    """``(checkpoint to resume, its global step)``, or ``(None, None)`` for a new run.

    ``ckpt_path``: a file, or ``last`` (= the ``last.ckpt`` that ``callbacks`` write, by default
    ``<run dir>/checkpoints/last.ckpt``; must exist); with ``resume=auto`` and no ``ckpt_path``, that
    ``last.ckpt`` is resumed when it exists. The file is checked first
    (``vitrel.models.checkpoint.check_checkpoint``: a truncated or foreign file is a clear
    ``CheckpointError``), then its model configuration against ``model``'s (:func:`check_same_model`), then its
    validation split against ``dm``'s (``VisionDataModule.check_split``: a resume with another ``data.seed`` or
    ``data.val_fraction`` would validate on images it trained on), and a position mid-epoch against ``dm``'s batch
    size and the trainer's processes (:func:`~vitrel.train.callbacks.check_resume_position`: another would train on
    some of the epoch's images twice and skip others).
    """
    root = cfg.trainer.get("default_root_dir") or run_dir
    path = _ckpt_path(cfg, last_checkpoint_file(callbacks, root), run_dir)
    if path is None:
        return None, None
    check_checkpoint(path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors stay on disk
    check_same_model(ckpt, model, path)
    if hasattr(dm, "check_split"):  # vitrel's data modules (a _target_ of one's own may have no split record)
        dm.check_split(ckpt.get(type(dm).__qualname__), path)
    position = (ckpt.get("callbacks") or {}).get(ExactResume.__qualname__)
    seed = next((cb.seed for cb in callbacks if isinstance(cb, ExactResume)), None)  # the epoch order's
    check_resume_position(position, getattr(dm, "batch_size", None), world_size(cfg.trainer), path, seed)
    if "global_step" not in ckpt:
        raise CheckpointError(
            f"{path} is not a training checkpoint (no training state to resume, only weights): to start a new run "
            f"from its weights use model=from_checkpoint model.path={path} (or vitrel.load_model)"
        )
    return path, int(ckpt["global_step"])


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
    theirs = extract_model_state(ckpt)[0]
    a, b = _flat(theirs), _flat(mine)
    diff = sorted(k for k in a.keys() | b.keys() if k.split(".")[0] not in _TRAINING_ONLY and a.get(k) != b.get(k))
    if diff:
        absent = "(absent)"
        lines = "\n".join(f"  {k}: checkpoint {a.get(k, absent)!r}, configured {b.get(k, absent)!r}" for k in diff)
        raise CheckpointError(
            f"{where} holds another model than the one configured ({', '.join(diff)} differ):\n{lines}\n"
            "Resume with the configuration it was trained with (its run folder's .hydra/config.yaml), or start a "
            f"new run from its weights instead of resuming it: model=from_checkpoint model.path={where} (its "
            "architecture and scheme) in a new run folder."
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


def _ckpt_path(cfg: DictConfig, last: Path | None, run_dir: Path) -> str | None:
    last = last or run_dir / "checkpoints" / "last.ckpt"
    ck = cfg.get("ckpt_path")
    if ck == "last":
        if not last.exists():
            raise CheckpointError(
                f"ckpt_path=last: there is no {last}. `last` is the last checkpoint of this run's folder ({run_dir}); "
                "to resume an earlier run, run in its folder (hydra.run.dir=<that folder>) or give ckpt_path=<file>."
            )
        return str(last)
    if ck:
        p = Path(str(ck)).expanduser()
        if not p.exists():
            raise CheckpointError(f"ckpt_path={ck}: no such file or folder")
        return str(p)
    resume = check_resume(cfg)
    if resume == "auto" and last.exists():
        rank_zero_info(f"resume=auto: resuming from {last} (set resume=false to start over in this folder)")
        return str(last)
    return None


@rank_zero_only
def _adopt_csv_columns(loggers: Sequence[Logger]) -> None:
    """Let each CSV logger's writer know the columns already in its ``metrics.csv``.

    Under ``ddp_spawn`` the fit runs in spawned processes, which write ``metrics.csv``; the writer of
    the main process (created before) would then rewrite the file for the test metrics with only the
    columns it knows, which fails. Adopting the file's header first keeps every row. Rank 0 only, the
    rank that writes the file (on the others ``logger.experiment`` is Lightning's dummy).
    """
    for lg in loggers:
        if isinstance(lg, CSVLogger):
            w = lg.experiment
            path = Path(w.metrics_file_path)
            if path.exists():
                with open(path, newline="") as f:
                    header = next(csv.reader(f), [])
                w.metrics_keys = sorted(set(w.metrics_keys) | set(header))


def _wandb_where(loggers: Sequence[Logger]) -> str | None:
    """Where the W&B run is: its offline folder (and how to upload it), or its URL; None without W&B."""
    for lg in loggers:
        if isinstance(lg, WandbLogger) and rank_zero_only.rank == 0:
            run = lg.experiment
            folder = Path(run.dir).parent  # <save_dir>/wandb/<offline-run-...>/files
            if getattr(run.settings, "_offline", False) or run.settings.mode == "offline":
                return f"{folder} (offline; upload with: wandb sync {folder})"
            return str(run.url or folder)
    return None


def _finish_wandb(loggers: Sequence[Logger], exit_code: int) -> None:
    if any(isinstance(lg, WandbLogger) for lg in loggers) and rank_zero_only.rank == 0:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)


# ------------------------------------------------------------------------------------------ entry point
def train(cfg: DictConfig, callbacks: Sequence[Callback] = ()) -> dict[str, float]:
    """Fit and test as ``cfg`` says; return the final metrics (also in ``<run dir>/metrics.json``).

    ``callbacks`` are added to those of ``cfg.callbacks``. The run folder is locked while it runs
    (:class:`~vitrel.train.rundir.RunLock`, by the process of global rank 0).
    """
    check_moved_keys(cfg)  # +optim.lr=... (vitrel 0.1) would be composed and ignored
    check_resume(cfg)  # resume=true: before anything is built
    check_accelerator(cfg.trainer)  # trainer=gpu on a machine without one: what to run instead
    t0 = time.time()
    route_lightning_logs()
    run_dir = run_dir_of(cfg)
    check_launch(cfg.trainer)
    joined = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        if not is_launching_process():
            return _train(cfg, callbacks, run_dir, t0)
        with RunLock(run_dir):
            write_held_back_record(run_dir, cfg)  # the folder was busy when Hydra started: its record, now ours
            return _train(cfg, callbacks, run_dir, t0)
    finally:
        if not joined:
            _leave_process_group()


def _leave_process_group() -> None:
    """Destroy the process group the run's DDP strategy made, as PyTorch asks before exit.

    Lightning does it at exit for NCCL only; a gloo group left to the interpreter's shutdown can abort the rank
    ("terminate called without an active exception") after the run has finished. A group that existed before
    ``train()`` is the caller's and stays.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _train(cfg: DictConfig, callbacks: Sequence[Callback], run_dir: Path, t0: float) -> dict[str, float]:
    L.seed_everything(int(cfg.seed), workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(str(cfg.get("matmul_precision", "high")))

    check_pos_override(cfg)  # model=from_checkpoint takes its scheme from the file: a pos= override is refused
    dm = instantiate(cfg.data)
    model = build_model(cfg.model, dm)
    check_data_fits_model(dm, model, f"the model ({_model_name(cfg, model)})")  # before a batch is made
    module = instantiate(cfg.module, model=model, num_classes=dm.num_classes)
    cbs = instantiate_callbacks(cfg.get("callbacks")) + list(callbacks)
    ckpt, resume_step = resolve_ckpt_path(cfg, cbs, run_dir, model, dm)  # before the loggers open their files
    loggers = instantiate_loggers(cfg.get("logger"), resume_step=resume_step)
    if not loggers:  # LearningRateMonitor needs a logger
        cbs = [cb for cb in cbs if not isinstance(cb, LearningRateMonitor)]
    bar = progress_bar_kind(str(cfg.get("progress_bar", "auto")))
    counted, validated = CountTestImages(), CountValidations()  # the test images scored, the validations run
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        logger=loggers or False,
        callbacks=cbs + progress_callbacks(bar) + [counted, validated],
        enable_progress_bar=bar in ("rich", "tqdm"),
        plugins=[*_plugins(cfg.trainer), AtomicCheckpointIO()],
    )
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if _loads_checkpoint(cfg.model):  # the scheme the model has (the file's), not the pos group's default
        resolved["pos"] = _stored(model).get("pos", resolved.get("pos"))
    for lg in loggers:
        lg.log_hyperparams(resolved)
    n_params = sum(p.numel() for p in model.parameters())
    rank_zero_info(
        f"run folder {run_dir}\nmodel {_model_name(cfg, model)} pos={_pos_name(cfg, model)} "
        f"({n_params / 1e6:.2f}M params), "
        f"data {type(dm).__name__} img_size={dm.img_size} classes={dm.num_classes}"
    )

    status, wandb_where, tested = "failed", None, (None, None)
    try:
        t_fit = time.time()
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt, weights_only=True)  # tensors and containers only
        except SIGTERMException as e:  # Lightning's SIGTERM exit carries no code: report the signal
            raise SystemExit(e.code if e.code is not None else 128 + signal.SIGTERM) from None
        fit_s = time.time() - t_fit
        metrics = scalars(trainer.callback_metrics)
        if cfg.get("test", True):
            _adopt_csv_columns(loggers)
            for res in trainer.test(module, datamodule=dm, verbose=False):
                metrics.update(scalars(res))
            tested = (counted.count, _split_size(trainer.test_dataloaders))
        status = "finished"
        wandb_where = _wandb_where(loggers)
    finally:
        _finish_wandb(loggers, 0 if status == "finished" else 1)

    last = last_checkpoint_path(trainer)
    best = (
        trainer.checkpoint_callback.best_model_path if isinstance(trainer.checkpoint_callback, ModelCheckpoint) else ""
    )
    result = {
        "status": status,
        "metrics": metrics,
        "epochs": trainer.current_epoch,
        "val_runs": validated.count,  # 0: trainer.max_steps ended the fit before its first validation
        "global_step": trainer.global_step,
        "wall_s": round(time.time() - t0, 2),
        "fit_s": round(fit_s, 2),
        "run_dir": str(run_dir),
        "last_ckpt": str(last) if last is not None and last.exists() else None,
        "best_ckpt": best or None,
        "test_images": tested[0],  # scored: fewer than test_split_images under trainer.limit_test_batches
        "test_split_images": tested[1],
        "test_limited_by": _test_limit(cfg.trainer) if _part(*tested) else None,
        "model": _model_name(cfg, model),
        "params": sum(p.numel() for p in model.parameters()),  # (timm's param_count, not in millions)
        "pos": _pos_name(cfg, model),
        "data": cfg.data.get("name", cfg.data.get("_target_")),
        "overrides": _overrides(),
    }
    if status == "finished" and resume_step is not None and trainer.global_step == resume_step:
        result = _resumed_finished(result, run_dir)
        metrics = result["metrics"]  # (optimized_metric: val/acc1 is the finished run's)
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.json").write_text(json.dumps(result, indent=2))
        print(_report(result, wandb_where, counted.classes_note()), flush=True)
    target = cfg.get("optimized_metric")
    if target:
        if target not in metrics:
            raise KeyError(f"optimized_metric={target!r} is not among the run's metrics: {sorted(metrics)}")
        return metrics[target]  # type: ignore[return-value]
    return metrics


def _resumed_finished(result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The record of a run that resumed a checkpoint with nothing left to train (a finished run, or a finished job of
    a sweep, run again in its folder): the finished run's validation metrics, epochs and times
    (:func:`~vitrel.train.hydra_callbacks.finished_record`), this pass's test metrics (the same weights), and
    ``resumed_finished: true``. Without the finished run's record, its times are unknown (None), not this pass's."""
    earlier = finished_record(run_dir, result["global_step"])
    if earlier is None:
        rank_zero_info(f"resumed a finished run with no record of it in {run_dir}: its validation and times unknown")
        return {**result, "wall_s": None, "fit_s": None, "resumed_finished": True}
    kept = {k: earlier[k] for k in ("epochs", "val_runs", "wall_s", "fit_s") if k in earlier}
    return {**result, **kept, "metrics": {**earlier.get("metrics", {}), **result["metrics"]}, "resumed_finished": True}


def _plugins(trainer_cfg: DictConfig) -> list[Any]:
    """The plugins ``cfg.trainer.plugins`` asks for (``train()`` adds its checkpoint IO to them)."""
    node = trainer_cfg.get("plugins")
    if node is None:
        return []
    built = instantiate(node)
    return list(built) if isinstance(built, (list, tuple)) or OmegaConf.is_list(built) else [built]


def _stored(model: torch.nn.Module) -> dict[str, Any]:
    return getattr(model, "vitrel_cfg", None) or {}


def _loads_checkpoint(model_cfg: DictConfig) -> bool:
    """``model=from_checkpoint``: the network is ``vitrel.load_model(model.path)``, its scheme the file's."""
    return model_cfg.get("path") is not None and "load_model" in str(model_cfg.get("_target_", ""))


def _model_name(cfg: DictConfig, model: torch.nn.Module | None = None) -> str:
    """The architecture the model has (its ``vitrel_cfg``), else ``model.name`` / ``model.architecture``."""
    stored = _stored(model) if model is not None else {}
    return str(stored.get("architecture") or cfg.model.get("name") or cfg.model.get("architecture"))


def _pos_name(cfg: DictConfig, model: torch.nn.Module) -> str | None:
    """The position scheme the model has: ``model=from_checkpoint`` builds the file's, whatever the pos group says."""
    pos = _stored(model).get("pos") if _loads_checkpoint(cfg.model) else None
    if isinstance(pos, Mapping):
        return pos.get("name")
    return pos if isinstance(pos, str) else cfg.pos.get("name")


def check_pos_override(cfg: DictConfig) -> None:
    """``model=from_checkpoint`` builds the position scheme stored in ``model.path``: a ``pos=`` / ``pos.<key>=``
    override on the command line would have no effect, so it is refused (ConfigError), before anything is built."""
    if not _loads_checkpoint(cfg.model):
        return
    given = [o for o in _overrides() if override_key(o).split(".")[0] == "pos"]
    if given:
        stored = (stored_config(str(cfg.model.path)) or {}).get("pos")
        name = stored.get("name") if isinstance(stored, Mapping) else stored
        raise ConfigError(
            f"{' '.join(given)} has no effect with model=from_checkpoint: the model is {cfg.model.path}'s, with its "
            f"position scheme ({name}). Drop {'it' if len(given) == 1 else 'them'} to fine-tune that model, or train "
            "a new one with model=<architecture> pos=<scheme>."
        )


def _report(result: dict, wandb_where: str | None, classes: str = "") -> str:
    """The run's closing lines: accuracy, wall time, and where the run folder, checkpoints and W&B run are.
    ``classes``: :meth:`~vitrel.train.progress.CountTestImages.classes_note`, said of a test of part of the split."""
    m = result["metrics"]
    stage = "test" if "test/acc1" in m else "val"
    lines = []
    if f"{stage}/acc1" in m:
        extra = [f"top-5 {100 * m[k]:.1f} %" for k in (f"{stage}/acc5",) if k in m]
        extra += [f"loss {m[k]:.3f}" for k in (f"{stage}/loss",) if k in m]
        n, total = result["test_images"], result["test_split_images"]
        part = ""
        if stage == "test" and _part(n, total):
            part = f" on {n} of the {total} test images{classes} ({result['test_limited_by']})"
        lines.append(f"{stage} accuracy {100 * m[f'{stage}/acc1']:.2f} % ({', '.join(extra)}){part}")
    fit_s, wall_s = (f"{result[k]:.0f} s" if result[k] is not None else "(unknown)" for k in ("fit_s", "wall_s"))
    again = "; resumed finished: nothing left to train, tested again" if result.get("resumed_finished") else ""
    lines.append(
        f"training {fit_s} ({_plural(result['epochs'], 'epoch')}, {_plural(result['global_step'], 'step')}); "
        f"whole run {wall_s}{again}"
    )
    lines.append(f"run folder  {result['run_dir']}")
    if result["last_ckpt"] or result["best_ckpt"]:
        best = f"  (best val/acc1: {result['best_ckpt']})" if result["best_ckpt"] else ""
        lines.append(f"checkpoint  {result['last_ckpt'] or result['best_ckpt']}{best}")
    if wandb_where:
        lines.append(f"W&B run     {wandb_where}")
    return "\n".join(lines)


def _part(scored: int | None, split: int | None) -> bool:
    """The test loop scored part of the split (not: all of it, or more, a DistributedSampler padding the ranks)."""
    return scored is not None and split is not None and scored < split


def _split_size(loaders: Any) -> int | None:
    """The number of samples of the test loader's data set (None when it has no length: a stream)."""
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    try:
        return len(loader.dataset)
    except (AttributeError, TypeError):
        return None


def _test_limit(trainer_cfg: DictConfig) -> str:
    """The trainer setting that limits the test loop: ``fast_dev_run`` (``debug=fdr``) or ``limit_test_batches``."""
    if trainer_cfg.get("fast_dev_run"):
        return "trainer.fast_dev_run"
    return "trainer.limit_test_batches"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _overrides() -> list[str]:
    hc = hydra_config()
    return list(hc.overrides.task) if hc is not None else []
