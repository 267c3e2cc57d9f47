"""A training run's lifecycle: interruptions and resumes with gradient accumulation, logged rates, repeatability."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.train_helpers import FAST, TINY_VIT, SaveWeights, SendSignal, compose
from vitrel.train.loop_rules import mid_window
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


class _Windows(Callback):
    """Per training batch: (epoch, batch_idx, ``mid_window`` at its end, no optimizer step in it)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, bool, bool]] = []
        self._step = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        no_step = trainer.global_step == self._step
        self.rows.append((trainer.current_epoch, batch_idx, mid_window(trainer, batch_idx), no_step))


def test_mid_window_is_where_lightning_does_not_step(tmp_path):
    """``mid_window`` (no step or signal checkpoint there) against the optimizer steps Lightning takes, windows of 3
    batches in epochs of 8: steps after batches 3, 6 and 8, the epoch's last (its window cut short), in both epochs."""
    run = [o for o in ACCUMULATE if not o.startswith(("trainer.accumulate_grad_batches", "trainer.max_epochs"))]
    windows = _Windows()
    train(compose(tmp_path, [*run, "trainer.accumulate_grad_batches=3", "trainer.max_epochs=2"]), callbacks=[windows])
    assert [(e, i) for e, i, mid, _ in windows.rows if not mid] == [(e, i) for e in (0, 1) for i in (2, 5, 7)]
    assert all(mid == no_step for *_, mid, no_step in windows.rows)


class _SigtermInValidation(Callback):
    """SIGTERM to this process as batch ``at`` of the first validation starts; the validation batches started."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.started: list[int] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.started.append(batch_idx)
        if trainer.current_epoch == 0 and batch_idx == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("at", [1, 3])
def test_sigterm_during_validation_stops_as_lightning_does(tmp_path, at):
    """SIGTERM during validation (4 batches, at the end of epoch 0 of 4 steps): at batch 1, the run stops as batch 1
    ends, without a checkpoint; at the last batch, after the epoch's end, its ``last.ckpt`` (step 4) saved."""
    run = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=4"]
    run += ["logger=none", "test=false"]
    stop = _SigtermInValidation(at)
    with pytest.raises(SystemExit) as exc:
        train(compose(tmp_path, run), callbacks=[stop])
    assert exc.value.code == 128 + signal.SIGTERM
    last = tmp_path / "checkpoints" / "last.ckpt"
    if at == 1:
        assert stop.started == [0, 1] and not last.exists()
    else:
        assert stop.started == [0, 1, 2, 3]
        assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 4


def test_a_run_shorter_than_its_warmup_logs_the_configured_warmup_rates(tmp_path, caplog):
    """``trainer.max_steps=6`` of a recipe whose warmup is half an epoch of 20 steps (10 steps): the logged rate at step
    k is ``warmup_lr + (lr - warmup_lr) * k / 10``, the configured ramp, and the log says the run ends inside it.
    Clipped to the run's 6 steps, the ramp was steeper than configured (step 5: 0.83 lr, not 0.5 lr), and a resume
    with a longer run went back down it."""
    import csv

    run = [*TINY_VIT, *FAST, "trainer.max_steps=6", "trainer.limit_train_batches=20", "trainer.limit_val_batches=1"]
    run += ["trainer.limit_test_batches=1", "logger=csv", "trainer.log_every_n_steps=1", "test=false"]
    run += ["module.optimizer.lr=1e-3", "module.scheduler.warmup_epochs=0.5", "module.scheduler.warmup_lr=0.0"]
    with caplog.at_level("INFO"):
        train(compose(tmp_path, run))
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    logged = {int(r["step"]): float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")}
    assert sorted(logged) == list(range(6))
    assert all(logged[k] == pytest.approx(1e-3 * k / 10) for k in logged)
    assert "ends inside its warmup" in caplog.text


def test_a_mid_epoch_resume_with_another_seed_is_refused_naming_the_seed(tmp_path):
    """The epoch's order is drawn from ``seed``: a run of ``seed=3`` stopped mid-epoch and resumed as
    docs/checkpoints.md shows (``hydra.run.dir=<run> ckpt_path=last``, the ``seed=3`` override not repeated) continued
    the epoch in ``seed=0``'s order, training on some of its images twice and skipping others, without a word. It is a
    ``ResumePositionError`` naming both seeds; with ``seed=3`` it resumes; at an epoch's end any seed does."""
    from vitrel.train.callbacks import ResumePositionError

    run = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=5", "trainer.limit_val_batches=1"]
    run += ["logger=none", "test=false", "callbacks.model_checkpoint=null"]
    with pytest.raises(SystemExit):
        train(compose(tmp_path, [*run, "seed=3"]), callbacks=[SendSignal(at_step=2, signum=signal.SIGTERM)])
    with pytest.raises(ResumePositionError, match=r"seed=0 \(checkpoint: 3\).* Resume with .*seed=3"):
        train(compose(tmp_path, [*run, "ckpt_path=last"]))
    with pytest.raises(SystemExit):  # the same seed: resumes, and stops at the epoch's end (step 5)
        train(compose(tmp_path, [*run, "seed=3"]), callbacks=[SendSignal(at_step=4, signum=signal.SIGTERM)])
    assert train(compose(tmp_path, [*run, "seed=1"]))  # an epoch's end: the next epoch in seed=1's order


def test_debug_overfit_trains_on_the_default_memory_loader_data(tmp_path):
    """``debug=overfit`` on Fashion-MNIST (whose loader is ``memory``): Lightning's ``overfit_batches`` swaps the
    training loader's sampler, which only a DataLoader has; it failed with a traceback ending in "needs to subclass
    `torch.utils.data.DataLoader`". The debug config takes the workers loader."""
    run = [*TINY_VIT, *FAST, "debug=overfit", "trainer.max_epochs=2", "trainer.limit_test_batches=1", "logger=none"]
    result = train(compose(tmp_path, run))
    assert result["test/acc1"] >= 0.0
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_overfit_batches_with_the_memory_loader_is_refused_naming_the_fix(tmp_path):
    """``trainer.overfit_batches=4`` alone (Lightning's flag) on the default data: Lightning's traceback ("needs to
    subclass torch.utils.data.DataLoader") before; a ``ConfigError`` naming ``data.loader=workers`` and
    ``debug=overfit``, before anything is built."""
    from vitrel.config import ConfigError

    run = [*TINY_VIT, *FAST, "trainer.overfit_batches=4", "trainer.max_epochs=1", "logger=none"]
    with pytest.raises(ConfigError, match=r"^trainer.overfit_batches=4 .* add data.loader=workers .* debug=overfit"):
        train(compose(tmp_path, run))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("value", ["true", "yes"])
def test_a_resume_value_it_does_not_take_is_one_line_naming_the_choices(tmp_path, value):
    """``resume=true`` (a user who wants the run to resume) ended in a traceback, after the data and the model were
    built: one line, naming what ``resume`` takes and ``ckpt_path=last``."""
    from tests.train_helpers import run_script_forked

    proc = run_script_forked(
        "train.py", [*TINY_VIT, *FAST, f"resume={value}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    last = out.splitlines()[-1]
    assert last.startswith("train.py: ConfigError: resume=") and "auto" in last and "ckpt_path=last" in last, last
