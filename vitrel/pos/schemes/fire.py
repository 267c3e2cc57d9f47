"""FIRE: functional interpolation for relative positions (Li et al., "Functional Interpolation for Relative
Positions Improves Long Context Transformers", ICLR 2024, arXiv:2310.04418), on raster order (``fire1d``)
and per axis (``fire2d``).

**fire1d** is FIRE as the paper defines it, with the parametrisation and defaults of the PyTorch module ``FIRE``
in ``mcleish7/arithmetic`` (``cramming/architectures/embeddings.py``), which cites the paper and is, as far as
could be checked, the paper's own listing (not verified against the paper's text; no repository of the authors
was found, Papers with Code lists none), on the raster index ``p = row * W + col``::

    psi(x) = log(|c x| + 1)                          (learnable c, init 0.1)
    L      = |L_mult * L0|                           (the threshold: L0 = 512 fixed, L_mult learnable, init 1)
    b_h(i, j) = f_theta( psi(|p_i - p_j|) / (psi(max(L, p_i)) + eps) )_h,   eps = 1e-6
    f_theta   = Linear(1, 32) -> ReLU -> Linear(32, heads)
    A_ij = q_i . k_j / sqrt(d) + b_h(i, j)

The paper writes the causal form ``f(psi(i - j) / psi(max(L, i)))`` for ``i >= j``; the listing
computes ``psi`` of ``|c (i - j)|`` over every pair, so without a causal mask (a ViT) it is the bidirectional
form above, normalised by the **query's** position. ``causal=True`` (set by a causal ``Attention``) keeps the
same values for ``j <= i`` and sets ``b(i, j) = 0`` for ``j > i`` (pairs the causal mask removes anyway).
The normaliser ``psi(max(L, p_i))`` depends on the query's absolute position once ``p_i > L``, so the bias
is not a function of the offset alone: ``has_offset_table`` is False (``attn_impl=flex`` is refused),
and the scheme is translation-equivariant only while every position is below the threshold
(``N <= L``; true at the initial ``L = 512`` for grids of up to 512 patches). Like every raster scheme it
depends on the grid's width (``depends_on_extent``).

**fire2d** (no 2-D form is published; this one is vitrel's): FIRE's bias below the threshold, per axis and
signed, into one MLP over both axes::

    s_a(d) = sign(d) psi_a(|d|) / (psi_a(L_a) + eps),   psi_a(x) = log(|c_a x| + 1),   L_a = |L_mult_a * L0|
    b_h(i, j) = f_theta( s_h(dh_ij), s_w(dw_ij) )_h,   f_theta = Linear(2, 32) -> ReLU -> Linear(32, heads)

with per-axis learnable ``c_a`` (init 0.1) and ``L_mult_a`` (init 1, ``L0 = 512``). Why: (1) FIRE's
``psi(max(L, i))`` equals ``psi(L)`` for every position below ``L``; a vision grid has far fewer rows or
columns than the initial ``L = 512``, so the query-dependent branch would never act at the initial
threshold, and keeping it would only cost the offset table. With the threshold alone the bias is a
function of the offset ``(dh, dw)``: **translation-invariant**, it has an ``offset_table`` (flex works)
and is the same on every grid (not ``depends_on_extent``). (2) The sign keeps the direction (above / below,
left / right), which ``|i - j|`` loses in a bidirectional ViT; Swin V2's CPB feeds signed offsets too.
(3) Two inputs, not two MLPs summed, so the bias need not factor into rows plus columns (as Swin's table
and CPB). Offsets larger than ``L_a`` give inputs beyond 1 (extrapolation, where FIRE would interpolate).

Mixed precision: the MLP and what feeds it (``psi``, the threshold) run in the weights' dtype with autocast off;
the kernel still casts the bias to the attention's dtype. Under autocast the MLP's inputs and the gradient of every
pair (fire1d) or offset (fire2d) are rounded to bfloat16 / float16 before the sums over the pairs that make the
parameters' gradients: at a 32 x 32 grid the worst of them (the first layer's) was then 41x to 169x the error of
plain attention's q, k, v gradients; in float32, 4x to 9x (``bench/results/attention_autocast_cpu.md``), mostly the
last layer's: its bias's gradient is the kernel's bias gradient summed over every pair, a sum that cancels.
fire1d's hidden activations, ``[N^2, mlp_width]``, take twice bfloat16's memory.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitrel.device_cache import per_device
from vitrel.layout.geometry import Grid, pad_prefix
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos
from vitrel.pos.schemes.bias2d import full_bias_flat

__all__ = ["Fire1d", "Fire2d"]


class _FireBase(PositionScheme):
    family = "learned bias"
    has_bias = True
    # The MLP's weights are decayed like any Linear's (timm's rule; no training code of the authors to follow, unlike
    # rel2d_cpb); c and L_multiplier are 0-d / 1-d tensors, which timm's param_groups_weight_decay leaves undecayed.
    no_weight_decay_keys = ()

    #: inputs of the MLP (1: the raster distance; 2: one per axis)
    _axes = 1

    def __init__(
        self, *, mlp_width: int = 32, init_c: float = 0.1, init_L: float = 512.0, eps: float = 1e-6, **kw
    ) -> None:
        super().__init__(**kw)
        axes = self._axes
        if mlp_width < 1:
            raise ValueError(f"mlp_width must be positive, got {mlp_width}")
        if init_L <= 0:
            raise ValueError(f"init_L must be positive, got {init_L}")
        if init_c == 0:
            # |c x| has gradient 0 at c = 0: c would stay 0 and every bias would be the MLP of 0 (no position)
            raise ValueError("init_c must be non-zero: c = 0 gives psi = 0 everywhere and never moves from 0")
        shape = () if axes == 1 else (axes,)
        self.mlp = nn.Sequential(nn.Linear(axes, mlp_width), nn.ReLU(), nn.Linear(mlp_width, self.num_heads))
        self.c = nn.Parameter(torch.full(shape, float(init_c)))
        self.L_multiplier = nn.Parameter(torch.ones(shape))
        # the listing keeps L0 as a frozen parameter; a persistent buffer here (same state-dict key), so that
        # every parameter of the scheme is trained
        self.register_buffer("init_L", torch.full(shape, float(init_L)), persistent=True)
        self.eps = float(eps)

    def threshold(self) -> Tensor:
        """``L = |L_multiplier * init_L|``."""
        return (self.L_multiplier * self.init_L).abs()

    def psi(self, x: Tensor) -> Tensor:
        """``log(|c x| + 1)`` (``c`` broadcast over the last dimension for fire2d)."""
        return torch.log((self.c * x).abs() + 1.0)


@register_pos("fire1d")
class Fire1d(_FireBase):
    """FIRE on the raster index: ``f(psi(|p_i - p_j|) / psi(max(L, p_i)))``; query-dependent, no offset table.

    ``causal=True``: the bias of the pairs ``j > i`` is 0 (set by a causal ``Attention``).
    """

    causal_aware = True
    depends_on_extent = True
    has_offset_table = False  # psi(max(L, p_i)) reads the query's absolute position

    def __init__(
        self,
        *,
        mlp_width: int = 32,
        init_c: float = 0.1,
        init_L: float = 512.0,
        eps: float = 1e-6,
        causal: bool = False,
        **kw,
    ) -> None:
        super().__init__(mlp_width=mlp_width, init_c=init_c, init_L=init_L, eps=eps, **kw)
        self.causal = bool(causal)

    def normalized_distances(self, n: int) -> Tensor:
        """``psi(|p_i - p_j|) / (psi(max(L, p_i)) + eps)``, ``[n, n]`` (rows: queries)."""
        w = self.mlp[0].weight
        p = torch.arange(n, device=w.device).to(w.dtype)
        d = p[:, None] - p[None, :]
        norm = self.psi(torch.maximum(p, self.threshold())) + self.eps  # [n]
        return self.psi(d) / norm[:, None]

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        with torch.autocast(self.mlp[0].weight.device.type, enabled=False):  # see the module docstring
            b = self.mlp(self.normalized_distances(grid.n).unsqueeze(-1)).permute(2, 0, 1)  # [heads, n, n]
        if self.causal:
            b = b.tril()
        return pad_prefix(b, num_prefix_tokens)


@per_device(maxsize=32)
def _signed_offsets(gh: int, gw: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """``(sign(d), |d|)`` of every 2-D offset ``d = (dh, dw)`` of a ``GH x GW`` grid, ``[(2GH-1) (2GW-1), 2]`` row-major
    (built flat: any symbolic size); made once per arguments (:func:`~vitrel.device_cache.per_device`)."""
    tw = 2 * gw - 1
    a = torch.arange((2 * gh - 1) * tw, device=device)
    ih = a // tw
    d = torch.stack((ih - (gh - 1), a - ih * tw - (gw - 1)), dim=-1).to(dtype)  # (dh, dw)
    return torch.sign(d), d.abs()


@register_pos("fire2d")
class Fire2d(_FireBase):
    """FIRE per axis, signed, below a learned threshold: ``f(s_h(dh), s_w(dw))``; a function of the offset."""

    has_offset_table = True
    _axes = 2

    def _table_flat(self, grid: Grid) -> Tensor:
        """The bias of every offset, ``[heads, (2H-1) (2W-1)]`` row-major (built flat: any symbolic size), in the MLP's
        dtype with autocast off (see the module docstring)."""
        w = self.mlp[0].weight
        sign, size = _signed_offsets(grid.h, grid.w, w.dtype, w.device)
        with torch.autocast(w.device.type, enabled=False):
            s = sign * self.psi(size) / (self.psi(self.threshold()) + self.eps)
            return self.mlp(s).t()

    def offset_table(self, grid: Grid) -> Tensor:
        return self._table_flat(grid).reshape(self.num_heads, 2 * grid.h - 1, 2 * grid.w - 1)

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        t = self._table_flat(grid)
        return pad_prefix(full_bias_flat(t, 2 * grid.h - 1, 2 * grid.w - 1, grid), num_prefix_tokens)
