"""Triton kernels of fused attention with a relative-position bias read by offset (``attn_impl="triton"``).

FlashAttention-2's algorithm (forward with online softmax; backward after a preprocess, ``D = rowsum(o * do)``, in
two kernels: ``dk, dv`` per key block, its tiles transposed as the tutorial's, ``dq`` per query block), after
Triton's fused-attention tutorial, with one addition: the bias

    bias[h, i, j] = T[h, r_i - r_j + GH - 1, c_i - c_j + GW - 1]     (patch pairs; pairs with a prefix token: 0)

is read per tile from the offset table ``T [heads, 2 GH - 1, 2 GW - 1]`` with the offsets computed from token
indices (``r = (t - P) // GW``, ``c = (t - P) % GW``), or loaded whole from the bias tiles of a full grid (its tiles
repeat: :func:`vitrel.kernels.triton_bias.tile_patterns`). The table's gradient is reduced without an ``N x N``
tensor and without atomics. Where the bias is read as tiles, a fourth kernel (``dbias``) sums ``dS`` per tile pattern
in registers over the pattern's tiles and the batch, and plain tensor sums reduce those to the table; else the ``dq``
kernel reduces it by diagonals:

With patch indices ``i' = i - P`` in raster order, ``i' - j' = (r_i - r_j) GW + (c_i - c_j)``: the flattened
offset is a 1-D (Toeplitz) offset ``d = i - j`` once the pairs are split by whether ``c_i >= c_j``
(``dw >= 0``: ``dh = floor(d / GW)``, ``dw = d mod GW``; else ``dh = floor(d / GW) + 1``, ``dw = d mod GW - GW``).
So ``dT`` is two diagonal sums of ``dS`` (one per case), and a tile's diagonal sums are one register gather
(the skew of the founding notes: a diagonal becomes a column) and a column sum. Each ``dq`` program owns one slot
per key block for these sums (it loops over a share of the batch, adding into its own slots); the slots are
reduced by deterministic tensor sums afterwards (:func:`vitrel.kernels.triton_bias.table_grad`), so two runs are
bitwise equal.

``deterministic=False`` (:func:`vitrel.kernels.triton_bias.rel_bias_attention`) instead adds each tile's ``dq`` by
atomics from the ``dkdv`` kernel, as FlashAttention-2 does, where the ``dq`` kernel has no table gradient to reduce:
the backward then needs 5 matrix products a tile (7 with the ``dbias`` kernel) instead of 7 (9).

Every kernel reads the tile's logits through :func:`_logits` (the one place the bias, the window mask or the windows'
regions and the causal mask are applied), in base 2 (``LOG2E`` folded in, as the tutorial).
"""

from __future__ import annotations

# the kernels' long argument lists stay packed (ruff format would put one per line)
# fmt: off
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


#: the per-token buffers (the log-sum-exp and ``D``, ``[B, H, NP]``; a layout's tokens, ``[B, 4, NP]``) are padded
#: to ``NP`` tokens (:func:`_stats_len`), a multiple of it, which every kernel's tile divides, so the kernels read them
#: with no mask; the padding (tokens past the end) holds +inf (log-sum-exp: their ``p`` is 0), 0 (``D``), and segment
#: -2, row -1, column 0, group 0 (tokens: no patch, of no image)
STATS_ROWS = tl.constexpr(128)


@triton.jit
def _stats_len(N):
    """``NP``, the padded length of the per-token buffers of ``N`` tokens (:data:`STATS_ROWS`)."""
    return tl.cdiv(N, STATS_ROWS) * STATS_ROWS


@triton.jit
def _tokens(TOK, b, offs, P, N, GW, LAYOUT: tl.constexpr):
    """Patch flags, rows, columns, segments and table groups of tokens ``offs`` of batch ``b``: from the indices on a
    full grid (one image: segment 0, group 0; prefix and out-of-range tokens are not patches), from
    ``TOK [B, 4, NP]`` (segment, row, column, group; rows -1 for prefix and padding tokens; read with no mask: its
    padding, :data:`STATS_ROWS`) on a token layout."""
    inside = offs < N
    if LAYOUT:
        NP = _stats_len(N)
        base = TOK + b * 4 * NP  # (the base first: loop-invariant, hoisted)
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
    """The smallest and largest segment of tokens ``offs`` (padding: -1) on a layout; ``(0, 0)`` on a full grid."""
    if LAYOUT:
        inside = offs < N
        seg = tl.load(TOK + b * 4 * _stats_len(N) + offs)
        return tl.min(tl.where(inside, seg, 1 << 30)), tl.max(tl.where(inside, seg, -(1 << 30)))
    return 0, 0


#: the token tiles of the visible-tile flags (:func:`vitrel.kernels.triton_bias.visible_tiles`); every kernel tile is a
#: multiple of it
FLAG_TILE = tl.constexpr(16)


