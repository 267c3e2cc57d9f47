"""The loggers of the training runs: Lightning's, built so that a resumed run continues its logs.

``train()`` resolves the checkpoint it resumes before it builds the loggers, and hands its global step
to each logger node that has a ``resume_step`` entry (``conf/logger/*.yaml``):

* :func:`csv_logger` (``logger=csv``): one ``<run folder>/csv/metrics.csv`` for the whole run. A resumed
  run keeps the file's rows of the steps before the checkpoint and appends its own; the rows the
  interrupted run logged after its checkpoint (from ``resume_step`` on) are dropped, since the resumed
  run logs those steps again. No row from before the checkpoint is lost, no step appears twice.
* :func:`tensorboard_logger` (``logger=tensorboard``): the event files of ``<run folder>/tensorboard``;
  a resumed run adds its own file with ``purge_step=resume_step`` (``SummaryWriter``), so TensorBoard
  hides the interrupted run's events from that step on instead of showing them twice (a run that starts over in
  the folder: from step 0). A run writes one file, its fit's and test's events in order (:class:`RunTensorBoardLogger`):
  TensorBoard reads a folder's files in name order, and a second file of the same second could sort first
  (``.10`` before ``.9``), its test metrics and pictures then purged by the run's own ``purge_step``.
* :func:`wandb_logger` (``logger=wandb``): Lightning's ``WandbLogger`` (:class:`RunFolderWandbLogger`) plus what a
  sweep on a cluster needs: the mode is picked from the environment (``auto``), a run folder keeps one W&B run across
  resumes and requeues (its id is kept in ``<run folder>/wandb_run_id``, resumed with ``resume="allow"``; a run that
  starts over in the folder, ``resume_step`` None, gets a new one), and the jobs of a ``-m`` sweep share a group named
  after the sweep.

While the run goes on: :func:`adopt_csv_columns` before its test (``ddp_spawn``), :func:`wandb_where` and
:func:`close_loggers` at its end.
"""

from __future__ import annotations

import csv
import netrc
import os
import re
import secrets
import socket
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from vitrel.train.utils import hydra_config, is_multirun

__all__ = [
    "csv_logger",
    "tensorboard_logger",
    "wandb_logger",
    "offline_parts",
    "RunFolderWandbLogger",
    "wandb_mode",
    "adopt_csv_columns",
    "wandb_where",
    "close_loggers",
    "RunTensorBoardLogger",
    "image_loggers",
]


# ------------------------------------------------------------------------------------------ CSV
def csv_logger(save_dir: str, name: str = "csv", resume_step: int | None = None, **kwargs: Any) -> CSVLogger:
    """Lightning's ``CSVLogger`` writing ``<save_dir>/<name>/metrics.csv`` (no version folder).

    ``resume_step``: the global step of the checkpoint this run resumes (None: a new run, which starts
    the file over as Lightning does). The rows of the steps before it are kept (see the module
    docstring); other keyword arguments go to ``CSVLogger`` (``flush_logs_every_n_steps``).
    """
    logger = CSVLogger(save_dir, name=name, version="", **kwargs)
    if resume_step is not None and rank_zero_only.rank == 0:
        kept = _continue_csv(logger, int(resume_step))
        if kept is not None:
            rank_zero_info(f"{logger.log_dir}/metrics.csv: {kept} rows before step {resume_step} kept, continued")
    return logger


def _continue_csv(logger: CSVLogger, resume_step: int) -> int | None:
    """Let ``logger`` continue its ``metrics.csv`` with the rows of steps ``< resume_step``; their count
    (None without a file).

    Lightning's writer removes an existing ``metrics.csv`` when it is created: the file is moved aside
    (``metrics.csv.resuming``, atomically) first, the writer created, then the kept rows written through
    it and the file aside removed. A run interrupted in between finds the file aside next time.
    """
    path = Path(logger.log_dir) / "metrics.csv"
    aside = path.with_name(path.name + ".resuming")
    if not aside.exists():
        if not path.exists():
            return None
        os.replace(path, aside)
    with open(aside, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("step") and int(row["step"]) < resume_step]
    with warnings.catch_warnings():  # this is the resume's own doing: the rows are kept
        warnings.filterwarnings("ignore", message=".*Previous log files in this directory will be deleted")
        writer = logger.experiment
    writer.metrics = rows
    writer.save()
    aside.unlink()
    return len(rows)


