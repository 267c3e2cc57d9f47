"""A fit's log says what it trains and validates on: the sizes and whether val is a hold-out of train or the test
split (:func:`vitrel.train.progress.data_sizes`)."""

from __future__ import annotations

import pytest

from vitrel.data.fashion_mnist import FashionMNISTDataModule
from vitrel.data.moving_fmnist import MovingFMNISTDataModule
from vitrel.train.progress import data_sizes


@pytest.mark.parametrize("loader", ["workers", "memory"])
def test_the_line_counts_a_held_out_val_and_the_test_split(loader):
    held = FashionMNISTDataModule(val_fraction=0.25, seed=3, loader=loader, num_workers=0)
    held.setup("fit")
    assert data_sizes(held) == "train 7,500 images, val 2,500 (held out of train: data.val_fraction=0.25, data.seed=3)"
    test = FashionMNISTDataModule(val_fraction=0.0, loader=loader, num_workers=0)
    test.setup("fit")
    assert data_sizes(test) == "train 10,000 images, val 2,000 (the test split: data.val_fraction=0)"


def test_a_video_module_counts_clips():
    dm = MovingFMNISTDataModule(val_fraction=0.5, num_workers=0)
    dm.setup("fit")
    n = len(dm.dataset("train"))
    assert data_sizes(dm) == f"train {n:,} clips, val {len(dm.dataset('val')):,} (held out of train: " + (
        "data.val_fraction=0.5, data.seed=0)"
    )


def test_another_data_module_gets_no_line():
    assert data_sizes(object()) is None
