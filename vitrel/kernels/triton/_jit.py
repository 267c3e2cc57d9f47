"""Pieces the fused kernels share: token coordinates, tile loops and reads, and the logits of a tile.

A tile's logits come from :func:`_logits`, the one place the bias (gathered from the table ``T`` or read whole from
the bias tiles ``BT``), a float mask or the windows' regions, a token layout's images and the causal mask apply, in
base 2 (``LOG2E`` folded in). Inputs: q and k share the strides ``sq`` (a tuple: batch, head, token; the head dim's
is 1), v has ``sv``, do ``sdo``; the outputs (o, dq, dk, dv) are contiguous ``[B, H, N, D]``; the table is
contiguous ``[G, H, 2 GH - 1, 2 GW - 1]``. The kernels take the grid as ``geo = (P, GH, GW)`` (prefix tokens, rows,
columns) and the bias tiles' patterns as ``patterns = (n_pat, d_min, n_m)`` with ``g_d``, ``g_m`` compile-time constants
(:class:`~vitrel.kernels.triton.patterns.TilePatterns`).
"""

from __future__ import annotations

# the kernels' long argument lists stay packed (ruff format would put one per line)
# fmt: off
import triton
import triton.language as tl

from vitrel.kernels.triton import patterns

LOG2E = 1.4426950408889634

#: the per-token buffers (log-sum-exp, ``D``, a layout's tokens, region ids) are padded to a multiple of it
STATS_ROWS = tl.constexpr(patterns.STATS_ROWS)


@triton.jit
def _stats_len(N):
    """``NP``, the padded length of the per-token buffers of ``N`` tokens."""
    return tl.cdiv(N, STATS_ROWS) * STATS_ROWS


@triton.jit
def _tokens(TOK, b, offs, P, N, GW, LAYOUT: tl.constexpr):
    """Patch flags, rows, columns, segments and groups of tokens ``offs``: from their indices on a full grid, or read
    from ``TOK [B, 4, NP]`` on a token layout (rows -1: prefix and padding tokens)."""
    inside = offs < N
    if LAYOUT:
        NP = _stats_len(N)
        base = TOK + b * 4 * NP
        r = tl.load(base + NP + offs)
        patch = r >= 0
        c = tl.load(base + 2 * NP + offs)
        return patch, tl.where(patch, r, 0), c, tl.load(base + offs), tl.load(base + 3 * NP + offs)
    p = offs - P
    patch = (p >= 0) & inside
    p = tl.where(patch, p, 0)
    zero = tl.zeros_like(offs)
    return patch, p // GW, p % GW, zero, zero


@triton.jit
def _span(TOK, b, offs, N, LAYOUT: tl.constexpr):
    """The smallest and largest segment of tokens ``offs`` on a layout; ``(0, 0)`` on a full grid."""
    if LAYOUT:
        inside = offs < N
        seg = tl.load(TOK + b * 4 * _stats_len(N) + offs)
        return tl.min(tl.where(inside, seg, 1 << 30)), tl.max(tl.where(inside, seg, -(1 << 30)))
    return 0, 0


