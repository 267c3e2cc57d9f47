"""The Triton kernels of :mod:`vitrel.kernels.triton.rope`: the rotation of q and k, forward and backward.

Every program takes a tile of ``BN`` tokens of one head and a share of the batch (``b = split, split + n_split,
...``), and rotates the queries and the keys of each of its batch elements (one launch for both). ``q`` and ``k``
share their strides ``(sxb, sxh, sxn)`` (views of one ``qkv`` projection: no copy), outputs and output gradients
theirs ``(sob, soh, son)``; the head dim is contiguous. Tables are read through strides ``(stb, sth, stn)``, 0 on an
axis the table does not have (no batch axis: shared by the images; no head axis: shared by the heads). The
arithmetic is in the tables' dtype (float32, or float64 for float64 inputs).

* pairs: ``y = P_h x`` (STRING's basis, ``HAS_BASIS``) or ``y = x``; pair ``t`` of token ``n``
  ``o_2t = y_2t c - y_2t+1 s``, ``o_2t+1 = y_2t s + y_2t+1 c`` with ``c, s = C[n, t], S[n, t]``.
* blocks: ``o_r = sum_j R[n, r, j] x_{(r // bs) bs + j}`` (``R[n, m, i, j]`` flattened: ``r = m bs + i``).

Backward: the transposed rotation, and the gradients of the tables (summed over the program's batch share into a
slot of its own, or stored per batch element for a table with a batch axis) and of the basis (per program slot).
"""

from __future__ import annotations

import triton
import triton.language as tl


# ---------------------------------------------------------------------------------------------------- pairs
@triton.jit
def _pairs_in(X, base, offs_n, offs_t, offs_d, mn, mt, sxn, pe, po, D: tl.constexpr, HAS_BASIS: tl.constexpr,
              PREC: tl.constexpr, dt):  # fmt: skip
    """The rotation's input ``y`` (``P_h x`` or ``x``) as its even and odd channels ``[BN, BH]`` each, and ``x``."""
    if HAS_BASIS:
        md = offs_d < D
        x = tl.load(X + base + offs_n[:, None] * sxn + offs_d[None, :], mask=mn[:, None] & md[None, :], other=0.0)
        x = x.to(dt)
        y0 = tl.dot(x, tl.trans(pe), input_precision=PREC, out_dtype=dt)
        y1 = tl.dot(x, tl.trans(po), input_precision=PREC, out_dtype=dt)
    else:
        m2 = mn[:, None] & mt[None, :]
        ptr = X + base + offs_n[:, None] * sxn + 2 * offs_t[None, :]
        x = tl.load(ptr, mask=m2, other=0.0).to(dt)
        y0 = x
        y1 = tl.load(ptr + 1, mask=m2, other=0.0).to(dt)
    return y0, y1, x


@triton.jit
def _basis_rows(P, h, offs_t, offs_d, mt, D: tl.constexpr, dt):
    """STRING's ``P_h`` rows ``2t`` and ``2t + 1``, ``[BH, BD]`` each."""
    m = mt[:, None] & (offs_d < D)[None, :]
    ptr = P + h * D * D + (2 * offs_t)[:, None] * D + offs_d[None, :]
    return tl.load(ptr, mask=m, other=0.0).to(dt), tl.load(ptr + D, mask=m, other=0.0).to(dt)


@triton.jit
def _pairs_tile(P, pid_n, h, N, sth, stn, son, D: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr,
                BD: tl.constexpr, HAS_BASIS: tl.constexpr, dt):  # fmt: skip
    """A program's tokens ``offs_n``, pairs ``offs_t``, channels ``offs_d``, their masks, ``P_h``'s rows, and the
    offsets of its table entries (head ``h``) and of its even channels in a row of the output."""
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_t = tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    mn, mt = offs_n < N, offs_t < D // 2
    pe, po = offs_t, offs_t  # placeholders without a basis
    if HAS_BASIS:
        pe, po = _basis_rows(P, h, offs_t, offs_d, mt, D, dt)
    t_off = h * sth + offs_n[:, None] * stn + offs_t[None, :]
    o_off = offs_n[:, None] * son + 2 * offs_t[None, :]
    return offs_n, offs_t, offs_d, mn, mt, mn[:, None] & mt[None, :], pe, po, t_off, o_off


