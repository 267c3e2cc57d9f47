"""Which frames of a video a clip takes: clips ``stride`` frames apart, clips spread over the video, segments.

A video of ``N`` decoded frames gives clips of ``T = num_frames`` frames ``stride`` frames apart,
spanning ``span = (T - 1) * stride + 1`` frames. A clip starting at frame ``s`` takes the frames::

    index_t = min(s + t * stride, N - 1),   t = 0 .. T-1

so a video shorter than the span is padded by repeating its last frame (as V-JEPA 2's loader does; torchvision's
``VideoClips`` drops such videos instead; :func:`warn_short_video` names one of fewer than ``span / 2`` frames).
With ``delta = max(N - span, 0)``:

* ``uniform`` (evaluation): ``K = clips_per_video`` clips with evenly spaced starts ``s_k = floor(k * delta / (K - 1))``
  (the first clip at the start, the last at the end), or the centre ``s = floor(delta / 2)`` when ``K = 1``
  (SlowFast's and PyTorchVideo's constant-clips-per-video sampling);
* ``random`` (training): one start per sample drawn uniformly from ``0 .. delta`` with torch's random generator
  of the process that loads it, as the image pipelines' random crops are: seeded from ``(seed, epoch, video index)``
  under ``train.py``'s exact resume (:class:`~vitrel.data.video.clips.VideoClips` takes the keyed sampler's
  ``SampleKey``), else per worker and per epoch by torch (and Lightning's ``seed_everything(workers=True)``).

Spread frames (``frame_sampling="spread"``, TSN's sampling; VideoMAE's Something-Something v2 clips, their
``ssv2.py``): a clip's ``T`` frames are one from each of ``T`` equal parts of the whole video instead of ``stride``
apart (:func:`spread_indices`): random within each part in training, at fixed places in evaluation.

Segments (``num_segments = K > 1``, V-JEPA 2's evaluation protocol, TSN's segments): a sample is ``K`` clips, one
from each of ``K`` equal parts of the video (:func:`segment_starts`), each transformed on its own, joined along time
(:func:`~vitrel.data.video.clips.stack_views`); the model encodes each alone and pools their tokens together;
``clips_per_video`` is then 1.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import Generator

__all__ = [
    "SAMPLINGS",
    "FRAME_SAMPLINGS",
    "clip_span",
    "clip_indices",
    "uniform_starts",
    "random_start",
    "segment_starts",
    "sample_starts",
    "spread_indices",
    "warn_short_video",
    "check_segments",
    "check_frame_sampling",
]

#: where a video's clips start: evenly spaced (evaluation) or drawn (training)
SAMPLINGS = ("uniform", "random")
#: how a clip's frames are spread: ``stride`` frames apart, or one from each of ``num_frames`` parts of the video
FRAME_SAMPLINGS = ("stride", "spread")

log = logging.getLogger(__name__)


def _check_clip(num_frames: int, stride: int) -> None:
    if num_frames < 1 or stride < 1:
        raise ValueError(f"num_frames and stride must be >= 1, got num_frames={num_frames}, stride={stride}")


def clip_span(num_frames: int, stride: int) -> int:
    """Frames a clip spans: ``(num_frames - 1) * stride + 1``."""
    _check_clip(num_frames, stride)
    return (num_frames - 1) * stride + 1


def clip_indices(video_frames: int, num_frames: int, stride: int, start: int) -> np.ndarray:
    """The frame indices of the clip starting at ``start``: ``min(start + t * stride, video_frames - 1)``."""
    _check_clip(num_frames, stride)
    if video_frames < 1 or not 0 <= start < video_frames:
        raise ValueError(f"start={start} is not a frame of a video of {video_frames} frames")
    return np.minimum(start + stride * np.arange(num_frames), video_frames - 1)


def uniform_starts(video_frames: int, num_frames: int, stride: int, clips: int) -> list[int]:
    """Starts of ``clips`` evenly spaced clips (see the module docstring)."""
    if clips < 1:
        raise ValueError(f"clips_per_video must be >= 1, got {clips}")
    delta = max(video_frames - clip_span(num_frames, stride), 0)
    if clips == 1:
        return [delta // 2]
    return [k * delta // (clips - 1) for k in range(clips)]


def random_start(video_frames: int, num_frames: int, stride: int, generator: torch.Generator | None = None) -> int:
    """A start drawn uniformly from ``0 .. max(video_frames - span, 0)`` (torch's generator, or ``generator``)."""
    delta = max(video_frames - clip_span(num_frames, stride), 0)
    return int(torch.randint(delta + 1, (), generator=generator))


def segment_starts(
    video_frames: int, num_frames: int, stride: int, segments: int, train: bool, generator: Generator | None = None
) -> list[int]:
    """The starts of ``K = segments`` clips, one from each of ``K`` equal parts of a video of ``N = video_frames``
    frames: part ``i`` is the frames ``i P .. (i + 1) P - 1``, ``P = N // K`` (the last ``N - K P`` in none, as
    V-JEPA 2's ``loadvideo_decord``). With ``span = (num_frames - 1) * stride + 1`` (:func:`clip_span`):

    * ``P >= span``: ``s_i = i P + o_i``, ``o_i`` drawn uniformly from ``0 .. P - span`` for each clip when ``train``
      (torch's generator, or ``generator``, as :func:`random_start`), else the centre ``o_i = floor((P - span) / 2)``
      (a deterministic evaluation; V-JEPA 2 draws ``o_i`` at evaluation too);
    * ``P < span`` (V-JEPA 2's ``allow_clip_overlap=True``, as its evaluation): overlapping clips evenly spread over
      the video, ``uniform_starts(N, num_frames, stride, K)`` (the first at 0, the last at the end), train or not.

    ``K = 1``: :func:`random_start` when ``train``, else ``uniform_starts(N, num_frames, stride, 1)``, as without
    segments. ``K`` below 1 raises ``ValueError`` naming ``num_segments``.
    """
    if isinstance(segments, bool) or not isinstance(segments, (int, np.integer)) or segments < 1:
        raise ValueError(f"num_segments must be an integer >= 1, got {segments!r}")
    if segments == 1 and train:  # (evaluation's K = 1 is the equation's: the centre, or 0 for a short video)
        return [random_start(video_frames, num_frames, stride, generator)]
    span, part = clip_span(num_frames, stride), video_frames // segments
    if part < span:
        return uniform_starts(video_frames, num_frames, stride, segments)
    if not train:
        return [i * part + (part - span) // 2 for i in range(segments)]
    return [i * part + int(torch.randint(part - span + 1, (), generator=generator)) for i in range(segments)]


def sample_starts(video_frames: int, num_frames: int, stride: int, clips: int, segments: int, train: bool) -> list[int]:
    """A sample's clip starts: ``clips > 1`` evenly spaced ones (:func:`uniform_starts`), else one from each of the
    ``segments`` parts (:func:`segment_starts`; one segment: the one clip, drawn when ``train``)."""
    if clips > 1:
        return uniform_starts(video_frames, num_frames, stride, clips)
    return segment_starts(video_frames, num_frames, stride, segments, train)


def spread_indices(
    video_frames: int, num_frames: int, views: int, train: bool, generator: Generator | None = None
) -> list[np.ndarray]:
    """The frames of a video's clips under ``frame_sampling="spread"``: each of ``T = num_frames`` frames from its own
    of ``T`` equal parts of the video (TSN's segments, one frame each), ``views`` clips (one when ``train``).

    * ``train`` (one clip): frame ``t`` is ``t P + o_t``, ``P = N // T`` (``N = video_frames``), ``o_t`` drawn
      uniformly from ``0 .. P - 1`` for each frame (torch's generator, or ``generator``), as VideoMAE's
      ``SSVideoClsDataset.loadvideo_decord`` in training (the last ``N - T P`` frames in no part);
    * evaluation, view ``k`` of ``K = views``: frame ``t`` is ``floor(N (t K + k) / (T K))``, the frame ``k / K`` of
      the way into part ``t`` of ``N / T`` frames: view 0 the parts' first frames; with ``K = 2`` view 1 their middle
      ones: VideoMAE's test views (``test_num_segment 2``: ``int(tick * t)`` and ``int(tick / 2 + tick * t)``).

    A video of fewer than ``T`` frames (``P = 0``) repeats frames: evaluation's view 0, ``floor(t N / T)``, in training
    too (VideoMAE's code takes frame 0 for every ``t`` there).
    """
    if isinstance(views, bool) or views < 1 or (train and views != 1):
        raise ValueError(f"views must be >= 1 (1 in training), got {views!r}")
    if video_frames < 1 or num_frames < 1:
        raise ValueError(f"video_frames and num_frames must be >= 1, got {video_frames}, {num_frames}")
    n, t = int(video_frames), np.arange(num_frames)
    part = n // num_frames
    if train and part > 0:
        return [t * part + torch.randint(part, (num_frames,), generator=generator).numpy()]
    return [(n * (t * views + k)) // (num_frames * views) for k in range(1 if train else views)]


def warn_short_video(path: str | Path, video_frames: int, num_frames: int, stride: int) -> bool:
    """Whether video ``path`` of ``video_frames`` frames has fewer than half the frames a clip spans
    (:func:`clip_span`); if so, one warning names it: its clips are mostly its last frame repeated."""
    span = clip_span(num_frames, stride)
    if 2 * video_frames >= span:
        return False
    log.warning(
        "%s has %d frame(s), fewer than half the %d a clip of %d frames %d apart spans: its clips repeat its last "
        "frame (data.num_frames, data.stride)",
        path,
        video_frames,
        span,
        num_frames,
        stride,
    )
    return True


def check_segments(segments: int, clips_per_video: int) -> int:
    """``segments`` (an integer >= 1; above 1 only with one clip per video), else ``ValueError`` naming the keys."""
    if isinstance(segments, bool) or not isinstance(segments, (int, np.integer)) or segments < 1:
        raise ValueError(f"data.num_segments must be an integer >= 1, got {segments!r}")
    if segments > 1 and clips_per_video != 1:
        raise ValueError(
            f"data.num_segments={segments} makes each video one sample of its {segments} segments' clips: give data."
            f"clips_per_video=1 (got {clips_per_video}), or data.num_segments=1 for {clips_per_video} clips a video"
        )
    return int(segments)


def check_frame_sampling(frame_sampling: str, stride: int, segments: int) -> bool:
    """Whether ``frame_sampling`` (one of :data:`FRAME_SAMPLINGS`) spreads a clip's frames over the video;
    ``ValueError`` naming the data keys for another value, or ``"spread"`` with a ``stride`` above 1 or segments."""
    if frame_sampling not in FRAME_SAMPLINGS:
        raise ValueError(f"data.frame_sampling must be one of {FRAME_SAMPLINGS}, got {frame_sampling!r}")
    wrong = [f"data.{k}={v}" for k, v in (("stride", int(stride)), ("num_segments", segments)) if v != 1]
    if frame_sampling == "spread" and wrong:
        raise ValueError(
            f"data.frame_sampling=spread places a clip's frames itself (one in each of num_frames parts of the video), "
            f"so {' and '.join(wrong)} has no meaning with it: set "
            f"{' and '.join(w.split('=')[0] + '=1' for w in wrong)}"
        )
    return frame_sampling == "spread"
