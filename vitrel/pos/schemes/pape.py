"""PaPE, parabolic position encoding (Ohrstrom et al. 2026, arXiv 2602.01418), and its rotation-invariant PaPE-RI.

Both follow the authors' code (github.com/DTU-PAS/parabolic-position-encoding, commit ``21cb390``,
``pape/nn/positions/pape.py`` and ``pape_ri.py``): the parabolas are extra channels appended to the
queries and keys, so that one ``scaled_dot_product_attention`` call runs without an ``N x N`` mask.

Positions are those of the authors' image classifier (``pape/nn/image_classifier.py``): patch ``(row, col)``
(0-based, raster order) is at ``pos = (col + 1, row + 1)`` (``x`` first), the class token at ``(0, 0)``.
With ``prefix_position="origin"`` (the authors') every prefix token is at ``(0, 0)`` (they have one class
token; registers get the same place); ``"none"`` gives pairs with a prefix token no term (vitrel's convention).

``pape`` (``P`` parabolas per head, ``W [heads * P, 2]`` and ``A, B [heads * P, C]`` learned, no biases)::

    u_i = W pos_i                                  per head and parabola   (a function of the position)
    a_i = softplus(A x_i),  b_i = B x_i            per head and parabola   (of the query's input token x_i)
    A_ij = (q_i . k_j + sum_p [-a_ip (u_ip - u_jp)^2 + b_ip (u_ip - u_jp)]) * scale

``pape_ri`` (one parabola per head, isotropic; ``s_h`` a fixed random buffer, ``U(-1/sqrt(2), 1/sqrt(2))``)::

    a_i = softplus(A x_i)                          per head
    A_ij = (q_i . k_j - a_i s_h^2 ||pos_i - pos_j||^2) * scale

``x_i`` is the attention layer's input (after the block's norm), as in the authors' ``Attention``; the
term is scaled by ``scale = head_dim ** -0.5`` with the dot product (the authors pass that scale to SDPA).

The term is content-dependent (``a``, ``b`` depend on the query token), so there is no ``bias`` and no
``offset_table`` (no ``attn_impl="flex"`` / ``"fold"``). Between patches it depends on the query's content
and the offset ``pos_i - pos_j`` only (translation invariant); PaPE-RI's on ``||pos_i - pos_j||`` only
(rotation invariant). Augmentation (:meth:`augment`, what the authors' ``encode_query_key`` computes)::

    q' = [q, sum_p -a_p u_ip^2, a_i, 2 a_i u_i, sum_p b_p u_ip, b_i]     k' = [k, 1, -u_j^2, u_j, 1, -u_j]
    q' = [q, sum_c -a_i u_ic^2, a_i (2x), 2 a_i u_i]                      k' = [k, 1, -u_j^2, u_j]   (RI)

zero-padded to a head dim SDPA's fused kernels take (:func:`~vitrel.layout.heads.sdpa_width`: a multiple of 8 of
``head_dim + 3P + 2``; ``+ 2 * 2 + 1`` for RI), as they do: PaPE's
``channels="parabolas"``. The default ``channels="compact"`` computes the same function in 6 channels: positions
are 2-D, so the ``P`` parabolas of a head sum to one quadratic in ``pos_i - pos_j`` (:func:`_compact`); the
parameters, the logits and the gradients are the authors' (equal up to rounding, checked in float64), the
``N x N`` products cost ``head_dim + 6`` channels instead of ``head_dim + 3P + 2`` (216 for ViT-B: 3.4x).
``Attention.logits`` (``attn_impl="eager"``) is ``q' k'^T * scale``, the authors' ``return_attention_maps``
path; ``forward`` the same in one SDPA call (``v`` zero-padded to the width of ``q'``,
:func:`~vitrel.kernels.common.sdpa_padded`).

Mixed precision: both layouts multiply positions and their squares (up to ``(W + 1)^2``) into a term of order
``a (u_i - u_j)^2``; in bfloat16 (8 bits) these products cancel, and at a 64 x 64 grid the term between near
tokens is rounding noise. So where ``q`` comes in bfloat16 or float16 (autocast, or a model cast to it),
:meth:`~_Parabolic.augment` computes the channels with autocast off and returns ``q'``, ``k'`` in float32, and
:meth:`~_Parabolic.attend` runs the kernel in float32 (``v`` cast up, the output cast back to ``v``'s dtype;
``Attention.logits`` the same, :func:`~vitrel.layout.heads.widened_precision`): outputs are then as far from
float64 as without position, gradients within 2.6x of that (``bench/results/pape_autocast_cpu.md``), for the cost
of a float32 attention call.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, patch_coords
from vitrel.layout.heads import pad_to_sdpa_width, widened_precision
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.registry import register_pos

__all__ = ["pape_positions", "Pape", "PapeRi"]

PREFIX_POSITIONS = ("origin", "none")
CHANNELS = ("compact", "parabolas")
LOW_PRECISION = (torch.bfloat16, torch.float16)


def pape_positions(grid: Grid, num_prefix_tokens: int, device: Any = None, dtype: Any = None) -> Tensor:
    """``[N, 2]``: ``(col + 1, row + 1)`` of each patch (raster order), ``(0, 0)`` for each prefix token (the
    authors' class token)."""
    rows, cols = patch_coords(grid, device)
    pos = torch.stack([cols + 1, rows + 1], dim=-1).to(dtype)
    return F.pad(pos, (0, 0, num_prefix_tokens, 0)) if num_prefix_tokens else pos


def _compact(a: Tensor, beta: Tensor, w: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """PaPE's term in 6 channels (``channels="compact"``), exactly the sum of its ``P`` parabolas.

    With 2-D positions ``u_ip - u_jp = w_p . D`` (``D = pos_i - pos_j``), so the sum over the parabolas is one
    quadratic in ``D``: ``-D^T M_i D + beta_i . D`` with ``M_i = sum_p a_ip w_p w_p^T`` and ``beta_i = sum_p b_ip w_p``.
    Expanded: ``q' = [-pos_i^T M_i pos_i + beta_i . pos_i, 2 M_i pos_i - beta_i, M_xx, 2 M_xy, M_yy]``,
    ``k' = [1, pos_j, -x_j^2, -x_j y_j, -y_j^2]``. ``a [B, heads, N, P]``, ``beta [B, heads, N, 2]``,
    ``w [heads, P, 2]``, ``pos [Bp, 1, N, 2]`` (``Bp``: 1, or ``B`` on a token layout)
    """
    wx, wy = w.unbind(-1)
    m = torch.einsum("bhnp,hpc->bhnc", a, torch.stack([wx * wx, 2 * wx * wy, wy * wy], -1))  # Mxx, 2Mxy, Myy
    x, y = pos.unbind(-1)
    quad = torch.stack([x * x, x * y, y * y], -1)  # [Bp, 1, N, 3]
    mxx, mxy2, myy = m.unbind(-1)
    two_mp = torch.stack([2 * mxx * x + mxy2 * y, mxy2 * x + 2 * myy * y], -1)  # 2 M pos_i
    const = -(m * quad).sum(-1, keepdim=True) + (beta * pos).sum(-1, keepdim=True)
    qx = torch.cat([const, two_mp - beta, m], dim=-1)
    kx = torch.cat([torch.ones_like(x)[..., None], pos, -quad], dim=-1)
    return qx, kx.expand(-1, w.shape[0], -1, -1)


class _Parabolic(PositionScheme):
    """What PaPE and PaPE-RI share: the token augmentation and its one-SDPA path."""

    kind = "relative"
    family = "content bias"
    has_token_terms = True
    prefix_positioned = True  # the class default: prefix_position="origin"

    def __init__(self, *, prefix_position: str = "origin", **kw: Any) -> None:
        super().__init__(**kw)
        if prefix_position not in PREFIX_POSITIONS:
            raise ValueError(f"{self.name}: prefix_position must be one of {PREFIX_POSITIONS}, got {prefix_position!r}")
        self.prefix_position = prefix_position
        self.prefix_positioned = prefix_position == "origin"  # this instance's (the class declares the default)

    def extras(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """``(qx [B, heads, N, e], kx [Bp, heads, N, e])`` for positions ``pos [Bp, 1, N, 2]``: the channels appended
        to the queries and the keys."""
        raise NotImplementedError

    def augment(self, x: Tensor, q: Tensor, k: Tensor, state: PosState) -> tuple[Tensor, Tensor]:
        p, layout = state.num_prefix_tokens, state.layout
        low = q.dtype in LOW_PRECISION  # autocast or a bfloat16 / float16 model: q', k' in float32 (module docstring)
        dtype = torch.float32 if low else x.dtype
        if layout is None:
            pos = pape_positions(state.grid, p, x.device, dtype)[None, None]  # [1, 1, N, 2]
            index = torch.arange(pos.shape[-2], device=x.device)[None]
        else:  # each token at its own patch: (col + 1, row + 1), prefix tokens at the origin
            layout = layout.to(x.device)
            pos = (layout.coords.flip(-1) + 1).clamp(min=0).to(dtype)[:, None]  # [B, 1, N, 2]
            index = layout.index
        with torch.autocast(x.device.type, enabled=False) if low else contextlib.nullcontext():
            qx, kx = self.extras(x.to(dtype), pos)
        if p and self.prefix_position == "none":  # no term for any pair with a prefix token
            keep = (index >= p).to(qx.dtype)[:, None, :, None]
            qx, kx = qx * keep, kx * keep
        dtype = torch.float32 if low else q.dtype
        q = pad_to_sdpa_width(torch.cat([q.to(dtype), qx.to(dtype)], dim=-1))
        k = pad_to_sdpa_width(torch.cat([k.to(dtype), kx.to(dtype).expand(k.shape[0], -1, -1, -1)], dim=-1))
        return q, k

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, state: PosState, dropout_p=0.0
    ) -> Tensor:
        """The kernel's attention; in float32 for q', k' in float32 over bfloat16 / float16 values (``augment`` under
        low precision), the output in the values' dtype."""
        with widened_precision(q, v):
            return super().attend(q, k, v.to(q.dtype), mask, scale, state, dropout_p).to(v.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, prefix_position={self.prefix_position}"


@register_pos("pape")
class Pape(_Parabolic):
    """PaPE: ``parabolas`` parabolas per head over a learned linear map of the position, with curvature
    ``softplus(A x_i)`` and slope ``B x_i`` from the query's token (module docstring). Content-dependent:
    no offset table. Parameters as the authors' (``position``: ``Linear(2, heads * P)``, ``ab``:
    ``Linear(C, 2 * heads * P)``, no biases, torch's default init), so their state dict loads as is."""

    def __init__(self, *, parabolas: int = 50, channels: str = "compact", **kw: Any) -> None:
        super().__init__(**kw)
        if parabolas < 1:
            raise ValueError(f"{self.name}: parabolas must be a positive number, got {parabolas}")
        if channels not in CHANNELS:
            raise ValueError(f"{self.name}: channels must be one of {CHANNELS}, got {channels!r}")
        self.parabolas = parabolas
        self.channels = channels
        self.position = nn.Linear(2, self.num_heads * parabolas, bias=False)
        self.ab = nn.Linear(self.embed_dim, 2 * self.num_heads * parabolas, bias=False)

    def extras(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        b, n, c = x.shape
        h, p, bp = self.num_heads, self.parabolas, pos.shape[0]
        if self.channels == "compact":
            # beta_i = sum_p b_ip w_p = (sum_p w_p B_p) x_i: the slopes folded into a [heads * 2, C] weight
            w, wab = self.position.weight.to(x.dtype).reshape(h, p, 2), self.ab.weight.to(x.dtype).reshape(2, h, p, c)
            a = F.softplus(F.linear(x, wab[0].reshape(h * p, c)).reshape(b, n, h, p).transpose(1, 2))
            beta = F.linear(x, torch.einsum("hpk,hpc->hkc", w, wab[1]).reshape(h * 2, c))
            return _compact(a, beta.reshape(b, n, h, 2).transpose(1, 2), w, pos)
        u = F.linear(pos, self.position.weight.to(x.dtype)).reshape(bp, n, h, p).transpose(1, 2)  # [Bp, h, N, P]
        ab = F.linear(x, self.ab.weight.to(x.dtype)).reshape(b, n, 2, h, p).permute(2, 0, 3, 1, 4)  # [2, B, h, N, P]
        a, slope = F.softplus(ab[0]), ab[1]
        u2 = u.square()
        qx = torch.cat(
            [-(a * u2).sum(-1, keepdim=True), a, 2 * a * u, (slope * u).sum(-1, keepdim=True), slope], dim=-1
        )
        one = torch.ones_like(u[..., :1])
        kx = torch.cat([one, -u2, u, one, -u], dim=-1)
        return qx, kx

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parabolas={self.parabolas}, channels={self.channels}"


@register_pos("pape_ri")
class PapeRi(_Parabolic):
    """PaPE-RI: one isotropic parabola per head, ``-softplus(A x_i) s_h^2 ||pos_i - pos_j||^2`` (module
    docstring); ``s_h`` is a fixed (not learned) buffer ``position_scales [1, heads, 1, 1]`` drawn from
    ``U(-1/sqrt(2), 1/sqrt(2))`` as the authors', ``A`` is ``a``: ``Linear(C, heads)``, no bias."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        bound = math.sqrt(1 / 2)  # sqrt(1 / num_positions), 2-D positions
        self.register_buffer("position_scales", ((2 * torch.rand(self.num_heads) - 1) * bound).view(1, -1, 1, 1))
        self.a = nn.Linear(self.embed_dim, self.num_heads, bias=False)

    def extras(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        b, n, _ = x.shape
        u = pos * self.position_scales.to(pos.dtype)  # [Bp, heads, N, 2]
        a = F.softplus(F.linear(x, self.a.weight.to(x.dtype))).transpose(1, 2)[..., None].expand(-1, -1, -1, 2)
        u2 = u.square()
        qx = torch.cat([-(a * u2).sum(-1, keepdim=True), a, 2 * a * u], dim=-1)
        kx = torch.cat([torch.ones_like(u[..., :1]), -u2, u], dim=-1)
        return qx, kx
