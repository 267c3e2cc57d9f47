"""Rotary position embeddings (RoPE, Su et al. 2021) on a patch grid: 1-D, 2-D axial and 2-D mixed.

Queries and keys of every patch token ``i`` are rotated, pair by pair, by the angles
``theta_i`` of its position; the dot product then depends only on the difference of angles::

    q~_i = R(theta_i) q_i,   k~_j = R(theta_j) k_j,   q~_i . k~_j = q_i . R(theta_j - theta_i) k_j
    A_ij = q~_i . k~_j / sqrt(d)                       (plain SDPA, no bias: the fast path)

Rotation convention (all three schemes): the head dimension is split into ``d/2`` interleaved
pairs ``(2t, 2t+1)`` (RoPE-ViT's complex view, timm's ``rot``) and pair ``t`` is rotated by
``theta_t``::

    [q~_2t  ]   [cos theta_t  -sin theta_t] [q_2t  ]
    [q~_2t+1] = [sin theta_t   cos theta_t] [q_2t+1]

Angles, with ``r``/``c`` the row/column of the patch and ``p = r * W + c`` its raster index:

* ``rope1d``:       ``theta_t = p * omega_t``, ``omega_t = base^(-2t/d)``, ``t < d/2`` (``d % 2 == 0``)
* ``rope2d_axial``: RoPE-ViT axial (Heo et al. 2024): ``omega_t = base^(-4t/d)``, ``t < d/4``;
  pairs ``t < d/4`` use the column, ``theta_t = c * omega_t``, pairs ``d/4 + t`` use the row,
  ``theta_{d/4+t} = r * omega_t`` (``d % 4 == 0``)
* ``rope2d_mixed``: RoPE-Mixed (Heo et al. 2024): learned per-head frequencies mixing both axes,
  ``theta_{h,t} = f^x_{h,t} * c + f^y_{h,t} * r``, ``freqs = [f^x, f^y]`` of ``[2, heads, d/2]``,
  initialised as in the paper: magnitudes ``base^(-4t/d)`` (``t < d/4``, twice) along a random
  direction ``phi_h`` per head, the second quarter turned by ``pi/2`` (``d % 4 == 0``)

Prefix (class/register) tokens get ``theta = 0``: they are left exactly unrotated (as in RoPE-ViT),
so a prefix<->patch logit sees the patch's absolute rotation; patch<->patch logits are purely
relative. Coordinates
are plain integers, so every scheme runs on any grid. ``prepare`` computes ``cos/sin`` once per
forward (a model whose blocks share the scheme hands them to every block); the fixed schemes also
reuse them across eager forwards (:class:`~vitrel.pos.cache.TensorCache`), the mixed scheme
recomputes them from its learned frequencies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.pos.base import Grid, PositionScheme, PosState, as_grid, check_tokens, patch_coords, register_pos
from vitrel.pos.cache import TensorCache

__all__ = [
    "Rope1d",
    "Rope2dAxial",
    "Rope2dMixed",
    "apply_rope",
    "apply_rope_complex",
    "apply_rope_real",
    "rope1d_angles",
    "rope2d_axial_angles",
    "rope2d_mixed_angles",
    "init_mixed_freqs",
]


# ---------------------------------------------------------------------------- functional core
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


def _geometric(base: float, head_dim: int, step: int, device: torch.device | None, dtype: torch.dtype) -> Tensor:
    """``base^(-step * t / head_dim)`` for ``t = 0 .. head_dim / step - 1``."""
    t = torch.arange(0, head_dim, step, device=device, dtype=dtype)
    return base ** (-t / head_dim)


def rope1d_angles(grid: Grid, head_dim: int, base: float, dtype: torch.dtype = torch.float64) -> Tensor:
    """``theta[p, t] = p * base^(-2t/d)`` for the raster index ``p`` of each patch, ``[H*W, d/2]``."""
    p = torch.arange(grid.n, dtype=dtype)
    return p[:, None] * _geometric(base, head_dim, 2, None, dtype)[None, :]


def rope2d_axial_angles(grid: Grid, head_dim: int, base: float, dtype: torch.dtype = torch.float64) -> Tensor:
    """``[c * omega, r * omega]`` with ``omega_t = base^(-4t/d)``, ``t < d/4``: ``[H*W, d/2]``."""
    r, c = patch_coords(grid)
    omega = _geometric(base, head_dim, 4, None, dtype)
    return torch.cat((c.to(dtype)[:, None] * omega, r.to(dtype)[:, None] * omega), dim=-1)


def rope2d_mixed_angles(freqs: Tensor, grid: Grid) -> Tensor:
    """``theta[h, p, t] = freqs[0, h, t] * col_p + freqs[1, h, t] * row_p``: ``[heads, H*W, d/2]``.

    Computed in at least float32 (the frequencies' dtype if wider), differentiable in ``freqs``.
    """
    dtype = torch.promote_types(freqs.dtype, torch.float32)
    r, c = patch_coords(grid, freqs.device)
    f = freqs.to(dtype)
    # elementwise outer products (autocast would downcast a matmul)
    return c.to(dtype)[None, :, None] * f[0][:, None, :] + r.to(dtype)[None, :, None] * f[1][:, None, :]


def init_mixed_freqs(
    num_heads: int, head_dim: int, base: float = 10.0, rotate: bool = True, generator: torch.Generator | None = None
) -> Tensor:
    """RoPE-Mixed initial frequencies ``[2, heads, d/2]`` (RoPE-ViT's ``init_random_2d_freqs``).

    ``m_t = base^(-4t/d)`` (``t < d/4``), ``phi_h ~ U[0, 2 pi)`` per head (0 if not ``rotate``)::

        f^x_h = [m cos(phi_h), m cos(phi_h + pi/2)],   f^y_h = [m sin(phi_h), m sin(phi_h + pi/2)]
    """
    mag = _geometric(base, head_dim, 4, None, torch.float64)[None, :]  # [1, d/4]
    if rotate:
        phi = torch.rand(num_heads, 1, generator=generator, dtype=torch.float64) * (2 * math.pi)
    else:
        phi = torch.zeros(num_heads, 1, dtype=torch.float64)
    fx = torch.cat((mag * torch.cos(phi), mag * torch.cos(phi + math.pi / 2)), dim=-1)
    fy = torch.cat((mag * torch.sin(phi), mag * torch.sin(phi + math.pi / 2)), dim=-1)
    return torch.stack((fx, fy), dim=0).float()


def _rotate_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _check_qk(scheme: PositionScheme, q: Tensor, k: Tensor, grid: Grid, num_prefix_tokens: int) -> Grid:
    if q.dim() != 4 or q.shape[-1] != scheme.head_dim or k.shape[-1] != scheme.head_dim:
        raise ValueError(
            f"{scheme.name} expects q and k of shape [B, heads, N, {scheme.head_dim}], "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    grid = as_grid(grid)
    check_tokens(q.shape[-2], grid, num_prefix_tokens)
    check_tokens(k.shape[-2], grid, num_prefix_tokens)
    return grid


def _table_dtype(dtype: torch.dtype) -> torch.dtype:
    """cos/sin tables are float64 for float64 inputs and float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------- modules
class _Rope(PositionScheme):
    """RoPE: ``rotation`` gives ``(cos, sin)`` (``prepare`` puts them into the state), ``rotate`` applies them."""

    family = "rotary"
    has_rotation = True

    def cos_sin(self, grid: Grid, num_prefix_tokens: int, device: torch.device, dtype: torch.dtype):
        raise NotImplementedError  # pragma: no cover - overridden

    def rotation(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype | None
    ) -> tuple[Tensor, Tensor]:
        return self.cos_sin(grid, num_prefix_tokens, device, dtype or torch.float32)

    def rotate(
        self, q: Tensor, k: Tensor, grid: Grid, num_prefix_tokens: int = 0, state: PosState | None = None
    ) -> tuple[Tensor, Tensor]:
        grid = _check_qk(self, q, k, grid, num_prefix_tokens)
        if state is not None and state.rope is not None:
            cos, sin = state.rope
        else:
            cos, sin = self.cos_sin(grid, num_prefix_tokens, q.device, q.dtype)
        return _rotate_qk(q, k, cos.to(q.device), sin.to(q.device))


class _FixedRope(_Rope):
    """RoPE with fixed frequencies: ``cos/sin`` reused across eager forwards per (grid, prefix, device, dtype)."""

    _divisor: int = 2

    def __init__(self, *, base: float = 100.0, **kw) -> None:
        super().__init__(**kw)
        if self.head_dim % self._divisor:
            raise ValueError(f"{self.name} needs head_dim divisible by {self._divisor}, got head_dim={self.head_dim}")
        if not base > 0:
            raise ValueError(f"{self.name} needs base > 0, got {base}")
        self.base = float(base)
        self._cs_cache = TensorCache()

    def angles(self, grid: Grid) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def cos_sin(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """``cos/sin`` of ``[P + H*W, d/2]`` (prefix rows ``cos = 1, sin = 0``), computed in float64 then cast."""
        dtype = _table_dtype(dtype)
        key = (tuple(grid), num_prefix_tokens, device, dtype)
        return self._cs_cache.get(key, lambda: self._cos_sin(grid, num_prefix_tokens, device, dtype))

    def _cos_sin(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        theta = F.pad(self.angles(grid), (0, 0, num_prefix_tokens, 0))
        return theta.cos().to(device=device, dtype=dtype), theta.sin().to(device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}"


@register_pos("rope1d")
class Rope1d(_FixedRope):
    """RoPE on the raster index ``p = row * W + col``: ``theta_t = p * base^(-2t/d)``."""

    _divisor = 2

    def angles(self, grid: Grid) -> Tensor:
        return rope1d_angles(grid, self.head_dim, self.base)


@register_pos("rope2d_axial")
class Rope2dAxial(_FixedRope):
    """RoPE-ViT axial: pairs ``t < d/4`` rotate by ``col * omega_t``, pairs ``d/4 + t`` by ``row * omega_t``."""

    _divisor = 4

    def angles(self, grid: Grid) -> Tensor:
        return rope2d_axial_angles(grid, self.head_dim, self.base)


@register_pos("rope2d_mixed")
class Rope2dMixed(_Rope):
    """RoPE-Mixed: learned per-head frequencies ``theta_{h,t} = f^x_{h,t} col + f^y_{h,t} row``.

    ``freqs`` (``[2, heads, d/2]``) is a parameter without weight decay; ``cos/sin`` are recomputed
    on every call because the frequencies change during training.
    """

    no_weight_decay_keys = ("freqs",)

    def __init__(self, *, base: float = 10.0, rotate: bool = True, **kw) -> None:
        super().__init__(**kw)
        if self.head_dim % 4:
            raise ValueError(f"{self.name} needs head_dim divisible by 4, got head_dim={self.head_dim}")
        if not base > 0:
            raise ValueError(f"{self.name} needs base > 0, got {base}")
        self.base = float(base)
        self.rotate_init = bool(rotate)
        self.freqs = nn.Parameter(init_mixed_freqs(self.num_heads, self.head_dim, self.base, self.rotate_init))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freqs.copy_(init_mixed_freqs(self.num_heads, self.head_dim, self.base, self.rotate_init))

    def cos_sin(
        self,
        grid: Grid,
        num_prefix_tokens: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``cos/sin`` of ``[heads, P + H*W, d/2]`` (prefix rows ``cos = 1, sin = 0``), on the
        frequencies' device, in at least float32 (``device`` / ``dtype`` are not used: the
        frequencies decide)."""
        theta = F.pad(rope2d_mixed_angles(self.freqs, grid), (0, 0, num_prefix_tokens, 0))
        return theta.cos(), theta.sin()

    def rotate(
        self, q: Tensor, k: Tensor, grid: Grid, num_prefix_tokens: int = 0, state: PosState | None = None
    ) -> tuple[Tensor, Tensor]:
        if q.dim() == 4 and q.shape[1] != self.num_heads:
            raise ValueError(f"{self.name} has {self.num_heads} heads, q has {q.shape[1]}")
        return super().rotate(q, k, grid, num_prefix_tokens, state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}"
