"""The fused kernel's launch configuration: tiles, warps and stages by head dim, one frozen object per device.

Figures behind the CUDA table: ``bench/results/triton_tune_h100_tiles.md`` and ``triton_tune_h100_dq_grad.md``
(H100, bf16); ``bench/journal/triton-variants.md`` lists the variants that left the code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "MAX_HEAD_DIM", "INTERPRETER", "ROPE_CUDA", "ROPE_INTERPRETER", "KernelConfig", "RopeConfig", "Warps", "block_dim",
    "cuda_config", "default_config",
]  # fmt: skip

#: the largest head dim the kernels take (their tiles at 256 need more shared memory than an SM has)
MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class Warps:
    """A launch's ``num_warps`` and ``num_stages`` (None: Triton's default)."""

    num_warps: int | None = 4
    num_stages: int | None = 2

    def options(self) -> dict[str, int]:
        return {k: v for k, v in (("num_warps", self.num_warps), ("num_stages", self.num_stages)) if v is not None}


@dataclass(frozen=True)
class KernelConfig:
    """How :func:`~vitrel.kernels.triton.rel_bias_attention` launches at one head dim.

    ``fwd_tile`` ``(BM, BN)`` of the forward; ``bwd_tile`` the backward's square tile; ``dkdv_tile``, ``dq_tile``,
    ``dbias_tile``: a kernel's own ``(BM, BN)`` where the bias is read whole or there is none (None: the square
    tile), launched with ``wide``; ``fwd_one_tile_max``, ``bwd_one_tile_max``: the most tokens for the one-tile
    forward and backward (at most ``bwd_tile``; 0: never); ``tma_min_tiles``: the fewest key tiles for the forward's
    tensor descriptors; ``tile_budget_bytes``: the most memory a call's bias tiles may take (else gathered per
    score); ``grid_y_max``: the most programs on a grid's second axis (CUDA's limit: beyond it, batch shares).
    """

    fwd_tile: tuple[int, int] = (64, 64)
    bwd_tile: int = 64
    fwd: Warps = Warps(4, 2)
    bwd: Warps = Warps(4, 2)
    dkdv_tile: tuple[int, int] | None = None
    dq_tile: tuple[int, int] | None = None
    dbias_tile: tuple[int, int] | None = None
    wide: Warps = Warps(8, 2)
    fwd_one_tile_max: int = 64
    bwd_one_tile_max: int = 64
    fwd_one_tile: Warps = Warps(4, 1)
    bwd_one_tile: Warps = Warps(4, 1)
    bwd_one_tile_each: Warps = Warps(4, 1)
    delta: Warps = Warps(8, None)
    table_grad: Warps = Warps(4, 1)
    table_grad_block: int = 128
    tma_min_tiles: int = 8
    tile_budget_bytes: int = 64 << 20
    grid_y_max: int = 65535

    def __post_init__(self):
        if max(self.fwd_one_tile_max, self.bwd_one_tile_max) > self.bwd_tile:
            raise ValueError(f"the one-tile kernels take at most the backward's tile, {self.bwd_tile} tokens")
        for name in ("fwd_tile", "dkdv_tile", "dq_tile", "dbias_tile"):
            tile = getattr(self, name)
            if tile is not None and (min(tile) < 16 or any(t & (t - 1) for t in tile)):
                raise ValueError(f"{name} {tile}: powers of two of at least 16")

    def wide_tile(self, kernel: str) -> tuple[int, int] | None:
        """The own tile of ``kernel`` (``dkdv``, ``dq``, ``dbias``), or None."""
        return getattr(self, f"{kernel}_tile")


def block_dim(head_dim: int) -> int:
    """The head dim's tile width, a power of two from 16; an error above :data:`MAX_HEAD_DIM`."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    if block_d > MAX_HEAD_DIM:
        raise ValueError(f"attn_impl='triton' takes head dims up to {MAX_HEAD_DIM}, got {head_dim}")
    return block_d


#: Triton's interpreter: 16-token tiles (several blocks at small sizes), no launch options
INTERPRETER = KernelConfig(
    fwd_tile=(16, 16), bwd_tile=16, fwd=Warps(None, None), bwd=Warps(None, None), wide=Warps(None, None),
    fwd_one_tile_max=16, bwd_one_tile_max=16, fwd_one_tile=Warps(None, None), bwd_one_tile=Warps(None, None),
    bwd_one_tile_each=Warps(None, None), delta=Warps(None, None), table_grad=Warps(None, None),
)  # fmt: skip

#: CUDA by head dim (its power of two): the fastest of bench/triton_tune.py on an H100 in bf16
_CUDA = {
    16: KernelConfig(),
    32: KernelConfig(),
    64: KernelConfig(fwd=Warps(4, 3), bwd=Warps(4, 3), bwd_one_tile=Warps(8, 1)),
    128: KernelConfig(
        fwd_tile=(64, 32), bwd_tile=32, dkdv_tile=(64, 128), dq_tile=(128, 64), dbias_tile=(128, 64),
        fwd_one_tile_max=32, bwd_one_tile_max=32,
    ),
}  # fmt: skip


def cuda_config(head_dim: int, capability: tuple[int, int] = (9, 0), dtype: torch.dtype = torch.bfloat16):
    """The configuration of a CUDA device of ``capability`` for inputs of ``dtype`` at ``head_dim``: the H100's
    table for every capability and dtype (the only one measured)."""
    del capability, dtype  # (one table: a second device's or dtype's would be chosen here)
    return _CUDA[block_dim(head_dim)]


def default_config(q: torch.Tensor) -> KernelConfig:
    """The configuration for ``q [B, heads, N, d]`` on its device: :func:`cuda_config`, or :data:`INTERPRETER`."""
    block_dim(q.shape[-1])
    if q.device.type != "cuda":
        return INTERPRETER
    return cuda_config(q.shape[-1], torch.cuda.get_device_capability(q.device), q.dtype)


@dataclass(frozen=True)
class RopeConfig:
    """How the fused rotation launches: tokens per program for plane rotations (``pairs_tokens``) and for dense
    blocks (``block_elems`` tile elements, at most ``block_tokens_max`` tokens), and its warps."""

    pairs_tokens: int = 64
    block_elems: int = 4096
    block_tokens_max: int = 64
    warps: Warps = Warps(4, 1)

    def block_tokens(self, block_d: int, block_b: int) -> int:
        """Tokens per program for dense blocks of ``block_b`` in a head of ``block_d`` lanes."""
        return max(1, min(self.block_tokens_max, self.block_elems // (block_d * block_b)))


#: the rotation on CUDA, and in the interpreter (16 tokens a program: several per test grid)
ROPE_CUDA = RopeConfig()
ROPE_INTERPRETER = RopeConfig(pairs_tokens=16, block_elems=1 << 30, block_tokens_max=16, warps=Warps(None, None))