@triton.jit
def _visits(
    TOK, BLK, b, h, offs, lo, hi, q0, k0, N,
    BQ: tl.constexpr, BK: tl.constexpr, LAYOUT: tl.constexpr, HAS_BLOCKS: tl.constexpr,
):
    """Whether the ``[BQ, BK]`` tile of queries from ``q0`` and keys from ``k0`` can hold a visible pair, else it is
    skipped whole. On a layout: whether the loop's tokens ``offs`` can be of one image with the program's tokens
    (segments ``[lo, hi]``); with ``BLK [heads, cdiv(N, BQ), cdiv(N, BK)]`` (the table's ``-inf`` entries: LookHere's
    views; :func:`vitrel.kernels.triton_bias.tile_flags`): the tile's flag, one load (the ``dbias`` kernel's tiles;
    the others loop over lists of the visible tiles, :func:`_tile_loop`); else always."""
    if LAYOUT:
        klo, khi = _span(TOK, b, offs, N, LAYOUT)
        return (klo <= hi) & (khi >= lo)
    if HAS_BLOCKS:
        return tl.load(BLK + (h * tl.cdiv(N, BQ) + q0 // BQ) * tl.cdiv(N, BK) + k0 // BK) > 0
    return True


@triton.jit
def _tile_loop(BLK, h, tile, n_tiles, n_other, lo, hi, HAS_BLOCKS: tl.constexpr):
    """``(row, first, last)`` of a loop over the other axis's tiles from a program's ``tile``: with ``HAS_BLOCKS``,
    over the entries of its row of the tile lists ``BLK [heads, n_tiles, 1 + n_other]`` (a count, then the visible
    tiles: :func:`vitrel.kernels.triton_bias.tile_lists`; step 1), so the loop has no branch to skip a tile; else over
    the tokens ``[lo, hi)`` (step: the tile)."""
    if HAS_BLOCKS:
        row = BLK + (h * n_tiles + tile) * (n_other + 1)
        return row, 0, tl.load(row)
    return BLK, lo, hi


@triton.jit
def _tile_start(row, j, STEP: tl.constexpr, HAS_BLOCKS: tl.constexpr):
    """The first token of the loop's tile ``j`` (:func:`_tile_loop`: an entry of the list, or the token itself)."""
    if HAS_BLOCKS:
        return tl.load(row + 1 + j) * STEP
    return j


@triton.jit
def _tile(ptr, b, h, sb, sh, sn, offs, offs_d, mask):
    """The ``[len(offs), BLOCK_D]`` rows ``offs`` of a ``[B, H, N, D]`` tensor at batch ``b``, head ``h`` (zeros
    outside ``mask``)."""
    return tl.load(ptr + b * sb + h * sh + offs[:, None] * sn + offs_d[None, :], mask, 0.0)


@triton.jit
def _program(H, N, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, D):
    """A ``(blocks, B * H)`` grid's program: its batch, head, ``b * H + h``, the token indices of its block, the
    head-dim lanes and the ``[BLOCK, BLOCK_D]`` mask of real rows and lanes."""
    bh = tl.program_id(1)
    offs, offs_d, mask = _block_lanes(N, BLOCK, BLOCK_D, D)
    return bh // H, bh % H, bh, offs, offs_d, mask


@triton.jit
def _block_lanes(N, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, D):
    """The token indices of block ``program_id(0)``, the head-dim lanes and the ``[BLOCK, BLOCK_D]`` mask of real rows
    and lanes."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    return offs, offs_d, (offs < N)[:, None] & (offs_d < D)[None, :]


@triton.jit
def _tile_program(N, BM: tl.constexpr, BLOCK_D: tl.constexpr, D):
    """A one-tile kernel's program ``(split, h)`` (``fwd_tile``, ``tile``: a share of the batch, one head): its share,
    head, the tile's token and head-dim lanes, the lanes' mask, the rows it reads (past the end: the last row's,
    :func:`_rows`) and the ``[BM, BLOCK_D]`` mask of the real rows and lanes it stores."""
    offs = tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    return tl.program_id(0), tl.program_id(1), offs, offs_d, dmask, _rows(offs, N), (offs < N)[:, None] & dmask[None, :]


@triton.jit
def _rows(offs, N):
    """Token indices ``offs`` clamped to the last token, for the tiles of q, k, v and ``do`` a kernel reads in its
    loops: read with no row mask, the rows past the end a copy of the last row, which no result takes. Keys past the
    end are masked (``-inf``: their ``p`` is 0), queries past the end have a log-sum-exp of ``+inf`` (their ``p``
    and ``dS`` are 0: :func:`_row_stats`) and their ``dq`` is stored with a mask. With the row mask, each 16-byte
    copy of a tile computed its predicate and its zero-fill size: sm_90, Triton 3.6, 11-22 instructions per 64 x 64
    scores at head dim 64 (forward, ``dkdv``, ``dq``), 39 in head dim 128's ``dq``."""
    return tl.minimum(offs, N - 1)


@triton.jit
def _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D):
    """The key and value rows ``offs_n`` of batch ``b``, head ``h`` (past the end: the last row, :func:`_rows`)."""
    rows = _rows(offs_n, N)
    dmask = (offs_d < D)[None, :]
    return _tile(K, b, h, skb, skh, skn, rows, offs_d, dmask), _tile(V, b, h, svb, svh, svn, rows, offs_d, dmask)


@triton.jit
def _row_stats(LSE, DELTA, bh, N, offs):
    """The forward's log-sum-exp and the backward's ``D = rowsum(o * do)`` of query rows ``offs``, read with no mask
    (the buffers' rows padded: :data:`STATS_ROWS`). With a mask (``offs < N``, N odd), Triton 3.6 copied each thread's
    16 columns of the transposed ``dkdv`` tile one 4-byte element at a time, with their predicates: about 150 of
    the 657 instructions a tile (sm_90); unmasked it copies pairs and issues 502."""
    tl.static_assert(STATS_ROWS % offs.shape[0] == 0, "a query tile must divide STATS_ROWS")
    row = bh * _stats_len(N)  # (each base plus the row first: the loop-invariant part, hoisted)
    return tl.load(LSE + row + offs), tl.load(DELTA + row + offs)


@triton.jit
def _q_axis(x, TRANS: tl.constexpr):
    """A vector over the tile's queries, as the tile's query axis: its rows, or with ``TRANS`` (a tile of keys by
    queries, the ``dkdv`` kernel's) its columns."""
    if TRANS:  # (one return: Triton checks every return's type, a constexpr branch's too)
        y = x[None, :]
    else:
        y = x[:, None]
    return y


@triton.jit
def _k_axis(x, TRANS: tl.constexpr):
    """A vector over the tile's keys, as the tile's key axis: its columns, or with ``TRANS`` its rows."""
    if TRANS:
        y = x[:, None]
    else:
        y = x[None, :]
    return y


@triton.jit
def _bias_tile(
    BT, h, q0, k0, GW, n_kt, n_pat, d_min, g_d: tl.constexpr, n_m, g_m: tl.constexpr,
    HAS_TABLE: tl.constexpr, TILED: tl.constexpr, TM: tl.constexpr, TW: tl.constexpr, PAIRS: tl.constexpr = False,
):
    """The ``[TM, TW]`` bias tile of queries from ``q0`` and keys from ``k0`` read whole from the bias tiles
    ``BT [heads, n_pat, TM, TW]`` (one coalesced load: every entry of a pattern's tile exists), its pattern computed
    from ``(q0 - k0, q0 mod GW)`` (``n_m > 0``) or its place (a full grid's tiles repeat:
    :func:`vitrel.kernels.triton_bias.tile_patterns`); 0.0 where the bias is not read as tiles. For :func:`_logits`;
    a kernel that visits one tile for many batch elements (``dbias``) loads it once.

    ``PAIRS``: bf16 tiles read as 32-bit words of two entries and widened by hand (the low entry shifted up, the high
    one masked: two instructions a pair, where the compiler's conversion takes three, a ``PRMT`` and two shifts);
    sm_90: 17 fewer instructions a 64 x 64 tile in the forward and 16 in ``dq``. Not for a tile that is transposed
    after (``dkdv``: the products then serialize under Triton 3.6), nor ``dbias`` (it spills more), nor ``dq`` with a
    float mask (it then spills)."""
    bias = 0.0
    if HAS_TABLE and TILED:
        col = 0
        if n_m > 1:  # (g_m: a compile-time power of two, so a shift; (q0 mod W) / g_m is 0 where W divides TM)
            col = (q0 % GW) // g_m
        bias = _pattern_tile(BT, h, _pattern_index(q0, k0, col, n_kt, d_min, g_d, n_m, TM, TW), n_pat, TM, TW, PAIRS)
    return bias


@triton.jit
def _pattern_index(q0, k0, col, n_kt, d_min, g_d: tl.constexpr, n_m, TM: tl.constexpr, TW: tl.constexpr):
    """The pattern of the tile of queries from ``q0`` and keys from ``k0``
    (:func:`vitrel.kernels.triton_bias.tile_patterns`): from ``(q0 - k0, col)`` (``col = (q0 mod GW) / g_m``) where
    ``n_m > 0``, else its place. Both computed and one selected, with no branch. ``g_d``: a compile-time power of
    two, so a shift."""
    return tl.where(n_m > 0, ((q0 - k0 - d_min) // g_d) * n_m + col, (q0 // TM) * n_kt + k0 // TW)


@triton.jit
def _pattern_tile(BT, h, pat, n_pat, TM: tl.constexpr, TW: tl.constexpr, PAIRS: tl.constexpr):
    """The bias tile of pattern ``pat`` (:func:`_bias_tile`): in the tiles' type, or with ``PAIRS`` float32."""
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
def _bias_product(s, bias, TM: tl.constexpr, TRANS: tl.constexpr, PREC: tl.constexpr):
    """``s`` plus the bias tile ``bias`` by a product with the identity, ``s + I b`` (``TRANS``: ``s + b I``), where
    no tile of the call needs a mask (``triton_bias.BIAS_BY_PRODUCT``, ``triton_bias._product_tiles``: the tiles
    divided by the scale, so added to the unscaled logits, with a finite stand-in for ``-inf``, whose product with 0
    is 0, not NaN). The tile
    in the inputs' type is then an operand of a product, read from shared memory by the tensor cores as the keys are,
    and pipelined as they are (three buffers, where a tile added to the logits had two: sm_90), with no widening, no
    addition and no load into registers: sm_90, ViT-B/16's call, a 64 x 64 tile's instructions 417 -> 340 in the
    forward and 465 -> 376 in ``dkdv`` (Triton 3.8; 401 -> 336 and 494 -> 362 under 3.6), for a third product of the
    tile's size (``TM`` the identity's side); each product of the identity's zeros is exact, and so is the bias's sum
    into float32."""
    eye = tl.where(tl.arange(0, TM)[:, None] == tl.arange(0, TM)[None, :], 1.0, 0.0).to(bias.dtype)
    if TRANS:
        out = tl.dot(bias, eye, s, input_precision=PREC)
    else:
        out = tl.dot(eye, bias, s, input_precision=PREC)
    return out


@triton.jit
def _logits(
    q, k, b, h, offs_m, offs_n, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, qk_scale, P, N, GH, GW,
    bias, n_m, q0, k0,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr, PREC: tl.constexpr,
    TILED: tl.constexpr, TM: tl.constexpr, TW: tl.constexpr, TRANS: tl.constexpr = False, RAW: tl.constexpr = False,
):
    """Base-2 logits of the ``[TM, TW]`` tile of queries from ``q0`` and keys from ``k0``, ``-inf`` where masked (out
    of range, causal, across images or windows' regions, the table's or the mask's ``-inf``), and the tile's
    patch-pair flags (pairs of one image where the bias applies). The bias is gathered per score from ``T``
    (``[G, heads, 2 GH - 1, 2 GW - 1]``, a table per group of images; ``stride_tg`` 0 on a full grid), or with
    ``TILED`` is ``bias``, the tile :func:`_bias_tile` read. ``MASK_KIND``: 0 none, 1 ``MASK`` an additive float mask
    ``[Mb, N, N]``, 2 ``MASK`` region ids ``[Mb, NP]`` (batch ``b`` reads row ``b mod Mb``; padded with -1:
    :data:`STATS_ROWS`). ``T``, the bias tiles
    and a float ``MASK`` come multiplied by ``LOG2E``.

    Where the bias is read as tiles on a full grid with no mask (or regions whose tokens in the tile are of one
    region), a tile whose pairs are all patch pairs (no prefix token, none past the end: all but the first and last
    rows and columns of tiles), and every tile where each pattern is one exact tile (``n_m = 0``: its prefix pairs 0,
    its keys past the end ``-inf``), takes a branch with no mask at all: the bias added as it is read. So does a tile
    with no key past the end where there is no table.

    ``TRANS``: the tile transposed, ``[TW, TM]`` keys by queries (``bias`` too, and ``q`` given as ``q^T``,
    ``[BLOCK_D, TM]``), as Triton's tutorial computes its ``dk, dv``: ``p^T`` and ``dS^T`` are then the left operands
    of their products as they stand in registers, where the transposes of ``p`` and ``dS`` went through shared
    memory, two round trips a tile (and made ptxas serialize the products).

    ``RAW`` (no table, no float mask, ``qk_scale > 0``; or 2: the tiles, divided by the scale, added by a product,
    :func:`_bias_product`; :func:`_shift`): the logits are returned unscaled (``-inf`` where masked), and the caller
    scales them in the instruction that subtracts the row's maximum or log-sum-exp."""
    if TRANS:
        s = tl.dot(k, q, input_precision=PREC)  # (q^T: [BLOCK_D, TM])
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if HAS_TABLE and RAW == 2:  # the bias by a product (:func:`_bias_product`), unscaled as the logits
        s = _bias_product(s, bias, TM, TRANS, PREC)
    if not RAW:
        s = s * qk_scale
    if (TILED or not HAS_TABLE) and MASK_KIND != 1 and not CAUSAL and not LAYOUT:  # (gathered: the masks cost less)
        if HAS_TABLE and RAW == 2:  # (tiles by a product: nothing to mask; known here, so no masks compiled in,
            interior = True  # which the compiler made selects on every tile, 3 a score, in dkdv: sm_90)
        elif HAS_TABLE:
            interior = (n_m == 0) | ((q0 >= P) & (k0 >= P) & (q0 + TM <= N) & (k0 + TW <= N))
        else:  # (no bias: only the keys past the end are masked; a query past the end is harmless)
            interior = k0 + TW <= N
        if MASK_KIND == 2:  # a window whose tokens in this tile are of one region (all but the seam's windows)
            rptr = MASK + (b % n_mask_b) * stride_mb  # (region ids padded: read with no mask)
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
        if HAS_TABLE and RAW != 2:  # (not a 0.0 added: x + 0.0 is not folded, as -0.0 + 0.0 is +0.0)
            s = s + bias
    else:
        s, pair = _masked(
            s, bias, b, h, offs_m, offs_n, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, P, N, GH, GW,
            HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, TILED, TRANS, RAW,
        )
    return s, pair


@triton.jit
def _shift(s, m, qk_scale, RAW: tl.constexpr):
    """``s - m`` for the softmax, the logits ``s`` of :func:`_logits` in base 2: with ``RAW`` they come unscaled and
    are scaled here, ``s qk_scale - m``, one FFMA a score (as Triton's tutorial), where the scale's multiply in
    :func:`_logits` and the subtraction took two (an FMUL the compiler cannot fuse: the scaled logits have a second
    use, the row's maximum, which the forward takes unscaled instead: ``qk_scale > 0``)."""
    if RAW:
        x = s * qk_scale - m
    else:
        x = s - m
    return x


@triton.jit
def _masked(
    s, bias, b, h, offs_m, offs_n, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, P, N, GH, GW,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    TILED: tl.constexpr, TRANS: tl.constexpr, RAW: tl.constexpr,
):
    """:func:`_logits` of a tile with masks: the bias (``bias``, a tile read whole; else gathered from ``T``) on the
    patch pairs, ``-inf`` where masked (``TRANS``: a tile of keys by queries)."""
    qpatch, rq, cq, sq, gq = _tokens(TOK, b, offs_m, P, N, GW, LAYOUT)
    kpatch, rk, ck, sk, _ = _tokens(TOK, b, offs_n, P, N, GW, LAYOUT)
    same = _q_axis(sq, TRANS) == _k_axis(sk, TRANS)
    pair = _q_axis(qpatch, TRANS) & _k_axis(kpatch, TRANS) & same
    if HAS_TABLE and RAW != 2:  # (RAW 2: the bias is in the logits, :func:`_bias_product`)
        if TILED:
            s += tl.where(pair, bias, 0.0)
        else:  # T pre-scaled by LOG2E; the flat offset index is a row term minus a column term
            row = T + gq * stride_tg + h * stride_th + (rq + GH - 1) * (2 * GW - 1) + cq + GW - 1
            s += tl.load(_q_axis(row, TRANS) - _k_axis(rk * (2 * GW - 1) + ck, TRANS), mask=pair, other=0.0)
    inside = _q_axis(offs_m < N, TRANS) & _k_axis(offs_n < N, TRANS)
    if MASK_KIND == 1:  # an additive float mask [Mb, N, N]
        mptr = MASK + (b % n_mask_b) * stride_mb + _q_axis(offs_m, TRANS) * N + _k_axis(offs_n, TRANS)
        s += tl.load(mptr, mask=inside, other=0.0)
    valid = inside | _q_axis(offs_m >= N, TRANS)  # (queries past the end: harmless, their loads are zeros)
    if MASK_KIND == 2:  # region ids [Mb, NP] (a batch of windows' layout): a token sees its own region's tokens
        rptr = MASK + (b % n_mask_b) * stride_mb
        rq = tl.load(rptr + offs_m)
        valid = valid & (_q_axis(rq, TRANS) == _k_axis(tl.load(rptr + offs_n), TRANS))
    if LAYOUT:  # a token sees its own image's tokens (padding: padding)
        valid = valid & same
    if CAUSAL:
        valid = valid & (_k_axis(offs_n, TRANS) <= _q_axis(offs_m, TRANS))
    return tl.where(valid, s, float("-inf")), pair


@triton.jit
def _fwd_kernel(
    Q, K, V, T, MASK, TOK, BLK, BT, O, LSE,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, stride_tg, stride_th, stride_mb, n_mask_b,
    H, N, P, GH, GW, qk_scale, n_kt, n_pat, d_min, g_d: tl.constexpr, n_m, g_m: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr, TMA: tl.constexpr,
    ONE: tl.constexpr,
):
    """The output and the rows' log-sum-exp of one query tile. ``TMA``: the key and value tiles read through tensor
    descriptors (Hopper's tensor-memory accelerator: one thread issues a tile's copy, no address per thread, the
    rows past the end and the lanes past ``D`` zero-filled), where :func:`vitrel.kernels.triton_bias.tma_reads` allows
    it; sm_90, Triton 3.6: 18-20 fewer instructions per 64 x 64 scores (224 without a table, 302 with one) and 28
    fewer registers. ``ONE``: the call's keys are one tile (a Swin window's), so the loop's one visit takes the
    softmax with no rescaling (sm_90, a Swin window's forward: 4-7 % fewer instructions on its unmasked path, 3-11 %
    on its masked one, Triton 3.6 and 3.8)."""
    b, h, bh, offs_m, offs_d, q_mask = _program(H, N, BM, BLOCK_D, D)
    q = _tile(Q, b, h, sqb, sqh, sqn, offs_m, offs_d, q_mask)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_D], tl.float32)
    lo, hi_seg = _span(TOK, b, offs_m, N, LAYOUT)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, tl.program_id(0) * BM + BM)
    row, first, last = _tile_loop(BLK, h, tl.program_id(0), tl.cdiv(N, BM), tl.cdiv(N, BN), 0, hi, HAS_BLOCKS)
    if HAS_BLOCKS:  # a query tile with no visible key tile visits the first of its list's invisible ones: all -inf
        last = tl.maximum(last, 1)
    # the loop runs at least once: without this, LLVM places the path that skips it (its accumulators set to zero)
    # after the loop's products, between a product and its wait, and ptxas then serializes every product of the
    # kernel (its note C7515: non-product instructions writing a product's accumulators in its pipeline stage), as it
    # did with half-precision bias tiles (sm_90, Triton 3.6 and 3.8)
    tl.assume(last > first)
    if TMA:  # (the batch: this launch's, a share of the call's beyond CUDA's grid)
        n_b = tl.num_programs(1) // H
        k_desc = tl.make_tensor_descriptor(K, [n_b, H, N, D], [skb, skh, skn, 1], [1, 1, BN, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V, [n_b, H, N, D], [svb, svh, svn, 1], [1, 1, BN, BLOCK_D])
    for j in range(first, last, 1 if HAS_BLOCKS else BN):
        start_n = _tile_start(row, j, BN, HAS_BLOCKS)
        offs_n = start_n + tl.arange(0, BN)
        if _visits(TOK, BLK, b, h, offs_n, lo, hi_seg, tl.program_id(0) * BM, start_n, N, BM, BN, LAYOUT, False):
            if TMA:
                k = k_desc.load([b, h, start_n, 0]).reshape(BN, BLOCK_D)
                v = v_desc.load([b, h, start_n, 0]).reshape(BN, BLOCK_D)
            else:
                k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D)
            bias = _bias_tile(
                BT, h, tl.program_id(0) * BM, start_n, GW, n_kt, n_pat, d_min, g_d, n_m, g_m, HAS_TABLE, TILED, BM, BN,
                RAW != 2,
            )
            s, _ = _logits(
                q, k, b, h, offs_m, offs_n, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, qk_scale, P, N,
                GH, GW, bias, n_m, tl.program_id(0) * BM, start_n, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED,
                BM, BN, RAW=RAW,
            )
            m_i, l_i, acc = _online_softmax(s, m_i, l_i, acc, v, qk_scale, RAW, ONE, PREC)
    _fwd_store(O, LSE, acc, m_i, l_i, b, h, bh, sob, soh, son, offs_m, offs_d, q_mask, N, BM)


