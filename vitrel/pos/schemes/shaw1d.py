"""Shaw et al. (2018) content-aware relative keys and values on a 1-D sequence, via the skew trick.

For queries at positions ``i + o`` (``o = q_offset``) and keys at positions ``j``, per head, the
tables are indexed by the key-minus-query offset ``r_ij = -d_ij`` (``d_ij = (i + o) - j`` in the
query-minus-key convention of every vitrel scheme; Shaw et al. and the Music Transformer write
``j - i``)::

    r_ij   = clip(j - (i + o), -K, K)
    A_ij   = (q_i . k_j + q_i . r^K[r_ij]) * scale + mask_ij
    out_i  = sum_j softmax_j(A)_ij (v_j + r^V[r_ij])

with tables ``r^K, r^V`` of ``[2K+1, d]`` shared by all heads (offsets beyond ``K`` get the edge
embedding: Shaw's clipping). ``o`` is 0 for full and cross attention and ``n_k - n_q`` for causal
attention (the queries are the last ``n_q`` positions).

The memory-efficient path of Huang et al. (2018, Music Transformer), generalised to self, cross,
full and causal attention: the ``L`` offsets that occur are ``r_min .. r_max`` (``L = n_q + n_k -
1`` for full attention, ``L = n_k`` for causal); the clipped tables are expanded to those ``L``
offsets (``[L, d]``, cheap), ``x = q E^T`` is ``[n_q, L]`` and :func:`~vitrel.pos.shaw_base.skew` moves ``x[i, m]`` to
column ``j = m + i - shift`` with one pad + reshape + slice (no gather, no ``[n_q, n_k, d]``). The
value term uses the adjoint :func:`~vitrel.pos.shaw_base.unskew`, which sums the attention weights of each offset.

``shaw1d`` applies it to the patch tokens in raster order ``p = row * W + col`` (a true 1-D
sequence is the grid ``(1, L)``); prefix tokens get no relative terms. Its fast path
(:func:`shaw1d_attention`) takes the patch queries in blocks of ``c`` (``block_queries``), each
:func:`shaw_logits` / :func:`shaw_values` with ``q_offset`` the block's start, checkpointed in training: temporaries of
``O(c N)`` per head instead of the ``N x (2N - 1)`` offsets and ``N x N`` weights of the whole layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, check_tokens, pad_prefix
from vitrel.pos.base import PosState
from vitrel.pos.registry import register_pos
from vitrel.pos.shaw_base import (
    ShawScheme,
    attend_query_blocks,
    query_spans,
    skew,
    skew_all_offsets,
    unskew,
    unskew_all_offsets,
)
from vitrel.pos.tables import check_init_std, take_renamed

__all__ = [
    "offset_range",
    "expand_table",
    "shaw_logits",
    "shaw_values",
    "shaw1d_attention",
    "Shaw1d",
]


def offset_range(n_q: int, n_k: int, q_offset: int, causal: bool) -> tuple[int, int]:
    """``(r_min, L)``: the offsets ``r = j - (i + q_offset)`` that occur are ``r_min .. r_min + L - 1``.

    With these, ``skew(q E^T, n_k, shift=n_q - 1)`` puts offset ``r`` of query ``i`` at key ``j``.
    """
    r_min = -(n_q - 1) - q_offset
    r_max = n_k - 1 - q_offset
    if causal:
        r_max = min(r_max, 0)
    return r_min, r_max - r_min + 1


def expand_table(table: Tensor, r_min: int, length: int, clip_distance: int | None = None) -> Tensor:
    """Rows of ``table [2K+1, d]`` for offsets ``r_min .. r_min + L - 1``, clipped to ``[-K', K']``.

    ``K' = clip_distance`` (at most ``K``), or ``K`` when None. Returns ``[L, d]``.
    """
    if table.dim() != 2 or table.shape[0] % 2 == 0:
        raise ValueError(f"a relative table must be [2K+1, d], got {tuple(table.shape)}")
    half = (table.shape[0] - 1) // 2
    if clip_distance is None:
        clip_distance = half
    if not 0 <= clip_distance <= half:
        raise ValueError(
            f"clip_distance must be in [0, {half}] for a table of {table.shape[0]} rows, got {clip_distance}"
        )
    r = torch.arange(r_min, r_min + length, device=table.device).clamp(-clip_distance, clip_distance) + half
    return table.index_select(0, r)


def _expand_offsets(
    table: Tensor, n_q: int, n_k: int, q_offset: int | None, causal: bool, clip_distance: int | None
) -> tuple[Tensor, int]:
    """``(E [L, d], L)``: the rows of ``table`` for the ``L`` offsets that occur between ``n_q`` queries (the first at
    ``q_offset``; None: the last ``n_q`` positions when ``causal``, else 0) and ``n_k`` keys (:func:`offset_range`,
    :func:`expand_table`), what :func:`shaw_logits` skews and :func:`shaw_values` unskews."""
    if q_offset is None:
        q_offset = n_k - n_q if causal else 0
    if causal and q_offset < 0:
        raise ValueError(f"causal attention needs q_offset >= 0 (queries after the first key), got {q_offset}")
    r_min, length = offset_range(n_q, n_k, q_offset, causal)
    return expand_table(table, r_min, length, clip_distance), length


def shaw_logits(
    q: Tensor,
    rel_k: Tensor,
    n_k: int,
    *,
    q_offset: int | None = None,
    causal: bool = False,
    clip_distance: int | None = None,
) -> Tensor:
    """Unscaled ``S_ij = q_i . r^K[clip(j - i - q_offset)]``: ``q [..., n_q, d]`` -> ``[..., n_q, n_k]``.

    With ``causal`` only offsets ``<= 0`` are computed (``L = n_k``) and entries with ``j > i +
    q_offset`` are arbitrary: mask them.
    """
    n_q = q.shape[-2]
    e, _ = _expand_offsets(rel_k, n_q, n_k, q_offset, causal, clip_distance)  # [L, d]
    return skew(q @ e.t(), n_k, n_q - 1) if causal else skew_all_offsets(q @ e.t(), n_k)


def shaw_values(
    attn: Tensor,
    rel_v: Tensor,
    *,
    q_offset: int | None = None,
    causal: bool = False,
    clip_distance: int | None = None,
) -> Tensor:
    """``sum_j attn_ij r^V[clip(j - i - q_offset)]``: ``attn [..., n_q, n_k]`` -> ``[..., n_q, d]``.

    With ``causal`` the weights of keys ``j > i + q_offset`` are ignored (they are 0 after masking).
    """
    n_q, n_k = attn.shape[-2:]
    e, length = _expand_offsets(rel_v, n_q, n_k, q_offset, causal, clip_distance)  # [L, d]
    return (unskew(attn, length, n_q - 1) if causal else unskew_all_offsets(attn)) @ e


def _block_logits(q: Tensor, rel_k: Tensor, rel_v: Tensor, t0: int, n: int) -> Tensor:
    return shaw_logits(q, rel_k, n, q_offset=t0)


def _block_values(a: Tensor, rel_k: Tensor, rel_v: Tensor, t0: int, n: int) -> Tensor:
    return shaw_values(a, rel_v, q_offset=t0)


def shaw1d_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor,
    rel_v: Tensor,
    grid: Grid,
    num_prefix_tokens: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_queries: int | None = None,
) -> Tensor:
    """``shaw1d`` attention (raster order of the patches), ``q, k, v [B, h, N, d]``, tables ``[2K+1, d]``:
    ``A_ij = (q_i . k_j + q_i . r^K[clip(p_j - p_i)]) * scale + mask_ij``,
    ``out_i = sum_j softmax_j(A)_ij (v_j + r^V[clip(p_j - p_i)])`` (no relative terms for prefix pairs), the
    patch queries in blocks of ``block_queries`` (None: sized for the device,
    :func:`~vitrel.pos.shaw_base.query_blocks`), each a skew with the block's query offset (see
    :func:`~vitrel.pos.shaw_base.attend_query_blocks`). Under ``torch.export`` (any sizes) or in an ``fx`` trace
    there is one block.
    """
    p, n = num_prefix_tokens, grid.n
    blocks, record = query_spans(q, grid, p, block_queries)
    if blocks is None:  # one block: no Python arithmetic on the (maybe symbolic) sizes
        spans = [(p, q.shape[-2], (rel_k, rel_v, 0, n))]
    else:
        spans = [(p + t0, p + t1, (rel_k, rel_v, t0, n)) for t0, t1 in blocks]
    return attend_query_blocks(q, k, v, spans, _block_logits, _block_values, mask, scale, dropout_p, p, record)


@register_pos("shaw1d")
class Shaw1d(ShawScheme):
    """Shaw's relative keys and values on the raster order of the patches, tables shared by heads.

    ``A_ij = (q_i . k_j + q_i . r^K[clip(-d_ij)]) / sqrt(d)``, ``out_i = sum_j a_ij (v_j +
    r^V[clip(-d_ij)])``, ``d_ij = p_i - p_j``, ``p = row * W + col``, clipped at ``clip_distance`` (default: the built
    grid's ``H * W - 1``; offsets beyond the table get its edge embedding). ``attn_impl="shaw"`` runs
    :func:`shaw1d_attention` (blocks of ``block_queries`` queries; None: sized for the device);
    ``attn_impl="eager"`` the whole layer at once (the skew trick on ``[N, 2N - 1]``).
    """

    _rel_tables = {"rel_k": "1d", "rel_v": "1d"}
    depends_on_extent = True
    no_weight_decay_keys = ("rel_k", "rel_v")

    def __init__(
        self, *, clip_distance: int | None = None, init_std: float = 0.02, block_queries: int | None = None, **kw
    ) -> None:
        clip_distance = take_renamed(kw, "max_distance", "clip_distance", clip_distance, self.name)
        super().__init__(**kw)
        check_init_std(self.name, init_std)
        if clip_distance is None:
            clip_distance = self.grid.n - 1
        if clip_distance < 0:
            raise ValueError(f"clip_distance must be >= 0, got {clip_distance}")
        if block_queries is not None and block_queries < 1:
            raise ValueError(f"{self.name}: block_queries must be a positive number or None, got {block_queries}")
        self.block_queries = block_queries
        size = 2 * int(clip_distance) + 1
        self.rel_k = nn.Parameter(torch.zeros(size, self.head_dim))
        self.rel_v = nn.Parameter(torch.zeros(size, self.head_dim))
        nn.init.trunc_normal_(self.rel_k, std=init_std)
        nn.init.trunc_normal_(self.rel_v, std=init_std)

    @property
    def clip_distance(self) -> int:
        """``K`` of the current tables (they may have been resized on load)."""
        return (self.rel_k.shape[0] - 1) // 2

    def content_logits(self, q: Tensor, state: PosState) -> Tensor:
        grid, p = state.grid, state.num_prefix_tokens
        check_tokens(q.shape[-2], grid, p)
        s = shaw_logits(q[..., p:, :], self.rel_k, grid.n, q_offset=0)
        return pad_prefix(s, p)

    def content_values(self, attn: Tensor, state: PosState) -> Tensor:
        grid, p = state.grid, state.num_prefix_tokens
        check_tokens(attn.shape[-1], grid, p)
        out = shaw_values(attn[..., p:, p:], self.rel_v, q_offset=0)
        return F.pad(out, (0, 0, p, 0))

    def content_attention(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, grid: Grid, p: int, dropout_p: float
    ) -> Tensor:
        return shaw1d_attention(q, k, v, self.rel_k, self.rel_v, grid, p, mask, scale, dropout_p, self.block_queries)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, clip_distance={self.clip_distance}"
