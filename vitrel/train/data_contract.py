"""What ``train.py`` and ``eval.py`` read from a data module, checked where a data module of the user's own (any
``LightningDataModule`` named by ``data._target_``) could lack it: the attributes the model is sized by
(:func:`check_data_module`), the preprocessing the checkpoints store for ``predict.py`` and ``vitrel.load_model``
(:func:`warn_no_preprocessing`), and the targets of every batch (:func:`check_targets`: class indices
``0..num_classes-1``, where ``F.cross_entropy`` would stop with an index error deep in torch, or skip the target
``-100`` silently). docs/training.md, "Your own data"."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from vitrel.config import ConfigError

__all__ = ["SIZED_BY", "TargetError", "check_data_module", "check_targets", "warn_no_preprocessing"]

#: the attributes of a data module the model is built from (``train.py``) or checked against (``eval.py``)
SIZED_BY = ("num_classes", "in_chans", "img_size")
#: the guide's section on a data module of one's own
GUIDE = 'docs/training.md, "Your own data"'


class TargetError(ValueError):
    """A batch whose targets are not class indices of the model (``train.py`` and ``eval.py`` print it as one
    line)."""


def check_data_module(dm: Any) -> None:
    """``dm`` has an ``num_classes``, ``in_chans`` and ``img_size`` (:data:`SIZED_BY`), not None: else a
    :class:`~vitrel.config.ConfigError` naming those it lacks, before anything is built."""
    missing = [k for k in SIZED_BY if getattr(dm, k, None) is None]
    if not missing:
        return
    raise ConfigError(
        f"{type(dm).__name__} has no {', '.join(missing)}: the model is built from the data module's num_classes "
        "(an int), in_chans (1 for grey images) and img_size (the side of its square images, or [H, W]); set them "
        f"as attributes in its __init__ ({GUIDE})"
    )


def warn_no_preprocessing(dm: Any) -> None:
    """A warning when ``dm`` has no ``mean`` / ``std``: the checkpoints then store no preprocessing, and
    ``predict.py`` and ``vitrel.load_model`` would normalise images with the architecture's defaults."""
    missing = [k for k in ("mean", "std") if getattr(dm, k, None) is None]
    if missing:
        rank_zero_warn(
            f"{type(dm).__name__} has no {' and '.join(missing)}: the checkpoints store no preprocessing, so "
            "predict.py and vitrel.load_model will normalise images with the architecture's defaults, not as this "
            "data module's loaders do; set mean and std (per channel, of images scaled to 0-1) to what they apply, "
            f"and class_names for predict.py's labels ({GUIDE})"
        )


def check_targets(y: Tensor, num_classes: int) -> None:
    """The targets of a batch are integer class indices in ``0..num_classes-1``: else a :class:`TargetError` naming
    what was found (one read of the device: their smallest and largest value)."""
    if y.dtype not in (torch.int64, torch.uint8):
        kind = "float" if y.is_floating_point() else str(y.dtype).removeprefix("torch.")
        raise TargetError(
            f"the batch's targets are {kind} ({y.dtype}): a classifier takes class indices 0..{num_classes - 1} as "
            "torch.long (int64); return them so from the data set"
        )
    if y.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(y))
    if lo >= 0 and hi < num_classes:
        return
    hint = f"; labels 1..{num_classes}? subtract 1" if lo >= 1 and hi == num_classes else ""
    raise TargetError(
        f"the batch holds targets {lo}..{hi}, but the model has {num_classes} classes (the data module's "
        f"num_classes): targets must be class indices 0..{num_classes - 1}{hint} ({GUIDE})"
    )
