"""The study's pictures, from its summary rows (``vitrel.study.reading.summarise``; the ``summary`` of a
results JSON): accuracies with their intervals per scheme, paired differences against a baseline, one metric
against another, and accuracy against the resolution factor (the ``extrapolation`` budget's curves).

Every function returns a ``matplotlib.figure.Figure`` built without pyplot, as ``vitrel.viz``'s do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vitrel.figures import new_figure
from vitrel.pos.base import FAMILIES
from vitrel.study.runs import TEST_ON_OOD

__all__ = ["plot_study", "plot_study_diffs", "plot_study_scatter", "plot_curves"]


def _titled(fig, title: str | None):
    """``fig`` with ``title`` as its title (when given)."""
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def _archs(rows: Sequence[Mapping[str, Any]], archs: Sequence[str] | None, what: str) -> list[str]:
    """``archs``, by default those of the summary ``rows`` in their order (no rows: a ``ValueError``)."""
    if not rows:
        raise ValueError(f"{what} needs at least one summary row")
    return list(archs) if archs is not None else list(dict.fromkeys(r["arch"] for r in rows))


def _metric_label(key: str) -> str:
    return key.removesuffix("_mean").removesuffix("_acc").replace("_", " ")


_MARKERS = "osD^v<>p*h"


def _percent(rows: Sequence[Mapping[str, Any]], key: str, missing: Sequence[float] | float = math.nan) -> np.ndarray:
    """``100 * row[key]`` for each row; ``missing`` (one value, or one per row) where a row has no value."""
    fill = np.broadcast_to(np.asarray(missing, dtype=float), (len(rows),))
    return np.array([100 * float(r[key]) if r.get(key) is not None else f for r, f in zip(rows, fill)])


def _interval(
    rows: Sequence[Mapping[str, Any]], mean: str, lo: str, hi: str, clip: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``mean`` and its error bars ``[2, n]`` to ``[lo, hi]`` (none where a row has no interval), in %;
    ``clip``: an accuracy's, drawn within [0, 100] (a wide t-interval of few seeds ran to 154 %)."""
    m = _percent(rows, mean)
    low, high = _percent(rows, lo, m), _percent(rows, hi, m)
    if clip:
        low, high = np.clip(low, 0.0, 100.0), np.clip(high, 0.0, 100.0)
    return m, np.stack([m - low, high - m])


def _names(sub: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rows' schemes, ``(k of n seeds)`` added where a row has fewer seeds than the most of ``rows`` (no bar)."""
    most = max((r.get("seeds") or 0 for r in rows), default=0)
    few = lambda r: f" ({r['seeds']} of {most} seeds)" if (r.get("seeds") or most) < most else ""  # noqa: E731
    return [r["scheme"] + few(r) for r in sub]


def _dot_axis(ax, names: Sequence[str], series: Sequence[tuple[str, np.ndarray, np.ndarray]], xlabel: str, title: str):
    """A horizontal dot plot on ``ax``: one row per name, and per series ``(label, values, error bars)`` a dot in
    each row (the series side by side within the row) with its bars (``[n]`` symmetric or ``[2, n]`` below / above)."""
    y = np.arange(len(names))
    width = 0.7 / max(len(series), 1)
    for i, (label, values, err) in enumerate(series):
        off = (i - (len(series) - 1) / 2) * width
        ax.errorbar(values, y + off, xerr=err, fmt=_MARKERS[i % len(_MARKERS)], ms=4, capsize=2, label=label)
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.grid(axis="x", color="0.9")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=7)


