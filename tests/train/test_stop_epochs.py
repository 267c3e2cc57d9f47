"""``metrics.json``'s ``epochs`` of a fit a stop ended part-way through an epoch: the completed epochs, and the
stop's steps of the next as ``partial_epoch_steps``."""

from __future__ import annotations

import json

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train

# 4 batches an epoch
RUN = [*TINY_VIT, *FAST, "logger=none", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
RUN += ["trainer.max_epochs=2", "trainer.limit_train_batches=4"]


def _figures(run) -> dict:
    record = json.loads((run / "metrics.json").read_text())
    return {k: record.get(k) for k in ("epochs", "partial_epoch_steps", "val_runs", "global_step", "metrics")}


def test_epochs_count_the_completed_ones_and_a_stops_steps_of_the_next(tmp_path, capsys):
    """``trainer.max_steps=6`` with epochs of 4 steps: 1 epoch and 2 steps of the next, where ``epochs`` said 2.
    Resumed to its end, 2 epochs and no partial steps, as the unstopped run."""
    train(compose(tmp_path, [*RUN, "trainer.max_steps=6"]))
    first = _figures(tmp_path)
    assert (first["epochs"], first["partial_epoch_steps"], first["global_step"]) == (1, 2, 6)
    assert "(1 epoch and 2 steps of the next, 6 steps" in capsys.readouterr().out  # (the closing line)
    train(compose(tmp_path, RUN))
    done = _figures(tmp_path)
    assert (done["epochs"], done["partial_epoch_steps"], done["global_step"]) == (2, 0, 8)
