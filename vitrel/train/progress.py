"""Progress for logs: :class:`LineProgress`, plain lines when stdout is not a terminal (training steps and epochs,
validation and test batches), :class:`StepLearningRateMonitor`, the rate of each optimizer step to the loggers, and
:class:`CountTestImages`, the images a test loop scored (fewer than the split's under ``trainer.limit_test_batches``
or ``fast_dev_run``), :class:`CountValidations`, the validations a fit ran, and :class:`DataSizes`, what a fit trains
and validates on."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ProgressBar, RichProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from vitrel.config import ConfigError
from vitrel.train.data_contract import is_video_data
from vitrel.train.loop_rules import fit_steps
from vitrel.train.summary import known_size

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = [
    "LineProgress",
    "StepLearningRateMonitor",
    "CountTestImages",
    "CountValidations",
    "WarnPartialValidation",
    "DataSizes",
    "data_sizes",
]


def _lr(trainer) -> float:
    """The first optimizer's largest group rate: the schedule's (``module.layer_decay`` gives the lower layers less)."""
    return max(g["lr"] for g in trainer.optimizers[0].param_groups) if trainer.optimizers else float("nan")


class StepLearningRateMonitor(LearningRateMonitor):
    """Lightning's ``LearningRateMonitor`` logging at most once per optimizer step (every
    ``trainer.log_every_n_steps``, as Lightning logs): the rate that step uses, read as its first
    batch starts (Lightning's logs it at every batch, so each step's row came ``accumulate_grad_batches`` times)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._logged_step: int | None = None

    def on_train_batch_start(self, trainer, *args, **kwargs) -> None:
        step = trainer.global_step  # (the optimizer steps taken: the step Lightning logs the rate at)
        if step != self._logged_step:
            self._logged_step = step
            super().on_train_batch_start(trainer, *args, **kwargs)


