"""``attn_impl="fold"``: a bias that factors, ``bias = u w^T`` (``rel2d_factored``, ``rel2d_bucket``), folded into the
queries and keys, ``q' = [q, u / scale]``, ``k' = [k, w]``, so SDPA runs with no bias mask and no ``N x N`` gradient
per head; masks (windows, causal, a layout's images) still go in as masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrel.kernels.base import content_refusal, token_terms_refusal
from vitrel.kernels.common import merge_masks, sdpa_padded
from vitrel.kernels.registry import Kernel, register_kernel
from vitrel.layout.tokens import gather_tokens

__all__ = ["FoldKernel", "attend_folded"]


def attend_folded(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, factors: tuple[Tensor, Tensor], dropout_p=0.0
) -> Tensor:
    """SDPA over ``[q, u / scale]`` and ``[k, w]``: ``q k^T * scale + u w^T`` without a bias mask."""
    u, w = factors
    lead = (q.shape[0], -1, -1, -1)
    q = torch.cat([q, (u.to(q.dtype) / scale).expand(*lead)], dim=-1)
    k = torch.cat([k, w.to(k.dtype).expand(*lead)], dim=-1)
    return sdpa_padded(q, k, v, merge_masks(None, mask, q.dtype), scale, dropout_p)


@register_kernel("fold")
class FoldKernel(Kernel):
    reads = frozenset({"factors"})

    @classmethod
    def refuses(cls, scheme):
        refusal = token_terms_refusal(cls.name, scheme, "no fixed factors")
        refusal = refusal or content_refusal(cls.name, scheme, "no bias to fold") or super().refuses(scheme)
        if refusal is None and not scheme.has_bias_factors:
            from vitrel.pos import get_pos_class, list_pos

            takes = ", ".join(n for n in list_pos() if getattr(get_pos_class(n), "has_bias_factors", False) is True)
            refusal = (
                f"attn_impl='fold' folds a bias that factors into the queries and keys; {scheme.name} has no such "
                f"bias (the factored tables {takes} do; a scheme gets one by defining bias_factors() and "
                "has_bias_factors = True): use attn_impl='sdpa' or 'auto'"
            )
        return refusal

    @classmethod
    def inputs(cls, scheme, grid, num_prefix_tokens):
        return {"factors": scheme.bias_factors(grid, num_prefix_tokens)}

    @classmethod
    def layout_inputs(cls, scheme, layout, mask):
        fs = [scheme.bias_factors(g, layout.num_prefix_tokens) for g in layout.grids]
        r = max(u.shape[-1] for u, _ in fs)
        pad = [(F.pad(u, (0, r - u.shape[-1])), F.pad(w, (0, r - w.shape[-1]))) for u, w in fs]
        u = gather_tokens([f[0] for f in pad], layout)
        w = gather_tokens([f[1] for f in pad], layout)
        return {"bias": mask, "factors": (u, w)}  # (the images' block-diagonal mask in bias)

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        return attend_folded(q, k, v, merge_masks(state.bias, mask, q.dtype), scale, state.factors, dropout_p)
