"""Resolution extrapolation: every scheme x extension method, trained at the base size, scored zero-shot at 1x-4x.

    python bench/extrapolation.py                                  # CPU budget -> bench/results/study_extrapolation.*
    python bench/extrapolation.py --seeds 1 --schemes rope2d_axial,rope2d_axial_yarn   # a slice
    python bench/extrapolation.py --device cuda trainer.limit_train_batches=null trainer.max_epochs=10   # GPU

A thin layer over the study (``bench/study.py --budget extrapolation``, recipe and claims in
``conf/experiment/study_extrapolation.yaml``): the same runs, resume, intervals, paired differences and
verdicts; this script adds the curves, ``<name>_curves.png``: accuracy (mean and 95 % interval over seeds)
against the resolution factor, one panel per family. Every argument goes to the study.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import study  # noqa: E402  (bench/study.py)


def plot_curves(rows: Sequence[Mapping[str, Any]], scales: Mapping[str, float], title: str | None = None):
    """Accuracy against resolution factor per scheme (summary rows of the study), one panel per family."""
    import matplotlib.pyplot as plt

    from vitrel.pos.base import FAMILIES

    families = [f for f in FAMILIES if any(r["family"] == f for r in rows)]
    evals = sorted(scales, key=scales.get)
    xs = [scales[e] for e in evals]
    fig, axes = plt.subplots(1, len(families), figsize=(4.2 * len(families), 3.6), squeeze=False, sharey=True)
    for ax, fam in zip(axes[0], families):
        for r in (r for r in rows if r["family"] == fam):
            ys = [r.get(f"{e}_acc_mean") for e in evals]
            if any(y is None for y in ys):
                continue
            lo = [r.get(f"{e}_acc_lo") if r.get(f"{e}_acc_lo") is not None else y for e, y in zip(evals, ys)]
            hi = [r.get(f"{e}_acc_hi") if r.get(f"{e}_acc_hi") is not None else y for e, y in zip(evals, ys)]
            (line,) = ax.plot(xs, [100 * y for y in ys], marker="o", ms=3, label=r["scheme"])
            ax.fill_between(xs, [100 * v for v in lo], [100 * v for v in hi], color=line.get_color(), alpha=0.15)
        ax.set_title(fam, fontsize=9)
        ax.set_xlabel("resolution factor (zero-shot)")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("accuracy (%)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--budget" not in argv:
        argv = ["--budget", "extrapolation", *argv]
    state = study.main(argv)
    args = study.parse_args(argv)
    rows, scales = state.get("summary") or [], state["recipe"]["study"].get("scales") or {}
    if rows and scales and not args.shard:
        name, out = args.name or f"study_{args.budget}", Path(args.out)
        fig = plot_curves(rows, scales, title=f"{name}: {state['machine']['description']}")
        fig.savefig(out / f".{name}_curves.png.tmp", dpi=110, format="png")
        (out / f".{name}_curves.png.tmp").replace(out / f"{name}_curves.png")
        print(f"curves: {out / f'{name}_curves.png'}")
    return state


if __name__ == "__main__":
    main()
