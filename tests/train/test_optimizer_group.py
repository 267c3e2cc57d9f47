"""``module/optimizer``: AdamW (the default) or SGD with Nesterov momentum (timm's ``sgd``), each typed by its own
schema; keys an optimizer, the schedule or the data module does not take, and a seed numpy does not, are one-line
refusals before the run starts (they were a ``TypeError`` inside Hydra's error, a Lightning traceback)."""

from __future__ import annotations

import pytest
import torch

from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.config import ConfigError
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
SHORT += ["logger=none"]


def test_sgd_trains_with_nesterov_momentum_and_the_decay_groups(tmp_path):
    """``train.py module/optimizer=sgd module.optimizer.lr=0.05``: the checkpoint's optimizer is torch's SGD with
    the file's momentum and Nesterov, at the rate given, and the position table in the group without weight decay
    (as AdamW's groups)."""
    train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, "module/optimizer=sgd", "module.optimizer.lr=0.05"]))
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    groups = state["optimizer_states"][0]["param_groups"]
    assert {(g["momentum"], g["nesterov"], g["dampening"], g["initial_lr"]) for g in groups} == {(0.9, True, 0.0, 0.05)}
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 1e-4]
    assert "momentum_buffer" in next(iter(state["optimizer_states"][0]["state"].values()))


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("+module.optimizer.momentum=0.9", r"^module.optimizer.momentum: torch.optim.AdamW takes no momentum; it "
         r"takes amsgrad, betas, .*weight_decay$"),
        ("+module.scheduler.warmup_epoch=2", r"^module.scheduler.warmup_epoch: vitrel.train.optim.warmup_cosine takes "
         r"no warmup_epoch; did you mean module.scheduler.warmup_epochs or module.scheduler.warmup_steps\?$"),
        ("seed=-1", r"^seed=-1: a seed is a whole number from 0 to 4294967295"),
        ("+data.batchsize=32", r"^data.batchsize: vitrel.data.FashionMNISTDataModule takes no batchsize; did you "
         r"mean data.batch_size or data.patch_size\?$"),
    ],
)  # fmt: skip
def test_settings_the_run_cannot_take_are_refused_before_it_starts(tmp_path, override, said):
    with pytest.raises(ConfigError, match=said):
        train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT, override]))
    assert not (tmp_path / "checkpoints").exists()


def test_eval_py_refuses_a_split_it_does_not_score_before_reading_anything(tmp_path):
    """``eval.py split=train``: a traceback ending in ``ValueError``; now one line (a ``ConfigError``)."""
    from vitrel.train.evaluate import evaluate

    missing = tmp_path / "none.ckpt"
    missing.write_bytes(b"")  # (never read: the split is refused first)
    with pytest.raises(ConfigError, match=r"^split=train: eval.py scores split=test \(the default\) or split=val$"):
        evaluate(compose(tmp_path / "eval", [f"ckpt_path={missing}", "split=train"], config_name="eval"))


def test_an_epochs_last_partial_accumulation_window_steps_on_its_own_mean_gradient(tmp_path):
    """``trainer.accumulate_grad_batches=2`` over 3 batches: the epoch's last window holds one batch, and Lightning
    divided its loss by 2, so that step took half its gradient (an audit's, with SGD: 0.5000), where timm's
    ``train.py`` divides the last window by its own length. The gradient stepped equals the gradient of that batch's
    mean loss, recomputed here from the weights and the batch."""
    import lightning as L
    import torch.nn.functional as F

    class Grads(L.Callback):
        want = got = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:  # (the last window's one batch, at the weights it is trained at)
                x, y = batch
                head = pl_module.model.head.weight
                loss = F.cross_entropy(pl_module(x).float(), y, label_smoothing=pl_module.label_smoothing)
                self.want = torch.autograd.grad(loss, head)[0].clone()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                self.got = pl_module.model.head.weight.grad.clone()

    over = [*TINY_VIT, *FAST, *SHORT[3:], "trainer.max_epochs=1", "trainer.limit_train_batches=3"]
    over += ["trainer.limit_val_batches=1", "trainer.accumulate_grad_batches=2", "module/optimizer=sgd"]
    over += ["trainer.gradient_clip_val=null", "data.augment=false"]
    grads = Grads()
    train(compose(tmp_path, over), callbacks=[grads])
    torch.testing.assert_close(grads.got, grads.want, rtol=1e-4, atol=1e-7)


def test_a_resume_under_another_optimizer_is_refused_naming_it(tmp_path):
    """An AdamW run resumed with ``module/optimizer=sgd``: Lightning loaded AdamW's state into SGD, which failed at
    its first step on ``KeyError: 'momentum'`` (an audit's). Refused before the fit, naming both; the same optimizer
    resumes as before."""
    train(compose(tmp_path, [*TINY_VIT, *FAST, *SHORT]))
    again = [*TINY_VIT, *FAST, *SHORT[1:], "trainer.max_epochs=2"]
    with pytest.raises(ValueError, match=r"optimizer state has no 'momentum', the configured SGD takes it"):
        train(compose(tmp_path, [*again, "module/optimizer=sgd"]))
    train(compose(tmp_path, again))
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["epoch"] == 1
