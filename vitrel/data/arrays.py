"""Any image-classification data set given as uint8 arrays, held in memory.

``ArrayDataModule(train=(images, labels), test=(images, labels), num_classes=...)`` or
``ArrayDataModule(path="set.npz")`` (keys ``x_train, y_train, x_test, y_test``, as the embedded
Fashion-MNIST subset): images ``[N, H, W]`` (one channel) or ``[N, H, W, C]``, uint8; labels ``[N]``
in ``0..num_classes-1``. Normalisation: the given ``mean``/``std``, else the per-channel statistics of
the images trained on (``val_fraction``'s held-out part left out). Both loaders work (``loader="memory"``
by default); the default batch augmentation (with ``augment``) only shifts, by up to 2 pixels: no
mirroring, which is wrong for digits or text (``batch_augment`` sets it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from vitrel.data.base import DatasetNotFoundError, VisionDataModule

__all__ = ["ArrayDataModule"]

Arrays = tuple[np.ndarray, np.ndarray]


class ArrayDataModule(VisionDataModule):
    """uint8 image arrays as a DataModule (see the module docstring); other kwargs as ``VisionDataModule``."""

    dataset_name = "arrays"
    memory_capable = True
    default_val_fraction = 0.1  # (conf/data: the same)
    default_loader = "memory"
    default_batch_augment = {"translate": 2}

    def __init__(
        self,
        train: Arrays | None = None,
        test: Arrays | None = None,
        path: str | Path | None = None,
        num_classes: int | None = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        class_names: Sequence[str] | None = None,
        **kwargs,
    ) -> None:
        if (path is None) == (train is None or test is None):
            raise ValueError("give either path (an .npz file) or both train and test as (images, labels)")
        if path is not None:
            path = Path(path).expanduser()
            if not path.is_file():
                raise DatasetNotFoundError("array data set", [path], ["an .npz with x_train, y_train, x_test, y_test"])
            with np.load(path) as z:
                train, test = (z["x_train"], z["y_train"]), (z["x_test"], z["y_test"])
        self._splits = {"train": self._check(*train, "train"), "test": self._check(*test, "test")}
        x = self._splits["train"][0]
        if x.shape[1:3] != self._splits["test"][0].shape[1:3] or x.shape[1] != x.shape[2]:
            raise ValueError(f"train and test images must be square and of one size, got {x.shape} / {test[0].shape}")
        self.native_size = int(x.shape[1])
        super().__init__(**kwargs)
        labels = np.concatenate([self._splits["train"][1], self._splits["test"][1]])
        self.num_classes = int(num_classes if num_classes is not None else labels.max() + 1)
        if labels.min() < 0 or labels.max() >= self.num_classes:
            raise ValueError(f"labels must be in [0, {self.num_classes}), found {labels.min()}..{labels.max()}")
        if num_classes is None and labels.min() > 0:  # (labels 1..C: a class 0 that no image has)
            rank_zero_warn(
                f"labels are {labels.min()}..{labels.max()}: num_classes={self.num_classes} (the largest label + 1), "
                f"classes 0..{labels.min() - 1} with no image; labels 1..C? subtract 1 (or give num_classes)"
            )
        self.in_chans = 1 if x.ndim == 3 else int(x.shape[3])
        _, fit = self._split_of("train")  # (the train part only: not the val_fraction held out of it)
        fit_x = x if fit is None else x[fit]
        pixels = fit_x.reshape(len(fit_x), self.native_size**2, self.in_chans).astype(np.float64) / 255.0
        self.mean = tuple(float(m) for m in (mean if mean is not None else pixels.mean((0, 1))))
        self.std = tuple(float(s) for s in (std if std is not None else pixels.std((0, 1))))
        if class_names is not None and len(class_names) != self.num_classes:  # (predict.py would label by index)
            raise ValueError(f"{len(class_names)} class_names for {self.num_classes} classes: {list(class_names)}")
        self.class_names = list(class_names) if class_names is not None else [str(i) for i in range(self.num_classes)]

    @staticmethod
    def _check(images: np.ndarray, labels: np.ndarray, split: str) -> Arrays:
        images, labels = np.asarray(images), np.asarray(labels)
        if labels.dtype.kind not in "iu":  # (astype would truncate 1.5 to 1, and read "3" as 3)
            raise ValueError(
                f"{split} labels must be integer class indices 0..num_classes-1, got {labels.dtype}: map names to "
                "indices (and give their names as class_names), or cast whole numbers with labels.astype(int)"
            )
        if labels.ndim != 1:  # ([N, 1]: a batch of [N, 1] targets stops cross-entropy with torch's "multi-target")
            hint = " (Keras's load_data gives [N, 1]): labels.ravel()" if labels.shape[1:] == (1,) else ""
            raise ValueError(f"{split} labels must be [N] class indices, got shape {labels.shape}{hint}")
        labels = labels.astype(np.int64)
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"{split} images must be uint8 [N, H, W(, C)], got {images.dtype} {images.shape}")
        if images.ndim == 4 and images.shape[1] <= 4 < images.shape[3]:  # (else "not square" hides the cause)
            raise ValueError(
                f"{split} images must be channels-last [N, H, W, C], got {images.shape} (channels-first "
                "[N, C, H, W]?): images.transpose(0, 2, 3, 1)"
            )
        if len(images) != len(labels):
            raise ValueError(f"{split}: {len(images)} images but {len(labels)} labels")
        return images, labels

    def _locate(self) -> None:
        return None

    def _load_arrays(self, split: str) -> Arrays:
        return self._splits[split]
