"""Settings checked against what takes them, before a run starts: the keys of a node Hydra instantiates against its
``_target_``'s arguments (:func:`check_target_keys`: ``module.optimizer``, ``module.scheduler``, ``data``) and the
seed (:func:`check_seed`). Each refusal is a :class:`~vitrel.config.ConfigError`, one line from ``train.py`` and
``eval.py``, where Hydra's ``instantiate`` or Lightning raised inside a traceback."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from vitrel.config import ConfigError

__all__ = ["check_seed", "check_target_keys"]


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
    import difflib

    from hydra.utils import get_method

    if not isinstance(node, DictConfig) or not node.get("_target_"):
        return
    target = str(node._target_)
    try:
        takes = _arguments(get_method(target))
    except Exception:  # noqa: BLE001  (not importable, no signature: Hydra's own error, at the build)
        return
    if takes is None:
        return
    names = sorted(set(takes) - {"self", *given})
    skip = set(ignore)
    wrong = [k for k in node if k not in takes and k not in skip and not (k.startswith("_") and k.endswith("_"))]
    said = []
    for k in wrong:
        near = difflib.get_close_matches(k, names, n=2, cutoff=0.75)
        hint = f"did you mean {' or '.join(f'{key}.{n}' for n in near)}?" if near else f"it takes {', '.join(names)}"
        said.append(f"{key}.{k}: {target} takes no {k}; {hint}")
    if said:
        raise ConfigError("; ".join(said))


def check_seed(seed: Any) -> None:
    """``seed`` a whole number numpy and Lightning take (0 to 2**32 - 1); else a :class:`ConfigError` (Lightning's
    ``seed_everything`` refused it in a traceback)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
        raise ConfigError(f"seed={seed}: a seed is a whole number from 0 to {2**32 - 1} (numpy's and Lightning's)")
