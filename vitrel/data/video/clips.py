"""Clips of encoded videos: reading the frames a clip takes with PyAV, a video's clips as a sample.

Which frames a clip takes is :mod:`vitrel.data.video.sampling`'s (clips ``stride`` frames apart, spread over the
video, or one from each segment).

Decoding: PyAV (FFmpeg's libraries, bundled in its wheels: ``pip install av``, nothing else on the system), of
the video stream libavformat picks (``av_find_best_stream``, as ffplay: not a cover or preview still stored before
the video, which a file's first video stream can be; an audio file whose only video stream is its cover art is
refused). The frame count ``N`` is the container's
(``stream.frames``), or, where the container states none (WebM, Matroska), the number of video packets; the
frames are decoded from the start of the file up to the clip's last one (no seeking: fine for clips of seconds, as
UCF-101's and Kinetics', slow for long videos). A stream that ends before
the stated count is sampled again from the frames that decoded, with a warning naming the file. Each frame is turned
upright by its display matrix (phones' portrait video: :func:`upright`), as players show it, and converted to RGB on
one thread (FFmpeg's automatic count was 1.5 to 12 times slower here, bench/results/video_convert_cpu.md, and left
threads that a forked DataLoader worker could hang freeing). A file that cannot be opened or decoded, that holds no
video stream, or whose clip's frames differ in size (a WebM may change size mid-stream) raises
:class:`VideoDecodeError` naming it.

Transforms: a clip is read as a uint8 ``[T, C, H, W]`` tensor (torchvision's ``TCHW``); the per-clip transforms
(:mod:`vitrel.data.video.transforms`) give the model's float ``[C, T, H, W]``.
DataLoader workers: a worker forked from a process that had decoded video (a clip looked at before training, an
error kept with its traceback) inherits PyAV objects waiting for the garbage collector; they own FFmpeg threads that
do not exist in the fork, so collecting one there waits forever. The data sets here call :func:`leave_inherited` on
their first sample in each worker, which freezes what the worker inherited (``gc.freeze()``, Python's advice for
forked children).
:class:`VideoClips` gives one sample per video: with ``K > 1`` uniform clips, the ``K`` transformed clips stacked,
``[K, C, T, H, W]`` (a batch ``[B, K, C, T, H, W]``, scored per video by averaging its clips' softmax).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, get_worker_info

from vitrel.data.datasets import BadSampleError
from vitrel.data.transforms import SampleKey, seeded_draws
from vitrel.data.unreadable import SKIP_HINT, SkipUnreadable
from vitrel.data.video.sampling import (
    SAMPLINGS,
    check_frame_sampling,
    check_segments,
    clip_indices,
    clip_span,
    sample_starts,
    spread_indices,
    warn_short_video,
)

__all__ = [
    "VideoDecodeError",
    "VideoFileClips",
    "stack_views",
    "count_frames",
    "read_frames",
    "read_clip",
    "leave_inherited",
    "VideoClips",
    "RepeatsCollate",
]


class VideoDecodeError(BadSampleError):
    """A video file could not be read: not a video, damaged, or without a video stream. ``path`` is the file,
    ``reason`` what went wrong.

    A data set error (``train.py`` and ``eval.py`` print its message alone). Raised in a DataLoader worker, it is
    rebuilt in the main process by torch from its text alone (``VideoDecodeError(text)``, the worker's traceback
    ending with this error's line): it keeps that line as its message (``path`` and ``reason`` are then None).
    """

    def __init__(self, path: str | Path, reason: str | None = None) -> None:
        self.reason = reason
        if reason is None:  # torch re-raising a worker's error (BadSampleError keeps its last line)
            self.path = None
            super().__init__(str(path))
            return
        self.path = str(path)
        super().__init__(f"cannot read video {self.path}: {reason}")


# ---------------------------------------------------------------------------------------------- decoding
_LEFT_IN: int | None = None  # (the worker process whose inherited objects are frozen)


def leave_inherited() -> None:
    """In a DataLoader worker, once per process: ``gc.freeze()``, so its garbage collector never frees what the
    worker inherited from the process it was forked from (see above). Elsewhere nothing."""
    global _LEFT_IN
    if _LEFT_IN != os.getpid() and get_worker_info() is not None:
        gc.freeze()
        _LEFT_IN = os.getpid()


def _open(path: str | Path):
    import av

    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError) as e:
        raise VideoDecodeError(path, str(e)) from e
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        container.close()
        raise VideoDecodeError(path, f"it has no video stream (streams: {', '.join(kinds)})")
    # libavformat's choice (av_find_best_stream, as ffplay's), not the first: a file may hold a cover or preview
    # still before its video (a Matroska track, an MP4 attached picture)
    stream = container.streams.best("video")
    if stream.disposition & av.stream.Disposition.attached_pic:  # (libavformat picks a real video over such a still)
        container.close()
        raise VideoDecodeError(path, "it holds no video, only an attached picture (an audio file's cover art)")
    stream.thread_type = "AUTO"
    return container, stream


def count_frames(path: str | Path) -> int:
    """Frames of the video stream (the one ffmpeg picks): the container's count, else the number of its packets
    (see above)."""
    import av

    container, stream = _open(path)
    try:
        n = int(stream.frames or 0)
        if n == 0:
            n = sum(1 for packet in container.demux(stream) if packet.size)
    except av.error.FFmpegError as e:
        raise VideoDecodeError(path, str(e)) from e
    finally:
        container.close()
    if n == 0:
        raise VideoDecodeError(path, "its video stream has no frames")
    return n


def upright(frame: Any, image: np.ndarray, path: str | Path) -> np.ndarray:
    """``image`` (``frame`` as ``[H, W, C]``) turned as its display matrix says, as players and ffmpeg show it.

    Phones store portrait video as landscape frames with a matrix (``ffprobe``: "displaymatrix: rotation of -90.00
    degrees"). The matrix ``[[a, b], [c, d]]`` maps a pixel at column ``p``, row ``q`` to ``(a p + c q, b p + d q)``
    (``libavutil/display.h``): a quarter turn or a flip, ffmpeg's ``transpose`` / ``hflip`` / ``vflip``. A matrix
    that is neither (a turn by another angle) raises :class:`VideoDecodeError` naming the file.
    """
    from av.sidedata.sidedata import Type

    side = frame.side_data.get(Type.DISPLAYMATRIX)
    if side is None:
        return image
    m = np.frombuffer(bytes(side), dtype=np.int32)[[0, 1, 3, 4]].astype(np.float64)
    if not m.any():  # a singular matrix (ffmpeg ignores it too)
        return image
    m /= np.abs(m).max()
    a, b, c, d = r = np.rint(m).astype(int)
    if np.abs(m - r).max() < 1e-3:
        if a and d and not b and not c:  # a flip (or none): p' = a p, q' = d q
            return image[::d, ::a]
        if b and c and not a and not d:  # a quarter turn: p' = c q, q' = b p, the image transposed then flipped
            return image.transpose(1, 0, 2)[::b, ::c]
    angle = float(np.degrees(np.arctan2(m[1], m[0])))
    raise VideoDecodeError(path, f"its display matrix turns it by {-angle:.1f} degrees, not a quarter turn or a flip")


def read_frames(path: str | Path, indices: Sequence[int]) -> tuple[Tensor | None, int]:
    """Decode the frames ``indices`` (any order, repeats allowed) as uint8 RGB ``[len(indices), 3, H, W]``, each
    turned upright by its display matrix (:func:`upright`).

    Returns ``(frames, decoded)``: ``frames`` is None when the stream ended before ``max(indices)``; ``decoded`` is
    the number of frames decoded (all of them when it ended early).
    """
    import av

    wanted = set(int(i) for i in indices)
    last = max(wanted)
    got: dict[int, np.ndarray] = {}
    container, stream = _open(path)
    decoded = 0
    try:
        for i, frame in enumerate(container.decode(stream)):
            decoded = i + 1
            if i in wanted:
                got[i] = upright(frame, frame.to_ndarray(format="rgb24", threads=1), path)  # [H, W, 3]
            if i == last:
                break
    except av.error.FFmpegError as e:
        raise VideoDecodeError(path, f"decoding frame {decoded} failed: {e}") from e
    finally:
        container.close()
    if last not in got:
        return None, decoded
    _check_one_size(path, got)
    frames = torch.from_numpy(np.stack([got[int(i)] for i in indices]))  # [T, H, W, 3]
    return frames.permute(0, 3, 1, 2).contiguous(), decoded


def _check_one_size(path: str | Path, images: dict[int, np.ndarray]) -> None:
    """Raise :class:`VideoDecodeError` when the frames ``images`` (frame index -> ``[H, W, 3]``) differ in size."""
    sizes = {i: image.shape[:2] for i, image in sorted(images.items())}
    first, *_ = sizes.items()
    other = next(((i, hw) for i, hw in sizes.items() if hw != first[1]), None)
    if other is None:
        return
    (i, (h, w)), (j, (h2, w2)) = first, other
    raise VideoDecodeError(
        path,
        f"its frames change size ({h}x{w} at frame {i}, {h2}x{w2} at frame {j}); re-encode it at one size, e.g. "
        f"ffmpeg -i {path} -vf scale={w}:{h} out.mp4",
    )


def read_clip(path: str | Path, choose: Callable[[int], Sequence[int]]) -> Tensor:
    """uint8 ``[T, 3, H, W]``: the frames ``choose(N)`` of the video (``N``: :func:`count_frames`).

    When the stream holds fewer frames than its container states, ``choose`` is called again with the number
    that decoded (a warning names the file).
    """
    n = count_frames(path)
    frames, decoded = read_frames(path, choose(n))
    if frames is None:
        if decoded == 0:
            raise VideoDecodeError(path, "no frame decodes")
        warnings.warn(
            f"{path}: the container states {n} frames but {decoded} decode; sampling from those", stacklevel=2
        )
        frames, _ = read_frames(path, choose(decoded))
        if frames is None:  # (the file changed between the two reads)
            raise VideoDecodeError(path, f"{decoded} frames decoded once, fewer the second time")
    return frames


def stack_views(clips: list[Tensor], segments: int = 1) -> Tensor:
    """A video's clips (each ``[C, T, H, W]``, or its spatial views ``[S, C, T, H, W]``) as one sample: the clip
    itself for one view, else every view ``[K * S, C, T, H, W]`` (clip-major: clip 0's views, then clip 1's); with
    ``segments > 1``, the segments' clips joined along time, ``[C, K * T, H, W]`` (``[S, C, K * T, H, W]``)."""
    if segments > 1:
        return torch.cat(clips, dim=-3)
    x = torch.stack(clips)
    x = x.flatten(0, 1) if clips[0].dim() == 5 else x
    return x[0] if x.shape[0] == 1 else x


class VideoClips(SkipUnreadable, Dataset):
    """The videos of ``videos`` (a data set of ``(path, label)``) -> ``(clips, label)``, one sample per video.

    ``sampling="uniform"``: the video's ``K = clips_per_video`` evenly spaced clips, each through ``transform``
    (it receives the uint8 ``[T, 3, H, W]`` clip, ``[T, 1, H, W]`` with ``grey``: made grey as predict.py makes
    them, PIL's ``convert("L")``; None: kept as it is), stacked: ``[K, C, T, H, W]`` (uint8 ``[K, T, C, H, W]``
    without a transform), or the one clip ``[C, T, H, W]`` when ``K = 1``. The ``K`` clips are decoded in one pass.
    ``sampling="random"``: one random clip, a fresh start each time the video is read.
    ``segments = K > 1`` (``clips_per_video`` 1): the video's ``K`` segment clips (:func:`sample_starts`), each
    through ``transform``, joined along time (:func:`stack_views`; uint8 ``[K * T, C, H, W]`` without a transform).
    ``frame_sampling="spread"`` (``stride`` 1, one segment): each clip's frames one from each of ``num_frames`` parts
    of the video (:func:`spread_indices`; ``clips_per_video`` views at their places in evaluation).
    ``repeats = R > 1`` (random sampling): the frames read once and the sample ``R`` times through ``transform``,
    stacked ``[R, ...]`` (VideoMAE's ``num_sample``: R augmented views of one decoded clip;
    :class:`RepeatsCollate` makes them ``R`` samples of a batch).

    A video that does not decode raises :class:`VideoDecodeError` naming it and ``data.on_bad_sample=skip``
    (``on_bad_sample="raise"``), or, with ``"skip"``, is logged by name and the next video that decodes, with its
    own label, is read in its place; with ``leave_out`` too (evaluation), the sample is ``None``, left out
    (:class:`~vitrel.data.unreadable.SkipUnreadable` counts them). A video with fewer than half the frames a clip
    spans is named in one warning (:func:`warn_short_video`; once per video, the DataLoader workers included).
    """

    noun = "video file"
    read_errors = (VideoDecodeError,)
    keyed_draws = True  # (a keyed EpochSampler's SampleKey: the draws of :func:`~vitrel.data.transforms.seeded_draws`)

    def __init__(
        self,
        videos: Dataset,
        num_frames: int,
        stride: int = 1,
        sampling: str = "uniform",
        clips_per_video: int = 1,
        transform: Callable[[Tensor], Any] | None = None,
        on_bad_sample: str = "raise",
        leave_out: bool = False,
        grey: bool = False,
        segments: int = 1,
        repeats: int = 1,
        frame_sampling: str = "stride",
    ) -> None:
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
        clip_span(num_frames, stride)  # (checks both)
        if clips_per_video < 1 or (sampling == "random" and clips_per_video != 1):
            raise ValueError(f"clips_per_video must be >= 1 (1 with random sampling), got {clips_per_video}")
        self.segments = check_segments(segments, clips_per_video)
        self.spread = check_frame_sampling(frame_sampling, stride, self.segments)
        if repeats < 1 or (repeats > 1 and (sampling != "random" or transform is None)):
            raise ValueError(f"repeats must be >= 1 (above 1: random sampling through a transform), got {repeats}")
        self.repeats = int(repeats)
        self.videos, self.num_frames, self.stride = videos, int(num_frames), int(stride)
        self.sampling, self.clips_per_video, self.transform = sampling, int(clips_per_video), transform
        self.grey = bool(grey)
        self.init_skips(on_bad_sample, leave_out)
        self._named_short = torch.zeros(len(self), dtype=torch.bool).share_memory_()  # (shared with the workers)

    def __len__(self) -> int:
        return len(self.videos)  # type: ignore[arg-type]

    def bad_reason(self, path: str, err: BaseException) -> str:
        return getattr(err, "reason", None) or str(err)

    def bad_sample_error(self, path: str, reason: str) -> Exception:
        return VideoDecodeError(path, f"{reason}; {SKIP_HINT}")

    def clip_starts(self, video_frames: int) -> list[int]:
        """The starts of the clips of a video of ``video_frames`` frames (a fresh draw when random)."""
        train = self.sampling == "random"
        return sample_starts(video_frames, self.num_frames, self.stride, self.clips_per_video, self.segments, train)

    def sample_path(self, index: int) -> str:
        return str(self.videos[index][0])

    def _read(self, index: int) -> tuple[Tensor, int]:
        """Video ``index``'s frames, uint8 ``[K * T, C, H, W]`` (``C`` 1 when ``grey``, else 3), and its label."""
        path, label = self.videos[index]

        def choose(n: int) -> list[int]:  # the clips' frames, one clip after the other
            if not self._named_short[index] and warn_short_video(path, n, self.num_frames, self.stride):
                self._named_short[index] = True
            if self.spread:
                train = self.sampling == "random"
                return [i for v in spread_indices(n, self.num_frames, self.clips_per_video, train) for i in v.tolist()]
            return [i for s in self.clip_starts(n) for i in clip_indices(n, self.num_frames, self.stride, s).tolist()]

        frames = read_clip(path, choose)
        return (_grey(frames) if self.grey else frames), int(label)

    def __getitem__(self, index: int | SampleKey) -> tuple[Any, int] | None:
        if isinstance(index, SampleKey):  # (training: the clip's draws from its key, the same after a resume)
            with seeded_draws(index.seed, index.epoch, index.index):
                return self._sample(index.index)
        return self._sample(index)

    def _sample(self, index: int) -> tuple[Any, int] | None:
        leave_inherited()
        item = self.read_or_skip(index, self._read)
        if item is None:  # (left out: evaluation)
            return None
        frames, label = item
        if self.transform is None and self.segments > 1:  # (the K * T frames as read)
            return frames, label
        views = []
        for _ in range(self.repeats):  # (the frames decoded once, each view augmented on its own)
            clips = [self.transform(c) if self.transform is not None else c for c in frames.split(self.num_frames)]
            views.append(stack_views(clips, self.segments))
        return (views[0] if self.repeats == 1 else torch.stack(views)), label


class RepeatsCollate:
    """``collate`` (default: torch's ``default_collate``) of samples of ``R`` views each (:class:`VideoClips`'
    ``repeats``): the batch ``[B, R, ...]`` as ``B * R`` samples, each label repeated ``R`` times."""

    def __init__(self, repeats: int, collate: Callable[[list], Any] | None = None) -> None:
        from torch.utils.data import default_collate

        self.repeats, self.collate = int(repeats), collate if collate is not None else default_collate

    def __call__(self, samples: list) -> Any:
        x, y = self.collate(samples)
        return x.flatten(0, 1), y.repeat_interleave(self.repeats)


def _grey(frames: Tensor) -> Tensor:
    """uint8 RGB ``[T, 3, H, W]`` -> ``[T, 1, H, W]`` by PIL's ``convert("L")``, as the image path converts."""
    from PIL import Image

    grey = [np.asarray(Image.fromarray(f.permute(1, 2, 0).numpy()).convert("L")) for f in frames]
    return torch.from_numpy(np.stack(grey))[:, None]


class VideoFileClips(Dataset):
    """``predict.py``'s videos: ``files[i]`` -> ``(i, clips [K, C, T, H, W], None)``, its ``K`` uniform clips
    (``sampling``: ``(num_frames, stride, K)``, :func:`uniform_starts`), decoded in one pass, each through
    ``transform`` (``grey``: converted to one channel first); a file that does not decode gives ``(i, None, reason)``
    (skipped and counted by predict's loop). A video far shorter than a clip is named in one warning
    (:func:`warn_short_video`, as in training and evaluation). ``segments`` above 1 (``K`` then 1): the video's
    segment clips joined along time (:func:`sample_starts`, :func:`stack_views`), ``[V, C, segments * T, H, W]``.
    ``frame_sampling="spread"``: the ``K`` views of :func:`spread_indices` (evaluation's)."""

    def __init__(
        self,
        files: Sequence[Path],
        sampling: tuple[int, int, int],
        transform: Any,
        grey: bool,
        *,
        segments: int = 1,
        frame_sampling: str = "stride",
    ) -> None:
        self.files, self.sampling, self.transform, self.grey = list(files), sampling, transform, grey
        self.segments = check_segments(segments, sampling[2])
        self.spread = check_frame_sampling(frame_sampling, sampling[1], self.segments)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[int, Tensor | None, str | None]:
        leave_inherited()
        t, stride, k = self.sampling

        def choose(n: int) -> list[int]:  # the K clips' (or segments') frames, one after the other
            warn_short_video(self.files[i], n, t, stride)
            if self.spread:
                return [j for v in spread_indices(n, t, k, train=False) for j in v.tolist()]
            starts = sample_starts(n, t, stride, k, self.segments, train=False)
            return [j for s in starts for j in clip_indices(n, t, stride, s).tolist()]

        try:
            frames = read_clip(self.files[i], choose)  # [K * T, 3, H, W]
        except VideoDecodeError as e:
            return i, None, str(e)
        if self.grey:
            frames = _grey(frames)
        views = stack_views([self.transform(clip) for clip in frames.split(t)], self.segments)
        return i, (views if views.dim() == 5 else views[None]), None
