"""Launch planning: the kernels, grids and arguments of one call, forward and backward, from its tensors and a
:class:`~vitrel.kernels.triton.config.KernelConfig`."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from vitrel.device_cache import per_device
from vitrel.kernels.triton.config import KernelConfig, block_dim
from vitrel.kernels.triton.device import interpreter_on
from vitrel.kernels.triton.launch import Launch
from vitrel.kernels.triton.patterns import (
    STATS_ROWS,
    TilePatterns,
    bias_tiles,
    dbias_order,
    stats_len,
    tile_dtype,
    tile_flags,
    tile_lists,
    tile_patterns,
    triton_cdiv,
)  # fmt: skip

__all__ = ["BIAS_READS", "LOG2E", "Backward", "bwd_launches", "fwd_launch", "same_layout", "tma_reads"]

LOG2E = 1.4426950408889634
#: how the kernels read a full grid's bias: ``auto`` (tiles where they fit, else gathered), ``tiles``, ``gather``
BIAS_READS = ("auto", "tiles", "gather")
#: the ``dq`` kernel's table-gradient modes (its ``TABLE_GRAD``): none, by diagonals, by tile pattern
NO_SUMS, DIAGONALS, TILE_SUMS = 0, 1, 2
#: the constexpr flags the one-tile kernels take (no token layout, no tile lists)
_TILE_FLAGS = ("D", "BLOCK_D", "HAS_TABLE", "MASK_KIND", "CAUSAL", "TILED", "PREC", "RAW")


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(*ts: Tensor) -> list[tuple[int, int, int]]:
    """Each ``[B, H, N, D]`` tensor's strides as the kernels take them: one tuple ``(batch, head, token)``."""
    out = []
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError("rel_bias_attention: the head dim must be contiguous")
        out.append((t.stride(0), t.stride(1), t.stride(2)))
    return out


def _pattern_args(tiling) -> list:
    """The kernels' ``patterns = (n_pat, d_min, n_m)``, ``g_d``, ``g_m`` from :func:`_tile_args`' tiling."""
    _, n_pat, d_min, g_d, n_m, g_m = tiling
    return [(n_pat, d_min, n_m), g_d, g_m]


@per_device(maxsize=32)
def _placeholder(dtype: torch.dtype, dims: int, device: torch.device) -> Tensor:
    """A zero of ``dims`` dimensions that a kernel takes for an input it does not read."""
    return torch.zeros((1,) * dims, device=device, dtype=dtype)


def _table_arg(table: Tensor | None, q: Tensor, memo: dict | None) -> Tensor:
    """The table in base 2 (as the kernels' logits), or a placeholder; made once per call with ``memo``."""
    if table is None:
        return _placeholder(torch.float32, 1, q.device)
    t = None if memo is None else memo.get("table")
    if t is None:
        t = table * LOG2E
        if memo is not None:
            memo["table"] = t
    return t


def _int_args(t: Tensor | None, q: Tensor) -> Tensor:
    """``t`` (a layout's tokens, the visible-tile flags), or a placeholder."""
    return _placeholder(torch.int32, 1, q.device) if t is None else t


def tma_reads(k: Tensor, v: Tensor, block_d: int, cuda: bool) -> bool:
    """Whether the forward reads ``k`` and ``v`` through tensor descriptors: a device with them (compute capability 9
    or above, the interpreter, or with ``cuda`` the GPU :func:`plan` plans for) and tensors as they need (unit stride
    on the head dim, other strides and addresses multiples of 16 bytes, tile rows of at least 16 bytes)."""
    if k.device.type == "cuda":
        if torch.cuda.get_device_capability(k.device)[0] < 9:
            return False
    elif not (cuda or interpreter_on()):
        return False
    for t in (k, v):
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]):
            return False
    return block_d * k.element_size() >= 16


