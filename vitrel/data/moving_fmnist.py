"""Moving Fashion-MNIST: garments sliding across a canvas, labelled by the direction of their motion, made
deterministically from the Fashion-MNIST images shipped with vitrel (``fashion_mnist_subset.npz``).

A model that does not know the order of the frames cannot beat chance on it, on any split: every clip's
time-reversed clip is in the same split under the other label.

Construction. Image ``i`` of the split (train: the subset's 10,000, test: its 2,000, or the first ``train_images``
/ ``test_images``) is resized to ``object_size`` (bilinear, antialiased), placed at the top-left of a black
``size x size`` canvas, and moved on that canvas as on a torus (it leaves one edge and comes back at the
opposite one)::

    frame_t[y, x] = canvas[(y - y_t) mod size, (x - x_t) mod size],   (y_t, x_t) = (y_0, x_0) + t * v

Image ``i`` gives two clips of ``T = num_frames`` frames (``numpy.random.default_rng([seed, split])`` draws, per
image, an orientation from ``orientations``, a speed from ``speeds`` and a start uniformly on the torus):

* clip ``2i``, label 0 (``forward``): start ``p``, velocity ``v = speed * step``, ``step`` the orientation's
  ``(dy, dx)``: 0 = ``(0, 1)`` (rightwards), 45 = ``(1, 1)`` (down-right), 90 = ``(1, 0)`` (down),
  135 = ``(1, -1)`` (down-left);
* clip ``2i + 1``, label 1 (``backward``): start ``p + (T - 1) v``, velocity ``-v``: the frames of clip ``2i`` in
  reverse order.

So the two clips hold the same frames under different labels: a model that treats the frames as a set (no
temporal position, attention over frames and mean pooling) gives both the same output and is right on exactly one,
accuracy 50% (chance). ``val_fraction`` holds out whole pairs. Speeds must stay below ``size / 2`` so a step's
direction is unambiguous on the torus. The guarantee is for models that see each frame on its own: a tubelet
embedding over several frames (VideoMAE's ``tubelet_size=2``) reads their order inside each tubelet.

Sizes: 8 frames of 32 x 32 grey pixels by default, 20,000 training and 4,000 test clips rendered on access
(microseconds each; no files). Normalisation: the exact mean and std of the training clips' pixels
(``val_fraction``'s held-out pairs left out; every frame is a rolled canvas, so they follow from the resized
garments). ``augment`` is refused (a flip reverses the direction of some orientations and not others).
``make_dataset(split, num_frames=2 * T)`` renders the same motions longer (time extrapolation).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, Subset

from vitrel.data.datasets import seeded_split
from vitrel.data.fashion_mnist import SUBSET_PATH, load_embedded_subset
from vitrel.data.transforms import MappedDataset
from vitrel.data.video.base import VideoDataModule

__all__ = ["MovingFashionMNIST", "MovingFMNISTDataModule", "ORIENTATIONS", "render_objects", "draw_motions"]

#: orientation (degrees, image y pointing down) -> its unit step ``(dy, dx)``
ORIENTATIONS = {0: (0, 1), 45: (1, 1), 90: (1, 0), 135: (1, -1)}
CLASS_NAMES = ("forward", "backward")
_SPLIT_ID = {"train": 0, "test": 1}


def render_objects(images: np.ndarray, object_size: int) -> np.ndarray:
    """uint8 ``[N, 28, 28]`` -> uint8 ``[N, object_size, object_size]`` (bilinear, antialiased, rounded)."""
    if images.shape[-1] == object_size and images.shape[-2] == object_size:
        return np.ascontiguousarray(images, dtype=np.uint8)
    x = torch.from_numpy(np.asarray(images, dtype=np.float32))[:, None]
    x = F.interpolate(x, size=(object_size, object_size), mode="bilinear", antialias=True, align_corners=False)
    return x[:, 0].round().clamp(0, 255).to(torch.uint8).numpy()


def draw_motions(
    n: int, size: int, speeds: Sequence[int], orientations: Sequence[int], seed: int, split: str
) -> np.ndarray:
    """int64 ``[n, 4]``: ``(vy, vx, y0, x0)`` of each image's forward clip (see the module docstring)."""
    rng = np.random.default_rng([seed, _SPLIT_ID[split]])
    steps = np.array([ORIENTATIONS[o] for o in orientations], dtype=np.int64)[rng.integers(len(orientations), size=n)]
    speed = np.asarray(speeds, dtype=np.int64)[rng.integers(len(speeds), size=n)]
    start = rng.integers(size, size=(n, 2))
    return np.concatenate([steps * speed[:, None], start], axis=1)


