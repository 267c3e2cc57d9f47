"""``attn_impl="flex"``: FlexAttention (compiled on first use) with a ``score_mod`` that reads the bias from the
scheme's offset table ``T[h, dh + H - 1, dw + W - 1]``, the offsets computed from the token indices
(``r = (i - P) // W``, ``c = (i - P) % W``; from the tokens' coordinates on a packed layout), so no ``N x N`` bias or
bias gradient exists. On a video grid ``(T, H, W)`` the table is ``T[h, dt + T - 1, dh + H - 1, dw + W - 1]``, the
frame ``(i - P) // (H W)`` and the row and column of the rest. Window masks are read in the same ``score_mod``; causal
attention and the table's ``-inf`` entries (LookHere's views) are ``BlockMask`` s, so whole blocks are skipped. No
attention dropout; torch has no FlexAttention backward on CPU (inference only there). On CUDA its table gradient goes
through atomics (not bitwise repeatable; ``attn_impl="triton"`` is). On Hopper the default tiles need more shared
memory than there is with a bf16 table: :func:`kernel_options` gives the tiles that compile there (measured on an H200,
``bench/results/triton_diag_h200_first_kernel.md``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

from vitrel.kernels.base import OffsetTableKernel
from vitrel.kernels.registry import KernelDeviceError, register_kernel
from vitrel.layout.geometry import Grid, Grid3
from vitrel.layout.tokens import TokenLayout

__all__ = [
    "FlexKernel",
    "OffsetTableKernel",
    "attend_flex",
    "kernel_options",
    "layout_block_mask",
    "offset_block_mask",
    "with_causal_blocks",
]

#: FlexAttention tiles by CUDA compute capability (major): Hopper's defaults ask 245,760 bytes of shared memory with a
#: bf16 table, above the H200's 232,448; these compiled there, forward and backward (bench/triton_tune.py --diagnose)
KERNEL_OPTIONS = {
    9: {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
}


def kernel_options(device: torch.device) -> dict[str, Any] | None:
    """FlexAttention's ``kernel_options`` for ``device`` (None: its defaults)."""
    if device.type != "cuda":
        return None
    return KERNEL_OPTIONS.get(torch.cuda.get_device_properties(device).major)  # (torch.compile folds it)


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    return torch.compile(flex_attention, dynamic=False)


#: zero rows of storage after the keys for the compiled CPU kernel (see :func:`_keys_with_slack`)
CPU_KEY_SLACK_ROWS = 64


def _keys_with_slack(k: Tensor) -> Tensor:
    """``k`` copied into a contiguous buffer followed by ``CPU_KEY_SLACK_ROWS`` zero rows (storage only, not in the
    shape).

    torch 2.14's compiled CPU FlexAttention reads keys past the end of their storage at short sequences (seen at
    8 and 24 keys, head dim 16): the last batch x head slice then gets wrong rows, NaN or finite, differently from
    run to run (``tests/kernels/test_flex.py::test_cpu_flex_short_sequences_equal_sdpa``). Zeros there make whatever it
    reads harmless; 64 rows cover what was seen (256 elements fixed head dim 16, 64 did not)."""
    buf = k.new_zeros(k.numel() + CPU_KEY_SLACK_ROWS * k.shape[-1])
    out = buf[: k.numel()].view(k.shape)
    out.copy_(k)
    return out


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """FlexAttention, compiled (once per shape, lazily) unless the caller is being compiled already; on CPU the
    keys get zero storage after their end (:func:`_keys_with_slack`)."""
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, **kwargs)
    if q.dtype == torch.float64:
        raise ValueError(
            "attn_impl='flex' runs FlexAttention compiled, which takes float32, float16 and bfloat16 inputs, not "
            "float64: use attn_impl='sdpa' (or 'eager') for float64"
        )
    if k.device.type == "cpu":
        k = _keys_with_slack(k)
    return _compiled_flex()(q, k, v, **kwargs)


