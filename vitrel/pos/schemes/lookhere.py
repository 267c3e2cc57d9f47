"""LookHere (Fuller et al., NeurIPS 2024): heads look in fixed directions, with a distance penalty.

Every head ``h`` sees only the keys inside its field of view (a direction-dependent 2-D mask) and
pays a linear penalty for Euclidean distance; prefix (class/register) tokens are unrestricted. With
``d_ij = (dh, dw) = (row_i - row_j, col_i - col_j)`` (query minus key)::

    A_ij = q_i . k_j / sqrt(d) - g * s_l * m_h * sqrt(dh^2 + dw^2)   if j is in head h's view of i
    A_ij = -inf                                                       otherwise

``s_l`` is the per-layer slope, linear over depth from ``layer_slopes[0]`` (first block) to
``layer_slopes[1]`` (last block), and ``g`` the ``global_slope`` (2, as the authors' released
configurations), as in the authors' ``create_lh_bias_tensor`` (GreenCUBIC/lookhere ``lookhere.py``).

**Head groups.** The heads are split into groups, each with a direction set of four views (the
authors' ``create_lh_layer_tensor``; views inclusive of their borders and of the query itself):

* ``halves``: up ``dh >= 0``, down ``dh <= 0``, left ``dw >= 0``, right ``dw <= 0``;
* ``quadrants`` (the authors' ``corners``): up-left, up-right, down-left, down-right (two halves);
* ``triangles`` (90-degree wedges around an axis): up ``dh >= |dw|``, down ``-dh >= |dw|``, left
  ``dw >= |dh|``, right ``-dw >= |dh|``;
* ``diagonals`` (180-degree half-planes along a diagonal, the union of two triangles): up-right,
  up-left, down-right, down-left (``dh >= dw``, ``dh >= -dw``, ``dh <= -dw``, ``dh <= dw``);
* ``eighths`` (the authors' ``eighths1``): up-triangle & left half, down-triangle & left half,
  left-triangle & up half, right-triangle & up half;
* ``eighths2``: the other eighths: up-triangle & right half, down-triangle & right half,
  left-triangle & down half, right-triangle & down half;
* ``none``: no mask (every key), distance penalty only.

Head ``k`` of a group (counting from the group's first head) looks in view ``k mod 4`` of its set.
Slopes ``m_h`` restart in every run of consecutive heads with the same set (the authors' ``groupby``
of head names): a directional run of ``n`` heads gets ``2^-(floor(k / 4) + 1)`` (``get_slopes``), a
``none`` run ``1/4, 1/16, 1/64, 1/256`` with each value on ``ceil``/``floor`` of ``n / 4`` consecutive
heads (``get_none_slopes``: ``n <= 4`` takes the first ``n``, ``n = 4m`` repeats each ``m`` times).

``fov`` picks the authors' released configurations (LH-180 / LH-90 / LH-45: the co-author's ADE20K
configs, DanielKyr/mmsegmentation ``configs/lookhere/LH2-ADE.py`` / ``LH4-ADE.py`` / ``LH8-ADE.py``, all with
``global_slope=2, layer_slopes=[1.5, 0.5]``; LH-90 also in DTU-PAS's PaPE ``pape/nn/positions/lookhere.py``):

* ``fov=180``: ``halves``, ``diagonals``, ``none``;
* ``fov=90``: ``quadrants``, ``triangles``, ``none``;
* ``fov=45``: ``eighths``, ``eighths2``, ``none``.

``directions=`` replaces the preset: one set by name (every head looks in that set, slopes halving
every four heads: the single-set form, vitrel's ``fov`` before the presets), a list of set names
(``[halves, diagonals, none]``), or the authors' hyphenated string (``corners-triangles-none``).

**Head counts.** Heads go to the groups in blocks of four (one head per view), dealt in turn from the
first group: group ``g`` of ``G`` gets ``floor(B / G)`` blocks, plus one if ``g < B mod G``
(``B = floor(heads / 4)``), and the ``heads mod 4`` heads left over go to the next group in turn
(group ``B mod G``), which then uses the first views of its set. This is the authors' split wherever
their code builds (12 heads: 4/4/4 for three groups, 8/4 for two; 16 heads: 8/4/4, 8/8, 4/4/4/4; their
``create_lh_layer_tensor`` fails at 6 heads for the three presets); elsewhere it continues the same
rule: with three groups, 4 heads get the first set only (LH-180 at 4 heads is ``halves``), 8 heads
the first two sets, 6 heads 4 of the first and 2 of the second (vitrel's), 24 heads 8/8/8.
:attr:`LookHere.groups` lists each group's head count.

Views and penalty depend on the offset only, so the scheme is relative (translation-equivariant) and
runs on any grid, in windows too. The masked directions are ``-inf`` in the bias (the authors fill
them with bfloat16's largest finite value before their bfloat16 cast: the same zero attention
weight); FlexAttention skips the blocks they mask entirely (``has_masked_offsets``: a block mask from
the offset table). Configurations written before the presets (``vitrel_format`` < 3) meant the single-set form
with ``global_slope`` 1 and keep it (:meth:`LookHere.legacy_options`).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any

import torch
from torch import Tensor

from vitrel.layout.geometry import Grid, as_grid, expand_offset_table, offset_grid
from vitrel.layout.tokens import TokenLayout
from vitrel.pos.base import PositionScheme, PosState
from vitrel.pos.cache import GridBuffers
from vitrel.pos.registry import register_pos

__all__ = [
    "LookHere",
    "DIRECTION_SETS",
    "FOV_PRESETS",
    "head_layout",
    "offset_views",
    "parse_directions",
]

#: per set, the four views as lists of elementary views (a view is the intersection of its parts)
DIRECTION_SETS: dict[str, list[list[str]]] = {
    "halves": [["up"], ["down"], ["left"], ["right"]],
    "quadrants": [["up", "left"], ["up", "right"], ["down", "left"], ["down", "right"]],
    "triangles": [["tri_up"], ["tri_down"], ["tri_left"], ["tri_right"]],
    "diagonals": [["diag_up_right"], ["diag_up_left"], ["diag_down_right"], ["diag_down_left"]],
    "eighths": [["tri_up", "left"], ["tri_down", "left"], ["tri_left", "up"], ["tri_right", "up"]],
    "eighths2": [["tri_up", "right"], ["tri_down", "right"], ["tri_left", "down"], ["tri_right", "down"]],
    "none": [[], [], [], []],
}
#: the authors' names of vitrel's sets
ALIASES = {"corners": "quadrants", "eighths1": "eighths"}
#: ``fov`` -> the head groups of the authors' released LH-180 / LH-90 / LH-45
FOV_PRESETS: dict[int, tuple[str, ...]] = {
    180: ("halves", "diagonals", "none"),
    90: ("quadrants", "triangles", "none"),
    45: ("eighths", "eighths2", "none"),
}
#: ``fov`` -> the single set it meant before the presets (configurations with ``vitrel_format`` < 3)
LEGACY_FOV_SETS = {180: "halves", 90: "quadrants", 45: "eighths"}
NONE_SLOPES = (1 / 4, 1 / 16, 1 / 64, 1 / 256)


def parse_directions(directions: str | Sequence[str]) -> tuple[str, ...]:
    """The head groups named by ``directions``: a set, a list of sets or ``"a-b-c"``, as vitrel's names."""
    names = directions.split("-") if isinstance(directions, str) else list(directions)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"lookhere: directions must name one or more direction sets, got {directions!r}")
    out = tuple(ALIASES.get(n, n) for n in names)
    bad = [n for n in out if n not in DIRECTION_SETS]
    if bad:
        known = sorted([*DIRECTION_SETS, *ALIASES])
        raise ValueError(f"lookhere: directions must be one of {known} (or a list of them), got {bad[0]!r}")
    return out


