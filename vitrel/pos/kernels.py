"""The attention kernels a position scheme's :meth:`~vitrel.pos.base.PositionScheme.attend` runs.

Every kernel computes ``dropout(softmax(q k^T * scale + bias + mask)) v`` for ``[B, heads, N, d]`` inputs from
the scheme's :class:`~vitrel.pos.base.PosState` (its grid, prefix count, bias or its factors or offset table):

* :func:`attend_sdpa`: SDPA with the bias in its float mask (``attn_impl="sdpa"`` / ``"auto"``);
* :func:`attend_folded`: a factored bias folded into the queries and keys, no mask (``"fold"``);
* :func:`attend_flex`: FlexAttention reading the bias by offset in its ``score_mod`` (``"flex"``);
* :func:`attend_eager`: the softmax written out, with Shaw's content terms (``"eager"``);
* :func:`attend_state`: the dispatch between them by the state's ``impl``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

from vitrel.pos.geometry import Grid, patch_coords
from vitrel.pos.tokens import content_logits, content_values

if TYPE_CHECKING:
    from vitrel.pos.base import PosState
    from vitrel.pos.tokens import TokenLayout

ATTN_IMPLS = ("auto", "sdpa", "flex", "fold", "eager", "triton")

__all__ = [
    "ATTN_IMPLS",
    "attend_state",
    "attend_sdpa",
    "attend_folded",
    "attend_flex",
    "attend_eager",
    "eager_logits",
    "merge_masks",
    "sdpa_padded",
    "offset_block_mask",
    "layout_block_mask",
    "with_causal_blocks",
]


def attend_state(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p: float = 0.0
) -> Tensor:
    """The kernel of ``state.impl`` (``q`` and ``k`` already rotated; ``mask`` an additive float mask
    broadcastable to ``[B, heads, N, N]``: windows, causal)."""
    if state.impl == "flex":
        return attend_flex(q, k, v, mask, scale, state, dropout_p)
    if state.impl == "triton":
        return attend_triton(q, k, v, mask, scale, state, dropout_p)
    if state.factors is not None:  # (a layout's block-diagonal mask in state.bias)
        return attend_folded(q, k, v, merge_masks(state.bias, mask, q.dtype), scale, state.factors, dropout_p)
    if state.scheme.has_content_terms or state.impl == "eager":
        return attend_eager(q, k, v, full_mask(state.bias, mask, q), scale, state, dropout_p)
    return attend_sdpa(q, k, v, full_mask(state.bias, mask, q), scale, dropout_p)


def attend_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, dropout_p: float = 0.0) -> Tensor:
    """``F.scaled_dot_product_attention`` with ``mask`` (bias included, :func:`full_mask`); queries and keys
    wider than the values (channels appended by ``augment``, PaPE) go through :func:`sdpa_padded`."""
    if q.shape[-1] != v.shape[-1]:
        return sdpa_padded(q, k, v, mask, scale, dropout_p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


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
    """SDPA for queries and keys wider than the values (channels appended: a folded bias, PaPE): ``v``
    zero-padded to their width (SDPA's fused kernels want one head dim, else the math path) and the padding
    cut off the output."""
    ev = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - ev))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)[..., :ev]


def attend_folded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    factors: tuple[Tensor, Tensor],
    dropout_p: float = 0.0,
) -> Tensor:
    """SDPA over ``[q, u / scale]`` and ``[k, w]``: ``q k^T * scale + u w^T`` without a bias mask (the
    fold of a factored bias, ``attn_impl="fold"``); ``mask`` (windows, causal) still goes in as a mask."""
    u, w = factors
    lead = (q.shape[0], -1, -1, -1)
    q = torch.cat([q, (u.to(q.dtype) / scale).expand(*lead)], dim=-1)
    k = torch.cat([k, w.to(k.dtype).expand(*lead)], dim=-1)
    return sdpa_padded(q, k, v, merge_masks(None, mask, q.dtype), scale, dropout_p)


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


def attend_eager(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p: float = 0.0
) -> Tensor:
    """The one eager attention path: ``a = dropout(softmax(eager_logits))``, ``a v + content_values(a)``."""
    attn = eager_logits(q, k, mask, scale, state).softmax(dim=-1)
    if dropout_p > 0.0:
        attn = F.dropout(attn, dropout_p)
    out = attn @ v
    cv = content_values(attn, state)
    return out if cv is None else out + cv


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    return torch.compile(flex_attention, dynamic=False)


#: zero rows of storage after the keys for the compiled CPU kernel (see :func:`_keys_with_slack`)
CPU_KEY_SLACK_ROWS = 64


def _keys_with_slack(k: Tensor, rows: int = CPU_KEY_SLACK_ROWS) -> Tensor:
    """``k`` copied into a contiguous buffer followed by ``rows`` zero rows (storage only, not in the shape).

    torch 2.14's compiled CPU FlexAttention reads keys past the end of their storage at short sequences (seen at
    8 and 24 keys, head dim 16): the last batch x head slice then gets wrong rows, NaN or finite, differently from
    run to run (``tests/test_attn_flex.py::test_cpu_flex_short_sequences_equal_sdpa``). Zeros there make whatever it
    reads harmless; 64 rows cover what was seen (256 elements fixed head dim 16, 64 did not)."""
    buf = k.new_zeros(k.numel() + rows * k.shape[-1])
    out = buf[: k.numel()].view(k.shape)
    out.copy_(k)
    return out


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """FlexAttention, compiled (once per shape, lazily) unless the caller is being compiled already; on CPU the
    keys get zero storage after their end (:func:`_keys_with_slack`)."""
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, **kwargs)
    if k.device.type == "cpu":
        k = _keys_with_slack(k)
    return _compiled_flex()(q, k, v, **kwargs)


def attend_flex(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p: float = 0.0
) -> Tensor:
    """FlexAttention with ``score_mod = score + T[h, dh + H - 1, dw + W - 1] + mask`` (``attn_impl="flex"``):
    the bias is read from the offset table ``T`` (gradients reach it; on CUDA through atomics, so not
    bitwise deterministic), prefix pairs get none; ``mask`` (windows, causal) an additive float mask
    broadcastable to ``[B, heads, N, N]``, read in the same ``score_mod``. No attention dropout; no
    backward on CPU (torch has none there): use ``sdpa`` for those. ``state.block_mask`` (:func:`offset_block_mask`)
    lets the kernel skip blocks the table masks out entirely."""
    table = state.table
    if dropout_p > 0.0:
        raise ValueError("attn_impl='flex' has no attention dropout (FlexAttention has none): use attn_impl='sdpa'")
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad or (table is not None and table.requires_grad)
    if q.device.type == "cpu" and torch.is_grad_enabled() and needs_grad:
        raise ValueError(
            "attn_impl='flex' cannot train on CPU (torch has no FlexAttention backward there): use attn_impl='sdpa' "
            "on CPU, or flex for inference (torch.no_grad / inference_mode)"
        )
    at, patch = _offset_reader(table, state.grid, state.num_prefix_tokens, q.device, state.layout)
    if mask is not None:
        mask = mask.to(q.dtype)
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    mb, mh = (mask.shape[0] > 1, mask.shape[1] > 1) if mask is not None else (False, False)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if table is not None:
            t = at(b, h, qi, ki)
            score = score + torch.where(patch(b, qi) & patch(b, ki), t, torch.zeros_like(t))
        if mask is not None:
            score = score + mask[b if mb else 0, h if mh else 0, qi, ki]
        return score

    return _flex_attention(q, k, v, score_mod=score_mod, block_mask=state.block_mask, scale=scale)


def attend_triton(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p: float = 0.0
) -> Tensor:
    """The fused Triton kernel reading the bias from the offset table (``attn_impl="triton"``,
    :mod:`vitrel.kernels.triton_bias`); ``mask`` ``[nW, n, n]`` (windows) or ``[n, n]``."""
    from vitrel.kernels.triton_bias import rel_bias_attention

    if dropout_p > 0.0:
        raise ValueError("attn_impl='triton' has no attention dropout: use attn_impl='sdpa' for attn_drop > 0")
    if mask is not None and mask.dim() == 4:
        if mask.shape[1] != 1:
            raise ValueError("attn_impl='triton' takes a mask shared by the heads ([B | nW, N, N])")
        mask = mask[:, 0]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    return rel_bias_attention(
        q, k, v, state.table, state.grid, state.num_prefix_tokens, scale, mask, causal=state.causal
    )


def _offset_reader(
    table: Tensor | None, grid: Grid, num_prefix_tokens: int, device: torch.device, layout: TokenLayout | None = None
) -> tuple[Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]:
    """``(at, patch)`` for FlexAttention's mods: ``at(b, h, qi, ki) = T[h, dh + H - 1, dw + W - 1]`` of tokens ``qi``,
    ``ki`` (prefix tokens read some entry: mask them with ``patch(b, i)``, true for a patch token). With a ``layout``,
    ``T [G, heads, 2H-1, 2W-1]`` holds one table per distinct image grid (:func:`~vitrel.pos.tokens.stack_tables`)
    and the offsets are read from the tokens' coordinates."""
    if layout is not None:
        # contiguous copies: FlexAttention's CPU kernel takes no strided views as captured buffers
        rows, cols = layout.coords[..., 0].contiguous(), layout.coords[..., 1].contiguous()
        group = layout.group.contiguous()

        def at_tokens(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            dh = rows[b, qi] - rows[b, ki] + grid.h - 1
            dw = cols[b, qi] - cols[b, ki] + grid.w - 1
            return table[group[b, qi], h, dh.clamp(0, 2 * grid.h - 2), dw.clamp(0, 2 * grid.w - 2)]

        return at_tokens, lambda b, i: rows[b, i] >= 0
    rows, cols = patch_coords(grid, device)
    p = num_prefix_tokens
    rows, cols = F.pad(rows, (p, 0)), F.pad(cols, (p, 0))

    def at(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return table[h, rows[qi] - rows[ki] + grid.h - 1, cols[qi] - cols[ki] + grid.w - 1]

    patch = torch.arange(p + grid.n, device=device) >= p
    return at, lambda b, i: patch[i]


def offset_block_mask(table: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Any:
    """FlexAttention ``BlockMask`` of the pairs an offset table lets through: ``T[h, dh, dw] > -inf``, and every
    pair with a prefix token (``[heads, N, N]``, no batch dimension)."""
    at, patch = _offset_reader(table, grid, num_prefix_tokens, table.device)

    def mask_mod(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return ~(patch(b, qi) & patch(b, ki)) | (at(b, h, qi, ki) > float("-inf"))

    n = num_prefix_tokens + grid.n
    return create_block_mask(mask_mod, None, table.shape[0], n, n, device=table.device)


def layout_block_mask(layout: TokenLayout, table: Tensor | None, heads: int, masked_offsets: bool) -> Any:
    """FlexAttention ``BlockMask`` of a token layout: the document mask (a query sees the keys of its own image;
    padding sees padding), intersected with the table's ``-inf`` entries when it has some (LookHere's views).
    Blocks across images are skipped whole."""
    seg = layout.segment
    b, n = seg.shape

    def document(bi: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return seg[bi, qi] == seg[bi, ki]

    if not masked_offsets or table is None:
        return create_block_mask(document, b, None, n, n, device=seg.device)
    extent = Grid((table.shape[-2] + 1) // 2, (table.shape[-1] + 1) // 2)
    at, patch = _offset_reader(table, extent, layout.num_prefix_tokens, seg.device, layout)

    def views(bi: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return ~(patch(bi, qi) & patch(bi, ki)) | (at(bi, h, qi, ki) > float("-inf"))

    return create_block_mask(and_masks(document, views), b, heads, n, n, device=seg.device)


def _causal(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
    return qi >= ki


def with_causal_blocks(block_mask: Any, heads: int, n: int, device: torch.device) -> Any:
    """The FlexAttention ``BlockMask`` of causal attention over ``n`` tokens (key ``j <= i``), intersected with
    ``block_mask`` (a scheme's, e.g. LookHere's views) if there is one: the kernel skips the blocks above the
    diagonal and masks the diagonal blocks exactly (no float mask is read)."""
    if block_mask is None:
        return create_block_mask(_causal, None, None, n, n, device=device)
    return create_block_mask(and_masks(block_mask.mask_mod, _causal), None, heads, n, n, device=device)
