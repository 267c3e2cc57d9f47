"""A run's training curves as a picture in its folder, ``curves.png`` (:class:`TrainingCurves`): the training and
validation loss against the epoch in one panel, their top-1 accuracy in another, the finished run's test accuracy
marked. It needs no logger: the values are those the module logs, read from ``trainer.callback_metrics`` at each
epoch's end, and kept in the checkpoints, so a resumed run draws the whole run."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from vitrel.train.last_checkpoint import last_checkpoint_path
from vitrel.train.sweep_plot import save_png

__all__ = ["TrainingCurves", "plot_curves"]

#: the epoch values recorded, by stage: (key in ``callback_metrics``, the panel's: "loss" / "acc1")
KEYS = {
    "train": (("train/loss_epoch", "loss"), ("train/acc1", "acc1")),
    "val": (("val/loss", "loss"), ("val/acc1", "acc1")),
    "test": (("test/loss", "loss"), ("test/acc1", "acc1")),
}


def _value(metrics: dict[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):  # (a non-scalar entry: not a metric)
        return None


class TrainingCurves(Callback):
    """Records the epoch values of the training loss and top-1 accuracy (``train/loss_epoch``, ``train/acc1``) as each
    training epoch ends, the validation's (``val/loss``, ``val/acc1``) as each validation ends and the test's
    (``test/loss``, ``test/acc1``) as the test ends, and draws them into ``<save_dir>/<filename>``: at each training
    epoch's end and at a validation's end inside an epoch (``trainer.val_check_interval``), at most once every
    ``min_interval_s`` seconds (the first chance draws), then whatever is not drawn yet when the fit ends (also by an
    exception) and after the test. Only the global rank 0 draws (every rank records the same, synced values).

    A record's ``x`` is the epochs trained when it was logged: ``current_epoch`` plus the share of the epoch's
    batches done (1.0 at an epoch's end; less for a validation inside an epoch or a ``trainer.max_steps`` stop). The
    records are the callback's state in the checkpoints: a resumed run keeps those up to its checkpoint. One resumed
    from a checkpoint written without them (``unknown_before``: its step) says so in the picture's title.

    Under ``ddp_spawn`` the fit and the test run in different spawned processes, each given the callback as the
    calling process has it (no records): the test's draw takes the fit's from ``last.ckpt``.
    """

    def __init__(self, save_dir: str | Path, filename: str = "curves.png", min_interval_s: float = 30.0) -> None:
        if not min_interval_s >= 0:
            raise ValueError(f"TrainingCurves: min_interval_s={min_interval_s!r}: seconds, 0 or more (0: every epoch)")
        self.path = Path(save_dir) / filename
        self.min_interval_s = float(min_interval_s)
        self._drawn_at = -math.inf  # (time.monotonic() of the last draw)
        self._undrawn = False  # records not in the picture yet
        self.records: list[dict[str, Any]] = []  # {"stage", "epoch", "step", "x", <key>: value, ...}
        self.loaded = False  # records taken from a checkpoint
        self.unknown_before: int | None = None  # the step of a resumed checkpoint written without records

    # ------------------------------------------------------------------------------ recording
    def _record(self, trainer: L.Trainer, stage: str) -> bool:
        metrics = trainer.callback_metrics
        values = {k: v for k, _ in KEYS[stage] if (v := _value(metrics, k)) is not None}
        if not values:
            return False
        x = float(trainer.current_epoch) + self._share(trainer) if stage != "test" else None
        rec = {"stage": stage, "epoch": trainer.current_epoch, "step": trainer.global_step, "x": x, **values}
        # one record per stage and step (work done again after a resume: the later value), one test
        at = (rec["epoch"], rec["step"])
        kept = [r for r in self.records if r["stage"] != stage or (stage != "test" and (r["epoch"], r["step"]) != at)]
        self.records = [*kept, rec]
        self._undrawn = True
        return True

    @staticmethod
    def _share(trainer: L.Trainer) -> float:
        """The share of the current epoch's batches done (1.0 where the number of batches is unknown)."""
        total = trainer.num_training_batches
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        if not isinstance(total, int | float) or not math.isfinite(total) or total <= 0:
            return 1.0
        return min(done / total, 1.0)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0 and not self.loaded:  # (resumed from a checkpoint written before the records)
            self.unknown_before = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, "train")
        self._draw(trainer, pl_module, due=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._record(trainer, "val"):
            return
        if self.records[-1]["x"] < trainer.current_epoch + 1:  # inside the epoch (its end draws with the train value)
            self._draw(trainer, pl_module, due=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._undrawn:
            self._draw(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._undrawn:  # (a crash or Ctrl-C: the picture of what was recorded)
            self._draw(trainer, pl_module)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not any(r["stage"] != "test" for r in self.records):  # ddp_spawn: the fit's records, in last.ckpt
            self._records_of_last_checkpoint(trainer)
            if not any(r["stage"] != "test" for r in self.records) and self.path.exists():
                return  # (no last.ckpt: the fit's picture kept, not replaced by the test's line alone)
        if self._record(trainer, "test"):
            self._draw(trainer, pl_module)

    def _records_of_last_checkpoint(self, trainer: L.Trainer) -> None:
        last = last_checkpoint_path(trainer)
        if last is None or not last.is_file():
            return
        ckpt = torch.load(last, map_location="cpu", weights_only=True, mmap=True)  # (mmap: the weights left unread)
        state = (ckpt.get("callbacks") or {}).get(self.state_key)
        if state is not None:
            self.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        kept = [dict(r) for r in self.records if r["stage"] != "test"]
        return {"records": kept, "unknown_before": self.unknown_before}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = [dict(r) for r in state_dict.get("records", [])]
        self.unknown_before, self.loaded = state_dict.get("unknown_before"), True

    # ------------------------------------------------------------------------------ drawing
    def title(self, pl_module: L.LightningModule) -> str:
        """The model's architecture and position scheme (its ``vitrel_cfg``), where it has them, and whether the
        validation and test score the EMA weights (the training values are always the raw weights')."""
        cfg = getattr(getattr(pl_module, "model", None), "vitrel_cfg", None) or {}
        pos = cfg.get("pos")
        pos = pos.get("name") if isinstance(pos, dict) else pos
        parts = [str(cfg["architecture"])] if cfg.get("architecture") else []
        if pos:
            parts.append(f"pos={pos}")
        title = " ".join(parts) or type(getattr(pl_module, "model", pl_module)).__name__
        scored = getattr(pl_module, "scored_network", None)
        if scored is not None and scored is not getattr(pl_module, "model", None):  # (module.ema_eval)
            title += " (validation and test: the EMA weights)"
        return title

    def _draw(self, trainer: L.Trainer, pl_module: L.LightningModule, due: bool = False) -> None:
        """Draws on global rank 0; ``due``: a redraw during the fit, skipped within ``min_interval_s`` of the last."""
        if not (trainer.is_global_zero and self.records):
            return
        if due and time.monotonic() - self._drawn_at < self.min_interval_s:
            return
        self.draw(pl_module)

    def draw(self, pl_module: L.LightningModule) -> None:
        """The records as ``self.path``, replaced whole (the hooks call it on global rank 0 only)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        title = self.title(pl_module)
        if self.unknown_before is not None:
            title += f" (values before step {self.unknown_before} unknown: not in the checkpoint resumed)"
        save_png(plot_curves(self.records, title), self.path)
        self._drawn_at, self._undrawn = time.monotonic(), False


def plot_curves(records: list[dict[str, Any]], title: str):
    """``records`` (:class:`TrainingCurves`') as a two-panel ``matplotlib.figure.Figure`` (no pyplot): loss, and top-1
    accuracy in %, against the epoch; the test's values as a dashed line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.6), layout="constrained")
    axes = dict(zip(("loss", "acc1"), fig.subplots(1, 2)))
    scale = {"loss": 1.0, "acc1": 100.0}
    style = {"train": ("C0", "o", "training"), "val": ("C1", "s", "validation")}
    for stage in ("train", "val"):
        color, marker, name = style[stage]
        for key, panel in KEYS[stage]:
            pts = [(r["x"], r[key]) for r in records if r["stage"] == stage and key in r]
            if pts:
                xs, ys = zip(*pts)
                axes[panel].plot(xs, [y * scale[panel] for y in ys], color=color, marker=marker, ms=3, lw=1.2,
                                 label=f"{name} ({key})")  # fmt: skip
    for r in records:
        if r["stage"] == "test":
            for key, panel in KEYS["test"]:
                if key in r:
                    v = r[key] * scale[panel]
                    axes[panel].axhline(v, color="C2", ls="--", lw=1, label=f"test ({key}) {v:.4g}")
    trained = [r for r in records if r["stage"] != "test"]
    last = max((r["x"] for r in trained), default=0.0)
    for panel, label in (("loss", "loss"), ("acc1", "top-1 accuracy (%)")):
        ax = axes[panel]
        ax.set_xlabel("epoch", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlim(0, max(last, 1.0) * 1.02)
        ax.grid(color="0.9")
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            what = label.split(" (")[0]
            ax.text(0.5, 0.5, f"no {what} logged", transform=ax.transAxes, ha="center", color="0.5", fontsize=8)
    step = max((r["step"] for r in trained), default=0)
    fig.suptitle(f"{title}: {last:.3g} epochs, {step} steps", fontsize=9)
    return fig