class LineProgress(Callback):
    """One plain line every ``every_n_steps`` optimizer steps (default: the trainer's ``log_every_n_steps``) and one
    per epoch (rank 0; its ``val/*`` when the epoch validated), for logs; validation and test (``eval.py``) print one
    every ``every_n_steps`` of their batches.
    Epochs count from 1 on every line. A step line ``step N/total`` is printed as optimizer step ``N`` ends:
    ``N`` is ``trainer.global_step`` then (under ``accumulate_grad_batches`` a step is several batches), ``total`` the
    step the fit ends at (:func:`~vitrel.train.loop_rules.fit_steps`: also after a resume on another number of
    processes); the loggers index that step ``N - 1``. Its ``lr`` is the rate the
    step used (read as its batches start: the scheduler moves it after the step), as the loggers' ``lr-*`` rows have
    it; under ``module.layer_decay`` the largest group's (the top layer's: the schedule's rate). Its ``img/s`` is the
    training images per second since the previous step line, over all processes (rank 0's count times the world
    size, timm's train.py convention), validation time left out; ``eta`` the fit's remaining steps at that pace."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self._lr = float("nan")
        self._step_before = 0  # trainer.global_step as the batch started: the batch ended a step when it moved
        self._validated = False  # a validation ran in this training epoch (its val/* are this epoch's)
        self._t0 = time.monotonic()
        self._t_eval = time.monotonic()
        self._window = _Window()  # the training images and time since the previous step line

    def _every(self, trainer) -> int:
        return self.every_n_steps if self.every_n_steps is not None else trainer.log_every_n_steps

    @staticmethod
    def _total(trainer) -> int | str:
        return trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"

    @staticmethod
    def _fmt(metrics: dict, keys: Sequence[str]) -> str:
        out = []
        for k in keys:
            if k in metrics:
                out.append(f"{k} {float(metrics[k]):.4g}")
        return "  ".join(out)

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = time.monotonic()  # a run resumed mid-epoch starts without on_train_epoch_start
        self._validated = False
        self._window = _Window(step=trainer.global_step)
        self._fit_steps = fit_steps(trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t0 = time.monotonic()
        self._validated = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._lr = _lr(trainer)
        self._step_before = trainer.global_step

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, every = trainer.global_step, self._every(trainer)
        if isinstance(batch, (list, tuple)) and len(batch) > 1 and hasattr(batch[1], "shape"):
            self._window.images += int(batch[1].shape[0])  # (the targets: one per image, NaFlex batches too)
        if every > 0 and step != self._step_before and step % every == 0:
            total = self._fit_steps
            m = trainer.callback_metrics
            pace = self._window.pace(step, total, trainer.world_size)
            self._window = _Window(step=step)
            print(
                f"epoch {trainer.current_epoch + 1} step {step}/{total if total != float('inf') else '?'}  "
                f"{self._fmt(m, ['train/loss_step'])}  lr {self._lr:.3g}{pace}",
                flush=True,
            )

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        m = trainer.callback_metrics
        keys = ["train/loss_epoch", "train/acc1"]
        if self._validated:  # (else m's val/* are an earlier epoch's: check_val_every_n_epoch > 1)
            keys += ["val/loss", "val/acc1", "val/acc5"]
        print(
            f"epoch {trainer.current_epoch + 1}/{self._total(trainer)}  {self._fmt(m, keys)}  "
            f"({time.monotonic() - self._t0:.1f} s)",
            flush=True,
        )

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._t_eval = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        self._validated = self._validated or not trainer.sanity_checking
        self._window.paused += time.monotonic() - self._t_eval  # (not training time: the pace leaves it out)

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self._t_eval = time.monotonic()

    def _eval_line(self, trainer, stage: str, totals, batch_idx: int, dataloader_idx: int) -> None:
        every = self._every(trainer)
        if every > 0 and (batch_idx + 1) % every == 0:
            total = totals[dataloader_idx] if isinstance(totals, (list, tuple)) else totals
            spent = time.monotonic() - self._t_eval
            left = _clock(spent / (batch_idx + 1) * (total - batch_idx - 1)) if total != float("inf") else "?"
            print(f"{stage} batch {batch_idx + 1}/{total}  ({spent:.1f} s, eta {left})", flush=True)

    @rank_zero_only
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._eval_line(trainer, "val", trainer.num_val_batches, batch_idx, dataloader_idx)

    @rank_zero_only
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._eval_line(trainer, "test", trainer.num_test_batches, batch_idx, dataloader_idx)


class _Window:
    """The training images and wall time since the previous step line (from ``step``), validation time apart."""

    def __init__(self, step: int = 0) -> None:
        self.step, self.images, self.paused, self.started = step, 0, 0.0, time.monotonic()

    def pace(self, step: int, total: float, world_size: int) -> str:
        """``"  412 img/s  eta 1:02:03"``: all processes' images per second in the window and the time the fit's
        remaining steps take at that pace (``""`` for a window of no steps, images or time)."""
        seconds = time.monotonic() - self.started - self.paused
        if step <= self.step or self.images == 0 or seconds <= 0:
            return ""
        out = f"  {self.images * world_size / seconds:.0f} img/s"
        if total != float("inf"):
            out += f"  eta {_clock((total - step) * seconds / (step - self.step))}"
        return out


def _clock(seconds: float) -> str:
    """``3723.9`` -> ``"1:02:03"``."""
    s = int(max(0.0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class CountTestImages(Callback):
    """The images the test loop scored (the targets of its batches: one per image, NaFlex batches too) and the classes
    among them, summed over the ranks: fewer than the split's under ``trainer.limit_test_batches`` or ``fast_dev_run``,
    whose first batches of a split sorted by class (an ImageFolder's) hold its first classes only."""

    def __init__(self) -> None:
        self.count = 0
        self.classes: int | None = None  # classes among the scored images (None: the module has no num_classes)
        self.num_classes: int | None = None
        self._seen: torch.Tensor | None = None

    def on_test_start(self, trainer, pl_module) -> None:
        self.count, self.classes = 0, None
        self.num_classes = getattr(pl_module, "num_classes", None)
        self._seen = torch.zeros(self.num_classes, device=pl_module.device) if self.num_classes else None

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if batch is None:  # (unreadable files only, left out: vitrel.data.unreadable)
            return
        y = batch[1]
        self.count += int(y.shape[0])
        if self._seen is not None and y.ndim == 1 and not y.is_floating_point():  # class indices
            self._seen[y.to(self._seen.device)] = 1.0

    def on_test_end(self, trainer, pl_module) -> None:
        self.count = int(trainer.strategy.reduce(torch.tensor(self.count, device=pl_module.device), reduce_op="sum"))
        if self._seen is not None:
            self.classes = int((trainer.strategy.reduce(self._seen, reduce_op="sum") > 0).sum())

    def classes_note(self) -> str:
        """``", 2 of the 10 classes"`` when the scored images hold fewer classes than the model classifies (the part
        of the split is then no sample of every class), else ``""``."""
        if self.classes is None or self.num_classes is None or self.classes >= self.num_classes:
            return ""
        return f", {self.classes} of the {self.num_classes} classes"


class WarnPartialValidation(Callback):
    """One warning after a fit's first validation (not the sanity check) under ``trainer.limit_val_batches`` when
    the split is sorted by class (an ImageFolder's: the labels it scored never went down) and the part scored holds
    fewer classes than the model classifies: ``val/*`` and the checkpoint chosen on them are then of its first
    classes only (the test's closing line says the same of ``limit_test_batches``: :class:`CountTestImages`). A val
    split that is a seeded sample of train is not sorted: no warning."""

    def __init__(self) -> None:
        self._seen: torch.Tensor | None = None
        self._last, self._sorted = -1, True
        self.said = False

    def on_validation_start(self, trainer, pl_module) -> None:
        n, lim = getattr(pl_module, "num_classes", None), trainer.limit_val_batches
        limited = not (isinstance(lim, float) and lim == 1.0)  # (an int counts batches: 1 is one batch)
        first = not (self.said or trainer.sanity_checking)
        self._seen = torch.zeros(n, device=pl_module.device) if n and limited and first else None
        self._last, self._sorted = -1, True

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        y = batch[1] if self._seen is not None and batch is not None else None
        if y is None or y.ndim != 1 or y.is_floating_point() or not len(y):  # (class indices only)
            return
        self._seen[y.to(self._seen.device)] = 1.0
        y = y.cpu()
        self._sorted &= bool(y[0] >= self._last) and bool((y[1:] >= y[:-1]).all())
        self._last = int(y[-1])

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._seen is None:
            return
        seen = int((trainer.strategy.reduce(self._seen, reduce_op="sum") > 0).sum())
        unsorted = torch.tensor(float(not self._sorted), device=self._seen.device)
        ordered = float(trainer.strategy.reduce(unsorted, reduce_op="sum")) == 0.0
        n, self._seen, self.said = len(self._seen), None, True
        if seen < n and ordered:
            rank_zero_warn(
                f"validation scored {seen} of the {n} classes (trainer.limit_val_batches={trainer.limit_val_batches}"
                " of a split sorted by class: its first classes): val/* and the checkpoint chosen on them are of "
                "those classes only; limit_val_batches=1.0, or a val split that is a seeded sample of train "
                "(data.val_fraction), scores every class"
            )


class CountValidations(Callback):
    """The validation passes a fit ran, the sanity check not counted: 0 when ``trainer.max_steps`` ends the fit within
    its first epoch (Lightning then skips the epoch's validation), so a run with no ``val/*`` metric says why.

    The count is kept in the checkpoints: a resumed fit counts the validations of the processes before it up to its
    checkpoint. ``train()`` loads it from the checkpoint it resumes, as :class:`~vitrel.train.run_times.RunTimes`'
    times (:func:`~vitrel.train.resume.resolve_ckpt_path`): from a checkpoint written before vitrel kept it, the count
    is unknown (None)."""

    def __init__(self) -> None:
        self.count: int | None = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The checkpoint's count (``{}``: a checkpoint written before vitrel kept one, the count unknown)."""
        self.count = state_dict.get("count")

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and self.count is not None:
            self.count += 1


def _count(dataset: Any) -> str:
    n = known_size(dataset)
    return "?" if n is None else f"{n:,}"  # (?: a stream of shards without a length)


def data_sizes(dm: Any) -> str | None:
    """``"train 9,000 images, val 1,000 (held out of train: data.val_fraction=0.1, data.seed=0)"``, or ``val ... (the
    test split: data.val_fraction=0)``, for a vitrel data module set up for fitting; None for another (one without
    ``dataset(split)`` / ``val_fraction``)."""
    if not (hasattr(dm, "dataset") and hasattr(dm, "val_fraction")):
        return None
    unit = "clips" if is_video_data(dm) else "images"
    if dm.val_fraction > 0.0:
        val = f"held out of train: data.val_fraction={dm.val_fraction:g}, data.seed={dm.seed}"
    else:
        val = "the test split: data.val_fraction=0"
    return f"train {_count(dm.dataset('train'))} {unit}, val {_count(dm.dataset('val'))} ({val})"


class DataSizes(Callback):
    """One line as a fit starts (rank 0): how many images it trains and validates on, and what the validation split
    is, a hold-out of train or the test split (whose ``val/*`` then score the images ``test/*`` score)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        line = data_sizes(trainer.datamodule) if trainer.datamodule is not None else None
        if line is not None:
            rank_zero_info(f"data: {line}")


def progress_bar_kind(requested: str | bool = "auto") -> str:
    """``auto``: ``rich`` on a terminal, ``lines`` (plain lines) when stdout is not a TTY. ``false`` is ``none`` and
    ``true`` is ``auto``, as Lightning's ``enable_progress_bar`` (``progress_bar=false`` reaches here as "False")."""
    requested = {"false": "none", "true": "auto"}.get(str(requested).lower(), str(requested))
    if requested not in ("auto", "rich", "tqdm", "lines", "none"):
        raise ValueError(f"progress_bar must be auto, rich, tqdm, lines or none, got {requested!r}")
    if requested == "auto":
        return "rich" if sys.stdout.isatty() else "lines"
    return requested


def progress_display(requested: str | bool, callbacks_cfg: DictConfig | None, callbacks: list[Callback]) -> str:
    """:func:`progress_bar_kind`, or ``own`` when ``callbacks`` hold a Lightning progress bar of one's own
    (``+callbacks.bar={_target_: ...RichProgressBar, leave: true}``): that is the display, with ``progress_bar=auto``;
    another ``progress_bar`` is a :class:`~vitrel.config.ConfigError` naming the callback."""
    own = [type(cb).__name__ for cb in callbacks if isinstance(cb, ProgressBar)]
    if not own:
        return progress_bar_kind(requested)
    requested = {"false": "none", "true": "auto"}.get(str(requested).lower(), str(requested))
    if requested != "auto":
        entries = (callbacks_cfg or {}).items()
        names = [n for n, e in entries if e is not None and str(e.get("_target_", "")).endswith(f".{own[0]}")]
        raise ConfigError(
            f"progress_bar={requested} with a progress bar among the callbacks "
            f"({f'callbacks.{names[0]}: ' if names else ''}{own[0]}), which is the display: leave progress_bar=auto, "
            "or drop the callback"
        )
    return "own"


def progress_callbacks(kind: str) -> list[Callback]:
    """The progress display for ``progress_bar_kind(...)``: a rich bar, plain lines, or nothing
    (``tqdm`` is Lightning's default bar, which needs no callback; ``own``: a callback of one's own)."""
    if kind == "rich":
        return [RichProgressBar()]
    if kind == "lines":
        return [LineProgress()]
    return []
