"""Build a training run from a Hydra config, fit, test, and write the run's metrics.

``train(cfg)`` is what ``python train.py`` calls. It builds, in order: the datamodule
(``cfg.data``), the network (``vitrel.create_model(cfg.model.name, pos=cfg.pos, ...)`` sized by the
datamodule), the :class:`ClassifierModule` (``cfg.optim``, ``cfg.module``), the loggers
(``cfg.logger``), the callbacks (``cfg.callbacks``) and the trainer (``cfg.trainer``); then fits
(resuming per ``ckpt_path`` / ``resume``), tests, and writes ``<run dir>/metrics.json``, which the
sweep summary reads.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from omegaconf import DictConfig, OmegaConf

from vitrel.train.callbacks import (
    ExactResume,
    LastCheckpoint,
    LineProgress,
    NaNGuard,
    PosImageLogger,
    SignalCheckpoint,
    last_checkpoint_path,
)
from vitrel.train.module import ClassifierModule

__all__ = [
    "train",
    "build_datamodule",
    "build_model",
    "build_module",
    "build_loggers",
    "build_callbacks",
    "build_trainer",
    "resolve_ckpt_path",
    "wandb_mode",
    "run_dir_of",
]

CALLBACKS: dict[str, type[Callback]] = {
    "model_checkpoint": ModelCheckpoint,
    "last_checkpoint": LastCheckpoint,
    "lr_monitor": LearningRateMonitor,
    "signal_checkpoint": SignalCheckpoint,
    "nan_guard": NaNGuard,
    "exact_resume": ExactResume,
    "pos_images": PosImageLogger,
}
LOGGERS = ("wandb", "csv", "tensorboard")


def _plain(node: Any) -> Any:
    """An OmegaConf node (or anything) as plain, resolved Python containers."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _hydra_cfg() -> Any | None:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _is_multirun() -> bool:
    from hydra.types import RunMode

    hc = _hydra_cfg()
    return hc is not None and hc.mode == RunMode.MULTIRUN


def route_lightning_logs() -> None:
    """Under Hydra (the root logger has handlers) let Lightning's messages go through them only.

    ``import lightning`` adds its own console handler while still propagating to the root logger,
    which prints every message twice; drop that handler when the root logger already prints.
    """
    if logging.getLogger().hasHandlers():
        lg = logging.getLogger("lightning")
        for h in list(lg.handlers):
            if type(h) is logging.StreamHandler:
                lg.removeHandler(h)


def run_dir_of(cfg: DictConfig) -> Path:
    """The run's output folder: ``cfg.paths.output_dir`` (Hydra's job folder by default)."""
    return Path(str(cfg.paths.output_dir)).resolve()


# ------------------------------------------------------------------------------------------ builders
def build_datamodule(data_cfg: DictConfig | dict) -> L.LightningDataModule:
    """``cfg.data`` -> DataModule: ``{"name": ..., **kwargs}`` (``vitrel.data.build_datamodule``) or ``_target_``."""
    d = dict(_plain(data_cfg))
    name = d.pop("name", None)  # the data set's name (for logs); the _target_ class does not take it
    if "_target_" in d:
        from hydra.utils import instantiate

        return instantiate(d)
    if name is None:
        raise ValueError(f"the data config needs a 'name' (or a '_target_'), got keys {sorted(d)}")
    from vitrel.data import build_datamodule as build

    return build(name, **d)


def build_model(cfg: DictConfig, dm: L.LightningDataModule) -> torch.nn.Module:
    """``vitrel.create_model(cfg.model.name, pos=cfg.pos, **cfg.model)`` sized by the datamodule."""
    import vitrel

    m = dict(_plain(cfg.model))
    name = m.pop("name", None)
    if name is None:
        raise ValueError(f"the model config needs a 'name', got keys {sorted(m)}")
    pos = _plain(cfg.get("pos"))
    for key, value in (("num_classes", dm.num_classes), ("in_chans", dm.in_chans), ("img_size", dm.img_size)):
        m.setdefault(key, value)
    return vitrel.create_model(name, pos=pos, **m)