@triton.jit
def _online_softmax(s, m_i, l_i, acc, v, qk_scale, RAW: tl.constexpr, ONE: tl.constexpr, PREC: tl.constexpr):
    """The forward's step over one key tile: the rows' running maximum ``m_i``, sum ``l_i`` and output ``acc``
    updated with the tile's base-2 logits ``s`` (:func:`_logits`) and values ``v``. ``ONE``: the call's one key tile,
    nothing before it to rescale."""
    if RAW:  # (the row's maximum of the unscaled logits, scaled: qk_scale > 0)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.math.exp2(_shift(s, m_safe[:, None], qk_scale, RAW))
    if ONE:
        l_i = tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, input_precision=PREC)
    else:
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _fwd_store(O, LSE, acc, m_i, l_i, b, h, bh, sob, soh, son, offs_m, offs_d, q_mask, N, BM: tl.constexpr):
    """The forward's output rows and their base-2 log-sum-exp (+inf past the end, and on the padding rows past the
    last query tile's: :data:`STATS_ROWS`)."""
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty), q_mask)
    tl.static_assert(STATS_ROWS % BM == 0, "a query tile must divide STATS_ROWS")
    lse_row = LSE + bh * _stats_len(N)
    tl.store(lse_row + offs_m, tl.where(offs_m < N, m_safe + tl.math.log2(l_safe), float("inf")))
    if tl.program_id(0) == tl.num_programs(0) - 1:  # the padding rows past the last query tile's
        for r in range((tl.program_id(0) + 1) * BM, _stats_len(N), BM):
            tl.store(lse_row + r + tl.arange(0, BM), tl.full([BM], float("inf"), tl.float32))


