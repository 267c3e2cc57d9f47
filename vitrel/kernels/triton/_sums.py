"""Kernels that sum over a share of the batch: the bias tiles' gradient per tile pattern (``dbias``), the whole
backward of a call that fits one tile (``tile``), and the table's gradient from either's sums (``table_grad``).
Each program writes its own sums once: no atomics, deterministic."""

from __future__ import annotations

# fmt: off
import triton
import triton.language as tl

from vitrel.kernels.triton._jit import (
    _kv,
    _logits,
    _out,
    _pattern_tile,
    _row_stats,
    _rows,
    _shift,
    _stats_len,
    _tile,
    _tile_program,
    _tile_t,
    _visits,
)


@triton.jit
def _bwd_dbias_kernel(
    Q, K, V, T, MASK, TOK, BLK, BT, DO, LSE, DELTA, ORDER, DBT, sq, sv, sdo, n_mask_b,
    B, H, N, geo, qk_scale, patterns, g_d: tl.constexpr, g_m: tl.constexpr, n_split,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr, RAW: tl.constexpr,
):
    """Program ``(pat, h, split)`` (read from ``ORDER``, the longest patterns first) sums ``dS`` over the ``[BM, BN]``
    tiles of pattern ``pat`` (a block diagonal, in its class of ``q0 mod GW`` where ``n_m > 0``) and its share of the
    batch in registers, zero at the pairs with a prefix token, and writes it once to ``DBT [n_split, H, n_pat, BM,
    BN]``."""
    tl.static_assert(BM % BN == 0, "the dbias kernel's key tile must divide its query tile")
    P, GH, GW = geo
    n_pat, d_min, n_m = patterns
    which = tl.load(ORDER + tl.program_id(0))
    split = which % n_split
    h = (which // n_split) % H
    pat = which // (n_split * H)
    n_qt = tl.cdiv(N, BM)
    n_kt = tl.cdiv(N, BN)
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
    if CAUSAL:  # tiles wholly above the diagonal hold no visible pair
        qb_hi = tl.where(diag <= -R, qb_lo, qb_hi)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    bias = 0.0
    if HAS_TABLE and TILED:
        bias = _pattern_tile(BT, h, pat, n_pat, BM, BN, False)
    for qb in range(qb_lo, qb_hi):
        q0 = qb * BM
        k0 = q0 - diag * BN
        if _dbias_visits(TOK, BLK, h, q0, k0, phase, N, GW, n_m, g_m, BM, BN, LAYOUT, HAS_BLOCKS):
            tile_acc = tl.zeros([BM, BN], tl.float32)
            for b in range(split, B, n_split):
                tile_acc += _dbias_ds(
                    Q, K, V, T, MASK, TOK, DO, LSE, DELTA, sq, sv, sdo, n_mask_b, b, h, H, N, P, GH, GW, qk_scale,
                    n_m, q0, k0, bias, D, BLOCK_D, BM, BN, HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, RAW,
                )
            # the pairs with a prefix token have no bias
            acc += tl.where((q0 + offs_m >= P)[:, None] & (k0 + offs_n >= P)[None, :], tile_acc, 0.0)
    local = offs_m[:, None] * BN + offs_n[None, :]
    tl.store(DBT + ((split * H + h) * n_pat + pat) * (BM * BN) + local, acc)


@triton.jit
def _dbias_visits(
    TOK, BLK, h, q0, k0, phase, N, GW, n_m, g_m: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    LAYOUT: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
):
    """Whether the ``dbias`` kernel sums the tile at ``(q0, k0)`` of its diagonal: in its class, and visible."""
    ok = q0 >= 0
    if n_m > 1:
        ok = (q0 % GW) // g_m == phase
    if LAYOUT or HAS_BLOCKS:
        ok = ok & _visits(TOK, BLK, 0, h, k0 + tl.arange(0, BN), 0, 0, q0, k0, N, BM, BN, LAYOUT, HAS_BLOCKS)
    return ok


@triton.jit
def _dbias_ds(
    Q, K, V, T, MASK, TOK, DO, LSE, DELTA, sq, sv, sdo, n_mask_b, b, h, H, N, P, GH, GW, qk_scale, n_m, q0, k0, bias,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, HAS_TABLE: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LAYOUT: tl.constexpr, PREC: tl.constexpr, TILED: tl.constexpr,
    RAW: tl.constexpr,
):
    """``dS = p (dp - D)`` of batch ``b``'s tile at ``(q0, k0)``."""
    offs_m = q0 + tl.arange(0, BM)
    offs_n = k0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BLOCK_D)
    rows = _rows(offs_m, N)
    dmask = (offs_d < D)[None, :]
    q = _tile(Q, b, h, sq, rows, offs_d, dmask)
    do = _tile(DO, b, h, sdo, rows, offs_d, dmask)
    lse, delta = _row_stats(LSE, DELTA, b * H + h, N, offs_m)
    k, v = _kv(K, V, b, h, sq, sv, offs_n, offs_d, N, D)
    s, _ = _logits(
        q, k, b, h, offs_m, offs_n, T, MASK, n_mask_b, TOK, qk_scale, H, P, N, GH, GW, bias, n_m, q0, k0,
        HAS_TABLE, MASK_KIND, CAUSAL, LAYOUT, PREC, TILED, BM, BN, RAW=RAW,
    )
    p = tl.math.exp2(_shift(s, lse[:, None], qk_scale, RAW))
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p * (dp - delta[:, None])


