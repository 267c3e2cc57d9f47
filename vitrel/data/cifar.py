"""CIFAR-10 / CIFAR-100 (Krizhevsky, 2009): 32x32 RGB, 50k train / 10k test, torchvision's on-disk format.

``root`` holds ``cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}`` or
``cifar-100-python/{train, test, meta}`` (the extracted python-version archives; ``root`` may also
point at that folder itself). ``prepare_data()`` downloads with torchvision when the files are missing
and ``download=True``.

Integrity: with ``verify=True`` (default) every file's md5 is compared with torchvision's table of the
official release, once per setup; a mismatch raises ``DatasetIntegrityError`` naming the files. A
deliberately regenerated or converted copy (same pickle format, other bytes; e.g. the tests' tiny
files) needs ``verify=False``, which only checks that the files exist. Either way the files are then
read by torchvision's own ``CIFAR10``/``CIFAR100`` code, through a subclass whose own integrity hooks
(``_check_integrity``, ``_load_meta``) check existence only, since the md5 check was done here.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.utils import check_integrity

from vitrel.data.base import DatasetIntegrityError, DatasetNotFoundError, VisionDataModule

__all__ = ["CIFARDataModule", "CIFAR_STATS", "CIFAR10_CLASSES", "CIFAR100_CLASSES"]

CIFAR_STATS = {
    10: ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    100: ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# fmt: off
CIFAR100_CLASSES = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish", "forest",
    "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion", "lizard",
    "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange", "orchid",
    "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine", "possum",
    "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk", "skyscraper",
    "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank", "telephone",
    "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf",
    "woman", "worm",
)
# fmt: on


class _ExistenceCheckOnly:
    """Overrides torchvision's CIFAR integrity hooks to check existence only (md5 is checked by the module)."""

    def _check_integrity(self) -> bool:
        return all(
            os.path.isfile(os.path.join(self.root, self.base_folder, name))  # type: ignore[attr-defined]
            for name, _ in self.train_list + self.test_list  # type: ignore[attr-defined]
        )

    def _load_meta(self) -> None:
        path = os.path.join(self.root, self.base_folder, self.meta["filename"])  # type: ignore[attr-defined]
        with open(path, "rb") as f:
            data = pickle.load(f, encoding="latin1")
        self.classes = data[self.meta["key"]]  # type: ignore[attr-defined]
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}


class _CIFAR10(_ExistenceCheckOnly, CIFAR10):
    pass


class _CIFAR100(_ExistenceCheckOnly, CIFAR100):
    pass


