"""The sweep summary's tables, from the job folders of a sweep: one row per job (:func:`collect_sweep`,
:func:`summary_rows`), with a ``seed=`` sweep one row per setting of its seeds' mean ± standard deviation
(:func:`seed_means`), and their text: fixed-width tables for the console and ``summary.md`` (:func:`format_table`,
:func:`format_means`), CSV for ``summary.csv`` / ``summary_seeds.csv`` (:func:`csv_text`)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from vitrel.train.sweep_files import ERROR, STOPPED, SWEEP_ID, job_order, read_note, sweep_plan
from vitrel.train.sweep_plot import ACCURACY  # (the module imports matplotlib only when it draws)
from vitrel.train.sweep_rerun import mark_other_settings, swept_settings, trained_with
from vitrel.train.sweepers import is_seed
from vitrel.train.utils import override_key

__all__ = [
    "ABOUT",
    "EVAL_ABOUT",
    "INTERRUPTED",
    "NOT_RUN",
    "NO_VAL",
    "about",
    "collect_sweep",
    "csv_fields",
    "csv_text",
    "distance_groups",
    "format_means",
    "format_table",
    "seed_means",
    "split_common",
    "summary_rows",
]

#: the status of a job a stopped sweep never started, and of one it stopped while it ran
NOT_RUN, INTERRUPTED = "not run", "interrupted"


#: what a job's columns are: the heading of the summary
ABOUT = (
    "test/*: the last weights (the EMA copy with module/ema=default, unless module.ema_eval=false) on the test split "
    "(test_images: scored / split size); params: the model's parameters; gflops: its forward on one image at its "
    "img_size, 10^9 FLOPs (2 per multiply-add); "
    "val/*: the last validation (the test split when data.val_fraction=0; 'no validation ran': the job ended before "
    "its first, e.g. trainer.max_steps within the first epoch); accuracies as fractions"
)
#: the heading of an ``eval.py -m`` sweep's summary (each job's ``eval_metrics.json``)
EVAL_ABOUT = (
    "test/*, val/*: the checkpoint's scores on the split the job scored (split=), at its data.img_size (images: "
    "scored / split size); gflops: its forward on one image at the size scored, 10^9 FLOPs (2 per multiply-add); "
    "accuracies as fractions"
)
#: the columns after the metrics, of a training sweep (``metrics.json``) and of an ``eval.py`` one
_TRAIN_COLUMNS, _EVAL_COLUMNS = ("params", "gflops", "epochs", "wall_s", "test_images"), ("gflops", "wall_s", "images")


def _is_train(record: str) -> bool:
    return record == "metrics.json"


def about(record: str = "metrics.json") -> str:
    """What a summary's columns are, for the jobs' ``record``: :data:`ABOUT` (train.py), :data:`EVAL_ABOUT`."""
    return ABOUT if _is_train(record) else EVAL_ABOUT


def csv_fields(metrics: Sequence[str], record: str = "metrics.json") -> list[str]:
    """The columns of ``summary.csv`` for the jobs' ``record``."""
    if _is_train(record):
        fields = ["job", "overrides", *metrics, "params", "gflops", "epochs", "val_runs", "wall_s", "test_images"]
        return [*fields, "test_split_images", "status", "error", "trained_with"]
    return ["job", "overrides", "trained", *metrics, "gflops", "wall_s", "images", "split_images", "status", "error"]


def collect_sweep(sweep_dir: str | Path, metrics: Sequence[str], record: str = "metrics.json") -> list[dict[str, Any]]:
    """One row per job folder of ``sweep_dir`` (those with a ``.hydra`` folder or a ``metrics.json``; ``record``:
    the file each job writes, ``eval_metrics.json`` for ``eval.py -m``, whose rows hold ``images`` and
    ``split_images``, the images it scored of its split's, and ``trained``, the settings a training sweep varied for
    the checkpoint scored).

    A job folder whose ``.sweep_id`` is not the sweep folder's (:class:`~vitrel.train.hydra_callbacks.SweepSummary`
    writes them as the sweep and each job start) is of an earlier sweep in the same folder, not yet run again by this
    one: its row has ``earlier=True``. A ``metrics.json`` of other overrides than the job's ``.hydra/overrides.yaml``
    is an earlier run's: the job shows as failed. A failed job's error (written as the job ends) is the row's
    ``error``, and its status ``failed (...)`` also where it raised after writing its ``metrics.json`` (whose figures
    the row keeps; it enters no mean); a job the sweep stopped while it ran (Ctrl-C, SIGTERM: its ``interrupted.txt``)
    is ``interrupted``, that text its ``error``.
    """
    sweep_dir = Path(sweep_dir)
    sweep_id = read_note(sweep_dir / SWEEP_ID)
    rows = []
    for d in sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=job_order):
        mfile, ofile = d / record, d / ".hydra" / "overrides.yaml"
        if not mfile.exists() and not (d / ".hydra").exists():
            continue
        row: dict[str, Any] = {"job": d.name, "earlier": sweep_id is not None and read_note(d / SWEEP_ID) != sweep_id}
        data = json.loads(mfile.read_text()) if mfile.exists() else None
        overrides = [str(o) for o in OmegaConf.load(ofile)] if ofile.exists() else None
        if data is not None and overrides is not None and list(data.get("overrides", [])) != overrides:
            data = None  # an earlier run's
        row["overrides"] = overrides if overrides is not None else list((data or {}).get("overrides", []))
        error = read_note(d / ERROR)  # (the job's, also one raised after it wrote its metrics.json)
        if data is not None:
            row["status"] = data.get("status", "?")
            for m in metrics:
                row[m] = data.get("metrics", {}).get(m)
            row["gflops"], row["wall_s"] = data.get("gflops"), data.get("wall_s")
            if not _is_train(record):  # (eval.py's record: the images of its split= it scored)
                row["images"], row["split_images"] = data.get("num_images"), data.get("split_images")
                row["trained"] = data.get("trained")  # (a sweep job's checkpoint: the settings its sweep varied)
            else:
                row["params"], row["epochs"] = data.get("params"), data.get("epochs")
                row["val_runs"] = data.get("val_runs")
                row["test_images"], row["test_split_images"] = data.get("test_images"), data.get("test_split_images")
                row["trained_with"] = trained_with(d, data, row["overrides"])
        if error:
            row["status"], row["error"] = f"failed ({error.split(':', 1)[0]})", error
        elif data is None and (d / STOPPED).exists():
            row["status"], row["error"] = INTERRUPTED, read_note(d / STOPPED)
        elif data is None:
            row["status"], row["error"] = f"failed (no {record})", error
        rows.append(row)
    return rows