# ------------------------------------------------------------------------------------------ TensorBoard
def tensorboard_logger(
    save_dir: str, name: str = "tensorboard", resume_step: int | None = None, **kwargs: Any
) -> TensorBoardLogger:
    """Lightning's ``TensorBoardLogger`` writing into ``<save_dir>/<name>`` (no version folder); a resumed
    run (``resume_step``) passes ``purge_step=resume_step`` to its ``SummaryWriter``, a run that starts over in a
    folder holding event files (``resume=false``) ``purge_step=0``: TensorBoard hides the earlier run's events, as
    ``metrics.csv`` starts over. Other keyword arguments go to ``TensorBoardLogger``."""
    if resume_step is not None:
        kwargs["purge_step"] = int(resume_step)
    elif any(Path(save_dir, name).glob("events.out.tfevents.*")):
        kwargs["purge_step"] = 0
    return RunTensorBoardLogger(save_dir, name=name, version="", **kwargs)


class RunTensorBoardLogger(TensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` whose event file stays open from the fit to the test: Lightning's
    ``finalize`` (at the end of each stage) flushes it here, and :func:`close_loggers` closes it as the run ends.
    Lightning's closes it, so the test opened a second file, which TensorBoard may read before the first."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None:
            self.experiment.flush()
        if status == "success":
            self.save()

    @rank_zero_only
    def close(self) -> None:
        if self._experiment is not None:
            self.experiment.close()


# ------------------------------------------------------------------------------------------ W&B


def _wandb_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return host is not None and netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb_reachable(timeout: float = 3.0) -> bool:
    """The W&B server (``$WANDB_BASE_URL``, else api.wandb.ai) takes a connection within ``timeout`` seconds."""
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def wandb_mode(requested: str = "auto") -> str:
    """``auto``: ``$WANDB_MODE`` if set, else ``online`` with an API key (env or netrc) and a server that answers
    (a compute node with a key and no network: W&B waited two minutes and stopped the run), else ``offline``."""
    if requested not in ("auto", "online", "offline", "disabled"):
        raise ValueError(f"logger.wandb.mode must be auto, online, offline or disabled, got {requested!r}")
    if requested != "auto":
        return requested
    env = os.environ.get("WANDB_MODE")
    if env:
        return "offline" if env == "dryrun" else env
    if not _wandb_key_available():
        return "offline"
    if not _wandb_reachable():
        warnings.warn(
            "W&B: an API key is set but the server does not answer (no network?): logging offline; upload later "
            "with `wandb sync` (the closing line names the folders); logger.wandb.mode=online insists",
            stacklevel=2,
        )
        return "offline"
    return "online"


def wandb_logger(
    save_dir: str,
    project: str = "vitrel",
    name: str | None = None,
    group: str | None = None,
    id: str | None = None,
    mode: str = "auto",
    log_model: bool = True,
    task_name: str = "train",
    resume_step: int | None = None,
    **kwargs: Any,
) -> WandbLogger:
    """A ``WandbLogger`` writing under ``save_dir`` (the run folder).

    ``name`` defaults to the run folder's name (under ``-m``: ``<sweep>/<job>:<overrides>``), ``group``
    under ``-m`` to ``<task_name>-<sweep folder>``. ``id``: a run that resumes a checkpoint (``resume_step``, its
    global step) continues the W&B run kept in ``save_dir/wandb_run_id``; a run that starts at step 0 (None: a new
    folder, ``resume=false``, or a folder whose earlier attempt left no checkpoint) gets a new one, written there, as
    its ``metrics.csv`` starts over. ``log_model`` applies online only (artifacts need a server). Other keyword
    arguments go to ``WandbLogger`` (``entity``, ``tags``).
    """
    run_dir = Path(save_dir)
    mode = wandb_mode(mode)
    if is_multirun():
        hc = hydra_config()
        sweep = Path(str(hc.sweep.dir)).name
        group = group or f"{task_name}-{sweep}"
        name = name or f"{sweep}/{hc.job.num}:{hc.job.override_dirname or 'defaults'}"
    name = name or run_dir.name
    id_file = run_dir / "wandb_run_id"
    kept = id_file.read_text().strip() if resume_step is not None and id_file.exists() else None
    run_id = id or kept
    if run_id is None:
        run_id = secrets.token_hex(4)
        if rank_zero_only.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id)
    return RunFolderWandbLogger(
        save_dir=str(run_dir),
        project=project,
        name=name,
        group=group,
        id=run_id,
        resume="allow",
        mode=mode,
        log_model=log_model if mode == "online" else False,
        **kwargs,
    )


class RunFolderWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` whose copies in the processes Lightning spawns (``trainer=ddp_spawn``) write the
    run's files into its folder. Lightning pickles the logger for them and each attaches to the W&B run with its
    own process's settings: W&B's directory the working directory's ``./wandb``, where the media logged there (the
    position-scheme pictures) went, outside the run folder that ``wandb sync`` uploads. Unpickled, the copy sets
    ``WANDB_DIR`` of its process (a spawned worker of this run) to the run folder, as the main process's
    ``wandb.init(dir=save_dir)`` has it."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._save_dir is not None:
            os.environ["WANDB_DIR"] = str(Path(self._save_dir).resolve())


