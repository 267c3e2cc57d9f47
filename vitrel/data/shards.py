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

**Undecodable samples** (:func:`guard_bad_samples`, the data module's ``on_bad_sample``): timm's webdataset reader
drops a sample it cannot decode with a warning that names neither shard nor key, and fills the epoch with others;
its streamed Hugging Face reader stops with PIL's error. Guarded, a bad sample is named by its shard and key (for
parquet: the data set, split and the image's stored file name) and, with ``raise`` (the default), stops the run
with a :class:`BadSampleError`; with ``skip`` it is logged, left out, and each loader worker logs the count and the
list of the samples it skipped when its pass over the epoch ends.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from timm.data.readers.reader_wds import ReaderWds
from torch.utils.data import DataLoader

from vitrel.data.datasets import (
    IMG_EXTENSIONS,
    ON_BAD_SAMPLE,
    BadSampleError,
    ClassFoldersMismatchError,
    check_val_classes,
    class_folder_samples,
    class_folders,
)

__all__ = [
    "write_wds",
    "write_hf",
    "ShardLoader",
    "epoch_samples_per_rank",
    "folder_samples",
    "SPLIT_NAMES",
    "ON_BAD_SAMPLE",
    "BadSampleError",
    "guard_bad_samples",
    "ShardSplitError",
    "ShardCountError",
]
log = logging.getLogger(__name__)


class ShardCountError(ValueError):
    """A webdataset train split of fewer shards than ranks x loader workers (``train.py`` prints it as one line)."""


class ShardSplitError(ValueError):
    """A shard split that cannot be read as given: a training brace pattern of no stated length (one line too)."""


#: ImageFolder split folder -> split name in the shards
SPLIT_NAMES = {"train": "train", "val": "validation"}
_KEEP_EXT = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}


def folder_samples(folder: str | Path, classes: Sequence[str]) -> list[tuple[Path, int]]:
    """``(file, class index)`` of every image under ``folder/<class>/`` (the scan of ``data=imagenet``'s
    :class:`~vitrel.data.imagenet.FixedClassImageFolder`: :func:`~vitrel.data.datasets.class_folder_samples`)."""
    index = {c: i for i, c in enumerate(classes)}
    found = class_folder_samples(str(folder), index, IMG_EXTENSIONS, allow_empty=True)
    return [(Path(p), int(t)) for p, t in found]


def _image_bytes(path: Path) -> tuple[bytes, str]:
    """The file's bytes and its webdataset extension; other formats re-encoded as PNG."""
    ext = _KEEP_EXT.get(path.suffix.lower())
    if ext is not None:
        return path.read_bytes(), ext
    from PIL import Image

    from vitrel.data.datasets import to_8bit

    buf = io.BytesIO()
    try:
        with Image.open(path) as img:
            to_8bit(img).convert("RGB").save(buf, format="PNG")  # (16-bit scaled, not clipped)
    except (OSError, ValueError, SyntaxError) as e:  # (not an image, truncated, no scale to 8 bits: one line)
        raise BadSampleError(f"cannot re-encode {path} as PNG ({type(e).__name__}: {e})") from e
    return buf.getvalue(), "png"


def _splits(root: Path) -> tuple[list[str], dict[str, tuple[Path, list[tuple[Path, int]]]]]:
    """The class names (train's folders), and the folder and samples (:func:`folder_samples`) of each split present
    under ``root``, checked as ``data=imagenet`` checks its folders: a val class folder that train lacks, or a train
    class folder without image files, is a :class:`~vitrel.data.datasets.ClassFoldersMismatchError` (the writer would
    drop that val folder's images, or write a class no sample has)."""

    folders = {name: root / d for d, name in SPLIT_NAMES.items() if (root / d).is_dir()}
    if "train" not in folders:
        raise FileNotFoundError(f"{root} has no train/ folder (the classes are train's class folders)")
    classes = class_folders(folders["train"])
    if not classes:
        raise FileNotFoundError(f"{folders['train']} has no class folders")
    if "validation" in folders:
        val_classes = class_folders(folders["validation"])
        why = " (their images would be left out of the shards)"
        check_val_classes(folders["train"], folders["validation"], classes, val_classes, why)
    samples = {split: (folder, folder_samples(folder, classes)) for split, folder in folders.items()}
    have = {t for _, t in samples["train"][1]}
    empty = [c for i, c in enumerate(classes) if i not in have]
    if empty:
        raise ClassFoldersMismatchError(
            f"{folders['train']} has class folders without image files: {empty[:5]}{' ...' if len(empty) > 5 else ''}: "
            "every folder of train is a class; remove the empty one(s) or put their images in"
        )
    return classes, samples


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
    for split, (folder, found) in folders.items():
        samples = _ordered(found, seed)
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
    for split, (_, found) in folders.items():
        samples = _ordered(found, seed)
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


