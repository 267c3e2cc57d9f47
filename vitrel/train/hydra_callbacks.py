"""Hydra callbacks: the run folder taken before Hydra writes there (``python train.py``), and the summary table
printed at the end of a sweep (``python train.py -m ...``).

Each job of a sweep writes ``<sweep dir>/<job>/metrics.json`` (``vitrel.train.run.train``; ``eval.py -m``:
``eval_metrics.json``, conf/eval.yaml's ``record``);
:class:`SweepSummary` reads them all when the sweep ends (in the launching process, whatever the
launcher), prints one row per job and writes ``summary.csv`` / ``summary.md`` into the sweep folder (with a ``seed=``
sweep, each setting's mean ± standard deviation over its seeds, also ``summary_seeds.csv``), and draws them as
``summary.png`` (:mod:`vitrel.train.sweep_plot`; a failure to draw is a warning). It also writes them as
each job ends: Hydra's sweeper raises when a job has failed, before the sweep's end; the table so far is then
printed as the process exits, after Hydra's error (likewise after Ctrl-C, where the job it stopped shows as
interrupted and, for Hydra's basic sweeper, the jobs it never started as not run). A sweep run again in its folder
is told from the earlier one by the id each sweep writes (``.sweep_id``, in the sweep's and its jobs' folders).

The parts: :mod:`vitrel.train.sweepers` (what the sweeper is), :mod:`vitrel.train.sweep_files` (the files a sweep
keeps), :mod:`vitrel.train.sweep_rerun` (a sweep run again in its folder), :mod:`vitrel.train.sweep_table` (the
tables).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from vitrel.train.sweep_files import ERROR, PLANNED, STOPPED, SWEEP_ID, read_note, stopped_jobs, sweep_folder
from vitrel.train.sweep_rerun import set_aside_earlier_run
from vitrel.train.sweep_table import (
    INTERRUPTED,
    NOT_RUN,
    about,
    csv_fields,
    csv_text,
    distance_groups,
    format_means,
    format_table,
    summary_rows,
)
from vitrel.train.sweepers import check_search, optuna_best, planned_jobs

__all__ = ["SweepSummary", "TakeRunFolder", "write_held_back_record"]

log = logging.getLogger(__name__)


class SweepSummary(Callback):
    """Print (and save) a table of every job's final metrics when a multirun ends; with a ``seed=`` sweep, a second
    table of each setting's mean ± standard deviation over its seeds. ``record``: the file each job writes,
    train.py's ``metrics.json`` or eval.py's ``eval_metrics.json`` (whose table shows the ``metrics`` some job
    scored: a job scores one split)."""

    def __init__(
        self,
        metrics: Sequence[str] = ("test/acc1", "test/acc5", "test/loss", "val/acc1"),
        record: str = "metrics.json",
    ) -> None:
        if record not in ("metrics.json", "eval_metrics.json"):
            raise ValueError(f"hydra.callbacks.sweep_summary.record: metrics.json or eval_metrics.json, got {record!r}")
        self.metrics, self.record = list(metrics), record
        self._unended: Path | None = None  # the sweep folder from the sweep's start to its end

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A new id for the sweep folder: job folders of an earlier sweep there (which this sweep has not run again)
        keep theirs and are left out of the summary. Until the sweep's end, the process prints the table so far
        when it exits (:meth:`_at_exit`)."""
        check_search(config)  # (a search of the seed refused, one picked on the test split warned)
        sweep_dir = sweep_folder(config.hydra)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        sweep_id = uuid.uuid4().hex
        (sweep_dir / SWEEP_ID).write_text(sweep_id + "\n")
        try:
            jobs = planned_jobs(config)
        except Exception as e:  # noqa: BLE001  (Hydra refuses such a sweep itself, with its own message)
            log.warning("sweep summary: the sweep's jobs are not known in advance (%s: %s); the table lists only "
                        "those that started", type(e).__name__, e)  # fmt: skip
            jobs = None
        (sweep_dir / PLANNED).unlink(missing_ok=True)  # (an earlier sweep's)
        if jobs is not None:
            (sweep_dir / PLANNED).write_text(json.dumps({"sweep_id": sweep_id, "jobs": jobs}))
        self._unended = sweep_dir
        atexit.register(self._at_exit)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """The job folder takes the sweep's id; an earlier run's ``metrics.json`` there (a sweep run again in its
        folder) is moved aside to ``metrics.previous.json`` and its error removed, so that a job that fails now
        shows as failed, not with the earlier run's metrics."""
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        job_dir = Path(str(config.hydra.runtime.output_dir))
        sweep_id = read_note(sweep_folder(config.hydra) / SWEEP_ID)
        if sweep_id is not None:
            (job_dir / SWEEP_ID).write_text(sweep_id + "\n")
        set_aside_earlier_run(job_dir, self.record)

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        """The summary so far, written as each job of a sweep ends: Hydra's sweeper raises when a job has failed
        (after the rest of its batch has run), and the sweep's end, :meth:`on_multirun_end`, never comes. A failed
        job's error goes to ``<job>/error.txt`` for the summary (only the first failed job's is printed by Hydra)."""
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        if job_return is not None and job_return.status == JobStatus.FAILED:
            try:
                with contextlib.redirect_stderr(io.StringIO()):  # (Hydra's "Error executing job" line comes later)
                    job_return.return_value  # noqa: B018  (raises the job's exception)
            except Exception as e:  # noqa: BLE001  (whatever the job raised is its error)
                out = Path(str(config.hydra.runtime.output_dir))
                (out / ERROR).write_text(f"{type(e).__name__}: {e}\n")
        self._summarize(sweep_folder(config.hydra), show=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unended = None
        atexit.unregister(self._at_exit)
        self._summarize(sweep_folder(config.hydra), show=True, config=config)

    def _at_exit(self) -> None:
        """The table so far of a sweep that never reached its end: Hydra's sweeper raised on a failed job (its
        error is printed first), or Ctrl-C. Never raises: the process is exiting."""
        sweep_dir, self._unended = self._unended, None
        if sweep_dir is None:
            return
        try:
            for job in stopped_jobs(sweep_dir, self.record):  # Ctrl-C, SIGTERM: no on_job_end
                ckpt = job / "checkpoints" / "last.ckpt"
                kept = f"{ckpt.relative_to(job)} kept" if ckpt.exists() else "no last.ckpt"
                kept = f"; {kept}" if self.record == "metrics.json" else ""  # (eval.py writes no checkpoint)
                (job / STOPPED).write_text(f"the sweep stopped while the job ran (Ctrl-C, SIGTERM, exit){kept}\n")
            if summary_rows(sweep_dir, self.metrics, self.record) is None:  # (Hydra refused an override at once)
                print("\nThe sweep stopped before any job ran (its error is above): no table", flush=True)
                return
            print("\nThe sweep stopped before its end (a failed job or an interruption): its jobs so far", flush=True)
            self._summarize(sweep_dir, show=True, stopped=True)
        except Exception as e:  # noqa: BLE001
            print(f"sweep summary: could not print the table of {sweep_dir} ({type(e).__name__}: {e})", flush=True)

    def _summarize(self, sweep_dir: Path, show: bool, stopped: bool = False, config: DictConfig | None = None) -> None:
        """Write ``summary.md`` / ``summary.csv`` (and ``summary_seeds.csv`` for a seed sweep) of the job folders in
        ``sweep_dir`` (each file replaced whole: jobs of a parallel launcher end at once) and, with ``show``, print
        the tables; at the sweep's end (``config``), an Optuna study's best trial below them
        (:func:`~vitrel.train.sweepers.optuna_best`)."""
        if not sweep_dir.exists():
            return
        summary = summary_rows(sweep_dir, self.metrics, self.record)
        if summary is None:
            return
        rows, means, common, earlier = summary
        metrics = self.metrics
        if self.record != "metrics.json":  # (eval.py: each job scores one split, test/* or val/*)
            metrics = [m for m in metrics if any(r.get(m) is not None for r in rows)] or metrics
        head = f"Sweep summary ({len(rows)} jobs, {sweep_dir})" + (f"; all jobs: {' '.join(common)}" if common else "")
        head += f"\n{about(self.record)}"
        if earlier:
            head += f"\njob folders {', '.join(earlier)}: of an earlier sweep in this folder, left out"
        text = f"{head}\n\n{format_table(rows, metrics, self.record)}\n"
        for what in ("failed", INTERRUPTED):
            said = [f"job {r['job']} {r['overrides']}: {r['error']}" for r in rows if r.get("error")
                    and r["status"].startswith(what)]  # fmt: skip
            if said:
                text += f"\n{what}:\n" + "\n".join(said) + "\n"
        if said := [f"job {r['job']} {r['overrides']}: {r['trained_with']}" for r in rows if r.get("trained_with")]:
            text += ("\n*: the job resumed its folder's run (a sweep run again in its folder), which keeps its "
                     "weights, optimizer and rates: the row's figures are of that run's settings\n"
                     + "\n".join(said) + "\n")  # fmt: skip
        if means:
            text += f"\nmean ± standard deviation over seeds (finished jobs):\n\n{format_means(means, metrics)}\n"
        best = optuna_best(config, sweep_dir, rows, common) if config is not None else None
        if best:
            text += f"\n{best}\n"
        if show:
            left = [r["job"] for r in rows if r["status"] in (INTERRUPTED, NOT_RUN)]
            how = ("an interrupted job resumes from its last.ckpt, a finished one only tests again and keeps its row"
                   if self.record == "metrics.json" else "every job scores its checkpoint again")  # fmt: skip
            if left and stopped:
                text += (f"\njobs {', '.join(left)} not finished: run the same command again with "
                         f"hydra.sweep.dir={sweep_dir} to finish them ({how})\n")  # fmt: skip
            print(f"\n{text}", flush=True)
        files = {"summary.md": text, "summary.csv": csv_text(csv_fields(metrics, self.record), rows)}
        mfields = ["overrides", "n", "jobs", *(f"{m} {s}" for m in metrics for s in ("mean", "std"))]
        mfields.append("trained_with")  # (the marked rows': their figures of a resumed run of other settings)
        files["summary_seeds.csv"] = csv_text(mfields, means) if means else None
        for name, content in files.items():
            if content is None:
                (sweep_dir / name).unlink(missing_ok=True)  # (an earlier sweep's)
                continue
            part = sweep_dir / f".{name}.{os.getpid()}"
            part.write_text(content, newline="")
            os.replace(part, sweep_dir / name)
        _draw(sweep_dir, rows, means)


def _draw(sweep_dir: Path, rows: list[dict[str, Any]], means: list[dict[str, Any]]) -> None:
    """``summary.png``; drawing never fails the sweep: an error is a warning, and an earlier picture (of fewer
    jobs) is removed rather than left to be taken for this one."""
    png = sweep_dir / "summary.png"
    try:
        from vitrel.train.sweep_plot import plot_rows, plot_sweep, save_png

        save_png(plot_sweep(plot_rows(rows, means), sweep_dir.name), png)
    except Exception as e:  # noqa: BLE001  (the tables are written; the picture is a convenience)
        log.warning("sweep summary: could not draw %s (%s: %s); summary.md and summary.csv are written", png,
                    type(e).__name__, e)  # fmt: skip
        png.unlink(missing_ok=True)
    _draw_distances(sweep_dir, distance_groups(rows, means))


def _draw_distances(sweep_dir: Path, groups: list[tuple[str, list[str]]]) -> None:
    """``attention_distance.png``: the finished jobs' mean attention distances in one picture, a colour per setting
    (its seeds' heads together); none (an earlier one removed) when no job wrote ``attention_distance.csv``."""
    png = sweep_dir / "attention_distance.png"
    try:
        from vitrel.train.attention_distance import sweep_distances
        from vitrel.train.sweep_plot import save_png
        from vitrel.viz import plot_attention_distance

        runs = sweep_distances(sweep_dir, groups)
        if not runs:
            png.unlink(missing_ok=True)
            return
        save_png(plot_attention_distance(runs, f"{sweep_dir.name}: mean attention distance per head"), png)
    except Exception as e:  # noqa: BLE001  (the tables are written; the picture is a convenience)
        log.warning("sweep summary: could not draw %s (%s: %s)", png, type(e).__name__, e)
        png.unlink(missing_ok=True)


class TakeRunFolder(Callback):
    """Lock the run folder (:class:`~vitrel.train.rundir.RunLock`) when a single run starts, before Hydra writes its
    ``.hydra/`` record there (``config.yaml``, ``overrides.yaml``, ``hydra.yaml``). ``train()`` holds the same lock
    again while it trains; the lock goes when the run ends. Only the process of global rank 0 takes it (the processes
    Lightning re-launches for DDP run in the folder it owns).

    When another run holds the folder, Hydra (which only warns about a callback's error) is told not to write the
    record (``hydra.output_subdir`` set to null for this run), so the running run's record stays as it was, and
    ``train()`` refuses the run (:class:`~vitrel.train.rundir.RunFolderBusy`). Should that run end in between and
    ``train()`` take the folder, it writes the held-back record itself (:func:`write_held_back_record`).

    The lock goes however the run ends: Hydra calls ``on_run_end`` only after a run that returned or raised an
    ``Exception``, so after a run refused with ``SystemExit`` (``train.py``'s one-line errors) or stopped by Ctrl-C
    it goes when the interpreter exits (``atexit``)."""

    def __init__(self) -> None:
        self.lock: Any = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from omegaconf import read_write

        from vitrel.train.rundir import RunFolderBusy, RunLock, is_launching_process

        global _HELD_BACK
        subdir = config.hydra.get("output_subdir")
        if not is_launching_process() or subdir is None:
            return
        run_dir = Path(str(config.hydra.run.dir)).expanduser().absolute()
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunFolderBusy:
            with read_write(config.hydra):
                config.hydra.output_subdir = None  # not over the running run's record
            _HELD_BACK = (run_dir.resolve(), str(subdir))
            return
        self.lock = lock
        atexit.register(self._release)  # (a run ended by SystemExit or KeyboardInterrupt gets no on_run_end)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._release)
        self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


#: (run folder, output_subdir) of a record :class:`TakeRunFolder` kept Hydra from writing (the folder was busy)
_HELD_BACK: tuple[Path, str] | None = None


def write_held_back_record(run_dir: str | Path, cfg: DictConfig) -> None:
    """Write the ``.hydra/`` record Hydra was kept from writing in ``run_dir`` (see :class:`TakeRunFolder`), once
    ``train()`` holds the folder; nothing when none was held back for it."""
    global _HELD_BACK
    if _HELD_BACK is None or _HELD_BACK[0] != Path(run_dir).resolve():
        return
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import _save_config

    out = Path(run_dir) / _HELD_BACK[1]
    _HELD_BACK = None
    hydra_cfg = HydraConfig.instance().cfg
    _save_config(cfg, "config.yaml", out)
    _save_config(hydra_cfg, "hydra.yaml", out)
    _save_config(hydra_cfg.hydra.overrides.task, "overrides.yaml", out)
