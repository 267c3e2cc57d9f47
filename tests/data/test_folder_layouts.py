"""Class-folder trees as they come from real machines: a notebook's ``.ipynb_checkpoints``, a ``.git``, a Mac zip's
``__MACOSX``, a Synology drive's ``@eaDir`` thumbnails, a link back up. ``data=imagenet``, the video folders, the
shards writer and ``predict.py`` pass the hidden and system folders over with a warning naming them (torchvision's
``ImageFolder`` makes each a class), and read each image once, under its own class."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.data.test_datamodules import make_imagenet_tree
from vitrel.data import ImageNetDataModule
from vitrel.data.shards import main as shards_main
from vitrel.data.video import VideoFolderDataModule
from vitrel.inference import find_images

CLASSES = ["n0001", "n0002", "n0003"]


def image(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((20, 20, 3), 99, np.uint8)).save(path)


def add_tool_folders(split: Path) -> None:
    """What Jupyter, git, a Mac's zip and a Synology drive leave in a split folder and its class folders."""
    image(split / ".ipynb_checkpoints" / "n0001_0-checkpoint.jpg")  # (with an image: a class for ImageFolder)
    (split / ".git" / "objects").mkdir(parents=True)
    (split / "__MACOSX" / "n0001").mkdir(parents=True)
    (split / "__MACOSX" / "n0001" / "._n0001_0.JPEG").write_bytes(b"\x00\x05\x16\x07")
    image(split / "@eaDir" / "n0001" / "SYNOPHOTO_THUMB_M.jpg")
    image(split / "n0002" / "@eaDir" / "n0002_0.JPEG" / "SYNOPHOTO_THUMB_S.jpg")  # (a thumbnail beside each image)
    image(split / "n0002" / ".ipynb_checkpoints" / "n0002_0-checkpoint.JPEG")


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_hidden_and_system_folders_are_passed_over_with_a_warning_not_classes(tmp_path, caplog):
    """Before: the classes were ['.git', '.ipynb_checkpoints', '@eaDir', '__MACOSX', 'n0001', 'n0002', 'n0003'] (a
    7-class model; with the empty ones refused only when the train set was built) and val's ``.ipynb_checkpoints``
    refused as a class train lacks; n0002's thumbnails and notebook copies were 2 more images of n0002 (11 train
    samples for 9). Now: train's 3 classes, 9 samples, val's 6, with train's indices, and the warnings name them."""
    make_imagenet_tree(tmp_path)
    add_tool_folders(tmp_path / "train")
    image(tmp_path / "val" / ".ipynb_checkpoints" / "x.jpg")
    with caplog.at_level(logging.WARNING):
        dm = ImageNetDataModule(root=tmp_path, img_size=16, augment=False, num_workers=0)
        assert dm.classes == CLASSES and dm.num_classes == 3
        train, val = dm.raw_dataset("train"), dm.raw_dataset("val")
    assert [t for _, t in train.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all("@eaDir" not in p and "checkpoint" not in p for p, _ in train.samples)
    assert [t for _, t in val.samples] == [0, 0, 1, 1, 2, 2]
    said = warnings(caplog)
    assert f"{tmp_path / 'train'}: passed over .git, .ipynb_checkpoints, @eaDir, __MACOSX (hidden or system " in (
        "\n".join(said)
    )
    assert f"{tmp_path / 'val'}: passed over .ipynb_checkpoints (hidden or system folders, not classes)" in said
    inner = [m for m in said if m.startswith("passed over 2 hidden or system folder(s) in the class folders of")]
    assert inner and "n0002/.ipynb_checkpoints, n0002/@eaDir" in inner[0]


def test_the_shards_writer_and_predict_pass_them_over_too(tmp_path, caplog):
    """Before: ``write-wds`` refused the tree (``.git`` and ``__MACOSX``: 'class folders without image files'), and
    with those removed wrote ``.ipynb_checkpoints`` and ``@eaDir`` as classes; ``predict.py`` on the train tree
    scored the notebook copies and thumbnails as images and named 7 class folders."""
    import json

    make_imagenet_tree(tmp_path / "tree")
    add_tool_folders(tmp_path / "tree" / "train")
    shards_main(["write-wds", str(tmp_path / "tree"), str(tmp_path / "wds")])
    info = json.loads((tmp_path / "wds" / "_info.json").read_text())
    assert info["classes"] == CLASSES and info["splits"]["train"]["num_samples"] == 9

    with caplog.at_level(logging.WARNING):
        files, folders = find_images(tmp_path / "tree" / "train")
    assert folders == CLASSES and len(files) == 9
    assert any(m.startswith("passed over 6 hidden or system folder(s) in ") for m in warnings(caplog))


def test_video_class_folders_pass_them_over(tmp_path):
    for split in ("train", "val"):
        for c in ("archery", "bowling"):
            (tmp_path / split / c).mkdir(parents=True)
        (tmp_path / split / ".ipynb_checkpoints").mkdir()
        (tmp_path / split / "__MACOSX").mkdir()
    assert VideoFolderDataModule(root=tmp_path).classes == ["archery", "bowling"]


@pytest.mark.parametrize("up", ["train", "n0001"])
def test_a_link_back_up_is_not_followed_round(tmp_path, caplog, up):
    """A class folder holding a link to the split folder (or to itself): torchvision's walk follows it round until the
    path is too long. Before: 369 train samples for 9 (129 with a link to itself), the other classes' images
    labelled n0001 too. Now 9, and a warning names the link."""
    make_imagenet_tree(tmp_path)
    target = tmp_path / "train" if up == "train" else tmp_path / "train" / "n0001"
    (tmp_path / "train" / "n0001" / "up").symlink_to(target, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        train = ImageNetDataModule(root=tmp_path, img_size=16, num_workers=0).raw_dataset("train")
    assert [t for _, t in train.samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    link = tmp_path / "train" / "n0001" / "up"
    assert f"{link} links back up to {target}, a folder it is in: not followed" in warnings(caplog)


def test_a_subset_of_linked_files_and_linked_class_folders_is_read(tmp_path):
    """A subset built of links (to files, to class folders) reads as the files it links to; two classes linking to
    one folder each hold its images (a link is followed unless it leads back up)."""
    make_imagenet_tree(tmp_path / "pool")
    sub = tmp_path / "sub"
    for split in ("train", "val"):
        (sub / split / "a").mkdir(parents=True)
        for f in sorted((tmp_path / "pool" / split / "n0001").iterdir()):
            (sub / split / "a" / f.name).symlink_to(f)
        (sub / split / "b").symlink_to(tmp_path / "pool" / split / "n0002", target_is_directory=True)
        (sub / split / "c").symlink_to(tmp_path / "pool" / split / "n0002", target_is_directory=True)
    dm = ImageNetDataModule(root=sub, img_size=16, num_workers=0)
    assert dm.classes == ["a", "b", "c"]
    assert [t for _, t in dm.raw_dataset("train").samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [t for _, t in dm.raw_dataset("val").samples] == [0, 0, 1, 1, 2, 2]


def test_predict_finds_the_files_the_data_set_reads(tmp_path, caplog):
    """``predict.py`` walked a tree once per real folder: of two class folders linking to one folder, the second's
    images were left out, and a link back up was passed over with no word. ``data=imagenet`` followed a link to the
    split folder from inside a *linked* class folder (its real path is elsewhere): 10 ``val`` samples for 6, class
    ``b``'s and ``c``'s images labelled ``a`` too. One walk now: the same 6 files, and one warning."""
    from vitrel.data.input_files import find_images

    make_imagenet_tree(tmp_path / "pool")
    for split in ("train", "val"):
        (tmp_path / "sub" / split).mkdir(parents=True)
        for name, target in (("a", "n0001"), ("b", "n0002"), ("c", "n0002")):
            (tmp_path / "sub" / split / name).symlink_to(tmp_path / "pool" / split / target, target_is_directory=True)
    val = tmp_path / "sub" / "val"
    (tmp_path / "pool" / "val" / "n0001" / "up").symlink_to(val, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        files, folders = find_images(val)
    read = ImageNetDataModule(root=tmp_path / "sub", img_size=16, num_workers=0).raw_dataset("val").samples
    assert [str(f) for f in files] == [p for p, _ in read] and folders == ["a", "b", "c"]
    assert f"{val / 'a' / 'up'} links back up to {val}, a folder it is in: not followed" in warnings(caplog)


@pytest.mark.parametrize("layout", ["train.zip", "root/train/train", "root=train", "train+valid", "train only"])
def test_a_root_one_level_off_or_an_archive_is_named_in_the_refusal(tmp_path, layout):
    """Before: 'No folder <root>/train.' (or val) and the generic how-to; now the line says what is likely wrong: for
    class folders of one's own without ``val/``, the folder of classes beside ``train/`` to name (a download's
    ``valid/``; which then trains), or what ``val/`` is for and what to do."""
    from vitrel.data.datasets import DatasetNotFoundError

    if layout == "train.zip":
        make_imagenet_tree(tmp_path / "x")
        (tmp_path / "train.zip").write_bytes(b"PK\x05\x06" + bytes(18))
        (tmp_path / "x" / "val").rename(tmp_path / "val")
        root, said = tmp_path, f"{tmp_path / 'train.zip'} is an archive: extract it"
    elif layout == "root/train/train":
        make_imagenet_tree(tmp_path / "train")
        root, said = tmp_path, f"{tmp_path / 'train'} holds a train/ folder: data.root={tmp_path / 'train'}?"
    elif layout == "root=train":
        make_imagenet_tree(tmp_path)
        root, said = tmp_path / "train", "data.root is a train/ folder itself: give the folder holding train/ and val/"
    else:
        make_imagenet_tree(tmp_path)
        (tmp_path / "notes").mkdir()  # (a folder of no classes: not named)
        if layout == "train+valid":
            (tmp_path / "val").rename(tmp_path / "valid")
            root, said = tmp_path, f"{tmp_path} holds valid/ beside train/: data.val_dir=valid?"
        else:
            shutil.rmtree(tmp_path / "val")
            said = "val/ is the test split (and validation, unless data.val_fraction holds out part of train/): move "
            root, said = tmp_path, said + "some files of each class into val/<class>/, or set data.val_dir to another"
    with pytest.raises(DatasetNotFoundError, match="No folder") as e:
        ImageNetDataModule(root=root, img_size=16).classes  # noqa: B018
    assert said in str(e.value)
    if layout == "train+valid":
        assert len(ImageNetDataModule(root=root, img_size=16, val_dir="valid").classes) == 3
