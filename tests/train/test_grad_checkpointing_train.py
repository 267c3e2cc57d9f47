"""module.grad_checkpointing: train.py's switch for timm's ``model.set_grad_checkpointing()`` (timm's ``train.py
--grad-checkpointing``). The composed config hands it to ClassifierModule, which sets it on the network: the training
step's loss and gradients are those of the plain network."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

import vitrel
from tests.train_helpers import compose
from vitrel.train.module import ClassifierModule


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rel2d_cpb", num_classes=10, embed_dim=32, depth=2, num_heads=2
    )


def test_the_config_key_sets_checkpointing_on_the_network(tmp_path):
    cfg = compose(tmp_path, ["logger=none"])
    assert cfg.module.grad_checkpointing is False
    assert not instantiate(cfg.module, model=_net(), num_classes=10).model.grad_checkpointing
    swin = "vitrel_swin_tiny_patch2_window4_32"
    cfg = compose(tmp_path, ["logger=none", "module.grad_checkpointing=true", f"model={swin}"])
    swin = vitrel.create_model(swin, num_classes=10)
    assert instantiate(cfg.module, model=swin, num_classes=10).model.grad_checkpointing


def test_the_training_step_is_the_plain_one():
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 32, 32, generator=g), torch.tensor([0, 3, 5, 9]))
    out = []
    for ckpt in (False, True):
        m = ClassifierModule(_net(), grad_checkpointing=ckpt)
        assert m.model.grad_checkpointing is ckpt
        m.training_step(batch, 0).backward()
        out.append({n: p.grad for n, p in m.model.named_parameters()})
    for n, grad in out[0].items():
        torch.testing.assert_close(out[1][n], grad, rtol=0, atol=0, msg=n)


def test_a_network_without_the_method_is_refused():
    with pytest.raises(AttributeError, match="set_grad_checkpointing"):
        ClassifierModule(torch.nn.Linear(3, 10), num_classes=10, grad_checkpointing=True)
