"""The learning rate a run logs: one ``metrics.csv`` row per optimizer step (gradient accumulation too)."""

from __future__ import annotations

import csv

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train

# 8 batches in windows of 2 (4 optimizer steps), a warmup over them so the rate changes every step, a row per step
RUN = [*TINY_VIT, *FAST, "trainer.max_steps=4", "trainer.limit_train_batches=8", "trainer.limit_val_batches=1"]
RUN += ["trainer.accumulate_grad_batches=2", "trainer.log_every_n_steps=1", "module.scheduler.warmup_steps=4"]
RUN += ["logger=csv", "test=false", "callbacks.model_checkpoint=null"]
LR = "lr-AdamW/pg1"


def _lr_rows(run_dir) -> list[tuple[int, float]]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return [(int(r["step"]), float(r[LR])) for r in csv.DictReader(f) if r.get(LR)]


def test_one_lr_row_per_optimizer_step_with_accumulation(tmp_path):
    train(compose(tmp_path, RUN))
    rows = _lr_rows(tmp_path)
    assert [s for s, _ in rows] == [0, 1, 2, 3], rows  # (Lightning's monitor wrote each step's row twice)
    assert len({lr for _, lr in rows}) == 4, rows  # the warmup: a new rate each step
