"""The rotary schemes' rotation of queries and keys fused into one Triton kernel, forward and backward.

``rope_rotate(q, k, rope)`` applies a rotary scheme's rotation, as its state holds it (``state.rope``), to
``q, k [B, heads, N, d]`` in one launch, for every token ``n`` and head ``h``:

* ``(cos, sin)``, each ``[N, d/2]``, ``[heads, N, d/2]`` or, on a token layout, ``[B, 1 | heads, N, d/2]``: plane
  rotations of the interleaved pairs (``rope1d``, ``rope2d_axial``, ``rope2d_mixed``, ``spiral_rope``, their
  scalings, LieRE / ComRoPE with ``block_size`` 2)::

      x~_2t = x_2t cos_nt - x_2t+1 sin_nt,    x~_2t+1 = x_2t sin_nt + x_2t+1 cos_nt

* ``(cos, sin, P)``: STRING's orthogonal basis ``P [heads, d, d]`` first, ``x~ = R_n (P_h x)``;
* ``(R,)``, ``R [heads, N, d/b, b, b]`` (or ``[B, heads, N, d/b, b, b]``): LieRE / ComRoPE's dense ``b x b``
  blocks, ``x~_{mb+i} = sum_j R[h, n, m, i, j] x_{mb+j}``.

Prefix tokens are whatever the tables hold for them (``cos = 1, sin = 0``: unrotated; LieRE's class position).
The backward is the transposed rotation, plus the gradients of the tables (``cos``, ``sin``, ``R``) and of ``P``,
so learned rotations (RoPE-Mixed's frequencies, LieRE / ComRoPE's generators, STRING) train through it.

It is a torch custom op (``torch.ops.vitrel.rope_rotate``) with its autograd formula and fake implementations, so
``torch.compile`` captures it as one node. ``attn_impl="triton"`` runs it (the kernel declares
``fused_rotation``; :class:`~vitrel.layers.Attention` asks). The kernels run on CUDA, or on CPU tensors through
Triton's interpreter when ``TRITON_INTERPRET=1`` (:func:`~vitrel.kernels.triton.device.check_device`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vitrel.kernels.triton.config import ROPE_CUDA, ROPE_INTERPRETER, RopeConfig
from vitrel.kernels.triton.device import check_device, jit_module

__all__ = ["rope_rotate", "rotation_tables"]


def _kernels():
    return jit_module("_rope_kernels")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _work_dtype(x: torch.dtype) -> torch.dtype:
    return torch.float64 if x == torch.float64 else torch.float32


def _prec(work: torch.dtype, x: torch.dtype) -> str:
    return "tf32" if work == torch.float32 and x != torch.float32 else "ieee"


def _n_split(programs: int, batch: int, device: torch.device) -> int:
    """Batch shares: enough programs to fill the device (4 per SM), no more than the batch."""
    if device.type != "cuda":
        return min(batch, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(batch, math.ceil(4 * sms / programs)))


def _config(device: torch.device) -> RopeConfig:
    return ROPE_CUDA if device.type == "cuda" else ROPE_INTERPRETER


def _launch(device: torch.device) -> dict:
    return _config(device).warps.options()


def _plan(q: Tensor, table: Tensor, pairs: bool) -> tuple[int, int, int, int, int]:
    """``(BN, n_tiles, n_split, BD, BB)`` for the launch."""
    b, h, n, d = q.shape
    bd = _pow2(d)
    bs = 2 if pairs else table.shape[-1] // d
    bb = _pow2(bs)
    config = _config(q.device)
    bn = config.pairs_tokens if pairs else config.block_tokens(bd, bb)
    n_tiles = -(-n // bn)
    split = b if table.shape[0] > 1 else _n_split(n_tiles * h, b, q.device)
    return bn, n_tiles, split, bd, bb


def _table_strides(t: Tensor, q: Tensor) -> list[int]:
    """``(batch, head, token)`` strides of a ``[1 | B, 1 | heads, N, W]`` table, 0 on an axis of size 1."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(3)]