def plot_study(
    rows: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] | None = None,
    archs: Sequence[str] | None = None,
    title: str | None = None,
    chance: float | None = None,
):
    """The study's picture: per architecture, accuracies per scheme (mean, error bar = the 95 % interval
    over seeds where the rows have one, else the std) and training throughput.

    ``rows``: summary rows (one per architecture x scheme) with ``arch``, ``scheme`` and, for each
    metric ``m``, ``m_mean`` and ``m_lo`` / ``m_hi`` or ``m_std`` (accuracies in [0, 1]), plus
    ``bench_img_s`` (throughput timed with the models taking turns) or, without it, ``train_img_s_mean``
    (the runs' own throughput).
    ``metrics`` default: every ``*_acc_mean`` key, in-distribution first; ``chance``: accuracy of a
    guess (drawn as a dotted line). Returns a Figure with ``2 * len(archs)`` axes (accuracy,
    throughput per architecture).
    """
    archs = _archs(rows, archs, "plot_study")
    if metrics is None:
        keys = [k for k in rows[0] if k.endswith("_acc_mean") and k != f"{TEST_ON_OOD}_acc_mean"]
        metrics = sorted(keys, key=lambda k: (k != "test_acc_mean", keys.index(k)))
    n_schemes = max(sum(1 for r in rows if r["arch"] == a) for a in archs)
    fig = new_figure(11.0, 0.28 * n_schemes * len(archs) + 1.2 * len(archs) + 0.6)
    axes = np.atleast_2d(fig.subplots(len(archs), 2, squeeze=False, width_ratios=[3, 1]))
    for a_i, arch in enumerate(archs):
        sub = [r for r in rows if r["arch"] == arch]
        ax = axes[a_i, 0]
        with_ci = any(r.get(m.removesuffix("_mean") + "_lo") is not None for r in sub for m in metrics)
        series = []
        for m in metrics:
            base = m.removesuffix("_mean")
            if with_ci:  # asymmetric bars [lo, hi]; none where a cell has a single seed
                mean, err = _interval(sub, m, f"{base}_lo", f"{base}_hi", clip=True)
            else:
                mean, err = _percent(sub, m), _percent(sub, f"{base}_std", 0.0)
            series.append((_metric_label(m), mean, err))
        bar = "95 % interval" if with_ci else "std"
        names = _names(sub, rows)
        _dot_axis(ax, names, series, "accuracy (%)", f"{arch}: accuracy (mean, bar = {bar} over seeds)")
        y = np.arange(len(sub))
        if chance is not None:
            ax.axvline(100 * chance, ls=":", color="0.5", lw=1, label="chance")
        if a_i == 0:
            fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncol=len(metrics) + 1, loc="outside lower center")
        ax2 = axes[a_i, 1]
        thr = np.array([float(r.get("bench_img_s") or r.get("train_img_s_mean") or math.nan) for r in sub])
        own = np.array([not r.get("bench_img_s") for r in sub])  # (not timed in turns: the runs' own steps, as the
        ax2.barh(y, np.where(own, np.nan, thr), color="0.6", label="timed in turns")  # report's *: not comparable)
        if own.any():
            ax2.barh(y, np.where(own, thr, np.nan), color="white", edgecolor="0.4", hatch="///", label="own steps (*)")
            ax2.legend(fontsize=6, loc="lower right")
        ax2.set_yticks(y, [])
        ax2.invert_yaxis()
        ax2.set_xlabel("train images / s", fontsize=8)
        ax2.set_title(f"{arch}: throughput", fontsize=8)
        ax2.tick_params(labelsize=7)
    return _titled(fig, title)


def plot_study_diffs(
    rows: Sequence[Mapping[str, Any]],
    base: str = "none",
    metrics: Sequence[str] | None = None,
    archs: Sequence[str] | None = None,
    title: str | None = None,
):
    """Paired differences against the ``base`` scheme, per architecture: for every other scheme and metric
    ``m`` the mean of ``m_vs_<base>_mean`` with its 95 % interval ``[m_vs_<base>_lo, m_vs_<base>_hi]`` in
    percentage points (the study's summary rows). An interval clear of the zero line is a resolved
    difference. ``metrics`` default: every ``*_acc`` with such columns. Returns a Figure, one axis per
    architecture."""
    archs = _archs(rows, archs, "plot_study_diffs")
    suffix = f"_vs_{base}_mean"
    if metrics is None:
        metrics = [k.removesuffix(suffix) for k in rows[0] if k.endswith(suffix)]
    if not metrics:
        raise ValueError(f"the rows have no paired differences against {base!r} (columns *{suffix})")
    n_schemes = max(sum(1 for r in rows if r["arch"] == a and r["scheme"] != base) for a in archs)
    fig = new_figure(11.0, 0.28 * n_schemes * len(archs) + 1.2 * len(archs) + 0.6)
    axes = np.atleast_1d(fig.subplots(len(archs), 1, squeeze=False)[:, 0])
    for ax, arch in zip(axes, archs):
        sub = [r for r in rows if r["arch"] == arch and r["scheme"] != base]
        series = []
        for m in metrics:
            mean, err = _interval(sub, f"{m}_vs_{base}_mean", f"{m}_vs_{base}_lo", f"{m}_vs_{base}_hi")
            series.append((_metric_label(m.removesuffix("_acc") + "_acc_mean"), mean, err))
        xlabel = f"accuracy minus {base}'s, same seeds (percentage points)"
        title_ax = f"{arch}: paired difference against {base} (mean, bar = 95 % interval)"
        _dot_axis(ax, _names(sub, rows), series, xlabel, title_ax)
        ax.axvline(0.0, color="0.3", lw=1)
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=7, ncol=len(metrics), loc="outside lower center")
    return _titled(fig, title)


