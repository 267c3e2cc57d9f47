"""Each DDP rank's own random stream for the training step: :class:`SeedRanks` and :func:`seed_rank`.

``seed_everything(seed)`` (and Lightning's DDP strategy, which seeds again when it joins the ranks) gives every rank
the same torch, numpy and python RNG state, so that the draws in the model and the module (drop-path masks, token
dropping, dropout, mixup's lambda) would be the same on every rank at every step, each rank's images dropped and mixed
alike. timm's ``train.py`` seeds rank ``r`` with ``seed + r``; here rank ``r > 0`` is seeded with a hash of
``(seed, r)`` when training starts and rank 0 keeps its stream, so a run on one process draws what it drew before.

What stays shared or is seeded elsewhere: the model's initial weights (drawn before, and broadcast by DDP), the epoch's
order (:class:`~vitrel.data.sampling.EpochSampler`: one seed on every rank, each rank taking its share), the loaders'
augmentation (from ``(seed, epoch, index)`` or ``(seed, epoch, rank)``) and the workers' seeds (Lightning's
``pl_worker_init_function``, from the loader's base seed, drawn before training starts, and the rank).
"""

from __future__ import annotations

import random

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

__all__ = ["SeedRanks", "seed_rank"]


def seed_rank(seed: int, rank: int, *more: int) -> None:
    """Seed torch (CPU and CUDA), numpy and python's global RNGs from a hash of ``(seed, rank, *more)``
    (``numpy.random.SeedSequence``: nearby seeds and ranks give unrelated streams, unlike ``seed + rank``)."""
    words = np.random.SeedSequence([int(seed) % 2**64, int(rank), *(int(m) for m in more)]).generate_state(4)
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))
    np.random.seed(words)
    random.seed(int(words[2]) << 32 | int(words[3]))


class SeedRanks(Callback):
    """At the start of training, every rank but rank 0 seeds its global RNGs from ``(seed, rank)``
    (:func:`seed_rank`); a resumed run then restores each rank's saved states
    (:class:`~vitrel.train.exact_resume.ExactResume`, at its first batch). One process: nothing changes."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank > 0:
            seed_rank(self.seed, trainer.global_rank)
