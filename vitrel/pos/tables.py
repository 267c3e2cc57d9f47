"""Index helpers and table resizing shared by the learned relative schemes.

A table indexed by a signed offset ``d`` in ``[-(L-1), L-1]`` stores it at row ``d + L - 1``.

**Extension rules** (the option ``extend`` of ``rel2d_full``, ``rel2d_factored`` and the Shaw
schemes): what a table becomes at a grid it was not built for, both when a checkpoint is loaded at
another image size and, for the bias tables, when a call's grid is larger than the table:

* ``grow`` (default) and ``clip`` (its name in T5 and Shaw et al.) are one rule: an offset beyond the table takes
  the edge value. A call on a larger grid clamps its offsets to the table's edge; a checkpoint loaded at a larger size
  grows its table, every offset it had keeping its value and each new one starting at the edge value (new parameters
  that fine-tuning learns apart): the loaded model computes on that grid what the original computes there.
* ``interpolate``: bicubic resize of the whole table to the new extent (Swin V1's fine-tuning rule,
  timm's ``resize_rel_pos_bias_table_simple``: ``align_corners=False``), at load and, for the bias
  tables, at call time (differentiable, every forward on a larger grid).
* ``geometric``: at load, BEiT's resize (the authors' microsoft/unilm ``run_class_finetuning.py``, timm's
  ``resize_rel_pos_bias_table``, which timm's BEiT and Swin loaders apply): the old offsets placed on a geometric
  progression that spans the new extent, interpolated there per head in float32 (linear without scipy, cubic with
  it, as timm). A call on a larger grid clamps as ``grow`` does.

The video tables (``rel3d_full``'s ``[2T-1, 2H-1, 2W-1, C]``, :func:`extend_table3`) follow the same rules one axis
at a time: the ``(dh, dw)`` plane of every ``dt`` by the 2-D rule, then the ``dt`` axis by the 1-D rule (bicubic per
axis, i.e. tricubic, under ``interpolate``), so a table whose ``dt`` extent stays gets the 2-D rule
exactly.

The Shaw schemes clip at ``clip_distance`` by their definition, so at call time they always clip;
``extend`` sets how their tables are resized when loaded at another size.

A load that resizes tables warns once per resize of shapes (a ``UserWarning`` naming the scheme, the shapes and the
rule, attributed to the code that called into vitrel), not once per block: a factored table's rows and columns
(``(5, 8) -> (9, 8)``, ``(7, 8) -> (11, 8)``) are two.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from vitrel.caller import caller_stacklevel

__all__ = [
    "EXTEND_RULES",
    "extend_table",
    "extend_table3",
    "cover_grid",
    "cover_grid3",
    "offset_index",
    "offset_rows",
    "warn_once",
    "take_renamed",
    "ResizeOnLoad",
    "check_init_std",
]

_WARNED: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def check_init_std(scheme: str, init_std: float) -> float:
    """``init_std`` of a learned table (its initial values ``~ N(0, init_std)``, truncated), refused unless positive:
    ``trunc_normal_`` would draw with a negative one silently (and divide by a zero one)."""
    if not init_std > 0:
        raise ValueError(f"{scheme}: init_std is the spread of the table's initial values, > 0; got {init_std}")
    return float(init_std)


def take_renamed(kwargs: dict, old: str, new: str, value, scheme: str):
    """``value``, or ``kwargs[old]`` (removed from ``kwargs``) for configs written before ``old`` became ``new``."""
    if old not in kwargs:
        return value
    legacy = kwargs.pop(old)
    if value is not None and legacy is not None and value != legacy:
        raise ValueError(f"{scheme}: give {new} only ({old} is its old name), got {new}={value} and {old}={legacy}")
    warn_once(f"{scheme}: the option {old!r} is now called {new!r} (read {old}={legacy!r} from an older config)")
    return value if value is not None else legacy


def offset_index(n: int, half: int, device: torch.device) -> Tensor:
    """``[n, n]`` long index ``clamp(i - j, -half, half) + half`` into a ``2*half+1`` table."""
    d = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]
    return d.clamp(-half, half) + half


def offset_rows(n: int, half: int, device: torch.device | None = None) -> Tensor:
    """``[2n-1]`` long index ``clamp(d, -half, half) + half`` into a ``2*half+1`` table for the offsets
    ``d = -(n-1) .. n-1`` of an axis of ``n`` patches (an offset table's rows, see ``offset_table``)."""
    return torch.arange(-(n - 1), n, device=device).clamp(-half, half) + half


def take_offsets(table: Tensor, dim: int, n: int, half: int) -> Tensor:
    """The rows of ``table`` (``2 half + 1`` along ``dim``) at the offsets of an axis of ``n`` patches
    (:func:`offset_rows`): the table itself where it spans them exactly (``half = n - 1``: no index, no copy, nothing
    for autograd to scatter back; the common case, a grid at its trained size), else indexed. A symbolic ``n``
    (``torch.export``'s dynamic sizes) is indexed: comparing it would pin the program to the example's size."""
    if isinstance(n, int) and half == n - 1:
        return table
    return table.index_select(dim, offset_rows(n, half, table.device))


EXTEND_RULES = ("grow", "clip", "interpolate", "geometric")


def _work_dtype(table: Tensor) -> torch.dtype:
    """The dtype a table is interpolated in: float64 for a float64 table (exact to its precision), else float32
    (bicubic interpolation of half / bfloat16 tables)."""
    return torch.float64 if table.dtype == torch.float64 else torch.float32


def extend_table(table: Tensor, new_size: tuple[int, int], rule: str = "grow") -> Tensor:
    """A 2-D offset table ``[2H-1, 2W-1, C]`` at ``[2H'-1, 2W'-1, C]`` by an extension rule (module docstring)."""
    if rule not in EXTEND_RULES:
        raise ValueError(f"extend must be one of {EXTEND_RULES}, got {rule!r}")
    old_h, old_w, c = table.shape
    new_h, new_w = new_size
    if (old_h, old_w) == (new_h, new_w):
        return table
    if rule in ("grow", "clip"):
        ih = offset_rows((new_h + 1) // 2, (old_h - 1) // 2, table.device)
        iw = offset_rows((new_w + 1) // 2, (old_w - 1) // 2, table.device)
        return table[ih][:, iw]
    from timm.layers import resize_rel_pos_bias_table, resize_rel_pos_bias_table_simple

    chw = table.permute(2, 0, 1)
    window = ((new_h + 1) // 2, (new_w + 1) // 2)
    if rule == "geometric":
        with warnings.catch_warnings():  # (torch's notes on timm's interpolator: non-contiguous input, indexing)
            warnings.simplefilter("ignore", UserWarning)
            out = resize_rel_pos_bias_table(chw.contiguous(), window, (c, new_h, new_w))
    else:
        out = resize_rel_pos_bias_table_simple(chw.to(_work_dtype(table)), window, (c, new_h, new_w))
    return out.permute(1, 2, 0).to(table.dtype)


def extend_table3(table: Tensor, new_size: tuple[int, int, int], rule: str = "grow") -> Tensor:
    """A video offset table ``[2T-1, 2H-1, 2W-1, C]`` at ``[2T'-1, 2H'-1, 2W'-1, C]`` by an extension rule, one axis
    at a time (module docstring): :func:`extend_table` on the ``(dh, dw)`` plane of every ``dt``, then on the ``dt``
    axis as a 1-D table."""
    if rule not in EXTEND_RULES:
        raise ValueError(f"extend must be one of {EXTEND_RULES}, got {rule!r}")
    old_t, old_h, old_w, c = table.shape
    new_t, new_h, new_w = new_size
    planes = table.permute(1, 2, 0, 3).reshape(old_h, old_w, old_t * c)
    planes = extend_table(planes, (new_h, new_w), rule).reshape(new_h, new_w, old_t, c).permute(2, 0, 1, 3)
    out = extend_table(planes.reshape(old_t, 1, new_h * new_w * c), (new_t, 1), rule)
    return out.reshape(new_t, new_h, new_w, c)


def cover_grid3(table: Tensor, grid: tuple[int, int, int], rule: str) -> Tensor:
    """:func:`cover_grid` of a video table ``[2Tt-1, 2Ht-1, 2Wt-1, C]`` for a call on ``grid`` ``(T, H, W)``."""
    need = tuple(max(s, 2 * g - 1) for s, g in zip(table.shape[:3], grid))
    if rule != "interpolate" or need == tuple(table.shape[:3]):
        return table
    return extend_table3(table, need, "interpolate")


def cover_grid(table: Tensor, grid: tuple[int, int], rule: str) -> Tensor:
    """``table [2Ht-1, 2Wt-1, C]`` for a call on ``grid`` (``(H, W)``): under ``interpolate`` resized so that
    every offset of the grid has an entry (each axis to ``max`` of the table's and the grid's extent);
    under ``grow`` / ``clip`` as it is (the callers clamp offsets to its edge)."""
    th, tw = table.shape[0], table.shape[1]
    need_h, need_w = max(th, 2 * grid[0] - 1), max(tw, 2 * grid[1] - 1)
    if rule != "interpolate" or (need_h, need_w) == (th, tw):
        return table
    return extend_table(table, (need_h, need_w), "interpolate")


class ResizeOnLoad:
    """Mixin: tables named in ``_rel_tables`` are resized when a state dict of another size loads, by the
    scheme's extension rule (option ``extend``: ``grow`` | ``clip`` | ``interpolate``, module docstring).

    ``_rel_tables`` maps a parameter name to ``"2d"`` (``[2H-1, 2W-1, C]``), ``"1d"`` (``[2L-1, C]``) or ``"3d"``
    (stored ``[2T-1, 2H-1, (2W-1) C]``, ``C`` the scheme's ``num_heads``; a state dict's ``[2T-1, 2H-1, 2W-1, C]``,
    the earlier shape, loads too).
    """

    _rel_tables: dict[str, str] = {}
    #: a call on a grid larger than the tables reads them through :func:`cover_grid` (the bias schemes)
    _covers_grid: bool = False

    @property
    def size_branches(self) -> bool:
        """``extend: interpolate`` of a bias table: resized at call time only when the grid outgrows it."""
        return self._covers_grid and self.extend == "interpolate"

    def __init__(self, *, extend: str = "grow", **kw) -> None:
        super().__init__(**kw)  # type: ignore[call-arg]
        if extend not in EXTEND_RULES:
            raise ValueError(f"{getattr(self, 'name', 'scheme')}: extend must be one of {EXTEND_RULES}, got {extend!r}")
        self.extend = extend

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        for name, kind in self._rel_tables.items():
            key = prefix + name
            if key not in state_dict:
                continue
            src = state_dict[key]
            dst = getattr(self, name)
            if kind == "3d":  # as [2T-1, 2H-1, 2W-1, C] (stored with the last two axes merged)
                heads = self.num_heads  # type: ignore[attr-defined]
                if isinstance(src, Tensor) and src.dim() == 4 and src.shape[-1] == heads:
                    state_dict[key] = src = src.reshape(*src.shape[:2], -1)  # the earlier shape: same order
                if isinstance(src, Tensor) and src.dim() == 3 and src.shape[-1] % heads == 0:
                    src, dst = src.reshape(*src.shape[:2], -1, heads), dst.reshape(*dst.shape[:2], -1, heads)
            if src.shape == dst.shape or src.dim() != dst.dim() or src.shape[-1] != dst.shape[-1]:
                continue  # same size, or not a resizable mismatch: let torch report it
            if kind == "1d":
                state_dict[key] = extend_table(src[:, None, :], (dst.shape[0], 1), self.extend)[:, 0, :]
            elif kind == "3d":
                state_dict[key] = extend_table3(src, tuple(dst.shape[:3]), self.extend).flatten(2)
            else:
                state_dict[key] = extend_table(src, (dst.shape[0], dst.shape[1]), self.extend)
            if self.extend in ("interpolate", "geometric"):
                how = "bicubic resize of the whole table" if self.extend == "interpolate" else "BEiT's geometric resize"
            elif all(a <= b for a, b in zip(dst.shape, src.shape)):  # (grow, clip: one rule)
                how = "offsets the smaller grid has keep their values, the others are dropped"
            else:
                how = "offsets the tables had keep their values, new ones take the edge values"
            # one text per pair of shapes (no parameter name): Python's default filter shows each once
            warnings.warn(
                f"{getattr(self, 'name', 'scheme')}: resized relative-position tables {tuple(src.shape)} -> "
                f"{tuple(dst.shape)} by the rule extend={self.extend!r} ({how}); the scheme's option `extend` "
                f"({' | '.join(EXTEND_RULES)}) chooses the rule",
                stacklevel=caller_stacklevel(),
            )
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]
