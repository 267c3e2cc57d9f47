"""Continuous relative position bias of Swin Transformer V2 (Liu et al., 2022).

Each offset ``(dh, dw)`` is normalised by the grid the scheme was built for (the "pretrained
window", kept in the state dict as ``ref_grid``), log-spaced, and mapped to one bias per head by a small MLP::

    x = 8 * (dh / (H0 - 1), dw / (W0 - 1)),   x' = sign(x) * log2(1 + |x|) / log2(8)
    A_ij = q_i . k_j / sqrt(d) + 16 * sigmoid(MLP(x'_ij))_h

Being a function of the offset, it extends to any grid with no resizing.

``mode: cr`` is timm's other log-coordinate MLP (``timm.layers.RelPosMlp(mode="cr")``, the bias of its
``vit_relpos_*`` models): offsets not normalised, natural log, both layers with a bias, no gate, and dropout 0.125 on
the hidden features in training (timm's ``Mlp(drop=(0.125, 0.))``)::

    x' = sign(d) * ln(1 + |d|),   A_ij = q_i . k_j / sqrt(d) + MLP(x'_ij)_h

Mixed precision: the MLP, its sigmoid and the table run in the weights' dtype with autocast off. Under autocast (as
the Swin V2 authors' code and timm's run it) its inputs, the log-spaced offsets, and the gradient of every table
entry are rounded to bfloat16 / float16 before the first layer's weight gradient sums them over the offsets, a sum
that cancels (the offsets are symmetric): at a 14 x 14 grid that gradient is then 6 % (bf16) and 1.7 % (fp16) from
float64, 13x and 28x the error of plain attention's q, k, v gradients; in float32, 2.7x and 2.8x, at no measurable
cost (``bench/results/attention_autocast_cpu.md``). The bias is still cast to the attention's dtype by the kernel.

Weight decay: none on the MLP, as the authors' training code (microsoft/Swin-Transformer ``optimizer.py``
``set_weight_decay`` with ``SwinTransformerV2.no_weight_decay_keywords()``, which names ``cpb_mlp``) and timm's
``SwinTransformerV2.no_weight_decay()``. ``mlp_weight_decay: true`` decays its weight matrices as any ``Linear``'s:
what vitrel did before ``vitrel_format`` 8, which a configuration written then keeps (:meth:`Rel2dCpb.legacy_options`:
its optimizer state fits only that layout).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.device_cache import per_device
from vitrel.layout.geometry import Grid, pad_prefix
from vitrel.pos.base import PositionScheme
from vitrel.pos.registry import register_pos
from vitrel.pos.schemes.bias2d import full_bias_flat

__all__ = ["Rel2dCpb", "cpb_coords"]


def cpb_coords(grid: Grid, ref: Grid, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Log-spaced normalised offsets ``[2H-1, 2W-1, 2]`` of ``grid``, normalised by ``ref``."""
    return _flat_coords(grid, ref, device, dtype).view(2 * grid.h - 1, 2 * grid.w - 1, 2)


def _flat_coords(grid: Grid, ref: Grid, device: torch.device | None, dtype: torch.dtype) -> Tensor:
    """:func:`cpb_coords` flat, ``[(2H-1) (2W-1), 2]`` row-major (built flat: no reshapes, any symbolic size); made
    once per arguments (:func:`~vitrel.device_cache.per_device`)."""
    return _log_coords(grid.h, grid.w, ref.h, ref.w, dtype, device)


@per_device(maxsize=32)
def _log_coords(gh: int, gw: int, rh: int, rw: int, dtype: torch.dtype, device) -> Tensor:
    tw = 2 * gw - 1
    a = torch.arange((2 * gh - 1) * tw, device=device)
    ih = a // tw
    dh = (ih - (gh - 1)).to(dtype) / max(rh - 1, 1)
    dw = (a - ih * tw - (gw - 1)).to(dtype) / max(rw - 1, 1)
    c = torch.stack((dh, dw), dim=-1) * 8.0
    return torch.sign(c) * torch.log2(c.abs() + 1.0) / math.log2(8.0)


@per_device(maxsize=32)
def _ln_coords(gh: int, gw: int, dtype: torch.dtype, device) -> Tensor:
    """``mode: cr``'s offsets ``sign(d) ln(1 + |d|)``, flat ``[(2H-1) (2W-1), 2]`` row-major, not normalised."""
    tw = 2 * gw - 1
    a = torch.arange((2 * gh - 1) * tw, device=device)
    ih = a // tw
    c = torch.stack((ih - (gh - 1), a - ih * tw - (gw - 1)), dim=-1).to(dtype)
    return torch.sign(c) * torch.log1p(c.abs())