def attend_flex(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state, dropout_p=0.0) -> Tensor:
    """FlexAttention with ``score_mod = score + T[h, dh + H - 1, dw + W - 1] + mask`` (prefix pairs: no bias);
    ``mask`` (windows) an additive float mask broadcastable to ``[B, heads, N, N]`` (or ``[nW, N, N]``: batch ``b``
    reads window ``b mod nW``), or the windows' layout (:meth:`~vitrel.layout.tokens.TokenLayout.windows`: ``-inf``
    across the regions of window ``b mod nW``, read from its ``[nW, N]`` region ids, no ``N x N`` mask);
    ``state.block_mask`` the table's ``-inf`` blocks, intersected with the causal blocks when ``state.causal``."""
    table = state.table
    if table is not None and table.dtype == torch.float64 and q.dtype != torch.float64:
        table = table.float()  # (ALiBi's and LookHere's slopes are float64: compiled flex mixed them with the scores
        # wrongly on CPU, NaN; the float32 table is what triton reads too)
    if dropout_p > 0.0:
        raise ValueError("attn_impl='flex' has no attention dropout (FlexAttention has none): use attn_impl='sdpa'")
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad or (table is not None and table.requires_grad)
    if q.device.type == "cpu" and torch.is_grad_enabled() and needs_grad:
        raise KernelDeviceError(
            "attn_impl='flex' cannot train on CPU (torch has no FlexAttention backward there): use attn_impl='sdpa' "
            "on CPU, or flex for inference (torch.no_grad / inference_mode)"
        )
    at, patch = _offset_reader(table, state.grid, state.num_prefix_tokens, q.device, state.layout)
    regions = None
    if isinstance(mask, TokenLayout):  # (contiguous: FlexAttention's CPU kernel takes no strided captured buffers)
        mask, regions = None, mask.segment.contiguous()
    if mask is not None:
        mask = mask.to(q.dtype)
        if mask.dim() == 3:  # a window mask [nW, N, N]: batch b reads window b mod nW
            mask = mask[:, None]
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if mask.shape[2:] != (q.shape[2], q.shape[2]):  # (a key-padding mask [B, 1, 1, N]: score_mod reads [qi, ki])
            mask = mask.expand(*mask.shape[:2], q.shape[2], q.shape[2]).contiguous()
    mb, mh = (mask.shape[0] > 1, mask.shape[1] > 1) if mask is not None else (False, False)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if table is not None:
            t = at(b, h, qi, ki)
            score = score + torch.where(patch(b, qi) & patch(b, ki), t, torch.zeros_like(t))
        if mask is not None:
            score = score + mask[b % mask.shape[0] if mb else 0, h if mh else 0, qi, ki]
        if regions is not None:
            w = b % regions.shape[0]
            score = torch.where(regions[w, qi] == regions[w, ki], score, float("-inf"))
        return score

    blocks = state.block_mask
    if state.causal:
        blocks = with_causal_blocks(blocks, q.shape[1], q.shape[2], q.device)
    opts = kernel_options(q.device)
    return _flex_attention(q, k, v, score_mod=score_mod, block_mask=blocks, scale=scale, kernel_options=opts)


def _offset_reader(
    table: Tensor | None, grid: Grid, num_prefix_tokens: int, device: torch.device, layout: TokenLayout | None = None
) -> tuple[Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], Callable[[Tensor, Tensor], Tensor]]:
    """``(at, patch)`` for FlexAttention's mods: ``at(b, h, qi, ki) = T[h, dh + H - 1, dw + W - 1]`` of tokens ``qi``,
    ``ki`` (prefix tokens read some entry: mask them with ``patch(b, i)``, true for a patch token). On a full grid the
    offsets are computed from the indices; with a ``layout``, ``T [G, heads, 2H-1, 2W-1]`` holds one table per
    distinct image grid (:func:`~vitrel.layout.tokens.stack_tables`) and the offsets are read from the tokens'
    coordinates."""
    if layout is not None:
        # contiguous copies: FlexAttention's CPU kernel takes no strided views as captured buffers
        rows, cols = layout.coords[..., 0].contiguous(), layout.coords[..., 1].contiguous()
        group = layout.group.contiguous()

        def at_tokens(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            dh = rows[b, qi] - rows[b, ki] + grid.h - 1
            dw = cols[b, qi] - cols[b, ki] + grid.w - 1
            return table[group[b, qi], h, dh.clamp(0, 2 * grid.h - 2), dw.clamp(0, 2 * grid.w - 2)]

        return at_tokens, lambda b, i: rows[b, i] >= 0
    p, gw = num_prefix_tokens, grid.w
    if isinstance(grid, Grid3):  # a video grid, t-major: i - P = (t * H + row) * W + col
        gt, gh, hw = grid.t, grid.h, grid.h * grid.w

        def at3(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            pi, pj = (qi - p).clamp(min=0), (ki - p).clamp(min=0)
            ti, tj = pi // hw, pj // hw
            si, sj = pi - ti * hw, pj - tj * hw
            return table[h, ti - tj + gt - 1, si // gw - sj // gw + gh - 1, si % gw - sj % gw + gw - 1]

        return at3, lambda b, i: i >= p

    def at(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        pi, pj = (qi - p).clamp(min=0), (ki - p).clamp(min=0)
        return table[h, pi // gw - pj // gw + grid.h - 1, pi % gw - pj % gw + gw - 1]

    return at, lambda b, i: i >= p


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


@register_kernel("flex")
class FlexKernel(OffsetTableKernel):
    window_layouts = True
    onnx = False  # (ONNX has no FlexAttention operator)

    @classmethod
    def skip_blocks(cls, table, grid, num_prefix_tokens):
        return offset_block_mask(table, grid, num_prefix_tokens)

    @classmethod
    def layout_blocks(cls, scheme, layout, table):
        return layout_block_mask(layout, table, scheme.num_heads, scheme.has_masked_offsets)

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        return attend_flex(q, k, v, mask, scale, state, dropout_p)
