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

Shards (``source=...``, a name for ``timm.data.create_dataset``; the same transforms):

* ``wds/<any>``: webdataset tar shards in ``root`` with timm's ``_info.json`` (splits ``train_split`` and
  ``val_split``; written by ``python -m vitrel.data.shards write-wds``);
* ``hfids/<name>``: a Hugging Face data set streamed (``<name>``: a local folder, e.g. one written by
  ``python -m vitrel.data.shards write-hf``, or a hub id; ``root`` is its cache folder);
* ``hfds/<name>``: the same read map-style (random access: the ordinary samplers, exact resume);
* ``tfds/<name>``: TensorFlow Datasets (``num_classes`` must be given).

The iterable ones (``wds``, ``hfids``, ``tfds``) split every epoch by rank and loader worker in timm's
readers (whole shards per worker for ``wds``): each worker yields ``ceil(N / (ranks * workers))`` samples
rounded up to a whole number of batches, repeating its own shards if they hold fewer and stopping early if
they hold more, so every rank has the same number of batches
(:func:`vitrel.data.shards.epoch_samples_per_rank`). ``wds`` needs at least ``ranks * workers`` shards
(else a worker would get none and its rank fewer batches: refused). Mid-epoch resume is not exact for them
(a warning says so; see docs/data.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from PIL import Image, UnidentifiedImageError
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import ImageFolder

from vitrel.data.base import DatasetNotFoundError, VisionDataModule
from vitrel.data.datasets import (
    IMG_EXTENSIONS,
    ON_BAD_SAMPLE,
    ClassFoldersMismatchError,
    check_val_classes,
    class_folder_samples,
    class_folders,
    load_rgb,
    rgb_8bit,
)
from vitrel.data.unreadable import LeaveOutCollate, SkipUnreadable

log = logging.getLogger(__name__)

#: prefixes of ``timm.data.create_dataset`` names this module reads; the iterable (streamed) ones
SHARD_PREFIXES = ("wds", "hfids", "hfds", "tfds")
ITERABLE_PREFIXES = ("wds", "hfids", "tfds")

__all__ = [
    "ImageNetDataModule",
    "FixedClassImageFolder",
    "LazyClasses",
    "locate_class_folders",
    "ClassFoldersMismatchError",
    "check_val_classes",
]


#: what a file that cannot be read may raise while it is loaded (PIL: ``OSError`` for a truncated or unknown file,
#: ``SyntaxError`` for some broken PNGs, ``DecompressionBombError``; :func:`load_rgb`: ``ValueError``)
READ_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


class FixedClassImageFolder(SkipUnreadable, ImageFolder):
    """``ImageFolder`` with a given class list (so val uses train's class indices). Images load as RGB with 16-bit
    ones scaled to 8 bits (:func:`~vitrel.data.datasets.load_rgb`; torchvision's loader clips them) unless ``loader``
    is given. A file that cannot be read (truncated, empty, not an image) raises a
    :class:`~vitrel.data.datasets.BadSampleError` naming it and ``data.on_bad_sample=skip`` (``on_bad_sample="raise"``),
    or, with ``"skip"``, is logged by name and the next readable file of the split, with its own label, is returned in
    its place; in a
    :meth:`~vitrel.data.unreadable.SkipUnreadable.leaving_out` copy (evaluation), the sample is ``None`` (left out)
    (:class:`~vitrel.data.unreadable.SkipUnreadable` counts them)."""

    noun = "image file"
    read_errors = READ_ERRORS

    def __init__(self, root: str | Path, classes: list[str], on_bad_sample: str = "raise", **kwargs) -> None:
        if on_bad_sample not in ON_BAD_SAMPLE:  # (before the walk)
            raise ValueError(f"on_bad_sample must be one of {ON_BAD_SAMPLE}, got {on_bad_sample!r}")
        kwargs.setdefault("loader", load_rgb)
        self._fixed_classes = list(classes)
        try:
            super().__init__(str(root), **kwargs)
        except FileNotFoundError as e:  # (an empty class folder: torchvision names the class, not the folder)
            raise FileNotFoundError(f"{root}: {e}") from e
        self.init_skips(on_bad_sample)  # (its flags: one a file)

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        return self._fixed_classes, {c: i for i, c in enumerate(self._fixed_classes)}

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        """torchvision's walk (:func:`~vitrel.data.datasets.walk_files`), passing over macOS's AppleDouble files
        (``._<name>.jpg``, not images: :func:`~vitrel.data.datasets.is_apple_double`) as it passes over
        ``.DS_Store``, hidden and system folders in the class folders (``.ipynb_checkpoints``, ``@eaDir``'s
        thumbnails: one warning names them) and links back up to a folder the walk is in (a warning each)."""
        if (extensions is None) == (is_valid_file is None):  # (neither or both: torchvision's error)
            return ImageFolder.make_dataset(directory, class_to_idx, extensions, is_valid_file, allow_empty)
        if is_valid_file is None:  # (ImageFolder hands over torchvision's list: vitrel's, predict.py's, with .gif)
            extensions = IMG_EXTENSIONS
        return class_folder_samples(directory, class_to_idx, extensions, is_valid_file, allow_empty)

    def bad_reason(self, path: str, err: BaseException) -> str:
        if isinstance(err, UnidentifiedImageError):  # (PIL's text names a file object, not the file)
            return "an empty file" if os.path.getsize(path) == 0 else "not an image file PIL can identify"
        return super().bad_reason(path, err)

    def sample_path(self, index: int) -> str:
        return self.samples[index][0]

    def __getitem__(self, index: int) -> tuple[Any, Any] | None:
        def read(i: int) -> tuple[Any, int]:
            path, target = self.samples[i]
            return self.loader(path), target

        item = self.read_or_skip(index, read)
        if item is None:  # (left out: evaluation)
            return None
        sample, target = item
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target


def _reader_ranks(ds: Dataset) -> tuple[int, int]:
    """``(world size, rank)`` a timm iterable data set's reader splits its shards by."""
    reader = ds.reader  # type: ignore[attr-defined]
    return getattr(reader, "dist_num_replicas", 1), getattr(reader, "dist_rank", 0)


def _eval_wds(root: str | None, source: str, split: str, transform=None, **kwargs: Any) -> Dataset:
    """``timm.data.create_dataset(source, ...)`` of a webdataset evaluation split, through
    :class:`~vitrel.data.shards.EvalReaderWds` (``kwargs``: the reader's, as timm's ``create_reader`` takes them)."""
    from timm.data import IterableImageDataset

    from vitrel.data.shards import EvalReaderWds

    kwargs = {k: v for k, v in kwargs.items() if v is not None and k != "download"}
    reader = EvalReaderWds(root=root, name=source.partition("/")[2], split=split, **kwargs)
    return IterableImageDataset(root, reader=reader, transform=transform)


ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".7z")


