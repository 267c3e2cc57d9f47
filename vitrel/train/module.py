"""The image-classification LightningModule.

Loss: cross-entropy with label smoothing, or, with ``mixup`` (timm ``Mixup``), soft-target
cross-entropy on the mixed, smoothed targets. Optimizer and schedule: given as factories
(``_partial_`` config nodes, as in lightning-hydra-template), completed here with the parameter
groups (no weight decay on position tables, RoPE frequencies, embeddings, tokens, norms and biases:
:func:`vitrel.train.optim.param_groups`) and the run's length. Optional EMA of the weights (timm
``ModelEmaV3`` as ``ema_model``), used for validation and test when ``ema_eval``. Metrics: top-1 /
top-5 accuracy (torchmetrics); the losses' epoch means are torchmetrics ``MeanMetric`` objects too (exact over ranks).
The training metrics' running totals are part of the state dict (``persistent``), so a run resumed
from a mid-epoch checkpoint ends the epoch with the metrics of the uninterrupted run; under DDP a checkpoint holds
their sums over the ranks, and a resume gives them to rank 0 (the other ranks start from zero).

Batches are ``(images [B, C, H, W], targets [B])`` or, with ``data.packing``, ``(NaFlex batch dict, targets
[num_images])`` (:mod:`vitrel.data.packing`: rows packing several images; the model returns one row of logits per
image, in the targets' order); losses and metrics count images, and a packed batch's ``padding_fraction`` is logged
as ``train/padding``. timm's ``Mixup`` mixes image tensors, timm's ``NaFlexMixup`` NaFlex batches
(:mod:`vitrel.train.mixing`; each refuses the other's batches). Video
batches are ``(clips [B, C, T, H, W], targets [B])``; mixup / CutMix mixes whole clips (:func:`mix_clips`). An
evaluation batch ``(clips [B, K, C, T, H, W], targets [B])`` holds ``K`` clips (views) of each of ``B`` videos: the
``B * K`` clips go through the network as one batch, a video's probabilities are the mean of its clips' softmax (as
``predict.py``'s), accuracy is of those, and the loss is the negative log of the mean probability of the target
(:func:`vitrel.inference.mean_softmax_log`); losses and metrics count videos.

Checkpoints hold the network under ``model.*`` (``ema_model.module.*`` for the EMA copy, and the same tensors,
stored once, under ``checkpoint["state_dict_ema"]`` with the network's own keys, where timm's ``load_checkpoint``
looks for an EMA copy), the config that rebuilds it under ``checkpoint["vitrel_cfg"]``, so
``vitrel.load_model(path)`` works on them, and the preprocessing of the data it was trained on under
``hyper_parameters["data_config"]`` (timm's data-config fields, :func:`data_config_of`), which ``predict.py``,
``python -m vitrel.export`` and ``vitrel.load_model`` (the model's ``pretrained_cfg``) use.

``compile=True`` (or a dict of ``torch.compile`` arguments) runs the training and evaluation steps
through ``torch.compile(model)``, held outside the module tree: the state-dict keys stay ``model.*`` and
``self.model`` stays the eager network for everything else (prediction, export, the study's scoring at other
sizes). With ``mode="reduce-overhead"`` (CUDA graphs) every step starts with
``torch.compiler.cudagraph_mark_step_begin``. NaFlex batches (and lists of images) run the eager network, with a
warning the first time: each image's grid is Python data the graph specialises on, so every new layout would be a new
graph (a compile per batch, until torch's ``recompile_limit`` made the model eager anyway, unsaid). With the data's
``size_choices`` (``data_config``) it compiles with ``dynamic=False`` unless ``compile`` names ``dynamic``: a static
graph per size (:meth:`ClassifierModule.compile_kwargs`).

``sync_free=True`` keeps the host from waiting on the device in the training step (``conf/step/fast.yaml``): the
training loss and accuracy are accumulated on the device (torchmetrics ``update``, without the per-batch value
nor its input checks) and logged at epoch end only (no ``train/loss_step``), so nothing is read back per step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import MulticlassAccuracy

from vitrel.inference import mean_softmax_log
from vitrel.models.data_config import data_config_of, example_input
from vitrel.models.naflex import input_form
from vitrel.train.data_contract import check_targets, planned_steps
from vitrel.train.flops import attn_pool_uncounted, count_cpu_attention
from vitrel.train.freeze import check_unfreeze_ranks
from vitrel.train.freeze import freeze_backbone as freeze_backbone_of
from vitrel.train.loop_rules import window_scale
from vitrel.train.mixing import check_mixup_fits, mix_clips, mix_naflex
from vitrel.train.module_checkpoint import load_extras, save_extras
from vitrel.train.module_load import module_parts
from vitrel.train.optim import check_float16_eps, follow_epochs, param_groups

__all__ = ["ClassifierModule", "ImageMean", "mix_clips"]


class ImageMean(MeanMetric):
    """torchmetrics' ``MeanMetric`` of a per-batch value weighted by the batch's images (``update(loss, weight=n)``),
    with a NaN passed through (``NaNGuard`` stops on it) and no read-back: ``MeanMetric``'s own NaN strategies either
    test the values on the host every step (``.any()``: a sync, which ``step=fast`` avoids) or, ``"disable"``, set
    every weight to 1 (torchmetrics 1.9: a mean over batches, a short last batch counting as a full one)."""

    def __init__(self) -> None:
        super().__init__(nan_strategy="disable")

    def update(self, value: Tensor | float, weight: Tensor | float | None = None) -> None:
        # in the totals' dtype: the metric's own (self.dtype) follows a move made under Lightning's *-true precision
        # (which sets the default dtype in the steps) to bfloat16, and the values were rounded to it
        dtype = self.mean_value.dtype
        value = torch.as_tensor(value, dtype=dtype, device=self.device)
        weight = torch.ones_like(value) if weight is None else torch.as_tensor(weight, dtype=dtype, device=self.device)
        weight = torch.broadcast_to(weight, value.shape)
        self.mean_value += (value * weight).sum()
        self.weight += weight.sum()


#: why compile leaves NaFlex batches to the eager network (warned once per module)
COMPILE_LAYOUT = (
    "module.compile: NaFlex batches (data.packing) run the eager network: each batch's layout of image sizes would be "
    "a new graph (a recompile per batch, until torch's recompile_limit makes it eager anyway); image batches stay "
    "compiled. module.compile=false runs everything eager without this warning"
)


#: why a model with FlexAttention gets no example input (so no FLOPs in Lightning's model summary)
SUMMARY_FLEX = (
    "model summary: no FLOPs counted: attn_impl='flex' (compiled FlexAttention) does not run under FlopCounterMode"
)


class ClassifierModule(L.LightningModule):
    """Train / evaluate an image classifier ``model`` (any ``nn.Module`` mapping images to logits).

    Args:
        model: the network; kept as ``self.model``.
        optimizer: ``optimizer(params=...)`` -> a torch optimizer, e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.05)`` (the default). It gets
            :func:`~vitrel.train.optim.param_groups`; the decay group takes its ``weight_decay``.
        scheduler: None (constant rate) or ``scheduler(optimizer, **run_length)`` -> a torch LR
            scheduler stepped every optimizer step, e.g. ``functools.partial(vitrel.train.optim.warmup_cosine,
            warmup_epochs=1, min_lr=1e-5)``; ``total_steps`` and ``steps_per_epoch`` are passed when it takes them.
        num_classes: number of classes (metrics, mixup targets); default ``model.num_classes``.
        label_smoothing: for the cross-entropy (also applied to mixup targets).
        mixup: None, or ``mixup(num_classes=..., label_smoothing=...)`` -> timm ``Mixup``, e.g.
            ``functools.partial(timm.data.Mixup, mixup_alpha=0.8, cutmix_alpha=1.0)``. Needs an even
            per-device batch (``data.drop_last=true``).
        ema: None, or ``ema(model)`` -> timm ``ModelEmaV3``, e.g.
            ``functools.partial(timm.utils.ModelEmaV3, decay=0.9998, use_warmup=True)``; updated after
            every optimizer step with the count of steps taken, that one included (1 at the first: timm's
            ``train.py``'s ``num_updates``; the first update copies the weights).
        ema_eval: validate / test with the EMA weights (when ``ema`` is given).
        compile: False, True or a dict of ``torch.compile`` kwargs (``{"backend": "eager"}``,
            ``{"mode": "reduce-overhead", "dynamic": False}``): the steps' network (``step_model``), compiled
            with ``dynamic=False`` under the data's ``size_choices`` unless they name ``dynamic``.
        sync_free: no host synchronisation in the training step: training metrics updated on the device
            and logged at epoch end only (see the module's docstring).
        grad_checkpointing: recompute each block's activations in the backward pass instead of storing them
            (timm's ``model.set_grad_checkpointing()``, as timm's ``train.py --grad-checkpointing``): less memory.
        layer_decay: None, or timm's layer-wise learning-rate decay for fine-tuning (e.g. 0.65): the
            layers of ``model.group_matcher()`` get ``lr * layer_decay ** depth_from_top``.
        freeze_backbone: train the head alone (linear / attentive probing, :mod:`vitrel.train.freeze`): every
            other parameter frozen, the backbone kept in eval mode.
        unfreeze_backbone_at_epoch: with ``freeze_backbone``, the epoch (from 0) from which the whole model trains
            (LP-FT); the optimizer holds every parameter from the start (none steps before it has a gradient).
        data_config: the preprocessing of the data (:func:`data_config_of`), stored in the checkpoints'
            ``hyper_parameters``; None: taken from the trainer's data module at ``setup`` (a vitrel data module).
        started_from: the pretrained weights the run started from, as its config names them
            (:func:`~vitrel.train.build.weights_source`; empty: none), stored in the checkpoints'
            ``hyper_parameters``: a resume from other weights is refused
            (:func:`~vitrel.train.resume.check_same_start`). None: not recorded, not checked.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        *,
        num_classes: int | None = None,
        label_smoothing: float = 0.0,
        mixup: Callable[..., Any] | None = None,
        ema: Callable[[nn.Module], nn.Module] | None = None,
        ema_eval: bool = True,
        compile: bool | dict = False,
        layer_decay: float | None = None,
        sync_free: bool = False,
        grad_checkpointing: bool = False,
        freeze_backbone: bool = False,
        unfreeze_backbone_at_epoch: int | None = None,
        data_config: Mapping[str, Any] | None = None,
        started_from: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        num_classes = int(num_classes if num_classes is not None else getattr(model, "num_classes", 0))
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 (or the model's num_classes), got {num_classes}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        hparams = {"num_classes": num_classes, "label_smoothing": float(label_smoothing)}
        hparams["data_config"] = None if data_config is None else dict(data_config)
        hparams["started_from"] = None if started_from is None else dict(started_from)
        hparams["ema_eval"] = bool(ema_eval)  # the weights val and test score: eval.py's ema=auto scores the same
        self.save_hyperparameters(hparams, logger=False)
        if grad_checkpointing:
            model.set_grad_checkpointing(True)  # (an nn.Module without it: AttributeError naming the method)
        self.model = model
        if unfreeze_backbone_at_epoch is not None and (not freeze_backbone or unfreeze_backbone_at_epoch < 1):
            raise ValueError(
                f"unfreeze_backbone_at_epoch={unfreeze_backbone_at_epoch} needs freeze_backbone=true and an epoch >= 1"
            )
        self._frozen = freeze_backbone_of(model) if freeze_backbone else None  # (not modules: not registered twice)
        self.unfreeze_at = unfreeze_backbone_at_epoch
        self.num_classes = num_classes
        self.label_smoothing = float(label_smoothing)
        self.make_optimizer = optimizer or functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.05)
        self.make_scheduler = scheduler
        if layer_decay is not None and not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
        self.layer_decay = layer_decay
        self.mixup_fn = mixup(num_classes=num_classes, label_smoothing=label_smoothing) if mixup else None

        self.ema_model: nn.Module | None = None
        if ema is not None:
            self.ema_model = ema(model)  # ModelEmaV3 keeps a deep copy as .module (keys ema_model.module.*)
            self.ema_model.requires_grad_(False)  # updated by averaging, never by the optimizer (nor DDP)
        self.ema_eval = bool(ema_eval)

        kw = {} if compile is True else dict(compile or {})
        self._compile_kw: dict[str, Any] | None = kw if compile else None
        # a tuple, not an attribute holding a module: not registered, so the state-dict keys stay model.*; built at
        # the first step (after setup, which may fill in the data's size choices: compile_kwargs)
        self._compiled: tuple[nn.Module, ...] = ()
        self._ema_cast: tuple[nn.Module, ...] = ()  # the EMA in the weights' dtype for an evaluation epoch (*-true)
        self._warned_layout = False  # COMPILE_LAYOUT said (once)
        self._mark_steps = kw.get("mode") in ("reduce-overhead", "max-autotune")  # the modes with CUDA graphs
        self.sync_free = bool(sync_free)

        # top-5 as timm's; with 5 classes or fewer every label is in the top 5 (always 1.0): not logged
        self.top_k: int | None = 5 if num_classes > 5 else None
        self.train_loss = ImageMean()  # NaNGuard stops on a non-finite loss
        # sync_free: no input checks (torchmetrics' read the targets back to the host)
        self.train_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro", validate_args=not self.sync_free)
        self.train_padding = ImageMean()  # NaFlex batches: the epoch's share of padding tokens, per image
        for m in self.train_metrics.values():
            m.persistent(True)  # running totals in checkpoints: a mid-epoch resume continues the epoch's
        # the evaluation losses' epoch means as metrics (float sums of loss x images and of images, summed over the
        # ranks): Lightning's sync_dist mean of a logged tensor divides the summed image count (an integer tensor) by
        # the ranks with integer truncation under gloo, so an odd total made val/loss N / (N - 1) times too large
        self.val_loss = ImageMean()
        self.test_loss = ImageMean()
        self.val_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.test_acc1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        if self.top_k is not None:
            self.val_acc5 = MulticlassAccuracy(num_classes, top_k=5, average="micro")
            self.test_acc5 = MulticlassAccuracy(num_classes, top_k=5, average="micro")

    def train(self, mode: bool = True) -> ClassifierModule:
        """``nn.Module.train``; a frozen backbone (``freeze_backbone``) stays in eval mode."""
        super().train(mode)
        for m in self._frozen.modules if self._frozen is not None else ():
            m.eval()
        return self

    @property
    def train_metrics(self) -> dict[str, Metric]:
        """The metrics accumulated over a training epoch (kept in checkpoints)."""
        return {"train_loss": self.train_loss, "train_acc1": self.train_acc1, "train_padding": self.train_padding}

    def metric_names(self, test: bool = True) -> list[str]:
        """The names a fit of this module (and, with ``test``, its test) may put in ``trainer.callback_metrics``,
        what ``train.py``'s ``optimized_metric`` may name (checked before the fit); Lightning names a value logged
        per step and per epoch also with ``_step`` / ``_epoch``. A subclass that logs more extends the list."""
        names = [f"train/{m}{e}" for m in ("loss", "padding") for e in ("", "_step", "_epoch")]  # (acc1: not mixed)
        names += ["train/acc1"] * (self.mixup_fn is None)
        for stage in ("val", "test") if test else ("val",):
            names += [f"{stage}/loss", f"{stage}/acc1"] + ([f"{stage}/acc5"] if self.top_k is not None else [])
        return names

    # ------------------------------------------------------------------------------ forward
    @property
    def eval_model(self) -> nn.Module:
        """The network used for validation and test (the EMA copy when enabled and ``ema_eval``)."""
        return self.ema_model if self.ema_model is not None and self.ema_eval else self.model

    @property
    def scored_network(self) -> nn.Module:
        """:attr:`eval_model`'s network: the EMA copy unwrapped (timm's ``ModelEmaV3`` holds it as ``.module``)."""
        return self.ema_model.module if self.eval_model is self.ema_model else self.model

    @property
    def step_model(self) -> nn.Module:
        """The network the training and evaluation steps call: ``torch.compile(self.model)`` with ``compile``,
        else ``self.model`` (the same parameters either way)."""
        if self._compile_kw is None:
            return self.model
        if not self._compiled:
            self._compiled = (torch.compile(self.model, **self.compile_kwargs()),)
        return self._compiled[0]

    def compile_kwargs(self) -> dict[str, Any]:
        """The ``torch.compile`` kwargs of :attr:`step_model`: ``compile``'s, with ``dynamic=False`` when the data has
        ``size_choices`` (``data_config``) and they do not name ``dynamic``: a graph per size, bounded by the number
        of choices, where torch's automatic dynamic shapes (``dynamic=None``) recompiled the second size with symbolic
        sizes (a tiny Swin: not done in 5 min; each static size: seconds). Warns once when the choices and the
        evaluation size are more graphs than torch's ``recompile_limit``."""
        kw = dict(self._compile_kw or {})
        choices = (self.hparams.get("data_config") or {}).get("size_choices")
        if not choices or "dynamic" in kw:
            return kw
        graphs = len(set(choices)) + 1  # a graph per training size, one for evaluation
        limit = torch._dynamo.config.recompile_limit
        if graphs > limit:
            rank_zero_warn(
                f"module.compile: data.size_choices={list(choices)} compile a graph per size ({graphs} with "
                f"evaluation's), over torch._dynamo.config.recompile_limit={limit}: past it the steps run eager; "
                f"raise the limit, or set module.compile.dynamic"
            )
        return {**kw, "dynamic": False}

    def _net_for(self, x: Tensor | dict | list) -> nn.Module:
        """:attr:`step_model`, except for a NaFlex dict or a list of images under ``compile``: the eager network
        (:data:`COMPILE_LAYOUT`, warned once)."""
        if self._compile_kw is None or input_form(x) == "images":
            return self.step_model
        if not self._warned_layout:
            self._warned_layout = True
            rank_zero_warn(COMPILE_LAYOUT)
        return self.model

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> ClassifierModule:  # type: ignore[override]
        """Lightning's ``load_from_checkpoint``; on a checkpoint ``train.py`` wrote it needs nothing more: the network
        is rebuilt from the stored ``vitrel_cfg``, with its EMA copy when the checkpoint holds one
        (:func:`~vitrel.train.module_load.module_parts`), unless ``model=`` / ``ema=`` are given. The optimizer,
        schedule and mixup are not hyper-parameters: defaults unless given (``train.py``'s resume restores a run)."""
        parts = module_parts(checkpoint_path, set(kwargs))
        return super().load_from_checkpoint(checkpoint_path, *args, **parts, **kwargs)

    def forward(self, x: Tensor | dict) -> Tensor:
        return self.model(x)

    def _step_begins(self) -> None:
        if self._mark_steps:  # CUDA graphs: the previous step's outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()

    # ------------------------------------------------------------------------------ steps
    def training_step(self, batch: tuple[Tensor | dict, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        n = _num_images(x, y)
        # their range: a read of the device (the eager step reads it anyway: its metrics check their inputs)
        check_targets(y, self.num_classes, values=not self.sync_free)
        self._step_begins()
        if self.mixup_fn is not None:
            x, target = self.mix(x, y)  # soft targets, smoothed by the mixer
            logits = self._net_for(x)(x)
            loss = F.cross_entropy(logits.float(), target)  # = timm's SoftTargetCrossEntropy
        else:
            logits = _check_logits(self._net_for(x)(x), y)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=self.label_smoothing)
            if self.sync_free:  # update only: the metric's forward computes (and logging reads) a per-batch value
                self.train_acc1.update(logits, y)
            else:
                self.train_acc1(logits, y)
            self.log("train/acc1", self.train_acc1, on_step=False, on_epoch=True, batch_size=n)
        if self.sync_free:  # the epoch value only (the mean over samples; the weight made on the device, no copy),
            self.train_loss.update(loss.detach(), weight=loss.detach().new_full((), n))  # named as the eager one's
            self.log("train/loss_epoch", self.train_loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=n)
        else:
            self.train_loss(loss.detach(), weight=n)  # the epoch value: the mean over samples
            self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=n)
        if input_form(x) == "naflex" and "padding_fraction" in x:  # NaFlex batches: the share of padding tokens
            padding = x["padding_fraction"].float()  # the epoch's mean a metric: over the ranks, kept in checkpoints
            if self.sync_free:
                self.train_padding.update(padding, weight=padding.new_full((), n))
                self.log("train/padding_step", padding, on_step=True, on_epoch=False, batch_size=n)
                self.log("train/padding_epoch", self.train_padding, on_step=False, on_epoch=True, batch_size=n)
            else:
                self.train_padding(padding, weight=n)
                self.log("train/padding", self.train_padding, on_step=True, on_epoch=True, batch_size=n)
        return loss * window_scale(self, batch_idx)  # (an epoch's last, partial window: its own mean)

    def mix(self, x: Tensor | dict, y: Tensor) -> tuple[Tensor | dict, Tensor]:
        """The batch ``(x, y)`` mixed by ``mixup`` as the training step mixes it (:mod:`vitrel.train.mixing`): the
        mixed input and the soft targets ``[B, num_classes]``. timm's ``Mixup`` mixes an image tensor in place."""
        check_mixup_fits(self.mixup_fn, input_form(x) == "naflex")
        if input_form(x) == "naflex":  # (timm's NaFlexMixup: the images put back, mixed, cut again)
            return mix_naflex(self.mixup_fn, x, y, self.model.patch_embed.proj.kernel_size[0])
        if x.shape[0] % 2:
            raise ValueError(
                f"mixup/cutmix needs an even batch, got {x.shape[0]}: use an even data.batch_size "
                "and data.drop_last=true"
            )
        return mix_clips(self.mixup_fn, x, y)

    def on_train_start(self) -> None:
        follow_epochs(self.trainer)  # (a resume with other steps an epoch: the schedule where the epochs done put it)
        self._unfreeze_when_due()  # (a resume mid-epoch, past the epoch: Lightning starts no epoch there)

    def on_train_epoch_start(self) -> None:
        self._unfreeze_when_due()
        if hasattr(self.mixup_fn, "set_epoch"):  # timm's NaFlexMixup: off from its mixup_off_epoch (0: never)
            self.mixup_fn.set_epoch(self.current_epoch)

    def _unfreeze_when_due(self) -> None:
        """LP-FT (``unfreeze_backbone_at_epoch``): the whole model trains from that epoch on."""
        if self._frozen is not None and self.unfreeze_at is not None and self.current_epoch >= self.unfreeze_at:
            self._frozen.unfreeze(self.training)
            self._frozen = None
            rank_zero_info(f"epoch {self.current_epoch}: the backbone is unfrozen (module.unfreeze_backbone_at_epoch)")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # an epoch's first batch starts from zero; Lightning resets after each epoch, but a run resumed
        # from an end-of-epoch checkpoint loads that epoch's totals (a mid-epoch resume keeps them)
        if batch_idx == 0:
            for m in self.train_metrics.values():
                m.reset()

    def _eval_step(self, batch: tuple[Tensor | dict, Tensor] | None, stage: str) -> dict[str, Tensor] | None:
        if batch is None:  # every file of the batch unreadable, left out (data.on_bad_sample=skip)
            return None
        x, y = batch
        n = _num_images(x, y)
        check_targets(y, self.num_classes)
        self._step_begins()
        logits = self._scored_logits(x)
        if isinstance(x, Tensor) and x.dim() == 6:  # (clips of videos: the log of the mean of each video's softmax)
            loss = F.nll_loss(logits, y)
        else:
            logits = _check_logits(logits, y)
            loss = F.cross_entropy(logits.float(), y)
        acc1 = self.val_acc1 if stage == "val" else self.test_acc1
        acc1(logits, y)
        mean_loss = self.val_loss if stage == "val" else self.test_loss
        mean_loss.update(loss.detach(), weight=n)  # (update: no per-batch value computed)
        self.log(f"{stage}/loss", mean_loss, on_epoch=True, prog_bar=stage == "val", batch_size=n)
        self.log(f"{stage}/acc1", acc1, on_epoch=True, prog_bar=stage == "val", batch_size=n)
        if self.top_k is not None:
            acc5 = self.val_acc5 if stage == "val" else self.test_acc5
            acc5(logits, y)
            self.log(f"{stage}/acc5", acc5, on_epoch=True, batch_size=n)
        return {"logits": logits.detach(), "target": y}  # (the test's: callbacks' on_test_batch_end, per_class)

    def _scored_logits(self, x: Tensor | dict) -> Tensor:
        """The logits of the weights validation and test score (the EMA copy unless ``ema_eval=False``); clips of
        videos ``[B, K, C, T, H, W]`` (``K`` clips of each of ``B`` videos): each video's log mean softmax."""
        net = self._net_for(x) if self.eval_model is self.model else (self._ema_cast or (self.eval_model,))[0]
        if isinstance(x, Tensor) and x.dim() == 6:
            return mean_softmax_log(net(x.flatten(0, 1)), x.shape[1])
        return net(x)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor | None:
        """Lightning's ``trainer.predict``: the logits test scores (:meth:`_scored_logits`) of a batch of inputs, or of
        ``(inputs, targets)`` pairs as the data loaders give them (the targets unused)."""
        if batch is None:  # (every file of the batch unreadable, data.on_bad_sample=skip)
            return None
        pair = isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], Tensor)
        return self._scored_logits(batch[0] if pair and batch[1].dim() == 1 else batch)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor] | None:
        return self._eval_step(batch, "test")

    # ------------------------------------------------------------------------------ EMA
    def to(self, *args: Any, **kwargs: Any) -> ClassifierModule:
        """``nn.Module.to``, except that a cast below float32 leaves the dtype of the EMA copy and of the metrics'
        running totals (they move with the device): Lightning's ``trainer.precision=bf16-true`` / ``16-true`` cast the
        module so. An EMA update ``(1 - decay) * (w - ema)`` of a decay near 1 is below bfloat16's resolution (timm
        rounds it stochastically: 200 steps at 0.9998 left the EMA 31 % off a float64 EMA of the same weights) and
        float16's (zero), and a bfloat16 sum of losses and image counts drifts (9000 images counted as 9024, the
        epoch's loss 3 % off). They stay in float32; validation and test score a copy of the EMA cast to the weights'
        dtype."""
        kept = {name: m for name, m in self.named_children() if m is self.ema_model or isinstance(m, Metric)}
        before = self.dtype
        for name in kept:  # (their slots emptied for the cast: the rest of the module casts as nn.Module's)
            setattr(self, name, None)
        try:
            super().to(*args, **kwargs)
        finally:
            for name, m in kept.items():
                setattr(self, name, m)
        widened = self.dtype != before and self.dtype.itemsize >= 4  # (64-true: in float64 too)
        for m in kept.values():
            m.to(device=self.device, dtype=self.dtype if widened else None)
        return self

    def _cast_ema(self) -> tuple[nn.Module, ...]:
        """The EMA copy in the weights' dtype, when it is scored and kept wider (:meth:`to`), else none."""
        if self.eval_model is self.model:
            return ()
        weights = next(self.model.parameters()).dtype
        if next(self.ema_model.parameters()).dtype == weights:
            return ()
        return (copy.deepcopy(self.ema_model.module).to(dtype=weights),)

    def on_validation_epoch_start(self) -> None:
        self._ema_cast = self._cast_ema()

    def on_validation_epoch_end(self) -> None:
        self._ema_cast = ()

    on_test_epoch_start = on_predict_epoch_start = on_validation_epoch_start
    on_test_epoch_end = on_predict_epoch_end = on_validation_epoch_end

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema_model is not None:  # step: the updates so far, this one included, as timm's train.py counts them
            self.ema_model.update(self.model, step=self.global_step + 1)  # (global_step counts it once this returns)

    # ------------------------------------------------------------------------------ optimizer
    def configure_gradient_clipping(
        self, optimizer: Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        """Lightning's clipping, except under ``bf16-mixed``, where a fused optimizer (``step=fast``'s AdamW) is clipped
        as in 32-bit: Lightning's AMP plugin refuses clipping with any optimizer that unscales gradients in its step
        ("does not allow for gradient clipping ... Are you using a 'fused' optimizer?", Lightning issue #21435), which
        is right with 16-mixed's GradScaler, but bf16 has no scaler: the gradients are unscaled already."""
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)  # MixedPrecision's less the check
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Optimizer | dict:
        base_lr = getattr(self.make_optimizer, "keywords", {}).get("lr")
        with contextlib.ExitStack() as stack:  # (LP-FT: the frozen parameters too, to train after unfreezing)
            if self._frozen is not None and self.unfreeze_at is not None:
                stack.enter_context(_requiring_grad(self._frozen.params))
            groups = param_groups(self.model, self.layer_decay, base_lr)
        return self.with_schedule(self.make_optimizer(params=groups))

    def with_schedule(self, opt: Optimizer) -> Optimizer | dict:
        """Lightning's answer for ``opt``: with ``scheduler``, stepped every optimizer step over the run's length."""
        check_float16_eps(opt)  # 16-true: AdamW's eps=1e-8 is 0 in float16, refused before a NaN at step 1
        if self.make_scheduler is None:
            return opt
        total = planned_steps(self.trainer)  # (no batch in an epoch: the data's sizes named)
        per_epoch = max(1, -(-self.trainer.num_training_batches // self.trainer.accumulate_grad_batches))
        run_length = {"total_steps": int(total), "steps_per_epoch": int(per_epoch)}
        make = self.make_scheduler
        target = make.func if isinstance(make, functools.partial) else make
        try:
            accepted = inspect.signature(target).parameters
        except (TypeError, ValueError):
            accepted = {}
        sched = make(opt, **{k: v for k, v in run_length.items() if k in accepted})
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    # ------------------------------------------------------------------------------ checkpoints
    def setup(self, stage: str) -> None:
        """The data module's preprocessing into the hyper-parameters (so into every checkpoint), unless given, and
        one sample of its shape (:func:`~vitrel.models.data_config.example_input`) as Lightning's
        ``example_input_array`` (the model summary's FLOPs and sizes), unless set; none with ``attn_impl="flex"``
        (:data:`SUMMARY_FLEX`) or ``global_pool="map"`` (:data:`~vitrel.train.flops.ATTN_POOL_UNCOUNTED`). LP-FT in
        one run is refused over several processes (:func:`~vitrel.train.freeze.check_unfreeze_ranks`)."""
        if stage == "fit" and self.unfreeze_at is not None:
            check_unfreeze_ranks(self.trainer.world_size)
        if self.hparams.get("data_config") is None:
            self.hparams["data_config"] = data_config_of(getattr(self.trainer, "datamodule", None))
        if self._example_input_array is not None:
            return
        flex = any(getattr(m, "attn_impl", None) == "flex" for m in self.model.modules())
        why = SUMMARY_FLEX if flex else attn_pool_uncounted(self.model)
        if why:  # (a forward torch's FlopCounterMode cannot run)
            rank_zero_info(why if flex else f"model summary: no FLOPs counted: {why}")
            return
        count_cpu_attention()  # (torch counts sdpa's CUDA kernels only)
        self.example_input_array = example_input(self.hparams["data_config"])

    @property
    def example_input_array(self) -> Tensor | None:
        """Lightning's example input, in the network's floating dtype (a ``*-true`` precision casts the weights
        after ``setup``)."""
        x = self._example_input_array
        p = next((p for p in self.model.parameters() if p.is_floating_point()), None)
        return x.to(p.dtype) if isinstance(x, Tensor) and p is not None else x

    @example_input_array.setter
    def example_input_array(self, example: Any) -> None:
        self._example_input_array = example

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_extras(self, checkpoint)  # the model's config, timm's state_dict_ema, the ranks' metric totals

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        load_extras(self, checkpoint)  # older layouts, the metric totals to rank 0, the EMA copy


def _num_images(x: Tensor | Mapping, y: Tensor) -> int:
    """Images in a batch: its first dimension, or (a NaFlex batch dict, rows packing several images) its targets'."""
    return int(y.shape[0]) if input_form(x) == "naflex" else int(x.shape[0])


def _check_logits(logits: Tensor, y: Tensor) -> Tensor:
    if logits.shape[0] != y.shape[0]:
        raise ValueError(
            f"the model returned {logits.shape[0]} rows of logits for {y.shape[0]} targets: a NaFlex batch "
            "(data.packing) needs a model that returns one row per image (row-major over rows, then segments)"
        )
    return logits


@contextlib.contextmanager
def _requiring_grad(params: tuple[nn.Parameter, ...]):
    """``params`` with ``requires_grad`` on inside the block (timm's parameter groups leave frozen ones out)."""
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(False)