class MovingFashionMNIST(Dataset):
    """The clips of ``objects`` (uint8 ``[N, o, o]``) moving as ``motions`` (``[N, 4]``: ``vy, vx, y0, x0``):
    ``2N`` samples ``(uint8 clip [T, C, size, size], label)``, sample ``2i + 1`` sample ``2i`` reversed in time."""

    def __init__(self, objects: np.ndarray, motions: np.ndarray, num_frames: int, size: int, in_chans: int = 1) -> None:
        if objects.ndim != 3 or objects.dtype != np.uint8 or len(objects) != len(motions):
            raise ValueError(
                f"objects must be uint8 [N, o, o] with one motion each, got {objects.shape} / {motions.shape}"
            )
        if num_frames < 2:
            raise ValueError(f"num_frames must be >= 2 (one frame has no direction of motion), got {num_frames}")
        self.objects, self.motions = objects, np.asarray(motions, dtype=np.int64)
        self.num_frames, self.size, self.in_chans = int(num_frames), int(size), int(in_chans)

    def __len__(self) -> int:
        return 2 * len(self.objects)

    def with_num_frames(self, num_frames: int) -> MovingFashionMNIST:
        """The same motions rendered with ``num_frames`` frames."""
        return MovingFashionMNIST(self.objects, self.motions, num_frames, self.size, self.in_chans)

    def label(self, index: int) -> int:
        return int(index) % 2

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} clips")
        pair, backward = divmod(int(index) % len(self), 2)
        vy, vx, y0, x0 = (int(v) for v in self.motions[pair])
        if backward:  # start where the forward clip ends, move the other way
            y0, x0, vy, vx = y0 + (self.num_frames - 1) * vy, x0 + (self.num_frames - 1) * vx, -vy, -vx
        obj = self.objects[pair]
        canvas = np.zeros((self.size, self.size), dtype=np.uint8)
        canvas[: obj.shape[0], : obj.shape[1]] = obj
        frames = np.stack(
            [np.roll(canvas, (y0 + t * vy, x0 + t * vx), axis=(0, 1)) for t in range(self.num_frames)]
        )  # [T, S, S]
        clip = torch.from_numpy(frames)[:, None].expand(-1, self.in_chans, -1, -1).contiguous()
        return clip, backward


