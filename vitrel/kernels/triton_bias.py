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
implementations, so ``torch.compile`` captures it as one node; in eager mode the same bodies run as an autograd
function (:class:`_Eager`: less host work a call). The kernels run on CUDA, or on CPU tensors through
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before this module is first used (the tests do so);
on CPU without it, :func:`check_device` says so.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import os
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor

from vitrel.device_cache import per_device
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
    "compile_launch",
    "serialized_products",
    "plan",
    "Launch",
    "interpreter_on",
    "layout_tokens",
    "visible_tiles",
    "rel_bias_attention",
    "table_grad_from_slots",
    "tile_flags",
    "tile_lists",
    "tile_patterns",
    "bias_tiles",
    "tile_dtype",
    "FLOAT32_TILES",
    "dbias_order",
]

#: (BM, BN) of the forward, and the square tile of the backward, by head dim; the interpreter takes 16
#: (small tiles keep its per-element work small and exercise several blocks at small sizes)
_FWD_BLOCKS = {16: (64, 64), 32: (64, 64), 64: (64, 64), 128: (64, 32)}
#: the forward's tile where its bias is read whole or there is none (a full grid's bias tiles, no table), by head dim,
#: where it is not the square one of :data:`_FWD_BLOCKS`: none, as measured on an H100 (``bench/results/
#: triton_tune_h100_tiles.md``, N = 4097): head dim 64, 64 x 64 in 4 warps and 2 stages 0.93x the time of 64 x 128
#: (2.17 against 2.33 ms); head dim 128, 64 x 32 in 4 warps 0.69x the time of 128 x 64 in 8 warps (1.29 against 1.87
#: ms), though the latter issues 0.67x the instructions per score (sm_90, Triton 3.6). The wide tiles stay supported
#: (``bench/triton_tune.py`` times them)
_FWD_WIDE: dict[int, tuple[int, int]] = {}
_BWD_BLOCK = {16: 64, 32: 64, 64: 64, 128: 32}
#: the ``dkdv`` kernel's ``(BM, BN)`` (queries streamed, keys held), the ``dq`` kernel's (queries held, keys streamed)
#: and the ``dbias`` kernel's, by head dim, where the bias is read whole or there is none, with :data:`LAUNCH`'s
#: ``(kernel, head dim)`` options; elsewhere the backward's square tile. As measured on an H100 (``bench/results/
#: triton_tune_h100_tiles.md``, N = 4097, forward + backward with the table's gradient): head dim 64 takes the
#: square 64 x 64 tile in 4 warps and 3 stages for all three, 9.39 ms against 11.83 with ``dkdv`` 64 x 128 and ``dq``
#: and ``dbias`` 128 x 64 in 8 warps (0.79x; the wide tiles issue 0.77x-0.95x the instructions per score on sm_90,
#: Triton 3.6, but ran slower), and the square ``dbias`` 0.98x the wide one beside wide ``dq`` tiles (it shares the
#: ``dq`` kernel's bias tiles). Head dim 128: ``dkdv`` 64 x 128 and ``dq`` 128 x 64 in 8 warps, 8.73 ms against 9.40
#: with ``dkdv`` 32 x 128 (64 x 128 spills in its loop, sm_90, yet ran faster) and 13.93 with the square 32 x 32
#: tiles; ``dbias`` 128 x 64 in 8 warps, 9.40 against 11.45 square
_DKDV_WIDE: dict[int, tuple[int, int]] = {128: (64, 128)}
_DQ_WIDE: dict[int, tuple[int, int]] = {128: (128, 64)}
_DBIAS_WIDE: dict[int, tuple[int, int]] = {128: (128, 64)}


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Raise unless the Triton kernels can run on ``device``: CUDA, or CPU with ``TRITON_INTERPRET=1``, where
    ``dtype`` (the inputs', for kernels with products) is not bfloat16: Triton's interpreter (3.6 and 3.8) computes
    ``tl.dot`` on bfloat16 operands wrongly (errors of 1e10 on a 16 x 16 product of unit normals), fp16 right."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreter_on():
        if dtype == torch.bfloat16:
            raise ValueError(
                "attn_impl='triton' on CPU runs in Triton's interpreter, whose products of bfloat16 tensors are wrong: "
                "use float32 or float16 on CPU (bfloat16 runs on CUDA), or attn_impl='sdpa'"
            )
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
                "TRITON_INTERPRET=1 was set after triton.language had been imported (importing timm, and so vitrel, "
                "imports it; so do torch.compile and torch.export), so Triton's own functions are not interpreted: "
                "set TRITON_INTERPRET=1 in the environment before starting Python"
            )
    return triton_bias_kernels


#: launch options (``num_warps``, ``num_stages``) of the forward and of the backward kernels on CUDA, and where a head
#: dim (its power of two) has its own: the backward at head dim 64 in 3 stages, the fastest of ``bench/triton_tune.py``
#: on an H100 at N = 1025 and 4097 (0.98x and 0.95x the time of 2); not measured at the others (Swin's 32: its
#: windows' ``dq`` kernel spills 72 bytes in 3 stages, sm_90); ``("dkdv", d)``, ``("dq", d)``, ``("dbias", d)``: those
#: kernels' options with their wide tiles only (:data:`_DKDV_WIDE`, :data:`_DQ_WIDE`, :data:`_DBIAS_WIDE`); ``tile``:
#: the one-tile backward (:data:`TILE_BWD`) where it sums the table's gradient over a share of the batch, and
#: ``tile_each`` where each program takes one batch element, 4 warps and 1 stage, and ``fwd_tile``, the one-tile
#: forward (:data:`TILE_FWD`), 4 warps and 1 stage: the fastest on an H100 over Swin-T's first stage (8,192 windows of
#: 7 x 7, 3 heads of 32; ``bench/results/triton_tune_h100_tiles.md``): the backward 1.86 ms against 1.98 in 8
#: warps and 2 stages, 2.10 in 4 and 2, 2.10 in 8 and 1, 2.58 with the four kernels; the forward 0.49 ms against 0.53
#: in 2 stages, 0.82 in 8 warps, 0.67 with a program a window. At head dim 64 the one-tile backward in 8 warps and 1
#: stage (4 warps spill 72-152 bytes, sm_90), at 128 (32-token tiles) 4 warps and 1 stage; both chosen from the code
#: compiled for sm_90 under Triton 3.6 and 3.8 (``bench/triton_resources.py``), untimed. ``("fwd", d)``: the
#: forward at head dim ``d``: at 64, 3 stages, 1.99 ms against 2.17 in 2 at N = 4097 on an H100
#: (``triton_tune_h100_tiles.md``; N = 196 and 1024 untimed). In 2 stages Triton's pipeliner gives the bias tile one
#: buffer and waits for its copy at the top of each key tile (``async_wait`` of none in flight, the compiled TTGIR for
#: sm_90), where the key and value tiles have two; in 3 stages the bias tile has two and one copy stays in flight
LAUNCH: dict[str | tuple[str, int], dict[str, int]] = {
    "fwd": {"num_warps": 4, "num_stages": 2},
    ("fwd", 64): {"num_warps": 4, "num_stages": 3},
    "bwd": {"num_warps": 4, "num_stages": 2},
    ("bwd", 64): {"num_warps": 4, "num_stages": 3},
    ("dkdv", 128): {"num_warps": 8, "num_stages": 2},
    # the dkdv kernel summing the table's gradient (TABLE_GRAD_IN_DKDV): untimed; 2 stages, its fewest instructions
    # a tile compiled for sm_90 (648 against 745 in 3, which spill 256 bytes outside the loop; 8 warps: 1,000)
    ("dkdv_sums", 64): {"num_warps": 4, "num_stages": 2},
    ("dq", 128): {"num_warps": 8, "num_stages": 2},
    ("dbias", 128): {"num_warps": 8, "num_stages": 2},
    "tile": {"num_warps": 4, "num_stages": 1},
    "tile_each": {"num_warps": 4, "num_stages": 1},
    "fwd_tile": {"num_warps": 4, "num_stages": 1},
    ("tile", 64): {"num_warps": 8, "num_stages": 1},
    ("tile", 128): {"num_warps": 4, "num_stages": 1},
    "table_grad": {"num_warps": 4, "num_stages": 1},
}


def _wide_tile(kernel: str, block_d: int, cuda: bool) -> tuple[int, int] | None:
    """The wide tile of ``kernel`` (``fwd``: :data:`_FWD_WIDE`, ``dkdv``: :data:`_DKDV_WIDE`, ``dq``:
    :data:`_DQ_WIDE`, ``dbias``: :data:`_DBIAS_WIDE`) at head dim ``block_d`` on CUDA; None in the interpreter."""
    wide = {"fwd": _FWD_WIDE, "dkdv": _DKDV_WIDE, "dq": _DQ_WIDE, "dbias": _DBIAS_WIDE}
    return wide[kernel].get(block_d) if cuda else None


