"""Where a warning is attributed: :func:`caller_stacklevel`, the first frame of the user's own code."""

from __future__ import annotations

import os
import sys

__all__ = ["caller_stacklevel"]


def caller_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, for a call made in the function that calls this one, that attributes the
    warning to the first frame outside vitrel, torch and timm: the user's code (a script, a notebook cell) rather
    than ``torch/nn/modules/module.py``. 1 (that function) when every frame is theirs."""
    dirs = tuple(
        os.path.dirname(m.__file__) + os.sep
        for m in (sys.modules.get(n) for n in ("vitrel", "torch", "timm"))
        if m is not None and getattr(m, "__file__", None)
    )
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame, level = frame.f_back, level + 1
    return 1 if frame is None else level
