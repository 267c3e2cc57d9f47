"""Attention kernels, one file each, behind one registry (:mod:`vitrel.kernels.registry`; :func:`list_kernels` names
them, docs/gpu.md describes them). Every module here that does not start with ``_`` is imported, so a new kernel is
one new file, its test and its row in docs/gpu.md's table (docs/gpu.md, "Adding a kernel")."""

import importlib
import pkgutil

from vitrel.kernels.registry import (
    AUTO,
    AutoRule,
    Kernel,
    attn_impls,
    check_choice,
    check_impl,
    get_kernel,
    list_kernels,
    register_kernel,
    resolve,
)

for _m in pkgutil.iter_modules(__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["AUTO", "AutoRule", "Kernel", "attn_impls", "check_choice", "check_impl", "get_kernel", "list_kernels",
           "register_kernel", "resolve"]  # fmt: skip
