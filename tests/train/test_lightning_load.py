"""Lightning's own routes on a checkpoint ``train.py`` wrote: ``ClassifierModule.load_from_checkpoint(path)`` with
nothing else (the network rebuilt from the stored ``vitrel_cfg``, its EMA copy when there is one), then
``trainer.predict`` and ``trainer.test``, scoring the weights the run tested (``vitrel.load_model``'s ``auto``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import vitrel
from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.models import CheckpointError
from vitrel.train.module import ClassifierModule
from vitrel.train.run import train

RUN = [*TINY_VIT, *FAST, "trainer.max_steps=3", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1"]
RUN += ["logger=none", "test=false"]


def _trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.parametrize("ema", ["none", "ema_eval", "ema_not_eval"])
def test_load_from_checkpoint_predicts_and_tests_with_the_weights_the_run_tested(tmp_path, ema):
    """Was: ``TypeError: missing 1 required positional argument: 'model'`` (the network is no hyper-parameter), and
    ``trainer.predict`` fed the ``(images, targets)`` pair to the network as a list of two images."""
    run = (
        RUN
        + {
            "none": [],
            "ema_eval": ["module/ema=default", "module.ema.decay=0.5"],
            "ema_not_eval": ["module/ema=default", "module.ema.decay=0.5", "module.ema_eval=false"],
        }[ema]
    )
    train(compose(tmp_path, run))
    path = tmp_path / "checkpoints" / "last.ckpt"
    module = ClassifierModule.load_from_checkpoint(path)
    assert (module.ema_model is not None) == (ema != "none") and module.ema_eval == (ema != "ema_not_eval")
    want_net = vitrel.load_model(path).eval()  # (auto: the weights the run validated and tested)
    x, y = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(0)), torch.arange(10)
    with torch.no_grad():
        want = want_net(x)
        live = module.model.eval()(x)
    assert torch.equal(want, live) == (ema != "ema_eval")  # (the EMA copy differs from the trained weights)
    pairs = DataLoader(TensorDataset(x, y), batch_size=4)
    got = torch.cat(_trainer().predict(module, pairs))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    images = DataLoader(x, batch_size=4)  # (a loader of inputs alone)
    torch.testing.assert_close(torch.cat(_trainer().predict(module, images)), want, rtol=0, atol=0)
    acc = _trainer().test(module, pairs, verbose=False)[0]["test/acc1"]
    assert acc == pytest.approx((want.argmax(1) == y).float().mean().item())


def test_load_from_checkpoint_takes_the_network_given_and_says_when_one_is_needed(tmp_path):
    train(compose(tmp_path, RUN))
    path = tmp_path / "checkpoints" / "last.ckpt"
    net = vitrel.load_model(path)
    assert ClassifierModule.load_from_checkpoint(path, model=net).model is net
    ckpt = torch.load(path, weights_only=True)
    del ckpt["vitrel_cfg"]
    torch.save(ckpt, tmp_path / "bare.ckpt")
    with pytest.raises(CheckpointError, match=r"no vitrel_cfg.*load_from_checkpoint\(path, model="):
        ClassifierModule.load_from_checkpoint(tmp_path / "bare.ckpt")


@pytest.mark.parametrize("pool", ["max", "avgmax", "map", "attentive"])
def test_a_run_with_timms_max_or_map_pooling_loads_back_with_its_pool(tmp_path, pool):
    """``python train.py model.global_pool=max`` (``avgmax``; ``map`` without a class token, SigLIP's head) was a
    ``ValueError`` at the model's build. The run's checkpoint now loads back with its pool, through
    ``vitrel.load_model`` and Lightning's ``load_from_checkpoint``, to the network the run trained (``attn_pool.*``
    with it for ``map``; the model summary counts no FLOPs for it: torch's counter fails on timm's pool). So does
    ``map`` with V-JEPA 2's attentive pool (``+model.attn_pool_type=attentive``)."""
    attentive = ["+model.attn_pool_type=attentive", "+model.attn_pool_depth=2"] if pool == "attentive" else []
    pool = "map" if attentive else pool
    over = [f"model.global_pool={pool}"] + (["+model.class_token=false"] if pool == "map" else []) + attentive
    train(compose(tmp_path, RUN + over))
    path = tmp_path / "checkpoints" / "last.ckpt"
    net = vitrel.load_model(path).eval()
    assert net.global_pool == net.vitrel_cfg["global_pool"] == pool
    assert type(net.attn_pool).__name__ == (
        "AttentivePool" if attentive else "AttentionPoolLatent" if net.attn_pool else "NoneType"
    )
    assert (net.attn_pool is not None) == isinstance(net.fc_norm, torch.nn.Identity) == (pool == "map")
    module = ClassifierModule.load_from_checkpoint(path)
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(net(x), module.model.eval()(x), rtol=0, atol=0)
    stored = torch.load(path, weights_only=True)["state_dict"]
    assert any(k.startswith("model.attn_pool.") for k in stored) == (pool == "map")
