"""``trainer=ddp`` with every logger: fit, test and a resume under two gloo CPU processes, the test metrics equal to
a single-process evaluation of the same checkpoint; ``trainer=ddp_spawn``'s record of its fit and test.

Each rank runs the whole of ``train()``, as under plain ``ddp`` (Lightning re-runs ``python train.py`` for rank 1,
which then reads its rank from the environment). Here both ranks are started from the test process with that
environment and the composed config, so no rank composes again: fresh processes forked from a server that imported
the training stack once (tests/preloaded.py), not forks of the test process (a fork fails once the test process has
run autograd, as an earlier test in the same pytest worker may have). The three loggers that write files run
together (``logger=[csv,tensorboard,wandb]``, one DDP run instead of three; each logger's files are checked), and
``logger=none`` alone in the validation test's fit (a fit and its test phase: no logger's folder), which runs under
``trainer=ddp_spawn`` instead: ``train()`` in the test process, Lightning spawning the ranks for the fit and the test.
"""

from __future__ import annotations

import csv
import json
import os
import socket
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.preloaded import preloaded
from tests.train_helpers import FAST, TINY_VIT, compose, wandb_contents
from vitrel.train.run import train

pytestmark = pytest.mark.slow

# 2 ranks x batch 16: 3 steps an epoch, one val batch a rank, 4 test batches a rank: the test split's first 128
# images (rank r takes images r, r + 2, ...), the first 8 batches of one process
DDP = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]
# trainer=ddp_spawn with the forkserver start method of tests/preloaded.py: Lightning's same multiprocessing launcher
# (the trainer pickled to the ranks, fit and test run in them, rank 0's results sent back to this process), its ranks
# forked from a server that imported the training stack once instead of fresh interpreters (about 8 s of CPU each: 6
# in the validation test); what "spawn" adds (a fresh interpreter, Lightning's snapshot of global torch settings) is
# Lightning's, no code of vitrel's. (``preloaded()`` sets what the server imports: call it before a fit.)
FORKSERVER = "trainer.strategy={_target_: lightning.pytorch.strategies.DDPStrategy, start_method: forkserver}"
SPAWN = ["trainer=ddp_spawn", *DDP[1:], FORKSERVER]
RUN = [*TINY_VIT, *FAST, *DDP, "trainer.limit_train_batches=3", "trainer.limit_val_batches=1"]
RUN += ["trainer.limit_test_batches=4", "trainer.log_every_n_steps=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, cfg, port: int) -> None:
    """One rank of plain ``ddp``: its environment as Lightning's launcher sets it, then ``train()``."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank), WANDB_MODE="offline")
    rank_zero_only.rank = rank  # what Lightning reads from LOCAL_RANK when a re-launched process imports it
    train(cfg)
    assert not torch.distributed.is_initialized(), "train() left its gloo group to the interpreter's exit"


class NaNLogitsOnOneRank(L.Callback):
    """The logits of global rank ``rank``'s training batch at global step ``at_step`` made NaN (the other ranks'
    losses stay finite), as one rank's bad batch would."""

    def __init__(self, rank: int, at_step: int) -> None:
        self.rank, self.at_step, self._hook = rank, at_step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at_step:
            self._hook = pl_module.model.register_forward_hook(lambda module, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()


def _nan_rank(rank: int, cfg, port: int, out: str) -> None:
    """One rank of plain ``ddp`` with rank 1's loss NaN at step 2: the NaN guard's message, to ``out/rank<r>.txt``."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from vitrel.train.callbacks import NonFiniteLossError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank))
    rank_zero_only.rank = rank
    with pytest.raises(NonFiniteLossError) as err:
        train(cfg, callbacks=[NaNLogitsOnOneRank(rank=1, at_step=2)])
    Path(out, f"rank{rank}.txt").write_text(str(err.value))


def _train_ddp(run_dir: Path, overrides: list[str]) -> dict:
    """Both ranks of ``train()``; rank 0's ``metrics.json``. A rank that raises ends the other (join)."""
    cfg = compose(run_dir, overrides)
    torch.multiprocessing.start_processes(_rank, args=(cfg, _free_port()), nprocs=2, start_method=preloaded())
    return json.loads((run_dir / "metrics.json").read_text())


def train_record(run_dir: Path, overrides: list[str]) -> dict:
    """``train()`` in this process (``trainer=ddp_spawn``: it spawns the ranks); its ``metrics.json``."""
    preloaded()  # (the forkserver's imports, were it not started yet)
    train(compose(run_dir, overrides))
    return json.loads((run_dir / "metrics.json").read_text())


def _evaluate(ckpt: Path, out: Path) -> dict:
    from vitrel.train.evaluate import evaluate

    over = [f"ckpt_path={ckpt}", "data.num_workers=0", "data.batch_size=16", "trainer.accelerator=cpu"]
    over += ["trainer.limit_test_batches=8", "progress_bar=none"]
    metrics = evaluate(compose(out, over, config_name="eval"))
    assert json.loads((out / "eval_metrics.json").read_text())["num_images"] == 128
    return metrics


def test_ddp_fit_test_and_resume_with_every_logger(tmp_path):
    """The loggers that write files, together; ``logger=none``: test_ddp_validation_and_eval_score_each_image_once."""
    logger = "[csv,tensorboard,wandb]"
    import wandb  # noqa: F401  (imported once here, not in each rank)

    run = tmp_path / "run"
    first = _train_ddp(run, [*RUN, f"logger={logger}", "trainer.max_epochs=1"])
    assert first["status"] == "finished" and first["global_step"] == 3
    resumed = _train_ddp(run, [*RUN, f"logger={logger}", "trainer.max_epochs=2", "ckpt_path=last"])
    assert resumed["status"] == "finished" and resumed["global_step"] == 6 and resumed["epochs"] == 2

    # the test phase under DDP (each rank half of the test split, synced) = one process on the same weights
    single = _evaluate(run / "checkpoints" / "last.ckpt", tmp_path / "eval")
    assert resumed["metrics"]["test/acc1"] == single["test/acc1"]  # counts: exact
    assert resumed["metrics"]["test/loss"] == pytest.approx(single["test/loss"], rel=1e-5)

    with open(run / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows if r.get("train/loss_step")]
    assert steps == list(range(6)), "rows lost or repeated across the resume"
    assert float([r for r in rows if r.get("test/acc1")][-1]["test/acc1"]) == pytest.approx(single["test/acc1"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss_step")] == list(range(6))
    assert events.Scalars("test/acc1")[-1].value == pytest.approx(single["test/acc1"])

    runs = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    assert len(runs) == 2, "one W&B run file per train() of rank 0: the first run, the resume"
    assert wandb_contents(runs[-1])[1]["test/acc1"] == pytest.approx(single["test/acc1"])


def test_a_non_finite_loss_on_one_rank_stops_every_rank_naming_it(tmp_path):
    """Rank 1's loss NaN, rank 0's finite: both stop before the step, and each says which process had which loss
    (rank 0's message gave its own finite loss as the non-finite one: ``non-finite training loss (2.26)``)."""
    cfg = compose(tmp_path / "run", [*RUN, "logger=none", "trainer.max_epochs=1", "test=false"])
    torch.multiprocessing.start_processes(
        _nan_rank, args=(cfg, _free_port(), str(tmp_path)), nprocs=2, start_method=preloaded()
    )
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert message.startswith("non-finite training loss (nan on process 1 of 2) in epoch 1, global step 2:"), (
            rank,
            message,
        )


def _eval_rank(rank: int, cfgs: list, port: int) -> None:
    """One rank of ``eval.py trainer.devices=2`` for each config in turn (one gloo group)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from vitrel.train.evaluate import evaluate

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank))
    rank_zero_only.rank = rank
    for cfg in cfgs:
        evaluate(cfg)


def test_ddp_validation_and_eval_score_each_image_once(tmp_path):
    """33 validation images (rank 0: 17 in 2 batches of 16, rank 1: 16 in 1): under DDP ``val/loss`` and ``val/acc1``
    are those of one process over the 33 (Lightning's synced mean of a logged loss divided by 16 images, not 16.5), and
    ``eval.py trainer.devices=2`` scores each once, with either loader (the memory loader's ranks were unknown when the
    loader was made: each rank scored all 33; a workers loader got Lightning's padding DistributedSampler: 34); the
    workers case under ``ddp_spawn`` (its record's counts are the spawned processes': in the calling process ``eval.py``
    failed reading the loader it never made).
    The fit runs under ``trainer=ddp_spawn`` (``train()`` in this process, the fit and the test in two processes it
    spawns) with ``logger=none``, its test phase on 4 batches a rank: no logger's folder is made, and ``metrics.json``
    has the figures of the spawned processes' fit and test (were they the calling process's trainer's and callbacks':
    0 epochs, 0 steps, 0 validations, 0 test images, no split size)."""
    val = ["data.val_fraction=0.0033", "data.num_workers=0", "data.batch_size=16", "progress_bar=none"]
    run = tmp_path / "run"
    over = [*TINY_VIT, *FAST, *SPAWN, *val, "trainer.limit_train_batches=2", "trainer.max_epochs=1", "logger=none"]
    fit = train_record(run, [*over, "trainer.limit_test_batches=4"])
    assert fit["status"] == "finished" and not {"csv", "tensorboard", "wandb"} & {p.name for p in run.iterdir()}
    figures = ("epochs", "global_step", "val_runs", "test_images", "test_split_images", "test_limited_by")
    assert {k: fit[k] for k in figures} == {
        "epochs": 1,
        "global_step": 2,  # trainer.limit_train_batches
        "val_runs": 1,
        "test_images": 4 * 16 * 2,  # limit_test_batches x batch_size x ranks
        "test_split_images": 2000,  # the embedded subset's test split
        "test_limited_by": "trainer.limit_test_batches",
    }, fit
    assert fit["metrics"]["test/acc1"] >= 0
    # the per-class report's counts are the two ranks' (torchmetrics' sync), each image once
    assert _per_class_total(run) == 4 * 16 * 2
    ckpt = run / "checkpoints" / "last.ckpt"
    over = [f"ckpt_path={ckpt}", "split=val", *val, "trainer.accelerator=cpu"]
    single = evaluate_split(compose(tmp_path / "one", over, config_name="eval"))
    outs = {loader: tmp_path / f"ddp_{loader}" for loader in ("memory", "workers")}
    cfg = compose(outs["memory"], [*over, *DDP[1:], "trainer.strategy=ddp", "data.loader=memory"], "eval")
    torch.multiprocessing.start_processes(_eval_rank, args=([cfg], _free_port()), nprocs=2, start_method=preloaded())
    evaluate_split(compose(outs["workers"], [*over, *SPAWN[1:], "data.loader=workers"], "eval"))

    assert single["num_images"] == 33
    assert fit["metrics"]["val/acc1"] == single["metrics"]["val/acc1"]
    assert fit["metrics"]["val/loss"] == pytest.approx(single["metrics"]["val/loss"], rel=1e-5)
    for loader, out in outs.items():
        ddp = json.loads((out / "eval_metrics.json").read_text())
        assert ddp["num_images"] == 33, loader
        assert ddp["metrics"]["val/acc1"] == single["metrics"]["val/acc1"], loader
        assert ddp["metrics"]["val/loss"] == pytest.approx(single["metrics"]["val/loss"], rel=1e-5), loader
        assert _per_class_total(out) == 33, loader
        assert (out / "confusion.csv").read_text() == (tmp_path / "one" / "confusion.csv").read_text(), loader


def _per_class_total(folder: Path) -> int:
    """The images ``<folder>/per_class.csv`` counts (its supports' sum)."""
    with (folder / "per_class.csv").open(newline="") as f:
        return sum(int(r["support"]) for r in csv.DictReader(f))


def evaluate_split(cfg) -> dict:
    """One process's ``eval.py``: its ``eval_metrics.json`` record."""
    from vitrel.train.evaluate import evaluate

    evaluate(cfg)
    return json.loads((Path(cfg.paths.output_dir) / "eval_metrics.json").read_text())


def test_sigterm_stops_a_ddp_run_with_its_checkpoint(tmp_path):
    """``python train.py trainer.devices=2`` (Lightning starts rank 1 by re-running train.py), each rank sent SIGTERM
    as step 3 starts, as a kill of the process group or SLURM's ``scancel`` does: ``last.ckpt`` is saved after step 4
    and both processes end, rank 0 with ``128 + SIGTERM``. With Lightning's own SIGTERM handler in charge, rank 0
    passed the signal on to rank 1 (which so had it twice) and each call of the handler ran a collective from inside
    it: the ranks' collectives went out of step, and the run hung."""
    import signal
    import subprocess
    import sys
    import time

    from tests.train_helpers import ROOT, script_env

    run = tmp_path / "run"
    args = [*TINY_VIT, *FAST, *DDP, "trainer.limit_train_batches=10", "trainer.limit_val_batches=1"]
    args += ["trainer.max_epochs=1", "test=false", "logger=none", f"hydra.run.dir={run}"]
    args += ["+callbacks.sig={_target_: train_helpers.SendSignal, at_step: 3}"]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # rank 1 is in rank 0's process group: both are killed below if they hang
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the DDP run did not end within 240 s of its start:\n{proc.communicate()[0][-4000:]}")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:  # rank 1 ends on its own, at about the time rank 0 does
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("rank 1 was still running 60 s after rank 0 ended")
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4
