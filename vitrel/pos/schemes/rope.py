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
* ``rope2d_axial``: axial RoPE (Heo et al. 2024): ``omega_t = base^(-4t/d)``, ``t < d/4``;
  pairs ``t < d/4`` use the row, ``theta_t = r * omega_t``, pairs ``d/4 + t`` use the column,
  ``theta_{d/4+t} = c * omega_t`` (``d % 4 == 0``). Rows first, as timm, DINOv3 and V-JEPA 2 (and
  ``rope3d_axial``); RoPE-ViT's ``compute_axial_cis`` puts the columns first: the same function once
  the two halves of each head's ``q`` and ``k`` channels are swapped
* ``rope2d_mixed``: RoPE-Mixed (Heo et al. 2024): learned per-head frequencies mixing both axes,
  ``theta_{h,t} = f^x_{h,t} * c + f^y_{h,t} * r``, ``freqs = [f^x, f^y]`` of ``[2, heads, d/2]``,
  initialised as in the paper: magnitudes ``base^(-4t/d)`` (``t < d/4``, twice) along a random
  direction ``phi_h`` per head, the second quarter turned by ``pi/2`` (``d % 4 == 0``)

Options of the 2-D schemes (``rope2d_axial``, ``rope2d_mixed``):

* ``coords="index"`` (default): ``r, c`` the integer row and column (RoPE-ViT); a larger grid
  *extrapolates* to angles never seen in training. ``coords="normalized"`` (DINOv3): 0.5-centred
  coordinates normalised per axis to ``(-1, 1)``, ``r' = 2 (r + 0.5) / H - 1``, and angles
  ``2 pi r' omega_t`` (DINOv3's periods ``base^(4t/d)``): a larger grid *interpolates* between angles
  seen in training. Training-time coordinate augmentation as DINOv3 (``shift``: one uniform offset
  in ``[-shift, shift]`` per axis; ``jitter``: one log-uniform factor in ``[1/jitter, jitter]`` per
  axis; ``rescale``: one log-uniform factor shared by both axes; drawn once per forward for every
  block, as DINOv3's model-level ``RopePositionEmbedding``, in training only; ``None`` = off).
* ``grid_offset`` (``coords="index"``; default 0): the patches' coordinates start at it, ``r + grid_offset``. The
  unrotated prefix tokens sit at 0, so ``grid_offset=1`` places the class token one row and one column before the
  first patch, as the Perception Encoder's RoPE (timm's ``vit_pe_*``, ``rope_grid_offset=1``); patch<->patch
  logits do not change.
* ``basis="identity"`` (default), ``"cayley"`` or ``"circulant"``: STRING (Schenck et al. 2025), a
  learned orthogonal change of basis ``P_h`` per head applied to queries and keys before the
  rotation, ``q~_i = R(theta_i) P_h q_i``: ``q~_i . k~_j = q_i . P_h^T R(theta_j - theta_i) P_h k_j``
  stays exactly relative. ``cayley``: ``P = (I - A)(I + A)^-1`` with ``A = S - S^T`` from a free
  ``[heads, d, d]`` parameter ``S``; ``circulant``: the same Cayley map of the skew-symmetric
  circulant ``A = C - C^T``, ``C_ab = s[(b - a) mod d]`` (``[heads, d]`` parameters). Both start at
  ``P = I`` (``S = 0``), so an untrained STRING model is plain RoPE. ``P`` is computed once per
  forward (``prepare``).

