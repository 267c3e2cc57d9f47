"""Lightning callbacks of the training framework.

* :class:`LastCheckpoint`: ``last.ckpt`` at the end of every epoch and, optionally, every N steps or minutes
  (:mod:`vitrel.train.last_checkpoint`, re-exported here with the helpers that find and write that file).
* :class:`KeepEarlyStop`: a run that ``EarlyStopping`` stopped, resumed, stops again before it trains.
* :class:`SignalCheckpoint`: SIGTERM / SIGUSR1 / SIGUSR2 -> save ``last.ckpt`` at the next batch
  boundary, then exit (or hand over to the handler that was there before, e.g. submitit's requeue).
* :class:`NaNGuard`: a non-finite loss stops the run before it reaches the weights, with a clear
  message naming the last good checkpoint.
* :class:`ExactResume`: the datamodule's seeded, resumable training order
  (``VisionDataModule.train_order_seed``) and the RNG states in checkpoints. A run killed mid-epoch
  and resumed from its last checkpoint ends as the uninterrupted run would (:mod:`vitrel.train.exact_resume`).
* :class:`PosImageLogger`: pictures of every layer's position scheme (``vitrel.viz``) every few epochs.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from vitrel.pos.base import PositionScheme
from vitrel.train.exact_resume import ExactResume, ResumePositionError, check_resume_position
from vitrel.train.last_checkpoint import (
    LastCheckpoint,
    flush_loggers,
    last_checkpoint_file,
    last_checkpoint_path,
    save_checkpoint,
)
from vitrel.train.loggers import image_loggers
from vitrel.train.loop_rules import mid_window, validates_after
from vitrel.train.optim import FLOAT16_EPS

__all__ = [
    "SignalCheckpoint",
    "NaNGuard",
    "NonFiniteLossError",
    "ExactResume",
    "ResumePositionError",
    "check_resume_position",
    "PosImageLogger",
    "last_checkpoint_path",
    "last_checkpoint_file",
    "LastCheckpoint",
    "KeepEarlyStop",
    "save_checkpoint",
    "flush_loggers",
]

log = logging.getLogger(__name__)


class KeepEarlyStop(Callback):
    """A run resumed from a checkpoint of a run that Lightning's ``EarlyStopping`` stopped stops again before it trains,
    as a run resumed at ``max_epochs`` does: Lightning keeps the callback's state but not the trainer's stop, so a run
    again in its folder (a requeued job, a sweep run again) trained one more epoch each time. Resume without the
    ``EarlyStopping`` callback to train such a run on."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for cb in trainer.callbacks:
            if isinstance(cb, EarlyStopping) and cb.stopping_reason != EarlyStoppingReason.NOT_STOPPED:
                trainer.should_stop = True
                rank_zero_info(
                    f"EarlyStopping stopped this run in epoch {cb.stopped_epoch + 1} ({cb.stopping_reason_message}): "
                    "nothing left to train (to train on, resume without the EarlyStopping callback)"
                )
                return


