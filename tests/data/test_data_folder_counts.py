"""Class folders (``data=imagenet``): each split's scan is announced before it starts (a million files take minutes
on a network drive, silent before) and its outcome logged: the image count, the classes it holds and, for a val
folder lacking some of train's classes, which (their per-class scores are empty; nothing said so before)."""

from __future__ import annotations

import logging

from PIL import Image

from vitrel.data import ImageNetDataModule


def _tree(root, train=("cat", "dog", "emu"), val=("cat", "emu"), n=(4, 2)):
    for split, classes, k in (("train", train, n[0]), ("val", val, n[1])):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(k):
                Image.new("RGB", (8, 8), (i, 0, 0)).save(root / split / c / f"{i}.png")


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "image files" in r.getMessage()]


def test_each_split_scan_is_announced_and_counted_and_missing_val_classes_named(tmp_path, caplog):
    _tree(tmp_path)
    dm = ImageNetDataModule(root=tmp_path, img_size=8, batch_size=4, num_workers=0, pin_memory=False)
    with caplog.at_level(logging.INFO):
        dm.setup("fit")
    said = _said(caplog)
    train, val = tmp_path.absolute() / "train", tmp_path.absolute() / "val"
    assert said[0] == f"train: listing the image files of {train} ..."
    assert said[1].startswith(f"train: 12 image files in the 3 classes of {train} (")
    assert said[2] == f"val: listing the image files of {val} ..."
    assert said[3].startswith(f"val: 4 image files in 2 of the 3 classes of {val} (")
    assert said[3].endswith("; none of: dog (their per-class scores stay empty)")
    assert len(said) == 4


def test_a_held_out_val_is_counted_from_the_train_folder(tmp_path, caplog):
    _tree(tmp_path, n=(10, 1))
    dm = ImageNetDataModule(root=tmp_path, img_size=8, batch_size=4, num_workers=0, pin_memory=False, val_fraction=0.2)
    with caplog.at_level(logging.INFO):
        dm.setup("fit")
    said = _said(caplog)
    assert said[1].startswith(f"train: 30 image files in the 3 classes of {tmp_path.absolute() / 'train'} (")
    assert len(said) == 2  # (the val folder is the test split, read when tested)
