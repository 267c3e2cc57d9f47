"""Exact mid-epoch resume: :class:`ExactResume` (the seeded, resumable training order and the RNG states in
checkpoints) and :func:`check_resume_position` (a position mid-epoch resumes only with the settings it was saved
with). ``vitrel.train.callbacks`` re-exports them (``conf/callbacks/default.yaml`` names them there)."""

from __future__ import annotations

import logging
import random
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

from vitrel.data.memory import ResumableLoader
from vitrel.train.rank_seed import seed_rank

__all__ = ["ExactResume", "ResumePositionError", "check_resume_position", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)


def rng_state() -> dict:
    """The global random states (torch, numpy, python; CUDA's once initialised), as :func:`set_rng_state` takes them."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": random.getstate(),
    }
    if torch.cuda.is_initialized():  # (not is_available(): ~45 us, and ExceptionCheckpoint calls this every step)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ExactResume(Callback):
    """Deterministic, resumable training data order and RNG state.

    Sets the datamodule's ``train_order_seed`` (``VisionDataModule``), so that its training loader is a
    :class:`~vitrel.data.memory.ResumableLoader` (the memory loader, or a
    :class:`~vitrel.data.base.ResumableDataLoader` on the workers path): order of epoch ``e`` seeded by
    ``seed + e``, split across ranks (Lightning leaves it as is under DDP), with a ``state_dict`` of its
    position in the epoch. Checkpoints get that position and the RNG states (torch, CUDA, numpy,
    python); on resume the loader continues where it stopped and the RNG states are put back just
    before the first resumed batch, so a killed and resumed run ends with the same weights as an
    uninterrupted one (and, with :class:`~vitrel.train.module.ClassifierModule`, whose training metrics
    keep their running totals in the checkpoint, with the same epoch metrics). The augmentation comes back too: the
    memory loader's batch augmentation is drawn from ``(seed, epoch)``, the workers loader's per-sample one from
    ``(seed, epoch, index)`` (:class:`~vitrel.data.transforms.MappedDataset`), in any worker.

    A position mid-epoch resumes only at the batch size and number of processes it was saved with: another is a
    :class:`ResumePositionError` (:func:`check_resume_position`; ``train()`` checks it before anything is built, this
    callback again at ``on_train_start``, where the trainer knows its processes). Each checkpoint keeps the epoch's
    number of batches (``epoch_batches``) beside the position, so that one written at an epoch's end resumes at any.

    The loader position is restored here, at ``on_train_start``, rather than by Lightning's own
    support for stateful loaders: Lightning skips that when the loader was built before the
    checkpoint was read, which ``trainer.estimated_stepping_batches`` in ``configure_optimizers``
    (the schedule's length) does.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self._loader: ResumableLoader | None = None
        self._epoch_batches: int | None = None  # the training batches of this epoch (trainer.num_training_batches)
        self._pending: dict | None = None  # the loader position to resume at
        self._pending_epoch_batches: int | None = None
        self._pending_seed: int | None = None
        self._pending_rng: dict | None = None
        self._pending_rng_ranks: list[dict] | None = None  # under DDP: each rank's RNG states, by global rank
        self._dm: Any = None
        self._dm_seed: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        if stage != "fit" or trainer.overfit_batches > 0:  # overfitting: Lightning fixes the order itself
            return
        if dm is None or not hasattr(dm, "train_order_seed"):
            log.warning("ExactResume: the datamodule has no train_order_seed; mid-epoch resume is approximate")
            return
        self._dm, self._dm_seed = dm, dm.train_order_seed
        dm.train_order_seed = self.seed

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._dm is not None:
            self._dm.train_order_seed = self._dm_seed
            self._dm = None

    def state_dict(self) -> dict[str, Any]:
        loader = self._loader.state_dict() if self._loader is not None else {}
        return {"loader": loader, "epoch_batches": self._epoch_batches, "rng": rng_state(), "seed": self.seed}

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Under DDP, every rank's RNG states beside rank 0's (``rng_ranks``, by global rank): the ranks' streams part
        when they draw different amounts (drop-path over a NaFlex batch's rows, which differ by rank), so each resumes
        its own. Lightning calls this on every rank (its collective is theirs together) and writes rank 0's dict."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if trainer.world_size > 1 and state is not None:
            ranks: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, state["rng"])
            state["rng_ranks"] = ranks

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_rng = state_dict.get("rng")
        self._pending_rng_ranks = state_dict.get("rng_ranks")
        # vitrel 0.1.0 kept the loader position at the top level
        self._pending = state_dict.get("loader", {k: state_dict[k] for k in ("epoch", "batches") if k in state_dict})
        self._pending_epoch_batches = state_dict.get("epoch_batches")
        self._pending_seed = state_dict.get("seed")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loader = trainer.train_dataloader
        self._loader = loader if isinstance(loader, ResumableLoader) else None
        self._count_batches(trainer)
        if self._pending and self._loader is not None:
            # train() refuses this before anything is built; here for a world size only the trainer knows (SLURM,
            # torchrun, devices=auto) and for trainer.fit(ckpt_path=...) outside train()
            now = self._loader.state_dict()
            saved = {"loader": self._pending, "epoch_batches": self._pending_epoch_batches, "seed": self._pending_seed}
            check_resume_position(saved, now.get("batch_size"), now.get("num_replicas"), trainer.ckpt_path, self.seed)
            self._loader.load_state_dict(self._pending)
        self._pending = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count_batches(trainer)

    def _count_batches(self, trainer: L.Trainer) -> None:
        n = trainer.num_training_batches
        self._epoch_batches = int(n) if n != float("inf") else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending_rng is not None:
            ranks = self._pending_rng_ranks  # (a checkpoint of another number of processes: at an epoch's end)
            own = ranks is not None and len(ranks) == trainer.world_size
            set_rng_state(ranks[trainer.global_rank] if own else self._pending_rng)
            if not own and trainer.global_rank > 0:  # rank 0's states only: each other rank its own stream
                seed_rank(self.seed, trainer.global_rank, trainer.global_step)
            self._pending_rng = self._pending_rng_ranks = None


class ResumePositionError(ValueError):
    """A checkpoint saved mid-epoch, resumed with another per-device batch size or number of processes: its position
    (batches done of each rank's order) would point at other samples, so that some of the epoch's samples would be
    trained on twice and others skipped."""


def check_resume_position(
    state: dict[str, Any] | None,
    batch_size: int | None,
    world_size: int | None,
    where: Any = "the checkpoint",
    seed: int | None = None,
    batch_key: str = "data.batch_size",
) -> None:
    """Refuse to resume :class:`ExactResume`'s ``state`` (as a checkpoint keeps it) mid-epoch with a ``batch_size``,
    ``world_size`` (processes: devices x nodes) or order ``seed`` (``seed=``) other than the ones it was saved with: a
    :class:`ResumePositionError` naming the checkpoint ``where``, both values and the fixes. Allowed: a checkpoint at
    an epoch's end (its epoch done: the next one starts from its beginning at any size), or one written before the
    loaders kept their batch size (not checked). ``None``: not known, not compared. ``batch_size`` is the samples a
    batch is collated from, which ``batch_key`` sets (``data.batch_size / data.clip_repeats`` for videos read in
    several views)."""
    state = state or {}
    loader, total = state.get("loader") or {}, state.get("epoch_batches")
    done = int(loader.get("batches", 0))
    if "batch_size" not in loader or done == 0 or (total is not None and done >= total):
        return
    old_bs, old_world = int(loader["batch_size"]), int(loader["num_replicas"])
    changed = []
    if batch_size is not None and int(batch_size) != old_bs:
        changed.append(f"{batch_key}={batch_size} (checkpoint: {old_bs})")
    if world_size is not None and int(world_size) != old_world:
        changed.append(f"{_processes(world_size)} (trainer.devices x trainer.num_nodes; checkpoint: {old_world})")
    old_seed = state.get("seed")  # (None: a checkpoint of vitrel before it kept the order's seed)
    reseeded = seed is not None and old_seed is not None and int(seed) != int(old_seed)
    if reseeded:  # the rest of the epoch would follow another order
        changed.append(f"seed={seed} (checkpoint: {old_seed})")
    if not changed:
        return
    of = f" of {total}" if total is not None else ""
    raise ResumePositionError(
        f"{where} was saved mid-epoch (epoch {loader.get('epoch')}, {done}{of} batches of {old_bs} samples on each "
        f"of {_processes(old_world)}): resuming it with {' and '.join(changed)} would train on some of that epoch's "
        f"samples twice and skip others. Resume with {batch_key}={old_bs} on {_processes(old_world)}"
        f"{f' with seed={old_seed}' if reseeded else ''}, or from a "
        f"checkpoint written at an epoch's end, or start a new run from its weights: model=from_checkpoint "
        f"model.path={where}"
    )


def _processes(n: int) -> str:
    return f"{n} process{'' if n == 1 else 'es'}"
