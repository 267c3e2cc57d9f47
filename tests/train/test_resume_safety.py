"""Nothing lost across interruptions (issue 20): a resumed run continues its CSV / TensorBoard logs and
its epoch metrics exactly, ``last.ckpt`` is never torn, one run owns a run folder at a time, and a
checkpoint of another model is refused with a ``CheckpointError``."""

from __future__ import annotations

import csv
import errno
import hashlib
import json
import logging
import math
import os
import signal
import socket
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from tests import preloaded
from tests.train_helpers import FAST, TINY_VIT, ForkedScript, compose, run_script_forked
from vitrel.config import ConfigError
from vitrel.data import ArrayDataModule, SplitMismatchError
from vitrel.models.checkpoint import CheckpointError
from vitrel.train.ckpt_io import AtomicCheckpointIO, atomic_write
from vitrel.train.progress import LineProgress
from vitrel.train.run import train
from vitrel.train.rundir import LOCK_NAME, RunFolderBusy, RunLock

# 2 epochs of 5 steps, a row per step, last.ckpt every 4 steps
COMMON = [*TINY_VIT, *FAST, "trainer.max_epochs=2", "trainer.limit_train_batches=5", "trainer.limit_val_batches=1"]
COMMON += ["trainer.log_every_n_steps=1", "test=false", "callbacks.model_checkpoint=null"]
COMMON += ["callbacks.last_checkpoint.every_n_train_steps=4"]


def _start(run_dir: Path, extra: list[str]) -> ForkedScript:
    """``python train.py <COMMON> <extra>`` in ``run_dir``, running (forked from tests/preloaded.py's server); its
    output to ``<run_dir>.out``."""
    args = [*COMMON, *extra, f"hydra.run.dir={run_dir}"]
    return ForkedScript("train.py", args, run_dir.parent, run_dir.parent / f"{run_dir.name}.out")


def _hang(at_step: int, marker: Path) -> str:
    return f"+callbacks.hang={{_target_: train_helpers.Hang, at_step: {at_step}, marker: '{marker}'}}"


def _wait_for(marker: Path, proc: ForkedScript, timeout: float = 240) -> None:
    t0 = time.time()
    while not marker.exists():
        assert proc.poll() is None, f"the run ended too early:\n{proc.output()[-4000:]}"
        assert time.time() - t0 < timeout, f"timed out waiting for {marker}"
        time.sleep(0.2)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ items 1, 4, 12, 13
