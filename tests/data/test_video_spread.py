"""``data.frame_sampling=spread``: a clip's frames one from each of ``num_frames`` equal parts of the video (TSN's
sampling, VideoMAE's Something-Something v2 clips). The frames against VideoMAE's own index code
(``SSVideoClsDataset.loadvideo_decord`` in MCG-NJU/VideoMAE's ``ssv2.py``, written out below with its random draws
replayed from torch's); a real video file's samples against its frames decoded; the data module's refusals and
stored data config; ``data=video_list`` composed by Hydra with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

from tests.data.test_video import data_config, frame_ids, needs_av, write_video
from vitrel.data.video import VideoClips, VideoFolderDataModule, spread_indices
from vitrel.data.video.clips import VideoFileClips
from vitrel.models.data_config import data_config_of


# ---------------------------------------------------------------------------- VideoMAE's code, written out
def videomae_train(n: int, num_segment: int, randint) -> list[int]:
    """``loadvideo_decord``'s training indices (``mode="train"``); ``randint(high, size)`` stands for their
    ``np.random.randint``."""
    average_duration = n // num_segment
    all_index = []
    if average_duration > 0:
        all_index += list(
            np.multiply(list(range(num_segment)), average_duration) + randint(average_duration, num_segment)
        )
    elif n > num_segment:
        all_index += list(np.sort(randint(n, num_segment)))
    else:
        all_index += list(np.zeros((num_segment,)))
    return [int(i) for i in all_index]


def videomae_test(n: int, num_segment: int, test_num_segment: int) -> list[list[int]]:
    """``loadvideo_decord``'s test indices (``mode="test"``) and ``__getitem__``'s views of them:
    ``buffer[chunk_nb::2]`` for ``chunk_nb`` in ``0 .. test_num_segment - 1``."""
    tick = n / float(num_segment)
    all_index = list(
        np.array([int(tick / 2.0 + tick * x) for x in range(num_segment)] + [int(tick * x) for x in range(num_segment)])
    )
    while len(all_index) < (num_segment * test_num_segment):
        all_index.append(all_index[-1])
    all_index = list(np.sort(np.array(all_index)))
    return [[int(i) for i in all_index[chunk::2]] for chunk in range(test_num_segment)]


@pytest.mark.parametrize("t", [8, 16])
def test_evaluation_views_are_videomaes_test_views(t):
    """Their released SSv2 test (``test_num_segment`` 2; 1 takes their first view) for every video length from 1
    to 400 frames: view 0 the parts' first frames, view 1 their middles."""
    for n in range(1, 401):
        for k in (1, 2):
            got = [v.tolist() for v in spread_indices(n, t, k, train=False)]
            assert got == videomae_test(n, t, k)[:k], (n, t, k)
    assert [v.tolist() for v in spread_indices(20, 4, 2, train=False)] == [[0, 5, 10, 15], [2, 7, 12, 17]]


