"""The normalisation statistics of a data module: ``data.mean`` / ``data.std`` when given, else the data set's own.

Each data module sets its data set's statistics as ``self.mean`` / ``self.std`` (they become ``dataset_mean`` /
``dataset_std``); :meth:`Normalisation.normalise_with` (the ``mean`` / ``std`` arguments of
:class:`~vitrel.data.VisionDataModule`, or ``train.py`` taking the statistics of pretrained weights) sets the ones
used instead. Every pipeline reads ``mean`` / ``std``, so either way the transforms, the memory loader and the data
config stored in checkpoints agree.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Normalisation"]


def _floats(values: Sequence[float], key: str) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if not out:
        raise ValueError(f"{key} must be a list of one value per channel, got {list(values)}")
    if key == "data.std" and min(out) <= 0:  # (a data set's own is what it is)
        raise ValueError(f"{key} must be positive (images are divided by it), got {list(out)}")
    return out


class Normalisation:
    """Mixin of :class:`~vitrel.data.VisionDataModule`: ``mean`` and ``std`` are ``given_mean`` / ``given_std`` when
    set (one value is used for every channel), else the data set's own ``dataset_mean`` / ``dataset_std``."""

    dataset_mean: tuple[float, ...] = ()
    dataset_std: tuple[float, ...] = ()
    given_mean: tuple[float, ...] | None = None
    given_std: tuple[float, ...] | None = None

    @property
    def mean(self) -> tuple[float, ...]:
        """The per-channel mean images are normalised with (assigning sets the data set's own)."""
        return self._stat("mean")

    @mean.setter
    def mean(self, value: Sequence[float]) -> None:
        self.dataset_mean = _floats(value, "mean")

    @property
    def std(self) -> tuple[float, ...]:
        """The per-channel standard deviation images are normalised with (assigning sets the data set's own)."""
        return self._stat("std")

    @std.setter
    def std(self, value: Sequence[float]) -> None:
        self.dataset_std = _floats(value, "std")

    def normalise_with(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> None:
        """Normalise with ``mean`` / ``std`` instead of the data set's own (None: leave that one as it is). Call it
        before the data is set up: the pipelines read the statistics when they are built."""
        if mean is not None:
            self.given_mean = _floats(mean, "data.mean")
        if std is not None:
            self.given_std = _floats(std, "data.std")

    def _stat(self, key: str) -> tuple[float, ...]:
        given = getattr(self, f"given_{key}")
        if given is None:
            return getattr(self, f"dataset_{key}")
        chans = getattr(self, "in_chans", None)
        if chans is None or len(given) == chans:
            return given
        if len(given) == 1:
            return given * int(chans)
        raise ValueError(
            f"data.{key}={list(given)} has {len(given)} values for {type(self).__name__}'s {chans}-channel images: "
            f"give {chans} values (or one for every channel)"
        )
