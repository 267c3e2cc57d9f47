"""Shards: an ImageFolder tree written as webdataset tar shards or as a Hugging Face (parquet) data set, and
the loader over timm's iterable data sets (``timm.data.create_dataset("wds/..." | "hfids/..." | "tfds/...")``).

Writers (the image files' bytes are stored as they are; only formats other than JPEG/PNG/WebP are
re-encoded, as PNG)::

    python -m vitrel.data.shards write-wds ROOT OUT --shard-size 1000  # OUT/imagenet-train-000000.tar, _info.json
    python -m vitrel.data.shards write-hf  ROOT OUT --shard-size 1000  # OUT/data/train-00000-of-00002.parquet

``ROOT`` holds ``train/<class>/*`` and ``val/<class>/*`` (any of them; ``val`` is written as the split
``validation``, the name timm's and the Hugging Face ImageNet copies use). Classes are the sorted folder
names of ``train`` (``val`` uses the same indices). The sample order is shuffled (``--seed``) before it is
cut into shards, so that a shard holds a mix of classes (an ImageFolder is sorted by class).

* webdataset: one ``<key>.{jpg|png|webp}`` + ``<key>.cls`` (the class index) + ``<key>.json``
  (``filename``, ``label``, ``class``) per sample, ``shard_size`` samples per tar (the last one less), and
  ``_info.json`` in timm's format (``splits.<split>.{num_samples, filenames, shard_lengths}``, plus
  ``classes``) that timm's ``ReaderWds`` reads for the sample count of a split.
* Hugging Face: parquet files with the features ``image`` (``datasets.Image``) and ``label``
  (``datasets.ClassLabel`` named by the folders), and a ``README.md`` whose ``dataset_info`` states the
  features and each split's ``num_examples`` (what timm's ``hfids`` reader needs for the epoch length)
  and whose ``configs`` map the splits to the files. ``datasets.load_dataset(OUT, split=...)`` reads it
  offline (timm's ``hfds/OUT`` map-style and ``hfids/OUT`` streaming readers).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

__all__ = ["write_wds", "write_hf", "ShardLoader", "epoch_samples_per_rank", "folder_samples", "SPLIT_NAMES"]

#: ImageFolder split folder -> split name in the shards
SPLIT_NAMES = {"train": "train", "val": "validation"}
_KEEP_EXT = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}


def folder_samples(folder: str | Path, classes: Sequence[str]) -> list[tuple[Path, int]]:
    """``(file, class index)`` of every image under ``folder/<class>/`` (torchvision's ImageFolder scan)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    index = {c: i for i, c in enumerate(classes)}
    return [(Path(p), int(t)) for p, t in make_dataset(str(folder), index, IMG_EXTENSIONS, allow_empty=True)]


def _image_bytes(path: Path) -> tuple[bytes, str]:
    """The file's bytes and its webdataset extension; other formats re-encoded as PNG."""
    ext = _KEEP_EXT.get(path.suffix.lower())
    if ext is not None:
        return path.read_bytes(), ext
    from PIL import Image

    with Image.open(path) as img:
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="PNG")
    return buf.getvalue(), "png"


def _splits(root: Path) -> tuple[list[str], dict[str, Path]]:
    """The class names (train's folders) and the split folders present under ``root``."""
    folders = {name: root / d for d, name in SPLIT_NAMES.items() if (root / d).is_dir()}
    if "train" not in folders:
        raise FileNotFoundError(f"{root} has no train/ folder (the classes are train's class folders)")
    classes = sorted(e.name for e in os.scandir(folders["train"]) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"{folders['train']} has no class folders")
    return classes, folders


def _ordered(samples: list[tuple[Path, int]], seed: int | None) -> list[tuple[Path, int]]:
    if seed is None:
        return samples
    perm = np.random.default_rng(seed).permutation(len(samples))
    return [samples[i] for i in perm]


def write_wds(
    root: str | Path,
    out: str | Path,
    shard_size: int = 1000,
    prefix: str = "imagenet",
    seed: int | None = 0,
) -> dict[str, Any]:
    """Write ``root/{train,val}/<class>/*`` as webdataset shards ``out/<prefix>-<split>-%06d.tar`` and
    ``out/_info.json`` (timm's format); returns the info written."""
    import webdataset as wds

    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    root, out = Path(root), Path(out)
    classes, folders = _splits(root)
    out.mkdir(parents=True, exist_ok=True)
    info_path = out / "_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info.update(name=prefix, classes=classes)
    info.setdefault("splits", {})
    for split, folder in folders.items():
        samples = _ordered(folder_samples(folder, classes), seed)
        pattern = str(out / f"{prefix}-{split}-%06d.tar")
        with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0) as sink:
            for i, (path, label) in enumerate(samples):
                data, ext = _image_bytes(path)
                meta = {"filename": str(path.relative_to(folder)), "label": label, "class": classes[label]}
                sink.write({"__key__": f"{i:08d}", ext: data, "cls": str(label), "json": json.dumps(meta)})
        n_shards = math.ceil(len(samples) / shard_size)
        lengths = [min(shard_size, len(samples) - k * shard_size) for k in range(n_shards)]
        info["splits"][split] = {
            "name": split,
            "num_samples": len(samples),
            "filenames": [f"{prefix}-{split}-{k:06d}.tar" for k in range(n_shards)],
            "shard_lengths": lengths,
        }
    info_path.write_text(json.dumps(info, indent=1))
    return info


