"""What ``ClassifierModule``'s checkpoints hold beyond Lightning's own, and what a resume makes of it: the network's
config (``vitrel_cfg``), the EMA copy under timm's ``state_dict_ema``, the training metrics' running totals summed over
the ranks; older checkpoints' layouts read (:func:`save_extras` and :func:`load_extras`, the module's
``on_save_checkpoint`` and ``on_load_checkpoint``). ``module`` is the ``ClassifierModule``: these read its ``model``,
``ema_model`` and ``train_metrics``."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["check_same_optimizer", "load_extras", "save_extras"]

_EMA = "ema_model."


def save_extras(module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """The model's config; the EMA copy as timm's train script keeps it (``state_dict_ema``: the network's keys,
    the same tensors as ``ema_model.module.*``, so ``torch.save`` stores them once), so that timm's
    ``load_checkpoint(model, path, use_ema=True)`` (and ``create_model(name, checkpoint_path=path)``) reads it;
    under DDP the training metrics' running totals summed over the ranks (each process holds its own share;
    Lightning calls this on every rank and writes rank 0's dict)."""
    cfg = getattr(module.model, "vitrel_cfg", None)
    if cfg is not None:
        checkpoint["vitrel_cfg"] = copy.deepcopy(cfg)
    sd = checkpoint.get("state_dict")
    if not isinstance(sd, dict):
        return
    if module.ema_model is not None:
        ema = f"{_EMA}module."
        checkpoint["state_dict_ema"] = {k[len(ema) :]: v for k, v in sd.items() if k.startswith(ema)}
    for name, metric in module.train_metrics.items():  # (one process: sync_context leaves the totals as they are)
        with metric.sync_context():  # the ranks' totals reduced as compute() would; the own ones after
            sd.update({k: v.clone() for k, v in metric.state_dict(prefix=f"{name}.").items()})


def load_extras(module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Resume from checkpoints of vitrel 0.1 (EMA weights under ``ema_model.*``, now
    ``ema_model.module.*``); a checkpoint without EMA weights starts the EMA from its weights; one
    without the training metrics' totals (vitrel <= 0.2) starts them from zero. The totals are the whole run's
    (summed over its ranks): under DDP rank 0 takes them and the other ranks start from zero, so that the epoch's
    sum over the ranks counts each batch once, whatever the number of ranks before."""
    check_same_optimizer(module, checkpoint)
    sd = checkpoint.get("state_dict")
    if not isinstance(sd, dict):
        return
    for name, metric in module.train_metrics.items():
        metric.reset()
        zero = metric.state_dict(prefix=f"{name}.")
        if _rank() > 0 or not any(k in sd for k in zero):
            sd.update({k: v.clone() for k, v in zero.items()})
    ema_keys = [k for k in sd if k.startswith(_EMA)]
    if ema_keys and module.ema_model is None:
        raise ValueError(
            "the checkpoint holds EMA weights (ema_model.*) but this run keeps none: resume with the EMA on "
            "(module/ema=default), or load the weights only (vitrel.load_model) to start a new run"
        )
    if module.ema_model is None:
        return
    if not ema_keys:
        rank_zero_warn("the checkpoint has no EMA weights: the EMA starts from its weights")
        for k in [k for k in sd if k.startswith("model.")]:
            sd[f"{_EMA}module.{k[len('model.') :]}"] = sd[k].clone()
    elif not any(k.startswith(f"{_EMA}module.") for k in ema_keys):  # vitrel 0.1 layout
        for k in ema_keys:
            sd[f"{_EMA}module.{k[len(_EMA) :]}"] = sd.pop(k)


def _rank() -> int:
    """This process's rank in the default process group (0 without one; ``LightningModule.global_rank`` is 0 until a
    trainer is attached, and the hooks also run without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def check_same_optimizer(module: LightningModule, checkpoint: dict[str, Any]) -> None:
    """Refuse, before the fit, a resume whose checkpoint holds another kind of optimizer than the one configured
    (SGD's ``momentum`` against AdamW's ``betas``): Lightning loads its state into the configured one, which failed
    at the first step on ``KeyError: 'momentum'`` (an audit's). A ``ValueError`` naming both and the ways out."""
    states, make = checkpoint.get("optimizer_states") or [], getattr(module, "make_optimizer", None)
    groups = (states[0].get("param_groups") or [{}]) if states and isinstance(states[0], dict) else [{}]
    target = make.func if isinstance(make, functools.partial) else make
    if not isinstance(target, type) or not groups[0]:
        return
    probe = make(params=[torch.nn.Parameter(torch.zeros(1))]).defaults
    kinds = [k for k in ("momentum", "betas") if (k in probe) != (k in groups[0])]
    if kinds:
        raise ValueError(
            f"the checkpoint's optimizer state has {'no ' * (kinds[0] in probe)}{kinds[0]!r}, the configured "
            f"{target.__name__} {'takes' if kinds[0] in probe else 'takes no'} it: another optimizer (a resume "
            "restores the checkpoint's); resume with its module/optimizer, or start a new run from its weights "
            "(resume=false, or model=from_checkpoint model.path=<it>)"
        )
