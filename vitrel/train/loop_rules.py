"""Lightning's rules for where its training loop steps and validates, read from the trainer's and the loops' public
state: :func:`mid_window` (a batch that only accumulated its gradient) and :func:`validates_after` (Lightning
validates after this batch). The checkpoint callbacks (:mod:`vitrel.train.callbacks`) save where a resume continues
exactly."""

from __future__ import annotations

import lightning as L

__all__ = ["mid_window", "validates_after"]


def validates_after(trainer: L.Trainer) -> bool:
    """In ``on_train_batch_end``: Lightning validates after this batch, before the next, in a fit that goes on
    (``trainer.val_check_interval``, ``check_val_every_n_epoch``, an epoch's last batch). A checkpoint of this step
    written before that validation resumes past it (Lightning counts a step saved at its batch's end as validated), so
    it is written at the validation's end. A stop (``trainer.should_stop``) does not count: Lightning validates then as
    well, a validation the fit that goes on would not run.

    Lightning's rule (``_TrainingEpochLoop._should_check_val_fx``) from the trainer's and the epoch loop's public
    state. Not covered, read as no validation (the step saved before it, as before): a time-based
    ``trainer.val_check_interval`` (``"00:00:10:00"``; its clock is Lightning's private state) and a ``training_step``
    taking ``dataloader_iter`` (vitrel's modules take batches)."""
    if not trainer.enable_validation:
        return False
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every != 0:
        return False
    loop = trainer.fit_loop.epoch_loop
    last = loop.batch_progress.is_last_batch
    batches = trainer.val_check_batch  # (None: time-based)
    if batches is None:
        return False
    infinite = batches == float("inf")  # (a training loader without a length, or val_check_interval=1.0)
    if last and infinite:
        return True
    if isinstance(trainer.limit_train_batches, int) and infinite:
        return (loop.batch_idx + 1) % trainer.limit_train_batches == 0
    if not infinite:
        at = loop.total_batch_idx if every is None else loop.batch_idx
        return (at + 1) % int(batches) == 0
    return last


def mid_window(trainer: L.Trainer, batch_idx: int) -> bool:
    """In ``on_train_batch_end`` of batch ``batch_idx``: the batch only accumulated its gradient
    (``trainer.accumulate_grad_batches``), the window's optimizer step is still to come. A checkpoint there would lose
    that gradient (none holds it): the resumed run would step on the window's later batches alone.

    Lightning's rule: a step at every ``accumulate_grad_batches``-th batch of the epoch and at its last batch (unless
    the strategy accumulates itself, as DeepSpeed does). The last batch is known from ``trainer.num_training_batches``:
    with a training loader without a length, an epoch's last, partial window counts as unfinished here (no step or
    signal checkpoint at its end; the epoch's end saves it)."""
    n = trainer.accumulate_grad_batches
    if n <= 1 or (batch_idx + 1) % n == 0:
        return False
    return trainer.strategy.handles_gradient_accumulation or batch_idx + 1 < trainer.num_training_batches
