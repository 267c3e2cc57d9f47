"""The plain progress lines agree with the loggers: an epoch's line gives the validation metrics of that epoch only."""

from __future__ import annotations

import csv

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train


def test_epoch_line_without_a_validation_shows_no_val_metrics(tmp_path, capsys):
    """``trainer.check_val_every_n_epoch=2``: epoch 2 validates, epochs 1 and 3 do not. Epoch 3's line showed epoch 2's
    ``val/*`` (the trainer's metrics keep the last ones) as if epoch 3 had scored them; ``metrics.csv`` has one
    validation row, at epoch index 1, and the lines now say the same."""
    over = [*TINY_VIT, *(a for a in FAST if a != "progress_bar=none"), "progress_bar=lines", "logger=csv"]
    over += ["trainer.max_epochs=3", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    over += ["trainer.limit_test_batches=1", "trainer.check_val_every_n_epoch=2"]
    train(compose(tmp_path, over))
    lines = {
        ln.split()[1]: ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch ") and "/3 " in ln
    }
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        validated = [int(r["epoch"]) + 1 for r in csv.DictReader(f) if r["val/acc1"]]
    assert validated == [2]
    assert [e for e, ln in sorted(lines.items()) if "val/acc1" in ln] == ["2/3"], lines


def test_step_lines_after_a_resume_with_other_steps_an_epoch_count_to_the_fits_end(tmp_path, capsys):
    """2 epochs of 4 batches in windows of 2 (4 steps), resumed to 4 epochs of 1-batch steps (as a run moved from 1
    process to 2): the fit ends at step 4 + 2 x 4 = 12. The lines counted to Lightning's estimate, 4 epochs x 4 = 16
    (an ETA of steps that never come); the other way they went past it (``step 42/36``)."""
    base = [*TINY_VIT, *(a for a in FAST if a != "progress_bar=none"), "progress_bar=lines", "logger=none"]
    base += [
        "trainer.limit_train_batches=4",
        "trainer.limit_val_batches=1",
        "test=false",
        "trainer.log_every_n_steps=1",
    ]
    train(compose(tmp_path, [*base, "trainer.max_epochs=2", "trainer.accumulate_grad_batches=2"]))
    capsys.readouterr()
    train(compose(tmp_path, [*base, "trainer.max_epochs=4", "trainer.accumulate_grad_batches=1"]))  # resume=auto
    steps = [ln.split()[3] for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch ") and " step " in ln]
    assert steps == [f"{n}/12" for n in range(5, 13)], steps
