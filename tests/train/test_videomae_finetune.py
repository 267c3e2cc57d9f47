"""Fine-tuning a VideoMAE network with ``train.py model.init_from=videomae:<size> model.init_file=<checkpoint>``
(docs/models.md): the run starts from their weights with their function and the data's classes as a new head, and
its checkpoint loads as any vitrel model."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.models.test_videomae_import import authors_network, network_weights
from tests.train.test_video_first_hour import SHORT, video_tree  # noqa: F401 (the fixture)
from tests.train.test_vjepa2_finetune import DATA
from tests.train_helpers import FAST, compose
from vitrel.train.run import train


def test_train_starts_from_their_network_with_a_new_head(video_tree, tmp_path):  # noqa: F811
    sd = {k: v.float() for k, v in network_weights(5, dim=384, depth=1).items()}  # ViT-S's width, one block
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": sd}, path)
    model = ["model=vit_video_tiny_fmnist", "model.init_from=videomae:vit_small", f"model.init_file={path}"]
    model += ["pos=sincos1d"]
    cfg = compose(tmp_path / "run", [*DATA, f"data.root={video_tree}", *model, *FAST[2:], "data.num_workers=0", *SHORT])
    with pytest.warns(UserWarning, match="architecture is vit_small's"):
        train(cfg)
    m = vitrel.load_model(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert (m.vitrel_cfg["embed_dim"], m.vitrel_cfg["qkv_bias"], m.num_classes, m.abs_pos.name) == (
        384, "qv", 2, "sincos1d")  # fmt: skip
    # the run's first model: their network's blocks and function, a new head of the data's 2 classes
    start = vitrel.create_model(
        "vitrel_vit_video_tiny_patch4_32", init_from="videomae:vit_small", init_file=str(path), num_classes=2,
        img_size=16, num_frames=2,
    ).eval()  # fmt: skip
    assert start.num_classes == 2
    x = torch.randn(1, 3, 2, 16, 16)
    features = {k: v.double() for k, v in sd.items() if not k.startswith("head.")}
    torch.testing.assert_close(start.forward_head(start.forward_features(x), pre_logits=True), authors_network(
        features, x.double(), 6).float(), rtol=1e-4, atol=1e-4)  # fmt: skip
