"""A run trained on NaFlex batches (``data.packing``) on class folders, scored at a fixed size (``eval.py
data.packing=false``, ``predict.py seq_len=null``): its model's stored ``img_size`` is the data group's default (224 for
``data=imagenet``), a size its training never fed it (at most ``data.max_tokens`` patches an image). The tools must not
call it the size the model was trained at, and must say so."""

from __future__ import annotations

import json
import logging

import pytest
from omegaconf import OmegaConf

from tests.data.test_datamodules import make_imagenet_tree
from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train

PACK = ["data=imagenet", "data.packing=pack", "data.seq_len=64", "data.patch_size=4", "data.max_tokens=64"]
SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=1", "logger=none", "data.batch_size=4"]


@pytest.fixture(scope="module")
def naflex_run(tmp_path_factory):
    """A train.py run folder: the tiny ViT, one step on NaFlex batches of an on-disk class-folder tree (JPEGs of
    30-60 px), with its run record as Hydra saves it."""
    tree = tmp_path_factory.mktemp("tree")
    make_imagenet_tree(tree)
    run = tmp_path_factory.mktemp("run")
    cfg = compose(run, [*TINY_VIT, *FAST, *SHORT, *PACK, f"data.root={tree}"])
    train(cfg)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    return run, tree


def test_eval_at_fixed_size_does_not_call_the_nominal_size_trained(naflex_run, tmp_path, caplog):
    """``eval.py data.packing=false`` on a NaFlex run: scored at the stored 224 (a 56x56 grid, 3136 patches; training
    saw at most 64), which the log called ``the size last.ckpt was trained at``. Now a warning says it is not one, and
    names the largest square within the run's budget (32)."""
    from vitrel.train.evaluate import evaluate

    run, tree = naflex_run
    over = [f"ckpt_path={run}", "data=imagenet", "data.packing=false", "data.num_workers=0", "progress_bar=none"]
    # (no attention-distance maps: at 3136 tokens they were half of this test's time; not what it checks, and
    # tests/train/test_attention_distance.py writes them)
    over += ["attention_distance=null"]
    with caplog.at_level(logging.INFO):
        evaluate(compose(tmp_path / "eval", [*over, "trainer.accelerator=cpu"], config_name="eval"))
    assert json.loads((tmp_path / "eval" / "eval_metrics.json").read_text())["img_size"] == 224
    assert "the size last.ckpt was trained at" not in caplog.text
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "NaFlex" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "224x224 (3136 patches of 4 px)" in warned[0] and "at most 64 patches" in warned[0], warned[0]
    assert "data.img_size=<n> (at most 32 " in warned[0], warned[0]


def test_eval_at_a_size_within_the_budget_does_not_warn(naflex_run, tmp_path, caplog):
    """``data.img_size=32`` given (8x8 patches, within the run's 64): no warning."""
    from vitrel.train.evaluate import evaluate

    run, _ = naflex_run
    over = [f"ckpt_path={run}", "data=imagenet", "data.packing=false", "data.img_size=32", "data.num_workers=0"]
    with caplog.at_level(logging.INFO):
        evaluate(
            compose(tmp_path / "eval", [*over, "progress_bar=none", "trainer.accelerator=cpu"], config_name="eval")
        )
    assert not [r for r in caplog.records if r.levelno == logging.WARNING and "NaFlex" in r.getMessage()]


def test_predict_seq_len_null_warns_at_the_nominal_size(naflex_run, tmp_path, caplog):
    """``predict.py seq_len=null``: fixed-size images at the stored 224, with the same warning."""
    from vitrel.train.predict import run_predict

    run, tree = naflex_run
    out = tmp_path / "p.csv"
    args = [f"ckpt_path={run}", f"input={tree / 'val'}", "seq_len=null", "progress_bar=false", f"results_file={out}"]
    with caplog.at_level(logging.INFO):
        run_predict(compose(tmp_path / "predict", args, config_name="predict"))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "NaFlex" in r.getMessage()]
    assert len(warned) == 1 and "224x224 (3136 patches of 4 px)" in warned[0], caplog.text
    assert "seq_len" in warned[0], warned[0]
