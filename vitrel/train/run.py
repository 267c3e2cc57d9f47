"""A training run's lifecycle: ``train(cfg)`` is what ``python train.py`` calls.

It locks the run folder (:class:`~vitrel.train.rundir.RunLock`: a second run in a folder whose run is still going
stops before it touches anything), builds the datamodule (``cfg.data``), the callbacks, finds the checkpoint to resume
(:func:`~vitrel.train.resume.resume_path`), builds the network (:func:`~vitrel.train.build.build_model`; a resumed
fine-tune's from that checkpoint) and takes its pretrained weights' normalisation
(:func:`~vitrel.train.build.adopt_preprocessing`), the :class:`~vitrel.train.module.ClassifierModule` (``cfg.module``),
checks the checkpoint against the model (:func:`~vitrel.train.resume.resolve_ckpt_path`), and only then builds the
loggers, from the checkpoint's step on (:mod:`vitrel.train.loggers`), so
that a resumed run continues its logs; then the trainer (``cfg.trainer``, with
:class:`~vitrel.train.ckpt_io.AtomicCheckpointIO`). It fits, tests, writes ``<run dir>/metrics.json`` (which the
sweep summary reads; its times the whole run's, over the processes a resume continued:
:class:`~vitrel.train.run_times.RunTimes`; its fit's and test's figures read where they ran, ``ddp_spawn``'s processes
too: :class:`~vitrel.train.run_figures.RunFigures`) and prints the closing lines (:mod:`vitrel.train.summary`).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from vitrel.config import (
    ConfigError,
    TrainConfig,
    check_moved_keys,
    check_resume,
    check_top_keys,
)
from vitrel.data.unreadable import ReportUnreadable
from vitrel.train.build import (
    adopt_preprocessing,
    build_model,
    check_from_checkpoint,
    loads_checkpoint,
    model_name,
    pos_name,
    stored_cfg,
    trainer_plugins,
    weights_source,
)
from vitrel.train.callbacks import KeepEarlyStop
from vitrel.train.ckpt_io import AtomicCheckpointIO
from vitrel.train.data_contract import (
    CheckOwnBatches,
    EveryEpochTrains,
    build_data,
    check_data_fits_model,
    check_flip_keeps_labels,
    is_video_data,
    warn_no_preprocessing,
)
from vitrel.train.flops import run_gflops
from vitrel.train.hydra_callbacks import write_held_back_record
from vitrel.train.last_checkpoint import last_checkpoint_path
from vitrel.train.launch_paths import TRAIN_PATHS, launch_paths
from vitrel.train.loggers import adopt_csv_columns, close_loggers, wandb_where
from vitrel.train.loop_rules import first_validation
from vitrel.train.mixing import EvenMixBatches, check_mixup_fits
from vitrel.train.progress import (
    CountTestImages,
    CountValidations,
    DataSizes,
    WarnPartialValidation,
    progress_callbacks,
    progress_display,
)
from vitrel.train.rank_seed import SeedRanks
from vitrel.train.resume import (
    StartRecord,
    SweepJobRecord,
    check_same_model,
    drop_requeue_checkpoints,
    resolve_ckpt_path,
    resume_path,
    run_job,
    world_size,
)
from vitrel.train.run_figures import RunFigures
from vitrel.train.run_times import RunTimes
from vitrel.train.rundir import RunLock, is_launching_process
from vitrel.train.summary import report, resumed_finished, test_limit, tested_part
from vitrel.train.sweepers import BASIC_SWEEPER, better, check_direction
from vitrel.train.target_keys import check_keys_taken, check_seed
from vitrel.train.utils import (
    apply_matmul_precision,
    check_accelerator,
    hydra_config,
    instantiate_callbacks,
    instantiate_loggers,
    is_multirun,
    route_lightning_logs,
    run_dir_of,
    scalars,
    task_overrides,
)

__all__ = [
    "train",
    "check_launch",
    # (re-exported from the modules that build and resume a run)
    "build_model",
    "check_from_checkpoint",
    "resolve_ckpt_path",
    "check_same_model",
    "world_size",
]


def check_launch(trainer_cfg: DictConfig | dict) -> None:
    """Lightning's plain ``ddp`` re-runs ``sys.argv`` for the extra processes: under ``-m`` with
    Hydra's in-process launcher every child would run the whole sweep (joblib's: its workers' command; submitit's
    local one: ``python -m submitit.core._submit <folder>``, which takes no overrides). Refuse it with the fix; only
    the SLURM launcher starts the ranks itself."""
    if not is_multirun():
        return
    strategy = str(trainer_cfg.get("strategy", "auto"))
    devices = trainer_cfg.get("devices", 1)
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    multi = nodes > 1 or devices not in (1, "1", [0], "auto")
    hc = hydra_config()
    launcher = str(hc.launcher.get("_target_", ""))
    choice = (hc.runtime.get("choices") or {}).get("hydra/launcher") or "basic"
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    managed = SLURMEnvironment.detect() or TorchElasticEnvironment.detect()
    in_process = any(w in strategy for w in ("spawn", "fork", "notebook"))  # multiprocessing: nothing re-run
    slurm_jobs = launcher.endswith("SlurmLauncher")  # (submitit's; its local launcher starts no ranks)
    if multi and strategy.startswith("ddp") and not in_process and not managed and not slurm_jobs:
        raise ValueError(
            f"trainer.strategy={strategy} with {devices} devices cannot run under -m with hydra/launcher={choice}: "
            "Lightning re-launches `python train.py <same arguments>` for each extra process, so every child would "
            "run the whole sweep. Under -m use trainer=ddp_spawn, or hydra/launcher=slurm (one SLURM job per sweep "
            "point, one task per device); or run the sweep points one by one without -m."
        )


def check_spawn_ema(cfg: DictConfig) -> None:
    """``module.ema`` (timm's ``ModelEmaV3``) under a strategy that spawns its processes (``trainer=ddp_spawn``): the
    EMA holds a ``torch.Generator``, which PyTorch fails to send to a spawned process (pytorch/pytorch#146828), so every
    rank would die as it starts with ``unable to resize file``. Refuse it with the ways that work."""
    strategy = cfg.trainer.get("strategy", "auto")
    if isinstance(strategy, DictConfig):  # a Lightning strategy object, e.g. DDPStrategy(start_method=...)
        method = strategy.get("start_method")
        shown = f"trainer.strategy.start_method={method}"
    else:
        method, shown = ("spawn" if "spawn" in str(strategy) else None), f"trainer.strategy={strategy}"
    if method not in ("spawn", "forkserver") or cfg.module.get("ema") is None:
        return
    raise ConfigError(
        f"module.ema cannot go with {shown}: timm's ModelEmaV3 holds a torch.Generator, which PyTorch fails to send "
        "to a spawned process (pytorch/pytorch#146828: each rank would stop at start with 'unable to resize file'); "
        "use trainer=ddp for a single run, trainer.strategy=ddp_fork on CPU, or hydra/launcher=slurm under -m"
    )


def check_overfit_loader(cfg: DictConfig) -> None:
    """Lightning's ``trainer.overfit_batches`` replaces a ``torch.utils.data.DataLoader``'s training sampler; the
    memory loader (``data.loader=memory``, Fashion-MNIST's and CIFAR's default) is none, and Lightning stopped in a
    traceback ("needs to subclass torch.utils.data.DataLoader"). Refused with the fix."""
    if not cfg.trainer.get("overfit_batches") or cfg.data.get("loader") != "memory":
        return
    raise ConfigError(
        f"trainer.overfit_batches={cfg.trainer.overfit_batches} replaces the training sampler of a torch DataLoader, "
        "which data.loader=memory has not: add data.loader=workers (data.num_workers=0 for a few batches), or take "
        "debug=overfit, which sets both"
    )


def train(cfg: DictConfig, callbacks: Sequence[Callback] = ()) -> dict[str, float]:
    """Fit and test as ``cfg`` says; return the final metrics (also in ``<run dir>/metrics.json``).

    ``callbacks`` are added to those of ``cfg.callbacks``. The run folder is locked while it runs
    (:class:`~vitrel.train.rundir.RunLock`, by the process of global rank 0).
    """
    check_moved_keys(cfg)  # +optim.lr=... (vitrel 0.1) would be composed and ignored
    check_top_keys(cfg, TrainConfig, "train.py")  # +epochs=3: composed and ignored
    check_resume(cfg)  # resume=true: before anything is built
    check_keys_taken(cfg)  # +trainer.max_epoch=1, +data.batchsize=32: a TypeError once the run has begun
    check_seed(cfg.seed)  # seed=-1: Lightning's traceback
    check_accelerator(cfg.trainer)  # trainer=gpu on a machine without one: what to run instead
    check_spawn_ema(cfg)  # trainer=ddp_spawn module/ema=default: every rank would die as it starts
    check_overfit_loader(cfg)  # trainer.overfit_batches with the memory loader: Lightning's traceback
    launch_paths(cfg, TRAIN_PATHS)  # data.path=fm.npz: the launch folder's, also under hydra.job.chdir=true
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
    apply_matmul_precision(cfg)

    check_from_checkpoint(cfg)  # model=from_checkpoint: its weights and scheme are the file's
    dm = build_data(cfg.data)  # (its name: passed to a class that takes it)
    cbs = instantiate_callbacks(cfg.get("callbacks")) + list(callbacks)
    bar = progress_display(cfg.get("progress_bar", "auto"), cfg.get("callbacks"), cbs)  # (own: a bar among cbs)
    check_tuner_callbacks(cfg.get("callbacks"))  # Lightning's LearningRateFinder, BatchSizeFinder: refused
    job = run_job()  # (kept in its checkpoints: a sweep run again resumes its own jobs' folders only; a resume with
    # other settings than the checkpoint's run is said)
    if job is not None:
        cbs.append(SweepJobRecord(job))
    clock = RunTimes(t0)  # (kept in the checkpoints: a resumed run's times count those of the processes before it)
    validated = CountValidations()  # the validations run (kept in the checkpoints too)
    cbs += [clock, validated, SeedRanks(int(cfg.seed))]  # (each DDP rank's own draws in the training step)
    cbs.append(WarnPartialValidation())  # (limit_val_batches on a split sorted by class: its first classes)
    cbs.append(KeepEarlyStop())  # (a resumed run that EarlyStopping stopped trains no further)
    cbs.append(StartRecord())  # the ckpt_path=<file> the folder's run started from (a requeued job continues it)
    cbs.append(EveryEpochTrains())  # (an epoch of no batch: an error, not a "finished" run that trained nothing)
    cbs.append(CheckOwnBatches(dm))  # (a data module of one's own: its first images as its attributes say)
    resume = resume_path(cfg, cbs, run_dir)  # a resumed fine-tune is built from it, not from its pretrained weights
    model = build_model(cfg.model, dm, resume)  # (a data module without num_classes, in_chans, img_size: refused)
    warn_no_preprocessing(dm)  # (no mean, std: the checkpoints could not tell predict.py how to normalise)
    normalised = adopt_preprocessing(cfg.data, cfg.model, dm, model, resume)  # pretrained weights' mean, std
    check_data_fits_model(dm, model, f"the model ({model_name(cfg, model)})")  # before a batch is made
    check_flip_keeps_labels(dm)  # (a flip over classes that tell left from right: SSv2's)
    started = weights_source(cfg.model)  # (kept in the checkpoints: a resume from other weights is refused)
    module = instantiate(cfg.module, model=model, num_classes=dm.num_classes, started_from=started)
    check_optimized_metric(cfg, module)  # (a misspelled name: refused now, not after the run or the sweep's jobs)
    if str(cfg.get("optimized_metric") or "").startswith("val/"):
        cbs.append(ValidatesBeforeEnd(cfg.optimized_metric))  # (a fit that never validates: refused as it starts)
    check_monitors(cbs, module)  # (EarlyStopping(monitor=val/acc): refused now, not after the first epoch)
    check_mixup_takes_batches(module, dm)  # (else the module's own check, at the first step, in a traceback)
    cbs.append(EvenMixBatches())  # (an odd batch: refused as the fit starts, not at the epoch's last step)
    ckpt, resume_step = resolve_ckpt_path(cfg, cbs, run_dir, model, dm, resume, started)  # before the loggers open
    loggers = instantiate_loggers(cfg.get("logger"), resume_step=resume_step)
    if not loggers:  # LearningRateMonitor needs a logger
        cbs = [cb for cb in cbs if not isinstance(cb, LearningRateMonitor)]
    counted = CountTestImages()  # the test images scored
    unreadable = ReportUnreadable()  # (data.on_bad_sample=skip: each pass's files replaced or left out, logged)
    figures = RunFigures(counted, unreadable, validated)  # (read where the fit and test ran: ddp_spawn's processes)
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        logger=loggers or False,
        callbacks=cbs + progress_callbacks(bar) + [counted, unreadable, figures, DataSizes()],
        enable_progress_bar=bar in ("rich", "tqdm", "own"),
        plugins=[*trainer_plugins(cfg.trainer), AtomicCheckpointIO()],
    )
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["data"].update(normalised)  # (what the run normalises with, where pretrained weights gave it)
    if loads_checkpoint(cfg.model):  # the scheme the model has (the file's), not the pos group's default
        resolved["pos"] = stored_cfg(model).get("pos", resolved.get("pos"))
    for lg in trainer.loggers:  # (Lightning's: a dummy under fast_dev_run, which opens no logger's run)
        lg.log_hyperparams(resolved)
    n_params = sum(p.numel() for p in model.parameters())
    rank_zero_info(
        f"run folder {run_dir}\nmodel {model_name(cfg, model)} pos={pos_name(cfg, model)} "
        f"({n_params:,} parameters), "  # (exact: schemes differ by a few thousand)
        f"data {type(dm).__name__} img_size={dm.img_size} classes={dm.num_classes}"
    )

    status, wandb_run = "failed", None
    tested: dict = {"test_images": None, "test_split_images": None, "classes_note": ""}
    try:
        t_fit = clock.fit_started = time.time()
        try:
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt, weights_only=True)  # tensors and containers only
        except SIGTERMException as e:  # Lightning's SIGTERM exit carries no code: report the signal
            raise SystemExit(e.code if e.code is not None else 128 + signal.SIGTERM) from None
        fit_s = time.time() - t_fit
        fitted = figures.take(trainer, "fit")  # epochs, global_step, val_runs
        drop_requeue_checkpoints(trainer)  # (under SLURM, trainer.test would load them)
        metrics = scalars(trainer.callback_metrics)
        if cfg.get("test", True):
            adopt_csv_columns(trainer.loggers)
            for res in trainer.test(module, datamodule=dm, verbose=False):
                metrics.update(scalars(res))
            tested = figures.take(trainer, "test")
        status = "finished"
        wandb_run = wandb_where(trainer.loggers)
    finally:
        close_loggers(trainer.loggers, 0 if status == "finished" else 1)

    last = last_checkpoint_path(trainer)
    chosen = trainer.checkpoint_callback if isinstance(trainer.checkpoint_callback, ModelCheckpoint) else None
    best = chosen.best_model_path if chosen is not None else ""
    n_tested, n_split = tested["test_images"], tested["test_split_images"]
    result = {
        "status": status,
        "metrics": metrics,
        "epochs": fitted["epochs"],  # completed; a stop's unfinished one: partial_epoch_steps
        "partial_epoch_steps": fitted["partial_epoch_steps"],  # 0: the last epoch ran to its end
        "val_runs": fitted["val_runs"],  # 0: trainer.max_steps ended the fit before its first validation
        "global_step": fitted["global_step"],
        "stopped_by": fitted["stopped_by"],  # "EarlyStopping in epoch 3 (...)", else None
        **clock.times(fit_s, time.time() - t0),  # the whole run's fit_s and wall_s, and their part before a resume
        "run_dir": str(run_dir),
        "last_ckpt": str(last) if last is not None and last.exists() else None,
        "best_ckpt": best or None,
        "best_monitor": chosen.monitor if best else None,  # (the metric best_ckpt is chosen by; None: the newest)
        "test_images": n_tested,  # scored: fewer than test_split_images under trainer.limit_test_batches
        "test_split_images": n_split,
        "test_limited_by": test_limit(cfg.trainer) if tested_part(n_tested, n_split) else None,
        "model": model_name(cfg, model),
        "params": n_params,  # (timm's param_count, not in millions)
        "gflops": run_gflops(model) if trainer.is_global_zero else None,  # one forward, one image at its img_size
        "pos": pos_name(cfg, model),
        "data": cfg.data.get("name", cfg.data.get("_target_")),
        "overrides": task_overrides(),
    }
    if status == "finished" and resume_step is not None and fitted["global_step"] == resume_step:
        result = resumed_finished(result, run_dir)
        metrics = result["metrics"]  # (optimized_metric: val/acc1 is the finished run's)
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.json").write_text(json.dumps(result, indent=2))
        noun = "videos" if is_video_data(dm) else "images"
        print(report(result, wandb_run, tested["classes_note"], noun), flush=True)
    target = cfg.get("optimized_metric")
    if target:
        if target not in metrics and str(target).startswith("val/") and result["val_runs"] == 0:
            raise ConfigError(  # (a plan ValidatesBeforeEnd could not read: a time-based val_check_interval ...)
                f"optimized_metric={target}: the run ended before its first validation (val_runs=0 in metrics.json), "
                "so it logged no val/ metric; validate within the fit (trainer.val_check_interval=<training "
                "batches>), shorten its epochs (trainer.limit_train_batches=<batches>), raise trainer.max_steps, or "
                "optimize a test/ metric"
            )
        if target not in metrics:  # (a metric named by metric_names that this run did not log, e.g. acc1 with mixup)
            raise KeyError(f"optimized_metric={target!r} is not among the run's metrics: {sorted(metrics)}")
        return metrics[target]  # type: ignore[return-value]
    return metrics


#: Lightning's tuner callbacks, and why a vitrel run cannot take them
TUNERS = {
    "LearningRateFinder": "the module has no lr attribute to set (module.optimizer.lr is built into the optimizer); "
    "search module.optimizer.lr with a sweep instead (-m module.optimizer.lr=1e-3,2e-3,4e-3, or hparams_search=...)",
    "BatchSizeFinder": "it changes the batch size after the learning-rate schedule is planned from it, and its trial "
    "restores count as resumes in metrics.json; set data.batch_size (per device) instead",
}


def check_tuner_callbacks(callbacks_cfg: DictConfig | None) -> None:
    """Lightning's ``LearningRateFinder`` and ``BatchSizeFinder`` among ``cfg.callbacks``: a
    :class:`~vitrel.config.ConfigError` naming the entry and what to set instead (:data:`TUNERS`)."""
    for name, entry in (callbacks_cfg or {}).items():
        cls = str(entry.get("_target_", "")).rsplit(".", 1)[-1] if entry is not None else ""
        if cls in TUNERS:
            raise ConfigError(f"callbacks.{name} ({cls}) cannot go with a vitrel run: {TUNERS[cls]}")


def check_mixup_takes_batches(module: L.LightningModule, dm: L.LightningDataModule) -> None:
    """``module.mixup`` takes the data's batches (timm's ``Mixup`` image tensors and clips, its ``NaFlexMixup`` NaFlex
    batches: ``data.packing``), else a :class:`~vitrel.config.ConfigError` before the run trains."""
    try:
        check_mixup_fits(getattr(module, "mixup_fn", None), getattr(dm, "packing", None) is not None)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_optimized_metric(cfg: DictConfig, module: L.LightningModule) -> None:
    """``optimized_metric`` (what ``train()`` returns to a Hydra sweeper) is one of the metrics ``module`` logs
    (``metric_names``; test metrics with ``test=true``), else a :class:`~vitrel.config.ConfigError` naming them,
    before the run trains; under ``-m``, the sweeper's ``direction`` goes with it (:func:`check_direction`)."""
    target, names = cfg.get("optimized_metric"), getattr(module, "metric_names", None)
    if not target or names is None:
        return
    known = names(test=bool(cfg.get("test", True)))
    if target not in known:
        no_test = " (test=false: no test/ metrics)" if str(target).startswith("test/") else ""
        said = f"optimized_metric={target} is not a metric this run logs{no_test}"
        raise ConfigError(f"{said}: one of {', '.join(known)}")
    hc = hydra_config()
    if not is_multirun():
        return
    if hc.sweeper.get("direction") is not None:
        check_direction(str(target), hc.sweeper.direction)
    if str(target).startswith("test/") and hc.sweeper.get("_target_") != BASIC_SWEEPER:
        rank_zero_warn(  # (Hydra's basic sweeper reads no value: there it only names the figure the job returns)
            f"optimized_metric={target}: the sweeper chooses its trials by the test split's score, so the best one's "
            "test score is no longer a fair estimate of new data (it was picked on it); search on a val/ metric "
            "(val/acc1) and report the chosen run's test score"
        )


class ValidatesBeforeEnd(Callback):
    """``optimized_metric`` a ``val/`` metric in a fit that ends before its first validation
    (:func:`~vitrel.train.loop_rules.first_validation`: ``trainer.max_steps`` within the first epoch, a
    ``check_val_every_n_epoch`` past ``max_epochs``, ``limit_val_batches=0``): a :class:`~vitrel.config.ConfigError`
    as the fit starts, naming the stop and the fix, not the missing metric after the run has trained and tested."""

    def __init__(self, target: str) -> None:
        self.target = target

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        plan = first_validation(trainer)
        if plan is None or plan[1]:
            return
        said = f"optimized_metric={self.target} is a validation metric"
        if plan[0] == float("inf"):
            raise ConfigError(f"{said}, and this run validates never (trainer.limit_val_batches=0?)")
        n, k = int(trainer.num_training_batches), trainer.accumulate_grad_batches
        every, max_steps, max_epochs = trainer.check_val_every_n_epoch, trainer.max_steps, trainer.max_epochs
        epoch = f"an epoch: {n} training batches, {-(-n // k)} optimizer steps"
        if max_steps is None or max_steps < 0 or (max_epochs is not None and 0 <= max_epochs * -(-n // k) < max_steps):
            raise ConfigError(  # (check_val_every_n_epoch past max_epochs)
                f"{said}, and this fit ends before its first validation: trainer.max_epochs={max_epochs} ends it, "
                f"trainer.check_val_every_n_epoch={every} validates after epoch {every} ({epoch}); set "
                f"trainer.check_val_every_n_epoch to at most {max_epochs}"
            )
        each = " trainer.check_val_every_n_epoch=1" if every not in (None, 1) else ""
        raise ConfigError(
            f"{said}, and this fit ends before its first validation: trainer.max_steps={max_steps} ends it, it would "
            f"first validate after optimizer step {int(plan[0])} ({epoch}); validate within its {max_steps} steps "
            f"(trainer.val_check_interval={k * max_steps}{each}: every {k * max_steps} training batches), shorten its "
            f"epochs (trainer.limit_train_batches={k * max_steps}{each}), raise trainer.max_steps, or optimize a test/ "
            "metric"
        )


def check_monitors(callbacks: Sequence[Callback], module: L.LightningModule) -> None:
    """The ``monitor`` of each ``EarlyStopping`` (``strict``) and ``ModelCheckpoint`` among ``callbacks``, before the
    run trains (Lightning's own error comes at the first validation's end, after its training): a name that is not one
    of the metrics the module logs (``module.metric_names(test=False)``) but is close to one (``val/acc`` for
    ``val/acc1``, ``val/loss_epoch``), or a ``test/`` one, is a :class:`~vitrel.config.ConfigError` naming them; any
    other name may be logged by a callback of one's own and is left to Lightning's check. A known metric's ``mode``:
    an accuracy's ``max``, a loss's ``min`` (EarlyStopping's default ``min`` for ``val/acc1`` stops a run that keeps
    improving).
    """
    names = getattr(module, "metric_names", None)
    if names is None:
        return
    known = names(test=False)
    for cb in callbacks:
        ckpt = isinstance(cb, ModelCheckpoint)  # (which also offers the epoch and step counters)
        if not ckpt and not isinstance(cb, EarlyStopping):
            continue
        logged = [*known, "epoch", "step"] if ckpt else known
        if ckpt:
            _check_saved_when_scored(cb)
        if cb.monitor is None or cb.monitor in logged:
            want = better(cb.monitor)
            if want is not None and cb.mode != want:
                raise ConfigError(
                    f"{type(cb).__name__}(monitor={cb.monitor}, mode={cb.mode}) would keep the worst value as the "
                    f"best; set its mode={want}"
                )
        elif (ckpt or cb.strict) and _misnamed(str(cb.monitor), known):
            raise ConfigError(
                f"{type(cb).__name__}(monitor={cb.monitor}) is not a metric this run logs: one of {', '.join(logged)}"
            )


def _check_saved_when_scored(cb: ModelCheckpoint) -> None:
    """A ``ModelCheckpoint`` monitoring a validation metric that also saves every N training steps or minutes saves
    between validations: its "best" file then holds weights no validation scored, kept for the previous validation's
    score. A :class:`~vitrel.config.ConfigError` naming
    ``last.ckpt``'s own triggers, which save mid-epoch without a score."""
    steps, interval = cb._every_n_train_steps, cb._train_time_interval
    if not str(cb.monitor).startswith("val/") or not (steps or interval):
        return
    given = f"every_n_train_steps={steps}" if steps else f"train_time_interval={interval}"
    mid = (
        f"callbacks.last_checkpoint.every_n_train_steps={steps}" if steps
        else f"callbacks.last_checkpoint.every_n_minutes={max(1, round(interval.total_seconds() / 60))}"
    )  # fmt: skip
    raise ConfigError(
        f"{type(cb).__name__}(monitor={cb.monitor}, {given}) would save its best file between validations, weights "
        f"no validation scored kept under the last validation's {cb.monitor}; for mid-epoch saves use {mid} "
        "(last.ckpt) and leave the best file to the validations"
    )


def _misnamed(name: str, known: Sequence[str]) -> bool:
    """``name``, not among the ``known`` metric names of the module, is one of them misspelled (``difflib``'s ratio
    0.85 or more: ``val/acc``, ``val/loss_``), with Lightning's ``_step`` / ``_epoch`` added to a metric logged once
    (``val/loss_epoch``), or a ``test/`` metric, which no fit logs. A name a callback of one's own logs
    (``val/my_metric``) is none of these: Lightning's check, at the first validation, is its."""
    import difflib

    base = name.removesuffix("_step").removesuffix("_epoch")
    if name.startswith("test/") or (base != name and base in known):
        return True
    return bool(difflib.get_close_matches(name, known, n=1, cutoff=0.85))
