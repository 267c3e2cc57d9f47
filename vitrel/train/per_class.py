"""Which classes a model gets wrong: the test's per-class report (:class:`PerClassReport`), written by train.py's test
into the run folder and by eval.py beside ``eval_metrics.json``.

* ``per_class.csv``: a row per class (its index, its name where the data module gives ``class_names``, its
  ``support``: the test images of the class, ``predicted``: those predicted as it, ``correct``, ``acc1``: the share
  of its images predicted as it, its recall, and ``precision``: the share of the images predicted as it that are
  of it; blank where there is none to share).
* ``confusion.csv``: the counts, a row per true class, a column per predicted class, named; ``confused_pairs.csv``:
  the ``top_pairs`` most frequent (true, predicted) pairs of different classes, with their share of the true class.
* ``confusion.png``: the confusion matrix, each row (a true class) divided by its support, the classes named on the
  axes, for at most ``max_png_classes`` classes (more are unreadable in a picture: a log line says so).

The figures are torchmetrics' (``MulticlassConfusionMatrix``, ``MulticlassAccuracy(average=None)``,
``MulticlassPrecision(average=None)``), updated with the logits and targets the module's ``test_step`` returns, the
same the test's top-1 accuracy is updated with: the diagonal of the counts over their total is ``test/acc1``.
Under several processes they are summed over the ranks (torchmetrics' sync; each image is scored once:
:class:`~vitrel.data.sampling.EvalSampler`); the global rank 0 writes the files.
"""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix, MulticlassPrecision

from vitrel.train.data_contract import is_video_data
from vitrel.train.sweep_plot import save_png

__all__ = ["PerClassReport", "confused_pairs", "plot_confusion", "write_per_class"]
log = logging.getLogger(__name__)

#: the columns of ``per_class.csv``
COLUMNS = ("class", "name", "support", "predicted", "correct", "acc1", "precision")


class PerClassReport(Callback):
    """Counts the test's top-1 predictions per class and writes ``per_class.csv``, ``confusion.csv``,
    ``confused_pairs.csv`` (the ``top_pairs`` most frequent (true, predicted) pairs of different classes) and, for at
    most ``max_png_classes`` classes, ``confusion.png`` (rows normalised) into ``save_dir``. The module's
    ``test_step`` returns ``{"logits", "target"}`` (:class:`~vitrel.train.module.ClassifierModule`'s does)."""

    def __init__(self, save_dir: str | Path, max_png_classes: int = 40, top_pairs: int = 20) -> None:
        if max_png_classes < 0 or top_pairs < 0:
            raise ValueError(f"max_png_classes and top_pairs must be >= 0, got {max_png_classes} and {top_pairs}")
        self.save_dir = Path(save_dir)
        self.max_png_classes, self.top_pairs = int(max_png_classes), int(top_pairs)
        self.metrics: MetricCollection | None = None

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        n = int(pl_module.num_classes)
        self.metrics = MetricCollection(
            {
                "confusion": MulticlassConfusionMatrix(n),
                "acc1": MulticlassAccuracy(n, average=None),
                "precision": MulticlassPrecision(n, average=None),
            }
        ).to(pl_module.device)

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:  # fmt: skip
        if outputs is None:  # (a batch of unreadable files only, left out)
            return
        if not isinstance(outputs, dict) or "logits" not in outputs or "target" not in outputs:
            raise TypeError(
                f"callbacks.per_class needs test_step to return {{'logits', 'target'}}; "
                f"{type(pl_module).__name__}.test_step returned {type(outputs).__name__}"
            )
        self.metrics.update(outputs["logits"].detach(), outputs["target"])

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        values = self.metrics.compute()  # (every rank: the sync over the ranks is collective)
        self.metrics = None
        if not trainer.is_global_zero:
            return
        counts = values["confusion"].long().cpu()
        names = _class_names(trainer.datamodule, counts.shape[0])
        self.save_dir.mkdir(parents=True, exist_ok=True)
        path = write_per_class(self.save_dir / "per_class.csv", counts, names, values["acc1"], values["precision"])
        matrix = self.save_dir / "confusion.csv"  # (rows: true classes, columns: predicted)
        _write_rows(matrix, ("true \\ predicted", *names), [(n, *row) for n, row in zip(names, counts.tolist())])
        pairs = self.save_dir / "confused_pairs.csv"
        _write_rows(pairs, ("true", "true_name", "predicted", "predicted_name", "count", "share_of_true"),
                    confused_pairs(counts, names, self.top_pairs))  # fmt: skip
        png = self.save_dir / "confusion.png"
        noun = "videos" if is_video_data(trainer.datamodule) else "images"
        written = f"{path} ({int(counts.sum())} {noun}), {matrix.name}, {pairs.name}"
        if counts.shape[0] <= self.max_png_classes:
            save_png(plot_confusion(counts, names), png)
            log.info("per-class report: %s, %s", written, png.name)
        else:
            png.unlink(missing_ok=True)  # (not an earlier test's picture left beside this test's figures)
            log.info(
                "per-class report: %s; no confusion.png: %d classes, above max_png_classes=%d (the counts are in %s)",
                written, counts.shape[0], self.max_png_classes, matrix.name,
            )  # fmt: skip


