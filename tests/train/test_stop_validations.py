"""A run stopped mid-epoch at a validation point (``trainer.val_check_interval``) and resumed against the same run
unstopped: the same validations in ``metrics.csv``, the same ``metrics.json`` figures; and the rule that tells
``last.ckpt`` to wait for a validation (:func:`vitrel.train.loop_rules.validates_after`) against Lightning's own."""

from __future__ import annotations

import json
import signal

import lightning as L
import pandas as pd
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.train_helpers import FAST, TINY_VIT, SendSignal, compose
from vitrel.train.loop_rules import validates_after
from vitrel.train.run import train

# 4 batches an epoch, validated after the 2nd and the 4th
RUN = [*TINY_VIT, *FAST, "logger=csv", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
RUN += ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.val_check_interval=0.5"]


def _validations(run) -> pd.DataFrame:
    rows = pd.read_csv(run / "csv" / "metrics.csv")
    return rows[rows["val/acc1"].notna()][["epoch", "step", "val/loss", "val/acc1"]].reset_index(drop=True)


def _figures(run) -> dict:
    record = json.loads((run / "metrics.json").read_text())
    return {k: record.get(k) for k in ("val_runs", "global_step", "metrics")}


def test_a_signal_at_a_validation_point_validates_then_saves(tmp_path):
    """SIGTERM during step 2, after which ``val_check_interval=0.5`` validates: ``last.ckpt`` was written before that
    validation and the run exited without it; Lightning resumes such a file past the validation, so the stopped and
    resumed run had 1 of the 2 validations in ``metrics.csv`` and ``val_runs`` 1. The validation runs, ``last.ckpt`` is
    written again after it, then the exit: both validations, the same figures as the unstopped run."""
    whole = tmp_path / "whole"
    train(compose(whole, RUN))
    stopped = tmp_path / "stopped"
    with pytest.raises(SystemExit) as stop:
        train(compose(stopped, RUN), callbacks=[SendSignal(at_step=1)])  # (raised as step 2 starts)
    assert stop.value.code == 128 + signal.SIGTERM
    ckpt = torch.load(stopped / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert (ckpt["global_step"], ckpt["callbacks"]["CountValidations"]["count"]) == (2, 1)
    train(compose(stopped, RUN))
    assert len(_validations(whole)) == 2
    pd.testing.assert_frame_equal(_validations(stopped), _validations(whole))
    assert _figures(stopped) == _figures(whole)


def test_a_max_steps_stop_at_a_validation_point_keeps_the_validation(tmp_path):
    """``trainer.max_steps=2`` stops where ``val_check_interval=0.5`` validates: ``last.ckpt`` was written before the
    validation Lightning then ran, so the resumed run's ``val_runs`` was 1 of 2; now written after it."""
    whole = tmp_path / "whole"
    train(compose(whole, RUN))
    stopped = tmp_path / "stopped"
    train(compose(stopped, [*RUN, "trainer.max_steps=2"]))
    ckpt = torch.load(stopped / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert (ckpt["global_step"], ckpt["callbacks"]["CountValidations"]["count"]) == (2, 1)
    train(compose(stopped, RUN))
    assert (_figures(stopped)["val_runs"], _figures(whole)["val_runs"]) == (2, 2)
    pd.testing.assert_frame_equal(_validations(stopped), _validations(whole))
    assert _figures(stopped) == _figures(whole)


# ---- the rule against Lightning's
class Tiny(L.LightningModule):
    def __init__(self, iterable: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.iterable = iterable

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.log("v", self.layer(batch[0]).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Endless() if self.iterable else TensorDataset(torch.randn(8, 2)), batch_size=1)

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(1, 2)), batch_size=1)


class Endless(IterableDataset):
    """A training set without a length (``trainer.val_check_batch`` is infinite)."""

    def __iter__(self):
        while True:
            yield (torch.randn(2),)


class Compare(Callback):
    """At every training batch's end: our rule, Lightning's (its private ``_should_check_val_fx``, the reference), and
    the global steps after which a validation did start."""

    def __init__(self) -> None:
        self.ours, self.lightnings, self.validated = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loop = trainer.fit_loop.epoch_loop
        self.ours.append((trainer.global_step, validates_after(trainer)))
        self.lightnings.append((trainer.global_step, bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))))

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validated.append(trainer.global_step)


GRID = [  # val_check_interval, check_val_every_n_epoch, limit_train_batches, a training set without a length
    *[(v, e, lim, False) for v in (0.25, 0.5, 1.0, 3) for e in (1, 2) for lim in (1.0, 6, 0.5)],
    *[(v, None, lim, False) for v in (3, 5) for lim in (1.0, 6)],
    (1.0, 1, 5, True),
    (2, 1, 5, True),
    (3, None, 5, True),
]


@pytest.mark.parametrize(("interval", "every", "limit", "iterable"), GRID)
def test_the_rule_agrees_with_lightnings_own(tmp_path, interval, every, limit, iterable):
    """``validates_after`` (public trainer and loop state only) says, at each training batch's end, what Lightning's
    ``_should_check_val_fx`` says, and a validation follows exactly those batches: 3 epochs (or 12 steps of a training
    set without a length) over a grid of ``val_check_interval``, ``check_val_every_n_epoch``,
    ``limit_train_batches``."""
    compare = Compare()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=3,
        max_steps=12 if iterable else -1,
        val_check_interval=interval,
        check_val_every_n_epoch=every,
        limit_train_batches=limit,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[compare],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(iterable))
    assert compare.ours == compare.lightnings
    assert [step for step, yes in compare.ours if yes] == compare.validated
    assert compare.validated  # (the grid validates somewhere)
