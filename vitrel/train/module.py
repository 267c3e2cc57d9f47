"""The image-classification LightningModule.

Loss: cross-entropy with label smoothing, or, with mixup/cutmix (timm ``Mixup``), soft-target
cross-entropy on the mixed, smoothed targets. Optimizer: AdamW without weight decay on position
tables, RoPE frequencies, embeddings, tokens, norms and biases (``optim.param_groups``), with a
per-step warmup + cosine schedule. Optional EMA of the weights (``ema_model``), used for
validation and test when ``ema_eval``. Metrics: top-1 / top-5 accuracy (torchmetrics).

Checkpoints hold the network under ``model.*`` (``ema_model.*`` for the EMA copy) and the
config that rebuilds it under ``checkpoint["vitrel_cfg"]``, so ``vitrel.load_model(path)`` works
on them. ``compile=True`` compiles the network in place (``nn.Module.compile``), which keeps the
state-dict keys as they are.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from vitrel.train.optim import WarmupCosine, param_groups

__all__ = ["ClassifierModule"]


class ClassifierModule(L.LightningModule):
    """Train / evaluate an image classifier ``model`` (any ``nn.Module`` mapping images to logits).

    Args:
        model: the network; kept as ``self.model``.
        num_classes: number of classes (metrics, mixup targets).
        lr, weight_decay, betas, eps: AdamW.
        warmup_epochs / warmup_steps: linear warmup length (steps win when given).
        min_lr, warmup_lr: cosine floor and warmup start (absolute learning rates).
        label_smoothing: for the cross-entropy (also applied to mixup targets).
        mixup_alpha, cutmix_alpha, mixup_prob, mixup_switch_prob, mixup_mode: timm ``Mixup``;
            off when both alphas are 0. Needs an even per-device batch (``data.drop_last=true``).
        ema_decay: EMA decay of the weights (None: no EMA); ``ema_warmup`` ramps it as
            ``min(decay, (1 + s) / (10 + s))``; ``ema_eval`` validates/tests with the EMA weights.
        compile: False, True or a dict of ``torch.compile`` kwargs (``{"backend": "eager"}``).
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_epochs: float = 0.0,
        warmup_steps: int | None = None,
        min_lr: float = 0.0,
        warmup_lr: float = 0.0,
        label_smoothing: float = 0.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        mixup_mode: str = "batch",
        ema_decay: float | None = None,
        ema_warmup: bool = True,
        ema_eval: bool = True,
        compile: bool | dict = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"], logger=False)
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if ema_decay is not None and not 0.0 < ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1) or None, got {ema_decay}")
        self.model = model
        self.num_classes = int(num_classes)
        self.label_smoothing = float(label_smoothing)

        self.mixup_fn = None
        if mixup_alpha > 0 or cutmix_alpha > 0:
            from timm.data import Mixup

            self.mixup_fn = Mixup(
                mixup_alpha=mixup_alpha,
                cutmix_alpha=cutmix_alpha,
                prob=mixup_prob,
                switch_prob=mixup_switch_prob,
                mode=mixup_mode,
                label_smoothing=label_smoothing,
                num_classes=num_classes,
            )

        self.ema_model: nn.Module | None = None
        if ema_decay is not None:
            self.ema_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ema_decay = ema_decay
        self.ema_warmup = ema_warmup
        self.ema_eval = ema_eval

        if compile:
            self.model.compile(**(dict(compile) if isinstance(compile, dict) else {}))

        k = min(5, num_classes)
        self.top_k = k
        self.train_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_acc5 = MulticlassAccuracy(num_classes, top_k=k, average="micro")
        self.test_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_acc5 = MulticlassAccuracy(num_classes, top_k=k, average="micro")

    # ------------------------------------------------------------------------------ forward
    @property
    def eval_model(self) -> nn.Module:
        """The network used for validation and test (the EMA copy when enabled and ``ema_eval``)."""
        return self.ema_model if self.ema_model is not None and self.ema_eval else self.model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    # ------------------------------------------------------------------------------ steps
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        if self.mixup_fn is not None:
            if x.shape[0] % 2:
                raise ValueError(
                    f"mixup/cutmix needs an even batch, got {x.shape[0]}: use an even data.batch_size "
                    "and data.drop_last=true"
                )
            x, target = self.mixup_fn(x, y)
            logits = self.model(x)
            loss = torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        else:
            logits = self.model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
            self.train_acc1(logits, y)
            self.log("train/acc1", self.train_acc1, on_step=False, on_epoch=True)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        x, y = batch
        logits = self.eval_model(x)
        loss = F.cross_entropy(logits.float(), y)
        acc1, acc5 = (self.val_acc1, self.val_acc5) if stage == "val" else (self.test_acc1, self.test_acc5)
        acc1(logits, y)
        acc5(logits, y)
        self.log(f"{stage}/loss", loss, on_epoch=True, prog_bar=stage == "val", sync_dist=True)
        self.log(f"{stage}/acc1", acc1, on_epoch=True, prog_bar=stage == "val")
        self.log(f"{stage}/acc{self.top_k}", acc5, on_epoch=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    # ------------------------------------------------------------------------------ EMA
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema_model is not None:
            self._update_ema()

    @torch.no_grad()
    def _update_ema(self) -> None:
        """``ema <- d * ema + (1 - d) * model`` for float parameters and buffers (others copied)."""
        d = float(self.ema_decay)
        if self.ema_warmup:
            s = self.global_step
            d = min(d, (1.0 + s) / (10.0 + s))
        ema_p, model_p = [], []
        for e, m in zip(self.ema_model.parameters(), self.model.parameters()):
            ema_p.append(e)
            model_p.append(m.detach())
        torch._foreach_lerp_(ema_p, model_p, 1.0 - d)
        for e, m in zip(self.ema_model.buffers(), self.model.buffers()):
            if e.is_floating_point():
                e.lerp_(m, 1.0 - d)
            else:
                e.copy_(m)

    # ------------------------------------------------------------------------------ optimizer
    def configure_optimizers(self) -> dict:
        hp = self.hparams
        nwd = self.model.no_weight_decay() if hasattr(self.model, "no_weight_decay") else ()
        groups = param_groups(self.model, hp.weight_decay, nwd)
        opt = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        total = self.trainer.estimated_stepping_batches
        if not isinstance(total, int) and not float(total).is_integer():
            raise ValueError("the cosine schedule needs a finite run: set trainer.max_epochs or trainer.max_steps")
        total = int(total)
        if hp.warmup_steps is not None:
            warmup = int(hp.warmup_steps)
        else:
            per_epoch = max(1, -(-self.trainer.num_training_batches // self.trainer.accumulate_grad_batches))
            warmup = int(round(hp.warmup_epochs * per_epoch))
        warmup = min(warmup, total)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, WarmupCosine(total, warmup, hp.lr, min_lr=hp.min_lr, warmup_lr=hp.warmup_lr)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    # ------------------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        cfg = getattr(self.model, "vitrel_cfg", None)
        if cfg is not None:
            checkpoint["vitrel_cfg"] = copy.deepcopy(cfg)
