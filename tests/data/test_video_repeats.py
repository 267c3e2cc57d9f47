"""``data.clip_repeats=R`` (vitrel/data/video/clips.py ``VideoClips(repeats=R)``, ``RepeatsCollate``; VideoMAE's
``num_sample``): each training video decoded once a step and augmented ``R`` times, each view a sample of the batch,
through the data module a run builds and ``train.py``."""

from __future__ import annotations

import json

import pytest
import torch
from hydra.utils import instantiate

from tests.data.test_video import data_config, needs_av, video_root, write_video  # noqa: F401 (the fixture)
from tests.train.test_video_first_hour import FOLDER, SHORT
from tests.train_helpers import compose, straight_and_resumed
from vitrel.data.video import ClipTransform, VideoClips
from vitrel.data.video.clips import RepeatsCollate
from vitrel.train.run import train


@needs_av
def test_a_video_is_read_once_and_augmented_into_each_view(video_root, monkeypatch):  # noqa: F811
    from vitrel.data.video import clips

    reads = []
    read_clip = clips.read_clip
    monkeypatch.setattr(clips, "read_clip", lambda *a: reads.append(a[0]) or read_clip(*a))
    videos = [(str(p), 0) for p in sorted(video_root.glob("train/*/*.avi"))]
    same = VideoClips(videos, 4, stride=2, sampling="random", transform=lambda c: c.float(), repeats=3)
    x, y = same[0]
    assert x.shape == (3, 4, 3, 30, 40) and y == 0 and len(reads) == 1  # ([R, T, C, H, W]: the clip as read, 3x)
    assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[2])  # one decoded clip
    tf = ClipTransform(16, (0.5,) * 3, (0.25,) * 3, train=True, re_prob=1.0, re_mode="pixel")
    views, _ = VideoClips(videos, 4, stride=2, sampling="random", transform=tf, repeats=2)[1]
    assert views.shape == (2, 3, 4, 16, 16) and not torch.equal(views[0], views[1])  # each view its own draws
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        VideoClips(videos, 4, sampling="uniform", transform=tf, repeats=2)  # (evaluation: one view a clip)


def test_the_collate_makes_each_view_a_sample():
    x = torch.arange(2 * 3 * 4.0).reshape(2, 3, 4)  # 2 videos x 3 views
    batch, labels = RepeatsCollate(3)([(x[0], 5), (x[1], 7)])
    assert torch.equal(batch, x.flatten(0, 1)) and labels.tolist() == [5, 5, 5, 7, 7, 7]


@needs_av
def test_the_data_module_reads_batch_size_over_repeats_videos_a_step(video_root, tmp_path):  # noqa: F811
    cfg = data_config("video_folder", root=video_root, num_frames=4, stride=2, img_size=16, batch_size=4)
    cfg.num_workers, cfg.pin_memory, cfg.clip_repeats = 0, False, 2
    dm = instantiate(cfg)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 4, 16, 16) and y[0] == y[1] and y[2] == y[3]  # (2 videos, 2 views each)
    assert len(dm.train_dataloader()) == 6 // 2  # (6 training videos, 2 a step)
    cfg.batch_size = 3
    with pytest.raises(Exception, match="data.clip_repeats=2 must be an integer >= 1 that divides data.batch_size=3"):
        instantiate(cfg)


@needs_av
def test_a_run_with_repeats_takes_a_step_per_half_batch_of_videos(tmp_path):
    """``train.py data.clip_repeats=2 data.batch_size=4`` on 4 training videos: 2 steps an epoch (2 videos a step),
    against 1 without repeats."""
    for split, n in (("train", 2), ("val", 1)):
        for cls in ("a", "b"):
            for k in range(n):
                write_video(tmp_path / "videos" / split / cls / f"{k}.mkv", 4, hw=(16, 16))
    over = [*FOLDER, f"data.root={tmp_path / 'videos'}", "data.num_workers=0", *SHORT, "data.batch_size=4"]
    over = [o for o in over if not o.startswith(("trainer.limit_train_batches", "data.batch_size=8"))]
    for repeats, steps in ((2, 2), (1, 1)):
        run = tmp_path / f"r{repeats}"
        train(compose(run, [*over, f"data.clip_repeats={repeats}"]))
        assert json.loads((run / "metrics.json").read_text())["global_step"] == steps, repeats


@needs_av
def test_a_video_run_killed_mid_epoch_resumes_as_the_uninterrupted_one(tmp_path):
    """``train.py`` on 6 training videos, 2 a step (``data.batch_size`` 4 with ``data.clip_repeats=2``: each read
    in 2 views), RandAugment and erasing drawn per view, SIGTERM at step 2 of 3, then the same command: it resumes
    mid-epoch and its weights equal the uninterrupted run's bit for bit (each clip's draws keyed by its index and
    epoch; the loader's position counted in videos, not views). Red with either fault alone (2026-12-07)."""
    for split, n in (("train", 3), ("val", 1)):
        for cls in ("a", "b"):
            for k in range(n):
                write_video(tmp_path / "videos" / split / cls / f"{k}.mkv", 6, hw=(16, 16))
    over = [*FOLDER, f"data.root={tmp_path / 'videos'}", "data.num_workers=0", "data.clip_repeats=2"]
    over += ["data.batch_size=4", "data.drop_last=true", "trainer.max_epochs=2", "logger=none"]
    over += ["data.augment_kwargs.auto_augment=rand-m7-n2", "data.augment_kwargs.re_prob=0.5", "test=false"]
    over += ["trainer.limit_val_batches=1", "callbacks.model_checkpoint=null", "module.scheduler=null"]
    a, b = straight_and_resumed(over, tmp_path, at_step=1)  # (SIGTERM in step 2: saved after it)
    assert a["global_step"] == b["global_step"] == 6
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"] if k.startswith("model."))
