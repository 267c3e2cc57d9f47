"""The norms of a ViT's layers, by timm's ``norm_layer`` names: ``"layernorm"`` (``nn.LayerNorm``) or ``"rmsnorm"``
(timm's ``RmsNorm``, ``x / sqrt(mean(x^2) + eps) * weight``: no mean removed, no bias; sapiens2's)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from timm.layers import RmsNorm
from torch import nn

from vitrel.layers.validate import NORM_LAYERS

__all__ = ["NORMS", "make_norm", "same_norm"]

NORMS: dict[str, type[nn.Module]] = dict(zip(NORM_LAYERS, (nn.LayerNorm, RmsNorm), strict=True))


def make_norm(kind: str, eps: float) -> Callable[[int], nn.Module]:
    """A norm of ``dim`` channels, ``make_norm(kind, eps)(dim)``: :data:`NORMS`' ``kind`` with epsilon ``eps``."""
    return functools.partial(NORMS[kind], eps=eps)


def same_norm(m: nn.Module, ref: nn.Module) -> bool:
    """``m`` is a norm vitrel builds (a LayerNorm with weight and bias, or timm's ``RmsNorm`` with a weight) of
    ``ref``'s kind and epsilon: what ``norm_layer`` and ``norm_eps`` give every norm of a model."""

    def kind(n: nn.Module) -> str | None:
        if isinstance(n, nn.LayerNorm) and n.weight is not None and n.bias is not None:
            return "layernorm"
        return "rmsnorm" if type(n) is RmsNorm and n.weight is not None else None

    return kind(m) is not None and kind(m) == kind(ref) and m.eps == ref.eps
