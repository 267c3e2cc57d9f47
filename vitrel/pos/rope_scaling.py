"""RoPE context extension for a grid larger than the one a model was built (trained) for.

The ``scaling`` option of ``rope1d``, ``rope2d_axial`` and ``rope2d_mixed`` (and of the video schemes
``rope3d_axial`` / ``rope3d_mixed``, per axis ``t, h, w``: ``factor: [t, h, w]``) takes Hugging Face's
``rope_scaling`` vocabulary (``transformers.modeling_rope_utils``), applied per axis, with the
*original extent* of an axis the built grid's (rows: its height, columns: its width; ``rope1d``:
its number of patches ``H*W``, the raster index's range)::

    scaling: {rope_type: yarn, factor: 2.0}          # or factor: [f_rows, f_cols], or factor: auto

With ``omega_t = base^(-2t/D)`` the frequencies of one axis (``D`` its rotary width: ``d`` for
``rope1d``, ``d/2`` per axis for the 2-D schemes), ``s`` the axis's factor, ``L`` its original extent
and ``L'`` the call's:

* ``linear`` (position interpolation): ``omega' = omega / s``.
* ``ntk`` (static NTK-aware scaling, FiT's VisionNTK): ``base' = base * s^(D / (D - 2))``.
* ``dynamic`` (dynamic NTK, HF's ``dynamic``): ``base' = base * (s L'/L - (s - 1))^(D / (D - 2))`` when
  ``L' > L``, else ``base``: recomputed for every call's extent.
* ``yarn`` (YaRN, Peng et al. 2023, HF's ``_compute_yarn_parameters``): per frequency, a ramp between
  interpolation (``omega / s``) and extrapolation (``omega``) over the pair indices between the
  correction dimensions of ``beta_fast`` (default 32) and ``beta_slow`` (default 1) rotations over
  ``L``, ``i(r) = D ln(L / (2 pi r)) / (2 ln base)``, rounded outwards to whole dimensions
  (``truncate: true``, the reference default; ``false`` keeps the continuous ramp); and an attention
  factor ``m`` (default ``0.1 ln(s) + 1``, 1 for ``s <= 1``) that multiplies ``cos`` and ``sin`` of
  every token (prefix tokens too), so every logit is multiplied by ``m^2`` (YaRN's ``1 / t``).

``factor`` is a number (every axis), a pair ``[rows, cols]`` for the 2-D schemes (FiT's decoupled
form), or ``auto``: ``max(1, L' / L)`` per axis, from the call's grid (``linear``, ``ntk``,
``yarn``), or ``grid`` (``linear`` only): ``L' / L`` at every call, smaller grids too, so the positions of any grid
span the reference's extent (EVA's rule, timm's ``ref_feat_shape``: ``i L / L'``). ``dynamic`` takes a number (it
scales with ``L'`` by itself). For the 2-D schemes YaRN's default attention factor uses the token-count ratio
``s = s_rows * s_cols`` (what ``s`` is for ``rope1d``'s raster index, whose extent is the number of patches).

``rope2d_mixed`` has learned frequencies, not a geometric sequence, so its scaling acts per
component of ``f = (f^x, f^y)`` (columns, rows): ``linear`` divides it by the axis factor; ``ntk`` /
``dynamic`` multiply the frequency of pair ``t`` by ``a^(-2 t' / (D - 2))`` (``t' = t mod d/4`` its
index in the initial geometric sequence, ``a`` the base factor above), which is exactly NTK's base
change for geometric frequencies; ``yarn`` places each learned component at its fractional pair
index ``i = -D ln|f| / (2 ln base)`` and ramps there (no rounding: ``truncate`` does not apply).

Scaling needs integer coordinates: ``coords: normalized`` (DINOv3) already interpolates, and is
refused with scaling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ROPE_TYPES",
    "RopeScaling",
    "parse_scaling",
    "yarn_mscale",
    "correction_range",
    "yarn_ramp",
    "scale_geometric",
    "scale_learned",
]

ROPE_TYPES = ("linear", "ntk", "dynamic", "yarn")
_KEYS = ("rope_type", "factor", "beta_fast", "beta_slow", "attention_factor", "truncate")


@dataclass(frozen=True)
class RopeScaling:
    """A parsed ``scaling`` option (see the module docstring)."""

    rope_type: str
    factor: tuple[float, ...] | str  # one per axis, or "auto" / "grid"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def factors(self, built: Sequence[int], call: Sequence[int]) -> tuple[float, ...]:
        """The factor of each axis for a call of extents ``call`` on a scheme built for ``built``."""
        if self.factor == "auto":
            return tuple(max(1.0, float(c) / float(b)) for b, c in zip(built, call))
        if self.factor == "grid":
            return tuple(float(c) / float(b) for b, c in zip(built, call))
        return tuple(self.factor)  # type: ignore[arg-type]

    def mscale(self, factors: Sequence[float]) -> float:
        """YaRN's attention factor (1 for the other types): the option, or ``0.1 ln(prod factors) + 1``."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return yarn_mscale(math.prod(factors))


