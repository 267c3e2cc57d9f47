"""Pieces the kernels share: masks summed and shaped for SDPA, SDPA on widened queries and keys, eager logits, and a
scheme's content terms (Shaw's) on a token layout, computed per image on its own grid."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrel.layout.tokens import TokenLayout, valid_of

if TYPE_CHECKING:
    from vitrel.pos.base import PosState

__all__ = ["content_logits", "content_values", "eager_logits", "full_mask", "merge_masks", "sdpa_padded"]


def full_mask(bias: Tensor | None, mask: Tensor | None, q: Tensor) -> Tensor | None:
    """:func:`merge_masks` of ``bias`` and ``mask`` for queries ``q``, expanded to the batch when the batch is
    symbolic (``torch.export``: SDPA's broadcast of a batch-1 mask would assume ``B != 1``)."""
    m = merge_masks(bias, mask, q.dtype)
    if m is not None and not isinstance(q.shape[0], int):
        m = m.expand(q.shape[0], *m.shape[1:])
    return m


def merge_masks(bias: Tensor | None, mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Sum of an optional ``[heads, N, N]`` bias and an optional broadcastable float mask.

    The result is 4-D (``[1, heads, N, N]`` for a bias alone): SDPA's fused CPU kernel takes a
    4-D mask, while a 3-D one sends it down the slow unfused path (1.7x slower at N = 196).
    """
    if bias is not None:
        bias = bias.to(dtype)
        if bias.dim() == 3:
            bias = bias[None]
    if mask is not None:
        mask = mask.to(dtype)
    if bias is None:
        return mask
    if mask is None:
        return bias
    return bias + mask


def sdpa_padded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, dropout_p: float = 0.0) -> Tensor:
    """SDPA for queries and keys wider than the values (channels appended: a folded bias, PaPE; padded by whoever
    widens them to a head dim the fused kernels take, :func:`~vitrel.layout.heads.sdpa_width`): ``v``
    zero-padded to their width (SDPA's fused kernels want one head dim, else the math path) and the padding cut off
    the output."""
    ev = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - ev))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)[..., :ev]


def eager_logits(q: Tensor, k: Tensor, mask: Tensor | None, scale: float, state: PosState) -> Tensor:
    """Pre-softmax logits ``(q k^T + content_logits(q) + content_key_logits(k)) * scale + mask``, ``[B, heads, N, N]``.

    ``mask`` already holds the bias (see :func:`merge_masks`).
    """
    logits = q @ k.transpose(-2, -1)
    for c in (content_logits(q, state), content_logits(k, state, keys=True)):
        if c is not None:
            logits = logits + c
    logits = logits * scale
    return logits if mask is None else logits + mask


def _image_groups(layout: TokenLayout) -> list[tuple[int, Tensor]]:
    """``(g, images)``: the images (ids, long) whose grid is ``layout.grids[g]``."""
    gid = torch.tensor([layout.grids.index(g) for g in layout.image_grids], dtype=torch.long)
    return [(g, (gid == g).nonzero().flatten()) for g in range(len(layout.grids))]


def content_logits(q: Tensor, state: PosState, keys: bool = False) -> Tensor | None:
    """The scheme's ``content_logits(q, state)`` (``keys``: its ``content_key_logits(k, state)`` of keys ``q``); on a
    token layout computed per image on its own grid: each image's queries scattered into its full sequence (absent
    tokens zero), the scheme's terms for that grid, read back at the tokens' pairs. Exact: a term ``f(q_i, p_i - p_j)``
    (``f(k_j, p_j - p_i)``) depends on no other token."""
    name = "content_key_logits" if keys else "content_logits"
    if name not in state.scheme.content_terms:
        return None
    hook = getattr(state.scheme, name)
    layout = state.layout
    if layout is None:
        return hook(q, state)
    b, heads, n, d = q.shape
    nmax = max(layout.num_prefix_tokens + g.n for g in layout.grids)
    valid = layout.valid
    full = q.new_zeros(layout.num_images, heads, nmax, d)
    full[layout.image[valid], :, layout.index[valid]] = q.transpose(1, 2)[valid]
    out = q.new_zeros(layout.num_images, heads, nmax, nmax)
    for g, ids in _image_groups(layout):
        ng = layout.num_prefix_tokens + layout.grids[g].n
        c = hook(full[ids.to(q.device), :, :ng], state.grid_states[g])
        if c is None:
            return None
        out[ids.to(q.device), :, :ng, :ng] = c.to(out.dtype)
    img, idx = layout.image.clamp(min=0), layout.index
    return out[img[:, :, None], :, idx[:, :, None], idx[:, None, :]].permute(0, 3, 1, 2)  # [B, heads, N, N]


def content_values(attn: Tensor, state: PosState) -> Tensor | None:
    """The scheme's ``content_values(attn, state)``; on a token layout computed per image (see
    :func:`content_logits`): each image's attention scattered into its full ``n x n`` (absent tokens zero, so
    ``sum_j a_ij r_ij`` runs over the present keys), the scheme's values for that grid, read back per token."""
    if "content_values" not in state.scheme.content_terms:
        return None
    layout = state.layout
    if layout is None:
        return state.scheme.content_values(attn, state)
    b, heads, n, _ = attn.shape
    nmax = max(layout.num_prefix_tokens + g.n for g in layout.grids)
    pair = (layout.image[:, :, None] == layout.image[:, None, :]) & layout.valid[:, :, None]  # [B, N, N]
    bi, i, j = pair.nonzero(as_tuple=True)
    full = attn.new_zeros(layout.num_images, heads, nmax, nmax)
    full[layout.image[bi, i], :, layout.index[bi, i], layout.index[bi, j]] = attn[bi, :, i, j]
    out = None
    for g, ids in _image_groups(layout):
        ng = layout.num_prefix_tokens + layout.grids[g].n
        v = state.scheme.content_values(full[ids.to(attn.device), :, :ng, :ng], state.grid_states[g])
        if v is None:
            return None
        if out is None:
            out = v.new_zeros(layout.num_images, heads, nmax, v.shape[-1])
        out[ids.to(attn.device), :, :ng] = v
    got = out[layout.image.clamp(min=0), :, layout.index]  # [B, N, heads, d]
    return (got * valid_of(layout, got)).transpose(1, 2)
