"""The data sets' shared pieces: the errors a missing or altered data set raises, an in-memory image data set, and
the seeded train / val split (:mod:`vitrel.data.base` re-exports them)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

log = logging.getLogger(__name__)

__all__ = [
    "DatasetNotFoundError",
    "DatasetIntegrityError",
    "SplitMismatchError",
    "SplitTooSmallError",
    "BadSampleError",
    "ClassFoldersMismatchError",
    "check_val_classes",
    "ON_BAD_SAMPLE",
    "ArrayImageDataset",
    "seeded_split",
    "split_record",
    "check_same_split",
    "to_8bit",
    "load_rgb",
    "rgb_8bit",
    "is_apple_double",
    "SYSTEM_FOLDERS",
    "is_system_folder",
    "walk_files",
    "class_folder_samples",
    "class_folders",
    "IMG_EXTENSIONS",
]

#: the image files every reader takes (class folders, the shards writers, ``predict.py``): torchvision's
#: ``ImageFolder`` list and ``.gif`` (its first frame), any case
IMG_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
#: files other tools leave beside images, passed over without a word
_SYSTEM_FILES = {".ds_store", "thumbs.db", "desktop.ini"}

#: PIL's modes of a 16-bit grey image (a 16-bit PNG or TIFF): ``convert("L" / "RGB")`` clips them at 255
MODES_16BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def is_apple_double(path: str | Path) -> bool:
    """Whether ``path`` is macOS's AppleDouble file ``._<name>``: the metadata of ``<name>`` that a copy from a Mac
    (zip, tar, a FAT or network drive) leaves beside it, with ``<name>``'s extension but never an image or a video."""
    return Path(path).name.startswith("._")


#: folders other tools leave in a data tree, never classes nor samples (besides any whose name starts with ``.``:
#: ``.ipynb_checkpoints``, ``.git``, ``.Trash-1000``): a Mac's zip's ``__MACOSX`` (metadata files ``._<name>``) and
#: a Synology drive's ``@eaDir`` (thumbnails ``SYNOPHOTO_THUMB_*.jpg`` of each image, in every folder)
SYSTEM_FOLDERS = ("__MACOSX", "@eaDir")


def is_system_folder(name: str) -> bool:
    """Whether a folder named ``name`` is a hidden one (``.<name>``) or one of :data:`SYSTEM_FOLDERS`: passed over by
    the class-folder data sets, the shards writers and ``predict.py``, where torchvision's ``ImageFolder`` makes it a
    class (``.ipynb_checkpoints`` with images in it) or reads its files as samples (``@eaDir``'s thumbnails)."""
    return name.startswith(".") or name in SYSTEM_FOLDERS


def walk_files(
    top: str | Path, within: str | Path | None = None
) -> tuple[list[tuple[str, list[str]]], list[str], list[str]]:
    """torchvision's ``ImageFolder`` walk of a folder (``os.walk(followlinks=True)``, sorted): the one walk of the
    class-folder data sets, the shards writers and ``predict.py``. It passes over the folders
    :func:`is_system_folder` names and does not follow a link to a folder it is in, or to one holding such a folder (a
    link back up, which ``os.walk`` follows round until the path is too long: each file, the other classes' too, read
    again under this class). Any other link to a folder is followed: two links to one folder read
    its files twice, as a subset built of links needs. A link to nothing is listed with the files. ``within``: the
    folder ``top`` is in (a class folder's split folder: a link to it from inside a linked class folder leads back up).
    Returns the ``(folder, sorted file names)``, the folders passed over and the links not followed."""
    out, passed, loops = [], [], []
    top = str(top)
    outer = () if within is None else (os.path.realpath(within),)
    inside = {top: (*outer, os.path.realpath(top))}  # (a folder -> the real paths of it and of the folders it is in)
    for root, dirs, names in os.walk(top, followlinks=True):
        keep = []
        for d in dirs:
            path = os.path.join(root, d)
            real = os.path.realpath(path)
            if is_system_folder(d):
                passed.append(path)
            elif any(r == real or r.startswith(real.rstrip(os.sep) + os.sep) for r in inside[root]):
                loops.append(path)
            else:
                inside[path] = (*inside[root], real)
                keep.append(d)
        dirs[:] = keep
        out.append((root, sorted(names)))
    return sorted(out), sorted(passed), sorted(loops)