@triton.jit
def _fwd_tile_kernel(
    Q, K, V, T, MASK, TOK, BT, O, LSE,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, stride_tg, stride_th, stride_mb, n_mask_b,
    B, H, N, P, GH, GW, qk_scale, n_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr,
    RAW: tl.constexpr,
):
    """The forward of a call whose ``N`` tokens fit one ``[BM, BM]`` tile (a batch of Swin's windows, a small grid), as
    :func:`_bwd_tile_kernel` takes its backward: program ``(split, h)`` takes batch elements ``b = split, split +
    n_split, ...`` one after another, each one tile: its logits, the softmax with no rescaling (one key tile), ``p v``,
    the output and the rows' log-sum-exp (+inf on the padding rows) written. Where :func:`_fwd_kernel` gives each batch
    element a program, whose set-up and stores were as many instructions as its one visit (sm_90, a Swin window), the
    set-up here is a share's, the bias tile (the call's one exact pattern) is loaded once, and the loop over the
    share, its body free of branches, is pipelined: the next element's q, k and v load during this one's."""
    split, h, offs, offs_d, dmask, rows, out_mask = _tile_program(N, BM, BLOCK_D, D)
    tl.static_assert(STATS_ROWS % BM == 0, "a query tile must divide STATS_ROWS")
    bias = 0.0
    if HAS_TABLE and TILED:  # (the one tile pattern, exact, read as 32-bit pairs as the forward's)
        bias = _pattern_tile(BT, h, 0, 1, BM, BM, True)
    for b in range(split, B, n_split):
        q = _tile(Q, b, h, sqb, sqh, sqn, rows, offs_d, dmask[None, :])  # (rows past the end: the last row's)
        k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs, offs_d, N, D)
        s, _ = _logits(  # (n_m 0: the call's one tile pattern is its one exact tile)
            q, k, b, h, offs, offs, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, qk_scale, P, N, GH, GW,
            bias, 0, 0, 0, HAS_TABLE, MASK_KIND, CAUSAL, False, PREC, TILED, BM, BM, RAW=RAW,
        )
        if RAW:  # (the row's maximum of the unscaled logits, scaled: qk_scale > 0)
            m = tl.max(s, 1) * qk_scale
        else:
            m = tl.max(s, 1)
        m = tl.where(m == float("-inf"), 0.0, m)  # rows with nothing visible
        p = tl.math.exp2(_shift(s, m[:, None], qk_scale, RAW))
        l_sum = tl.sum(p, 1)
        l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
        out = tl.dot(p.to(v.dtype), v, input_precision=PREC) / l_sum[:, None]
        tl.store(O + b * sob + h * soh + offs[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty), out_mask)
        lse_row = LSE + (b * H + h) * STATS_ROWS  # (N <= BM: one padded block of rows)
        tl.store(lse_row + offs, tl.where(offs < N, m + tl.math.log2(l_sum), float("inf")))
        for r in tl.static_range(BM, STATS_ROWS, BM):  # the padding rows past the tile
            tl.store(lse_row + r + offs, tl.full([BM], float("inf"), tl.float32))


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, DK, DV, DQ, DBT, LOCKS, DQO,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_tg, stride_th, stride_mb, n_mask_b,
    sgb, sgh, sgn, shb, shh, shn, sab, sah, san,
    B, H, N, P, GH, GW, qk_scale, sm_scale, n_kt, n_pat, d_min, g_d: tl.constexpr, n_m, g_m: tl.constexpr, n_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    TILE_GRAD: tl.constexpr, SHARES: tl.constexpr, ORDERED_DQ: tl.constexpr, NT: tl.constexpr,
):
    """``dk``, ``dv`` of one key block (``DK``, ``DV`` ``[B, H, N, D]`` with strides ``sg*``, ``sh*``); with
    ``ATOMIC_DQ``, also each tile's part of ``dq``, added by atomics into ``DQ [B, H, N, D]`` (float32, strides
    ``sa*``) as FlashAttention-2's backward does: no ``dq`` kernel (one matrix product a tile instead of three), but
    the order of the additions, so the low bits of ``dq``, change from run to run. With ``ORDERED_DQ`` instead, each
    tile's part of ``dq`` is added in the order of the key blocks, so deterministic with no ``dq`` kernel
    (:func:`_add_in_order`): the program of key block ``j`` waits until ``LOCKS [B, H, n_qt]`` (int32, zeros first)
    reads ``j NT`` at its query tile (``NT``: its threads), then stores its part (``j = 0``) or adds it to the float32
    sums in ``DQ``, or, the last key block, writes ``dq`` itself to ``DQO`` (the strides of ``DK``), and each thread
    counts the lock up. Every key block visits every query tile in the same order (a full grid: no token layout,
    mask, causal or skipped tiles), so after the first tile the blocks should run one addition apart and seldom wait
    (untimed). It needs each key block's lower blocks' programs started first, as CUDA starts a grid's programs in
    the order of their index (and Triton's interpreter runs them one after another).

    Programs ``(key block, b H + h)``; with ``SHARES``, ``(key block, h, split)``, each taking the batch elements
    ``b = split, split + n_split, ...`` one after another; with ``TILE_GRAD`` (``SHARES`` too; the bias read as
    tiles, one exact pattern a tile), each adding each tile's ``dS`` to its pattern's sum, which only this program's
    tiles have (its key tile's, its share of the batch), in ``DBT [n_split, H, n_pat, BN, BM]`` (zeros first; the
    tiles transposed, keys by queries, as computed): the ``dbias`` kernel's sums without its second pass over q, k, v
    and ``do`` and its two products. The sums are added by atomics that return nothing (a read and a write held 77
    more instructions a tile in registers and spilled, sm_90): each entry is added by one thread only, in the order
    of its batch loop, and the additions of one thread to one address are performed in its program order, so the
    sums are in a fixed order (``dq``'s atomics, from every key block's programs, are not)."""
    if SHARES:
        h = tl.program_id(1)
        split = tl.program_id(2)
        for b in range(split, B, n_split):
            _dkdv_block(
                Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, DK, DV, DQ, DBT + (split * H + h) * n_pat * BM * BN,
                LOCKS, DQO,
                sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_tg, stride_th, stride_mb,
                n_mask_b, sgb, sgh, sgn, shb, shh, shn, sab, sah, san, b, h, b * H + h, H, N, P, GH, GW, qk_scale,
                sm_scale, n_kt, n_pat, d_min, g_d, n_m, g_m, D, BLOCK_D, BM, BN, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT,
                HAS_BLOCKS, TILED, PREC, RAW, ATOMIC_DQ, TILE_GRAD, ORDERED_DQ, NT,
            )
    else:
        _dkdv_block(
            Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, DK, DV, DQ, DBT, LOCKS, DQO,
            sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_tg, stride_th, stride_mb, n_mask_b,
            sgb, sgh, sgn, shb, shh, shn, sab, sah, san, tl.program_id(1) // H, tl.program_id(1) % H, tl.program_id(1),
            H, N, P, GH, GW, qk_scale, sm_scale, n_kt, n_pat, d_min, g_d, n_m, g_m, D, BLOCK_D, BM, BN, HAS_TABLE,
            MASK_KIND, CAUSAL, LAYOUT, HAS_BLOCKS, TILED, PREC, RAW, ATOMIC_DQ, TILE_GRAD, ORDERED_DQ, NT,
        )


