"""Data: Lightning DataModules for Fashion-MNIST, CIFAR-10/100 and ImageNet, plus study transforms.

``build_datamodule(name, **kwargs)`` builds one by name; Hydra configs in ``conf/data/`` do the same
through ``_target_``. See ``base.py`` for the shared contract and ``transforms.py`` for the
translation canvas and resize wrappers (position-scheme generalisation studies).
"""

from __future__ import annotations

from typing import Any

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
    "build_datamodule",
    "build_transform",
    "canvas_offset",
    "list_datamodules",
    "read_idx",
    "seeded_split",
    "translate_canvas",
    "write_idx",
]

_REGISTRY: dict[str, tuple[type[VisionDataModule], dict[str, Any]]] = {
    "fashion_mnist": (FashionMNISTDataModule, {"subset": "embedded"}),
    "fashion_mnist_full": (FashionMNISTDataModule, {"subset": "full"}),
    "cifar10": (CIFARDataModule, {"num_classes": 10}),
    "cifar100": (CIFARDataModule, {"num_classes": 100}),
    "imagenet": (ImageNetDataModule, {}),
}


def list_datamodules() -> list[str]:
    """Names accepted by ``build_datamodule``."""
    return list(_REGISTRY)


def build_datamodule(name: str, **kwargs: Any) -> VisionDataModule:
    """DataModule by name (``fashion_mnist``, ``fashion_mnist_full``, ``cifar10``, ``cifar100``, ``imagenet``).

    ``kwargs`` go to the constructor and override the name's presets (e.g. ``subset="full"``).
    """
    key = name.lower().replace("-", "_")
    if key not in _REGISTRY:
        raise ValueError(f"unknown data set {name!r}; choose from {list_datamodules()}")
    cls, preset = _REGISTRY[key]
    if key.startswith("cifar") and kwargs.get("num_classes", preset["num_classes"]) != preset["num_classes"]:
        raise ValueError(f"{name} has {preset['num_classes']} classes, got num_classes={kwargs['num_classes']}")
    return cls(**{**preset, **kwargs})
