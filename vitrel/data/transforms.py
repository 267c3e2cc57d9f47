"""Image transforms and dataset wrappers: timm/plain pipelines, the translation canvas, resizing.

Pipelines (``build_transform``):

* training with ``augment=True``: ``timm.data.create_transform(is_training=True, ...)``
  (RandomResizedCrop, flip, optional colour jitter / RandAugment / random erasing, normalise);
* everything else: ``timm.data.create_transform(is_training=False, ...)``: ``[Resize(floor(S / crop_pct)),
  CenterCrop(S)]``, ``ToTensor`` (uint8 -> [0, 1]), ``Normalize(mean, std)``.

Translation canvas (position-scheme study, translation generalisation). An ``h x w`` image is pasted
at offset ``(top, left)`` into an ``H_c x W_c`` canvas of zeros (black, pixel value 0)::

    canvas[top + i, left + j] = img[i, j]   for 0 <= i < h, 0 <= j < w;   canvas = 0 elsewhere,
    top ~ U{0, ..., H_c - h},  left ~ U{0, ..., W_c - w}

With a ``step`` (``TranslatedDataset(grid_step=p)``) the offsets are whole multiples of ``p``: for the
patch size ``p`` the moved image's patches are exactly the untranslated ones, only their grid
positions change.

Offset regions (``mode``; the study's fixed-canvas split). With ``k_t = (H_c - h) // 2`` and
``k_l = (W_c - w) // 2`` (the centre offset):

* ``"random"``: every offset; ``"center"``: ``(k_t, k_l)`` only;
* ``"seen"``: the top-left block ``top <= k_t and left <= k_l`` (where training draws from);
* ``"unseen"``: its complement ``top > k_t or left > k_l`` (disjoint from ``"seen"``: held-out positions).

``off_step=p`` keeps only offsets that are *not* whole multiples of ``p`` on both axes (sub-patch moves);
with ``step=p`` instead, only whole-patch moves. A random offset is uniform over the region's offsets.

The canvas is applied to the raw image, *before* normalisation, so the background normalises to
``(0 - mean) / std`` like a black pixel of the data set.

Resizing (resolution generalisation): ``ResizedDataset`` resizes already normalised tensors. Bilinear
and bicubic interpolation (with or without antialiasing) are linear maps whose weights sum to one, so
they commute with the per-channel affine normalisation ``(x - m) / s``: resizing before or after
normalising gives the same tensor (up to float rounding).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset, get_worker_info
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

__all__ = [
    "translate_canvas",
    "canvas_offset",
    "offset_region",
    "CANVAS_MODES",
    "fixed_canvas_offsets",
    "TranslateCanvas",
    "TranslatedDataset",
    "ResizedDataset",
    "MappedDataset",
    "SampleKey",
    "seeded_draws",
    "build_transform",
    "plain_transform",
    "augment_transform",
]

ImageLike = Image.Image | Tensor | np.ndarray


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    size = tuple(int(s) for s in size)
    if len(size) != 2:
        raise ValueError(f"expected an int or an (h, w) pair, got {size!r}")
    return size  # type: ignore[return-value]


def image_hw(img: ImageLike) -> tuple[int, int]:
    """``(h, w)`` of a PIL image, a ``[..., C, H, W]`` tensor, or an ``[H, W(, C)]`` numpy array."""
    if isinstance(img, Image.Image):
        return img.height, img.width
    if isinstance(img, Tensor):
        return int(img.shape[-2]), int(img.shape[-1])
    if isinstance(img, np.ndarray):
        return int(img.shape[0]), int(img.shape[1])
    raise TypeError(f"unsupported image type {type(img).__name__}")


def translate_canvas(img: ImageLike, canvas_size: int | Sequence[int], top: int, left: int) -> ImageLike:
    """Paste ``img`` at ``(top, left)`` into a zero (black) canvas of ``canvas_size``.

    ``canvas[top + i, left + j] = img[i, j]``, zero elsewhere. Works on PIL images (any mode), tensors
    ``[..., C, H, W]`` and numpy arrays ``[H, W(, C)]``; returns the same kind. Apply it before
    normalisation (black must be pixel value 0).
    """
    ch, cw = _pair(canvas_size)
    h, w = image_hw(img)
    if not (0 <= top <= ch - h and 0 <= left <= cw - w):
        raise ValueError(f"a {h}x{w} image at (top={top}, left={left}) does not fit a {ch}x{cw} canvas")
    if isinstance(img, Image.Image):
        out = Image.new(img.mode, (cw, ch), 0)
        out.paste(img, (left, top))
        return out
    if isinstance(img, Tensor):
        out = img.new_zeros((*img.shape[:-2], ch, cw))
        out[..., top : top + h, left : left + w] = img
        return out
    out = np.zeros((ch, cw, *img.shape[2:]), dtype=img.dtype)
    out[top : top + h, left : left + w] = img
    return out


CANVAS_MODES = ("random", "center", "seen", "unseen")


def offset_region(
    img_hw: tuple[int, int], canvas_size: int | Sequence[int], mode: str = "random", step: int = 1, off_step: int = 1
) -> np.ndarray:
    """Every allowed ``(top, left)`` of an ``img_hw`` image in the canvas for ``mode`` (module docstring),
    ``[M, 2]`` int64 in row-major order: multiples of ``step``, and (``off_step > 1``) not multiples of
    ``off_step`` on both axes."""
    ch, cw = _pair(canvas_size)
    h, w = img_hw
    if h > ch or w > cw:
        raise ValueError(f"a {h}x{w} image does not fit a {ch}x{cw} canvas")
    if step < 1 or off_step < 1:
        raise ValueError(f"step and off_step must be positive numbers of pixels, got {step}, {off_step}")
    if mode not in CANVAS_MODES:
        raise ValueError(f"canvas mode must be one of {CANVAS_MODES}, got {mode!r}")
    top, left = np.meshgrid(np.arange(0, ch - h + 1, step), np.arange(0, cw - w + 1, step), indexing="ij")
    top, left = top.ravel(), left.ravel()
    kt, kl = (ch - h) // 2, (cw - w) // 2
    keep = {
        "random": np.ones_like(top, dtype=bool),
        "center": (top == step * (kt // step)) & (left == step * (kl // step)),
        "seen": (top <= kt) & (left <= kl),
        "unseen": (top > kt) | (left > kl),
    }[mode]
    if off_step > 1:
        keep &= (top % off_step != 0) | (left % off_step != 0)
    if not keep.any():
        raise ValueError(
            f"no {mode!r} offset of a {h}x{w} image in a {ch}x{cw} canvas (step {step}, off_step {off_step})"
        )
    return np.stack([top[keep], left[keep]], -1).astype(np.int64)


def canvas_offset(
    img_hw: tuple[int, int],
    canvas_size: int | Sequence[int],
    mode: str = "random",
    generator: Any = None,
    step: int = 1,
    off_step: int = 1,
) -> tuple[int, int]:
    """Offset ``(top, left)`` of an ``img_hw`` image in the canvas, in whole multiples of ``step`` pixels.

    ``mode="center"``: ``((H_c - h) // 2, (W_c - w) // 2)`` rounded down to a multiple of ``step``.
    ``mode="random"``: uniform over all valid (multiple of ``step``) offsets, drawn from ``generator``
    (a ``numpy.random.Generator``, a ``torch.Generator``, or None for torch's global RNG, which
    Lightning/DataLoader seed per worker). ``"seen"`` / ``"unseen"`` (and ``off_step``): uniform over
    :func:`offset_region`.
    """
    ch, cw = _pair(canvas_size)
    h, w = img_hw
    if h > ch or w > cw:
        raise ValueError(f"a {h}x{w} image does not fit a {ch}x{cw} canvas")
    if step < 1:
        raise ValueError(f"step must be a positive number of pixels, got {step}")
    if mode == "center":
        return step * ((ch - h) // 2 // step), step * ((cw - w) // 2 // step)
    if mode != "random" or off_step > 1:
        region = offset_region(img_hw, canvas_size, mode, step, off_step)
        if isinstance(generator, np.random.Generator):
            k = int(generator.integers(0, len(region)))
        else:
            k = int(torch.randint(0, len(region), (1,), generator=generator))
        return int(region[k, 0]), int(region[k, 1])
    nh, nw = (ch - h) // step + 1, (cw - w) // step + 1
    if isinstance(generator, np.random.Generator):
        return step * int(generator.integers(0, nh)), step * int(generator.integers(0, nw))
    top = int(torch.randint(0, nh, (1,), generator=generator))
    left = int(torch.randint(0, nw, (1,), generator=generator))
    return step * top, step * left


def fixed_canvas_offsets(
    n: int, img_hw: tuple[int, int], canvas_size: int | Sequence[int], seed: int, mode: str = "random"
) -> np.ndarray:
    """``[n, 2]`` int64 ``(top, left)`` of samples ``0..n-1``: sample ``i``'s from
    ``numpy.random.default_rng([seed, i])``, as :class:`TranslatedDataset` gives them."""
    return np.array(
        [canvas_offset(img_hw, canvas_size, mode, np.random.default_rng([seed, i])) for i in range(n)],
        dtype=np.int64,
    ).reshape(n, 2)


class TranslateCanvas:
    """Transform: paste the image into a black ``canvas_size`` canvas (see ``translate_canvas``).

    ``offset``: a region (``"random"``, ``"seen"``, ``"unseen"``: a fresh uniform offset of the region per
    call from torch's global RNG, so DataLoader workers seeded by Lightning give reproducible,
    per-worker-distinct offsets), ``"center"``, or a fixed ``(top, left)``. For a fixed random offset per
    sample (evaluation) use ``TranslatedDataset``.
    """

    def __init__(self, canvas_size: int | Sequence[int], offset: str | tuple[int, int] = "random") -> None:
        self.canvas_size = _pair(canvas_size)
        if isinstance(offset, str) and offset not in CANVAS_MODES:
            raise ValueError(f"offset must be one of {CANVAS_MODES} or (top, left), got {offset!r}")
        self.offset = offset if isinstance(offset, str) else (int(offset[0]), int(offset[1]))

    def __call__(self, img: ImageLike) -> ImageLike:
        if isinstance(self.offset, str):
            top, left = canvas_offset(image_hw(img), self.canvas_size, self.offset)
        else:
            top, left = self.offset
        return translate_canvas(img, self.canvas_size, top, left)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(canvas_size={self.canvas_size}, offset={self.offset!r})"


class SampleKey(NamedTuple):
    """A training sample's index with the run's order ``seed`` and the ``epoch`` (what a keyed
    :class:`~vitrel.data.sampling.EpochSampler` yields): :class:`MappedDataset` draws its random transform from them."""

    index: int
    epoch: int
    seed: int


@contextmanager
def seeded_draws(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Within: torch's (CPU), Python's ``random`` and numpy's global generators seeded from a hash of
    ``(seed, epoch, index)``. A transform drawing from them inside gives the same result for the same key in any
    process, DataLoader worker or batch position. After: in the main process (``num_workers=0``) all three as they
    were; in a worker they are left as seeded (the worker's own streams: only its collate draws from them between
    samples, then as repeatably), since putting numpy's back costs ~0.2 ms a sample, more than a small image's
    transform."""
    words = np.random.SeedSequence([int(seed) % 2**64, int(epoch), int(index)]).generate_state(4)
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state()) if get_worker_info() is None else None
    torch.default_generator.manual_seed(int(words[0]) << 32 | int(words[1]))
    random.seed(int(words[2]))
    np.random.seed(int(words[3]))
    try:
        yield
    finally:
        if saved is not None:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])


