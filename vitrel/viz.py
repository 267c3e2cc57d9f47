"""Pictures of position schemes: what a query at the centre of the grid sees, per head.

For a scheme on an ``H x W`` grid, :func:`position_kernel` returns the position-dependent part of
the attention logit between the centre patch ``c`` and every patch ``j``, for a fixed probe content
``u`` (the same vector at every position, pairs ``(1, 0)`` so RoPE pairs are all "unit-length
real")::

    K_h[j] = A_h(u, u)[c, j] - A_h^none(u, u)[c, j]
           = ( R_c u . R_j u + u . r^K_cj - u . u ) / sqrt(d) + bias_h[c, j]

so a bias scheme shows its bias (``b_h[dh, dw]`` around the centre), RoPE its sum-of-cosines
pattern ``sum_t (cos(theta_t(j) - theta_t(c)) - 1) / sqrt(d)``, and Shaw its key term ``u . r^K``.
Absolute schemes act on the tokens, not on the logits; for them :func:`position_kernel` returns
the cosine similarity of the centre patch's embedding with every patch's (the usual ViT picture).

:func:`plot_pos_scheme` draws those maps (one panel per head) and, for schemes with learned 2-D
RoPE frequencies (``freqs`` of ``[2, heads, d/2]``), the frequency vectors of each head. Figures are
built with ``matplotlib.figure.Figure`` (no pyplot, no GUI backend), so this works headless, in
callbacks and in notebooks alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from vitrel.pos.base import Grid, PositionScheme, as_grid

__all__ = ["position_kernel", "rope_freqs", "plot_pos_scheme", "figure_to_array"]


def _centre(grid: Grid) -> int:
    return (grid.h // 2) * grid.w + grid.w // 2


@torch.no_grad()
def position_kernel(scheme: PositionScheme, grid: Any) -> Tensor:
    """``[heads, H, W]`` map of the centre query's position term (see the module docstring).

    Absolute schemes: ``[1, H, W]`` cosine similarity of the centre patch's embedding with every patch.
    """
    grid = as_grid(grid)
    n, c = grid.n, _centre(grid)
    ref = next(iter(scheme.parameters()), None)
    device = ref.device if ref is not None else torch.device("cpu")
    dtype = torch.float32
    if scheme.kind == "absolute":
        e = scheme.add_to_tokens(torch.zeros(1, n, scheme.embed_dim, device=device, dtype=dtype), grid, 0)[0]
        e = torch.nn.functional.normalize(e.float(), dim=-1)
        return (e @ e[c]).reshape(1, grid.h, grid.w).cpu()
    heads, d = scheme.num_heads, scheme.head_dim
    u = torch.zeros(1, heads, n, d, device=device, dtype=dtype)
    u[..., 0::2] = 1.0
    base = (u[..., c : c + 1, :] * u).sum(-1)  # [1, heads, n]: u . u, the no-position logit * sqrt(d)
    q, k = scheme.rotate(u, u.clone(), grid, 0)
    logit = (q[..., c : c + 1, :] * k).sum(-1)  # [1, heads, n]
    extra = scheme.content_logits(q, grid, 0)
    if extra is not None:
        logit = logit + extra[..., c, :]
    out = (logit - base) * d**-0.5
    bias = scheme.bias(grid, 0)
    if bias is not None:
        out = out + bias[:, c, :].to(out.dtype)
    return out[0].reshape(heads, grid.h, grid.w).float().cpu()


def rope_freqs(scheme: PositionScheme) -> Tensor | None:
    """Learned 2-D RoPE frequencies ``[2, heads, d/2]`` (``f^x, f^y``) of a scheme, or None."""
    f = getattr(scheme, "freqs", None)
    if isinstance(f, Tensor) and f.dim() == 3 and f.shape[0] == 2 and f.shape[1] == scheme.num_heads:
        return f.detach().float().cpu()
    return None


def plot_pos_scheme(scheme: PositionScheme, grid: Any = None, title: str | None = None, max_heads: int = 16):
    """A ``matplotlib.figure.Figure`` of the scheme as seen from the centre query, one panel per head.

    Row 1: :func:`position_kernel` as an ``H x W`` heat map per head (the centre marked ``x``).
    Row 2 (schemes with learned 2-D RoPE frequencies): each head's frequency vectors ``(f^x_t, f^y_t)``.
    ``grid`` defaults to the grid the scheme was built for (its window, for windowed models).
    """
    from matplotlib.figure import Figure

    grid = as_grid(grid if grid is not None else scheme.grid)
    kernel = position_kernel(scheme, grid)[:max_heads].numpy()
    freqs = rope_freqs(scheme)
    panels = kernel.shape[0]
    rows = 2 if freqs is not None else 1
    fig = Figure(figsize=(1.9 * panels + 0.8, 2.0 * rows + 0.4), layout="constrained")
    axes = np.atleast_2d(fig.subplots(rows, panels, squeeze=False))
    lim = float(np.abs(kernel).max()) or 1.0
    absolute = scheme.kind == "absolute"
    cmap, vmin = ("viridis", -1.0) if absolute else ("RdBu_r", -lim)
    vmax = 1.0 if absolute else lim
    cy, cx = grid.h // 2, grid.w // 2
    im = None
    for h in range(panels):
        ax = axes[0, h]
        im = ax.imshow(kernel[h], cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.plot([cx], [cy], marker="x", color="k", markersize=5)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title("cos sim to centre" if absolute else f"head {h}", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), shrink=0.8)
    if freqs is not None:
        fmax = float(freqs.abs().max()) or 1.0
        for h in range(panels):
            ax = axes[1, h]
            fx, fy = freqs[0, h].numpy(), freqs[1, h].numpy()
            ax.scatter(fx, fy, s=8, c=np.arange(len(fx)), cmap="plasma")
            ax.axhline(0, color="0.8", lw=0.5)
            ax.axvline(0, color="0.8", lw=0.5)
            ax.set_xlim(-1.05 * fmax, 1.05 * fmax)
            ax.set_ylim(-1.05 * fmax, 1.05 * fmax)
            ax.set_aspect("equal")
            ax.tick_params(labelsize=6)
            ax.set_title(f"freqs (f_x, f_y), head {h}", fontsize=7)
    what = "embedding similarity" if absolute else "position term of the centre query's logits"
    fig.suptitle(title or f"{scheme.name} on {grid.h}x{grid.w}: {what}", fontsize=9)
    return fig


def figure_to_array(fig) -> np.ndarray:
    """Render a Figure to an ``[H, W, 3]`` uint8 array (for loggers that take images)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
