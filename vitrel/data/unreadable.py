"""What a class-folder data set (images or videos) does with a file it cannot read, ``data.on_bad_sample``.

``"raise"``: a :class:`~vitrel.data.datasets.BadSampleError` naming the file and ``data.on_bad_sample=skip``.
``"skip"``, a training split: the file is logged by name (once a run) and the next readable file of the split,
with its own label, is read in its place, as timm's ``ImageDataset`` does. ``"skip"``, an evaluation split (val,
test, ``eval.py``; the copy :meth:`SkipUnreadable.leaving_out` gives): the sample is ``None`` and
:class:`LeaveOutCollate` drops it from its batch, so every readable file is scored once and the unreadable ones not
at all (a replacement would be scored twice). Under DDP :class:`~vitrel.data.sampling.EvalSampler` gives each file to
one rank, so this holds over the ranks too.

The data set counts (shared with its DataLoader workers); :class:`ReportUnreadable`, a Lightning callback that
``train.py`` and ``eval.py`` add, logs one line at the end of each pass, summed over the ranks: the count of files
replaced (training), or the count and names of the files left out (evaluation).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import default_collate, get_worker_info

from vitrel.data.datasets import ON_BAD_SAMPLE, BadSampleError

__all__ = ["SkipUnreadable", "LeaveOutCollate", "ReportUnreadable", "MAX_CONSECUTIVE_SKIPS", "SKIP_HINT"]

log = logging.getLogger(__name__)

#: consecutive unreadable files after which ``on_bad_sample="skip"`` gives up (timm's ``ImageDataset`` retries 50)
MAX_CONSECUTIVE_SKIPS = 50
#: what a ``BadSampleError`` of a class-folder data set says after the file's name
SKIP_HINT = (
    "data.on_bad_sample=skip leaves such files out (each logged by name; in training the next readable file is taken "
    "in its place; a count at the end of each pass)"
)
#: the most files the end-of-pass line names (the others counted)
NAMED = 20


class SkipUnreadable:
    """Mixin of a class-folder data set: what it does with a file it cannot read (see the module docstring). A
    subclass calls :meth:`init_skips`, implements :meth:`sample_path`, reads through :meth:`read_or_skip` and may set
    ``noun`` and ``read_errors`` and override :meth:`bad_reason` and :meth:`bad_sample_error`.

    ``skipped`` counts the samples replaced (slot 0 the main process, ``1 + id`` worker ``id``'s); ``left_out`` (a
    :meth:`leaving_out` copy, else None) how often each sample was left out; both are in shared memory, so the
    DataLoader workers' counts reach the main process. :meth:`take_pass` gives the counts since its last call."""

    noun = "file"  #: what a sample is read from, in the messages ("image file", "video file")
    read_errors: tuple[type[BaseException], ...] = (OSError,)  #: what a file that cannot be read raises

    def init_skips(self, on_bad_sample: str, leave_out: bool = False) -> None:
        """The counts, none yet; ``leave_out`` (with ``"skip"``; the data set's length known): an evaluation split's
        data set, whose unreadable samples are ``None``."""
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f"on_bad_sample must be one of {ON_BAD_SAMPLE}, got {on_bad_sample!r}")
        self.on_bad_sample = on_bad_sample
        self.skipped = torch.zeros(65, dtype=torch.int64).share_memory_()
        self.left_out: torch.Tensor | None = None
        if leave_out and on_bad_sample == "skip":
            self.left_out = torch.zeros(len(self), dtype=torch.int32).share_memory_()  # type: ignore[arg-type]
        self._named = torch.zeros(len(self), dtype=torch.bool).share_memory_()  # type: ignore[arg-type]
        self._in_a_row = 0  # (this process's unreadable files in a row, leaving out)
        self._taken: tuple[int, torch.Tensor | None] = (0, None)  # (take_pass: the counts at its last call)

    def sample_path(self, index: int) -> str:
        """The file sample ``index`` is read from."""
        raise NotImplementedError

    def leaving_out(self) -> SkipUnreadable:
        """This data set for an evaluation split: with ``on_bad_sample="skip"``, a copy (the same files, counts of
        its own) whose unreadable samples are ``None``, to be dropped by :class:`LeaveOutCollate`; else itself."""
        if self.on_bad_sample != "skip":
            return self
        twin = copy.copy(self)
        twin.init_skips("skip", leave_out=True)
        return twin

    def bad_reason(self, path: str, err: BaseException) -> str:
        """Why ``path`` cannot be read, in a few words (the error, less the path it repeats)."""
        return f"{type(err).__name__}: {err}".replace(f"{path}: ", "")

    def bad_sample_error(self, path: str, reason: str) -> Exception:
        """The error ``on_bad_sample="raise"`` raises for ``path``."""
        return BadSampleError(f"cannot read {path} ({reason}); {SKIP_HINT}")

    def read_or_skip(self, index: int, read: Callable[[int], Any]) -> Any:
        """``read(index)``; when it raises one of ``read_errors`` and ``on_bad_sample`` is ``"skip"``: ``None`` (a
        :meth:`leaving_out` copy), else the first of ``read(index + 1)``, ``read(index + 2)``, ... (modulo the
        length) that does not. Gives up after :data:`MAX_CONSECUTIVE_SKIPS` unreadable files in a row."""
        if self.left_out is not None:
            try:
                item = read(index)
            except self.read_errors as err:
                self._in_a_row += 1
                self._bad(index, err, self._in_a_row)
                self.left_out[index] += 1
                return None
            self._in_a_row = 0
            return item
        for skips in range(1, MAX_CONSECUTIVE_SKIPS + 1):
            i = (int(index) + skips - 1) % len(self)  # type: ignore[arg-type]
            try:
                return read(i)
            except self.read_errors as err:
                self._bad(i, err, skips)
                if skips == 1:  # (the files after it tried in its place are counted when they are asked for)
                    info = get_worker_info()
                    self.skipped[0 if info is None else 1 + info.id % 64] += 1
        raise AssertionError("unreachable")  # (_bad raises at MAX_CONSECUTIVE_SKIPS)

    def _bad(self, index: int, err: BaseException, in_a_row: int) -> None:
        """Raise (``raise``, or ``in_a_row`` reaching :data:`MAX_CONSECUTIVE_SKIPS`), or log sample ``index``'s file
        the first time any of the data set's processes meets it (leaving out: at debug level,
        :class:`ReportUnreadable` names it)."""
        path = self.sample_path(index)
        reason = self.bad_reason(path, err)
        if self.on_bad_sample == "raise":
            raise self.bad_sample_error(path, reason) from err
        if in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise BadSampleError(
                f"{in_a_row} files in a row cannot be read, the last {path} ({reason}): is "
                f"{Path(path).parent.parent} a folder of class folders of {self.noun}s?"
            ) from err
        if not self._named[index]:  # (shared with the workers: a new worker each epoch names it no more)
            self._named[index] = True
            if self.left_out is not None:
                log.debug("left out %s: cannot read it (%s)", path, reason)
            else:
                what = "skipped %s: cannot read it (%s); the next readable file is taken in its place"
                log.warning(what, path, reason)

    def take_pass(self) -> tuple[int, torch.Tensor | None]:
        """``(samples replaced, per-sample times left out or None)`` since the last call (in the main process, after
        a pass: its counts)."""
        replaced, left = int(self.skipped.sum()), None if self.left_out is None else self.left_out.clone()
        before, self._taken = self._taken, (replaced, left)
        if left is not None and before[1] is not None:
            left = left - before[1]
        return replaced - before[0], left