def build_module(cfg: DictConfig, model: torch.nn.Module, num_classes: int) -> ClassifierModule:
    optim = dict(_plain(cfg.optim))
    name = optim.pop("name", "adamw")
    if name != "adamw":
        raise ValueError(f"optim.name must be 'adamw' (the only optimizer wired in), got {name!r}")
    module_kw = dict(_plain(cfg.get("module") or {}))
    return ClassifierModule(model, num_classes, **optim, **module_kw, compile=_plain(cfg.get("compile", False)))


def _wandb_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return host is not None and netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(requested: str = "auto") -> str:
    """``auto``: ``$WANDB_MODE`` if set, else ``online`` with an API key (env or netrc), else ``offline``."""
    if requested not in ("auto", "online", "offline", "disabled"):
        raise ValueError(f"logger.wandb.mode must be auto, online, offline or disabled, got {requested!r}")
    if requested != "auto":
        return requested
    env = os.environ.get("WANDB_MODE")
    if env:
        return "offline" if env == "dryrun" else env
    return "online" if _wandb_key_available() else "offline"


def _wandb_logger(opts: dict, cfg: DictConfig, run_dir: Path) -> WandbLogger:
    opts = dict(opts)
    mode = wandb_mode(opts.pop("mode", "auto"))
    hc = _hydra_cfg()
    name, group = opts.pop("name", None), opts.pop("group", None)
    if _is_multirun():
        sweep = Path(str(hc.sweep.dir)).name
        group = group or f"{cfg.get('task_name', 'train')}-{sweep}"
        name = name or f"{sweep}/{hc.job.num}:{hc.job.override_dirname or 'defaults'}"
    name = name or run_dir.name
    # one W&B run per run folder: a resumed (or requeued) job continues the same W&B run
    id_file = run_dir / "wandb_run_id"
    run_id = opts.pop("id", None) or (id_file.read_text().strip() if id_file.exists() else None)
    if run_id is None:
        run_id = secrets.token_hex(4)
        if rank_zero_only.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id)
    log_model = opts.pop("log_model", True)
    log_model = log_model if mode == "online" else False  # artifacts need a server
    return WandbLogger(
        save_dir=str(run_dir),
        name=name,
        group=group,
        id=run_id,
        resume="allow",
        mode=mode,
        log_model=log_model,
        **opts,
    )


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    """``cfg.logger``: a dict of named loggers (``wandb``, ``csv``, ``tensorboard``), each with its options."""
    out: list[Logger] = []
    for key, opts in dict(_plain(cfg.get("logger")) or {}).items():
        if opts is None or opts is False:
            continue
        opts = dict(opts) if isinstance(opts, dict) else {}
        if key == "wandb":
            out.append(_wandb_logger(opts, cfg, run_dir))
        elif key == "csv":
            out.append(CSVLogger(save_dir=str(run_dir), name=opts.pop("name", "csv"), version="", **opts))
        elif key == "tensorboard":
            out.append(
                TensorBoardLogger(save_dir=str(run_dir), name=opts.pop("name", "tensorboard"), version="", **opts)
            )
        else:
            raise ValueError(f"unknown logger {key!r}; known: {', '.join(LOGGERS)}")
    return out


