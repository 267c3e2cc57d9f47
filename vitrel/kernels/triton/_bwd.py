"""The backward kernels over key and query tiles (FlashAttention-2's, after a preprocess ``D = rowsum(o * do)``):
``dk, dv`` per key block (tiles transposed, keys by queries, as Triton's tutorial), ``dq`` per query block.

The ``dq`` kernel also reduces the table's gradient without an ``N x N`` tensor or atomics (``TABLE_GRAD``):
``DIAGONALS`` (the bias gathered per score) sums ``dS`` by diagonals into slots of its own, as the offset
``i - j`` splits by whether ``c_i >= c_j`` into two Toeplitz diagonals; ``TILE_SUMS`` (the bias read as tiles, one
pattern a tile) adds each tile's ``dS`` to its pattern's sum. Deterministic, unless ``ATOMIC_DQ`` (``dq`` added by
the ``dkdv`` kernel's atomics, as FlashAttention-2 does).
"""

from __future__ import annotations

# fmt: off
import triton
import triton.language as tl

from vitrel.kernels.triton._jit import (
    _bias_tile,
    _block_lanes,
    _kv,
    _logits,
    _out,
    _row_stats,
    _rows,
    _shift,
    _span,
    _stats_len,
    _tile,
    _tile_loop,
    _tile_start,
    _tile_t,
    _tokens,
    _visits,
)

#: the ``dq`` kernel's table-gradient modes (``TABLE_GRAD``)
DIAGONALS = tl.constexpr(1)
TILE_SUMS = tl.constexpr(2)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, DK, DV, DQ, sq, sv, sdo, n_mask_b,
    H, N, geo, qk_scale, sm_scale, patterns, g_d: tl.constexpr, g_m: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    """``dk``, ``dv`` of key block ``program_id(0)`` of batch and head ``program_id(1)``; with ``ATOMIC_DQ`` each
    tile's part of ``dq`` added by atomics into float32 ``DQ`` (not bitwise repeatable)."""
    P, GH, GW = geo
    n_pat, d_min, n_m = patterns
    b, h, bh = tl.program_id(1) // H, tl.program_id(1) % H, tl.program_id(1)
    offs_n, offs_d, kv_mask = _block_lanes(N, BN, BLOCK_D, D)
    dmask = offs_d < D
    k, v = _kv(K, V, b, h, sq, sv, offs_n, offs_d, N, D)
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
            # q^T [BLOCK_D, BM], the right operand of k q^T (as the tutorial)
            qt = _tile_t(Q, b, h, sq, rows, offs_d, dmask[:, None])
            do = _tile(DO, b, h, sdo, rows, offs_d, dmask[None, :])
            lse, delta = _row_stats(LSE, DELTA, bh, N, offs_m)
            bias = _bias_tile(
                BT, h, start_m, tl.program_id(0) * BN, N, GW, n_pat, d_min, g_d, n_m, g_m, HAS_TABLE, TILED, BM, BN,
            )
            if HAS_TABLE and TILED:  # (read as stored, queries by keys: transposed in shared memory)
                bias = tl.trans(bias)
            s, _ = _logits(
                qt, k, b, h, offs_m, offs_n, T, MASK, n_mask_b, TOK, qk_scale, H, P, N, GH, GW, bias, n_m, start_m,
                tl.program_id(0) * BN, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, BM, BN, True, RAW,
            )
            p = tl.math.exp2(_shift(s, lse[None, :], qk_scale, RAW))
            dv += tl.dot(p.to(do.dtype), do, input_precision=PREC)
            dp = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds = p * (dp - delta[None, :])
            dk += tl.dot(ds.to(qt.dtype), tl.trans(qt), input_precision=PREC)
            if ATOMIC_DQ:
                dq = tl.dot(tl.trans(ds.to(k.dtype)), k, input_precision=PREC) * sm_scale
                dq_mask = (offs_m < N)[:, None] & dmask[None, :]
                tl.atomic_add(_out(DQ, b, h, H, N, offs_m, offs_d, D), dq, mask=dq_mask, sem="relaxed")
    tl.store(_out(DK, b, h, H, N, offs_n, offs_d, D), (dk * sm_scale).to(DK.dtype.element_ty), kv_mask)
    tl.store(_out(DV, b, h, H, N, offs_n, offs_d, D), dv.to(DV.dtype.element_ty), kv_mask)


