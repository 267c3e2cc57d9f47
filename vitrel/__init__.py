"""vitrel: vision transformers with relative position."""

from vitrel.layers.attention import Attention
from vitrel.models import (
    CheckpointError,
    create_model,
    export_model,
    from_irpe,
    from_timm,
    from_videomae,
    from_vjepa2,
    list_models,
    load_model,
)
from vitrel.pos import Grid, PositionScheme, PosState, build_pos, list_pos, register_pos

__version__ = "0.1.0"

__all__ = ["Attention", "Grid", "PosState", "PositionScheme", "build_pos", "list_pos", "register_pos"]
__all__ += ["CheckpointError", "create_model", "export_model", "from_irpe", "from_timm", "from_vjepa2", "list_models"]
__all__ += ["from_videomae", "load_model"]
