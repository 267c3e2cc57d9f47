"""Position schemes: the protocol (:mod:`~vitrel.pos.base`), the registry, the shared tables and caches, and the
schemes themselves in :mod:`vitrel.pos.schemes` (one file each). ``vitrel.pos.<scheme>`` (e.g. ``vitrel.pos.rope``)
is an alias of ``vitrel.pos.schemes.<scheme>`` for one release."""

import importlib
import pkgutil
import sys

from vitrel.layout.geometry import Grid, as_grid
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.registry import PosSpec, build_pos, get_pos_class, list_pos, parse_pos, register_pos

# (the names above are bound first: a scheme module may import them from vitrel.pos, as docs/schemes.md does)
for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
schemes = sys.modules[f"{__name__}.schemes"]
for _m in pkgutil.iter_modules(schemes.__path__):  # the old paths, vitrel.pos.<scheme>
    sys.modules[f"{__name__}.{_m.name}"] = globals()[_m.name] = getattr(schemes, _m.name)

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
