"""Many probes on one frozen backbone (``module=probe_grid``): V-JEPA 2's multi-head probing.

Frozen evaluations report the best of several probes, each trained at its own learning rate and weight decay.
V-JEPA 2 trains 20 attentive probes at once (``evals/video_classification_frozen/eval.py``, their configs'
``multihead_kwargs``: learning rates 5e-3 .. 1e-4 x weight decays 0.01 .. 0.8) on one forward of the frozen encoder
per batch, and reports the best. :class:`ProbeGridModule` does the same: the backbone's features once per batch
(``forward_features``), then every probe through the model's own ``forward_head``
(``torch.func.functional_call`` with the probe's parameters). A probe is a copy of the model's head parameters
(:data:`~vitrel.train.freeze.PROBE_MODULES`: the attention pool, the norm after pooling, the classifier), in an
optimizer group of its own (``lr``, ``weight_decay`` on all of its parameters, as theirs); the schedule scales every
group alike. The training loss is the sum of the probes' (each gets its own gradient), logged as their mean.

Validation scores every probe: ``val/acc1`` and ``val/loss`` are the best probe's (the highest top-1, the first of a
tie), ``val/best_probe`` its index and ``val/probe_acc1/<i>`` each one's. The best probe's weights are then copied
into the model's head, so a checkpoint holds the model with it (``load_model``, ``eval.py``, ``predict.py``, the
exports) and test scores it: the probe is chosen on val, never on test. The probes stay under ``probes.*`` for a
resume.

Not taken with it, each refused by name: EMA, ``compile`` and ``sync_free`` (``step=fast``: give ``step=eager``),
``layer_decay``, ``unfreeze_backbone_at_epoch``, NaFlex batches. Every probe starts from the model's head's initial
weights (V-JEPA 2 draws each afresh); top-5 is not logged for the probes (test's is, of the chosen one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics.classification import MulticlassAccuracy

from vitrel.config import ConfigError
from vitrel.inference import mean_softmax_log
from vitrel.models.naflex import input_form
from vitrel.train.data_contract import check_targets
from vitrel.train.freeze import PROBE_MODULES
from vitrel.train.module import ClassifierModule, ImageMean

__all__ = ["ProbeGridModule", "check_probes"]

#: what ``module=probe_grid`` does not take, and the setting that leaves each out
_REFUSED = {
    "ema": "module/ema=null",
    "compile": "module.compile=false (step=eager)",
    "sync_free": "module.sync_free=false (step=eager)",
    "layer_decay": "module.layer_decay=null",
    "unfreeze_backbone_at_epoch": "module.unfreeze_backbone_at_epoch=null",
}


def check_probes(probes: Any) -> list[dict[str, float]]:
    """``probes`` as ``[{"lr": ..., "weight_decay": ...}, ...]``: a non-empty list of those two keys, a learning rate
    above 0 and a weight decay at least 0; else ``ValueError`` naming ``module.probes``."""
    if not isinstance(probes, Sequence) or isinstance(probes, str) or not probes:
        raise ValueError(f"module.probes must be a non-empty list of {{lr, weight_decay}}, got {probes!r}")
    out = []
    for i, p in enumerate(probes):
        if not isinstance(p, Mapping) or set(p) != {"lr", "weight_decay"}:
            raise ValueError(f"module.probes[{i}] must be {{lr: <rate>, weight_decay: <decay>}}, got {p!r}")
        lr, wd = float(p["lr"]), float(p["weight_decay"])
        if not (lr > 0 and wd >= 0):
            raise ValueError(f"module.probes[{i}]: lr must be > 0 and weight_decay >= 0, got {dict(p)}")
        out.append({"lr": lr, "weight_decay": wd})
    return out


class _Probe(nn.Module):
    """One probe: a trainable copy of each head parameter of ``model`` (``names``), stored under the name with its
    dots as ``__`` (``head__weight``)."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        own = dict(model.named_parameters())
        self.weights = nn.ParameterDict({n.replace(".", "__"): nn.Parameter(own[n].detach().clone()) for n in names})

    def by_name(self) -> dict[str, nn.Parameter]:
        """The parameters under the model's names (``head.weight``)."""
        return {k.replace("__", "."): p for k, p in self.weights.items()}


