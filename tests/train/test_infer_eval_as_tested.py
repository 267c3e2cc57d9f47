"""``eval.py`` on a run trained with the workers loader, resized bicubic to 32 px on 3 channels: its score is the run's
own test score, from the run folder (the run's loader: the memory loader resizes tensors with torch's bicubic, not
PIL's) and from a checkpoint moved out of it (its channels, from the data config stored with the weights)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train_helpers import EVAL_PICTURES_OFF, FAST, TINY_VIT, compose, run_script_forked
from vitrel.train.evaluate import evaluate

# no workers, on the CPU, no progress bar, no pictures; the first 500 test images, as the run's test
EVAL = [*FAST[:1], *FAST[2:4], *EVAL_PICTURES_OFF, "data.eval_batch_size=500", "trainer.limit_test_batches=1"]
# PIL's bicubic resize 28 -> 37 and a 32 px centre crop, the grey channel repeated
RUN_DATA = ["data.loader=workers", "data.img_size=32", "data.interpolation=bicubic", "data.crop_pct=0.875"]
RUN_DATA += ["data.in_chans=3"]


@pytest.fixture(scope="module")
def workers_run(tmp_path_factory):
    """``(run folder, its metrics)``: the tiny ViT, 2 steps, tested on the first 500 test images."""
    run = tmp_path_factory.mktemp("workers") / "run"
    args = [*TINY_VIT, *FAST, *RUN_DATA, "trainer.limit_train_batches=2", "data.eval_batch_size=500"]
    args += ["trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
    args += ["trainer.max_epochs=1", "logger=none", f"hydra.run.dir={run}"]
    r = run_script_forked("train.py", args, cwd=run.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return run, json.loads((run / "metrics.json").read_text())["metrics"]


def _eval(tmp_path, ckpt, over: list[str]) -> tuple[dict, dict]:
    cfg = compose(tmp_path, [f"ckpt_path={ckpt}", *over], config_name="eval")
    return evaluate(cfg), json.loads((tmp_path / "eval_metrics.json").read_text())


def test_eval_of_a_workers_run_scores_with_the_runs_loader(workers_run, tmp_path):
    """Was: the memory loader (eval's default) resized the images with torch's tensor bicubic, 28 grey levels from
    PIL's on some pixels: test/acc1 22.25 % against the run's 22.00 % (fmnist_quick, 1 epoch); here the loss is off."""
    run, trained = workers_run
    metrics, res = _eval(tmp_path, run, EVAL)
    assert res["num_images"] == 500 and metrics["test/acc1"] == trained["test/acc1"]
    assert metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-6)
    assert res["data_from_run"]["loader"] == "workers"


def test_a_moved_checkpoint_of_3_channel_fmnist_takes_its_stored_channels(workers_run, tmp_path):
    """Was: ``ConfigError: ... takes 3-channel images but FashionMNISTDataModule gives 1 (data=fashion_mnist): score it
    on the data it was trained on, data=<that data set>``, though it was trained on that data set."""
    run, trained = workers_run
    moved = tmp_path / "moved" / "model.ckpt"
    moved.parent.mkdir()
    shutil.copy(run / "checkpoints" / "last.ckpt", moved)
    metrics, res = _eval(tmp_path / "eval", moved, [*EVAL, "data.loader=workers"])
    assert res["data_from_run"]["in_chans"] == 3
    assert metrics["test/acc1"] == trained["test/acc1"]
    assert metrics["test/loss"] == pytest.approx(trained["test/loss"], rel=1e-6)
