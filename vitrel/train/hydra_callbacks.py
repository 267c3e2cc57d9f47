"""Hydra callbacks: the run folder taken before Hydra writes there (``python train.py``), and the summary table
printed at the end of a sweep (``python train.py -m ...``).

Each job of a sweep writes ``<sweep dir>/<job>/metrics.json`` (``vitrel.train.run.train``);
:class:`SweepSummary` reads them all when the sweep ends (in the launching process, whatever the
launcher), prints one row per job and writes ``summary.csv`` / ``summary.md`` into the sweep folder. It also
writes the two files as each job ends: Hydra's sweeper raises when a job has failed, before the sweep's end.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

__all__ = ["SweepSummary", "TakeRunFolder", "write_held_back_record", "collect_sweep", "format_table", "split_common"]

log = logging.getLogger(__name__)


def _job_key(p: Path) -> tuple[int, str]:
    return (int(p.name), p.name) if p.name.isdigit() else (10**9, p.name)


def collect_sweep(sweep_dir: str | Path, metrics: Sequence[str]) -> list[dict[str, Any]]:
    """One row per job folder of ``sweep_dir`` (those with a ``.hydra`` folder or a ``metrics.json``)."""
    rows = []
    for d in sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir()), key=_job_key):
        mfile = d / "metrics.json"
        if not mfile.exists() and not (d / ".hydra").exists():
            continue
        row: dict[str, Any] = {"job": d.name}
        if mfile.exists():
            data = json.loads(mfile.read_text())
            row["overrides"] = list(data.get("overrides", []))
            row["status"] = data.get("status", "?")
            for m in metrics:
                row[m] = data.get("metrics", {}).get(m)
            row["epochs"] = data.get("epochs")
            row["wall_s"] = data.get("wall_s")
        else:
            ov = d / ".hydra" / "overrides.yaml"
            row["overrides"] = [str(o) for o in OmegaConf.load(ov)] if ov.exists() else []
            row["status"] = "failed (no metrics.json)"
        rows.append(row)
    return rows


def split_common(rows: list[dict[str, Any]]) -> list[str]:
    """Overrides shared by every job; each row's ``overrides`` becomes the string of the others."""
    lists = [r["overrides"] for r in rows]
    common = [o for o in lists[0] if all(o in other for other in lists[1:])] if lists else []
    for r in rows:
        r["overrides"] = " ".join(o for o in r["overrides"] if o not in common) or "(none)"
    return common


def format_table(rows: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """Plain fixed-width table (readable in any log)."""
    cols = ["job", "overrides", *metrics, "epochs", "wall_s", "status"]

    def cell(c: str, v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if c == "wall_s" else f"{v:.4f}"
        return str(v)

    table = [[cell(c, r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(t, widths)) for t in table]
    return "\n".join(lines)


class SweepSummary(Callback):
    """Print (and save) a table of every job's final metrics when a multirun ends."""

    def __init__(self, metrics: Sequence[str] = ("test/acc1", "test/acc5", "test/loss", "val/acc1")) -> None:
        self.metrics = list(metrics)

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        """The summary so far, written as each job of a sweep ends: Hydra's sweeper raises when a job has failed
        (after the rest of its batch has run), and the sweep's end, :meth:`on_multirun_end`, never comes."""
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            self._summarize(Path(str(config.hydra.sweep.dir)), show=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._summarize(Path(str(config.hydra.sweep.dir)), show=True)

    def _summarize(self, sweep_dir: Path, show: bool) -> None:
        """Write ``summary.md`` / ``summary.csv`` of the job folders in ``sweep_dir`` (each file replaced whole: jobs
        of a parallel launcher end at once) and, with ``show``, print the table."""
        if not sweep_dir.exists():
            return
        rows = collect_sweep(sweep_dir, self.metrics)
        if not rows:
            return
        common = split_common(rows)
        table = format_table(rows, self.metrics)
        head = f"Sweep summary ({len(rows)} jobs, {sweep_dir})" + (f"; all jobs: {' '.join(common)}" if common else "")
        if show:
            print(f"\n{head}:\n{table}\n", flush=True)
        fields = ["job", "overrides", *self.metrics, "epochs", "wall_s", "status"]
        with io.StringIO(newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows({k: r.get(k) for k in fields} for r in rows)
            text = f.getvalue()
        for name, content in (("summary.md", f"{head}\n\n{table}\n"), ("summary.csv", text)):
            part = sweep_dir / f".{name}.{os.getpid()}"
            part.write_text(content, newline="")
            os.replace(part, sweep_dir / name)


class TakeRunFolder(Callback):
    """Lock the run folder (:class:`~vitrel.train.rundir.RunLock`) when a single run starts, before Hydra writes its
    ``.hydra/`` record there (``config.yaml``, ``overrides.yaml``, ``hydra.yaml``). ``train()`` holds the same lock
    again while it trains; the lock goes when the run ends. Only the process of global rank 0 takes it (the processes
    Lightning re-launches for DDP run in the folder it owns).

    When another run holds the folder, Hydra (which only warns about a callback's error) is told not to write the
    record (``hydra.output_subdir`` set to null for this run), so the running run's record stays as it was, and
    ``train()`` refuses the run (:class:`~vitrel.train.rundir.RunFolderBusy`). Should that run end in between and
    ``train()`` take the folder, it writes the held-back record itself (:func:`write_held_back_record`)."""

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

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
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
