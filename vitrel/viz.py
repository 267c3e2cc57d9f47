"""Pictures of position schemes and attention maps (the study's plots: ``vitrel.study.plots``).

Every plotting function returns a ``matplotlib.figure.Figure`` built without pyplot (no GUI backend): it draws in
notebooks, headless scripts and the training callbacks that log images to W&B / TensorBoard (:func:`figure_to_array`).

**The position term of the logits.** For a scheme on an ``H x W`` grid, :func:`position_matrix` returns the
position-dependent part of the attention logit between every query patch ``i`` and every key patch ``j``, for a fixed
probe content ``u`` (the same vector at every position, pairs ``(1, 0)``, so every RoPE pair is a unit-length "real"
number), with the scheme in eval mode (its mode restored after: the positions the model is evaluated at)::

    P_h[i, j] = A_h(u, u)[i, j] - A_h^none(u, u)[i, j]
              = ( R_i u . R_j u + u . r^K_ij - u . u ) / sqrt(d) + bias_h[i, j]

so a bias scheme shows exactly its bias ``b_h[i, j]``, RoPE its sum-of-cosines pattern
``sum_t (cos(theta_t(j) - theta_t(i)) - 1) / sqrt(d)`` (LieRE with blocks over 2 x 2: the term of this probe, which
another probe changes; :func:`rope_similarity` averages over probes), and Shaw its key term ``u . r^K_ij``. PaPE's
term depends on the layer's input token: it is drawn for the zero token (curvature ``softplus(0)``, slope 0). Absolute
schemes act on the tokens, not on the logits; for them the matrix is the cosine similarity of the patches' embeddings
``e_i . e_j / (|e_i| |e_j|)`` (the usual ViT picture, one "head"). :func:`position_kernel` is one row of it (what one
query patch sees) as an ``H x W`` map, and :func:`offset_profile` folds a matrix into a function of the offset
``(dh, dw)`` with ``dh = row_i - row_j``, ``dw = col_i - col_j`` (for a relative scheme every pair with the same offset
has the same value, so the fold loses nothing). On a video grid ``(T, H, W)`` (tokens t-major) the same numbers are
``[heads, T, H, W]`` per query, drawn as each head's ``T`` frames side by side.

**RoPE's similarity.** :func:`rope_similarity` is ``tr(R_i^T R_j) / d``, the cosine similarity of ``R_i u`` and
``R_j u`` averaged over every direction ``u`` (the mean over an orthonormal basis), as a function of ``(dh, dw)``. For
plane rotations (RoPE, ComRoPE, LieRE with 2 x 2 blocks) it is ``(2/d) sum_t cos(theta_t(i) - theta_t(j))``, for any
rotation the same sum over the angles of ``R_i^T R_j``. (One probe ``u`` would show ``u . R_i^T R_j u / |u|^2``, which
for blocks larger than 2 x 2, LieRE's, depends on ``u``.)

**Shaw's tables.** :func:`content_tables` returns the learned key/value tables of a scheme with content terms
(``r^K``, ``r^V``); :func:`plot_content_tables` draws 1-D tables ``[2K+1, d]`` as channel x offset images and 2-D
tables ``[2Kh+1, 2Kw+1, d]`` as the norm ``|r[dh, dw]|``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.figures import as_image, figure_to_array, hide_ticks, new_figure
from vitrel.layout.geometry import Grid, Grid3, as_grid, grid_str
from vitrel.pos.base import FAMILIES, PositionScheme

__all__ = [
    "group_by_family",
    "position_matrix",
    "position_kernel",
    "offset_profile",
    "rope_similarity",
    "rope_freqs",
    "content_tables",
    "attention_maps",
    "plot_pos_scheme",
    "plot_schemes",
    "plot_rope_similarity",
    "plot_content_tables",
    "plot_attention_maps",
    "plot_packed_batch",  # noqa: F822 (vitrel.viz_packing, through __getattr__)
    "attention_distance",  # noqa: F822 (vitrel.viz_distance, through __getattr__)
    "plot_attention_distance",  # noqa: F822 (vitrel.viz_distance, through __getattr__)
    "plot_swin_windows",  # noqa: F822 (vitrel.viz_packing, through __getattr__)
    "figure_to_array",  # vitrel.figures
]


# ------------------------------------------------------------------------------------------ families
def group_by_family(schemes: Mapping[str, PositionScheme]) -> dict[str, dict[str, PositionScheme]]:
    """``{family: {name: scheme}}`` by each scheme's declared ``family``, in the order of
    :data:`vitrel.pos.base.FAMILIES`, names in their given order."""
    out: dict[str, dict[str, PositionScheme]] = {f: {} for f in FAMILIES}
    for name, s in schemes.items():
        out.setdefault(s.family, {})[name] = s
    return {f: v for f, v in out.items() if v}


# ------------------------------------------------------------------------------------------ numbers
def _device(module: nn.Module) -> torch.device:
    ref = next(iter(module.parameters()), None)
    if ref is None:
        ref = next(iter(module.buffers()), None)
    return ref.device if ref is not None else torch.device("cpu")


def _check_mapping(schemes: Any, fn: str) -> None:
    """Refuse in one line a lone scheme (or anything but a mapping) where ``{name: scheme}`` is taken."""
    if not isinstance(schemes, Mapping):
        name = getattr(schemes, "name", None) or "name"
        raise TypeError(
            f"{fn} takes a mapping {{name: scheme}}, got {type(schemes).__name__}: {fn}({{{name!r}: scheme}})"
        )


def _check_scheme(obj: Any, fn: str) -> None:
    """Refuse in one line anything but a position scheme (a model or an attention layer: name one of its schemes)."""
    if isinstance(obj, PositionScheme):
        return
    inner = [n for n, m in obj.named_modules() if isinstance(m, PositionScheme)] if isinstance(obj, nn.Module) else []
    hint = f": pass one of its {len(inner)} scheme(s), e.g. .get_submodule({inner[0]!r})" if inner else ""
    raise TypeError(f"{fn} draws a position scheme (vitrel.pos.PositionScheme), got {type(obj).__name__}{hint}")


def _image_grid(grid: Grid | Grid3, fn: str) -> Grid:
    """``grid`` if it is an image grid, else one line (a video grid: :func:`plot_pos_scheme` draws its frames)."""
    if isinstance(grid, Grid3):
        raise ValueError(f"{fn} takes an image grid (H, W), not the video grid {grid_str(grid)}: use plot_pos_scheme")
    return grid


@contextmanager
def _evaluated(scheme: PositionScheme) -> Iterator[None]:
    """``scheme`` in eval mode, then its mode restored: no random draw of training-time coordinate augmentation."""
    was_training, _ = scheme.training, scheme.eval()
    try:
        yield
    finally:
        scheme.train(was_training)


#: basis vectors rotated at once by :func:`rope_similarity` (bounds its memory on large grids)
_BASIS_CHUNK = 16


def _probe(heads: int, n: int, d: int, device: torch.device) -> Tensor:
    """``[1, heads, n, d]`` with every rotation pair ``(1, 0)``."""
    u = torch.zeros(1, heads, n, d, device=device)
    u[..., 0::2] = 1.0
    return u


def _query_index(grid: Grid | Grid3, query: int | tuple[int, ...] | None) -> int:
    """Raster index of ``query``: ``(row, col)`` (a video grid: ``(frame, row, col)``), a raster index, or None for
    the centre patch."""
    sides = tuple(grid)
    if isinstance(query, int):
        if not 0 <= query < grid.n:
            raise ValueError(f"query index {query} is outside the {grid_str(grid)} grid")
        return query
    at = tuple(s // 2 for s in sides) if query is None else tuple(int(v) for v in query)
    if len(at) != len(sides) or not all(0 <= a < s for a, s in zip(at, sides)):
        raise ValueError(f"query {at} is outside the {grid_str(grid)} grid")
    return int(np.ravel_multi_index(at, sides))


def _query_at(grid: Grid | Grid3, query: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """``query``'s ``(row, col)`` (a video grid: ``(frame, row, col)``)."""
    return tuple(int(v) for v in np.unravel_index(_query_index(grid, query), tuple(grid)))


