"""The registered kernels ``triton`` and ``triton_atomic``: the fused kernel behind ``attn_impl``."""

from __future__ import annotations

from typing import ClassVar

import torch

from vitrel.kernels.base import OffsetTableKernel, video_refusal
from vitrel.kernels.registry import register_kernel
from vitrel.kernels.triton.config import MAX_HEAD_DIM
from vitrel.kernels.triton.op import layout_tokens, rel_bias_attention
from vitrel.kernels.triton.patterns import visible_tiles
from vitrel.layout.geometry import Grid, Grid3, grid_str
from vitrel.layout.tokens import TokenLayout

__all__ = ["TritonAtomicKernel", "TritonKernel"]


@register_kernel("triton")
class TritonKernel(OffsetTableKernel):
    """The fused kernel for every scheme with an offset table (and rotary schemes and no position: no table); full
    grids with prefix tokens, batches of windows (their regions masked in the kernel, or a float mask), causal 1-D,
    token layouts (packed images of any sizes, dropped tokens). No attention dropout. Its backward is bitwise
    repeatable (``deterministic``; ``triton_atomic``'s is not)."""

    window_layouts = True
    takes_dropout = False  # (attend says so: an error, and auto does not pick it for a layer that drops)
    onnx = False
    fused_rotation = True
    #: two backward passes bitwise equal (:func:`rel_bias_attention`'s ``deterministic``)
    deterministic: ClassVar[bool] = True

    @classmethod
    def refuses(cls, scheme):
        if scheme.grid_dims == 3 and scheme.has_bias:  # (rotary video schemes run: no table, a (T*H) x W raster)
            return video_refusal(cls.name, f"the video scheme {scheme.name}", scheme)
        reason = super().refuses(scheme)  # (first: what it names, sdpa, refuses Shaw's schemes)
        if reason is None and scheme.head_dim > MAX_HEAD_DIM:
            reason = (
                f"attn_impl={cls.name!r} takes head dims up to {MAX_HEAD_DIM}, {scheme.name} is built for "
                f"{scheme.head_dim}: use attn_impl='sdpa' or 'auto'"
            )
        return reason

    @classmethod
    def refuses_inputs(cls, mask=None, causal=False, layout=False):
        if isinstance(mask, torch.Tensor) and (
            mask.dim() not in (2, 3, 4) or (mask.dim() == 4 and mask.shape[1] != 1) or mask.shape[-1] == 1
        ):
            return (
                f"attn_impl={cls.name!r} takes a mask shared by the heads, over the keys ([N | 1, N], "
                f"[B | nW, N | 1, N], [B, 1, N | 1, N]), not one of shape {list(mask.shape)}: use attn_impl='sdpa' "
                "or 'auto'"
            )
        if causal and layout:
            return (
                f"attn_impl={cls.name!r} has no causal attention on a token layout (packed or token-dropped images): "
                "use attn_impl='sdpa' or 'auto'"
            )
        return None

    @classmethod
    def inputs(cls, scheme, grid, num_prefix_tokens):
        if isinstance(grid, Grid3) and scheme.has_bias:
            raise ValueError(video_refusal(cls.name, f"the video grid {grid_str(grid)}", scheme))
        return super().inputs(scheme, grid, num_prefix_tokens)

    @classmethod
    def skip_blocks(cls, table, grid, num_prefix_tokens):
        return visible_tiles(table, grid, num_prefix_tokens)

    @classmethod
    def attend(cls, q, k, v, mask, scale, state, dropout_p=0.0):
        if dropout_p > 0.0:
            raise ValueError(f"attn_impl={cls.name!r} has no attention dropout: use attn_impl='sdpa' for attn_drop > 0")
        reason = cls.refuses_inputs(mask, state.causal, state.layout is not None)
        if reason is not None:
            raise ValueError(reason)
        regions = None
        if isinstance(mask, TokenLayout):  # a batch of windows' layout: its regions masked in the kernel
            mask, regions = None, mask.segment
        if mask is not None and mask.dim() == 4:
            mask = mask[:, 0]
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
        tokens = None if state.layout is None else layout_tokens(state.layout)
        p, det = state.num_prefix_tokens, cls.deterministic
        settings = dict(causal=state.causal, tokens=tokens, blocks=state.block_mask, regions=regions, deterministic=det)
        grid = state.grid
        if state.table is None and isinstance(grid, Grid3):  # no bias (rotary schemes): t-major = a (T*H) x W raster
            grid = Grid(grid.t * grid.h, grid.w)
        return rel_bias_attention(q, k, v, state.table, grid, p, scale, mask, **settings)


@register_kernel("triton_atomic")
class TritonAtomicKernel(TritonKernel):
    """``triton``'s cases and inputs with the backward's ``dq`` added by atomics from the ``dkdv`` kernel, as
    FlashAttention-2 adds it: no ``dq`` kernel, not bitwise repeatable. Where the ``dq`` kernel sums the table
    gradient's diagonals (bias gathered per score, token layouts), under
    :func:`torch.use_deterministic_algorithms`, and for calls that fit one tile, the deterministic backward runs."""

    deterministic = False
