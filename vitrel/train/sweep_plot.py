"""The sweep summary's picture, ``summary.png`` (:class:`vitrel.train.hydra_callbacks.SweepSummary`): one
horizontal bar per job, its top-1 accuracy in %, in the table's order; with a ``seed=`` sweep one bar per setting
at the mean over its finished seeds, an error bar of ± the sample standard deviation (``summary_seeds.csv``'s) and
each seed's value as a dot. A job (a setting with no finished seed) that failed, was interrupted or was not run is
an empty row saying which; a label marked ``*`` is of a job (a setting's seeds) that resumed its folder's run of
other settings.

:func:`plot_rows` is the data the picture shows; :func:`plot_sweep` draws it as a ``matplotlib.figure.Figure``
built without pyplot, as ``vitrel.viz``'s are; :func:`save_png` writes it with the Agg canvas.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitrel.train.sweep_rerun import mark_other_settings

__all__ = ["ACCURACY", "PlotRows", "plot_rows", "plot_sweep", "save_png"]

#: the accuracy a bar shows: the test split's, else (a job run with ``test=false``) the last validation's
ACCURACY = ("test/acc1", "val/acc1")

_NAMES = {"test/acc1": "test", "val/acc1": "validation"}
#: a row's label wraps at this many characters (at 7 pt, under half the picture's 8 inches: the bars keep the rest)
LABEL_WIDTH = 56


@dataclass
class PlotRows:
    """One entry per row of the picture (top to bottom, the table's order); accuracies in %."""

    labels: list[str] = field(default_factory=list)
    #: the bar's length (a seed sweep: the mean over the finished seeds); None: an empty row
    values: list[float | None] = field(default_factory=list)
    #: ± the sample standard deviation over the seeds (None: one seed, or not a seed sweep)
    errors: list[float | None] = field(default_factory=list)
    #: each finished seed's value (a seed sweep), else empty
    points: list[list[float]] = field(default_factory=list)
    #: which metric the bar is (``test/acc1`` or ``val/acc1``; None for an empty row)
    metrics: list[str | None] = field(default_factory=list)
    #: what an empty row says (the job's status: ``failed (...)``), "" for a bar
    notes: list[str] = field(default_factory=list)
    jobs: int = 0
    finished: int = 0
    seeds: bool = False
    #: a label marked `` *``: its figures are of a resumed run of other settings (summary.md names them)
    other_settings: bool = False

    def xlabel(self) -> str:
        used = sorted({m for m in self.metrics if m is not None}, key=ACCURACY.index)
        if len(used) == 1:
            return f"{_NAMES[used[0]]} top-1 accuracy (%), {used[0]}"
        if not used:
            return "top-1 accuracy (%)"
        return "top-1 accuracy (%): test/acc1, val/acc1 where the row says [val/acc1] (no test metric)"


def _pct(v: Any) -> float | None:
    return None if v is None else 100.0 * float(v)


def plot_rows(rows: list[dict[str, Any]], means: list[dict[str, Any]]) -> PlotRows:
    """The picture's rows from the summary's: ``rows`` (:func:`~vitrel.train.sweep_table.collect_sweep`'s, with
    ``overrides`` made strings by ``split_common``) and ``means`` (``seed_means``'s, empty unless a ``seed=`` sweep;
    then one row per setting, its seeds the jobs named in ``members``). A bar is ``test/acc1`` where the job (for a
    setting: any of its finished seeds) has it, else ``val/acc1``."""
    out = PlotRows(jobs=len(rows), finished=sum(r["status"] == "finished" for r in rows), seeds=bool(means))
    out.other_settings = any(mark_other_settings(r) for r in means or rows)
    if not means:
        for r in rows:
            done = r["status"] == "finished"
            metric = next((m for m in ACCURACY if done and r.get(m) is not None), None)
            out.labels.append(f"{r['job']}: {r['overrides']}{mark_other_settings(r)}")
            out.values.append(_pct(r.get(metric)) if metric else None)
            out.errors.append(None)
            out.points.append([])
            out.metrics.append(metric)
            out.notes.append("" if metric else (r["status"] if not done else "no accuracy"))
        return out
    by_job = {r["job"]: r for r in rows}
    for s in means:
        metric = next((m for m in ACCURACY if s.get(f"{m} mean") is not None), None)
        seeds = f"{s['n']} seed{'s' if s['n'] != 1 else ''}" + (f" of {s['jobs']}" if s["n"] != s["jobs"] else "")
        out.labels.append(f"{s['overrides']} ({seeds}){mark_other_settings(s)}")
        out.values.append(_pct(s.get(f"{metric} mean")) if metric else None)
        out.errors.append(_pct(s.get(f"{metric} std")) if metric else None)
        members = [by_job[j] for j in s["members"]]
        done = [r for r in members if r["status"] == "finished" and metric and r.get(metric) is not None]
        out.points.append([100.0 * float(r[metric]) for r in done])
        out.metrics.append(metric)
        why = ", ".join(sorted({r["status"].split(" (")[0] for r in members if r["status"] != "finished"}))
        out.notes.append("" if metric else (why or "no accuracy"))
    return out


def plot_sweep(data: PlotRows, name: str):
    """The bars of ``data`` (:func:`plot_rows`) in a Figure titled with the sweep folder's ``name``."""
    import numpy as np
    from matplotlib.figure import Figure

    n = len(data.labels)
    val_too = "test/acc1" in data.metrics  # (rows of val/acc1 among test/acc1 ones say so)
    labels = [textwrap.fill(lab + (" [val/acc1]" if m == "val/acc1" and val_too else ""), LABEL_WIDTH)
              for lab, m in zip(data.labels, data.metrics)]  # fmt: skip
    lines = max([lab.count("\n") + 1 for lab in labels], default=1)  # (rows as tall as the tallest label)
    fig = Figure(figsize=(8.0, (0.2 + 0.12 * lines) * n + 1.5), layout="constrained")
    ax = fig.subplots()
    y = np.arange(n)
    vals = np.array([v if v is not None else np.nan for v in data.values])
    errs = np.array([e if e is not None else 0.0 for e in data.errors])
    ax.barh(y, np.nan_to_num(vals), color=["C1" if m == "val/acc1" else "C0" for m in data.metrics], height=0.6)
    if data.seeds:
        ax.errorbar(vals, y, xerr=errs, fmt="none", ecolor="0.35", capsize=3, lw=1)
        for i, pts in enumerate(data.points):
            ax.plot(pts, [i] * len(pts), "o", mfc="w", mec="k", ms=3.5, mew=0.8, zorder=3)
    ends = [max([v + e, *p]) for v, e, p in zip(np.nan_to_num(vals), errs, data.points)]
    right = max([*ends, 1.0]) * 1.2
    ax.set_xlim(0, right)
    for i, v in enumerate(data.values):
        if v is None:
            ax.text(0, i, f" {data.notes[i]}", va="center", ha="left", fontsize=7, color="0.4", style="italic")
        else:
            text = f"{v:.2f}" + (f" ± {data.errors[i]:.2f}" if data.errors[i] is not None else "")
            ax.text(ends[i] + 0.01 * right, i, text, va="center", ha="left", fontsize=7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_ylim(n - 0.5, -0.5)  # (the first row at the top, as in the table)
    ax.grid(axis="x", color="0.9")
    ax.set_axisbelow(True)
    ax.set_xlabel(data.xlabel(), fontsize=8)
    ax.tick_params(labelsize=7)
    title = f"{name}: {data.jobs} jobs, {data.finished} finished (rows in the summary table's order)"
    if data.seeds:
        title += "\nbar: mean over a setting's finished seeds, ± sample std; dots: the seeds"
    if data.other_settings:
        title += "\n*: of the run the job resumed, trained with other settings (summary.md names them)"
    fig.suptitle(title, fontsize=9)
    return fig


def save_png(fig, path: Path) -> None:
    """``fig`` as ``path`` through the Agg canvas, replacing the file whole (jobs of a parallel launcher end at
    once). The figure has no pyplot manager: nothing holds it once the caller drops it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    part = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fig.savefig(part, dpi=110, format="png")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
