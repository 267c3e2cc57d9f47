"""What the loggers write for a run that Lightning runs without loggers (``trainer.fast_dev_run``)."""

from __future__ import annotations

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1"]


def test_fast_dev_run_opens_no_logger_run(tmp_path, capsys, monkeypatch):
    """Lightning's ``fast_dev_run`` replaces the loggers with a dummy: no W&B run (offline files, or a run on the
    server online), no TensorBoard event file, no CSV ``hparams.yaml``; the closing lines name no W&B run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    over = [*TINY_VIT, *FAST, "trainer.fast_dev_run=true", "logger=[wandb,csv,tensorboard]"]
    train(compose(tmp_path, over))
    out = capsys.readouterr().out
    assert "test accuracy" in out and (tmp_path / "metrics.json").exists()
    assert not list(tmp_path.glob("wandb/*run-*")), sorted(p.name for p in (tmp_path / "wandb").iterdir())
    assert not (tmp_path / "csv" / "hparams.yaml").exists() and not list(tmp_path.glob("tensorboard/events.*"))
    assert "W&B run" not in out