def _layout_hint(root: Path, missing: Path, train_dir: str, val_dir: str) -> str:
    """What a missing split folder most likely means: an archive not extracted, ``root`` one level off, or class folders
    of one's own in another layout (a ``valid/`` or ``test/`` folder beside ``train/``, or none)."""
    archives = [missing.name + a for a in ARCHIVES if (root / (missing.name + a)).is_file()]
    if archives:
        return f" {root / archives[0]} is an archive: extract it (class folders are read, not archives)."
    if (root / train_dir / train_dir).is_dir():
        return f" {root / train_dir} holds a {train_dir}/ folder: data.root={root / train_dir}?"
    if root.name == train_dir:
        return f" data.root is a {train_dir}/ folder itself: give the folder holding {train_dir}/ and {val_dir}/."
    if missing.name == val_dir and (root / train_dir).is_dir():  # (class folders of one's own: another layout)
        others = [d.name for d in sorted(root.iterdir()) if d.is_dir() and d.name != train_dir and class_folders(d)]
        if others:
            return f" {root} holds {', '.join(f'{d}/' for d in others)} beside {train_dir}/: data.val_dir={others[0]}?"
        return (
            f" {val_dir}/ is the test split (and validation, unless data.val_fraction holds out part of {train_dir}/):"
            f" move some files of each class into {val_dir}/<class>/, or set data.val_dir to another folder of {root}."
        )
    return ""