@triton.jit
def _pairs_fwd_kernel(Q, K, OQ, OK, C, S, P, sxb, sxh, sxn, sob, soh, son, stb, sth, stn, B, N, n_split,
                      D: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, HAS_BASIS: tl.constexpr,
                      PREC: tl.constexpr):  # fmt: skip
    pid_n, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dt = C.dtype.element_ty
    offs_n, offs_t, offs_d, mn, mt, m2, pe, po, t_off, o_off = _pairs_tile(
        P, pid_n, h, N, sth, stn, son, D, BN, BH, BD, HAS_BASIS, dt
    )
    for b in range(split, B, n_split):
        c, s = tl.load(C + b * stb + t_off, mask=m2, other=0.0), tl.load(S + b * stb + t_off, mask=m2, other=0.0)
        base, base_o = b * sxb + h * sxh, b * sob + h * soh
        for which in tl.static_range(2):  # the queries, then the keys
            X = Q if which == 0 else K
            O = OQ if which == 0 else OK
            y0, y1, x = _pairs_in(X, base, offs_n, offs_t, offs_d, mn, mt, sxn, pe, po, D, HAS_BASIS, PREC, dt)
            ty = O.dtype.element_ty
            tl.store(O + base_o + o_off, (y0 * c - y1 * s).to(ty), mask=m2)
            tl.store(O + base_o + o_off + 1, (y0 * s + y1 * c).to(ty), mask=m2)