def summary_rows(
    sweep_dir: Path, metrics: Sequence[str], record: str = "metrics.json"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], list[str]] | None:
    """The summary of ``sweep_dir``'s jobs: the rows of this sweep's jobs (:func:`collect_sweep`, each ``overrides``
    the string of those not shared), the :func:`seed_means` rows, the shared overrides and the job folders of an
    earlier sweep (left out); None when no job of this sweep has a folder. The rows and means also hold the
    accuracies the picture shows (:data:`~vitrel.train.sweep_plot.ACCURACY`) when ``metrics`` does not name them."""
    wanted = [*metrics, *(m for m in ACCURACY if m not in metrics)]
    rows = collect_sweep(sweep_dir, wanted, record)
    earlier = [r["job"] for r in rows if r["earlier"]]
    rows = [r for r in rows if not r["earlier"]]
    if not rows:
        return None
    planned = sweep_plan(sweep_dir)
    if planned is not None:  # the jobs this sweep has not started (yet): rows saying so, with their overrides
        have = {r["job"] for r in rows}
        rows += [{"job": str(i), "earlier": False, "overrides": [str(o) for o in job], "status": NOT_RUN}
                 for i, job in enumerate(planned) if str(i) not in have]  # fmt: skip
        rows.sort(key=lambda r: job_order(Path(r["job"])))
    if not _is_train(record):  # (eval.py -m over a seed sweep's checkpoints: the seeds are in what each trained)
        for r in rows:
            r["setting"] = _eval_setting(r)
    means = seed_means(rows, wanted)
    common = split_common(rows)
    for r in means:
        r["overrides"] = _own_overrides(r["overrides"], common)
    return rows, means, common, earlier


def _eval_setting(row: dict[str, Any]) -> list[str]:
    """What an ``eval.py -m`` job scored, as overrides: its own less ``ckpt_path``, and the settings the training sweep
    varied for the checkpoint (``trained``: ``pos=rel2d_full seed=1``), which :func:`seed_means` groups by; for a job
    whose checkpoint records no sweep job (a single run, an export), or that failed before saying, its own overrides."""
    trained = row.get("trained")
    if row.get("status") != "finished" and trained is None:  # (failed: its eval_metrics.json, if any, is not read)
        trained = _trained_of(row["overrides"])
    if trained is None:
        return list(row["overrides"])
    return [*trained.split(" "), *(o for o in row["overrides"] if override_key(o) != "ckpt_path")]


def _trained_of(overrides: list[str]) -> str | None:
    """:func:`~vitrel.train.sweep_rerun.swept_settings` of the checkpoint a failed ``eval.py`` job was given (its
    ``ckpt_path=``, a run folder's taken as eval.py takes it); None where it cannot be read."""
    from vitrel.models.ckpt_files import run_checkpoint

    given = [o.split("=", 1)[1] for o in overrides if override_key(o) == "ckpt_path"]
    try:
        return swept_settings(run_checkpoint(Path(given[0]).expanduser(), say=False)) if given else None
    except Exception:  # noqa: BLE001  (a missing or damaged file: the job's own error says so)
        return None


def _own_overrides(overrides: list[str], common: list[str]) -> str:
    """A row's overrides not shared by every job; a sweep of one setting (``pos=rope2d_mixed seed=0,1``): the shared
    ones, which are then that setting's (not "(none)", which read as ``pos=none``); none at all: ``(defaults)``."""
    return " ".join(o for o in overrides if o not in common) or " ".join(common) or "(defaults)"


