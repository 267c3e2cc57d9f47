"""Video classification from list files: "path label" lists and Something-Something v2's annotation files.

Two formats, told apart by the file's suffix (``train_list`` and ``val_list``; val is also the test split):

* ``.csv`` / ``.txt`` (any suffix but ``.json``): one video a line, ``<path> <integer label>``, separated by
  whitespace, no header: the lists of V-JEPA 2 (``src/datasets/video_dataset.py`` reads them with
  ``pd.read_csv(path, header=None, delimiter=" ")``) and VideoMAE (its SSv2 and Kinetics ``train.csv`` /
  ``val.csv``). A path holds no space; blank lines are passed over.
* ``.json``: Something-Something v2's ``something-something-v2-train.json`` / ``-validation.json``, a list of
  ``{"id": "78687", "template": "Holding [something] next to [something]", ...}``; ``labels_file``
  (``something-something-v2-labels.json``) maps each template with its brackets removed to its class index, a
  string (``"0"`` .. ``"173"``). A video is ``<video_dir>/<id><video_ext>`` (``.webm``), its class
  ``int(labels[template.replace("[", "").replace("]", "")])``, as facebookresearch/SlowFast's
  ``slowfast/datasets/ssv2.py`` (``Ssv2._construct_loader``) reads them; the class names are the labels file's.

Paths: a relative ``train_list``, ``val_list``, ``labels_file``, ``class_names`` file or ``video_dir`` is under
``root``; a relative video path in a list (and an SSv2 id's file) under ``root/video_dir`` (``video_dir`` null:
``root`` itself); absolute paths are taken as they are. ``class_names``: a list, or a file of one name a line
(line ``i`` names class ``i``). ``num_classes``: as given, else the number of names, else the train list's largest
label + 1.

The clips are read as class folders' are (:class:`~vitrel.data.video.base.VideoFilesDataModule`: the same
sampling, ``clips_per_video``, ``num_segments``, ``on_bad_sample``). A missing list file or video folder raises
:class:`~vitrel.data.datasets.DatasetNotFoundError`; a line that is not ``<path> <integer>`` (its file, number and
text), a label outside ``0..num_classes-1``, an SSv2 template the labels file lacks, a train list of fewer than two
classes and listed videos that do not exist (checked at setup: the first few named, and how many) raise
:class:`VideoListError`, a data set error that ``train.py`` and ``eval.py`` print as its line alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitrel.data.datasets import DatasetIntegrityError, DatasetNotFoundError
from vitrel.data.imagenet import LazyClasses
from vitrel.data.video.base import VideoFilesDataModule

__all__ = ["VideoListDataModule", "VideoListError", "read_path_label_list", "read_ssv2_annotations", "read_ssv2_labels"]

#: a list's entries: ``(video path, label, where)``, ``where`` naming its line (or JSON entry) in errors
Entry = tuple[str, int, str]
_INT = re.compile(r"[+-]?\d+")
#: how many missing videos an error names
NAMED = 3


class VideoListError(DatasetIntegrityError, ValueError):
    """A list file that cannot be read as a data set, or videos it names that are not there: a data set error
    (``train.py`` and ``eval.py`` print its message alone)."""


def read_path_label_list(path: Path, videos: Path) -> list[Entry]:
    """The ``(video, label, "line n")`` of a "path label" list ``path``, a relative video path under ``videos``."""
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not _INT.fullmatch(fields[1]):
            raise VideoListError(
                f"{path}, line {n}: {line.strip()!r} is not '<video path> <integer label>' (one video a line, "
                "separated by a space, no header: V-JEPA 2's and VideoMAE's lists)"
            )
        entries.append((str(videos / fields[0]), int(fields[1]), f"line {n}"))
    return entries


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise VideoListError(f"{path}: not JSON ({e})") from None


def read_ssv2_labels(path: Path) -> dict[str, int]:
    """``something-something-v2-labels.json``: each template (brackets removed) -> its class index."""
    raw = _json(path)
    if not isinstance(raw, dict) or not all(isinstance(v, (str, int)) and _INT.fullmatch(str(v)) for v in raw.values()):
        raise VideoListError(
            f"{path}: not Something-Something v2's labels file (an object of template -> class index, "
            '{"Holding something next to something": "0", ...})'
        )
    labels = {str(k): int(v) for k, v in raw.items()}
    if sorted(labels.values()) != list(range(len(labels))):
        raise VideoListError(f"{path}: its class indices are not 0..{len(labels) - 1}, each once")
    return labels


def read_ssv2_annotations(path: Path, labels: dict[str, int], labels_file: Path, videos: Path, ext: str) -> list[Entry]:
    """The ``(videos/<id><ext>, class, "entry i (id ...)")`` of an SSv2 annotation file ``path`` (a JSON list of
    ``{"id", "template", ...}``), the class ``labels[template without brackets]`` (``labels_file``'s)."""
    raw = _json(path)
    if not isinstance(raw, list):
        raise VideoListError(f"{path}: not a Something-Something v2 annotation file (a JSON list of videos)")
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or "id" not in item or "template" not in item:
            has = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise VideoListError(
                f"{path}, entry {i}: {has} has no 'id' and 'template' (the test split's file has no labels: give "
                "something-something-v2-train.json and -validation.json)"
            )
        key = str(item["template"]).replace("[", "").replace("]", "")
        if key not in labels:
            raise VideoListError(
                f"{path}, entry {i} (id {item['id']}): its template {key!r} (brackets removed) is not in {labels_file}"
            )
        entries.append((str(videos / f"{item['id']}{ext}"), labels[key], f"entry {i} (id {item['id']})"))
    return entries


class VideoListDataModule(LazyClasses, VideoFilesDataModule):
    """Videos named by list files, ``train_list`` and ``val_list`` (see the module docstring): "path label" lists
    or Something-Something v2's JSON annotations (with ``labels_file``; ``video_dir``, ``video_ext``).

    ``class_names``: a list or a file of names (SSv2: the labels file's by default); ``num_classes``: inferred
    (the names, else the train list's largest label + 1), or given and checked. The clips' options and other
    kwargs as :class:`~vitrel.data.video.base.VideoFilesDataModule`.
    """

    dataset_name = "video lists"

    def __init__(
        self,
        root: str | Path | None = None,
        train_list: str | None = None,
        val_list: str | None = None,
        labels_file: str | None = None,
        video_dir: str | None = None,
        video_ext: str = ".webm",
        class_names: str | Sequence[str] | None = None,
        num_classes: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(root=root, num_classes=num_classes, **kwargs)
        self.train_list, self.val_list, self.labels_file = train_list, val_list, labels_file
        self.video_dir, self.video_ext = video_dir, video_ext
        self._names_given = class_names
        self._named = False
        self._entries: dict[str, list[Entry]] = {}

    @property
    def class_names(self) -> list[str] | None:
        """The classes' names when given (``class_names``, an SSv2 labels file), else None (their indices)."""
        return list(self.classes) if self._named else None

    def _file(self, name: str | os.PathLike) -> Path:
        """``name`` under ``root`` when relative."""
        path = Path(name).expanduser()
        return path if path.is_absolute() or self.root is None else self.root.absolute() / path

    @property
    def videos(self) -> Path:
        """The folder relative video paths (and SSv2 ids) are under: ``root/video_dir``."""
        return self._file(self.video_dir or ".")

    def _how_to_get(self) -> list[str]:
        return [
            "data.train_list, data.val_list: lists of '<video path> <integer label>' lines (V-JEPA 2's, VideoMAE's "
            "train.csv / val.csv), or Something-Something v2's something-something-v2-train.json / -validation.json "
            "with data.labels_file=something-something-v2-labels.json and data.video_dir=<the folder of <id>.webm>",
            "relative list files are under data.root, relative video paths under data.root/data.video_dir",
        ]

    def _not_found(self, detail: str, searched: Sequence[Path] = ()) -> DatasetNotFoundError:
        return DatasetNotFoundError(self.dataset_name, list(searched), self._how_to_get(), detail=detail)

    def _existing(self, key: str, value: Any) -> Path:
        if value is None:
            raise self._not_found(f"No data.{key} given.")
        path = self._file(value)
        if not path.is_file():
            raise self._not_found(f"No file {path} (data.{key}).", [path])
        return path

    def _read(self, key: str, labels: dict[str, int] | None, labels_file: Path | None) -> list[Entry]:
        path = self._existing(key, getattr(self, key))
        if path.suffix.lower() != ".json":
            return read_path_label_list(path, self.videos)
        if labels is None or labels_file is None:
            raise VideoListError(
                f"{path} (data.{key}) is a Something-Something v2 annotation file: give data.labels_file=<its "
                "something-something-v2-labels.json>"
            )
        return read_ssv2_annotations(path, labels, labels_file, self.videos, self.video_ext)

    def _names(self) -> list[str] | None:
        value = self._names_given
        if value is None or not isinstance(value, (str, os.PathLike)):
            return None if value is None else [str(v) for v in value]
        path = self._existing("class_names", value)
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]

    def _locate(self) -> list[str]:
        """Read both lists (and the labels file, the names); check their labels; return the class names (their
        indices as strings when none are given)."""
        labels_file = None if self.labels_file is None else self._existing("labels_file", self.labels_file)
        labels = None if labels_file is None else read_ssv2_labels(labels_file)
        if self.video_dir is not None and not self.videos.is_dir():
            raise self._not_found(f"No folder {self.videos} (data.video_dir).", [self.videos])
        train, val = (self._read(k, labels, labels_file) for k in ("train_list", "val_list"))
        names = self._names()
        if names is None and labels is not None:
            names = sorted(labels, key=labels.__getitem__)
        counts = {"data.num_classes": self._given_num_classes, "class names": None if names is None else len(names)}
        given = {k: int(v) for k, v in counts.items() if v is not None}
        if len(set(given.values())) > 1:
            raise VideoListError(
                f"{' but '.join(f'{k}: {v}' for k, v in given.items())}: give as many names as classes"
            )
        n = next(iter(given.values()), max((y for _, y, _ in train), default=-1) + 1)
        why = next(iter(given), f"the largest label of {self.train_list} + 1")
        for key, entries in (("train_list", train), ("val_list", val)):
            if not entries:
                raise VideoListError(f"{self._file(getattr(self, key))} (data.{key}) lists no videos")
            bad = next(((y, where) for _, y, where in entries if not 0 <= y < n), None)
            if bad is not None:
                raise VideoListError(
                    f"{self._file(getattr(self, key))}, {bad[1]}: label {bad[0]} is outside 0..{n - 1} ({n} classes: "
                    f"{why}; set data.num_classes to the number of classes)"
                )
        found = sorted({y for _, y, _ in train})
        if len(found) < 2:  # (else torchmetrics' "num_classes ... larger than 1", at the module)
            raise VideoListError(
                f"{self._file(self.train_list)} (data.train_list) has one class ({found[0]}): a classifier needs two "
                "or more"
            )
        self._entries = {"train": train, "test": val}
        self._named = names is not None
        return names if names is not None else [str(i) for i in range(n)]

    def _load_raw(self, split: str) -> list[tuple[str, int]]:
        """The split's ``(path, class index)`` pairs, every video checked to exist (the first few missing named)."""
        _ = self.classes  # (reads the lists)
        key, entries = (
            ("train_list", self._entries["train"]) if split == "train" else ("val_list", self._entries["test"])
        )
        missing = [p for p, _, _ in entries if not os.path.isfile(p)]
        if missing:
            named = ", ".join(missing[:NAMED]) + (", ..." if len(missing) > NAMED else "")
            raise VideoListError(
                f"{len(missing)} of the {len(entries)} videos of {self._file(getattr(self, key))} (data.{key}) do "
                f"not exist: {named} (relative paths are under {self.videos}: data.root/data.video_dir)"
            )
        return [(p, y) for p, y, _ in entries]
