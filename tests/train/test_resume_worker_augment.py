"""A resume of a run whose training augmentation runs per sample in the DataLoader (``data=imagenet``:
``data.loader=workers``, ``data.augment=true``) replays it exactly: each sample's augmentation is drawn from
``(seed, epoch, index)`` (``MappedDataset`` indexed by the keyed ``EpochSampler``'s ``SampleKey``), so a run resumed
at an epoch's end or mid-epoch ends with the uninterrupted run's weights and ``metrics.csv``, with or without
workers."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests.data.test_datamodules import make_imagenet_tree
from tests.train_helpers import FAST, TINY_VIT, RaiseInForward, compose
from vitrel.data.sampling import EpochSampler, ResumableDataLoader
from vitrel.data.transforms import MappedDataset, SampleKey, augment_transform
from vitrel.train.run import train

DATA = ["data=imagenet", "data.img_size=32", "data.batch_size=4", "data.augment=true", "logger=csv"]
DATA += ["module.scheduler=null"]  # a constant rate: a 1-epoch run's schedule is not the 2-epoch run's
AUG = ["+data.augment_kwargs={auto_augment: rand-m9-n2, re_prob: 0.5}"]  # python random and torch


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_resumed_run_replays_the_worker_augmentation(tmp_path, workers):
    """2 epochs straight vs 1 epoch then resumed to 2, and vs a run stopped by an exception after step 3 (mid-epoch 1,
    its exception checkpoint) then resumed."""
    tree = tmp_path / "tree"
    make_imagenet_tree(tree)  # 9 training images: 2 batches of 4 (drop_last)
    over = [*TINY_VIT, *FAST, *DATA, *AUG, f"data.root={tree}", f"data.num_workers={workers}"]
    straight, at_end, mid = tmp_path / "straight", tmp_path / "at_end", tmp_path / "mid"
    train(compose(straight, [*over, "trainer.max_epochs=2"]))
    train(compose(at_end, [*over, "trainer.max_epochs=1"]))
    train(compose(at_end, [*over, "trainer.max_epochs=2"]))  # resume=auto: from the epoch end's last.ckpt
    with pytest.raises(torch.OutOfMemoryError):  # in step 4's forward: last.ckpt of step 3, mid-epoch 1
        train(compose(mid, [*over, "trainer.max_epochs=2"]), callbacks=[RaiseInForward(at_step=3)])
    assert torch.load(mid / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    train(compose(mid, [*over, "trainer.max_epochs=2"]))
    want, want_rows = _weights(straight), _rows(straight)
    assert {"train/loss_epoch", "train/acc1"} <= set(want_rows[0]), sorted(want_rows[0])
    for run in (at_end, mid):
        got = _weights(run)
        diff = max(float((got[k].float() - v.float()).abs().max()) for k, v in want.items())
        assert diff == 0.0, f"{run.name}: weights differ from the uninterrupted run's by up to {diff}"
        assert _rows(run) == want_rows, f"{run.name}: metrics.csv differs from the uninterrupted run's"


class _Images(torch.utils.data.Dataset):
    def __init__(self, n: int = 6) -> None:
        from PIL import Image

        rng = np.random.default_rng(0)
        self.images = [Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], i


def _mapped() -> MappedDataset:
    tf = augment_transform(32, (0.5,) * 3, (0.25,) * 3, auto_augment="rand-m9-n2", re_prob=0.5)
    return MappedDataset(_Images(), tf)


def test_a_sample_key_gives_the_same_augmentation_in_any_process_and_leaves_the_rngs_alone():
    """The same ``(seed, epoch, index)``: the same tensor in the main process and in a worker, in any batch position;
    another epoch or seed: another draw; the global RNG states after a keyed read are those before it."""
    ds = _mapped()
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    here = {i: ds[SampleKey(i, 3, 7)][0] for i in range(len(ds))}
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    torch.manual_seed(123)  # other global states: no effect on a keyed draw
    assert torch.equal(ds[SampleKey(2, 3, 7)][0], here[2])
    assert not torch.equal(ds[SampleKey(2, 4, 7)][0], here[2]) and not torch.equal(ds[SampleKey(2, 3, 8)][0], here[2])

    sampler = EpochSampler(ds, shuffle=True, seed=7)
    loader = ResumableDataLoader(ds, sampler=sampler, batch_size=4, num_workers=1)
    assert sampler.keyed
    sampler.set_epoch(3)
    seen = [(x, int(i)) for xb, ib in loader for x, i in zip(xb, ib, strict=True)]
    assert sorted(i for _, i in seen) == list(range(len(ds)))
    for x, i in seen:
        assert torch.equal(x, here[i]), f"sample {i}: the worker's augmentation differs from the main process's"
    plain = DataLoader(ds, batch_size=4)  # evaluation-style int indices: unchanged, unkeyed
    assert len(next(iter(plain))[0]) == 4


def test_a_sample_key_fixes_naflex_random_sizes():
    """NaFlex's training transform (``data.size_scale``: a random size per image, then timm's augmentation): the same
    key, the same patches and grid whatever the global RNGs; another epoch, another draw."""
    from vitrel.data.packing import naflex_transform

    tf = naflex_transform(
        train=True, patch_size=4, max_tokens=64, mean=(0.5,) * 3, std=(0.25,) * 3, augment=True, size_scale=(0.3, 1.0)
    )
    ds = MappedDataset(_Images(), tf)
    torch.manual_seed(0), random.seed(0)
    a = ds[SampleKey(1, 0, 5)][0]
    torch.manual_seed(1), random.seed(1)
    b = ds[SampleKey(1, 0, 5)][0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    others = [ds[SampleKey(1, e, 5)][0] for e in range(1, 5)]
    assert any(o["patches"].shape != a["patches"].shape or not torch.equal(o["patches"], a["patches"]) for o in others)
