"""ImageNet (ILSVRC-2012) and any data set in the same class-folder layout.

Expected layout (torchvision ``ImageFolder``)::

    root/train/<wnid>/*.JPEG      e.g. root/train/n01440764/n01440764_10026.JPEG
    root/val/<wnid>/*.JPEG        e.g. root/val/n01440764/ILSVRC2012_val_00000293.JPEG

The official validation archive is flat (``val/ILSVRC2012_val_*.JPEG``); sort it into one folder per
wnid first (e.g. with the widely used ``valprep.sh`` script from the PyTorch ImageNet example). Classes
are the sorted ``train`` folder names (1000 for ImageNet-1k) and val uses the same class indices (a val
folder may lack classes, but may not add any). ImageNet cannot be downloaded automatically.

``val`` is also the test split (unless ``val_fraction > 0``). Normalisation: timm's ImageNet defaults.
It streams from the image files through ``DataLoader`` workers (``loader="workers"``, persistent, pinned
memory on CUDA) with timm's pipelines (``timm.data.create_transform``): training with ``augment=True``
RandomResizedCrop(0.08-1) + flip + colour jitter 0.4; evaluation resize of the shorter side to
``floor(img_size / crop_pct)`` (crop_pct 0.875, bicubic) and the centre crop.
"""

from __future__ import annotations

import os
from pathlib import Path

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder

from vitrel.data.base import DatasetNotFoundError, VisionDataModule

__all__ = ["ImageNetDataModule", "FixedClassImageFolder"]


class FixedClassImageFolder(ImageFolder):
    """``ImageFolder`` with a given class list (so val uses train's class indices)."""

    def __init__(self, root: str | Path, classes: list[str], **kwargs) -> None:
        self._fixed_classes = list(classes)
        super().__init__(str(root), **kwargs)

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        return self._fixed_classes, {c: i for i, c in enumerate(self._fixed_classes)}


def _subdirs(path: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir())


class ImageNetDataModule(VisionDataModule):
    """ImageNet-style class folders under ``root/train`` and ``root/val``.

    ``num_classes`` is inferred from the train folders; passing it checks it (and lets a model be
    built before the data is reachable). ``class_names`` are timm's ImageNet-1k descriptions when every
    folder is a known wnid, else the folder names; ``wnids`` are the folder names.
    """

    dataset_name = "ImageNet"
    native_size = 224
    fixed_size = False
    default_interpolation = "bicubic"
    default_crop_pct = 0.875
    default_augment_kwargs = {"scale": (0.08, 1.0), "hflip": 0.5, "color_jitter": 0.4}

    def __init__(
        self,
        root: str | Path | None = None,
        num_classes: int | None = None,
        train_dir: str = "train",
        val_dir: str = "val",
        **kwargs,
    ) -> None:
        super().__init__(root=root, **kwargs)
        self.train_dir, self.val_dir = train_dir, val_dir
        self._given_num_classes = num_classes
        self._wnids: list[str] | None = None
        self.in_chans = 3
        self.mean, self.std = tuple(IMAGENET_DEFAULT_MEAN), tuple(IMAGENET_DEFAULT_STD)

    # classes are read from disk lazily, so the module can be built before the data is reachable
    @property
    def wnids(self) -> list[str]:
        if self._wnids is None:
            self._wnids = self._locate()
        return self._wnids

    @property
    def num_classes(self) -> int:
        if self._wnids is None and self._given_num_classes is not None:
            try:
                self._wnids = self._locate()
            except DatasetNotFoundError:
                return self._given_num_classes
        return len(self.wnids)

    @property
    def class_names(self) -> list[str]:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        known = set(info.label_names())
        if all(w in known for w in self.wnids):
            return [info.label_name_to_description(w) for w in self.wnids]
        return list(self.wnids)

    def _how_to_get(self) -> list[str]:
        return [
            "ImageNet cannot be downloaded automatically: get ILSVRC2012 from https://image-net.org",
            f"lay it out as <root>/{self.train_dir}/<wnid>/*.JPEG and <root>/{self.val_dir}/<wnid>/*.JPEG "
            "(sort the flat validation archive into wnid folders, e.g. with valprep.sh)",
            "set root (config: VITREL_DATA_ROOT) to the folder holding train/ and val/",
        ]

    def _locate(self) -> list[str]:
        """Check the layout; return the sorted class folder names of train."""
        if self.root is None:
            raise DatasetNotFoundError(self.dataset_name, [], self._how_to_get(), detail="No root given.")
        root = self.root.absolute()
        train, val = root / self.train_dir, root / self.val_dir
        searched = [train, val]
        for d in (train, val):
            if not d.is_dir():
                raise DatasetNotFoundError(self.dataset_name, searched, self._how_to_get(), detail=f"No folder {d}.")
        wnids, val_classes = _subdirs(train), _subdirs(val)
        if not wnids:
            raise DatasetNotFoundError(
                self.dataset_name, searched, self._how_to_get(), detail=f"{train} has no class folders."
            )
        if not val_classes:
            raise DatasetNotFoundError(
                self.dataset_name,
                searched,
                self._how_to_get(),
                detail=f"{val} has no class folders (a flat val/ must be sorted into <wnid>/ folders).",
            )
        extra = sorted(set(val_classes) - set(wnids))
        if extra:
            raise ValueError(f"{val} has class folders not in {train}: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        if self._given_num_classes is not None and self._given_num_classes != len(wnids):
            raise ValueError(f"num_classes={self._given_num_classes} but {train} has {len(wnids)} class folders")
        return wnids

    def eval_transform(self, img_size: int | None = None):
        """timm's evaluation pipeline: ``create_transform(is_training=False)`` (resize, centre crop, normalise)."""
        from timm.data import create_transform

        return create_transform(
            img_size or self.img_size,
            is_training=False,
            interpolation=self.interpolation,
            crop_pct=self.crop_pct,
            mean=tuple(self.mean),
            std=tuple(self.std),
        )

    def _load_raw(self, split: str) -> Dataset:
        wnids = self.wnids
        folder = self.root.absolute() / (self.train_dir if split == "train" else self.val_dir)  # type: ignore[union-attr]
        return FixedClassImageFolder(folder, wnids, allow_empty=split != "train")

    def __repr__(self) -> str:
        try:
            n = self.num_classes
        except DatasetNotFoundError:
            n = "?"
        name = type(self).__name__
        return f"{name}(root={self.root}, num_classes={n}, img_size={self.img_size}, augment={self.augment})"
