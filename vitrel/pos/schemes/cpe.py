"""``pos=cpe``: conditional position encoding (CPE; Chu et al., "Conditional Positional Encodings for Vision
Transformers", 2021), the position encoding generator (PEG) of CPVT and Twins.

The patch tokens, laid out on their ``H x W`` grid, pass through a depthwise ``k x k`` convolution with zero padding
``k // 2`` (and a bias), added back::

    x_i <- x_i + b + sum_{(u, v) in window} w[u, v] * x_{(r_i + u, c_i + v)}     (per channel; zero outside the grid)

Prefix tokens (class, registers) pass unchanged. The encoding is computed from the tokens, so it is not a table: it
follows the grid at any size, and the zero padding at the borders tells a token where the image ends.

As the authors' code: the convolution, its residual and its initialisation (``N(0, 2 / k^2)`` weights, zero bias)
are Twins' ``PosConv`` (Meituan-AutoML/Twins, ``gvt.py``; timm's ``twins.py``), the class token passed through as the
PEG of the CPVT paper's Algorithm 1. Placed after the first block (``after_block=0``), CPVT's best place and where
Twins puts it; ``after_block=None`` adds it to the embedded patches instead, as an ``ape`` is.

Packed and dropped tokens (:meth:`Cpe.add_to_layout`): each image's tokens are laid on its own grid, zeros where a
token was dropped (its neighbours see zero, as at a border), and convolved alone.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vitrel.layout.geometry import Grid, as_grid, check_tokens
from vitrel.layout.tokens import TokenLayout
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos

__all__ = ["Cpe", "peg"]


def peg(x: Tensor, weight: Tensor, bias: Tensor | None, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
    """``x [B, P + H*W, C]`` with its patch tokens ``x + conv(x)`` on the grid: ``weight [C, 1, k, k]`` depthwise,
    zero padding ``k // 2``; prefix tokens unchanged."""
    grid = as_grid(grid)
    check_tokens(x.shape[1], grid, num_prefix_tokens)
    b, _, c = x.shape
    patches = x[:, num_prefix_tokens:]
    fmap = patches.transpose(1, 2).reshape(b, c, grid.h, grid.w)
    k = weight.shape[-1]
    out = F.conv2d(fmap, weight.to(x.dtype), None if bias is None else bias.to(x.dtype), padding=k // 2, groups=c)
    patches = patches + out.flatten(2).transpose(1, 2)
    return torch.cat((x[:, :num_prefix_tokens], patches), dim=1) if num_prefix_tokens else patches


@register_pos("cpe")
class Cpe(PositionScheme):
    """CPVT's position encoding generator: ``x + DWConv_k(x)`` on the patch grid (module docstring), after block
    ``after_block`` (0: the first, the authors' place; None: at the input).

    Options: ``after_block`` (int >= 0 or None), ``kernel_size`` (odd, 3 as the authors').
    """

    kind = "absolute"
    family = "absolute"
    embeds_content = True
    no_weight_decay_keys = ("proj",)  # (Twins' no_weight_decay names every parameter of its pos_block)

    def __init__(self, *, after_block: int | None = 0, kernel_size: int = 3, **kw) -> None:
        super().__init__(**kw)
        if after_block is not None and (isinstance(after_block, bool) or after_block < 0):
            raise ValueError(
                f"cpe: after_block is the block whose output gets the encoding (0: the first) or None (the input), "
                f"got {after_block!r}"
            )
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"cpe: kernel_size must be odd and positive (the grid keeps its size), got {kernel_size}")
        self.after_block = after_block
        self.kernel_size = kernel_size
        c = self.embed_dim
        self.proj = nn.Conv2d(c, c, kernel_size, padding=kernel_size // 2, groups=c)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Twins' init of its ``PosConv``: weights ``N(0, sqrt(2 / fan_out))``, ``fan_out = k * k`` (depthwise)."""
        nn.init.normal_(self.proj.weight, std=math.sqrt(2.0 / self.kernel_size**2))
        nn.init.zeros_(self.proj.bias)

    def add_to_tokens(self, x: Tensor, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        return peg(x, self.proj.weight, self.proj.bias, self.check_grid(grid), num_prefix_tokens)

    def add_to_layout(self, x: Tensor, layout: TokenLayout) -> Tensor:
        """Each image's patch tokens on a zero canvas of the batch's largest sides (one per image, each in its top-left
        corner: the zeros right and below are the zero padding of its own grid), convolved, read back; prefix and
        padding tokens unchanged."""
        layout = layout.to(x.device)
        b, n, c = x.shape
        h, w = max(g.h for g in layout.grids), max(g.w for g in layout.grids)
        cells = layout.num_images * h * w
        patch = layout.is_patch
        row, col = layout.coords.unbind(-1)
        at = torch.where(patch, (layout.image * h + row) * w + col, cells).reshape(-1)  # (the rest: one spare cell)
        canvas = x.new_zeros(cells + 1, c).index_copy(0, at, x.reshape(-1, c))[:cells]
        fmap = canvas.reshape(layout.num_images, h, w, c).permute(0, 3, 1, 2)
        k = self.kernel_size
        out = F.conv2d(fmap, self.proj.weight.to(x.dtype), self.proj.bias.to(x.dtype), padding=k // 2, groups=c)
        out = torch.cat((out.permute(0, 2, 3, 1).reshape(cells, c), out.new_zeros(1, c)))
        return x + out.index_select(0, at).reshape(b, n, c)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, embed_dim={self.embed_dim}, kernel_size={self.kernel_size}, " + (
            f"after_block={self.after_block}"
        )