@triton.jit
def _pairs_bwd_kernel(Q, K, GQ, GK, DQ, DK, C, S, P, DC, DS, DP, sxb, sxh, sxn, sob, soh, son, stb, sth, stn, sgs,
                      sgh, sgn, B, H, N, n_split, n_tiles, D: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr,
                      BD: tl.constexpr, HAS_BASIS: tl.constexpr, TABLE_BATCH: tl.constexpr, NEED_DT: tl.constexpr,
                      NEED_DP: tl.constexpr, NEED_X: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``dq, dk`` (contiguous like ``q``), the tables' gradients ``DC, DS [slots, H, N, D/2]`` (``sgs, sgh, sgn`` their
    strides; slot ``b`` with ``TABLE_BATCH``, else ``split``) and the basis's ``DP [n_split, H, n_tiles, D, D]``.
    ``NEED_X``: q and k are read (``NEED_DT`` or ``NEED_DP``; a fixed rotation's backward reads the gradients only)."""
    pid_n, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dt = C.dtype.element_ty
    offs_n, offs_t, offs_d, mn, mt, m2, pe, po, t_off, o_off = _pairs_tile(
        P, pid_n, h, N, sth, stn, son, D, BN, BH, BD, HAS_BASIS, dt
    )
    md = offs_d < D
    acc_c = tl.zeros([BN, BH], dtype=dt)
    acc_s = tl.zeros([BN, BH], dtype=dt)
    acc_pe = tl.zeros([BH, BD], dtype=dt)
    acc_po = tl.zeros([BH, BD], dtype=dt)
    g_off = h * sgh + offs_n[:, None] * sgn + offs_t[None, :]
    for b in range(split, B, n_split):
        c, s = tl.load(C + b * stb + t_off, mask=m2, other=0.0), tl.load(S + b * stb + t_off, mask=m2, other=0.0)
        base, base_o = b * sxb + h * sxh, b * sob + h * soh
        dc = tl.zeros([BN, BH], dtype=dt)
        ds = tl.zeros([BN, BH], dtype=dt)
        for which in tl.static_range(2):
            X = Q if which == 0 else K
            G = GQ if which == 0 else GK
            DX = DQ if which == 0 else DK
            if NEED_X:
                y0, y1, x = _pairs_in(X, base, offs_n, offs_t, offs_d, mn, mt, sxn, pe, po, D, HAS_BASIS, PREC, dt)
            g0 = tl.load(G + base_o + o_off, mask=m2, other=0.0).to(dt)
            g1 = tl.load(G + base_o + o_off + 1, mask=m2, other=0.0).to(dt)
            gy0 = g0 * c + g1 * s  # the transposed rotation
            gy1 = g1 * c - g0 * s
            if NEED_DT:
                dc += g0 * y0 + g1 * y1
                ds += g1 * y0 - g0 * y1
            ty = DX.dtype.element_ty
            if HAS_BASIS:  # dx = P_h^T gy; dP_h += gy x^T
                dx = tl.dot(gy0, pe, input_precision=PREC, out_dtype=dt)
                dx += tl.dot(gy1, po, input_precision=PREC, out_dtype=dt)
                mx = mn[:, None] & md[None, :]
                tl.store(DX + base_o + offs_n[:, None] * son + offs_d[None, :], dx.to(ty), mask=mx)
                if NEED_DP:
                    acc_pe += tl.dot(tl.trans(gy0), x, input_precision=PREC, out_dtype=dt)
                    acc_po += tl.dot(tl.trans(gy1), x, input_precision=PREC, out_dtype=dt)
            else:
                tl.store(DX + base_o + o_off, gy0.to(ty), mask=m2)
                tl.store(DX + base_o + o_off + 1, gy1.to(ty), mask=m2)
        if NEED_DT:
            if TABLE_BATCH:
                tl.store(DC + b * sgs + g_off, dc, mask=m2)
                tl.store(DS + b * sgs + g_off, ds, mask=m2)
            else:
                acc_c += dc
                acc_s += ds
    if NEED_DT and not TABLE_BATCH:
        tl.store(DC + split * sgs + g_off, acc_c, mask=m2)
        tl.store(DS + split * sgs + g_off, acc_s, mask=m2)
    if HAS_BASIS and NEED_DP:
        mp = mt[:, None] & md[None, :]
        ptr = DP + ((split * H + h) * n_tiles + pid_n) * D * D + (2 * offs_t)[:, None] * D + offs_d[None, :]
        tl.store(ptr, acc_pe, mask=mp)
        tl.store(ptr + D, acc_po, mask=mp)


# --------------------------------------------------------------------------------------------------- blocks
@triton.jit
def _block_offsets(offs_n, N, D: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, BB: tl.constexpr):
    """Channel ``r`` and block column ``j`` of ``[BN, BD, BB]`` tiles: ``R[n, r, j]``'s offset ``r BS + j`` in its
    row, the channel ``(r // BS) BS + j`` it reads, and the mask."""
    offs_r = tl.arange(0, BD)
    offs_j = tl.arange(0, BB)
    rj = offs_r[:, None] * BS + offs_j[None, :]
    col = (offs_r // BS * BS)[:, None] + offs_j[None, :]
    m3 = (offs_n < N)[:, None, None] & ((offs_r < D)[:, None] & (offs_j < BS)[None, :])[None, :, :]
    return offs_r, offs_j, rj, col, m3


@triton.jit
def _blocks_fwd_kernel(Q, K, OQ, OK, R, sxb, sxh, sxn, sob, soh, son, stb, sth, stn, B, N, n_split, D: tl.constexpr,
                       BS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BB: tl.constexpr):  # fmt: skip
    pid_n, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_r, offs_j, rj, col, m3 = _block_offsets(offs_n, N, D, BS, BD, BB)
    mo = (offs_n < N)[:, None] & (offs_r < D)[None, :]
    dt = R.dtype.element_ty
    for b in range(split, B, n_split):
        r = tl.load(R + b * stb + h * sth + offs_n[:, None, None] * stn + rj[None], mask=m3, other=0.0)
        base, base_o = b * sxb + h * sxh, b * sob + h * soh
        for which in tl.static_range(2):
            X = Q if which == 0 else K
            O = OQ if which == 0 else OK
            x = tl.load(X + base + offs_n[:, None, None] * sxn + col[None], mask=m3, other=0.0).to(dt)
            o = tl.sum(r * x, axis=2)
            tl.store(O + base_o + offs_n[:, None] * son + offs_r[None, :], o.to(O.dtype.element_ty), mask=mo)


@triton.jit
def _blocks_bwd_kernel(Q, K, GQ, GK, DQ, DK, R, DR, sxb, sxh, sxn, sob, soh, son, stb, sth, stn, sgs, sgh, sgn, B, N,
                       n_split, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BB: tl.constexpr,
                       TABLE_BATCH: tl.constexpr, NEED_DT: tl.constexpr):  # fmt: skip
    """``dx_c = sum_i R[n, (c // BS) BS + i, c mod BS] g_{(c // BS) BS + i}``;
    ``dR[n, r, j] = g_r x_{(r // BS) BS + j}`` into ``DR [slots, H, N, D BS]`` (strides ``sgs, sgh, sgn``)."""
    pid_n, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_r, offs_j, rj, col, m3 = _block_offsets(offs_n, N, D, BS, BD, BB)
    rt = col * BS + (offs_r % BS)[:, None]  # R[n, (c // BS) BS + i, c mod BS] for channel c = r and i = j
    mo = (offs_n < N)[:, None] & (offs_r < D)[None, :]
    dt = R.dtype.element_ty
    acc = tl.zeros([BN, BD, BB], dtype=dt)
    for b in range(split, B, n_split):
        r_t = tl.load(R + b * stb + h * sth + offs_n[:, None, None] * stn + rt[None], mask=m3, other=0.0)
        base, base_o = b * sxb + h * sxh, b * sob + h * soh
        dr = tl.zeros([BN, BD, BB], dtype=dt)
        for which in tl.static_range(2):
            X = Q if which == 0 else K
            G = GQ if which == 0 else GK
            DX = DQ if which == 0 else DK
            gg = tl.load(G + base_o + offs_n[:, None, None] * son + col[None], mask=m3, other=0.0).to(dt)
            dx = tl.sum(r_t * gg, axis=2)
            tl.store(DX + base_o + offs_n[:, None] * son + offs_r[None, :], dx.to(DX.dtype.element_ty), mask=mo)
            if NEED_DT:
                g = tl.load(G + base_o + offs_n[:, None] * son + offs_r[None, :], mask=mo, other=0.0).to(dt)
                x = tl.load(X + base + offs_n[:, None, None] * sxn + col[None], mask=m3, other=0.0).to(dt)
                dr += g[:, :, None] * x
        if NEED_DT:
            if TABLE_BATCH:
                tl.store(DR + b * sgs + h * sgh + offs_n[:, None, None] * sgn + rj[None], dr, mask=m3)
            else:
                acc += dr
    if NEED_DT and not TABLE_BATCH:
        tl.store(DR + split * sgs + h * sgh + offs_n[:, None, None] * sgn + rj[None], acc, mask=m3)
