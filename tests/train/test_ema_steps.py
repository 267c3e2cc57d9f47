"""The EMA of a run (``module/ema=default``) is timm's: ``ModelEmaV3.update(model, step=n)`` after the n-th optimizer
step, n counted from 1, as timm's ``train.py`` calls it (``num_updates += 1`` before the update). The first update
copies the weights; every later one averages with the decay of its step."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from timm.utils import ModelEmaV3

from tests.train_helpers import FAST, TINY_VIT, compose, model_state
from vitrel.train.run import train

RUN = [*TINY_VIT, *FAST, "trainer.max_steps=4", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1"]
RUN += ["logger=none", "test=false", "callbacks.model_checkpoint=null", "callbacks.last_checkpoint=null"]
RUN += ["module/ema=default"]


class Snapshots(Callback):
    """The network before training and after each optimizer step, and the EMA copy at the end."""

    def __init__(self) -> None:
        self.start: torch.nn.Module | None = None
        self.steps: list[dict[str, torch.Tensor]] = []
        self.ema: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = copy.deepcopy(pl_module.model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(model_state(pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        self.ema = {k: v.detach().clone() for k, v in pl_module.ema_model.module.state_dict().items()}


@pytest.mark.parametrize("ema", [["module.ema.decay=0.5", "module.ema.use_warmup=false"], []], ids=["fixed", "warmup"])
def test_ema_is_timms_with_the_update_count(tmp_path, ema):
    snaps = Snapshots()
    train(compose(tmp_path, [*RUN, *ema]), callbacks=[snaps])
    assert len(snaps.steps) == 4
    cfg = compose(tmp_path, [*RUN, *ema]).module.ema
    reference = ModelEmaV3(snaps.start, decay=cfg.decay, use_warmup=cfg.use_warmup, warmup_power=cfg.warmup_power)
    net = copy.deepcopy(snaps.start)
    for n, state in enumerate(snaps.steps, start=1):  # timm's train.py: num_updates += 1, then update(step=...)
        net.load_state_dict(state)
        reference.update(net, step=n)
    expected = reference.module.state_dict()
    # (the update of step 2 copied the weights again: the EMA was the last weights)
    assert not torch.equal(snaps.ema["head.weight"], snaps.steps[-1]["head.weight"])
    for k, v in expected.items():
        torch.testing.assert_close(snaps.ema[k], v, rtol=1e-6, atol=1e-7, msg=k)
