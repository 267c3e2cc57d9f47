"""What the Shaw schemes share (``shaw1d``, ``shaw2d_factored``, ``shaw2d_full``): the base class, the skew
trick, attention by blocks of queries and the size of those blocks.

Shaw et al. (2018) add content-aware relative terms to attention, ``A_ij = (q_i . k_j + q_i . r^K_ij) * scale``
and ``out_i = sum_j a_ij (v_j + r^V_ij)``. :func:`skew` / :func:`unskew` (Huang et al., 2018, Music
Transformer) move a term computed per relative offset to its key column and back, with one pad + reshape +
slice; :func:`attend_query_blocks` runs the attention a block of queries at a time, checkpointed in training,
so no ``N x N x d`` tensor is ever made; :func:`query_blocks` sizes the blocks for the device (small on the CPU,
as large as the free memory allows on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from vitrel.layout.geometry import Grid, check_tokens
from vitrel.layout.softmax import masked_softmax
from vitrel.pos.base import PositionScheme
from vitrel.pos.cache import concrete_grid
from vitrel.pos.tables import ResizeOnLoad

__all__ = [
    "ShawScheme",
    "attend_query_blocks",
    "query_block_size",
    "query_blocks",
    "query_spans",
    "skew",
    "skew_all_offsets",
    "unskew",
    "unskew_all_offsets",
]

#: ``N``-wide temporaries per query row of a block (scores, content logits, softmax, their gradients; the cells of
#: ``shaw2d_full``, up to ``4 N`` wide, count twice): what :func:`query_block_size` budgets
ROW_TEMPORARIES = 12
#: the share of the free device memory one layer's blocks may take (the later layers and the MLPs need the rest)
MEMORY_SHARE = 0.25


def skew(x: Tensor, n_k: int, shift: int) -> Tensor:
    """``x [..., n_q, L]`` (``q . E_m`` for ``L`` relative offsets) -> ``S [..., n_q, n_k]``.

    ``S[..., i, j] = x[..., i, j - i + shift]`` wherever ``0 <= j - i + shift < L``; the other entries
    are arbitrary (finite) values and may only be used where they are masked (causal attention).

    Pad + reshape + slice: row ``i`` of ``x`` padded to width ``M`` starts at ``i * M`` in the flat
    buffer; reading it back with rows of ``M - 1`` shifts row ``i`` left by ``i``.
    """
    if n_k < 1:
        raise ValueError(f"n_k must be positive, got {n_k}")
    *batch, n_q, length = x.shape
    a = max(0, -shift)  # left padding, so that the read start c = shift + a is >= 0
    c = shift + a
    m = max(n_k + 1, length + a)
    z = F.pad(x, (a, m - length - a)).reshape(*batch, n_q * m)
    end = c + n_q * (m - 1)
    if end > n_q * m:
        z = F.pad(z, (0, end - n_q * m))
    return z[..., c:end].reshape(*batch, n_q, m - 1)[..., :n_k]


def unskew(a: Tensor, length: int, shift: int) -> Tensor:
    """Adjoint of :func:`skew`: ``a [..., n_q, n_k]`` -> ``P [..., n_q, L]`` with
    ``P[..., i, m] = sum_j a[..., i, j] [j - i + shift == m]`` (i.e. ``a[..., i, m + i - shift]`` or 0).

    Pad + reshape + slice: row ``i`` padded to width ``M`` and read back with rows of ``M + 1``
    shifts row ``i`` right by ``i``; the padding is wide enough that only zeros fill the gaps.
    """
    if length < 1:
        raise ValueError(f"length must be positive, got {length}")
    *batch, n_q, n_k = a.shape
    b = max(shift, 0)  # left padding, so that the read start c = b - shift is >= 0
    c = b - shift
    m = max(b + n_k, length + n_q - 1 - shift + b)
    z = F.pad(a, (b, m - n_k - b)).reshape(*batch, n_q * m)
    end = c + n_q * (m + 1)
    if end > n_q * m:
        z = F.pad(z, (0, end - n_q * m))
    return z[..., c:end].reshape(*batch, n_q, m + 1)[..., :length]


def skew_all_offsets(x: Tensor, n_k: int) -> Tensor:
    """:func:`skew` of every offset between ``n_q`` queries and ``n_k`` keys (``L = n_q + n_k - 1``, ``shift = n_q -
    1``: every entry valid), ``x [..., n_q, L]`` -> ``[..., n_q, n_k]``, ``S[..., i, j] = x[..., i, j - i + n_q - 1]``.

    At concrete sizes :func:`skew` itself; at symbolic ones (``torch.export`` at dynamic sizes) rows padded to ``L +
    1`` (wide enough at any ``n_q``), cropped by a negative pad and read back with rows of ``L``: no ``max``, no
    branch and no clamped slice on the sizes, whose nested ``Max`` expressions took torch minutes to reason about."""
    *batch, n_q, length = x.shape
    if _concrete(n_q, n_k, length):
        if length != n_q + n_k - 1:
            raise ValueError(f"skew_all_offsets needs L = n_q + n_k - 1 = {n_q + n_k - 1} offsets, got {length}")
        return skew(x, n_k, n_q - 1)
    z = F.pad(x, (0, 1)).reshape(*batch, n_q * (length + 1))
    z = F.pad(z, (1 - n_q, -1))  # drops the first n_q - 1 and the last
    return z.reshape(*batch, n_q, length)[..., :n_k]


def unskew_all_offsets(a: Tensor) -> Tensor:
    """Adjoint of :func:`skew_all_offsets` (:func:`unskew` with ``L = n_q + n_k - 1``, ``shift = n_q - 1``): ``a
    [..., n_q, n_k]`` -> ``P [..., n_q, L]``, ``P[..., i, m] = a[..., i, m + i - n_q + 1]`` or 0. At concrete sizes
    :func:`unskew` itself; at symbolic ones its steps with the sizes written out (no ``max``, no branch)."""
    *batch, n_q, n_k = a.shape
    length = n_q + n_k - 1
    if _concrete(n_q, n_k):
        return unskew(a, length, n_q - 1)
    width = 2 * n_q + n_k - 2  # rows padded by n_q - 1 on each side
    z = F.pad(F.pad(a, (n_q - 1, n_q - 1)).reshape(*batch, n_q * width), (0, n_q))
    return z.reshape(*batch, n_q, width + 1)[..., :length]


def _concrete(*sizes: int) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _content_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_logits: Callable[..., Tensor],
    rel_values: Callable[..., Tensor],
    extra: tuple,
    mask: Tensor | None,
    scale: float,
    dropout_p: float,
    p: int,
) -> Tensor:
    """Patch queries ``q [B, h, c, d]`` against every key (``p`` prefix keys first): ``A = (q k^T + [0,
    rel_logits(q, *extra)]) * scale + mask``, ``softmax(A) v + rel_values(softmax(A)[..., p:], *extra)``."""
    s = q @ k.transpose(-2, -1) + F.pad(rel_logits(q, *extra), (p, 0))
    s = s * scale
    if mask is not None:
        s = s + mask
    a = masked_softmax(s, mask)
    if dropout_p > 0.0:
        a = F.dropout(a, dropout_p)
    return a @ v + rel_values(a[..., p:], *extra)


def attend_query_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: Sequence[tuple[int, int, tuple]],
    rel_logits: Callable[..., Tensor],
    rel_values: Callable[..., Tensor],
    mask: Tensor | None,
    scale: float | None,
    dropout_p: float,
    num_prefix_tokens: int,
    record: bool,
) -> Tensor:
    """Content-term attention by blocks of queries: the prefix queries through SDPA (no relative terms), then
    for each ``(t0, t1, extra)`` of ``spans`` (token indices of patch queries)::

        A   = (q_blk k^T + [0, rel_logits(q_blk, *extra)]) * scale + mask_rows      [B, h, t1 - t0, N]
        out = softmax(A) v + rel_values(softmax(A)[..., P:], *extra)

    (``rel_logits``: ``[B, h, c, HW]``, the unscaled ``q_i . r^K_ij`` of the block's queries and the patch
    keys; ``rel_values``: ``[B, h, c, d]``, ``sum_j a_ij r^V_ij``). Each block is checkpointed when ``record``
    (the backward recomputes its temporaries, with the forward's dropout draws, instead of keeping them).

    ``q, k, v [B, h, N, d]``; ``mask`` an additive float mask broadcastable to ``[B, h, N, N]`` or None;
    ``scale`` default ``d ** -0.5``. Returns ``[B, h, N, d]``.
    """
    p = num_prefix_tokens
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if mask is not None:
        mask = mask.to(q.dtype)
    outs = []
    if p:
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, :p], k, v, attn_mask=_rows_of(mask, 0, p), dropout_p=dropout_p, scale=scale
            )
        )
    for t0, t1, extra in spans:
        args = (q[:, :, t0:t1], k, v, rel_logits, rel_values, extra, _rows_of(mask, t0, t1), scale, dropout_p, p)
        outs.append(checkpoint(_content_block, *args, use_reentrant=False) if record else _content_block(*args))
    return torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]


def _rows_of(mask: Tensor | None, t0: int, t1: int) -> Tensor | None:
    """The rows ``t0 .. t1 - 1`` (queries) of an additive mask broadcastable to ``[B, h, N, N]``."""
    return mask if mask is None or mask.shape[-2] == 1 else mask[..., t0:t1, :]


def query_block_size(free_bytes: int, n: int, heads: int, head_dim: int, batch: int = 1, elem_bytes: int = 4) -> int:
    """Queries per block that fit ``MEMORY_SHARE`` of ``free_bytes``: each query row of a block holds
    ``ROW_TEMPORARIES`` tensors ``N`` wide (and its ``q``, output and gradients, ``4 head_dim``) per head and image;
    at most ``n`` (the whole layer at once), at least 1."""
    row = batch * heads * (ROW_TEMPORARIES * n + 4 * head_dim) * elem_bytes
    return int(min(n, max(1, MEMORY_SHARE * free_bytes // row)))


def _free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, None for any other: the driver's free bytes and what the caching allocator
    holds unused; under ``torch.compile`` (no call to the driver in a graph) the device's total memory."""
    if device.type != "cuda":
        return None
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def query_spans(
    q: Tensor, grid: Grid, num_prefix_tokens: int, block_queries: int | None, unit: int = 1
) -> tuple[list[tuple[int, int]] | None, bool]:
    """The query blocks of Shaw's query-block paths (``shaw1d``: ``unit`` 1 token; ``shaw2d_full``: ``unit`` a
    grid row of ``W``): ``(spans, record)``, ``spans`` the ``[a, b)`` in units covering the grid's patch queries,
    blocks of ``block_queries // unit`` units (at least one; :func:`query_blocks`), ``record`` whether each block is
    checkpointed (gradients recorded and the blocks checkpointed). ``(None, False)``: one block of every query,
    for a symbolic grid, under ``torch.export`` at any sizes (a Python loop of blocks would unroll into the program:
    a batch-size program of a shaw1d ViT had 11 copies of a block's graph) or in an ``fx`` trace."""
    check_tokens(q.shape[-2], grid, num_prefix_tokens)
    if not concrete_grid(grid) or isinstance(q, torch.fx.Proxy) or torch.compiler.is_exporting():
        return None, False
    c, checkpointed = query_blocks(q, q.shape[-2], block_queries)
    g, total = max(1, c // unit), grid.n // unit
    return [(a, min(total, a + g)) for a in range(0, total, g)], checkpointed and torch.is_grad_enabled()


def query_blocks(q: Tensor, n_keys: int, block_queries: int | None) -> tuple[int, bool]:
    """``(queries per block, checkpointed)`` of Shaw's query-block paths for queries ``q [B, heads, N, d]``.

    ``block_queries`` (a scheme's option) when set, checkpointed; else on CUDA the largest block the free memory
    takes (:func:`query_block_size`): the whole layer at once, not checkpointed, when it fits, else large tiles,
    checkpointed (the CPU's small blocks are thousands of small launches on a GPU); elsewhere about ``0.4 head_dim``
    queries, checkpointed, which keeps a block's temporaries near the ``O(N d)`` of ``q``, ``k``, ``v``.
    """
    if block_queries is not None:
        return block_queries, True
    b, heads, n_q, d = q.shape
    free = _free_bytes(q.device)
    if free is None:
        return max(1, int(0.4 * d)), True
    c = query_block_size(free, n_keys, heads, d, b, q.element_size())
    return c, c < n_q


class ShawScheme(ResizeOnLoad, PositionScheme):
    """What the Shaw schemes share. Their attention runs on the kernel ``attn_impl="shaw"``
    (:mod:`vitrel.kernels.shaw`, what ``auto`` picks), which calls :meth:`content_attention`, the scheme's fast path,
    or on ``attn_impl="eager"`` (softmax written out, ``content_logits`` / ``content_values``)."""

    family = "content"
    renamed_options = {"max_distance": "clip_distance"}
    has_content_terms = True

    def content_attention(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, grid: Grid, p: int, dropout_p: float
    ) -> Tensor:  # pragma: no cover - overridden
        """``softmax((q k^T + q . r^K) * scale + mask)`` applied to ``v + r^V`` on a full ``grid`` with ``p`` prefix
        tokens, never an ``N x N x d`` tensor (``mask``: an additive float mask broadcastable to ``[B, h, N, N]``)."""
        raise NotImplementedError
