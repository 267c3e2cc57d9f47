"""Hydra callbacks: the run folder taken before Hydra writes there (``python train.py``), and the summary table
printed at the end of a sweep (``python train.py -m ...``).

Each job of a sweep writes ``<sweep dir>/<job>/metrics.json`` (``vitrel.train.run.train``);
:class:`SweepSummary` reads them all when the sweep ends (in the launching process, whatever the
launcher), prints one row per job and writes ``summary.csv`` / ``summary.md`` into the sweep folder (with a ``seed=``
sweep, each setting's mean ± standard deviation over its seeds, also ``summary_seeds.csv``), and draws them as
``summary.png`` (:mod:`vitrel.train.sweep_plot`; a failure to draw is a warning). It also writes them as
each job ends: Hydra's sweeper raises when a job has failed, before the sweep's end; the table so far is then
printed as the process exits, after Hydra's error (likewise after Ctrl-C, where the job it stopped shows as
interrupted and, for Hydra's basic sweeper, the jobs it never started as not run). A sweep run again in its folder
is told from the earlier one by the id each sweep writes (``.sweep_id``, in the sweep's and its jobs' folders).
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import io
import itertools
import json
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from vitrel.train.sweep_plot import ACCURACY  # (the module imports matplotlib only when it draws)

__all__ = [
    "SweepSummary",
    "sweep_folder",
    "sweep_plan",
    "stopped_jobs",
    "TakeRunFolder",
    "write_held_back_record",
    "finished_record",
    "collect_sweep",
    "format_table",
    "format_means",
    "seed_means",
    "split_common",
    "summary_rows",
    "optuna_best",
    "picked_on_test",
    "searched_seed",
]

log = logging.getLogger(__name__)


#: the files :class:`SweepSummary` keeps: the sweep's id (in the sweep folder and in each of its jobs' folders),
#: a failed job's error, and a job's ``metrics.json`` of an earlier run in its folder (moved aside as the job starts)
SWEEP_ID, ERROR, PREVIOUS = ".sweep_id", "error.txt", "metrics.previous.json"
#: the sweep's jobs as its sweeper lays them out (sweep folder), and what stopped a job the sweep ended in (job folder)
PLANNED, STOPPED = ".sweep_jobs.json", "interrupted.txt"
#: the status of a job a stopped sweep never started, and of one it stopped while it ran
NOT_RUN, INTERRUPTED = "not run", "interrupted"
#: the overrides of the run a job's folder held as the job started (its ``last.ckpt``'s sweep job, job folder)
TRAINED_WITH = ".trained_with.json"


def _record_trained_with(job_dir: Path) -> None:
    """Keep the overrides of the sweep job that wrote ``job_dir``'s ``checkpoints/last.ckpt`` (a sweep run again in
    its folder: the job resumes that run) in ``TRAINED_WITH``, read before this job writes its own checkpoints;
    nothing without one, or from a checkpoint that records no sweep job or does not load."""
    (job_dir / TRAINED_WITH).unlink(missing_ok=True)
    ckpt = job_dir / "checkpoints" / "last.ckpt"
    if not ckpt.exists():
        return
    try:
        import torch

        from vitrel.train.resume import SWEEP_JOB

        job = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True).get(SWEEP_JOB)
    except Exception:  # noqa: BLE001  (a damaged or foreign file: train() says so as it resumes)
        return
    if isinstance(job, dict) and job.get("overrides") is not None:
        (job_dir / TRAINED_WITH).write_text(json.dumps({"overrides": [str(o) for o in job["overrides"]]}))


def trained_with(job_dir: Path, data: dict[str, Any], overrides: Sequence[str]) -> str | None:
    """For a job that resumed its folder's run (``data``: its ``metrics.json``), the settings that run was trained
    with where they differ from the job's ``overrides`` (``module.optimizer.lr=0.002``, or ``module.optimizer.lr
    (not set)``), less those a sweep run again may change (``trainer.max_epochs``, ``logger``, ...); None when the
    job did not resume, or resumed a run of its own settings. The resumed run keeps the checkpoint's weights,
    optimizer and rates: the row's figures are of those settings, not of the job's."""
    if not (data.get("resumes") or data.get("resumed_finished")) or not (job_dir / TRAINED_WITH).exists():
        return None
    from vitrel.train.resume import MAY_DIFFER
    from vitrel.train.utils import override_key

    theirs = json.loads((job_dir / TRAINED_WITH).read_text()).get("overrides") or []
    a, b = {override_key(o): o for o in theirs}, {override_key(o): o for o in overrides}
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k not in MAY_DIFFER)
    return " ".join(a.get(k, f"{k} (not set)") for k in keys) or None


def finished_record(run_dir: str | Path, global_step: int) -> dict[str, Any] | None:
    """The ``metrics.json`` record of the finished run that wrote the checkpoint of ``global_step`` in ``run_dir``:
    the folder's ``metrics.json`` (a single run run again in its folder), else its ``metrics.previous.json`` (a sweep
    run again: :class:`SweepSummary` moved it aside as the job started); None when neither is that run's (a run
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