def eval_batches(reader: Any, batch_size: int | None, num_workers: int) -> int | None:
    """Batches one process's evaluation pass over timm's webdataset ``reader`` yields: each of its ``W`` workers reads
    its shards once (:func:`eval_shards`; on one process worker ``w`` reads ``w, w + W, ...``, as timm's reader) and
    batches them itself, ``sum_w ceil(n_w / B)``; None where that is not known (not a webdataset reader, ``batch_size``
    None, no ``split_info.shard_lengths``, several ranks with timm's own reader, which evens the workers out)."""
    if not isinstance(reader, ReaderWds):  # (tfds, hfids: their own split of the files over the workers)
        return None
    lengths = shard_lengths(reader)
    ranks = getattr(reader, "dist_num_replicas", 1)
    if not batch_size or lengths is None or (ranks != 1 and not isinstance(reader, EvalReaderWds)):
        return None
    workers, rank = max(1, num_workers), getattr(reader, "dist_rank", 0)
    return sum(
        math.ceil(sum(lengths[i] for i in eval_shards(len(lengths), ranks, rank, workers, w)) / batch_size)
        for w in range(workers)
    )


def shard_lengths(reader: Any) -> list[int] | None:
    """The samples of each shard of a webdataset ``reader``'s split (timm's ``_info.json``), None where not stated."""
    info = getattr(reader, "split_info", None)
    lengths = list(getattr(info, "shard_lengths", None) or ())
    return lengths if lengths and len(lengths) == len(getattr(info, "filenames", None) or ()) else None


def eval_shards(num_shards: int, ranks: int, rank: int, workers: int, worker: int) -> list[int]:
    """The shards loader worker ``worker`` of ``workers`` on rank ``rank`` of ``ranks`` reads in an evaluation pass
    (:class:`EvalReaderWds`): the ranks take every ``ranks``-th shard, so each rank has one when there are as many
    shards as ranks, and a rank's workers every ``workers``-th of those."""
    return list(range(rank, num_shards, ranks))[worker::workers]


class EvalReaderWds(ReaderWds):
    """timm's webdataset reader for an evaluation split, each sample read once also under DDP.

    timm's own makes each of the ``ranks * workers`` loader workers yield ``ceil(N / (ranks * workers))`` samples
    there (``with_epoch``): it repeats a worker's shards when they hold fewer and cuts them when they hold more
    (ImageNet's val in 50 shards of 1,000 on 8 GPUs x 10 workers: 31,250 of the 50,000 scored), and a rank whose
    workers have no shard runs no validation while the others wait for it. Here each worker yields its
    :func:`eval_shards` once, every rank has shards when the split has as many as ranks (the data module refuses
    fewer), and the ranks run different numbers of batches, as the map-style data sets'
    :class:`~vitrel.data.sampling.EvalSampler` does. Shards of unstated lengths: timm's behaviour."""

    def _split_by_node_and_worker(self, src: Iterator) -> Iterator:
        mine = set(eval_shards(len(self.split_info.filenames), *self._place()))
        return (s for i, s in enumerate(src) if i in mine)

    def _place(self) -> tuple[int, int, int, int]:
        return self.dist_num_replicas, self.dist_rank, max(1, self.num_workers), self.worker_id

    def _num_samples_per_worker(self) -> int:
        lengths = shard_lengths(self)
        if lengths is None:
            return super()._num_samples_per_worker()
        return sum(lengths[i] for i in eval_shards(len(lengths), *self._place()))

    def __len__(self) -> int:
        """This rank's samples (its workers' shards)."""
        lengths = shard_lengths(self)
        if lengths is None:
            return super().__len__()
        return sum(lengths[self.dist_rank :: self.dist_num_replicas])


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

    def __len__(self) -> int:
        """Batches of a pass. Training: torch's count (each worker yields whole batches). Evaluation: each worker
        batches its own shards, its last batch partial, so a pass holds more than ``ceil(N / B)`` batches, where
        Lightning would stop: the sum over the workers (:func:`eval_batches`); where that is not known (under DDP,
        ``hfids``, ``tfds``, shards without lengths) the loader is unsized (a ``TypeError``) and Lightning runs it
        to its end."""
        reader = getattr(self.dataset, "reader", None)
        if reader is None or getattr(reader, "is_training", True):
            return super().__len__()
        n = eval_batches(reader, self.batch_size, self.num_workers)
        if n is None:
            raise TypeError(f"{type(self).__name__} over {type(reader).__name__} in evaluation has no known length")
        return n

    def __iter__(self) -> Iterator:
        epoch = self._epoch_of() if self._epoch_of is not None else None
        if epoch is None:
            epoch, self.epoch = self.epoch, self.epoch + 1
        self.dataset.set_epoch(int(epoch))
        return super().__iter__()