def _tile_args(table, tokens, bias_read: str, grid_h, grid_w, prefix, n, tm, tw, q, config: KernelConfig, memo):
    """``(tiles, n_kt, n_pat, d_min, g_d, n_m, g_m)``: the bias tiles of the base-2 ``table`` on a full grid where
    ``bias_read`` takes them and they fit the budget, else a placeholder and ``n_pat = 0`` (gathered per score)."""
    if table is not None and tokens is None and bias_read != "gather":
        pat = tile_patterns(grid_w, n, tm, tw)
        dtype = tile_dtype(q.dtype)
        size = table.shape[0] * pat.n_pat * tm * tw * dtype.itemsize
        if size <= config.tile_budget_bytes:
            key = ("tiles", tm, tw, dtype)
            if memo is not None and key in memo:
                return memo[key], *pat
            tiles = bias_tiles(table, grid_h, grid_w, prefix, pat, tm, tw).to(dtype)
            if memo is not None:
                memo[key] = tiles
            return tiles, *pat
        if bias_read == "tiles":
            raise ValueError(f"bias_read='tiles': {pat.n_pat} tile patterns take {size} bytes, above the budget")
    return _placeholder(torch.float32, 1, q.device), 0, 0, 0, 1, 0, 1


def _pick_tile(tiles: list, table, tokens, bias_read: str, grid_h, grid_w, prefix, n, q, config, memo):
    """``(BM, BN, bias tiles, tiling)``: the first of ``tiles`` (a kernel's own, then the square one) whose bias is
    read whole, else the last one's."""
    for bm, bn in tiles:
        read = "auto" if (bm, bn) != tiles[-1] and bias_read == "tiles" else bias_read
        bt, *tiling = _tile_args(table, tokens, read, grid_h, grid_w, prefix, n, bm, bn, q, config, memo)
        if table is None or tiling[1] > 0:
            break
    return bm, bn, bt, tiling


def _mask_args(mask: Tensor | None, q: Tensor) -> tuple[Tensor, int, int]:
    """The kernels' ``MASK`` (a float mask in base 2, or region ids), its rows and ``MASK_KIND``."""
    if mask is None:
        return _placeholder(torch.float32, 1, q.device), 1, 0
    if not mask.is_floating_point():
        return mask, mask.shape[0], 2
    return mask * LOG2E, mask.shape[0], 1


def _constexprs(d, block_d, table, mask_kind, causal, tokens, blocks, tiling, dtype, scale) -> dict:
    """The ``constexpr`` flags every kernel takes; ``RAW``: no table, no float mask and a positive scale, so the
    logits are scaled as the softmax subtracts."""
    return dict(
        D=d, BLOCK_D=block_d, HAS_TABLE=table is not None, MASK_KIND=mask_kind, CAUSAL=causal,
        LAYOUT=tokens is not None, HAS_BLOCKS=blocks is not None, TILED=tiling[1] > 0, PREC=_prec(dtype),
        RAW=table is None and mask_kind != 1 and scale > 0,
    )  # fmt: skip


def _n_split(programs: int, heads: int, batch: int, sms: int | None) -> int:
    """Batch shares: enough programs to fill ``sms`` multiprocessors (4 each), at most the batch; 2 in the
    interpreter (``sms`` None)."""
    if sms is None:
        return min(batch, 2)
    return max(1, min(batch, math.ceil(4 * sms / (programs * heads))))


