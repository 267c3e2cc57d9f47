"""A first ImageNet-style folder of one's own (``data=imagenet data.root=...``) with the files such folders hold: a
truncated JPEG, a 0-byte file, a file that is not an image, an empty class folder. Each stops the run with one line
naming the file (and ``data.on_bad_sample=skip``), or, skipped, is named and counted: never a worker traceback."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from tests.data.test_datamodules import make_imagenet_tree
from vitrel.data import ImageNetDataModule
from vitrel.data.datasets import load_rgb
from vitrel.data.sampling import EvalSampler
from vitrel.data.shards import BadSampleError
from vitrel.data.unreadable import ReportUnreadable
from vitrel.train.user_errors import one_line_errors


def spoil(root: Path) -> dict[str, Path]:
    """Add to ``root/train/n0001`` a truncated JPEG, an empty file and a file that is not an image (``.jpg``)."""
    folder = root / "train" / "n0001"
    whole = (folder / "n0001_0.JPEG").read_bytes()
    bad = {"truncated": folder / "cut.JPEG", "empty": folder / "zero.jpg", "not an image": folder / "notes.jpg"}
    bad["truncated"].write_bytes(whole[: len(whole) // 2])
    bad["empty"].write_bytes(b"")
    bad["not an image"].write_bytes(b"these are my notes, not a picture" * 4)
    return bad


def module(root: Path, **kwargs) -> ImageNetDataModule:
    kwargs = {"img_size": 16, "augment": False, "batch_size": 4, "num_workers": 0, "pin_memory": False, **kwargs}
    dm = ImageNetDataModule(root=root, **kwargs)
    dm.setup("fit")
    return dm


def stopping_line(dm) -> str:
    """What ``train.py`` prints when a pass over ``dm``'s training batches stops on a data set error."""
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        for _ in dm.train_dataloader():
            pass
    return str(stop.value)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("kind, says", [
    ("truncated", "OSError: image file is truncated"), ("empty", "an empty file"),
    ("not an image", "not an image file PIL can identify"),
])  # fmt: skip
def test_an_unreadable_image_is_one_line_naming_it_and_the_option_that_skips(tmp_path, workers, kind, says):
    """One bad file among good ones: ``train.py: BadSampleError: cannot read <file> (...); data.on_bad_sample=skip
    ...``, also from a DataLoader worker (torch re-raises its whole traceback as the error's text): no traceback."""
    make_imagenet_tree(tmp_path)
    bad = spoil(tmp_path)
    for other in set(bad.values()) - {bad[kind]}:
        other.unlink()
    message = stopping_line(module(tmp_path, num_workers=workers))
    assert message.startswith(f"train.py: BadSampleError: cannot read {bad[kind]} ({says}"), message
    assert "data.on_bad_sample=skip" in message and "\n" not in message and "Traceback" not in message


class Recorder(L.LightningModule):
    """Keeps the batches of each loop (``None``: a batch whose every file was left out); learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[str, list] = {"train": [], "val": [], "test": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(batch)
        return self.w * 0.0

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(batch)

    def test_step(self, batch, batch_idx):
        self.seen["test"].append(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def lightning_passes(dm, epochs: int = 2, test: bool = False) -> Recorder:
    """``epochs`` training epochs (each with its validation) and, with ``test``, a test, through a Lightning trainer
    with :class:`ReportUnreadable` (as train.py's): the batches each loop got."""
    rec = Recorder()
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ReportUnreadable()],
    )  # fmt: skip
    trainer.fit(rec, datamodule=dm)
    if test:
        trainer.test(rec, datamodule=dm, verbose=False)
    return rec


