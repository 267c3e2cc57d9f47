"""Video classification from class folders of encoded clips (the Kinetics / UCF-101 layout).

Expected layout (torchvision's ``Kinetics`` and ``DatasetFolder``)::

    root/train/<class>/<clip>.mp4      e.g. root/train/archery/-Qz25rXdMjE_000014_000024.mp4
    root/val/<class>/<clip>.avi        (.mp4, .avi, .webm, .mkv, .mov, .m4v: ``extensions``)

Classes are the sorted ``train`` folder names; ``val`` uses the same indices (it may lack classes, not add any)
and is also the test split (unless ``val_fraction > 0``). Kinetics-400/600/700 downloads come in this layout
(``train/``, ``val/``); UCF-101 ships one folder per class plus split lists (``trainlist01.txt``,
``testlist01.txt``): move (or link) each list's clips into ``train/<class>/`` and ``val/<class>/``.

Decoding is PyAV's (:mod:`vitrel.data.video.clips`). PyAV rather than torchcodec: PyAV's wheels bundle FFmpeg, so
``pip install av`` is all a machine needs, for any torch; torchcodec loads the system's FFmpeg libraries (4 to 8)
and must match the installed torch, and on a machine without them (this project's CPU CI) it cannot decode at all.

Training takes one random clip per video each time (``num_frames`` frames, ``stride`` apart, a fresh start every
epoch); evaluation a video's ``clips_per_video`` evenly spaced clips as one sample, ``[K, C, T, H, W]`` when
``K > 1`` (a batch ``[B, K, C, T, H, W]``: ``batch_size`` videos), so the accuracy logged is per video, of the mean
of its clips' softmax (multi-view testing, as VideoMAE's and Video Swin's). Normalisation: timm's ImageNet mean
and std (as VideoMAE's). A missing folder, or a train class folder without videos, raises ``DatasetNotFoundError``
naming it, a file that does not decode :class:`~vitrel.data.video.clips.VideoDecodeError` naming the file and
``data.on_bad_sample=skip``; with ``on_bad_sample="skip"`` such a file is logged by name and, in training, the next
video that decodes (with its own label) is read in its place; in evaluation it is left out (each video that decodes
scored once); a count at the end of each pass, as for image folders (:mod:`vitrel.data.unreadable`).
A class folder that is a link to nothing is named in a warning and passed over. A train folder with one class folder
raises ``DatasetNotFoundError`` (a classifier needs two classes).

With ``num_segments = G > 1`` (``clips_per_video`` 1) every sample, training's and evaluation's, is ``G`` clips, one
from each of ``G`` equal parts of the video, joined along time, ``[C, G * T, H, W]`` (V-JEPA 2's protocol:
:func:`~vitrel.data.video.sampling.segment_starts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from vitrel.data.datasets import DatasetNotFoundError
from vitrel.data.imagenet import FixedClassImageFolder, LazyClasses, locate_class_folders
from vitrel.data.video.base import VideoFilesDataModule

__all__ = ["VideoFolderDataModule", "VIDEO_EXTENSIONS", "video_files"]

VIDEO_EXTENSIONS = (".mp4", ".avi", ".webm", ".mkv", ".mov", ".m4v")


def video_files(
    folder: str | Path, classes: list[str], extensions: Sequence[str] = VIDEO_EXTENSIONS, allow_empty: bool = False
) -> Dataset:
    """``(path, class index)`` of every video file under ``folder/<class>/`` (sorted; torchvision's
    ``DatasetFolder`` walk). A class folder without a video raises ``FileNotFoundError`` naming it (unless
    ``allow_empty``), and so does a folder without any."""
    exts = tuple(e.lower() for e in extensions)
    try:
        ds = FixedClassImageFolder(
            folder, classes, loader=str, is_valid_file=lambda p: p.lower().endswith(exts), allow_empty=allow_empty
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} (video files: {', '.join(exts)})") from e
    if not len(ds):
        raise FileNotFoundError(f"{folder}: no video files ({', '.join(exts)}) in its class folders")
    return ds


class VideoFolderDataModule(LazyClasses, VideoFilesDataModule):
    """Class folders of videos under ``root/train`` and ``root/val`` (see the module docstring).

    ``num_classes`` is inferred from the train folders; passing it checks it (and lets a model be built before the
    data is reachable). The clips' options (``num_frames``, ``stride``, ``clips_per_video``, ``num_segments``,
    ``on_bad_sample``, ``in_chans``) and other kwargs as :class:`~vitrel.data.video.base.VideoFilesDataModule`.
    """

    dataset_name = "video folders"

    def __init__(
        self,
        root: str | Path | None = None,
        num_classes: int | None = None,
        train_dir: str = "train",
        val_dir: str = "val",
        extensions: Sequence[str] = VIDEO_EXTENSIONS,
        **kwargs: Any,
    ) -> None:
        if not extensions:
            raise ValueError("extensions must list at least one file extension, e.g. ['.mp4']")
        super().__init__(root=root, num_classes=num_classes, **kwargs)
        self.train_dir, self.val_dir = train_dir, val_dir
        self.extensions = tuple(extensions)

    @property
    def class_names(self) -> list[str]:
        return list(self.classes)

    def _how_to_get(self) -> list[str]:
        return [
            f"lay the clips out as <root>/{self.train_dir}/<class>/<clip>.mp4 and <root>/{self.val_dir}/<class>/...",
            "Kinetics: the train/ and val/ folders of a download; UCF-101: move each split list's clips into them",
            f"train.py and eval.py: data.root=<the folder holding {self.train_dir}/ and {self.val_dir}/> (by default "
            "$VITREL_DATA_ROOT/videos, else data/videos)",
        ]

    def _locate(self) -> list[str]:
        """Check the layout; return the sorted class folder names of train (at least two)."""
        return locate_class_folders(
            self.dataset_name, self.root, self.train_dir, self.val_dir, self._how_to_get(), self._given_num_classes
        )

    def _load_raw(self, split: str) -> Dataset:
        folder = self.root.absolute() / (self.train_dir if split == "train" else self.val_dir)  # type: ignore[union-attr]
        try:  # (val may lack some classes)
            return video_files(folder, self.classes, self.extensions, allow_empty=split != "train")
        except FileNotFoundError as e:  # no videos in a class folder: a data set error (one line from train.py)
            raise DatasetNotFoundError(self.dataset_name, [folder], self._how_to_get(), detail=str(e)) from None
