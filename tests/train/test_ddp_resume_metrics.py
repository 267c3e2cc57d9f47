"""A DDP checkpoint's training-metric totals are the sums over the ranks, and a resume counts them once: the epoch's
``train/loss_epoch`` and ``train/acc1`` of a run resumed mid-epoch equal the uninterrupted run's (before, the
checkpoint held rank 0's share, which every rank then took: rank 0's batches counted twice, rank 1's lost).

Two gloo processes run the module's own checkpoint hooks as Lightning calls them (``on_save_checkpoint`` on every
rank, rank 0's dict written; ``on_load_checkpoint`` on every rank before the state dict is loaded).
``bash bench/kill_resume.sh OUT trainer=ddp trainer.accelerator=cpu trainer.devices=2 trainer.precision=32-true``
checks the whole path (``train.py`` killed and resumed)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from tests.preloaded import run_ranks
from vitrel.train.module import ClassifierModule

# each rank's batches of one epoch: (loss, logits, targets); the checkpoint falls after the first two
_GEN = torch.Generator().manual_seed(0)
BATCHES = {
    r: [(torch.rand((), generator=_GEN), torch.randn(n, 3, generator=_GEN), torch.randint(0, 3, (n,), generator=_GEN))
        for n in (4, 3, 5)]
    for r in (0, 1)
}  # fmt: skip


def _update(module: ClassifierModule, batches) -> None:
    for loss, logits, targets in batches:
        module.train_loss.update(loss, weight=len(targets))
        module.train_acc1.update(logits, targets)


def _rank(rank: int, port: int, ckpt: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        first = ClassifierModule(nn.Linear(4, 3), num_classes=3)
        _update(first, BATCHES[rank][:2])
        checkpoint = {"state_dict": first.state_dict()}
        first.on_save_checkpoint(checkpoint)
        if rank == 0:
            torch.save(checkpoint, ckpt)
        torch.distributed.barrier()

        resumed = ClassifierModule(nn.Linear(4, 3), num_classes=3)
        checkpoint = torch.load(ckpt, weights_only=False)
        resumed.on_load_checkpoint(checkpoint)
        resumed.load_state_dict(checkpoint["state_dict"])
        _update(resumed, BATCHES[rank][2:])
        values = [resumed.train_loss.compute(), resumed.train_acc1.compute()]  # synced over the ranks
        if rank == 0:
            torch.save(values, out)
    finally:
        torch.distributed.destroy_process_group()


def test_a_ddp_resume_ends_the_epoch_with_the_uninterrupted_metrics(tmp_path: Path):
    ckpt, out = tmp_path / "last.ckpt", tmp_path / "metrics.pt"
    run_ranks(_rank, str(ckpt), str(out))
    loss, acc1 = torch.load(out)

    # the uninterrupted epoch, from the equation: image-weighted mean loss and top-1 over every batch of both ranks
    every = [b for r in (0, 1) for b in BATCHES[r]]
    images = sum(len(t) for _, _, t in every)
    expected_loss = sum(float(v) * len(t) for v, _, t in every) / images
    expected_acc1 = sum(int((lg.argmax(1) == t).sum()) for _, lg, t in every) / images
    assert abs(loss.item() - expected_loss) < 1e-6
    assert abs(acc1.item() - expected_acc1) < 1e-6
    held = torch.load(ckpt, weights_only=False)["state_dict"]
    assert held["train_loss.weight"].item() == 7 + 7, "the checkpoint holds both ranks' first two batches"