@torch.no_grad()
def position_matrix(scheme: PositionScheme, grid: Any = None) -> Tensor:
    """``[heads, N, N]`` position term of the logits between all patch pairs (module docstring).

    Absolute schemes: ``[1, N, N]`` cosine similarity of the patch embeddings. ``grid`` defaults to
    the grid the scheme was built for. Float32, on the CPU.
    """
    _check_scheme(scheme, "position_matrix")
    if scheme.embeds_content or scheme.mixes_weights:  # (cpe: a convolution of the tokens; gpsa: a second softmax)
        what = "is computed from the tokens" if scheme.embeds_content else "mixes its own attention in after softmax"
        instead = "" if scheme.embeds_content else "position_kernel (the weights it mixes in) or "
        raise ValueError(
            f"{scheme.name}'s position encoding {what}: it adds no term of its own to the logits to draw; draw "
            f"{instead}a trained model's attention instead (vitrel.viz.attention_maps)"
        )
    grid = as_grid(grid if grid is not None else scheme.grid)
    n, device = grid.n, _device(scheme)
    if scheme.kind == "absolute":
        e = scheme.add_to_tokens(torch.zeros(1, n, scheme.embed_dim, device=device), grid, 0)[0]
        e = F.normalize(e.float(), dim=-1)
        return (e @ e.t())[None].cpu()
    heads, d = scheme.num_heads, scheme.head_dim
    u = _probe(heads, n, d, device)
    with _evaluated(scheme):
        st = scheme.prepare(grid, 0, device, u.dtype)
        q, k = scheme.rotate(u, u.clone(), st)
        if scheme.has_token_terms:  # PaPE: the term of a zero input token (module docstring)
            x = torch.zeros(1, n, scheme.embed_dim, device=device, dtype=next(scheme.parameters()).dtype)
            q, k = scheme.augment(x, q, k, st)
        extras = (scheme.content_logits(q, st), scheme.content_key_logits(k, st))
    logit = q.float() @ k.float().transpose(-2, -1)  # [1, heads, n, n]
    for extra in extras:
        if extra is not None:
            logit = logit + extra.float()
    out = (logit - d / 2) * d**-0.5  # u . u = d / 2: the logit without position
    bias = st.bias  # prepared above with the rotation
    if bias is not None:
        out = out + bias.float()
    return out[0].cpu()