def _any_rank(trainer: L.Trainer, flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank (a collective when world_size > 1)."""
    if trainer.world_size > 1:
        return bool(trainer.strategy.reduce_boolean_decision(flag, all=False))
    return flag


# ------------------------------------------------------------------------------------------ signals
class SignalCheckpoint(Callback):
    """On SIGTERM / SIGUSR1 / SIGUSR2: save ``last.ckpt`` at the end of the current batch, then exit.

    While fitting, each signal gets a handler that only records it (installed as the sanity check or training
    starts, the handlers before put back as training ends): SIGTERM's replaces Lightning's (which would end the run
    after the batch, at a window's first batch too, and under DDP calls a collective from inside the signal handler,
    which hangs when the ranks take the signal at different points) and calls the handler that was there before
    Lightning's, as Lightning's does. SIGUSR1 is left to Lightning where it handles it (its SLURM auto-requeue: it
    saves an ``hpc_ckpt`` and requeues the job); submitit signals preemption and time-outs with SIGUSR2.

    The save happens at ``on_train_batch_end`` of a batch that ran an optimizer step (with gradient accumulation, the
    window's last: :func:`mid_window`), agreed on by all ranks (a signal that reached one rank stops them all).
    The exit follows at the next hook after Lightning has logged that batch's metrics (the next batch's
    start, the start of validation, the next epoch's start or the end of training), so the metrics of
    the saved step reach the loggers, which the resumed run does not log again. Then, for SIGUSR1/2, a
    handler installed before that is not Lightning's (submitit's requeue handler) is called; otherwise
    the run exits with ``128 + signum`` through Lightning's ``SIGTERMException``.

    SIGTERM outside the training batches ends the run as Lightning's own handling would: during validation at the
    next validation batch, without a checkpoint (not after a loader's last batch: training goes on to its next
    stop); at an epoch's end (its last validation batch, the epoch-end hooks) once ``last.ckpt`` is saved there.
    Under DDP validation runs to its end first (the ranks' validation batches may differ in number).
    """

    def __init__(self, signals: Sequence[str] = ("SIGTERM", "SIGUSR1", "SIGUSR2")) -> None:
        self.signals = []
        for name in signals:
            sig = getattr(signal, str(name).upper(), None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"unknown signal {name!r} in SignalCheckpoint(signals=...)")
            self.signals.append(sig)
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._before_lightning: Any = None  # SIGTERM's handler before Lightning's, called on SIGTERM as Lightning does
        self._active = False  # the handlers are installed
        self._exit_signal: int | None = None  # saved; exit at the next hook
        self._after_val: int | None = None  # saved; exit once the validation that follows the saved step has run

    # ---- handler management
    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            log.warning(f"received {signal.Signals(signum).name}: saving a checkpoint at the end of this batch")
        before = self._before_lightning
        if signum == signal.SIGTERM and callable(before) and not self._is_lightnings(before):
            before(signum, frame)

    @staticmethod
    def _is_lightnings(handler: Any) -> bool:
        return callable(handler) and type(handler).__module__.startswith("lightning")

    def _install(self) -> None:
        if self._active or threading.current_thread() is not threading.main_thread():
            return
        self._active = True
        for sig in self.signals:
            current = signal.getsignal(sig)
            if sig != signal.SIGTERM and self._is_lightnings(current):
                continue  # Lightning's SIGUSR1, under SLURM auto-requeue
            self._previous[sig] = current
            signal.signal(sig, self._handler)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}
        self._active = False

    def _pending(self, trainer: L.Trainer) -> int | None:
        if self.received is not None:
            return self.received
        # Lightning's handler caught it before this one was installed (it then also ends the run after this batch)
        if signal.SIGTERM in self.signals and trainer.received_sigterm:
            return int(signal.SIGTERM)
        return None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = None
        self._exit_signal = None
        self._after_val = None
        self._before_lightning = signal.getsignal(signal.SIGTERM)  # (Lightning installs its handler after this hook)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._exit_signal is not None or self._after_val is not None:
            return
        pending = self._pending(trainer)
        if mid_window(trainer, batch_idx):  # (the same on every rank) saved at the window's end, after its step
            return
        if not _any_rank(trainer, pending is not None):
            return
        signum = int(pending or signal.SIGTERM)
        path = last_checkpoint_path(trainer) or Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        save_checkpoint(trainer, path)
        last = next((cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)), None)
        then = ""
        if last is not None and validates_after(trainer):
            # (trainer.val_check_interval, the epoch's end) a resume from this file would skip that validation: it runs,
            # last.ckpt is written again after it (at the epoch's last batch, the epoch's end writes it), then the exit
            if batch_idx + 1 < trainer.num_training_batches:
                last.save_after_validation()
            self._after_val = signum
            then = "; validating, then saving again"
        else:
            self._exit_signal = signum
        rank_zero_info(
            f"{signal.Signals(signum).name}: saved {path} in epoch {trainer.current_epoch + 1}, "
            f"step {trainer.global_step}{then}; resume with ckpt_path=last (same run folder)"
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._after_val is not None and not trainer.sanity_checking:
            self._exit_signal, self._after_val = self._after_val, None  # (last.ckpt's save follows: checkpoints last)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        # one process only: under DDP the ranks may run different numbers of validation batches (no collective per
        # batch), and a rank stopping alone would leave the others waiting; validation ends, the next stop saves
        if not self._active or self._exit_signal is not None or self._after_val is not None or trainer.world_size > 1:
            return
        batches = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        if self.received == signal.SIGTERM and batch_idx + 1 < batches[dataloader_idx]:  # (last: on to the next stop)
            rank_zero_info("SIGTERM during validation: stopping without a checkpoint (last.ckpt is the last saved)")
            self._exit_signal = int(signal.SIGTERM)
            self._exit()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # (before LastCheckpoint's epoch-end save: checkpoint callbacks run last; the exit comes at the next hook)
        if self._active and self._exit_signal is None and _any_rank(trainer, self.received == signal.SIGTERM):
            self._exit_signal = int(signal.SIGTERM)

    def _exit(self, validating: bool = False) -> None:
        if not validating and self._after_val is not None:  # (the validation did not run: no batches)
            self._exit_signal, self._after_val = self._after_val, None
        signum = self._exit_signal
        if signum is None:
            return
        self._exit_signal = None
        prev = self._previous.get(signum)
        self._restore()
        if callable(prev) and not self._is_lightnings(prev):
            prev(signum, None)  # e.g. submitit: requeue the job and exit
        raise SIGTERMException(128 + signum)

    # the first hook after the saved batch's metrics were logged
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._exit()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._exit(validating=True)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._exit()

    def on_train_end(self, trainer, pl_module) -> None:
        try:
            self._exit()
        finally:
            self._restore()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()


# ------------------------------------------------------------------------------------------ NaN guard
class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


class NaNGuard(Callback):
    """Stop on a non-finite loss before its backward pass, so the weights never see it.

    The run ends with :class:`NonFiniteLossError`; checkpoints already on disk (``last.ckpt``) are
    the last good state. In DDP the check is agreed on by all ranks so they stop together.

    ``every_n_steps``: 1 checks every step, which reads the loss back to the host (a synchronisation per
    step). ``N > 1`` (``conf/step/fast.yaml``) or ``None`` keeps a flag on the device instead, read every ``N``
    optimizer steps (``None``: never on a step boundary), at the end of each epoch and before every checkpoint is
    written: no checkpoint ever holds weights a non-finite loss touched, but the steps after it, up to the
    check, did run.
    """

    def __init__(self, every_n_steps: int | None = 1) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._bad: torch.Tensor | None = None  # deferred: any non-finite loss since the last check, on the device
        self._since: int | None = None  # the global step of the last check

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.every_n_steps != 1:
            bad = ~torch.isfinite(loss.detach()).all()
            self._bad = bad if self._bad is None else self._bad | bad
            return
        bad = not bool(torch.isfinite(loss.detach()).all())
        if not _any_rank(trainer, bad):
            return
        raise NonFiniteLossError(
            f"non-finite training loss ({self._bad_losses(trainer, loss)}) in epoch {trainer.current_epoch + 1}, "
            f"global step {trainer.global_step}: training stopped before this step updated the weights; "
            f"{self._kept(trainer)}. {self._hint(trainer)}"
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every_n_steps not in (None, 1) and trainer.global_step % self.every_n_steps == 0:
            self._check(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._check(trainer)  # raises before the file is written

    def _check(self, trainer: L.Trainer) -> None:
        """The deferred check: read the device flag (one synchronisation), stop if it is set."""
        bad, since = self._bad, self._since
        self._bad, self._since = None, trainer.global_step
        if not _any_rank(trainer, bad is not None and bool(bad)):
            return
        where = f"after global step {since}" if since is not None else "since the run (re)started"
        raise NonFiniteLossError(
            f"non-finite training loss {where} (checked every {self.every_n_steps or 'epoch'} steps, at epoch ends "
            f"and before checkpoints; now in epoch {trainer.current_epoch + 1}, global step {trainer.global_step}): "
            f"training stopped, the steps since it updated the weights; {self._kept(trainer)}. {self._hint(trainer)} "
            "callbacks.nan_guard.every_n_steps=1 stops before the step (a synchronisation per step)."
        )

    @staticmethod
    def _bad_losses(trainer: L.Trainer, loss: torch.Tensor) -> str:
        """The loss (one process), or each non-finite one with its process (every rank: the same words), e.g.
        ``nan on process 1 of 2``: the ranks that stop with a finite loss of their own name the one that did not."""
        value = loss.detach().float().reshape(())
        if trainer.world_size == 1:
            return f"{value.item()}"
        every = trainer.strategy.all_gather(value).reshape(-1).tolist()  # a collective: every rank is here
        return ", ".join(f"{v} on process {r} of {len(every)}" for r, v in enumerate(every) if not math.isfinite(v))

    @staticmethod
    def _hint(trainer: L.Trainer) -> str:
        """The advice for the run's ``trainer.precision``: float16 advice only where float16 is in use."""
        precision = str(trainer.precision)
        tried = "Try a lower module.optimizer.lr or clipping (trainer.gradient_clip_val)"
        if precision == "16-mixed":
            return f"{tried}, or trainer.precision=bf16-mixed instead of 16-mixed."
        if precision == "16-true":  # float16 weights and optimizer state: a small eps is 0 or too small there
            eps = [g["eps"] for o in trainer.optimizers for g in o.param_groups if isinstance(g.get("eps"), float)]
            zero = bool(eps) and float(torch.tensor(min(eps), dtype=torch.float16)) == 0.0
            how = "rounds to 0" if zero else "is small"  # 1e-6 and 1e-7 NaN'd within 7 steps of a tiny run, 1e-5 not
            small = f"; the optimizer's eps={min(eps):g} {how} in float16 (module.optimizer.eps={FLOAT16_EPS:g} trains)"
            return (
                f"{tried}, or trainer.precision=16-mixed, bf16-mixed or bf16-true instead of 16-true (float16 weights "
                f"and optimizer state){small if eps and min(eps) < FLOAT16_EPS else ''}."
            )
        if precision == "bf16-true":
            return f"{tried}, or trainer.precision=bf16-mixed instead of bf16-true (float32 weights)."
        return f"{tried}."

    @staticmethod
    def _kept(trainer: L.Trainer) -> str:
        last = last_checkpoint_path(trainer)
        if last is not None and last.exists():
            return f"the last good checkpoint is {last}"
        return "no checkpoint was saved yet"


# ------------------------------------------------------------------------------------------ position pictures
def position_schemes(model: torch.nn.Module) -> list[tuple[str, PositionScheme]]:
    """``(name, scheme)`` of every distinct position scheme in ``model`` that has something to show: not ``none``, and
    not a scheme computed from the tokens (``embeds_content``: ``cpe``'s convolution has no picture of its own)."""
    seen, out = set(), []
    for name, m in model.named_modules():
        if isinstance(m, PositionScheme) and id(m) not in seen and m.name != "none" and not m.embeds_content:
            seen.add(id(m))
            out.append((name or "pos", m))
    return out


class PosImageLogger(Callback):
    """Every ``every_n_epochs`` epochs (and at the end of training), a picture of each layer's position scheme as
    seen from the centre query (``vitrel.viz.plot_pos_scheme``; a video grid's frames side by side), logged to
    W&B / TensorBoard as images under ``pos/<module name>``; without such a logger the PNGs go to
    ``<run dir>/pos_images/``. Drawn from the weights validation scores (the EMA copy under ``module/ema`` unless
    ``module.ema_eval=false``, as ``vitrel.load_model`` loads a run), the title says which.
    """

    def __init__(self, every_n_epochs: int = 5, max_layers: int | None = None, save_dir: str | None = None) -> None:
        self.every_n_epochs = int(every_n_epochs)
        self.max_layers = max_layers
        self.save_dir = save_dir
        self._last_logged_step = -1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs > 0 and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.log_images(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:  # also as a test starts: a finished run resumed has no
        if self._last_logged_step != trainer.global_step and trainer.global_step > 0:  # train end, and TensorBoard's
            self.log_images(trainer, pl_module)  # purge hid the pictures of its last step

    on_test_start = on_train_end

    @rank_zero_only
    def log_images(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from vitrel.viz import figure_to_array, plot_pos_scheme

        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        self._last_logged_step = trainer.global_step
        # the weights val / test score and load_model loads (another LightningModule: its .model, or itself)
        model = getattr(pl_module, "scored_network", None)
        model = getattr(pl_module, "model", pl_module) if model is None else model
        has_ema = getattr(pl_module, "ema_model", None) is not None
        ema = has_ema and pl_module.eval_model is pl_module.ema_model
        schemes = position_schemes(model)[: self.max_layers]
        loggers = image_loggers(trainer.loggers)  # (none: pictures to files, pos_images/)
        step, epoch = trainer.global_step, trainer.current_epoch
        images = {}
        for name, scheme in schemes:
            weights = ("EMA weights, " if ema else "raw weights, ") if has_ema else ""
            fig = plot_pos_scheme(scheme, title=f"{name}: {scheme.name} ({weights}step {step})")
            images[f"pos/{name}"] = figure_to_array(fig)
            if not loggers:
                out = Path(self.save_dir or trainer.default_root_dir) / "pos_images"
                out.mkdir(parents=True, exist_ok=True)
                fig.savefig(out / f"{name.replace('.', '_')}_step{step:07d}.png", dpi=100)
        for lg in loggers:
            if isinstance(lg, WandbLogger):
                import wandb

                lg.log_metrics({k: wandb.Image(v) for k, v in images.items()}, step=step)
            else:
                for k, v in images.items():
                    lg.experiment.add_image(k, v, global_step=step, dataformats="HWC")
        rank_zero_info(f"logged {len(images)} position-scheme pictures (epoch {epoch}, step {step})")
