"""The video DataModules' shared part: :class:`VideoDataModule`, the image contract of
:class:`vitrel.data.base.VisionDataModule` for clips.

What changes from images:

* samples are float ``[C, T, H, W]`` clips (batches ``[B, C, T, H, W]``, VideoMAE's layout); ``num_frames``
  (``T``) joins ``img_size`` as a public attribute, and ``input_size`` is ``(C, T, H, W)``; an evaluation sample
  of a module taking ``K > 1`` clips per video is the video's clips ``[K, C, T, H, W]`` (batches
  ``[B, K, C, T, H, W]``, scored per video by :class:`~vitrel.train.module.ClassifierModule`); a module reading
  ``num_segments = G > 1`` clips a sample (one from each of ``G`` parts of the video, V-JEPA 2's protocol) joins
  them along time, ``[C, G * T, H, W]``, and its ``input_size`` is ``(C, G * T, H, W)`` (``num_frames`` stays ``T``);
* the per-clip pipeline is :class:`vitrel.data.video.transforms.ClipTransform`: training with ``augment`` a random
  resized crop and flip drawn once per clip (``augment_kwargs``: ``scale``, ``ratio``, ``hflip``; RandAugment and
  random erasing with ``auto_augment``, ``re_prob``, ``re_mode``, ``re_count``), evaluation a
  resize of the shorter side to ``floor(img_size / crop_pct)`` and the centre crop, both normalised;
* clips stream through ``DataLoader`` workers (``loader="workers"``); the image-only options (``canvas_size``,
  ``packing``, ``size_choices``, the memory loader) are refused;
* ``make_dataset(split, img_size=None, transform=None, num_frames=None)`` also takes another clip length
  (evaluation at ``2T`` or ``4T``).

The rest is the image modules' (``batch_size``, ``num_workers``, ``seed``, ``val_fraction``, ``train_order_seed``,
the loaders). Subclasses implement ``_locate()``, ``_load_raw(split)`` (the split's videos) and ``_clips(videos,
transform, num_frames, training)`` (the data set of transformed clips over them).
:class:`VideoFilesDataModule` is that part for encoded files, a split's videos a list of ``(path, class index)``
decoded with PyAV (:class:`~vitrel.data.video.clips.VideoClips`): class folders
(:mod:`~vitrel.data.video.folder`) and list files (:mod:`~vitrel.data.video.lists`) build on it.
"""

from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset, Subset

from vitrel.data.base import VisionDataModule
from vitrel.data.datasets import ON_BAD_SAMPLE, SplitTooSmallError
from vitrel.data.normalisation import per_channel
from vitrel.data.unreadable import LeaveOutCollate
from vitrel.data.video.clips import RepeatsCollate, VideoClips
from vitrel.data.video.sampling import check_frame_sampling, check_segments
from vitrel.data.video.transforms import ClipTransform

__all__ = ["VideoDataModule", "VideoFilesDataModule", "AUGMENT_KEYS"]

#: the ``augment_kwargs`` a video module takes: the random resized crop's and the flip's, RandAugment's config
#: (``auto_augment``), random erasing's (``re_prob``, ``re_mode``, ``re_count``: :mod:`vitrel.data.video.augment`)
AUGMENT_KEYS = ("scale", "ratio", "hflip", "auto_augment", "re_prob", "re_mode", "re_count")
_IMAGE_ONLY = ("canvas_size", "packing", "size_choices")