#: the largest head dim the kernels take (their tiles at 256 need more shared memory than an SM has)
MAX_HEAD_DIM = 128


def _blocks(d: int, cuda: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_D, BM, BN, BWD)`` for head dim ``d`` on CUDA, or in the interpreter."""
    block_d = max(16, 1 << (d - 1).bit_length())
    if block_d > MAX_HEAD_DIM:
        raise ValueError(f"attn_impl='triton' takes head dims up to {MAX_HEAD_DIM}, got {d}")
    if not cuda:  # the interpreter
        return block_d, 16, 16, 16
    bm, bn = _FWD_BLOCKS[block_d]
    return block_d, bm, bn, _BWD_BLOCK[block_d]


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(*ts: Tensor) -> list[int]:
    out: list[int] = []
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError("rel_bias_attention: the head dim must be contiguous")
        out += [t.stride(0), t.stride(1), t.stride(2)]
    return out


@per_device(maxsize=32)
def _placeholder(dtype: torch.dtype, dims: int, device: torch.device) -> Tensor:
    """A zero of ``dims`` dimensions that a kernel takes for an input it does not read."""
    return torch.zeros((1,) * dims, device=device, dtype=dtype)


def _table_args(table: Tensor | None, q: Tensor, memo: dict | None = None) -> tuple[Tensor, int, int]:
    """The table in base 2 (the kernels' logits are), or a placeholder, and its group and head strides (group 0 on a
    full grid's ``[heads, 2 GH - 1, 2 GW - 1]``); ``memo`` (one call's, :class:`_Eager`): made once for its forward
    and backward."""
    if table is None:
        return _placeholder(torch.float32, 1, q.device), 0, 0
    t = None if memo is None else memo.get("table")
    if t is None:
        t = table * _kernels().LOG2E
        if memo is not None:
            memo["table"] = t
    return (t, 0, t.stride(0)) if t.dim() == 3 else (t, t.stride(0), t.stride(1))


def _int_args(t: Tensor | None, q: Tensor) -> Tensor:
    """``t`` (a layout's tokens, the visible-tile flags), or a placeholder."""
    return _placeholder(torch.int32, 1, q.device) if t is None else t


#: the most memory the bias tiles of one call may take (:func:`bias_tiles`); beyond it the bias is gathered per score
TILE_BUDGET_BYTES = 64 << 20
#: how the kernels read a full grid's bias (``rel_bias_attention(..., bias_read=)``): ``auto`` (the bias tiles where
#: they fit :data:`TILE_BUDGET_BYTES`, else gathered), ``tiles`` (an error where they do not fit), ``gather``
BIAS_READS = ("auto", "tiles", "gather")


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


#: the kernels that read float32 bias tiles for half-precision inputs (``fwd``, ``dkdv``, ``dq``, ``dbias``): none.
#: ``bench/triton_tune.py`` sets ``"fwd"`` to time the forward's float32 tiles against its half ones
FLOAT32_TILES: set[str] = set()


#: the head dims (``BLOCK_D``) whose ``dbias`` programs loop over their share of the batch outside the tiles of their
#: diagonal (``BATCH_OUTER``: at any time the programs read the q, k, v and ``do`` of fewer batch elements, a smaller
#: working set in L2), where the default loops over the tiles outside; ``bench/triton_tune.py`` times both
DBIAS_BATCH_OUTER: set[int] = set()


#: the kernels that read their key and value tiles through tensor descriptors (Hopper's tensor-memory accelerator),
#: where :func:`tma_reads` allows it; ``bench/triton_tune.py`` times the forward without them
TMA_READS: set[str] = {"fwd"}
#: the fewest key tiles a program's loop must have to read them through tensor descriptors: each program makes its
#: two descriptors in global memory (and fences them) before its loop, a cost a short loop does not repay (a Swin
#: window is one tile: sm_90, its forward issued 5-17 more instructions a tile with them); chosen from the compiled
#: code, untimed
TMA_MIN_TILES = 8


def tma_reads(kernel: str, k: Tensor, v: Tensor, block_d: int, cuda: bool) -> bool:
    """Whether ``kernel`` reads ``k`` and ``v`` (``[B, H, N, D]``, any strides) through tensor descriptors: it is in
    :data:`TMA_READS`, the device has the tensor-memory accelerator (CUDA compute capability 9 or above; Triton's
    interpreter, which emulates it; or, for CPU tensors with ``cuda``, the Hopper GPU that :func:`plan` plans for), and
    the tensors are as it needs them: unit stride along the head dim, every other stride and the addresses a multiple
    of 16 bytes, a tile row (``block_d`` lanes) of at least 16 bytes."""
    if kernel not in TMA_READS:
        return False
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


#: whether the ``dq`` kernel sums the bias tiles' gradient where each of its tiles is one pattern (a full grid's
#: bias read as tiles whose patterns are not shared: ViT-B/16's 197 tokens), so no ``dbias`` kernel runs its second
#: pass over q, k, v and ``do`` (:func:`vitrel.kernels._triton_bias_kernels._bwd_dq_kernel`'s ``TILE_GRAD``). On:
#: the layer's forward + backward at 197 tokens took 1.929 ms against the dbias kernel's 2.081 on an H100
#: (``bench/results/triton_tune_h100_dq_grad.md``; ``bench/triton_tune.py --in-dq`` times both)
TABLE_GRAD_IN_DQ = True

#: the same where ``dq`` is added by atomics (``triton_atomic``: no ``dq`` kernel): the ``dkdv`` kernel sums the bias
#: tiles' gradient where each of its tiles is one pattern, its programs each a key block, a head and a share of the
#: batch (:func:`vitrel.kernels._triton_bias_kernels._bwd_dkdv_kernel`'s ``TILE_GRAD``), so the backward runs
#: FlashAttention-2's five matrix products a tile and no ``dbias`` kernel (its two). On, as ``TABLE_GRAD_IN_DQ``, the
#: same sums in the same kernel's loop; not yet timed on a GPU (``bench/triton_tune.py --in-dq`` times both)
TABLE_GRAD_IN_DKDV = True

#: whether the deterministic backward's ``dkdv`` kernel adds ``dq`` itself, in the order of the key blocks (each
#: waits on a lock per query tile for the blocks before it; :func:`vitrel.kernels._triton_bias_kernels._add_in_order`),
#: where every key block visits every query tile (full grids: no token layout, mask, causal or skipped tiles): no
#: ``dq`` kernel, which recomputes ``q k^T`` and ``dO v^T``, so FlashAttention-2's five products a tile, bitwise
#: repeatable; with the table's gradient in the ``dkdv`` kernel as ``TABLE_GRAD_IN_DKDV``. Off: untimed on a GPU,
#: and its locks need the lower key blocks' programs started first (CUDA starts a grid's programs in the order of
#: their index); ``bench/triton_tune.py --in-dq`` times it
DQ_IN_ORDER = False

#: the kernels (of ``fwd``, ``dkdv``, ``dq``; not ``dbias`` nor the one-tile ones, which read a tile once for many)
#: that add the bias by a product, where each tile is one exact pattern (ViT-B/16's 197 tokens) or patterns are
#: shared with no prefix token and no key past the end (the layer's N = 1024 and 4096; :func:`_product_tiles`):
#: ``s + I b``, the tile an operand of the tensor cores (:func:`vitrel.kernels._triton_bias_kernels._bias_product`),
#: so it is pipelined as the keys are, with no widening and no addition, for a third product of the tile's size.
#: Those kernels read the tiles divided by the scale, as they add to the unscaled logits (``RAW``), with a finite
#: stand-in for a tile's ``-inf`` (the keys past the end), as a product with ``-inf`` is NaN; the call's other kernels
#: read the tiles as before (a second set where they differ; added to unscaled logits they made Triton 3.6's
#: pipeliner fail on the forward). Not with visible-tile flags (LookHere's ``-inf`` views skip tiles), a float mask or
#: a scale not positive. Empty: untimed (sm_90, a 64 x 64 tile's instructions, Triton 3.8: ViT-B/16's forward
#: 417 -> 340, ``dkdv`` 465 -> 376, ``dq`` 533 -> 453; N = 4096's 396 -> 346, 428 -> 360, 352 -> 287; a third product,
#: which a loop already bound by its products, as ``dkdv``'s four, pays in full; ``bench/triton_tune.py --in-dq`` times
#: each)
BIAS_BY_PRODUCT: set[str] = set()
#: the kernels that can add the bias by a product (:data:`BIAS_BY_PRODUCT`)
_PRODUCT_KERNELS = ("fwd", "dkdv", "dq")


def _stand_in(dtype: torch.dtype) -> float:
    """The bias tiles' finite stand-in for ``-inf`` where the kernels add them by a product (:data:`BIAS_BY_PRODUCT`):
    half the type's largest magnitude, negative (in the unscaled logits: a product with the identity's zeros is 0)."""
    return -torch.finfo(dtype).max / 2


def _bias_divisor(
    table, tokens, blocks, mask_kind: int, scale: float, one_tile: bool, dtype, kernel: str
) -> float | None:  # fmt: skip
    """What ``kernel``'s bias tiles are divided by where it adds them by a product (:data:`BIAS_BY_PRODUCT`): the
    base-2 logits' scale, so they add to the unscaled logits; None where they are added to the logits (a kernel not in
    the set, no table, a token layout, visible-tile flags, a float mask, a scale not positive, a call of the one-tile
    kernels, or a scale under which the tiles' ``-inf`` stand-in, :func:`_stand_in`, would not make a score's weight
    0: below -2,000 in the base-2 logits, it does for any spread of the logits under 1,850)."""
    ok = kernel in BIAS_BY_PRODUCT and kernel in _PRODUCT_KERNELS and table is not None and tokens is None
    ok = ok and blocks is None and mask_kind != 1
    qk_scale = scale * _kernels().LOG2E
    ok = ok and not one_tile and _stand_in(tile_dtype(dtype)) * qk_scale <= -2000
    return qk_scale if ok else None


def _product_tiles(n_m: int, prefix: int, n: int, tw: int) -> bool:
    """Whether ``[., tw]`` bias tiles of ``n`` tokens may be added by a product (:data:`BIAS_BY_PRODUCT`): each tile
    one exact pattern (``n_m = 0``), or, where patterns are shared, no prefix token and no key past the end, none of
    whose pairs are the table's, which shared patterns hold (a query past the end is harmless: its row is not
    stored)."""
    return n_m == 0 or (prefix == 0 and n % tw == 0)


def _by_product(divisor: float | None, tiling, prefix: int, n: int, tw: int) -> bool:
    """Whether a launch with the bias tiling ``tiling`` (:func:`_tile_args`) of ``[., tw]`` tiles adds the bias by a
    product: a divisor (:func:`_bias_divisor`) and tiles that take it (:func:`_product_tiles`, as made)."""
    return divisor is not None and tiling[1] > 0 and _product_tiles(tiling[4], prefix, n, tw)


def tile_dtype(dtype: torch.dtype, kernel: str = "dq") -> torch.dtype:
    """The element type of the bias tiles ``kernel`` reads for inputs of ``dtype``: the inputs' own where they are
    half precision, as SDPA takes its float mask in the queries' type (a bias tile is a score tile read from memory:
    in float32 it moved as many bytes per score as a 64-query tile's keys and values together, and the kernels were
    bound by L2's bandwidth, ``bench/results/gpu_h100_bias_tiles.md``); float32 else, and where ``kernel`` is in
    :data:`FLOAT32_TILES`. The kernels add them to float32 logits. (The forward read float32 tiles while its
    half-precision ones made ptxas serialize its products; the cause was its loop's zero-trip path, which the kernel
    now rules out: ``_fwd_kernel``.)"""
    half = dtype in (torch.bfloat16, torch.float16) and kernel not in FLOAT32_TILES
    return dtype if half else torch.float32


def _tile_args(
    table: Tensor | None, tokens: Tensor | None, bias_read: str, grid_h, grid_w, prefix, n, tm, tw, q, kernel: str,
    memo: dict | None = None, divisor: float | None = None,
):  # fmt: skip
    """``(tiles, n_kt, n_pat, d_min, g_d, n_m, g_m)`` for the ``kernel``'s launch: the bias tiles of the base-2
    ``table`` on a full grid where ``bias_read`` takes them (:func:`tile_dtype`), else a placeholder and ``n_pat = 0``
    (the bias gathered per score); ``memo`` (one call's): the tiles of one shape and type made once for its forward
    and backward; ``divisor`` (:func:`_bias_divisor`): the tiles divided by it, with a finite stand-in for ``-inf``
    (:func:`_stand_in`), for a product, where their patterns allow (:func:`_product_tiles`)."""
    if table is not None and tokens is None and bias_read != "gather":
        pat = tile_patterns(grid_w, n, tm, tw)
        dtype = tile_dtype(q.dtype, kernel)
        size = table.shape[0] * pat.n_pat * tm * tw * dtype.itemsize
        if size <= TILE_BUDGET_BYTES:
            divisor = divisor if _product_tiles(pat.n_m, prefix, n, tw) else None
            key = ("tiles", tm, tw, dtype, divisor)
            if memo is not None and key in memo:
                return memo[key], *pat
            tiles = bias_tiles(table, grid_h, grid_w, prefix, pat, tm, tw)
            if divisor is not None:  # (an operand of a product: -inf's stand-in finite, as 0 * -inf is NaN)
                tiles = (tiles / divisor).clamp(min=_stand_in(dtype))
            tiles = tiles.to(dtype)
            if memo is not None:
                memo[key] = tiles
            return tiles, *pat
        if bias_read == "tiles":
            raise ValueError(f"bias_read='tiles': {pat.n_pat} tile patterns take {size} bytes, above the budget")
    return _placeholder(torch.float32, 1, q.device), 0, 0, 0, 1, 0, 1


def _pick_tile(
    tiles: list, table, tokens, bias_read: str, grid_h, grid_w, prefix, n, q, kernel: str, memo=None, divisor=None
):  # fmt: skip
    """``(BM, BN, bias tiles, tiling)`` of ``kernel``'s launch: the first of ``tiles`` (a wide one, or None, then the
    narrow one) whose bias is read whole (its tiles within the budget: else the narrow one's, gathered or not), or any
    where there is no table (:func:`_tile_args`)."""
    tiles = [c for c in tiles if c]
    for bm, bn in tiles:
        read = "auto" if (bm, bn) != tiles[-1] and bias_read == "tiles" else bias_read
        bt, *tiling = _tile_args(table, tokens, read, grid_h, grid_w, prefix, n, bm, bn, q, kernel, memo, divisor)
        if table is None or tiling[1] > 0:
            break
    return bm, bn, bt, tiling


def _mask_args(mask: Tensor | None, q: Tensor) -> tuple[Tensor, int, int, int]:
    """The kernels' ``MASK`` (a float mask in base 2, or region ids), its row stride, rows and ``MASK_KIND``."""
    if mask is None:
        return _placeholder(torch.float32, 1, q.device), 0, 1, 0
    if not mask.is_floating_point():
        return mask, mask.stride(0), mask.shape[0], 2
    return mask * _kernels().LOG2E, mask.stride(0), mask.shape[0], 1


#: the parameters the forward op and its backward share, declared once in their schemas: the inputs and the call's
#: settings (``torch.library`` ops, so ``torch.compile`` captures each as one node)
_INPUTS = "Tensor q, Tensor k, Tensor v, Tensor? table, Tensor? mask, Tensor? tokens, Tensor? blocks"
_SETTINGS = "float scale, SymInt grid_h, SymInt grid_w, int prefix, bool causal, str bias_read, bool deterministic"
torch.library.define("vitrel::rel_bias_attention", f"({_INPUTS}, {_SETTINGS}) -> (Tensor, Tensor)")
torch.library.define(
    "vitrel::rel_bias_attention_bwd",
    f"(Tensor do, {_INPUTS}, Tensor out, Tensor lse, {_SETTINGS}, bool table_grad) -> (Tensor, Tensor, Tensor, Tensor)",
)


class Launch(NamedTuple):
    """One launch of a kernel of :mod:`vitrel.kernels._triton_bias_kernels`: its name (:data:`_KERNELS`),
    grid, every argument by name (``constexpr`` ones too) and launch options (``num_warps``, ``num_stages`` on CUDA;
    none in the interpreter). The op builds its launches as these and runs them; :func:`plan` returns them for
    :func:`compile_launch` to compile ahead of time exactly as Triton's JIT would at that call."""

    kernel: str
    grid: tuple[int, ...]
    args: dict
    options: dict

    @classmethod
    def make(cls, kernel: str, grid: tuple[int, ...], positional: list, constexprs: dict, options: dict) -> Launch:
        fn = _kernel_fn(kernel)
        if len(positional) + len(constexprs) != len(fn.arg_names):
            raise TypeError(f"{kernel}: {len(positional)} + {len(constexprs)} arguments for {len(fn.arg_names)}")
        return cls(kernel, grid, {**dict(zip(fn.arg_names, positional)), **constexprs}, options)

    def __call__(self) -> None:
        if self.args.get("TMA"):  # (tensor descriptors made in the kernel take global scratch from Triton's allocator)
            contextvars.copy_context().run(self._with_scratch)
        else:
            _kernel_fn(self.kernel)[self.grid](**self.args, **self.options)

    def _with_scratch(self) -> None:
        """The launch with Triton's allocator set to torch's on the inputs' device, in a copy of the caller's context
        (Triton keeps its allocator in a context variable: nothing is left set after the launch)."""
        import triton

        device = self.args["Q"].device
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
        _kernel_fn(self.kernel)[self.grid](**self.args, **self.options)


#: the kernels of :mod:`vitrel.kernels._triton_bias_kernels` by their launches' names
_KERNELS = {
    "fwd": "_fwd_kernel", "fwd_tile": "_fwd_tile_kernel", "delta": "_bwd_delta_kernel", "dkdv": "_bwd_dkdv_kernel",
    "dq": "_bwd_dq_kernel", "dbias": "_bwd_dbias_kernel", "tile": "_bwd_tile_kernel",
    "table_grad": "_table_grad_kernel",
}  # fmt: skip


def _kernel_fn(kernel: str):
    return getattr(_kernels(), _KERNELS[kernel])


#: the most programs a CUDA grid takes on its second axis (the fwd and dkdv kernels put ``batch x heads`` there)
GRID_Y_MAX = 65535
#: the arguments of the fwd and dkdv kernels with a batch axis first (``TOK`` on a token layout)
_BATCHED = ("Q", "K", "V", "O", "LSE", "DO", "DELTA", "DK", "DV")


def _batch_chunks(launch: Launch, batch: int, heads: int) -> list[Launch]:
    """``launch`` (grid ``(tiles, batch x heads)``) as launches over consecutive shares of the batch, each within
    :data:`GRID_Y_MAX` programs on its second axis: a batch of windows beyond it (Swin-T's first stage at more than
    341 images: 64 windows x 3 heads each); one launch where it fits. A share starts at a multiple of the mask's rows
    (batch ``b`` reads row ``b mod Mb``), or slices them where there is one per batch element."""
    if batch * heads <= GRID_Y_MAX:
        return [launch]
    a = launch.args
    names = [*_BATCHED, *(("TOK",) if a["LAYOUT"] else ()), *(("DQ",) if a.get("ATOMIC_DQ") else ())]
    rows = a["n_mask_b"] if a["MASK_KIND"] else 1
    if a["MASK_KIND"] and rows == batch:
        names.append("MASK")
        rows = 1
    step = GRID_Y_MAX // heads // rows * rows
    if step == 0:
        raise ValueError(f"rel_bias_attention: {heads} heads and {rows} mask rows exceed CUDA's grid ({GRID_Y_MAX})")
    out = []
    for b0 in range(0, batch, step):
        b1 = min(batch, b0 + step)
        args = {**a, **{k: a[k][b0:b1] for k in names if k in a}}
        out.append(launch._replace(grid=(launch.grid[0], (b1 - b0) * heads), args=args))
    return out


#: the :func:`_constexprs` flags the one-tile kernels take (``fwd_tile``, ``tile``: no token layout, no tile lists)
_TILE_FLAGS = ("D", "BLOCK_D", "HAS_TABLE", "MASK_KIND", "CAUSAL", "TILED", "PREC", "RAW")


def _constexprs(d, block_d, table, mask_kind, causal, tokens, blocks, tiling, dtype, scale, product=False) -> dict:
    """The ``constexpr`` flags every kernel takes; ``RAW``: the logits scaled as the softmax subtracts (one FFMA a
    score), where nothing is added to them in base 2 (no table, no float mask) and the scale is positive (the row's
    maximum is taken of the unscaled logits); 2 where the tiles, divided by the scale, are added by a product
    (``product``: :func:`_by_product`)."""
    return dict(
        D=d, BLOCK_D=block_d, HAS_TABLE=table is not None, MASK_KIND=mask_kind, CAUSAL=causal,
        LAYOUT=tokens is not None, HAS_BLOCKS=blocks is not None, TILED=tiling[1] > 0, PREC=_prec(dtype),
        RAW=2 if product else table is None and mask_kind != 1 and scale > 0,
    )  # fmt: skip


def _fwd_launch(
    q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read, out, lse, sms,
    tile=None, options=None, memo=None,
) -> Launch:  # fmt: skip
    """The forward's launch writing ``out`` and ``lse`` (``sms``: the device's multiprocessors, None in the
    interpreter); ``tile`` ``(BM, BN)`` and ``options`` replace the device's. A call whose tokens fit one tile of the
    backward takes the one-tile forward (:data:`TILE_FWD`)."""
    b, h, n, d = q.shape
    cuda = sms is not None
    block_d, bm0, bn0, blk = _blocks(d, cuda)
    t, stg, sth = _table_args(table, q, memo)
    m, smb, nmb, mask_kind = _mask_args(mask, q)
    if TILE_FWD and tile is None and tokens is None and n <= blk:
        bt, *tiling = _tile_args(None if table is None else t, None, bias_read, grid_h, grid_w, prefix, n, blk, blk, q,
                                 "fwd", memo)  # fmt: skip
        n_split = _n_split(1, h, b, sms)
        flags = _constexprs(d, block_d, table, mask_kind, causal, None, None, tiling, q.dtype, scale)
        return Launch.make(
            "fwd_tile", (n_split, h),
            [q, k, v, t, m, _int_args(None, q), bt, out, lse, *_strides(q, k, v, out), stg, sth, smb, nmb, b, h, n,
             prefix, grid_h, grid_w, scale * _kernels().LOG2E, n_split],
            {**{name: flags[name] for name in _TILE_FLAGS}, "BM": blk},
            (options or LAUNCH.get(("fwd_tile", block_d), LAUNCH["fwd_tile"])) if cuda else {},
        )  # fmt: skip
    wide = _wide_tile("fwd", block_d, cuda) if tokens is None and mask_kind == 0 and not tile else None
    divisor = _bias_divisor(table, tokens, blocks, mask_kind, scale, False, q.dtype, "fwd")
    bm, bn, bt, tiling = _pick_tile(
        [tile] if tile else [wide, (bm0, bn0)], None if table is None else t, tokens, bias_read, grid_h, grid_w, prefix,
        n, q, "fwd", memo, divisor,
    )  # fmt: skip
    visits = tile_lists(tile_flags(blocks, bm, bn, causal))  # the key tiles each query tile visits
    positional = [
        q, k, v, t, m, _int_args(tokens, q), _int_args(visits, q), bt, out, lse, *_strides(q, k, v, out), stg, sth,
        smb, nmb, h, n, prefix, grid_h, grid_w, scale * _kernels().LOG2E, *tiling,
    ]  # fmt: skip
    product = _by_product(divisor, tiling, prefix, n, bn)
    flags = _constexprs(d, block_d, table, mask_kind, causal, tokens, blocks, tiling, q.dtype, scale, product)
    opts = (options or LAUNCH.get(("fwd", block_d), LAUNCH["fwd"])) if cuda else {}
    tma = triton_cdiv(n, bn) >= TMA_MIN_TILES and tma_reads("fwd", k, v, block_d, cuda)
    one = triton_cdiv(n, bn) == 1  # (the loop's one visit: no rescaling)
    consts = dict(**flags, BM=bm, BN=bn, TMA=tma, ONE=one)
    return Launch.make("fwd", (triton_cdiv(n, bm), b * h), positional, consts, opts)


def _fwd_impl(
    q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic, memo=None
):
    """``vitrel::rel_bias_attention``: the output and its rows' base-2 log-sum-exp (what the backward reads);
    ``memo``: :class:`_Eager`'s (what the backward may take again). Checks the device here, where eager calls,
    compiled graphs and ``torch.export`` programs all run the kernels."""
    check_device(q.device, q.dtype)
    b, h, n, _ = q.shape
    out = q.new_empty(q.shape)  # contiguous, as the fake says (inductor may hand q in another layout)
    lse = torch.empty(b, h, stats_len(n), device=q.device, dtype=torch.float32)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else None
    args = (table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read)  # (the forward is one)
    launch = _fwd_launch(q, k, v, *args, out, lse, sms, memo=memo)
    for part in _batch_chunks(launch, b, h) if launch.kernel == "fwd" else [launch]:  # (fwd_tile: a share a program)
        part()
    return out, lse


torch.library.register_kernel("vitrel::rel_bias_attention", None, _fwd_impl)  # (the function kept: host_overhead.py)


@torch.library.register_fake("vitrel::rel_bias_attention")
def _fwd_fake(q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic):
    return q.new_empty(q.shape), q.new_empty((*q.shape[:2], stats_len(q.shape[2])), dtype=torch.float32)


def stats_len(n: int) -> int:
    """The padded length of the per-token buffers of ``n`` tokens (the forward's log-sum-exp, the backward's ``D``,
    a layout's tokens): a multiple of the kernels' ``STATS_ROWS``, so the kernels read them with no mask."""
    rows = _kernels().STATS_ROWS.value
    return (n + rows - 1) // rows * rows


def _n_split(programs: int, heads: int, batch: int, sms: int | None) -> int:
    """Batch shares of the ``dq`` and ``dbias`` kernels (``programs`` a head and share: query blocks, tile patterns):
    enough programs to fill a device of ``sms`` multiprocessors (4 per SM), no more than the batch; 2 in the
    interpreter (``sms`` None)."""
    if sms is None:
        return min(batch, 2)
    return max(1, min(batch, math.ceil(4 * sms / (programs * heads))))


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


class _Backward(NamedTuple):
    """The backward's launches (``delta`` first: ``rowsum(o * do)``, which the others read), or its one launch
    (``tile``: :data:`TILE_BWD`), and what they write: ``dq, dk, dv`` (``dq`` in float32 where the ``dkdv`` kernel
    adds it by atomics: no ``dq`` launch); the table's gradient as the ``dq`` kernel's diagonal sums (``slots``),
    or, where the bias is read as tiles, as the ``dbias`` kernel's sums per tile pattern (``dbt``)."""

    delta: Launch | None
    dkdv: Launch | None
    dq: Launch | None
    dbias: Launch | None
    grads: tuple[Tensor, Tensor, Tensor]
    slots: Tensor
    dbt: Tensor | None
    patterns: TilePatterns
    blk: int
    tile: Launch | None = None


def _bwd_launches(
    do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic,
    table_grad, sms, tile=None, options=None, memo=None,
) -> _Backward:  # fmt: skip
    """The backward's launches (``sms``: the device's multiprocessors, None in the interpreter); ``tile`` (the square
    tile) and ``options`` replace the device's. Not ``deterministic`` (and :func:`torch.use_deterministic_algorithms`
    not set), the ``dkdv`` kernel adds ``dq`` by atomics and no ``dq`` kernel runs, unless that kernel reduces the
    table's gradient (gathered bias, token layouts), which costs the atomics nothing to spare."""
    b, h, n, d = q.shape
    cuda = sms is not None
    block_d, _, _, blk = _blocks(d, cuda)
    blk = tile or blk
    do = do if do.stride(-1) == 1 else do.contiguous()  # (read through its strides, as q, k, v)
    t, stg, sth = _table_args(table, q, memo)
    m, smb, nmb, mask_kind = _mask_args(mask, q)
    tok = _int_args(tokens, q)
    tab = None if table is None else t
    one_tile = TILE_BWD and n <= blk and tokens is None  # (the one-tile kernel's, where it takes the call)
    div = {kernel: _bias_divisor(table, tokens, blocks, mask_kind, scale, one_tile, q.dtype, kernel)
           for kernel in _PRODUCT_KERNELS}  # fmt: skip
    bt, *tiling = _tile_args(tab, tokens, bias_read, grid_h, grid_w, prefix, n, blk, blk, q, "dq", memo, div["dq"])
    qk_scale = scale * _kernels().LOG2E

    def consts(til, tw, kernel):  # the constexpr flags of kernel's launch with the bias tiling til of [., tw] tiles
        product = _by_product(div.get(kernel), til, prefix, n, tw)
        return _constexprs(d, block_d, table, mask_kind, causal, tokens, blocks, til, q.dtype, scale, product)

    flags = consts(tiling, blk, "tile")
    grad_t = table_grad and table is not None
    if one_tile and (flags["TILED"] or not grad_t):
        inputs = [q, k, v, t, m, tok, bt, out, do, lse, *_strides(q, k, v, out, do), stg, sth, smb, nmb]
        sizes = [h, n, prefix, grid_h, grid_w, qk_scale, scale]
        return _tile_bwd_launch(inputs, sizes, flags, grad_t, TilePatterns(*tiling), sms, blk, options)
    rows = _kernels().STATS_ROWS.value  # the delta kernel's: one program a padded block of the buffer
    delta = torch.empty(b, h, stats_len(n), device=q.device, dtype=torch.float32)  # rowsum(o * do), FA-2's D
    delta_launch = Launch.make(
        "delta", (b * h, stats_len(n) // rows), [out, do, delta, *_strides(out, do), h, n],
        dict(D=d, BLOCK_D=block_d, BM=rows), {"num_warps": 8} if cuda else {},
    )  # fmt: skip
    dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the fakes
    visible = tile_flags(blocks, blk, blk, causal)  # dbias reads them; dq its rows listed
    opts = (options or LAUNCH.get(("bwd", block_d), LAUNCH["bwd"])) if cuda else {}

    # (tile, tiles' dtype, divisor) -> _pick_tile's: the dq and dbias kernels' wide tiles are one set (where neither or
    # both add them by a product)
    made: dict = {}

    def pick(kernel: str):
        """``(BM, BN, bias tiles, tiling, visible-tile flags, launch options)`` of ``kernel`` (``dkdv``: keys held
        ``BN``, queries streamed ``BM``; ``dq`` and ``dbias``: queries held ``BM``): its wide tile where its bias is
        read whole or there is none, else the square one; divided by the scale where it adds them by a product."""
        wide = _wide_tile(kernel, block_d, cuda) if tile is None and tokens is None and mask_kind == 0 else None
        if wide is None and div.get(kernel) == div["dq"]:
            return blk, blk, bt, tiling, visible, opts
        key = (wide, tile_dtype(q.dtype, kernel), div.get(kernel))
        if key not in made:
            made[key] = _pick_tile([wide, (blk, blk)], tab, tokens, bias_read, grid_h, grid_w, prefix, n, q, kernel,
                                   memo, div.get(kernel))  # fmt: skip
        tm, tw, bias, til = made[key]
        if (tm, tw) == (blk, blk):
            return blk, blk, bias, til, visible, opts
        return tm, tw, bias, til, tile_flags(blocks, tm, tw, causal), options or LAUNCH.get((kernel, block_d)) or opts

    dm, dn, bt_kv, tiling_kv, kv_visible, opts_kv = pick("dkdv")
    by_cols = tile_lists(None if kv_visible is None else kv_visible.transpose(1, 2))

    def inputs(tiles, bias=bt):  # (the kernels' BLK: which tiles they visit)
        return [q, k, v, t, m, tok, _int_args(tiles, q), bias, do, lse, delta]

    common = [*_strides(q, k, v, do), stg, sth, smb, nmb]
    sizes = [h, n, prefix, grid_h, grid_w, qk_scale, scale]
    by_tiles = grad_t and flags["TILED"]  # the table's gradient by tile pattern (dbias), else in the dq kernel
    diagonals = grad_t and not by_tiles  # (the dq kernel sums the table gradient's diagonals: gathered, layouts)
    atomic = not (deterministic or torch.are_deterministic_algorithms_enabled() or diagonals)
    # dq added by the dkdv kernel in the key blocks' order (DQ_IN_ORDER): deterministic, where every key block visits
    # every query tile (a full grid, nothing masked or skipped) and no dq kernel sums the table's gradient
    ordered = DQ_IN_ORDER and not (atomic or diagonals)
    ordered = ordered and tokens is None and blocks is None and not causal and mask_kind == 0
    # dq: added into float32 by the dkdv kernel's atomics, or written by the dq kernel, or by the dkdv kernel in
    # order (its float32 sums, which the first key block stores; the last writes dq)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic else q.new_empty(q.shape)
    if atomic or ordered:
        dq_acc = dq if atomic else torch.empty(q.shape, device=q.device, dtype=torch.float32)
    else:
        dq_acc = _placeholder(q.dtype, 4, q.device)
    locks = (
        torch.zeros(b, h, triton_cdiv(n, dm), device=q.device, dtype=torch.int32)
        if ordered
        else _placeholder(torch.int32, 1, q.device)
    )
    # the bias tiles' gradient summed by the dkdv kernel (TABLE_GRAD_IN_DKDV), where it adds dq (no dq kernel to sum
    # it) and each of its tiles is one pattern; transposed, keys by queries, as the kernel's tiles
    in_dkdv = TABLE_GRAD_IN_DKDV and by_tiles and (atomic or ordered) and dm == dn
    in_dkdv = in_dkdv and tiling_kv[1] > 0 and tiling_kv[4] == 0
    shares = in_dkdv or ordered  # (programs of a key block, a head and a share of the batch)
    n_kb = triton_cdiv(n, dn)
    split_kv = _n_split(n_kb, h, b, sms) if shares else 1
    dbt_kv = (
        torch.zeros(split_kv, h, tiling_kv[1], dn, dm, device=q.device, dtype=torch.float32)
        if in_dkdv
        else _placeholder(torch.float32, 1, q.device)
    )
    if in_dkdv and cuda:
        opts_kv = options or LAUNCH.get(("dkdv_sums", block_d), opts_kv)
    dkdv = Launch.make(
        "dkdv", (n_kb, h, split_kv) if shares else (n_kb, b * h),
        [*inputs(by_cols, bt_kv), dk, dv, dq_acc, dbt_kv, locks, dq,  # (DQO: dq, written only where ordered)
         *common, *_strides(dk, dv, dq_acc), b, *sizes, *tiling_kv, split_kv],
        dict(**consts(tiling_kv, dn, "dkdv"), BM=dm, BN=dn, ATOMIC_DQ=atomic, TILE_GRAD=in_dkdv, SHARES=shares,
             ORDERED_DQ=ordered, NT=32 * opts_kv.get("num_warps", 4)), opts_kv,
    )  # fmt: skip
    # dq: the square tile where it sums the table gradient's diagonals (gathered bias, token layouts), else as pick
    qm, qn, bt_q, tiling_q, q_visible, opts_q = (blk, blk, bt, tiling, visible, opts)
    if not (diagonals or atomic or ordered):
        qm, qn, bt_q, tiling_q, q_visible, opts_q = pick("dq")
    n_b = triton_cdiv(n, qm)
    n_split = _n_split(n_b, h, b, sms)
    # per program: a full grid's diagonal sums per key block (n_b x 2 cases x 2 blk), a layout's whole table
    slot_size = (table.numel() // h if tokens is not None else n_b * 4 * blk) if diagonals else 0
    slots = torch.zeros(n_split, h, n_b, slot_size, device=q.device, dtype=torch.float32)
    scratch = (
        torch.empty(n_split * h * n_b * blk * blk, device=q.device)
        if slot_size and tokens is not None
        else _placeholder(torch.float32, 1, q.device)
    )
    # the bias tiles' gradient summed by the dq kernel (TABLE_GRAD_IN_DQ), where each of its tiles is one pattern
    in_dq = TABLE_GRAD_IN_DQ and by_tiles and not (atomic or ordered) and tiling_q[1] > 0 and tiling_q[4] == 0
    dbt_q = (
        torch.zeros(n_split, h, tiling_q[1], qm, qn, device=q.device, dtype=torch.float32)
        if in_dq
        else _placeholder(torch.float32, 1, q.device)
    )
    dq_launch = None if atomic or ordered else Launch.make(
        "dq", (n_b, h, n_split), [*inputs(tile_lists(q_visible), bt_q), dq, slots, scratch, dbt_q, *common,
        *_strides(dq), b, *sizes, *tiling_q, n_split, slot_size],
        dict(**consts(tiling_q, qn, "dq"), BM=qm, BN=qn, TABLE_GRAD=diagonals, TILE_GRAD=in_dq), opts_q,
    )  # fmt: skip
    dbias = dbt = None
    tiling_t = tiling
    if in_dq:
        dbt, tiling_t = dbt_q, tiling_q
    elif in_dkdv:
        dbt, tiling_t = dbt_kv.transpose(-1, -2), tiling_kv
    elif by_tiles:
        tm, tw, bt_t, tiling_t, t_visible, opts_t = pick("dbias")
        n_pat = tiling_t[1]
        split_t = _n_split(n_pat, h, b, sms)
        dbt = torch.empty(split_t, h, n_pat, tm, tw, device=q.device, dtype=torch.float32)  # each program writes
        order = _dbias_order(TilePatterns(*tiling_t), n, tm, tw, grid_w, causal, h, split_t, q.device)
        sizes_t = [*sizes[:6], *tiling_t, split_t]
        dbias = Launch.make(
            "dbias", (n_pat * h * split_t,), [*inputs(t_visible, bt_t), order, dbt, *common, b, *sizes_t],
            dict(**consts(tiling_t, tw, "dbias"), BM=tm, BN=tw, BATCH_OUTER=block_d in DBIAS_BATCH_OUTER), opts_t,
        )  # fmt: skip
    return _Backward(delta_launch, dkdv, dq_launch, dbias, (dq, dk, dv), slots, dbt, TilePatterns(*tiling_t), blk)


#: the forward of a call whose tokens fit one square tile of the backward (the one-tile backward's calls,
#: :data:`TILE_BWD`; token layouts excepted) runs as
#: :func:`vitrel.kernels._triton_bias_kernels._fwd_tile_kernel`, a share of the batch a program, instead of
#: :func:`~vitrel.kernels._triton_bias_kernels._fwd_kernel`'s program per batch element; ``bench/triton_tune.py``
#: times the latter (False)
TILE_FWD = True

#: the backward of a call whose tokens fit one square tile of the backward (``N <= 64`` at head dims up to 64 on a GPU,
#: ``N <= 16`` in the interpreter; a batch of Swin's 7 x 7 windows) runs as one kernel (``tile``:
#: :func:`vitrel.kernels._triton_bias_kernels._bwd_tile_kernel`) instead of ``delta``, ``dkdv``, ``dq`` and ``dbias``,
#: except on a token layout and where the table's gradient would be gathered per score; ``bench/triton_tune.py`` times
#: the four kernels it replaces (False)
TILE_BWD = True


def _tile_bwd_launch(
    inputs: list, sizes: list, flags: dict, grad_t: bool, pat: TilePatterns, sms: int | None, blk: int, options,
) -> _Backward:  # fmt: skip
    """The one-tile backward (:data:`TILE_BWD`) of a call of ``N <= blk`` tokens (``inputs``: q, k, v, the table, the
    mask, the tokens' placeholder, the bias tiles, o, do, the log-sum-exp and their strides; ``sizes``; ``flags``,
    :func:`_constexprs`'; ``grad_t``: the table's gradient, its bias read as tiles). Programs ``(share, head)``: one
    per batch element, or where it sums the table's gradient, :func:`_n_split`'s shares (the sums' buffer,
    ``[n_split, heads, 1, blk, blk]``, stays small)."""
    q, k, v = inputs[:3]
    b, h = q.shape[:2]
    n_split = _n_split(1, h, b, sms) if grad_t else b
    # (one shape, _op_args checked, so one contiguous layout: the kernel stores all three through dq's strides)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    dbt = torch.empty(n_split, h, 1, blk, blk, device=q.device, dtype=torch.float32) if grad_t else None
    kind = "tile" if grad_t else "tile_each"
    opts = (options or LAUNCH.get((kind, flags["BLOCK_D"]), LAUNCH[kind])) if sms is not None else {}
    launch = Launch.make(
        "tile", (n_split, h),
        [*inputs[:10], dq, dk, dv, dbt if grad_t else _placeholder(torch.float32, 1, q.device), *inputs[10:],
         *_strides(dq), b, *sizes, n_split],
        {**{name: flags[name] for name in _TILE_FLAGS}, "BM": blk, "TABLE_GRAD": grad_t}, opts,
    )  # fmt: skip
    return _Backward(None, None, None, None, (dq, dk, dv), q.new_empty(0), dbt, pat, blk, launch)


def _bwd_impl(
    do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic,
    table_grad, memo=None,
):  # fmt: skip
    """``vitrel::rel_bias_attention_bwd``: ``dq, dk, dv`` and, with ``table_grad``, the table's gradient; ``memo``:
    what :class:`_Eager`'s forward made (the base-2 table, the bias tiles)."""
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else None
    bwd = _bwd_launches(
        do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read,
        deterministic, table_grad, sms, memo=memo,
    )  # fmt: skip
    if bwd.tile is not None:
        bwd.tile()
        dt = q.new_zeros(0, dtype=torch.float32)
        if bwd.dbt is not None:
            dt = table_grad_from_tiles(bwd.dbt, bwd.patterns, grid_h, grid_w, prefix)
        return (*bwd.grads, dt)
    bwd.delta()
    for launch in [bwd.dkdv] if bwd.dkdv.args["SHARES"] else _batch_chunks(bwd.dkdv, *q.shape[:2]):
        launch()  # (SHARES's programs: a head and share each, the batch in their loop)
    dq, dk, dv = bwd.grads
    if bwd.dkdv.args["ATOMIC_DQ"]:  # added by atomics in float32
        dq = dq.to(q.dtype)
    elif bwd.dq is not None:  # (else written by the dkdv kernel: ORDERED_DQ)
        bwd.dq()
    h, slots = q.shape[1], bwd.slots
    if bwd.dbias is not None:
        bwd.dbias()
    if bwd.dbt is not None:  # (the dbias kernel's sums, or the dq kernel's: TABLE_GRAD_IN_DQ)
        dt = table_grad_from_tiles(bwd.dbt, bwd.patterns, grid_h, grid_w, prefix)
    elif bwd.dq is None or not bwd.dq.args["TABLE_GRAD"]:
        dt = q.new_zeros(0, dtype=torch.float32)
    elif tokens is not None:  # [n_split, heads, n_qb, G K] -> [G, heads, 2 GH - 1, 2 GW - 1]
        dt = slots.sum((0, 2)).view(h, table.shape[0], *table.shape[2:]).transpose(0, 1).contiguous()
    else:
        n_split, _, n_b, _ = slots.shape
        dt = table_grad_from_slots(slots.view(n_split, h, n_b, n_b, 2, 2 * bwd.blk), grid_h, grid_w, bwd.blk)
    return dq, dk, dv, dt


torch.library.register_kernel("vitrel::rel_bias_attention_bwd", None, _bwd_impl)


@torch.library.register_fake("vitrel::rel_bias_attention_bwd")
def _bwd_fake(
    do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic,
    table_grad,
):  # fmt: skip
    dt = table.new_empty(table.shape) if (table_grad and table is not None) else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dt


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


def table_grad_from_tiles(dbt: Tensor, pat: TilePatterns, grid_h: int, grid_w: int, prefix: int) -> Tensor:
    """``dT [heads, 2 GH - 1, 2 GW - 1]`` (float32) from the gradient of the bias tiles, the ``dbias`` kernel's sums of
    ``dS`` per pattern ``dbt [n_split, heads, n_pat, tm, tw]`` over its batch shares (zero off the patch pairs): the
    adjoint of :func:`bias_tiles`, summed over the shares. Each tile entry adds to the table entry it was gathered
    from (where each pattern is one exact tile, its patch pairs only), in one launch of
    :func:`~vitrel.kernels._triton_bias_kernels._table_grad_kernel` that sums each table entry's tile entries in a
    fixed order (:func:`_table_grad_index`): deterministic. ``dbt`` may be the transpose of its last two axes' storage
    (the ``dkdv`` kernel's sums, keys by queries): read as stored, through an index made for it, with no copy."""
    n_split, heads, n_pat, tm, tw = dbt.shape
    transposed = not dbt.is_contiguous() and dbt.transpose(-1, -2).is_contiguous()
    src, ptr = _table_grad_index(pat, tm, tw, prefix, grid_h, grid_w, transposed, dbt.device)
    n_t = (2 * grid_h - 1) * (2 * grid_w - 1)
    dt = torch.empty(heads, 2 * grid_h - 1, 2 * grid_w - 1, device=dbt.device, dtype=torch.float32)
    block = TABLE_GRAD_BLOCK
    opts = LAUNCH["table_grad"] if dbt.device.type == "cuda" else {}
    stored = dbt.transpose(-1, -2) if transposed else dbt.contiguous()
    Launch.make(
        "table_grad", (triton_cdiv(n_t, block), heads), [stored, src, ptr, dt, heads, n_pat * tm * tw, n_t, n_split],
        dict(BLOCK=block), opts,
    )()  # fmt: skip
    return dt


#: the table entries a program of :func:`table_grad_from_tiles`'s kernel sums
TABLE_GRAD_BLOCK = 128


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
    f = _kernels().FLAG_TILE.value
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
    tile = _kernels().FLAG_TILE.value
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


def _setup(ctx, inputs, output):
    q, k, v, table, mask, tokens, blocks, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, table, mask, tokens, blocks, out, lse)
    ctx.args = tuple(args)  # scale, grid_h, grid_w, prefix, causal, bias_read, deterministic


def _backward(ctx, dout, dlse):
    q, k, v, table, mask, tokens, blocks, out, lse = ctx.saved_tensors
    need_t = table is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dt = torch.ops.vitrel.rel_bias_attention_bwd(
        dout, q, k, v, table, mask, tokens, blocks, out, lse, *ctx.args, need_t
    )
    return dq, dk, dv, (dt if need_t else None), *(None,) * 10


torch.library.register_autograd("vitrel::rel_bias_attention", _backward, setup_context=_setup)


class _Eager(torch.autograd.Function):
    """The op's bodies in eager mode, as an autograd function: the same kernels, launched the same way, without the
    dispatcher's and ``torch.library``'s autograd wrapper's host work (on the H100 machine's host, 86 us and 285 us of
    a 799 us forward call, ``bench/results/host_overhead_h100.md``), and with what the forward made for the kernels
    (the base-2 table, the bias tiles) kept for its backward instead of made again. Under ``torch.compile`` and
    ``torch.export``, :func:`rel_bias_attention` calls the custom op instead (one node of the graph, its fake and
    autograd registered)."""

    @staticmethod
    def forward(ctx, q, k, v, table, mask, tokens, blocks, *settings):
        memo: dict = {}
        out, lse = _fwd_impl(q, k, v, table, mask, tokens, blocks, *settings, memo=memo)
        ctx.save_for_backward(q, k, v, table, mask, tokens, blocks, out, lse)
        ctx.settings, ctx.memo = settings, memo  # (memo: tensors made without a graph, read once by the backward)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, table, mask, tokens, blocks, out, lse = ctx.saved_tensors
        need_t = table is not None and ctx.needs_input_grad[3]
        memo, ctx.memo = ctx.memo, None
        dq, dk, dv, dt = _bwd_impl(dout, q, k, v, table, mask, tokens, blocks, out, lse, *ctx.settings, need_t, memo)
        return dq, dk, dv, (dt if need_t else None), *(None,) * 10


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
    deterministic: bool = True,
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
    whole. ``bias_read`` (:data:`BIAS_READS`): how the kernels read a full grid's bias (:func:`tile_patterns`).

    ``deterministic`` (default): two backward passes are bitwise equal. ``False``: ``dq`` is added by atomics, as
    FlashAttention-2's backward (and so SDPA's) adds it, which spares the backward a kernel where the table's
    gradient is not reduced by it (a fixed table, no table, the bias read as tiles), and its low bits change from run
    to run; :func:`torch.use_deterministic_algorithms` set overrides it (PyTorch's rule: the deterministic algorithm
    where there is one)."""
    args = _op_args(
        q, k, v, table, grid, num_prefix_tokens, scale, mask, causal, tokens, blocks, bias_read, regions, deterministic
    )
    if torch.compiler.is_compiling():
        return torch.ops.vitrel.rel_bias_attention(*args)[0]
    return _Eager.apply(*args)


def _padded_tokens(tokens: Tensor, n: int) -> Tensor:
    """A layout's tokens ``[B, 4, n]`` padded to ``[B, 4, stats_len(n)]``, as the kernels read them (with no mask):
    the padding's segment -2, row -1 (no patch), column and group 0."""
    pad = (0, stats_len(n) - n)
    parts = [torch.nn.functional.pad(tokens[:, i : i + 1], pad, value=x) for i, x in enumerate((-2, -1))]
    return torch.cat([*parts, torch.nn.functional.pad(tokens[:, 2:], pad, value=0)], 1).contiguous()


def _op_args(
    q, k, v, table, grid, num_prefix_tokens, scale, mask, causal, tokens, blocks, bias_read, regions, deterministic=True
) -> tuple:
    """The custom op's arguments for a call of :func:`rel_bias_attention`, checked."""
    b, h, n, d = q.shape
    gh, gw = grid[0], grid[1]  # (symbolic under torch.export's dynamic sizes: the op's schema takes SymInts)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"rel_bias_attention: q, k, v must have one shape, got {q.shape}, {k.shape}, {v.shape}")
    if tokens is None and n != num_prefix_tokens + gh * gw:
        raise ValueError(f"rel_bias_attention: {n} tokens, but the grid {gh}x{gw} with {num_prefix_tokens} prefix")
    if tokens is not None:
        if tuple(tokens.shape) != (b, 4, n):
            raise ValueError(f"rel_bias_attention: tokens {tuple(tokens.shape)}, expected {(b, 4, n)}")
        if causal:
            raise ValueError("rel_bias_attention: causal attention on a token layout is not supported")
        tokens = _padded_tokens(tokens.to(torch.int32), n)
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
        # the kernels' MASK, read as region ids with no mask: padded to stats_len(n) (-1, a region of no token)
        mask = torch.nn.functional.pad(regions.to(torch.int32), (0, stats_len(n) - n), value=-1).contiguous()
    if mask is not None and b % mask.shape[0]:
        raise ValueError(f"rel_bias_attention: batch {b} is not a multiple of the mask's {mask.shape[0]} rows")
    # the kernels take any strides with a contiguous head dim (the qkv projection's views: no copies, as SDPA)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = d**-0.5 if scale is None else float(scale)
    if bias_read not in BIAS_READS:
        raise ValueError(f"rel_bias_attention: bias_read must be one of {BIAS_READS}, got {bias_read!r}")
    settings = (scale, gh, gw, num_prefix_tokens, causal, bias_read, bool(deterministic))
    return q, k, v, table, mask, tokens, blocks, *settings


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
    attention dropout. Its backward is bitwise repeatable (``deterministic``; ``triton_atomic`` is not)."""

    window_layouts = True
    takes_dropout = False  # (attend says so: an error, and auto does not pick it for a layer that drops)
    onnx = False
    fused_rotation = True
    #: two backward passes bitwise equal (:func:`rel_bias_attention`'s ``deterministic``)
    deterministic: ClassVar[bool] = True

    @classmethod
    def refuses(cls, scheme):
        if scheme.head_dim > MAX_HEAD_DIM:
            return (
                f"attn_impl={cls.name!r} takes head dims up to {MAX_HEAD_DIM}, {scheme.name} is built for "
                f"{scheme.head_dim}: use attn_impl='sdpa'"
            )
        return super().refuses(scheme)

    @classmethod
    def skip_blocks(cls, table, grid, num_prefix_tokens):
        return visible_tiles(table, grid, num_prefix_tokens)

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        if dropout_p > 0.0:
            raise ValueError(f"attn_impl={cls.name!r} has no attention dropout: use attn_impl='sdpa' for attn_drop > 0")
        regions = None
        if isinstance(mask, TokenLayout):  # a batch of windows' layout: its regions masked in the kernel
            mask, regions = None, mask.segment
        if mask is not None and mask.dim() == 4:
            if mask.shape[1] != 1:
                raise ValueError(f"attn_impl={cls.name!r} takes a mask shared by the heads ([B | nW, N, N])")
            mask = mask[:, 0]
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        tokens = None if state.layout is None else layout_tokens(state.layout)
        p, det = state.num_prefix_tokens, cls.deterministic
        settings = dict(causal=state.causal, tokens=tokens, blocks=state.block_mask, regions=regions, deterministic=det)
        return rel_bias_attention(q, k, v, state.table, state.grid, p, scale, mask, **settings)


def plan(
    *args,
    table_grad: bool = True,
    sms: int = 132,
    fwd_tile: tuple[int, int] | None = None,
    bwd_tile: int | None = None,
    fwd_options: dict | None = None,
    bwd_options: dict | None = None,
    **kwargs,
) -> dict[str, Launch]:
    """The launches (``fwd``, ``delta``, ``dkdv``, ``dq`` unless ``dkdv`` adds ``dq`` by atomics, and ``dbias`` where
    the bias is read as tiles) that the call
    ``rel_bias_attention(*args, **kwargs)`` makes, forward and backward (``table_grad``: the table's gradient too), on
    a CUDA device of ``sms`` multiprocessors (an H100 or H200: 132), built from tensors on any device: what
    :func:`compile_launch` compiles without a GPU. ``fwd_tile`` ``(BM, BN)``, ``bwd_tile`` and ``*_options``
    (``num_warps``, ``num_stages``) replace the device's choices."""
    call = inspect.signature(rel_bias_attention).bind(*args, **kwargs)
    call.apply_defaults()
    args = _op_args(*call.arguments.values())
    q, k, v, table, mask, tokens, blocks, scale, gh, gw, prefix, causal, bias_read, deterministic = args
    out, lse = _fwd_fake(*args)  # (the shapes the op makes)
    fwd = _fwd_launch(*args[:-1], out, lse, sms, fwd_tile, fwd_options)
    bwd = _bwd_launches(
        torch.zeros_like(q), q, k, v, table, mask, tokens, blocks, out, lse, scale, gh, gw, prefix, causal, bias_read,
        deterministic, table_grad, sms, bwd_tile, bwd_options,
    )  # fmt: skip
    launches = {"fwd": fwd, "delta": bwd.delta, "dkdv": bwd.dkdv, "dq": bwd.dq, "dbias": bwd.dbias, "tile": bwd.tile}
    return {name: launch for name, launch in launches.items() if launch is not None}


#: Triton's names of the tensors' element types
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32"}


def compile_launch(launch: Launch, arch: int = 90):
    """Compile ``launch``'s kernel ahead of time for CUDA compute capability ``arch`` (no GPU needed: Triton's own
    compiler and ptxas), specialized as Triton's JIT specializes it for that call: integer arguments equal to 1 become
    constants, and integers and tensor addresses divisible by 16 are declared so (what lets the compiler vectorize
    loads); the backend's own rules (``get_int_specialization``, ``get_tensor_specialization``, ``parse_attr``).
    Returns Triton's compiled kernel (its ``metadata``, its ``asm``). Needs Triton's CUDA backend and
    ``TRITON_INTERPRET`` unset (the kernels must be JIT functions)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel_fn(launch.kernel)
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = launch.args[param.name]
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        if isinstance(value, Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[value.dtype]
            spec = BaseBackend.get_tensor_specialization(value, align=True)
        elif isinstance(value, float):
            signature[param.name], spec = "fp32", ""
        else:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            spec = BaseBackend.get_int_specialization(value, align=True)
        if spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def serialized_products(compiled, arch: int = 90) -> bool:
    """Whether ptxas serializes the tensor-core products of a kernel ``compiled`` for ``arch`` (:func:`compile_launch`):
    its performance note C7515 ("wgmma.mma_async instructions are serialized"), where each product waits for the one
    before instead of overlapping it and the work between them (the softmax), as Hopper's asynchronous products are
    meant to. Triton runs the same ptxas (shipped with it) and drops the note; this runs it again on the kernel's PTX
    and reads it. No GPU needed."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        cmd = [get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", ptx, "-o", os.path.join(d, "kernel.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return "C7515" in out.stdout + out.stderr


def compile_for(
    arch: int = 90,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    layout: bool = False,
    regions: bool = False,
    deterministic: bool = True,
) -> dict[str, int]:
    """The three kernels of a small call compiled ahead of time for ``arch`` (:func:`compile_launch`), with a table,
    a mask and the table's gradient: each kernel's shared memory in bytes. The call: a full grid's (8 x 8 and a prefix
    token, visible-tile flags, bias tiles, a float mask); ``layout``: two images packed in a token layout;
    ``regions``: a batch of 7 x 7 windows with their region ids instead of a float mask; not ``deterministic``:
    ``dq`` by atomics (no ``dq`` kernel on a full grid). Catches what the interpreter lets through (types, layouts,
    shared memory)."""
    gen = torch.Generator().manual_seed(0)
    gh = gw = 7 if regions else 8
    p = 0 if regions or layout else 1
    n, b, h = p + gh * gw, 4, 2
    q, k, v = (torch.randn(b, h, n, head_dim, generator=gen).to(dtype) for _ in range(3))
    table = torch.randn(h, 2 * gh - 1, 2 * gw - 1, generator=gen)
    if layout:
        t = torch.arange(n)
        seg = (t >= 40).int()
        t = t - 40 * seg
        tokens = torch.stack([seg, t // 5, t % 5, torch.zeros_like(t)]).int().expand(b, 4, n)
        launches = plan(
            q, k, v, table[None], (gh, gw), mask=torch.zeros(1, n, n), tokens=tokens, deterministic=deterministic
        )
    else:
        from vitrel.pos.geometry import Grid

        blocks = visible_tiles(table, Grid(gh, gw), p)
        extra = {"regions": torch.arange(n).remainder(3).expand(2, n)} if regions else {"mask": torch.zeros(1, n, n)}
        launches = plan(
            q, k, v, table, (gh, gw), p, blocks=blocks, bias_read="tiles", deterministic=deterministic, **extra
        )
    return {name: compile_launch(launch, arch).metadata.shared for name, launch in launches.items()}
