"""On an exception while fitting, ``last.ckpt`` at the last completed optimizer step: :class:`ExceptionCheckpoint`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchmetrics import Metric

from vitrel.train.callbacks import ExactResume, NonFiniteLossError
from vitrel.train.last_checkpoint import LastCheckpoint

__all__ = ["ExceptionCheckpoint"]

log = logging.getLogger(__name__)


@dataclass
class _Snapshot:
    """What a checkpoint written at the end of an optimizer step's batch holds that moves without a step."""

    step: int  # trainer.global_step
    loops: dict[str, Any]  # trainer.fit_loop.state_dict(): a checkpoint's loops["fit_loop"]
    resume: dict[str, Any] | None  # ExactResume.state_dict(): RNG states, loader position (None: no ExactResume)
    metric_updates: list[int]  # the LightningModule's torchmetrics' update_count


class ExceptionCheckpoint(Checkpoint):
    """When fitting stops on an exception (a corrupt image raising in the loader, an out-of-memory in a batch's
    forward, a bug in a callback, Ctrl-C), write ``last.ckpt`` as :class:`~vitrel.train.last_checkpoint.LastCheckpoint`
    would have written it at the end of the last completed optimizer step, so that ``resume=auto`` continues exactly
    from there; then the exception goes on.

    At the end of each batch that ran an optimizer step it keeps what moves without a step: the loops' state
    (``trainer.fit_loop.state_dict()``) and :class:`~vitrel.train.callbacks.ExactResume`'s state (the RNG states and
    the training loader's position). On the exception, when nothing else a checkpoint holds can have changed since (no
    optimizer step began, no validation ran, no torchmetrics metric of the LightningModule counted another batch, the
    step's batch is done and the next one of the same epoch is being fetched or has not reached its step), it calls
    ``LastCheckpoint.save`` (the same file and writer), and its ``on_save_checkpoint`` puts those two kept states in
    the checkpoint in place of the current ones: Lightning collects every callback's ``state_dict`` before it calls any
    ``on_save_checkpoint``, and calls checkpoint callbacks such as this one after the others. Nothing of the trainer
    or of the RNGs is changed.

    Not saved: a ``NonFiniteLossError`` (the weights may hold bad steps), ``SIGTERMException`` (the signal path saved),
    an exception with more than one process (saving needs every rank), one with no step since the last save, and
    (with a warning saying why) the cases above where more than those states changed. An exception while the loggers
    record the step's row (after its batch is done, before the next fetch) saves too; that row can then be missing.
    """

    def __init__(self) -> None:
        self._snap: _Snapshot | None = None
        self._saving: _Snapshot | None = None  # while LastCheckpoint.save runs for the exception
        self._stepping = False  # an optimizer step began since the snapshot
        self._validated = False  # a validation began since the snapshot
        self._last: LastCheckpoint | None = None
        self._resume: ExactResume | None = None
        self._metrics: list[Metric] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._snap, self._stepping, self._validated = None, False, False
        self._last = next((cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)), None)
        self._resume = next((cb for cb in trainer.callbacks if isinstance(cb, ExactResume)), None)
        self._metrics = [m for m in pl_module.modules() if isinstance(m, Metric)]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepping = True

    def on_validation_start(self, trainer, pl_module) -> None:
        self._validated = True  # its results (the best checkpoint, the val rows) are not in the snapshot

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._stepping:
            return  # no optimizer step in this batch (gradient accumulation): the last snapshot stays
        self._stepping = self._validated = False
        self._snap = _Snapshot(
            trainer.global_step,
            trainer.fit_loop.state_dict(),  # built anew by each call (no copy needed: a deepcopy is 50 us more)
            self._resume.state_dict() if self._resume is not None else None,
            [m.update_count for m in self._metrics],
        )

    def on_train_end(self, trainer, pl_module) -> None:
        self._snap = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        snap, self._snap, last = self._snap, None, self._last
        if last is None or snap is None or last.last_saved_step == snap.step:
            return  # nothing to add to the last save
        if isinstance(exception, (NonFiniteLossError, SIGTERMException)):
            return
        try:  # whatever happens here, the exception that stopped the run goes on
            why = self._why_not(trainer, snap)
            if why:
                log.warning(f"last.ckpt not updated to step {snap.step} before the exception: {why}")
                return
            self._saving = snap
            try:
                saved = last.save(trainer)
            finally:
                self._saving = None
            if saved:
                log.warning(f"saved last.ckpt at step {snap.step} before the exception: resume with resume=auto")
        except Exception as err:
            log.warning(f"could not save last.ckpt at step {snap.step} before the exception: {err!r}")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """During the exception's save: the snapshot's loops and ExactResume states in place of the current ones
        (the callbacks' states are in ``checkpoint`` before any ``on_save_checkpoint`` runs)."""
        snap = self._saving
        if snap is None:
            return
        checkpoint["loops"]["fit_loop"] = snap.loops
        if snap.resume is not None:
            checkpoint["callbacks"][self._resume.state_key] = snap.resume

    def _why_not(self, trainer: L.Trainer, snap: _Snapshot) -> str | None:
        """Why a save now would not be the checkpoint of the snapshot's step with its states put back (None: it
        would)."""
        if trainer.world_size > 1:
            return f"the exception was on one of {trainer.world_size} processes, and saving needs every process"
        if self._stepping or trainer.global_step != snap.step:
            return "the exception came during or right after an optimizer step"
        if self._validated:
            return "the exception came in or after a validation"
        if [m.update_count for m in self._metrics] != snap.metric_updates:
            return "the failed batch already counts in the epoch's training metrics"
        now = trainer.fit_loop.state_dict()
        bp, then = now["epoch_loop.batch_progress"], snap.loops["epoch_loop.batch_progress"]["current"]
        done, ready = bp["current"]["completed"], bp["current"]["ready"]
        if done == then["completed"]:  # the step's batch still in its on_train_batch_end
            return "the exception came before the last step's batch was done"
        between = ready == done and done < trainer.num_training_batches and not bp["is_last_batch"]
        inside = ready == done + 1 and bp["current"]["processed"] == done  # the next batch, before its step
        same_epoch = now["epoch_progress"] == snap.loops["epoch_progress"]
        if not (trainer.training and same_epoch and (between or inside)):
            return "the exception came outside a training batch (in validation or at the epoch's end)"
        if done != then["completed"] + 1:
            return "a batch without an optimizer step (gradient accumulation) ran since the last step"
        return None
