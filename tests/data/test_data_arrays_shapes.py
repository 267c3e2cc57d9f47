"""``data=arrays``: the label and image layouts other libraries hand over are refused with the cause named, where
labels ``[N, 1]`` (Keras's ``load_data``) stopped the first training step inside cross-entropy ("0D or 1D target
tensor expected, multi-target not supported") and channels-first images were called "not square"."""

from __future__ import annotations

import numpy as np
import pytest

from vitrel.data import ArrayDataModule

RNG = np.random.default_rng(0)
X = RNG.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)
Y = np.arange(20) % 4


def test_column_labels_are_refused_naming_ravel(tmp_path):
    np.savez(tmp_path / "k.npz", x_train=X[:16], y_train=Y[:16, None], x_test=X[16:], y_test=Y[16:, None])
    with pytest.raises(ValueError, match=r"train labels must be \[N\].*\(16, 1\).*Keras.*ravel"):
        ArrayDataModule(path=tmp_path / "k.npz")
    with pytest.raises(ValueError, match=r"test labels must be \[N\].*\(4, 2\)"):
        ArrayDataModule(train=(X[:16], Y[:16]), test=(X[16:], np.zeros((4, 2), np.int64)))


def test_channels_first_images_are_refused_naming_the_transpose():
    with pytest.raises(ValueError, match=r"channels-last.*\(16, 3, 8, 8\).*transpose\(0, 2, 3, 1\)"):
        ArrayDataModule(train=(X[:16].transpose(0, 3, 1, 2), Y[:16]), test=(X[16:].transpose(0, 3, 1, 2), Y[16:]))
    dm = ArrayDataModule(train=(X[:16], Y[:16]), test=(X[16:], Y[16:]))  # channels-last, [N] labels: as before
    assert (dm.num_classes, dm.in_chans, dm.img_size) == (4, 3, 8)
