"""``curves.png``: each run draws its training and validation curves in its folder whatever the logger, from the values
the run logged (compared with ``metrics.csv``), the whole run after a resume, and what it has when the fit stops
inside its first epoch without a validation."""

from __future__ import annotations

import csv
import signal

import lightning as L
import pytest
import torch

from tests.train_helpers import FAST, TINY_VIT, SendSignal, compose
from vitrel.train.curves import TrainingCurves, plot_curves
from vitrel.train.run import train

# 2 epochs of 4 steps, one validation batch each; SIGTERM at step 5 saves last.ckpt after step 6 (inside epoch 2)
DRAWN = [o for o in FAST if o != "callbacks.curves=null"]  # (FAST leaves the picture out)
ARGS = [*TINY_VIT, *DRAWN, "trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1"]
ARGS += ["callbacks.model_checkpoint=null", "logger=csv"]
PNG = b"\x89PNG\r\n\x1a\n"


def _records(ckpt, key: str = "TrainingCurves") -> list[dict]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["callbacks"][key]["records"]


def _csv_epoch_values(run_dir) -> list[tuple[str, int, int, str, float]]:
    """(stage, epoch, step, key, value) of every epoch value of the curves' keys in ``metrics.csv``."""
    out = []
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        for r in csv.DictReader(f):
            for key in ("train/loss_epoch", "train/acc1", "val/loss", "val/acc1"):
                if r.get(key):
                    out.append((key.split("/")[0], int(r["epoch"]), int(r["step"]), key, float(r[key])))
    return sorted(out)


def _flat(records: list[dict]) -> list[tuple[str, int, int, str, float]]:
    """The records as :func:`_csv_epoch_values`' rows (the loggers index a step's row ``global_step - 1``)."""
    keys = ("train/loss_epoch", "train/acc1", "val/loss", "val/acc1")
    return sorted((r["stage"], r["epoch"], r["step"] - 1, k, r[k]) for r in records for k in keys if k in r)


