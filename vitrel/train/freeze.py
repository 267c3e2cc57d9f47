"""Probing a frozen backbone (``module.freeze_backbone=true``): linear probing (MAE, DINOv2) and attentive probing
(V-JEPA 2) train the classifier alone on features the backbone keeps.

The probe is the model's head as timm names it, the children :data:`PROBE_MODULES` (the attention pool of
``global_pool="map"``, the norm after pooling, the head's dropout and the classifier). Every other parameter is
frozen (``requires_grad`` off, so the optimizer never holds it and autograd records nothing through the backbone),
and the backbone's modules stay in eval mode while the probe trains: no dropout or drop path on the features, as
the probes of V-JEPA 2 (``encoder.eval()`` under ``torch.no_grad()``) and MAE see them.
"""

from __future__ import annotations

from torch import nn

__all__ = ["PROBE_MODULES", "freeze_backbone"]

#: the children of a timm / vitrel classifier that make its head (timm's ``VisionTransformer`` names)
PROBE_MODULES = ("attn_pool", "fc_norm", "head_drop", "head")


def freeze_backbone(model: nn.Module) -> tuple[nn.Module, ...]:
    """Freeze every parameter of ``model`` outside its head (:data:`PROBE_MODULES`) and return the frozen child
    modules, which the caller keeps in eval mode. A model without such children, or whose head has no parameter to
    train (``num_classes=0``), is a ``ValueError``."""
    children = dict(model.named_children())
    if not any(name in children for name in PROBE_MODULES):
        raise ValueError(
            f"module.freeze_backbone=true trains the head, which {type(model).__name__} does not name (children "
            f"{', '.join(PROBE_MODULES)}; it has {', '.join(children) or 'none'})"
        )
    frozen = tuple(m for name, m in children.items() if name not in PROBE_MODULES)
    model.requires_grad_(False)
    for name in PROBE_MODULES:
        if name in children:
            children[name].requires_grad_(True)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("module.freeze_backbone=true leaves nothing to train: the model's head has no parameters")
    return frozen