class VideoDataModule(VisionDataModule):
    """Base class of the video DataModules (see the module docstring); ``num_frames``: frames per clip."""

    #: clips a sample joins along time (:class:`VideoFilesDataModule`'s ``num_segments``; 1: one clip a sample)
    num_segments = 1
    #: training views of each decoded clip (:class:`VideoFilesDataModule`'s ``clip_repeats``)
    clip_repeats = 1
    default_augment_kwargs = {
        "scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3), "hflip": 0.5, "auto_augment": None, "re_prob": 0.0,
        "re_mode": "const", "re_count": 1,
    }  # fmt: skip

    def __init__(self, num_frames: int = 16, **kwargs: Any) -> None:
        given = [k for k in _IMAGE_ONLY if kwargs.get(k) not in (None, False)]
        if given:
            raise ValueError(f"{', '.join(f'data.{k}' for k in given)}: image options; video data takes none")
        if kwargs.get("loader") not in (None, "workers"):
            raise ValueError(
                f"video clips stream through DataLoader workers: use loader=workers, got {kwargs['loader']!r}"
            )
        unknown = sorted(set(kwargs.get("augment_kwargs") or {}) - set(AUGMENT_KEYS))
        if unknown:
            raise ValueError(f"data.augment_kwargs {unknown}: a video module takes only {list(AUGMENT_KEYS)}")
        if int(num_frames) < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        super().__init__(**kwargs)
        self.num_frames = int(num_frames)

    @property
    def input_size(self) -> tuple[int, int, int, int]:  # type: ignore[override]
        """``(in_chans, num_segments * num_frames, img_size, img_size)``: the frames one model input holds."""
        return (self.in_chans, self.num_segments * self.num_frames, self.img_size, self.img_size)

    def _clip_transform(self, augment: bool, img_size: int | None, crops: int = 1) -> ClipTransform:
        kw = self.augment_kwargs
        return ClipTransform(
            img_size or self.img_size,
            self.mean,
            self.std,
            train=augment,
            scale=kw["scale"],
            ratio=kw["ratio"],
            hflip=kw["hflip"],
            auto_augment=kw["auto_augment"],
            re_prob=kw["re_prob"],
            re_mode=kw["re_mode"],
            re_count=kw["re_count"],
            interpolation=self.interpolation,
            crop_pct=self.crop_pct,
            crops=crops,
        )

    def train_transform(self, img_size: int | None = None) -> ClipTransform:
        """The training clips' pipeline (augmented when ``augment``; else resize and centre crop: one view, whatever
        ``spatial_crops`` the evaluation takes)."""
        return self._clip_transform(self.augment, img_size)

    def eval_transform(self, img_size: int | None = None) -> ClipTransform:
        """The evaluation clips' pipeline (resize, centre crop or ``spatial_crops`` crops, normalise)."""
        return self._clip_transform(False, img_size, crops=getattr(self, "spatial_crops", 1))

    def make_dataset(
        self,
        split: str,
        img_size: int | None = None,
        transform: Any = None,
        num_frames: int | None = None,
        training: bool = False,
        **image_kwargs: Any,
    ) -> Dataset:
        """``(clip [C, T, H, W], label)`` of ``split`` with the evaluation pipeline (the training one with
        ``training``), ``(clips [K, C, T, H, W], label)`` for a module evaluating ``K > 1`` clips per video;
        ``num_frames`` (default this module's) sets ``T``, ``transform`` replaces the pipeline (it receives each
        uint8 clip ``[T, C, H, W]``)."""
        if any(v is not None for v in image_kwargs.values()):
            raise ValueError(f"{sorted(image_kwargs)}: image options; video data takes none")
        if num_frames is not None and num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        ds, idx = self._source(split)
        if idx is not None:
            ds = Subset(ds, idx.tolist())
        if transform is None:
            transform = self.train_transform(img_size) if training else self.eval_transform(img_size)
        return self._clips(ds, transform, int(num_frames or self.num_frames), training)

    def _clips(self, videos: Dataset, transform: Any, num_frames: int, training: bool) -> Dataset:
        """The data set of ``(transform(clip), label)`` over the split's ``videos`` (``_load_raw``'s items), one
        sample per video (its clips stacked when it has several)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        for split in self._missing_splits(stage):
            self._datasets[split] = self.make_dataset(split, training=split == "train")
            if split == "train":
                self._check_train_batches()

    def _check_train_batches(self) -> None:
        """Refuse a training split that ``drop_last`` leaves without a batch (fewer clips a rank than
        ``batch_size``, or videos than ``batch_size / clip_repeats``), before a step is counted: a tiny folder with
        data=video_folder's ``batch_size`` 8."""
        n, world = len(self._datasets["train"]), self._ranks()[0]  # type: ignore[arg-type]
        per_rank, r = -(-n // world), self.clip_repeats
        if self.drop_last and per_rank < self.train_batch_size:
            ranks = f" over {world} ranks ({per_rank} a rank)" if world > 1 else ""
            views = f" ({self.train_batch_size} videos x data.clip_repeats={r})" if r > 1 else ""
            raise SplitTooSmallError(
                f"data.batch_size={self.batch_size}{views} but the training split has {n} clips{ranks}, and "
                f"data.drop_last=true drops the incomplete batch: no training step is left. Set data.batch_size to "
                f"at most {per_rank * r}, or data.drop_last=false"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={self.root}, num_classes={self.num_classes}, input_size={self.input_size}, "
            + (f"num_segments={self.num_segments}, " if self.num_segments > 1 else "")
            + f"augment={self.augment}, batch_size={self.batch_size}, val_fraction={self.val_fraction})"
        )

    __str__ = __repr__


class VideoFilesDataModule(VideoDataModule):
    """The video modules over encoded files: ``_load_raw(split)`` gives the split's ``(path, class index)`` pairs,
    decoded by :class:`~vitrel.data.video.clips.VideoClips` (training one random clip per video, evaluation
    ``clips_per_video`` evenly spaced ones).

    ``num_frames`` frames per clip, ``stride`` frames apart; ``clips_per_video`` evaluation clips per video, each in
    ``spatial_crops`` crops along the longer side of its frames (one sample ``[K * S, C, T, H, W]`` of its views
    when more than one, :class:`~vitrel.data.video.transforms.ClipTransform`); ``num_segments = G > 1``
    (``clips_per_video`` 1): every sample, training's and evaluation's, is ``G`` clips, one from each of ``G`` equal
    parts of the video, each transformed alone, joined along time, ``[C, G * T, H, W]`` (``[S, C, G * T, H, W]``
    with ``S`` spatial crops; :func:`~vitrel.data.video.sampling.segment_starts`); ``frame_sampling="spread"``
    (``stride`` 1): each clip's frames one from each of ``num_frames`` parts of the video instead,
    ``clips_per_video`` views of them in evaluation (:func:`~vitrel.data.video.sampling.spread_indices`, VideoMAE's
    SSv2 sampling); ``on_bad_sample``: ``"raise"`` or ``"skip"`` a video that does not decode; ``in_chans``: 3 (RGB)
    or 1 (grey frames, made as predict.py makes them: PIL's ``convert("L")``; ImageNet's statistics averaged);
    ``num_classes``: kept as ``_given_num_classes`` (the subclass checks it against its data). Normalisation: timm's
    ImageNet mean and std (as VideoMAE's). Other kwargs as :class:`VideoDataModule`.
    """

    native_size = 224
    fixed_size = False

    def __init__(
        self,
        root: Any = None,
        num_classes: int | None = None,
        num_frames: int = 16,
        stride: int = 4,
        clips_per_video: int = 1,
        on_bad_sample: str = "raise",
        in_chans: int = 3,
        spatial_crops: int = 1,
        num_segments: int = 1,
        clip_repeats: int = 1,
        frame_sampling: str = "stride",
        **kwargs: Any,
    ) -> None:
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 (grey frames) or 3 (RGB), got {in_chans}")
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f"on_bad_sample must be one of {ON_BAD_SAMPLE}, got {on_bad_sample!r}")
        if int(stride) < 1 or int(clips_per_video) < 1 or int(spatial_crops) < 1:
            raise ValueError(
                f"stride, clips_per_video and spatial_crops must be >= 1, got {stride}, {clips_per_video}, "
                f"{spatial_crops}"
            )
        num_segments = check_segments(num_segments, int(clips_per_video))  # (an int >= 1; > 1 with one clip a video)
        check_frame_sampling(frame_sampling, int(stride), num_segments)
        super().__init__(root=root, num_frames=num_frames, **kwargs)
        if isinstance(clip_repeats, bool) or int(clip_repeats) < 1 or self.batch_size % int(clip_repeats):
            raise ValueError(
                f"data.clip_repeats={clip_repeats} must be an integer >= 1 that divides data.batch_size="
                f"{self.batch_size}: a training batch is batch_size / clip_repeats videos, each in clip_repeats views"
            )
        self.clip_repeats = int(clip_repeats)
        self.stride, self.clips_per_video = int(stride), int(clips_per_video)
        self.spatial_crops, self.num_segments = int(spatial_crops), num_segments
        self.frame_sampling = frame_sampling
        self.on_bad_sample = on_bad_sample
        self._given_num_classes = num_classes
        self.in_chans = int(in_chans)
        self.mean = per_channel(IMAGENET_DEFAULT_MEAN, self.in_chans)
        self.std = per_channel(IMAGENET_DEFAULT_STD, self.in_chans)

    def _clips(self, videos: Dataset, transform: Any, num_frames: int, training: bool) -> Dataset:
        return VideoClips(
            videos,
            num_frames,
            stride=self.stride,
            sampling="random" if training else "uniform",
            clips_per_video=1 if training else self.clips_per_video,
            transform=transform,
            on_bad_sample=self.on_bad_sample,
            leave_out=not training,  # (evaluation: each video that decodes scored once, the others left out)
            grey=self.in_chans == 1,
            segments=self.num_segments,
            repeats=self.clip_repeats if training else 1,
            frame_sampling=self.frame_sampling,
        )

    @property
    def train_batch_size(self) -> int:
        """The videos of a training batch: ``batch_size / clip_repeats``."""
        return self.batch_size // self.clip_repeats

    @property
    def train_collate_fn(self) -> Any:
        """The training collate, each video's ``clip_repeats`` views as that many samples
        (:class:`~vitrel.data.video.clips.RepeatsCollate`)."""
        collate = self.collate_fn
        return RepeatsCollate(self.clip_repeats, collate) if self.clip_repeats > 1 else collate

    @property
    def collate_fn(self) -> Any:
        """The base collate, dropping the videos an evaluation split left out (``on_bad_sample="skip"``)."""
        collate = super().collate_fn
        return LeaveOutCollate(collate) if self.on_bad_sample == "skip" else collate
