"""``attn_impl="sdpa"`` (what ``auto`` falls back to): ``F.scaled_dot_product_attention`` with the bias in its float
mask. Schemes with content terms (Shaw) take the eager path instead (no SDPA computes ``q . r_ij``); queries and keys
wider than the values (channels appended by ``augment``: PaPE) go through :func:`~vitrel.kernels.common.sdpa_padded`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from vitrel.kernels.common import full_mask, sdpa_padded
from vitrel.kernels.eager import attend_eager
from vitrel.kernels.registry import Kernel, register_kernel

__all__ = ["SdpaKernel", "attend_sdpa"]


def attend_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, dropout_p: float = 0.0) -> Tensor:
    """SDPA with ``mask`` (bias included)."""
    if q.shape[-1] != v.shape[-1]:
        return sdpa_padded(q, k, v, mask, scale, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


@register_kernel("sdpa")
class SdpaKernel(Kernel):
    """Every scheme, every case; reads the dense bias."""

    reads = frozenset({"bias"})

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        m = full_mask(state.bias, mask, q)
        if state.scheme.has_content_terms:
            return attend_eager(q, k, v, m, scale, state, dropout_p)
        return attend_sdpa(q, k, v, m, scale, dropout_p)
