"""The MLPs of a ViT's blocks and their activations, by timm's names (``mlp_layer``, ``act_layer``)."""

from __future__ import annotations

from collections.abc import Callable

from timm.layers import GELUTanh, Mlp, QuickGELU, SwiGLU
from torch import nn

from vitrel.layers.validate import ACT_LAYERS

__all__ = ["ACTIVATIONS", "make_mlp"]

#: ``act_layer`` of a ViT's MLP (names as timm's ``get_act_layer``): GELU, its tanh form (SigLIP's), QuickGELU (OpenAI
#: CLIP's ``x sigmoid(1.702 x)``)
ACTIVATIONS: dict[str, type[nn.Module]] = dict(zip(ACT_LAYERS, (nn.GELU, GELUTanh, QuickGELU), strict=True))


def make_mlp(
    kind: str, dim: int, hidden: int, drop: float, norm: Callable[[int], nn.Module] | None = None, act: str = "gelu"
) -> nn.Module:
    """A block's MLP: timm's ``Mlp`` with GELU (``"mlp"``, ViT's), or timm's ``SwiGLU``, ``fc2(SiLU(fc1_g x) *
    fc1_x x)`` (``"swiglu"``: DINOv3's ViT-H+ and 7B, EVA-02's), both with ``hidden`` features; ``norm``: a norm of
    the hidden features before ``fc2`` (timm's ``scale_mlp``, EVA-02's sub-LN); ``act``: the ``Mlp``'s activation
    (:data:`ACTIVATIONS`; the SwiGLU's is SiLU)."""
    if kind == "swiglu":
        return SwiGLU(dim, hidden, act_layer=nn.SiLU, norm_layer=norm, drop=drop)
    return Mlp(dim, hidden, act_layer=ACTIVATIONS[act], norm_layer=norm, drop=drop)
