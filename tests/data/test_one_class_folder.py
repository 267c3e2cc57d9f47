"""A video or image folder whose train/ holds one class folder is refused by the data module, naming the folder,
as a ``ClassFoldersMismatchError`` (it was a ``DatasetNotFoundError`` beginning "<name> not found"; before that,
torchmetrics' "Expected argument `num_classes` to be an integer larger than 1, but got 1" through Hydra's
traceback, when train.py built the module)."""

from __future__ import annotations

import pytest

from vitrel.data import ImageNetDataModule
from vitrel.data.datasets import ClassFoldersMismatchError
from vitrel.data.video import VideoFolderDataModule


@pytest.mark.parametrize(("module", "file"), [(VideoFolderDataModule, "a.mp4"), (ImageNetDataModule, "a.jpg")])
def test_one_class_folder_is_refused_naming_it(tmp_path, module, file):
    for split in ("train", "val"):
        (tmp_path / split / "jump").mkdir(parents=True)
        (tmp_path / split / "jump" / file).write_bytes(b"")  # (never decoded: the layout is refused first)
    dm = module(root=tmp_path, num_workers=0)
    one = r"^\S+train has one class folder \(jump\): a classifier needs two"
    with pytest.raises(ClassFoldersMismatchError, match=one):
        _ = dm.num_classes
    (tmp_path / "train" / "swim").mkdir()
    (tmp_path / "train" / "swim" / file).write_bytes(b"")
    assert module(root=tmp_path, num_workers=0).num_classes == 2
