"""Position schemes. Every module in this package is imported, so a new scheme is one new file."""

import importlib
import pkgutil

from vitrel.layout.geometry import Grid, as_grid
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.registry import PosSpec, build_pos, get_pos_class, list_pos, parse_pos, register_pos

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

__all__ = [
    "Grid",
    "PositionScheme",
    "as_grid",
    "PosState",
    "PosSpec",
    "build_pos",
    "get_pos_class",
    "list_pos",
    "parse_pos",
    "register_pos",
]
