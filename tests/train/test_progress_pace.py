"""The step lines' pace (``LineProgress``): images per second over all processes, validation left out, and the time
the fit's remaining steps take at that pace, as timm's train.py logs its rate."""

import re

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train import progress
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]


def test_pace_counts_every_process_images_and_leaves_validation_out(monkeypatch):
    clock = iter([100.0, 102.0])  # the window opens at 100 s; the line is printed at 102 s
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    window = progress._Window(step=4)
    window.images, window.paused = 96, 0.5  # 96 images on this process in 2 s, 0.5 s of them validating
    # 96 images x 2 processes / 1.5 s = 128 img/s; 2 steps in 1.5 s, 10 steps left: 7.5 s
    assert window.pace(6, 16, world_size=2) == "  128 img/s  eta 0:00:07"


def test_pace_without_a_known_total_or_a_step_says_what_it_can(monkeypatch):
    monkeypatch.setattr(progress.time, "monotonic", lambda: 10.0)
    window = progress._Window(step=3)
    window.images, window.started = 50, 5.0
    assert window.pace(5, float("inf"), world_size=1) == "  10 img/s"
    assert window.pace(3, 100, world_size=1) == ""  # no step since the window opened


def test_step_lines_of_a_run_give_the_pace_and_the_time_left(tmp_path, capsys):
    over = [*TINY_VIT, *FAST, *SHORT, "progress_bar=lines", "trainer.log_every_n_steps=1"]
    train(compose(tmp_path, over))
    out = capsys.readouterr().out.splitlines()
    steps = [x for x in out if " step " in x]
    assert steps, "no step lines"
    for line in steps:
        assert re.search(r"  lr \S+  \d+ img/s  eta \d+:\d\d:\d\d$", line), line
    assert steps[-1].endswith("eta 0:00:00")  # the fit's last step: none left
    (test,) = [x for x in out if x.startswith("test batch")]  # validation and test lines: the time left too
    assert re.fullmatch(r"test batch 1/1  \(\d+\.\d s, eta 0:00:00\)", test), test


def test_clock():
    assert (progress._clock(3723.9), progress._clock(59.99), progress._clock(-1)) == ("1:02:03", "0:00:59", "0:00:00")
