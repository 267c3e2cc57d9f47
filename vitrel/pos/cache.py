"""Parameter-free position tensors (ALiBi and LookHere biases, fixed RoPE tables, sin-cos embeddings,
Swin window masks): computed from the configuration, never stored by a forward pass.

A forward pass changes nothing on a module: the tensors of the grid a module is built for are
non-persistent buffers (:class:`NonPersistentBuffers`, timm's convention for Swin's masks and
relative-position indices), made at construction and remade after every ``to()`` / ``to_empty()`` (so a
model built on the meta device gets them right); any other grid computes them in the forward pass.
Under ``torch.export`` / ``torch.compile`` with symbolic sizes, and inside ``torch.fx`` traces, they are
computed in the graph.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GridBuffers", "NonPersistentBuffers", "concrete_grid"]


def concrete_grid(grid: Any) -> bool:
    """The grid's sides are plain ints (not ``torch.SymInt`` under export, nor ``torch.fx`` proxies)."""
    return all(type(v) is int for v in grid)


class NonPersistentBuffers:
    """Mixin for a module with derived non-persistent buffers: tensors computed from its configuration,
    not saved in checkpoints (fixed position tables and biases, Swin's window masks).

    The one mechanism that keeps them right, for every such module in vitrel. The contract is timm's public
    one: the module implements ``_init_buffers`` (registers the buffers, on the device / dtype of the ones
    it replaces, see :meth:`_like`) and calls ``self.init_non_persistent_buffers()`` at the end of its
    ``__init__``; ``init_non_persistent_buffers()`` is the hook ``timm.models.reinit_non_persistent_buffers``
    calls. This mixin also calls it after every conversion (``to()``, ``double()``, ``half()``,
    ``to_empty()``, ...), so the buffers hold exact values in the new dtype (a float64 sin-cos table, not a
    float32 one cast up) and real values after ``to_empty()`` (a model built on the meta device runs as
    soon as its weights are loaded).

    Why ``_apply``: every conversion of ``nn.Module`` goes through it and PyTorch has no public hook that
    runs after one (its global hooks cover registration, forward and backward only). Overriding the public
    ``to`` / ``double`` / ``half`` / ``float`` / ``bfloat16`` / ``type`` / ``to_empty`` instead would be
    seven overrides doing the same; this is the only ``_apply`` override in vitrel (a test keeps it so).
    """

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
        """``device`` / ``dtype`` of buffer ``name`` (empty before it exists or while it is None)."""
        t = getattr(self, name, None)
        return {} if t is None else {"device": t.device, "dtype": t.dtype}


class GridBuffers(NonPersistentBuffers):
    """:class:`NonPersistentBuffers` of a position scheme: the parameter-free tensors of the grid it is
    built for. ``at_built_grid`` says when a call may use them."""

    grid: Any
    num_prefix_tokens: int

    def at_built_grid(self, grid: Any, num_prefix_tokens: int) -> bool:
        return concrete_grid(grid) and tuple(grid) == tuple(self.grid) and num_prefix_tokens == self.num_prefix_tokens