class _Skips:
    """The samples one loader worker skipped in its current pass (``on_bad_sample: skip``)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.items = mode, []

    def bad(self, where: str, err: Exception, hint: str = "") -> None:
        """Raise (``raise``) or record and log (``skip``) the sample ``where`` that failed with ``err`` (``hint``:
        what the failure says of the shards)."""
        reason = f"{type(err).__name__}: {err}{hint}"
        if self.mode == "raise":
            skip = "; data.on_bad_sample=skip leaves such samples out (logged, and counted at the end of each epoch)"
            raise BadSampleError(f"{where}: cannot decode the sample ({reason}){'' if hint else skip}") from err
        self.items.append(where)
        log.warning("skipped %s: cannot decode it (%s)", where, reason)

    def report(self) -> None:
        if self.items:
            n = len(self.items)
            log.warning("skipped %d undecodable sample(s) in this pass over the epoch: %s", n, "; ".join(self.items))
            self.items = []


class _NamedDecode:
    """timm's webdataset sample decode, a failure named by the sample's shard (``__url__``) and key (``__key__``)."""

    def __init__(self, decode: Callable, skips: _Skips) -> None:
        self.decode, self.skips = decode, skips

    def __call__(self, sample: dict) -> Any:
        from timm.data.readers.reader_wds import WdsTargetKeyError

        try:
            return self.decode(sample)
        except (TypeError, WdsTargetKeyError):  # a code or configuration error, as timm's own handler treats them
            raise
        except Exception as e:  # noqa: BLE001 - any other failure is this sample's
            self.skips.bad(f"shard {sample.get('__url__')}, sample key {sample.get('__key__')!r}", e, _dotted(sample))
            return None  # webdataset's map leaves out a None


def _dotted(sample: dict) -> str:
    """Why a sample of files named with more than one dot has no ``jpg`` / ``cls``: webdataset cuts a file's name at
    its first dot into the key and the extension (``photo.v2_0001.jpg``: key ``photo``, extension ``v2_0001.jpg``)."""
    exts = sorted(k for k in sample if not k.startswith("__"))
    if not any("." in k for k in exts):
        return ""
    return (
        f"; its files' extensions are {exts}: webdataset cuts a file name at its first dot, so a name with dots "
        f"before the extension ('{sample.get('__key__')}.{exts[0]}') is read as key and extension; write the shards "
        "with keys without dots (python -m vitrel.data.shards write-wds does)"
    )


@functools.cache
def _guarded_wds():
    from timm.data.readers.reader_wds import ReaderWds

    class GuardedReaderWds(ReaderWds):
        """timm's ``ReaderWds`` whose decode stage names (and raises or skips) a sample it cannot decode."""

        def _lazy_init(self) -> None:
            import webdataset as wds
            from timm.data.readers import reader_wds

            super()._lazy_init()
            for i, stage in enumerate(self.ds.pipeline):
                args = getattr(stage, "args", ())
                fn = args[0] if args and getattr(stage, "f", None) is wds.filters._map else None
                if isinstance(fn, functools.partial) and fn.func is reader_wds._decode:
                    self.ds.pipeline[i] = wds.map(_NamedDecode(fn, self._skips), handler=wds.reraise_exception)
                    return
            raise RuntimeError(
                f"timm {_timm_version()}'s webdataset reader has no decode stage where vitrel looks for it: "
                "bad samples cannot be named; use data.dataset_kwargs or another timm release"
            )

        def __iter__(self):
            yield from super().__iter__()
            self._skips.report()

    GuardedReaderWds.__module__, GuardedReaderWds.__qualname__ = __name__, "GuardedReaderWds"
    return GuardedReaderWds


