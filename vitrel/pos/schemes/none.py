"""``pos=none``: no position information."""

from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos

__all__ = ["NonePos"]


@register_pos("none")
class NonePos(PositionScheme):
    """No position information: plain attention. ``A_ij = q_i . k_j / sqrt(d)``."""

    grid_dims = None
