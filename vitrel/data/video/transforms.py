"""The per-clip transforms: a uint8 clip ``[T, C, H, W]`` as read (torchvision's ``TCHW``) to the model's float
``[C, T, H, W]`` (VideoMAE's and PyTorchVideo's layout; a batch is ``[B, C, T, H, W]``), normalised.

Training (:class:`ClipTransform` with ``train=True``): RandAugment (``auto_augment``), the random resized crop and
flip (torchvision ``transforms.v2`` over a ``tv_tensors.Video``) and random erasing (``re_prob``), each drawn once
per clip, so every frame of a clip gets the same (:mod:`vitrel.data.video.augment`). Evaluation: the shorter side
resized and the centre crop, or several crops along the longer side (multi-view testing: :func:`spatial_views`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchvision.transforms import InterpolationMode

from vitrel.data.augment import normalize, resize_crop, resize_shorter
from vitrel.data.video.augment import ClipRandAugment, CubeErasing

__all__ = ["ClipTransform", "crop_starts", "spatial_views"]


class ClipTransform:
    """uint8 clip ``[T, C, H, W]`` -> float ``[C, T, size, size]``, ``(x / 255 - mean) / std``.

    ``train=True``: with ``auto_augment``, RandAugment on the frames as read (:class:`ClipRandAugment`); a random
    resized crop (``scale``, ``ratio``: timm's parameters) and a horizontal flip with probability ``hflip``; with
    ``re_prob``, random erasing of the normalised frames (:class:`CubeErasing`, ``re_mode``, ``re_count``): each
    drawn once per clip. ``train=False``: the shorter side resized to ``floor(size / crop_pct)`` and the centre
    ``size x size`` (nothing when the clip already is ``size x size`` and ``crop_pct == 1``), as the image evaluation
    pipeline; with ``crops`` above 1, that many ``size x size`` crops evenly spaced along the longer side
    (:func:`crop_starts`; centred on the shorter), stacked ``[crops, C, T, size, size]``: the spatial views of
    multi-view testing (3: VideoMAE's, Video Swin's, V-JEPA 2's).
    """

    def __init__(
        self,
        size: int,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        train: bool = False,
        scale: Sequence[float] = (0.08, 1.0),
        ratio: Sequence[float] = (3 / 4, 4 / 3),
        hflip: float = 0.5,
        interpolation: str = "bilinear",
        crop_pct: float = 1.0,
        crops: int = 1,
        auto_augment: str | None = None,
        re_prob: float = 0.0,
        re_mode: str = "const",
        re_count: int = 1,
    ) -> None:
        from torchvision.transforms import v2

        if not 0.0 < crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
        if isinstance(crops, bool) or not isinstance(crops, int) or crops < 1:
            raise ValueError(f"spatial_crops must be an integer >= 1, got {crops!r}")
        self.crops = crops
        if len(mean) != len(std):
            raise ValueError(f"mean and std must have one value per channel, got {list(mean)} / {list(std)}")
        self.size, self.train, self.crop_pct = int(size), bool(train), float(crop_pct)
        self.interpolation = InterpolationMode(interpolation)
        self.mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]  # [C, 1, 1]
        self.std = torch.tensor(std, dtype=torch.float32)[:, None, None]
        self.augment = self.rand_augment = self.erase = None
        if train and auto_augment:
            self.rand_augment = ClipRandAugment(auto_augment, self.size, channels=len(mean))
        if train and re_prob:
            self.erase = CubeErasing(re_prob, re_mode, re_count)
        if train:
            self.augment = v2.Compose(
                [
                    v2.RandomResizedCrop(
                        self.size, scale=tuple(scale), ratio=tuple(ratio), interpolation=self.interpolation
                    ),
                    v2.RandomHorizontalFlip(float(hflip)),
                ]
            )

    def __call__(self, clip: Tensor) -> Tensor:
        from torchvision import tv_tensors

        if clip.dtype != torch.uint8 or clip.ndim != 4 or clip.shape[1] != len(self.mean):
            raise ValueError(f"a clip must be uint8 [T, {len(self.mean)}, H, W], got {clip.dtype} {tuple(clip.shape)}")
        if self.augment is not None:
            if self.rand_augment is not None:
                clip = self.rand_augment(clip)
            x = self.augment(tv_tensors.Video(clip)).as_subclass(Tensor)  # (one draw: v2 takes a Video as one input)
            x = normalize(x, self.mean, self.std)
            return (self.erase(x) if self.erase is not None else x).permute(1, 0, 2, 3)
        if self.crops > 1:
            scaled = resize_shorter(clip, self.size, self.crop_pct, self.interpolation)
            return torch.stack([self._view(v) for v in spatial_views(scaled, self.size, self.crops)])
        return self._view(resize_crop(clip, self.size, self.crop_pct, self.interpolation))

    def _view(self, x: Tensor) -> Tensor:
        return normalize(x, self.mean, self.std).permute(1, 0, 2, 3)  # [T, C, H, W] -> [C, T, H, W]

    def __repr__(self) -> str:
        steps = [t for t in (self.rand_augment, self.augment, self.erase) if t is not None]
        kind = f"augment={steps}" if self.augment is not None else f"crop_pct={self.crop_pct}"
        return f"ClipTransform(size={self.size}, {kind}" + (f", crops={self.crops})" if self.crops > 1 else ")")


def crop_starts(length: int, size: int, crops: int) -> list[int]:
    """Where ``crops`` windows of ``size`` start along a side of ``length``: evenly spaced from one end to the other,
    ``ceil(i (length - size) / (crops - 1))`` (for 3: the start, the centre rounded up and the end, PyTorchVideo's
    ``uniform_crop`` and SlowFast's); the centre, ``round((length - size) / 2)`` as torchvision's, for one."""
    if crops == 1:
        return [int(round((length - size) / 2.0))]
    return [-((-i * (length - size)) // (crops - 1)) for i in range(crops)]


def spatial_views(scaled: Tensor, size: int, crops: int) -> list[Tensor]:
    """The ``crops`` spatial views ``[T, C, size, size]`` of a resized clip ``scaled`` (its shorter side at least
    ``size``): along its longer side :func:`crop_starts`, centred on the shorter (a square clip: along the width)."""
    h, w = scaled.shape[-2:]
    if min(h, w) < size:
        raise ValueError(f"a clip resized to {h} x {w} is smaller than its {size} x {size} crops")
    along_h = h > w
    views = []
    for start in crop_starts(h if along_h else w, size, crops):
        top, left = (start, crop_starts(w, size, 1)[0]) if along_h else (crop_starts(h, size, 1)[0], start)
        views.append(scaled[..., top : top + size, left : left + size])
    return views
