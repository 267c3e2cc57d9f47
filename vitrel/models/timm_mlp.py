"""The MLP of a timm ViT block read as vitrel's (``mlp_layer``, ``mlp_ratio``, ``mlp_norm``), for
:func:`~vitrel.models.timm_import.from_timm`: timm's ``Mlp`` with GELU, its ``SwiGLU`` with SiLU (DINOv3's S+, H+ and
7B; EVA-02's base and large, with a LayerNorm of the hidden features) and its packed ``GluMlp`` SwiGLU (EVA-02's tiny
and small), whose ``fc1`` vitrel splits into ``fc1_x`` and ``fc1_g``."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from timm.layers import GELUTanh, GluMlp, QuickGELU, SwiGLU
from torch import Tensor, nn

from vitrel.layers.norms import same_norm

__all__ = ["mlp_args", "split_packed"]


def _packed_swiglu(mlp: nn.Module) -> bool:
    """timm's ``GluMlp`` as SwiGLU (``SwiGLUPacked``: ``fc1`` holds the value rows and the gate's, the gate's last
    with ``gate_last``; SiLU on the gate)."""
    return isinstance(mlp, GluMlp) and isinstance(mlp.act, nn.SiLU) and mlp.chunk_dim == -1


def mlp_args(t: nn.Module, blk: nn.Module, refuse: Callable[[bool, str], None]) -> dict[str, Any]:
    """``mlp_ratio``, ``mlp_layer``, ``mlp_norm`` and ``act_layer`` of the timm block ``blk``'s MLP (of model ``t``);
    ``refuse(condition, what)`` raises for what vitrel has no equivalent of."""
    mlp = blk.mlp
    swiglu = isinstance(mlp, SwiGLU) or _packed_swiglu(mlp)
    gated = hasattr(mlp, "fc1_g") or isinstance(mlp, GluMlp)
    refuse(not swiglu and (gated or not hasattr(mlp, "fc1")), "a gated MLP other than timm's SwiGLU")
    act = None if swiglu else _act_name(mlp.act)  # (a SwiGLU's is SiLU, not an act_layer)
    wrong = not isinstance(mlp.act, nn.SiLU) if swiglu else act is None
    said = "SiLU in a SwiGLU" if swiglu else "GELU, GELUTanh or QuickGELU"
    refuse(wrong, f"an MLP activation {type(mlp.act).__name__} (vitrel: {said})")
    refuse(swiglu and any(m.bias is None for m in mlp.modules() if isinstance(m, nn.Linear)), "a SwiGLU without biases")
    norm = getattr(mlp, "norm", nn.Identity())
    plain = isinstance(norm, nn.Identity)
    refuse(not plain and not same_norm(norm, blk.norm1), "a norm inside the MLP other than the block's")
    hidden = mlp.fc2.in_features
    ratio = hidden / t.embed_dim
    if int(t.embed_dim * ratio) != hidden:  # (vitrel builds int(embed_dim * mlp_ratio) features, as timm)
        ratio = math.nextafter(ratio, math.inf)
    return dict(mlp_ratio=ratio, mlp_layer="swiglu" if swiglu else "mlp", mlp_norm=not plain, act_layer=act or "gelu")


def _act_name(act: nn.Module) -> str | None:
    """vitrel's ``act_layer`` name of a timm MLP's activation, or None (another one)."""
    if isinstance(act, GELUTanh) or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    if isinstance(act, QuickGELU):
        return "quick_gelu"
    exact = type(act).__name__ == "GELU" and getattr(act, "approximate", "none") == "none"  # (torch's or timm's)
    return "gelu" if exact else None


def split_packed(key: str, v: Tensor, own: Mapping[str, Tensor], t: nn.Module) -> dict[str, Tensor] | None:
    """A packed SwiGLU's ``...mlp.fc1.weight`` / ``.bias`` (``key`` in timm model ``t``, value ``v``) as vitrel's
    ``fc1_x`` and ``fc1_g`` (the value's half and the gate's, as its ``gate_last`` orders them), when ``own`` (the
    vitrel model's state dict) has those; else None."""
    head, _, kind = key.rpartition(".fc1.")
    if not head.endswith(".mlp") or f"{head}.fc1_g.{kind}" not in own:
        return None
    first, second = v.chunk(2, dim=0)
    value, gate = (first, second) if t.get_submodule(head).gate_last else (second, first)
    return {f"{head}.fc1_x.{kind}": value, f"{head}.fc1_g.{kind}": gate}
