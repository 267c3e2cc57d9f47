"""Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017): 28x28 grayscale, 10 classes, 60k train / 10k test.

Fashion-MNIST is (c) 2017 Zalando SE (Zalando Research), https://github.com/zalandoresearch/fashion-mnist,
released under the MIT License; see ``FASHION_MNIST_LICENSE.txt`` beside this file. The embedded
subset ``fashion_mnist_subset.npz`` (10,000 train / 2,000 test images, 1000 / 200 per class, drawn
with a fixed seed by ``python -m vitrel.data.make_subset``) is a copy of part of that data set.

``subset="embedded"`` (default) uses that shipped subset: no files needed. ``subset="full"`` looks, in
order, for the raw IDX files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each plain or ``.gz``) in

1. ``root``, 2. ``root/FashionMNIST/raw`` (torchvision's layout), 3. ``/usr/share/datasets/fashion-mnist``
(Debian/Ubuntu package ``dataset-fashion-mnist``),

and ``prepare_data()`` downloads them with torchvision into ``root/FashionMNIST/raw`` when none is
found and ``download=True``.

IDX format (big-endian): ``0x00 0x00 <type> <ndim>`` (type 0x08 = uint8: magic 2051 for images of
``ndim=3``, 2049 for labels of ``ndim=1``), ``ndim`` int32 sizes, then the data in C order.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from vitrel.data.base import DatasetNotFoundError, VisionDataModule

__all__ = [
    "FashionMNISTDataModule",
    "read_idx",
    "write_idx",
    "locate_fashion_mnist",
    "load_fashion_mnist",
    "load_embedded_subset",
    "DEBIAN_DIR",
    "SUBSET_PATH",
    "FASHION_MNIST_CLASSES",
]

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
SUBSET_PATH = Path(__file__).with_name("fashion_mnist_subset.npz")
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MEAN, STD = 0.2860, 0.3530

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (gzip-compressed if its name ends in ``.gz``) into a numpy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic {data[:4].hex()})")
    ndim = data[3]
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(data) - offset != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but {len(data) - offset} bytes follow")
    arr = np.frombuffer(data, dtype=dtype, offset=offset).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as an IDX file (gzip-compressed if the name ends in ``.gz``)."""
    array = np.ascontiguousarray(array)
    if array.dtype != np.uint8:
        raise ValueError(f"write_idx writes uint8 only, got {array.dtype}")
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())


def _find_file(directory: Path, name: str) -> Path | None:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def candidate_dirs(root: str | Path | None) -> list[Path]:
    """Directories searched for the full set, in order."""
    dirs = []
    if root is not None:
        root = Path(root).expanduser().absolute()
        dirs += [root, root / "FashionMNIST" / "raw"]
    return dirs + [DEBIAN_DIR]


def locate_fashion_mnist(root: str | Path | None) -> dict[str, tuple[Path, Path]]:
    """``{split: (images_path, labels_path)}`` from the first directory holding all four files."""
    dirs = candidate_dirs(root)
    for d in dirs:
        found = {split: tuple(_find_file(d, n) for n in names) for split, names in FILES.items()}
        if all(p is not None for pair in found.values() for p in pair):
            return found  # type: ignore[return-value]
    names = ", ".join(f"{n}[.gz]" for pair in FILES.values() for n in pair)
    raise DatasetNotFoundError(
        "Fashion-MNIST (full)",
        dirs,
        [
            "apt-get install dataset-fashion-mnist  (Debian/Ubuntu: gz IDX files in /usr/share/datasets/fashion-mnist)",
            "download=True (train.py: data.download=true) with a root: prepare_data() downloads with torchvision into "
            "<root>/FashionMNIST/raw",
            f"or put the raw IDX files ({names}) in root",
            'or use subset="embedded" (10k/2k subset shipped with vitrel; train.py: data=fashion_mnist)',
        ],
        detail="Each directory needs all four IDX files (plain or .gz).",
    )


