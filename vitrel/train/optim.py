"""AdamW parameter groups and the warmup + cosine learning-rate schedule (per optimizer step).

Weight decay applies to weight matrices only: a parameter gets none if it has ``ndim <= 1``
(norm scales, biases, 1-D scales) or its name is in ``model.no_weight_decay()`` (relative
position tables, RoPE frequencies, absolute embeddings, class/register tokens).

Schedule, with ``W`` warmup steps out of ``T`` and ``s`` the optimizer step::

    lr(s) = warmup_lr + (lr - warmup_lr) * s / W                              s < W
    lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2     W <= s <= T
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from torch import nn

__all__ = ["param_groups", "WarmupCosine"]


def param_groups(model: nn.Module, weight_decay: float, no_weight_decay: Iterable[str] = ()) -> list[dict]:
    """Two AdamW groups: ``{"params": decay, "weight_decay": wd}`` and ``{"params": no_decay, "weight_decay": 0}``.

    ``no_weight_decay``: exact parameter names (as in ``model.named_parameters()``) or module
    prefixes (``"pos"`` covers ``"pos.table"``).
    """
    skip = set(no_weight_decay)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        if p.ndim <= 1 or prefixes & skip:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class WarmupCosine:
    """Multiplicative factor of ``LambdaLR`` implementing the schedule of the module docstring.

    A callable object (not a closure) so ``LambdaLR.state_dict()`` stores its plain-number
    settings and checkpoints stay loadable with ``torch.load(weights_only=True)``.
    """

    def __init__(self, total_steps: int, warmup_steps: int, lr: float, min_lr: float = 0.0, warmup_lr: float = 0.0):
        if total_steps < 1:
            raise ValueError(f"the schedule needs at least one optimizer step, got total_steps={total_steps}")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.lr = float(lr)
        self.min_lr = float(min_lr)
        self.warmup_lr = float(warmup_lr)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr + (self.lr - self.warmup_lr) * step / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        t = min(step - self.warmup_steps, span) / span
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))

    def __call__(self, step: int) -> float:
        return self.lr_at(step) / self.lr
