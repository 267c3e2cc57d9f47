"""Fused attention with a relative-position bias read from its offset table: the torch custom op, its autograd
and fakes, and the function users call.

``rel_bias_attention(q, k, v, table, ...)`` computes, for ``q, k, v [B, heads, N, d]`` on a ``GH x GW`` grid after
``P`` prefix tokens (raster order),

    out = softmax(q k^T * scale + bias + mask) v,    bias[h, i, j] = T[h, r_i - r_j + GH - 1, c_i - c_j + GW - 1]

(patch pairs; 0 for pairs with a prefix token), with an optional float mask, windows' region ids, causal masking or
a token layout of packed images. Nothing ``N x N`` is stored; the backward returns ``dq, dk, dv`` and the table's
gradient, reduced in the kernels, deterministic. ``torch.ops.vitrel.rel_bias_attention`` is one node under
``torch.compile`` and ``torch.export``; eager calls run the same bodies as an autograd function.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from vitrel.kernels.triton.config import INTERPRETER, KernelConfig, cuda_config, default_config
from vitrel.kernels.triton.device import check_device
from vitrel.kernels.triton.launch import Launch, batch_chunks
from vitrel.kernels.triton.patterns import (
    FLAG_TILE,
    stats_len,
    table_grad_from_slots,
    table_grad_from_tiles,
    triton_cdiv,
)  # fmt: skip
from vitrel.kernels.triton.planning import BIAS_READS, bwd_launches, fwd_launch, same_layout
from vitrel.layout.tokens import TokenLayout

__all__ = ["layout_tokens", "plan", "rel_bias_attention"]


#: the parameters the forward op and its backward share: the inputs and the call's settings
_INPUTS = "Tensor q, Tensor k, Tensor v, Tensor? table, Tensor? mask, Tensor? tokens, Tensor? blocks"
_SETTINGS = "float scale, SymInt grid_h, SymInt grid_w, int prefix, bool causal, str bias_read, bool deterministic"
torch.library.define("vitrel::rel_bias_attention", f"({_INPUTS}, {_SETTINGS}) -> (Tensor, Tensor)")
torch.library.define(
    "vitrel::rel_bias_attention_bwd",
    f"(Tensor do, {_INPUTS}, Tensor out, Tensor lse, {_SETTINGS}, bool table_grad) -> (Tensor, Tensor, Tensor, Tensor)",
)


def _sms(q: Tensor) -> int | None:
    """The device's multiprocessors on CUDA; None in the interpreter."""
    return torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda" else None


def _fwd_impl(
    q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic, memo=None,
    config=None,
):  # fmt: skip
    """``vitrel::rel_bias_attention``: the output and its rows' base-2 log-sum-exp; ``memo``: what :class:`_Eager`'s
    backward may take again. Checks the device here, where eager, compiled and exported calls all run."""
    check_device(q.device, q.dtype)
    config = config or default_config(q)
    b, h, n, _ = q.shape
    out = q.new_empty(q.shape)  # contiguous, as the fake says (inductor may hand q in another layout)
    lse = torch.empty(b, h, stats_len(n), device=q.device, dtype=torch.float32)
    args = (table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read)
    launch = fwd_launch(q, k, v, *args, out, lse, _sms(q), config, memo)
    chunks = batch_chunks(launch, b, h, config.grid_y_max) if launch.kernel == "fwd" else [launch]
    for part in chunks:  # (fwd_tile: a share of the batch a program)
        part()
    return out, lse


torch.library.register_kernel("vitrel::rel_bias_attention", None, _fwd_impl)


@torch.library.register_fake("vitrel::rel_bias_attention")
def _fwd_fake(q, k, v, table, mask, tokens, blocks, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic):
    return q.new_empty(q.shape), q.new_empty((*q.shape[:2], stats_len(q.shape[2])), dtype=torch.float32)


