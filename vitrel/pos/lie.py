"""Rotations from learned Lie-algebra generators: LieRE (Ostmeier et al., ICML 2025) and ComRoPE
(Yu et al., CVPR 2025, code Longin-Yu/ComRoPE ``model.py``).

Each token at position ``x = (x_row, x_col)`` rotates its query and key by ``R(x) = exp(sum_a x_a A_a)``,
with ``A_a`` skew-symmetric and block-diagonal (``d / b`` blocks of ``b x b``, ``b = block_size``), one
set per head, so that ``R(x)`` is block-diagonal and orthogonal::

    q~_i = R(x_i) q_i,   k~_j = R(x_j) k_j,   A_ij = q~_i . k~_j / sqrt(d) = q_i . R(x_i)^T R(x_j) k_j / sqrt(d)

``R(x_i)^T R(x_j) = R(x_j - x_i)`` (the logit depends on the offset only) exactly when the generators
of every block commute (ComRoPE's RoPE equation). The generators, as the authors' code builds them
(``F`` free parameters ``~ N(0, init_std)``, per head and block):

* ``liere``: ``A_a = F_a - F_a^T``, a free generator per axis: more expressive, but for ``b > 2``
  the ``A_a`` do not commute, so LieRE is then relative only approximately (the translation test
  measures the violation, ``tests/test_pos_lie.py``); with ``b = 2`` all ``2 x 2`` skew-symmetric
  matrices commute and LieRE is exactly relative (a learned 2-D RoPE).
* ``comrope`` ``variant: ld`` (linearly dependent): ``A_a = theta_{a, j} (F - F^T)`` per block ``j``, one
  matrix per head and block scaled per axis (``theta ~ N(0, 1)``): the generators of a block are
  multiples of one matrix, so they commute: exactly relative.
* ``comrope`` ``variant: ap`` (axis-partitioned): block ``j`` belongs to axis ``j mod 2`` (round
  robin), ``A_a`` is ``F_j - F_j^T`` on the blocks of axis ``a`` and zero elsewhere: generators act on
  disjoint blocks, so they commute: exactly relative. Needs ``d / 2`` divisible by ``b``.

Positions follow the authors' ``get_positions``: ``coords: normalized`` (their ``axis_scale``, the
default) puts patch ``(r, c)`` at ``((r + 0.5) / H, (c + 0.5) / W)`` (a larger grid interpolates),
``coords: index`` at ``(r, c)``; prefix (class/register) tokens sit at ``(cls_position, cls_position)``
(their default ``0.5``: the image centre, so the class token is rotated like a patch there) or, with
``cls_position: null``, stay unrotated (``R = I``, vitrel's convention for the other rotary schemes).

Differences from the authors' code, none in the forward values: their LieRE stores ``F`` multiplied
by ``scale_factor`` and divides it back (a learning-rate scaling of the generators; its default
``1e100`` overflows float32, so their runs must have set it: it is not reproduced); they build the
full ``d x d`` matrix per token and multiply, here the ``b x b`` blocks are applied directly (and, for
``b = 2``, as the plane rotations they are: RoPE's ``cos`` / ``sin``). The rotations are computed once per
forward and grid (``prepare``), as ``[heads, N, d / b, b, b]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.geometry import Grid, as_grid, patch_coords
from vitrel.pos.registry import register_pos
from vitrel.pos.rope import apply_rope, check_qk

__all__ = ["Liere", "Comrope", "lie_positions", "block_rotations", "apply_block_rotation"]

COORDS = ("normalized", "index")


def lie_positions(
    grid: Grid,
    num_prefix_tokens: int,
    coords: str,
    cls_position: float | None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Positions ``[P + H*W, 2]`` (row, column) of the tokens (see the module docstring)."""
    r, c = patch_coords(grid, device)
    xy = torch.stack((r, c), dim=-1).to(dtype)
    if coords == "normalized":
        xy = (xy + 0.5) / torch.tensor([grid.h, grid.w], dtype=dtype, device=device)
    prefix = torch.full((num_prefix_tokens, 2), 0.0 if cls_position is None else float(cls_position), dtype=dtype)
    return torch.cat((prefix.to(device), xy), dim=0)


def block_rotations(generators: Tensor, positions: Tensor) -> Tensor:
    """``exp(sum_a x_a A_a)`` per head, token and block: ``generators [heads, axes, m, b, b]`` and
    ``positions [N, axes]`` -> ``[heads, N, m, b, b]``."""
    log = torch.einsum("na,hamij->hnmij", positions.to(generators.dtype), generators)
    return torch.linalg.matrix_exp(log.contiguous())


def apply_block_rotation(x: Tensor, rot: Tensor) -> Tensor:
    """``x [B, heads, N, d]`` with each block of ``b`` channels multiplied by ``rot [heads, N, d/b, b, b]``."""
    m, b = rot.shape[-3], rot.shape[-1]
    xb = x.reshape(*x.shape[:-1], m, b)
    if rot.dim() == 6:  # [B, heads, N, d/b, b, b]: per row (a token layout)
        return torch.einsum("zhnmij,zhnmj->zhnmi", rot.to(x.dtype), xb).flatten(-2)
    out = torch.einsum("hnmij,zhnmj->zhnmi", rot.to(x.dtype), xb)
    return out.flatten(-2)