def build_callbacks(cfg: DictConfig, run_dir: Path, with_loggers: bool) -> list[Callback]:
    """``cfg.callbacks``: named entries, each a known name (see ``CALLBACKS``) with its options or a ``_target_``;
    ``null`` switches one off. Adds the progress display (rich on a terminal, plain lines otherwise)."""
    out: list[Callback] = []
    for key, opts in dict(_plain(cfg.get("callbacks")) or {}).items():
        if opts is None or opts is False:
            continue
        opts = dict(opts) if isinstance(opts, dict) else {}
        if "_target_" in opts:
            from hydra.utils import instantiate

            out.append(instantiate(opts))
            continue
        if key not in CALLBACKS:
            raise ValueError(f"unknown callback {key!r}; known: {', '.join(CALLBACKS)} (or give a _target_)")
        if key in ("model_checkpoint", "last_checkpoint"):
            opts.setdefault("dirpath", str(run_dir / "checkpoints"))
        elif key == "exact_resume":
            opts.setdefault("seed", int(cfg.seed))
        elif key == "pos_images":
            opts.setdefault("save_dir", str(run_dir))
        elif key == "lr_monitor" and not with_loggers:
            continue  # LearningRateMonitor needs a logger
        out.append(CALLBACKS[key](**opts))
    bar = progress_bar_kind(str(cfg.get("progress_bar", "auto")))
    if bar == "rich":
        out.append(RichProgressBar())
    elif bar == "lines":
        out.append(LineProgress(every_n_steps=int(cfg.get("log_every_n_steps", 50))))
    return out


def progress_bar_kind(requested: str = "auto") -> str:
    """``auto``: ``rich`` on a terminal, ``lines`` (plain lines) when stdout is not a TTY."""
    if requested not in ("auto", "rich", "tqdm", "lines", "none"):
        raise ValueError(f"progress_bar must be auto, rich, tqdm, lines or none, got {requested!r}")
    if requested == "auto":
        return "rich" if sys.stdout.isatty() else "lines"
    return requested


def _check_launch(trainer_cfg: dict) -> None:
    """Lightning's plain ``ddp`` re-runs ``sys.argv`` for the extra processes: under ``-m`` with
    Hydra's in-process launcher every child would run the whole sweep. Refuse it with the fix."""
    if not _is_multirun():
        return
    strategy = str(trainer_cfg.get("strategy", "auto"))
    devices = trainer_cfg.get("devices", 1)
    nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    multi = nodes > 1 or devices not in (1, "1", [0], "auto")
    launcher = str(_hydra_cfg().launcher.get("_target_", ""))
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    managed = SLURMEnvironment.detect() or TorchElasticEnvironment.detect()
    if multi and strategy.startswith("ddp") and "spawn" not in strategy and not managed and "submitit" not in launcher:
        raise ValueError(
            f"trainer.strategy={strategy} with {devices} devices cannot run under -m with Hydra's local launcher: "
            "Lightning re-launches `python train.py <same arguments>` for each extra process, so every child would "
            "run the whole sweep. Under -m use trainer=ddp_spawn, or hydra/launcher=slurm (one SLURM job per sweep "
            "point, one task per device); or run the sweep points one by one without -m."
        )


def build_trainer(cfg: DictConfig, loggers: list[Logger], callbacks: list[Callback], run_dir: Path) -> L.Trainer:
    tcfg = dict(_plain(cfg.trainer))
    _check_launch(tcfg)
    bar = progress_bar_kind(str(cfg.get("progress_bar", "auto")))
    tcfg.setdefault("default_root_dir", str(run_dir))
    tcfg.setdefault("log_every_n_steps", int(cfg.get("log_every_n_steps", 50)))
    return L.Trainer(
        logger=loggers if loggers else False,
        callbacks=callbacks,
        enable_progress_bar=bar in ("rich", "tqdm"),
        **tcfg,
    )


def resolve_ckpt_path(cfg: DictConfig, trainer: L.Trainer, run_dir: Path) -> str | None:
    """``ckpt_path``: a file, or ``last`` (= ``<run dir>/checkpoints/last.ckpt``, must exist); with
    ``resume=auto`` and no ``ckpt_path``, that ``last.ckpt`` is resumed when it exists."""
    last = last_checkpoint_path(trainer) or run_dir / "checkpoints" / "last.ckpt"
    ck = cfg.get("ckpt_path")
    if ck == "last":
        if not last.exists():
            raise FileNotFoundError(
                f"ckpt_path=last: there is no {last}. `last` is the last checkpoint of this run's folder ({run_dir}); "
                "to resume an earlier run, run in its folder (hydra.run.dir=<that folder>) or give ckpt_path=<file>."
            )
        return str(last)
    if ck:
        p = Path(str(ck)).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"ckpt_path={ck}: no such file")
        return str(p)
    resume = cfg.get("resume", "auto")
    if resume not in ("auto", False, "never", None):
        raise ValueError(f"resume must be 'auto' or false, got {resume!r}")
    if resume == "auto" and last.exists():
        rank_zero_info(f"resume=auto: resuming from {last} (set resume=false to start over in this folder)")
        return str(last)
    return None