@pytest.mark.slow
def test_interrupted_runs_continue_their_logs_and_epoch_metrics(tmp_path, capsys, caplog):
    """SIGTERM (step 7) and SIGKILL (step 8, after the step-8 last.ckpt) mid-epoch 1, then resume: the CSV
    file, every row of it (train/loss_epoch and train/acc1 included), and TensorBoard's scalars equal the
    uninterrupted run's; the resumed epoch's progress line has a sane time; no `weights_only` line."""
    logs = ["logger=[csv,tensorboard]"]
    term_dir, kill_dir = tmp_path / "term", tmp_path / "kill"
    marker = tmp_path / "hanging"
    term = _start(term_dir, [*logs, "+callbacks.sig={_target_: train_helpers.SendSignal, at_step: 7}"])
    kill = _start(kill_dir, [*logs, _hang(8, marker)])
    try:
        _wait_for(marker, kill)
        kill.send_signal(signal.SIGKILL)
        out_term, _ = term.communicate(timeout=240)
        kill.wait(timeout=30)
    finally:
        for p in (term, kill):
            if p.poll() is None:
                p.kill()
    assert term.returncode == 128 + signal.SIGTERM, out_term[-4000:]
    assert kill.returncode == -signal.SIGKILL
    assert "weights_only" not in out_term, "Lightning's `weights_only` line in the console"
    for d in (term_dir, kill_dir):
        last = torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert last["global_step"] == 8 and last["epoch"] == 1  # mid-epoch 1: 3 of its 5 batches done

    straight = tmp_path / "straight"
    train(compose(straight, [*COMMON, *logs]))
    capsys.readouterr()
    caplog.clear()
    for d in (term_dir, kill_dir):
        train(compose(d, [*COMMON, *logs, "ckpt_path=last", "progress_bar=lines"]))
    out = capsys.readouterr().out
    assert "weights_only" not in caplog.text + out

    # the resumed epoch's line: a time in seconds, not time since 1970 (LineProgress._t0 set at train start)
    epoch_lines = [ln for ln in out.splitlines() if ln.startswith("epoch 2/2")]
    assert len(epoch_lines) == 2
    for ln in epoch_lines:
        assert float(ln.rsplit("(", 1)[1].split(" s)")[0]) < 600, ln

    want = _rows(straight / "csv" / "metrics.csv")
    assert {"train/loss_epoch", "train/acc1", "val/acc1"} <= set(want[0]), sorted(want[0])
    for d in (term_dir, kill_dir):
        got = _rows(d / "csv" / "metrics.csv")
        assert [r["step"] for r in got] == [r["step"] for r in want], f"{d.name}: rows lost or repeated"
        assert got == want, f"{d.name}: the resumed run's metrics.csv differs from the uninterrupted run's"
        assert not (d / "csv" / "metrics.csv.resuming").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars(d: Path, tag: str) -> list[tuple[int, float]]:
        ea = EventAccumulator(str(d / "tensorboard"))
        ea.Reload()
        return [(e.step, e.value) for e in ea.Scalars(tag)]

    for tag in ("train/loss_step", "train/loss_epoch", "train/acc1"):
        ref = scalars(straight, tag)
        for d in (term_dir, kill_dir):
            assert scalars(d, tag) == ref, f"{d.name}: TensorBoard {tag}"


# ------------------------------------------------------------------------------------------ item 2
def test_atomic_write_keeps_the_previous_file_when_the_disk_is_full(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous checkpoint")

    def half_then_full(f):
        f.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, half_then_full)
    assert target.read_bytes() == b"previous checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], "temporary file left behind"


def _write_slowly(target: str, marker: str, tmpdir: str) -> None:
    """``atomic_write`` of a new ``target`` that writes 1 MB, says so in ``marker`` and sleeps (to be killed there),
    with ``TMPDIR=tmpdir`` (in a process of its own: tests/preloaded.py)."""
    import tempfile

    os.environ["TMPDIR"] = tmpdir
    tempfile.tempdir = None  # (looked up again from TMPDIR, as in a process started with it)

    def slow(f):
        f.write(b"y" * 1_000_000)
        f.flush()
        Path(marker).write_text("1")
        time.sleep(600)

    atomic_write(target, slow)