class MappedDataset(Dataset):
    """``(x, y) -> (transform(x), y)`` over a dataset of raw ``(image, label)`` pairs; ``None`` (a file an evaluation
    split left out: :mod:`vitrel.data.unreadable`) stays ``None``. Indexed by a :class:`SampleKey` (the training
    loader's), the read and the transform draw from :func:`seeded_draws` of the key: a sample's augmentation depends
    on ``(seed, epoch, index)`` only."""

    #: it takes :class:`SampleKey` indices (a keyed :class:`~vitrel.data.sampling.EpochSampler`'s)
    keyed_draws = True

    def __init__(self, dataset: Dataset, transform: Callable | None = None) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int | SampleKey) -> tuple[Any, Any] | None:
        if isinstance(index, SampleKey):
            with seeded_draws(index.seed, index.epoch, index.index):
                return self._item(index.index)
        return self._item(index)

    def _item(self, index: int) -> tuple[Any, Any] | None:
        item = self.dataset[index]
        if item is None:
            return None
        x, y = item
        return (self.transform(x) if self.transform is not None else x), y


class TranslatedDataset(Dataset):
    """Dataset wrapper: sample ``i`` is pasted into a black canvas at a fixed, seeded offset.

    The offset of sample ``i`` is drawn from ``numpy.random.default_rng([seed, i])``: it depends only
    on ``(seed, i)`` and the sizes, not on the access order or the worker, so an evaluation is exactly
    reproducible; ``offset(i)`` returns it. ``grid_step=p`` snaps the offsets to whole multiples of ``p``
    pixels (``p`` = the patch size: whole-patch moves), ``off_step=p`` keeps the other offsets (sub-patch
    moves); ``mode`` is a region of :func:`offset_region` (or ``"center"``). ``transform`` (e.g. ToTensor +
    Normalize) is applied to the canvas. ``return_offset=True`` yields ``(x, y, (top, left))``.
    """

    def __init__(
        self,
        dataset: Dataset,
        canvas_size: int | Sequence[int],
        seed: int = 0,
        transform: Callable | None = None,
        mode: str = "random",
        return_offset: bool = False,
        grid_step: int = 1,
        off_step: int = 1,
    ) -> None:
        if grid_step < 1 or off_step < 1:
            raise ValueError(f"grid_step and off_step must be positive numbers of pixels, got {grid_step}, {off_step}")
        if mode not in CANVAS_MODES:
            raise ValueError(f"mode must be one of {CANVAS_MODES}, got {mode!r}")
        self.dataset = dataset
        self.canvas_size = _pair(canvas_size)
        self.seed = int(seed)
        self.transform = transform
        self.mode = mode
        self.return_offset = return_offset
        self.grid_step = int(grid_step)
        self.off_step = int(off_step)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def offset(self, index: int, img_hw: tuple[int, int] | None = None) -> tuple[int, int]:
        """``(top, left)`` of sample ``index`` (``img_hw`` defaults to that sample's size)."""
        if img_hw is None:
            img_hw = image_hw(self.dataset[index][0])
        rng = np.random.default_rng([self.seed, int(index)])
        return canvas_offset(img_hw, self.canvas_size, self.mode, rng, self.grid_step, self.off_step)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        x, y = self.dataset[index]
        top, left = self.offset(index, image_hw(x))
        x = translate_canvas(x, self.canvas_size, top, left)
        if self.transform is not None:
            x = self.transform(x)
        return (x, y, (top, left)) if self.return_offset else (x, y)


