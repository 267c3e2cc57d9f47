"""The forward kernels: FlashAttention-2's online softmax over key tiles (``_fwd_kernel``), and a one-tile forward
for calls whose tokens fit one tile (``_fwd_tile_kernel``: a share of the batch a program, Swin's windows)."""

from __future__ import annotations

# fmt: off
import triton
import triton.language as tl

from vitrel.kernels.triton._jit import (
    STATS_ROWS,
    _bias_tile,
    _kv,
    _logits,
    _out,
    _pattern_tile,
    _program,
    _shift,
    _span,
    _stats_len,
    _tile,
    _tile_loop,
    _tile_program,
    _tile_start,
    _visits,
)


@triton.jit
def _fwd_kernel(
    Q, K, V, T, MASK, TOK, BLK, BT, O, LSE, sq, sv, n_mask_b, H, N, geo, qk_scale, patterns, g_d: tl.constexpr,
    g_m: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr, TMA: tl.constexpr,
    ONE: tl.constexpr,
):
    """The output and the rows' log-sum-exp of one query tile. ``TMA``: keys and values read through tensor
    descriptors; ``ONE``: the call's keys are one tile, so the softmax needs no rescaling."""
    P, GH, GW = geo
    n_pat, d_min, n_m = patterns
    b, h, bh, offs_m, offs_d, q_mask = _program(H, N, BM, BLOCK_D, D)
    q = _tile(Q, b, h, sq, offs_m, offs_d, q_mask)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_D], tl.float32)
    lo, hi_seg = _span(TOK, b, offs_m, N, LAYOUT)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, tl.program_id(0) * BM + BM)
    row, first, last = _tile_loop(BLK, h, tl.program_id(0), tl.cdiv(N, BM), tl.cdiv(N, BN), 0, hi, HAS_BLOCKS)
    if HAS_BLOCKS:  # a query tile with no visible key tile visits an invisible one: all -inf
        last = tl.maximum(last, 1)
    # the loop runs at least once: a zero-trip path made ptxas serialize the products (its note C7515)
    tl.assume(last > first)
    if TMA:  # (the batch: this launch's share)
        n_b = tl.num_programs(1) // H
        k_desc = tl.make_tensor_descriptor(K, [n_b, H, N, D], [sq[0], sq[1], sq[2], 1], [1, 1, BN, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V, [n_b, H, N, D], [sv[0], sv[1], sv[2], 1], [1, 1, BN, BLOCK_D])
    for j in range(first, last, 1 if HAS_BLOCKS else BN):
        start_n = _tile_start(row, j, BN, HAS_BLOCKS)
        offs_n = start_n + tl.arange(0, BN)
        if _visits(TOK, BLK, b, h, offs_n, lo, hi_seg, tl.program_id(0) * BM, start_n, N, BM, BN, LAYOUT, False):
            if TMA:
                k = k_desc.load([b, h, start_n, 0]).reshape(BN, BLOCK_D)
                v = v_desc.load([b, h, start_n, 0]).reshape(BN, BLOCK_D)
            else:
                k, v = _kv(K, V, b, h, sq, sv, offs_n, offs_d, N, D)
            bias = _bias_tile(
                BT, h, tl.program_id(0) * BM, start_n, N, GW, n_pat, d_min, g_d, n_m, g_m, HAS_TABLE, TILED, BM, BN,
                True,
            )
            s, _ = _logits(
                q, k, b, h, offs_m, offs_n, T, MASK, n_mask_b, TOK, qk_scale, H, P, N, GH, GW, bias, n_m,
                tl.program_id(0) * BM, start_n, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, BM, BN, RAW=RAW,
            )
            m_i, l_i, acc = _online_softmax(s, m_i, l_i, acc, v, qk_scale, RAW, ONE, PREC)
    _fwd_store(O, LSE, acc, m_i, l_i, b, h, bh, H, offs_m, offs_d, q_mask, N, D, BM)


@triton.jit
def _online_softmax(s, m_i, l_i, acc, v, qk_scale, RAW: tl.constexpr, ONE: tl.constexpr, PREC: tl.constexpr):
    """One key tile's step: the rows' running maximum ``m_i``, sum ``l_i`` and output ``acc`` updated."""
    if RAW:  # (the maximum of the unscaled logits, scaled: qk_scale > 0)
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
def _fwd_store(O, LSE, acc, m_i, l_i, b, h, bh, H, offs_m, offs_d, q_mask, N, D: tl.constexpr, BM: tl.constexpr):
    """The output rows and their base-2 log-sum-exp (+inf past the end and on the padding rows)."""
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(_out(O, b, h, H, N, offs_m, offs_d, D), out.to(O.dtype.element_ty), q_mask)
    tl.static_assert(STATS_ROWS % BM == 0, "a query tile must divide STATS_ROWS")
    lse_row = LSE + bh * _stats_len(N)
    tl.store(lse_row + offs_m, tl.where(offs_m < N, m_safe + tl.math.log2(l_safe), float("inf")))
    if tl.program_id(0) == tl.num_programs(0) - 1:  # the padding rows past the last query tile's
        for r in range((tl.program_id(0) + 1) * BM, _stats_len(N), BM):
            tl.store(lse_row + r + tl.arange(0, BM), tl.full([BM], float("inf"), tl.float32))


@triton.jit
def _fwd_tile_kernel(
    Q, K, V, T, MASK, TOK, BT, O, LSE, sq, sv, n_mask_b, B, H, N, geo, qk_scale, n_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr,
    RAW: tl.constexpr,
):
    """The forward of a call whose ``N`` tokens fit one ``[BM, BM]`` tile: program ``(split, h)`` takes batch
    elements ``split, split + n_split, ...``, each one tile with no rescaling; the bias tile loaded once."""
    P, GH, GW = geo
    split, h, offs, offs_d, dmask, rows, out_mask = _tile_program(N, BM, BLOCK_D, D)
    tl.static_assert(STATS_ROWS % BM == 0, "a query tile must divide STATS_ROWS")
    bias = 0.0
    if HAS_TABLE and TILED:  # (the one tile pattern, exact)
        bias = _pattern_tile(BT, h, 0, 1, BM, BM, True)
    for b in range(split, B, n_split):
        q = _tile(Q, b, h, sq, rows, offs_d, dmask[None, :])  # (rows past the end: the last row's)
        k, v = _kv(K, V, b, h, sq, sv, offs, offs_d, N, D)
        s, _ = _logits(  # (n_m 0: the call's one tile pattern is its one exact tile)
            q, k, b, h, offs, offs, T, MASK, n_mask_b, TOK, qk_scale, H, P, N, GH, GW, bias, 0, 0, 0,
            HAS_TABLE, MASK_KIND, CAUSAL, False, PREC, TILED, BM, BM, RAW=RAW,
        )
        if RAW:
            m = tl.max(s, 1) * qk_scale
        else:
            m = tl.max(s, 1)
        m = tl.where(m == float("-inf"), 0.0, m)  # rows with nothing visible
        p = tl.math.exp2(_shift(s, m[:, None], qk_scale, RAW))
        l_sum = tl.sum(p, 1)
        l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
        out = tl.dot(p.to(v.dtype), v, input_precision=PREC) / l_sum[:, None]
        tl.store(_out(O, b, h, H, N, offs, offs_d, D), out.to(O.dtype.element_ty), out_mask)
        lse_row = LSE + (b * H + h) * STATS_ROWS  # (N <= BM: one padded block of rows)
        tl.store(lse_row + offs, tl.where(offs < N, m + tl.math.log2(l_sum), float("inf")))
        for r in tl.static_range(BM, STATS_ROWS, BM):  # the padding rows past the tile
            tl.store(lse_row + r + offs, tl.full([BM], float("inf"), tl.float32))
