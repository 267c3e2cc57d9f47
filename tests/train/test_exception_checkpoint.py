"""An exception mid-epoch (a loader error, an out-of-memory in a forward, Ctrl-C) leaves ``last.ckpt`` at the last
completed step (``ExceptionCheckpoint``): the training state of the uninterrupted run's checkpoint at that step (loops,
RNG states, loader position), and ``resume=auto`` from it ends as the uninterrupted run: the same weights, bit for bit,
and the same ``metrics.csv``. No save after a non-finite loss or with no step since the last save."""

from __future__ import annotations

import csv
import logging
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.train_helpers import FAST, TINY_VIT, PoisonWeights, RaiseInForward, SendSignal, compose, run_script_forked
from vitrel.train.callbacks import NonFiniteLossError
from vitrel.train.run import train

# 2 epochs of 4 steps (last.ckpt at each epoch's end), a CSV row per step; drop path and mixup draw from the torch and
# numpy RNGs in every step, so a resume that does not restore them diverges
COMMON = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1"]
COMMON += ["trainer.log_every_n_steps=1", "test=false", "callbacks.model_checkpoint=null", "logger=csv"]
COMMON += ["model.drop_path_rate=0.1", "module/mixup=default"]
SAVED = "saved last.ckpt at step 5 before the exception: resume with resume=auto"