class MovingFMNISTDataModule(VideoDataModule):
    """Moving Fashion-MNIST (see the module docstring): 2 classes, ``forward`` and ``backward``.

    Args:
        num_frames: frames per clip (``T``, >= 2).
        size: side of the square canvas (the clips' native size).
        object_size: side the 28 x 28 garments are resized to (at most ``size``).
        speeds: pixels per frame along each moving axis, drawn per image (each in ``1 .. size / 2 - 1``).
        orientations: degrees among 0, 45, 90, 135, drawn per image.
        train_images, test_images: the first this many images of each split (None: all; each gives 2 clips).
        in_chans: 1 (grey) or 3 (the value repeated).
        seed: the motions' seed (and the ``val_fraction`` split's); other kwargs as ``VideoDataModule``.
    """

    dataset_name = "Moving Fashion-MNIST"

    def __init__(
        self,
        num_frames: int = 8,
        size: int = 32,
        object_size: int = 16,
        speeds: Sequence[int] = (1, 2, 3),
        orientations: Sequence[int] = (0, 45, 90, 135),
        train_images: int | None = None,
        test_images: int | None = None,
        in_chans: int = 1,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("augment"):
            raise ValueError(
                "Moving Fashion-MNIST takes no augment: a flip reverses the direction of some orientations and not "
                "others (the clips are synthetic; more come from train_images or another seed)"
            )
        if not 1 <= object_size <= size:
            raise ValueError(f"object_size must be in [1, size={size}], got {object_size}")
        if not speeds or any(not 1 <= int(s) < size / 2 for s in speeds):
            raise ValueError(
                f"speeds must be pixels per frame in [1, size / 2) = [1, {size / 2:g}), got {list(speeds)}"
            )
        if not orientations or any(o not in ORIENTATIONS for o in orientations):
            raise ValueError(f"orientations must be among {sorted(ORIENTATIONS)} (degrees), got {list(orientations)}")
        if int(num_frames) < 2:
            raise ValueError(f"num_frames must be >= 2 (one frame has no direction of motion), got {num_frames}")
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        for name, n in (("train_images", train_images), ("test_images", test_images)):
            if n is not None and n < 1:
                raise ValueError(f"{name} must be >= 1 (or null: all), got {n}")
        self.native_size = int(size)
        super().__init__(num_frames=num_frames, **kwargs)
        self.size, self.object_size = int(size), int(object_size)
        self.speeds, self.orientations = tuple(int(s) for s in speeds), tuple(int(o) for o in orientations)
        self._images = {"train": train_images, "test": test_images}
        self.num_classes = 2
        self.in_chans = int(in_chans)
        self.class_names = list(CLASS_NAMES)
        mean, std = self._pixel_stats()
        self.mean, self.std = (mean,) * self.in_chans, (std,) * self.in_chans

    def _locate(self) -> Path:
        return SUBSET_PATH

    def _objects(self, split: str) -> np.ndarray:
        images = load_embedded_subset(split)[0]
        n = self._images[split]
        if n is not None and n > len(images):
            raise ValueError(f"{split}_images={n} but the shipped {split} split has {len(images)} images")
        return render_objects(images[:n], self.object_size)

    def _pixel_stats(self) -> tuple[float, float]:
        """Mean and std of the training clips' pixels in [0, 1] (``val_fraction``'s held-out pairs left out): each
        frame's pixels are the canvas's."""
        _, fit = self._split_of("train")  # (clip indices 2i, 2i + 1: garment i)
        obj = self._raw_split("train").objects  # type: ignore[attr-defined]
        obj = (obj if fit is None else obj[fit[::2] // 2]).astype(np.float64) / 255.0
        pixels = len(obj) * self.size**2
        mean = obj.sum() / pixels
        blank = pixels - obj.size  # (the canvas around each garment, 0)
        return float(mean), float(np.sqrt((((obj - mean) ** 2).sum() + blank * mean**2) / pixels))

    def _load_raw(self, split: str) -> MovingFashionMNIST:
        objects = self._objects(split)
        motions = draw_motions(len(objects), self.size, self.speeds, self.orientations, self.seed, split)
        return MovingFashionMNIST(objects, motions, self.num_frames, self.size, self.in_chans)

    def _split_of(self, split: str) -> tuple[str, np.ndarray | None]:
        """As the image modules', but ``val_fraction`` holds out whole pairs (a clip and its reversal)."""
        if self.val_fraction > 0.0 and self._split_idx is None:
            train, val = seeded_split(len(self._raw_split("train")) // 2, self.val_fraction, self.seed)
            self._split_idx = tuple(np.stack([2 * i, 2 * i + 1], axis=1).ravel() for i in (train, val))  # type: ignore[assignment]
        return super()._split_of(split)

    def _clips(self, videos: Dataset, transform: Any, num_frames: int, training: bool) -> Dataset:
        if num_frames != self.num_frames:
            if isinstance(videos, Subset):
                videos = Subset(videos.dataset.with_num_frames(num_frames), videos.indices)  # type: ignore[attr-defined]
            else:
                videos = videos.with_num_frames(num_frames)  # type: ignore[attr-defined]
        return MappedDataset(videos, transform)