class ResizedDataset(Dataset):
    """Dataset wrapper resizing image tensors ``[C, H, W]`` to ``size`` (up- or down-sampling).

    Safe on normalised tensors: the interpolation is linear with weights summing to one, so it
    commutes with per-channel normalisation (see the module docstring).
    """

    def __init__(
        self,
        dataset: Dataset,
        size: int | Sequence[int],
        interpolation: str = "bilinear",
        antialias: bool = True,
    ) -> None:
        self.dataset = dataset
        self.size = list(_pair(size))
        self.interpolation = InterpolationMode(interpolation)
        self.antialias = antialias

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        x, *rest = self.dataset[index]
        if not isinstance(x, Tensor):
            raise TypeError(f"ResizedDataset expects image tensors, got {type(x).__name__}")
        x = TF.resize(x, self.size, interpolation=self.interpolation, antialias=self.antialias)
        return (x, *rest)


def plain_transform(
    img_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    interpolation: str = "bilinear",
    crop_pct: float = 1.0,
) -> Callable:
    """timm's evaluation pipeline (``create_transform(is_training=False)``): shorter side resized to
    ``floor(img_size / crop_pct)``, centre ``img_size`` crop, to tensor, normalise. An image already
    ``img_size x img_size`` at ``crop_pct == 1`` keeps its pixels (the resize to its own size is a copy)."""
    from timm.data import create_transform

    if not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
    kw = dict(mean=tuple(mean), std=tuple(std), interpolation=interpolation, crop_pct=crop_pct)
    return create_transform(img_size, is_training=False, **kw)


