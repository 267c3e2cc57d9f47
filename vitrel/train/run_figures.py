"""The figures of a fit and of a test that a run's ``metrics.json`` records, read where the fit and the test ran:
:class:`RunFigures`, which brings them back to the process that writes the record under any strategy."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from vitrel.data.unreadable import ReportUnreadable
from vitrel.train.progress import CountTestImages, CountValidations
from vitrel.train.summary import split_size

__all__ = ["RunFigures", "early_stop", "partial_epoch_steps"]


def partial_epoch_steps(trainer: L.Trainer) -> int:
    """At the end of a fit: the optimizer steps of the epoch it stopped in part-way (``trainer.max_steps``,
    ``trainer.max_time``, a callback's ``trainer.should_stop``), 0 when its last epoch ran to its end. Lightning's
    own count: the epoch loop's batches, restored across a resume, one step per ``accumulate_grad_batches``."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    done = progress.current.completed
    if done == 0 or progress.is_last_batch:
        return 0
    return done // max(1, trainer.accumulate_grad_batches)


def early_stop(trainer: L.Trainer) -> str | None:
    """``"EarlyStopping in epoch 3 (<its reason>)"`` when an ``EarlyStopping`` callback stopped the fit, else None."""
    for cb in trainer.callbacks:
        if isinstance(cb, EarlyStopping) and cb.stopping_reason != EarlyStoppingReason.NOT_STOPPED:
            return f"EarlyStopping in epoch {cb.stopped_epoch + 1} ({cb.stopping_reason_message})"
    return None


class RunFigures(Callback):
    """At the end of a fit (``epochs``: completed; ``partial_epoch_steps``, ``global_step``, ``val_runs``,
    ``stopped_by``: :func:`early_stop`) and of a test
    (``test_images``, ``test_split_images``, ``classes_note``), puts those figures into ``trainer.callback_metrics``
    under one key; :meth:`take` removes them there, in the process that called ``trainer.fit`` / ``trainer.test``.

    Under ``ddp_spawn`` Lightning fits and tests in spawned processes and sends back only their rank 0's
    ``callback_metrics``, best checkpoint path and weights: the calling process's trainer keeps ``global_step`` and
    ``current_epoch`` at 0, and its callbacks (``validated``, ``counted``, ``unreadable``) their counts untouched. The
    figures travel in the ``callback_metrics`` sent back; under other strategies they are taken from the same dict in
    the same process. Add it after the callbacks it reads: their ``on_test_end`` (the test images summed over the
    ranks) runs before its own.
    """

    KEY = "vitrel/run_figures"  # (a dict, not a metric: scalars() and the loggers leave it out)

    def __init__(
        self, counted: CountTestImages, unreadable: ReportUnreadable, validated: CountValidations | None = None
    ) -> None:
        self.counted, self.unreadable, self.validated = counted, unreadable, validated

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = partial_epoch_steps(trainer)
        epochs = trainer.current_epoch - (1 if steps else 0)  # (Lightning counts an epoch a stop ended as done)
        figures = {"epochs": epochs, "partial_epoch_steps": steps, "global_step": trainer.global_step}
        figures["stopped_by"] = early_stop(trainer)
        val_runs = self.validated.count if self.validated is not None else None
        trainer.callback_metrics[self.KEY] = {"stage": "fit", **figures, "val_runs": val_runs}

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        left_out = list(self.unreadable.left_out.get(self.unreadable.test_split, ()))
        trainer.callback_metrics[self.KEY] = {
            "stage": "test",
            "test_images": self.counted.count,
            "test_split_images": split_size(trainer.test_dataloaders, left_out),
            "unreadable": left_out,
            "classes_note": self.counted.classes_note(),
        }

    def take(self, trainer: L.Trainer, stage: str) -> dict[str, Any]:
        """The figures of the ``stage`` (``"fit"``, ``"test"``) the trainer ran last, removed from its
        ``callback_metrics``."""
        figures = trainer.callback_metrics.pop(self.KEY, None)
        if not isinstance(figures, dict) or figures.get("stage") != stage:
            raise RuntimeError(f"the {stage} ended without RunFigures' record of it in trainer.callback_metrics")
        return {k: v for k, v in figures.items() if k != "stage"}
