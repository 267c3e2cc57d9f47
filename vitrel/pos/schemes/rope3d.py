"""Rotary position embeddings on a video's grid of tubelets ``(T, H, W)``: 3-D axial and 3-D mixed RoPE.

Tokens are t-major, ``index = (t * H + h) * W + w`` (:class:`~vitrel.layout.geometry.Grid3`); an image grid
``(H, W)`` is one frame, ``t = 0``. Pairs are vitrel's interleaved ``(2j, 2j+1)``, rotated by ``theta_j`` as in
:mod:`vitrel.pos.schemes.rope`; prefix (class/register) tokens are left unrotated, so the logits between patches
depend on ``(dt, dh, dw)`` alone.

**rope3d_axial.** Pair ``j`` rotates by one axis's coordinate, ``theta_j = x_{a(j)} * omega_j`` (``x = (t, h, w)``):

* ``sections: [st, sh, sw]``: the rotary pairs of each axis. Default V-JEPA 2's split, ``(head_dim // 3) // 2``
  pairs each (its ``RoPEAttention``: ``d_dim = h_dim = w_dim = 2 * ((head_dim // 3) // 2)`` channels); the
  first ``st + sh + sw`` pairs rotate, the remaining channels (at the end of the head) are left unrotated.
* ``layout: sectioned`` (default): contiguous pairs per axis, ``t`` then ``h`` then ``w`` (V-JEPA 2; Qwen2-VL's
  ``mrope_section``). ``interleaved``: pairs dealt ``t, h, w, t, h, w, ...``, an axis skipped once its pairs are
  used up (Qwen3-VL's ``apply_interleaved_mrope``; the same assignment as its code whenever ``st >= sh, sw``, as in
  its ``[24, 20, 20]``; its code would give the time axis more slots than ``st`` otherwise).
* ``freqs: per_axis`` (default): each axis its own series, the ``k``-th of an axis's ``s`` pairs at
  ``omega = base^(-k/s)`` (``rope2d_axial``'s rule; V-JEPA 2's ``rotate_queries_or_keys`` with ``D = 2s``).
  ``shared``: one series over the head, pair ``j`` at ``base^(-2j/head_dim)`` whichever axis it serves (Qwen's
  M-RoPE: ``inv_freq`` over the head, then the slots given to the axes).
* ``base`` (10000), ``scaling``: RoPE context extension per axis (:mod:`vitrel.pos.rope_scaling`, the vocabulary
  of the 2-D schemes; ``factor`` a number or ``[t, h, w]``): an axis's series is scaled as a ``rope1d`` of
  rotary width ``2s`` (``per_axis``) or ``head_dim`` (``shared``, its pairs picked from the scaled series).

How this compares with the authors' code (the tests check the equalities on a video grid):

* V-JEPA 2 (facebookresearch/vjepa2, ``src/models/utils/modules.py``, ``RoPEAttention``): the default sections,
  ``sectioned``, ``per_axis``, integer positions, no prefix tokens. Its released code expands ``cos/sin`` with
  ``repeat(..., 2)``, which gives the two channels of a pair different frequencies (not a rotation); the authors
  document the fix, ``repeat_interleave(2)``, kept off for their checkpoints. vitrel is the fixed form, and its
  pairs are V-JEPA 2's (``stack((-y2, y1))`` on ``(2k, 2k+1)``): equal, no conversion. The released form, which their
  checkpoints need, is ``rope3d_vjepa2`` (:mod:`vitrel.pos.schemes.rope3d_vjepa2`).
* Qwen2-VL / Qwen2.5-VL (``apply_multimodal_rotary_pos_emb``, ``mrope_section``; Hugging Face transformers
  ``modeling_qwen2_vl.py``): ``sectioned``, ``shared``, ``sections`` summing to ``head_dim / 2``. Qwen3-VL
  (``modeling_qwen3_vl.py``): ``interleaved``, ``shared``. Qwen pairs channel ``j`` with ``j + head_dim/2``
  (``rotate_half``) where vitrel pairs ``2j`` with ``2j+1``: equal after that fixed permutation of the channels
  (a permutation of the ``q``/``k`` projections' rows). Qwen's text tokens get one position on all three axes,
  continuing after the vision tokens, and the vision tokens start after the text before them (a shift, which
  the logits between patches ignore); vitrel's prefix tokens are unrotated. Qwen2.5-VL scales ``t`` by
  ``tokens_per_second * second_per_grid_t`` (absolute time); vitrel's ``t`` is the frame index. Qwen's ``base``
  is ``10^6``: set ``base``.

At ``T = 1`` (an image) the time pairs have angle 0, so ``sections: [0, sh, sw]`` with ``per_axis`` rotates rows
by ``sh`` pairs then columns by ``sw``. ``rope2d_axial`` rotates rows then columns, ``d/4`` pairs each:
``sections: [0, d/4, d/4]`` is exactly ``rope2d_axial`` at the same ``base`` (``rope2d_axial``'s default is 100).

**rope3d_mixed.** RoPE-Mixed (Heo et al. 2024, naver-ai/rope-vit) over three axes: learned frequencies per head
and pair, ``theta_{h,j} = f^t_{h,j} t + f^h_{h,j} h + f^w_{h,j} w``, ``freqs [3, heads, d/2]`` (``t``, ``h``,
``w``; a parameter without weight decay). ``f^h``, ``f^w`` start as ``rope2d_mixed``'s (``f^h = f^y``,
``f^w = f^x``: magnitudes ``base^(-4k/d)``, ``k < d/4``, twice, along a random direction per head, the second
quarter turned by ``pi/2``; same draws from the same seed); ``f^t`` starts at those magnitudes, the same for
every head (each pair's frequency vector starts with a time component as large as its spatial one). At ``T = 1``
``f^t`` meets ``t = 0``: the scheme is ``rope2d_mixed`` with the same seed, at any initialisation. Options
``base`` (10), ``rotate``, ``scaling`` (per axis, as ``rope2d_mixed``'s); ``d % 4 == 0``.

``coords: normalized`` and STRING's ``basis`` of the 2-D schemes are not offered in 3-D.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitrel.layout.geometry import Grid3, as_grid3, patch_coords3
from vitrel.pos.registry import register_pos
from vitrel.pos.rope_angles import geometric_freqs, init_mixed_freqs
from vitrel.pos.rope_scaling import scale_learned
from vitrel.pos.schemes.rope import FixedRope, _Rope, _scaling_repr

__all__ = [
    "LAYOUTS",
    "FREQS",
    "Rope3dAxial",
    "Rope3dMixed",
    "default_sections",
    "init_mixed3_freqs",
    "pair_axes",
    "rope3d_mixed_angles",
]

LAYOUTS = ("sectioned", "interleaved")
FREQS = ("per_axis", "shared")


def default_sections(head_dim: int) -> tuple[int, int, int]:
    """V-JEPA 2's split: ``(head_dim // 3) // 2`` rotary pairs for each of ``t``, ``h``, ``w``."""
    s = (head_dim // 3) // 2
    return s, s, s


def pair_axes(sections: Sequence[int], layout: str) -> list[int]:
    """The axis (0: ``t``, 1: ``h``, 2: ``w``) of each rotated pair, ``sum(sections)`` of them (see the module
    docstring: ``sectioned`` in blocks, ``interleaved`` dealt round-robin over the axes with pairs left)."""
    if layout == "sectioned":
        return [a for a, s in enumerate(sections) for _ in range(s)]
    left, out = list(sections), []
    while any(left):
        for a in range(3):
            if left[a]:
                out.append(a)
                left[a] -= 1
    return out


def _check_sections(name: str, sections: Any, head_dim: int) -> tuple[int, int, int]:
    if sections is None:
        sections = default_sections(head_dim)
        if not any(sections):
            raise ValueError(
                f"{name}: head_dim={head_dim} is too small for the default sections ((head_dim // 3) // 2 = 0 pairs "
                "per axis): give sections: [st, sh, sw]"
            )
        return sections
    try:
        vals = list(sections)
    except TypeError:
        vals = None
    if (
        vals is None
        or len(vals) != 3
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals)
    ):
        raise ValueError(f"{name}: sections must be three whole numbers of rotary pairs [st, sh, sw], got {sections!r}")
    if sum(vals) == 0:
        raise ValueError(f"{name}: sections {vals} rotate no pair (pos=none does that)")
    if 2 * sum(vals) > head_dim:
        raise ValueError(
            f"{name}: sections {vals} need {sum(vals)} rotary pairs ({2 * sum(vals)} channels), more than "
            f"head_dim={head_dim} holds ({head_dim // 2} pairs)"
        )
    return vals[0], vals[1], vals[2]


