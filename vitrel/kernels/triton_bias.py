"""Fused attention with a relative-position bias read from its offset table, forward and backward in Triton.

``rel_bias_attention(q, k, v, table, ...)`` computes, for ``q, k, v [B, heads, N, d]`` on an ``GH x GW`` grid after
``P`` prefix tokens (raster order),

    out = softmax(q k^T * scale + bias + mask) v,    bias[h, i, j] = T[h, r_i - r_j + GH - 1, c_i - c_j + GW - 1]

(patch pairs; 0 for pairs with a prefix token), with ``mask`` an optional additive float mask ``[Mb, N, N]``
(batch ``b`` reads ``mask[b % Mb]``), or instead ``regions`` ``[Mb, N]`` (integers: a token attends to the tokens of
its region only, computed in the kernel; a batch of windows' layout, Swin's shifted windows) and ``causal`` the keys
after the query masked
(blocks above the diagonal skipped). Nothing ``N x N`` is stored; the backward returns ``dq, dk, dv`` and the
table's gradient ``dT``, reduced in the kernel (:mod:`vitrel.kernels._triton_bias_kernels`), deterministic.

It is a torch custom op (``torch.ops.vitrel.rel_bias_attention``) with its autograd formula and fake (meta)
implementations, so ``torch.compile`` captures it as one node. The kernels run on CUDA, or on CPU tensors through
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before this module is first used (the tests do so);
on CPU without it, :func:`check_device` says so.
"""

from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from vitrel.kernels.flex import OffsetTableKernel
from vitrel.kernels.registry import register_kernel
from vitrel.pos.tokens import TokenLayout

if TYPE_CHECKING:
    from vitrel.pos.geometry import Grid

__all__ = [
    "TilePatterns",
    "TritonKernel",
    "check_device",
    "compile_for",
    "compile_kernel",
    "interpreter_on",
    "layout_tokens",
    "visible_tiles",
    "rel_bias_attention",
    "table_grad_from_slots",
    "tile_patterns",
    "bias_tiles",
]

#: (BM, BN) of the forward, and the square tile of the backward, by head dim; the interpreter takes 16
#: (small tiles keep its per-element work small and exercise several blocks at small sizes)
_FWD_BLOCKS = {16: (64, 64), 32: (64, 64), 64: (64, 64), 128: (64, 32)}
_BWD_BLOCK = {16: 64, 32: 64, 64: 64, 128: 32}


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(device: torch.device) -> None:
    """Raise unless the Triton kernels can run on ``device``: CUDA, or CPU with ``TRITON_INTERPRET=1``."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreter_on():
        return
    raise ValueError(
        f"attn_impl='triton' runs Triton kernels on CUDA; on {device.type} tensors it needs Triton's interpreter: "
        "set TRITON_INTERPRET=1 in the environment before starting Python (slow: for tests at small sizes), or use "
        "attn_impl='sdpa' on this device"
    )


@functools.cache
def _kernels():
    from vitrel.kernels import _triton_bias_kernels as triton_bias_kernels

    if interpreter_on():
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton.language had been imported (torch.export and torch.compile "
                "import it), so Triton's own functions are not interpreted: set TRITON_INTERPRET=1 in the environment "
                "before starting Python"
            )
    return triton_bias_kernels


#: launch options (``num_warps``, ``num_stages``) of the forward and of the backward kernels on CUDA
LAUNCH = {"fwd": {"num_warps": 4, "num_stages": 2}, "bwd": {"num_warps": 4, "num_stages": 2}}


def _blocks(d: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_D, BM, BN, BWD)`` for head dim ``d``."""
    block_d = max(16, 1 << (d - 1).bit_length())
    if block_d > 128:
        raise ValueError(f"attn_impl='triton' takes head dims up to 128, got {d}")
    if device.type == "cpu":  # the interpreter
        return block_d, 16, 16, 16
    bm, bn = _FWD_BLOCKS[block_d]
    return block_d, bm, bn, _BWD_BLOCK[block_d]


def _launch(kind: str, device: torch.device) -> dict:
    return LAUNCH[kind] if device.type == "cuda" else {}


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(*ts: Tensor) -> list[int]:
    out: list[int] = []
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError("rel_bias_attention: the head dim must be contiguous")
        out += [t.stride(0), t.stride(1), t.stride(2)]
    return out