def position_kernel(scheme: PositionScheme, grid: Any = None, query: int | tuple[int, ...] | None = None) -> Tensor:
    """``[heads, H, W]`` (a video grid: ``[heads, T, H, W]``): the row of :func:`position_matrix` of one query patch
    (default: the centre).

    ``query`` is ``(row, col)`` (a video grid: ``(frame, row, col)``) or a raster index. Absolute schemes: one
    "head", the cosine similarity of that patch's embedding with every patch's. A scheme that mixes attention weights
    of its own in (``mixes_weights``: ``gpsa``): the weights it gives the query's row, ``mix`` of zero content weights
    (GPSA's ``sigmoid(g_h) P_h``: each map sums to the head's positional share).
    """
    _check_scheme(scheme, "position_kernel")
    grid = as_grid(grid if grid is not None else scheme.grid)
    if scheme.mixes_weights:
        device, dtype = _device(scheme), next(scheme.parameters()).dtype
        with _evaluated(scheme), torch.no_grad():
            st = scheme.prepare(grid, 0, device, dtype)
            m = scheme.mix(torch.zeros(1, scheme.num_heads, grid.n, grid.n, device=device, dtype=dtype), None, st)[0]
        return m[:, _query_index(grid, query)].reshape(m.shape[0], *grid).float().cpu()
    m = position_matrix(scheme, grid)
    return m[:, _query_index(grid, query)].reshape(m.shape[0], *grid)


