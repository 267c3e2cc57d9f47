"""Video data: class folders of encoded clips decoded with PyAV (:mod:`~vitrel.data.video.folder`), list files
naming them ("path label" lists, Something-Something v2's annotations: :mod:`~vitrel.data.video.lists`), the
frames a clip takes (:mod:`~vitrel.data.video.sampling`), decoding them (:mod:`~vitrel.data.video.clips`), the
per-clip transforms and augmentations
(:mod:`~vitrel.data.video.transforms`, :mod:`~vitrel.data.video.augment`), and the DataModule contract the video
modules share (:mod:`~vitrel.data.video.base`). Moving Fashion-MNIST is :mod:`vitrel.data.moving_fmnist`.
"""

from __future__ import annotations

from vitrel.data.video.augment import ClipRandAugment, CubeErasing
from vitrel.data.video.base import VideoDataModule
from vitrel.data.video.clips import VideoClips, VideoDecodeError, read_clip
from vitrel.data.video.folder import VIDEO_EXTENSIONS, VideoFolderDataModule, video_files
from vitrel.data.video.lists import VideoListDataModule, VideoListError
from vitrel.data.video.sampling import clip_indices, random_start, segment_starts, spread_indices, uniform_starts
from vitrel.data.video.transforms import ClipTransform

__all__ = [
    "VIDEO_EXTENSIONS",
    "ClipRandAugment",
    "ClipTransform",
    "CubeErasing",
    "VideoClips",
    "VideoDataModule",
    "VideoDecodeError",
    "VideoFolderDataModule",
    "VideoListDataModule",
    "VideoListError",
    "clip_indices",
    "random_start",
    "read_clip",
    "segment_starts",
    "spread_indices",
    "uniform_starts",
    "video_files",
]