@register_pos("rel2d_cpb")
class Rel2dCpb(PositionScheme):
    """Swin V2 continuous position bias: an MLP over log-spaced offsets, ``16 * sigmoid`` output."""

    family = "learned bias"
    has_bias = True

    def __init__(
        self,
        *,
        hidden_dim: int = 512,
        mode: str = "swin",
        mlp_drop: float | None = None,
        mlp_weight_decay: bool = False,
        **kw,
    ) -> None:
        if hidden_dim < 1:  # no hidden unit: the same bias for every offset
            raise ValueError(f"rel2d_cpb: hidden_dim must be a positive integer, got {hidden_dim}")
        if mode not in ("swin", "cr"):
            raise ValueError(f"rel2d_cpb: mode must be 'swin' (Swin V2's) or 'cr' (timm's relpos ViTs'), got {mode!r}")
        mlp_drop = (0.125 if mode == "cr" else 0.0) if mlp_drop is None else mlp_drop
        if not 0.0 <= mlp_drop < 1.0:
            raise ValueError(f"rel2d_cpb: mlp_drop must be in [0, 1), got {mlp_drop!r}")
        if not isinstance(mlp_weight_decay, bool):
            raise ValueError(f"rel2d_cpb: mlp_weight_decay must be true or false, got {mlp_weight_decay!r}")
        super().__init__(**kw)
        self.mode, self.mlp_drop = mode, float(mlp_drop)
        self.mlp_weight_decay = mlp_weight_decay
        # (an instance's: the class's () is the option's true)
        self.no_weight_decay_keys = () if mlp_weight_decay else ("mlp",)  # type: ignore[misc]
        drop = [nn.Dropout(self.mlp_drop)] if mode == "cr" else []  # (Swin V2's keeps its layers' indices)
        self.mlp = nn.Sequential(
            nn.Linear(2, hidden_dim, bias=True),
            nn.ReLU(inplace=True),
            *drop,
            nn.Linear(hidden_dim, self.num_heads, bias=mode == "cr"),
        )
        # The normalising grid travels with the weights: a checkpoint loaded at another size keeps
        # the function it learned (Swin V2's "pretrained window size").
        self.register_buffer("ref_grid", torch.tensor([self.grid.h, self.grid.w]), persistent=True)
        self._ref = self.grid  # the same as Python ints, so forward never reads a tensor back to the host

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        ref = state_dict.get(prefix + "ref_grid")
        if isinstance(ref, torch.Tensor) and ref.shape == (2,):
            self._ref = Grid(int(ref[0]), int(ref[1]))
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @classmethod
    def legacy_options(cls, options: dict[str, Any], written_format: int = 1) -> dict[str, Any]:
        """Before format 8 the MLP's weight matrices were weight-decayed."""
        options = super().legacy_options(options, written_format)
        return options if written_format >= 8 else {"mlp_weight_decay": True, **options}

    def extra_repr(self) -> str:
        mode = f", mode=cr, mlp_drop={self.mlp_drop}" if self.mode == "cr" else ""
        return f"{super().extra_repr()}{mode}, mlp_weight_decay={self.mlp_weight_decay}"

    def _flat_table(self, grid: Grid) -> Tensor:
        """``16 * sigmoid(MLP(x'))`` (``mode: cr``: ``MLP(x')``), ``[(2H-1) (2W-1), heads]``, in the MLP's dtype with
        autocast off (see the module docstring)."""
        w = self.mlp[0].weight
        with torch.autocast(w.device.type, enabled=False):
            if self.mode == "cr":
                return self.mlp(_ln_coords(grid.h, grid.w, w.dtype, w.device))
            return 16.0 * torch.sigmoid(self.mlp(_flat_coords(grid, self._ref, w.device, w.dtype)))

    def table(self, grid: Grid) -> Tensor:
        """The ``[2H-1, 2W-1, heads]`` bias table of ``grid``."""
        return self._flat_table(grid).view(2 * grid.h - 1, 2 * grid.w - 1, self.num_heads)

    has_offset_table = True

    def offset_table(self, grid: Grid) -> Tensor:
        return self._flat_table(grid).t().reshape(self.num_heads, 2 * grid.h - 1, 2 * grid.w - 1)

    def bias(self, grid: Grid, num_prefix_tokens: int = 0) -> Tensor:
        t = self._flat_table(grid)
        return pad_prefix(full_bias_flat(t.t(), 2 * grid.h - 1, 2 * grid.w - 1, grid), num_prefix_tokens)