def locate_class_folders(
    name: str,
    root: Path | None,
    train_dir: str,
    val_dir: str,
    how_to_get: list[str],
    num_classes: int | None = None,
) -> list[str]:
    """Check that ``root/train_dir`` holds two or more class folders (as many as ``num_classes`` when given) and
    ``root/val_dir`` class folders among train's; return train's sorted names. Raises ``DatasetNotFoundError``
    with ``how_to_get`` (a folder missing or empty, one class), :class:`ClassFoldersMismatchError` (classes that
    disagree)."""
    if root is None:
        raise DatasetNotFoundError(name, [], how_to_get, detail="No root given.")
    root = root.absolute()
    train, val = root / train_dir, root / val_dir
    searched = [train, val]
    for d in (train, val):
        if not d.is_dir():
            hint = _layout_hint(root, d, train_dir, val_dir)
            raise DatasetNotFoundError(name, searched, how_to_get, detail=f"No folder {d}.{hint}")
    classes, val_classes = class_folders(train), class_folders(val)
    if not classes:
        raise DatasetNotFoundError(name, searched, how_to_get, detail=f"{train} has no class folders.")
    if len(classes) == 1:  # (else torchmetrics' "num_classes ... larger than 1", through Hydra, at the module)
        raise ClassFoldersMismatchError(  # (found, so not DatasetNotFoundError's "not found")
            f"{train} has one class folder ({classes[0]}): a classifier needs two or more, one per class"
        )
    if not val_classes:
        raise DatasetNotFoundError(
            name,
            searched,
            how_to_get,
            detail=f"{val} has no class folders (a flat val/ must be sorted into one folder per class).",
        )
    check_val_classes(train, val, classes, val_classes)
    if num_classes is not None and num_classes != len(classes):
        raise ClassFoldersMismatchError(f"num_classes={num_classes} but {train} has {len(classes)} class folders")
    return classes


class LazyClasses:
    """Mixin (before the ``VisionDataModule``): a data module's classes read by its ``_locate()`` on first use
    (``classes``), so that the module can be built before its data is reachable; ``num_classes`` is then the
    ``num_classes`` it was given (``_given_num_classes``, set by the subclass), or, when none was, ``_locate()``'s
    ``DatasetNotFoundError``."""

    _given_num_classes: int | None
    _classes: list[str] | None = None

    @property
    def classes(self) -> list[str]:
        """The class names, read by ``_locate()`` on first use."""
        if self._classes is None:
            self._classes = self._locate()
        return self._classes

    @property
    def num_classes(self) -> int:
        """The number of classes; the given ``num_classes`` while the classes cannot be reached."""
        try:
            return len(self.classes)
        except DatasetNotFoundError:
            if self._given_num_classes is None:
                raise
            return int(self._given_num_classes)