def parse_scaling(scaling: Mapping[str, Any] | None, axes: int, scheme: str) -> RopeScaling | None:
    """Validate a ``scaling`` option (None: no scaling); ``axes`` is 1 (``rope1d``) or 2."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{scheme}: scaling must be a mapping such as {{rope_type: yarn, factor: 2}}, got {scaling!r}")
    unknown = sorted(set(scaling) - set(_KEYS))
    if unknown:
        raise ValueError(f"{scheme}: unknown scaling option(s) {unknown}; known: {list(_KEYS)}")
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{scheme}: scaling.rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    raw = scaling.get("factor")
    if raw == "auto":
        if rope_type == "dynamic":
            raise ValueError(
                f"{scheme}: scaling.factor=auto does not apply to rope_type=dynamic, which follows the call's "
                "extent by itself: give its factor as a number (e.g. 2.0)"
            )
        factor: tuple[float, ...] | str = "auto"
    elif raw == "grid":
        if rope_type != "linear":
            raise ValueError(
                f"{scheme}: scaling.factor=grid (L' / L at every grid, EVA's rule) is position interpolation: "
                f"give rope_type=linear, got {rope_type!r}"
            )
        factor = "grid"
    else:
        vals = list(raw) if isinstance(raw, (list, tuple)) else [raw]
        if len(vals) == 1:
            vals = vals * axes
        if len(vals) != axes:
            raise ValueError(f"{scheme}: scaling.factor takes 1 or {axes} numbers, got {raw!r}")
        if not all(_is_number(v) for v in vals):
            raise ValueError(
                f"{scheme}: scaling.factor must be a number >= 1, a list of them, auto or grid; got {raw!r}"
            )
        factor = tuple(float(v) for v in vals)
        if not all(math.isfinite(f) and f >= 1.0 for f in factor):
            raise ValueError(f"{scheme}: scaling.factor must be >= 1 (a factor below 1 shrinks nothing), got {raw!r}")
    beta_fast = _number(scaling, "beta_fast", 32.0, scheme)
    beta_slow = _number(scaling, "beta_slow", 1.0, scheme)
    if not beta_fast > beta_slow > 0:
        raise ValueError(f"{scheme}: scaling needs beta_fast > beta_slow > 0, got {beta_fast}, {beta_slow}")
    af = scaling.get("attention_factor")
    if af is not None and not (_is_number(af) and af > 0):
        raise ValueError(f"{scheme}: scaling.attention_factor must be a positive number or null, got {af!r}")
    if af is not None and rope_type != "yarn":
        raise ValueError(f"{scheme}: scaling.attention_factor applies to rope_type=yarn only")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):  # a string "false" would be read as True
        raise ValueError(
            f"{scheme}: scaling.truncate must be true or false, got {truncate!r} ({type(truncate).__name__})"
        )
    return RopeScaling(rope_type, factor, beta_fast, beta_slow, None if af is None else float(af), truncate)


def _is_number(v: Any) -> bool:
    """A real number as YAML / JSON gives one (an int or a float; not a bool, not a string of digits)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(scaling: Mapping[str, Any], key: str, default: float, scheme: str) -> float:
    """The option ``key`` of ``scaling`` (``default`` when absent) as a float; a ``ValueError`` naming the key and the
    value for anything but a finite number."""
    v = scaling.get(key, default)
    if not (_is_number(v) and math.isfinite(v)):
        raise ValueError(f"{scheme}: scaling.{key} must be a finite number, got {v!r} ({type(v).__name__})")
    return float(v)


