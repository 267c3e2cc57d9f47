"""RandAugment and random erasing drawn once per clip (vitrel/data/video/augment.py) equal V-JEPA 2's video
augmentation (tests/data/vjepa2_video_aug.py, written out from their code) draw for draw, and every frame of a clip
gets the same ops and boxes, through the video DataModule a training run builds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from PIL import Image

from tests.data import vjepa2_video_aug as theirs
from tests.data.test_video import data_config, needs_av, write_video
from vitrel.data.video import ClipRandAugment, ClipTransform, CubeErasing

CONFIGS = ["rand-m7-n4-mstd0.5-inc1", "rand-m9-n3-mstd0.5", "rand-m5-n2"]


def _seed(s: int) -> None:
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def _clip(t: int = 3, c: int = 3, h: int = 20, w: int = 28, seed: int = 0) -> torch.Tensor:
    """Frames with edges and gradients (every op changes them) that differ from frame to frame."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 255, w)[None, None, None, :] * torch.linspace(0.2, 1, h)[None, None, :, None]
    noise = torch.randint(0, 60, (t, c, h, w), generator=g)
    return (ramp * torch.linspace(0.5, 1, c)[None, :, None, None] + noise).clamp(0, 255).to(torch.uint8)


def _their_randaugment(clip: torch.Tensor, config: str, size: int) -> torch.Tensor:
    """Their VideoTransform's RandAugment step: each frame to PIL (ToPILImage), the list through their transform."""
    frames = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in clip]
    out = theirs.create_random_augment(size, config)(frames)
    return torch.stack([torch.from_numpy(np.array(f)).permute(2, 0, 1) for f in out])


@pytest.mark.parametrize("config", CONFIGS)
def test_clip_randaugment_equals_theirs_draw_for_draw(config):
    """40 clips each: the same frames out, bit for bit, from the same seeds, and the generators left where theirs
    leave them (one draw per clip: the next clip's draws match too)."""
    ours = ClipRandAugment(config, 24)
    changed = 0
    for s in range(40):
        clip = _clip(seed=s)
        _seed(s)
        want = _their_randaugment(clip, config, 24)
        after = (random.random(), np.random.rand())
        _seed(s)
        got = ours(clip)
        assert torch.equal(got, want), (config, s)
        assert (random.random(), np.random.rand()) == after, (config, s)
        changed += not torch.equal(got, clip)
    assert changed >= 20, changed  # (the ops acted: each of n ops applies with probability 0.5)


def test_every_frame_of_a_clip_gets_the_same_ops_grey_frames_too():
    for c in (3, 1):
        ra = ClipRandAugment("rand-m9-n6-mstd0.5-inc1", 24, channels=c)
        for s in range(25):
            clip = _clip(t=4, c=c, seed=s)
            clip[:] = clip[0]  # four copies of one frame: whatever is drawn, the frames stay equal
            _seed(s)
            out = ra(clip)
            assert out.shape == clip.shape and out.dtype == torch.uint8
            assert all(torch.equal(out[i], out[0]) for i in range(4)), (c, s)


@pytest.mark.parametrize(("mode", "count"), [("pixel", 1), ("rand", 1), ("const", 3), ("pixel", 3)])
def test_cube_erasing_equals_theirs_and_cuts_one_box_through_every_frame(mode, count):
    ours = CubeErasing(0.7, mode, count)
    erased = 0
    for s in range(30):
        x = torch.randn(4, 3, 18, 26, generator=torch.Generator().manual_seed(s))
        _seed(s)
        want = theirs.RandomErasing(0.7, mode=mode, max_count=count)(x.clone())
        _seed(s)
        got = ours(x.clone())
        assert torch.equal(got, want), (mode, count, s)
        where = got != x
        assert all(torch.equal(where[i].any(0), where[0].any(0)) for i in range(4)), s  # the same boxes, every frame
        erased += bool(where.any())
    assert 12 <= erased <= 28, erased  # (probability 0.7 of 30)


def test_clip_transform_runs_the_three_steps_and_refuses_bad_settings():
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    tf = ClipTransform(16, mean, std, train=True, auto_augment="rand-m9-n2", re_prob=1.0, re_mode="const")
    assert "ClipRandAugment('rand-m9-n2')" in repr(tf) and "CubeErasing(prob=1.0" in repr(tf)
    clip = _clip(t=4, seed=1)
    clip[:] = clip[0]
    _seed(3)
    out = tf(clip)  # [C, T, H, W]
    assert out.shape == (3, 4, 16, 16)
    assert all(torch.equal(out[:, i], out[:, 0]) for i in range(4))  # one RandAugment, crop, flip and box for all
    assert (out == 0).all(0).any()  # (const erasing: 0 after normalisation)
    assert ClipTransform(16, mean, std, auto_augment="rand-m9-n2", re_prob=1.0).rand_augment is None  # (evaluation)
    with pytest.raises(ValueError, match="RandAugment config"):
        ClipTransform(16, mean, std, train=True, auto_augment="augmix-m5")
    with pytest.raises(ValueError, match="not a RandAugment config timm reads"):
        ClipTransform(16, mean, std, train=True, auto_augment="rand-q3")
    with pytest.raises(ValueError, match="re_mode"):
        ClipTransform(16, mean, std, train=True, re_prob=0.5, re_mode="noise")


@needs_av
def test_the_video_data_module_of_a_run_augments_with_the_keys(tmp_path):
    """``data.augment_kwargs`` as a run composes them: the training clips go through RandAugment and erasing, the
    evaluation clips through neither; a key a video module does not take is refused by name."""
    for split in ("train", "val"):
        for cls in ("a", "b"):
            write_video(tmp_path / split / cls / "0.avi", 6, "ffv1", "yuv420p", hw=(30, 40))
    kw = {"auto_augment": "rand-m7-n4-mstd0.5-inc1", "re_prob": 0.25, "re_mode": "pixel"}
    cfg = data_config(
        "video_folder",
        root=tmp_path,
        num_frames=4,
        img_size=16,
        batch_size=2,
        **{f"augment_kwargs.{k}": v for k, v in kw.items()},
    )
    cfg.num_workers, cfg.pin_memory = 0, False
    dm = instantiate(cfg)
    train, evaluation = dm.train_transform(), dm.eval_transform()
    assert train.rand_augment.config == kw["auto_augment"] and (train.erase.prob, train.erase.mode) == (0.25, "pixel")
    assert evaluation.rand_augment is None and evaluation.erase is None
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 4, 16, 16) and torch.isfinite(x).all()
    cfg.augment_kwargs = {"re_split": True}
    with pytest.raises(InstantiationException, match=r"augment_kwargs \['re_split'\]: a video module takes only"):
        instantiate(cfg)