def load_fashion_mnist(root: str | Path | None, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Full-set ``(images uint8 [N, 28, 28], labels uint8 [N])`` of ``split`` in ``{"train", "test"}``."""
    img_path, lbl_path = locate_fashion_mnist(root)[split]
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f"{img_path}, {lbl_path}: shapes {images.shape} / {labels.shape} are not [N,H,W] / [N]")
    return images.astype(np.uint8, copy=False), labels.astype(np.uint8, copy=False)


def load_embedded_subset(split: str) -> tuple[np.ndarray, np.ndarray]:
    """The shipped stratified subset: 10,000 train / 2,000 test (1000 / 200 per class)."""
    if not SUBSET_PATH.is_file():
        raise DatasetNotFoundError(
            "Fashion-MNIST (embedded subset)",
            [SUBSET_PATH],
            ["python -m vitrel.data.make_subset  (rebuilds it from the full set)", 'or use subset="full"'],
        )
    with np.load(SUBSET_PATH) as z:
        return z[f"x_{split}"], z[f"y_{split}"]


class FashionMNISTDataModule(VisionDataModule):
    """Fashion-MNIST, embedded subset or full set (see the module docstring for where it looks).

    ``in_chans=1`` (grayscale) by default; ``in_chans=3`` repeats the channel (mean/std repeated).
    Normalisation: mean 0.2860, std 0.3530. Held in memory by default (``loader="memory"``: 10k + 2k
    images are 9 MB, the full set 55 MB); the default batch augmentation (with ``augment``) shifts by up
    to 2 pixels and mirrors half the images (clothes keep their class in a mirror).
    """

    dataset_name = "Fashion-MNIST"
    native_size = 28
    default_augment_kwargs = {"scale": (0.5, 1.0), "hflip": 0.5, "color_jitter": 0.0}
    memory_capable = True
    default_val_fraction = 0.1  # (conf/data: the same)
    default_loader = "memory"
    default_batch_augment = {"translate": 2, "hflip": 0.5}

    def __init__(self, root: str | Path | None = None, subset: str = "embedded", in_chans: int = 1, **kwargs) -> None:
        if subset not in ("embedded", "full"):
            raise ValueError(f'subset must be "embedded" or "full", got {subset!r}')
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        super().__init__(root=root, **kwargs)
        self.subset = subset
        self.num_classes = 10
        self.in_chans = in_chans
        self.mean = (MEAN,) * in_chans
        self.std = (STD,) * in_chans
        self.class_names = list(FASHION_MNIST_CLASSES)

    @property
    def data_dir(self) -> Path:
        """Directory the full set is read from (raises ``DatasetNotFoundError``); the .npz for the subset."""
        if self.subset == "embedded":
            return SUBSET_PATH
        return locate_fashion_mnist(self.root)["train"][0].parent

    def _locate(self) -> Path:
        return self.data_dir

    def prepare_data(self) -> None:
        if self.subset == "embedded":
            return
        try:
            locate_fashion_mnist(self.root)
            return
        except DatasetNotFoundError as err:
            if not self.download:
                return  # setup() raises the error with the paths
            if self.root is None:
                raise DatasetNotFoundError(
                    "Fashion-MNIST (full)", err.searched, err.how_to_get, detail="download=True needs a root."
                ) from err
            missing = err
        from torchvision.datasets import FashionMNIST

        try:
            for train in (True, False):
                FashionMNIST(str(self.root), train=train, download=True)
        except Exception as exc:  # network or disk failure: report it with the paths searched
            raise DatasetNotFoundError(
                "Fashion-MNIST (full)",
                missing.searched,
                missing.how_to_get,
                detail=f"Download into {self.root / 'FashionMNIST' / 'raw'} failed: {exc!r}.",
            ) from exc

    def _load_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        if self.subset == "embedded":
            images, labels = load_embedded_subset(split)
        else:
            images, labels = load_fashion_mnist(self.root, split)
        if labels.max(initial=0) >= self.num_classes:
            raise ValueError(f"Fashion-MNIST labels must be < 10, found {int(labels.max())}")
        return images, labels