def _table_args(table: Tensor | None, q: Tensor) -> tuple[Tensor, int, int]:
    """The table in base 2 (the kernels' logits are), or a placeholder, and its group and head strides (group 0 on a
    full grid's ``[heads, 2 GH - 1, 2 GW - 1]``)."""
    if table is None:
        return q.new_zeros(1, dtype=torch.float32), 0, 0
    t = table * _kernels().LOG2E
    return (t, 0, t.stride(0)) if t.dim() == 3 else (t, t.stride(0), t.stride(1))


def _int_args(t: Tensor | None, q: Tensor) -> Tensor:
    """``t`` (a layout's tokens, the visible-tile flags), or a placeholder."""
    return q.new_zeros(1, dtype=torch.int32) if t is None else t


#: the most memory the bias tiles of one call may take (:func:`bias_tiles`); beyond it the bias is gathered per score
TILE_BUDGET_BYTES = 64 << 20
#: how the kernels read a full grid's bias (``rel_bias_attention(..., bias_read=)``): ``auto`` (the bias tiles where
#: they fit :data:`TILE_BUDGET_BYTES`, else gathered), ``tiles`` (an error where they do not fit), ``gather``
BIAS_READS = ("auto", "tiles", "gather")


class TilePatterns(NamedTuple):
    """How a full grid's ``[tm, tw]`` tiles of bias map to their distinct patterns (:func:`tile_patterns`): pattern
    ``((q0 - k0 - d_min) / g_d) n_m + (q0 mod W) / g_m`` of the tile of queries from ``q0`` and keys from ``k0``
    where ``n_m > 0``, else ``(q0 / tm) n_kt + k0 / tw`` (one per tile, where that is fewer). The kernels compute the
    same from these integers."""

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


