"""Data: Lightning DataModules for Fashion-MNIST, CIFAR-10/100, ImageNet and any uint8 arrays, plus study transforms.

The Hydra configs in ``conf/data/`` build them through ``_target_``. See ``base.py`` for the shared
contract, ``memory.py`` for the device-resident loader (``loader="memory"``) and ``augment.py`` for its
batched augmentation, and ``transforms.py`` for the per-sample pipelines, the translation canvas and the
resize wrappers (position-scheme generalisation studies).
"""

from __future__ import annotations

from vitrel.data.arrays import ArrayDataModule
from vitrel.data.augment import BatchAugment
from vitrel.data.base import (
    ArrayImageDataset,
    DatasetIntegrityError,
    DatasetNotFoundError,
    SplitMismatchError,
    VisionDataModule,
    seeded_split,
)
from vitrel.data.cifar import CIFARDataModule
from vitrel.data.fashion_mnist import FashionMNISTDataModule, read_idx, write_idx
from vitrel.data.imagenet import ImageNetDataModule
from vitrel.data.memory import MemoryBudgetError, MemoryLoader, TensorImageDataset
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
    "ArrayDataModule",
    "ArrayImageDataset",
    "BatchAugment",
    "CIFARDataModule",
    "DatasetIntegrityError",
    "DatasetNotFoundError",
    "FashionMNISTDataModule",
    "ImageNetDataModule",
    "MappedDataset",
    "MemoryBudgetError",
    "MemoryLoader",
    "ResizedDataset",
    "SplitMismatchError",
    "TensorImageDataset",
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
