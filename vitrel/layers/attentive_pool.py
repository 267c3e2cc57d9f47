"""V-JEPA 2's attentive pool (Assran et al. 2025; facebookresearch/vjepa2 ``src/models/attentive_pooler.py``): the
pool of their attentive probes, which classify a frozen encoder's tokens.

``depth - 1`` pre-norm self-attention blocks over the tokens (timm's ``Block``: their ``Block`` has its parameter
names and function), then one learned query attending to them::

    q = query + CrossAttn(query, LN1(x))        (queries from ``q``, keys and values from ``kv``; no output projection)
    y = q + MLP(LN2(q))

Unlike timm's ``AttentionPoolLatent`` (``global_pool="map"``'s other form) the query keeps its residual, the tokens
are normalised before the keys and values, and the attention has no output projection. Its norms are theirs,
``nn.LayerNorm`` with epsilon 1e-5, whatever the model's; the initialisation is theirs (truncated normal of std
0.02, the residual outputs scaled down by depth).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from timm.layers import Mlp, trunc_normal_
from timm.models.vision_transformer import Block
from torch import Tensor, nn

__all__ = ["AttentivePool"]

#: their norms: ``nn.LayerNorm``'s default epsilon
NORM_EPS = 1e-5


class CrossAttention(nn.Module):
    """Their ``CrossAttention``: queries ``q [B, n, C]`` attend to ``x [B, N, C]`` (keys and values from one
    projection ``kv``), heads concatenated; no output projection."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)

    def forward(self, q: Tensor, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        (b, n, c), h = q.shape, self.num_heads
        q = self.q(q).view(b, n, h, c // h).transpose(1, 2)
        k, v = self.kv(x).view(b, x.shape[1], 2, h, c // h).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).transpose(1, 2).reshape(b, n, c)


class CrossAttentionBlock(nn.Module):
    """Their ``CrossAttentionBlock``: ``q + xattn(q, norm1(x))``, then ``+ mlp(norm2(.))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=NORM_EPS)
        self.xattn = CrossAttention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=NORM_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)

    def forward(self, q: Tensor, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        q = q + self.xattn(q, self.norm1(x), attn_mask)
        return q + self.mlp(self.norm2(q))


class AttentivePool(nn.Module):
    """V-JEPA 2's ``AttentivePooler`` with one query (their classifiers'): tokens ``[B, N, C]`` -> ``[B, C]``
    (the module docstring). Parameter names are theirs (``query_tokens``, ``blocks.{i}``, ``cross_attention_block``).

    Args:
        dim: the tokens' width.
        num_heads: the pool's heads (their released probes: 16).
        mlp_ratio: its MLPs' hidden width over ``dim``.
        depth: the cross-attention block and ``depth - 1`` self-attention blocks before it (their
            ``num_probe_blocks``; 4 in their released probes).
        qkv_bias: biases in the query, key and value projections.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, depth: int = 1, qkv_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.query_tokens = nn.Parameter(torch.zeros(1, 1, dim))
        norm = functools.partial(nn.LayerNorm, eps=NORM_EPS)
        self.blocks = nn.ModuleList(
            [Block(dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, norm_layer=norm) for _ in range(depth - 1)]
        )
        self.cross_attention_block = CrossAttentionBlock(dim, num_heads, mlp_ratio, qkv_bias)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Their initialisation: linear weights and the query truncated normal (std ``std``), biases 0, norms 1 and 0;
        block ``i``'s (from 1) residual outputs divided by ``sqrt(2 i)``, the cross-attention block's MLP by the
        last self-attention block's."""
        trunc_normal_(self.query_tokens, std=std)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for i, blk in enumerate(self.blocks, start=1):
            blk.attn.proj.weight.div_(math.sqrt(2.0 * i))
            blk.mlp.fc2.weight.div_(math.sqrt(2.0 * i))
        self.cross_attention_block.mlp.fc2.weight.div_(math.sqrt(2.0 * max(len(self.blocks), 1)))

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """``x [B, N, C]`` -> ``[B, C]``; ``attn_mask`` (additive, ``[B, 1, 1, N]``): the tokens every query sees
        (padding masked out of the self-attention blocks' keys and the query's)."""
        for blk in self.blocks:
            x = blk(x, attn_mask=attn_mask)
        q = self.query_tokens.repeat(x.shape[0], 1, 1)  # (theirs: a copy; torch's FLOP counter fails on a view)
        return self.cross_attention_block(q, x, attn_mask)[:, 0]
