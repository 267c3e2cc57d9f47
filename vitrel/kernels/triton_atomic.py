"""``attn_impl="triton_atomic"``: the fused bias kernel of :mod:`vitrel.kernels.triton_bias` with its backward's
``dq`` added by atomics, as FlashAttention-2's backward (so SDPA's on a GPU) adds it.

The deterministic backward (``attn_impl="triton"``) runs a ``dq`` kernel that recomputes each tile's ``q k^T`` and
``dO v^T`` so that no two programs add into one row of ``dq``: 7 matrix products a tile in the backward (``dkdv`` 4,
``dq`` 3; 9 with the ``dbias`` kernel of a trained table read as bias tiles), against FlashAttention-2's 5. Here the
``dkdv`` kernel adds each tile's ``dS k`` into a float32 ``dq`` by atomics instead, and no ``dq`` kernel runs: 7 (9)
become 5 (7); where each of its tiles is one tile pattern (ViT-B/16's 197 tokens), the ``dkdv`` kernel sums the
table's gradient too (``triton_bias.TABLE_GRAD_IN_DKDV``), and the 7 are 5. The atomics' order changes from
run to run, and so do the low bits of ``dq`` (and of every gradient
downstream of it): two runs are not bitwise equal. Where the ``dq`` kernel reduces the table's gradient (the bias
gathered per score, token layouts) it still runs, and the backward is the deterministic one; so it is wherever
:func:`torch.use_deterministic_algorithms` is set (PyTorch's rule: the deterministic algorithm where there is one).
A call whose tokens fit one tile (Swin's windows: ``triton_bias.TILE_BWD``) runs the one-tile backward either way:
5 products a tile and no atomics (a program owns its windows' rows).
"""

from __future__ import annotations

from vitrel.kernels.registry import register_kernel
from vitrel.kernels.triton_bias import TritonKernel

__all__ = ["TritonAtomicKernel"]


@register_kernel("triton_atomic")
class TritonAtomicKernel(TritonKernel):
    """``triton``'s cases and inputs; ``dq`` by atomics in the backward (not bitwise repeatable)."""

    deterministic = False
