"""``attn_impl="sdpa"`` (what ``auto`` falls back to): ``F.scaled_dot_product_attention`` with the bias in its float
mask. Schemes with content terms (Shaw) are refused (no SDPA computes ``q . r_ij``: ``attn_impl="shaw"``); queries and
keys wider than the values (channels appended by ``augment``: PaPE) go through
:func:`~vitrel.kernels.common.sdpa_padded`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from vitrel.kernels.common import full_mask, sdpa_padded
from vitrel.kernels.registry import Kernel, register_kernel

__all__ = ["SdpaKernel", "attend_sdpa"]


def attend_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, dropout_p: float = 0.0) -> Tensor:
    """SDPA with ``mask`` (bias included)."""
    if q.shape[-1] != v.shape[-1]:
        return sdpa_padded(q, k, v, mask, scale, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


@register_kernel("sdpa")
class SdpaKernel(Kernel):
    """Every scheme without content terms, every case; reads the dense bias."""

    reads = frozenset({"bias"})

    @classmethod
    def refuses(cls, scheme):
        if scheme.has_content_terms:
            return (
                f"attn_impl='sdpa': no SDPA computes {scheme.name}'s content terms (q_i . r_ij, sum_j a_ij r_ij): use "
                "attn_impl='shaw' (its fast path, what 'auto' picks) or 'eager'"
            )
        return super().refuses(scheme)

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        return attend_sdpa(q, k, v, full_mask(state.bias, mask, q), scale, dropout_p)
