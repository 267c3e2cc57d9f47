"""Probing a frozen backbone (``module.freeze_backbone=true``): linear probing (MAE, DINOv2) and attentive probing
(V-JEPA 2) train the classifier alone on features the backbone keeps; with ``module.unfreeze_backbone_at_epoch=N``
the whole model trains from epoch ``N`` on (LP-FT: a linear probe, then fine-tuning; Kumar et al., 2022; the epoch
Lightning's ``BackboneFinetuning`` calls ``unfreeze_backbone_at_epoch``).

The probe is the model's head as timm names it, the children :data:`PROBE_MODULES` (the attention pool of
``global_pool="map"``, the norm after pooling, the head's dropout and the classifier). Every other parameter is
frozen (``requires_grad`` off: the optimizer takes no step on it and autograd records nothing through the backbone),
and the backbone's modules stay in eval mode while the probe trains: no dropout or drop path on the features, as
the probes of V-JEPA 2 (``encoder.eval()`` under ``torch.no_grad()``) and MAE see them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vitrel.config import ConfigError

__all__ = ["PROBE_MODULES", "Frozen", "check_unfreeze_ranks", "freeze_backbone"]

#: the children of a timm / vitrel classifier that make its head (timm's ``VisionTransformer`` names)
PROBE_MODULES = ("attn_pool", "fc_norm", "head_drop", "head")


@dataclass(frozen=True)
class Frozen:
    """What :func:`freeze_backbone` froze: the child ``modules`` kept in eval mode, the ``params`` it turned off."""

    modules: tuple[nn.Module, ...]
    params: tuple[nn.Parameter, ...]

    def unfreeze(self, training: bool) -> None:
        """Give the parameters back to training, and the modules the mode ``training``."""
        for p in self.params:
            p.requires_grad_(True)
        for m in self.modules:
            m.train(training)


def freeze_backbone(model: nn.Module) -> Frozen:
    """Freeze every parameter of ``model`` outside its head (:data:`PROBE_MODULES`); the caller keeps the frozen
    child modules in eval mode. A model without such children, or whose head has no parameter to train
    (``num_classes=0``), is a ``ValueError``."""
    children = dict(model.named_children())
    if not any(name in children for name in PROBE_MODULES):
        raise ValueError(
            f"module.freeze_backbone=true trains the head, which {type(model).__name__} does not name (children "
            f"{', '.join(PROBE_MODULES)}; it has {', '.join(children) or 'none'})"
        )
    head = {id(p) for name in PROBE_MODULES if name in children for p in children[name].parameters()}
    if not any(p.requires_grad for p in model.parameters() if id(p) in head):
        raise ValueError("module.freeze_backbone=true leaves nothing to train: the model's head has no parameters")
    params = tuple(p for p in model.parameters() if id(p) not in head and p.requires_grad)
    for p in params:
        p.requires_grad_(False)
    return Frozen(tuple(m for name, m in children.items() if name not in PROBE_MODULES), params)


def check_unfreeze_ranks(world_size: int) -> None:
    """LP-FT in one run needs one process: DDP wraps the model once and leaves out the parameters frozen then, so a
    backbone unfrozen later would train apart on each rank, never synchronised (Lightning's ``BackboneFinetuning``
    alike: Lightning-AI/pytorch-lightning#20340). A :class:`~vitrel.config.ConfigError` naming the two-run way."""
    if world_size > 1:
        raise ConfigError(
            f"module.unfreeze_backbone_at_epoch trains a backbone DDP left out when it wrapped the model: over "
            f"{world_size} processes its ranks would drift apart. Run LP-FT as two runs: the probe "
            "(module.freeze_backbone=true), then model=from_checkpoint model.path=<its last.ckpt>"
        )
