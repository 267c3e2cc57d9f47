"""``last.ckpt``, the file a run resumes from (``ckpt_path=last``): :class:`LastCheckpoint` writes it
(``callbacks.last_checkpoint``), :func:`last_checkpoint_path` / :func:`last_checkpoint_file` find it, and
:func:`save_checkpoint` is the writer the other checkpoint callbacks share (:mod:`vitrel.train.callbacks`,
:mod:`vitrel.train.crash_checkpoint`). ``vitrel.train.callbacks`` re-exports them (configs written before they moved
name them there)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint, StochasticWeightAveraging

from vitrel.train.loop_rules import mid_window, validates_after

__all__ = [
    "LastCheckpoint",
    "last_checkpoint_path",
    "last_checkpoint_file",
    "save_checkpoint",
    "flush_loggers",
]


def last_checkpoint_path(trainer: L.Trainer) -> Path | None:
    """The ``last.ckpt`` the trainer writes: its :class:`LastCheckpoint`'s, else that of a ModelCheckpoint
    with ``save_last``; None without either."""
    return last_checkpoint_file(trainer.callbacks, trainer.default_root_dir)


def last_checkpoint_file(callbacks: Sequence[Callback], root_dir: str | Path) -> Path | None:
    """The ``last.ckpt`` that ``callbacks`` write in a trainer whose ``default_root_dir`` is ``root_dir``
    (see :func:`last_checkpoint_path`); usable before the trainer exists."""
    for cb in callbacks:
        if isinstance(cb, LastCheckpoint):
            return cb.path_in(root_dir)
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath is not None:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    return None


class LastCheckpoint(Checkpoint):
    """``<dirpath>/last.ckpt`` (always overwritten): at the end of every training epoch (after
    validation), and optionally every ``every_n_train_steps`` optimizer steps or every
    ``every_n_minutes`` of training, mid-epoch, and at the step the fit stops mid-epoch
    (``trainer.max_steps``, ``trainer.max_time``, ``trainer.should_stop``). ``dirpath`` defaults to
    ``<default_root_dir>/checkpoints``.

    A Lightning ``Checkpoint``: Lightning calls checkpoint callbacks last, in their list order, and at the end
    of an epoch after the LightningModule's own hook. This one moves itself behind every other checkpoint
    callback when fitting starts, so ``last.ckpt`` holds their state after this epoch's update: a
    ``ModelCheckpoint``'s best files and score, which a resumed run then continues (``save_top_k`` holds
    across the resume: the old best file is replaced, not kept beside the new one).

    Written with ``trainer.save_checkpoint`` at the points where Lightning's ``ModelCheckpoint``
    writes (the end of a training batch, the end of the epoch), so a run resumes from it exactly; the
    file itself goes through the trainer's checkpoint IO (``train()`` installs
    :class:`~vitrel.train.ckpt_io.AtomicCheckpointIO`: the previous file survives a failed write).
    The loggers are flushed before each save and again at the next batch, after the saved step's own
    row is logged: every row up to the checkpoint is on disk when a run resumes from it.
    A callback of its own because ``ModelCheckpoint``'s step, time and epoch triggers are mutually
    exclusive, and because one that monitors a validation metric defers its step checkpoints until
    that metric exists.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = None,
        filename: str = "last.ckpt",
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1 or None, got {every_n_train_steps}")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self.filename = filename
        self._last_step = -1
        self._last_time = time.monotonic()
        self._flush_pending = False
        self._stopped = False  # a stop was asked for mid-epoch (its step saved)
        self._stop_val = False  # the validation after the stop's step is one Lightning runs only for the stop
        self._after_val = False  # this step's save waits for the validation Lightning runs after its batch

    def path(self, trainer: L.Trainer) -> Path:
        return self.path_in(trainer.default_root_dir)

    def path_in(self, root_dir: str | Path) -> Path:
        """The file, for a trainer whose ``default_root_dir`` is ``root_dir``."""
        return Path(self.dirpath or Path(root_dir) / "checkpoints") / self.filename

    @property
    def stopped_mid_epoch(self) -> bool:
        """``last.ckpt`` was written at the step the fit stopped on mid-epoch (its epoch's end hooks come early)."""
        return self._stopped

    @property
    def stop_validation(self) -> bool:
        """The validation after the stopping step is one Lightning runs only because the fit stops mid-epoch
        (``trainer.max_time``, ``trainer.should_stop``), not one of ``trainer.val_check_interval``'s: ``last.ckpt`` is
        of before it."""
        return self._stop_val

    @property
    def last_saved_step(self) -> int | None:
        """The global step of the last ``last.ckpt`` written by this callback in this process (None: none yet)."""
        return self._last_step if self._last_step >= 0 else None

    def save(self, trainer: L.Trainer) -> bool:
        """Write ``last.ckpt`` now (all ranks call this; rank 0 writes), unless this step is saved already: written?"""
        if trainer.fast_dev_run or trainer.sanity_checking or self._last_step == trainer.global_step:
            return False
        save_checkpoint(trainer, self.path(trainer))
        self._last_step = trainer.global_step
        self._last_time = time.monotonic()
        self._flush_pending = True
        return True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # behind the other checkpoint callbacks (a new list: the hook's loop runs on the old one)
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_time = time.monotonic()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._flush_pending:  # the row of the step saved last is logged by now
            flush_loggers(trainer)
            self._flush_pending = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_minutes:
            due = time.monotonic() - self._last_time >= 60.0 * self.every_n_minutes
            due = bool(trainer.strategy.broadcast(due))  # rank 0's clock decides for all
        elif self.every_n_train_steps:
            due = trainer.global_step > 0 and trainer.global_step % self.every_n_train_steps == 0
        else:
            due = False
        # the fit stops mid-epoch (trainer.max_steps reached, trainer.max_time, a callback's trainer.should_stop):
        # this step's checkpoint, so that a resume trains the epoch's remaining batches (Lightning then runs the
        # epoch's end hooks early: a file written there would resume at the next epoch); the epoch's end keeps it
        steps_done = trainer.max_steps not in (-1, None) and trainer.global_step >= trainer.max_steps
        mid_epoch = batch_idx + 1 < trainer.num_training_batches
        self._stopped = (trainer.should_stop or steps_done) and mid_epoch
        due = (due or self._stopped) and mid_epoch  # (at the epoch's last batch, the epoch's end saves)
        validates = due and validates_after(trainer)
        self._stop_val = self._stopped and not validates
        if due and not mid_window(trainer, batch_idx):  # (a window's end is due as well: the time or step count holds)
            if validates:  # (trainer.val_check_interval) a file of before it would resume past it, never run
                self._after_val = True
            else:
                self.save(trainer)

    def save_after_validation(self) -> None:
        """Write ``last.ckpt`` (again, though this step is saved) at the end of the validation that follows this
        training batch."""
        self._after_val = True
        self._last_step = -1

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._after_val and not trainer.sanity_checking:
            self._after_val = False
            self.save(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._after_val = False  # (a validation that did not run: no batches)
        self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's StochasticWeightAveraging copies its average into the network now, after the last epoch's save
        # (a network without BatchNorm; with it, an extra epoch updates the statistics and its end saves): again, so
        # last.ckpt holds the weights the test scores
        # (not over a stop's mid-epoch file, which a resume needs)
        if not self._stopped and any(swa_averaged_at_end(cb, trainer, pl_module) for cb in trainer.callbacks):
            self._last_step = -1
            self.save(trainer)


def swa_averaged_at_end(cb: Callback, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
    """``cb`` is a ``StochasticWeightAveraging`` that puts its average into ``pl_module`` in this ``on_train_end``
    (Lightning's rule: the fit ran to its last SWA epoch, and no BatchNorm layer needed an extra epoch)."""
    if not isinstance(cb, StochasticWeightAveraging) or cb.pl_module_contains_batch_norm(pl_module):
        return False
    return trainer.current_epoch - 1 == cb.swa_end or trainer.max_epochs == -1


def flush_loggers(trainer: L.Trainer) -> None:
    """Write what the loggers hold in memory (CSV rows, TensorBoard events) to disk (``Logger.save``)."""
    for lg in trainer.loggers:
        lg.save()


def save_checkpoint(trainer: L.Trainer, path: Path) -> None:
    """``trainer.save_checkpoint`` of the whole training state (``weights_only=False``, said explicitly:
    Lightning logs a line on every save otherwise), the loggers flushed first so that the rows logged
    before it are on disk whenever it is."""
    flush_loggers(trainer)
    trainer.save_checkpoint(str(path), weights_only=False)
