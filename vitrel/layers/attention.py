"""Multi-head self-attention that takes any position scheme.

For ``x`` of ``[B, N, C]`` on a grid ``H x W`` with ``P`` prefix tokens (``N = P + H W``)::

    q, k, v = split(x W_qkv)                    per head, [B, heads, N, d]
    q, k    = pos.rotate(q, k)                  (RoPE; identity otherwise)
    A       = (q k^T + pos.content_logits(q)) / sqrt(d) + pos.bias() + mask
    out     = softmax(A) v + pos.content_values(softmax(A))

``forward`` runs the scheme's fused path (``PositionScheme.attend``: SDPA with the bias as a
float mask, or the scheme's own kernel); ``logits`` returns ``A`` eagerly for inspection.

Windows: pass ``x`` as ``[B * num_windows, n, C]`` with ``grid`` the window's grid and ``mask``
``[num_windows, n, n]`` (the shifted-window mask); the bias is built once for the window grid and
shared by every window.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from vitrel.pos.base import Grid, PositionScheme, as_grid, build_pos, check_tokens, merge_masks

__all__ = ["Attention", "attention_logits"]


class Attention(nn.Module):
    """``Attention(dim, num_heads, pos=<name | config | PositionScheme>)``.

    Args:
        dim: embedding dimension ``C``.
        num_heads: number of heads; ``dim`` must be divisible by it.
        pos: the position scheme (a registered name, a config dict with ``name``, or a module,
            which may be shared between layers). Absolute schemes act at the input of the
            network, so inside attention they behave as ``none``.
        grid: the grid (or window) the scheme is built for; sizes learned tables.
        num_prefix_tokens: class/register tokens ahead of the patch tokens.
        qkv_bias, attn_drop, proj_drop: as in timm.
        pos_kwargs: extra options for the scheme when ``pos`` is a name.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        pos: str | dict | PositionScheme | None = "none",
        grid: Any = (14, 14),
        num_prefix_tokens: int = 0,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        causal: bool = False,
        **pos_kwargs: Any,
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.num_prefix_tokens = num_prefix_tokens
        self.causal = causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.pos = build_pos(
            pos,
            num_heads=num_heads,
            head_dim=self.head_dim,
            grid=grid,
            num_prefix_tokens=num_prefix_tokens,
            embed_dim=dim,
            **pos_kwargs,
        )
        if self.pos.num_heads != num_heads or self.pos.head_dim != self.head_dim:
            raise ValueError(
                f"position scheme built for {self.pos.num_heads} heads of {self.pos.head_dim} dims, "
                f"attention has {num_heads} heads of {self.head_dim}"
            )

    # ------------------------------------------------------------------------------ internals
    def _qkv(self, x: Tensor, grid: Grid) -> tuple[Tensor, Tensor, Tensor]:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"expected x of shape [B, N, {self.dim}], got {tuple(x.shape)}")
        check_tokens(x.shape[1], grid, self.num_prefix_tokens)
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.pos.rotate(q, k, grid, self.num_prefix_tokens)
        return q, k, v

    def _mask(self, mask: Tensor | None, b: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """Window mask ``[nW, n, n]`` -> ``[B, 1, n, n]``; plus the causal mask if enabled."""
        if mask is not None:
            if mask.dim() == 3:
                nw = mask.shape[0]
                if b % nw:
                    raise ValueError(f"batch {b} is not a multiple of the {nw} windows of the mask")
                mask = mask.to(dtype).repeat(b // nw, 1, 1)[:, None]  # [B, 1, n, n]
            elif mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, float("-inf"))
        if self.causal:
            c = torch.full((n, n), float("-inf"), dtype=dtype, device=device).triu(1)
            mask = c if mask is None else mask + c
        return mask

    # ------------------------------------------------------------------------------- public
    def forward(self, x: Tensor, grid: Any, mask: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` on ``grid`` -> ``[B, N, C]``. ``mask``: ``[nW, n, n]`` window mask or a
        float mask broadcastable to ``[B, heads, N, N]``."""
        grid = as_grid(grid)
        q, k, v = self._qkv(x, grid)
        b, n, c = x.shape
        m = self._mask(mask, b, n, q.dtype, q.device)
        if self.attn_drop and self.training:
            out = self._dropout_attend(q, k, v, m, grid)
        else:
            out = self.pos.attend(q, k, v, m, self.scale, grid, self.num_prefix_tokens)
        out = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))

    def _dropout_attend(self, q: Tensor, k: Tensor, v: Tensor, m: Tensor | None, grid: Grid) -> Tensor:
        attn = self._logits_qk(q, k, m, grid).softmax(-1)
        attn_d = nn.functional.dropout(attn, self.attn_drop)
        out = attn_d @ v
        cv = self.pos.content_values(attn_d, grid, self.num_prefix_tokens)
        return out if cv is None else out + cv

    def _logits_qk(self, q: Tensor, k: Tensor, m: Tensor | None, grid: Grid) -> Tensor:
        a = q @ k.transpose(-2, -1)
        c = self.pos.content_logits(q, grid, self.num_prefix_tokens)
        if c is not None:
            a = a + c
        a = a * self.scale
        bias_mask = merge_masks(self.pos.cached_bias(grid, self.num_prefix_tokens), m, a.dtype)
        return a if bias_mask is None else a + bias_mask

    def logits(self, x: Tensor, grid: Any, mask: Tensor | None = None) -> Tensor:
        """Pre-softmax logits ``[B, heads, N, N]``, computed eagerly (for inspection)."""
        grid = as_grid(grid)
        q, k, _ = self._qkv(x, grid)
        m = self._mask(mask, x.shape[0], x.shape[1], q.dtype, q.device)
        return self._logits_qk(q, k, m, grid)

    def attention_map(self, x: Tensor, grid: Any, mask: Tensor | None = None) -> Tensor:
        """Attention probabilities ``[B, heads, N, N]``."""
        return self.logits(x, grid, mask).softmax(-1)

    def bias(self, grid: Any) -> Tensor | None:
        """The scheme's additive term ``[heads, N, N]`` for ``grid`` (None for non-bias schemes)."""
        return self.pos.bias(as_grid(grid), self.num_prefix_tokens)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.num_heads}, prefix={self.num_prefix_tokens}"


def attention_logits(attn: Attention, x: Tensor, grid: Any) -> Tensor:
    """Functional alias of :meth:`Attention.logits`."""
    return attn.logits(x, grid)
