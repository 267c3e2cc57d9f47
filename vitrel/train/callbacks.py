"""Lightning callbacks of the training framework.

* :class:`SignalCheckpoint`: SIGTERM / SIGUSR1 / SIGUSR2 -> save ``last.ckpt`` at the next batch
  boundary, then exit (or hand over to the handler that was there before, e.g. submitit's requeue).
* :class:`NaNGuard`: a non-finite loss stops the run before it reaches the weights, with a clear
  message naming the last good checkpoint.
* :class:`ExactResume`: seeded per-epoch data order, split across ranks like ``DistributedSampler``,
  that resumes mid-epoch where it stopped; restores the RNG states. A run killed mid-epoch and
  resumed from its last checkpoint ends as the uninterrupted run would.
* :class:`LineProgress`: plain progress lines (for logs, when stdout is not a terminal).
* :class:`PosImageLogger`: pictures of every layer's position scheme (``vitrel.viz``) every few epochs.
"""

from __future__ import annotations

import itertools
import logging
import random
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from vitrel.pos.base import PositionScheme

__all__ = [
    "SignalCheckpoint",
    "NaNGuard",
    "NonFiniteLossError",
    "ExactResume",
    "EpochSampler",
    "ResumableDataLoader",
    "LineProgress",
    "PosImageLogger",
    "last_checkpoint_path",
    "LastCheckpoint",
]

log = logging.getLogger(__name__)


