"""Data: Lightning DataModules for Fashion-MNIST, CIFAR-10/100 and ImageNet, plus study transforms.

The Hydra configs in ``conf/data/`` build them through ``_target_``. See ``base.py`` for the shared
contract and ``transforms.py`` for the translation canvas and resize wrappers (position-scheme
generalisation studies).
"""

from __future__ import annotations

from vitrel.data.base import (
    ArrayImageDataset,
    DatasetIntegrityError,
    DatasetNotFoundError,
    VisionDataModule,
    seeded_split,
)
from vitrel.data.cifar import CIFARDataModule
from vitrel.data.fashion_mnist import FashionMNISTDataModule, read_idx, write_idx
from vitrel.data.imagenet import ImageNetDataModule
from vitrel.data.transforms import (
    MappedDataset,
    ResizedDataset,
    TranslateCanvas,
    TranslatedDataset,
    build_transform,
    canvas_offset,
    translate_canvas,
)

__all__ = [
    "ArrayImageDataset",
    "CIFARDataModule",
    "DatasetIntegrityError",
    "DatasetNotFoundError",
    "FashionMNISTDataModule",
    "ImageNetDataModule",
    "MappedDataset",
    "ResizedDataset",
    "TranslateCanvas",
    "TranslatedDataset",
    "VisionDataModule",
    "build_transform",
    "canvas_offset",
    "read_idx",
    "seeded_split",
    "translate_canvas",
    "write_idx",
]