def write_hf(root: str | Path, out: str | Path, shard_size: int = 1000, seed: int | None = 0) -> dict[str, int]:
    """Write ``root/{train,val}/<class>/*`` as parquet files ``out/data/<split>-%05d-of-%05d.parquet`` and a
    ``README.md`` stating the features and split sizes; returns ``{split: num_examples}``."""
    from datasets import ClassLabel, Dataset, DatasetInfo, Features, SplitDict, SplitInfo
    from datasets import Image as HFImage
    from datasets.info import DatasetInfosDict
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard, DatasetCardData

    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    root, out = Path(root), Path(out)
    classes, folders = _splits(root)
    features = Features({"image": HFImage(), "label": ClassLabel(names=classes)})
    (out / "data").mkdir(parents=True, exist_ok=True)
    sizes, splits = {}, SplitDict()
    for split, folder in folders.items():
        samples = _ordered(folder_samples(folder, classes), seed)
        n_files = max(1, math.ceil(len(samples) / shard_size))
        for k in range(n_files):
            part = samples[k * shard_size : (k + 1) * shard_size]
            images = []
            for path, _ in part:
                data, ext = _image_bytes(path)
                images.append({"bytes": data, "path": f"{path.stem}.{ext}"})
            ds = Dataset.from_dict({"image": images, "label": [t for _, t in part]}, features=features)
            ds.to_parquet(str(out / "data" / f"{split}-{k:05d}-of-{n_files:05d}.parquet"))
        sizes[split] = len(samples)
        splits.add(SplitInfo(name=split, num_examples=len(samples)))
    card = DatasetCardData()
    DatasetInfosDict({"default": DatasetInfo(features=features, splits=splits)}).to_dataset_card_data(card)
    files = [{"split": s, "path": f"data/{s}-*"} for s in sizes]
    MetadataConfigs({"default": {"data_files": files}}).to_dataset_card_data(card)
    DatasetCard(f"---\n{card}\n---\n").save(str(out / "README.md"))
    return sizes


def epoch_samples_per_rank(num_samples: int, world_size: int, num_workers: int, batch_size: int) -> int:
    """Samples one rank's epoch covers from timm's iterable readers (``wds``, ``hfids``) in training:
    each of the ``world_size * max(1, num_workers)`` loader workers yields ``ceil(num_samples / workers)``
    rounded up to a whole number of batches (a worker whose shards hold fewer repeats them, one whose
    shards hold more stops early), so every rank has the same number of full batches."""
    workers = max(1, num_workers)
    per_worker = math.ceil(num_samples / (world_size * workers))
    return workers * batch_size * math.ceil(per_worker / batch_size)


class ShardLoader(DataLoader):
    """A ``DataLoader`` over one of timm's ``IterableImageDataset`` s that sets the data set's epoch (timm's
    shard / sample shuffle is seeded by ``seed + epoch``, shared by every rank and worker) before each
    pass: ``epoch_of()`` (the trainer's current epoch) when it gives a number, else the count of passes
    so far (or the last ``set_epoch``). Not resumable mid-epoch (see the ImageNet module's docs)."""

    def __init__(self, dataset, *args: Any, epoch_of: Callable[[], int | None] | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._epoch_of = epoch_of
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator:
        epoch = self._epoch_of() if self._epoch_of is not None else None
        if epoch is None:
            epoch, self.epoch = self.epoch, self.epoch + 1
        self.dataset.set_epoch(int(epoch))
        return super().__iter__()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m vitrel.data.shards", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd, what in (("write-wds", "webdataset tar shards + _info.json"), ("write-hf", "parquet + README.md")):
        s = sub.add_parser(cmd, help=f"write ROOT/{{train,val}}/<class>/* as {what}")
        s.add_argument("root", help="folder holding train/ (and val/) in ImageFolder layout")
        s.add_argument("out", help="output folder")
        s.add_argument("--shard-size", type=int, default=1000, help="samples per shard / parquet file")
        s.add_argument("--seed", type=int, default=0, help="shuffle seed of the sample order; -1 keeps the order")
        if cmd == "write-wds":
            s.add_argument("--prefix", default="imagenet", help="shard names: <prefix>-<split>-%%06d.tar")
    args = p.parse_args(argv)
    seed = None if args.seed < 0 else args.seed
    if args.cmd == "write-wds":
        info = write_wds(args.root, args.out, args.shard_size, args.prefix, seed)
        for split, s in info["splits"].items():
            print(f"{split}: {s['num_samples']} samples in {len(s['filenames'])} shards")
    else:
        for split, n in write_hf(args.root, args.out, args.shard_size, seed).items():
            print(f"{split}: {n} samples")


if __name__ == "__main__":
    main()