def last_checkpoint_path(trainer: L.Trainer) -> Path | None:
    """``<dirpath>/last.ckpt`` of the trainer's ModelCheckpoint that keeps a last checkpoint; None without one."""
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.save_last and cb.dirpath is not None:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    return None


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt`` only (no monitored metric, always overwritten): at the end of every epoch, and
    optionally every ``every_n_train_steps`` optimizer steps or every ``every_n_minutes`` of
    training, mid-epoch.

    Kept apart from the best-checkpoint callback because Lightning defers the step checkpoints of a
    callback that monitors a validation metric until that metric exists (after the first epoch), and
    because Lightning's step and epoch triggers are mutually exclusive: the end-of-epoch save is
    added here (``on_train_epoch_end``, after validation) so the last state is always on disk.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = None,
        every_n_minutes: float | None = None,
    ) -> None:
        import datetime

        interval = datetime.timedelta(minutes=every_n_minutes) if every_n_minutes else None
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps if interval is None else None,
            train_time_interval=interval,
            enable_version_counter=False,
        )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if not self._should_skip_saving_checkpoint(trainer):  # also skips a step already saved
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def _any_rank(trainer: L.Trainer, flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank (a collective when world_size > 1)."""
    if trainer.world_size > 1:
        return bool(trainer.strategy.reduce_boolean_decision(flag, all=False))
    return flag


# ------------------------------------------------------------------------------------------ signals
class SignalCheckpoint(Callback):
    """On SIGTERM / SIGUSR1 / SIGUSR2: save ``last.ckpt`` at the end of the current batch, then exit.

    The handler only records the signal; the save happens at the next ``on_train_batch_end`` (a
    consistent state, the same point where step checkpoints are written), agreed on by all ranks
    (a signal that reached one rank stops them all). Then, if a handler that is not Lightning's was
    installed before (submitit's requeue handler on SIGUSR2), it is called; otherwise the run exits
    with ``128 + signum`` through Lightning's ``SIGTERMException``.

    Under SLURM with Lightning's auto-requeue, the requeue signal (SIGUSR1) is left to Lightning
    (it saves an ``hpc_ckpt`` and requeues the job).
    """

    def __init__(self, signals: Sequence[str] = ("SIGTERM", "SIGUSR1", "SIGUSR2")) -> None:
        self.signals = []
        for name in signals:
            sig = getattr(signal, str(name).upper(), None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"unknown signal {name!r} in SignalCheckpoint(signals=...)")
            self.signals.append(sig)
        self.received: int | None = None
        self.saved_path: Path | None = None
        self._previous: dict[int, Any] = {}

    # ---- handler management
    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            log.warning(f"received {signal.Signals(signum).name}: saving a checkpoint at the end of this batch")

    def _install(self, trainer: L.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        env = trainer._accelerator_connector.cluster_environment
        lightning_requeue = getattr(env, "auto_requeue", False) and getattr(env, "requeue_signal", None)
        for sig in self.signals:
            if lightning_requeue and sig == lightning_requeue:
                continue
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)

    def _restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = None
        self._install(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not _any_rank(trainer, self.received is not None):
            return
        signum = int(self.received or signal.SIGTERM)
        path = last_checkpoint_path(trainer) or Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(str(path))
        self.saved_path = path
        rank_zero_info(
            f"{signal.Signals(signum).name}: saved {path} at epoch {trainer.current_epoch}, "
            f"step {trainer.global_step}; resume with ckpt_path=last (same run folder)"
        )
        prev = self._previous.get(signum)
        self._restore()
        if callable(prev) and not type(prev).__module__.startswith("lightning"):
            prev(signum, None)  # e.g. submitit: requeue the job and exit
        raise SIGTERMException(128 + signum)

    def on_train_end(self, trainer, pl_module) -> None:
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
    """

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        bad = not bool(torch.isfinite(loss.detach()).all())
        if not _any_rank(trainer, bad):
            return
        last = last_checkpoint_path(trainer)
        kept = (
            f"the last good checkpoint is {last}"
            if last is not None and last.exists()
            else "no checkpoint was saved yet"
        )
        raise NonFiniteLossError(
            f"non-finite training loss ({loss.detach().float().item()}) at epoch {trainer.current_epoch}, "
            f"global step {trainer.global_step}: training stopped before this step updated the weights; {kept}. "
            "Try a lower optim.lr, gradient clipping (trainer.gradient_clip_val) or bf16-mixed instead of 16-mixed."
        )


# ------------------------------------------------------------------------------------------ exact resume
class EpochSampler(DistributedSampler):
    """Order of epoch ``e``: a permutation seeded by ``seed + e`` (or ``0..N-1``), rank ``r`` taking
    ``order[r::num_replicas]`` (padded to equal length, as ``DistributedSampler``); the next
    iteration starts ``skip`` samples in (a resumed epoch)."""

    def __init__(self, dataset, *, shuffle: bool, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class ResumableDataLoader(DataLoader):
    """A DataLoader over an :class:`EpochSampler` that counts the batches it yielded this epoch."""

    batches_yielded: int = 0

    def __iter__(self):
        start = self.sampler.skip // self.batch_size if isinstance(self.sampler, EpochSampler) else 0
        self.batches_yielded = start
        for batch in super().__iter__():
            self.batches_yielded += 1
            yield batch

    @classmethod
    def from_loader(cls, dl: DataLoader, sampler: EpochSampler) -> ResumableDataLoader:
        kwargs = dict(
            batch_size=dl.batch_size,
            sampler=sampler,
            num_workers=dl.num_workers,
            collate_fn=dl.collate_fn,
            pin_memory=dl.pin_memory,
            drop_last=dl.drop_last,
            timeout=dl.timeout,
            worker_init_fn=dl.worker_init_fn,
            multiprocessing_context=dl.multiprocessing_context,
            generator=dl.generator,
            persistent_workers=dl.persistent_workers,
            pin_memory_device=dl.pin_memory_device,
        )
        if dl.num_workers > 0:
            kwargs["prefetch_factor"] = dl.prefetch_factor
        return cls(dl.dataset, **kwargs)


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ExactResume(Callback):
    """Deterministic, resumable training data order and RNG state.

    The datamodule's training loader (a plain shuffled or sequential one) is rebuilt over an
    :class:`EpochSampler` (order seeded by ``seed + epoch``, split across ranks; Lightning leaves
    it as is under DDP). Checkpoints record how many batches of the current epoch were consumed
    and the RNG states (torch, CUDA, numpy, python); on resume the epoch restarts exactly where it
    stopped and the RNG states are put back just before the first resumed batch, so a killed and
    resumed run ends with the same weights as an uninterrupted one. Random augmentation inside
    DataLoader workers is not replayed exactly after a mid-epoch resume (worker RNG streams are
    per worker, not per sample); everything else is.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self._loader: ResumableDataLoader | None = None
        self._pending: dict | None = None
        self._pending_rng: dict | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        if stage != "fit" or dm is None or trainer.overfit_batches > 0 or getattr(dm, "_vitrel_exact_resume", None):
            return
        original = dm.train_dataloader

        def train_dataloader() -> DataLoader:
            dl = original()
            if not isinstance(dl, DataLoader) or type(dl.batch_sampler) is not BatchSampler:
                log.warning(
                    "ExactResume: the training loader is not a plain DataLoader; mid-epoch resume is approximate"
                )
                return dl
            if not isinstance(dl.sampler, (RandomSampler, SequentialSampler)):
                log.warning(
                    f"ExactResume: keeping the custom sampler {type(dl.sampler).__name__}; resume is approximate"
                )
                return dl
            sampler = EpochSampler(
                dl.dataset,
                shuffle=isinstance(dl.sampler, RandomSampler),
                seed=self.seed,
                num_replicas=trainer.world_size,
                rank=trainer.global_rank,
            )
            self._loader = ResumableDataLoader.from_loader(dl, sampler)
            return self._loader

        dm.train_dataloader = train_dataloader
        dm._vitrel_exact_resume = original
        # Lightning warns that a mid-epoch resume is unreliable unless the loader is stateful: here it is exact
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        original = getattr(dm, "_vitrel_exact_resume", None) if dm is not None else None
        if original is not None:
            dm.train_dataloader = original
            dm._vitrel_exact_resume = None

    def state_dict(self) -> dict[str, Any]:
        if self._loader is None:
            return {}
        return {
            "epoch": int(self._loader.sampler.epoch),
            "batches": int(self._loader.batches_yielded),
            "rng": _rng_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._pending = dict(state_dict)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pending is None or self._loader is None:
            return
        done = self._pending["batches"]
        if 0 < done < trainer.num_training_batches:  # resumed mid-epoch: skip what was consumed
            self._loader.sampler.set_epoch(self._pending["epoch"])
            self._loader.sampler.skip = done * self._loader.batch_size
        self._pending_rng = self._pending.get("rng")
        self._pending = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending_rng is not None:
            _set_rng_state(self._pending_rng)
            self._pending_rng = None


# ------------------------------------------------------------------------------------------ progress lines
class LineProgress(Callback):
    """One plain line every ``every_n_steps`` training steps (default: the trainer's
    ``log_every_n_steps``) and one per epoch (rank 0), for logs."""

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self._t0 = 0.0

    @staticmethod
    def _fmt(metrics: dict, keys: Sequence[str]) -> str:
        out = []
        for k in keys:
            if k in metrics:
                out.append(f"{k} {float(metrics[k]):.4g}")
        return "  ".join(out)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t0 = time.time()

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.every_n_steps if self.every_n_steps is not None else trainer.log_every_n_steps
        if every > 0 and (batch_idx + 1) % every == 0:
            m = trainer.callback_metrics
            lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
            print(
                f"epoch {trainer.current_epoch} step {batch_idx + 1}/{trainer.num_training_batches}  "
                f"{self._fmt(m, ['train/loss_step'])}  lr {lr:.3g}",
                flush=True,
            )

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        m = trainer.callback_metrics
        keys = ["train/loss_epoch", "train/acc1", "val/loss", "val/acc1", "val/acc5"]
        total = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else "?"
        print(
            f"epoch {trainer.current_epoch + 1}/{total}  {self._fmt(m, keys)}  ({time.time() - self._t0:.1f} s)",
            flush=True,
        )


# ------------------------------------------------------------------------------------------ position pictures
def position_schemes(model: torch.nn.Module) -> list[tuple[str, PositionScheme]]:
    """``(name, scheme)`` of every distinct position scheme in ``model`` that has something to show."""
    seen, out = set(), []
    for name, m in model.named_modules():
        if isinstance(m, PositionScheme) and id(m) not in seen and m.name != "none":
            seen.add(id(m))
            out.append((name or "pos", m))
    return out


class PosImageLogger(Callback):
    """Every ``every_n_epochs`` epochs (and at the end of training), a picture of each layer's
    position scheme as seen from the centre query (``vitrel.viz.plot_pos_scheme``), logged to
    W&B / TensorBoard as images under ``pos/<module name>``; without such a logger the PNGs go to
    ``<run dir>/pos_images/``.
    """

    def __init__(self, every_n_epochs: int = 5, max_layers: int | None = None, save_dir: str | None = None) -> None:
        self.every_n_epochs = int(every_n_epochs)
        self.max_layers = max_layers
        self.save_dir = save_dir
        self._last_logged_step = -1

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs > 0 and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.log_images(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._last_logged_step != trainer.global_step:
            self.log_images(trainer, pl_module)

    @rank_zero_only
    def log_images(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from vitrel.viz import figure_to_array, plot_pos_scheme

        if trainer.sanity_checking or trainer.fast_dev_run:
            return
        self._last_logged_step = trainer.global_step
        model = getattr(pl_module, "model", pl_module)
        schemes = position_schemes(model)[: self.max_layers]
        loggers = [lg for lg in trainer.loggers if isinstance(lg, (WandbLogger, TensorBoardLogger))]
        step, epoch = trainer.global_step, trainer.current_epoch
        images = {}
        for name, scheme in schemes:
            fig = plot_pos_scheme(scheme, title=f"{name}: {scheme.name} (step {step})")
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
