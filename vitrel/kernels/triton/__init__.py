"""The fused Triton kernels: attention with a relative-position bias read by offset (``attn_impl="triton"``,
``"triton_atomic"``) and the rotary rotation of queries and keys.

Layout: :mod:`.config` (launch configuration by device and head dim), :mod:`.patterns` (bias tile patterns and the
table gradient's reductions), :mod:`.planning` (launch planning), :mod:`.launch` (a launch as data), :mod:`.op` (the
custom op, its autograd and fakes), :mod:`.attend` (the registered kernels), :mod:`.rope` (the rotation's op); the
jit kernels in ``_jit``, ``_fwd``, ``_bwd``, ``_sums`` and ``_rope_kernels``, loaded on first use.
"""

from vitrel.kernels.triton.attend import TritonAtomicKernel, TritonKernel
from vitrel.kernels.triton.config import INTERPRETER, MAX_HEAD_DIM, KernelConfig, Warps, cuda_config, default_config
from vitrel.kernels.triton.device import check_device, interpreter_on
from vitrel.kernels.triton.launch import Launch
from vitrel.kernels.triton.op import layout_tokens, plan, rel_bias_attention
from vitrel.kernels.triton.patterns import (
    TilePatterns,
    bias_tiles,
    dbias_order,
    stats_len,
    table_grad_from_slots,
    table_grad_from_tiles,
    tile_dtype,
    tile_flags,
    tile_lists,
    tile_patterns,
    visible_tiles,
)
from vitrel.kernels.triton.planning import BIAS_READS, tma_reads
from vitrel.kernels.triton.rope import rope_rotate, rotation_tables

__all__ = [
    "BIAS_READS", "INTERPRETER", "MAX_HEAD_DIM", "KernelConfig", "Launch", "TilePatterns", "TritonAtomicKernel",
    "TritonKernel", "Warps", "bias_tiles", "check_device", "cuda_config", "dbias_order", "default_config",
    "interpreter_on", "layout_tokens", "plan", "rel_bias_attention", "rope_rotate", "rotation_tables", "stats_len",
    "table_grad_from_slots", "table_grad_from_tiles", "tile_dtype", "tile_flags", "tile_lists", "tile_patterns",
    "tma_reads", "visible_tiles",
]  # fmt: skip