def _scalars(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out[k] = float(v)
        elif isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def _adopt_csv_columns(loggers: Sequence[Logger]) -> None:
    """Let each CSV logger's writer know the columns already in its ``metrics.csv``.

    Under ``ddp_spawn`` the fit runs in spawned processes, which write ``metrics.csv``; the writer of
    the main process (created before) would then rewrite the file for the test metrics with only the
    columns it knows, which fails. Adopting the file's header first keeps every row.
    """
    import csv

    for lg in loggers:
        if isinstance(lg, CSVLogger):
            w = lg.experiment
            path = Path(w.metrics_file_path)
            if path.exists():
                with open(path, newline="") as f:
                    header = next(csv.reader(f), [])
                w.metrics_keys = sorted(set(w.metrics_keys) | set(header))


def _finish_wandb(loggers: Sequence[Logger], exit_code: int) -> None:
    if any(isinstance(lg, WandbLogger) for lg in loggers) and rank_zero_only.rank == 0:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)


# ------------------------------------------------------------------------------------------ entry point
def train(cfg: DictConfig, callbacks: Sequence[Callback] = ()) -> dict[str, float]:
    """Fit and test as ``cfg`` says; return the final metrics (also in ``<run dir>/metrics.json``)."""
    t0 = time.time()
    route_lightning_logs()
    run_dir = run_dir_of(cfg)
    L.seed_everything(int(cfg.seed), workers=True)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision(str(cfg.get("matmul_precision", "high")))

    dm = build_datamodule(cfg.data)
    model = build_model(cfg, dm)
    module = build_module(cfg, model, dm.num_classes)
    loggers = build_loggers(cfg, run_dir)
    cbs = build_callbacks(cfg, run_dir, with_loggers=bool(loggers)) + list(callbacks)
    trainer = build_trainer(cfg, loggers, cbs, run_dir)
    ckpt = resolve_ckpt_path(cfg, trainer, run_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for lg in loggers:
        lg.log_hyperparams(resolved)
    n_params = sum(p.numel() for p in model.parameters())
    rank_zero_info(
        f"run folder {run_dir}\nmodel {cfg.model.name} pos={cfg.pos.get('name')} ({n_params / 1e6:.2f}M params), "
        f"data {type(dm).__name__} img_size={dm.img_size} classes={dm.num_classes}"
    )

    status = "failed"
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
        metrics = _scalars(trainer.callback_metrics)
        if cfg.get("test", True):
            _adopt_csv_columns(loggers)
            for res in trainer.test(module, datamodule=dm, verbose=False):
                metrics.update(_scalars(res))
        status = "finished"
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
        "global_step": trainer.global_step,
        "wall_s": round(time.time() - t0, 2),
        "run_dir": str(run_dir),
        "last_ckpt": str(last) if last is not None and last.exists() else None,
        "best_ckpt": best or None,
        "model": str(cfg.model.name),
        "pos": cfg.pos.get("name"),
        "data": cfg.data.get("name", cfg.data.get("_target_")),
        "overrides": _overrides(),
    }
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.json").write_text(json.dumps(result, indent=2))
        shown = "  ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if k.startswith(("test/", "val/")))
        print(f"done in {result['wall_s']:.0f} s: {shown}\nrun folder {run_dir}", flush=True)
    target = cfg.get("optimized_metric")
    if target:
        if target not in metrics:
            raise KeyError(f"optimized_metric={target!r} is not among the run's metrics: {sorted(metrics)}")
        return metrics[target]  # type: ignore[return-value]
    return metrics


def _overrides() -> list[str]:
    hc = _hydra_cfg()
    return list(hc.overrides.task) if hc is not None else []
