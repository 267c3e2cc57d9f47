"""A resume of a run whose training augmentation runs in DataLoader workers (``data=imagenet``: ``data.loader=workers``,
``data.augment=true``): the order, weights and RNG states come back, the workers' random streams do not (they start
afresh in the resumed run, at an epoch's end as mid-epoch). The resumed run says so, once; without augmentation
(replayed exactly) it says nothing."""

from __future__ import annotations

import logging

import pytest

from tests.data.test_datamodules import make_imagenet_tree
from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.run import train

DATA = ["data=imagenet", "data.img_size=32", "data.num_workers=1", "data.batch_size=4", "logger=none"]


@pytest.mark.parametrize("augment", [True, False])
def test_a_resume_with_worker_augmentation_says_it_is_not_replayed(tmp_path, caplog, augment):
    tree = tmp_path / "tree"
    make_imagenet_tree(tree)
    over = [*TINY_VIT, *FAST, *DATA, f"data.root={tree}", f"data.augment={augment}", "data.num_workers=1"]
    run = tmp_path / "run"
    train(compose(run, [*over, "trainer.max_epochs=1"]))
    with caplog.at_level(logging.WARNING):
        train(compose(run, [*over, "trainer.max_epochs=2"]))  # resume=auto: from the epoch end's last.ckpt
    said = [r.getMessage() for r in caplog.records if "differs from an uninterrupted run's" in r.getMessage()]
    if augment:
        assert len(said) == 1, caplog.text
        assert "1 DataLoader worker" in said[0] and "data.augment=false" in said[0], said[0]
    else:
        assert said == []