def warn_loops(loops: list[str]) -> None:
    """One warning for each link back up that :func:`walk_files` did not follow."""
    for link in loops:
        log.warning("%s links back up to %s, a folder it is in: not followed", link, os.path.realpath(link))


def class_folder_samples(
    directory: str, class_to_idx: dict[str, int], extensions=None, is_valid_file=None, allow_empty: bool = False
) -> list[tuple[str, int]]:
    """torchvision's ``make_dataset`` of class folders (``(path, class index)``, classes and files sorted) through
    :func:`walk_files`: macOS's AppleDouble files (``._<name>.jpg``, not images: :func:`is_apple_double`) passed over
    as ``.DS_Store`` is, hidden and system folders in the class folders (``.ipynb_checkpoints``, ``@eaDir``'s
    thumbnails: one warning names them) and links back up to a folder the walk is in (a warning each). Files of
    other kinds (``.txt``, ``.heic``) are counted by extension in one warning (``.DS_Store``, ``Thumbs.db`` aside)."""
    from torchvision.datasets.folder import has_file_allowed_extension

    valid = is_valid_file or (lambda p: has_file_allowed_extension(p, extensions))
    samples, passed, others = [], [], []
    for c in sorted(class_to_idx):
        top = os.path.join(os.path.expanduser(directory), c)
        if not os.path.isdir(top):
            continue
        folders, skipped, loops = walk_files(top, within=os.path.expanduser(directory))
        passed += skipped
        warn_loops(loops)
        for root, names in folders:
            for p in (os.path.join(root, n) for n in names):
                if is_apple_double(p):
                    continue
                if valid(p):
                    samples.append((p, class_to_idx[c]))
                elif os.path.basename(p).lower() not in _SYSTEM_FILES:
                    others.append(p)
    if passed:
        more = " ..." if len(passed) > 5 else ""
        log.warning(
            "passed over %d hidden or system folder(s) in the class folders of %s (not images of the class): %s%s",
            len(passed), directory, ", ".join(os.path.relpath(p, directory) for p in passed[:5]), more,
        )  # fmt: skip
    if others:  # (a kind of image the readers do not take would otherwise be lost without a word)
        kinds = Counter(os.path.splitext(p)[1].lower() or os.path.basename(p) for p in others)
        counts = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kn: (-kn[1], kn[0])))
        log.warning(
            "passed over %d file(s) of other kinds in the class folders of %s (%s): not read",
            len(others),
            directory,
            counts,
        )
    found = {t for _, t in samples}
    empty = sorted(c for c, i in class_to_idx.items() if i not in found)
    if empty and not allow_empty:  # (torchvision's message; it names the extensions it looked for)
        exts = f"Supported extensions are: {', '.join(extensions)}" if extensions is not None else ""
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}. {exts}")
    return samples


def class_folders(path: Path) -> list[str]:
    """The folders in ``path`` (links to folders included), sorted; a link to nothing is named in a warning, and so
    are the hidden and system folders passed over (``.ipynb_checkpoints``, ``__MACOSX``: not classes,
    :func:`~vitrel.data.datasets.is_system_folder`)."""
    names, passed = [], []
    for e in os.scandir(path):
        if e.is_dir() and is_system_folder(e.name):
            passed.append(e.name)
        elif e.is_dir():
            names.append(e.name)
        elif e.is_symlink() and not os.path.exists(e.path):
            log.warning(
                "%s is a link to %s, which does not exist: not a class folder (passed over)", e.path, os.readlink(e)
            )
    if passed:
        log.warning("%s: passed over %s (hidden or system folders, not classes)", path, ", ".join(sorted(passed)))
    return sorted(names)