@torch.library.custom_op("vitrel::rope_rotate", mutates_args=())
def _rotate_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor | None, basis: Tensor | None) -> tuple[Tensor, Tensor]:
    b, h, n, d = q.shape
    pairs = sin is not None
    bn, n_tiles, split, bd, bb = _plan(q, cos, pairs)
    oq, ok = q.new_empty(q.shape), k.new_empty(k.shape)
    ks, grid = _kernels(), (n_tiles, h, split)
    xs = [*q.stride()[:3], *oq.stride()[:3]]
    if pairs:
        bh = max(16 if basis is not None else 1, _pow2(d // 2))
        p = basis if basis is not None else cos
        ks._pairs_fwd_kernel[grid](
            q, k, oq, ok, cos, sin, p, *xs, *_table_strides(cos, q), b, n, split, D=d, BN=bn, BH=bh,
            BD=max(16, bd), HAS_BASIS=basis is not None, PREC=_prec(cos.dtype, q.dtype), **_launch(q.device),
        )  # fmt: skip
    else:
        ks._blocks_fwd_kernel[grid](
            q, k, oq, ok, cos, *xs, *_table_strides(cos, q), b, n, split, D=d, BS=cos.shape[-1] // d, BN=bn, BD=bd,
            BB=bb, **_launch(q.device),
        )  # fmt: skip
    return oq, ok


@_rotate_op.register_fake
def _rotate_fake(q, k, cos, sin, basis):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("vitrel::rope_rotate_bwd", mutates_args=())
def _rotate_bwd_op(
    gq: Tensor,
    gk: Tensor,
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor | None,
    basis: Tensor | None,
    table_grad: bool,
    basis_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk``, the tables' gradients (``cos``'s or ``R``'s, then ``sin``'s; empty when not asked) and the
    basis's (empty when not asked), each of its input's shape."""
    b, h, n, d = q.shape
    gq, gk = gq.contiguous(), gk.contiguous()
    pairs = sin is not None
    bn, n_tiles, split, bd, bb = _plan(q, cos, pairs)
    ks, grid = _kernels(), (n_tiles, h, split)
    dq, dk = q.new_empty(q.shape), k.new_empty(k.shape)
    xs = [*q.stride()[:3], *gq.stride()[:3]]
    slots = (split, h, n, cos.shape[-1])  # per batch element (a table with a batch axis) or per batch share
    ph = cos.new_zeros(1, 1, 1, 1)  # the kernel's placeholder for what is not asked for (returned empty)
    dc = cos.new_zeros(slots) if table_grad else ph
    ds = cos.new_zeros(slots) if table_grad and pairs else ph
    gs = [dc.stride(0), dc.stride(1), dc.stride(2)]
    with_basis = basis is not None
    dp = cos.new_zeros(split, h, n_tiles, d, d) if with_basis and basis_grad else ph
    if pairs:
        bh = max(16 if with_basis else 1, _pow2(d // 2))
        ks._pairs_bwd_kernel[grid](
            q, k, gq, gk, dq, dk, cos, sin, basis if with_basis else cos, dc, ds, dp, *xs, *_table_strides(cos, q),
            *gs, b, h, n, split, n_tiles, D=d, BN=bn, BH=bh, BD=max(16, bd), HAS_BASIS=with_basis,
            TABLE_BATCH=cos.shape[0] > 1, NEED_DT=table_grad, NEED_DP=with_basis and basis_grad,
            NEED_X=table_grad or (with_basis and basis_grad), PREC=_prec(cos.dtype, q.dtype), **_launch(q.device),
        )  # fmt: skip
    else:
        ks._blocks_bwd_kernel[grid](
            q, k, gq, gk, dq, dk, cos, dc, *xs, *_table_strides(cos, q), *gs, b, n, split, D=d,
            BS=cos.shape[-1] // d, BN=bn, BD=bd, BB=bb, TABLE_BATCH=cos.shape[0] > 1, NEED_DT=table_grad,
            **_launch(q.device),
        )  # fmt: skip

    def reduce(g: Tensor, asked: bool) -> Tensor:  # the slots summed to the table's shape (fixed order: deterministic)
        if not asked:
            return cos.new_zeros(0)
        if cos.shape[0] == 1:
            g = g.sum(0, keepdim=True)
        return g.sum(1, keepdim=True) if cos.shape[1] == 1 else g

    dpb = dp.sum((0, 2)) if with_basis and basis_grad else cos.new_zeros(0)
    return dq, dk, reduce(dc, table_grad), reduce(ds, table_grad and pairs), dpb


@_rotate_bwd_op.register_fake
def _rotate_bwd_fake(gq, gk, q, k, cos, sin, basis, table_grad, basis_grad):
    dc = cos.new_empty(cos.shape) if table_grad else cos.new_empty(0)
    ds = cos.new_empty(cos.shape) if table_grad and sin is not None else cos.new_empty(0)
    dp = basis.new_empty(basis.shape) if basis is not None and basis_grad else cos.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), dc, ds, dp


def _setup(ctx, inputs, output):
    q, k, cos, sin, basis = inputs
    ctx.save_for_backward(q, k, cos, sin, basis)


def _backward(ctx, gq, gk):
    q, k, cos, sin, basis = ctx.saved_tensors
    need_t = ctx.needs_input_grad[2] or (sin is not None and ctx.needs_input_grad[3])
    need_p = basis is not None and ctx.needs_input_grad[4]
    dq, dk, dc, ds, dp = _rotate_bwd_op(gq, gk, q, k, cos, sin, basis, need_t, need_p)
    return dq, dk, dc if need_t else None, ds if need_t and sin is not None else None, dp if need_p else None


_rotate_op.register_autograd(_backward, setup_context=_setup)


def rotation_tables(rope: tuple[Tensor, ...], q: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """A scheme's ``state.rope`` as the kernel reads it: ``(cos, sin, basis)`` with ``cos, sin [1 | B, 1 | heads, N,
    d/2]``, or ``(R, None, None)`` with ``R [1 | B, 1 | heads, N, d b]`` (each row of a token's ``d / b`` blocks
    flattened), in the work dtype (float64 for float64 inputs, else float32), contiguous; a clear error for
    tables that do not fit ``q [B, heads, N, d]``."""
    b, h, n, d = q.shape
    work = _work_dtype(q.dtype)
    if len(rope) == 1:  # [(B,) heads, N, d/b, b, b]
        r = rope[0]
        if r.dim() not in (5, 6) or r.shape[-1] != r.shape[-2] or r.shape[-3] * r.shape[-1] != d:
            raise ValueError(f"rope_rotate: block rotations [(B,) heads, N, d/b, b, b] for d={d}, got {tuple(r.shape)}")
        tables = [r.flatten(-3)]
    elif len(rope) in (2, 3):
        tables = list(rope[:2])
        if any(t.shape[-1] * 2 != d or t.shape != tables[0].shape for t in tables):
            raise ValueError(
                f"rope_rotate: cos and sin of one shape [..., N, {d // 2}], got {[tuple(t.shape) for t in tables]}"
            )
    else:
        raise ValueError(f"rope_rotate: a rotation is (cos, sin), (cos, sin, P) or (R,); got {len(rope)} tensors")
    out = []
    for t in tables:
        t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t
        if t.dim() != 4 or t.shape[0] not in (1, b) or t.shape[1] not in (1, h) or t.shape[2] != n:
            raise ValueError(
                f"rope_rotate: a rotation table of shape {tuple(t.shape)} does not fit q, k {tuple(q.shape)} "
                "([N, w], [heads, N, w] or [1 | B, 1 | heads, N, w])"
            )
        out.append(t.to(device=q.device, dtype=work).contiguous())
    basis = None
    if len(rope) == 3:
        basis = rope[2]
        if basis.shape != (h, d, d):
            raise ValueError(f"rope_rotate: STRING's basis [{h}, {d}, {d}], got {tuple(basis.shape)}")
        basis = basis.to(device=q.device, dtype=work).contiguous()
    return out[0], (out[1] if len(out) > 1 else None), basis


def rope_rotate(q: Tensor, k: Tensor, rope: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """``q, k [B, heads, N, d]`` rotated by ``rope`` (a rotary scheme's ``state.rope``; see the module docstring), in
    one launch; differentiable in ``q``, ``k`` and the tables (and STRING's basis)."""
    check_device(q.device)
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"rope_rotate: q and k of one shape [B, heads, N, d], got {tuple(q.shape)}, {tuple(k.shape)}")
    cos, sin, basis = rotation_tables(rope, q)
    if q.stride() != k.stride() or q.stride(-1) != 1:  # (the views of one qkv projection share theirs)
        q, k = q.contiguous(), k.contiguous()
    return _rotate_op(q, k, cos, sin, basis)