@functools.cache
def _guarded_hfids():
    from timm.data.readers.reader_hfids import ReaderHfids

    class GuardedReaderHfids(ReaderHfids):
        """timm's ``ReaderHfids`` decoding the images itself, so that one it cannot decode is named (data set,
        split, the image's stored file name) and raised or skipped, not PIL's error from inside ``datasets``."""

        def _lazy_init(self) -> None:
            from datasets import Image as HFImage

            super()._lazy_init()
            self.ds = self.ds.cast_column(self.input_key, HFImage(decode=False)).map(self._decode_image)
            self.ds = self.ds.filter(lambda ex: ex[self.input_key] is not None)

        def _decode_image(self, example: dict) -> dict:
            from PIL import Image

            value = example[self.input_key]
            try:
                with io.BytesIO(value["bytes"]) as b:
                    img = Image.open(b)
                    img.load()
            except Exception as e:  # noqa: BLE001 - any failure is this sample's
                where = f"data set {self.name}, split {self.split!r}, image {value.get('path')!r}"
                self.skips_.bad(where, e)
                img = None
            return {**example, self.input_key: img}

        def __iter__(self):
            yield from super().__iter__()
            self.skips_.report()

    GuardedReaderHfids.__module__, GuardedReaderHfids.__qualname__ = __name__, "GuardedReaderHfids"
    return GuardedReaderHfids


#: the guarded readers, made on first use (they subclass timm's readers, whose modules import webdataset / datasets)
_GUARDED = {"wds": _guarded_wds, "hfids": _guarded_hfids}


def __getattr__(name: str) -> Any:  # the guarded readers by name, for pickling (spawned loader workers)
    if name == "GuardedReaderWds":
        return _guarded_wds()
    if name == "GuardedReaderHfids":
        return _guarded_hfids()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _timm_version() -> str:
    import timm

    return timm.__version__


def guard_bad_samples(dataset: Any, on_bad_sample: str = "raise") -> Any:
    """Make a timm iterable shard data set (``create_dataset("wds/..." | "hfids/...")``) name a sample it cannot
    decode by its shard and key, and raise (:class:`BadSampleError`) or skip it (module docstring); returns
    ``dataset``. Other readers are returned as they are."""
    if on_bad_sample not in ON_BAD_SAMPLE:
        raise ValueError(f"on_bad_sample must be one of {ON_BAD_SAMPLE}, got {on_bad_sample!r}")
    reader = getattr(dataset, "reader", None)
    from timm.data.readers.reader_hfids import ReaderHfids
    from timm.data.readers.reader_wds import ReaderWds

    if type(reader) is ReaderWds:
        reader.__class__ = _GUARDED["wds"]()
        reader._skips = _Skips(on_bad_sample)
    elif type(reader) is ReaderHfids:
        reader.__class__ = _GUARDED["hfids"]()
        reader.skips_ = _Skips(on_bad_sample)
    return dataset


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

    try:
        _write(args, seed)
    except (FileNotFoundError, ClassFoldersMismatchError, BadSampleError) as e:  # (a folder, a file: the reason)
        raise SystemExit(f"{p.prog}: {type(e).__name__}: {e}") from None


def _write(args: argparse.Namespace, seed: int | None) -> None:
    if args.cmd == "write-wds":
        info = write_wds(args.root, args.out, args.shard_size, args.prefix, seed)
        for split, s in info["splits"].items():
            print(f"{split}: {s['num_samples']} samples in {len(s['filenames'])} shards")
    else:
        for split, n in write_hf(args.root, args.out, args.shard_size, seed).items():
            print(f"{split}: {n} samples")


if __name__ == "__main__":
    main()
