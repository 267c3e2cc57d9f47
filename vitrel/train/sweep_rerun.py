"""A sweep run again in its folder: each job's folder may hold the run of the earlier sweep. As the job starts,
:func:`set_aside_earlier_run` moves that run's record aside and notes the settings its ``last.ckpt`` was trained
with (the job resumes that run); :func:`trained_with` says, for the summary, where those differ from the job's
(its rows marked: :func:`mark_other_settings`); :func:`finished_record` finds the record of a finished run the
job resumed (its figures)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitrel.train.sweep_files import ERROR, MAY_DIFFER, PREVIOUS, STOPPED, SWEEP_JOB, TRAINED_WITH
from vitrel.train.utils import override_key

__all__ = ["finished_record", "mark_other_settings", "set_aside_earlier_run", "swept_settings", "trained_with"]


def set_aside_earlier_run(job_dir: Path, record: str = "metrics.json") -> None:
    """Make ``job_dir`` ready for a sweep job: an earlier run's ``record`` there (``metrics.json``; eval.py's
    ``eval_metrics.json``) is moved aside to ``metrics.previous.json`` (``eval_metrics.previous.json``; its settings
    noted: :func:`_record_trained_with`), its error and what stopped it removed, so that a job that fails now shows
    as failed, not with the earlier run's metrics."""
    if (job_dir / record).exists():
        previous = PREVIOUS if record == "metrics.json" else f"{Path(record).stem}.previous.json"
        os.replace(job_dir / record, job_dir / previous)
    _record_trained_with(job_dir)
    (job_dir / ERROR).unlink(missing_ok=True)
    (job_dir / STOPPED).unlink(missing_ok=True)


def _record_trained_with(job_dir: Path) -> None:
    """Keep the overrides of the sweep job that wrote ``job_dir``'s ``checkpoints/last.ckpt`` (a sweep run again in
    its folder: the job resumes that run) in ``TRAINED_WITH``, read before this job writes its own checkpoints;
    nothing without one, or from a checkpoint that records no sweep job or does not load."""
    (job_dir / TRAINED_WITH).unlink(missing_ok=True)
    ckpt = job_dir / "checkpoints" / "last.ckpt"
    job = _sweep_job(ckpt) if ckpt.exists() else None
    if job is not None and job.get("overrides") is not None:
        (job_dir / TRAINED_WITH).write_text(json.dumps({"overrides": [str(o) for o in job["overrides"]]}))


def _sweep_job(ckpt: str | Path) -> dict[str, Any] | None:
    """The sweep-job record (:data:`SWEEP_JOB`) of the checkpoint ``ckpt``; None without one, or for a file that does
    not load (a damaged or foreign file: whoever loads its weights says so)."""
    try:
        import torch

        job = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True).get(SWEEP_JOB)
    except Exception:  # noqa: BLE001
        return None
    return job if isinstance(job, dict) else None


def swept_settings(ckpt: str | Path) -> str | None:
    """The overrides of the keys its sweep varied, of the sweep job that wrote the checkpoint ``ckpt``
    (``pos=rel2d_full seed=1``): what tells its run from the sweep's others (``eval.py -m`` over a sweep's jobs labels
    its rows with them). None for a single run, an export, or a checkpoint that records no sweep job."""
    job = _sweep_job(ckpt) if Path(ckpt).suffix == ".ckpt" else None
    if job is None:
        return None
    swept = set(job.get("swept") or ())
    return " ".join(str(o) for o in job.get("overrides") or () if override_key(str(o)) in swept) or None


def trained_with(job_dir: Path, data: dict[str, Any], overrides: Sequence[str]) -> str | None:
    """For a job that resumed its folder's run (``data``: its ``metrics.json``), the settings that run was trained
    with where they differ from the job's ``overrides`` (``module.optimizer.lr=0.002``, or ``module.optimizer.lr
    (not set)``), less those a sweep run again may change (``trainer.max_epochs``, ``logger``, ...); None when the
    job did not resume, or resumed a run of its own settings. The resumed run keeps the checkpoint's weights,
    optimizer and rates: the row's figures are of those settings, not of the job's."""
    if not (data.get("resumes") or data.get("resumed_finished")) or not (job_dir / TRAINED_WITH).exists():
        return None
    theirs = json.loads((job_dir / TRAINED_WITH).read_text()).get("overrides") or []
    a, b = {override_key(o): o for o in theirs}, {override_key(o): o for o in overrides}
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in MAY_DIFFER)
    return " ".join(a.get(k, f"{k} (not set)") for k in keys) or None


def mark_other_settings(row: dict[str, Any]) -> str:
    """`` *`` after a summary row (a job, or a setting's seeds) that holds :func:`trained_with`'s settings: its
    figures are of a resumed run of other settings (the tables, ``summary_seeds.csv``'s ``trained_with``, the
    picture's label); "" otherwise."""
    return " *" if row.get("trained_with") else ""


def finished_record(run_dir: str | Path, global_step: int) -> dict[str, Any] | None:
    """The ``metrics.json`` record of the finished run that wrote the checkpoint of ``global_step`` in ``run_dir``:
    the folder's ``metrics.json`` (a single run run again in its folder), else its ``metrics.previous.json`` (a sweep
    run again: :func:`set_aside_earlier_run` moved it aside as the job started); None when neither is that run's (a run
    stopped before it wrote its record, or one of another step)."""
    for name in ("metrics.json", PREVIOUS):
        p = Path(run_dir) / name
        try:
            data = json.loads(p.read_text()) if p.exists() else None
        except json.JSONDecodeError:
            continue  # (a damaged record is no record of the run)
        if isinstance(data, dict) and data.get("status") == "finished" and data.get("global_step") == global_step:
            return data
    return None