@triton.jit
def _visits(
    TOK, BLK, b, h, offs, lo, hi, q0, k0, N,
    BQ: tl.constexpr, BK: tl.constexpr, LAYOUT: tl.constexpr, HAS_BLOCKS: tl.constexpr,
):
    """Whether the ``[BQ, BK]`` tile at ``(q0, k0)`` can hold a visible pair: on a layout, whether keys ``offs`` can
    share an image with segments ``[lo, hi]``; with ``BLK`` (tile flags) the tile's flag; else always."""
    if LAYOUT:
        klo, khi = _span(TOK, b, offs, N, LAYOUT)
        return (klo <= hi) & (khi >= lo)
    if HAS_BLOCKS:
        return tl.load(BLK + (h * tl.cdiv(N, BQ) + q0 // BQ) * tl.cdiv(N, BK) + k0 // BK) > 0
    return True


@triton.jit
def _tile_loop(BLK, h, tile, n_tiles, n_other, lo, hi, HAS_BLOCKS: tl.constexpr):
    """``(row, first, last)`` of a loop over the other axis's tiles: over a row of the tile lists ``BLK [heads,
    n_tiles, 1 + n_other]`` (a count, then the visible tiles) with ``HAS_BLOCKS``, else over tokens ``[lo, hi)``."""
    if HAS_BLOCKS:
        row = BLK + (h * n_tiles + tile) * (n_other + 1)
        return row, 0, tl.load(row)
    return BLK, lo, hi


@triton.jit
def _tile_start(row, j, STEP: tl.constexpr, HAS_BLOCKS: tl.constexpr):
    """The first token of the loop's tile ``j`` (an entry of the list, or the token itself)."""
    if HAS_BLOCKS:
        return tl.load(row + 1 + j) * STEP
    return j


@triton.jit
def _tile(ptr, b, h, st, offs, offs_d, mask):
    """The rows ``offs`` of a ``[B, H, N, D]`` tensor of strides ``st`` at batch ``b``, head ``h`` (zeros outside
    ``mask``)."""
    return tl.load(ptr + b * st[0] + h * st[1] + offs[:, None] * st[2] + offs_d[None, :], mask, 0.0)


@triton.jit
def _tile_t(ptr, b, h, st, offs, offs_d, mask):
    """:func:`_tile` transposed, ``[BLOCK_D, rows]`` (``mask`` of that shape)."""
    return tl.load(ptr + b * st[0] + h * st[1] + offs[None, :] * st[2] + offs_d[:, None], mask, 0.0)


@triton.jit
def _out(ptr, b, h, H, N, offs, offs_d, D: tl.constexpr):
    """The addresses of rows ``offs`` of a contiguous ``[B, H, N, D]`` output at batch ``b``, head ``h``."""
    return ptr + ((b * H + h) * N + offs[:, None]) * D + offs_d[None, :]


@triton.jit
def _block_lanes(N, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, D):
    """The token indices of block ``program_id(0)``, the head-dim lanes and the mask of real rows and lanes."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    return offs, offs_d, (offs < N)[:, None] & (offs_d < D)[None, :]


@triton.jit
def _program(H, N, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, D):
    """A ``(blocks, B * H)`` grid's program: batch, head, ``b * H + h``, its tokens, lanes and mask."""
    bh = tl.program_id(1)
    offs, offs_d, mask = _block_lanes(N, BLOCK, BLOCK_D, D)
    return bh // H, bh % H, bh, offs, offs_d, mask


@triton.jit
def _tile_program(N, BM: tl.constexpr, BLOCK_D: tl.constexpr, D):
    """A one-tile kernel's program ``(split, h)``: share, head, lanes, lane mask, rows read and the store mask."""
    offs = tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    return tl.program_id(0), tl.program_id(1), offs, offs_d, dmask, _rows(offs, N), (offs < N)[:, None] & dmask[None, :]


@triton.jit
def _rows(offs, N):
    """Token indices clamped to the last token: loop tiles read with no row mask (no result takes those rows)."""
    return tl.minimum(offs, N - 1)


@triton.jit
def _kv(K, V, b, h, sq, sv, offs_n, offs_d, N, D):
    """The key and value rows ``offs_n`` of batch ``b``, head ``h`` (past the end: the last row)."""
    rows = _rows(offs_n, N)
    dmask = (offs_d < D)[None, :]
    return _tile(K, b, h, sq, rows, offs_d, dmask), _tile(V, b, h, sv, rows, offs_d, dmask)


@triton.jit
def _row_stats(LSE, DELTA, bh, N, offs):
    """The log-sum-exp and ``D = rowsum(o * do)`` of query rows ``offs``, read with no mask (padded buffers)."""
    tl.static_assert(STATS_ROWS % offs.shape[0] == 0, "a query tile must divide STATS_ROWS")
    row = bh * _stats_len(N)
    return tl.load(LSE + row + offs), tl.load(DELTA + row + offs)


@triton.jit
def _q_axis(x, TRANS: tl.constexpr):
    """A vector over the tile's queries as its query axis (``TRANS``: a tile of keys by queries)."""
    if TRANS:  # (one return: Triton checks every return's type)
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def _k_axis(x, TRANS: tl.constexpr):
    """A vector over the tile's keys as its key axis."""
    if TRANS:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit
def _mask_row(MASK, b, n_mask_b, N, MASK_KIND: tl.constexpr):
    """Batch ``b``'s row of ``MASK``: a float mask ``[Mb, N, N]`` (kind 1) or region ids ``[Mb, NP]`` (kind 2)."""
    if MASK_KIND == 1:
        row = MASK + (b % n_mask_b) * N * N
    else:
        row = MASK + (b % n_mask_b) * _stats_len(N)
    return row


@triton.jit
def _bias_tile(
    BT, h, q0, k0, N, GW, n_pat, d_min, g_d: tl.constexpr, n_m, g_m: tl.constexpr,
    HAS_TABLE: tl.constexpr, TILED: tl.constexpr, TM: tl.constexpr, TW: tl.constexpr, PAIRS: tl.constexpr = False,
):
    """The ``[TM, TW]`` bias tile at ``(q0, k0)`` read whole from the bias tiles ``BT [heads, n_pat, TM, TW]`` by its
    pattern; 0.0 where the bias is not read as tiles. ``PAIRS``: bf16 tiles read as 32-bit words, widened by hand."""
    bias = 0.0
    if HAS_TABLE and TILED:
        col = 0
        if n_m > 1:
            col = (q0 % GW) // g_m
        pat = _pattern_index(q0, k0, col, tl.cdiv(N, TW), d_min, g_d, n_m, TM, TW)
        bias = _pattern_tile(BT, h, pat, n_pat, TM, TW, PAIRS)
    return bias


@triton.jit
def _pattern_index(q0, k0, col, n_kt, d_min, g_d: tl.constexpr, n_m, TM: tl.constexpr, TW: tl.constexpr):
    """The pattern of the tile at ``(q0, k0)``: from ``(q0 - k0, col)`` where ``n_m > 0``, else its place."""
    return tl.where(n_m > 0, ((q0 - k0 - d_min) // g_d) * n_m + col, (q0 // TM) * n_kt + k0 // TW)


@triton.jit
def _pattern_tile(BT, h, pat, n_pat, TM: tl.constexpr, TW: tl.constexpr, PAIRS: tl.constexpr):
    """The bias tile of pattern ``pat``: in the tiles' type, or with ``PAIRS`` float32."""
    if PAIRS and BT.dtype.element_ty == tl.bfloat16:
        HW: tl.constexpr = TW // 2
        local = tl.arange(0, TM)[:, None] * HW + tl.arange(0, HW)[None, :]
        x = tl.load(BT.to(tl.pointer_type(tl.int32)) + (h * n_pat + pat) * (TM * HW) + local)
        bias = tl.join((x << 16).to(tl.float32, bitcast=True), (x & -65536).to(tl.float32, bitcast=True))
        bias = bias.reshape(TM, TW)  # (entry 2c in a word's low half, 2c + 1 in its high half)
    else:
        local = tl.arange(0, TM)[:, None] * TW + tl.arange(0, TW)[None, :]
        bias = tl.load(BT + (h * n_pat + pat) * (TM * TW) + local)
    return bias


@triton.jit
def _logits(
    q, k, b, h, offs_m, offs_n, T, MASK, n_mask_b, TOK, qk_scale, H, P, N, GH, GW, bias, n_m, q0, k0,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr, PREC: tl.constexpr,
    TILED: tl.constexpr, TM: tl.constexpr, TW: tl.constexpr, TRANS: tl.constexpr = False, RAW: tl.constexpr = False,
):
    """Base-2 logits of the ``[TM, TW]`` tile at ``(q0, k0)``, ``-inf`` where masked, and its patch-pair flags.

    The bias is gathered per score from ``T``, or is ``bias`` (:func:`_bias_tile`) with ``TILED``. ``MASK_KIND``: 0
    none, 1 a float mask, 2 region ids. A tile with nothing to mask takes a branch with no mask. ``TRANS``: keys by
    queries (``q`` given as ``q^T``). ``RAW`` (no table, no float mask, a positive scale): the logits come unscaled,
    scaled by :func:`_shift` as the softmax subtracts.
    """
    if TRANS:
        s = tl.dot(k, q, input_precision=PREC)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if not RAW:
        s = s * qk_scale
    if (TILED or not HAS_TABLE) and MASK_KIND != 1 and not CAUSAL and not LAYOUT:
        if HAS_TABLE:
            interior = (n_m == 0) | ((q0 >= P) & (k0 >= P) & (q0 + TM <= N) & (k0 + TW <= N))
        else:  # (no bias: only the keys past the end are masked)
            interior = k0 + TW <= N
        if MASK_KIND == 2:  # a window whose tokens in this tile are of one region
            rptr = _mask_row(MASK, b, n_mask_b, N, MASK_KIND)
            rq = tl.load(rptr + offs_m)
            rk = tl.load(rptr + offs_n)
            lo = tl.minimum(tl.min(tl.where(offs_m < N, rq, 1 << 30)), tl.min(tl.where(offs_n < N, rk, 1 << 30)))
            hi = tl.maximum(tl.max(tl.where(offs_m < N, rq, -1)), tl.max(tl.where(offs_n < N, rk, -1)))
            interior = interior & (lo == hi)
    else:
        interior = False
    if interior:
        if TRANS:
            pair = tl.full([TW, TM], 1, tl.int1)
        else:
            pair = tl.full([TM, TW], 1, tl.int1)
        if HAS_TABLE:  # (not a 0.0 added: x + 0.0 is not folded)
            s = s + bias
    else:
        s, pair = _masked(
            s, bias, b, h, offs_m, offs_n, T, MASK, n_mask_b, TOK, H, P, N, GH, GW,
            HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, TILED, TRANS,
        )
    return s, pair


@triton.jit
def _shift(s, m, qk_scale, RAW: tl.constexpr):
    """``s - m`` for the softmax; with ``RAW`` the logits come unscaled: ``s qk_scale - m``, one FFMA."""
    if RAW:
        x = s * qk_scale - m
    else:
        x = s - m
    return x


@triton.jit
def _masked(
    s, bias, b, h, offs_m, offs_n, T, MASK, n_mask_b, TOK, H, P, N, GH, GW,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    TILED: tl.constexpr, TRANS: tl.constexpr,
):
    """:func:`_logits` of a tile with masks: the bias on the patch pairs, ``-inf`` where masked."""
    qpatch, rq, cq, sq, gq = _tokens(TOK, b, offs_m, P, N, GW, LAYOUT)
    kpatch, rk, ck, sk, _ = _tokens(TOK, b, offs_n, P, N, GW, LAYOUT)
    same = _q_axis(sq, TRANS) == _k_axis(sk, TRANS)
    pair = _q_axis(qpatch, TRANS) & _k_axis(kpatch, TRANS) & same
    if HAS_TABLE:
        if TILED:
            s += tl.where(pair, bias, 0.0)
        else:  # T pre-scaled by LOG2E; the flat offset index is a row term minus a column term
            row = T + (gq * H + h) * ((2 * GH - 1) * (2 * GW - 1)) + (rq + GH - 1) * (2 * GW - 1) + cq + GW - 1
            s += tl.load(_q_axis(row, TRANS) - _k_axis(rk * (2 * GW - 1) + ck, TRANS), mask=pair, other=0.0)
    inside = _q_axis(offs_m < N, TRANS) & _k_axis(offs_n < N, TRANS)
    if MASK_KIND == 1:
        mptr = _mask_row(MASK, b, n_mask_b, N, MASK_KIND) + _q_axis(offs_m, TRANS) * N + _k_axis(offs_n, TRANS)
        s += tl.load(mptr, mask=inside, other=0.0)
    valid = inside | _q_axis(offs_m >= N, TRANS)  # (queries past the end: harmless)
    if MASK_KIND == 2:
        rptr = _mask_row(MASK, b, n_mask_b, N, MASK_KIND)
        rq = tl.load(rptr + offs_m)
        valid = valid & (_q_axis(rq, TRANS) == _k_axis(tl.load(rptr + offs_n), TRANS))
    if LAYOUT:
        valid = valid & same
    if CAUSAL:
        valid = valid & (_k_axis(offs_n, TRANS) <= _q_axis(offs_m, TRANS))
    return tl.where(valid, s, float("-inf")), pair
