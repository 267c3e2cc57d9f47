"""The image files ``predict.py`` reads (:func:`vitrel.inference.predict_folder`): each file's tensor (or NaFlex dict),
or the reason it could not be read, and its EXIF orientation (a phone photo stored turned), batched by
:func:`collate_files` or :class:`PackedCollateFiles`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps
from torch import Tensor

__all__ = ["EXIF_ORIENTATION", "exif_orientation", "ImageFiles", "collate_files", "PackedCollateFiles"]

#: the EXIF tag of a photo's orientation: 1 upright, 3 turned 180 degrees, 6 and 8 by 90, 2, 4, 5 and 7 mirrored
EXIF_ORIENTATION = 0x0112


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation of ``img`` (2 to 8: a phone photo stored turned or mirrored, which a photo viewer shows
    upright), 1 when it has none or one outside 1-8 (which ``PIL.ImageOps.exif_transpose`` leaves as it is)."""
    o = img.getexif().get(EXIF_ORIENTATION, 1)
    return o if isinstance(o, int) and 1 <= o <= 8 else 1


class ImageFiles(torch.utils.data.Dataset):
    """``(index, tensor, None, EXIF orientation)``; a file that fails to open gives ``(index, None, reason, 1)``
    (skipped and counted by the loop). ``upright``: photos turned as their EXIF orientation says first."""

    def __init__(self, files: Sequence[Path], transform: Callable[[Any], Tensor], upright: bool = False) -> None:
        self.files, self.transform, self.upright = list(files), transform, upright

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[int, Tensor | None, str | None, int]:
        try:
            with Image.open(self.files[i]) as img:
                img.load()
                turn = exif_orientation(img)
                upright = ImageOps.exif_transpose(img) if self.upright and turn != 1 else img
                return i, self.transform(upright), None, turn
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, with its reason
            return i, None, f"cannot read it as an image ({type(e).__name__}: {e})", 1


def collate_files(batch: list[tuple]) -> tuple[list[int], Tensor | None, list[tuple[int, str]], list[tuple[int, int]]]:
    """Images' (:class:`ImageFiles`) or videos' samples -> the indices read, their batch, the ``(index, reason)`` of
    those that were not, and the ``(index, EXIF orientation)`` of the photos stored turned."""
    ok = [(b[0], b[1]) for b in batch if b[1] is not None]
    bad = [(b[0], b[2]) for b in batch if b[1] is None]
    return [i for i, _ in ok], (torch.stack([x for _, x in ok]) if ok else None), bad, _turned(batch)


def _turned(batch: list[tuple]) -> list[tuple[int, int]]:
    return [(b[0], b[3]) for b in batch if len(b) > 3 and b[3] != 1]


class PackedCollateFiles:
    """NaFlex per-image dicts -> a packed batch dict; the file indices in the order of the model's logits."""

    def __init__(self, seq_len: int, mode: str = "pack") -> None:
        from vitrel.data.packing import PackingCollator

        self.collator = PackingCollator(seq_len, mode)

    def __call__(self, batch: list[tuple]) -> tuple[list[int], Any, list[tuple[int, str]], list[tuple[int, int]]]:
        ok = [(b[0], b[1]) for b in batch if b[1] is not None]
        bad = [(b[0], b[2]) for b in batch if b[1] is None]
        if not ok:
            return [], None, bad, _turned(batch)
        x, order = self.collator([(x, i) for i, x in ok])
        return order.tolist(), x, bad, _turned(batch)