def _read(p: Path) -> str | None:
    return p.read_text().strip() if p.exists() else None


def _job_key(p: Path) -> tuple[int, str]:
    return (int(p.name), p.name) if p.name.isdigit() else (10**9, p.name)


#: what a job's columns are: the heading of the summary
ABOUT = (
    "test/*: the last weights (the EMA copy with module/ema=default, unless module.ema_eval=false) on the test split "
    "(test_images: scored / split size); params: the model's parameters; gflops: its forward on one image at its "
    "img_size, 10^9 FLOPs (2 per multiply-add); "
    "val/*: the last validation (the test split when data.val_fraction=0; 'no validation ran': the job ended before "
    "its first, e.g. trainer.max_steps within the first epoch); accuracies as fractions"
)


def collect_sweep(sweep_dir: str | Path, metrics: Sequence[str]) -> list[dict[str, Any]]:
    """One row per job folder of ``sweep_dir`` (those with a ``.hydra`` folder or a ``metrics.json``).

    A job folder whose ``.sweep_id`` is not the sweep folder's (:class:`SweepSummary` writes them as the sweep and
    each job start) is of an earlier sweep in the same folder, not yet run again by this one: its row has
    ``earlier=True``. A ``metrics.json`` of other overrides than the job's ``.hydra/overrides.yaml`` is an earlier
    run's: the job shows as failed. A failed job's error (written as the job ends) is the row's ``error``; a job the
    sweep stopped while it ran (Ctrl-C, SIGTERM: its ``interrupted.txt``) is ``interrupted``, that text its ``error``.
    """
    sweep_dir = Path(sweep_dir)
    sweep_id = _read(sweep_dir / SWEEP_ID)
    rows = []
    for d in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=_job_key):
        mfile, ofile = d / "metrics.json", d / ".hydra" / "overrides.yaml"
        if not mfile.exists() and not (d / ".hydra").exists():
            continue
        row: dict[str, Any] = {"job": d.name, "earlier": sweep_id is not None and _read(d / SWEEP_ID) != sweep_id}
        data = json.loads(mfile.read_text()) if mfile.exists() else None
        overrides = [str(o) for o in OmegaConf.load(ofile)] if ofile.exists() else None
        if data is not None and overrides is not None and list(data.get("overrides", [])) != overrides:
            data = None  # an earlier run's
        row["overrides"] = overrides if overrides is not None else list((data or {}).get("overrides", []))
        if data is not None:
            row["status"] = data.get("status", "?")
            for m in metrics:
                row[m] = data.get("metrics", {}).get(m)
            row["params"], row["gflops"] = data.get("params"), data.get("gflops")
            row["epochs"], row["val_runs"] = data.get("epochs"), data.get("val_runs")
            row["wall_s"] = data.get("wall_s")
            row["test_images"], row["test_split_images"] = data.get("test_images"), data.get("test_split_images")
            row["trained_with"] = trained_with(d, data, row["overrides"])
        elif (d / STOPPED).exists() and not (d / ERROR).exists():
            row["status"], row["error"] = INTERRUPTED, _read(d / STOPPED)
        else:
            row["error"] = _read(d / ERROR)
            row["status"] = f"failed ({row['error'].split(':', 1)[0]})" if row["error"] else "failed (no metrics.json)"
        rows.append(row)
    return rows


