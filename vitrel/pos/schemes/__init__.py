"""The position schemes, one file each, registered by name (:func:`vitrel.pos.registry.register_pos`). Every module in
this package is imported, so a new scheme is one new file (and its config in ``conf/pos/``, its test and its
README row)."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
