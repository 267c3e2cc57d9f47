"""A training run's lifecycle: interruptions and resumes with gradient accumulation, logged rates, repeatability."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.train_helpers import FAST, TINY_VIT, SaveWeights, SendSignal, compose
from vitrel.train.run import train

ACCUMULATE = [
    *TINY_VIT,
    *FAST,
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.accumulate_grad_batches=2",
    "logger=none",
    "test=false",
]


def _weights(folder) -> dict[str, torch.Tensor]:
    return torch.load(folder / "rank0.pt", weights_only=True)


def test_sigterm_mid_accumulation_saves_at_the_window_end_and_resumes_exactly(tmp_path):
    """SIGTERM during the first batch of a window of 2 (``trainer.accumulate_grad_batches=2``): ``last.ckpt`` is saved
    at the end of the window's last batch, after its optimizer step. Saved after the first batch, the resumed run
    stepped on the second batch's gradient alone (the first's is in no checkpoint): other weights, no error."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(compose(whole, ACCUMULATE), callbacks=[SaveWeights(str(whole / "w"))])
    with pytest.raises(SystemExit):  # global step 1 starts at batch 2: the first of the second window
        train(compose(cut, ACCUMULATE), callbacks=[SendSignal(at_step=1, signum=signal.SIGTERM)])
    ckpt = torch.load(cut / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    position = ckpt["callbacks"]["ExactResume"]["loader"]["batches"]
    assert (ckpt["global_step"], position) == (2, 4)  # two optimizer steps, four batches: a window's end
    train(compose(cut, ACCUMULATE), callbacks=[SaveWeights(str(cut / "w"))])
    a, b = _weights(whole / "w"), _weights(cut / "w")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_run_does_not_overwrite_its_window_end_checkpoint_mid_window(tmp_path):
    """``every_n_train_steps=2`` with windows of 2 batches: the resumed run's first batch is at global step 2 still (the
    step it resumed at), which a new process has not saved; ``last.ckpt`` stays the window end's until step 4."""
    run = [*ACCUMULATE, "callbacks.last_checkpoint.every_n_train_steps=2"]
    with pytest.raises(SystemExit):  # stopped after batch 3's end, where step 2 was saved
        train(compose(tmp_path, run), callbacks=[_StopAfterBatch(4)])
    first = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert first["callbacks"]["ExactResume"]["loader"]["batches"] == 4
    with pytest.raises(SystemExit):  # the resumed run: stopped at its first batch's end (global step 2, batch 5)
        train(compose(tmp_path, run), callbacks=[_StopAfterBatch(5)])
    again = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert again["callbacks"]["ExactResume"]["loader"]["batches"] == 4  # not 5: mid-window, its gradient lost


class _StopAfterBatch(SendSignal):
    """Raise SystemExit at the start of the batch after ``batches`` batches of the epoch (every callback's
    ``on_train_batch_end`` of the batch before has run)."""

    def __init__(self, batches: int) -> None:
        super().__init__(at_step=-1)
        self.batches = batches

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batches:
            raise SystemExit(3)
