"""DataLoader workers forked after the main process decoded video: the worker inherits the PyAV objects left for the
garbage collector (a clip looked at before training leaves its frames in a reference cycle), which own FFmpeg threads
that the fork lacks; before the fix, the worker's first full collection waited on them forever (the DataLoader timed
out). The video data sets freeze what a worker inherited on its first sample (``leave_inherited``)."""

from __future__ import annotations

import gc

from torch.utils.data import DataLoader, Dataset

from tests.data.test_bad_videos import module, video_tree
from tests.data.test_video import needs_av


class CollectsEachItem(Dataset):
    """``dataset``'s samples, each followed by a full garbage collection (as a worker's long epoch has, sometime)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        item = self.dataset[i]
        gc.collect()
        return item


@needs_av
def test_a_worker_forked_after_a_clip_was_read_in_the_main_process_does_not_hang(tmp_path):
    video_tree(tmp_path)
    dm = module(tmp_path)
    train = dm.train_dataloader().dataset
    gc.disable()  # (the main process keeps its garbage until the fork, as it may in a notebook)
    try:
        clip, label = train[0]  # a look at a clip before training
        loader = DataLoader(CollectsEachItem(train), batch_size=None, num_workers=1, timeout=30)
        items = list(loader)
    finally:
        gc.enable()
    assert [lab for _, lab in items] == [0, 0] and items[0][0].shape == clip.shape


def collect(_worker: int) -> None:
    gc.collect()


@needs_av
def test_a_worker_that_collects_garbage_before_its_first_clip_does_not_hang(tmp_path):
    """A worker whose first full collection comes before its first sample (here its ``worker_init_fn``; in a run,
    whenever the worker's allocations call for one) frees the inherited frames before ``leave_inherited`` can freeze
    them; with FFmpeg's automatic swscale threads it waited for them forever. Frames are converted on one thread."""
    video_tree(tmp_path)
    train = module(tmp_path).train_dataloader().dataset
    gc.disable()
    try:
        clip, _ = train[0]
        loader = DataLoader(train, batch_size=None, num_workers=1, timeout=30, worker_init_fn=collect)
        first, label = next(iter(loader))
    finally:
        gc.enable()
    assert label == 0 and first.shape == clip.shape
