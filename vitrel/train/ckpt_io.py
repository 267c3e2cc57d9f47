"""Checkpoint files that are either the old file or the complete new one, never a torn mix.

Lightning's ``TorchCheckpointIO`` serialises to memory, then moves a temporary file from ``$TMPDIR``
over the target (an fsspec transaction). When the run folder is on another filesystem than
``$TMPDIR`` (a cluster's scratch or NFS run folder, ``/tmp`` local), that move is a copy into the
target file itself: a full disk or a kill during the copy leaves a torn ``last.ckpt``, and the previous
one is gone.

:class:`AtomicCheckpointIO` writes into a temporary file in the target's own folder, flushes it to disk
(``fsync``), then renames it over the target (``os.replace``, atomic within a filesystem) and syncs the
folder. Any failure before the rename (no space left, a signal, SIGKILL) leaves the previous file as it
was; the temporary file is removed on an exception (after SIGKILL it stays behind as
``.<name>.*.tmp``, never under the checkpoint's own name). ``train()`` hands it to the trainer
(``Trainer(plugins=[AtomicCheckpointIO()])``), so every checkpoint the trainer writes goes through it:
``last.ckpt`` (:class:`~vitrel.train.last_checkpoint.LastCheckpoint`,
:class:`~vitrel.train.callbacks.SignalCheckpoint`) and ``ModelCheckpoint``'s best files alike.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vitrel.models.ckpt_files import follow_umask

__all__ = ["AtomicCheckpointIO", "atomic_write"]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """``write(f)`` into a temporary file beside ``path``, ``fsync``, then ``os.replace`` it over ``path``.

    On any exception the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        follow_umask(tmp)  # (mkstemp creates 0600: the checkpoint gets a file's usual permissions)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (the folder's entry), where the OS allows opening folders."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows: folders cannot be opened; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves go through :func:`atomic_write` (same-folder temporary
    file, ``fsync``, ``os.replace``). Remote paths (``s3://...``) are Lightning's own transaction, which
    uploads whole objects. Loading is Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg is not supported "
                f"for `{type(self).__name__}`. Please implement your custom `CheckpointIO` to define how you'd like "
                "to use `storage_options`."
            )
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_write(path, lambda f: torch.save(checkpoint, f))