def same_layout(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """``q`` and ``k`` in one layout (the kernels read both through ``q``'s strides): as they are where they share
    it (views of one ``qkv``), else contiguous."""
    same = all(a == b or size == 1 for a, b, size in zip(q.stride(), k.stride(), q.shape))
    return (q, k) if same else (q.contiguous(), k.contiguous())


def fwd_launch(
    q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read, out, lse, sms,
    config: KernelConfig, memo=None,
) -> Launch:  # fmt: skip
    """The forward's launch writing ``out`` and ``lse`` (``sms``: the device's multiprocessors, None in the
    interpreter): the one-tile forward where the call's tokens fit its tile, else a program per query tile."""
    b, h, n, d = q.shape
    cuda = sms is not None
    block_d = block_dim(d)
    t = _table_arg(table, q, memo)
    tab = None if table is None else t
    m, nmb, mask_kind = _mask_args(mask, q)
    strides = [*_strides(q, v), nmb]
    geo = (prefix, grid_h, grid_w)
    if tokens is None and n <= config.fwd_one_tile_max:
        blk = config.bwd_tile
        bt, *tiling = _tile_args(tab, None, bias_read, grid_h, grid_w, prefix, n, blk, blk, q, config, memo)
        n_split = _n_split(1, h, b, sms)
        flags = _constexprs(d, block_d, table, mask_kind, causal, None, None, tiling, q.dtype, scale)
        return Launch.make(
            "fwd_tile", (n_split, h),
            [q, k, v, t, m, _int_args(None, q), bt, out, lse, *strides, b, h, n, geo, scale * LOG2E, n_split],
            {**{name: flags[name] for name in _TILE_FLAGS}, "BM": blk}, config.fwd_one_tile.options(),
        )  # fmt: skip
    bm, bn = config.fwd_tile
    bt, *tiling = _tile_args(tab, tokens, bias_read, grid_h, grid_w, prefix, n, bm, bn, q, config, memo)
    visits = tile_lists(tile_flags(blocks, bm, bn, causal))  # the key tiles each query tile visits
    positional = [
        q, k, v, t, m, _int_args(tokens, q), _int_args(visits, q), bt, out, lse, *strides, h, n, geo, scale * LOG2E,
        *_pattern_args(tiling),
    ]  # fmt: skip
    flags = _constexprs(d, block_d, table, mask_kind, causal, tokens, blocks, tiling, q.dtype, scale)
    tma = triton_cdiv(n, bn) >= config.tma_min_tiles and tma_reads(k, v, block_d, cuda)
    one = triton_cdiv(n, bn) == 1  # (the loop's one visit: no rescaling)
    consts = dict(**flags, BM=bm, BN=bn, TMA=tma, ONE=one)
    return Launch.make("fwd", (triton_cdiv(n, bm), b * h), positional, consts, config.fwd.options())


class Backward(NamedTuple):
    """The backward's launches (``delta`` first) or its one launch (``tile``), and what they write: ``dq, dk, dv``
    (``dq`` in float32 where the ``dkdv`` kernel adds it by atomics), the table gradient's diagonal sums
    (``slots``) or its sums per tile pattern (``dbt``, of ``patterns``)."""

    delta: Launch | None
    dkdv: Launch | None
    dq: Launch | None
    dbias: Launch | None
    grads: tuple[Tensor, Tensor, Tensor]
    slots: Tensor | None
    dbt: Tensor | None
    patterns: TilePatterns
    blk: int
    tile: Launch | None = None


@per_device(maxsize=64)
def _dbias_order(pat: TilePatterns, n: int, tm: int, tw: int, grid_w: int, causal: bool, heads: int, n_split: int,
                 device) -> Tensor:  # fmt: skip
    """:func:`~vitrel.kernels.triton.patterns.dbias_order` of a call's patterns, made once per shape and device."""
    return dbias_order(pat.tiles(n, tm, tw, grid_w, causal, device), heads, n_split)


def bwd_launches(
    do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic,
    table_grad, sms, config: KernelConfig, memo=None,
) -> Backward:  # fmt: skip
    """The backward's launches. Not ``deterministic`` (and :func:`torch.use_deterministic_algorithms` not set), the
    ``dkdv`` kernel adds ``dq`` by atomics and no ``dq`` kernel runs, unless that kernel sums the table gradient's
    diagonals (gathered bias, token layouts)."""
    b, h, n, d = q.shape
    block_d, blk = block_dim(d), config.bwd_tile
    do = do if do.stride(-1) == 1 else do.contiguous()  # (read through its strides, as q, k, v)
    out = out.contiguous()  # (the kernels read o as the forward wrote it)
    t = _table_arg(table, q, memo)
    tab = None if table is None else t
    m, nmb, mask_kind = _mask_args(mask, q)
    tok = _int_args(tokens, q)
    bt, *tiling = _tile_args(tab, tokens, bias_read, grid_h, grid_w, prefix, n, blk, blk, q, config, memo)
    qk_scale = scale * LOG2E

    def consts(til):  # the constexpr flags of a launch with the bias tiling til
        return _constexprs(d, block_d, table, mask_kind, causal, tokens, blocks, til, q.dtype, scale)

    flags = consts(tiling)
    grad_t = table_grad and table is not None
    strides = [*_strides(q, v, do), nmb]
    sizes = [h, n, (prefix, grid_h, grid_w), qk_scale, scale]
    if tokens is None and n <= config.bwd_one_tile_max and (flags["TILED"] or not grad_t):
        inputs = [q, k, v, t, m, tok, bt, out, do, lse]
        return _tile_bwd_launch(inputs, strides, sizes, flags, grad_t, TilePatterns(*tiling), sms, blk, config)
    delta = torch.empty(b, h, stats_len(n), device=q.device, dtype=torch.float32)  # rowsum(o * do), FA-2's D
    delta_launch = Launch.make(
        "delta", (b * h, stats_len(n) // STATS_ROWS), [out, do, delta, *_strides(do), h, n],
        dict(D=d, BLOCK_D=block_d, BM=STATS_ROWS), config.delta.options(),
    )  # fmt: skip
    dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the fakes
    visible = tile_flags(blocks, blk, blk, causal)  # dbias reads them; dq its rows listed
    opts = config.bwd.options()
    made: dict = {}  # a kernel's own tile -> _pick_tile's (dq and dbias share theirs)

    def pick(kernel: str):
        """``(BM, BN, bias tiles, tiling, visible-tile flags, options)`` of ``kernel``: its own tile where the bias
        is read whole or there is none, else the square one."""
        wide = config.wide_tile(kernel) if tokens is None and mask_kind == 0 else None
        if wide is None:
            return blk, blk, bt, tiling, visible, opts
        if wide not in made:
            made[wide] = _pick_tile([wide, (blk, blk)], tab, tokens, bias_read, grid_h, grid_w, prefix, n, q, config,
                                    memo)  # fmt: skip
        tm, tw, bias, til = made[wide]
        if (tm, tw) == (blk, blk):
            return blk, blk, bias, til, visible, opts
        return tm, tw, bias, til, tile_flags(blocks, tm, tw, causal), config.wide.options()

    def inputs(tiles, bias=bt):  # (BLK: which tiles a kernel visits)
        return [q, k, v, t, m, tok, _int_args(tiles, q), bias, do, lse, delta]

    dm, dn, bt_kv, tiling_kv, kv_visible, opts_kv = pick("dkdv")
    by_cols = tile_lists(None if kv_visible is None else kv_visible.transpose(1, 2))
    by_tiles = grad_t and flags["TILED"]  # the table's gradient by tile pattern, else by the dq kernel's diagonals
    diagonals = grad_t and not by_tiles
    atomic = not (deterministic or torch.are_deterministic_algorithms_enabled() or diagonals)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic else q.new_empty(q.shape)
    dkdv = Launch.make(
        "dkdv", (triton_cdiv(n, dn), b * h),
        [*inputs(by_cols, bt_kv), dk, dv, dq if atomic else _placeholder(q.dtype, 4, q.device), *strides, *sizes,
         *_pattern_args(tiling_kv)],
        dict(**consts(tiling_kv), BM=dm, BN=dn, ATOMIC_DQ=atomic), opts_kv,
    )  # fmt: skip
    qm, qn, bt_q, tiling_q, q_visible, opts_q = (blk, blk, bt, tiling, visible, opts)
    if not (diagonals or atomic):
        qm, qn, bt_q, tiling_q, q_visible, opts_q = pick("dq")
    n_b = triton_cdiv(n, qm)
    n_split = _n_split(n_b, h, b, sms)
    # the dq kernel sums the bias tiles' gradient where each of its tiles is one pattern (else the dbias kernel)
    in_dq = by_tiles and not atomic and tiling_q[1] > 0 and tiling_q[4] == 0
    mode = DIAGONALS if diagonals else TILE_SUMS if in_dq else NO_SUMS
    scratch = _placeholder(torch.float32, 1, q.device)
    # per program: a full grid's diagonal sums per key block (n_b x 2 cases x 2 blk), a layout's whole table
    slot_size = (table.numel() // h if tokens is not None else n_b * 4 * blk) if diagonals else 0
    if diagonals:
        sums = torch.zeros(n_split, h, n_b, slot_size, device=q.device, dtype=torch.float32)
        if tokens is not None:
            scratch = torch.empty(n_split * h * n_b * blk * blk, device=q.device)
    elif in_dq:
        sums = torch.zeros(n_split, h, tiling_q[1], qm, qn, device=q.device, dtype=torch.float32)
    else:
        sums = _placeholder(torch.float32, 1, q.device)
    dq_launch = None if atomic else Launch.make(
        "dq", (n_b, h, n_split),
        [*inputs(tile_lists(q_visible), bt_q), dq, sums, scratch, *strides, b, *sizes[1:], *_pattern_args(tiling_q),
         slot_size],  # (its heads and batch shares: its grid's)
        dict(**consts(tiling_q), BM=qm, BN=qn, TABLE_GRAD=mode), opts_q,
    )  # fmt: skip
    dbias = dbt = None
    tiling_t = tiling
    if in_dq:
        dbt, tiling_t = sums, tiling_q
    elif by_tiles:
        tm, tw, bt_t, tiling_t, t_visible, opts_t = pick("dbias")
        n_pat = tiling_t[1]
        split_t = _n_split(n_pat, h, b, sms)
        dbt = torch.empty(split_t, h, n_pat, tm, tw, device=q.device, dtype=torch.float32)  # each program writes
        order = _dbias_order(TilePatterns(*tiling_t), n, tm, tw, grid_w, causal, h, split_t, q.device)
        dbias = Launch.make(
            "dbias", (n_pat * h * split_t,),
            [*inputs(t_visible, bt_t), order, dbt, *strides, b, *sizes[:4], *_pattern_args(tiling_t), split_t],
            dict(**consts(tiling_t), BM=tm, BN=tw), opts_t,
        )  # fmt: skip
    slots = sums if diagonals else None
    return Backward(delta_launch, dkdv, dq_launch, dbias, (dq, dk, dv), slots, dbt, TilePatterns(*tiling_t), blk)


def _tile_bwd_launch(inputs, strides, sizes, flags, grad_t, pat, sms, blk, config: KernelConfig) -> Backward:
    """The one-tile backward of a call of at most ``blk`` tokens: programs ``(share, head)``, one per batch element,
    or where it sums the table's gradient, :func:`_n_split`'s shares."""
    q, k, v = inputs[:3]
    b, h = q.shape[:2]
    n_split = _n_split(1, h, b, sms) if grad_t else b
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # (one contiguous layout)
    dbt = torch.empty(n_split, h, 1, blk, blk, device=q.device, dtype=torch.float32) if grad_t else None
    warps = config.bwd_one_tile if grad_t else config.bwd_one_tile_each
    launch = Launch.make(
        "tile", (n_split, h),
        [*inputs, dq, dk, dv, dbt if grad_t else _placeholder(torch.float32, 1, q.device), *strides, b, *sizes,
         n_split],
        {**{name: flags[name] for name in _TILE_FLAGS}, "BM": blk, "TABLE_GRAD": grad_t}, warps.options(),
    )  # fmt: skip
    return Backward(None, None, None, None, (dq, dk, dv), None, dbt, pat, blk, launch)