def split_common(rows: list[dict[str, Any]]) -> list[str]:
    """Overrides shared by every job; each row's ``overrides`` becomes the string of the others."""
    lists = [r["overrides"] for r in rows]
    common = [o for o in lists[0] if all(o in other for other in lists[1:])] if lists else []
    for r in rows:
        r["overrides"] = _own_overrides(r["overrides"], common)
    return common


def seed_means(rows: list[dict[str, Any]], metrics: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of jobs that differ only in ``seed=`` as one row each: ``n`` finished of ``jobs``, the mean and the
    sample standard deviation of each metric over the finished ones (``rows`` with their override lists, before
    :func:`split_common`, grouped by their ``setting`` where they have one: :func:`_eval_setting`; ``members``: the
    setting's job folders; ``trained_with``: the finished ones' marks of a resumed run of other settings,
    :func:`~vitrel.train.sweep_rerun.trained_with`, else None). Empty when the sweep does not vary the seed."""
    settings = [r.get("setting", r["overrides"]) for r in rows]
    if len({tuple(o for o in s if is_seed(o)) for s in settings}) < 2:
        return []
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r, s in zip(rows, settings):
        groups.setdefault(tuple(o for o in s if not is_seed(o)), []).append(r)
    out = []
    for key, members in groups.items():
        done = [r for r in members if r["status"] == "finished"]
        row: dict[str, Any] = {"overrides": list(key), "n": len(done), "jobs": len(members)}
        row["members"] = [r["job"] for r in members]
        row["trained_with"] = "; ".join(sorted({r["trained_with"] for r in done if r.get("trained_with")})) or None
        for m in metrics:
            vals = [float(r[m]) for r in done if r.get(m) is not None]
            mean = sum(vals) / len(vals) if vals else None
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else None
            row[f"{m} mean"], row[f"{m} std"] = mean, std
        out.append(row)
    return out


def distance_groups(rows: list[dict[str, Any]], means: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The settings the sweep's attention-distance picture draws, each ``(label, finished job folders)``: a seed
    sweep's :func:`seed_means` settings (their seeds together), else one per job; the rows' and means' ``overrides``
    are :func:`summary_rows`' strings."""
    finished = {r["job"] for r in rows if r.get("status") == "finished"}
    groups = [(m["overrides"], m["members"]) for m in means] if means else [(r["overrides"], [r["job"]]) for r in rows]
    return [(label, [j for j in jobs if j in finished]) for label, jobs in groups]


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


def _scored_of(n: Any, of: Any) -> Any:
    return f"{n}/{of}" if n is not None and of is not None and n != of else (of if of is not None else n)


#: a ``val/*`` cell of a job whose fit ran no validation (its ``metrics.json``'s ``val_runs`` is 0)
NO_VAL = "no validation ran"


def format_table(rows: list[dict[str, Any]], metrics: Sequence[str], record: str = "metrics.json") -> str:
    """Plain fixed-width table (readable in any log), of the jobs' ``record``'s columns."""
    trained = ["trained"] * any(r.get("trained") for r in rows)  # (eval.py -m over a sweep's checkpoints)
    cols = ["job", "overrides", *trained, *metrics, *(_TRAIN_COLUMNS if _is_train(record) else _EVAL_COLUMNS)]
    cols.append("status")
    shown = [dict(r, test_images=_scored_of(r.get("test_images"), r.get("test_split_images"))) for r in rows]
    for r in shown:
        r["images"] = _scored_of(r.get("images"), r.get("split_images"))
    for r in shown:  # (a job that resumed a run of other settings: its figures are that run's, said below the table)
        r["status"] = f"{r['status']}{mark_other_settings(r)}"
    for r in shown:  # (an empty val/* cell of a job that ran no validation: said, not left blank)
        r.update({m: NO_VAL for m in metrics if m.startswith("val/") and r.get(m) is None and r.get("val_runs") == 0})
    return _fixed_width(cols, [[_cell(c, r.get(c)) for c in cols] for r in shown])


def format_means(means: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """The :func:`seed_means` table: ``mean ± std`` per metric, ``n`` finished seeds (``of`` jobs; `` *``: of runs of
    other settings, as :func:`format_table`'s status)."""

    def pm(r: dict[str, Any], m: str) -> str:
        mean, std = r[f"{m} mean"], r[f"{m} std"]
        return "-" if mean is None else f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "")

    cols = ["overrides", "seeds", *metrics]
    seeds = [f"{r['n']}" + (f" of {r['jobs']}" if r["n"] != r["jobs"] else "") + mark_other_settings(r) for r in means]
    table = [[r["overrides"], n] for r, n in zip(means, seeds)]
    for t, r in zip(table, means):
        t += [pm(r, m) for m in metrics]
    return _fixed_width(cols, table)


def csv_text(fields: Sequence[str], rows: list[dict[str, Any]]) -> str:
    with io.StringIO(newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({k: r.get(k) for k in fields} for r in rows)
        return f.getvalue()
