"""The fast training step (``conf/step/fast.yaml``, trainer=gpu's): chosen by the trainer, nothing read back to the
host per step, compiled steps equal to eager ones, the NaN guard's deferred check; under ``-m cuda`` the same with
CUDA graphs and torch's synchronisation detector."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from tests.train_helpers import FAST, TINY_VIT, PoisonWeights, compose
from vitrel.train.callbacks import NonFiniteLossError
from vitrel.train.run import train

ONE_EPOCH = ["trainer.max_epochs=1", "trainer.limit_val_batches=0", "test=false", "logger=none"]
#: what makes the host wait for the device when the tensor lives there
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def test_the_step_follows_the_trainer(tmp_path):
    """trainer=gpu composes the fast step (train.yaml: ``optional step: ${trainer}``); step=eager takes it back;
    the default (CPU) recipe keeps the eager step."""
    cpu = compose(tmp_path, [])
    assert cpu.module.compile is False and not cpu.module.sync_free and cpu.module.optimizer.fused is None
    assert cpu.data.drop_last is False and cpu.callbacks.nan_guard.every_n_steps == 1
    gpu = compose(tmp_path, ["trainer=gpu"])
    assert dict(gpu.module.compile) == {"mode": "reduce-overhead", "dynamic": False}
    assert gpu.module.sync_free and gpu.module.optimizer.fused and gpu.data.drop_last
    assert gpu.callbacks.nan_guard.every_n_steps == 100 and gpu.trainer.precision == "bf16-mixed"
    back = compose(tmp_path, ["trainer=gpu", "step=eager"])
    assert back.module.compile is False and back.trainer.accelerator == "gpu"
    assert compose(tmp_path, ["step=fast"]).module.sync_free  # on any trainer


class CountReads(L.Callback):
    """Counts the calls of ``READS`` on tensors from the start of training batch ``skip`` to the start of the
    epoch's last batch: whole steps, the loop's own work after each batch's hooks included."""

    def __init__(self, skip: int = 1) -> None:
        self.skip, self.calls, self._saved = skip, [], {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == trainer.num_training_batches - 1:
            self._restore()
        elif batch_idx == self.skip:
            for name in READS:
                orig = self._saved[name] = getattr(torch.Tensor, name)

                def counted(t, *a, _orig=orig, _name=name, **k):
                    self.calls.append(_name)
                    return _orig(t, *a, **k)

                setattr(torch.Tensor, name, counted)

    def _restore(self) -> None:
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        self._saved = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore()


STEPS = ["trainer.limit_train_batches=6", "progress_bar=lines", "trainer.log_every_n_steps=2"]


def test_fast_step_reads_nothing_back_per_step(tmp_path):
    """step=fast (uncompiled here: compiling changes no host read) through a whole Lightning step, with the
    callbacks, the progress lines and the scheduler: no tensor is read back between a batch's start and its end.
    The eager step reads the loss every step (the NaN guard, the step's logged value)."""
    common = [*TINY_VIT, *FAST, *ONE_EPOCH, *STEPS, "module.compile=false"]
    fast = CountReads()
    metrics = train(compose(tmp_path / "fast", [*common, "step=fast"]), callbacks=[fast])
    assert fast.calls == [] and math.isfinite(metrics["train/loss_epoch"])
    assert "train/loss_step" not in metrics  # the epoch's value only
    eager = CountReads()
    train(compose(tmp_path / "eager", [*common, "step=eager"]), callbacks=[eager])
    assert len(eager.calls) >= 4  # at least one per counted step (batches 1 to 4)


def _weights_after_steps(tmp_path, step: list[str]) -> tuple[dict, dict]:
    torch.manual_seed(0)
    over = [*TINY_VIT, *FAST, *ONE_EPOCH, "trainer.limit_train_batches=4", "data.drop_last=true", *step]
    over += ["module.optimizer.fused=true", "callbacks.last_checkpoint.every_n_train_steps=null"]
    metrics = train(compose(tmp_path, over))
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return metrics, {k: v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}


@pytest.mark.slow
def test_compiled_fast_step_equals_eager(tmp_path):
    """4 steps of step=fast compiled (inductor's default mode on the CPU; CUDA graphs need CUDA) against 4 eager
    steps from the same seed: the epoch's mean loss within 1e-5 relative, every weight within 1e-4 absolute (AdamW
    moves a weight by about lr = 2e-3 per step whatever its gradient's size, so a gradient equal to 1e-6 relative
    can move a weight whose gradient is near zero by more than its rounding)."""
    m_eager, w_eager = _weights_after_steps(tmp_path / "eager", ["step=eager"])
    m_fast, w_fast = _weights_after_steps(tmp_path / "fast", ["step=fast", "module.compile={dynamic: false}"])
    assert m_fast["train/loss_epoch"] == pytest.approx(m_eager["train/loss_epoch"], rel=1e-5)
    assert w_fast.keys() == w_eager.keys()
    moved = max((w_fast[k] - w_eager[k]).abs().max().item() for k in w_eager)
    assert moved <= 1e-4, f"compiled and eager weights differ by {moved:.3g}"


def test_deferred_nan_guard_stops_before_a_checkpoint_holds_bad_weights(tmp_path):
    """every_n_steps=100 (step=fast): a NaN at step 3 is found by the check before the checkpoint of step 4 is
    written; the last checkpoint on disk is step 2's, finite."""
    over = [*TINY_VIT, *FAST, *ONE_EPOCH, "trainer.limit_train_batches=8", "step=fast", "module.compile=false"]
    over += ["callbacks.last_checkpoint.every_n_train_steps=2"]
    with pytest.raises(NonFiniteLossError, match=r"after global step 2 .*last good checkpoint"):
        train(compose(tmp_path, over), callbacks=[PoisonWeights(at_step=3)])
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_fast_step_clips_fused_adamw_under_bf16(tmp_path, monkeypatch):
    """trainer=gpu's precision (bf16-mixed) with the fast step's fused AdamW and the recipe's clipping
    (trainer.gradient_clip_val=1.0): Lightning's AMP plugin refuses clipping with any optimizer that unscales in its
    step ("Are you using a 'fused' optimizer?"), which stopped bench/gpu.py's train section on the H100 at the first
    step. bf16 has no GradScaler, so the module clips as in 32-bit: the run goes through with the fused optimizer and
    every step's gradients are clipped at norm 1."""
    clip, norms, fused = torch.nn.utils.clip_grad_norm_, [], []

    def spy(parameters, max_norm, *args, **kwargs):
        norms.append(max_norm)
        return clip(parameters, max_norm, *args, **kwargs)

    class Optimizer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            fused.append(trainer.optimizers[0].defaults["fused"])

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    over = [*TINY_VIT, *FAST, *ONE_EPOCH, "trainer.limit_train_batches=3", "step=fast", "module.compile=false"]
    over += ["trainer.precision=bf16-mixed", "trainer.gradient_clip_val=1.0"]
    metrics = train(compose(tmp_path, over), callbacks=[Optimizer()])
    assert fused == [True] and norms == [1.0] * 3 and math.isfinite(metrics["train/loss_epoch"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU")
def test_gpu_fast_step_never_synchronises_and_equals_eager(tmp_path):
    """trainer=gpu (CUDA graphs, bf16): with torch's synchronisation detector set to error from the third step on,
    the steps run; the loss after 20 steps is that of the eager step within bf16's tolerance (2 %)."""

    class NoSync(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= 2:
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.set_sync_debug_mode(0)

        def on_exception(self, trainer, pl_module, exception):
            torch.cuda.set_sync_debug_mode(0)

    over = [*TINY_VIT, "trainer=gpu", "data.num_workers=0", "callbacks.pos_images=null", *ONE_EPOCH]
    over += ["trainer.limit_train_batches=20", "progress_bar=lines"]
    fast = train(compose(tmp_path / "fast", over), callbacks=[NoSync()])
    eager = train(compose(tmp_path / "eager", [*over, "step=eager"]))
    assert fast["train/loss_epoch"] == pytest.approx(eager["train/loss_epoch"], rel=0.02)
