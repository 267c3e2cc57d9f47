"""``Normalisation.adopt``: the preprocessing weights expect (a ``pretrained_cfg``, a checkpoint's stored data config),
taken where the ``data`` config leaves it null, as one value per channel, set on the data module and logged in one
line beside the module's own. ``train.py`` (pretrained weights, a resume, ``model=from_checkpoint``) and ``eval.py``
(as the checkpoint was trained) both go through it: tests/train/test_finetune_path.py runs them."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from vitrel.data import ArrayDataModule

NULL = {"mean": None, "std": None, "interpolation": None, "crop_pct": None}


def _grey(**kwargs) -> ArrayDataModule:
    """A one-channel data module of 8 x 8 images (its own statistics: those of its images)."""
    x = np.random.default_rng(0).integers(0, 256, (8, 8, 8), dtype=np.uint8)
    return ArrayDataModule(train=(x, np.arange(8) % 2), test=(x[:4], np.arange(4) % 2), **kwargs)


def test_adopt_takes_the_null_keys_per_channel_sets_and_logs_them(caplog):
    dm = _grey(std=[0.25])
    offered = {"mean": [0.2, 0.4, 0.6], "std": [0.5, 0.5, 0.5], "interpolation": "bicubic", "crop_pct": 0.9}
    offered["input_size"] = [3, 9, 9]
    with caplog.at_level(logging.INFO):
        taken = dm.adopt(offered, "the weights'", {**NULL, "std": [0.25]})
    # the RGB mean averaged to the grey channel; data.std given: kept; what is not preprocessing: not taken
    assert taken == {"mean": [pytest.approx(0.4)], "interpolation": "bicubic", "crop_pct": 0.9}, taken
    assert dm.mean == pytest.approx((0.4,)) and dm.std == (0.25,) and dm.interpolation == "bicubic"
    assert dm.crop_pct == 0.9 and dm.eval_transform(32).transforms[0].size == 35  # floor(32 / 0.9)
    said = [r.getMessage() for r in caplog.records if "data.mean=" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("data.mean=[0.4] data.interpolation=bicubic data.crop_pct=0.9: the weights'; "), said
    own = f"ArrayDataModule's own: mean [{dm.dataset_mean[0]:.4g}], interpolation bilinear, crop_pct 1"
    assert f"{own} (data.<key>=<v> for others)" in said[0], said


def test_adopt_takes_only_what_differs_unless_always(caplog):
    dm = _grey()
    same = {"mean": list(dm.mean), "std": list(dm.std), "interpolation": dm.interpolation, "crop_pct": dm.crop_pct}
    with caplog.at_level(logging.INFO):
        assert dm.adopt(same, "the checkpoint's", NULL) == {}
    assert not [r for r in caplog.records if "data.mean=" in r.getMessage()]  # nothing taken: nothing said
    assert dm.given_mean is None and dm.given_std is None
    taken = dm.adopt({**same, "interpolation": "bicubic"}, "the checkpoint's", NULL)
    assert taken == {"interpolation": "bicubic"} and dm.interpolation == "bicubic"
    assert dm.adopt(same, "the weights'", NULL, always=True) == {**same, "interpolation": "bilinear"}
    given = {"mean": [0.1], "std": [0.2], "interpolation": "nearest", "crop_pct": 0.8}
    assert dm.adopt({**same, "crop_pct": 0.95}, "the weights'", given) == {}