def batches(seen: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The images and labels of a loop's batches, the batches of files left out only (``None``) less."""
    xs, ys = zip(*[b for b in seen if b is not None])
    return torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("workers", [0, 1])
def test_skip_names_each_unreadable_image_counts_them_and_keeps_every_label(tmp_path, workers, caplog):
    """``on_bad_sample=skip`` in training: every pass still yields a sample per file; a bad file's place is taken by
    the next readable file with that file's own label (never the bad file's class on another class's image); the
    files are named (in the process that read them) and the count logged at the end of each epoch."""
    make_imagenet_tree(tmp_path)
    bad = spoil(tmp_path)
    for c in ("n0002", "n0003"):  # one colour per class: an image's class can be read off its pixels
        for f in (tmp_path / "train" / c).iterdir():
            Image.fromarray(np.full((8, 8, 3), 60 * int(c[-1]), np.uint8)).save(f, quality=100)
    dm = module(tmp_path, num_workers=workers, on_bad_sample="skip", drop_last=False)
    with caplog.at_level(logging.WARNING):
        seen = lightning_passes(dm, epochs=2).seen["train"]
    x, y = batches(seen[: len(seen) // 2])  # the first epoch
    assert len(y) == 9 + 3  # 3 classes x 3 good files, and the 3 bad ones' places
    count = "skipped 3 unreadable image file(s) in this pass over train (data.on_bad_sample=skip"
    assert caplog.text.count(count) == 2, caplog.text  # once a pass
    assert "left out" not in caplog.text  # (the val folder's files all read)
    if workers == 0:  # (a worker's own warnings go to its console)
        for path in bad.values():
            assert f"skipped {path}: cannot read it" in caplog.text
    mean = x.mean(dim=(1, 2, 3))
    for c in (1, 2):  # n0002 and n0003 are flat images of their own colour: each sample labelled c looks like c
        assert torch.allclose(mean[y == c], mean[y == c][0]) and (y == c).sum() >= 3
    # sorted, n0001 is cut.JPEG, n0001_{0,1,2}.JPEG, notes.jpg, zero.jpg: cut.JPEG's place goes to n0001_0.JPEG, the
    # other two's to n0002's first file, with its label
    assert (y == 0).sum() == 3 + 1 and (y == 1).sum() == 3 + 2


@pytest.mark.parametrize("workers", [0, 1])
def test_evaluation_scores_each_readable_image_once_and_names_the_unreadable(tmp_path, workers, caplog):
    """``on_bad_sample=skip`` in validation and test: each readable file of the split is scored once and the
    unreadable ones not at all (a replacement would score its image twice and shift top-1); one line a pass names
    them. Batches of 2 over val/ sorted (n0001_0, n0001_1, n0002_0, n0002_1, n0003_0, n0003_1): the second batch is
    the two unreadable files, none left (``None``, passed over by the module)."""
    make_imagenet_tree(tmp_path)
    val = tmp_path / "val"
    readable = [val / "n0001" / "n0001_0.JPEG", val / "n0001" / "n0001_1.JPEG"]
    readable += [val / "n0003" / "n0003_0.JPEG", val / "n0003" / "n0003_1.JPEG"]
    cut, empty = val / "n0002" / "n0002_0.JPEG", val / "n0002" / "n0002_1.JPEG"
    cut.write_bytes(cut.read_bytes()[:200])
    empty.write_bytes(b"")
    dm = module(tmp_path, num_workers=workers, on_bad_sample="skip", batch_size=2)
    with caplog.at_level(logging.WARNING):
        rec = lightning_passes(dm, epochs=1, test=True)
    tf = dm.eval_transform()
    expected = torch.stack([tf(load_rgb(str(p))) for p in readable])
    for stage in ("val", "test"):
        assert [b is None for b in rec.seen[stage]] == [False, True, False]
        x, y = batches(rec.seen[stage])
        assert y.tolist() == [0, 0, 2, 2]
        torch.testing.assert_close(x, expected)  # each readable image once, in the split's order
        line = (
            f"{stage}: 2 unreadable image file(s) left out of 6 in {val} (data.on_bad_sample=skip; the others each "
            "scored once): n0002/n0002_0.JPEG, n0002/n0002_1.JPEG"
        )
        assert caplog.text.count(line) == 1, caplog.text
    assert "skipped" not in caplog.text  # (the training files all read)


def test_eval_sampler_over_ranks_scores_each_readable_image_once(tmp_path):
    """DDP's :class:`EvalSampler` gives each file to one rank (``r::ranks``, no padding) and the collate drops what a
    rank could not read: over 2 and 3 ranks the readable files are scored once each and the files left out are
    counted once (the callback sums the ranks' counts)."""
    make_imagenet_tree(tmp_path)
    (tmp_path / "val" / "n0002" / "n0002_1.JPEG").write_bytes(b"")
    dm = module(tmp_path, on_bad_sample="skip", batch_size=2)
    for ranks in (2, 3):
        ys, left = [], torch.zeros(6, dtype=torch.int32)
        for rank in range(ranks):
            ds = dm.make_dataset("val")  # (each rank's process: a data set of its own)
            loader = DataLoader(ds, 2, sampler=EvalSampler(ds, num_replicas=ranks, rank=rank), collate_fn=dm.collate_fn)
            ys += [y for b in loader if b is not None for y in b[1].tolist()]
            left += ds.dataset.take_pass()[1]
        assert sorted(ys) == [0, 0, 1, 2, 2] and left.tolist() == [0, 0, 0, 1, 0, 0]


def test_a_train_class_folder_without_images_is_one_line_naming_it(tmp_path):
    """An empty class folder in train/ (or one of files of other extensions only): a class the model could never
    learn. One line naming the folder, not torchvision's traceback."""
    make_imagenet_tree(tmp_path)
    (tmp_path / "train" / "n0004").mkdir()
    (tmp_path / "train" / "n0004" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    with pytest.raises(SystemExit) as stop, one_line_errors("train.py"):
        module(tmp_path)
    message = str(stop.value)
    assert message.startswith(f"train.py: ClassFoldersMismatchError: {tmp_path / 'train'}: Found no valid file for")
    assert "n0004" in message and "remove the empty one(s) or put their images in" in message and "\n" not in message


def test_files_that_are_not_images_and_a_linked_class_folder(tmp_path, caplog):
    """.DS_Store, Thumbs.db, a .txt in class folders are not samples (the .txt and a .heic counted in one warning,
    the system files not); a GIF is, as predict.py reads it (torchvision's list lacks it: GIFs were left out of
    training without a word); a symlinked class folder is a class; a val folder missing a class keeps train's class
    indices."""
    make_imagenet_tree(tmp_path, val_classes=("n0001", "n0003"))
    for junk in (".DS_Store", "Thumbs.db", "notes.txt", "phone.HEIC"):
        (tmp_path / "train" / "n0002" / junk).write_bytes(b"junk")
    Image.new("P", (8, 8), 3).save(tmp_path / "train" / "n0001" / "z.gif")
    (tmp_path / "train" / "n0003").rename(tmp_path / "n0003_elsewhere")
    (tmp_path / "train" / "n0003").symlink_to(tmp_path / "n0003_elsewhere", target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="vitrel.data.datasets"):
        dm = module(tmp_path)
        train = dm.raw_dataset("train")
    assert dm.classes == ["n0001", "n0002", "n0003"]
    assert [y for _, y in train.samples] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert train.samples[3][0].endswith("z.gif") and train[3][0].size == (8, 8)
    said = [r.getMessage() for r in caplog.records if "of other kinds" in r.getMessage()]
    assert said == [
        f"passed over 2 file(s) of other kinds in the class folders of {tmp_path / 'train'} (.heic 1, .txt 1): not read"
    ]
    assert [y for _, y in dm.raw_dataset("val").samples] == [0, 0, 2, 2]


def test_an_unreadable_image_raises_bad_sample_error_in_python(tmp_path):
    make_imagenet_tree(tmp_path)
    bad = spoil(tmp_path)["empty"]
    ds = module(tmp_path).raw_dataset("train")
    with pytest.raises(BadSampleError, match=f"cannot read {bad} "):
        ds[[p for p, _ in ds.samples].index(str(bad))]
    with pytest.raises(ValueError, match="on_bad_sample must be one of"):
        ImageNetDataModule(root=tmp_path, on_bad_sample="ignore")


def test_skip_names_each_unreadable_image_once_a_run_over_workers_and_epochs(tmp_path):
    """Each epoch's DataLoader workers are new processes (``persistent_workers`` off): a bad file was named again by
    every worker of every epoch that met it. A flag a file, shared with the workers, names it once."""
    make_imagenet_tree(tmp_path)
    bad = spoil(tmp_path)
    ds = module(tmp_path, on_bad_sample="skip").train_dataloader().dataset
    handler = logging.FileHandler(tmp_path / "log.txt")  # (forked workers write to it too)
    logger = logging.getLogger("vitrel.data.unreadable")
    logger.addHandler(handler)
    try:
        for _ in range(2):  # two epochs, two workers each, each file met by both (batches of one, shuffled)
            for _ in DataLoader(ds, batch_size=1, shuffle=True, num_workers=2, persistent_workers=False):
                pass
    finally:
        logger.removeHandler(handler)
        handler.close()
    said = (tmp_path / "log.txt").read_text()
    for path in bad.values():
        assert said.count(f"skipped {path}: cannot read it") == 1, said