#: the ``_target_`` of Hydra's own sweeper (``hydra/sweeper=basic``), whose jobs are known before they run
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def planned_jobs(config: DictConfig) -> list[list[str]] | None:
    """Each job's overrides, in job-number order, as Hydra's basic sweeper will run them (its ``params`` and the
    command line's sweep overrides, their product); None for another sweeper (its jobs are not known in advance) or
    job folders not named by job number (``hydra.sweep.subdir``)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.get("sweeper") or {}
    subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
    if sweeper.get("_target_") != BASIC_SWEEPER or subdir != "${hydra.job.num}":
        return None
    args = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    args += [str(o) for o in config.hydra.overrides.task]
    loader = GlobalHydra.instance().config_loader() if GlobalHydra.instance().is_initialized() else None
    choices: dict[str, list[str]] = {}  # the basic sweeper's rule: a key's last override wins, keys in first order
    for o in OverridesParser.create(config_loader=loader).parse_overrides(args):
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise ValueError(f"{key}: the basic sweeper takes discrete sweeps only")
        values = o.sweep_string_iterator() if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices[key] = [f"{key}={v}" for v in values]
    return [list(job) for job in itertools.product(*choices.values())]


def _searching(config: DictConfig) -> bool:
    """Whether the sweep's sweeper picks its jobs from their returned values (Optuna's, any but Hydra's basic one)."""
    target = (config.hydra.get("sweeper") or {}).get("_target_")
    return bool(target) and target != BASIC_SWEEPER


def searched_seed(config: DictConfig) -> str | None:
    """The ``seed`` sweep (as written: ``seed=0,1,2``) of a search sweeper's sweep (:func:`_searching`), from the
    command line or ``hydra.sweeper.params``; None without one. Optuna's sweeper makes any such list a categorical
    search dimension: its best trial would be the luckiest seed, not a setting's mean over seeds."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not _searching(config):
        return None
    args = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    args += [str(o) for o in config.hydra.overrides.task]
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:  # noqa: BLE001  (Hydra refuses such an override itself, with its own message)
        return None
    return next((a for a, o in zip(args, parsed) if _is_seed(o.get_key_element()) and o.is_sweep_override()), None)


def picked_on_test(config: DictConfig) -> str | None:
    """Why a search sweeper's best trial (:func:`_searching`) is picked on the test split: ``optimized_metric`` is a
    ``test/`` metric, or a ``val/`` one with ``data.val_fraction=0`` (the data modules then validate on the test
    split); None otherwise."""
    target = str(config.get("optimized_metric") or "")
    if not _searching(config) or not target:
        return None
    if target.startswith("test/"):
        return f"optimized_metric={target} is a test split score"
    data = config.get("data") or {}
    if target.startswith("val/") and "val_fraction" in data and not data.get("val_fraction"):
        return f"optimized_metric={target} with data.val_fraction=0, which validates on the test split"
    return None


def _sweeper_name(config: DictConfig) -> str:
    """The sweeper's class name, less ``Sweeper`` (``Optuna``)."""
    target = str((config.hydra.get("sweeper") or {}).get("_target_", ""))
    return target.rsplit(".", 1)[-1].removesuffix("Sweeper") or "sweep's"


def sweep_folder(hydra_cfg: Any) -> Path:
    """The sweep folder, ``hydra.sweep.dir`` of ``hydra_cfg`` (the ``hydra`` node) from the launch folder (Hydra's
    ``to_absolute_path``): a job under ``hydra.job.chdir=true`` runs in its own folder, where the default
    ``outputs/...`` would name another."""
    return Path(to_absolute_path(str(hydra_cfg.sweep.dir)))


def sweep_plan(sweep_dir: Path) -> list[list[str]] | None:
    """Each job's overrides, as this sweep's ``SweepSummary`` recorded them when it started (:func:`planned_jobs`);
    None for a sweeper other than Hydra's basic one, or a record of an earlier sweep in the same folder."""
    return _planned(sweep_dir, _read(sweep_dir / SWEEP_ID))


