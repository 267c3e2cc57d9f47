"""Index helpers and table resizing shared by the learned relative schemes.

A table indexed by a signed offset ``d`` in ``[-(L-1), L-1]`` stores it at row ``d + L - 1``.
At call time a grid larger than the table clamps offsets to the table's range (the same rule as
Shaw's clipping). To *grow* a table, e.g. when a checkpoint is loaded at a larger image size,
:func:`resize_rel_table` keeps every offset the table already had and fills new ones by
interpolation (timm's ``resize_rel_pos_bias_table`` stretches the whole table instead; that is
``mode="stretch"`` here).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "offset_index",
    "offset_rows",
    "resize_rel_table",
    "resize_1d_table",
    "warn_once",
    "take_renamed",
    "ResizeOnLoad",
]

_WARNED: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


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


def resize_1d_table(table: Tensor, new_len: int, mode: str = "keep") -> Tensor:
    """Resize ``[2L-1, C]`` (offset-major) to ``[new_len, C]`` (``new_len`` odd)."""
    return resize_rel_table(table[:, None, :], (new_len, 1), mode=mode)[:, 0, :]


def resize_rel_table(table: Tensor, new_size: tuple[int, int], mode: str = "keep") -> Tensor:
    """Resize a 2-D offset table ``[2H-1, 2W-1, C]`` to ``[2H'-1, 2W'-1, C]``.

    ``mode="keep"``: offsets present in the old table keep their values exactly; offsets that are
    new are taken from a bicubic stretch of the old table (so the edges continue smoothly).
    ``mode="stretch"``: plain bicubic stretch of the whole table (timm's behaviour).
    Shrinking always crops the centre (a smaller grid never sees the outer offsets).
    """
    if mode not in ("keep", "stretch"):
        raise ValueError(f"mode must be 'keep' or 'stretch', got {mode!r}")
    old_h, old_w, c = table.shape
    new_h, new_w = new_size
    if (old_h, old_w) == (new_h, new_w):
        return table
    if old_h % 2 == 0 or old_w % 2 == 0 or new_h % 2 == 0 or new_w % 2 == 0:
        raise ValueError(f"offset tables have odd sides, got {(old_h, old_w)} -> {(new_h, new_w)}")
    src = table.permute(2, 0, 1)[None].float()  # [1, C, h, w]
    out = F.interpolate(src, size=(new_h, new_w), mode="bicubic", align_corners=True)
    out = out[0].permute(1, 2, 0)
    if mode == "keep":
        # copy every offset both tables have, exactly
        ch, cw = min(old_h, new_h), min(old_w, new_w)
        oh, ow = (old_h - ch) // 2, (old_w - cw) // 2
        nh, nw = (new_h - ch) // 2, (new_w - cw) // 2
        out = out.clone()
        out[nh : nh + ch, nw : nw + cw] = table[oh : oh + ch, ow : ow + cw].float()
    return out.to(table.dtype).contiguous()


class ResizeOnLoad:
    """Mixin: tables named in ``_rel_tables`` are resized when a state dict of another size loads.

    ``_rel_tables`` maps a parameter name to ``"2d"`` (``[2H-1, 2W-1, C]``) or ``"1d"``
    (``[2L-1, C]``). Offsets the stored table had keep their values (``resize_rel_table``).
    """

    _rel_tables: dict[str, str] = {}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        for name, kind in self._rel_tables.items():
            key = prefix + name
            if key not in state_dict:
                continue
            src = state_dict[key]
            dst = getattr(self, name)
            if src.shape == dst.shape or src.dim() != dst.dim() or src.shape[-1] != dst.shape[-1]:
                continue  # same size, or not a resizable mismatch: let torch report it
            if kind == "1d":
                state_dict[key] = resize_1d_table(src, dst.shape[0])
            else:
                state_dict[key] = resize_rel_table(src, (dst.shape[0], dst.shape[1]))
            warn_once(
                f"resized relative-position table {key} from {tuple(src.shape)} to {tuple(dst.shape)} "
                "(offsets the table already had keep their values)"
            )
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]
