"""Parameter-free position tensors (ALiBi and LookHere biases, fixed RoPE tables, sin-cos embeddings,
Swin window masks): computed from the configuration, never stored by a forward pass.

A forward pass changes nothing on a module: the tensors of the grid a module is built for are
non-persistent buffers (:class:`GridBuffers`, timm's convention for Swin's masks and relative-position
indices), made at construction and remade after every ``to()`` / ``to_empty()`` (so a model built on the
meta device gets them right); any other grid computes them in the forward pass. Under ``torch.export``
/ ``torch.compile`` with symbolic sizes, and inside ``torch.fx`` traces, they are computed in the graph.

:class:`TensorCache` is a memo kept for the explicit helper calls of a few schemes
(``Sincos2d.embed``, ``cos_sin`` of the fixed RoPE schemes); no forward pass goes through it. It is
bypassed while tracing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

__all__ = ["GridBuffers", "TensorCache", "concrete_grid", "is_tracing"]

T = TypeVar("T")


def is_tracing(*refs: Any) -> bool:
    """True under ``torch.compile`` / ``torch.export`` tracing, or when a ref is an ``torch.fx`` proxy."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(r, torch.fx.Proxy) for r in refs)


def concrete_grid(grid: Any) -> bool:
    """The grid's sides are plain ints (not ``torch.SymInt`` under export, nor ``torch.fx`` proxies)."""
    return all(type(v) is int for v in grid)


class GridBuffers:
    """Mixin for a module whose parameter-free tensors of its built grid are non-persistent buffers.

    The module sets its configuration, then calls ``self.init_non_persistent_buffers()``; ``_init_buffers``
    (re)registers the buffers on the device / dtype of the ones it replaces. They are remade after every
    ``_apply`` (``to()``, ``double()``, ``to_empty()``): exact values on the new device and dtype, and right
    after construction on the meta device. ``at_built_grid`` says when a call may use them.
    """

    grid: Any
    num_prefix_tokens: int

    def _init_buffers(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def init_non_persistent_buffers(self) -> None:
        """Recompute the buffers (timm's hook, as ``timm.models.reinit_non_persistent_buffers`` calls it)."""
        with torch.no_grad():
            self._init_buffers()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)  # type: ignore[misc]
        self.init_non_persistent_buffers()
        return self

    def _like(self, name: str) -> dict[str, Any]:
        """``device`` / ``dtype`` of buffer ``name`` (empty before it exists)."""
        t = getattr(self, name, None)
        return {} if t is None else {"device": t.device, "dtype": t.dtype}

    def at_built_grid(self, grid: Any, num_prefix_tokens: int) -> bool:
        return concrete_grid(grid) and tuple(grid) == tuple(self.grid) and num_prefix_tokens == self.num_prefix_tokens


class TensorCache:
    """A bounded least-recently-used memo ``key -> value``, bypassed while tracing (see the module docstring).

    ``get(key, fn)`` returns ``fn()`` memoised under ``(key, inference_mode)``; put the device and
    dtype into ``key`` when the value depends on them.
    """

    def __init__(self, maxsize: int = 16) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, fn: Callable[[], T], *refs: Any) -> T:
        if is_tracing(*refs):
            return fn()
        full = (key, torch.is_inference_mode_enabled())
        if full in self._data:
            self._data.move_to_end(full)
            return self._data[full]
        value = fn()
        self._data[full] = value
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)
        return value

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"TensorCache({len(self._data)}/{self.maxsize})"
