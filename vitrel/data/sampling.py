"""The training order of the workers loader: an epoch's seeded order per rank (:class:`EpochSampler`) and a
``DataLoader`` that resumes mid-epoch (:class:`ResumableDataLoader`); :mod:`vitrel.data.base` re-exports them. The
evaluation order over ranks, each sample once (:class:`EvalSampler`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from vitrel.data.memory import ResumableLoader
from vitrel.data.transforms import SampleKey

__all__ = ["EpochSampler", "EvalSampler", "ResumableDataLoader"]


class EpochSampler(DistributedSampler):
    """Order of epoch ``e``: a permutation seeded by ``seed + e`` (or ``0..N-1``), rank ``r`` taking
    ``order[r::num_replicas]`` (padded to equal length, as ``DistributedSampler``); the next
    iteration starts ``skip`` samples in (a resumed epoch). ``keyed``: it yields each index as a
    :class:`~vitrel.data.transforms.SampleKey` ``(index, epoch, seed)``, drawn here in the main process at the epoch
    Lightning set (``set_epoch``), so a :class:`~vitrel.data.transforms.MappedDataset` seeds the sample's
    augmentation from it in whichever worker reads it."""

    def __init__(
        self, dataset, *, shuffle: bool, seed: int, num_replicas: int = 1, rank: int = 0, keyed: bool = False
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.skip = 0
        self.keyed = keyed

    def indices(self) -> list[int]:
        """This rank's whole order for the current epoch (``skip`` not applied)."""
        return list(super().__iter__())

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        order = itertools.islice(self.indices(), skip, None)
        if self.keyed:
            epoch, seed = int(self.epoch), int(self.seed)
            return (SampleKey(i, epoch, seed) for i in order)
        return order


class EvalSampler(DistributedSampler):
    """Evaluation order over ``num_replicas`` ranks: ``0..N-1``, rank ``r`` taking ``r::num_replicas``, not padded
    (the ranks' lengths differ by at most one), so a metric summed over the ranks counts each sample once; Lightning's
    own ``DistributedSampler`` pads the last ranks with repeated samples. A ``DistributedSampler``: Lightning keeps it.
    """

    def __init__(self, dataset, *, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.total_size = len(dataset)
        self.num_samples = len(range(rank, self.total_size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class ResumableDataLoader(ResumableLoader, DataLoader):
    """A ``DataLoader`` over an :class:`EpochSampler` that can resume mid-epoch.

    ``state_dict()`` is ``{"epoch", "batches", "batch_size", "num_replicas"}`` (the sampler's epoch, batches of
    ``batch_size`` yielded in it so far, the sampler's number of ranks);
    after ``load_state_dict(state)`` the iteration of that epoch starts after those batches (an
    iteration of another epoch starts at its beginning). Lightning keeps the state of such stateful
    loaders in its checkpoints and restores it on resume. Under DDP Lightning leaves the sampler (a
    ``DistributedSampler``) as it is. Over a data set with ``keyed_draws`` (a
    :class:`~vitrel.data.transforms.MappedDataset`, video clips) the sampler is made
    ``keyed``: each sample's random transform is drawn from ``(seed, epoch, index)``, the same after a resume and
    with any number of workers.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(self.sampler, EpochSampler) and getattr(self.dataset, "keyed_draws", False):
            self.sampler.keyed = True
        self.batches_yielded = 0
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches done)

    def __iter__(self):
        sampler = self.sampler if isinstance(self.sampler, EpochSampler) else None
        start = 0
        if sampler is not None and self._resume_at is not None and self._resume_at[0] == sampler.epoch:
            start = self._resume_at[1]
            sampler.skip = start * int(self.batch_size or 1)
        self._resume_at = None
        self.batches_yielded = start
        for batch in super().__iter__():
            self.batches_yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        if not isinstance(self.sampler, EpochSampler):
            return {}
        return {
            "epoch": int(self.sampler.epoch),
            "batches": int(self.batches_yielded),
            "batch_size": int(self.batch_size or 1),
            "num_replicas": int(self.sampler.num_replicas),
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if state_dict and isinstance(self.sampler, EpochSampler):
            self._resume_at = (int(state_dict["epoch"]), int(state_dict["batches"]))