class ImageNetDataModule(LazyClasses, VisionDataModule):
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
        source: str | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        num_samples: int | None = None,
        dataset_kwargs: dict[str, Any] | None = None,
        on_bad_sample: str = "raise",
        **kwargs,
    ) -> None:
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f"on_bad_sample must be one of {ON_BAD_SAMPLE}, got {on_bad_sample!r}")
        self.on_bad_sample = on_bad_sample
        super().__init__(root=root, **kwargs)
        self.train_dir, self.val_dir = train_dir, val_dir
        self.source = source or None
        self.train_split, self.val_split = train_split, val_split
        self.num_samples = None if num_samples is None else int(num_samples)
        self.dataset_kwargs = dict(dataset_kwargs or {})
        if self.source is not None:
            prefix = self.source.partition("/")[0].lower()
            if "/" not in self.source or prefix not in SHARD_PREFIXES:
                raise ValueError(f"source must be one of {[p + '/<name>' for p in SHARD_PREFIXES]}, got {source!r}")
            if self.val_fraction > 0:
                raise ValueError("val_fraction > 0 needs the ImageFolder path (source=null): use val_split")
            if self.loader != "workers":
                raise ValueError("source=... (shards) streams through DataLoader workers: use loader=workers")
        self._given_num_classes = num_classes
        self.in_chans = 3
        self.mean, self.std = tuple(IMAGENET_DEFAULT_MEAN), tuple(IMAGENET_DEFAULT_STD)

    @property
    def wnids(self) -> list[str]:
        """The class names (ImageNet's WordNet ids), read on first use: ``classes``."""
        return self.classes

    @property
    def class_names(self) -> list[str]:
        from timm.data import ImageNetInfo

        info = ImageNetInfo()
        known = set(info.label_names())
        if all(w in known for w in self.wnids):
            return [info.label_name_to_description(w) for w in self.wnids]
        return list(self.wnids)

    @property
    def prefix(self) -> str | None:
        """``wds``, ``hfids``, ``hfds``, ``tfds`` (``source=...``), or None (the ImageFolder path)."""
        return None if self.source is None else self.source.partition("/")[0].lower()

    @property
    def iterable(self) -> bool:
        """Whether the data set is one of timm's ``IterableImageDataset`` s (``wds``, ``hfids``, ``tfds``)."""
        return self.prefix in ITERABLE_PREFIXES

    def _how_to_get(self) -> list[str]:
        if self.source is not None:
            return [
                "write shards from an ImageFolder tree: python -m vitrel.data.shards write-wds ROOT OUT "
                "(or write-hf ROOT OUT), then data.root=OUT data.source=wds/imagenet",
                "or point data.root at existing webdataset shards with timm's _info.json",
            ]
        return [
            "ImageNet cannot be downloaded automatically: get ILSVRC2012 from https://image-net.org",
            f"lay it out as <root>/{self.train_dir}/<wnid>/*.JPEG and <root>/{self.val_dir}/<wnid>/*.JPEG "
            "(sort the flat validation archive into wnid folders, e.g. with valprep.sh)",
            "set root (config: VITREL_DATA_ROOT) to the folder holding train/ and val/",
        ]

    def _locate(self) -> list[str]:
        """Check the layout; return the sorted class folder names of train."""
        if self.source is not None:
            return self._locate_shards()
        return locate_class_folders(
            self.dataset_name, self.root, self.train_dir, self.val_dir, self._how_to_get(), self._given_num_classes
        )

    def _locate_shards(self) -> list[str]:
        """Class names of a shard data set: ``_info.json``'s ``classes`` (wds, as written by
        ``vitrel.data.shards``), the ``ClassLabel`` names (Hugging Face), else ``0..num_classes-1``."""
        names: list[str] | None = None
        if self.prefix == "wds":
            if self.root is None:
                raise DatasetNotFoundError(self.dataset_name, [], self._how_to_get(), detail="No root given.")
            info = self.root.absolute() / "_info.json"
            meta = json.loads(info.read_text()) if info.is_file() else {}
            names = meta.get("classes")
            for split in (self.train_split, self.val_split):
                is_pattern = ".tar" in split or ".." in split  # timm: brace pattern of tars, '|<num_samples>'
                if is_pattern:
                    continue
                if not meta:
                    raise DatasetNotFoundError(self.dataset_name, [info], self._how_to_get(), detail=f"No {info}.")
                if split not in meta.get("splits", {}):
                    raise ValueError(f"split {split!r} is not in {info} (it has {sorted(meta.get('splits', {}))})")
        elif self.prefix in ("hfds", "hfids"):
            import datasets

            builder = datasets.load_dataset_builder(self.source.split("/", 1)[1], cache_dir=self._root_str())
            label = (builder.info.features or {}).get(self.dataset_kwargs.get("target_key", "label"))
            names = list(label.names) if isinstance(label, datasets.ClassLabel) else None
        if names is None:
            if self._given_num_classes is None:
                raise ValueError(f"{self.source} states no class names: give num_classes")
            names = [str(i) for i in range(self._given_num_classes)]
        if self._given_num_classes is not None and self._given_num_classes != len(names):
            raise ValueError(f"num_classes={self._given_num_classes} but {self.source} has {len(names)} classes")
        return list(names)

    def _root_str(self) -> str | None:
        return None if self.root is None else str(self.root.absolute())

    def _split_name(self, split: str) -> str:
        return self.train_split if split == "train" else self.val_split

    def _reader_kwargs(self) -> dict[str, Any]:
        """``dataset_kwargs`` for ``timm.data.create_dataset``. timm's readers convert each image with
        ``convert("RGB")``, which clips a 16-bit image at 255; unless ``input_img_mode`` is given, wds / hf readers
        hand over the image as decoded (``input_img_mode=""``: no conversion; ``None`` is dropped for timm's default)
        and :func:`~vitrel.data.datasets.rgb_8bit` makes it RGB, scaled, as class folders do (TFDS decodes to 8 bits
        itself)."""
        kwargs = dict(self.dataset_kwargs)
        if self.prefix != "tfds":
            kwargs.setdefault("input_img_mode", "")
        return kwargs

    def make_shard_dataset(self, split: str, transform=None, training: bool | None = None) -> Dataset:
        """``timm.data.create_dataset(self.source, ...)`` for ``split`` (``train`` or ``val``/``test``) with
        ``transform`` (default: this module's train / eval pipeline). The iterable ones take the rank and
        world size from ``torch.distributed`` when it is initialised, so build them in each process (the
        loaders do)."""
        from timm.data import create_dataset

        from vitrel.data.shards import ShardSplitError, guard_bad_samples

        if not self.iterable:
            raise ValueError(f"{self.source} is map-style: use make_dataset / raw_dataset")
        self.wnids  # noqa: B018 (checks the data set and num_classes)
        train = split == "train" if training is None else training
        if transform is None:
            transform = self.train_transform() if split == "train" else self.eval_transform()
        kwargs = self._reader_kwargs()
        if kwargs.get("input_img_mode") == "":  # the images as decoded, made RGB here
            from torchvision.transforms import Compose

            transform = Compose([rgb_8bit, transform])
        kwargs.update(
            is_training=train,
            batch_size=self.batch_size if train else self.eval_batch_size,
            seed=self.seed,
            num_samples=self.num_samples if split == "train" else None,
            transform=transform,
        )
        try:
            if self.prefix == "wds" and not train:  # each sample once, also under DDP
                ds = _eval_wds(self._root_str(), self.source, self._split_name(split), **kwargs)
            else:
                ds = create_dataset(self.source, root=self._root_str(), split=self._split_name(split), **kwargs)
        except RuntimeError as e:  # (timm's reader: a training split of unknown length)
            if "num_samples not specified" not in str(e):
                raise
            name = self._split_name(split)
            raise ShardSplitError(
                f"the training split {name!r} states no number of samples (an epoch's length): append it, "
                f"\"data.train_split='{name}|<samples>'\", or give data.num_samples=<samples>"
            ) from None
        ds.set_loader_cfg(num_workers=self.num_workers)
        return guard_bad_samples(ds, self.on_bad_sample)  # a sample that cannot be decoded: named, raised or skipped

    def make_dataset(self, split: str, img_size: int | None = None, transform=None, **kwargs) -> Dataset:
        if not self.iterable:
            return super().make_dataset(split, img_size=img_size, transform=transform, **kwargs)
        if kwargs.get("canvas_size") is not None:
            raise ValueError("canvas_size needs fixed-size images")
        tf = transform if transform is not None else self.eval_transform(img_size)
        return self.make_shard_dataset(split, transform=tf, training=False)

    def setup(self, stage: str | None = None) -> None:
        if not self.iterable:
            super().setup(stage)
            return
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
        for split in splits.get(stage, ("train", "val", "test")):  # type: ignore[arg-type]
            if split not in self._datasets:
                self._datasets[split] = self.make_shard_dataset(split)

    def _ranks(self) -> tuple[int, int]:
        """The trainer's ``(world size, rank)``; shards without a trainer: ``torch.distributed``'s when it is
        initialised (what timm's readers split the shards by), else ``(1, 0)``."""
        import torch.distributed as dist

        if self.iterable and self.trainer is None and dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return super()._ranks()

    def _source(self, split: str) -> tuple[Dataset, Any]:
        """The split's files; an evaluation split's leave out what cannot be read (``on_bad_sample="skip"``: each
        file scored once, :class:`~vitrel.data.unreadable.SkipUnreadable`), where training reads the next file."""
        ds, idx = super()._source(split)
        return (ds.leaving_out() if split != "train" and isinstance(ds, SkipUnreadable) else ds), idx

    @property
    def collate_fn(self) -> Any:
        """The base collate, dropping the samples an evaluation split left out (``on_bad_sample="skip"``)."""
        collate = super().collate_fn
        return LeaveOutCollate(collate) if self.on_bad_sample == "skip" else collate

    def _loader(self, split: str) -> DataLoader:
        if not self.iterable:
            return super()._loader(split)
        # (imported here: `python -m vitrel.data.shards` runs that module alone)
        from vitrel.data.shards import ShardCountError, ShardLoader

        train = split == "train"
        world, rank = self._ranks()
        ds = self._datasets.get(split)
        if ds is None or _reader_ranks(ds) != (world, rank):  # e.g. set up before the process group was up
            ds = self._datasets[split] = self.make_shard_dataset(split)
        if _reader_ranks(ds) != (world, rank):
            raise RuntimeError(
                f"{self.source}: the trainer has rank {rank} of {world} but torch.distributed says "
                f"{_reader_ranks(ds)[1]} of {_reader_ranks(ds)[0]}; timm's readers split the shards by the latter"
            )
        reader = ds.reader
        shards = getattr(getattr(reader, "split_info", None), "filenames", None)
        workers = world * max(1, self.num_workers)
        if self.prefix == "wds" and shards is not None and len(shards) < workers:
            msg = (
                f"{self.source} split {self._split_name(split)!r} has {len(shards)} shards for {world} ranks x "
                f"{max(1, self.num_workers)} loader workers = {workers}: a worker without a shard yields nothing"
            )
            if train:
                raise ShardCountError(
                    msg + " and its rank would run fewer batches than the others (a DDP hang). Use num_workers <= "
                    "shards / ranks, or write more shards (a multiple of ranks x workers, of equal size, is exact)"
                )
            if len(shards) < world:  # (evaluation: the shards go to the ranks first, vitrel.data.shards.eval_shards)
                raise ShardCountError(
                    f"{self.source} split {self._split_name(split)!r} has {len(shards)} shards for {world} ranks: a "
                    "rank without one would run no evaluation while the others wait for it (a DDP hang). Write the "
                    "split in at least as many shards as ranks, or evaluate on fewer devices (eval.py "
                    "trainer.devices=1)"
                )
            log.warning(msg + " (here in evaluation: those workers stay idle)")
        if train and self.train_order_seed is not None:
            log.warning(
                "%s is an iterable (streamed) data set: train_order_seed (ExactResume) does not apply and a run "
                "resumed mid-epoch is not exact: the interrupted epoch restarts from its beginning and stops at the "
                "number of batches it still owed (see docs/data.md, ImageNet from shards)",
                self.source,
            )
        return ShardLoader(
            ds,
            collate_fn=self.collate_fn,
            batch_size=self.batch_size if train else self.eval_batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and self.device.type == "cuda",
            persistent_workers=self.num_workers > 0,
            epoch_of=(lambda: self.trainer.current_epoch if self.trainer is not None else None) if train else None,
        )

    def eval_transform(self, img_size: int | None = None):
        """timm's evaluation pipeline: ``create_transform(is_training=False)`` (resize, centre crop, normalise); with
        ``packing`` (and no ``img_size``), each image at its own aspect ratio as a NaFlex dict."""
        from timm.data import create_transform

        if self.packing is not None and img_size is None:
            return self.naflex_transform(train=False)

        return create_transform(
            img_size or self.img_size,
            is_training=False,
            interpolation=self.interpolation,
            crop_pct=self.crop_pct,
            mean=tuple(self.mean),
            std=tuple(self.std),
        )

    def _load_raw(self, split: str) -> Dataset:
        if self.prefix == "hfds":  # map-style: raw (PIL image, label) pairs, the ordinary samplers
            from timm.data import create_dataset

            self.wnids  # noqa: B018
            name, split_name, kwargs = self.source, self._split_name(split), self._reader_kwargs()
            if kwargs.get("input_img_mode") == "":
                kwargs["transform"] = rgb_8bit
            return create_dataset(name, root=self._root_str(), split=split_name, **kwargs)
        wnids = self.wnids
        folder = self.root.absolute() / (self.train_dir if split == "train" else self.val_dir)  # type: ignore[union-attr]
        name = "train" if split == "train" else "val"
        rank_zero_info(f"{name}: listing the image files of {folder} ...")
        started = time.monotonic()
        try:
            ds = FixedClassImageFolder(folder, wnids, self.on_bad_sample, allow_empty=split != "train")
        except FileNotFoundError as e:  # a train class folder without images: a class the model could never learn
            raise ClassFoldersMismatchError(
                f"{e}: every folder of {folder} is a class of the model; remove the empty one(s) or put their images "
                "in (a val folder may lack classes)"
            ) from None
        held = set(ds.targets)
        missing = [w for i, w in enumerate(wnids) if i not in held]
        which, none = f"the {len(wnids)}", ""
        if missing:  # (a val folder may lack classes: say which, once)
            which = f"{len(held)} of the {len(wnids)}"
            more = " ..." if len(missing) > 10 else ""
            none = f"; none of: {', '.join(missing[:10])}{more} (their per-class scores stay empty)"
        took = time.monotonic() - started
        rank_zero_info(f"{name}: {len(ds):,} image files in {which} classes of {folder} ({took:.1f} s){none}")
        return ds

    def __repr__(self) -> str:
        try:
            n = self.num_classes
        except DatasetNotFoundError:
            n = "?"
        name, src = type(self).__name__, "" if self.source is None else f"source={self.source}, "
        return f"{name}({src}root={self.root}, num_classes={n}, img_size={self.img_size}, augment={self.augment})"