def to_8bit(img: Image.Image) -> Image.Image:
    """``img`` with 8-bit values, for ``convert("L" / "RGB")``. PIL's ``convert`` clips a 16-bit grey image at 255 (a
    mid-grey picture turns white); such an image (mode ``I;16*``, or ``I`` read from a PNG, whose integers are at
    most 16-bit) is scaled by 255 / 65535 to mode ``L``. An ``I`` or ``F`` image of another format with values
    outside 0-255, or within 0-1 (not all 0: a float TIFF's 0-1 scale, which ``convert`` turns black), has no agreed
    scale: a ``ValueError`` naming its range. A palette image with per-entry transparency is made ``RGBA`` (the pixels
    ``convert`` gives, without its warning). Other images are returned as they are."""
    if img.mode == "P" and isinstance(img.info.get("transparency"), bytes):
        return img.convert("RGBA")  # (what convert("RGB")'s warning asks for; the same pixels)
    sixteen = img.mode in MODES_16BIT or (img.mode == "I" and img.format == "PNG")
    if sixteen:
        scaled = np.rint(np.asarray(img).astype(np.float64) * (255 / 65535))
        return Image.fromarray(scaled.astype(np.uint8), mode="L")
    if img.mode in ("I", "F"):
        lo, hi = img.getextrema()
        unit = 0 <= lo and 0 < hi <= 1  # (a 0-1 image, e.g. a float TIFF: read as 0-255 it would be black)
        if lo < 0 or hi > 255 or unit:
            kind = "32-bit integer" if img.mode == "I" else "floating-point"
            black = ", 0-1 or 0-255: as 0-255 it is a black image" if unit else ""
            raise ValueError(
                f"a {kind} image (PIL mode {img.mode}) with values {lo} to {hi}: no agreed scale to 8 bits{black} "
                "(save it as an 8- or 16-bit image)"
            )
    return img


def rgb_8bit(img: Image.Image) -> Image.Image:
    """``img.convert("RGB")`` with 16-bit images scaled, not clipped (:func:`to_8bit`)."""
    return to_8bit(img).convert("RGB")


def load_rgb(path: str) -> Image.Image:
    """torchvision's ``pil_loader`` (the file as an RGB image), 16-bit images scaled, not clipped (:func:`to_8bit`)."""
    with open(path, "rb") as f:
        img = Image.open(f)
        img.load()
        return rgb_8bit(img)


class DatasetNotFoundError(FileNotFoundError):
    """A data set is not where it was looked for. ``searched`` lists every path tried."""

    def __init__(self, name: str, searched: Sequence[str | Path], how_to_get: Sequence[str], detail: str = "") -> None:
        self.dataset_name = name
        self.searched = [str(p) for p in searched]
        self.how_to_get = list(how_to_get)
        lines = [f"{name} not found." + (f" {detail}" if detail else ""), "Looked in:"]
        lines += [f"  - {p}" for p in self.searched] or ["  (nowhere: no root given)"]
        lines += ["How to get it:"] + [f"  - {h}" for h in self.how_to_get]
        super().__init__("\n".join(lines))


class DatasetIntegrityError(RuntimeError):
    """The files exist but differ from the official release (checksum mismatch)."""


#: what a data set does with a sample it cannot read (``data.on_bad_sample``): stop the run, or leave it out
ON_BAD_SAMPLE = ("raise", "skip")


class BadSampleError(DatasetIntegrityError):
    """A sample that cannot be read or decoded (``on_bad_sample: raise``), named by its file (class folders) or its
    shard and key. A data set error (``train.py`` and ``eval.py`` print its message alone). Raised in a DataLoader
    worker, torch rebuilds it in the main process from the worker's whole traceback text: it keeps that text's last
    line, the message."""

    def __init__(self, message: str) -> None:
        text = str(message).rstrip()
        if "Original Traceback" in text:  # torch re-raising a worker's error: "Caught ... Original Traceback ...
            text = text.splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1]  # ...\n<module>.Name: msg"
        super().__init__(text)


class ClassFoldersMismatchError(DatasetIntegrityError, ValueError):
    """The class folders of a split disagree with train's, or with ``num_classes``: a data set error (``train.py``
    and ``eval.py`` print its message alone)."""


