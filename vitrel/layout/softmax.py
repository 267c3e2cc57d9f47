"""The eager paths' softmax: a row the mask closes (every key ``-inf``) attends to nothing, as in SDPA's kernels."""

from __future__ import annotations

from torch import Tensor

__all__ = ["masked_softmax"]


def masked_softmax(logits: Tensor, mask: Tensor | None) -> Tensor:
    """``softmax(logits, -1)``, with the rows ``mask`` closes set to 0 (SDPA's and FlexAttention's output there).

    A plain softmax makes such a row NaN, and every gradient that passes through it (``0 * NaN``): a padding query
    under a ``[B, 1, N, N]`` pair mask, one whose LookHere heads see only padding keys. ``mask`` is the additive
    mask already in ``logits``, or ``None`` where no mask can close a row (a bias alone: a query sees itself); then
    this is the plain softmax, at no extra cost."""
    if mask is None:
        return logits.softmax(-1)
    closed = mask.amax(-1, keepdim=True) == float("-inf")
    return logits.masked_fill(closed, 0.0).softmax(-1).masked_fill(closed, 0.0)