def _coords(grid: Grid3, device: torch.device | None, dtype: torch.dtype) -> Tensor:
    """``[3, T*H*W]``: frame, row and column of each tubelet, t-major."""
    return torch.stack(patch_coords3(grid, device)).to(dtype)


@register_pos("rope3d_axial")
class Rope3dAxial(FixedRope):
    """3-D axial RoPE: ``sections`` pairs per axis ``t, h, w``, ``layout`` ``sectioned | interleaved``, ``freqs``
    ``per_axis | shared`` (see the module docstring)."""

    grid_dims = 3
    _axes = 3
    _divisor = 2

    def __init__(
        self,
        *,
        sections: Sequence[int] | None = None,
        layout: str = "sectioned",
        freqs: str = "per_axis",
        base: float = 10000.0,
        **kw,
    ) -> None:
        super().__init__(base=base, **kw)  # (its buffers wait for the options: see _init_buffers)
        if layout not in LAYOUTS:
            raise ValueError(f"{self.name}: layout must be one of {LAYOUTS}, got {layout!r}")
        if freqs not in FREQS:
            raise ValueError(f"{self.name}: freqs must be one of {FREQS}, got {freqs!r}")
        self.sections = _check_sections(self.name, sections, self.head_dim)
        self.pair_layout, self.freq_rule = layout, freqs  # (the options layout and freqs)
        self.axes = pair_axes(self.sections, layout)
        self.init_non_persistent_buffers()

    def _init_buffers(self) -> None:
        if "axes" in self.__dict__:  # (FixedRope's __init__ calls this before the options are read)
            super()._init_buffers()

    def pair_omega(self, grid: Grid3, dtype: torch.dtype = torch.float64) -> Tensor:
        """``omega_j`` of each rotated pair ``[st + sh + sw]`` for a call on ``grid`` (``scaling`` applied)."""
        out = torch.zeros(len(self.axes), dtype=dtype)
        for a in range(3):
            pairs = [j for j, axis in enumerate(self.axes) if axis == a]  # (python ints: no data-dependent shapes)
            if not pairs:
                continue
            idx = torch.tensor(pairs)
            if self.freq_rule == "per_axis":  # k-th of the axis's s pairs at base^(-2k / 2s)
                out[idx] = self._series(a, 2 * len(pairs), grid, dtype)
            else:  # one series over the head: pair j at base^(-2j / d)
                out[idx] = self._series(a, self.head_dim, grid, dtype)[idx]
        return out

    def _series(self, axis: int, dim: int, grid: Grid3, dtype: torch.dtype) -> Tensor:
        if dim == 2 and self.scaling is not None and self.scaling.rope_type in ("ntk", "dynamic"):
            return torch.ones(1, dtype=dtype)  # NTK's base change leaves base^0 = 1 (its exponent d/(d-2) is 0/0)
        return self.axis_omega(axis, dim, grid, dtype)

    def angles(self, grid: Any, draw: Tensor | None = None) -> Tensor:
        """``theta [T*H*W, d/2]``: pair ``j < st + sh + sw`` at ``x_{a(j)} omega_j``, the other pairs 0."""
        grid = as_grid3(grid)
        x = _coords(grid, None, torch.float64)[torch.tensor(self.axes)]  # [R, N]
        theta = x.T * self.pair_omega(grid)[None, :]
        return F.pad(theta, (0, self.head_dim // 2 - len(self.axes)))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, sections={list(self.sections)}, layout={self.pair_layout}, freqs={self.freq_rule}"
        )


def init_mixed3_freqs(
    num_heads: int, head_dim: int, base: float = 10.0, rotate: bool = True, generator: torch.Generator | None = None
) -> Tensor:
    """RoPE-Mixed's initial frequencies over ``(t, h, w)``: ``[3, heads, d/2]``, ``f^h`` and ``f^w``
    :func:`~vitrel.pos.rope_angles.init_mixed_freqs`'s rows and columns (the same draws), ``f^t`` their magnitudes
    ``base^(-4k/d)`` (``k < d/4``, twice) for every head."""
    fx, fy = init_mixed_freqs(num_heads, head_dim, base, rotate, generator)
    mag = geometric_freqs(base, head_dim, 4, None, torch.float64).repeat(2)
    ft = mag.float()[None, :].expand(num_heads, -1)
    return torch.stack((ft, fy, fx), dim=0)


def rope3d_mixed_angles(freqs: Tensor, grid: Any) -> Tensor:
    """``theta[h, n, j] = f[0, h, j] t_n + f[1, h, j] h_n + f[2, h, j] w_n``: ``[heads, T*H*W, d/2]``, in at least
    float32 (the frequencies' dtype if wider), differentiable in ``freqs`` (``[3, heads, d/2]``)."""
    dtype = torch.promote_types(freqs.dtype, torch.float32)
    x = _coords(as_grid3(grid), freqs.device, dtype)
    f = freqs.to(dtype)
    # elementwise outer products (autocast would downcast a matmul)
    return sum(x[a][None, :, None] * f[a][:, None, :] for a in range(3))


@register_pos("rope3d_mixed")
class Rope3dMixed(_Rope):
    """RoPE-Mixed over ``(t, h, w)``: learned per-head frequencies ``freqs [3, heads, d/2]`` (see the module
    docstring); ``cos/sin`` recomputed on every call."""

    grid_dims = 3
    _axes = 3
    _divisor = 4
    no_weight_decay_keys = ("freqs",)
    per_head = True

    def __init__(self, *, base: float = 10.0, rotate: bool = True, **kw) -> None:
        super().__init__(**kw)
        self._set_base(base)
        self.rotate_init = bool(rotate)
        self.freqs = nn.Parameter(init_mixed3_freqs(self.num_heads, self.head_dim, self.base, self.rotate_init))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freqs.copy_(init_mixed3_freqs(self.num_heads, self.head_dim, self.base, self.rotate_init))

    def scaled_freqs(self, freqs: Tensor, grid: Grid3) -> Tensor:
        """``freqs [3, ..., d/2]`` as ``scaling`` sets them for a call on ``grid``, per axis (as ``rope2d_mixed``)."""
        if self.scaling is None:
            return freqs
        factors, half = self.scaling_factors(grid), self.head_dim // 2
        return torch.stack(
            [
                scale_learned(self.scaling, freqs[a], half, self.base, factors[a], self.ref[a], grid[a])
                for a in range(3)
            ],
            dim=0,
        )

    def cos_sin(self, grid: Any, num_prefix_tokens: int = 0, *_: Any) -> tuple[Tensor, Tensor]:
        """``cos/sin`` of ``[heads, P + T*H*W, d/2]`` (prefix rows ``cos = 1, sin = 0``), on the frequencies' device,
        in at least float32 (the protocol's device / dtype arguments are not used: the frequencies decide)."""
        grid = as_grid3(grid)
        theta = F.pad(rope3d_mixed_angles(self.scaled_freqs(self.freqs, grid), grid), (0, 0, num_prefix_tokens, 0))
        m = self.attention_factor(grid)
        return (theta.cos(), theta.sin()) if m == 1.0 else (theta.cos() * m, theta.sin() * m)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}{_scaling_repr(self.scaling)}"