def canvas_transform(image_size: int, canvas_size: int, interpolation: str = "bilinear") -> Callable:
    """An image at ``image_size`` (shorter side resized, centre-cropped; as it is at that size) in the middle of a black
    ``canvas_size`` canvas (``TranslateCanvas(canvas_size, "center")``): ``predict.py``'s images for a model trained
    on a canvas (``data.canvas_size``; ``"center"`` lies in every training region but ``unseen``)."""
    resize = _ResizeCrop(image_size, image_size, InterpolationMode(interpolation))
    return T.Compose([resize, TranslateCanvas(canvas_size, "center")])


class _ResizeCrop:
    def __init__(self, size: int, scale: int, interpolation: InterpolationMode) -> None:
        self.size, self.scale, self.interpolation = size, scale, interpolation

    def __call__(self, img: ImageLike) -> ImageLike:
        if image_hw(img) == (self.size, self.size) and self.scale == self.size:
            return img
        img = TF.resize(img, self.scale, interpolation=self.interpolation, antialias=True)
        return TF.center_crop(img, [self.size, self.size])

    def __repr__(self) -> str:
        return f"ResizeCrop(size={self.size}, resize_to={self.scale}, interpolation={self.interpolation.value})"


def augment_transform(
    img_size: int, mean: Sequence[float], std: Sequence[float], interpolation: str = "bilinear", **timm_kwargs: Any
) -> Callable:
    """timm's training pipeline: ``timm.data.create_transform(img_size, is_training=True, ...)``, its posterize
    keeping 0 bits a black image under any Pillow (:func:`~vitrel.data.timm_compat.black_posterize`)."""
    from timm.data import create_transform

    from vitrel.data.timm_compat import black_posterize

    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in timm_kwargs.items()}
    tf = create_transform(
        img_size, is_training=True, mean=tuple(mean), std=tuple(std), interpolation=interpolation, **kw
    )
    return black_posterize(tf)  # (0 bits kept: a black image, as before Pillow 13)


def build_transform(
    *,
    train: bool,
    augment: bool,
    img_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    interpolation: str = "bilinear",
    crop_pct: float = 1.0,
    augment_kwargs: dict[str, Any] | None = None,
    canvas_size: int | None = None,
    canvas_mode: str = "random",
) -> Callable:
    """Full per-sample pipeline: optional canvas (raw image) -> timm augmentation or plain resize -> normalise.

    The canvas step here draws a fresh offset per call (training); evaluation splits use
    ``TranslatedDataset`` instead, for fixed per-sample offsets.
    """
    if train and augment:
        tf = augment_transform(img_size, mean, std, interpolation, **(augment_kwargs or {}))
    else:
        tf = plain_transform(img_size, mean, std, interpolation, crop_pct)
    if canvas_size is not None:
        tf = T.Compose([TranslateCanvas(canvas_size, canvas_mode), tf])
    return tf
