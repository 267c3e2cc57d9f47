"""Shaw et al. (2018) content-aware relative keys and values on a 2-D grid: factored and full.

Per head (``d = head_dim``), with ``r^K_ij, r^V_ij in R^d`` shared by all heads (as in Shaw et al.
and MViTv2) and ``dh = row_i - row_j``, ``dw = col_i - col_j``::

    A_ij  = (q_i . k_j + q_i . r^K_ij) / sqrt(d) + mask_ij
    out_i = sum_j softmax_j(A)_ij (v_j + r^V_ij)

``shaw2d_factored`` (decomposed, as in MViTv2 / SAM)::

    r^K_ij = r^Kh[clip(dh)] + r^Kw[clip(dw)],    r^V_ij = r^Vh[clip(dh)] + r^Vw[clip(dw)]

``shaw2d_full``::

    r^K_ij = r^K[clip(dh), clip(dw)],            r^V_ij = r^V[clip(dh), clip(dw)]

``clip`` clamps an offset to ``[-K, K]`` (``clip_distance``; default the built grid's extent, i.e.
tables of ``2H-1`` / ``2W-1`` rows). Offsets beyond a table get its edge embedding (Shaw's
clipping), so the schemes run on any grid. Pairs that involve a prefix token get ``r^K = r^V = 0``.

Fast paths, never an ``N x N x d`` tensor:

* factored: ONE ``scaled_dot_product_attention`` call on augmented tensors (``N x N`` is never
  built either). With ``Rh[i, y] = q_i . r^Kh[clip(row_i - y)]`` and ``Rw[i, z]`` likewise::

      q' = [q, Rh, Rw],  k' = [k, onehot(row_j), onehot(col_j)],  v' = [v, onehot(row_j), onehot(col_j)]

  (each zero-padded to a head dim SDPA's fused kernels take, :func:`~vitrel.layout.heads.sdpa_width`),
  so ``q'_i . k'_j = q_i . k_j + q_i . r^K_ij``; the extra output channels are the attention mass
  per key row ``Ph[i, y]`` and per key column ``Pw[i, z]``, and
  ``out_i += sum_y Ph[i, y] r^Vh[clip(row_i - y)] + sum_z Pw[i, z] r^Vw[clip(col_i - z)]``.
* full (:func:`shaw2d_full_attention`): blocks of whole grid rows of queries, one at a time. Eagerly, for a
  block, ``QE = q_blk r^K_blk^T`` (``[c, R_blk]``, ``R_blk`` the table cells those rows reach) gathered
  to ``[c, N]``; values: ``P = scatter_add(attn_blk)`` over the same cells, then ``P r^V_blk``. Under
  ``torch.compile``, the skew trick along the columns instead: for query row ``y`` and key row ``r`` the
  table row ``clip(y - r)`` is fixed, so ``z[y, r, x, m] = q_(y,x) . r^K[clip(y - r), clip(-m)]`` over
  the ``2W - 1`` column offsets ``m`` (one product with the block's expanded tables ``[g, H, 2W-1, d]``)
  and :func:`~vitrel.pos.schemes.shaw1d.skew` moves offset ``m = c - x`` to key column ``c``; values:
  :func:`~vitrel.pos.schemes.shaw1d.unskew` sums the weights of each offset. In training each block is
  checkpointed (recomputed in backward), so no ``N x N`` tensor is kept: memory ``O(c N)`` of temporaries
  per head on top of ``O(N d)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, check_tokens, pad_prefix, patch_coords
from vitrel.layout.heads import sdpa_width
from vitrel.pos.base import PosState
from vitrel.pos.registry import register_pos
from vitrel.pos.shaw_base import ShawScheme, attend_query_blocks, query_spans, skew, unskew
from vitrel.pos.tables import check_init_std, offset_index, offset_rows, take_renamed

__all__ = [
    "gather_1d_table",
    "factored_rel_logits",
    "factored_content_logits",
    "factored_content_values",
    "shaw2d_factored_attention",
    "full_rel_index",
    "full_content_logits",
    "full_content_values",
    "shaw2d_full_attention",
    "Shaw2dFactored",
    "Shaw2dFull",
]


def _half(table: Tensor) -> int:
    return (table.shape[0] - 1) // 2


def _pad_rows(x: Tensor, p: int) -> Tensor:
    """Zero-pad ``[..., n, C]`` with ``p`` leading rows (prefix queries)."""
    return F.pad(x, (0, 0, p, 0)) if p else x


def _split_patches(x: Tensor, num_prefix_tokens: int, grid: Grid) -> Tensor:
    check_tokens(x.shape[-2], grid, num_prefix_tokens)
    return x[..., num_prefix_tokens:, :]


def gather_1d_table(table: Tensor, n: int) -> Tensor:
    """``table [2K+1, d]`` -> ``T [n, n, d]`` with ``T[a, b] = table[clip(a - b, -K, K)]``."""
    return table[offset_index(n, _half(table), table.device)]


# --------------------------------------------------------------------------------- factored
def factored_rel_logits(q_patch: Tensor, tkh: Tensor, tkw: Tensor, grid: Grid) -> tuple[Tensor, Tensor]:
    """``Rh [..., HW, H]``, ``Rw [..., HW, W]``: ``Rh[i, y] = q_i . tkh[row_i, y]``, ``Rw[i, z] = q_i . tkw[col_i, z]``.

    ``q_patch [B, h, HW, d]``; ``tkh [H, H, d]``, ``tkw [W, W, d]`` are the gathered tables.
    """
    b, nh, _, d = q_patch.shape
    qg = q_patch.reshape(b, nh, grid.h, grid.w, d)
    rh = torch.einsum("bnxwd,xyd->bnxwy", qg, tkh).reshape(b, nh, grid.n, grid.h)
    rw = torch.einsum("bnxwd,wzd->bnxwz", qg, tkw).reshape(b, nh, grid.n, grid.w)
    return rh, rw


def factored_values(ph: Tensor, pw: Tensor, tvh: Tensor, tvw: Tensor, grid: Grid) -> Tensor:
    """``sum_y ph[i, y] tvh[row_i, y] + sum_z pw[i, z] tvw[col_i, z]`` -> ``[B, h, HW, d]``."""
    b, nh = ph.shape[:2]
    ph = ph.reshape(b, nh, grid.h, grid.w, grid.h)
    pw = pw.reshape(b, nh, grid.h, grid.w, grid.w)
    out = torch.einsum("bnxwy,xyd->bnxwd", ph, tvh) + torch.einsum("bnxwz,wzd->bnxwd", pw, tvw)
    return out.reshape(b, nh, grid.n, -1)


def factored_content_logits(
    q: Tensor, rel_kh: Tensor, rel_kw: Tensor, grid: Grid, num_prefix_tokens: int = 0
) -> Tensor:
    """Unscaled ``q_i . (r^Kh[clip(dh)] + r^Kw[clip(dw)])`` -> ``[B, h, N, N]`` (eager path)."""
    qp = _split_patches(q, num_prefix_tokens, grid)
    rh, rw = factored_rel_logits(qp, gather_1d_table(rel_kh, grid.h), gather_1d_table(rel_kw, grid.w), grid)
    s = rh[..., :, None] + rw[..., None, :]  # [B, h, HW, H, W]
    return pad_prefix(s.flatten(-2), num_prefix_tokens)


def factored_content_values(
    attn: Tensor, rel_vh: Tensor, rel_vw: Tensor, grid: Grid, num_prefix_tokens: int = 0
) -> Tensor:
    """``sum_j attn_ij (r^Vh[clip(dh)] + r^Vw[clip(dw)])`` -> ``[B, h, N, d]`` from row/column sums."""
    p = num_prefix_tokens
    check_tokens(attn.shape[-1], grid, p)
    a = attn[..., p:, p:].unflatten(-1, (grid.h, grid.w))  # [B, h, HW, H, W]
    out = factored_values(a.sum(-1), a.sum(-2), gather_1d_table(rel_vh, grid.h), gather_1d_table(rel_vw, grid.w), grid)
    return _pad_rows(out, p)


def _onehot_keys(grid: Grid, num_prefix_tokens: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[N, H + W]``: ``[onehot(row_j), onehot(col_j)]`` for patch keys, zeros for prefix keys."""
    rows, cols = patch_coords(grid, device)
    ih, iw = torch.arange(grid.h, device=device), torch.arange(grid.w, device=device)
    oh = torch.cat([rows[:, None] == ih, cols[:, None] == iw], dim=-1).to(dtype)  # one-hot, any (symbolic) size
    return _pad_rows(oh, num_prefix_tokens)


