"""Settings checked against what takes them, before a run starts: the keys of the nodes Hydra instantiates against
their ``_target_``'s arguments (:func:`check_keys_taken`: ``trainer``, ``module.optimizer``, ``module.scheduler``,
``data``) and the seed (:func:`check_seed`). Each refusal is a :class:`~vitrel.config.ConfigError`, one line from
``train.py`` and ``eval.py``, where Hydra's ``instantiate`` or Lightning raised inside a traceback."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from vitrel.config import TRAINER_DOCS, TRAINER_SET_BY_TRAIN, ConfigError

__all__ = ["check_keys_taken", "check_seed", "check_target_keys", "check_trainer_keys"]


def _arguments(target: Any) -> dict[str, inspect.Parameter] | None:
    """The keyword arguments ``target`` takes; None where it takes any (``**kwargs``), except for vitrel's own
    classes, whose ``**kwargs`` go to their base class's ``__init__`` (the data modules'): theirs are added, up the
    MRO, to the first without ``**kwargs``."""
    owner = target if inspect.isclass(target) and target.__module__.startswith("vitrel.") else None
    chain = [c.__init__ for c in owner.__mro__ if "__init__" in vars(c)] if owner is not None else [target]
    out: dict[str, inspect.Parameter] = {}
    for fn in chain:
        params = inspect.signature(fn).parameters
        out |= {k: p for k, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return out
    return None


def check_target_keys(node: Any, key: str, given: Sequence[str] = (), ignore: Sequence[str] = ()) -> None:
    """A :class:`ConfigError` naming the nearest arguments when the node at ``key`` holds a key its ``_target_`` does
    not take (``given``: the arguments its caller passes, left out of the hint; ``ignore``: keys the caller takes
    away, as ``data.name``). ``+module.optimizer.momentum=0.9`` on AdamW, ``module.optimizer._target_=torch.optim.SGD``
    with AdamW's ``betas`` or ``+data.batchsize=32`` were a ``TypeError`` inside Hydra's error, the first two once
    the fit began, its run folder made. A target taking ``**kwargs`` (``vitrel.create_model``) is not checked."""
    from hydra.utils import get_method

    if not isinstance(node, DictConfig) or not node.get("_target_"):
        return
    target = str(node._target_)
    try:
        takes = _arguments(get_method(target))
    except Exception:  # noqa: BLE001  (not importable, no signature: Hydra's own error, at the build)
        return
    if takes is not None:
        names = sorted(set(takes) - {"self", *given})
        refuse_keys(node, key, target, set(takes) | set(ignore), names, f"it takes {', '.join(names)}")


def check_trainer_keys(trainer: DictConfig) -> None:
    """A :class:`ConfigError` naming the nearest arguments when ``trainer`` holds a key Lightning's ``Trainer`` does
    not take: Hydra lets ``+trainer.max_epoch=1`` (and an experiment's file) add any key to the typed node, and
    Lightning then refuses it after the run has started, inside Hydra's error (``unexpected keyword argument``)."""
    from lightning.pytorch import Trainer

    takes = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    offer = sorted(takes - set(TRAINER_SET_BY_TRAIN))
    refuse_keys(trainer, "trainer", "Lightning's Trainer", takes, offer, f"its arguments: {TRAINER_DOCS}", n=3)


def refuse_keys(node: DictConfig, key: str, owner: str, takes: set[str], offer: list[str], otherwise: str, n: int = 2):
    """A :class:`ConfigError` for each key of ``node`` (at ``key``) not in ``takes`` (Hydra's ``_target_``-like keys
    pass): ``<key>.<k>: <owner> takes no <k>; did you mean ...`` (up to ``n`` of ``offer``), else ``otherwise``."""
    import difflib

    said = []
    for k in node:
        if k in takes or (k.startswith("_") and k.endswith("_")):
            continue
        near = difflib.get_close_matches(k, offer, n=n, cutoff=0.75)
        hint = f"did you mean {' or '.join(f'{key}.{n}' for n in near)}?" if near else otherwise
        said.append(f"{key}.{k}: {owner} takes no {k}; {hint}")
    if said:
        raise ConfigError("; ".join(said))


def check_keys_taken(cfg: DictConfig) -> None:
    """:func:`check_trainer_keys`, then :func:`check_target_keys` of ``module.optimizer`` and ``module.scheduler``
    (where ``cfg`` has a module: ``train.py``'s) and of ``data``, before anything is built."""
    check_trainer_keys(cfg.trainer)  # +trainer.max_epoch=1: Lightning's TypeError after the run has begun
    module = cfg.get("module")
    for key in ("optimizer", "scheduler") if module is not None else ():  # +module.optimizer.momentum=0.9 on AdamW
        given = ("params",) if key == "optimizer" else ("optimizer", "total_steps", "steps_per_epoch")
        check_target_keys(module.get(key), f"module.{key}", given)
    check_target_keys(cfg.data, "data", ignore=("name",))  # +data.batchsize=32: the data module's TypeError


def check_seed(seed: Any) -> None:
    """``seed`` a whole number numpy and Lightning take (0 to 2**32 - 1); else a :class:`ConfigError` (Lightning's
    ``seed_everything`` refused it in a traceback)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
        raise ConfigError(f"seed={seed}: a seed is a whole number from 0 to {2**32 - 1} (numpy's and Lightning's)")
