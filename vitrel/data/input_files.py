"""The files ``predict.py`` scores (:func:`vitrel.inference.predict_folder`): the images or videos under a folder, a
tree of class folders or one file, found as the class-folder data sets find theirs (one walk, links to folders followed
unless they lead back up, hidden and system folders and macOS's ``._<name>`` files passed over)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from vitrel.data.datasets import IMG_EXTENSIONS, is_apple_double, is_system_folder, walk_files, warn_loops

__all__ = [
    "IMG_EXTENSIONS",
    "NoImagesError",
    "NoVideosError",
    "FoundFiles",
    "check_input",
    "walk_input",
    "find_files",
    "find_images",
    "find_videos",
]

log = logging.getLogger(__name__)


class NoImagesError(FileNotFoundError):
    """The input folder holds no image files."""


class NoVideosError(FileNotFoundError):
    """The input folder holds no video files."""


def walk_input(root: Path, passed: list[Path] | None = None, loops: list[str] | None = None) -> list[Path]:
    """Every file under ``root``, found by the class-folder data sets' walk
    (:func:`~vitrel.data.datasets.walk_files`: links to folders followed unless they lead back up, a link to nothing
    listed, so that a name with an image extension is counted as a file that cannot be read); the hidden and system
    folders it passes over (``.ipynb_checkpoints``, ``@eaDir``) are added to ``passed``, the links back up it does
    not follow to ``loops``."""
    folders, skipped, not_followed = walk_files(root)
    if passed is not None:
        passed += [Path(p) for p in skipped]
    if loops is not None:
        loops += not_followed
    return [Path(folder) / n for folder, names in folders for n in names]


class FoundFiles(NamedTuple):
    """What :func:`find_files` found under a folder, in one walk."""

    files: list[Path]  #: the files with the extensions asked, sorted
    folders: list[str] | None  #: the class folder names when the folder is a tree of class folders, else None
    others: int  #: the files of other kinds under the folder (0 when the input is one file)


def check_input(
    root: Path, what: str, error: type[FileNotFoundError] = FileNotFoundError, extensions: Sequence[str] = ()
) -> None:
    """``FileNotFoundError`` naming ``root`` (and what to give: a folder of ``what``...) when nothing is there, and
    ``error`` when ``root`` is a folder whose tree holds no file at all (only folders; a link counts as something:
    :func:`walk_input` follows it) or, given ``extensions``, a file or a tree holding none of them (only other files;
    the hidden and system folders :func:`walk_input` passes over not looked in). Cheap: the walk stops at the first
    file (of ``extensions``, when given)."""
    if not root.exists():
        raise FileNotFoundError(
            f"input {root} does not exist: give a folder of {what}, a tree of class folders or a file"
        )
    kinds = f"looked for {', '.join(extensions)}"
    if root.is_file():
        if extensions and root.suffix.lower() not in extensions:
            raise error(f"input {root} is none of the {what} taken ({kinds})")
        return
    found, others = _first_file(root, extensions)
    if found:
        return
    if not others:
        raise error(f"no {what} in {root}: neither it nor its sub-folders hold a file")
    raise error(f"no {what} in {root} ({kinds}): its tree holds {len(others)} other file(s), e.g. {others[0]}")


def _first_file(root: Path, extensions: Sequence[str]) -> tuple[bool, list[str]]:
    """Whether the tree under the folder ``root`` holds a file (of ``extensions`` when given, not an AppleDouble
    ``._<name>``) or a link to a folder, walked top-down and stopping at the first; and, when it holds none, the
    other files' paths under ``root``, sorted."""
    others = []
    for folder, subfolders, files in os.walk(root):
        if extensions:
            subfolders[:] = sorted(d for d in subfolders if not is_system_folder(d))
        if any(os.path.islink(os.path.join(folder, d)) for d in subfolders):
            return True, []
        taken = [f for f in files if f.lower().endswith(tuple(extensions)) and not is_apple_double(f)]
        if taken if extensions else files:
            return True, []
        others += [str(Path(folder, f).relative_to(root)) for f in files]
    return False, sorted(others)


def find_files(root: Path, extensions: Sequence[str], what: str, error: type[FileNotFoundError]) -> FoundFiles:
    """Files under ``root`` with ``extensions`` (sorted; ``root`` alone when it is one such file; links to folders
    followed, links to nothing kept: :func:`walk_input`), the class folder names when ``root`` is a tree of class
    folders (files only in its sub-folders), else None, and the count of the other files; ``error`` (named ``what``)
    for none."""
    check_input(root, what, error)
    if root.is_file():
        if root.suffix.lower() not in extensions:
            raise error(f"input {root} is not one of the {what} the model takes ({', '.join(extensions)})")
        return FoundFiles([root], None, 0)
    passed: list[Path] = []
    loops: list[str] = []
    walked = walk_input(root, passed, loops)
    files = sorted(f for f in walked if f.suffix.lower() in extensions and not is_apple_double(f))
    warn_loops(loops)
    if passed:
        more = " ..." if len(passed) > 5 else ""
        names = ", ".join(str(p.relative_to(root)) for p in sorted(passed)[:5])
        log.warning(f"passed over {len(passed)} hidden or system folder(s) in {root}: {names}{more}")
    if not files:
        raise error(f"no {what} in {root} (looked for {', '.join(extensions)} in the folder and its sub-folders)")
    tree = all(len(f.relative_to(root).parts) == 2 for f in files)
    folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not is_system_folder(d.name))
    return FoundFiles(files, folders if tree else None, len(walked) - len(files))


def find_images(root: str | Path) -> tuple[list[Path], list[str] | None]:
    """Image files under ``root`` (sorted; ``root`` alone when it is an image file), and the class folder names when
    ``root`` is an ``ImageFolder`` tree (images only in its sub-folders), else None. Raises :class:`NoImagesError` for
    none."""
    return find_files(Path(root), IMG_EXTENSIONS, "images", NoImagesError)[:2]


def find_videos(root: str | Path) -> tuple[list[Path], list[str] | None]:
    """Video files under ``root`` (the extensions of :data:`vitrel.data.video.VIDEO_EXTENSIONS`), as
    :func:`find_images`. Raises :class:`NoVideosError` for none."""
    from vitrel.data.video.folder import VIDEO_EXTENSIONS

    return find_files(Path(root), VIDEO_EXTENSIONS, "videos", NoVideosError)[:2]