def offset_profile(matrix: Tensor, grid: Any) -> Tensor:
    """Fold ``[..., N, N]`` pair values into ``[..., 2H-1, 2W-1]`` by offset (mean over the pairs).

    Entry ``[dh + H - 1, dw + W - 1]`` is the mean of ``matrix[..., i, j]`` over the pairs with
    ``row_i - row_j = dh`` and ``col_i - col_j = dw``.
    """
    grid = _image_grid(as_grid(grid), "offset_profile")
    if matrix.shape[-2:] != (grid.n, grid.n):
        raise ValueError(f"expected [..., {grid.n}, {grid.n}] for grid {tuple(grid)}, got {tuple(matrix.shape)}")
    r = torch.arange(grid.h).repeat_interleave(grid.w)
    c = torch.arange(grid.w).repeat(grid.h)
    idx = ((r[:, None] - r[None, :] + grid.h - 1) * (2 * grid.w - 1) + (c[:, None] - c[None, :] + grid.w - 1)).flatten()
    size = (2 * grid.h - 1) * (2 * grid.w - 1)
    flat = matrix.reshape(-1, grid.n * grid.n).double()
    sums = torch.zeros(flat.shape[0], size, dtype=torch.float64).index_add_(1, idx, flat)
    counts = torch.zeros(size, dtype=torch.float64).index_add_(0, idx, torch.ones(idx.shape, dtype=torch.float64))
    out = (sums / counts).to(matrix.dtype)
    return out.reshape(*matrix.shape[:-2], 2 * grid.h - 1, 2 * grid.w - 1)


@torch.no_grad()
def rope_similarity(scheme: PositionScheme, grid: Any = None) -> Tensor:
    """``[heads, 2H-1, 2W-1]``: ``tr(R_i^T R_j) / d`` as a function of ``(dh, dw)`` (module docstring).

    For plane rotations ``(2/d) sum_t cos(theta_t(i) - theta_t(j))``: the cosine similarity of two patches' rotated
    queries and keys at offset ``(dh, dw)``, averaged over the content directions, on ``grid`` (default: the scheme's
    grid; a larger grid shows the offsets a model never saw in training). A scheme that is relative only
    approximately (LieRE with blocks over 2) shows the mean over the pairs at each offset. Normalised by the patches'
    own terms, ``sqrt(tr(R_i^T R_i) tr(R_j^T R_j))`` (``d`` for a rotation), so a scale a scheme puts on its
    rotations (YaRN's attention factor ``m`` at a larger grid: ``m^2`` on every term) is not drawn as similarity.
    """
    _check_scheme(scheme, "rope_similarity")
    if not scheme.has_rotation:
        raise ValueError(f"{scheme.name} does not rotate queries and keys; rope_similarity needs a rotary scheme")
    grid = _image_grid(as_grid(grid if grid is not None else scheme.grid), "rope_similarity")
    d, heads, device = scheme.head_dim, scheme.num_heads, _device(scheme)
    sim = torch.zeros(heads, grid.n, grid.n, device=device)
    with _evaluated(scheme):
        st = scheme.prepare(grid, 0, device, torch.float32)
        for first in range(0, d, _BASIS_CHUNK):  # the basis vectors e_b as a batch: sum_b R_i e_b . R_j e_b
            u = torch.eye(d, device=device)[first : first + _BASIS_CHUNK, None, None, :]
            u = u.expand(-1, heads, grid.n, d).contiguous()
            q, k = scheme.rotate(u, u.clone(), st)
            sim += (q.float() @ k.float().transpose(-2, -1)).sum(0)
    own = sim.diagonal(dim1=-2, dim2=-1).clamp_min(1e-12).sqrt()  # (sqrt(d) for a rotation: |R e_b| = 1)
    return offset_profile((sim / (own[..., :, None] * own[..., None, :])).cpu(), grid)


def rope_freqs(scheme: PositionScheme) -> Tensor | None:
    """Learned 2-D RoPE frequencies ``[2, heads, d/2]`` (``f^x, f^y``) of a scheme, or None."""
    _check_scheme(scheme, "rope_freqs")
    f = getattr(scheme, "freqs", None)
    if isinstance(f, Tensor) and f.dim() == 3 and f.shape[0] == 2 and f.shape[1] == scheme.num_heads:
        return f.detach().float().cpu()
    return None


