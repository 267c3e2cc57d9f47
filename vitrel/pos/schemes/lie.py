"""Rotations from learned Lie-algebra generators: LieRE (Ostmeier et al., ICML 2025, code StanfordMIMI/LieRE
``models/rope_vit.py``) and ComRoPE (Yu et al., CVPR 2025, code Longin-Yu/ComRoPE ``model.py``).

Each token at position ``x = (x_row, x_col)`` rotates its query and key by ``R(x) = exp(sum_a x_a A_a)``,
with ``A_a`` skew-symmetric and block-diagonal (``d / b`` blocks of ``b x b``, ``b = block_size``), one
set per head, so that ``R(x)`` is block-diagonal and orthogonal::

    q~_i = R(x_i) q_i,   k~_j = R(x_j) k_j,   A_ij = q~_i . k~_j / sqrt(d) = q_i . R(x_i)^T R(x_j) k_j / sqrt(d)

``R(x_i)^T R(x_j) = R(x_j - x_i)`` (the logit depends on the offset only) exactly when the generators
of every block commute (ComRoPE's RoPE equation). The generators, per head and block:

* ``liere``: a free generator per axis: more expressive, but for ``b > 2`` the ``A_a`` do not commute, so
  LieRE is then relative only approximately (the translation test measures the violation,
  ``tests/pos/test_lie.py``); with ``b = 2`` all ``2 x 2`` skew-symmetric matrices commute and LieRE is exactly
  relative (a learned 2-D RoPE: the LieRE authors' ``rope_mixed`` baseline). ``init: uniform_triu`` (the LieRE
  authors' code, ``LierePositionEncoder``): ``A_a = U_a - U_a^T`` with ``U_a`` the strict upper triangle of ``F_a
  ~ U[0, 2 pi)``; ``init: normal`` (the LieRE baseline of the ComRoPE code, ``LieREAttention``): ``A_a = F_a -
  F_a^T``, ``F_a ~ N(0, init_std)``.
* ``comrope`` ``variant: ld`` (linearly dependent): ``A_a = theta_{a, j} (F - F^T)`` per block ``j``, one
  matrix per head and block scaled per axis (``F ~ N(0, init_std)``, ``theta ~ N(0, 1)``, as the ComRoPE code):
  the generators of a block are multiples of one matrix, so they commute: exactly relative.
* ``comrope`` ``variant: ap`` (axis-partitioned): block ``j`` belongs to axis ``j mod 2`` (round
  robin), ``A_a`` is ``F_j - F_j^T`` on the blocks of axis ``a`` and zero elsewhere: generators act on
  disjoint blocks, so they commute: exactly relative. Needs ``d / 2`` divisible by ``b``.

Positions (``coords``), for patch ``(r, c)`` of an ``H x W`` grid on a scheme built for ``H0 x W0``:

* ``linspace`` (the LieRE authors' ``PositionEncoderBase.forward``): ``torch.linspace(0, H / H0, H)[r]`` per axis:
  ``0 .. 1`` at the built grid, past 1 at a larger one (the positions extrapolate, about one step per patch);
* ``linspace_unit``: ``torch.linspace(0, 1, H)[r]`` per axis, ``0 .. 1`` at every grid (a larger grid interpolates;
  ``linspace`` at the built grid): the LieRE code's ``scale_0_to_1`` branch, which it leaves off;
* ``normalized`` (the ComRoPE code's ``get_positions`` with ``axis_scale``): ``((r + 0.5) / H, (c + 0.5) / W)``,
  in ``(0, 1)`` at every grid (a larger grid interpolates);
* ``index``: ``(r, c)``.

Prefix (class/register) tokens sit at ``(cls_position, cls_position)`` (the ComRoPE code's default ``0.5``: the
image centre, rotated like a patch there) or, with ``cls_position: null``, stay unrotated (``R = I``: the LieRE
authors' code, and vitrel's convention for the other rotary schemes).

**Presets** (``liere``'s ``preset``; an option set explicitly wins over its preset):

* ``liere_authors`` (the default): the LieRE authors' code (StanfordMIMI/LieRE ``models/rope_vit.py`` at
  ``b27b41b``, ``phase_type="naver"``, ``rotary_embedding_per_head``): ``block_size: head`` (one generator over
  the whole head: their ``generator_dim`` 64, ``ModelArgs``' default and ``lightning_cifar100.sh``'s, with 64-channel
  heads; their ``lightning_imagenet.sh`` sets 8: ``block_size: 8``), ``init: uniform_triu``, ``coords: linspace``,
  ``cls_position: null``.
* ``comrope_baseline``: the LieRE baseline of the ComRoPE code (Longin-Yu/ComRoPE ``model.py`` at ``7aeef08``,
  ``LieREAttention``), vitrel's ``liere`` before ``vitrel_format`` 4: ``block_size: 2``, ``init: normal``,
  ``coords: normalized``, ``cls_position: 0.5``. Configurations and checkpoints written before keep it
  (:meth:`Liere.legacy_options`).

``comrope`` has no presets: its defaults are the ComRoPE code's (``block_size`` 2, ``coords: normalized``,
``cls_position`` 0.5).

Differences from the authors' code, none in the forward values: the ComRoPE code's LieRE and ComRoPE store ``F``
multiplied by ``scale_factor`` and divide it back (a learning-rate scaling of the generators; its default
``1e100`` overflows float32, so their runs must have set it: it is not reproduced); both codes build the full
``d x d`` (ComRoPE) or ``generator_dim``-square (LieRE) matrices per token and multiply, here the ``b x b`` blocks
are applied directly (and, for ``b = 2``, as the plane rotations they are: RoPE's ``cos`` / ``sin``); the LieRE
code's ``triu(F, 1) - 0.5`` subtracts a constant matrix, which cancels in ``U - U^T``. The LieRE
authors' configurations set ``rotary_embedding_per_layer``, but their ``Transformer.forward`` (``models/vit.py``
lines 106-121) replaces the transforms by layer 0's at the first block and so gives every block layer 0's
rotations: in effect one scheme shared by all blocks (vitrel's model option ``pos_share=True``; vitrel's default
gives each block its own). The rotations are computed once per forward and grid (``prepare``), as ``[heads, N,
d / b, b, b]``.

Stored shapes: ``liere``'s ``generator`` ``[heads, 2, (d / b) b b]``, ``comrope``'s ``[heads, (d / b) b b]`` and its
``multiplier`` ``[2, d / b]``: no 4-D or 5-D parameters, which ``model.to(memory_format=torch.channels_last)``
would convert (and refuse, 5-D). Weights stored in the earlier shapes, ``[heads, 2 or 1, d / b, b, b]`` and ``[1, 2,
d / b, 1, 1]``, load as they are (:meth:`_LieRotation._load_from_state_dict`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, as_grid, patch_coords
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.reference import ReferenceGrid
from vitrel.pos.registry import register_pos
from vitrel.pos.rotation import apply_rope
from vitrel.pos.schemes.rope import check_qk

__all__ = ["Liere", "Comrope", "LIERE_PRESETS", "lie_positions", "block_rotations", "apply_block_rotation"]

COORDS = ("linspace", "linspace_unit", "normalized", "index")

#: ``liere``'s presets (see the module docstring): the options each one sets
LIERE_PRESETS: dict[str, dict[str, Any]] = {
    # StanfordMIMI/LieRE models/rope_vit.py (b27b41b): LierePositionEncoder with phase_type "naver"
    "liere_authors": {"block_size": "head", "init": "uniform_triu", "coords": "linspace", "cls_position": None},
    # Longin-Yu/ComRoPE model.py (7aeef08): LieREAttention, get_positions (vitrel's liere before vitrel_format 4)
    "comrope_baseline": {"block_size": 2, "init": "normal", "coords": "normalized", "cls_position": 0.5},
}
#: an option left to ``liere``'s preset (the default of the options a preset sets)
PRESET = "preset"
INITS = ("uniform_triu", "normal")


def lie_positions(
    grid: Grid,
    num_prefix_tokens: int,
    coords: str,
    cls_position: float | None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    built: Grid | None = None,
) -> Tensor:
    """Positions ``[P + H*W, 2]`` (row, column) of the tokens (see the module docstring); ``built``: the grid the
    scheme was built for (``coords: linspace``)."""
    r, c = patch_coords(grid, device)
    xy = torch.stack((r, c), dim=-1).to(dtype)
    if coords == "normalized":
        xy = (xy + 0.5) / torch.tensor([grid.h, grid.w], dtype=dtype, device=device)
    elif coords == "linspace":  # torch.linspace(0, n / n0, n)[i] = i * (n / n0) / (n - 1) per axis, 0 for n = 1
        if built is None:
            raise ValueError("coords 'linspace' needs the grid the scheme was built for")
        step = [n / n0 / max(n - 1, 1) for n, n0 in ((grid.h, built.h), (grid.w, built.w))]
        xy = xy * torch.tensor(step, dtype=dtype, device=device)
    elif coords == "linspace_unit":  # torch.linspace(0, 1, n)[i] per axis
        xy = xy * torch.tensor([1 / max(n - 1, 1) for n in (grid.h, grid.w)], dtype=dtype, device=device)
    prefix = torch.full((num_prefix_tokens, 2), 0.0 if cls_position is None else float(cls_position), dtype=dtype)
    return torch.cat((prefix.to(device), xy), dim=0)


def block_rotations(generators: Tensor, positions: Tensor) -> Tensor:
    """``exp(sum_a x_a A_a)`` per head, token and block: ``generators [heads, axes, m, b, b]`` and
    ``positions [N, axes]`` -> ``[heads, N, m, b, b]``."""
    log = _position_sum(positions.to(generators.dtype), generators)
    if torch.compiler.is_exporting():  # an exported program may go to ONNX, which has no matrix exponential
        return expm_squaring(log)
    return torch.linalg.matrix_exp(log.contiguous())


def expm_squaring(a: Tensor, squarings: int = 20, degree: int = 12) -> Tensor:
    """``exp(a)`` for ``a [..., b, b]`` from matrix products only (ONNX has no matrix exponential), in float64:
    scaling (each matrix by ``2^-s``, ``s`` from its infinity norm, to norm <= 1/2), Taylor's series to
    ``degree``, then ``s`` squarings of each (a fixed ``squarings`` loop, masked: no data-dependent control flow;
    norms above ``2^(squarings - 1)`` lose accuracy)."""
    x = a.double()
    norm = x.abs().sum(-1).amax(-1)
    s = torch.ceil(torch.log2(norm.clamp_min(1e-300) * 2.0)).clamp(0, squarings)
    x = x * torch.exp2(-s)[..., None, None]
    eye = torch.eye(a.shape[-1], dtype=x.dtype, device=x.device).expand_as(x)
    r = eye
    for k in range(degree, 0, -1):  # Horner: I + x (I + x/2 (I + x/3 (...)))
        r = eye + (x @ r) / k
    for i in range(squarings):
        r = torch.where((s > i)[..., None, None], r @ r, r)
    return r.to(a.dtype)


def _position_sum(positions: Tensor, per_axis: Tensor) -> Tensor:
    """``sum_a x_a G_a`` per head and token: ``positions [N, axes]``, ``per_axis [heads, axes, *rest]`` -> ``[heads,
    N, *rest]``, as elementwise products (autocast would run a matmul / einsum in bf16: angles of several radians,
    and a bf16 matrix exponential, NaN)."""
    rest = (1,) * (per_axis.dim() - 2)
    terms = [positions[:, a].reshape(1, -1, *rest) * per_axis[:, a].unsqueeze(1) for a in range(per_axis.shape[1])]
    return torch.stack(terms).sum(0)


def apply_block_rotation(x: Tensor, rot: Tensor) -> Tensor:
    """``x [B, heads, N, d]`` with each block of ``b`` channels multiplied by ``rot [heads, N, d/b, b, b]``."""
    m, b = rot.shape[-3], rot.shape[-1]
    xb, r = x.unflatten(-1, (m, b)), rot.to(x.dtype)
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        # as row vectors, x^T R^T: [B, heads, N, d/b, 1, b] @ [(B,) heads, N, d/b, b, b]. The einsum below traces a
        # guard ``B != 1`` into exported programs (dynamic batch); eagerly it is about twice as fast on CPU
        return torch.matmul(xb.unsqueeze(-2), r.transpose(-1, -2)).flatten(-3)
    if rot.dim() == 6:  # [B, heads, N, d/b, b, b]: per row (a token layout)
        return torch.einsum("zhnmij,zhnmj->zhnmi", r, xb).flatten(-2)
    return torch.einsum("hnmij,zhnmj->zhnmi", r, xb).flatten(-2)


class _LieRotation(ReferenceGrid, PositionScheme):
    """Shared by LieRE and ComRoPE: positions, the block rotations (``prepare``) and ``rotate``."""

    family = "rotary"
    has_rotation = True
    standard_rotation = True  # (rotate() applies state.rope as the fused rotation does)
    no_weight_decay_keys = ("generator", "multiplier")

    def __init__(
        self,
        *,
        block_size: int | str = 2,
        init_std: float = 1.0,
        coords: str = "normalized",
        cls_position: float | None = 0.5,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if block_size == "head":
            block_size = self.head_dim
        if not isinstance(block_size, int) or block_size < 2 or self.head_dim % block_size:
            raise ValueError(
                f"{self.name}: block_size must be an integer >= 2 that divides the head dim ({self.head_dim}) "
                f"or 'head' (the whole head), got block_size={block_size!r}"
            )
        if coords not in COORDS:
            raise ValueError(f"{self.name}: coords must be one of {COORDS}, got {coords!r}")
        if not init_std > 0:
            raise ValueError(f"{self.name}: init_std must be > 0, got {init_std}")
        if cls_position is not None and not (
            isinstance(cls_position, (int, float))
            and not isinstance(cls_position, bool)
            and math.isfinite(cls_position)
        ):
            raise ValueError(
                f"{self.name}: cls_position must be a finite number (the prefix tokens' position on both axes) or "
                f"null (prefix tokens unrotated), got {cls_position!r}"
            )
        self.block_size, self.num_blocks = block_size, self.head_dim // block_size
        self.init_std, self.coords = float(init_std), coords
        self.cls_position = None if cls_position is None else float(cls_position)
        self.init_reference(coords == "linspace")  # positions 0 .. 1 at the training grid

    @property
    def depends_on_extent(self) -> bool:  # type: ignore[override]
        return self.coords != "index"

    @property
    def depends_on_built_grid(self) -> bool:
        """The positions depend on the grid the scheme was built for (``coords: linspace``, ``0 .. 1`` there): the
        same weights built for another grid give other logits at a given grid, as the LieRE authors' model built
        for another image size, unless loaded with their ``ref_grid`` (:mod:`vitrel.pos.reference`)."""
        return self.coords == "linspace"

    def generators(self) -> Tensor:  # pragma: no cover - overridden
        """The skew-symmetric generators ``[heads, 2, d / b, b, b]`` (row axis first)."""
        raise NotImplementedError

    def _blocks(self, t: Tensor, axes: int) -> Tensor:
        """A stored ``[heads, (axes,) m b b]`` parameter as ``[heads, axes, m, b, b]``."""
        return t.reshape(self.num_heads, axes, self.num_blocks, self.block_size, self.block_size)

    def stored_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """``{name: (earlier stored shape, shape now)}`` of the parameters stored in another shape before."""
        raise NotImplementedError  # pragma: no cover - overridden

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        for name, (old, new) in self.stored_shapes().items():
            value = state_dict.get(prefix + name)
            if isinstance(value, Tensor) and tuple(value.shape) == old:  # the same values in the same order
                state_dict[prefix + name] = value.reshape(new)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def positions(self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype) -> Tensor:
        return lie_positions(grid, num_prefix_tokens, self.coords, self.cls_position, device, dtype, self.ref)

    def rotation(
        self, grid: Grid, num_prefix_tokens: int, device: torch.device | None, dtype: torch.dtype | None, draw=None
    ) -> tuple[Tensor, ...]:
        """``(R,)``, ``R [heads, P + H*W, d / b, b, b]``, in at least float32 (the generators' dtype if wider).

        With ``b = 2`` every block is a plane rotation, ``exp([[0, -t], [t, 0]]) = [[cos t, -sin t], [sin t,
        cos t]]`` with ``t = sum_a x_a A_a[1, 0]``: then ``(cos, sin)`` of ``[heads, P + H*W, d / 2]``, applied
        as RoPE is (the same values, no matrix exponential)."""
        a = self.generators()
        work = torch.promote_types(a.dtype, torch.float32)
        pos = self.positions(as_grid(grid), num_prefix_tokens, a.device, work)
        if self.block_size == 2:
            theta = _position_sum(pos, a[..., 1, 0].to(work))
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
    """LieRE: a free skew-symmetric generator per head, axis and block; relative only approximately (the
    generators need not commute; see the module docstring).

    Args:
        preset: ``liere_authors`` (default: the LieRE authors' code, StanfordMIMI/LieRE) or ``comrope_baseline``
            (the LieRE baseline of the ComRoPE code, vitrel's ``liere`` before ``vitrel_format`` 4): the values of
            the four options below left at ``"preset"`` (:data:`LIERE_PRESETS`).
        block_size: ``b``, an integer dividing the head dim, or ``"head"`` (one generator over the whole head).
        init: ``uniform_triu`` (``A = U - U^T``, ``U`` the strict upper triangle of ``F ~ U[0, 2 pi)``: the LieRE
            authors') or ``normal`` (``A = F - F^T``, ``F ~ N(0, init_std)``: the ComRoPE code's LieRE).
        coords: ``linspace``, ``normalized`` or ``index`` (the module docstring).
        cls_position: prefix tokens at ``(x, x)``, or None: unrotated.
        init_std: the standard deviation of ``init: normal``.
    """

    @property
    def exactly_relative(self) -> bool:  # type: ignore[override]
        """Only with 2 x 2 blocks (``so(2)`` is abelian: LieRE is then a learned 2-D RoPE); larger blocks
        do not commute and the logits depend on the offset only approximately."""
        return self.block_size == 2

    def __init__(
        self,
        *,
        preset: str = "liere_authors",
        block_size: int | str = PRESET,
        init: str = PRESET,
        coords: str = PRESET,
        cls_position: float | None | str = PRESET,
        **kw: Any,
    ) -> None:
        if preset not in LIERE_PRESETS:
            raise ValueError(f"liere: preset must be one of {tuple(LIERE_PRESETS)}, got {preset!r}")
        given = dict(block_size=block_size, init=init, coords=coords, cls_position=cls_position)
        opts = {k: LIERE_PRESETS[preset][k] if v == PRESET else v for k, v in given.items()}
        init = opts.pop("init")
        if init not in INITS:
            raise ValueError(f"liere: init must be one of {INITS}, got {init!r}")
        if init != "normal" and kw.get("init_std", 1.0) != 1.0:  # (1.0: the default, which conf/pos/liere.yaml sets)
            raise ValueError(
                f"liere: init_std ({kw['init_std']}) is the spread of init: normal; this one initialises {init} "
                f"(preset {preset}): set init: normal too, or leave init_std"
            )
        super().__init__(**opts, **kw)
        self.preset, self.init = preset, init
        shape = (self.num_heads, 2, self.num_blocks * self.block_size**2)  # [heads, axes, m b b]: see stored_shapes
        if init == "normal":
            self.generator = nn.Parameter(torch.randn(shape) * self.init_std)
        else:  # the LieRE authors': torch.rand(...) * 2 pi, of which the strict upper triangle is used
            self.generator = nn.Parameter(torch.rand(shape) * (2 * math.pi))

    @classmethod
    def legacy_options(cls, options: dict[str, Any], written_format: int = 1) -> dict[str, Any]:
        """Before format 4, ``liere`` was the LieRE baseline of the ComRoPE code: a stored spec keeps it. Before
        format 6, ``init_std`` beside an init other than ``normal`` was ignored (refused since): a stored spec drops
        it (it only ever set the initialisation, which the stored weights replace)."""
        out = dict(options)
        if written_format < 4:
            out["preset"] = out.get("preset", "comrope_baseline")
        if written_format < 6:
            init = out.get("init", PRESET)
            if init == PRESET:
                init = LIERE_PRESETS.get(out.get("preset", "liere_authors"), {}).get("init")
            if init != "normal":
                out.pop("init_std", None)
        return out

    def stored_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        h, m, b = self.num_heads, self.num_blocks, self.block_size
        return {"generator": ((h, 2, m, b, b), (h, 2, m * b * b))}

    def generators(self) -> Tensor:
        f = self._blocks(self.generator, 2)
        if self.init == "normal":
            return _skew(f)
        return _skew(torch.triu(f, diagonal=1))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, preset={self.preset}, init={self.init}"


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
        # [heads, m b b] and [axes, m]: see stored_shapes
        self.generator = nn.Parameter(torch.randn(self.num_heads, m * b * b) * self.init_std)
        if variant == "ld":
            self.multiplier = nn.Parameter(torch.randn(2, m))

    def stored_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        h, m, b = self.num_heads, self.num_blocks, self.block_size
        return {"generator": ((h, 1, m, b, b), (h, m * b * b)), "multiplier": ((1, 2, m, 1, 1), (2, m))}

    def generators(self) -> Tensor:
        s = _skew(self._blocks(self.generator, 1))  # [heads, 1, m, b, b]
        if self.variant == "ld":
            return s * self.multiplier.reshape(1, 2, self.num_blocks, 1, 1)
        blocks = torch.arange(self.num_blocks, device=s.device)
        mask = blocks[None, :] % 2 == torch.arange(2, device=s.device)[:, None]  # block j serves axis j mod 2
        return s * mask.to(s.dtype)[None, :, :, None, None]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variant={self.variant}"
