"""Lightning's rules for where its training loop steps and validates, read from the trainer's and the loops' public
state: :func:`mid_window` (a batch that only accumulated its gradient), :func:`validates_after` (Lightning
validates after this batch) and :func:`first_validation` (the optimizer step of a fit's first validation, and
whether the fit reaches it). The checkpoint callbacks (:mod:`vitrel.train.callbacks`) save where a resume continues
exactly."""

from __future__ import annotations

import math

import lightning as L

__all__ = ["mid_window", "validates_after", "first_validation", "resumed_epochs", "fit_steps"]


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


def first_validation(trainer: L.Trainer) -> tuple[float, bool] | None:
    """Once the training loader is set up (``on_train_start``): the optimizer steps done when a fit from its start
    first validates (``math.inf``: never, ``trainer.limit_val_batches=0`` or no validation loader), and whether the
    fit reaches that validation before ``trainer.max_steps`` or ``trainer.max_epochs`` end it. The batch it validates
    after is :func:`validates_after`'s first (``trainer.val_check_interval`` in batches or a fraction of the epoch,
    ``check_val_every_n_epoch``, ``None`` for batches counted across epochs); an epoch takes
    ``ceil(batches / accumulate_grad_batches)`` steps, its last batch stepping a partial window. None where the plan
    is not known before the fit: a time-based ``val_check_interval``, a training loader without a length, a strategy
    that accumulates gradients itself (DeepSpeed)."""
    if not trainer.enable_validation:
        return math.inf, False
    batches, n = trainer.val_check_batch, trainer.num_training_batches
    if batches is None or math.isinf(batches) or math.isinf(n) or trainer.strategy.handles_gradient_accumulation:
        return None
    every, k, batches, n = trainer.check_val_every_n_epoch, trainer.accumulate_grad_batches, int(batches), int(n)
    if every is None:  # (the batches counted over the fit)
        epoch, batch = divmod(batches - 1, n)
    elif batches > n:  # (the batches counted in each epoch: never reaches it)
        return math.inf, False
    else:
        epoch, batch = every - 1, batches - 1  # (0-based: the batch it validates after)
    per_epoch = math.ceil(n / k)
    before = epoch * per_epoch + batch // k  # the steps done as that batch starts
    at = epoch * per_epoch + (per_epoch if batch + 1 == n else (batch + 1) // k)
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    reached = (max_steps is None or max_steps < 0 or before < max_steps) and (
        max_epochs is None or max_epochs < 0 or epoch < max_epochs
    )
    return at, reached


def resumed_epochs(trainer: L.Trainer) -> int | None:
    """For a run of ``trainer.max_epochs`` resumed at an epoch's end (``on_train_start``), its optimizer steps an
    epoch (``ceil(batches / accumulate_grad_batches)``, which ``trainer.devices``, ``data.batch_size`` or
    ``accumulate_grad_batches`` changed since may make another count than the checkpoint's); None for a fresh fit,
    a resume inside an epoch (whose steps an epoch cannot change), a run of ``trainer.max_steps`` or a training loader
    without a length."""
    if trainer.max_steps != -1:
        return None
    batches, acc = trainer.num_training_batches, trainer.accumulate_grad_batches
    if not isinstance(batches, int) or batches < 1:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress  # (a checkpoint of an epoch's end: that epoch's, until reset)
    return -(-batches // acc) if progress.is_last_batch else None


def fit_steps(trainer: L.Trainer) -> float:
    """The optimizer step the fit ends at (``on_train_start``): Lightning's ``estimated_stepping_batches``, or for a
    run resumed at an epoch's end (:func:`resumed_epochs`) the checkpoint's steps plus the epochs left at this run's
    steps an epoch (Lightning's estimate counts every epoch at those)."""
    per_epoch = resumed_epochs(trainer)
    if per_epoch is None or trainer.max_epochs is None or trainer.max_epochs < 0:
        return trainer.estimated_stepping_batches
    return trainer.global_step + (trainer.max_epochs - trainer.current_epoch) * per_epoch


def window_scale(module: L.LightningModule, batch_idx: int) -> float:
    """The factor on ``module``'s loss of training batch ``batch_idx`` that makes an epoch's last, partial
    accumulation window step on its own batches' mean gradient: Lightning divides every loss by
    ``accumulate_grad_batches`` (``k``), so a last window of ``r < k`` batches stepped on ``r / k`` of it (an audit's:
    0.5 with ``k = 2``), where timm's ``train.py`` divides by ``r``. ``k / r`` in that window; 1 elsewhere, where the
    epoch's length is not known, where the strategy accumulates itself (DeepSpeed), and without a trainer."""
    try:
        trainer = module.trainer
    except RuntimeError:  # (not attached to a Trainer: a step called by hand)
        return 1.0
    k, n = trainer.accumulate_grad_batches, trainer.num_training_batches
    if k <= 1 or math.isinf(n) or trainer.strategy.handles_gradient_accumulation:
        return 1.0
    rest = int(n) % k
    return k / rest if rest and batch_idx >= int(n) - rest else 1.0
