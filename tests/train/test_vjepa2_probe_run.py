"""``python train.py experiment=vjepa2_probe`` (conf/experiment/vjepa2_probe.yaml) on a few Something-Something v2
videos in the official layout, from a V-JEPA 2 checkpoint in the authors' layout (ViT-L's width, one block, made
small): their attentive probe trains on 2 segments while the encoder stays their weights bit for bit."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.data.test_video_lists import ssv2
from tests.models.test_vjepa2_import import encoder_weights, released_layout
from tests.train_helpers import FAST, compose
from vitrel.train.run import train

pytest.importorskip("av", reason="PyAV not installed: pip install -e '.[video]'")


def test_the_probe_recipe_trains_their_probe_on_a_frozen_encoder(tmp_path):
    enc = tmp_path / "vitl.pt"
    weights = [{k: v.float() for k, v in encoder_weights(s, 1024, 1, 16).items()} for s in (0, 1)]  # (theirs: fp32)
    torch.save(released_layout(*weights), enc)
    root = tmp_path / "ssv2"
    templates = ["Pushing [something] from left to right", "Holding [something] next to [something]"]
    ssv2(root, [(str(i), templates[i % 2]) for i in range(4)], [(str(i), templates[i % 2]) for i in range(4, 6)])
    data = [f"data.root={root}", "data.video_dir=videos", "data.train_list=something-something-v2-train.json"]
    data += ["data.val_list=something-something-v2-validation.json", "data.num_classes=3", "data.batch_size=2"]
    data += ["data.labels_file=something-something-v2-labels.json", "data.img_size=16", "data.num_frames=2"]
    data += ["data.stride=1", "data.pin_memory=false"]
    over = ["experiment=vjepa2_probe", f"model.init_file={enc}", "trainer=cpu", "trainer.max_epochs=1", "test=false"]
    over += ["logger=none", "module.optimizer.lr=0.05", *FAST, *data]
    train(compose(tmp_path / "run", over))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    m = vitrel.load_model(ckpt)
    cfg = m.vitrel_cfg
    assert (cfg["num_segments"], cfg["attn_pool_type"], cfg["attn_pool_depth"], m.attn_pool.num_heads) == (
        2, "attentive", 4, 16)  # fmt: skip
    theirs = vitrel.from_vjepa2(enc, name="vit_large", img_size=16, num_frames=2).state_dict()
    ours = m.state_dict()
    encoder = [k for k in theirs if not k.startswith(("head", "attn_pool", "fc_norm"))]
    assert len(encoder) > 10 and all(torch.equal(ours[k], theirs[k]) for k in encoder)
    state = torch.load(ckpt, weights_only=True)
    held = sum(len(g["params"]) for g in state["optimizer_states"][0]["param_groups"])
    assert held == sum(1 for k, p in m.named_parameters() if k.startswith(("attn_pool.", "head.")))