def _class_names(dm: Any, n: int) -> list[str]:
    """The data module's ``class_names`` when it has ``n`` of them, else the indices."""
    names = getattr(dm, "class_names", None) if dm is not None else None
    if names is None or len(names) != n:
        return [str(i) for i in range(n)]
    return [str(s) for s in names]


def _write_rows(path: Path, header: tuple[str, ...], rows: list[tuple]) -> None:
    part = path.with_name(f".{path.name}.{os.getpid()}")
    with part.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    os.replace(part, path)


def write_per_class(path: Path, counts: Tensor, names: list[str], acc1: Tensor, precision: Tensor) -> Path:
    """``per_class.csv`` (:data:`COLUMNS`) of the confusion ``counts`` ``[true, predicted]`` and torchmetrics' per-class
    ``acc1`` (recall) and ``precision``, blank where the class has no images (``acc1``) or no predictions
    (``precision``)."""
    support, predicted, correct = counts.sum(1), counts.sum(0), counts.diagonal()
    rows = []
    for i, name in enumerate(names):
        r = f"{float(acc1[i]):.6f}" if support[i] > 0 else ""
        p = f"{float(precision[i]):.6f}" if predicted[i] > 0 else ""
        rows.append((i, name, int(support[i]), int(predicted[i]), int(correct[i]), r, p))
    _write_rows(path, COLUMNS, rows)
    return path


def confused_pairs(counts: Tensor, names: list[str], top: int) -> list[tuple]:
    """The ``top`` most frequent (true, predicted) pairs of different classes among ``counts``, with their count and
    share of the true class's images, most first (ties: by true, then predicted class)."""
    off = counts.clone()
    off.fill_diagonal_(0)
    pairs = sorted(((int(off[t, p]), t, p) for t, p in torch.nonzero(off).tolist()), key=lambda x: (-x[0], x[1], x[2]))
    support = counts.sum(1)
    return [(t, names[t], p, names[p], c, f"{c / int(support[t]):.6f}") for c, t, p in pairs[:top]]


def plot_confusion(counts: Tensor, names: list[str]):
    """The confusion ``counts`` with each row divided by its support (a class without images: a row of 0), the class
    names on the axes, drawn by torchmetrics' ``MulticlassConfusionMatrix.plot`` on a ``matplotlib.figure.Figure`` (no
    pyplot); the cells' values written for up to 15 classes."""
    from matplotlib.figure import Figure

    n = counts.shape[0]
    support = counts.sum(1, keepdim=True)
    rates = counts.double() / support.clamp(min=1)
    side = min(4.0 + 0.38 * n, 22.0)
    fig = Figure(figsize=(side, side * 0.9), layout="constrained")
    ax = fig.subplots()
    MulticlassConfusionMatrix(n).plot(val=rates, ax=ax, add_text=n <= 15, labels=names, cmap="Blues")
    ax.images[0].set_clim(0.0, 1.0)  # (shares: one colour scale for every run's picture)
    small = 7 if n <= 15 else 6
    for t in ax.texts:
        t.set_fontsize(small)
    ax.tick_params(labelsize=small)
    ax.set_xlabel("predicted class", fontsize=8)
    ax.set_ylabel("true class", fontsize=8)
    total, right = int(counts.sum()), int(counts.diagonal().sum())
    ax.set_title(f"confusion, each row / its support: {right} of {total} right ({right / max(total, 1):.2%})",
                 fontsize=9)  # fmt: skip
    return fig
