"""The normalisation statistics of a data module: ``data.mean`` / ``data.std`` when given, else the data set's own.

Each data module sets its data set's statistics as ``self.mean`` / ``self.std`` (they become ``dataset_mean`` /
``dataset_std``); :meth:`Normalisation.normalise_with` (the ``mean`` / ``std`` arguments of
:class:`~vitrel.data.VisionDataModule`, or ``train.py`` taking the statistics of pretrained weights) sets the ones
used instead. Every pipeline reads ``mean`` / ``std``, so either way the transforms, the memory loader and the data
config stored in checkpoints agree. :meth:`Normalisation.adopt` takes the preprocessing weights expect (pretrained
weights' ``pretrained_cfg``, a checkpoint's stored data config) where the config leaves it null, and logs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["ADOPTED", "Normalisation", "per_channel"]

#: the data keys :meth:`Normalisation.adopt` takes from weights: the preprocessing they expect (timm's data config)
ADOPTED = ("mean", "std", "interpolation", "crop_pct")


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
    interpolation: str  # (set by the data module)
    crop_pct: float

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

    def adopt(self, values: Mapping[str, Any], whose: str, config: Mapping[str, Any], always: bool = False) -> dict:
        """Preprocess as weights expect: of ``values`` (a data config: ``mean``, ``std``, ``interpolation``,
        ``crop_pct``, the keys of :data:`ADOPTED`), take those ``config`` (the ``data`` node) leaves null, means and
        standard deviations as one value per channel of this module (averaged for another channel count, as timm
        adapts a patch embedding). Those that differ from this module's own (``always``: all) are set, before the data
        is set up, and logged in one line with the module's own; ``whose``: whose values they are. Returns the values
        set."""
        chans = getattr(self, "in_chans", None)
        own = {"mean": list(self.mean), "std": list(self.std), "interpolation": self.interpolation}
        own["crop_pct"] = self.crop_pct
        keys = [k for k in ADOPTED if config.get(k) is None and values.get(k) is not None]
        offered = {k: _value(k, values[k], chans) for k in keys}
        taken = {k: v for k, v in offered.items() if always or not _same(v, own[k])}
        if not taken:
            return {}
        self.normalise_with(taken.get("mean"), taken.get("std"))
        self.interpolation = taken.get("interpolation", self.interpolation)
        self.crop_pct = taken.get("crop_pct", self.crop_pct)
        given = " ".join(f"data.{k}={_text(v, 8)}" for k, v in taken.items())
        mine = ", ".join(f"{k} {_text(own[k], 4)}" for k in taken)
        rank_zero_info(f"{given}: {whose}; {type(self).__name__}'s own: {mine} (data.<key>=<v> for others)")
        return taken

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


def _value(key: str, value: Any, chans: int | None) -> Any:
    """``value`` of ``data.<key>`` as a data module takes it: ``mean`` / ``std`` one float per channel (averaged for
    another channel count; ``chans`` None: as given), ``interpolation`` a string, ``crop_pct`` a float."""
    if key == "interpolation":
        return str(value)
    if key == "crop_pct":
        return float(value)
    return [float(v) for v in value] if chans is None else list(per_channel(value, chans))


def per_channel(values: Sequence[float], chans: int) -> tuple[float, ...]:
    """``values`` (a mean or std) for ``chans`` channels: as they are when there are that many, else their average
    for every channel (as timm adapts a patch embedding to another channel count: an RGB statistic for grey)."""
    out = tuple(float(v) for v in values)
    return out if len(out) == chans else (sum(out) / len(out),) * int(chans)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(abs(x - y) < 1e-6 for x, y in zip(a, b))
    return a == b


def _text(v: Any, digits: int) -> str:
    """``v`` as a command-line override writes it, floats to ``digits`` significant digits."""
    if isinstance(v, list):
        return f"[{','.join(_text(x, digits) for x in v)}]"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)