class _LieRotation(PositionScheme):
    """Shared by LieRE and ComRoPE: positions, the block rotations (``prepare``) and ``rotate``."""

    family = "rotary"
    has_rotation = True
    no_weight_decay_keys = ("generator", "multiplier")

    def __init__(
        self,
        *,
        block_size: int = 2,
        init_std: float = 1.0,
        coords: str = "normalized",
        cls_position: float | None = 0.5,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if not isinstance(block_size, int) or block_size < 2 or self.head_dim % block_size:
            raise ValueError(
                f"{self.name}: block_size must be an integer >= 2 that divides the head dim ({self.head_dim}), "
                f"got block_size={block_size!r}"
            )
        if coords not in COORDS:
            raise ValueError(f"{self.name}: coords must be one of {COORDS}, got {coords!r}")
        if not init_std > 0:
            raise ValueError(f"{self.name}: init_std must be > 0, got {init_std}")
        self.block_size, self.num_blocks = block_size, self.head_dim // block_size
        self.init_std, self.coords = float(init_std), coords
        self.cls_position = None if cls_position is None else float(cls_position)

    @property
    def depends_on_extent(self) -> bool:  # type: ignore[override]
        return self.coords == "normalized"

    def generators(self) -> Tensor:  # pragma: no cover - overridden
        """The skew-symmetric generators ``[heads, 2, d / b, b, b]`` (row axis first)."""
        raise NotImplementedError

    def positions(self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype) -> Tensor:
        return lie_positions(grid, num_prefix_tokens, self.coords, self.cls_position, device, dtype)

    def rotation(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype | None
    ) -> tuple[Tensor, ...]:
        """``(R,)``, ``R [heads, P + H*W, d / b, b, b]``, in at least float32 (the generators' dtype if wider).

        With ``b = 2`` every block is a plane rotation, ``exp([[0, -t], [t, 0]]) = [[cos t, -sin t], [sin t,
        cos t]]`` with ``t = sum_a x_a A_a[1, 0]``: then ``(cos, sin)`` of ``[heads, P + H*W, d / 2]``, applied
        as RoPE is (the same values, no matrix exponential)."""
        a = self.generators()
        work = torch.promote_types(a.dtype, torch.float32)
        pos = self.positions(as_grid(grid), num_prefix_tokens, a.device, work)
        if self.block_size == 2:
            theta = torch.einsum("na,ham->hnm", pos, a[..., 1, 0].to(work))
            return theta.cos(), theta.sin()
        return (block_rotations(a.to(work), pos),)

    def rotation_axes(self, rope: tuple[Tensor, ...]) -> tuple[int | None, ...]:
        return (-2, -2) if len(rope) == 2 else (-4,)  # cos / sin [heads, N, d/2], or R [heads, N, d/b, b, b]

    def rotate(self, q: Tensor, k: Tensor, state: PosState) -> tuple[Tensor, Tensor]:
        check_qk(self, q, k, state, per_head=True)
        rot = state.rope
        if len(rot) == 2:  # b = 2: plane rotations as RoPE's cos / sin
            cos, sin = rot[0].to(q.device), rot[1].to(q.device)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        r = rot[0].to(q.device)
        return apply_block_rotation(q, r), apply_block_rotation(k, r)

    def extra_repr(self) -> str:
        cls = "unrotated" if self.cls_position is None else self.cls_position
        return f"{super().extra_repr()}, block_size={self.block_size}, coords={self.coords}, prefix at {cls}"


def _skew(f: Tensor) -> Tensor:
    return f - f.transpose(-1, -2)


@register_pos("liere")
class Liere(_LieRotation):
    """LieRE: a free skew-symmetric generator per head, axis and block, ``A_a = F_a - F_a^T``; relative
    only approximately (the generators need not commute; see the module docstring)."""

    @property
    def exactly_relative(self) -> bool:  # type: ignore[override]
        """Only with 2 x 2 blocks (``so(2)`` is abelian: LieRE is then a learned 2-D RoPE); larger blocks
        do not commute and the logits depend on the offset only approximately."""
        return self.block_size == 2

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.generator = nn.Parameter(
            torch.randn(self.num_heads, 2, self.num_blocks, self.block_size, self.block_size) * self.init_std
        )

    def generators(self) -> Tensor:
        return _skew(self.generator)


@register_pos("comrope")
class Comrope(_LieRotation):
    """ComRoPE: commuting generators (``variant: ld`` linearly dependent, ``ap`` axis-partitioned), so
    exactly relative (see the module docstring)."""

    VARIANTS = ("ld", "ap")

    def __init__(self, *, variant: str = "ld", **kw: Any) -> None:
        super().__init__(**kw)
        if variant not in self.VARIANTS:
            raise ValueError(f"{self.name}: variant must be one of {self.VARIANTS}, got {variant!r}")
        self.variant = variant
        b, m = self.block_size, self.num_blocks
        if variant == "ap" and (self.head_dim // 2) % b:
            raise ValueError(
                f"{self.name}: variant ap splits the head dim ({self.head_dim}) between 2 axes, so block_size must "
                f"divide {self.head_dim // 2}, got block_size={b}"
            )
        self.generator = nn.Parameter(torch.randn(self.num_heads, 1, m, b, b) * self.init_std)
        if variant == "ld":
            self.multiplier = nn.Parameter(torch.randn(1, 2, m, 1, 1))

    def generators(self) -> Tensor:
        s = _skew(self.generator)  # [heads, 1, m, b, b]
        if self.variant == "ld":
            return s * self.multiplier
        blocks = torch.arange(self.num_blocks, device=s.device)
        mask = blocks[None, :] % 2 == torch.arange(2, device=s.device)[:, None]  # block j serves axis j mod 2
        return s * mask.to(s.dtype)[None, :, :, None, None]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variant={self.variant}"