def yarn_mscale(factor: float) -> float:
    """YaRN's attention factor ``0.1 ln(s) + 1`` (1 for ``s <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, original: float, truncate: bool = True
) -> tuple[float, float]:
    """YaRN's pair-index range ``(low, high)`` between the correction dimensions of ``beta_fast`` and
    ``beta_slow`` rotations over ``original`` positions, clamped to ``[0, dim - 1]``."""

    def at(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = at(beta_fast), at(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_ramp(index: Tensor, low: float, high: float) -> Tensor:
    """``clamp((index - low) / (high - low), 0, 1)``: 0 keeps a frequency (extrapolation), 1 divides it by
    the factor (interpolation). ``high == low`` widens the range by 0.001, as the reference does."""
    if high == low:
        high = high + 0.001
    return ((index - low) / (high - low)).clamp(0, 1)


def scale_geometric(
    sc: RopeScaling, dim: int, base: float, factor: float, original: int, extent: int, dtype: torch.dtype
) -> Tensor:
    """The scaled frequencies ``[dim / 2]`` of one axis whose plain ones are ``base^(-2t/dim)``."""
    t = torch.arange(0, dim, 2, dtype=dtype) / dim  # 2t / dim
    omega = base**-t
    if sc.rope_type == "linear":
        return omega / factor
    if sc.rope_type in ("ntk", "dynamic"):
        a = _ntk_base_factor(sc, factor, original, extent)
        return (base * a ** (dim / (dim - 2))) ** -t
    low, high = correction_range(sc.beta_fast, sc.beta_slow, dim, base, original, sc.truncate)
    interp = yarn_ramp(torch.arange(dim // 2, dtype=dtype), low, high)
    return omega / factor * interp + omega * (1 - interp)


def _ntk_base_factor(sc: RopeScaling, factor: float, original: int, extent: int) -> float:
    if sc.rope_type == "dynamic":
        return factor * max(extent, original) / original - (factor - 1)
    return factor


def scale_learned(
    sc: RopeScaling, f: Tensor, dim: int, base: float, factor: float, original: int, extent: int
) -> Tensor:
    """RoPE-Mixed's learned frequencies ``f [..., d/2]`` of one axis, scaled (see the module docstring);
    ``dim`` is the per-axis rotary width ``d/2`` and ``base`` the base of the initial sequence."""
    if sc.rope_type == "linear":
        return f / factor
    quarter = f.shape[-1] // 2
    tp = torch.arange(f.shape[-1], device=f.device, dtype=f.dtype) % quarter  # index in the initial sequence
    if sc.rope_type in ("ntk", "dynamic"):
        a = _ntk_base_factor(sc, factor, original, extent)
        return f * a ** (-2 * tp / (dim - 2))
    low, high = correction_range(sc.beta_fast, sc.beta_slow, dim, base, original, truncate=False)
    index = -dim * torch.log(f.detach().abs().clamp_min(1e-30)) / (2 * math.log(base))
    interp = yarn_ramp(index, low, high)
    return f / factor * interp + f * (1 - interp)