def content_tables(scheme: PositionScheme) -> dict[str, Tensor]:
    """The learned tables of a scheme with content terms (Shaw's ``r^K``, ``r^V``), by parameter name."""
    _check_scheme(scheme, "content_tables")
    if not scheme.has_content_terms:
        raise ValueError(f"{scheme.name} has no content terms (no key/value tables)")
    return {n: p.detach().float().cpu() for n, p in scheme.named_parameters()}


def attention_maps(model: nn.Module, images: Tensor, block: int = -1, stage: int = 0) -> Tensor:
    """``[B, heads, H, W]`` attention of one block of a model over its patch grid, float32 on the CPU.

    The model draws its own (in eval mode; its training mode is restored after): any backbone with a
    method ``attention_maps(images, block=-1, stage=0) -> [B, heads, H, W]`` plugs in. vitrel's
    ``VisionTransformer``: block ``block``, the class token's attention to the patches (without a class
    token, the attention each patch receives averaged over the patch queries); ``SwinTransformer``: block
    ``block`` of stage ``stage``, the attention each position receives averaged over all queries.
    """
    draw = getattr(model, "attention_maps", None)
    if not callable(draw):
        raise TypeError(f"{type(model).__name__} has no attention_maps(images, block, stage) method to draw")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return draw(images, block=block, stage=stage).float().cpu()
    finally:
        model.train(was_training)


# ------------------------------------------------------------------------------------------ figures
_DH, _DW = "dh = row_q - row_k", "dw = col_q - col_k"  # the offset axes: query minus key, as offset_profile


def _sym_lim(a: np.ndarray) -> float:
    a = np.abs(a[np.isfinite(a)])  # LookHere's -inf (keys out of a head's view): grey in _scale's colour map
    lim = float(a.max()) if a.size else 0.0
    return lim if lim > 0 else 1.0


def _scale(a: np.ndarray, absolute: bool) -> tuple[Any, float, float]:
    """Colour map and limits of a heat map: on ``[-1, 1]`` for absolute schemes' similarities, else symmetric about 0
    over the finite values, ``-inf`` (a key a head cannot see) in grey, not in the white of a zero term."""
    from matplotlib import colormaps

    lim = _sym_lim(a)
    return ("viridis", -1.0, 1.0) if absolute else (colormaps["RdBu_r"].with_extremes(bad="0.4"), -lim, lim)


