"""The rotation every rotary scheme applies: interleaved pairs ``(x_2t, x_2t+1)`` turned by per-token angles
(:mod:`vitrel.pos.schemes.rope` and the schemes built on it re-export these)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rope", "apply_rope_complex", "apply_rope_real"]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs ``(x_2t, x_2t+1)`` of ``x [..., N, d]`` by angles with ``cos/sin [..., N, d/2]``.

    ``x~_2t = x_2t cos - x_2t+1 sin``, ``x~_2t+1 = x_2t sin + x_2t+1 cos``, i.e. the complex product
    ``(x_2t + i x_2t+1) e^(i theta)``. The product runs in the promoted dtype of ``x`` and ``cos``
    (float32 tables keep bf16/fp16 inputs accurate); the result has ``x``'s dtype. Eagerly this
    uses one complex multiply (several times faster than the real form on CPU); under
    ``torch.compile`` it uses the real form, which the compiler fuses.
    """
    work = torch.promote_types(x.dtype, cos.dtype)
    if work in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
        return apply_rope_complex(x, cos, sin)
    return apply_rope_real(x, cos, sin)


def apply_rope_real(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rope` with real arithmetic only (any dtype, compiler friendly)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rope_complex(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rope` as ``view_as_complex(x) * (cos + i sin)`` (float32/float64 work dtype)."""
    work = torch.promote_types(x.dtype, cos.dtype)
    xr = x.to(work).unflatten(-1, (-1, 2))
    if xr.storage_offset() % 2 or any(st % 2 for st in xr.stride()[:-1]) or xr.stride(-1) != 1:
        xr = xr.clone(memory_format=torch.contiguous_format)  # view_as_complex: even offset and strides
    cis = torch.complex(cos.to(work), sin.to(work))
    return torch.view_as_real(torch.view_as_complex(xr) * cis).flatten(-2).to(x.dtype)