@triton.jit
def _scatter_rows(ds, SCR, SLOT, TOK, b, pid_m, offs_n, N, GH, GW, BM: tl.constexpr):
    """Add a tile's ``dS`` into this program's slots ``SLOT [G (2 GH - 1) (2 GW - 1)]`` at each pair's group and
    offset on a token layout: one row at a time through the scratch ``SCR [BM, BM]`` (no collisions in a row)."""
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
    Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, DQ, DT, SCRATCH, sq, sv, sdo, n_mask_b,
    B, N, geo, qk_scale, sm_scale, patterns, g_d: tl.constexpr, g_m: tl.constexpr, slot_size,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, TABLE_GRAD: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr,
):
    """``dq`` of query block ``program_id(0)``, head ``program_id(1)`` of ``H``, for the batch share ``program_id(2)``
    of ``n_split`` (the grid's sizes), and the table gradient's sums into ``DT``: ``DIAGONALS``, slots ``[n_split, H,
    n_qb, slot_size]`` (on a full grid ``[n_kb, 2, 2 BM]`` per program, by case and diagonal; on a layout the whole
    table, :func:`_scatter_rows`); ``TILE_SUMS``, the bias tiles' sums ``[n_split, H, n_pat, BM, BN]``."""
    tl.static_assert(BN == BM or TABLE_GRAD != DIAGONALS)
    P, GH, GW = geo
    n_pat, d_min, n_m = patterns
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_qb, H, n_split = tl.num_programs(0), tl.num_programs(1), tl.num_programs(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q_mask = (offs_m < N)[:, None] & dmask[None, :]
    E: tl.constexpr = 2 * BM
    # the skew: column e of row i reads key j = (i - e) mod BM, so a diagonal becomes a column
    e = tl.arange(0, BM)
    ii = tl.arange(0, BM)[:, None]
    jj = (ii - e[None, :] + BM) % BM
    lower = ii >= e[None, :]
    _, _, cq, _, _ = _tokens(TOK, 0, offs_m, P, N, GW, False)
    program = (split * H + h) * n_qb + pid_m
    slot_row = DT + program * slot_size
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BM)
    for b in range(split, B, n_split):
        q = _tile(Q, b, h, sq, offs_m, offs_d, q_mask)
        do = _tile(DO, b, h, sdo, offs_m, offs_d, q_mask)
        lse, delta = _row_stats(LSE, DELTA, b * H + h, N, offs_m)
        dq = tl.zeros([BM, BLOCK_D], tl.float32)
        lo, hi_seg = _span(TOK, b, offs_m, N, LAYOUT)
        row, first, last = _tile_loop(BLK, h, pid_m, n_qb, tl.cdiv(N, BN), 0, hi, HAS_BLOCKS)
        for j in range(first, last, 1 if HAS_BLOCKS else BN):
            start_n = _tile_start(row, j, BN, HAS_BLOCKS)
            offs_n = start_n + tl.arange(0, BN)
            if _visits(TOK, BLK, b, h, offs_n, lo, hi_seg, pid_m * BM, start_n, N, BM, BN, LAYOUT, False):
                k, v = _kv(K, V, b, h, sq, sv, offs_n, offs_d, N, D)
                bias = _bias_tile(
                    BT, h, pid_m * BM, start_n, N, GW, n_pat, d_min, g_d, n_m, g_m, HAS_TABLE, TILED, BM, BN,
                    MASK_KIND != 1,  # (not with a float mask: it then spills)
                )
                s, pair = _logits(
                    q, k, b, h, offs_m, offs_n, T, MASK, n_mask_b, TOK, qk_scale, H, P, N, GH, GW, bias, n_m,
                    pid_m * BM, start_n, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, BM, BN, RAW=RAW,
                )
                p = tl.math.exp2(_shift(s, lse[:, None], qk_scale, RAW))
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)
                ds = p * (dp - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
                if TABLE_GRAD == TILE_SUMS:  # (its pattern: (q0 / BM) n_kt + k0 / BN)
                    pat = pid_m * tl.cdiv(N, BN) + start_n // BN
                    slot = DT + (((split * H + h) * n_pat + pat) * BM) * BN
                    slot += tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
                    tl.store(slot, tl.load(slot) + ds)
                if TABLE_GRAD == DIAGONALS:
                    ds = tl.where(pair, ds, 0.0)
                    if LAYOUT:
                        _scatter_rows(ds, SCRATCH + program * BM * BM, slot_row, TOK, b, pid_m, offs_n, N, GH, GW, BM)
                    else:
                        _, _, ck, _, _ = _tokens(TOK, b, offs_n, P, N, GW, False)
                        right = cq[:, None] >= ck[None, :]  # dw >= 0 (case 0) or not (case 1)
                        r0 = tl.gather(tl.where(right, ds, 0.0), jj, axis=1)
                        r1 = tl.gather(tl.where(right, 0.0, ds), jj, axis=1)
                        # slot of i - j = d is d + BM - 1: the lower diagonals at e + BM - 1, the upper at e - 1
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
        tl.store(_out(DQ, b, h, H, N, offs_m, offs_d, D), (dq * sm_scale).to(DQ.dtype.element_ty), q_mask)


@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, sdo, H, N, D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr):
    """``D = rowsum(o * do)`` in float32 of ``BM`` query rows of batch and head ``program_id(0)`` (0 on padding)."""
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < N)[:, None] & (offs_d < D)[None, :]
    o = tl.load(_out(O, bh // H, bh % H, H, N, offs_m, offs_d, D), mask, 0.0)
    do = _tile(DO, bh // H, bh % H, sdo, offs_m, offs_d, mask)
    tl.store(DELTA + bh * _stats_len(N) + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1))
