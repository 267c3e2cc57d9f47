"""The learning rate a run logs: one ``metrics.csv`` row per optimizer step (gradient accumulation too), and the plain
progress line: one per optimizer step, showing the rate the step used, as the CSV does."""

from __future__ import annotations

import csv
import json
import re

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


def test_progress_line_counts_optimizer_steps_and_shows_the_rate_each_used(tmp_path, capsys):
    """Under accumulate_grad_batches=2 a step line is an optimizer step (trainer.global_step as it ends, of the fit's
    4), not a batch: the 8 batches make 4 lines, step N being the loggers' row N - 1."""
    train(compose(tmp_path, [*RUN, "progress_bar=lines"]))
    csv_lr = dict(_lr_rows(tmp_path))
    lines = re.findall(r"^epoch 1 step (\d+)/(\S+) .* lr (\S+)(?:  \d+ img/s.*)?$", capsys.readouterr().out, flags=re.M)
    assert [(int(n), total) for n, total, _ in lines] == [(1, "4"), (2, "4"), (3, "4"), (4, "4")], lines
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 4  # the last line's step
    for n, _, lr in lines:
        assert lr == f"{csv_lr[int(n) - 1]:.3g}", (n, lr, csv_lr)


def test_progress_line_shows_the_top_layers_rate_under_layer_decay(tmp_path, capsys):
    """Under ``module.layer_decay`` each layer's group has its own rate (``lr-AdamW/pg1`` the stem's, the lowest); the
    step line shows the largest, the rate the schedule gives ``module.optimizer.lr`` (the head's), not the stem's."""
    train(compose(tmp_path, [*RUN, "progress_bar=lines", "module.layer_decay=0.5"]))
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get(LR)]
    top = {int(r["step"]): max(float(v) for k, v in r.items() if k.startswith("lr-") and v) for r in rows}
    assert all(top[int(r["step"])] >= 7.9 * float(r[LR]) for r in rows)  # 2 blocks: the stem at 0.5 ** 3 of the head
    lines = re.findall(r"^epoch 1 step (\d+)/\S+ .* lr (\S+)(?:  \d+ img/s.*)?$", capsys.readouterr().out, flags=re.M)
    assert len(lines) == 4, lines
    for n, lr in lines:
        assert lr == f"{top[int(n) - 1]:.3g}", (n, lr, top)
