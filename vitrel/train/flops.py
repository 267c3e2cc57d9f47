"""FLOPs of sdpa's CPU kernel for torch's ``FlopCounterMode`` (Lightning's model summary counts with it).

torch counts the CUDA kernels of ``scaled_dot_product_attention`` (flash, memory-efficient, cuDNN) but has no formula
for the CPU one, ``aten._scaled_dot_product_flash_attention_for_cpu``: a CPU run's summary left the attention's
``q @ k^T`` and ``attn @ v`` out. :func:`count_cpu_attention` registers torch's own rule for them (through the public
``register_flop_formula``), once, and only where torch has none."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

__all__ = ["count_cpu_attention", "cpu_sdpa_flop"]

_CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kw) -> int:
    """``q [B, H, N, d] @ k^T`` and ``attn @ v [B, H, M, d_v]``: 2 FLOPs per multiply-add, as torch's CUDA rule."""
    b, h, n, d = query_shape
    m, dv = key_shape[-2], value_shape[-1]
    return 2 * b * h * n * m * d + 2 * b * h * n * m * dv


def count_cpu_attention() -> None:
    """Register :func:`cpu_sdpa_flop` for sdpa's CPU kernel unless torch already counts it."""
    if _CPU_SDPA not in flop_registry:
        register_flop_formula(_CPU_SDPA)(cpu_sdpa_flop)