@pytest.mark.slow
def test_sigkill_mid_write_keeps_the_previous_file(tmp_path):
    """A process killed while writing the new checkpoint leaves the old one whole (and its temporary
    file beside it, never under the checkpoint's name); TMPDIR on another filesystem changes nothing."""
    target, marker = tmp_path / "last.ckpt", tmp_path / "writing"
    target.write_bytes(b"previous checkpoint")
    tmpdir = "/dev/shm" if Path("/dev/shm").is_dir() else str(tmp_path)
    proc = preloaded.start(_write_slowly, str(target), str(marker), tmpdir)
    try:
        t0 = time.time()
        while not marker.exists():
            assert proc.is_alive(), f"the writer ended (exit code {proc.exitcode}) before it wrote"
            assert time.time() - t0 < 240, f"timed out waiting for {marker}"
            time.sleep(0.2)
        proc.kill()
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    assert target.read_bytes() == b"previous checkpoint"
    (tmp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt.")]
    assert tmp.stat().st_size == 1_000_000  # the torn bytes went to the temporary file beside it


def test_training_writes_last_ckpt_atomically_and_keeps_it_on_enospc(tmp_path, monkeypatch):
    """The trainer of train() saves through AtomicCheckpointIO; a save that cannot reach the disk (ENOSPC
    at fsync, as NFS reports a full disk) fails the run and leaves the previous last.ckpt as it was."""
    short = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    short += ["test=false", "logger=none", "callbacks.model_checkpoint=null"]
    ios = []

    class Spy(LineProgress):
        def on_train_start(self, trainer, pl_module):
            ios.append(trainer.strategy.checkpoint_io)

    train(compose(tmp_path, short), callbacks=[Spy()])
    assert type(ios[0]) is AtomicCheckpointIO
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = _digest(last)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        train(compose(tmp_path, [*short, "trainer.max_epochs=2"]))
    assert _digest(last) == before
    assert not [p.name for p in last.parent.iterdir() if p.name.endswith(".tmp")], "temporary file left behind"


# ------------------------------------------------------------------------------------------ item 3
@pytest.mark.slow
def test_second_run_in_a_busy_folder_is_refused_and_a_stale_lock_is_taken_over(tmp_path):
    """A second run in a live run's folder is refused, in-process and as ``python train.py`` (whose Hydra no longer
    rewrites the first run's ``.hydra/config.yaml`` / ``overrides.yaml`` / ``hydra.yaml`` with the refused run's),
    touching none of the first run's files; once the first run is SIGKILLed, the next run takes the lock over."""
    run_dir, marker = tmp_path / "run", tmp_path / "hanging"
    first = _start(run_dir, ["logger=csv", _hang(4, marker)])
    try:
        _wait_for(marker, first)  # step 4 saved, its rows flushed
        files = {p: _digest(p) for p in (run_dir / "csv" / "metrics.csv", run_dir / "checkpoints" / "last.ckpt")}
        record = {p: _digest(p) for p in (run_dir / ".hydra").iterdir()}
        assert {"config.yaml", "overrides.yaml", "hydra.yaml"} <= {p.name for p in record}
        with pytest.raises(RunFolderBusy) as exc:
            train(compose(run_dir, [*COMMON, "logger=csv"]))
        msg = str(exc.value)
        assert f"pid {first.pid}" in msg and socket.gethostname() in msg and "started" in msg, msg
        second = run_script_forked(
            "train.py", [*COMMON, "logger=csv", "pos=rope2d_mixed", f"hydra.run.dir={run_dir}"], tmp_path
        )
        assert second.returncode != 0
        assert "another run is training in" in second.stdout + second.stderr, second.stderr[-3000:]
        assert first.poll() is None
        assert {p: _digest(p) for p in files} == files, "the second run touched the first run's files"
        after = {p: _digest(p) for p in (run_dir / ".hydra").iterdir()}
        assert after == record, "the refused run rewrote the running run's .hydra record"
        assert "pos=rope2d_mixed" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
        assert RunLock(run_dir).read().pid == first.pid
    finally:
        first.kill()
        first.wait(timeout=30)
    # the first run is gone (SIGKILL: its lock stays): the next run takes the lock over and resumes
    assert (run_dir / LOCK_NAME).exists()
    metrics = train(compose(run_dir, [*COMMON, "logger=csv"]))
    assert metrics["val/acc1"] >= 0
    assert not (run_dir / LOCK_NAME).exists()
    steps = [int(r["step"]) for r in _rows(run_dir / "csv" / "metrics.csv") if r["train/loss_step"]]
    assert steps == list(range(10)), steps


def test_a_refused_run_leaves_no_lock(tmp_path):
    """``python train.py`` refused with its one-line error (a SystemExit: Hydra then calls no ``on_run_end``) leaves
    no lock in its folder, whether refused before ``train()`` holds the folder (``resume=yes``) or while it does
    (``ckpt_path=last`` without a checkpoint). The two runs go at once, to keep the test short."""
    refusals = {"config": (["resume=yes"], "ConfigError"), "no_ckpt": (["ckpt_path=last"], "CheckpointError")}
    procs = {name: _start(tmp_path / name, extra) for name, (extra, _) in refusals.items()}
    for name, proc in procs.items():
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 1 and f"train.py: {refusals[name][1]}" in out, out[-3000:]
        assert (tmp_path / name / ".hydra" / "config.yaml").exists()  # (TakeRunFolder took the folder first)
        assert not (tmp_path / name / LOCK_NAME).exists(), f"the refused run ({name}) left its lock"


def test_a_forked_child_leaves_its_parents_lock(tmp_path):
    """A forked child that releases the lock it inherited (an ``atexit`` handler run at its exit) leaves the file to
    the process that took it."""
    lock = RunLock(tmp_path)
    lock.acquire()
    pid = os.fork()
    if pid == 0:
        lock.release()
        os._exit(0)
    os.waitpid(pid, 0)
    assert (tmp_path / LOCK_NAME).exists()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_is_left_to_rank_zero(tmp_path, monkeypatch):
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from vitrel.train.rundir import is_launching_process

    assert is_launching_process()
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # a DDP child (LOCAL_RANK=1 when Lightning imported)
    assert not is_launching_process()
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    monkeypatch.setenv("NODE_RANK", "1")
    assert not is_launching_process()


def test_lock_of_a_live_process_on_another_host_is_not_taken(tmp_path):
    lock = RunLock(tmp_path)
    lock.path.write_text('{"pid": 1, "host": "elsewhere", "started": "2026-01-01T00:00:00", "slurm_job_id": null}')
    with pytest.raises(RunFolderBusy, match="pid 1 on host elsewhere, started 2026-01-01T00:00:00"):
        lock.acquire()


# ------------------------------------------------------------------------------------------ items 3 and 10
def test_resuming_a_checkpoint_of_another_model_is_a_checkpoint_error(tmp_path):
    short = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1"]
    short += ["test=false", "logger=none", "callbacks.model_checkpoint=null"]
    first = tmp_path / "first"
    train(compose(first, short))
    ckpt = first / "checkpoints" / "last.ckpt"
    # resume=auto in the same folder with another position scheme
    with pytest.raises(CheckpointError) as exc:
        train(compose(first, [*short, "trainer.max_epochs=2", "pos=rope2d_axial"]))
    msg = str(exc.value)
    assert "pos.name: checkpoint 'rel2d_factored', configured 'rope2d_axial'" in msg, msg
    assert "state_dict" not in msg
    # ckpt_path=<another model's checkpoint> (docs/models.md: a CheckpointError on this route)
    with pytest.raises(CheckpointError, match="embed_dim: checkpoint 32, configured 48"):
        train(compose(tmp_path / "other", [*short, "model.embed_dim=48", f"ckpt_path={ckpt}"]))
    # training-only settings may change on resume
    train(compose(first, [*short, "trainer.max_epochs=2", "+model.proj_drop_rate=0.1"]))


# ------------------------------------------------------------------------------------------ issue 57, item 4
class _LearningRates(L.Callback):
    """``(global step, learning rate of that step)`` of every training step."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]))


def test_resume_with_more_epochs_follows_the_longer_schedule_and_keeps_the_best(tmp_path, caplog):
    """1 epoch of 4 steps, then resumed to 2 epochs: steps 4-7 at the rates of an uninterrupted 2-epoch run (not the
    1-epoch schedule's min_lr); the best checkpoint (``save_top_k=1``, ``monitor=epoch``, ``mode=min``: the first
    epoch stays best) is still the one file, with its score."""
    # (Lightning's rank-zero logger at INFO, whatever an earlier test in this process set)
    caplog.set_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero")
    run = tmp_path / "run"
    base = [*TINY_VIT, *FAST, "trainer.limit_train_batches=4", "trainer.limit_val_batches=1", "test=false"]
    base += ["logger=none", "callbacks.model_checkpoint.monitor=epoch", "callbacks.model_checkpoint.mode=min"]
    train(compose(run, [*base, "trainer.max_epochs=1"]))
    resumed, straight = _LearningRates(), _LearningRates()
    train(compose(run, [*base, "trainer.max_epochs=2"]), callbacks=[resumed])  # resume=auto
    train(compose(tmp_path / "straight", [*base, "trainer.max_epochs=2"]), callbacks=[straight])

    assert [s for s, _ in resumed.seen] == [4, 5, 6, 7] and [s for s, _ in straight.seen] == list(range(8))
    assert [lr for _, lr in resumed.seen] == pytest.approx([lr for _, lr in straight.seen[4:]], rel=1e-12)
    # the schedule's formula, in float64: warmup of round(0.25 * 4) = 1 step, cosine to min_lr over 8
    peak, low = 2e-3, 1e-5
    want = [low + (peak - low) * 0.5 * (1 + math.cos(math.pi * (s - 1) / 7)) for s in range(4, 8)]
    assert [lr for _, lr in resumed.seen] == pytest.approx(want, rel=1e-6)
    assert "learning-rate schedule: 8 steps (1 of warmup) for this run, the checkpoint's had 4 (1)" in caplog.text

    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("best-*")) == ["best-epoch000.ckpt"], "save_top_k=1 across the resume"
    state = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)["callbacks"]
    best = next(v for k, v in state.items() if k.startswith("ModelCheckpoint"))
    assert best["best_model_path"] == str(ckpts / "best-epoch000.ckpt") and float(best["best_model_score"]) == 0.0
    assert list(best["best_k_models"]) == [str(ckpts / "best-epoch000.ckpt")]


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)], ids=["fewer-steps-before", "more-steps-before"])
def test_resume_with_other_steps_an_epoch_follows_the_epochs_done(tmp_path, caplog, before, after):
    """2 epochs of 4 batches under ``accumulate_grad_batches=before``, resumed to 4 epochs under ``after`` (as a run
    moved from 1 process to 2, or a batch size changed): every rate after the resume is that of an uninterrupted
    4-epoch run of the new settings at the same epoch and batch (timm's ``num_updates = epoch * updates_per_epoch``).
    By the optimizer steps taken (4 of 2-batch windows), the schedule of 16 one-batch steps restarted at 4 and ended
    at step 11 without its cosine's end; the other way, the added epochs ran at ``min_lr``."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero")
    run = tmp_path / "run"
    base = [*TINY_VIT, *FAST, "trainer.limit_train_batches=4", "trainer.limit_val_batches=1", "test=false"]
    base += ["logger=none", "callbacks.model_checkpoint=null", "module.scheduler.warmup_epochs=0.5"]
    train(compose(run, [*base, "trainer.max_epochs=2", f"trainer.accumulate_grad_batches={before}"]))
    resumed, straight = _LearningRates(), _LearningRates()
    new = [*base, "trainer.max_epochs=4", f"trainer.accumulate_grad_batches={after}"]
    train(compose(run, new), callbacks=[resumed])  # resume=auto
    train(compose(tmp_path / "straight", new), callbacks=[straight])
    # (the rate of each batch: an accumulation window's batches share their step's)
    assert [lr for _, lr in resumed.seen] == pytest.approx([lr for _, lr in straight.seen[8:]], rel=1e-12)
    assert straight.seen[-1][1] < 2e-3 * 0.2  # (the cosine near its end)
    steps_done = 8 // before
    said = f"the 2 epoch(s) done are step {8 // after} of this run's ({4 // after} an epoch), where the checkpoint "
    assert said + f"took {steps_done} optimizer steps" in caplog.text


def test_a_moved_run_folder_resumes_keeping_its_best_checkpoint_and_score(tmp_path):
    """A run folder moved (or copied) and resumed there: Lightning's ``ModelCheckpoint`` reloads no best score when
    its folder changed, so the next epoch became "best" whatever its score (a second best file beside the first, and
    the summary naming it: epoch 4 at val/acc1 0.25 over epoch 1's 0.28), or a copy kept naming the other folder's
    file. The state now follows the folder: the best file and score are the moved run's."""
    import shutil

    base = [*TINY_VIT, *FAST, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
    base += ["logger=none", "callbacks.model_checkpoint.monitor=epoch", "callbacks.model_checkpoint.mode=min"]
    train(compose(tmp_path / "a", [*base, "trainer.max_epochs=1"]))
    shutil.move(tmp_path / "a", tmp_path / "b")
    train(compose(tmp_path / "b", [*base, "trainer.max_epochs=2"]))  # resume=auto, epoch 1 not better
    ckpts = tmp_path / "b" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("best-*")) == ["best-epoch000.ckpt"], "save_top_k=1 across the move"
    res = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert res["best_ckpt"] == str(ckpts / "best-epoch000.ckpt") and res["epochs"] == 2
    state = torch.load(ckpts / "last.ckpt", map_location="cpu", weights_only=True)["callbacks"]
    best = next(v for k, v in state.items() if k.startswith("ModelCheckpoint"))
    assert best["best_model_path"] == str(ckpts / "best-epoch000.ckpt") and float(best["best_model_score"]) == 0.0


def test_a_resume_after_a_kill_between_the_best_and_last_saves_names_no_gone_file(tmp_path):
    """Killed after writing a new best file (which removes the previous one) and before ``last.ckpt``: the resumed
    state named the removed file, and a replayed epoch that scored lower left ``metrics.json``'s ``best_ckpt`` naming
    a file that is gone (an audit's), beside the killed run's best file no state names. Both are now warned about,
    and the best is chosen among the files left and the validations from there (here the gone file was the best)."""
    import shutil

    base = [*TINY_VIT, *FAST, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
    base += ["logger=none", "callbacks.model_checkpoint.monitor=epoch", "callbacks.model_checkpoint.mode=min"]
    train(compose(tmp_path, [*base, "trainer.max_epochs=1"]))
    ckpts = tmp_path / "checkpoints"
    shutil.move(ckpts / "best-epoch000.ckpt", ckpts / "best-epoch001.ckpt")  # (what the killed run left)
    with pytest.warns(UserWarning) as said:
        train(compose(tmp_path, [*base, "trainer.max_epochs=2"]))  # resume=auto
    text = " ".join(str(w.message) for w in said)
    assert "best-epoch000.ckpt, the resumed checkpoint's best file(s), are gone from" in text
    assert "best-epoch001.ckpt in " in text and "not among the resumed checkpoint's best files" in text
    res = json.loads((tmp_path / "metrics.json").read_text())
    assert Path(res["best_ckpt"]).is_file() and res["best_ckpt"] == str(ckpts / "best-epoch001-v1.ckpt")


# ------------------------------------------------------------------------------------------ the resumed split
def test_resume_with_another_validation_split_is_refused(tmp_path):
    """A resume (resume=auto or ckpt_path) holds out the split its checkpoint trained with: another ``data.seed`` or
    ``data.val_fraction`` would validate on images it trained on, so train.py refuses it in one line, naming the
    checkpoint's values; the same settings resume."""
    short = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=1", "trainer.limit_val_batches=1"]
    short += ["test=false", "logger=none", "callbacks.model_checkpoint=null"]
    run = tmp_path / "run"
    train(compose(run, [*short, "data.val_fraction=0.2", "data.seed=1", "logger=csv"]))
    ckpt = run / "checkpoints" / "last.ckpt"
    logs = {p: _digest(p) for p in (run / "csv").iterdir()}
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)["FashionMNISTDataModule"]["split"]
    assert {k: stored[k] for k in ("val_fraction", "seed", "pool")} == {"val_fraction": 0.2, "seed": 1, "pool": 10000}

    proc = run_script_forked(
        "train.py",
        [*short, "trainer.max_epochs=2", "data.val_fraction=0.2", "data.seed=2", "logger=csv", f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert {p: _digest(p) for p in (run / "csv").iterdir()} == logs  # refused before the loggers open
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert last.startswith(f"train.py: SplitMismatchError: {ckpt} was trained with another validation split"), last
    assert "(data.seed: checkpoint 1, configured 2)" in last and "Resume with data.val_fraction=0.2 data.seed=1" in last
    with pytest.raises(SplitMismatchError, match=r"data.val_fraction: checkpoint 0.2, configured 0.1\)"):
        train(compose(tmp_path / "other", [*short, "data.val_fraction=0.1", "data.seed=1", f"ckpt_path={ckpt}"]))
    with pytest.raises(SplitMismatchError, match=r"data.val_fraction: checkpoint 0.2, configured 0.0\)"):
        train(compose(run, [*short, "trainer.max_epochs=2", "data.val_fraction=0", "data.seed=1"]))
    train(compose(run, [*short, "trainer.max_epochs=2", "data.val_fraction=0.2", "data.seed=1"]))  # the same: resumes


def _arrays(n: int) -> ArrayDataModule:
    x = np.zeros((n, 8, 8), np.uint8)
    return ArrayDataModule(train=(x, np.arange(n) % 2), test=(x[:4], np.arange(4) % 2), val_fraction=0.25, seed=3)


def test_split_check_names_a_changed_training_set_and_passes_old_checkpoints(monkeypatch):
    """The same seed and fraction over another number of training images, or drawing other samples (another
    permutation), is refused; a checkpoint without a split record, or with no held-out split either time, is not
    checked. Lightning's restore (``load_state_dict``) checks as train.py does."""
    state = _arrays(40).state_dict()
    assert state["split"]["pool"] == 40 and len(state["split"]["val_digest"]) == 16
    with pytest.raises(SplitMismatchError, match="split from 40 training samples then, 44 now"):
        _arrays(44).load_state_dict(state)
    _arrays(40).load_state_dict(state)
    _arrays(44).check_split(None)  # a checkpoint from before the split record
    x = np.zeros((8, 8, 8), np.uint8)
    unsplit = ArrayDataModule(train=(x, np.arange(8) % 2), test=(x, np.arange(8) % 2), val_fraction=0.0)  # val: test
    unsplit.check_split(unsplit.state_dict())
    unsplit.check_split({"split": {"val_fraction": 0.0, "note": "another record of no split"}})

    import vitrel.data.base as base

    monkeypatch.setattr(base, "seeded_split", lambda n, f, s: (np.arange(10, n), np.arange(10)))
    with pytest.raises(SplitMismatchError, match="the same settings hold out other samples here"):
        _arrays(40).check_split(state, "x.ckpt")


# ------------------------------------------------------------------------------------ the resumed preprocessing
def test_resume_with_other_preprocessing_is_refused(tmp_path):
    """A finished run run again in its folder with another ``data.std`` had nothing to train and was tested again
    under it: its ``metrics.json`` (and a sweep's table, its row marked as of the run's settings) held a test of the
    run's weights on other inputs, 30 points under ``eval.py``'s of the same checkpoint in the audit's run. Refused in
    one line naming the checkpoint's and the new values, before the run folder's files change; the same settings
    resume; the memory loader's tensor resize against the workers loader's PIL resize is named too."""
    short = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
    short += ["trainer.limit_test_batches=1", "logger=none", "callbacks.model_checkpoint=null"]
    run = tmp_path / "run"
    first = train(compose(run, short))
    ckpt, record = run / "checkpoints" / "last.ckpt", (run / "metrics.json").read_text()
    proc = run_script_forked("train.py", [*short, "data.std=[0.1]", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = (proc.stdout + proc.stderr).strip().splitlines()[-1]
    assert last.startswith(
        f"train.py: ConfigError: {ckpt} was trained on data preprocessed otherwise than this run's (std: checkpoint "
        "[0.353], now [0.1]): resumed, it would train on and be tested under preprocessing"
    ), last
    assert (run / "metrics.json").read_text() == record
    with pytest.raises(ConfigError, match=r"\(resize: checkpoint tensor, now None\)"):
        train(compose(run, [*short, "data.loader=workers"]))
    again = train(compose(run, short))  # the same settings: resumed, finished, tested again
    assert again["test/acc1"] == first["test/acc1"]
