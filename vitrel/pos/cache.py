"""One memo for the parameter-free position tensors (ALiBi distances, fixed RoPE tables, sin-cos
embeddings, Swin window masks).

These tensors depend only on the grid (and device / dtype), so eager forwards reuse them. A cache
filled during a trace would keep the tracer's tensors (a ``FakeTensor`` left on the module by
``torch.export`` makes the next eager call return fake tensors), so :class:`TensorCache` is bypassed
while ``torch.compile`` / ``torch.export`` / ``torch.fx`` trace: the computation is then recorded
in the graph instead. Entries made under ``torch.inference_mode`` are kept apart (such tensors cannot
be saved for a later backward pass).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

__all__ = ["TensorCache", "is_tracing"]

T = TypeVar("T")


def is_tracing(*refs: Any) -> bool:
    """True under ``torch.compile`` / ``torch.export`` tracing, or when a ref is an ``torch.fx`` proxy."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(r, torch.fx.Proxy) for r in refs)


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
