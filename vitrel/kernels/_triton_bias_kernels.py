"""Triton kernels of fused attention with a relative-position bias read by offset (``attn_impl="triton"``).

FlashAttention-2's algorithm (forward with online softmax, backward in two kernels: ``dk, dv`` per key block,
``dq`` per query block), after Triton's fused-attention tutorial, with one addition: the bias

    bias[h, i, j] = T[h, r_i - r_j + GH - 1, c_i - c_j + GW - 1]     (patch pairs; pairs with a prefix token: 0)

is read per tile from the offset table ``T [heads, 2 GH - 1, 2 GW - 1]`` with the offsets computed from token
indices (``r = (t - P) // GW``, ``c = (t - P) % GW``), and its gradient is reduced in the ``dq`` kernel without an
``N x N`` tensor and without atomics:

With patch indices ``i' = i - P`` in raster order, ``i' - j' = (r_i - r_j) GW + (c_i - c_j)``: the flattened
offset is a 1-D (Toeplitz) offset ``d = i - j`` once the pairs are split by whether ``c_i >= c_j``
(``dw >= 0``: ``dh = floor(d / GW)``, ``dw = d mod GW``; else ``dh = floor(d / GW) + 1``, ``dw = d mod GW - GW``).
So ``dT`` is two diagonal sums of ``dS`` (one per case), and a tile's diagonal sums are one register gather
(the skew of the founding notes: a diagonal becomes a column) and a column sum. Each ``dq`` program owns one slot
per key block for these sums (it loops over a share of the batch, adding into its own slots); the slots are
reduced by deterministic tensor sums afterwards (:func:`vitrel.kernels.triton_bias.table_grad`), so two runs are
bitwise equal.

Every kernel reads the tile's logits through :func:`_logits` (the one place the bias, the window mask and the
causal mask are applied), in base 2 (``LOG2E`` folded in, as the tutorial).
"""

from __future__ import annotations

# the kernels' long argument lists stay packed (ruff format would put one per line)
# fmt: off
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _coords(offs, P, N, GW):
    """Patch flags, rows and columns of token indices ``offs`` (prefix and out-of-range tokens: not patches)."""
    p = offs - P
    patch = (p >= 0) & (offs < N)
    p = tl.where(patch, p, 0)
    return patch, p // GW, p % GW


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
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    return bh // H, bh % H, bh, offs, offs_d, (offs < N)[:, None] & (offs_d < D)[None, :]


@triton.jit
def _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D):
    """The key and value rows ``offs_n`` of batch ``b``, head ``h``."""
    kv_mask = (offs_n < N)[:, None] & (offs_d < D)[None, :]
    k = _tile(K, b, h, skb, skh, skn, offs_n, offs_d, kv_mask)
    return k, _tile(V, b, h, svb, svh, svn, offs_n, offs_d, kv_mask)


@triton.jit
def _row_stats(LSE, DELTA, bh, N, offs):
    """The forward's log-sum-exp and the backward's ``D = rowsum(o * do)`` of query rows ``offs``."""
    return tl.load(LSE + bh * N + offs, offs < N, 0.0), tl.load(DELTA + bh * N + offs, offs < N, 0.0)