def test_evaluation_views_by_the_equation():
    """Any view count and length: view k's frame t is floor(N (t K + k) / (T K)), inside part t of N / T frames."""
    for n in (1, 7, 16, 45, 100):
        for t in (1, 3, 16):
            for k in (1, 2, 3, 5):
                views = spread_indices(n, t, k, train=False)
                assert len(views) == k
                for j, v in enumerate(views):
                    assert v.tolist() == [(n * (i * k + j)) // (t * k) for i in range(t)]
                    assert all((i * n) // t <= f < (i + 1) * n / t for i, f in enumerate(v.tolist()))  # (in part i)


def test_training_draws_are_videomaes_from_the_same_draws():
    """Training, video lengths 16 to 300 with T 16 (and 5 with T 4): torch's draws fed to their code give our
    frames; each frame in its part of P = N // T frames, every offset 0 .. P - 1 drawn."""
    for t, lengths in ((16, range(16, 301, 7)), (4, (5, 9, 23))):
        for n in lengths:
            g = torch.Generator().manual_seed(n)
            ours = spread_indices(n, t, 1, train=True, generator=g)
            draws = torch.Generator().manual_seed(n)
            theirs = videomae_train(n, t, lambda high, size, g=draws: torch.randint(high, (size,), generator=g).numpy())
            assert len(ours) == 1 and ours[0].tolist() == theirs, (n, t)
    g = torch.Generator().manual_seed(0)
    seen = np.stack([spread_indices(50, 16, 1, train=True, generator=g)[0] for _ in range(200)])  # P = 3
    assert ((seen >= np.arange(16)[None] * 3) & (seen < np.arange(1, 17)[None] * 3)).all()
    assert set((seen % 3).ravel().tolist()) == {0, 1, 2}
    assert len({tuple(r) for r in seen.tolist()}) > 150  # each frame its own draw


def test_a_video_shorter_than_a_clip_repeats_frames():
    """N < T: evaluation's view 0 (floor(t N / T)) in training too (VideoMAE's code takes frame 0 for every t)."""
    want = [(5 * i) // 8 for i in range(8)]
    assert spread_indices(5, 8, 1, train=True)[0].tolist() == want == spread_indices(5, 8, 1, train=False)[0].tolist()
    assert videomae_train(5, 8, None) == [0] * 8  # (theirs, for the record)
    with pytest.raises(ValueError, match="views must be >= 1 \\(1 in training\\), got 2"):
        spread_indices(20, 4, 2, train=True)


# ---------------------------------------------------------------------------- real files and the data module
@pytest.fixture(scope="module")
def twenty(tmp_path_factory) -> Path:
    """20 frames of 20 x 26 lossless grey (frame i at brightness 8 + 12 i)."""
    return write_video(tmp_path_factory.mktemp("spread") / "twenty.mkv", 20, "ffv1", "gray", hw=(20, 26))


@needs_av
def test_a_file_gives_the_spread_frames(twenty):
    """20 frames, T 4 (parts of 5): evaluation 2 views, the parts' first frames and middles, as VideoClips' and
    predict.py's samples; training one frame from each part, drawn afresh."""
    raw = VideoClips([(str(twenty), 1)], 4, stride=1, clips_per_video=2, frame_sampling="spread")
    views = [frame_ids(v) for v in raw[0][0].unbind(0)]  # uint8 [K, T, C, H, W] without a transform
    assert views == [[0, 5, 10, 15], [2, 7, 12, 17]] and raw[0][1] == 1
    files = VideoFileClips([twenty], (4, 1, 2), lambda c: c, grey=False, frame_sampling="spread")[0]
    assert [frame_ids(v) for v in files[1].unbind(0)] == views  # predict.py's views
    train = VideoClips([(str(twenty), 0)], 4, sampling="random", frame_sampling="spread")
    torch.manual_seed(0)
    drawn = [frame_ids(train[0][0]) for _ in range(30)]
    assert all(5 * i <= f < 5 * (i + 1) for d in drawn for i, f in enumerate(d))
    assert len({tuple(d) for d in drawn}) > 10


def test_spread_refuses_a_stride_segments_and_other_names(tmp_path):
    with pytest.raises(ValueError, match=r"data.frame_sampling=spread .* so data.stride=4 has .*: set data.stride=1$"):
        VideoFolderDataModule(root=tmp_path, frame_sampling="spread")
    with pytest.raises(ValueError, match=r"so data.num_segments=2 has no meaning with it: set data.num_segments=1$"):
        VideoFolderDataModule(root=tmp_path, stride=1, num_segments=2, frame_sampling="spread")
    with pytest.raises(ValueError, match=r"data.frame_sampling must be one of \('stride', 'spread'\), got 'tsn'"):
        VideoClips([], 4, frame_sampling="tsn")


@needs_av
def test_the_data_config_train_py_stores_names_the_sampling(tmp_path):
    for split in ("train", "val"):
        for cls in ("a", "b"):
            write_video(tmp_path / split / cls / "v.mkv", 6, "ffv1", "gray", hw=(16, 20))
    dm = VideoFolderDataModule(root=tmp_path, stride=1, clips_per_video=2, frame_sampling="spread")
    dc = data_config_of(dm)
    assert dc["frame_sampling"] == "spread" and dc["frame_stride"] == 1 and dc["clips_per_video"] == 2
    assert data_config_of(VideoFolderDataModule(root=tmp_path))["frame_sampling"] == "stride"


@needs_av
def test_video_list_config_with_spread(tmp_path):
    """data=video_list data.frame_sampling=spread as train.py composes it: batches of T frames spread."""
    lines = []
    for c in range(2):
        write_video(tmp_path / f"v{c}.mkv", 12 + 4 * c, "ffv1", "gray", hw=(16, 20))
        lines.append(f"v{c}.mkv {c}")
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    over = dict(root=tmp_path, train_list="train.csv", val_list="train.csv", num_frames=4, stride=1, img_size=16)
    cfg = data_config("video_list", frame_sampling="spread", clips_per_video=2, **over)
    cfg.num_workers, cfg.pin_memory, cfg.batch_size = 0, False, 2
    dm = instantiate(cfg)
    assert dm.frame_sampling == "spread" and dm.input_size == (3, 4, 16, 16)
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 4, 16, 16)
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (2, 2, 3, 4, 16, 16) and y.tolist() == [0, 1]
