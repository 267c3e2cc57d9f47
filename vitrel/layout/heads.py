"""The head dims SDPA's fused CUDA kernels take, for queries and keys widened by appended channels (a folded bias,
Shaw's factored terms, PaPE's parabolas): the channel layout both the schemes that widen them and the kernels read,
and the dtype such queries and keys are multiplied in."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["FLASH_MAX_HEAD_DIM", "pad_to_sdpa_width", "sdpa_width", "widened_precision"]

#: the widest head dim of FlashAttention-2 (SDPA's flash backend; wider heads run on the memory-efficient kernel)
FLASH_MAX_HEAD_DIM = 256


def sdpa_width(width: int) -> int:
    """The head dim SDPA's fused CUDA kernels (flash, cuDNN, memory-efficient) take for ``width`` channels: the next
    multiple of 8 (flash and cuDNN read heads in 16-byte vectors; a width that is not one is padded by SDPA itself,
    a copy per call). Flash takes it up to :data:`FLASH_MAX_HEAD_DIM`; queries, keys and values of one width (the
    values padded with zeros: :func:`~vitrel.kernels.common.sdpa_padded`)."""
    return width + (-width % 8)


def pad_to_sdpa_width(t: Tensor) -> Tensor:
    """``t [..., c]`` with zero channels up to ``sdpa_width(c)``: they change no product ``q . k``."""
    return F.pad(t, (0, sdpa_width(t.shape[-1]) - t.shape[-1]))


def widened_precision(q: Tensor, v: Tensor) -> contextlib.AbstractContextManager:
    """Autocast off when the queries come in another dtype than the values: a scheme that widened them in float32
    over bfloat16 or float16 values (PaPE under autocast, :mod:`vitrel.pos.schemes.pape`) has their products
    computed in float32; a no-op otherwise."""
    return torch.autocast(q.device.type, enabled=False) if q.dtype != v.dtype else contextlib.nullcontext()
