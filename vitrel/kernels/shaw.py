"""``attn_impl="shaw"``: the content schemes, what ``auto`` picks for them: Shaw et al.'s relative keys and values
(``shaw1d``, ``shaw2d_factored``, ``shaw2d_full``) by each scheme's own fast path, iRPE's (``irpe``) eagerly.

No SDPA computes ``q_i . r^K_ij`` or ``sum_j a_ij r^V_ij``: each Shaw scheme declares ``content_attention``
(:class:`~vitrel.pos.shaw_base.ShawScheme`), which never makes an ``N x N x d`` tensor:

* ``shaw2d_factored``: one SDPA call on queries, keys and values widened by ``H + W`` channels, padded to a head
  dim SDPA's fused kernels take (:func:`~vitrel.layout.heads.sdpa_width`);
* ``shaw1d``, ``shaw2d_full``: blocks of queries (:func:`~vitrel.pos.shaw_base.attend_query_blocks`), sized for the
  device (:func:`~vitrel.pos.shaw_base.query_blocks`: on CUDA the whole layer at once or large tiles, as the free
  memory allows; on the CPU about ``0.4 head_dim`` queries), checkpointed in training where there are several.

A content scheme without a path of its own (``irpe``, whose authors write the attention out) runs the eager path
(:func:`~vitrel.kernels.eager.attend_eager`). On a token layout (packed images, dropped tokens) the content terms are
computed per image on its own grid: the eager path too, with the images' block-diagonal mask read from ``bias``.
"""

from __future__ import annotations

from vitrel.kernels.common import full_mask
from vitrel.kernels.eager import attend_eager
from vitrel.kernels.registry import Kernel, register_kernel

__all__ = ["ShawKernel"]


@register_kernel("shaw")
class ShawKernel(Kernel):
    """Schemes with content terms (Shaw, iRPE); reads ``bias`` (they have none: only a layout's image mask)."""

    reads = frozenset({"bias"})

    @classmethod
    def refuses(cls, scheme):
        if not scheme.has_content_terms:
            other = "eager" if scheme.mixes_weights else "sdpa"  # (GPSA's mixture: the eager path alone)
            return (
                f"attn_impl='shaw' runs the content-aware relative keys and values of Shaw et al. (shaw1d, "
                f"shaw2d_factored, shaw2d_full) and iRPE (irpe); {scheme.name} has no such terms: use "
                f"attn_impl='{other}' or 'auto'"
            )
        return super().refuses(scheme)

    @classmethod
    def default_for(cls, scheme):
        return scheme.has_content_terms

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        m = full_mask(state.bias, mask, q)
        if state.layout is not None or not hasattr(state.scheme, "content_attention"):  # (iRPE: no path of its own)
            return attend_eager(q, k, v, m, scale, state, dropout_p)
        return state.scheme.content_attention(q, k, v, m, scale, state.grid, state.num_prefix_tokens, dropout_p)