class LeaveOutCollate:
    """``collate`` (default: torch's ``default_collate``) of a batch's samples that are not ``None`` (the files a
    :meth:`SkipUnreadable.leaving_out` data set could not read); ``None`` when none is left."""

    def __init__(self, collate: Callable[[list], Any] | None = None) -> None:
        self.collate = collate if collate is not None else default_collate

    def __call__(self, samples: list) -> Any:
        kept = [s for s in samples if s is not None]
        return self.collate(kept) if kept else None


def _skip_datasets(loaders: Any) -> list[SkipUnreadable]:
    """The :class:`SkipUnreadable` data sets (``on_bad_sample="skip"``) behind ``loaders`` (a loader, or a list or
    dict of them; a data set found through its wrappers' ``dataset``)."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    found = []
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        ds = getattr(loader, "dataset", None)
        while ds is not None and not isinstance(ds, SkipUnreadable):
            ds = getattr(ds, "dataset", None)
        if ds is not None and ds.on_bad_sample == "skip":
            found.append(ds)
    return found


class ReportUnreadable(Callback):
    """At the end of each training, validation (not the sanity check) and test pass, one log line (rank 0) per
    :class:`SkipUnreadable` data set with ``on_bad_sample="skip"`` that met unreadable files in the pass, counted over
    the ranks: ``skipped 3 unreadable image file(s) in this pass over train ...`` (training: each replaced by the next
    file), or ``val: 2 unreadable image file(s) left out of 1,000 in <folder> (...): <class>/<file>, ...``
    (evaluation). ``test_split`` names the test loop's split in that line (``eval.py split=val``: ``"val"``).
    ``left_out`` maps ``"val"`` / ``"test"`` to the files the last such pass left out."""

    def __init__(self, test_split: str = "test") -> None:
        self.test_split = test_split
        self.left_out: dict[str, list[str]] = {}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._report(trainer, pl_module, trainer.train_dataloader, "train")

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:  # (its few batches: the first full pass names them)
            self._report(trainer, pl_module, trainer.val_dataloaders, "val")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._report(trainer, pl_module, trainer.test_dataloaders, self.test_split)

    def _report(self, trainer, pl_module, loaders: Any, split: str) -> None:
        for ds in _skip_datasets(loaders):
            replaced, left = ds.take_pass()
            if trainer.world_size > 1:  # (every rank holds the same data sets: the same collectives)
                n = torch.tensor(replaced, device=pl_module.device)
                replaced = int(trainer.strategy.reduce(n, reduce_op="sum"))
                if left is not None:
                    left = trainer.strategy.reduce(left.to(pl_module.device), reduce_op="sum").cpu()
            if left is not None:
                names = [ds.sample_path(int(i)) for i in torch.nonzero(left).flatten()]
                self.left_out[split] = names
                if names and trainer.is_global_zero:
                    log.warning(_left_out_line(split, names, len(ds), ds.noun))  # type: ignore[arg-type]
            elif replaced and trainer.is_global_zero:
                log.warning(
                    "skipped %d unreadable %s(s) in this pass over %s (data.on_bad_sample=skip, each named when first "
                    "met), each replaced by the next readable file",
                    replaced,
                    ds.noun,
                    split,
                )


def _left_out_line(split: str, paths: list[str], total: int, noun: str) -> str:
    """``val: 2 unreadable image file(s) left out of 1,000 in <folder> (...): a/x.jpg, b/y.jpg`` (names relative to
    the class folders' folder when they share one; the first :data:`NAMED`, then a count)."""
    folders = {Path(p).parent.parent for p in paths}
    where = f" in {folders.pop()}" if len(folders) == 1 else ""
    names = [str(Path(p).relative_to(Path(p).parent.parent)) if where else p for p in paths[:NAMED]]
    more = f", and {len(paths) - NAMED} more" if len(paths) > NAMED else ""
    return (
        f"{split}: {len(paths)} unreadable {noun}(s) left out of {total:,}{where} (data.on_bad_sample=skip; the others "
        f"each scored once): {', '.join(names)}{more}"
    )