@triton.jit
def _dkdv_block(
    Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, DK, DV, DQ, DBT, LOCKS, DQO,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_tg, stride_th, stride_mb, n_mask_b,
    sgb, sgh, sgn, shb, shh, shn, sab, sah, san, b, h, bh,
    H, N, P, GH, GW, qk_scale, sm_scale, n_kt, n_pat, d_min, g_d: tl.constexpr, n_m, g_m: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    TILE_GRAD: tl.constexpr, ORDERED_DQ: tl.constexpr, NT: tl.constexpr,
):
    """:func:`_bwd_dkdv_kernel`'s work for batch element ``b``, head ``h`` (``bh = b H + h``; ``DBT``: its share's and
    head's sums)."""
    offs_n, offs_d, kv_mask = _block_lanes(N, BN, BLOCK_D, D)
    dmask = offs_d < D
    k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D)
    dk = tl.zeros([BN, BLOCK_D], tl.float32)
    dv = tl.zeros([BN, BLOCK_D], tl.float32)
    klo, khi = _span(TOK, b, offs_n, N, LAYOUT)
    lo = 0
    if CAUSAL:
        lo = (tl.program_id(0) * BN // BM) * BM
    row, first, last = _tile_loop(BLK, h, tl.program_id(0), tl.cdiv(N, BN), tl.cdiv(N, BM), lo, N, HAS_BLOCKS)
    for j in range(first, last, 1 if HAS_BLOCKS else BM):
        start_m = _tile_start(row, j, BM, HAS_BLOCKS)
        offs_m = start_m + tl.arange(0, BM)
        if _visits(TOK, BLK, b, h, offs_m, klo, khi, start_m, tl.program_id(0) * BN, N, BM, BN, LAYOUT, False):
            rows = _rows(offs_m, N)
            # q^T [BLOCK_D, BM] loaded so (as the tutorial), the right operand of k q^T
            qt = tl.load(Q + b * sqb + h * sqh + rows[None, :] * sqn + offs_d[:, None], dmask[:, None], 0.0)
            do = _tile(DO, b, h, sdob, sdoh, sdon, rows, offs_d, dmask[None, :])
            lse, delta = _row_stats(LSE, DELTA, bh, N, offs_m)
            # the tile transposed, keys by queries (as Triton's tutorial): p^T and dS^T feed dv and dk as they stand
            bias = _bias_tile(
                BT, h, start_m, tl.program_id(0) * BN, GW, n_kt, n_pat, d_min, g_d, n_m, g_m, HAS_TABLE, TILED, BM, BN,
            )
            if HAS_TABLE and TILED:  # (read whole as stored, rows of queries: transposed in shared memory)
                bias = tl.trans(bias)
            s, _ = _logits(
                qt, k, b, h, offs_m, offs_n, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, qk_scale, P, N,
                GH, GW, bias, n_m, start_m, tl.program_id(0) * BN, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED,
                BM, BN, True, RAW,
            )
            p = tl.math.exp2(_shift(s, lse[None, :], qk_scale, RAW))
            dv += tl.dot(p.to(do.dtype), do, input_precision=PREC)
            dp = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds = p * (dp - delta[None, :])
            dk += tl.dot(ds.to(qt.dtype), tl.trans(qt), input_precision=PREC)
            if ATOMIC_DQ or ORDERED_DQ:
                dq = tl.dot(tl.trans(ds.to(k.dtype)), k, input_precision=PREC) * sm_scale
            if ATOMIC_DQ:
                dq_ptr = DQ + b * sab + h * sah + offs_m[:, None] * san + offs_d[None, :]
                tl.atomic_add(dq_ptr, dq, mask=(offs_m < N)[:, None] & dmask[None, :], sem="relaxed")
            if ORDERED_DQ:
                _add_in_order(
                    DQ, LOCKS, DQO, dq, b, h, bh, start_m, offs_m, offs_d, N, D, sab, sah, san, sgb, sgh, sgn, BM,
                    NT,
                )
            if TILE_GRAD:  # (its pattern: (q0 / BM) n_kt + k0 / BN; its pairs off the table's, not read)
                slot = DBT + ((start_m // BM) * n_kt + tl.program_id(0)) * BN * BM
                slot += tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
                tl.atomic_add(slot, ds, sem="relaxed")  # (this thread's entries only: see the docstring)
    dk_ptr = DK + b * sgb + h * sgh + offs_n[:, None] * sgn + offs_d[None, :]
    tl.store(dk_ptr, (dk * sm_scale).to(DK.dtype.element_ty), kv_mask)
    dv_ptr = DV + b * shb + h * shh + offs_n[:, None] * shn + offs_d[None, :]
    tl.store(dv_ptr, dv.to(DV.dtype.element_ty), kv_mask)


@triton.jit
def _add_in_order(
    DQ, LOCKS, DQO, dq, b, h, bh, start_m, offs_m, offs_d, N, D, sab, sah, san, sgb, sgh, sgn, BM: tl.constexpr,
    NT: tl.constexpr,
):
    """The ``dkdv`` kernel's ``ORDERED_DQ`` addition of key block ``program_id(0)``'s part ``dq`` of a query tile:
    once the tile's lock reads ``NT`` (the program's threads) times this block's index, the first block stores its
    part in the float32 sums ``DQ``, the next add theirs to them (read past the L1 cache, which another program's
    writes do not reach), the last writes the total to ``DQO``; then every thread adds 1 to the lock with release
    semantics, each after its own stores, so the next block's acquiring read of ``NT`` more sees them all. (One
    release after a barrier kept Triton from pipelining the tile loop's loads: sm_90, no asynchronous copies; these
    releases do not.)"""
    rank = tl.program_id(0)
    last = tl.num_programs(0) - 1
    lock = LOCKS + bh * tl.cdiv(N, BM) + start_m // BM
    if rank > 0:
        while tl.atomic_add(lock, 0, sem="acquire") != rank * NT:
            pass
    mask = (offs_m < N)[:, None] & (offs_d < D)[None, :]
    acc = DQ + b * sab + h * sah + offs_m[:, None] * san + offs_d[None, :]
    if rank > 0:
        dq += tl.load(acc, mask, 0.0, cache_modifier=".cg")
    if rank == last:
        out = DQO + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_d[None, :]
        tl.store(out, dq.to(DQO.dtype.element_ty), mask)
    else:
        tl.store(acc, dq, mask)
    one = tl.full([NT], 1, tl.int32)  # (one element a thread: each releases its own stores)
    tl.atomic_add(lock + tl.zeros([NT], tl.int32), one, sem="release")


@triton.jit
def _scatter_rows(
    ds, SCR, SLOT, TOK, b, pid_m, offs_n, N, GH, GW, BM: tl.constexpr,
):
    """Add a tile's ``dS`` (zero off the patch pairs of one image) into this program's table-gradient slots
    ``SLOT [G (2 GH - 1) (2 GW - 1)]`` at each pair's group and offset, on a token layout: a row's keys of one image
    have distinct offsets, so each row is one scatter without collisions; the rows go one after another through
    this program's scratch ``SCR [BM, BM]`` (a barrier between them), in a fixed order: deterministic."""
    cols = tl.arange(0, BM)
    tl.store(SCR + cols[:, None] * BM + cols[None, :], ds)
    tl.debug_barrier()
    kpatch, rk, ck, sk, _ = _tokens(TOK, b, offs_n, 0, N, GW, True)
    key_col = rk * (2 * GW - 1) + ck
    NP = _stats_len(N)
    for r in range(0, BM):
        t = pid_m * BM + r
        there = t < N
        base = TOK + b * 4 * NP + t
        rq = tl.load(base + NP, mask=there, other=-1)
        cq = tl.load(base + 2 * NP, mask=there, other=0)
        ok = kpatch & (rq >= 0) & (sk == tl.load(base, mask=there, other=-2))
        at = SLOT + tl.load(base + 3 * NP, mask=there, other=0) * ((2 * GH - 1) * (2 * GW - 1))
        at += (rq + GH - 1) * (2 * GW - 1) + cq + GW - 1 - key_col
        tl.store(at, tl.load(at, mask=ok, other=0.0) + tl.load(SCR + r * BM + cols), mask=ok)
        tl.debug_barrier()


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, DQ, SLOTS, SCRATCH, DBT,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_tg, stride_th, stride_mb, n_mask_b,
    sgb, sgh, sgn,
    B, H, N, P, GH, GW, qk_scale, sm_scale, n_kt, n_pat, d_min, g_d: tl.constexpr, n_m, g_m: tl.constexpr, n_split,
    slot_size,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, TABLE_GRAD: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr,
    TILE_GRAD: tl.constexpr,
):
    """``dq`` of one query block for a share of the batch (``b = split, split + n_split, ...``), and the table
    gradient's sums of ``dS`` into this program's slots ``SLOTS [n_split, H, n_qb, slot_size]``. On a full grid,
    per key block: ``[n_kb, 2, 2 BM]`` (slot ``[case, e]``: the pairs with ``c_i >= c_j`` (case 0) or ``c_i < c_j``
    (case 1) at ``(i - i0) - (j - j0) = e - BM + 1``); on a token layout, the whole table per program
    (:func:`_scatter_rows`). ``BM`` queries held, ``BN`` keys streamed; the table's gradient takes square tiles
    (``BN = BM``). ``TILE_GRAD`` (the bias read as tiles, one exact pattern a tile): the gradient of the bias tiles
    instead, the ``dbias`` kernel's ``DBT [n_split, H, n_pat, BM, BN]`` (zeros first), each tile's ``dS`` added to
    its pattern's sum, which only this program's tiles have (its query tile's, its share of the batch): no
    ``dbias`` kernel (its second pass over q, k, v, ``do`` and its products), a read and a write of the sum a tile,
    deterministic."""
    tl.static_assert(BN == BM or not TABLE_GRAD)
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_qb = tl.num_programs(0)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q_mask = (offs_m < N)[:, None] & dmask[None, :]
    E: tl.constexpr = 2 * BM
    # the skew: column e of row i reads key j = (i - e) mod BM of the tile, so a diagonal i - j = e (i >= e) or
    # i - j = e - BM (i < e) becomes a column; the column sums over i >= e and i < e are the two diagonals' sums
    e = tl.arange(0, BM)
    ii = tl.arange(0, BM)[:, None]
    jj = (ii - e[None, :] + BM) % BM
    lower = ii >= e[None, :]
    _, _, cq, _, _ = _tokens(TOK, 0, offs_m, P, N, GW, False)
    program = (split * H + h) * n_qb + pid_m
    slot_row = SLOTS + program * slot_size
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BM)
    for b in range(split, B, n_split):
        bh = b * H + h
        q = _tile(Q, b, h, sqb, sqh, sqn, offs_m, offs_d, q_mask)
        do = _tile(DO, b, h, sdob, sdoh, sdon, offs_m, offs_d, q_mask)
        lse, delta = _row_stats(LSE, DELTA, bh, N, offs_m)
        dq = tl.zeros([BM, BLOCK_D], tl.float32)
        lo, hi_seg = _span(TOK, b, offs_m, N, LAYOUT)
        row, first, last = _tile_loop(BLK, h, pid_m, n_qb, tl.cdiv(N, BN), 0, hi, HAS_BLOCKS)
        for j in range(first, last, 1 if HAS_BLOCKS else BN):
            start_n = _tile_start(row, j, BN, HAS_BLOCKS)
            offs_n = start_n + tl.arange(0, BN)
            if _visits(TOK, BLK, b, h, offs_n, lo, hi_seg, pid_m * BM, start_n, N, BM, BN, LAYOUT, False):
                k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D)
                bias = _bias_tile(
                    BT, h, pid_m * BM, start_n, GW, n_kt, n_pat, d_min, g_d, n_m, g_m, HAS_TABLE, TILED, BM, BN,
                    MASK_KIND != 1 and RAW != 2,  # (a float mask: the pairs' registers spilled, Triton 3.6, sm_90)
                )
                s, pair = _logits(
                    q, k, b, h, offs_m, offs_n, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, qk_scale,
                    P, N, GH, GW, bias, n_m, pid_m * BM, start_n, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED,
                    BM, BN, RAW=RAW,
                )
                p = tl.math.exp2(_shift(s, lse[:, None], qk_scale, RAW))
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)
                ds = p * (dp - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
                if TILE_GRAD:  # (its pattern: (q0 / BM) n_kt + k0 / BN; its pairs off the table's, not read)
                    slot = DBT + (((split * H + h) * n_pat + pid_m * n_kt + start_n // BN) * BM) * BN
                    slot += tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
                    tl.store(slot, tl.load(slot) + ds)
                if TABLE_GRAD:
                    ds = tl.where(pair, ds, 0.0)
                    if LAYOUT:
                        _scatter_rows(
                            ds, SCRATCH + program * BM * BM, slot_row, TOK, b, pid_m, offs_n, N, GH, GW, BM,
                        )
                    else:
                        _, _, ck, _, _ = _tokens(TOK, b, offs_n, P, N, GW, False)
                        right = cq[:, None] >= ck[None, :]  # dw >= 0 (case 0) or not (case 1)
                        r0 = tl.gather(tl.where(right, ds, 0.0), jj, axis=1)
                        r1 = tl.gather(tl.where(right, 0.0, ds), jj, axis=1)
                        # slot index of i - j = d is d + BM - 1: the lower diagonals at e + BM - 1, the upper at e - 1
                        sp = slot_row + (start_n // BM) * 2 * E + e
                        up = e >= 1
                        tl.store(sp + BM - 1, tl.load(sp + BM - 1) + tl.sum(tl.where(lower, r0, 0.0), axis=0))
                        tl.store(
                            sp - 1, tl.load(sp - 1, mask=up) + tl.sum(tl.where(lower, 0.0, r0), axis=0), mask=up
                        )
                        sp1 = sp + E
                        tl.store(sp1 + BM - 1, tl.load(sp1 + BM - 1) + tl.sum(tl.where(lower, r1, 0.0), axis=0))
                        tl.store(
                            sp1 - 1, tl.load(sp1 - 1, mask=up) + tl.sum(tl.where(lower, 0.0, r1), axis=0), mask=up
                        )
        dq_ptr = DQ + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_d[None, :]
        tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), q_mask)


@triton.jit
def _bwd_dbias_kernel(
    Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, ORDER, DBT,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_tg, stride_th, stride_mb, n_mask_b,
    B, H, N, P, GH, GW, qk_scale, n_kt, n_pat, d_min, g_d: tl.constexpr, n_m, g_m: tl.constexpr, n_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr, BATCH_OUTER: tl.constexpr,
):
    """The gradient of the bias tiles (a full grid's, read as ``TILED``): program ``(pat, h, split)`` (read from
    ``ORDER``, the longest patterns first: :func:`vitrel.kernels.triton_bias.dbias_order`) sums ``dS`` over
    the ``[BM, BN]`` tiles of pattern ``pat`` and its share of the batch (``b = split, split + n_split, ...``) in
    registers (zero at the pairs with a prefix token, which have no bias; at the other pairs that are not patch pairs
    ``P = 0``), and writes the sum once, to ``DBT [n_split, H, n_pat, BM, BN]``.
    The tiles of a pattern lie on one block diagonal, ``q0 - k0 = d_min + (pat / n_m) BN`` (``q0 mod GW`` in class
    ``pat mod n_m`` where ``n_m > 0``; one tile per pattern else; ``BN`` divides ``BM``, so every query tile's key
    tile on the diagonal starts on a key tile), and share one bias tile, loaded once. The loops: each tile of the
    diagonal, then the share of the batch at that tile; or with ``BATCH_OUTER``, each batch element, then the
    diagonal's tiles (the q, k, v, ``do`` the programs read at once are of fewer batch elements: L2's working set).
    :func:`vitrel.kernels.triton_bias.table_grad_from_tiles` reduces the sums to the table's gradient. No atomics:
    deterministic."""
    tl.static_assert(BM % BN == 0, "the dbias kernel's key tile must divide its query tile")
    which = tl.load(ORDER + tl.program_id(0))
    split = which % n_split
    h = (which // n_split) % H
    pat = which // (n_split * H)
    n_qt = tl.cdiv(N, BM)
    R: tl.constexpr = BM // BN
    if n_m > 0:  # (g_d = gcd(BM, BN) = BN)
        diag = pat // n_m + d_min // BN  # (q0 - k0) / BN
        phase = pat % n_m
        qb_lo = tl.cdiv(tl.maximum(diag, 0), R)  # (k0 >= 0)
        qb_hi = tl.minimum(n_qt, (n_kt - 1 + diag) // R + 1)  # (k0 at most the last key tile's start)
    else:
        qb_lo = pat // n_kt
        qb_hi = qb_lo + 1
        diag = qb_lo * R - pat % n_kt
        phase = 0
    if CAUSAL:  # tiles wholly above the diagonal (k0 >= q0 + BM) hold no visible pair
        qb_hi = tl.where(diag <= -R, qb_lo, qb_hi)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    bias = 0.0
    if HAS_TABLE and TILED:
        bias = _pattern_tile(BT, h, pat, n_pat, BM, BN, False)
    if BATCH_OUTER:
        for b in range(split, B, n_split):
            for qb in range(qb_lo, qb_hi):
                q0 = qb * BM
                k0 = q0 - diag * BN
                if _dbias_visits(TOK, BLK, h, q0, k0, phase, N, GW, n_m, g_m, BM, BN, LAYOUT, HAS_BLOCKS):
                    ds = _dbias_ds(
                        Q, K, V, T, MASK, TOK, DO, LSE, DELTA, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh,
                        sdon, stride_tg, stride_th, stride_mb, n_mask_b, b, h, H, N, P, GH, GW, qk_scale, n_m, q0, k0,
                        bias, D, BLOCK_D, BM, BN, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, RAW,
                    )
                    if (q0 < P) | (k0 < P):  # the pairs with a prefix token have no bias
                        ds = tl.where((q0 + offs_m >= P)[:, None] & (k0 + offs_n >= P)[None, :], ds, 0.0)
                    acc += ds
    else:
        for qb in range(qb_lo, qb_hi):
            q0 = qb * BM
            k0 = q0 - diag * BN
            if _dbias_visits(TOK, BLK, h, q0, k0, phase, N, GW, n_m, g_m, BM, BN, LAYOUT, HAS_BLOCKS):
                tile_acc = tl.zeros([BM, BN], tl.float32)
                for b in range(split, B, n_split):
                    tile_acc += _dbias_ds(
                        Q, K, V, T, MASK, TOK, DO, LSE, DELTA, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh,
                        sdon, stride_tg, stride_th, stride_mb, n_mask_b, b, h, H, N, P, GH, GW, qk_scale, n_m, q0, k0,
                        bias, D, BLOCK_D, BM, BN, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, RAW,
                    )
                # the pairs with a prefix token have no bias (off the other pairs of one image p = 0)
                acc += tl.where((q0 + offs_m >= P)[:, None] & (k0 + offs_n >= P)[None, :], tile_acc, 0.0)
    local = offs_m[:, None] * BN + offs_n[None, :]
    tl.store(DBT + ((split * H + h) * n_pat + pat) * (BM * BN) + local, acc)


@triton.jit
def _dbias_visits(
    TOK, BLK, h, q0, k0, phase, N, GW, n_m, g_m: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    LAYOUT: tl.constexpr, HAS_BLOCKS: tl.constexpr,
):
    """Whether the ``dbias`` kernel sums the tile of queries from ``q0`` and keys from ``k0`` of its diagonal: in
    its pattern's class of ``q0 mod GW`` (``n_m > 1``: with one class or one tile a pattern, every tile of the
    diagonal is), and visible (:func:`_visits`)."""
    ok = q0 >= 0
    if n_m > 1:  # (the remainder only where there are classes: about 20 instructions)
        ok = (q0 % GW) // g_m == phase
    if LAYOUT or HAS_BLOCKS:
        ok = ok & _visits(TOK, BLK, 0, h, k0 + tl.arange(0, BN), 0, 0, q0, k0, N, BM, BN, LAYOUT, HAS_BLOCKS)
    return ok


@triton.jit
def _dbias_ds(
    Q, K, V, T, MASK, TOK, DO, LSE, DELTA, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
    stride_tg, stride_th, stride_mb, n_mask_b, b, h, H, N, P, GH, GW, qk_scale, n_m, q0, k0, bias,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_TABLE: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr, PREC: tl.constexpr, TILED: tl.constexpr,
    RAW: tl.constexpr,
):
    """``dS = p (dp - D)`` of batch ``b``'s tile of queries from ``q0`` and keys from ``k0`` (the ``dbias``
    kernel's)."""
    offs_m = q0 + tl.arange(0, BM)
    offs_n = k0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BLOCK_D)
    rows = _rows(offs_m, N)
    dmask = (offs_d < D)[None, :]
    q = _tile(Q, b, h, sqb, sqh, sqn, rows, offs_d, dmask)
    do = _tile(DO, b, h, sdob, sdoh, sdon, rows, offs_d, dmask)
    lse, delta = _row_stats(LSE, DELTA, b * H + h, N, offs_m)
    k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D)
    s, _ = _logits(
        q, k, b, h, offs_m, offs_n, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, qk_scale, P, N, GH, GW,
        bias, n_m, q0, k0, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, BM, BN, RAW=RAW,
    )
    p = tl.math.exp2(_shift(s, lse[:, None], qk_scale, RAW))
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p * (dp - delta[:, None])


@triton.jit
def _bwd_tile_kernel(
    Q, K, V, T, MASK, TOK, BT, O, DO, LSE, DQ, DK, DV, DBT,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon, stride_tg, stride_th, stride_mb,
    n_mask_b, sgb, sgh, sgn,
    B, H, N, P, GH, GW, qk_scale, sm_scale, n_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr,
    RAW: tl.constexpr, TABLE_GRAD: tl.constexpr,
):
    """The whole backward of a call whose ``N`` tokens fit one ``[BM, BM]`` tile (a batch of Swin's windows, a small
    grid): program ``(split, h)`` takes batch elements ``b = split, split + n_split, ...`` one after another, each
    in one tile: ``D = rowsum(o * do)``, ``dv = p^T do``, ``dk = dS^T q`` and ``dq = dS k`` written whole (each
    program owns its rows: no atomics), and with ``TABLE_GRAD`` the sum of ``dS`` over its share of the batch in
    registers, written once to ``DBT [n_split, H, 1, BM, BM]`` (the ``dbias`` kernel's sums of a call's one tile
    pattern, which :func:`vitrel.kernels.triton_bias.table_grad_from_tiles` reduces on its patch pairs). One launch
    and 5 matrix products a tile, where the ``delta``, ``dkdv``, ``dq`` and ``dbias`` kernels take four launches, 9
    products and read q, k, v and ``do`` three times. The tile is transposed, keys by queries, as the ``dkdv``
    kernel's (``p^T`` and ``dS^T`` feed ``dv`` and ``dk`` as they stand; ``dq`` takes ``dS`` transposed, as the
    ``dkdv`` kernel's atomic ``dq``). ``DQ``, ``DK``, ``DV``: one layout, strides ``sg*`` (one address a store)."""
    split, h, offs, offs_d, dmask, rows, store_mask = _tile_program(N, BM, BLOCK_D, D)
    bias = 0.0
    if HAS_TABLE and TILED:  # (the one tile pattern, exact: read as stored, queries by keys, once)
        bias = tl.trans(_pattern_tile(BT, h, 0, 1, BM, BM, False))
    acc = tl.zeros([BM, BM], tl.float32)  # keys by queries
    for b in range(split, B, n_split):
        at = b * sgb + h * sgh + offs[:, None] * sgn + offs_d[None, :]  # (dq, dk, dv: one layout)
        # each result stored as soon as it is made (fewer registers live at once: no spills at head dim 32, sm_90)
        do = _tile(DO, b, h, sdob, sdoh, sdon, rows, offs_d, dmask[None, :])
        o = _tile(O, b, h, sob, soh, son, rows, offs_d, dmask[None, :])
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (rows past the end: the last row's, p = 0 there)
        # q^T [BLOCK_D, BM], the right operand of k q^T (as the dkdv kernel's)
        qt = tl.load(Q + b * sqb + h * sqh + rows[None, :] * sqn + offs_d[:, None], dmask[:, None], 0.0)
        k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs, offs_d, N, D)
        lse = tl.load(LSE + (b * H + h) * _stats_len(N) + offs)
        s, _ = _logits(  # (n_m 0: the call's one tile pattern is its one exact tile)
            qt, k, b, h, offs, offs, T, stride_tg, stride_th, MASK, stride_mb, n_mask_b, TOK, qk_scale, P, N, GH, GW,
            bias, 0, 0, 0, HAS_TABLE, MASK_KIND, CAUSAL, False, PREC, TILED, BM, BM, True, RAW,
        )
        p = tl.math.exp2(_shift(s, lse[None, :], qk_scale, RAW))
        dv = tl.dot(p.to(do.dtype), do, input_precision=PREC)
        tl.store(DV + at, dv.to(DV.dtype.element_ty), store_mask)
        ds = p * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
        ds_in = ds.to(k.dtype)  # (dS^T in the inputs' type: dk's left operand, and transposed dq's)
        dk = tl.dot(ds_in, tl.trans(qt), input_precision=PREC)
        tl.store(DK + at, (dk * sm_scale).to(DK.dtype.element_ty), store_mask)
        dq = tl.dot(tl.trans(ds_in), k, input_precision=PREC)
        tl.store(DQ + at, (dq * sm_scale).to(DQ.dtype.element_ty), store_mask)
        if TABLE_GRAD:
            acc += ds
    if TABLE_GRAD:  # (its pairs with a prefix token too: the reduction takes the one exact tile's patch pairs only)
        tl.store(DBT + (split * H + h) * (BM * BM) + offs[None, :] * BM + offs[:, None], acc)


@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, sob, soh, son, sdob, sdoh, sdon, H, N,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
):
    """FlashAttention-2's ``D = rowsum(o * do)`` in float32 (``DELTA [B, H, NP]``: 0 on the padding rows,
    :func:`_stats_len`) of ``BM`` query rows of batch and head ``program_id(0)`` (the backward's first kernel, as the
    tutorial's preprocess: one read of ``o`` and ``do``, where ``(o.float() * do.float()).sum(-1)`` wrote and read
    them in float32)."""
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < N)[:, None] & (offs_d < D)[None, :]
    o = _tile(O, bh // H, bh % H, sob, soh, son, offs_m, offs_d, mask)
    do = _tile(DO, bh // H, bh % H, sdob, sdoh, sdon, offs_m, offs_d, mask)
    tl.store(DELTA + bh * _stats_len(N) + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1))


@triton.jit
def _table_grad_kernel(DBT, SRC, PTR, DT, H, P, T, n_split, BLOCK: tl.constexpr):
    """The table's gradient ``DT [H, T]`` (float32) from the ``dbias`` kernel's sums ``DBT [n_split, H, P]`` (``P``
    entries of the bias tiles a head, :func:`vitrel.kernels.triton_bias.table_grad_from_tiles`): entry ``e`` of the
    table is the sum of ``DBT[s, h, SRC[p]]`` over the batch shares ``s`` and ``PTR[e] <= p < PTR[e + 1]`` (the tile
    entries at that offset, by target: a CSR index made once per shape). ``BLOCK`` table entries of head
    ``program_id(1)`` a program, each summed in one fixed order: deterministic, no atomics, one launch (it replaced
    27 tensor operators, each a launch and its host work)."""
    h = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < T
    start = tl.load(PTR + offs, mask=inside, other=0)
    count = tl.load(PTR + offs + 1, mask=inside, other=0) - start
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, n_split):
        base = DBT + (s * H + h).to(tl.int64) * P
        for j in range(0, tl.max(count, 0)):
            on = j < count
            src = tl.load(SRC + start + j, mask=on, other=0)
            acc += tl.load(base + src, mask=on, other=0.0)
    tl.store(DT + h * T + offs, acc, mask=inside)


__all__ = [
    "LOG2E", "_fwd_kernel", "_fwd_tile_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_dbias_kernel",
    "_bwd_tile_kernel", "_bwd_delta_kernel", "_table_grad_kernel",
]
