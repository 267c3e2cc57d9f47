"""``pos=gpsa``: gated positional self-attention (GPSA; d'Ascoli et al., "ConViT: Improving Vision Transformers with
Soft Convolutional Inductive Biases", 2021).

Each head mixes its content attention with a positional attention, a softmax over a learned linear function of the
offsets, by a learned gate ``g_h``::

    r_ij  = (c_j - c_i,  r_j - r_i,  (r_j - r_i)^2 + (c_j - c_i)^2)          (key minus query, as the authors)
    P_ij  = softmax_j(w_h . r_ij)                                             over the patch keys
    a_ij  = (1 - sigmoid(g_h)) softmax_j(q_i . k_j / sqrt(d) + mask_ij) + sigmoid(g_h) P_ij
    out_i = sum_j a_ij v_j

The mask (window shifts, packed images, dropped tokens) closes the same keys in both softmaxes. With the local
initialisation (``local_init``, ``locality_strength`` ``a``), head ``h1 + k h2`` of the first ``k^2`` (``k =
floor(sqrt(heads))``) starts as ``w_h = -a (2 (c - h2), 2 (c - h1), 1)``, ``c = (k - 1) / 2``: ``P`` a Gaussian of
the distance to the offset ``(h1 - c, h2 - c)`` (rows, columns), a soft ``k x k`` convolution; ``g_h = 1``.

As the authors' code: the mixture, the offsets, the local init (over trunc-normal(0.02) weights, the value
projection of the layer set to the identity, :meth:`Gpsa.init_layer`) and the gate's init are ConViT's ``GPSA``
(facebookresearch/convit, ``convit.py``; timm's ``convit.py``), on any grid rather than a square one. Their
``pos_proj`` also has a bias, constant over the keys, which the softmax cancels: not kept. ConViT adds its class
token after its GPSA blocks, so their GPSA never sees one (the ViT's ``pos_depth`` and ``prefix_at`` give that
layout; ``vitrel.from_timm("convit_tiny")`` reads their models); here a prefix token (class, registers) attends by
content alone (its gate is 0) and is never a key of the positional attention. The mixture runs on the eager path
(``attn_impl="eager"``, what ``auto`` picks): SDPA, FlexAttention and the fused kernels compute one softmax.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import patch_coords
from vitrel.layout.softmax import masked_softmax
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.registry import register_pos

__all__ = ["Gpsa", "local_init_weights", "positional_logits"]


def positional_logits(weight: Tensor, coords: Tensor) -> Tensor:
    """``w_h . r_ij`` for tokens at ``coords [..., N, 2]`` (``(row, col)``) and ``weight [heads, 3]`` (columns,
    rows, squared distance, as ConViT's ``pos_proj``): ``[..., heads, N, N]``."""
    row, col = coords.to(weight.dtype).unbind(-1)
    dr = row[..., None, :] - row[..., :, None]  # [..., N (query), N (key)]: key minus query
    dc = col[..., None, :] - col[..., :, None]
    feats = torch.stack((dc, dr, dr * dr + dc * dc), dim=-1)  # [..., N, N, 3]
    return torch.einsum("...ijf,hf->...hij", feats, weight)


def local_init_weights(weight: Tensor, locality_strength: float = 1.0) -> Tensor:
    """ConViT's ``local_init`` of ``weight [heads, 3]`` (in place, and returned): the first ``k^2`` heads (``k =
    floor(sqrt(heads))``) centred on the ``k x k`` offsets around the query, every row then scaled by
    ``locality_strength``."""
    k = int(weight.shape[0] ** 0.5)
    center = (k - 1) / 2
    with torch.no_grad():
        for h1 in range(k):
            for h2 in range(k):
                weight[h1 + k * h2] = torch.tensor([2 * (h2 - center), 2 * (h1 - center), -1.0])
        weight.mul_(locality_strength)
    return weight


@register_pos("gpsa")
class Gpsa(PositionScheme):
    """ConViT's gated positional self-attention (module docstring): per head, ``sigmoid(gate)`` of the attention is a
    softmax over ``pos_proj`` of the offsets.

    Options: ``locality_strength`` (> 0; 1 as the authors), ``local_init`` (the authors' local initialisation of
    ``pos_proj`` and of the layer's value projection, the identity; False: trunc-normal(0.02) alone, timm's values).
    """

    family = "gated"
    mixes_weights = True

    def __init__(self, *, locality_strength: float = 1.0, local_init: bool = True, **kw) -> None:
        super().__init__(**kw)
        if isinstance(locality_strength, bool) or not locality_strength > 0 or not math.isfinite(locality_strength):
            raise ValueError(f"gpsa: locality_strength must be a positive number, got {locality_strength!r}")
        self.locality_strength = float(locality_strength)
        self.local_init = bool(local_init)
        self.pos_proj = nn.Parameter(torch.empty(self.num_heads, 3))
        self.gating = nn.Parameter(torch.empty(self.num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """ConViT's: ``pos_proj`` trunc-normal(0.02) (timm's ViT init), then the local init; gates 1."""
        nn.init.trunc_normal_(self.pos_proj, std=0.02)
        if self.local_init:
            local_init_weights(self.pos_proj, self.locality_strength)
        nn.init.ones_(self.gating)

    def init_layer(self, qkv: nn.Linear) -> None:
        """ConViT's local init also sets the value projection to the identity (``v = x``, bias 0): with
        ``local_init``."""
        if self.local_init:
            c = qkv.in_features
            if qkv.out_features != 3 * c:
                raise ValueError(
                    "gpsa's local init makes v the identity, which grouped-query attention (num_kv_heads, fewer value "
                    "channels) has no room for: give local_init=False"
                )
            with torch.no_grad():
                qkv.weight[2 * c :].copy_(torch.eye(c, dtype=qkv.weight.dtype, device=qkv.weight.device))
                if qkv.bias is not None:
                    qkv.bias[2 * c :].zero_()

    def _coords(self, state: PosState, device: torch.device) -> tuple[Tensor, Tensor]:
        """The tokens' ``(row, col) [..., N, 2]`` and which are patches ``[..., N]``: the layout's, or the grid's in
        raster order after the prefix tokens."""
        if state.layout is not None:
            return state.layout.coords, state.layout.is_patch
        r, c = patch_coords(state.grid, device)
        p = state.num_prefix_tokens
        coords = torch.cat((torch.full((p, 2), -1, device=device, dtype=r.dtype), torch.stack((r, c), -1)))
        patch = torch.arange(p + state.grid.n, device=device) >= p
        return coords, patch

    def positional_attention(self, mask: Tensor | None, state: PosState, dtype: torch.dtype) -> Tensor:
        """``P [..., heads, N, N]``: the softmax of the positional logits over the patch keys ``mask`` leaves open; the
        rows of prefix tokens 0."""
        coords, patch = self._coords(state, self.pos_proj.device)
        return self._positional(coords, patch, mask, dtype)

    def _positional(self, coords: Tensor, patch: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
        logits = positional_logits(self.pos_proj, coords).to(dtype)
        logits = logits.masked_fill(~patch[..., None, None, :], float("-inf"))
        if mask is not None:
            logits = logits + mask
        return masked_softmax(logits, logits)

    def mix(self, attn: Tensor, mask: Tensor | None, state: PosState) -> Tensor:
        coords, patch = self._coords(state, attn.device)
        gate = torch.sigmoid(self.gating).to(attn.dtype)[:, None, None] * patch[..., None, :, None]
        return attn + gate * (self._positional(coords, patch, mask, attn.dtype) - attn)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, locality_strength={self.locality_strength:g}, local_init={self.local_init}"