@rank_zero_only
def adopt_csv_columns(loggers: Sequence[Logger]) -> None:
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


def offline_parts(wandb_dir: Path, run_id: str) -> list[Path]:
    """The offline folders of W&B run ``run_id`` under ``wandb_dir``, oldest first: ``offline-run-<time>-<id>``
    (``<time>``: ``YYYYMMDD_HHMMSS``), and ``-<id>-<k>`` for the k-th more that started within the same second (W&B's
    name for it)."""
    name = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = [(m, p) for p in wandb_dir.glob("offline-run-*") if (m := name.fullmatch(p.name))]
    return [p for m, p in sorted(found, key=lambda mp: (mp[0][1], int(mp[0][2] or 0)))]


def wandb_where(loggers: Sequence[Logger]) -> str | None:
    """Where the W&B run is: its offline folder (and how to upload it), or its URL; None without W&B or with W&B
    disabled (``mode=disabled``: nothing written).

    A run resumed offline in its folder is one W&B run (one id) written to one ``offline-run-<time>-<id>`` folder per
    process: the upload command names them all, oldest first (``wandb sync`` syncs the parts of a run in that order),
    not only this process's part."""
    for lg in loggers:
        if isinstance(lg, WandbLogger) and rank_zero_only.rank == 0:
            run = lg.experiment
            if getattr(run.settings, "_noop", False) or run.settings.mode == "disabled":
                return None
            folder = Path(run.dir).parent  # <save_dir>/wandb/<offline-run-...>/files
            if getattr(run.settings, "_offline", False) or run.settings.mode == "offline":
                parts = offline_parts(folder.parent, run.id) or [folder]
                counted = f", {len(parts)} parts" if len(parts) > 1 else ""
                return f"{folder} (offline{counted}; upload with: wandb sync {' '.join(map(str, parts))})"
            return str(run.url or folder)
    return None


def close_loggers(loggers: Sequence[Logger], exit_code: int) -> None:
    """As the run ends: its TensorBoard event file closed, its W&B run finished with ``exit_code``."""
    for lg in loggers:
        if isinstance(lg, RunTensorBoardLogger):
            lg.close()
    if any(isinstance(lg, WandbLogger) for lg in loggers) and rank_zero_only.rank == 0:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)


def image_loggers(loggers: Sequence[Logger]) -> list[Logger]:
    """The loggers that keep pictures: TensorBoard's, and W&B's unless its run is a no-op (``WANDB_MODE=disabled``,
    whose pictures would be lost while the log said them logged: they go to files instead)."""
    wandb = [lg for lg in loggers if isinstance(lg, WandbLogger) and not getattr(lg.experiment, "disabled", False)]
    return [lg for lg in loggers if isinstance(lg, TensorBoardLogger) or lg in wandb]