def group_sizes(num_groups: int, num_heads: int) -> list[int]:
    """Heads per group: blocks of four dealt in turn from the first group, the ``heads mod 4`` left over
    to the next group in turn (see the module docstring)."""
    blocks, rest = divmod(num_heads, 4)
    sizes = [4 * (blocks // num_groups + (g < blocks % num_groups)) for g in range(num_groups)]
    sizes[blocks % num_groups] += rest
    return sizes


def head_layout(groups: Sequence[str], num_heads: int) -> tuple[list[list[str]], list[float]]:
    """Per head, its view (elementary parts) and its slope ``m_h``, for head groups ``groups``."""
    names, views = [], []
    for name, n in zip(groups, group_sizes(len(groups), num_heads)):
        names += [name] * n
        views += [DIRECTION_SETS[name][k % 4] for k in range(n)]
    slopes: list[float] = []
    for name, run in groupby(names):
        n = len(list(run))
        if name == "none":
            q, r = divmod(n, 4)
            slopes += [s for j, s in enumerate(NONE_SLOPES) for _ in range(q + (j < r))]
        else:
            slopes += [2.0 ** -(k // 4 + 1) for k in range(n)]
    return views, slopes


def _elementary(dh: Tensor, dw: Tensor) -> dict[str, Tensor]:
    tri = {
        "tri_up": dh >= dw.abs(),
        "tri_down": -dh >= dw.abs(),
        "tri_left": dw >= dh.abs(),
        "tri_right": -dw >= dh.abs(),
    }
    return {
        "up": dh >= 0,
        "down": dh <= 0,
        "left": dw >= 0,
        "right": dw <= 0,
        **tri,
        "diag_up_right": tri["tri_up"] | tri["tri_right"],
        "diag_up_left": tri["tri_up"] | tri["tri_left"],
        "diag_down_right": tri["tri_down"] | tri["tri_right"],
        "diag_down_left": tri["tri_down"] | tri["tri_left"],
    }


def offset_views(dh: Tensor, dw: Tensor, directions: str | Sequence[str], num_heads: int) -> Tensor:
    """Boolean ``[heads, *dh.shape]``: offset ``(dh, dw)`` (query minus key) is in head ``h``'s view
    (``directions``: head groups, as :func:`parse_directions` reads them)."""
    parts = _elementary(dh, dw)
    views = []
    for view in head_layout(parse_directions(directions), num_heads)[0]:
        v = torch.ones_like(dh, dtype=torch.bool)
        for p in view:
            v = v & parts[p]
        views.append(v)
    return torch.stack(views)


@register_pos("lookhere")
class LookHere(GridBuffers, PositionScheme):
    """LookHere's directional views and distance penalties (see the module docstring).

    Args:
        fov: 180, 90 or 45: the authors' LH-180 / LH-90 / LH-45 head groups (``halves-diagonals-none``,
            ``corners-triangles-none``, ``eighths1-eighths2-none``), used when ``directions`` is None.
        directions: instead of the preset, one set by name (every head looks in it: the single-set
            form), a list of sets (head groups) or the authors' ``"a-b-c"`` string. Sets: ``halves``,
            ``quadrants`` (``corners``), ``triangles``, ``diagonals``, ``eighths`` (``eighths1``),
            ``eighths2``, ``none``.
        global_slope: ``g`` (2, the authors' released configurations).
        layer_slopes: ``(first, last)``: the per-layer slope ``s_l`` goes linearly from ``first`` to
            ``last`` over the model's blocks (``first`` alone for a scheme shared by all blocks).

    Heads that do not divide into blocks of four per group follow the rule of the module docstring
    (``groups`` lists what each group got).
    """

    family = "fixed bias"
    has_bias = True

    def __init__(
        self,
        *,
        fov: int = 180,
        directions: str | Sequence[str] | None = None,
        global_slope: float = 2.0,
        layer_slopes: tuple[float, float] | list[float] = (1.5, 0.5),
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if directions is None:
            if fov not in FOV_PRESETS:
                raise ValueError(f"lookhere: fov must be one of {sorted(FOV_PRESETS)}, got {fov!r}")
            groups = FOV_PRESETS[fov]
        elif fov != 180:  # (180: the default, which conf/pos/lookhere.yaml sets beside directions)
            raise ValueError(
                f"lookhere: fov={fov} picks the authors' head groups and directions={directions!r} sets its own: give "
                "one of the two (fov applies with directions: null)"
            )
        else:
            groups = parse_directions(directions)
        ls = [float(v) for v in layer_slopes]
        if len(ls) != 2 or min(ls) < 0 or global_slope < 0:
            raise ValueError(
                f"lookhere: layer_slopes is (first, last) >= 0 and global_slope >= 0, got {ls}, {global_slope}"
            )
        self.fov, self.directions = fov, groups
        #: ``(set, heads)`` of each head group, in head order (groups that got no head left out)
        self.groups = [(g, n) for g, n in zip(groups, group_sizes(len(groups), self.num_heads)) if n]
        self.global_slope, self.layer_slopes = float(global_slope), tuple(ls)
        self.slope = self.global_slope * self.layer_slope()
        self.init_non_persistent_buffers()

    @classmethod
    def legacy_options(cls, options: dict[str, Any], written_format: int = 1) -> dict[str, Any]:
        """Before format 3, ``fov`` meant one set for every head (180 ``halves``, 90 ``quadrants``, 45
        ``eighths``) and ``global_slope`` defaulted to 1: a stored spec keeps that model. Before format 6, ``fov``
        beside ``directions`` was ignored (refused since): a stored spec drops it."""
        if written_format >= 6:
            return options
        out = dict(options)
        if written_format >= 3:
            if out.get("directions") is not None:
                out.pop("fov", None)
            return out
        if out.get("fov", 180) in LEGACY_FOV_SETS:  # fov is then said by directions (or was ignored beside them)
            fov = out.pop("fov", 180)
            if out.get("directions") is None:
                out["directions"] = LEGACY_FOV_SETS[fov]
        out.setdefault("global_slope", 1.0)
        return out

    def _init_buffers(self) -> None:
        """``head_slopes`` and ``built_bias`` (the bias of the built grid), as non-persistent buffers."""
        head = torch.tensor(head_layout(self.directions, self.num_heads)[1], dtype=torch.float64)
        self.register_buffer("head_slopes", head.to(**self._like("head_slopes")), persistent=False)
        self.register_buffer("built_bias", self._bias(self.grid, self.num_prefix_tokens), persistent=False)

    def layer_dependence(self) -> str | None:
        first, last = self.layer_slopes
        return None if first == last else f"layer_slopes {[first, last]} set a slope per block"

    def layer_slope(self) -> float:
        """``s_l``: linear from ``layer_slopes[0]`` to ``[1]`` over the blocks (``torch.linspace``'s points)."""
        first, last = self.layer_slopes
        if self.layer is None or self.layer[1] <= 1:
            return first
        i, n = self.layer
        return first + (last - first) * i / (n - 1)

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        if self.at_built_grid(grid, num_prefix_tokens):
            return self.built_bias
        return self._bias(grid, num_prefix_tokens)

    has_offset_table = True
    has_masked_offsets = True

    def offset_table(self, grid: Grid) -> Tensor:
        dh, dw = offset_grid(grid, self.head_slopes.device)
        dist = torch.sqrt((dh * dh + dw * dw).to(self.head_slopes.dtype))
        t = -(self.slope * self.head_slopes[:, None, None]) * dist[None]
        return t.masked_fill(~offset_views(dh, dw, self.directions, self.num_heads), float("-inf"))

    @classmethod
    def prepare_many(
        cls, schemes: Sequence[PositionScheme], grid: Any, num_prefix_tokens=0, device=None, dtype=None, kernel=None
    ) -> list[PosState]:
        """For a kernel that reads a block mask (flex's ``BlockMask``, triton's visible tiles), one for every block that
        looks in the same directions (the views do not depend on the layer's slope), made by the kernel
        (``skip_blocks``); otherwise each scheme's ``prepare``."""
        if isinstance(grid, TokenLayout) or len(schemes) < 2 or any(type(s) is not cls for s in schemes):
            return super().prepare_many(schemes, grid, num_prefix_tokens, device, dtype, kernel)
        grid = as_grid(grid)
        if kernel is None or "block_mask" not in kernel.reads:
            return super().prepare_many(schemes, grid, num_prefix_tokens, device, dtype, kernel)
        schemes[0].check_kernel(kernel)
        masks, states = {}, []
        for s in schemes:
            table = s.offset_table(grid)
            key = (s.directions, s.num_heads)
            if key not in masks:
                masks[key] = kernel.skip_blocks(table, grid, num_prefix_tokens)
            states.append(PosState(s, grid, num_prefix_tokens, table=table, block_mask=masks[key], kernel=kernel))
        return states

    def _bias(self, grid: Grid, num_prefix_tokens: int) -> Tensor:
        return expand_offset_table(self.offset_table(grid), grid, num_prefix_tokens)

    def extra_repr(self) -> str:
        groups = "-".join(f"{g}:{n}" for g, n in self.groups)
        return f"{super().extra_repr()}, groups={groups}, slope={self.slope:g}"