def _png(path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG


def test_curves_are_the_logged_values_and_drawn(tmp_path):
    train(compose(tmp_path, [*ARGS, "trainer.limit_test_batches=1"]))
    records = _records(tmp_path / "checkpoints" / "last.ckpt")
    assert [(r["stage"], r["epoch"], r["x"]) for r in records] == [
        ("val", 0, 1.0), ("train", 0, 1.0), ("val", 1, 2.0), ("train", 1, 2.0)
    ], records  # fmt: skip
    logged = _csv_epoch_values(tmp_path)
    assert len(logged) == 8 and _flat(records) == logged, (_flat(records), logged)  # exactly, not within a tolerance
    assert _png(tmp_path / "curves.png")


def test_a_resumed_run_draws_the_whole_run(tmp_path, caplog):
    caplog.set_level("INFO")
    with pytest.raises(SystemExit) as stop:
        train(compose(tmp_path, [*ARGS, "test=false"]), callbacks=[SendSignal(at_step=5)])
    assert stop.value.code == 128 + signal.SIGTERM
    assert "last.ckpt in epoch 2, step 6; resume with" in caplog.text  # (counted from 1, as the progress lines)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert [(r["stage"], r["epoch"]) for r in _records(ckpt)] == [("val", 0), ("train", 0)]  # epoch 1, before the stop
    (tmp_path / "curves.png").unlink()  # (drawn at epoch 1's end: the resumed process draws it again)

    train(compose(tmp_path, [*ARGS, "test=false"]))  # resume=auto: from step 6, inside epoch 2
    records = _records(ckpt)
    assert [(r["stage"], r["epoch"], r["x"]) for r in records] == [
        ("val", 0, 1.0), ("train", 0, 1.0), ("val", 1, 2.0), ("train", 1, 2.0)
    ], records  # fmt: skip
    assert _flat(records) == _csv_epoch_values(tmp_path)  # (metrics.csv continued: both processes' rows)
    assert _png(tmp_path / "curves.png")


def test_a_checkpoint_without_records_says_the_earlier_values_are_unknown(tmp_path):
    with pytest.raises(SystemExit):
        train(compose(tmp_path, [*ARGS, "test=false", "logger=none"]), callbacks=[SendSignal(at_step=5)])
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    del state["callbacks"]["TrainingCurves"]  # (as one written before the curves were kept)
    torch.save(state, ckpt)
    curves = TrainingCurves(tmp_path / "own")
    train(compose(tmp_path, [*ARGS, "test=false", "logger=none", "callbacks.curves=null"]), callbacks=[curves])
    assert curves.unknown_before == 6 and [(r["stage"], r["epoch"]) for r in curves.records] == [
        ("val", 1), ("train", 1)
    ]  # fmt: skip
    assert _records(ckpt) == curves.records and _png(tmp_path / "own" / "curves.png")
    assert torch.load(ckpt, weights_only=True)["callbacks"]["TrainingCurves"]["unknown_before"] == 6  # carried on


def test_a_stop_inside_the_first_epoch_without_validation_draws_what_it_has(tmp_path):
    """The stop's ``last.ckpt`` is written at its step, before the epoch's end hooks record the partial epoch's values
    (a resume trains the epoch's other batches and records the epoch then): the picture has them, the file none."""
    args = [*ARGS, "trainer.max_steps=3", "trainer.limit_val_batches=0", "test=false", "logger=none"]
    curves = TrainingCurves(tmp_path)
    train(compose(tmp_path, [*args, "callbacks.curves=null"]), callbacks=[curves])
    records = curves.records
    assert [(r["stage"], r["epoch"], r["step"], r["x"]) for r in records] == [("train", 0, 3, 0.75)], records
    assert _records(tmp_path / "checkpoints" / "last.ckpt") == []
    assert _png(tmp_path / "curves.png")


def test_a_validation_inside_the_epoch_is_placed_at_its_share_of_the_epoch(tmp_path):
    args = [*ARGS, "trainer.max_epochs=1", "trainer.val_check_interval=0.5", "test=false"]
    train(compose(tmp_path, args))
    records = _records(tmp_path / "checkpoints" / "last.ckpt")
    assert [(r["stage"], r["step"], r["x"]) for r in records] == [("val", 2, 0.5), ("val", 4, 1.0), ("train", 4, 1.0)]
    assert _flat(records) == _csv_epoch_values(tmp_path)
    assert _png(tmp_path / "curves.png")


def test_switched_off_and_drawn_with_nothing(tmp_path):
    train(compose(tmp_path, [*ARGS, "trainer.max_steps=1", "callbacks.curves=null", "test=false"]))
    assert not (tmp_path / "curves.png").exists()
    fig = plot_curves([], "nothing")  # (a figure, not an error)
    assert len(fig.axes) == 2
    assert TrainingCurves(tmp_path).records == []


class _RankCurves(TrainingCurves):
    """TrainingCurves that notes each draw in ``<save_dir>/drawn-rank<r>``: the training epochs drawn, whether the
    test's line is in."""

    def draw(self, pl_module) -> None:
        super().draw(pl_module)
        fit = sum(r["stage"] == "train" for r in self.records)
        with open(self.path.with_name(f"drawn-rank{pl_module.global_rank}"), "a") as f:
            f.write(f"{fit} {any(r['stage'] == 'test' for r in self.records)}\n")


def _curves_rank(rank: int, cfg, port: int) -> None:
    """One rank of plain ``ddp`` (tests/train/test_ddp.py's ``_rank``) with :class:`_RankCurves`."""
    import os

    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(LOCAL_RANK=str(rank))
    rank_zero_only.rank = rank
    train(cfg, callbacks=[_RankCurves(cfg.paths.output_dir)])


@pytest.mark.slow
def test_ddp_draws_on_rank_zero_the_synced_values(tmp_path):
    from tests.preloaded import preloaded
    from tests.train.test_ddp import DDP, _free_port

    args = [*ARGS, *DDP, "trainer.limit_train_batches=3", "test=false", "callbacks.curves=null"]
    cfg = compose(tmp_path, args)
    torch.multiprocessing.start_processes(_curves_rank, args=(cfg, _free_port()), nprocs=2, start_method=preloaded())
    assert (tmp_path / "drawn-rank0").read_text().split("\n") == ["1 False", "2 False", ""]  # one a training epoch
    assert not (tmp_path / "drawn-rank1").exists()
    records = _records(tmp_path / "checkpoints" / "last.ckpt", "_RankCurves")
    assert [(r["stage"], r["epoch"]) for r in records] == [("val", 0), ("train", 0), ("val", 1), ("train", 1)]
    assert _flat(records) == _csv_epoch_values(tmp_path)  # (rank 0's CSV: the values synced over the ranks)
    assert _png(tmp_path / "curves.png")


@pytest.mark.slow
def test_ddp_spawn_draws_the_test_with_the_fit(tmp_path):
    """Under ``ddp_spawn`` the test runs in processes given the callback without the fit's records: its draw takes
    them from last.ckpt (the test's line alone replaced the fit's picture)."""
    from tests.preloaded import preloaded
    from tests.train.test_ddp import SPAWN

    preloaded()
    args = [*ARGS, *SPAWN, "trainer.limit_train_batches=2", "trainer.limit_test_batches=1", "logger=none"]
    train(compose(tmp_path, [*args, "callbacks.curves=null"]), callbacks=[_RankCurves(tmp_path)])
    assert (tmp_path / "drawn-rank0").read_text().split("\n") == ["1 False", "2 False", "2 True", ""]
    assert not (tmp_path / "drawn-rank1").exists() and _png(tmp_path / "curves.png")


class _Boom(L.Callback):
    """Raises at the first batch of the third epoch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch == 2:
            raise RuntimeError("boom")


@pytest.mark.parametrize(("interval", "drawn"), [(0, ["1 False", "2 False", "3 False"]), (1e9, ["1 False", "3 False"])])
def test_redraws_at_most_every_min_interval_s_and_the_fits_end_draws_the_rest(tmp_path, interval, drawn):
    curves = _RankCurves(tmp_path, min_interval_s=interval)
    args = [*ARGS, "trainer.max_epochs=3", "test=false", "logger=none", "callbacks.curves=null"]
    train(compose(tmp_path, args), callbacks=[curves])
    assert (tmp_path / "drawn-rank0").read_text().split("\n") == [*drawn, ""]
    assert _png(tmp_path / "curves.png") and sum(r["stage"] == "train" for r in curves.records) == 3


def test_an_error_draws_what_is_not_drawn_yet(tmp_path):
    curves = _RankCurves(tmp_path, min_interval_s=1e9)
    args = [*ARGS, "trainer.max_epochs=3", "test=false", "logger=none", "callbacks.curves=null"]
    with pytest.raises(RuntimeError, match="boom"):
        train(compose(tmp_path, args), callbacks=[curves, _Boom()])
    assert (tmp_path / "drawn-rank0").read_text().split("\n") == ["1 False", "2 False", ""]


def test_min_interval_s_is_seconds(tmp_path):
    with pytest.raises(ValueError, match="min_interval_s=-1"):
        TrainingCurves(tmp_path, min_interval_s=-1)


@pytest.mark.parametrize("ema", [[], ["module/ema=default"], ["module/ema=default", "module.ema_eval=false"]])
def test_the_title_says_when_validation_scores_the_ema_weights(tmp_path, ema):
    """The training values are the raw weights'; with ``module.ema_eval`` the validation and test score the EMA copy:
    the picture says so, else two curves of different networks read as one."""
    from hydra.utils import instantiate

    cfg = compose(tmp_path, [*TINY_VIT, *ema])
    module = instantiate(cfg.module, model=instantiate(cfg.model, num_classes=10), num_classes=10)
    title = TrainingCurves(tmp_path).title(module)
    assert title.startswith("vit") and ("EMA" in title) == (len(ema) == 1), title
