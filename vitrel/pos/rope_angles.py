"""The angle maths of the rotary schemes, without modules: the geometric frequencies, each 2-D scheme's angles
(``rope1d``, ``rope2d_axial``, ``rope2d_mixed`` and its initial frequencies), the patch coordinates and their
training-time augmentation (DINOv3), and STRING's orthogonal basis. :mod:`vitrel.pos.schemes.rope` builds its
schemes on them and re-exports them; ``rope3d`` and ``spiral`` use the frequencies."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vitrel.layout.geometry import Grid, patch_coords

__all__ = [
    "AXIAL_ORDERS",
    "COORDS",
    "geometric_freqs",
    "rope1d_angles",
    "rope_coords",
    "apply_augment",
    "augment_coords",
    "draw_augment",
    "rope2d_axial_angles",
    "rope2d_mixed_angles",
    "init_mixed_freqs",
    "string_basis",
]


def geometric_freqs(base: float, head_dim: int, step: int, device: torch.device | None, dtype: torch.dtype) -> Tensor:
    """``base^(-step * t / head_dim)`` for ``t = 0 .. head_dim / step - 1``."""
    t = torch.arange(0, head_dim, step, device=device, dtype=dtype)
    return base ** (-t / head_dim)


def rope1d_angles(grid: Grid, head_dim: int, base: float, dtype: torch.dtype = torch.float64) -> Tensor:
    """``theta[p, t] = p * base^(-2t/d)`` for the raster index ``p`` of each patch, ``[H*W, d/2]``."""
    p = torch.arange(grid.n, dtype=dtype)
    return p[:, None] * geometric_freqs(base, head_dim, 2, None, dtype)[None, :]


COORDS = ("index", "normalized")
#: ``rope2d_axial``'s pair layouts: rows first (timm, DINOv3, V-JEPA 2; vitrel_format >= 5), columns first (RoPE-ViT)
AXIAL_ORDERS = ("rows_first", "columns_first")


def rope_coords(
    grid: Grid, coords: str = "index", device: torch.device | None = None, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """Row and column coordinates ``(r, c)`` of the patches, each ``[H*W]``, in the angle's units.

    ``"index"``: the integers; ``"normalized"``: DINOv3's ``2 pi (2 (i + 0.5) / S - 1)`` per axis (the
    ``2 pi`` of its angles ``2 pi coord / period`` folded in).
    """
    if coords not in COORDS:
        raise ValueError(f"coords must be one of {COORDS}, got {coords!r}")
    r, c = patch_coords(grid, device)
    r, c = r.to(dtype), c.to(dtype)
    if coords == "normalized":
        r = 2 * math.pi * (2 * (r + 0.5) / grid.h - 1)
        c = 2 * math.pi * (2 * (c + 0.5) / grid.w - 1)
    return r, c


def augment_coords(
    r: Tensor, c: Tensor, shift: float | None = None, jitter: float | None = None, rescale: float | None = None
) -> tuple[Tensor, Tensor]:
    """DINOv3's training-time coordinate augmentation (same draws, same order: shift, jitter, rescale;
    row axis first), on coordinates in DINOv3's units (``rope_coords`` without the ``2 pi``): one
    :func:`draw_augment` applied by :func:`apply_augment`."""
    return apply_augment(r, c, draw_augment(shift, jitter, rescale, r.device, r.dtype))


def draw_augment(
    shift: float | None, jitter: float | None, rescale: float | None, device: torch.device | None, dtype: torch.dtype
) -> Tensor:
    """One draw of DINOv3's coordinate augmentation, ``[shift_r, shift_c, jitter_r, jitter_c, rescale]`` (0 and 1
    where an option is off), from torch's generator in DINOv3's order: a uniform shift per axis in ``[-shift,
    shift]``, a log-uniform factor per axis in ``[1/jitter, jitter]``, one log-uniform factor in ``[1/rescale,
    rescale]``. DINOv3 draws once per forward for every block (``RopePositionEmbedding`` at the model level)."""
    out = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0], dtype=dtype, device=device)
    if shift:
        out[:2] = torch.empty(2, dtype=dtype, device=device).uniform_(-shift, shift)
    if jitter:
        out[2:4] = torch.empty(2, dtype=dtype, device=device).uniform_(-math.log(jitter), math.log(jitter)).exp()
    if rescale:
        m = math.log(rescale)
        out[4:] = torch.empty(1, dtype=dtype, device=device).uniform_(-m, m).exp()
    return out


def apply_augment(r: Tensor, c: Tensor, draw: Tensor) -> tuple[Tensor, Tensor]:
    """Coordinates (DINOv3's units) moved by a :func:`draw_augment`: ``(x + shift) * jitter * rescale`` per axis."""
    d = draw.to(device=r.device, dtype=r.dtype)
    rc = (torch.stack((r, c), dim=-1) + d[:2]) * d[2:4] * d[4]
    return rc[..., 0], rc[..., 1]


def rope2d_axial_angles(
    grid: Grid,
    head_dim: int,
    base: float,
    dtype: torch.dtype = torch.float64,
    coords: str = "index",
    rc: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``[r * omega, c * omega]`` (rows first) with ``omega_t = base^(-4t/d)``, ``t < d/4``: ``[H*W, d/2]``
    (``r, c`` from :func:`rope_coords`, or given as ``rc``)."""
    r, c = rc if rc is not None else rope_coords(grid, coords, None, dtype)
    omega = geometric_freqs(base, head_dim, 4, None, dtype)
    return torch.cat((r.to(dtype)[:, None] * omega, c.to(dtype)[:, None] * omega), dim=-1)


def rope2d_mixed_angles(freqs: Tensor, grid: Grid, rc: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``theta[h, p, t] = freqs[0, h, t] * col_p + freqs[1, h, t] * row_p``: ``[heads, H*W, d/2]``
    (integer coordinates, or ``rc`` from :func:`rope_coords`).

    Computed in at least float32 (the frequencies' dtype if wider), differentiable in ``freqs``.
    """
    dtype = torch.promote_types(freqs.dtype, torch.float32)
    r, c = rc if rc is not None else patch_coords(grid, freqs.device)
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
    mag = geometric_freqs(base, head_dim, 4, None, torch.float64)[None, :]  # [1, d/4]
    if rotate:
        phi = torch.rand(num_heads, 1, generator=generator, dtype=torch.float64) * (2 * math.pi)
    else:
        phi = torch.zeros(num_heads, 1, dtype=torch.float64)
    fx = torch.cat((mag * torch.cos(phi), mag * torch.cos(phi + math.pi / 2)), dim=-1)
    fy = torch.cat((mag * torch.sin(phi), mag * torch.sin(phi + math.pi / 2)), dim=-1)
    return torch.stack((fx, fy), dim=0).float()


def string_basis(param: Tensor, kind: str) -> Tensor:
    """STRING's orthogonal ``P [heads, d, d]``: the Cayley map ``(I + A)^-1 (I - A)`` of the skew-symmetric
    ``A`` built from ``param`` (``cayley``: ``[heads, d, d]``, ``A = S - S^T``; ``circulant``:
    ``[heads, d]``, ``A = C - C^T`` with ``C_ab = s[(b - a) mod d]``). Computed in at least float32."""
    work = torch.promote_types(param.dtype, torch.float32)
    s = param.to(work)
    if kind == "circulant":
        d = s.shape[-1]
        idx = (torch.arange(d, device=s.device)[None, :] - torch.arange(d, device=s.device)[:, None]) % d
        s = s[..., idx]  # [heads, d, d] circulant
    elif kind != "cayley":
        raise ValueError(f"basis must be 'identity', 'cayley' or 'circulant', got {kind!r}")
    a = s - s.transpose(-1, -2)
    eye = torch.eye(a.shape[-1], dtype=work, device=a.device).expand_as(a)
    return torch.linalg.solve(eye + a, eye - a)