@triton.jit
def _bwd_tile_kernel(
    Q, K, V, T, MASK, TOK, BT, O, DO, LSE, DQ, DK, DV, DBT, sq, sv, sdo, n_mask_b,
    B, H, N, geo, qk_scale, sm_scale, n_split, D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
    HAS_TABLE: tl.constexpr, MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, TILED: tl.constexpr, PREC: tl.constexpr,
    RAW: tl.constexpr, TABLE_GRAD: tl.constexpr,
):
    """The whole backward of a call whose ``N`` tokens fit one ``[BM, BM]`` tile: program ``(split, h)`` takes batch
    elements ``split, split + n_split, ...`` one after another (``D``, ``dv``, ``dk``, ``dq`` written whole; keys by
    queries), and with ``TABLE_GRAD`` writes the sum of ``dS`` over its share to ``DBT [n_split, H, 1, BM, BM]``."""
    P, GH, GW = geo
    split, h, offs, offs_d, dmask, rows, store_mask = _tile_program(N, BM, BLOCK_D, D)
    bias = 0.0
    if HAS_TABLE and TILED:  # (the one tile pattern, exact: read as stored, queries by keys, once)
        bias = tl.trans(_pattern_tile(BT, h, 0, 1, BM, BM, False))
    acc = tl.zeros([BM, BM], tl.float32)  # keys by queries
    for b in range(split, B, n_split):
        at = ((b * H + h) * N + offs[:, None]) * D + offs_d[None, :]  # (dq, dk, dv: one contiguous layout)
        # each result stored as soon as it is made (fewer registers live at once)
        do = _tile(DO, b, h, sdo, rows, offs_d, dmask[None, :])
        o = tl.load(_out(O, b, h, H, N, rows, offs_d, D), dmask[None, :], 0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (rows past the end: the last row's, p = 0 there)
        qt = _tile_t(Q, b, h, sq, rows, offs_d, dmask[:, None])
        k, v = _kv(K, V, b, h, sq, sv, offs, offs_d, N, D)
        lse = tl.load(LSE + (b * H + h) * _stats_len(N) + offs)
        s, _ = _logits(  # (n_m 0: the call's one tile pattern is its one exact tile)
            qt, k, b, h, offs, offs, T, MASK, n_mask_b, TOK, qk_scale, H, P, N, GH, GW, bias, 0, 0, 0,
            HAS_TABLE, MASK_KIND, CAUSAL, False, PREC, TILED, BM, BM, True, RAW,
        )
        p = tl.math.exp2(_shift(s, lse[None, :], qk_scale, RAW))
        dv = tl.dot(p.to(do.dtype), do, input_precision=PREC)
        tl.store(DV + at, dv.to(DV.dtype.element_ty), store_mask)
        ds = p * (tl.dot(v, tl.trans(do), input_precision=PREC) - delta[None, :])
        ds_in = ds.to(k.dtype)
        dk = tl.dot(ds_in, tl.trans(qt), input_precision=PREC)
        tl.store(DK + at, (dk * sm_scale).to(DK.dtype.element_ty), store_mask)
        dq = tl.dot(tl.trans(ds_in), k, input_precision=PREC)
        tl.store(DQ + at, (dq * sm_scale).to(DQ.dtype.element_ty), store_mask)
        if TABLE_GRAD:
            acc += ds
    if TABLE_GRAD:  # (its prefix pairs too: the reduction takes the exact tile's patch pairs only)
        tl.store(DBT + (split * H + h) * (BM * BM) + offs[None, :] * BM + offs[:, None], acc)


@triton.jit
def _table_grad_kernel(DBT, SRC, PTR, DT, H, P, T, n_split, BLOCK: tl.constexpr):
    """The table's gradient ``DT [H, T]`` from the sums ``DBT [n_split, H, P]``: entry ``e`` sums ``DBT[s, h,
    SRC[p]]`` over the shares and ``PTR[e] <= p < PTR[e + 1]``, in one fixed order."""
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
