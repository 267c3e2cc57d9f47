"""Evaluation over webdataset shards with several loader workers: each worker yields its own shards, its last
batch partial, so the loader holds more batches than ``ceil(N / B)``; Lightning stops a sized loader at its
``len()``, which then left the last batches, and their images, unscored."""

from __future__ import annotations

import math

import lightning as L
import torch

from tests.data.test_shards import CLASSES, VAL_PER_CLASS, make_tree, module
from vitrel.data.shards import write_wds

N_VAL = len(CLASSES) * VAL_PER_CLASS  # 12 validation images


class Count(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 3)
        self.seen = 0

    def test_step(self, batch, batch_idx):
        self.seen += len(batch[1])


def test_wds_evaluation_scores_every_image_with_several_workers(tmp_path):
    make_tree(tmp_path / "tree")
    write_wds(tmp_path / "tree", tmp_path / "wds", shard_size=5)  # validation: shards of 5, 5, 2
    # 2 workers: shards 0 and 2 (7 images: batches of 4 and 3) and shard 1 (5 images: 4 and 1): 4 batches, not 3
    dm = module(tmp_path / "wds", "wds/imagenet", batch_size=4, num_workers=2)
    dm.setup("test")
    loader = dm.test_dataloader()
    assert len(loader) == sum(1 for _ in loader) == 4 > math.ceil(N_VAL / 4)
    probe = Count()
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    L.Trainer(accelerator="cpu", **quiet).test(probe, datamodule=dm, verbose=False)
    assert probe.seen == N_VAL


def test_hfids_evaluation_runs_to_the_end_of_an_unsized_loader(tmp_path):
    """The streamed parquet reader states no per-file lengths: the evaluation loader is unsized and Lightning scores
    every image the workers yield."""
    from vitrel.data.shards import write_hf

    make_tree(tmp_path / "tree")
    write_hf(tmp_path / "tree", tmp_path / "hf", shard_size=5)
    dm = module(tmp_path / "cache", f"hfids/{tmp_path / 'hf'}", batch_size=4, num_workers=2)
    dm.setup("test")
    probe = Count()
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    L.Trainer(accelerator="cpu", **quiet).test(probe, datamodule=dm, verbose=False)
    assert probe.seen == N_VAL
