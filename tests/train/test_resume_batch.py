"""A resume mid-epoch continues the epoch's order where it stopped, counted in batches of the checkpoint's size on each
of its processes: with another ``data.batch_size`` or number of processes it would train on some of the epoch's images
twice and skip others, so it is refused in one line; at an epoch's end any batch size resumes."""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

import vitrel.train.resume as resume_module
from tests.train_helpers import FAST, TINY_VIT, compose, run_script_forked
from vitrel.train.callbacks import ResumePositionError
from vitrel.train.run import train

# 2 epochs of 5 steps of 16 images; SIGTERM at step 3 saves last.ckpt after it (4 of epoch 0's 5) and exits
SHORT = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=5", "trainer.limit_val_batches=1"]
SHORT += ["test=false", "callbacks.model_checkpoint=null"]


def _files(d: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def killed_mid_epoch(tmp_path_factory) -> Path:
    """The run folder of ``python train.py`` (batch 16, one process) stopped by SIGTERM after step 4 of epoch 0's 5."""
    run = tmp_path_factory.mktemp("resume_batch") / "run"
    sig = "+callbacks.sig={_target_: train_helpers.SendSignal, at_step: 3}"
    proc = run_script_forked("train.py", [*SHORT, "logger=csv", sig, f"hydra.run.dir={run}"], run.parent)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout[-2000:] + proc.stderr[-4000:]
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["global_step"] == 4 and state["epoch"] == 0
    position = state["callbacks"]["ExactResume"]
    assert position["loader"] == {"epoch": 0, "batches": 4, "batch_size": 16, "num_replicas": 1}
    assert position["epoch_batches"] == 5
    return run


def test_mid_epoch_resume_with_another_batch_size_is_one_line(killed_mid_epoch, tmp_path):
    """``python train.py data.batch_size=32`` in the killed run's folder: one line naming the checkpoint, both sizes and
    the fixes, before the loggers touch the run's files."""
    run = killed_mid_epoch
    ckpt, before = run / "checkpoints" / "last.ckpt", _files(run / "csv")
    proc = run_script_forked("train.py", [*SHORT, "logger=csv", "data.batch_size=32", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert last.startswith(f"train.py: ResumePositionError: {ckpt} was saved mid-epoch (epoch 0, 4 of 5 batches"), last
    assert "data.batch_size=32 (checkpoint: 16)" in last and "Resume with data.batch_size=16 on 1 process," in last
    assert f"model=from_checkpoint model.path={ckpt}" in last and "an epoch's end" in last
    assert _files(run / "csv") == before


def test_mid_epoch_resume_on_more_processes_is_refused(killed_mid_epoch):
    """Two DDP processes (each would take every other sample of the order) from a one-process checkpoint: refused
    before the processes start (ddp_spawn: were they started, they would fail in the children, not here)."""
    two = [*SHORT, "logger=none", "trainer.devices=2", "trainer.strategy=ddp_spawn"]
    with pytest.raises(ResumePositionError, match=r"with 2 processes \(trainer.devices x trainer.num_nodes; checkp"):
        train(compose(killed_mid_epoch, two))


def test_the_trainer_refuses_what_train_could_not_see(killed_mid_epoch, tmp_path, monkeypatch):
    """ExactResume checks the loader it resumes (trainer.fit with a ckpt_path, a cluster's world size) itself."""
    run = tmp_path / "copy"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes((killed_mid_epoch / "checkpoints" / "last.ckpt").read_bytes())
    monkeypatch.setattr(resume_module, "check_resume_position", lambda *a, **k: None)  # (train()'s, before the trainer)
    with pytest.raises(ResumePositionError, match=r"data.batch_size=8 \(checkpoint: 16\)"):
        train(compose(run, [*SHORT, "logger=none", "data.batch_size=8"]))


def test_old_checkpoints_and_the_same_settings_resume(killed_mid_epoch, tmp_path):
    """A checkpoint written before the loaders kept their batch size is not checked; the same settings resume (their
    exactness: test_resume_safety.py::test_interrupted_runs_continue_their_logs_and_epoch_metrics)."""
    state = torch.load(killed_mid_epoch / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    position = state["callbacks"]["ExactResume"]
    position["loader"] = {k: position["loader"][k] for k in ("epoch", "batches")}
    del position["epoch_batches"]
    old = tmp_path / "old.ckpt"
    torch.save(state, old)
    train(compose(tmp_path / "from_old", [*SHORT, "logger=none", "data.batch_size=32", f"ckpt_path={old}"]))

    same = tmp_path / "same"
    (same / "checkpoints").mkdir(parents=True)
    (same / "checkpoints" / "last.ckpt").write_bytes((killed_mid_epoch / "checkpoints" / "last.ckpt").read_bytes())
    train(compose(same, [*SHORT, "logger=none"]))
    assert torch.load(same / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 10


class _Seen(L.Callback):
    """A digest of every training image, per epoch."""

    def __init__(self) -> None:
        self.seen: dict[int, list[str]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x = batch[0].detach().cpu()
        digests = [hashlib.sha1(x[i].numpy().tobytes()).hexdigest() for i in range(len(x))]
        self.seen.setdefault(trainer.current_epoch, []).extend(digests)


def test_resume_at_an_epoch_end_with_another_batch_size_trains_every_image_once(tmp_path):
    """One epoch of 200 images in batches of 16, resumed for a second in batches of 40: 5 steps, each image once."""
    base = [*TINY_VIT, *FAST, "data.val_fraction=0.98", "trainer.limit_val_batches=1", "test=false", "logger=none"]
    base += ["callbacks.model_checkpoint=null"]
    first, second = _Seen(), _Seen()
    train(compose(tmp_path, [*base, "trainer.max_epochs=1"]), callbacks=[first])
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert state["callbacks"]["ExactResume"]["loader"]["batches"] == 13  # epoch 0 done: ceil(200 / 16)
    train(compose(tmp_path, [*base, "trainer.max_epochs=2", "data.batch_size=40"]), callbacks=[second])
    assert list(second.seen) == [1]
    assert sorted(second.seen[1]) == sorted(first.seen[0]) and len(first.seen[0]) == 200
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert state["global_step"] == 13 + 5