def _bwd_impl(
    do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read, deterministic,
    table_grad, memo=None, config=None,
):  # fmt: skip
    """``vitrel::rel_bias_attention_bwd``: ``dq, dk, dv`` and, with ``table_grad``, the table's gradient; ``memo``:
    what :class:`_Eager`'s forward made (the base-2 table, the bias tiles)."""
    config = config or default_config(q)
    bwd = bwd_launches(
        do, q, k, v, table, mask, tokens, blocks, out, lse, scale, grid_h, grid_w, prefix, causal, bias_read,
        deterministic, table_grad, _sms(q), config, memo,
    )  # fmt: skip
    if bwd.tile is not None:
        bwd.tile()
        dt = q.new_zeros(0, dtype=torch.float32)
        if bwd.dbt is not None:
            dt = table_grad_from_tiles(bwd.dbt, bwd.patterns, grid_h, grid_w, prefix, config)
        return (*bwd.grads, dt)
    bwd.delta()
    for launch in batch_chunks(bwd.dkdv, *q.shape[:2], config.grid_y_max):
        launch()
    dq, dk, dv = bwd.grads
    if bwd.dkdv.args["ATOMIC_DQ"]:  # added by atomics in float32
        dq = dq.to(q.dtype)
    else:
        bwd.dq()
    h, slots = q.shape[1], bwd.slots
    if bwd.dbias is not None:
        bwd.dbias()
    if bwd.dbt is not None:  # (the dbias kernel's sums, or the dq kernel's)
        dt = table_grad_from_tiles(bwd.dbt, bwd.patterns, grid_h, grid_w, prefix, config)
    elif slots is None:
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
    """The op's bodies in eager mode, as an autograd function: the same kernels without the dispatcher's host work,
    and what the forward made (the base-2 table, the bias tiles) kept for its backward. Under ``torch.compile`` and
    ``torch.export``, :func:`rel_bias_attention` calls the custom op instead."""

    @staticmethod
    def forward(ctx, q, k, v, table, mask, tokens, blocks, config, *settings):
        memo: dict = {}
        out, lse = _fwd_impl(q, k, v, table, mask, tokens, blocks, *settings, memo=memo, config=config)
        ctx.save_for_backward(q, k, v, table, mask, tokens, blocks, out, lse)
        ctx.settings, ctx.memo, ctx.config = settings, memo, config  # (memo: read once by the backward)
        return out

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiated: an error, not a silently wrong second order
    def backward(ctx, dout):
        q, k, v, table, mask, tokens, blocks, out, lse = ctx.saved_tensors
        need_t = table is not None and ctx.needs_input_grad[3]
        memo, ctx.memo = ctx.memo, None
        args = (dout, q, k, v, table, mask, tokens, blocks, out, lse, *ctx.settings, need_t, memo, ctx.config)
        dq, dk, dv, dt = _bwd_impl(*args)
        return dq, dk, dv, (dt if need_t else None), *(None,) * 11


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
    config: KernelConfig | None = None,
) -> Tensor:
    """``softmax(q k^T * scale + T[offsets] + mask) v`` for ``q, k, v [B, heads, N, d]`` (see the module docstring).

    ``table`` ``[heads, 2 GH - 1, 2 GW - 1]`` (any float dtype: read and differentiated in float32; ``-inf`` entries
    mask their pairs) or None; ``grid`` ``(GH, GW)`` with ``N = num_prefix_tokens + GH GW``; ``mask`` ``[Mb, N, N]``
    additive (``[Mb, 1, N]``: a key mask, the same for every query), or ``regions`` ``[Mb, N]`` integer region ids
    (a token sees the tokens of its region only: a batch of windows' layout,
    :meth:`~vitrel.layout.tokens.TokenLayout.windows`); batch ``b`` reads row ``b % Mb``.

    ``tokens`` ``[B, 4, N]`` (integers: each token's segment, row, column and table group; :func:`layout_tokens`)
    lays out packed images instead (a token layout, :mod:`vitrel.layout.tokens`): a token attends to the tokens of its
    segment only (padding, segment -1, to padding), the bias of a patch pair read from its group's table
    ``table [G, heads, 2 GH - 1, 2 GW - 1]`` at the pair's offset (rows -1: prefix and padding tokens, no bias),
    ``grid`` the tables' extent; tiles with no pair of one segment are skipped.

    ``blocks`` (a full grid's, :func:`visible_tiles`) lets the kernels skip the tiles the table's ``-inf`` entries mask
    whole. ``bias_read`` (:data:`BIAS_READS`): how the kernels read a full grid's bias (:func:`tile_patterns`).

    ``deterministic`` (default): two backward passes are bitwise equal. ``False``: ``dq`` is added by atomics, as
    FlashAttention-2's backward (and so SDPA's) adds it, which spares the backward a kernel where the table's
    gradient is not reduced by it (a fixed table, no table, the bias read as tiles), and its low bits change from run
    to run; :func:`torch.use_deterministic_algorithms` set overrides it (PyTorch's rule: the deterministic algorithm
    where there is one).

    ``config``: the launch configuration (default: the device's, :func:`~vitrel.kernels.triton.config.default_config`);
    eager calls only."""
    args = _op_args(
        q, k, v, table, grid, num_prefix_tokens, scale, mask, causal, tokens, blocks, bias_read, regions, deterministic
    )
    if torch.compiler.is_compiling():
        if config is not None:
            raise ValueError("rel_bias_attention: config= is for eager calls; compiled graphs take the device's own")
        return torch.ops.vitrel.rel_bias_attention(*args)[0]
    return _Eager.apply(*args[:7], config, *args[7:])


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
        n_flag = triton_cdiv(n, FLAG_TILE)
        if tokens is not None or tuple(blocks.shape) != (h, n_flag, n_flag):
            want = (h, n_flag, n_flag)
            raise ValueError(f"rel_bias_attention: blocks {tuple(blocks.shape)}, expected {want} on a full grid")
        blocks = blocks.to(torch.int32).contiguous()
    if mask is not None and regions is not None:
        raise ValueError("rel_bias_attention: pass a float mask or regions, not both")
    if mask is not None:
        if mask.dim() < 2 or mask.shape[-1] != n or mask.shape[-2] not in (1, n):
            raise ValueError(f"rel_bias_attention: mask must be [Mb, N | 1, N] for N = {n}, got {tuple(mask.shape)}")
        mask = mask.expand(*mask.shape[:-2], n, n).reshape(-1, n, n).float().contiguous()  # a key mask to its rows
    elif regions is not None:
        if regions.dim() != 2 or regions.shape[1] != n or regions.is_floating_point():
            raise ValueError(f"rel_bias_attention: regions must be integers [Mb, {n}], got {tuple(regions.shape)}")
        # the kernels' MASK, read as region ids with no mask: padded to stats_len(n) (-1, a region of no token)
        mask = torch.nn.functional.pad(regions.to(torch.int32), (0, stats_len(n) - n), value=-1).contiguous()
    if mask is not None and b % mask.shape[0]:
        raise ValueError(f"rel_bias_attention: batch {b} is not a multiple of the mask's {mask.shape[0]} rows")
    # the kernels take any strides with a contiguous head dim (the qkv projection's views: no copies, as SDPA)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q, k = same_layout(q, k)
    scale = d**-0.5 if scale is None else float(scale)
    if bias_read not in BIAS_READS:
        raise ValueError(f"rel_bias_attention: bias_read must be one of {BIAS_READS}, got {bias_read!r}")
    settings = (scale, gh, gw, num_prefix_tokens, causal, bias_read, bool(deterministic))
    return q, k, v, table, mask, tokens, blocks, *settings


