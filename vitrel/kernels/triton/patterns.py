"""A full grid's bias tile patterns and the table gradient's reductions, on the host (device work, no host sync).

A full grid's bias repeats: a ``[tm, tw]`` tile's bias depends only on ``(q0 - k0, q0 mod W)``, so the kernels read
one tile per pattern (:func:`bias_tiles`). The table's gradient comes back as sums per pattern
(:func:`table_grad_from_tiles`) or per diagonal (:func:`table_grad_from_slots`), reduced in a fixed order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from vitrel.device_cache import per_device
from vitrel.kernels.triton.config import INTERPRETER, KernelConfig
from vitrel.kernels.triton.launch import Launch

if TYPE_CHECKING:
    from vitrel.layout.geometry import Grid

__all__ = [
    "FLAG_TILE", "STATS_ROWS", "TilePatterns", "bias_tiles", "dbias_order", "stats_len", "table_grad_from_slots",
    "table_grad_from_tiles", "tile_dtype", "tile_flags", "tile_lists", "tile_patterns", "triton_cdiv", "visible_tiles",
]  # fmt: skip

#: the per-token buffers' padding (the kernels' ``STATS_ROWS``) and the visible-tile flags' tile (``FLAG_TILE``)
STATS_ROWS = 128
FLAG_TILE = 16


class TilePatterns(NamedTuple):
    """How a full grid's ``[tm, tw]`` tiles of bias map to their distinct patterns (:func:`tile_patterns`): pattern
    ``((q0 - k0 - d_min) / g_d) n_m + (q0 mod W) / g_m`` of the tile of queries from ``q0`` and keys from ``k0``
    where ``n_m > 0``, else ``(q0 / tm) n_kt + k0 / tw`` (one per tile, where that is fewer). The kernels compute the
    same from these integers, with ``g_d`` and ``g_m`` (gcds of a power-of-two tile: powers of two) as compile-time
    constants, so their divisions are shifts (a grid width with another ``g_m`` compiles the kernels again)."""

    n_kt: int
    n_pat: int
    d_min: int
    g_d: int
    n_m: int
    g_m: int

    def index(self, q0: int, k0: int, tm: int, tw: int, grid_w: int) -> int:
        """The pattern of one tile."""
        if self.n_m > 0:
            return (q0 - k0 - self.d_min) // self.g_d * self.n_m + (q0 % grid_w) // self.g_m
        return q0 // tm * self.n_kt + k0 // tw

    def tiles(self, n: int, tm: int, tw: int, grid_w: int, causal: bool = False, device=None) -> Tensor:
        """``[n_pat]``: how many of the ``[tm, tw]`` tiles of ``n`` tokens are of each pattern, as the ``dbias``
        kernel's loop visits them (a block diagonal, the tiles of its phase; with ``causal``, none wholly above the
        diagonal): each ``dbias`` program's work. Computed on ``device`` (no copy to it, no host sync: a CUDA graph
        captures it)."""
        n_qt, pat = triton_cdiv(n, tm), torch.arange(self.n_pat, device=device)
        if self.n_m == 0:
            return (pat // self.n_kt * tm + tm > pat % self.n_kt * tw).long() if causal else torch.ones_like(pat)
        pat, qb = pat[:, None], torch.arange(n_qt, device=device)[None, :]
        delta = pat // self.n_m * self.g_d + self.d_min  # q0 - k0
        k0 = qb * tm - delta
        on = (k0 >= 0) & (k0 <= (self.n_kt - 1) * tw)
        on &= (qb * tm % grid_w) // self.g_m == pat % self.n_m
        if causal:
            on &= delta > -tm
        return on.sum(1)


def tile_patterns(grid_w: int, n: int, tm: int, tw: int) -> TilePatterns:
    """The bias patterns of a full grid's ``[tm, tw]`` tiles, from integers only (no device work, no host sync).

    Tokens ``t`` in raster order after ``P`` prefix tokens: shifting a tile's queries and keys by a multiple of the
    grid's width ``W`` shifts their rows alike and keeps their columns, so a tile's bias depends only on
    ``(q0 - k0, q0 mod W)``: ``q0 - k0`` a multiple of ``g_d = gcd(tm, tw)``, ``q0 mod W`` one of ``W / g_m`` values
    (``g_m = gcd(tm, W)``). About ``2 n / tw`` patterns where the width divides the tile (a 64 x 64 grid with
    64-token tiles: 127 patterns for 4,096 tiles); one per tile where that is fewer."""
    n_qt, n_kt = triton_cdiv(n, tm), triton_cdiv(n, tw)
    g_d, g_m = math.gcd(tm, tw), math.gcd(tm, grid_w)
    d_min = -(n_kt - 1) * tw
    n_d = ((n_qt - 1) * tm - d_min) // g_d + 1
    n_m = grid_w // g_m
    if n_d * n_m < n_qt * n_kt:
        return TilePatterns(n_kt, n_d * n_m, d_min, g_d, n_m, g_m)
    return TilePatterns(n_kt, n_qt * n_kt, 0, 1, 0, 1)


def _pattern_tokens(pat: TilePatterns, tm: int, tw: int, prefix: int, device) -> tuple[Tensor, Tensor]:
    """``[n_pat, tm]``, ``[n_pat, tw]``: the patch indices ``t - P`` of the queries and keys of a tile of each pattern
    (queries from ``m``, keys from ``m - d``; negative before the grid)."""
    i = torch.arange(pat.n_pat, device=device)
    if pat.n_m > 0:
        q0 = (i % pat.n_m) * pat.g_m
        k0 = q0 - (pat.d_min + (i // pat.n_m) * pat.g_d)
    else:
        q0, k0 = i // pat.n_kt * tm, i % pat.n_kt * tw
    pq = q0[:, None] + torch.arange(tm, device=device) - prefix
    return pq, k0[:, None] + torch.arange(tw, device=device) - prefix


def bias_tiles(table: Tensor, grid_h: int, grid_w: int, prefix: int, pat: TilePatterns, tm: int, tw: int) -> Tensor:
    """``[heads, n_pat, tm, tw]``: the bias tile of each pattern, which the kernels load whole (coalesced, like a key
    tile) instead of gathering each score from the table. A pattern ``(d, m)`` is computed at queries from ``m`` and
    keys from ``m - d`` with the coordinates extended past the grid's ends (``r = floor(p / W)``, ``c = p mod W``
    for every ``p = t - P``, negative too), so it equals the table at every patch pair of every tile of that pattern;
    the kernels zero the pairs with a prefix token and mask those past the end. Where each pattern is one tile
    (``n_m = 0``), the tile is exact instead: 0 at the pairs with a prefix token, ``-inf`` at the keys past the end,
    and the kernels read it with no mask. One gather from the table (and one ``where``) per call: the indices, made
    from integers only, are made once per shape and device (:func:`_tile_index`). Device work only (no host sync)."""
    index, keep, fill = _tile_index(pat, tm, tw, prefix, grid_h, grid_w, table.device)
    tiles = table.flatten(1)[:, index]
    return tiles if keep is None else torch.where(keep, tiles, fill)


@per_device(maxsize=16)
def _tile_index(pat: TilePatterns, tm: int, tw: int, prefix: int, grid_h: int, grid_w: int, device):
    """``(index, keep, fill)`` of :func:`bias_tiles`: each tile entry's flat index into the table
    ``[heads, (2 GH - 1) (2 GW - 1)]`` (offsets clamped: the pairs past the grid's ends, zeroed by the kernels), and
    where each pattern is one exact tile, which entries keep the table's value (patch pairs) and what the others take
    (``-inf`` at the keys past the end, else 0); None and None otherwise."""
    pq, pk = _pattern_tokens(pat, tm, tw, prefix, device)
    dh = pq.div(grid_w, rounding_mode="floor")[:, :, None] - pk.div(grid_w, rounding_mode="floor")[:, None, :]
    dw = pq.remainder(grid_w)[:, :, None] - pk.remainder(grid_w)[:, None, :]
    dh = (dh + grid_h - 1).clamp(0, 2 * grid_h - 2)
    dw = (dw + grid_w - 1).clamp(0, 2 * grid_w - 2)
    index = (dh * (2 * grid_w - 1) + dw).int()  # (int32: the cache holds a few MB per shape at N = 4097)
    if pat.n_m > 0:
        return index, None, None
    past = (pk >= grid_h * grid_w)[:, None, :].expand(index.shape)
    keep = _pattern_pairs(pq, pk, grid_h * grid_w) & ~past
    fill = torch.zeros(index.shape, device=device).masked_fill(past, float("-inf"))
    return index, keep, fill


def _pattern_pairs(pq: Tensor, pk: Tensor, n_patch: int) -> Tensor:
    """``[n_pat, tm, tw]``: the patch pairs of the tiles of each pattern (of its one tile, where ``n_m = 0``)."""
    return ((pq >= 0) & (pq < n_patch))[:, :, None] & ((pk >= 0) & (pk < n_patch))[:, None, :]


def tile_dtype(dtype: torch.dtype) -> torch.dtype:
    """The bias tiles' element type for inputs of ``dtype``: the inputs' own in half precision (as SDPA takes its
    float mask), else float32; the kernels add them to float32 logits."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def stats_len(n: int) -> int:
    """The padded length of the per-token buffers of ``n`` tokens (the forward's log-sum-exp, the backward's ``D``,
    a layout's tokens): a multiple of the kernels' ``STATS_ROWS``, so the kernels read them with no mask."""
    rows = STATS_ROWS
    return (n + rows - 1) // rows * rows


def dbias_order(tiles: Tensor, heads: int, n_split: int) -> Tensor:
    """The ``dbias`` kernel's programs ``(pattern, head, share)``, as ``(pattern H + head) n_split + share`` (int32),
    in the order they launch: the patterns with the most tiles first (a grid's central block diagonals; ``tiles``:
    :meth:`TilePatterns.tiles`), so the short ones fill in behind them rather than the longest starting last (CUDA
    starts a grid's programs in the order of their index). Any order gives the same sums."""
    pat = torch.sort(tiles, descending=True, stable=True).indices
    heads_, shares = torch.arange(heads, device=tiles.device), torch.arange(n_split, device=tiles.device)
    idx = (pat[:, None, None] * heads + heads_[:, None]) * n_split + shares
    return idx.flatten().to(torch.int32)


@per_device(maxsize=64)
def _dbias_order(
    pat: TilePatterns, n: int, tm: int, tw: int, grid_w: int, causal: bool, heads: int, n_split: int, device
) -> Tensor:
    """:func:`dbias_order` of a call's patterns, made once per shape and device (integers only)."""
    return dbias_order(pat.tiles(n, tm, tw, grid_w, causal, device), heads, n_split)


def table_grad_from_slots(slots: Tensor, grid_h: int, grid_w: int, blk: int) -> Tensor:
    """``dT [heads, 2 GH - 1, 2 GW - 1]`` from the ``dq`` kernel's slots ``[n_split, heads, n_qb, n_kb, 2, 2 blk]``.

    Slot ``(qb, kb, case, e)`` holds the sum of ``dS`` over the tile's pairs with
    ``i - j = (qb - kb) blk + e - blk + 1`` (``case`` 0: ``dw >= 0``, 1: ``dw < 0``). Summed over the batch shares
    and over the tiles of one block diagonal ``qb - kb`` (:func:`_per_diagonal`), then laid out by offset
    (:func:`_table_from_diagonals`). Plain tensor sums in a fixed order: deterministic."""
    d_min = -(slots.shape[3] - 1) * blk
    return _table_from_diagonals(_per_diagonal(slots.sum(0), blk, blk), grid_h, grid_w, blk, d_min, blk)


def _per_diagonal(s: Tensor, tm: int, tw: int) -> Tensor:
    """``[heads, n_diag, 2, L]``: the sums ``s [heads, n_qb, n_kb, 2, L]`` of each ``[tm, tw]`` tile summed over the
    tiles of each block diagonal ``q0 - k0 = qb tm - kb tw`` (``tw`` divides ``tm``), from ``-(n_kb - 1) tw`` in
    steps of ``tw`` (:func:`_block_diagonals`)."""
    n_qb, n_kb = s.shape[1:3]
    qb, kb, inside = _block_diagonals(n_qb, n_kb, tm // tw, s.device)
    return (s[:, qb, kb] * inside).sum(1)


@per_device(maxsize=32)
def _block_diagonals(n_qb: int, n_kb: int, ratio: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """``(qb [n_qb, 1], kb [n_qb, n_diag], inside [n_qb, n_diag, 1, 1])`` of :func:`_per_diagonal`: the key tile of
    each query tile (``ratio`` key tiles tall) on each block diagonal ``t``, ``q0 - k0 = (t - n_kb + 1) tw``
    (clamped), and whether it exists. Made once per shape and device (integers only)."""
    qb = torch.arange(n_qb, device=device)[:, None]
    kb = ratio * qb - torch.arange(-(n_kb - 1), ratio * (n_qb - 1) + 1, device=device)[None, :]
    inside = (kb >= 0) & (kb < n_kb)
    return qb, kb.clamp(0, n_kb - 1), inside[:, :, None, None].float()


def _table_from_diagonals(per_diag: Tensor, grid_h: int, grid_w: int, step: int, d_min: int, tw: int) -> Tensor:
    """``dT`` from the sums of ``dS`` per block diagonal ``q0 - k0 = d_min + t step`` (``t`` from 0) of ``[tm, tw]``
    tiles, case and ``e`` (``[heads, n_diag, 2, L]``, ``L = tm + tw`` a multiple of ``step``; ``e = i - j + tw - 1``
    within a tile, as the ``dq`` kernel's slots hold them): each diagonal's ``L`` sums laid at its offset (``L / step``
    chunks, overlapping the next diagonals'), giving ``G[case, i - j]``; ``dT[dh, dw] = G[dw < 0, dh GW + dw]``."""
    heads, n_diag, _, length = per_diag.shape
    chunks = length // step
    ext = per_diag.new_zeros(heads, n_diag + chunks - 1, 2, step)
    for c in range(chunks):
        ext[:, c : c + n_diag] += per_diag[..., c * step : (c + 1) * step]
    ext = ext.permute(0, 2, 1, 3).reshape(heads, 2, (n_diag + chunks - 1) * step)  # index y = t step + e
    case, y = _offset_slots(grid_h, grid_w, tw - 1 - d_min, per_diag.device)
    return ext[:, case, y]


@per_device(maxsize=32)
def _offset_slots(grid_h: int, grid_w: int, shift: int, device) -> tuple[Tensor, Tensor]:
    """``(case, y)`` ``[2 GH - 1, 2 GW - 1]`` of :func:`_table_from_diagonals`: the case ``dw < 0`` of each table offset
    and its flat offset ``dh GW + dw`` plus ``shift`` (made once per shape and device: integers only)."""
    dh = torch.arange(-(grid_h - 1), grid_h, device=device)[:, None]
    dw = torch.arange(-(grid_w - 1), grid_w, device=device)[None, :]
    y = dh * grid_w + dw + shift
    return (dw < 0).long().expand_as(y), y


def table_grad_from_tiles(
    dbt: Tensor, pat: TilePatterns, grid_h: int, grid_w: int, prefix: int, config: KernelConfig = INTERPRETER
) -> Tensor:
    """``dT [heads, 2 GH - 1, 2 GW - 1]`` (float32) from the gradient of the bias tiles, the ``dbias`` kernel's sums of
    ``dS`` per pattern ``dbt [n_split, heads, n_pat, tm, tw]`` over its batch shares (zero off the patch pairs): the
    adjoint of :func:`bias_tiles`, summed over the shares. Each tile entry adds to the table entry it was gathered
    from (where each pattern is one exact tile, its patch pairs only), in one launch of
    the ``table_grad`` kernel (:mod:`vitrel.kernels.triton._sums`) that sums each table entry's tile entries in a
    fixed order (:func:`_table_grad_index`): deterministic. ``dbt`` may be the transpose of its last two axes' storage
    (the ``dkdv`` kernel's sums, keys by queries): read as stored, through an index made for it, with no copy."""
    n_split, heads, n_pat, tm, tw = dbt.shape
    transposed = not dbt.is_contiguous() and dbt.transpose(-1, -2).is_contiguous()
    src, ptr = _table_grad_index(pat, tm, tw, prefix, grid_h, grid_w, transposed, dbt.device)
    n_t = (2 * grid_h - 1) * (2 * grid_w - 1)
    dt = torch.empty(heads, 2 * grid_h - 1, 2 * grid_w - 1, device=dbt.device, dtype=torch.float32)
    block = config.table_grad_block
    stored = dbt.transpose(-1, -2) if transposed else dbt.contiguous()
    Launch.make(
        "table_grad", (triton_cdiv(n_t, block), heads), [stored, src, ptr, dt, heads, n_pat * tm * tw, n_t, n_split],
        dict(BLOCK=block), config.table_grad.options(),
    )()  # fmt: skip
    return dt


@per_device(maxsize=16)
def _table_grad_index(
    pat: TilePatterns, tm: int, tw: int, prefix: int, grid_h: int, grid_w: int, transposed: bool, device
):
    """``(src, ptr)`` int32 of :func:`table_grad_from_tiles`: the flat tile entries ``[n_pat tm tw]`` (``[n_pat tw
    tm]`` where ``transposed``: as stored) sorted by the table entry each was gathered from (:func:`_tile_index`;
    stable: in the tiles' order), and where each table entry's run starts (``[T + 1]``); entries that add to no table
    entry (where each pattern is one exact tile, its pairs with a prefix token or past the end) sort last, past
    ``ptr[T]``. Device work only (no host sync: a sort and a search)."""
    index, keep, _ = _tile_index(pat, tm, tw, prefix, grid_h, grid_w, device)
    if transposed:
        index, keep = index.transpose(-1, -2), None if keep is None else keep.transpose(-1, -2)
    n_t = (2 * grid_h - 1) * (2 * grid_w - 1)
    target = index.flatten().long()
    if keep is not None:  # (its patch pairs: keep's)
        target = torch.where(keep.flatten(), target, n_t)
    key, order = torch.sort(target, stable=True)
    ptr = torch.searchsorted(key, torch.arange(n_t + 1, device=device))
    return order.to(torch.int32), ptr.to(torch.int32)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_lists(flags: Tensor | None) -> Tensor | None:
    """``[heads, rows, 1 + cols]`` int32 of tile flags ``[heads, rows, cols]`` (:func:`tile_flags`): each row's count of
    visible tiles, then their indices in order, which a kernel loops over with no branch to skip a tile."""
    if flags is None:
        return None
    order = torch.sort((flags == 0).int(), dim=-1, stable=True).indices  # the visible tiles first, in order
    return torch.cat([flags.sum(-1, keepdim=True), order], -1).to(torch.int32).contiguous()


def tile_flags(blocks: Tensor | None, tm: int, tw: int, causal: bool = False) -> Tensor | None:
    """The visible-tile flags ``[heads, n, n]`` of 16-token blocks (:func:`visible_tiles`) pooled to the kernel's
    ``[tm, tw]`` tiles, ``[heads, cdiv(N, tm), cdiv(N, tw)]``: 1 where a block of the tile is, and (``causal``) the
    tile is not above the diagonal."""
    if blocks is None:
        return None
    f = FLAG_TILE
    fm, fw = tm // f, tw // f
    heads, n, _ = blocks.shape
    rows, cols = triton_cdiv(n, fm), triton_cdiv(n, fw)
    padded = torch.nn.functional.pad(blocks, (0, cols * fw - n, 0, rows * fm - n))
    flags = padded.view(heads, rows, fm, cols, fw).amax((2, 4))
    if causal:  # a tile whose first key is after its last query holds no visible pair
        qt, kt = torch.arange(rows, device=flags.device), torch.arange(cols, device=flags.device)
        flags = flags * (kt[None, :] * tw <= qt[:, None] * tm + tm - 1)
    return flags.contiguous()


def visible_tiles(table: Tensor, grid: Grid, num_prefix_tokens: int = 0, chunk: int = 1024) -> Tensor:
    """``[heads, n, n]`` int32 flags of a table with ``-inf`` entries (LookHere's views), ``n = ceil(N / 16)``:
    1 where some pair of query tile ``i`` and key tile ``j`` (16 tokens each) is visible (a finite entry, or a pair
    with a prefix token), so the kernels skip the ``[BM, BN]`` tiles whose flags are all 0. Computed from the
    table exactly, ``chunk`` query rows at a time (no ``N x N`` tensor per head at once; all at once where the grid is
    symbolic, ``torch.export``'s dynamic sizes, which a loop over chunks would pin to the example's size)."""
    tile = FLAG_TILE
    finite = torch.isfinite(table)
    heads, p = table.shape[0], num_prefix_tokens
    n_flag = triton_cdiv(p + grid.n, tile)
    size = n_flag * tile
    t = torch.arange(size, device=table.device) - p
    patch, real = (t >= 0) & (t < grid.n), t < grid.n  # (tokens past the end: in no pair)
    r, c = t.clamp(0, grid.n - 1) // grid.w, t.clamp(0, grid.n - 1) % grid.w
    chunk = chunk - chunk % tile if isinstance(size, int) else size
    out = []
    for s in range(0, size, chunk) if isinstance(size, int) else [0]:
        rq, cq, pq, tq = r[s : s + chunk, None], c[s : s + chunk, None], patch[s : s + chunk, None], real[s : s + chunk]
        seen = finite[:, rq - r[None, :] + grid.h - 1, cq - c[None, :] + grid.w - 1] | ~(pq & patch[None, :])
        seen &= tq[:, None] & real[None, :]
        out.append(seen.view(heads, -1, tile, n_flag, tile).any(4).any(2))
    return torch.cat(out, 1).to(torch.int32)
