"""Training framework: Lightning module, callbacks, the Hydra-driven run and evaluation.

``python train.py`` calls :func:`vitrel.train.run.train`; ``python eval.py`` calls
:func:`vitrel.train.evaluate.evaluate`. Imports are lazy so that ``import vitrel.train.hydra_callbacks``
(done by Hydra) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ClassifierModule", "ProbeGridModule", "train", "evaluate", "SweepSummary"]

_WHERE = {
    "ClassifierModule": "vitrel.train.module",
    "ProbeGridModule": "vitrel.train.probe_grid",
    "train": "vitrel.train.run",
    "evaluate": "vitrel.train.evaluate",
    "SweepSummary": "vitrel.train.hydra_callbacks",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'vitrel.train' has no attribute {name!r}")
