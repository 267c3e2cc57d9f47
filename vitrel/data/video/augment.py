"""Augmentations drawn once per clip: RandAugment on every frame alike, and random erasing through every frame.

Both are the video codebases' (V-JEPA 2's ``src/datasets/utils/video/randaugment.py`` and ``randerase.py``, used by
their ``evals/video_classification_frozen``; VideoMAE's are the same code): a clip's frames share one draw, so the
augmentation changes what every frame looks like without making the frames disagree (a rotation that differs per
frame would be motion the video does not have).

* :class:`ClipRandAugment`: timm's RandAugment (its config string, ``rand-m7-n4-mstd0.5-inc1`` for V-JEPA 2). The
  ``n`` ops are chosen once per clip (numpy's generator, as timm), and each op's draws (whether it applies, its
  magnitude, its sign) are made once and applied to every frame. It runs on the decoded frames before the random
  resized crop, as theirs, with bicubic resampling and a grey (128) fill, as their ``create_random_augment``.
* :class:`CubeErasing`: timm's random erasing parameters (``re_prob``, ``re_mode``, ``re_count``) with their
  ``cube=True``: each box is drawn once per clip (Python's generator) and cut through every frame; ``pixel`` fills
  each frame's box with its own normal noise, ``rand`` each frame's box with a normal value per channel, ``const``
  with 0. It runs on the normalised frames, as timm's and theirs.

Random draws come from the process's generators: DataLoader workers are seeded per worker and epoch by torch and by
Lightning's ``seed_everything(workers=True)`` (numpy's and Python's too), as the image pipelines' are.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from vitrel.data.augment import ERASE_MODES
from vitrel.data.timm_compat import black_posterize

__all__ = ["ClipRandAugment", "CubeErasing"]


class ClipRandAugment:
    """timm's RandAugment ``config`` (``rand-m9-mstd0.5-inc1``, ...) drawn once per clip: uint8 ``[T, C, H, W]`` in,
    uint8 ``[T, C, H, W]`` out (``C = channels``, 1 or 3). ``img_size`` sets timm's ``translate_const`` (0.45 of it)
    as their ``create_random_augment`` does; the ``Rel`` translations RandAugment draws are a fraction of each frame."""

    def __init__(self, config: str, img_size: int, channels: int = 3, interpolation: str = "bicubic") -> None:
        from timm.data.auto_augment import rand_augment_transform
        from timm.data.transforms import str_to_pil_interp

        if not isinstance(config, str) or not config.startswith("rand"):
            raise ValueError(
                f"a video's auto_augment is a RandAugment config ('rand-m7-n4-mstd0.5-inc1'), got {config!r}"
            )
        if channels not in (1, 3):
            raise ValueError(f"RandAugment takes frames of 1 or 3 channels, got {channels}")
        hparams = {
            "translate_const": int(img_size * 0.45),
            "interpolation": str_to_pil_interp(interpolation),
            "img_mean": 128 if channels == 1 else (128, 128, 128),  # (timm's grey fill; one value for a grey frame)
        }
        try:
            self.randaugment = black_posterize(rand_augment_transform(config, hparams))
        except (AssertionError, ValueError, KeyError) as err:
            raise ValueError(f"auto_augment {config!r} is not a RandAugment config timm reads ({err!r})") from None
        self.config, self.channels = config, channels

    def __call__(self, clip: Tensor) -> Tensor:
        if clip.dtype != torch.uint8 or clip.ndim != 4 or clip.shape[1] != self.channels:
            raise ValueError(
                f"RandAugment takes a uint8 clip [T, {self.channels}, H, W], got {clip.dtype} {tuple(clip.shape)}"
            )
        grey = clip.shape[1] == 1
        frames = [Image.fromarray(f[0].numpy() if grey else f.permute(1, 2, 0).numpy()) for f in clip]
        ra = self.randaugment  # (timm's RandAugment.__call__, its ops applied to every frame)
        for op in np.random.choice(ra.ops, ra.num_layers, replace=ra.choice_weights is None, p=ra.choice_weights):
            frames = _every_frame(op, frames)
        out = torch.from_numpy(np.stack([np.asarray(f) for f in frames]))
        return out[:, None] if grey else out.permute(0, 3, 1, 2).contiguous()

    def __repr__(self) -> str:
        return f"ClipRandAugment({self.config!r})"


def _every_frame(op: Any, frames: list[Image.Image]) -> list[Image.Image]:
    """timm's ``AugmentOp`` on every frame with one draw: Python's generator set back to where it was before each
    frame, so each frame's call draws what the first frame's drew, and the generator ends where one call leaves it."""
    state = random.getstate()
    out = []
    for frame in frames:
        random.setstate(state)
        out.append(op(frame))
    return out


class CubeErasing:
    """Random erasing through a clip's frames (V-JEPA 2's ``RandomErasing(cube=True)``, timm's parameters) on a float
    ``[T, C, H, W]`` clip, in place: with probability ``prob``, ``1..max_count`` boxes (a count drawn uniformly), each
    of area ``U(min_area, max_area) * H * W / count`` and aspect ratio log-uniform in ``[min_aspect, 1 / min_aspect]``
    (up to 100 tries for one that fits), at the same place in every frame."""

    def __init__(
        self, prob: float, mode: str = "const", max_count: int = 1, min_area: float = 0.02, max_area: float = 1 / 3,
        min_aspect: float = 0.3,
    ) -> None:  # fmt: skip
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"re_prob must be in [0, 1], got {prob}")
        if mode not in ERASE_MODES:
            raise ValueError(f"re_mode must be const, rand or pixel, got {mode!r}")
        if int(max_count) < 1:
            raise ValueError(f"re_count must be >= 1, got {max_count}")
        self.prob, self.mode, self.max_count = float(prob), mode, int(max_count)
        self.area = (float(min_area), float(max_area))
        self.log_aspect = (math.log(min_aspect), math.log(1 / min_aspect))

    def __call__(self, clip: Tensor) -> Tensor:
        if random.random() > self.prob:
            return clip
        t, c, h, w = clip.shape
        count = 1 if self.max_count == 1 else random.randint(1, self.max_count)
        for _ in range(count):
            for _ in range(100):
                target = random.uniform(*self.area) * h * w / count
                aspect = math.exp(random.uniform(*self.log_aspect))
                bh, bw = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
                if bw < w and bh < h:
                    top, left = random.randint(0, h - bh), random.randint(0, w - bw)
                    for i in range(t):  # (each frame's fill drawn on its own, as theirs)
                        clip[i, :, top : top + bh, left : left + bw] = self._fill((c, bh, bw), clip.dtype)
                    break
        return clip

    def _fill(self, shape: tuple[int, int, int], dtype: torch.dtype) -> Tensor:
        if self.mode == "pixel":
            return torch.empty(shape, dtype=dtype).normal_()
        if self.mode == "rand":
            return torch.empty((shape[0], 1, 1), dtype=dtype).normal_()
        return torch.zeros((shape[0], 1, 1), dtype=dtype)

    def __repr__(self) -> str:
        return f"CubeErasing(prob={self.prob}, mode={self.mode!r}, max_count={self.max_count})"
