"""``module.freeze_backbone=true`` (vitrel/train/freeze.py): the probe alone trains. On what users run, a probe of
a train.py checkpoint (``model=from_checkpoint``) keeps every backbone tensor bit for bit, trains the head, and its
optimizer holds the head alone; in training mode the frozen backbone computes its eval-mode features (no drop
path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitrel
from tests.train_helpers import FAST, TINY_VIT, compose, straight_and_resumed
from vitrel.train.freeze import PROBE_MODULES, freeze_backbone
from vitrel.train.module import ClassifierModule
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "test=false"]
SHORT += ["logger=none", "data.val_fraction=0.0"]


def _probe(name: str) -> bool:
    return name.split(".")[0] in PROBE_MODULES


def test_a_probe_of_a_checkpoint_trains_its_head_alone(tmp_path):
    run = tmp_path / "source"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT]))
    source = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    probe = tmp_path / "probe"
    over = ["model=from_checkpoint", f"model.path={run / 'checkpoints' / 'last.ckpt'}", "+model.drop_path_rate=0.3"]
    train(compose(probe, [*over, "module.freeze_backbone=true", "module.optimizer.lr=0.05", *FAST, *SHORT]))
    ckpt = torch.load(probe / "checkpoints" / "last.ckpt", weights_only=True)
    after = ckpt["state_dict"]
    backbone = [k for k in source if k.startswith("model.") and not _probe(k.removeprefix("model."))]
    head = [k for k in source if k.startswith("model.") and _probe(k.removeprefix("model."))]
    assert len(backbone) > 20 and {k.split(".")[1] for k in head} == {"head", "fc_norm"}
    for k in backbone:
        assert torch.equal(after[k], source[k]), k
    assert all(not torch.equal(after[k], source[k]) for k in head if k.endswith("weight"))
    held = [p for g in ckpt["optimizer_states"][0]["param_groups"] for p in g["params"]]
    assert len(held) == len(head)  # (AdamW's state: the head's tensors alone)


def test_lp_ft_probes_then_trains_the_whole_model_from_its_epoch(tmp_path):
    """``module.unfreeze_backbone_at_epoch=1``: epoch 0 trains the head alone (the backbone bit for bit the
    source's, though the optimizer holds every parameter); the run continued to 2 epochs (``resume=auto``) trains
    the backbone from epoch 1 on."""
    run = tmp_path / "source"
    train(compose(run, [*TINY_VIT, *FAST, *SHORT]))
    source = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    backbone = [k for k in source if k.startswith("model.") and not _probe(k.removeprefix("model."))]
    over = ["model=from_checkpoint", f"model.path={run / 'checkpoints' / 'last.ckpt'}", "module.freeze_backbone=true"]
    over += ["module.unfreeze_backbone_at_epoch=1", *FAST, *SHORT]
    probe = tmp_path / "lpft"
    train(compose(probe, over))
    first = torch.load(probe / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(torch.equal(first["state_dict"][k], source[k]) for k in backbone)
    held = sum(len(g["params"]) for g in first["optimizer_states"][0]["param_groups"])
    assert held == sum(1 for k in source if k.startswith("model.") and source[k].is_floating_point())
    train(compose(probe, [*over, "trainer.max_epochs=2"]))
    after = torch.load(probe / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert after["model.blocks.0.attn.qkv.weight"].ne(source["model.blocks.0.attn.qkv.weight"]).any()
    with pytest.raises(ValueError, match="unfreeze_backbone_at_epoch=2 needs freeze_backbone=true"):
        ClassifierModule(vitrel.create_model("vitrel_vit_tiny_patch4_32", num_classes=3), unfreeze_backbone_at_epoch=2)


ARCHS = {  # (the ViT and the Swin: their heads are named alike, timm's names)
    "vit": ("vitrel_vit_tiny_patch4_32", dict(depth=2)),
    "swin": ("vitrel_swin_tiny_patch2_window4_32", dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2))),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_frozen_backbone_stays_in_eval_mode(arch):
    """Train mode reaches the head only: with drop path 0.5 in every block, the training-mode logits are the
    eval-mode ones (a backbone in train mode drops paths: another output)."""
    name, kw = ARCHS[arch]
    torch.manual_seed(0)
    m = vitrel.create_model(name, num_classes=3, drop_path_rate=0.5, **kw)
    x = torch.randn(4, 3, 32, 32)
    module = ClassifierModule(m, freeze_backbone=True).train()
    assert not m.patch_embed.training and not m.norm.training and m.head.training
    trained_mode = m(x)
    module.eval()
    torch.testing.assert_close(trained_mode, m(x), rtol=0, atol=0)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in m.named_parameters() if _probe(n)] and "head.weight" in trainable
    free = vitrel.create_model(name, num_classes=3, drop_path_rate=0.5, **kw)
    free.load_state_dict(m.state_dict())
    ClassifierModule(free).train()
    assert (free(x) - trained_mode).abs().max() > 1e-3


def test_a_model_without_a_head_is_one_error():
    class Net(nn.Module):
        def __init__(self, head: nn.Module | None = None) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            if head is not None:
                self.head = head

    with pytest.raises(ValueError, match="does not name .*attn_pool, fc_norm, head_drop, head; it has body"):
        freeze_backbone(Net())
    with pytest.raises(ValueError, match="leaves nothing to train"):
        freeze_backbone(Net(nn.Identity()))


def test_lp_ft_killed_mid_epoch_after_the_unfreeze_resumes_bit_for_bit(tmp_path):
    """SIGTERM at step 5 (epoch 1's second of 3 batches, the backbone unfrozen at epoch 1), then ``resume=auto``: the
    weights equal an uninterrupted run's bit for bit (Lightning starts no epoch on a mid-epoch resume, so the unfreeze
    is due at the fit's start too; drop path 0.2, a constant rate: nothing else differs)."""
    src = tmp_path / "src"
    train(compose(src, [*TINY_VIT, *FAST, *SHORT]))
    over = ["model=from_checkpoint", f"model.path={src / 'checkpoints' / 'last.ckpt'}", "+model.drop_path_rate=0.2"]
    over += ["module.freeze_backbone=true", "module.unfreeze_backbone_at_epoch=1", "module.scheduler=null", *FAST]
    over += [*SHORT, "trainer.max_epochs=2", "callbacks.model_checkpoint=null"]
    a, b = (c["state_dict"] for c in straight_and_resumed(over, tmp_path, at_step=4))  # (saved after step 5)
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("model."))


def test_lp_ft_in_one_run_is_refused_over_several_processes():
    """DDP leaves out what is frozen when it wraps the model: a backbone unfrozen later would train apart on each
    rank (Lightning-AI/pytorch-lightning#20340). ``setup("fit")`` refuses it, naming the two-run way."""
    from types import SimpleNamespace

    from vitrel.config import ConfigError

    m = vitrel.create_model("vitrel_vit_tiny_patch4_32", num_classes=3, depth=1)
    module = ClassifierModule(m, freeze_backbone=True, unfreeze_backbone_at_epoch=1, data_config={"input_size": [3]})
    module._trainer = SimpleNamespace(world_size=2)
    with pytest.raises(ConfigError, match="over 2 processes .* two runs: the probe .*model=from_checkpoint"):
        module.setup("fit")