def shaw2d_factored_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_kh: Tensor,
    rel_kw: Tensor,
    rel_vh: Tensor,
    rel_vw: Tensor,
    grid: Grid,
    num_prefix_tokens: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Factored Shaw attention in one SDPA call on augmented ``q', k', v'`` (see the module docstring).

    ``q, k, v [B, h, N, d]``, ``N = num_prefix_tokens + H W``; ``mask`` an additive float mask
    broadcastable to ``[B, h, N, N]`` or None; ``scale`` default ``d ** -0.5``; ``dropout_p``
    attention dropout (the value terms then see the dropped probabilities, as the eager path). Memory
    ``O(N (d + H + W))`` per head (with SDPA's flash kernel): no ``N x N`` and no ``N x N x d``.
    """
    b, nh, n, d = q.shape
    p = num_prefix_tokens
    check_tokens(n, grid, p)
    if scale is None:
        scale = d**-0.5
    tkh, tkw = gather_1d_table(rel_kh, grid.h), gather_1d_table(rel_kw, grid.w)
    rh, rw = factored_rel_logits(q[:, :, p:], tkh, tkw, grid)
    # zeros up to a head dim SDPA's fused kernels take (sdpa_width; they change no product)
    width = d + grid.h + grid.w
    pad = sdpa_width(width) - width if isinstance(width, int) else 0
    q2 = F.pad(torch.cat([q, _pad_rows(torch.cat([rh, rw], dim=-1), p)], dim=-1), (0, pad))
    oh = F.pad(_onehot_keys(grid, p, q.dtype, q.device), (0, pad)).expand(b, nh, n, grid.h + grid.w + pad)
    k2 = torch.cat([k, oh], dim=-1)
    v2 = torch.cat([v, oh], dim=-1)
    if mask is not None:
        mask = mask.to(q.dtype)
    o = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    out, ph, pw, _ = o.split([v.shape[-1], grid.h, grid.w, pad], dim=-1)
    rel = factored_values(
        ph[:, :, p:], pw[:, :, p:], gather_1d_table(rel_vh, grid.h), gather_1d_table(rel_vw, grid.w), grid
    )
    return out + _pad_rows(rel, p)


# ------------------------------------------------------------------------------------- full
def full_rel_index(grid: Grid, half_h: int, half_w: int, device: torch.device) -> tuple[Tensor, int, int]:
    """Index ``[HW, HW]`` into the used cells of a ``[2Kh+1, 2Kw+1]`` table, flattened.

    Only the offsets that occur on ``grid`` are used: rows ``Kh - eh .. Kh + eh`` with
    ``eh = min(Kh, H - 1)`` (same for columns). Returns ``(index, eh, ew)``; the used sub-table is
    ``table[Kh - eh : Kh + eh + 1, Kw - ew : Kw + ew + 1]`` flattened row-major.
    """
    eh, ew = min(half_h, grid.h - 1), min(half_w, grid.w - 1)
    ih = offset_index(grid.h, eh, device)  # [H, H] in [0, 2 eh]
    iw = offset_index(grid.w, ew, device)  # [W, W] in [0, 2 ew]
    idx = ih[:, None, :, None] * (2 * ew + 1) + iw[None, :, None, :]  # [H, W, H, W]
    return idx.reshape(grid.n, grid.n), eh, ew


def _used_cells(table: Tensor, eh: int, ew: int) -> Tensor:
    kh, kw = (table.shape[0] - 1) // 2, (table.shape[1] - 1) // 2
    return table[kh - eh : kh + eh + 1, kw - ew : kw + ew + 1].reshape(-1, table.shape[-1])  # [R, d]


def full_content_logits(q: Tensor, rel_k: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
    """Unscaled ``q_i . r^K[clip(dh), clip(dw)]`` -> ``[B, h, N, N]`` via ``[B, h, HW, R]`` and a gather."""
    qp = _split_patches(q, num_prefix_tokens, grid)
    idx, eh, ew = full_rel_index(grid, (rel_k.shape[0] - 1) // 2, (rel_k.shape[1] - 1) // 2, q.device)
    qe = qp @ _used_cells(rel_k, eh, ew).t()  # [B, h, HW, R]
    s = qe.gather(-1, idx.expand(*qe.shape[:-1], grid.n))
    return pad_prefix(s, num_prefix_tokens)


def full_content_values(attn: Tensor, rel_v: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
    """``sum_j attn_ij r^V[clip(dh), clip(dw)]`` -> ``[B, h, N, d]`` via ``scatter_add`` to ``[B, h, HW, R]``."""
    p = num_prefix_tokens
    check_tokens(attn.shape[-1], grid, p)
    a = attn[..., p:, p:]
    idx, eh, ew = full_rel_index(grid, (rel_v.shape[0] - 1) // 2, (rel_v.shape[1] - 1) // 2, attn.device)
    tv = _used_cells(rel_v, eh, ew)  # [R, d]
    pr = a.new_zeros(*a.shape[:-1], tv.shape[0]).scatter_add(-1, idx.expand_as(a), a)
    return _pad_rows(pr @ tv, p)


def _row_tables(table: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``table [2Kh+1, 2Kw+1, d]`` -> ``[g, H, 2W-1, d]``: for query row ``y`` (of ``g``) and key row ``r``,
    the table row ``rows[y, r]`` at the column of each key-minus-query column offset (``cols [2W-1]``)."""
    return table[rows].index_select(2, cols)


def _skew_logits(q: Tensor, rel_k: Tensor, rel_v: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``q [B, h, g W, d]`` (``g`` whole grid rows) -> ``q_i . r^K_ij`` ``[B, h, g W, H W]`` by the skew trick
    along the columns: ``z[y, r, x, m] = q_(y,x) . T[y, r, m]`` for the ``2W-1`` column offsets ``m``, then
    ``skew`` puts offset ``c - x`` of query column ``x`` at key column ``c`` (no gather of scores)."""
    t = _row_tables(rel_k, rows, cols)  # [g, H, 2W-1, d]
    g, nr, length, _ = t.shape
    w = (length + 1) // 2
    z = torch.einsum("bhgxd,grmd->bhgrxm", q.unflatten(-2, (g, w)), t)  # [B, h, g, H, W, 2W-1]
    s = skew(z, w, w - 1)  # [B, h, g, H, W (query column), W (key column)]
    return s.transpose(3, 4).reshape(*q.shape[:2], g * w, nr * w)


def _skew_values(a: Tensor, rel_k: Tensor, rel_v: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``a [B, h, g W, H W]`` -> ``sum_j a_ij r^V_ij`` ``[B, h, g W, d]``: ``unskew`` (the adjoint of the logits'
    skew) sums the weights of each column offset, then one product with the block's value tables."""
    t = _row_tables(rel_v, rows, cols)  # [g, H, 2W-1, d]
    g, nr, length, _ = t.shape
    w = (length + 1) // 2
    u = unskew(a.reshape(*a.shape[:2], g, w, nr, w).transpose(3, 4), length, w - 1)  # [B, h, g, H, W, 2W-1]
    return torch.einsum("bhgrxm,grmd->bhgxd", u, t).reshape(*a.shape[:2], g * w, -1)


def _cell_index(ih: Tensor, iw: Tensor, width: int) -> Tensor:
    """``[g W, H W]``: the cell (within the block's cells, ``width`` per table row) of each (query, key) pair
    from its row cells ``ih [g, H]`` and column cells ``iw [W, W]`` (built per block, inside the checkpoint:
    no index of every block is kept at once)."""
    return (ih[:, None, :, None] * width + iw[None, :, None, :]).reshape(ih.shape[0] * iw.shape[0], -1)


def _cell_logits(q: Tensor, tk: Tensor, tv: Tensor, cells: slice, ih: Tensor, iw: Tensor, width: int) -> Tensor:
    """``q [B, h, c, d]`` -> ``q_i . r^K_ij`` ``[B, h, c, HW]``: ``q tk[cells]^T`` over the table cells the block
    reaches, gathered by the cell of each (query, key) pair (:func:`_cell_index`). The cells are sliced here,
    inside the block's checkpoint, so that backward accumulates each block's table gradient as it goes."""
    qe = q @ tk[cells].t()  # [B, h, c, R_blk]
    idx = _cell_index(ih, iw, width)
    return qe.gather(-1, idx.expand(*qe.shape[:-1], idx.shape[-1]))


def _cell_values(a: Tensor, tk: Tensor, tv: Tensor, cells: slice, ih: Tensor, iw: Tensor, width: int) -> Tensor:
    """``a [B, h, c, HW]`` -> ``sum_j a_ij r^V_ij``: the weights summed per cell (``scatter_add``), times
    ``tv[cells]``."""
    tv = tv[cells]
    idx = _cell_index(ih, iw, width)
    pr = a.new_zeros(*a.shape[:-1], tv.shape[0]).scatter_add(-1, idx.expand_as(a), a)
    return pr @ tv


def _use_skew() -> bool:
    """The skew form of shaw2d_full's blocks under ``torch.compile``, the cells form eagerly (see
    :func:`shaw2d_full_attention`)."""
    return torch.compiler.is_compiling()


def shaw2d_full_attention(
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
    use_skew: bool | None = None,
) -> Tensor:
    """Full 2-D Shaw attention, ``q, k, v [B, h, N, d]``, tables ``[2Kh+1, 2Kw+1, d]``, by blocks of queries.

    ``A_ij = (q_i . k_j + q_i . r^K_ij) * scale + mask_ij``, ``out_i = sum_j softmax_j(A)_ij (v_j + r^V_ij)``
    (``r = 0`` for prefix pairs); ``mask`` an additive float mask broadcastable to ``[B, h, N, N]``.
    Patch queries in blocks of whole grid rows (``block_queries // W``, at least one; None: sized for the device by
    :func:`~vitrel.pos.shaw_base.query_blocks`), each checkpointed while gradients are recorded
    (:func:`~vitrel.pos.shaw_base.attend_query_blocks`), so no ``[N, N]`` tensor of the whole layer is kept, unless
    the whole layer fits the free memory of a CUDA device at once. A block's terms are computed in one of two exact
    ways (``use_skew``; None: skew under ``torch.compile``, cells eagerly, the faster of the two in each on CPU; see
    ``bench/results/attention_shaw_blocks_cpu.md``):

    * cells: ``q tk^T`` over the table cells the block reaches, gathered per pair; values by ``scatter_add``
      (:func:`_cell_logits`, :func:`_cell_values`);
    * skew: the skew trick along the columns (:func:`_skew_logits`, :func:`_skew_values`), no gather or
      scatter of scores (inductor compiles ``scatter_add`` into slow loops).

    Under ``torch.export`` (any sizes) or in an ``fx`` trace there is one block of cells.
    """
    p = num_prefix_tokens
    rows, record = query_spans(q, grid, p, block_queries, unit=grid.w)  # blocks of grid rows [y0, y1)
    one_block = rows is None
    kh, kw = (rel_k.shape[0] - 1) // 2, (rel_k.shape[1] - 1) // 2
    eh, ew = min(kh, grid.h - 1), min(kw, grid.w - 1)  # the offsets that occur on the grid
    skewed = not one_block and (_use_skew() if use_skew is None else use_skew)
    if skewed:  # table column of each key-minus-query column offset c - x = m - (W - 1): clip(x - c) + Kw
        cols = offset_rows(grid.w, kw, q.device).flip(0)
    else:
        tk, tv = _used_cells(rel_k, eh, ew), _used_cells(rel_v, eh, ew)
        iw = offset_index(grid.w, ew, q.device)  # [W, W]
        width = 2 * ew + 1  # cells per table row
    spans = []
    # one block: no Python arithmetic on the (maybe symbolic) sizes
    for y0, y1 in [(0, grid.h)] if one_block else rows:
        dy = torch.arange(y0, y1, device=q.device)[:, None] - torch.arange(grid.h, device=q.device)  # [g, H]
        if skewed:
            extra = (rel_k, rel_v, dy.clamp(-kh, kh) + kh, cols)
        else:
            # the table rows the block reaches: clip(y - row_j) + eh for y in [y0, y1), row_j in [0, H)
            lo = 0 if one_block else min(max(y0 - grid.h + 1, -eh), eh) + eh
            hi = 2 * eh if one_block else min(max(y1 - 1, -eh), eh) + eh
            # cell of (query, key) within the block's cells: rows clip(y - row_j) + eh - lo, columns as iw
            extra = (tk, tv, slice(lo * width, (hi + 1) * width), dy.clamp(-eh, eh) + (eh - lo), iw, width)
        spans.append((p + y0 * grid.w, p + y1 * grid.w, extra))
    rel = (_skew_logits, _skew_values) if skewed else (_cell_logits, _cell_values)
    return attend_query_blocks(q, k, v, spans, *rel, mask, scale, dropout_p, p, record)


# ----------------------------------------------------------------------------------- modules
def _halves(clip_distance: int | tuple[int, int] | None, grid: Grid) -> tuple[int, int]:
    if clip_distance is None:
        return grid.h - 1, grid.w - 1
    if isinstance(clip_distance, int):
        kh = kw = clip_distance
    else:
        kh, kw = (int(m) for m in clip_distance)
    if kh < 0 or kw < 0:
        raise ValueError(f"clip_distance must be >= 0, got {clip_distance}")
    return kh, kw


@register_pos("shaw2d_factored")
class Shaw2dFactored(ShawScheme):
    """Factored Shaw keys and values: ``r_ij = r_h[clip(dh)] + r_w[clip(dw)]``, tables shared by heads.

    ``clip_distance``: ``K`` (int, or ``(Kh, Kw)``) or None for the built grid's extent. ``forward``
    of :class:`~vitrel.layers.Attention` uses the single-SDPA fast path (:meth:`content_attention`, through
    ``attn_impl="shaw"``).
    """

    _rel_tables = {"rel_kh": "1d", "rel_kw": "1d", "rel_vh": "1d", "rel_vw": "1d"}
    no_weight_decay_keys = ("rel_kh", "rel_kw", "rel_vh", "rel_vw")

    def __init__(self, *, clip_distance: int | tuple[int, int] | None = None, init_std: float = 0.02, **kw) -> None:
        clip_distance = take_renamed(kw, "max_distance", "clip_distance", clip_distance, self.name)
        super().__init__(**kw)
        check_init_std(self.name, init_std)
        kh, kw_ = _halves(clip_distance, self.grid)
        d = self.head_dim
        self.rel_kh = nn.Parameter(torch.zeros(2 * kh + 1, d))
        self.rel_kw = nn.Parameter(torch.zeros(2 * kw_ + 1, d))
        self.rel_vh = nn.Parameter(torch.zeros(2 * kh + 1, d))
        self.rel_vw = nn.Parameter(torch.zeros(2 * kw_ + 1, d))
        for t in (self.rel_kh, self.rel_kw, self.rel_vh, self.rel_vw):
            nn.init.trunc_normal_(t, std=init_std)

    def content_logits(self, q: Tensor, state: PosState) -> Tensor:
        return factored_content_logits(q, self.rel_kh, self.rel_kw, state.grid, state.num_prefix_tokens)

    def content_values(self, attn: Tensor, state: PosState) -> Tensor:
        return factored_content_values(attn, self.rel_vh, self.rel_vw, state.grid, state.num_prefix_tokens)

    def content_attention(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, grid: Grid, p: int, dropout_p: float
    ) -> Tensor:
        return shaw2d_factored_attention(
            q, k, v, self.rel_kh, self.rel_kw, self.rel_vh, self.rel_vw, grid, p, mask, scale, dropout_p
        )

    @property
    def clip_distance(self) -> tuple[int, int]:
        """``(Kh, Kw)`` of the current tables (they may have been resized on load)."""
        return _half(self.rel_kh), _half(self.rel_kw)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, clip_distance={self.clip_distance}"


@register_pos("shaw2d_full")
class Shaw2dFull(ShawScheme):
    """Full 2-D Shaw keys and values: ``r_ij = r[clip(dh), clip(dw)]`` from ``[2Kh+1, 2Kw+1, d]`` tables.

    ``attn_impl="shaw"`` (``auto``) runs :func:`shaw2d_full_attention` (blocks of ``block_queries`` queries, whole
    grid rows; None: sized for the device, :func:`~vitrel.pos.shaw_base.query_blocks`), which keeps no ``N x N``
    tensor unless the whole layer fits a GPU's free memory; ``attn_impl="eager"`` the one-block eager path
    (``O(N R)`` memory per head, ``R`` the table cells used).
    """

    _rel_tables = {"rel_k": "2d", "rel_v": "2d"}
    no_weight_decay_keys = ("rel_k", "rel_v")

    def __init__(
        self,
        *,
        clip_distance: int | tuple[int, int] | None = None,
        init_std: float = 0.02,
        block_queries: int | None = None,
        **kw,
    ) -> None:
        clip_distance = take_renamed(kw, "max_distance", "clip_distance", clip_distance, self.name)
        super().__init__(**kw)
        check_init_std(self.name, init_std)
        kh, kw_ = _halves(clip_distance, self.grid)
        if block_queries is not None and block_queries < 1:
            raise ValueError(f"{self.name}: block_queries must be a positive number or None, got {block_queries}")
        self.block_queries = block_queries
        self.rel_k = nn.Parameter(torch.zeros(2 * kh + 1, 2 * kw_ + 1, self.head_dim))
        self.rel_v = nn.Parameter(torch.zeros(2 * kh + 1, 2 * kw_ + 1, self.head_dim))
        nn.init.trunc_normal_(self.rel_k, std=init_std)
        nn.init.trunc_normal_(self.rel_v, std=init_std)

    def content_logits(self, q: Tensor, state: PosState) -> Tensor:
        return full_content_logits(q, self.rel_k, state.grid, state.num_prefix_tokens)

    def content_values(self, attn: Tensor, state: PosState) -> Tensor:
        return full_content_values(attn, self.rel_v, state.grid, state.num_prefix_tokens)

    def content_attention(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, grid: Grid, p: int, dropout_p: float
    ) -> Tensor:
        return shaw2d_full_attention(
            q, k, v, self.rel_k, self.rel_v, grid, p, mask, scale, dropout_p, self.block_queries
        )

    @property
    def clip_distance(self) -> tuple[int, int]:
        """``(Kh, Kw)`` of the current tables (they may have been resized on load)."""
        return (self.rel_k.shape[0] - 1) // 2, (self.rel_k.shape[1] - 1) // 2

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, clip_distance={self.clip_distance}"