class CIFARDataModule(VisionDataModule):
    """CIFAR-10 (``num_classes=10``) or CIFAR-100 (``num_classes=100``, fine labels).

    ``class_names`` start as the official names and are replaced by the ones in the meta file at setup.
    Held in memory by default (``loader="memory"``: 50k + 10k images are 176 MB); the default batch
    augmentation (with ``augment``) is the classic CIFAR one: shifts of up to 4 pixels (a random crop of
    the image padded by 4) and mirrors.
    """

    native_size = 32
    default_augment_kwargs = {"scale": (0.35, 1.0), "hflip": 0.5, "color_jitter": 0.0}
    memory_capable = True
    default_val_fraction = 0.1  # (conf/data: the same)
    default_loader = "memory"
    default_batch_augment = {"translate": 4, "hflip": 0.5}

    def __init__(self, root: str | Path | None = None, num_classes: int = 10, verify: bool = True, **kwargs) -> None:
        if num_classes not in CIFAR_STATS:
            raise ValueError(f"num_classes must be 10 or 100, got {num_classes}")
        self.dataset_name = f"CIFAR-{num_classes}"
        super().__init__(root=root, **kwargs)
        self.num_classes = num_classes
        self.verify = bool(verify)
        self.in_chans = 3
        self.mean, self.std = CIFAR_STATS[num_classes]
        self.class_names = list(CIFAR10_CLASSES if num_classes == 10 else CIFAR100_CLASSES)
        self._tv_cls = _CIFAR10 if num_classes == 10 else _CIFAR100  # reading (md5 checked by _verify)
        self._tv_download_cls = CIFAR10 if num_classes == 10 else CIFAR100  # stock class, for downloading
        self._verified = False

    @property
    def _folder(self) -> str:
        return self._tv_cls.base_folder

    def _files(self) -> list[tuple[str, str]]:
        c = self._tv_cls
        return [*c.train_list, *c.test_list, (c.meta["filename"], c.meta["md5"])]

    def _tv_root(self) -> Path | None:
        if self.root is None:
            return None
        root = self.root.absolute()
        return root.parent if root.name == self._folder and not (root / self._folder).is_dir() else root

    def _locate(self) -> Path:
        """The torchvision root (parent of the CIFAR folder); raises ``DatasetNotFoundError``."""
        tv_root = self._tv_root()
        searched = [] if tv_root is None else [tv_root / self._folder]
        missing = [name for name, _ in self._files()] if tv_root is None else []
        if tv_root is not None:
            missing = [name for name, _ in self._files() if not (tv_root / self._folder / name).is_file()]
            if not missing:
                return tv_root
        raise DatasetNotFoundError(
            self.dataset_name,
            searched,
            [
                f"download=True (train.py: data.download=true) with root set: prepare_data() downloads it into "
                f"<root>/{self._folder}",
                f"or extract the official python-version archive so that <root>/{self._folder}/ holds "
                + ", ".join(name for name, _ in self._files()),
            ],
            detail=("Missing: " + ", ".join(missing) + ".") if tv_root is not None else "No root given.",
        )

    def _verify(self, tv_root: Path) -> None:
        if not self.verify or self._verified:
            return
        bad = [n for n, md5 in self._files() if not check_integrity(str(tv_root / self._folder / n), md5)]
        if bad:
            raise DatasetIntegrityError(
                f"{self.dataset_name}: {', '.join(bad)} in {tv_root / self._folder} exist but do not match the md5 "
                "of the official release. Delete the folder and re-download (download=True; train.py: "
                "data.download=true), or, for a deliberately regenerated/converted copy in the same format, pass "
                "verify=False (train.py and eval.py: data.verify=false)."
            )
        self._verified = True

    def prepare_data(self) -> None:
        try:
            self._locate()
            return
        except DatasetNotFoundError as err:
            if not self.download:
                return  # setup() raises the error
            if self.root is None:
                raise
            missing = err
        try:
            for train in (True, False):
                self._tv_download_cls(str(self._tv_root()), train=train, download=True)
        except Exception as exc:  # network or disk failure
            raise DatasetNotFoundError(
                self.dataset_name,
                missing.searched,
                missing.how_to_get,
                detail=f"Download into {self._tv_root()} failed: {exc!r}.",
            ) from exc

    def _load_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        tv_root = self._locate()
        self._verify(tv_root)
        try:
            ds = self._tv_cls(str(tv_root), train=split == "train", download=False)
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as e:  # (a cut or foreign batch file)
            folder = os.path.join(tv_root, self._tv_cls.base_folder)
            raise ValueError(f"{self.dataset_name}: cannot read the {split} batches in {folder}: {e!r}") from e
        if len(ds.classes) != self.num_classes:
            raise ValueError(
                f"{self.dataset_name}: meta file in {tv_root} lists {len(ds.classes)} classes, expected "
                f"{self.num_classes}"
            )
        bad = [t for t in set(ds.targets) if not 0 <= t < self.num_classes]
        if bad:
            raise ValueError(
                f"{self.dataset_name}: labels out of range [0, {self.num_classes}) in the {split} batches in "
                f"{tv_root}: {sorted(bad)[:5]} (another data set's files?)"
            )
        self.class_names = list(ds.classes)
        return ds.data, np.asarray(ds.targets, dtype=np.int64)  # [N, 32, 32, 3] uint8, as torchvision reads it