def check_val_classes(train: Path, val: Path, classes: list[str], val_classes: list[str], why: str = "") -> None:
    """A :class:`ClassFoldersMismatchError` when ``val_classes`` (``val``'s folders) hold one that ``classes``
    (``train``'s) lack, ``why`` added to its message."""
    extra = sorted(set(val_classes) - set(classes))
    if extra:
        more = " ..." if len(extra) > 5 else ""
        raise ClassFoldersMismatchError(f"{val} has class folders not in {train}: {extra[:5]}{more}{why}")


class SplitMismatchError(ValueError):
    """A resumed run would hold out another validation split than the one it trained with."""


class SplitTooSmallError(ValueError):
    """A split too small for the run: a training split that ``drop_last`` leaves without a batch, an evaluation split
    with fewer samples than ranks. A data setting error (``train.py`` and ``eval.py`` print its message alone)."""


class ArrayImageDataset(Dataset):
    """In-memory uint8 images ``[N, H, W]`` or ``[N, H, W, C]`` -> ``(PIL image, int label)``.

    ``mode="RGB"`` converts grayscale images to 3 channels (the value repeated).
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, mode: str | None = None) -> None:
        if images.dtype != np.uint8 or images.ndim not in (3, 4):
            raise ValueError(f"images must be uint8 [N, H, W(, C)], got {images.dtype} {images.shape}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.mode = mode

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        img = Image.fromarray(self.images[index])
        if self.mode is not None and img.mode != self.mode:
            img = img.convert(self.mode)
        return img, int(self.labels[index])


#: the splits a data module serves
SPLITS = ("train", "val", "test")


def seeded_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random split of ``range(n)`` into ``(train_idx, val_idx)``, ``len(val) = round(fraction n)``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {fraction}")
    n_val = int(round(fraction * n))
    if not 0 < n_val < n:
        raise ValueError(f"val_fraction={fraction} of {n} samples leaves an empty train or val split")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def split_record(val_fraction: float, seed: int, train: np.ndarray | None, val: np.ndarray | None) -> dict[str, Any]:
    """What decides a validation split held out of train: ``val_fraction`` and, when it is > 0, the ``seed``, how
    many training samples it is drawn from (``pool``: ``train`` and ``val`` indices together) and a digest of the
    held-out indices (``val_digest``)."""
    if val_fraction <= 0.0 or train is None or val is None:
        return {"val_fraction": float(val_fraction)}
    digest = hashlib.sha1(np.sort(np.asarray(val, dtype="<i8")).tobytes()).hexdigest()[:16]
    return {"val_fraction": float(val_fraction), "seed": int(seed), "pool": len(train) + len(val), "val_digest": digest}


def check_same_split(theirs: Mapping[str, Any], mine: Mapping[str, Any], where: str | Path | None = None) -> None:
    """A :class:`SplitMismatchError` when a checkpoint's split record ``theirs`` (read from ``where``) is not the
    configured one, ``mine`` (:func:`split_record`), naming the differing settings with both values."""
    if theirs == mine:
        return
    keys = [k for k in ("val_fraction", "seed") if k in theirs and k in mine and theirs[k] != mine[k]]
    if keys:
        what = ", ".join(f"data.{k}: checkpoint {theirs.get(k)}, configured {mine.get(k)}" for k in keys)
    elif theirs.get("pool") != mine.get("pool"):
        what = f"split from {theirs.get('pool')} training samples then, {mine.get('pool')} now"
    else:
        what = "the same settings hold out other samples here"
    advice = " ".join(f"data.{k}={theirs[k]}" for k in ("val_fraction", "seed") if k in theirs)
    raise SplitMismatchError(
        f"{f'{where} was' if where else 'the checkpoint was'} trained with another validation split ({what}): "
        f"resumed with this one, it would validate on images it trained on. Resume with {advice} (the "
        "checkpoint's), or start a new run in a new folder (model=from_checkpoint model.path=<checkpoint> to "
        "start from its weights)."
    )
