"""The grid a scheme's function is measured from (its *reference*), kept with the weights.

Most schemes give the same terms at a grid whatever grid they were built for. A few compare the call's grid with
the grid they were trained at: RoPE ``scaling`` (``factor: auto`` and ``dynamic`` scale by ``L' / L``, YaRN's
ramp reads ``L``) and LieRE's ``coords: linspace`` (``0 .. 1`` at the training grid, past 1 at a larger one).
Rebuilding such a model at another size (``vitrel.load_model(path, img_size=48)``, ``eval.py data.img_size=48``,
``set_input_size``) would make that size the reference and silently change the function: at 48 px a YaRN model
would not scale at all, a LieRE model would interpolate instead of extrapolating, and the trained size itself
would give other logits. So these schemes keep the reference as a persistent buffer ``ref_grid`` (as Swin V2's
continuous bias keeps its pretrained window, :mod:`vitrel.pos.schemes.cpb`), read back when weights load.

Weights stored without it (written before it existed, or by the same scheme without the option that needs it)
load with the grid the scheme is built for, except through :func:`vitrel.load_model`, which takes the grid of
the size the checkpoint stores (``fill_reference_grids``). A ``ref_grid`` given to a scheme that keeps none is
ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.layout.geometry import Grid, Grid3

__all__ = ["ReferenceGrid", "fill_reference_grids"]

KEY = "ref_grid"


class ReferenceGrid:
    """Mixin for a position scheme whose function depends on the grid it was trained at (``self.ref``: an image's
    ``Grid`` or a video's ``Grid3``)."""

    grid: Any
    ref: Grid | Grid3

    def init_reference(self, needed: bool) -> None:
        """``self.ref`` is the built grid; ``needed``: keep it with the weights (buffer ``ref_grid``)."""
        self.ref = self.grid
        if needed:
            self.register_buffer(KEY, torch.tensor(list(self.grid)), persistent=True)  # type: ignore[attr-defined]

    @property
    def keeps_reference(self) -> bool:
        return getattr(self, KEY, None) is not None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        key, new = prefix + KEY, None
        if not self.keeps_reference:
            state_dict.pop(key, None)  # meaningless for this scheme (another option set wrote it)
        elif key not in state_dict:
            state_dict[key] = getattr(self, KEY).clone()  # stored without it: the built grid
        else:
            ref = state_dict[key]
            if isinstance(ref, Tensor) and ref.shape == (len(self.grid),) and not ref.is_meta:
                new = type(self.grid)(*(int(v) for v in ref))  # (h, w), or a video's (t, h, w)
        out = super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]
        if new is not None and new != self.ref:
            self.ref = new
            init = getattr(self, "init_non_persistent_buffers", None)
            if init is not None:  # buffers of the built grid (RoPE's cos / sin) depend on the reference
                init()
        return out


def fill_reference_grids(
    model: nn.Module, state_dict: Mapping[str, Tensor], reference: Callable[[str], Grid | Grid3] | None = None
) -> dict[str, Tensor]:
    """``state_dict`` with the ``ref_grid`` of every scheme of ``model`` that keeps one and lacks it there (taken
    from ``reference(module name)``, by default the scheme's own), and without those the model's schemes keep
    none of: the keys a strict load of ``model`` then expects."""
    sd = dict(state_dict)
    for name, mod in model.named_modules(remove_duplicate=False):
        if not isinstance(mod, ReferenceGrid):
            continue
        key = f"{name}.{KEY}" if name else KEY
        if not mod.keeps_reference:
            sd.pop(key, None)
        elif key not in sd:
            grid = mod.ref if reference is None else reference(name)
            sd[key] = torch.tensor(list(grid))
    return sd
