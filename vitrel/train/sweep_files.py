"""Where a sweep keeps its files, and reading them back: the sweep folder (:func:`sweep_folder`), the marks
:class:`~vitrel.train.hydra_callbacks.SweepSummary` writes into it and into its jobs' folders (the sweep's id, a
failed job's error, an earlier run's record moved aside, the jobs as planned, what stopped a job), the jobs as planned
(:func:`sweep_plan`), and the jobs a stopped sweep left unended (:func:`stopped_jobs`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.utils import to_absolute_path

__all__ = [
    "ERROR",
    "MAY_DIFFER",
    "PLANNED",
    "PREVIOUS",
    "STOPPED",
    "SWEEP_ID",
    "SWEEP_JOB",
    "TRAINED_WITH",
    "job_order",
    "read_note",
    "stopped_jobs",
    "sweep_folder",
    "sweep_plan",
]

#: the checkpoint key of the sweep job that wrote it (:class:`~vitrel.train.resume.SweepJobRecord`)
SWEEP_JOB = "vitrel_sweep_job"
#: overrides a resume (a sweep run again in its folder) may change without a word: how long, where and how it runs
#: and logs (``trainer=ddp`` and its strategy, nodes and precision: a run moved between 1 and several processes)
MAY_DIFFER = frozenset({
    "trainer.max_epochs", "trainer.max_steps", "trainer.max_time", "trainer.devices", "trainer.accelerator",
    "trainer", "trainer.strategy", "trainer.num_nodes", "trainer.precision", "trainer.log_every_n_steps",
    "data.num_workers", "progress_bar", "logger", "test", "resume", "ckpt_path",
})  # fmt: skip


#: the files the sweep summary keeps: the sweep's id (in the sweep folder and in each of its jobs' folders), a
#: failed job's error, and a job's ``metrics.json`` of an earlier run in its folder (moved aside as the job starts)
SWEEP_ID, ERROR, PREVIOUS = ".sweep_id", "error.txt", "metrics.previous.json"
#: the sweep's jobs as its sweeper lays them out (sweep folder), and what stopped a job the sweep ended in (job folder)
PLANNED, STOPPED = ".sweep_jobs.json", "interrupted.txt"
#: the overrides of the run a job's folder held as the job started (its ``last.ckpt``'s sweep job, job folder)
TRAINED_WITH = ".trained_with.json"


def read_note(p: Path) -> str | None:
    """The text of one of these files, stripped; None when there is none."""
    return p.read_text().strip() if p.exists() else None


def job_order(p: Path) -> tuple[int, str]:
    """The sort key of a job folder: job-number order (``2`` before ``10``), other names after them."""
    return (int(p.name), p.name) if p.name.isdigit() else (10**9, p.name)


def sweep_folder(hydra_cfg: Any) -> Path:
    """The sweep folder, ``hydra.sweep.dir`` of ``hydra_cfg`` (the ``hydra`` node) from the launch folder (Hydra's
    ``to_absolute_path``): a job under ``hydra.job.chdir=true`` runs in its own folder, where the default
    ``outputs/...`` would name another."""
    return Path(to_absolute_path(str(hydra_cfg.sweep.dir)))


def sweep_plan(sweep_dir: Path) -> list[list[str]] | None:
    """Each job's overrides, as this sweep's ``SweepSummary`` recorded them when it started
    (:func:`~vitrel.train.sweepers.planned_jobs`); None for a sweeper other than Hydra's basic one, or a record of an
    earlier sweep in the same folder."""
    return _planned(sweep_dir, read_note(sweep_dir / SWEEP_ID))


def _planned(sweep_dir: Path, sweep_id: str | None) -> list[list[str]] | None:
    try:
        data = json.loads((sweep_dir / PLANNED).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data["jobs"] if isinstance(data, dict) and data.get("sweep_id") == sweep_id else None


def stopped_jobs(sweep_dir: Path, record: str = "metrics.json") -> list[Path]:
    """The job folders this sweep started (its ``.sweep_id``) that neither ended (no ``record``, no error) nor
    still run: no run lock, or that of a process gone or of this one. Hydra's basic launcher runs the jobs in this
    process; joblib's and submitit's in others, whose job ends without a word when a signal stops it (Lightning
    leaves through ``SystemExit``, which Hydra does not catch) or the launcher kills it. A job whose lock is of a live
    process, or of one on another host (a SLURM job that goes on after its launcher), is left as it is."""
    from vitrel.train.rundir import RunLock

    sweep_id, out = read_note(sweep_dir / SWEEP_ID), []
    for job in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=job_order):
        if sweep_id is None or read_note(job / SWEEP_ID) != sweep_id:
            continue
        if any((job / name).exists() for name in (record, ERROR, STOPPED)):
            continue
        owner = RunLock(job).read()
        alive = owner.alive() if owner is not None else False
        if alive is False or (alive and owner.pid == os.getpid()):
            out.append(job)
    return out