@triton.jit
def _logits(
    q, k, b, h, offs_m, offs_n, T, stride_th, MASK, stride_mb, n_mask_b, qk_scale, P, N, GH, GW,
    HAS_TABLE: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """Base-2 logits of a ``[BM, BN]`` tile, ``-inf`` where masked (out of range, causal, the table's or the mask's
    ``-inf``), and the tile's patch-pair flags (where the bias applies). ``T`` and ``MASK`` come multiplied by
    ``LOG2E`` (:mod:`vitrel.kernels.triton_bias` does it once per call)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    qpatch, rq, cq = _coords(offs_m, P, N, GW)
    kpatch, rk, ck = _coords(offs_n, P, N, GW)
    pair = qpatch[:, None] & kpatch[None, :]
    if HAS_TABLE:  # T pre-scaled by LOG2E; the flat offset index is a row term minus a column term
        row = T + h * stride_th + (rq + GH - 1) * (2 * GW - 1) + cq + GW - 1
        s += tl.load(row[:, None] - (rk * (2 * GW - 1) + ck)[None, :], mask=pair, other=0.0)
    inside = (offs_m < N)[:, None] & (offs_n < N)[None, :]
    if HAS_MASK:
        mptr = MASK + (b % n_mask_b) * stride_mb + offs_m[:, None] * N + offs_n[None, :]
        s += tl.load(mptr, mask=inside, other=0.0)
    valid = inside | (offs_m >= N)[:, None]  # (rows past the end: harmless, their loads are zeros)
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    return tl.where(valid, s, float("-inf")), pair


@triton.jit
def _fwd_kernel(
    Q, K, V, T, MASK, O, LSE,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, stride_th, stride_mb, n_mask_b,
    H, N, P, GH, GW, qk_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    b, h, bh, offs_m, offs_d, q_mask = _program(H, N, BM, BLOCK_D, D)
    q = _tile(Q, b, h, sqb, sqh, sqn, offs_m, offs_d, q_mask)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BLOCK_D], tl.float32)
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, tl.program_id(0) * BM + BM)
    for start_n in range(0, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D)
        s, _ = _logits(
            q, k, b, h, offs_m, offs_n, T, stride_th, MASK, stride_mb, n_mask_b, qk_scale, P, N, GH, GW, HAS_TABLE,
            HAS_MASK, CAUSAL, PREC,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty), q_mask)
    tl.store(LSE + bh * N + offs_m, m_safe + tl.math.log2(l_safe), offs_m < N)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, T, MASK, DO, LSE, DELTA, DK, DV,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_th, stride_mb, n_mask_b,
    sgb, sgh, sgn, shb, shh, shn,
    H, N, P, GH, GW, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_TABLE: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """``dk``, ``dv`` of one key block (``DK``, ``DV`` ``[B, H, N, D]`` with strides ``sg*``, ``sh*``)."""
    b, h, bh, offs_n, offs_d, kv_mask = _program(H, N, BN, BLOCK_D, D)
    dmask = offs_d < D
    k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D)
    dk = tl.zeros([BN, BLOCK_D], tl.float32)
    dv = tl.zeros([BN, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (tl.program_id(0) * BN // BM) * BM
    for start_m in range(lo, N, BM):
        offs_m = start_m + tl.arange(0, BM)
        q_mask = (offs_m < N)[:, None] & dmask[None, :]
        q = _tile(Q, b, h, sqb, sqh, sqn, offs_m, offs_d, q_mask)
        do = _tile(DO, b, h, sdob, sdoh, sdon, offs_m, offs_d, q_mask)
        lse, delta = _row_stats(LSE, DELTA, bh, N, offs_m)
        s, _ = _logits(
            q, k, b, h, offs_m, offs_n, T, stride_th, MASK, stride_mb, n_mask_b, qk_scale, P, N, GH, GW, HAS_TABLE,
            HAS_MASK, CAUSAL, PREC,
        )
        p = tl.math.exp2(s - lse[:, None])
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    dk_ptr = DK + b * sgb + h * sgh + offs_n[:, None] * sgn + offs_d[None, :]
    tl.store(dk_ptr, (dk * sm_scale).to(DK.dtype.element_ty), kv_mask)
    dv_ptr = DV + b * shb + h * shh + offs_n[:, None] * shn + offs_d[None, :]
    tl.store(dv_ptr, dv.to(DV.dtype.element_ty), kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, T, MASK, DO, LSE, DELTA, DQ, SLOTS,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, stride_th, stride_mb, n_mask_b,
    sgb, sgh, sgn,
    B, H, N, P, GH, GW, qk_scale, sm_scale, n_split, n_kb,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BM: tl.constexpr,
    HAS_TABLE: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, TABLE_GRAD: tl.constexpr,
    PREC: tl.constexpr,
):
    """``dq`` of one query block for a share of the batch (``b = split, split + n_split, ...``), and the table
    gradient's diagonal sums of ``dS`` per key block into this program's slots
    ``SLOTS [n_split, H, n_qb, n_kb, 2, 2 BM]`` (slot ``[case, e]``: the pairs with ``c_i >= c_j`` (case 0) or
    ``c_i < c_j`` (case 1) at ``(i - i0) - (j - j0) = e - BM + 1``). Square tiles (``BN = BM``)."""
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
    _, _, cq = _coords(offs_m, P, N, GW)
    slot_row = SLOTS + ((split * H + h) * n_qb + pid_m) * n_kb * 2 * E
    hi = N
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BM)
    for b in range(split, B, n_split):
        bh = b * H + h
        q = _tile(Q, b, h, sqb, sqh, sqn, offs_m, offs_d, q_mask)
        do = _tile(DO, b, h, sdob, sdoh, sdon, offs_m, offs_d, q_mask)
        lse, delta = _row_stats(LSE, DELTA, bh, N, offs_m)
        dq = tl.zeros([BM, BLOCK_D], tl.float32)
        for start_n in range(0, hi, BM):
            offs_n = start_n + tl.arange(0, BM)
            k, v = _kv(K, V, b, h, skb, skh, skn, svb, svh, svn, offs_n, offs_d, N, D)
            s, pair = _logits(
                q, k, b, h, offs_m, offs_n, T, stride_th, MASK, stride_mb, n_mask_b, qk_scale, P, N, GH, GW,
                HAS_TABLE, HAS_MASK, CAUSAL, PREC,
            )
            p = tl.math.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
            if TABLE_GRAD:
                _, _, ck = _coords(offs_n, P, N, GW)
                ds = tl.where(pair, ds, 0.0)
                right = cq[:, None] >= ck[None, :]  # dw >= 0 (case 0) or not (case 1)
                r0 = tl.gather(tl.where(right, ds, 0.0), jj, axis=1)
                r1 = tl.gather(tl.where(right, 0.0, ds), jj, axis=1)
                # slot index of i - j = d is d + BM - 1: the lower diagonals at e + BM - 1, the upper at e - 1
                sp = slot_row + (start_n // BM) * 2 * E + e
                up = e >= 1
                tl.store(sp + BM - 1, tl.load(sp + BM - 1) + tl.sum(tl.where(lower, r0, 0.0), axis=0))
                tl.store(sp - 1, tl.load(sp - 1, mask=up) + tl.sum(tl.where(lower, 0.0, r0), axis=0), mask=up)
                sp1 = sp + E
                tl.store(sp1 + BM - 1, tl.load(sp1 + BM - 1) + tl.sum(tl.where(lower, r1, 0.0), axis=0))
                tl.store(sp1 - 1, tl.load(sp1 - 1, mask=up) + tl.sum(tl.where(lower, 0.0, r1), axis=0), mask=up)
        dq_ptr = DQ + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_d[None, :]
        tl.store(dq_ptr, (dq * sm_scale).to(DQ.dtype.element_ty), q_mask)


__all__ = ["LOG2E", "_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]
