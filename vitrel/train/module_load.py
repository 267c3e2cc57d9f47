"""What Lightning's ``ClassifierModule.load_from_checkpoint(path)`` cannot rebuild from a checkpoint's
``hyper_parameters``: the network (an ``nn.Module``, given to the module, not a hyper-parameter) and its EMA copy.
A checkpoint ``train.py`` wrote stores the network's ``vitrel_cfg``; the EMA copy is timm's ``ModelEmaV3`` (its
weights load from the checkpoint; the decay of a further run is the caller's ``ema=``, the run's is in its folder's
``.hydra/config.yaml``)."""

from __future__ import annotations

import functools
import os
from typing import Any

from timm.utils import ModelEmaV3

from vitrel.models.checkpoint import checkpoint_has_ema
from vitrel.models.ckpt_files import CheckpointError, stored_config
from vitrel.models.registry import build_from_cfg

__all__ = ["module_parts"]


def module_parts(path: str | os.PathLike, given: set[str]) -> dict[str, Any]:
    """The ``ClassifierModule`` arguments of the checkpoint at ``path`` that are not in ``given`` (the keyword
    arguments of the call): ``model`` rebuilt from its ``vitrel_cfg`` (weights still to load), ``ema`` (timm's
    ``ModelEmaV3``) when the checkpoint holds an EMA copy. Only the configuration and the keys are read."""
    parts: dict[str, Any] = {}
    if "model" not in given:
        cfg = stored_config(path)
        if cfg is None:
            raise CheckpointError(
                f"{path} stores no vitrel_cfg to rebuild the network from: pass it, "
                "ClassifierModule.load_from_checkpoint(path, model=<the network>)"
            )
        parts["model"] = build_from_cfg(cfg)
    if "ema" not in given and checkpoint_has_ema(path):
        parts["ema"] = functools.partial(ModelEmaV3)
    return parts
