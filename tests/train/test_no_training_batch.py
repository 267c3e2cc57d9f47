"""A run whose training data gives no batch stops with a :class:`NoTrainingBatchError` naming why, where it ended
"finished" having trained nothing (shards whose every training sample failed to decode under
``data.on_bad_sample=skip``: exit code 0, ``"status": "finished"``) or in a traceback from the schedule (9 images and
``data.batch_size=16`` with ``drop_last``: ``total_steps=0``)."""

from __future__ import annotations

import pytest

from tests.data.test_datamodules import make_imagenet_tree
from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.data.shards import write_wds
from vitrel.train.data_contract import NoTrainingBatchError
from vitrel.train.run import train

RUN = [*TINY_VIT, *FAST, "trainer.max_epochs=1", "logger=none", "data.img_size=32"]


@pytest.mark.parametrize("scheduler", [[], ["module.scheduler=null"]], ids=["schedule", "no-schedule"])
def test_fewer_images_than_a_whole_batch_is_named(tmp_path, scheduler):
    """9 training images, ``data.batch_size=16``, ``drop_last`` (data=imagenet's default): no batch, said with the
    sizes and the fix; without a schedule Lightning's fit returned at once ("No training batches")."""
    make_imagenet_tree(tmp_path / "tree")
    over = [*RUN, *scheduler, "data=imagenet", f"data.root={tmp_path / 'tree'}"]
    with pytest.raises(NoTrainingBatchError) as err:
        train(compose(tmp_path / "run", over))
    assert str(err.value) == (
        "the training epoch has no batch: 9 training images a process, data.batch_size=16 with drop_last (whole "
        "batches only): lower data.batch_size or set data.drop_last=false"
    )
    assert not (tmp_path / "run" / "metrics.json").exists()  # (no record of a finished run)


@pytest.mark.parametrize("key", ["max_steps", "limit_train_batches"])
def test_lightnings_ways_to_train_nothing_are_named(tmp_path, key):
    """``trainer.max_steps=0`` was blamed on the data (9,000 images: "add images"); ``trainer.limit_train_batches=0``
    ended in an ``AttributeError`` inside that message's helper (no training loader). Each is named, with the way to
    score a model without training."""
    with pytest.raises(NoTrainingBatchError) as err:
        train(compose(tmp_path / "run", [*RUN, f"trainer.{key}=0", "trainer.limit_val_batches=1"]))
    assert str(err.value) == (
        f"trainer.{key}=0 trains nothing: trainer.max_epochs=0 tests the model as built or loaded, and eval.py "
        "ckpt_path=<checkpoint> scores a trained one"
    )
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_shards_of_undecodable_samples_skipped_stop_the_run(tmp_path):
    """Every training sample of the shards is not an image: under ``skip`` each is left out, the epoch ran no batch;
    the run fails, as it would have at the first sample under ``raise`` (it wrote a finished record before)."""
    tree = tmp_path / "tree"
    make_imagenet_tree(tree)
    for f in (tree / "train").rglob("*.JPEG"):
        f.write_bytes(b"not an image")
    write_wds(tree, tmp_path / "wds", shard_size=4)
    over = [*RUN, "data=imagenet_wds", f"data.root={tmp_path / 'wds'}", "data.on_bad_sample=skip", "data.batch_size=2"]
    with pytest.raises(NoTrainingBatchError, match=r"^training epoch 1 ran no batch: its loader gave nothing"):
        train(compose(tmp_path / "run", over))
    assert not (tmp_path / "run" / "metrics.json").exists()
