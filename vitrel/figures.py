"""Matplotlib figures without pyplot (no GUI backend): what :mod:`vitrel.viz`, :mod:`vitrel.viz_packing` and the
study's plots (:mod:`vitrel.study.plots`) draw on, and the rendering of a figure for loggers that take images."""

from __future__ import annotations

import numpy as np
from torch import Tensor

__all__ = ["new_figure", "hide_ticks", "as_image", "figure_to_array"]


def new_figure(width: float, height: float):
    """A ``matplotlib.figure.Figure`` of ``width x height`` inches with the constrained layout, built without pyplot."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def hide_ticks(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])


def as_image(x: Tensor) -> np.ndarray:
    """``[C, H, W]`` -> ``[H, W]`` or ``[H, W, 3]`` in ``[0, 1]`` (min-max per image)."""
    a = x.detach().float().cpu()
    a = (a - a.min()) / (a.max() - a.min()).clamp_min(1e-8)
    return a[0].numpy() if a.shape[0] == 1 else a[:3].permute(1, 2, 0).numpy()


def figure_to_array(fig) -> np.ndarray:
    """Render a Figure to an ``[H, W, 3]`` uint8 array (for loggers that take images)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
