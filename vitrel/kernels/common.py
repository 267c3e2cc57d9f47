"""Pieces the kernels share: masks summed and shaped for SDPA, SDPA on widened queries and keys, eager logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrel.layout.tokens import content_logits

if TYPE_CHECKING:
    from vitrel.pos.base import PosState

__all__ = ["eager_logits", "full_mask", "merge_masks", "sdpa_padded"]


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
    """Pre-softmax logits ``(q k^T + content_logits(q)) * scale + mask``, ``[B, heads, N, N]``.

    ``mask`` already holds the bias (see :func:`merge_masks`).
    """
    logits = q @ k.transpose(-2, -1)
    c = content_logits(q, state)
    if c is not None:
        logits = logits + c
    logits = logits * scale
    return logits if mask is None else logits + mask
