"""The probes of a ``module=probe_grid`` run, in its folder (:class:`ProbeTable`): ``probes.csv``, each probe's
learning rate, weight decay and top-1 at the latest validation, the chosen one marked; ``probes.png``, that top-1
over the grid: a heatmap of learning rate against weight decay when the probes are every pair of some rates and
decays (V-JEPA 2's 20 are 5 x 4), else a bar a probe. A run of another module writes neither."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from vitrel.train.sweep_plot import save_png

__all__ = ["ProbeTable", "plot_probes", "probe_rows"]


def probe_rows(metrics: Mapping[str, Any], module: L.LightningModule) -> list[dict[str, Any]]:
    """``[{probe, lr, weight_decay, val_acc1, chosen}, ...]`` of ``module``'s probes (its ``hparams["probes"]``) from a
    validation's logged ``val/probe_acc1/<i>`` and ``val/best_probe``; empty for a module without probes or before
    a validation."""
    settings = (getattr(module, "hparams", None) or {}).get("probes") or []
    if not settings or "val/best_probe" not in metrics:
        return []
    best = int(metrics["val/best_probe"])
    return [
        {"probe": i, "lr": float(s["lr"]), "weight_decay": float(s["weight_decay"]),
         "val_acc1": float(metrics[f"val/probe_acc1/{i}"]), "chosen": i == best}
        for i, s in enumerate(settings)
    ]  # fmt: skip


def plot_probes(rows: list[dict[str, Any]], title: str = "") -> Any:
    """``rows`` (:func:`probe_rows`) as a ``matplotlib.figure.Figure`` (no pyplot): a heatmap of top-1 over learning
    rate (columns) and weight decay (rows) with each cell's value and the chosen cell outlined, when the probes are
    every pair of their rates and decays once; else a bar a probe, the chosen one dark."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    lrs = sorted({r["lr"] for r in rows}, reverse=True)
    wds = sorted({r["weight_decay"] for r in rows})
    cells = {(r["weight_decay"], r["lr"]): r for r in rows}
    fig = Figure(figsize=(1.3 * max(len(lrs), 3) + 1.5, 0.6 * max(len(wds), 3) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    if len(cells) == len(rows) == len(lrs) * len(wds):
        grid = [[cells[(wd, lr)]["val_acc1"] for lr in lrs] for wd in wds]
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        low, high = image.get_clim()
        for y, wd in enumerate(wds):
            for x, lr in enumerate(lrs):
                light = high > low and (grid[y][x] - low) / (high - low) > 0.6  # (dark text on viridis' yellows)
                ax.text(x, y, f"{grid[y][x]:.3f}", ha="center", va="center", color="k" if light else "w", fontsize=8)
                if cells[(wd, lr)]["chosen"]:
                    ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="r", linewidth=2))
        ax.set_xticks(range(len(lrs)), [f"{v:g}" for v in lrs])
        ax.set_yticks(range(len(wds)), [f"{v:g}" for v in wds])
        ax.set_xlabel("learning rate")
        ax.set_ylabel("weight decay")
        fig.colorbar(image, ax=ax, label="val top-1")
    else:
        ax.bar(range(len(rows)), [r["val_acc1"] for r in rows], color=["C3" if r["chosen"] else "C0" for r in rows])
        ax.set_xticks(range(len(rows)), [f"lr {r['lr']:g}\nwd {r['weight_decay']:g}" for r in rows], fontsize=7)
        ax.set_ylabel("val top-1")
    ax.set_title(title or "probes: val top-1 (the chosen one marked)", fontsize=9)
    return fig


class ProbeTable(Callback):
    """Writes ``<save_dir>/probes.csv`` after each validation of a ``module=probe_grid`` fit (:func:`probe_rows`)
    and draws ``<save_dir>/probes.png`` (:func:`plot_probes`) when the fit ends. Global rank 0 only (the values are
    synced); nothing for a module without probes."""

    def __init__(self, save_dir: str | Path) -> None:
        self.save_dir = Path(save_dir)
        self.rows: list[dict[str, Any]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        self.rows = probe_rows(trainer.callback_metrics, pl_module) or self.rows
        if self.rows:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            with open(self.save_dir / "probes.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(self.rows[0]))
                writer.writeheader()
                writer.writerows(self.rows)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and self.rows:
            title = f"{len(self.rows)} probes after epoch {trainer.current_epoch}: val top-1 (the chosen one marked)"
            save_png(plot_probes(self.rows, title), self.save_dir / "probes.png")
