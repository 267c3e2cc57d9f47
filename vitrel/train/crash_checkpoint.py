"""On an exception while fitting, ``last.ckpt`` at the last completed optimizer step: :class:`ExceptionCheckpoint`."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchmetrics import Metric

from vitrel.train.callbacks import LastCheckpoint, NonFiniteLossError

__all__ = ["ExceptionCheckpoint"]

log = logging.getLogger(__name__)


def _progress_objects(loop: _Loop) -> list[Any]:
    """Every progress counter object (Lightning's ``_BaseProgress`` dataclasses and the ones nested in them) of ``loop``
    and its sub-loops: what the loops' ``state_dict`` is made of, besides ``on_save_checkpoint``."""
    out: list[Any] = []

    def add(p: Any) -> None:
        out.append(p)
        for v in vars(p).values():
            if isinstance(v, _BaseProgress):
                add(v)

    def walk(lp: _Loop) -> None:
        for v in vars(lp).values():
            if isinstance(v, _BaseProgress):
                add(v)
            elif isinstance(v, _Loop):
                walk(v)

    walk(loop)
    return out


class ExceptionCheckpoint(Checkpoint):
    """When fitting stops on an exception (a corrupt image raising in the loader, an out-of-memory in a batch's
    forward, a bug in a callback, Ctrl-C), write ``last.ckpt`` as :class:`~vitrel.train.callbacks.LastCheckpoint`
    would have written it at the end of the last completed optimizer step, so that ``resume=auto`` continues exactly
    from there; then the exception goes on.

    At the end of each batch that completed an optimizer step it keeps what moves without a step: the RNG states (torch,
    CUDA, numpy, python), the loops' progress counters and the training loader's position. On the exception, when
    nothing a checkpoint holds can have changed since but those (no optimizer step began, no epoch metric counted the
    failed batch, no validation ran, the epoch is not at its end), they are put back for the save
    (``LastCheckpoint.save``: the same file and writer) and restored after it.

    Not saved: a ``NonFiniteLossError`` (the weights may hold bad steps), ``SIGTERMException`` (the signal path saved),
    an exception with more than one process (saving needs every rank), one with no step since the last save, and one
    after the failed batch counted in the LightningModule's torchmetrics (``ClassifierModule``'s epoch totals: an
    exception in its backward pass) or after its optimizer step began.
    """

    def __init__(self) -> None:
        self._snap: _Snapshot | None = None
        self._stepping = False  # an optimizer step began after the snapshot
        self._validated = False  # a validation began after it
        self._progress: list[Any] = []
        self._metrics: list[Metric] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._snap, self._stepping, self._validated = None, False, False
        self._progress = _progress_objects(trainer.fit_loop)
        self._metrics = [m for m in pl_module.modules() if isinstance(m, Metric)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._snap is not None and self._snap.step == trainer.global_step:
            return  # no optimizer step in this batch (gradient accumulation): the last snapshot stays
        self._stepping = self._validated = False
        self._snap = _Snapshot(
            trainer.global_step,
            trainer.current_epoch,
            trainer.fit_loop.epoch_loop.batch_progress.current.completed,
            [m.update_count for m in self._metrics],
            self._state(trainer),
        )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepping = True

    def on_validation_start(self, trainer, pl_module) -> None:
        self._validated = True  # its results (the best checkpoint, the val rows) are not in the snapshot

    def on_train_end(self, trainer, pl_module) -> None:
        self._snap = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        last = next((cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)), None)
        snap, self._snap = self._snap, None
        if last is None or snap is None or last._last_step == snap.step:
            return  # nothing to add to the last save
        if isinstance(exception, (NonFiniteLossError, SIGTERMException)):
            return
        try:  # whatever happens here, the exception that stopped the run goes on
            why = self._why_not(trainer, snap)
            if why:
                log.warning(f"last.ckpt not updated to step {snap.step} before the exception: {why}")
            elif self._save(trainer, last, snap):
                log.warning(f"saved last.ckpt at step {snap.step} before the exception: resume with resume=auto")
        except Exception as err:
            log.warning(f"could not save last.ckpt at step {snap.step} before the exception: {err!r}")

    def _save(self, trainer: L.Trainer, last: LastCheckpoint, snap: _Snapshot) -> bool:
        """``last.save`` with the snapshot's RNG states, counters and loader position in place; then today's back."""
        now = self._state(trainer)
        self._put(trainer, snap.state, position=True)
        try:
            return last.save(trainer)
        finally:
            self._put(trainer, now, position=False)

    def _why_not(self, trainer: L.Trainer, snap: _Snapshot) -> str | None:
        """Why a save now would not hold the state at the snapshot's step (None: it would)."""
        if trainer.world_size > 1:
            return f"the exception was on one of {trainer.world_size} processes, and saving needs every process"
        if self._stepping or trainer.global_step != snap.step:
            return "the exception came during or right after an optimizer step"
        if self._validated:
            return "the exception came in or after a validation"
        if [m.update_count for m in self._metrics] != snap.metric_updates:
            return "the failed batch already counts in the epoch's training metrics"
        epoch_loop = trainer.fit_loop.epoch_loop
        bp = epoch_loop.batch_progress.current
        # the snapshot's batch completed; now fetching the next one of this epoch, or inside it (not yet processed)
        fetching = bp.ready == bp.completed and not epoch_loop._num_ready_batches_reached()
        in_batch = bp.ready == bp.completed + 1 and bp.processed == bp.completed
        next_batch = bp.completed == snap.completed + 1 and trainer.current_epoch == snap.epoch
        if not (trainer.training and next_batch and (fetching or in_batch)):
            return "the exception came outside a training batch (in validation or at the epoch's end)"
        if epoch_loop._batches_that_stepped != snap.state.batches_that_stepped + 1:
            return "the exception came between batches, before the last step's batch was done"
        return None

    def _state(self, trainer: L.Trainer) -> _State:
        loader = trainer.train_dataloader
        return _State(
            (torch.get_rng_state(), np.random.get_state(), random.getstate(), _cuda_rng()),
            [vars(p).copy() for p in self._progress],
            trainer.fit_loop.epoch_loop._batches_that_stepped,
            loader.state_dict() if hasattr(loader, "state_dict") else None,
        )

    def _put(self, trainer: L.Trainer, state: _State, position: bool) -> None:
        """Set the RNG states and progress counters to ``state``'s; ``position``: the training loader's
        ``state_dict()`` returns ``state``'s position until called again with ``position=False``."""
        torch_rng, np_rng, py_rng, cuda_rng = state.rng
        torch.set_rng_state(torch_rng)
        np.random.set_state(np_rng)
        random.setstate(py_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for p, saved in zip(self._progress, state.progress):
            vars(p).update(saved)
        trainer.fit_loop.epoch_loop._batches_that_stepped = state.batches_that_stepped
        loader = trainer.train_dataloader
        if position and state.loader is not None:
            loader.state_dict = lambda: dict(state.loader)  # an instance attribute over the method
        elif "state_dict" in getattr(loader, "__dict__", {}):
            del loader.state_dict


@dataclass
class _State:
    """What moves without an optimizer step: RNG states, loop counters, the loader's position."""

    rng: tuple
    progress: list[dict[str, Any]]
    batches_that_stepped: int
    loader: dict[str, Any] | None


@dataclass
class _Snapshot:
    step: int
    epoch: int
    completed: int  # the training batches of this epoch completed before the snapshot's (its own still counting)
    metric_updates: list[int]
    state: _State


def _cuda_rng() -> list[torch.Tensor] | None:
    return torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # (is_available(): ~60 us)
