"""Training on video: clips through train.py, eval.py and predict.py, mixup per clip, the video / image pairing
refused at once, and the checkpoint a video run writes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from timm.data import Mixup

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.module import mix_clips
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]
# Moving Fashion-MNIST, small: 64 training and 32 test clips
TINY_CLIPS = ["data=moving_fmnist", "data.train_images=32", "data.test_images=16", "data.batch_size=8"]


def test_image_model_with_video_data_is_refused_before_anything_is_built(tmp_path):
    cfg = compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, *TINY_CLIPS])
    with pytest.raises(ValueError, match=r"gives clips \[B, C, T, H, W\].*is an image model.*model=vitrel_vit_video"):
        train(cfg)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("mode", ["batch", "pair", "elem"])
def test_cutmix_pastes_one_box_on_every_frame_of_a_clip(mode):
    """Each frame of the mixed clips is what timm's image CutMix makes of that frame alone (the same draw): one box,
    the same for all the clip's frames and all its time steps mixed."""
    b, c, t, h, w = 4, 2, 3, 16, 16
    x = torch.randn(b, c, t, h, w, generator=torch.Generator().manual_seed(0))
    y = torch.arange(b)
    make = functools.partial(Mixup, mixup_alpha=0.0, cutmix_alpha=1.0, mode=mode, num_classes=b)
    np.random.seed(3)
    mixed, target = mix_clips(make(), x.clone(), y)
    assert mixed.shape == x.shape
    changed = (mixed != x).any(dim=1)  # [B, T, H, W]
    assert changed.any(), "the draw pasted nothing: the test would not see a wrong box"
    for k in range(t):
        np.random.seed(3)
        frame, frame_target = make()(x[:, :, k].clone(), y)  # timm on images: the reference
        torch.testing.assert_close(mixed[:, :, k], frame, rtol=0, atol=0)
        torch.testing.assert_close(target, frame_target, rtol=0, atol=0)
        assert torch.equal(changed[:, k], changed[:, 0])


def test_mixup_blends_whole_clips():
    b = 4
    x = torch.randn(b, 1, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    np.random.seed(0)
    mixed, target = mix_clips(
        Mixup(mixup_alpha=1.0, cutmix_alpha=0.0, label_smoothing=0.0, num_classes=b), x.clone(), torch.arange(b)
    )
    lam = float(target[0, 0])  # the first clip keeps lam of its own class
    torch.testing.assert_close(mixed, lam * x + (1 - lam) * x.flip(0))
