"""``num_segments``: a sample of K clips, one from each of K equal parts of the video, joined along time (V-JEPA 2's
evaluation protocol, ``loadvideo_decord``). The starts against a naive reference written from the equation of
:func:`vitrel.data.video.sampling.segment_starts`; a sample of a real video file against its frames decoded, picked and
transformed by hand; the DataModule's ``input_size``, its refusal of ``clips_per_video > 1``, and
``data=video_folder`` composed by Hydra with ``data.num_segments=2``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from tests.data.test_video import av, data_config, frame_ids, needs_av, write_video
from vitrel.data.video import (
    ClipTransform,
    VideoClips,
    VideoFolderDataModule,
    random_start,
    segment_starts,
    uniform_starts,
)
from vitrel.data.video.clips import VideoFileClips


def reference_ranges(n: int, t: int, stride: int, k: int) -> list[tuple[int, int]] | None:
    """Each clip's range of starts ``[i P, i P + P - span]`` (``P = n // k``, ``span = (t - 1) stride + 1``), by
    loops over the frames; None when a part is shorter than a clip (the overlapping case)."""
    span = (t - 1) * stride + 1
    part = n // k
    if part < span:
        return None
    ranges = []
    for i in range(k):
        frames = [f for f in range(n) if i * part <= f < (i + 1) * part]  # part i, frame by frame
        starts = [s for s in frames if all(s + j * stride in frames for j in range(t))]  # the clip inside the part
        ranges.append((min(starts), max(starts)))
    return ranges


def reference_eval(n: int, t: int, stride: int, k: int) -> list[int]:
    """The evaluation starts: each part's centre, else (parts shorter than a clip) evenly spread over the video."""
    ranges = reference_ranges(n, t, stride, k)
    if ranges is None:
        span = (t - 1) * stride + 1
        delta = max(n - span, 0)
        return [delta // 2] if k == 1 else [(j * delta) // (k - 1) for j in range(k)]
    return [lo + (hi - lo) // 2 for lo, hi in ranges]


GRID = [(n, t, s, k) for n in (1, 5, 9, 16, 23, 40) for t in (1, 2, 4) for s in (1, 2, 3) for k in (1, 2, 3, 4)]


def test_evaluation_starts_are_the_parts_centres():
    for n, t, s, k in GRID:
        assert segment_starts(n, t, s, k, train=False) == reference_eval(n, t, s, k), (n, t, s, k)
    # worked example: 40 frames, K 4, parts of 10, a span of 4 frames (T 2, stride 3): offsets (10 - 4) // 2 = 3
    assert segment_starts(40, 2, 3, 4, train=False) == [3, 13, 23, 33]


def test_training_starts_stay_in_their_parts_and_reach_every_offset():
    for n, t, s, k in GRID:
        ranges = reference_ranges(n, t, s, k)
        g = torch.Generator().manual_seed(n * 1000 + t * 100 + s * 10 + k)
        draws = [segment_starts(n, t, s, k, train=True, generator=g) for _ in range(60 if ranges else 3)]
        if ranges is None:  # (overlapping: evenly spread, as evaluation; K = 1 is random_start, 0 here)
            assert all(d == uniform_starts(n, t, s, k) for d in draws), (n, t, s, k)
            continue
        for i, (lo, hi) in enumerate(ranges):
            seen = {d[i] for d in draws}
            assert all(lo <= x <= hi for x in seen), (n, t, s, k, i, seen)
    # every offset reached, each clip drawn on its own: 40 frames, K 4, parts of 10, span 4: offsets 0 .. 6
    g = torch.Generator().manual_seed(0)
    draws = [segment_starts(40, 2, 3, 4, train=True, generator=g) for _ in range(700)]
    for i in range(4):
        counts = Counter(d[i] - 10 * i for d in draws)
        assert sorted(counts) == list(range(7)) and min(counts.values()) > 60, (i, counts)
    assert len({tuple(d) for d in draws}) > 300  # (not one offset for all clips)


def test_overlapping_segments_and_one_segment_are_todays_sampling():
    # parts of 23 // 4 = 5 frames, shorter than a clip of 7: the clips overlap, spread from the start to the end
    assert segment_starts(23, 4, 2, 4, train=False) == segment_starts(23, 4, 2, 4, train=True) == [0, 5, 10, 16]
    assert segment_starts(23, 4, 2, 4, train=False) == uniform_starts(23, 4, 2, 4)
    for n, t, s, _ in GRID:
        assert segment_starts(n, t, s, 1, train=False) == uniform_starts(n, t, s, 1)
        a, b = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
        assert [segment_starts(n, t, s, 1, True, a)[0] for _ in range(5)] == [
            random_start(n, t, s, b) for _ in range(5)
        ]
        assert torch.equal(a.get_state(), b.get_state())  # (the same draws: a short video's too, the crops after)
    with pytest.raises(ValueError, match="num_segments must be an integer >= 1, got 0"):
        segment_starts(20, 4, 1, 0, train=False)


# ------------------------------------------------------------------------------------------------ the samples
@pytest.fixture(scope="module")
def twenty(tmp_path_factory) -> Path:
    """20 frames of 20 x 26 lossless grey (frame i at brightness 8 + 12 i), a bright block top-left."""
    return write_video(tmp_path_factory.mktemp("seg") / "twenty.mkv", 20, "ffv1", "gray", hw=(20, 26))


def by_hand(path: Path, starts: list[int], t: int, stride: int, tf: ClipTransform) -> torch.Tensor:
    """The clips starting at ``starts``, decoded with PyAV, each through ``tf``, joined along T (dim -3)."""
    with av.open(str(path)) as container:
        decoded = [torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1) for f in container.decode(video=0)]
    n = len(decoded)
    clips = [tf(torch.stack([decoded[min(s + j * stride, n - 1)] for j in range(t)])) for s in starts]
    return torch.cat(clips, dim=-3)


@needs_av
@pytest.mark.parametrize("crops", [1, 3])
def test_a_segments_sample_is_its_clips_by_hand(twenty, crops):
    """20 frames, K 2, parts of 10, T 3, stride 2 (span 5): the clips start at 0 + 2 and 10 + 2, frames
    [2, 4, 6] then [12, 14, 16]; each transformed alone (the evaluation pipeline), joined along time."""
    tf = ClipTransform(16, (0.4, 0.45, 0.5), (0.2, 0.25, 0.3), crop_pct=0.8, crops=crops)
    raw = VideoClips([(str(twenty), 1)], 3, stride=2, segments=2)[0]
    assert raw[0].dtype == torch.uint8 and raw[0].shape == (6, 3, 20, 26) and raw[1] == 1  # [K * T, C, H, W]
    assert frame_ids(raw[0]) == [2, 4, 6, 12, 14, 16]
    x, label = VideoClips([(str(twenty), 1)], 3, stride=2, transform=tf, segments=2)[0]
    assert x.shape == ((3, 6, 16, 16) if crops == 1 else (3, 3, 6, 16, 16)) and label == 1
    torch.testing.assert_close(x, by_hand(twenty, [2, 12], 3, 2, tf), rtol=0, atol=0)
    files = VideoFileClips([twenty], (3, 2, 1), tf, grey=False, segments=2)[0]  # predict.py's: [V, C, T', ...]
    assert files[2] is None and torch.equal(files[1], x if crops > 1 else x[None])


@needs_av
def test_training_segments_are_drawn_in_their_parts_and_transformed_one_by_one(twenty):
    """Training: each sample's 2 clips drawn afresh in parts [0, 10) and [10, 20) (starts 0 .. 5 and 10 .. 15),
    each clip through the transform on its own (its own crop and flip), joined: [C, K T, H, W]."""
    seen: list[list[int]] = []

    def record(clip: torch.Tensor) -> torch.Tensor:  # uint8 [T, C, H, W] -> float [C, T, H, W]
        seen.append(frame_ids(clip))
        return clip.permute(1, 0, 2, 3).float()

    ds = VideoClips([(str(twenty), 0)], 3, stride=2, sampling="random", transform=record, segments=2)
    torch.manual_seed(0)
    for _ in range(20):
        seen.clear()
        x = ds[0][0]
        assert x.shape == (3, 6, 20, 26) and len(seen) == 2  # one call per segment's clip
        (a, *_), (b, *_) = seen
        assert seen == [[a, a + 2, a + 4], [b, b + 2, b + 4]] and 0 <= a <= 5 and 10 <= b <= 15
        assert frame_ids(x.permute(1, 0, 2, 3).to(torch.uint8)) == seen[0] + seen[1]  # segment 0 first
    raw = VideoClips([(str(twenty), 0)], 3, stride=2, sampling="random", segments=2)  # uint8 [K * T, C, H, W]
    pairs = {tuple(frame_ids(raw[0][0])[::3]) for _ in range(40)}  # (each clip's first frame)
    assert len({a for a, _ in pairs}) > 3 and len({b for _, b in pairs}) > 3  # fresh draws
    assert any(b - 10 != a for a, b in pairs)  # each clip its own offset in its part
    tf = ClipTransform(12, (0.5,) * 3, (0.25,) * 3, train=True, scale=(0.1, 0.3), hflip=0.5)
    x = VideoClips([(str(twenty), 0)], 3, stride=2, sampling="random", transform=tf, segments=2)[0][0]
    assert x.shape == (3, 6, 12, 12) and x.dtype == torch.float32


def test_segments_refuse_clips_per_video(tmp_path):
    with pytest.raises(ValueError, match=r"data\.num_segments=2 .* data\.clips_per_video=1 \(got 3\)"):
        VideoClips([], 4, clips_per_video=3, segments=2)
    with pytest.raises(ValueError, match=r"data\.num_segments=4 .* data\.clips_per_video=1 \(got 2\)"):
        VideoFolderDataModule(root=tmp_path, num_segments=4, clips_per_video=2)
    with pytest.raises(ValueError, match="data.num_segments must be an integer >= 1, got 0"):
        VideoFolderDataModule(root=tmp_path, num_segments=0)
    with pytest.raises(ValueError, match="data.num_segments=2"):
        VideoFileClips([], (4, 1, 2), None, grey=False, segments=2)


@needs_av
def test_video_folder_config_with_segments(tmp_path):
    """data=video_folder data.num_segments=2 as train.py composes it: input_size and batches hold K * T frames."""
    for split in ("train", "val"):
        for cls in ("a", "b"):
            write_video(tmp_path / split / cls / "v.avi", 12, "ffv1", "yuv420p", hw=(16, 20))
    cfg = data_config("video_folder", root=tmp_path, num_frames=2, stride=2, num_segments=2, img_size=16)
    cfg.num_workers, cfg.pin_memory, cfg.batch_size = 0, False, 2
    dm = instantiate(cfg)
    assert dm.num_segments == 2 and dm.num_frames == 2 and dm.input_size == (3, 4, 16, 16)
    assert "num_segments=2" in repr(dm)
    x, _ = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 4, 16, 16)
    xs = torch.cat([b[0] for b in dm.val_dataloader()])
    assert xs.shape == (2, 3, 4, 16, 16)
    one = instantiate(data_config("video_folder", root=tmp_path, num_frames=2, img_size=16))
    assert one.num_segments == 1 and one.input_size == (3, 2, 16, 16)
