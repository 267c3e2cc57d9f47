"""``rope3d_vjepa2``: the rotation V-JEPA 2's released checkpoints were trained with, for their weights.

V-JEPA 2 (facebookresearch/vjepa2, ``src/models/utils/modules.py``: ``RoPEAttention`` and
``rotate_queries_or_keys``) gives each axis ``t, h, w`` a section of ``D = 2 * ((head_dim // 3) // 2)`` channels,
in that order, the channels after ``3D`` unrotated (``rope3d_axial``'s default sections). Within a section its code
expands the ``D / 2`` angles ``x_a omega_k`` (``omega_k = base^(-k / (D/2))``, ``x_a`` the token's frame, row or
column) with ``repeat(..., 2)``, so channel ``c`` gets angle ``theta_c = x_a omega_(c mod D/2)``, and turns the pairs
``(2j, 2j+1)``::

    x~_2j   = x_2j   cos(theta_2j)   - x_2j+1 sin(theta_2j)
    x~_2j+1 = x_2j+1 cos(theta_2j+1) + x_2j   sin(theta_2j+1)

The two channels of a pair have different angles, so this is not a rotation: a logit between two tubelets depends on
where each one is, not only on their offset (``exactly_relative = False``). The authors document the fix
(``repeat_interleave``, which is ``rope3d_axial``) and keep it off because their checkpoints need this form
(their comment in ``rotate_queries_or_keys``). Use this scheme to run their weights as they were trained
(:func:`vitrel.from_vjepa2`); ``rope3d_axial`` is the rotation they meant, a different function on the same weights.

Options: ``base`` (10000, their ``10000 ** omega``). Prefix tokens are unrotated (V-JEPA 2's encoder has none). No
``scaling``, ``sections``, ``layout`` or ``freqs``: those are ``rope3d_axial``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vitrel.layout.geometry import as_grid3
from vitrel.pos.base import PosState
from vitrel.pos.registry import register_pos
from vitrel.pos.rope_angles import geometric_freqs
from vitrel.pos.schemes.rope import FixedRope, check_qk
from vitrel.pos.schemes.rope3d import _check_sections, _coords

__all__ = ["Rope3dVjepa2", "vjepa2_rotate"]


def vjepa2_rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """V-JEPA 2's turn of the pairs ``(x_2j, x_2j+1)`` of ``x [..., N, d]`` with one angle per channel, ``cos/sin
    [..., N, d]`` (the module docstring's equation), in the promoted dtype of ``x`` and the tables; ``x``'s dtype
    out."""
    work = torch.promote_types(x.dtype, cos.dtype)
    x0, x1 = x.to(work).unflatten(-1, (-1, 2)).unbind(-1)
    c0, c1 = cos.to(work).unflatten(-1, (-1, 2)).unbind(-1)
    s0, s1 = sin.to(work).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x0 * c0 - x1 * s0, x1 * c1 + x0 * s1), dim=-1).flatten(-2).to(x.dtype)


@register_pos("rope3d_vjepa2")
class Rope3dVjepa2(FixedRope):
    """V-JEPA 2's released rotation (the module docstring): ``cos/sin [P + N, head_dim]``, one angle per channel."""

    grid_dims = 3
    _axes = 3
    standard_rotation = False  # (one angle per channel: the fused rotations turn pairs by one angle)
    exactly_relative = False

    def __init__(self, *, base: float = 10000.0, **kw: Any) -> None:
        if kw.get("scaling") is not None:
            raise ValueError(f"{self.name} is V-JEPA 2's released rotation, which has no scaling: use rope3d_axial")
        super().__init__(base=base, **kw)  # (its buffers wait for the sections: see _init_buffers)
        self.sections = _check_sections(self.name, None, self.head_dim)  # V-JEPA 2's: (head_dim // 3) // 2 pairs
        self.init_non_persistent_buffers()

    def _init_buffers(self) -> None:
        if "sections" in self.__dict__:  # (FixedRope's __init__ calls this before the sections are set)
            super()._init_buffers()

    def angles(self, grid: Any, draw: Tensor | None = None) -> Tensor:
        """``theta [T*H*W, head_dim]``: channel ``c`` of axis ``a``'s section at ``x_a omega_(c mod D/2)``."""
        grid = as_grid3(grid)
        x = _coords(grid, None, torch.float64)  # [3, N]
        parts = []
        for a, s in enumerate(self.sections):  # (V-JEPA 2's sections: s pairs, D = 2s channels, each axis)
            omega = geometric_freqs(self.base, 2 * s, 2, None, torch.float64)  # base^(-k/s), k < s
            parts.append(x[a][:, None] * omega.repeat(2)[None, :])  # their repeat(..., 2)
        theta = torch.cat(parts, dim=-1)
        return torch.nn.functional.pad(theta, (0, self.head_dim - theta.shape[-1]))

    def rotate(self, q: Tensor, k: Tensor, state: PosState) -> tuple[Tensor, Tensor]:
        check_qk(self, q, k, state)
        cos, sin = (t.to(q.device) for t in state.rope[:2])
        return vjepa2_rotate(q, cos, sin), vjepa2_rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, base={self.base}, sections={list(self.sections)}"