def _planned(sweep_dir: Path, sweep_id: str | None) -> list[list[str]] | None:
    try:
        data = json.loads((sweep_dir / PLANNED).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data["jobs"] if isinstance(data, dict) and data.get("sweep_id") == sweep_id else None


def split_common(rows: list[dict[str, Any]]) -> list[str]:
    """Overrides shared by every job; each row's ``overrides`` becomes the string of the others."""
    lists = [r["overrides"] for r in rows]
    common = [o for o in lists[0] if all(o in other for other in lists[1:])] if lists else []
    for r in rows:
        r["overrides"] = " ".join(o for o in r["overrides"] if o not in common) or "(none)"
    return common


def _is_seed(override: str) -> bool:
    return override.split("=", 1)[0].lstrip("+~") == "seed"


def seed_means(rows: list[dict[str, Any]], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of jobs that differ only in ``seed=`` as one row each: ``n`` finished of ``jobs``, the mean and the
    sample standard deviation of each metric over the finished ones (``rows`` with their override lists, before
    :func:`split_common`; ``members``: the setting's job folders). Empty when the sweep does not vary the seed."""
    if len({tuple(o for o in r["overrides"] if _is_seed(o)) for r in rows}) < 2:
        return []
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(o for o in r["overrides"] if not _is_seed(o)), []).append(r)
    out = []
    for key, members in groups.items():
        done = [r for r in members if r["status"] == "finished"]
        row: dict[str, Any] = {"overrides": list(key), "n": len(done), "jobs": len(members)}
        row["members"] = [r["job"] for r in members]
        for m in metrics:
            vals = [float(r[m]) for r in done if r.get(m) is not None]
            mean = sum(vals) / len(vals) if vals else None
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else None
            row[f"{m} mean"], row[f"{m} std"] = mean, std
        out.append(row)
    return out


def _cell(c: str, v: Any) -> str:
    if v is None:
        return "-"
    if c == "params":  # (timm's param_count: millions, or thousands for the tiny models of tests and studies)
        return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k"
    if c == "gflops":  # (4 digits: schemes that add work to the same network differ in the third or fourth)
        return f"{v:.4g}"
    if isinstance(v, float):
        return f"{v:.0f}" if c == "wall_s" else f"{v:.4f}"
    return str(v)


def _fixed_width(cols: Sequence[str], table: list[list[str]]) -> str:
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    return "\n".join(lines)


def _test_images(r: dict[str, Any]) -> Any:
    n, of = r.get("test_images"), r.get("test_split_images")
    return f"{n}/{of}" if n is not None and of is not None and n != of else (of if of is not None else n)


#: a ``val/*`` cell of a job whose fit ran no validation (its ``metrics.json``'s ``val_runs`` is 0)
NO_VAL = "no validation ran"


def format_table(rows: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """Plain fixed-width table (readable in any log)."""
    cols = ["job", "overrides", *metrics, "params", "gflops", "epochs", "wall_s", "test_images", "status"]
    shown = [dict(r, test_images=_test_images(r)) for r in rows]
    for r in shown:  # (a job that resumed a run of other settings: its figures are that run's, said below the table)
        r["status"] = f"{r['status']} *" if r.get("trained_with") else r.get("status")
    for r in shown:  # (an empty val/* cell of a job that ran no validation: said, not left blank)
        r.update({m: NO_VAL for m in metrics if m.startswith("val/") and r.get(m) is None and r.get("val_runs") == 0})
    return _fixed_width(cols, [[_cell(c, r.get(c)) for c in cols] for r in shown])


def format_means(means: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """The :func:`seed_means` table: ``mean ± std`` per metric, ``n`` finished seeds (``of`` jobs)."""

    def pm(r: dict[str, Any], m: str) -> str:
        mean, std = r[f"{m} mean"], r[f"{m} std"]
        return "-" if mean is None else f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "")

    cols = ["overrides", "seeds", *metrics]
    table = [[r["overrides"], f"{r['n']}" + (f" of {r['jobs']}" if r["n"] != r["jobs"] else "")] for r in means]
    for t, r in zip(table, means):
        t += [pm(r, m) for m in metrics]
    return _fixed_width(cols, table)


def stopped_jobs(sweep_dir: Path) -> list[Path]:
    """The job folders this sweep started (its ``.sweep_id``) that neither ended (no ``metrics.json``, no error) nor
    still run: no run lock, or that of a process gone or of this one. Hydra's basic launcher runs the jobs in this
    process; joblib's and submitit's in others, whose job ends without a word when a signal stops it (Lightning
    leaves through ``SystemExit``, which Hydra does not catch) or the launcher kills it. A job whose lock is of a live
    process, or of one on another host (a SLURM job that goes on after its launcher), is left as it is."""
    from vitrel.train.rundir import RunLock

    sweep_id, out = _read(sweep_dir / SWEEP_ID), []
    for job in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=_job_key):
        if sweep_id is None or _read(job / SWEEP_ID) != sweep_id:
            continue
        if any((job / name).exists() for name in ("metrics.json", ERROR, STOPPED)):
            continue
        owner = RunLock(job).read()
        alive = owner.alive() if owner is not None else False
        if alive is False or (alive and owner.pid == os.getpid()):
            out.append(job)
    return out


class SweepSummary(Callback):
    """Print (and save) a table of every job's final metrics when a multirun ends; with a ``seed=`` sweep, a second
    table of each setting's mean ± standard deviation over its seeds."""

    def __init__(self, metrics: Sequence[str] = ("test/acc1", "test/acc5", "test/loss", "val/acc1")) -> None:
        self.metrics = list(metrics)
        self._unended: Path | None = None  # the sweep folder from the sweep's start to its end

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A new id for the sweep folder: job folders of an earlier sweep there (which this sweep has not run again)
        keep theirs and are left out of the summary. Until the sweep's end, the process prints the table so far
        when it exits (:meth:`_at_exit`)."""
        if seed := searched_seed(config):  # (SystemExit: Hydra turns a callback's Exception into a warning)
            raise SystemExit(
                f"{Path(sys.argv[0]).name}: ConfigError: {seed}: the {_sweeper_name(config)} sweeper would search the "
                "seed as a hyperparameter and report the luckiest one as its best trial; search with one seed, then "
                "run the chosen values over seeds (-m ... seed=0,1,2) for their mean"
            )
        if why := picked_on_test(config):
            log.warning("sweep: %s: the best trial is chosen on the test split, so its test/* overestimate new data; "
                        "search on a held-out validation split (data.val_fraction=0.1)", why)  # fmt: skip
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
        sweep_id = _read(sweep_folder(config.hydra) / SWEEP_ID)
        if sweep_id is not None:
            (job_dir / SWEEP_ID).write_text(sweep_id + "\n")
        if (job_dir / "metrics.json").exists():
            os.replace(job_dir / "metrics.json", job_dir / PREVIOUS)
        _record_trained_with(job_dir)
        (job_dir / ERROR).unlink(missing_ok=True)
        (job_dir / STOPPED).unlink(missing_ok=True)

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
            for job in stopped_jobs(sweep_dir):  # Ctrl-C, SIGTERM: no on_job_end
                ckpt = job / "checkpoints" / "last.ckpt"
                kept = f"{ckpt.relative_to(job)} kept" if ckpt.exists() else "no last.ckpt"
                (job / STOPPED).write_text(f"the sweep stopped while the job ran (Ctrl-C, SIGTERM, exit); {kept}\n")
            if summary_rows(sweep_dir, self.metrics) is None:  # (Hydra refused an override before the first job)
                print("\nThe sweep stopped before any job ran (its error is above): no table", flush=True)
                return
            print("\nThe sweep stopped before its end (a failed job or an interruption): its jobs so far", flush=True)
            self._summarize(sweep_dir, show=True, stopped=True)
        except Exception as e:  # noqa: BLE001
            print(f"sweep summary: could not print the table of {sweep_dir} ({type(e).__name__}: {e})", flush=True)

    def _summarize(self, sweep_dir: Path, show: bool, stopped: bool = False, config: DictConfig | None = None) -> None:
        """Write ``summary.md`` / ``summary.csv`` (and ``summary_seeds.csv`` for a seed sweep) of the job folders in
        ``sweep_dir`` (each file replaced whole: jobs of a parallel launcher end at once) and, with ``show``, print
        the tables; at the sweep's end (``config``), an Optuna study's best trial below them (:func:`optuna_best`)."""
        if not sweep_dir.exists():
            return
        summary = summary_rows(sweep_dir, self.metrics)
        if summary is None:
            return
        rows, means, common, earlier = summary
        head = f"Sweep summary ({len(rows)} jobs, {sweep_dir})" + (f"; all jobs: {' '.join(common)}" if common else "")
        head += f"\n{ABOUT}"
        if earlier:
            head += f"\njob folders {', '.join(earlier)}: of an earlier sweep in this folder, left out"
        text = f"{head}\n\n{format_table(rows, self.metrics)}\n"
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
            text += f"\nmean ± standard deviation over seeds (finished jobs):\n\n{format_means(means, self.metrics)}\n"
        best = optuna_best(config, sweep_dir, rows, common) if config is not None else None
        if best:
            text += f"\n{best}\n"
        if show:
            left = [r["job"] for r in rows if r["status"] in (INTERRUPTED, NOT_RUN)]
            if left and stopped:
                text += (f"\njobs {', '.join(left)} not finished: run the same command again with "
                         f"hydra.sweep.dir={sweep_dir} to finish them (an interrupted job resumes from its last.ckpt, "
                         "a finished one only tests again and keeps its row)\n")  # fmt: skip
            print(f"\n{text}", flush=True)
        fields = ["job", "overrides", *self.metrics, "params", "gflops", "epochs", "val_runs", "wall_s", "test_images"]
        fields.append("test_split_images")
        files = {"summary.md": text, "summary.csv": _csv([*fields, "status", "error", "trained_with"], rows)}
        mfields = ["overrides", "n", "jobs", *(f"{m} {s}" for m in self.metrics for s in ("mean", "std"))]
        files["summary_seeds.csv"] = _csv(mfields, means) if means else None
        for name, content in files.items():
            if content is None:
                (sweep_dir / name).unlink(missing_ok=True)  # (an earlier sweep's)
                continue
            part = sweep_dir / f".{name}.{os.getpid()}"
            part.write_text(content, newline="")
            os.replace(part, sweep_dir / name)
        _draw(sweep_dir, rows, means)


def optuna_best(config: DictConfig, sweep_dir: Path, rows: list[dict[str, Any]], common: list[str]) -> str | None:
    """The best trial of the sweep's Optuna study, as Hydra's Optuna sweeper wrote it to the sweep folder's
    ``optimization_results.yaml`` as the sweep ended, named by its job (``rows`` and ``common``:
    :func:`summary_rows`'); None for another sweeper, a study of several objectives, or no job of its values."""
    sweeper = config.hydra.get("sweeper") or {}
    path = sweep_dir / "optimization_results.yaml"
    if "optuna" not in str(sweeper.get("_target_", "")).lower() or not path.exists():
        return None
    result = OmegaConf.to_container(OmegaConf.load(path))
    if not isinstance(result, dict) or "best_params" not in result:
        return None
    params = [f"{k}={v}" for k, v in result["best_params"].items()]
    job = next((r["job"] for r in rows if set(params) <= {*r["overrides"].split(), *common}), None)
    if job is None:
        return None
    direction = getattr(sweeper.get("direction"), "name", sweeper.get("direction"))
    line = (
        f"Optuna's best trial ({direction} {config.get('optimized_metric')}): job {job}, {result['best_value']:.4f}, "
        + (" ".join(params) or "(no parameters)")
    )
    if why := picked_on_test(config):
        line += (f"\nchosen on the test split ({why}): job {job}'s test/* overestimate new data; search on a "
                 "held-out validation split (data.val_fraction=0.1)")  # fmt: skip
    return line


def summary_rows(
    sweep_dir: Path, metrics: Sequence[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], list[str]] | None:
    """The summary of ``sweep_dir``'s jobs: the rows of this sweep's jobs (:func:`collect_sweep`, each ``overrides``
    the string of those not shared), the :func:`seed_means` rows, the shared overrides and the job folders of an
    earlier sweep (left out); None when no job of this sweep has a folder. The rows and means also hold the
    accuracies the picture shows (:data:`~vitrel.train.sweep_plot.ACCURACY`) when ``metrics`` does not name them."""
    wanted = [*metrics, *(m for m in ACCURACY if m not in metrics)]
    rows = collect_sweep(sweep_dir, wanted)
    earlier = [r["job"] for r in rows if r["earlier"]]
    rows = [r for r in rows if not r["earlier"]]
    if not rows:
        return None
    planned = sweep_plan(sweep_dir)
    if planned is not None:  # the jobs this sweep has not started (yet): rows saying so, with their overrides
        have = {r["job"] for r in rows}
        rows += [{"job": str(i), "earlier": False, "overrides": [str(o) for o in job], "status": NOT_RUN}
                 for i, job in enumerate(planned) if str(i) not in have]  # fmt: skip
        rows.sort(key=lambda r: _job_key(Path(r["job"])))
    means = seed_means(rows, wanted)
    common = split_common(rows)
    for r in means:
        r["overrides"] = " ".join(o for o in r["overrides"] if o not in common) or "(none)"
    return rows, means, common, earlier


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


def distance_groups(rows: list[dict[str, Any]], means: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The settings the sweep's attention-distance picture draws, each ``(label, finished job folders)``: a seed
    sweep's :func:`seed_means` settings (their seeds together), else one per job; the rows' and means' ``overrides``
    are :func:`summary_rows`' strings."""
    finished = {r["job"] for r in rows if r.get("status") == "finished"}
    groups = [(m["overrides"], m["members"]) for m in means] if means else [(r["overrides"], [r["job"]]) for r in rows]
    return [(label, [j for j in jobs if j in finished]) for label, jobs in groups]


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


def _csv(fields: Sequence[str], rows: list[dict[str, Any]]) -> str:
    with io.StringIO(newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: r.get(k) for k in fields} for r in rows)
        return f.getvalue()


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
