"""Spiral RoPE (Liu et al. 2026, arXiv 2602.03227): rotary phases along several uniformly spaced directions."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vitrel.layout.geometry import Grid
from vitrel.pos.registry import register_pos
from vitrel.pos.rope_angles import geometric_freqs
from vitrel.pos.schemes.rope import FixedRope, Rope2dOptions

__all__ = ["SpiralRope"]


@register_pos("spiral_rope")
class SpiralRope(Rope2dOptions, FixedRope):
    """Spiral RoPE (Liu et al. 2026, arXiv 2602.03227): rotary phases along ``K`` uniformly spaced
    directions instead of the two axes.

    Direction ``k`` is ``u_k = (cos(pi k / K), sin(pi k / K))`` in (column, row) coordinates, ``k < K``
    (directions over a half turn: ``u`` and ``-u`` give the same phases up to sign); pair group ``k``
    (``d / (2K)`` consecutive pairs) rotates by ``theta = <p, u_k> * omega`` with ``p = (c, r)``::

        theta_{k, t} = (c cos(pi k / K) + r sin(pi k / K)) * omega_{k, t}

    Frequencies: ``same_theta: false`` (the authors' default) gives every direction its own frequencies,
    the ``d / 2`` distinct ``base^(-2t/d)`` dealt out round robin (direction ``k`` gets ``t = k, k + K,
    ...``); ``same_theta: true`` gives every direction the same ``base^(-2t / (d/K))``, ``t < d / (2K)``,
    which for ``K = 2`` is ``rope2d_axial`` with its two halves exchanged (direction 0 is the column axis,
    ``rope2d_axial`` rotates the rows first): the same function once the two halves of each head's ``q`` and
    ``k`` channels are swapped. The phases are exact projections computed per
    token; the authors' code (DiT-based) builds axial phase maps and rotates them with ``grid_sample``,
    which interpolates between grid points: here no interpolation error. Options as ``rope2d_axial``
    (``coords``, DINOv3 augmentation, STRING ``basis``); ``scaling`` takes ``rope_type: linear`` only
    (the directions mix both axes, so the per-axis frequency rules do not apply).
    """

    _divisor = 4
    no_weight_decay_keys = ("string",)

    def __init__(self, *, directions: int = 4, same_theta: bool = False, base: float = 10000.0, **kw) -> None:
        if not isinstance(directions, int) or directions < 1:
            raise ValueError(f"spiral_rope: directions must be a positive integer, got {directions!r}")
        head_dim = int(kw.get("head_dim", 0))
        if head_dim % (2 * directions):
            raise ValueError(
                f"spiral_rope: the head dim ({head_dim}) must split into {directions} directions of whole "
                f"rotation pairs (head_dim divisible by 2 * directions = {2 * directions})"
            )
        self.directions, self.same_theta = directions, bool(same_theta)
        super().__init__(base=base, **kw)
        if self.scaling is not None and self.scaling.rope_type != "linear":
            raise ValueError(
                f"spiral_rope: scaling takes rope_type=linear only (its directions mix both axes), "
                f"got {self.scaling.rope_type!r}"
            )

    def direction_freqs(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """``omega [K, d / (2K)]``: the frequencies of each direction's pairs."""
        k, per = self.directions, self.head_dim // (2 * self.directions)
        if self.same_theta:
            return geometric_freqs(self.base, self.head_dim // k, 2, None, dtype)[None].expand(k, per)
        omega = geometric_freqs(self.base, self.head_dim, 2, None, dtype)  # [d / 2]
        return omega.view(per, k).t()  # direction k: t = k, k + K, ...

    def angles(self, grid: Grid, draw: Tensor | None = None) -> Tensor:
        r, c = self.patch_rc(grid, draw)
        if self.scaling is not None:
            fr, fc = self.scaling_factors(grid)
            r, c = r / fr, c / fc
        phi = torch.arange(self.directions, dtype=torch.float64) * math.pi / self.directions
        proj = c[:, None] * torch.cos(phi) + r[:, None] * torch.sin(phi)  # [H*W, K]
        return (proj[:, :, None] * self.direction_freqs()[None]).flatten(1)  # [H*W, d/2]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, directions={self.directions}, same_theta={self.same_theta}"