class _ForwardHead(nn.Module):
    """``net.forward_head`` as a forward, which ``functional_call`` calls (held in a tuple: never registered)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, feats: Any) -> Tensor:
        return self.net.forward_head(feats)


class ProbeGridModule(ClassifierModule):
    """:class:`~vitrel.train.module.ClassifierModule` training ``probes`` (a list of ``{lr, weight_decay}``, one probe
    each) on the frozen backbone of ``model`` (the module docstring). ``optimizer`` makes each probe's optimizer
    group (its ``lr`` and ``weight_decay`` replaced by the probe's); other arguments as the parent's, with
    ``freeze_backbone`` always on."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[..., Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        *,
        probes: Sequence[Mapping[str, float]],
        **kwargs: Any,
    ) -> None:
        refused = [f"module.{k} ({_REFUSED[k]})" for k in _REFUSED if kwargs.get(k) not in (None, False)]
        if kwargs.get("freeze_backbone") is False:
            refused.append("module.freeze_backbone=false")
        if refused:
            raise ValueError(
                f"module=probe_grid trains probes on a frozen backbone; it does not take {', '.join(refused)}"
            )
        settings = check_probes(probes)
        super().__init__(model, optimizer, scheduler, **{**kwargs, "freeze_backbone": True})
        self.hparams["probes"] = settings  # (in every checkpoint)
        head = {n: p for n, p in model.named_parameters() if n.split(".")[0] in PROBE_MODULES}
        for p in head.values():  # (the model's head holds the chosen probe: copied, never stepped)
            p.requires_grad_(False)
        self.probes = nn.ModuleList(_Probe(model, list(head)) for _ in settings)
        self._head = (_ForwardHead(model),)
        self.probe_acc1 = nn.ModuleList(
            MulticlassAccuracy(self.num_classes, top_k=1, average="micro") for _ in settings
        )
        self.probe_loss = nn.ModuleList(ImageMean() for _ in settings)

    def setup(self, stage: str) -> None:
        """The parent's, after refusing a fit that never validates: the probe is chosen on val, and without a
        validation the model's head would stay as built (a :class:`~vitrel.config.ConfigError`)."""
        t = self.trainer
        every, epochs = t.check_val_every_n_epoch, t.max_epochs
        if stage == "fit" and (t.limit_val_batches == 0 or (every and epochs not in (None, -1) and every > epochs)):
            raise ConfigError(
                f"module=probe_grid chooses its probe on val, which this fit never runs (trainer.limit_val_batches="
                f"{t.limit_val_batches}, trainer.check_val_every_n_epoch={every}, trainer.max_epochs={epochs}): "
                "validate at least once, or train one probe with module=classifier module.freeze_backbone=true"
            )
        super().setup(stage)

    def metric_names(self, test: bool = True) -> list[str]:
        names = [f"train/loss{end}" for end in ("", "_step", "_epoch")] + ["val/loss", "val/acc1", "val/best_probe"]
        names += [f"val/probe_acc1/{i}" for i in range(len(self.probes))]
        if test:
            names += ["test/loss", "test/acc1"] + (["test/acc5"] if self.top_k is not None else [])
        return names

    def probe_logits(self, feats: Any, i: int) -> Tensor:
        """Probe ``i``'s logits of the backbone's features ``feats`` (``model.forward_features``)."""
        params = {f"net.{k}": p for k, p in self.probes[i].by_name().items()}
        return torch.func.functional_call(self._head[0], params, (feats,))

    def _features(self, x: Tensor) -> Any:
        if input_form(x) != "images":
            raise ValueError("module=probe_grid takes image or clip batches, not NaFlex batches (data.packing)")
        with torch.no_grad():  # (the backbone is frozen: nothing to record)
            return self.model.forward_features(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        check_targets(y, self.num_classes)
        n = int(y.shape[0])
        target, smoothing = y, self.label_smoothing
        if self.mixup_fn is not None:
            x, target = self.mix(x, y)  # (soft targets, smoothed by the mixer)
            smoothing = 0.0
        feats = self._features(x)
        losses = torch.stack(
            [F.cross_entropy(self.probe_logits(feats, i).float(), target, label_smoothing=smoothing) for i in
             range(len(self.probes))]
        )  # fmt: skip
        self.train_loss(losses.detach().mean(), weight=n)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=n)
        return losses.sum()

    def validation_step(self, batch: tuple[Tensor, Tensor] | None, batch_idx: int) -> None:
        if batch is None:  # (every file of the batch unreadable, left out)
            return
        x, y = batch
        check_targets(y, self.num_classes)
        views = x.shape[1] if x.dim() == 6 else None  # (clips of videos: each video's log mean softmax)
        feats = self._features(x.flatten(0, 1) if views else x)
        for i, (acc, mean_loss) in enumerate(zip(self.probe_acc1, self.probe_loss, strict=True)):
            logits = self.probe_logits(feats, i)
            if views:
                logits = mean_softmax_log(logits, views)
                loss = F.nll_loss(logits, y)
            else:
                loss = F.cross_entropy(logits.float(), y)
            acc.update(logits, y)
            mean_loss.update(loss, weight=int(y.shape[0]))

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        accs = torch.stack([m.compute() for m in self.probe_acc1])  # (over the ranks)
        losses = torch.stack([m.compute() for m in self.probe_loss])
        for m in (*self.probe_acc1, *self.probe_loss):
            m.reset()
        best = int(torch.argmax(accs))  # (the first of a tie)
        with torch.no_grad():
            own = dict(self.model.named_parameters())
            for name, p in self.probes[best].by_name().items():
                own[name].copy_(p)
        self.log("val/acc1", accs[best], prog_bar=True)
        self.log("val/loss", losses[best], prog_bar=True)
        self.log("val/best_probe", float(best))
        for i, a in enumerate(accs):
            self.log(f"val/probe_acc1/{i}", a)

    def configure_optimizers(self) -> Optimizer | dict:
        groups = [
            {"params": list(probe.parameters()), **setting}
            for probe, setting in zip(self.probes, self.hparams["probes"], strict=True)
        ]
        return self.with_schedule(self.make_optimizer(params=groups))
