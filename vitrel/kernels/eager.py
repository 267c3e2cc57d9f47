"""``attn_impl="eager"``: the softmax written out, with Shaw's content terms; the one eager attention path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

from vitrel.kernels.common import content_values, eager_logits, full_mask
from vitrel.kernels.registry import Kernel, register_kernel
from vitrel.layout.softmax import masked_softmax

if TYPE_CHECKING:
    from vitrel.pos.base import PosState

__all__ = ["EagerKernel", "attend_eager"]


def attend_eager(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    state: PosState,
    dropout_p: float = 0.0,
    closes_rows: bool = True,
) -> Tensor:
    """``a = dropout(mix(softmax(eager_logits)))``, ``a v + content_values(a)`` (``mask`` holds the bias already;
    ``mix``: the scheme's, GPSA's gated positional attention, where it ``mixes_weights``).

    A row ``mask`` closes is 0 (:func:`~vitrel.layout.softmax.masked_softmax`); ``closes_rows=False`` where ``mask``
    is a bias alone, which closes none, skips the check."""
    attn = masked_softmax(eager_logits(q, k, mask, scale, state), mask if closes_rows else None)
    if state.scheme.mixes_weights:
        attn = state.scheme.mix(attn, mask, state)
    if dropout_p > 0.0:
        attn = F.dropout(attn, dropout_p)
    out = attn @ v
    cv = content_values(attn, state)
    return out if cv is None else out + cv


@register_kernel("eager")
class EagerKernel(Kernel):
    """Every scheme, every case; reads the dense bias. The one kernel of the schemes that mix the attention weights
    (``mixes_weights``: GPSA), hence ``auto``'s for them."""

    reads = frozenset({"bias"})
    mixes_weights = True

    @classmethod
    def default_for(cls, scheme):
        return scheme.mixes_weights

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        m = full_mask(state.bias, mask, q)
        return attend_eager(q, k, v, m, scale, state, dropout_p, closes_rows=mask is not None)
