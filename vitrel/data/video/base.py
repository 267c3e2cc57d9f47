"""The video DataModules' shared part: :class:`VideoDataModule`, the image contract of
:class:`vitrel.data.base.VisionDataModule` for clips.

What changes from images:

* samples are float ``[C, T, H, W]`` clips (batches ``[B, C, T, H, W]``, VideoMAE's layout); ``num_frames``
  (``T``) joins ``img_size`` as a public attribute, and ``input_size`` is ``(C, T, H, W)``; an evaluation sample
  of a module taking ``K > 1`` clips per video is the video's clips ``[K, C, T, H, W]`` (batches
  ``[B, K, C, T, H, W]``, scored per video by :class:`~vitrel.train.module.ClassifierModule`);
* the per-clip pipeline is :class:`vitrel.data.video.clips.ClipTransform`: training with ``augment`` a random
  resized crop and flip drawn once per clip (``augment_kwargs``: ``scale``, ``ratio``, ``hflip``), evaluation a
  resize of the shorter side to ``floor(img_size / crop_pct)`` and the centre crop, both normalised;
* clips stream through ``DataLoader`` workers (``loader="workers"``); the image-only options (``canvas_size``,
  ``packing``, ``size_choices``, the memory loader) are refused;
* ``make_dataset(split, img_size=None, transform=None, num_frames=None)`` also takes another clip length
  (evaluation at ``2T`` or ``4T``).

The rest is the image modules' (``batch_size``, ``num_workers``, ``seed``, ``val_fraction``, ``train_order_seed``,
the loaders). Subclasses implement ``_locate()``, ``_load_raw(split)`` (the split's videos) and ``_clips(videos,
transform, num_frames, training)`` (the data set of transformed clips over them).
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, Subset

from vitrel.data.base import VisionDataModule
from vitrel.data.video.clips import ClipTransform

__all__ = ["VideoDataModule", "AUGMENT_KEYS"]

#: the ``augment_kwargs`` a video module takes (the random resized crop's and the flip's)
AUGMENT_KEYS = ("scale", "ratio", "hflip")
_IMAGE_ONLY = ("canvas_size", "packing", "size_choices")


class VideoDataModule(VisionDataModule):
    """Base class of the video DataModules (see the module docstring); ``num_frames``: frames per clip."""

    default_augment_kwargs = {"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3), "hflip": 0.5}

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
        """``(in_chans, num_frames, img_size, img_size)``."""
        return (self.in_chans, self.num_frames, self.img_size, self.img_size)

    def _clip_transform(self, train: bool, img_size: int | None) -> ClipTransform:
        kw = self.augment_kwargs
        return ClipTransform(
            img_size or self.img_size,
            self.mean,
            self.std,
            train=train,
            scale=kw["scale"],
            ratio=kw["ratio"],
            hflip=kw["hflip"],
            interpolation=self.interpolation,
            crop_pct=self.crop_pct,
        )

    def train_transform(self, img_size: int | None = None) -> ClipTransform:
        """The training clips' pipeline (augmented when ``augment``)."""
        return self._clip_transform(self.augment, img_size)

    def eval_transform(self, img_size: int | None = None) -> ClipTransform:
        """The evaluation clips' pipeline (resize, centre crop, normalise)."""
        return self._clip_transform(False, img_size)

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
        ``batch_size``), before a step is counted: a tiny folder with data=video_folder's ``batch_size`` 8."""
        n, world = len(self._datasets["train"]), self._ranks()[0]  # type: ignore[arg-type]
        per_rank = -(-n // world)
        if self.drop_last and per_rank < self.batch_size:
            ranks = f" over {world} ranks ({per_rank} a rank)" if world > 1 else ""
            raise ValueError(
                f"data.batch_size={self.batch_size} but the training split has {n} clips{ranks}, and data.drop_last="
                f"true drops the incomplete batch: no training step is left. Set data.batch_size to at most "
                f"{per_rank}, or data.drop_last=false"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={self.root}, num_classes={self.num_classes}, input_size={self.input_size}, "
            f"augment={self.augment}, batch_size={self.batch_size}, val_fraction={self.val_fraction})"
        )

    __str__ = __repr__
