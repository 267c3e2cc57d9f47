"""The EMA and the epoch means under ``trainer.precision=bf16-true``: Lightning casts the whole module to bfloat16, and
an EMA update ``(1 - decay) * (w - ema)`` is below bfloat16's resolution, so the EMA copy averages in float32
(checkpointed so, resumed so) and validation scores a copy of it in the weights' dtype; the metrics' running totals of
losses and images stay float32 too."""

from __future__ import annotations

import copy
import functools

import torch
from lightning.pytorch.callbacks import Callback
from timm.utils import ModelEmaV3

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.train.module import ClassifierModule
from vitrel.train.run import train

DECAY = 0.999
RUN = [*TINY_VIT, *FAST, "trainer.limit_train_batches=12", "trainer.limit_val_batches=1", "trainer.precision=bf16-true"]
RUN += ["logger=none", "test=false", "callbacks.model_checkpoint=null", "module/ema=default"]
RUN += [f"module.ema.decay={DECAY}", "module.ema.use_warmup=false"]


class Weights(Callback):
    """The weights after each optimizer step (float64), the EMA copy at the end, the networks validation scored."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.ema: dict[str, torch.Tensor] = {}
        self.scored: list[tuple[torch.dtype, dict[str, torch.Tensor]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: v.detach().double() for k, v in pl_module.model.state_dict().items()})

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        net = (getattr(pl_module, "_ema_cast", ()) or (pl_module.ema_model.module,))[0]
        self.scored.append((next(net.parameters()).dtype, copy.deepcopy(pl_module.ema_model.module.state_dict())))
        for k, v in net.state_dict().items():  # the EMA as it stands, rounded to the weights' dtype
            torch.testing.assert_close(v, self.scored[-1][1][k].to(v.dtype), rtol=0, atol=0, msg=k)

    def on_train_end(self, trainer, pl_module) -> None:
        self.ema = {k: v.detach().clone() for k, v in pl_module.ema_model.module.state_dict().items()}


def test_bf16_true_ema_is_a_float64_ema_of_the_same_weights(tmp_path):
    seen = Weights()
    train(compose(tmp_path, [*RUN, "trainer.max_epochs=2"]), callbacks=[seen])
    assert len(seen.steps) == 24 and seen.steps[0]["head.weight"].dtype == torch.float64
    assert next(iter(seen.steps[-1].values())).dtype == torch.float64
    reference = {k: v.clone() for k, v in seen.steps[0].items()}  # the first update copies the weights
    for state in seen.steps[1:]:
        for k, v in reference.items():
            v += (1 - DECAY) * (state[k] - v)
    moved = sum(float((reference[k] - seen.steps[0][k]).norm() ** 2) for k in reference) ** 0.5
    off = sum(float((seen.ema[k].double() - reference[k]).norm() ** 2) for k in reference) ** 0.5
    assert off / moved < 1e-3, f"the EMA is {off / moved:.2%} of its movement off a float64 EMA of the same weights"
    assert all(v.dtype == torch.float32 for v in seen.ema.values())
    assert [dtype for dtype, _ in seen.scored] == [torch.bfloat16] * 2  # each epoch's validation: the EMA in bf16
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    for k, v in seen.ema.items():
        assert torch.equal(saved[f"ema_model.module.{k}"], v), k
    assert saved["model.head.weight"].dtype == torch.bfloat16


def test_bf16_true_resume_continues_the_float32_ema(tmp_path):
    """Two epochs, and one epoch resumed for a second (Lightning restores before it casts the module): the same EMA
    (a constant rate: the schedule's length is the run's)."""
    whole, resumed, run = Weights(), Weights(), [*RUN, "module.scheduler=null"]
    train(compose(tmp_path / "whole", [*run, "trainer.max_epochs=2"]), callbacks=[whole])
    train(compose(tmp_path / "parts", [*run, "trainer.max_epochs=1"]))
    train(compose(tmp_path / "parts", [*run, "trainer.max_epochs=2", "ckpt_path=last"]), callbacks=[resumed])
    assert len(resumed.steps) == 12
    for k, v in whole.ema.items():
        assert resumed.ema[k].dtype == torch.float32 and torch.equal(resumed.ema[k], v), k


def test_a_cast_below_float32_leaves_the_ema_and_a_wider_one_takes_it():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    module = ClassifierModule(net, num_classes=3, ema=functools.partial(ModelEmaV3, decay=DECAY))
    with torch.no_grad():
        module.ema_model.module[0].weight.add_(1e-4)  # not a bfloat16 number
    kept = module.ema_model.module[0].weight.clone()
    module.to(dtype=torch.bfloat16)
    assert module.dtype == torch.bfloat16 and net[0].weight.dtype == torch.bfloat16
    assert torch.equal(module.ema_model.module[0].weight, kept)
    module.on_test_epoch_start()  # scored in the weights' dtype
    assert module._ema_cast[0][0].weight.dtype == torch.bfloat16
    assert torch.equal(module._ema_cast[0][0].weight, kept.to(torch.bfloat16))
    module.on_test_epoch_end()
    assert module._ema_cast == ()
    module.to(dtype=torch.float64)
    assert module.ema_model.module[0].weight.dtype == torch.float64
    module.on_test_epoch_start()
    assert module._ema_cast == ()


class Losses(Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self.logged = float("nan")
        self.dtypes: set[torch.dtype] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append((float(outputs["loss"]), len(batch[1])))

    def on_train_end(self, trainer, pl_module) -> None:
        self.logged = float(trainer.callback_metrics["train/loss_epoch"])
        self.dtypes = {m.mean_value.dtype for m in (pl_module.train_loss, pl_module.val_loss)}


def test_bf16_true_epoch_loss_is_the_mean_of_the_steps_losses(tmp_path):
    seen = Losses()
    run = [*RUN[:-3], "trainer.max_epochs=1", "trainer.limit_train_batches=24", "data.batch_size=32"]
    train(compose(tmp_path, run), callbacks=[seen])
    mean = sum(loss * n for loss, n in seen.steps) / sum(n for _, n in seen.steps)  # (float64)
    assert len(seen.steps) == 24 and abs(seen.logged - mean) / mean < 1e-5, (seen.logged, mean)
    assert seen.dtypes == {torch.float32}