Prefix (class/register) tokens get ``theta = 0``: they are left exactly unrotated (as in RoPE-ViT),
so a prefix<->patch logit sees the patch's absolute rotation; patch<->patch logits are purely
relative. Every scheme runs on any grid. ``prepare`` computes ``cos/sin`` once per
forward (a model whose blocks share the scheme hands them to every block); the fixed schemes keep
those of the grid they are built for as non-persistent buffers (:class:`~vitrel.pos.cache.GridBuffers`),
the mixed scheme recomputes them from its learned frequencies. The angle maths, without modules, is in
:mod:`vitrel.pos.rope_angles` (re-exported here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, as_grid
from vitrel.layout.tokens import TokenLayout
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.cache import GridBuffers
from vitrel.pos.reference import ReferenceGrid
from vitrel.pos.registry import register_pos
from vitrel.pos.rope_angles import (
    AXIAL_ORDERS,
    COORDS,
    apply_augment,
    augment_coords,
    draw_augment,
    geometric_freqs,
    init_mixed_freqs,
    rope1d_angles,
    rope2d_axial_angles,
    rope2d_mixed_angles,
    rope_coords,
    string_basis,
)
from vitrel.pos.rope_scaling import RopeScaling, parse_scaling, scale_geometric, scale_learned
from vitrel.pos.rotation import apply_rope, apply_rope_complex, apply_rope_real

__all__ = [
    "AXIAL_ORDERS",
    "Rope1d",
    "Rope2dAxial",
    "Rope2dMixed",
    "apply_rope",
    "apply_rope_complex",
    "apply_rope_real",
    "rope1d_angles",
    "rope2d_axial_angles",
    "rope2d_mixed_angles",
    "rope_coords",
    "augment_coords",
    "string_basis",
    "init_mixed_freqs",
    "geometric_freqs",
    "check_qk",
    "FixedRope",
    "Rope2dOptions",
]


# ---------------------------------------------------------------------------- helpers (the angles: rope_angles)
def _rotate_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def check_qk(scheme: PositionScheme, q: Tensor, k: Tensor, state: PosState, per_head: bool = False) -> None:
    """``q`` and ``k`` are ``[B, heads, N, head_dim]`` for the state's tokens (``heads == scheme.num_heads`` for
    a scheme with per-head angles)."""
    if q.dim() != 4 or q.shape[-1] != scheme.head_dim or k.shape[-1] != scheme.head_dim:
        raise ValueError(
            f"{scheme.name} expects q and k of shape [B, heads, N, {scheme.head_dim}], "
            f"got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if per_head and q.shape[1] != scheme.num_heads:
        raise ValueError(f"{scheme.name} has {scheme.num_heads} heads, q has {q.shape[1]}")
    state.check_tokens(q.shape[-2])
    state.check_tokens(k.shape[-2])


def _table_dtype(dtype: torch.dtype) -> torch.dtype:
    """cos/sin tables are float64 for float64 inputs and float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------- modules
class _Rope(ReferenceGrid, PositionScheme):
    """RoPE: ``rotation`` gives ``(cos, sin)`` (``prepare`` puts them into the state), ``rotate`` applies them."""

    family = "rotary"
    has_rotation = True
    standard_rotation = True  # (rotate() applies state.rope as the fused rotation does)
    #: axes of the position: 1 (raster index) or 2 (row, column), for ``scaling``
    _axes: int = 2
    #: ``head_dim`` must be a multiple of it: the rotated pairs (2), split between rows and columns (4)
    _divisor: int = 2

    def __init__(self, *, scaling: dict | None = None, **kw) -> None:
        super().__init__(**kw)
        self.scaling: RopeScaling | None = parse_scaling(scaling, self._axes, self.name)
        self.init_reference(self.scaling is not None)  # scaling reads the training grid

    def _set_base(self, base: float) -> None:
        """Check ``head_dim`` (a multiple of ``_divisor``) and the frequency base ``base > 0``; keep ``base``."""
        if self.head_dim % self._divisor:
            raise ValueError(f"{self.name} needs head_dim divisible by {self._divisor}, got head_dim={self.head_dim}")
        if not base > 0:
            raise ValueError(f"{self.name} needs base > 0, got {base}")
        self.base = float(base)

    @property
    def size_branches(self) -> bool:  # type: ignore[override]
        """``scaling.factor: auto`` / ``grid``: ``max(1, L' / L)`` / ``L' / L`` of the call's grid, from its sizes."""
        return self.scaling is not None and self.scaling.factor in ("auto", "grid")

    def scaling_factors(self, grid: Grid) -> tuple[float, ...]:
        """The ``scaling`` factor of each axis (rows, columns; or the raster index) for a call on ``grid``."""
        if self.scaling is None:
            return (1.0,) * self._axes
        if self._axes == 1:
            return self.scaling.factors((self.ref.n,), (grid.n,))
        return self.scaling.factors(tuple(self.ref), tuple(grid))

    def attention_factor(self, grid: Grid) -> float:
        """YaRN's factor on ``cos`` and ``sin`` (1 without ``scaling: {rope_type: yarn}``)."""
        return 1.0 if self.scaling is None else self.scaling.mscale(self.scaling_factors(grid))

    def axis_omega(self, axis: int, dim: int, grid: Grid, dtype: torch.dtype) -> Tensor:
        """``base^(-2t/dim)`` of axis ``axis`` (0: rows or the raster index, 1: columns), scaled by ``scaling``."""
        if self.scaling is None:
            return geometric_freqs(self.base, dim, 2, None, dtype)
        built, call = (self.ref.n, grid.n) if self._axes == 1 else (self.ref[axis], grid[axis])
        factor = self.scaling_factors(grid)[axis]
        return scale_geometric(self.scaling, dim, self.base, factor, built, call, dtype)

    def cos_sin(self, grid: Grid, num_prefix_tokens: int, device: torch.device, dtype: torch.dtype, draw=None):
        raise NotImplementedError  # pragma: no cover - overridden

    def basis(self) -> Tensor | None:
        """STRING's change of basis ``[heads, d, d]``, or None (plain RoPE)."""
        return None

    def rotation_table(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype, draw=None
    ) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` for the forward pass (``cos_sin`` here)."""
        return self.cos_sin(grid, num_prefix_tokens, device, dtype, draw)

    def rotation(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype | None, draw=None
    ) -> tuple[Tensor, ...]:
        """``(cos, sin)``, or ``(cos, sin, P)`` with STRING's basis; ``draw``: the forward's coordinate augmentation
        (:meth:`Rope2dOptions.draw`), drawn here when None."""
        cs = self.rotation_table(grid, num_prefix_tokens, device, dtype or torch.float32, draw)
        p = self.basis()
        return cs if p is None else (*cs, p)

    def rotation_axes(self, rope: tuple[Tensor, ...]) -> tuple[int | None, ...]:
        return (-2, -2, None) if len(rope) == 3 else (-2, -2)  # STRING's basis has no token axis

    #: the angles differ per head (``rotate`` checks the heads of ``q``)
    per_head: bool = False

    def rotate(self, q: Tensor, k: Tensor, state: PosState) -> tuple[Tensor, Tensor]:
        check_qk(self, q, k, state, self.per_head)
        rot = state.rope
        cos, sin = rot[0], rot[1]
        if len(rot) == 3:  # STRING: q, k -> P q, P k (per head) before the rotation
            p = rot[2].to(q.dtype).transpose(-1, -2)[None]
            q, k = q @ p, k @ p
        return _rotate_qk(q, k, cos.to(q.device), sin.to(q.device))


class FixedRope(GridBuffers, _Rope):
    """RoPE with fixed frequencies: the built grid's ``cos/sin`` are non-persistent buffers (``built_cos``,
    ``built_sin``, float32 unless the module was converted); another grid computes them (``cos_sin``)."""

    def __init__(self, *, base: float = 100.0, **kw) -> None:
        super().__init__(**kw)
        self._set_base(base)
        if not isinstance(self, Rope2dOptions):  # those make their buffers once their options are set
            self.init_non_persistent_buffers()

    def _init_buffers(self) -> None:
        like = self._like("built_cos") or {"device": None, "dtype": torch.float32}
        was = self.training
        self.training = False  # the plain table (training-time coordinate augmentation is per forward)
        try:
            cos, sin = self._cos_sin(self.grid, self.num_prefix_tokens, like["device"], like["dtype"])
        finally:
            self.training = was
        self.register_buffer("built_cos", cos, persistent=False)
        self.register_buffer("built_sin", sin, persistent=False)

    def rotation_table(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype, draw=None
    ) -> tuple[Tensor, Tensor]:
        dtype = _table_dtype(dtype)
        if getattr(self, "augmenting", False):  # fresh coordinates every forward
            return self._cos_sin(grid, num_prefix_tokens, device, dtype, draw)
        cos = self.built_cos
        if (
            self.at_built_grid(grid, num_prefix_tokens)
            and cos.dtype == dtype
            and (device is None or cos.device == device)
        ):
            return cos, self.built_sin
        return self._cos_sin(grid, num_prefix_tokens, device, dtype)

    def angles(self, grid: Grid, draw: Tensor | None = None) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def cos_sin(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype, draw=None
    ) -> tuple[Tensor, Tensor]:
        """``cos/sin`` of ``[P + H*W, d/2]`` (prefix rows ``cos = 1, sin = 0``), computed in float64 then cast."""
        return self._cos_sin(grid, num_prefix_tokens, device, _table_dtype(dtype), draw)

    def _cos_sin(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device, dtype: torch.dtype, draw=None
    ) -> tuple[Tensor, Tensor]:
        theta = F.pad(self.angles(grid, draw), (0, 0, num_prefix_tokens, 0))
        m = self.attention_factor(grid)
        cos, sin = (theta.cos(), theta.sin()) if m == 1.0 else (theta.cos() * m, theta.sin() * m)
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}{_scaling_repr(self.scaling)}"


def _scaling_repr(sc: RopeScaling | None) -> str:
    return "" if sc is None else f", scaling={sc.rope_type}(factor={sc.factor})"


class Rope2dOptions(_Rope):
    """The options of the 2-D schemes: ``coords`` (with DINOv3's augmentation) and STRING's ``basis``."""

    def __init__(
        self,
        *,
        coords: str = "index",
        shift: float | None = None,
        jitter: float | None = None,
        rescale: float | None = None,
        basis: str = "identity",
        grid_offset: float = 0.0,
        **kw,
    ) -> None:
        super().__init__(**kw)
        if not math.isfinite(grid_offset):
            raise ValueError(f"{self.name}: grid_offset must be a finite number, got {grid_offset!r}")
        if grid_offset and coords != "index":
            raise ValueError(f"{self.name}: grid_offset shifts integer coordinates (coords='index')")
        self.grid_offset = float(grid_offset)
        if coords not in COORDS:
            raise ValueError(f"{self.name}: coords must be one of {COORDS}, got {coords!r}")
        for name, v, lo in (("shift", shift, 0.0), ("jitter", jitter, 1.0), ("rescale", rescale, 1.0)):
            if v is not None and not (math.isfinite(v) and v >= lo):
                raise ValueError(f"{self.name}: {name} must be a finite number >= {lo} or None, got {v!r}")
        if self.scaling is not None and coords == "normalized":
            raise ValueError(
                f"{self.name}: scaling extends integer coordinates (coords='index'); coords='normalized' already "
                "interpolates at a larger grid"
            )
        if (shift or jitter or rescale) and coords != "normalized":
            raise ValueError(
                f"{self.name}: shift / jitter / rescale augment normalized coordinates (coords='normalized')"
            )
        self.coords, self.shift, self.jitter, self.rescale = coords, shift, jitter, rescale
        self.basis_kind = basis
        if basis == "identity":
            self.string = None
        elif basis == "cayley":
            self.string = nn.Parameter(torch.zeros(self.num_heads, self.head_dim, self.head_dim))
        elif basis == "circulant":
            self.string = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        else:
            raise ValueError(f"{self.name}: basis must be 'identity', 'cayley' or 'circulant', got {basis!r}")
        if isinstance(self, GridBuffers):
            self.init_non_persistent_buffers()

    @property
    def depends_on_extent(self) -> bool:  # type: ignore[override]
        return self.coords == "normalized"

    @property
    def augmenting(self) -> bool:
        return self.training and bool(self.shift or self.jitter or self.rescale)

    def coords_on(self) -> tuple[torch.device | None, torch.dtype]:
        """The device and dtype of the patches' coordinates (the angles' working precision)."""
        return None, torch.float64

    def draw(self) -> Tensor | None:
        """One draw of the coordinate augmentation (:func:`draw_augment`) for a forward, None when not augmenting.
        A model's blocks share it (:meth:`prepare_many`), as DINOv3's do."""
        return draw_augment(self.shift, self.jitter, self.rescale, *self.coords_on()) if self.augmenting else None

    def patch_rc(self, grid: Grid, draw: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Coordinates of the patches for the angles, augmented in training by ``draw`` (drawn here when None; see
        the module docstring)."""
        r, c = rope_coords(grid, self.coords, *self.coords_on())
        if self.grid_offset:
            r, c = r + self.grid_offset, c + self.grid_offset
        if self.augmenting:
            two_pi = 2 * math.pi  # augment in DINOv3's units
            r, c = apply_augment(r / two_pi, c / two_pi, self.draw() if draw is None else draw)
            r, c = r * two_pi, c * two_pi
        return r, c

    @classmethod
    def prepare_many(
        cls, schemes: Sequence[PositionScheme], grid: Any, num_prefix_tokens=0, device=None, dtype=None, kernel=None
    ) -> list[PosState]:
        """Blocks that augment their coordinates alike share one draw per forward (DINOv3's ``RopePositionEmbedding``
        serves every block); otherwise each scheme's ``prepare``."""

        def aug(s: Any) -> tuple:
            return (type(s), s.augmenting, s.shift, s.jitter, s.rescale, s.coords_on())

        draw = schemes[0].draw() if schemes and all(aug(s) == aug(schemes[0]) for s in schemes) else None
        if draw is None:
            return super().prepare_many(schemes, grid, num_prefix_tokens, device, dtype, kernel)
        return [s.prepare(grid, num_prefix_tokens, device, dtype, kernel, draw=draw) for s in schemes]

    def basis(self) -> Tensor | None:
        return None if self.string is None else string_basis(self.string, self.basis_kind)

    def extra_repr(self) -> str:
        out = f"{super().extra_repr()}, coords={self.coords}, basis={self.basis_kind}"
        out += f", grid_offset={self.grid_offset:g}" if self.grid_offset else ""
        aug = {k: v for k, v in (("shift", self.shift), ("jitter", self.jitter), ("rescale", self.rescale)) if v}
        return out + "".join(f", {k}={v}" for k, v in aug.items())


@register_pos("rope1d")
class Rope1d(FixedRope):
    """RoPE on the raster index ``p = row * W + col``: ``theta_t = p * base^(-2t/d)``."""

    _divisor = 2
    _axes = 1
    depends_on_extent = True

    def angles(self, grid: Grid, draw: Tensor | None = None) -> Tensor:
        if self.scaling is None:
            return rope1d_angles(grid, self.head_dim, self.base)
        p = torch.arange(grid.n, dtype=torch.float64)
        return p[:, None] * self.axis_omega(0, self.head_dim, grid, torch.float64)[None, :]


@register_pos("rope2d_axial")
class Rope2dAxial(Rope2dOptions, FixedRope):
    """Axial RoPE, rows first: pairs ``t < d/4`` rotate by ``row * omega_t``, pairs ``d/4 + t`` by ``col * omega_t``
    (options: ``coords``, ``shift``/``jitter``/``rescale``, ``basis``; see the module docstring).

    ``order="columns_first"`` swaps the two halves (RoPE-ViT's ``compute_axial_cis``): the layout ``rope2d_axial``
    had before ``vitrel_format`` 5, which a configuration written then gets on loading (:meth:`legacy_options`),
    so its weights compute what they computed when trained.
    """

    _divisor = 4
    no_weight_decay_keys = ("string",)

    def __init__(self, *, order: str = "rows_first", **kw) -> None:
        if order not in AXIAL_ORDERS:
            raise ValueError(f"rope2d_axial: order must be one of {AXIAL_ORDERS}, got {order!r}")
        self.order = order  # before the options' __init__ makes the built grid's tables
        super().__init__(**kw)

    @classmethod
    def legacy_options(cls, options: dict[str, Any], written_format: int = 1) -> dict[str, Any]:
        """Before format 5 ``rope2d_axial`` put the columns first."""
        return options if written_format >= 5 else {"order": "columns_first", **options}

    def angles(self, grid: Grid, draw: Tensor | None = None) -> Tensor:
        rc = self.patch_rc(grid, draw)
        if self.scaling is None:
            theta = rope2d_axial_angles(grid, self.head_dim, self.base, rc=rc)
        else:
            r, c = rc
            half = self.head_dim // 2  # each axis's rotary width: omega_t = base^(-2t / half)
            omega_r, omega_c = (self.axis_omega(a, half, grid, torch.float64) for a in (0, 1))
            theta = torch.cat((r[:, None] * omega_r, c[:, None] * omega_c), dim=-1)
        if self.order == "columns_first":
            q = theta.shape[-1] // 2
            theta = torch.cat((theta[:, q:], theta[:, :q]), dim=-1)
        return theta

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.order == "rows_first" else f", order={self.order}")


@register_pos("rope2d_mixed")
class Rope2dMixed(Rope2dOptions):
    """RoPE-Mixed: learned per-head frequencies ``theta_{h,t} = f^x_{h,t} col + f^y_{h,t} row``.

    ``freqs`` (``[2, heads, d/2]``) is a parameter without weight decay; ``cos/sin`` are recomputed
    on every call because the frequencies change during training (options: ``coords``,
    ``shift``/``jitter``/``rescale``, ``basis``; see the module docstring).
    """

    _divisor = 4
    no_weight_decay_keys = ("freqs", "string")

    per_head = True

    def __init__(self, *, base: float = 10.0, rotate: bool = True, **kw) -> None:
        super().__init__(**kw)
        self._set_base(base)
        self.rotate_init = bool(rotate)
        self.freqs = nn.Parameter(init_mixed_freqs(self.num_heads, self.head_dim, self.base, self.rotate_init))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freqs.copy_(init_mixed_freqs(self.num_heads, self.head_dim, self.base, self.rotate_init))

    def coords_on(self) -> tuple[torch.device | None, torch.dtype]:
        return self.freqs.device, torch.promote_types(self.freqs.dtype, torch.float32)

    def cos_sin(
        self, grid: Grid, num_prefix_tokens: int = 0, device=None, dtype=None, draw=None
    ) -> tuple[Tensor, Tensor]:
        """``cos/sin`` of ``[heads, P + H*W, d/2]`` (prefix rows ``cos = 1, sin = 0``), on the
        frequencies' device, in at least float32 (the device / dtype arguments of the protocol are
        not used: the frequencies decide)."""
        rc = self.patch_rc(grid, draw)
        theta = rope2d_mixed_angles(self.scaled_freqs(self.freqs, grid), grid, rc)
        return self._cos_sin_of(F.pad(theta, (0, 0, num_prefix_tokens, 0)), grid)

    def scaled_freqs(self, freqs: Tensor, grid: Grid) -> Tensor:
        """``freqs [2, ..., d/2]`` (columns, rows) as ``scaling`` sets them for a call on ``grid``
        (see :mod:`vitrel.pos.rope_scaling`); the frequencies themselves without ``scaling``."""
        if self.scaling is None:
            return freqs
        fr, fc = self.scaling_factors(grid)
        half = self.head_dim // 2
        col = scale_learned(self.scaling, freqs[0], half, self.base, fc, self.ref.w, grid.w)
        row = scale_learned(self.scaling, freqs[1], half, self.base, fr, self.ref.h, grid.h)
        return torch.stack((col, row), dim=0)

    def _cos_sin_of(self, theta: Tensor, grid: Grid) -> tuple[Tensor, Tensor]:
        m = self.attention_factor(grid)
        return (theta.cos(), theta.sin()) if m == 1.0 else (theta.cos() * m, theta.sin() * m)

    @classmethod
    def prepare_many(
        cls, schemes: Sequence[PositionScheme], grid: Any, num_prefix_tokens=0, device=None, dtype=None, kernel=None
    ) -> list[PosState]:
        """Every block's ``cos/sin`` (and STRING basis) in one product, as RoPE-ViT computes ``freqs_cis`` for
        all blocks at once: the same values as each scheme's ``prepare``. Schemes that differ in options or
        sizes, or on token layouts, are prepared one by one (one augmentation draw for all: :meth:`draw`)."""
        first = schemes[0] if schemes else None
        together = (
            not isinstance(grid, TokenLayout)
            and len(schemes) > 1
            and all(
                type(s) is cls
                and (s.coords, s.basis_kind, s.scaling, s.base, s.grid, s.freqs.shape, s.freqs.dtype, s.freqs.device)
                == (
                    first.coords,
                    first.basis_kind,
                    first.scaling,
                    first.base,
                    first.grid,
                    first.freqs.shape,
                    first.freqs.dtype,
                    first.freqs.device,
                )
                for s in schemes
            )
        )
        if not together:
            return super().prepare_many(schemes, grid, num_prefix_tokens, device, dtype, kernel)
        grid, p, layers = as_grid(grid), num_prefix_tokens, len(schemes)
        first.check_kernel(kernel)  # (says why a kernel cannot run the scheme)
        f = torch.stack([s.freqs for s in schemes], dim=1).flatten(1, 2)  # [2, L * heads, d/2]
        rc = first.patch_rc(grid)  # (one augmentation draw for every block)
        theta = F.pad(rope2d_mixed_angles(first.scaled_freqs(f, grid), grid, rc), (0, 0, p, 0))
        cos, sin = (t.unflatten(0, (layers, -1)).unbind(0) for t in first._cos_sin_of(theta, grid))
        if first.string is None:
            ropes = list(zip(cos, sin))
        else:
            basis = string_basis(torch.cat([s.string for s in schemes]), first.basis_kind).unflatten(0, (layers, -1))
            ropes = list(zip(cos, sin, basis.unbind(0)))
        return [
            PosState(s, grid, p, rope=r, kernel=kernel, **s.kernel_inputs(kernel, grid, p))
            for s, r in zip(schemes, ropes)
        ]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}{_scaling_repr(self.scaling)}"
