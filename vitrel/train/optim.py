"""Parameter groups and the warmup + cosine learning-rate schedule (per optimizer step).

Weight decay applies to weight matrices only: a parameter gets none if it has ``ndim <= 1``
(norm scales, biases, 1-D scales) or its name is in ``model.no_weight_decay()`` (relative
position tables, RoPE frequencies, absolute embeddings, class/register tokens): timm's
``param_groups_weight_decay``.

Schedule, with ``W`` warmup steps out of ``T`` and ``s`` the optimizer step::

    lr(s) = warmup_lr + (lr - warmup_lr) * s / W                              s < W
    lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2     W <= s <= T

A run resumed from a checkpoint continues the schedule at the checkpoint's step, with the length of the
resumed run: ``T`` and ``W`` are those the resumed run computes (``trainer.max_epochs`` raised from 10 to 20:
the cosine of a 20-epoch run, from the step reached on), the rates (``lr``, ``min_lr``, ``warmup_lr``) the
checkpoint's (:class:`WarmupCosineLR`). The learning rate from the resume on is then that of an uninterrupted
run of the new length; a changed length is logged with the rate before and after. Resumed at an epoch's end with
another number of steps an epoch, the schedule goes on from the epochs done, not the steps (:func:`follow_epochs`).

In the configs the optimizer and the scheduler are ``_partial_`` nodes (``conf/module/classifier.yaml``)
that :class:`~vitrel.train.module.ClassifierModule` completes: ``optimizer(params=param_groups(model))``
and ``scheduler(optimizer, total_steps=..., steps_per_epoch=...)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from timm import optim as timm_optim
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from vitrel.config import ConfigError
from vitrel.train.loop_rules import resumed_epochs

__all__ = [
    "param_groups", "WarmupCosine", "WarmupCosineLR", "warmup_cosine", "follow_epochs", "check_float16_eps",
    "FLOAT16_EPS",
]  # fmt: skip


def param_groups(model: nn.Module, layer_decay: float | None = None, lr: float | None = None) -> list[dict]:
    """Two groups: ``{"params": decay}`` (the optimizer's ``weight_decay``) and
    ``{"params": no_decay, "weight_decay": 0.0}``, empty ones left out.

    timm's ``param_groups_weight_decay`` with ``model.no_weight_decay()`` (exact parameter names).
    The decay group carries no ``weight_decay`` of its own, so the optimizer's applies
    (``module.optimizer.weight_decay``). The order (decay first) is that of vitrel 0.1, so the optimizer
    state of its checkpoints still lines up on resume.

    ``layer_decay`` (fine-tuning): timm's ``param_groups_layer_decay`` over ``model.group_matcher()``,
    one group per layer with learning rate ``lr * layer_decay ** (num_layers - layer)`` (the ``lr_scale``
    timm computes, applied here to the group's ``lr`` so any scheduler keeps it).
    """
    nwd = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    if layer_decay is not None:
        if lr is None:
            raise ValueError("layer_decay needs the base learning rate (module.optimizer.lr)")
        groups = param_groups_layer_decay(model, weight_decay=1.0, no_weight_decay_list=nwd, layer_decay=layer_decay)
        out = []
        for g in groups:
            g = dict(g)
            g["lr"] = lr * g.pop("lr_scale", 1.0)
            if g["weight_decay"]:
                del g["weight_decay"]  # the optimizer's
            out.append(g)
        return out
    # weight_decay=1.0 only marks the decay group (timm merges everything into one group at 0)
    groups = param_groups_weight_decay(model, weight_decay=1.0, no_weight_decay_list=nwd)
    decay = [{"params": g["params"]} for g in groups if g["weight_decay"]]
    no_decay = [{"params": g["params"], "weight_decay": 0.0} for g in groups if not g["weight_decay"]]
    return decay + no_decay


#: the ``eps`` suggested for float16 weights: measured on a tiny run (60 steps, ``trainer.precision=16-true``): train
#: loss 2.125 against 2.107 in 32-true; eps=1e-6, representable in float16, still NaN'd at step 7
FLOAT16_EPS = 1e-4

#: optimizers that keep their moments in the weights' dtype and divide by ``sqrt(v) + eps`` there: on float16 weights
#: their default eps rounds to 0 and a gradient whose square underflows (``|g| < 5e-3`` at beta2=0.999) divides by 0
#: (measured: inf or NaN weights within 10 steps). timm's Lamb, Lars, Adafactor, AdaBelief, ... compute in float32.
_TIMM_ADAMS = ("AdamP", "AdamWLegacy", "Adan", "LaProp", "Mars", "NAdamLegacy", "NAdamW")  # (those the timm has)
EPS_IN_WEIGHT_DTYPE: tuple[type[Optimizer], ...] = (
    *(getattr(torch.optim, n) for n in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "RMSprop", "Adagrad")),
    *(c for n in _TIMM_ADAMS if (c := vars(timm_optim).get(n))),
)


def check_float16_eps(optimizer: Optimizer) -> None:
    """Refuse, before the first step, an Adam-type optimizer (:data:`EPS_IN_WEIGHT_DTYPE`) over float16 weights
    (``trainer.precision=16-true``) whose ``eps`` rounds to 0 in float16: its first step divides by zero wherever a
    gradient's square underflows, and the loss is NaN at step 1. The fix is the user's to choose (eps is not raised
    in silence): ``trainer.precision=16-mixed`` (float32 weights and state) or a representable ``eps``."""
    if not isinstance(optimizer, EPS_IN_WEIGHT_DTYPE):
        return
    for group in optimizer.param_groups:
        eps = group.get("eps")
        half = any(p.dtype == torch.float16 for p in group["params"])
        if half and isinstance(eps, float) and float(torch.tensor(eps, dtype=torch.float16)) == 0.0:
            raise ConfigError(
                f"{type(optimizer).__name__}'s eps={eps:g} rounds to 0 in float16, the dtype of the weights and the "
                "optimizer state under trainer.precision=16-true: its first step would divide by zero where a "
                "gradient's square underflows (|g| < 5e-3), a NaN loss at step 1; take trainer.precision=16-mixed "
                f"(float32 weights and state) or bf16-mixed, or set module.optimizer.eps={FLOAT16_EPS:g}"
            )


class WarmupCosine:
    """Multiplicative factor of ``LambdaLR`` implementing the schedule of the module docstring.

    A callable object (not a closure) so ``LambdaLR.state_dict()`` stores its plain-number
    settings and checkpoints stay loadable with ``torch.load(weights_only=True)``.
    """

    def __init__(self, total_steps: int, warmup_steps: int, lr: float, min_lr: float = 0.0, warmup_lr: float = 0.0):
        if total_steps < 1:
            raise ValueError(f"the schedule needs at least one optimizer step, got total_steps={total_steps}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if lr < 0:
            raise ConfigError(f"lr={lr:g} is negative: set module.optimizer.lr >= 0 (0: the weights stay)")
        # a cosine "decay" up to a min_lr above lr, or a warmup down from above it, is no one's intent: refused
        if min_lr > lr:
            raise ConfigError(
                f"min_lr={min_lr:g} is above lr={lr:g}: the cosine would raise the rate from lr to min_lr over the "
                f"run; set module.scheduler.min_lr at most module.optimizer.lr (e.g. module.scheduler.min_lr="
                f"{lr / 100:g})"
            )
        if warmup_steps > 0 and warmup_lr > lr:
            raise ConfigError(
                f"warmup_lr={warmup_lr:g} is above lr={lr:g}: the warmup would lower the rate to lr; set "
                f"module.scheduler.warmup_lr at most module.optimizer.lr (e.g. module.scheduler.warmup_lr=0)"
            )
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.lr = float(lr)
        self.min_lr = float(min_lr)
        self.warmup_lr = float(warmup_lr)
        self.offset = 0  # this run's step minus the optimizer steps taken (:func:`follow_epochs`)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr + (self.lr - self.warmup_lr) * step / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        t = min(step - self.warmup_steps, span) / span
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))

    def __call__(self, step: int) -> float:
        return self.lr_at(step + self.offset) / self.lr if self.lr else 0.0  # (lr 0: min_lr, warmup_lr 0 too)


class WarmupCosineLR(LambdaLR):
    """``LambdaLR`` of :class:`WarmupCosine` whose length survives :meth:`load_state_dict`.

    ``LambdaLR.load_state_dict`` puts back every setting of the stored :class:`WarmupCosine`, its
    ``total_steps`` too, so a run resumed with a larger ``trainer.max_epochs`` would spend the added epochs
    at ``min_lr``. Here the stored state gives the step and the rates; ``total_steps`` and ``warmup_steps``
    stay those this scheduler was built with (the resumed run's), and the optimizer's groups get the rate of
    the restored step on the new schedule. The state dict is ``LambdaLR``'s: checkpoints of either load in
    the other.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        length = [(f.total_steps, f.warmup_steps) for f in self.lr_lambdas]
        super().load_state_dict(state_dict)
        stored = [(f.total_steps, f.warmup_steps) for f in self.lr_lambdas]
        if stored == length:
            return
        before = [group["lr"] for group in self.optimizer.param_groups]
        for f, (total, warmup) in zip(self.lr_lambdas, length):
            f.total_steps, f.warmup_steps = total, warmup
        self.set_rates()
        (old_total, old_warmup), (total, warmup) = stored[0], length[0]
        rank_zero_info(
            f"learning-rate schedule: {total} steps ({warmup} of warmup) for this run, the checkpoint's had "
            f"{old_total} ({old_warmup}); continuing at step {self.last_epoch} on the new one: lr "
            f"{before[0]:.4g} -> {self._last_lr[0]:.4g}"
        )

    def set_rates(self) -> None:
        """The optimizer's groups (and ``get_last_lr``) at the rates of the current step, after a schedule change."""
        self._last_lr = [base * f(self.last_epoch) for base, f in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def warmup_cosine(
    optimizer: Optimizer,
    total_steps: int,
    steps_per_epoch: int = 1,
    warmup_epochs: float = 0.0,
    warmup_steps: int | None = None,
    min_lr: float = 0.0,
    warmup_lr: float = 0.0,
) -> LambdaLR:
    """Linear warmup then cosine to ``min_lr`` over ``total_steps`` optimizer steps (:class:`WarmupCosineLR`, a
    ``LambdaLR`` of :class:`WarmupCosine`; the peak is the optimizer's ``lr``). The warmup lasts ``warmup_steps``
    steps, or ``round(warmup_epochs * steps_per_epoch)`` when ``warmup_steps`` is None, also when that is longer
    than the run (a short debugging run then ends inside the configured ramp, as the log says). Restored from a
    checkpoint, it keeps these lengths (see the module docstring)."""
    warmup = int(warmup_steps) if warmup_steps is not None else int(round(warmup_epochs * steps_per_epoch))
    lr = float(optimizer.defaults["lr"])
    schedule = WarmupCosine(int(total_steps), warmup, lr, min_lr=min_lr, warmup_lr=warmup_lr)
    if warmup > total_steps:  # the configured ramp (as timm's schedulers), not one squeezed into the run
        rank_zero_info(
            f"learning-rate schedule: the run ({total_steps} steps) ends inside its warmup ({warmup} steps): the rate "
            f"rises to {schedule.lr_at(int(total_steps) - 1):.4g} of lr={lr:.4g}, with no cosine decay"
        )
    return WarmupCosineLR(optimizer, schedule)


def follow_epochs(trainer: Any) -> None:
    """A run of ``trainer.max_epochs`` resumed with another number of optimizer steps an epoch (``trainer.devices``,
    ``data.batch_size``, ``trainer.accumulate_grad_batches`` changed) continues its :class:`WarmupCosineLR` where an
    uninterrupted run of the new settings is after the epochs done, ``epoch * steps_per_epoch`` (timm's ``train.py``:
    ``num_updates = epoch * updates_per_epoch``), not at the optimizer steps taken: else 1 process resumed on 2 (half
    the steps an epoch) spent the added epochs at ``min_lr``. A run of ``trainer.max_steps`` keeps its steps."""
    per_epoch = resumed_epochs(trainer)
    if per_epoch is None:  # a fresh run, a resume inside an epoch, a run of max_steps
        return
    position = trainer.current_epoch * per_epoch
    for config in trainer.lr_scheduler_configs:
        sched = config.scheduler
        if not isinstance(sched, WarmupCosineLR) or sched.lr_lambdas[0].offset == position - sched.last_epoch:
            continue
        before = [group["lr"] for group in sched.optimizer.param_groups]
        for f in sched.lr_lambdas:
            f.offset = position - sched.last_epoch
        sched.set_rates()
        rank_zero_info(
            f"learning-rate schedule: the {trainer.current_epoch} epoch(s) done are step {position} of this run's "
            f"({per_epoch} an epoch), where the checkpoint took {sched.last_epoch} optimizer steps: continuing at step "
            f"{position}: lr {before[0]:.4g} -> {sched.get_last_lr()[0]:.4g}"
        )