def layout_tokens(layout: TokenLayout) -> Tensor:
    """``[B, 4, N]`` int32: each token's segment, row, column (-1 for prefix and padding tokens) and table group, what
    :func:`rel_bias_attention` reads of a token layout."""
    return torch.stack([layout.segment, *layout.coords.unbind(-1), layout.group], 1).to(torch.int32)


def plan(*args, table_grad: bool = True, sms: int | None = 132, config: KernelConfig | None = None,
         **kwargs) -> dict[str, Launch]:  # fmt: skip
    """The launches (``fwd``, ``delta``, ``dkdv``, ``dq``, ``dbias``; or ``fwd_tile`` and ``tile``) of the call
    ``rel_bias_attention(*args, **kwargs)``, forward and backward (``table_grad``: the table's gradient too), on a
    CUDA device of ``sms`` multiprocessors (None: the interpreter), from tensors on any device; ``config`` defaults
    to the GPU's (:func:`~vitrel.kernels.triton.config.cuda_config`), or the interpreter's for ``sms=None``."""
    call = inspect.signature(rel_bias_attention).bind(*args, **kwargs)
    call.apply_defaults()
    call.arguments.pop("config")
    args = _op_args(*call.arguments.values())
    q, k, v, table, mask, tokens, blocks, scale, gh, gw, prefix, causal, bias_read, deterministic = args
    if config is None:
        config = INTERPRETER if sms is None else cuda_config(q.shape[-1], dtype=q.dtype)
    out, lse = _fwd_fake(*args)  # (the shapes the op makes)
    fwd = fwd_launch(*args[:-1], out, lse, sms, config)
    bwd = bwd_launches(
        torch.zeros_like(q), q, k, v, table, mask, tokens, blocks, out, lse, scale, gh, gw, prefix, causal, bias_read,
        deterministic, table_grad, sms, config,
    )  # fmt: skip
    launches = {"fwd": fwd, "delta": bwd.delta, "dkdv": bwd.dkdv, "dq": bwd.dq, "dbias": bwd.dbias, "tile": bwd.tile}
    return {name: launch for name, launch in launches.items() if launch is not None}