def plot_study_scatter(
    rows: Sequence[Mapping[str, Any]],
    x: str = "test_acc_mean",
    ys: Sequence[str] | None = None,
    archs: Sequence[str] | None = None,
    title: str | None = None,
):
    """Per architecture and per ``y`` metric, a scatter of ``y`` against ``x`` (one point per scheme,
    coloured by family, labelled by name): e.g. out-of-distribution against in-distribution accuracy.

    ``ys`` default: every ``*_acc_mean`` key but ``x``. Accuracies are shown in %. Returns a Figure with
    ``len(archs) * len(ys)`` axes.
    """
    archs = _archs(rows, archs, "plot_study_scatter")
    skip = (x, f"{TEST_ON_OOD}_acc_mean")
    ys = list(ys) if ys is not None else [k for k in rows[0] if k.endswith("_acc_mean") and k not in skip]
    if not ys:
        raise ValueError(f"no metric to plot against {x}")
    fams = list(dict.fromkeys(r.get("family", "?") for r in rows))
    fams.sort(key=lambda f: FAMILIES.index(f) if f in FAMILIES else len(FAMILIES))
    colours = {f: f"C{i}" for i, f in enumerate(fams)}
    fig = new_figure(4.2 * len(ys) + 0.4, 3.6 * len(archs) + 0.4)
    axes = np.atleast_2d(fig.subplots(len(archs), len(ys), squeeze=False))
    for a_i, arch in enumerate(archs):
        sub = [r for r in rows if r["arch"] == arch]
        for y_i, y in enumerate(ys):
            ax = axes[a_i, y_i]
            for fam in fams:
                pts = [r for r in sub if r.get("family", "?") == fam and r.get(x) is not None and r.get(y) is not None]
                if not pts:
                    continue
                ax.scatter([100 * r[x] for r in pts], [100 * r[y] for r in pts], c=colours[fam], s=18, label=fam)
                for r in pts:
                    ax.annotate(
                        r["scheme"], (100 * r[x], 100 * r[y]), fontsize=6, xytext=(2, 2), textcoords="offset points"
                    )
            ax.set_xlabel(f"{_metric_label(x)} accuracy (%)", fontsize=8)
            ax.set_ylabel(f"{_metric_label(y)} accuracy (%)", fontsize=8)
            ax.set_title(f"{arch}: {_metric_label(y)} vs {_metric_label(x)}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(color="0.92")
            if a_i == 0 and y_i == 0:
                ax.legend(fontsize=6)
    return _titled(fig, title)


def plot_curves(
    rows: Sequence[Mapping[str, Any]],
    scales: Mapping[str, float],
    title: str | None = None,
    scale_label: str = "resolution factor",
):
    """Accuracy (mean, band = the 95 % interval over seeds) against the factor of each eval per scheme, one panel
    per family. ``scales``: eval name -> factor (``study.scales`` of the recipe; accuracies ``<eval>_acc_*``),
    ``scale_label`` what the factor scales (``study.scale_label``: a video study's ``time factor``). A panel's first 10
    lines are solid in matplotlib's ten colours, the next 10 dashed, then dotted.
    Every point on the same images: ``test`` is read from ``test_on_ood_images_acc_*`` where a row has it (the
    ``test`` set's own images are others than those of the larger sets)."""
    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    evals = sorted(scales, key=scales.get)
    xs = [scales[e] for e in evals]
    fig = new_figure(4.2 * len(families), 3.6)
    axes = fig.subplots(1, len(families), squeeze=False, sharey=True)
    import matplotlib

    colours = matplotlib.colormaps["tab10"].colors
    for ax, fam in zip(axes[0], families):
        drawn = 0
        for r in (r for r in rows if r["family"] == fam):
            keys = [TEST_ON_OOD if e == "test" and r.get(f"{TEST_ON_OOD}_acc_mean") is not None else e for e in evals]
            ys = [r.get(f"{k}_acc_mean") for k in keys]
            if any(y is None for y in ys):
                continue
            lo = [r.get(f"{k}_acc_lo") if r.get(f"{k}_acc_lo") is not None else y for k, y in zip(keys, ys)]
            hi = [r.get(f"{k}_acc_hi") if r.get(f"{k}_acc_hi") is not None else y for k, y in zip(keys, ys)]
            style = dict(color=colours[drawn % 10], linestyle=("-", "--", ":")[min(drawn // 10, 2)])
            drawn += 1
            (line,) = ax.plot(xs, [100 * y for y in ys], marker="o", ms=3, label=r["scheme"], **style)
            # an accuracy lies in [0, 100]: a wide t-interval (few seeds) is drawn clipped to that range
            lo, hi = [100 * max(v, 0.0) for v in lo], [100 * min(v, 1.0) for v in hi]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(fam, fontsize=9)
        ax.set_ylim(0, 100)
        ax.set_xlabel(f"{scale_label} (zero-shot)")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("accuracy (%)")
    return _titled(fig, title)