def bias_tiles(table: Tensor, grid_h: int, grid_w: int, prefix: int, pat: TilePatterns, tm: int, tw: int) -> Tensor:
    """``[heads, n_pat, tm, tw]``: the bias tile of each pattern, which the kernels load whole (coalesced, like a key
    tile) instead of gathering each score from the table. A pattern ``(d, m)`` is computed at queries from ``m`` and
    keys from ``m - d`` with the coordinates extended past the grid's ends (``r = floor(p / W)``, ``c = p mod W``
    for every ``p = t - P``, negative too), so it equals the table at every patch pair of every tile of that pattern;
    the kernels zero the pairs with a prefix token and those past the end. Device work only (no host sync)."""
    dev = table.device
    i = torch.arange(pat.n_pat, device=dev)
    if pat.n_m > 0:
        q0 = (i % pat.n_m) * pat.g_m
        k0 = q0 - (pat.d_min + (i // pat.n_m) * pat.g_d)
    else:
        q0, k0 = i // pat.n_kt * tm, i % pat.n_kt * tw
    pq = q0[:, None] + torch.arange(tm, device=dev) - prefix  # [n_pat, tm]
    pk = k0[:, None] + torch.arange(tw, device=dev) - prefix
    dh = pq.div(grid_w, rounding_mode="floor")[:, :, None] - pk.div(grid_w, rounding_mode="floor")[:, None, :]
    dw = pq.remainder(grid_w)[:, :, None] - pk.remainder(grid_w)[:, None, :]
    dh = (dh + grid_h - 1).clamp(0, 2 * grid_h - 2)  # (clamped: pairs past the grid's ends, zeroed by the kernels)
    dw = (dw + grid_w - 1).clamp(0, 2 * grid_w - 2)
    return table[:, dh, dw].contiguous()


def _tile_args(table: Tensor | None, tokens: Tensor | None, bias_read: str, grid_h, grid_w, prefix, n, tm, tw, q):
    """``(tiles, n_kt, n_pat, d_min, g_d, n_m, g_m)`` for the kernels: the bias tiles of the base-2 ``table`` on a
    full grid where ``bias_read`` takes them, else a placeholder and ``n_pat = 0`` (the bias gathered per score)."""
    if table is not None and tokens is None and bias_read != "gather":
        pat = tile_patterns(grid_w, n, tm, tw)
        size = table.shape[0] * pat.n_pat * tm * tw * 4
        if size <= TILE_BUDGET_BYTES:
            return bias_tiles(table, grid_h, grid_w, prefix, pat, tm, tw), *pat
        if bias_read == "tiles":
            raise ValueError(f"bias_read='tiles': {pat.n_pat} tile patterns take {size} bytes, above the budget")
    return q.new_zeros(1, dtype=torch.float32), 0, 0, 0, 1, 0, 1


def _mask_args(mask: Tensor | None, q: Tensor) -> tuple[Tensor, int, int, int]:
    """The kernels' ``MASK`` (a float mask in base 2, or region ids), its row stride, rows and ``MASK_KIND``."""
    if mask is None:
        return q.new_zeros(1, dtype=torch.float32), 0, 1, 0
    if not mask.is_floating_point():
        return mask, mask.stride(0), mask.shape[0], 2
    return mask * _kernels().LOG2E, mask.stride(0), mask.shape[0], 1


#: the parameters the forward op and its backward share, declared once in their schemas: the inputs and the call's
#: settings (``torch.library`` ops, so ``torch.compile`` captures each as one node)
_INPUTS = "Tensor q, Tensor k, Tensor v, Tensor? table, Tensor? mask, Tensor? tokens, Tensor? blocks"
_SETTINGS = "float scale, int grid_h, int grid_w, int prefix, bool causal, str bias_read"
torch.library.define("vitrel::rel_bias_attention", f"({_INPUTS}, {_SETTINGS}) -> (Tensor, Tensor)")
torch.library.define(
    "vitrel::rel_bias_attention_bwd",
    f"(Tensor do, {_INPUTS}, Tensor out, Tensor lse, {_SETTINGS}, bool table_grad) -> (Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.register_kernel("vitrel::rel_bias_attention", None)
def _fwd_impl(q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read):
    """``vitrel::rel_bias_attention``: the output and its rows' base-2 log-sum-exp (what the backward reads)."""
    b, h, n, d = q.shape
    block_d, bm, bn, _ = _blocks(d, q.device)
    out = q.new_empty(q.shape)  # contiguous, as the fake says (inductor may hand q in another layout)
    lse = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    t, stg, sth = _table_args(table, q)
    m, smb, nmb, mask_kind = _mask_args(mask, q)
    bt, *tiling = _tile_args(None if table is None else t, tokens, bias_read, grid_h, grid_w, prefix, n, bm, bn, q)
    grid = (triton_cdiv(n, bm), b * h)
    _kernels()._fwd_kernel[grid](
        q, k, v, t, m, _int_args(tokens, q), _int_args(blocks, q), bt, out, lse, *_strides(q, k, v, out), stg, sth,
        smb, nmb, h, n, prefix, grid_h, grid_w, scale * _kernels().LOG2E, _n_flag(blocks), *tiling, D=d,
        BLOCK_D=block_d, BM=bm, BN=bn, HAS_TABLE=table is not None, MASK_KIND=mask_kind, CAUSAL=causal,
        LAYOUT=tokens is not None, HAS_BLOCKS=blocks is not None, TILED=tiling[1] > 0, PREC=_prec(q.dtype),
        **_launch("fwd", q.device),
    )  # fmt: skip
    return out, lse


@torch.library.register_fake("vitrel::rel_bias_attention")
def _fwd_fake(q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _n_split(n_qb: int, heads: int, batch: int, device: torch.device) -> int:
    """Batch shares of the ``dq`` kernel: enough programs to fill the device (4 per SM), no more than the batch."""
    if device.type != "cuda":
        return min(batch, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(batch, math.ceil(4 * sms / (n_qb * heads))))


@torch.library.register_kernel("vitrel::rel_bias_attention_bwd", None)
def _bwd_impl(
    do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read, table_grad
):
    """``vitrel::rel_bias_attention_bwd``: ``dq, dk, dv`` and, with ``table_grad``, the table's gradient."""
    b, h, n, d = q.shape
    block_d, _, _, blk = _blocks(d, q.device)
    do = do.contiguous()
    delta = (out.float() * do.float()).sum(-1).contiguous()  # rowsum(o * do), FlashAttention-2's D
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the fakes
    t, stg, sth = _table_args(table, q)
    m, smb, nmb, mask_kind = _mask_args(mask, q)
    tok, blk_flags = _int_args(tokens, q), _int_args(blocks, q)
    bt, *tiling = _tile_args(None if table is None else t, tokens, bias_read, grid_h, grid_w, prefix, n, blk, blk, q)
    ks = _kernels()
    qk_scale = scale * ks.LOG2E
    layout = tokens is not None
    flags = dict(
        D=d, BLOCK_D=block_d, HAS_TABLE=table is not None, MASK_KIND=mask_kind, CAUSAL=causal, LAYOUT=layout,
        HAS_BLOCKS=blocks is not None, TILED=tiling[1] > 0, PREC=_prec(q.dtype),
    )  # fmt: skip
    common = [*_strides(q, k, v, do), stg, sth, smb, nmb]
    n_b = triton_cdiv(n, blk)
    sizes = (h, n, prefix, grid_h, grid_w, qk_scale, scale, _n_flag(blocks), *tiling)
    ks._bwd_dkdv_kernel[(n_b, b * h)](
        q, k, v, t, m, tok, blk_flags, bt, do, lse, delta, dk, dv, *common, *_strides(dk, dv), *sizes, BM=blk,
        BN=blk, **flags, **_launch("bwd", q.device),
    )  # fmt: skip
    grad_t = table_grad and table is not None
    n_split = _n_split(n_b, h, b, q.device)
    # per program: a full grid's diagonal sums per key block (n_b x 2 cases x 2 blk), a layout's whole table
    slot_size = (table.numel() // h if layout else n_b * 4 * blk) if grad_t else 0
    slots = torch.zeros(n_split, h, n_b, slot_size, device=q.device, dtype=torch.float32)
    scratch = torch.empty(n_split * h * n_b * blk * blk if grad_t and layout else 1, device=q.device)
    ks._bwd_dq_kernel[(n_b, h, n_split)](
        q, k, v, t, m, tok, blk_flags, bt, do, lse, delta, dq, slots, scratch, *common, *_strides(dq), b, *sizes,
        n_split, slot_size, BM=blk, TABLE_GRAD=grad_t, **flags, **_launch("bwd", q.device),
    )  # fmt: skip
    if not grad_t:
        dt = q.new_zeros(0, dtype=torch.float32)
    elif layout:  # [n_split, heads, n_qb, G K] -> [G, heads, 2 GH - 1, 2 GW - 1]
        dt = slots.sum((0, 2)).view(h, table.shape[0], *table.shape[2:]).transpose(0, 1).contiguous()
    else:
        dt = table_grad_from_slots(slots.view(n_split, h, n_b, n_b, 2, 2 * blk), grid_h, grid_w, blk)
    return dq, dk, dv, dt


@torch.library.register_fake("vitrel::rel_bias_attention_bwd")
def _bwd_fake(
    do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read, table_grad
):
    dt = table.new_empty(table.shape) if (table_grad and table is not None) else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dt


def table_grad_from_slots(slots: Tensor, grid_h: int, grid_w: int, blk: int) -> Tensor:
    """``dT [heads, 2 GH - 1, 2 GW - 1]`` from the ``dq`` kernel's slots ``[n_split, heads, n_qb, n_kb, 2, 2 blk]``.

    Slot ``(qb, kb, case, e)`` holds the sum of ``dS`` over the tile's pairs with
    ``i - j = (qb - kb) blk + e - blk + 1`` (``case`` 0: ``dw >= 0``, 1: ``dw < 0``). Summed over the batch shares
    and over the tiles of one block diagonal ``qb - kb``, then each diagonal's ``2 blk`` sums laid at its offset
    (two halves overlapping the next diagonal's), giving ``G[case, i - j]``; ``dT[dh, dw] = G[dw < 0, dh GW + dw]``.
    Plain tensor sums in a fixed order: deterministic."""
    s = slots.sum(0)  # [heads, n_qb, n_kb, 2, E]
    heads, n_qb, n_kb = s.shape[:3]
    qb = torch.arange(n_qb, device=s.device)[:, None]
    diag = torch.arange(-(n_kb - 1), n_qb, device=s.device)[None, :]  # qb - kb
    kb = qb - diag
    inside = (kb >= 0) & (kb < n_kb)
    per_diag = s[:, qb, kb.clamp(0, n_kb - 1)]  # [heads, n_qb, n_diag, 2, E]
    per_diag = (per_diag * inside[None, :, :, None, None]).sum(1)  # [heads, n_diag, 2, E]
    lo, hi = per_diag[..., :blk], per_diag[..., blk:]
    n_diag = per_diag.shape[1]
    ext = s.new_zeros(heads, n_diag + 1, 2, blk)
    ext[:, :-1] += lo
    ext[:, 1:] += hi
    ext = ext.permute(0, 2, 1, 3).reshape(heads, 2, (n_diag + 1) * blk)  # index y = diag' blk + e
    # y = (i - j) + n_kb blk - 1
    dh = torch.arange(-(grid_h - 1), grid_h, device=s.device)[:, None]
    dw = torch.arange(-(grid_w - 1), grid_w, device=s.device)[None, :]
    y = dh * grid_w + dw + n_kb * blk - 1
    case = (dw < 0).long().expand_as(y)
    return ext[:, case, y]


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _n_flag(blocks: Tensor | None) -> int:
    return 0 if blocks is None else blocks.shape[-1]


def visible_tiles(table: Tensor, grid: Grid, num_prefix_tokens: int = 0, chunk: int = 1024) -> Tensor:
    """``[heads, n, n]`` int32 flags of a table with ``-inf`` entries (LookHere's views), ``n = ceil(N / 16)``:
    1 where some pair of query tile ``i`` and key tile ``j`` (16 tokens each) is visible (a finite entry, or a pair
    with a prefix token), so the kernels skip the ``[BM, BN]`` tiles whose flags are all 0. Computed from the
    table exactly, ``chunk`` query rows at a time (no ``N x N`` tensor per head at once)."""
    tile = _kernels().FLAG_TILE.value
    finite = torch.isfinite(table)
    heads, p = table.shape[0], num_prefix_tokens
    n_flag = triton_cdiv(p + grid.n, tile)
    t = torch.arange(n_flag * tile, device=table.device) - p
    patch, real = (t >= 0) & (t < grid.n), t < grid.n  # (tokens past the end: in no pair)
    r, c = t.clamp(0, grid.n - 1) // grid.w, t.clamp(0, grid.n - 1) % grid.w
    chunk -= chunk % tile
    out = []
    for s in range(0, n_flag * tile, chunk):
        rq, cq, pq, tq = r[s : s + chunk, None], c[s : s + chunk, None], patch[s : s + chunk, None], real[s : s + chunk]
        seen = finite[:, rq - r[None, :] + grid.h - 1, cq - c[None, :] + grid.w - 1] | ~(pq & patch[None, :])
        seen &= tq[:, None] & real[None, :]
        out.append(seen.view(heads, -1, tile, n_flag, tile).any(4).any(2))
    return torch.cat(out, 1).to(torch.int32)


def _setup(ctx, inputs, output):
    q, k, v, table, mask, tokens, blocks, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, table, mask, tokens, blocks, out, lse)
    ctx.args = tuple(args)  # scale, grid_h, grid_w, prefix, causal, bias_read


def _backward(ctx, dout, dlse):
    q, k, v, table, mask, tokens, blocks, out, lse = ctx.saved_tensors
    need_t = table is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dt = torch.ops.vitrel.rel_bias_attention_bwd(
        dout, q, k, v, table, mask, tokens, blocks, out, lse, *ctx.args, need_t
    )
    return dq, dk, dv, (dt if need_t else None), *(None,) * 9


torch.library.register_autograd("vitrel::rel_bias_attention", _backward, setup_context=_setup)


def rel_bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor | None,
    grid: tuple[int, int],
    num_prefix_tokens: int = 0,
    scale: float | None = None,
    mask: Tensor | None = None,
    causal: bool = False,
    tokens: Tensor | None = None,
    blocks: Tensor | None = None,
    bias_read: str = "auto",
    regions: Tensor | None = None,
) -> Tensor:
    """``softmax(q k^T * scale + T[offsets] + mask) v`` for ``q, k, v [B, heads, N, d]`` (see the module docstring).

    ``table`` ``[heads, 2 GH - 1, 2 GW - 1]`` (any float dtype: read and differentiated in float32; ``-inf`` entries
    mask their pairs) or None; ``grid`` ``(GH, GW)`` with ``N = num_prefix_tokens + GH GW``; ``mask`` ``[Mb, N, N]``
    additive, or ``regions`` ``[Mb, N]`` integer region ids (a token sees the tokens of its region only: a batch of
    windows' layout, :meth:`~vitrel.pos.tokens.TokenLayout.windows`); batch ``b`` reads row ``b % Mb``.

    ``tokens`` ``[B, 4, N]`` (integers: each token's segment, row, column and table group; :func:`layout_tokens`)
    lays out packed images instead (a token layout, :mod:`vitrel.pos.tokens`): a token attends to the tokens of its
    segment only (padding, segment -1, to padding), the bias of a patch pair read from its group's table
    ``table [G, heads, 2 GH - 1, 2 GW - 1]`` at the pair's offset (rows -1: prefix and padding tokens, no bias),
    ``grid`` the tables' extent; tiles with no pair of one segment are skipped.

    ``blocks`` (a full grid's, :func:`visible_tiles`) lets the kernels skip the tiles the table's ``-inf`` entries mask
    whole. ``bias_read`` (:data:`BIAS_READS`): how the kernels read a full grid's bias (:func:`tile_patterns`)."""
    check_device(q.device)
    b, h, n, d = q.shape
    gh, gw = int(grid[0]), int(grid[1])
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"rel_bias_attention: q, k, v must have one shape, got {q.shape}, {k.shape}, {v.shape}")
    if tokens is None and n != num_prefix_tokens + gh * gw:
        raise ValueError(f"rel_bias_attention: {n} tokens, but the grid {gh}x{gw} with {num_prefix_tokens} prefix")
    if tokens is not None:
        if tuple(tokens.shape) != (b, 4, n):
            raise ValueError(f"rel_bias_attention: tokens {tuple(tokens.shape)}, expected {(b, 4, n)}")
        if causal:
            raise ValueError("rel_bias_attention: causal attention on a token layout is not supported")
        tokens = tokens.to(torch.int32).contiguous()
    if table is not None:
        want = (h, 2 * gh - 1, 2 * gw - 1)
        if tuple(table.shape[-3:]) != want or table.dim() != 3 + (tokens is not None):
            groups = "[G, ...] of " if tokens is not None else ""
            raise ValueError(f"rel_bias_attention: table {tuple(table.shape)}, expected {groups}{want}")
        table = table.float().contiguous()
    if blocks is not None:
        n_flag = triton_cdiv(n, _kernels().FLAG_TILE.value)
        if tokens is not None or tuple(blocks.shape) != (h, n_flag, n_flag):
            want = (h, n_flag, n_flag)
            raise ValueError(f"rel_bias_attention: blocks {tuple(blocks.shape)}, expected {want} on a full grid")
        blocks = blocks.to(torch.int32).contiguous()
    if mask is not None and regions is not None:
        raise ValueError("rel_bias_attention: pass a float mask or regions, not both")
    if mask is not None:
        mask = mask.reshape(-1, n, n).float().contiguous()
    elif regions is not None:
        if regions.dim() != 2 or regions.shape[1] != n or regions.is_floating_point():
            raise ValueError(f"rel_bias_attention: regions must be integers [Mb, {n}], got {tuple(regions.shape)}")
        mask = regions.to(torch.int32).contiguous()  # the kernels' MASK, read as region ids
    if mask is not None and b % mask.shape[0]:
        raise ValueError(f"rel_bias_attention: batch {b} is not a multiple of the mask's {mask.shape[0]} rows")
    q, k, v = (t.contiguous() for t in (q, k, v))  # one layout at the op's boundary (its fakes say contiguous)
    scale = d**-0.5 if scale is None else float(scale)
    if bias_read not in BIAS_READS:
        raise ValueError(f"rel_bias_attention: bias_read must be one of {BIAS_READS}, got {bias_read!r}")
    op = torch.ops.vitrel.rel_bias_attention
    out, _ = op(q, k, v, table, mask, tokens, blocks, scale, gh, gw, num_prefix_tokens, causal, bias_read)
    return out


def layout_tokens(layout: TokenLayout) -> Tensor:
    """``[B, 4, N]`` int32: each token's segment, row, column (-1 for prefix and padding tokens) and table group, what
    :func:`rel_bias_attention` reads of a token layout."""
    return torch.stack([layout.segment, *layout.coords.unbind(-1), layout.group], 1).to(torch.int32)


@register_kernel("triton")
class TritonKernel(OffsetTableKernel):
    """The fused kernel above for every scheme with an offset table (and for rotary schemes and no position: no
    table); full grids with prefix tokens, batches of windows (their layout's regions masked in the kernel, or a float
    mask), causal 1-D, token layouts (packed
    images of any sizes, dropped tokens: a table per distinct grid, the tiles across images skipped). Not yet:
    attention dropout."""

    window_layouts = True
    onnx = False
    fused_rotation = True

    @classmethod
    def skip_blocks(cls, table, grid, num_prefix_tokens):
        return visible_tiles(table, grid, num_prefix_tokens)

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        if dropout_p > 0.0:
            raise ValueError("attn_impl='triton' has no attention dropout: use attn_impl='sdpa' for attn_drop > 0")
        regions = None
        if isinstance(mask, TokenLayout):  # a batch of windows' layout: its regions masked in the kernel
            mask, regions = None, mask.segment
        if mask is not None and mask.dim() == 4:
            if mask.shape[1] != 1:
                raise ValueError("attn_impl='triton' takes a mask shared by the heads ([B | nW, N, N])")
            mask = mask[:, 0]
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        tokens = None if state.layout is None else layout_tokens(state.layout)
        p, blocks = state.num_prefix_tokens, state.block_mask
        return rel_bias_attention(
            q, k, v, state.table, state.grid, p, scale, mask, state.causal, tokens, blocks, regions=regions
        )


def compile_kernel(
    kernel: str,
    arch: int = 90,
    head_dim: int = 64,
    dtype: str = "bf16",
    tile: int | None = None,
    launch: dict | None = None,
    **flags,
):
    """Compile one of the kernels (``fwd``, ``dkdv``, ``dq``) ahead of time for CUDA compute capability ``arch`` (no
    GPU needed: Triton's own compiler and ptxas) and return Triton's compiled kernel (its ``metadata``, its ``asm``).
    The case is a full grid's, the table read as bias tiles, no mask, the table's gradient on, unless ``flags`` (the
    kernels' ``constexpr`` arguments, e.g. ``MASK_KIND=2``, ``LAYOUT=True``) say otherwise; ``tile`` (``BM``, and
    ``BN`` but for ``dq``) and ``launch`` (``num_warps``, ``num_stages``) default to what a GPU of that kind uses for
    ``head_dim``. Needs Triton's CUDA backend and ``TRITON_INTERPRET`` unset (the kernels must be JIT functions)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ks = _kernels()
    fn = {"fwd": ks._fwd_kernel, "dkdv": ks._bwd_dkdv_kernel, "dq": ks._bwd_dq_kernel}[kernel]
    block_d, bm, bn, blk = _blocks(head_dim, torch.device("cuda"))
    consts = dict(
        D=head_dim, BLOCK_D=block_d, HAS_TABLE=True, MASK_KIND=0, CAUSAL=False, LAYOUT=False, HAS_BLOCKS=False,
        TILED=True, PREC=_prec(torch.bfloat16),
    )  # fmt: skip
    if kernel == "dq":
        consts.update(BM=tile or blk, TABLE_GRAD=True)
    else:
        consts.update(BM=tile or (bm if kernel == "fwd" else blk), BN=tile or (bn if kernel == "fwd" else blk))
    consts.update(flags)
    unknown = set(consts) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"compile_kernel: {kernel} has no arguments {sorted(unknown)}")
    t = f"*{dtype}"
    types = dict(
        Q=t, K=t, V=t, O=t, DO=t, DK=t, DV=t, DQ=t, T="*fp32", MASK="*i32" if consts["MASK_KIND"] == 2 else "*fp32",
        TOK="*i32", BLK="*i32", BT="*fp32", LSE="*fp32", DELTA="*fp32", SLOTS="*fp32", SCRATCH="*fp32",
        qk_scale="fp32", sm_scale="fp32",
    )  # fmt: skip
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    options = dict(launch or LAUNCH["fwd" if kernel == "fwd" else "bwd"])
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_for(
    arch: int = 90, head_dim: int = 64, dtype: str = "bf16", layout: bool = False, regions: bool = False
) -> dict[str, int]:
    """The three kernels compiled ahead of time for ``arch`` (:func:`compile_kernel`), with a table, a mask and the
    table's gradient: each kernel's shared memory in bytes (``layout``: the token-layout variants; else a full grid's,
    with visible-tile flags and bias tiles; ``regions``: windows' region ids instead of a float mask). Catches what
    the interpreter lets through (types, layouts, shared memory)."""
    flags = dict(MASK_KIND=2 if regions else 1, LAYOUT=layout, HAS_BLOCKS=not layout, TILED=not layout)
    return {k: compile_kernel(k, arch, head_dim, dtype, **flags).metadata.shared for k in ("fwd", "dkdv", "dq")}