def plot_pos_scheme(
    scheme: PositionScheme,
    grid: Any = None,
    title: str | None = None,
    max_heads: int = 16,
    query: int | tuple[int, int] | None = None,
):
    """A Figure of the scheme as seen from one query patch (default: the centre), one panel per head.

    Row 1: :func:`position_kernel` as an ``H x W`` heat map per head (the query marked ``x``).
    Row 2 (schemes with learned 2-D RoPE frequencies): each head's frequency vectors ``(f^x_t, f^y_t)``.
    A video grid ``(T, H, W)``: one row per head, its ``T`` frames' maps side by side (:func:`_plot_frames`).
    ``grid`` defaults to the grid the scheme was built for (its window, for windowed models).
    Used by the training callback that logs position pictures.
    """
    _check_scheme(scheme, "plot_pos_scheme")
    grid = as_grid(grid if grid is not None else scheme.grid)
    if isinstance(grid, Grid3):
        return _plot_frames(scheme, grid, title, max_heads, query)
    kernel = position_kernel(scheme, grid, query)[:max_heads].numpy()
    freqs = rope_freqs(scheme)
    if freqs is not None and getattr(scheme, "scaling", None) is not None:  # (those in effect on this grid)
        freqs = scheme.scaled_freqs(freqs.to(scheme.freqs), grid).detach().float().cpu()
    panels = kernel.shape[0]
    rows = 2 if freqs is not None else 1
    fig = new_figure(1.9 * panels + 0.8, 2.0 * rows + 0.4)
    axes = np.atleast_2d(fig.subplots(rows, panels, squeeze=False))
    absolute, mixed = scheme.kind == "absolute", scheme.mixes_weights
    cmap, vmin, vmax = ("viridis", 0.0, float(kernel.max()) or 1.0) if mixed else _scale(kernel, absolute)
    qy, qx = _query_at(grid, query)
    im = None
    for h in range(panels):
        ax = axes[0, h]
        im = ax.imshow(kernel[h], cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.plot([qx], [qy], marker="x", color="k", markersize=5)
        hide_ticks(ax)
        ax.set_title(
            "cos sim to query" if absolute else f"head {h}" + (f": {kernel[h].sum():.2f}" if mixed else ""), fontsize=8
        )
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
    where = "the centre query" if query is None else f"query {(qy, qx)}"
    what = "embedding similarity" if absolute else f"position term of {where}'s logits"
    what = f"attention weights {where} gets by position (share per head)" if mixed else what
    fig.suptitle(title or f"{scheme.name} on {grid.h}x{grid.w}: {what}", fontsize=9)
    return fig


def _plot_frames(scheme: PositionScheme, grid: Grid3, title: str | None, max_heads: int, query) -> Any:
    """:func:`plot_pos_scheme` on a video grid: per head (a row), the query's kernel over the ``T`` frames, each an
    ``H x W`` map, side by side (a blank column between frames), one colour scale; the query marked ``x``."""
    kernel = position_kernel(scheme, grid, query)[:max_heads].numpy()  # [heads, T, H, W]
    heads, (qt, qy, qx) = kernel.shape[0], _query_at(grid, query)
    strips = np.full((heads, grid.h, grid.t * (grid.w + 1) - 1), np.nan)
    for t in range(grid.t):
        strips[:, :, t * (grid.w + 1) : t * (grid.w + 1) + grid.w] = kernel[:, t]
    absolute = scheme.kind == "absolute"
    lim = _sym_lim(kernel)  # (not _scale: the NaN gaps between frames stay blank)
    cmap, vmin, vmax = ("viridis", -1.0, 1.0) if absolute else ("RdBu_r", -lim, lim)
    width = strips.shape[2] / grid.h  # each strip's aspect
    fig = new_figure(min(1.0 + 1.2 * width, 16.0), 0.5 + 1.3 * heads)
    axes = fig.subplots(heads, 1, squeeze=False)[:, 0]
    im = None
    for h, ax in enumerate(axes):
        im = ax.imshow(strips[h], cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        ax.plot([qt * (grid.w + 1) + qx], [qy], marker="x", color="k", markersize=5)
        ax.set_yticks([])
        ax.set_xticks([t * (grid.w + 1) + (grid.w - 1) / 2 for t in range(grid.t)], [str(t) for t in range(grid.t)])
        ax.tick_params(labelsize=6, length=0)
        ax.set_ylabel("cos sim" if absolute else f"head {h}", fontsize=8)
    axes[-1].set_xlabel(f"frame (the query's: {qt})", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=list(axes), shrink=0.8)
    what = "embedding similarity" if absolute else f"position term of query {(qt, qy, qx)}'s logits"
    fig.suptitle(title or f"{scheme.name} on {grid_str(grid)}: {what}", fontsize=9)
    return fig


def plot_schemes(
    schemes: Mapping[str, PositionScheme],
    grid: Any = None,
    query: int | tuple[int, int] | None = None,
    max_heads: int = 4,
    title: str | None = None,
):
    """One row per scheme: the ``N x N`` :func:`position_matrix` of head 0, then the ``H x W`` map
    seen from ``query`` (default: the centre patch) for each head (up to ``max_heads``).

    Colour scale: symmetric per row (red positive, blue negative); absolute schemes show the cosine
    similarity of their embeddings on ``[-1, 1]`` (one panel). ``grid`` defaults to each scheme's own.
    Returns a Figure with ``len(schemes) * (1 + max_heads)`` axes.
    """
    _check_mapping(schemes, "plot_schemes")
    if not schemes:
        raise ValueError("plot_schemes needs at least one scheme")
    for s in schemes.values():
        _check_scheme(s, "plot_schemes")
    cols = 1 + max_heads
    fig = new_figure(1.55 * cols + 0.6, 1.6 * len(schemes) + 0.5)
    axes = np.atleast_2d(fig.subplots(len(schemes), cols, squeeze=False))
    for r, (name, s) in enumerate(schemes.items()):
        g = _image_grid(as_grid(grid if grid is not None else s.grid), "plot_schemes")
        m = position_matrix(s, g)
        absolute = s.kind == "absolute"
        cmap, vmin, vmax = _scale(m.numpy(), absolute)
        ax = axes[r, 0]
        im = ax.imshow(m[0].numpy(), cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
        hide_ticks(ax)
        ax.set_title(f"{name}: {g.n}x{g.n}" + ("" if absolute else ", head 0"), fontsize=7)
        qi = _query_index(g, query)
        qy, qx = qi // g.w, qi % g.w
        for h in range(max_heads):
            ax = axes[r, 1 + h]
            if h >= m.shape[0]:
                ax.set_axis_off()
                continue
            ax.imshow(m[h, qi].reshape(g.h, g.w).numpy(), cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
            ax.plot([qx], [qy], marker="x", color="k", markersize=4)
            hide_ticks(ax)
            ax.set_title("cos sim from query" if absolute else f"head {h} from query", fontsize=7)
        fig.colorbar(im, ax=list(axes[r]), shrink=0.8, pad=0.01)
    fig.suptitle(title or "position term of the logits", fontsize=9)
    return fig


def plot_rope_similarity(
    schemes: Mapping[str, PositionScheme], grid: Any = None, max_heads: int = 4, title: str | None = None
):
    """One row per rotary scheme, one panel per head: :func:`rope_similarity` over ``(dh, dw)``.

    Returns a Figure with ``len(schemes) * max_heads`` axes.
    """
    _check_mapping(schemes, "plot_rope_similarity")
    if not schemes:
        raise ValueError("plot_rope_similarity needs at least one scheme")
    for s in schemes.values():
        _check_scheme(s, "plot_rope_similarity")
    fig = new_figure(1.9 * max_heads + 0.6, 1.8 * len(schemes) + 0.5)
    axes = np.atleast_2d(fig.subplots(len(schemes), max_heads, squeeze=False))
    im = None
    for r, (name, s) in enumerate(schemes.items()):
        g = as_grid(grid if grid is not None else s.grid)
        sim = rope_similarity(s, g).numpy()
        ext = (-(g.w - 1) - 0.5, g.w - 1 + 0.5, g.h - 1 + 0.5, -(g.h - 1) - 0.5)
        for h in range(max_heads):
            ax = axes[r, h]
            if h >= sim.shape[0]:
                ax.set_axis_off()
                continue
            im = ax.imshow(sim[h], cmap="RdBu_r", vmin=-1, vmax=1, extent=ext, interpolation="nearest")
            ax.tick_params(labelsize=6)
            ax.set_title(f"{name}, head {h}", fontsize=7)
            if h == 0:
                ax.set_ylabel(_DH, fontsize=7)
            ax.set_xlabel(_DW, fontsize=7)
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.suptitle(title or "RoPE: cosine similarity of rotated q and k vs offset (dh, dw)", fontsize=9)
    return fig


def plot_content_tables(scheme: PositionScheme, title: str | None = None):
    """One panel per learned table of a content scheme (:func:`content_tables`).

    1-D tables ``[2K+1, d]``: an image of channel x offset (offset ``-K .. K`` on the x axis).
    2-D tables ``[2Kh+1, 2Kw+1, d]``: the norm ``|r[dh, dw]|`` over the channels. Offsets are query minus key
    (``dh = row_q - row_k``), as the tables are read and as :func:`offset_profile` folds.
    """
    _check_scheme(scheme, "plot_content_tables")
    tables = content_tables(scheme)
    fig = new_figure(2.4 * len(tables) + 0.6, 2.4)
    axes = np.atleast_1d(fig.subplots(1, len(tables), squeeze=False)[0])
    for ax, (name, t) in zip(axes, tables.items()):
        if t.dim() == 2:
            k = (t.shape[0] - 1) // 2
            a = t.t().numpy()
            lim = _sym_lim(a)
            im = ax.imshow(
                a, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", extent=(-k - 0.5, k + 0.5, a.shape[0] - 0.5, -0.5)
            )
            ax.set_xlabel("offset (query - key)", fontsize=7)
            ax.set_ylabel("channel", fontsize=7)
        elif t.dim() == 3:
            kh, kw = (t.shape[0] - 1) // 2, (t.shape[1] - 1) // 2
            im = ax.imshow(
                t.norm(dim=-1).numpy(), cmap="magma", extent=(-kw - 0.5, kw + 0.5, kh + 0.5, -kh - 0.5), aspect="equal"
            )
            ax.set_xlabel(_DW, fontsize=7)
            ax.set_ylabel(_DH, fontsize=7)
        else:
            raise ValueError(f"{name}: cannot draw a table of shape {tuple(t.shape)}")
        ax.tick_params(labelsize=6)
        ax.set_title(f"{name} {list(t.shape)}" + (" (norm)" if t.dim() == 3 else ""), fontsize=7)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(title or f"{scheme.name}: learned key/value tables", fontsize=9)
    return fig


def plot_attention_maps(
    images: Tensor,
    maps: Tensor,
    labels: Sequence[str] | None = None,
    max_heads: int = 4,
    title: str | None = None,
):
    """One row per image: the image, the head-mean map over it, then each head's map.

    ``images [B, C, H, W]``; ``maps [B, heads, h, w]`` (e.g. :func:`attention_maps`); ``labels`` one
    caption per image. Returns a Figure with ``B * (2 + min(heads, max_heads))`` axes.
    """
    if images.dim() != 4 or maps.dim() != 4 or images.shape[0] != maps.shape[0]:
        raise ValueError(f"expected images [B, C, H, W] and maps [B, heads, h, w], got {images.shape}, {maps.shape}")
    b, heads = maps.shape[0], min(maps.shape[1], max_heads)
    cols = 2 + heads
    fig = new_figure(1.5 * cols + 0.4, 1.55 * b + 0.4)
    axes = np.atleast_2d(fig.subplots(b, cols, squeeze=False))
    ih, iw = images.shape[-2:]
    ph, pw = -(-ih // maps.shape[-2]), -(-iw // maps.shape[-1])  # patch sides (a padded grid passes the image)
    ext = (-0.5, maps.shape[-1] * pw - 0.5, maps.shape[-2] * ph - 0.5, -0.5)
    for i in range(b):
        img = as_image(images[i])
        m = maps[i].float().cpu().numpy()
        axes[i, 0].imshow(img, cmap="gray" if img.ndim == 2 else None)
        axes[i, 0].set_title(labels[i] if labels is not None else f"image {i}", fontsize=7)
        axes[i, 1].imshow(img, cmap="gray" if img.ndim == 2 else None)
        axes[i, 1].imshow(m.mean(0), cmap="inferno", alpha=0.6, extent=ext, interpolation="nearest")
        axes[i, 1].set_xlim(-0.5, iw - 0.5)  # (the image's frame: the padding's cells cut at its edge)
        axes[i, 1].set_ylim(ih - 0.5, -0.5)
        axes[i, 1].set_title("mean over heads", fontsize=7)
        for h in range(heads):
            axes[i, 2 + h].imshow(m[h], cmap="inferno", interpolation="nearest")
            axes[i, 2 + h].set_title(f"head {h}", fontsize=7)
        for ax in axes[i]:
            hide_ticks(ax)
    fig.suptitle(title or "attention over the patch grid", fontsize=9)
    return fig


def __getattr__(name: str) -> Any:  # the NaFlex batch, Swin's windows: viz_packing; attention distance: viz_distance
    if name in ("plot_packed_batch", "plot_swin_windows"):
        from vitrel import viz_packing

        return getattr(viz_packing, name)
    if name in ("attention_distance", "plot_attention_distance"):
        from vitrel import viz_distance

        return getattr(viz_distance, name)
    raise AttributeError(f"module 'vitrel.viz' has no attribute {name!r}")
