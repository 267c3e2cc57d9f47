"""The data sets whose normalisation statistics are computed (``data=arrays``, ``data=moving_fmnist``) take them from
the images trained on: a ``val_fraction`` held out of train is left out, as the test split is (they were over the
whole train array, the held-out val part included)."""

from __future__ import annotations

import numpy as np
import torch
from hydra.utils import instantiate

from tests.train_helpers import compose


def test_arrays_statistics_leave_the_val_part_out(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 6, 6, 3), dtype=np.uint8)
    x[::2] //= 2  # (half the images darker: a val part drawn from train moves the statistics)
    y = np.arange(40) % 4
    np.savez(tmp_path / "set.npz", x_train=x, y_train=y, x_test=x[:8], y_test=y[:8])
    cfg = compose(tmp_path, ["data=arrays", f"data.path={tmp_path / 'set.npz'}", "data.val_fraction=0.5"])
    dm = instantiate(cfg.data)
    train = np.asarray(dm.raw_dataset("train").indices)
    assert len(train) == 20 and len(dm.raw_dataset("val")) == 20
    pixels = x[train].reshape(-1, 3).astype(np.float64) / 255  # float64 reference over the train indices
    whole = x.reshape(-1, 3).astype(np.float64) / 255
    assert np.abs(pixels.mean(0) - whole.mean(0)).max() > 1e-3  # (the two differ: the test tells them apart)
    np.testing.assert_allclose(dm.mean, pixels.mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dm.std, pixels.std(0), rtol=0, atol=1e-12)
    # without a held-out part: the whole train array, as before
    full = instantiate(
        compose(tmp_path, ["data=arrays", f"data.path={tmp_path / 'set.npz'}", "data.val_fraction=0"]).data
    )
    np.testing.assert_allclose(full.mean, whole.mean(0), rtol=0, atol=1e-12)


def test_moving_fmnist_statistics_leave_the_val_pairs_out(tmp_path):
    overrides = ["data=moving_fmnist", "data.train_images=40", "data.test_images=8", "data.val_fraction=0.5"]
    dm = instantiate(compose(tmp_path, overrides).data)
    ds = dm.raw_dataset("train")
    clips = torch.stack([ds[i][0] for i in range(len(ds))]).numpy().astype(np.float64) / 255  # the clips trained on
    assert len(ds) == 40 and len(dm.raw_dataset("val")) == 40
    assert abs(dm.mean[0] - clips.mean()) < 1e-12 and abs(dm.std[0] - clips.std()) < 1e-12
    whole = instantiate(compose(tmp_path, [*overrides[:-1], "data.val_fraction=0"]).data)  # (all 80 clips)
    assert abs(whole.mean[0] - dm.mean[0]) > 1e-3  # (the two differ: the test tells them apart)