def _ckpt(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


class _SaveAt(L.Callback):
    """A checkpoint at the end of the batch of step ``step``, where LastCheckpoint writes its step checkpoints."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path, weights_only=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, list[dict[str, str]], dict]:
    """The final state dict and metrics rows of the run without an exception, and its checkpoint at step 5."""
    run = tmp_path_factory.mktemp("straight")
    train(compose(run, COMMON), callbacks=[_SaveAt(5, run / "step5.ckpt")])
    step5 = torch.load(run / "step5.ckpt", map_location="cpu", weights_only=True)
    return _ckpt(run)["state_dict"], _rows(run), step5


def _differences(got: Any, want: Any, at: str = "") -> list[str]:
    """Where two checkpoint parts differ (tensors bit for bit)."""
    if isinstance(want, dict) and isinstance(got, dict):
        if got.keys() != want.keys():
            return [f"{at}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in _differences(got[k], want[k], f"{at}/{k}")]
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{at}[{i}]")]
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
        return [] if torch.equal(got, want) else [at]
    return [] if got == want else [f"{at}: {got!r} != {want!r}"]


def _resume_matches(run: Path, uninterrupted) -> None:
    want_sd, want_rows, step5 = uninterrupted
    saved = _ckpt(run)
    assert saved["global_step"] == 5  # epoch 1, 1 of its 4 batches done
    # the file a save at the end of step 5's batch writes: loops, RNG states and loader position (ExactResume) included
    parts = ["epoch", "global_step", "loops", "callbacks", "state_dict", "optimizer_states", "lr_schedulers"]
    step5 = {**step5, "callbacks": dict(step5["callbacks"])}  # (the fixture's, shared: left as it is)
    times = [saved["callbacks"].pop("RunTimes"), step5["callbacks"].pop("RunTimes")]  # (each run's own: they differ)
    assert [t["processes"] for t in times] == [1, 1] and times[0]["fit_s"] > 0
    differ = _differences({k: saved[k] for k in parts}, {k: step5[k] for k in parts})
    assert not differ, f"last.ckpt differs from the uninterrupted run's checkpoint at step 5: {differ[:5]}"
    train(compose(run, COMMON))  # resume=auto
    got_sd = _ckpt(run)["state_dict"]
    assert got_sd.keys() == want_sd.keys()
    differ = [k for k in want_sd if not torch.equal(got_sd[k], want_sd[k])]
    assert not differ, f"the resumed run's final weights differ from the uninterrupted run's: {differ[:5]}"
    got_rows = _rows(run)
    assert [r["step"] for r in got_rows] == [r["step"] for r in want_rows], "rows lost or repeated"
    assert got_rows == want_rows


def test_loader_error_saves_the_last_step_and_resumes_exactly(tmp_path, uninterrupted):
    """``python train.py``: the data set raises making the batch of step 6; last.ckpt holds step 5."""
    crash = "+callbacks.crash={_target_: train_helpers.RaiseOnFetch, at_step: 5}"
    proc = run_script_forked("train.py", [*COMMON, crash, f"hydra.run.dir={tmp_path}"], tmp_path.parent)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "OSError: image file is truncated" in out, out[-3000:]
    assert SAVED in out, out[-3000:]
    _resume_matches(tmp_path, uninterrupted)


def test_out_of_memory_in_a_forward_saves_the_last_step_and_resumes_exactly(tmp_path, uninterrupted, caplog):
    """The forward of step 6's batch raises in its last block, after the first drew its drop path."""
    with caplog.at_level(logging.WARNING), pytest.raises(torch.OutOfMemoryError):
        train(compose(tmp_path, COMMON), callbacks=[RaiseInForward(at_step=5)])
    assert SAVED in caplog.text
    _resume_matches(tmp_path, uninterrupted)


def test_ctrl_c_saves_the_last_step_and_resumes_exactly(tmp_path, uninterrupted, caplog):
    """Ctrl-C (SIGINT) as the batch of step 6 starts: Lightning ends the run (exit 1) after the callbacks'
    ``on_exception``; last.ckpt holds step 5."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a terminal's Ctrl-C, whatever ran before)
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(SystemExit) as exc:
            train(compose(tmp_path, COMMON), callbacks=[SendSignal(at_step=5, signum=signal.SIGINT)])
    finally:
        signal.signal(signal.SIGINT, before)  # Lightning ignores further Ctrl-C while it shuts down
    assert exc.value.code == 1
    assert SAVED in caplog.text
    _resume_matches(tmp_path, uninterrupted)


def test_no_save_after_a_non_finite_loss(tmp_path, caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(NonFiniteLossError):
        train(compose(tmp_path, COMMON), callbacks=[PoisonWeights(at_step=5)])
    assert _ckpt(tmp_path)["global_step"] == 4  # epoch 0's end
    assert "before the exception" not in caplog.text


class _FileAtEpoch1(L.Callback):
    """At the start of epoch 1 (after epoch 0's last.ckpt): the file's inode and time; then the first fetch raises."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            st = os.stat(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")
            self.file = (st.st_ino, st.st_mtime_ns)

            def corrupt(*args, **kwargs):
                raise OSError("image file is truncated (test)")

            trainer.train_dataloader.dataset.batch = corrupt


def test_no_save_without_a_step_since_the_last_save(tmp_path, caplog):
    cb = _FileAtEpoch1()
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="truncated"):
        train(compose(tmp_path, COMMON), callbacks=[cb])
    st = os.stat(tmp_path / "checkpoints" / "last.ckpt")
    assert (st.st_ino, st.st_mtime_ns) == cb.file, "last.ckpt was written again"
    assert _ckpt(tmp_path)["global_step"] == 4
    assert "before the exception" not in caplog.text


class _RaiseInBackward(L.Callback):
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == 5:
            raise torch.OutOfMemoryError("CUDA out of memory (test: backward after step 5)")


def test_no_save_once_the_failed_batch_counts_in_the_epoch_metrics(tmp_path, caplog):
    """An exception in the backward pass: ClassifierModule's epoch totals hold the failed batch, so a save would not be
    the state after step 5; last.ckpt stays at epoch 0's end and the log says why."""
    with caplog.at_level(logging.WARNING), pytest.raises(torch.OutOfMemoryError):
        train(compose(tmp_path, COMMON), callbacks=[_RaiseInBackward()])
    assert _ckpt(tmp_path)["global_step"] == 4
    assert "not updated to step 5 before the exception: the failed batch already counts in the epoch's" in caplog.text
